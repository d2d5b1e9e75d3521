"""Differentiable primitives of a DSA block, on NumPy or CuPy arrays.

Every Function keeps float32 math for float32 inputs and saves only what its
backward needs. Shapes in the docstrings: ``...`` is any leading batch shape.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._backend import array_module, to_host
from .tensor import Function, Tensor


def rowwise_matmul(x, w):
    """x [..., i] @ w [i, o] -> [..., o], on NumPy arrays one BLAS product per row.

    Some BLAS kernels (OpenBLAS's Haswell sgemm, for one) give a row other
    bits in a product of another row count or at another row; products of
    one row each keep a row's bits whatever rows share the call, so a
    sequence shard computes the bits one process does. CuPy arrays take one
    product.
    """
    if not isinstance(x, np.ndarray):
        return x @ w
    rows = x.reshape(-1, 1, x.shape[-1])
    return np.matmul(rows, w).reshape(*x.shape[:-1], w.shape[-1])


class MatMul(Function):
    """x [..., i] @ w [i, o] -> [..., o]."""

    def forward(self, x, w):
        self.save(x if self.needs_input_grad[1] else None, w if self.needs_input_grad[0] else None)
        return rowwise_matmul(x, w)

    def backward(self, g):
        x, w = self.saved
        dx = g @ w.T if self.needs_input_grad[0] else None
        dw = None
        if self.needs_input_grad[1]:
            dw = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
        return dx, dw


class Add(Function):
    """a + b, same shapes (the residual add)."""

    def forward(self, a, b):
        return a + b

    def backward(self, g):
        return g, g


class Mul(Function):
    """a * b, same shapes."""

    def forward(self, a, b):
        self.save(a if self.needs_input_grad[1] else None, b if self.needs_input_grad[0] else None)
        return a * b

    def backward(self, g):
        a, b = self.saved
        return (g * b if self.needs_input_grad[0] else None, g * a if self.needs_input_grad[1] else None)


class SiLU(Function):
    """x * sigmoid(x)."""

    def forward(self, x):
        xp = array_module(x)
        sig = 1 / (1 + xp.exp(-x))
        self.save(x, sig)
        return x * sig

    def backward(self, g):
        x, sig = self.saved
        return (g * sig * (1 + x * (1 - sig)),)


class RMSNorm(Function):
    """x / sqrt(mean(x^2, -1) + eps) * weight; x [..., d], weight [d]."""

    def forward(self, x, weight, eps: float = 1e-6):
        xp = array_module(x)
        inv = 1 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        normed = x * inv
        self.save(normed, inv, weight)
        return normed * weight

    def backward(self, g):
        normed, inv, weight = self.saved
        dw = (g * normed).reshape(-1, normed.shape[-1]).sum(axis=0) if self.needs_input_grad[1] else None
        dx = None
        if self.needs_input_grad[0]:
            gn = g * weight
            dx = inv * (gn - normed * (gn * normed).mean(axis=-1, keepdims=True))
        return dx, dw


def rope_tables(xp, positions, dim: int, base: float = 10000.0):
    """(cos, sin) [N, dim/2] float32 for rotary embedding at integer ``positions`` [N];
    ``dim`` even (RoPE rotates pairs of dims)."""
    if dim % 2:
        raise ValueError(f"dim must be even (RoPE rotates pairs of dims), got {dim}")
    freq = base ** (-xp.arange(0, dim, 2, dtype=xp.float64) / dim)
    angle = xp.asarray(positions, dtype=xp.float64)[:, None] * freq[None, :]
    return xp.cos(angle).astype(xp.float32), xp.sin(angle).astype(xp.float32)


class RoPE(Function):
    """Rotary position embedding of x [N, ..., dim] (dim even, pairs (2i, 2i+1))
    with tables cos/sin [N, dim/2]; no parameters."""

    def forward(self, x, cos, sin):
        self.save(cos, sin)
        return _rotate(x, cos, sin, 1)

    def backward(self, g):
        cos, sin = self.saved
        return _rotate(g, cos, sin, -1), None, None


def _rotate(x, cos, sin, direction: int):
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1] // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape) * direction
    even, odd = x[..., 0::2], x[..., 1::2]
    out = array_module(x).empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


class Embedding(Function):
    """table [V, d] rows at ids [N] (int) -> [N, d]. The table gradient is a
    one-hot product, so it is deterministic on every backend."""

    def forward(self, table, ids):
        self.save(ids, table.shape[0])
        return table[ids]

    def backward(self, g):
        ids, vocab = self.saved
        xp = array_module(g)
        onehot = (ids[:, None] == xp.arange(vocab)[None, :]).astype(g.dtype)
        return onehot.T @ g, None


class CrossEntropy(Function):
    """Mean softmax cross-entropy of logits [N, V] against targets [N] (int)."""

    def forward(self, logits, targets):
        xp = array_module(logits)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_z = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
        log_p = shifted - log_z
        self.save(log_p, targets)
        picked = xp.take_along_axis(log_p, targets[:, None], axis=1)
        return -picked.mean()

    def backward(self, g):
        log_p, targets = self.saved
        xp = array_module(log_p)
        grad = xp.exp(log_p)
        rows = xp.arange(targets.shape[0])
        grad[rows, targets] -= 1
        return grad * (g / targets.shape[0]), None


class Reshape(Function):
    """x viewed with another shape of the same size."""

    def forward(self, x, shape: tuple[int, ...] = ()):
        self.save(x.shape)
        return x.reshape(shape)

    def backward(self, g):
        (shape,) = self.saved
        return (g.reshape(shape),)


def constant(data: Any) -> Tensor:
    """A Tensor that never needs a gradient (ids, position tables, targets)."""
    return Tensor(data, requires_grad=False)


class RoPETail(Function):
    """RoPE on the last ``cos.shape[1] * 2`` dims of x [N, ..., d] (MLA's rope
    part); the leading dims pass through unchanged."""

    def forward(self, x, cos, sin):
        self.save(cos, sin)
        return _rotate_tail(x, cos, sin, 1)

    def backward(self, g):
        cos, sin = self.saved
        return _rotate_tail(g, cos, sin, -1), None, None


def _rotate_tail(x, cos, sin, direction: int):
    start = x.shape[-1] - 2 * cos.shape[1]
    out = x.copy()
    out[..., start:] = _rotate(x[..., start:], cos, sin, direction)
    return out


class TakeRows(Function):
    """x [N, ...] rows at ``rows`` [M] (int in [0, N), repeats allowed) -> [M, ...].

    A row taken several times gets the sum of its copies' gradients, added in
    the order the copies appear in ``rows`` (no atomics: the same bits on
    every run and backend).
    """

    def forward(self, x, rows):
        self.save(rows, x.shape)
        return x[rows]

    def backward(self, g):
        rows, shape = self.saved
        xp = array_module(g)
        dx = xp.zeros(shape, dtype=g.dtype)
        for level in _repeat_levels(rows):
            at = xp.asarray(level)
            dx[rows[at]] += g[at]  # the rows within a level are distinct: each is added once
        return dx, None


def _repeat_levels(rows: Any) -> list[np.ndarray]:
    """Positions of ``rows`` [M] (int, NumPy or CuPy) by occurrence: level j
    holds, ascending, the positions p where ``rows[p]`` occurs for the
    (j+1)-th time counting from the left. int64 host arrays; one level when
    the rows are distinct, none when M = 0."""
    host = to_host(rows).reshape(-1)
    order = np.argsort(host, kind="stable")
    ranked = host[order]
    new_run = np.ones(host.size, dtype=bool)
    new_run[1:] = ranked[1:] != ranked[:-1]
    run_start = np.flatnonzero(new_run)[np.cumsum(new_run) - 1]
    occurrence = np.empty(host.size, dtype=np.int64)
    occurrence[order] = np.arange(host.size) - run_start
    return [np.flatnonzero(occurrence == j) for j in range(int(occurrence.max(initial=-1)) + 1)]


def swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """SwiGLU MLP: (SiLU(x @ w1) * (x @ w3)) @ w2; x [..., d], w1/w3 [d, f], w2 [f, d]."""
    return MatMul.apply(Mul.apply(SiLU.apply(MatMul.apply(x, w1)), MatMul.apply(x, w3)), w2)


def cast(x: Any, dtype: Any) -> Any:
    """x as ``dtype`` (float16/32/64 or ml_dtypes bfloat16), on x's backend; a no-op
    when it already is. bfloat16 rounds to nearest even (CuPy: by bits)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if array_module(x) is np:
        return x.astype(dtype)
    from ..gpu.convert import narrow, widen

    return narrow(widen(x, np.float32), dtype) if dtype.itemsize < 4 else widen(x, dtype)


class Cast(Function):
    """x converted to ``dtype``; the gradient is converted back to x's dtype (e.g.
    bfloat16 operands for the attention kernels inside a float32 model)."""

    def forward(self, x, dtype: Any = None):
        self.save(x.dtype)
        return cast(x, dtype)

    def backward(self, g):
        (dtype,) = self.saved
        return (cast(g, dtype),)
