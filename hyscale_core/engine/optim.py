"""AdamW with decoupled weight decay and global gradient-norm clipping."""
from __future__ import annotations

import math
from typing import Any, Iterable

from .._backend import array_module
from .._checks import check_real
from .tensor import Tensor


class AdamW:
    """AdamW over leaf Tensors (their ``.grad`` is consumed and cleared by ``step``).

    lr            : step size, finite and > 0.
    betas         : a pair (beta1, beta2), each finite in [0, 1).
    eps           : finite and > 0.
    weight_decay  : decoupled decay, ``p -= lr * weight_decay * p`` each step;
                    finite, >= 0 and below 1 / lr (so the decay only shrinks).
    max_grad_norm : clip the global L2 norm of all gradients to this, finite
                    and > 0 (None: off).

    Settings are checked here: a bad one is a ValueError (TypeError for a
    non-number) that names it and its value.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0) -> None:
        self.params = _trainable(params)
        self.lr, self.betas = check_real(lr, "lr", positive=True), _betas(betas)
        self.eps, self.weight_decay = check_real(eps, "eps", positive=True), check_real(weight_decay, "weight_decay")
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"lr * weight_decay must be < 1 (each step scales the parameters by 1 - lr * "
                             f"weight_decay), got lr={self.lr!r}, weight_decay={self.weight_decay!r}")
        self.max_grad_norm = (None if max_grad_norm is None
                              else check_real(max_grad_norm, "max_grad_norm", positive=True))
        self.step_count = 0
        self.m = [array_module(p.data).zeros_like(p.data) for p in self.params]
        self.v = [array_module(p.data).zeros_like(p.data) for p in self.params]

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (missing gradients count as zero)."""
        total = 0.0
        for p in self.params:
            if p.grad is not None:
                total += float((p.grad.astype("float64") ** 2).sum())
        return math.sqrt(total)

    def step(self) -> float:
        """Apply one update; returns the gradient norm before clipping."""
        norm = self.grad_norm()
        scale = 1.0
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            scale = self.max_grad_norm / (norm + 1e-12)
        self.step_count += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.step_count, 1 - b2**self.step_count
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            xp = array_module(p.data)
            g = p.grad * scale
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p.data *= 1 - self.lr * self.weight_decay
            p.data -= (self.lr / c1) * m / (xp.sqrt(v / c2) + self.eps)
            p.grad = None
        return norm

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _trainable(params: Iterable[Tensor]) -> list[Tensor]:
    """The Tensors of ``params`` that require a gradient (at least one)."""
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params must hold Tensors, got params[{i}] = {type(p).__name__}")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("AdamW got no parameters that require gradients")
    return trainable


def _betas(betas: Any) -> tuple[float, float]:
    """``betas`` as a pair of floats in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    pair = (check_real(betas[0], "betas[0]"), check_real(betas[1], "betas[1]"))
    for i, beta in enumerate(pair):
        if beta >= 1:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {betas[i]!r}")
    return pair
