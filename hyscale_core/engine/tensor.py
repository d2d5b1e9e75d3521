"""The tape: Tensors on raw NumPy/CuPy arrays and Functions that record how
they were made (the tinygrad/micrograd split).

A Function works on raw arrays: ``forward`` computes the output and saves the
minimum its ``backward`` needs; ``backward`` returns one gradient per input,
``None`` where ``needs_input_grad`` is false. :func:`backward` walks the
tape from a scalar, accumulates gradients into the leaves' ``.grad`` and
frees each Function's saved state once it has run.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

_GRAD_ENABLED = [True]


@contextlib.contextmanager
def no_grad():
    """Inside this block new Tensors record no Functions."""
    _GRAD_ENABLED.append(False)
    try:
        yield
    finally:
        _GRAD_ENABLED.pop()


class Tensor:
    """An array plus, when it needs a gradient, the Function that made it.

    data : NumPy or CuPy array.
    grad : accumulated gradient (same shape and array type), leaves only.
    aux  : non-differentiable side outputs of the Function that made it.
    """

    __slots__ = ("data", "grad", "requires_grad", "ctx", "name", "aux")

    def __init__(self, data: Any, requires_grad: bool = False, name: str | None = None) -> None:
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self.ctx: Function | None = None
        self.name = name
        self.aux: dict[str, Any] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    def detach(self) -> "Tensor":
        """The same data, cut from the tape."""
        return Tensor(self.data)

    def backward(self, grad: Any = None) -> None:
        backward(self, grad)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"Tensor{label}(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"


class Function:
    """One differentiable operation. Subclasses define ``forward`` and ``backward``.

    ``parents`` are the graph edges of the inputs: the Function that made an
    input, the input itself when it is a leaf that needs a gradient, or None.
    They hold no input data, so an intermediate array lives only as long as
    the caller or a ``save`` keeps it (the tape's memory is what the
    Functions saved, as in PyTorch's autograd).
    """

    def __init__(self, *inputs: Tensor) -> None:
        self.parents: tuple = tuple(_edge(t) for t in inputs)
        self.needs_input_grad = tuple(t.requires_grad for t in inputs)
        self.saved: tuple = ()
        self.spent = False

    def save(self, *arrays: Any) -> None:
        self.saved = arrays

    def forward(self, *arrays: Any, **options: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def backward(self, grad: Any) -> tuple:
        raise NotImplementedError(f"{type(self).__name__} defines no backward")

    @classmethod
    def apply(cls, *inputs: Tensor, **options: Any) -> Tensor:
        """Run ``forward`` on the inputs' arrays; record the Function if a gradient is needed.

        ``forward`` returns the output array, or ``(output, aux)`` with a dict
        of non-differentiable side outputs (exposed as ``Tensor.aux``).
        """
        ctx = cls(*inputs)
        result = ctx.forward(*(t.data for t in inputs), **options)
        out, aux = result if isinstance(result, tuple) else (result, {})
        tensor = Tensor(out, requires_grad=_GRAD_ENABLED[-1] and any(ctx.needs_input_grad))
        tensor.aux = aux
        if tensor.requires_grad:
            tensor.ctx = ctx  # otherwise nothing refers to ctx: it and what it saved are freed on return
        return tensor


def _edge(t: Tensor) -> Any:
    if t.ctx is not None:
        return t.ctx
    return t if t.requires_grad else None


def _node(root: Tensor) -> Any:
    """The graph node a root's gradient enters: its Function, or itself (a leaf)."""
    if not root.requires_grad:
        raise ValueError("backward() called on a Tensor that does not require a gradient")
    return root.ctx if root.ctx is not None else root


def _seed(root: Tensor, grad: Any) -> Any:
    """The gradient entering ``root``: ``grad``, checked to have root's shape, or 1."""
    if grad is None:
        if root.data.size != 1:
            raise ValueError(f"backward() needs grad for a non-scalar root of shape {root.shape}")
        return root.data * 0 + 1
    if tuple(np.shape(grad)) != root.shape:
        raise ValueError(f"grad must have the root's shape {root.shape}, got shape {tuple(np.shape(grad))}")
    return grad


def _topological(roots: list[Any]) -> list[Any]:
    """Nodes (Functions and leaf Tensors) reachable from ``roots``, each after its parents."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if isinstance(node, Function):
            for parent in reversed(node.parents):
                if parent is not None and id(parent) not in seen:
                    stack.append((parent, False))
    return order


def backward(root: Tensor, grad: Any = None) -> None:
    """Accumulate d(root)/d(leaf) into every leaf's ``.grad`` and free the tape.

    ``grad``: d(loss)/d(root), an array of exactly the root's shape (no
    broadcasting: a ValueError names both shapes); it defaults to 1 for a
    root of one element. Gradients are summed in a fixed order (reverse
    topological, parents in argument order): deterministic.
    """
    backward_many([(root, grad)])


def backward_many(seeds: list[tuple[Tensor, Any]]) -> None:
    """:func:`backward` from several roots at once, each with its own seed gradient."""
    grads: dict[int, Any] = {}
    roots = []
    for root, grad in seeds:
        node = _node(root)
        grad = _seed(root, grad)
        grads[id(node)] = grad if id(node) not in grads else grads[id(node)] + grad
        roots.append(node)
    for node in reversed(_topological(roots)):
        g = grads.pop(id(node), None)
        if g is None:
            continue
        if isinstance(node, Tensor):
            node.grad = g if node.grad is None else node.grad + g
        elif node.spent:
            raise RuntimeError(f"backward through {type(node).__name__} a second time: its saved state "
                               "was freed by the first backward")
        else:
            _run_backward(node, g, grads)


def _run_backward(ctx: Function, g: Any, grads: dict[int, Any]) -> None:
    parent_grads = ctx.backward(g)
    if len(parent_grads) != len(ctx.parents):
        raise RuntimeError(f"{type(ctx).__name__}.backward returned {len(parent_grads)} gradients "
                           f"for {len(ctx.parents)} inputs")
    for parent, pg, needs in zip(ctx.parents, parent_grads, ctx.needs_input_grad):
        if needs and pg is not None and parent is not None:
            key = id(parent)
            grads[key] = pg if key not in grads else grads[key] + pg
    ctx.saved = ctx.parents = ()
    ctx.spent = True
