"""AdamW with decoupled weight decay and global gradient-norm clipping."""
from __future__ import annotations

import math
from typing import Iterable

from .._backend import array_module
from .tensor import Tensor


class AdamW:
    """AdamW over leaf Tensors (their ``.grad`` is consumed and cleared by ``step``).

    lr, betas, eps : the usual Adam terms.
    weight_decay   : decoupled decay, ``p -= lr * weight_decay * p`` each step.
    max_grad_norm  : clip the global L2 norm of all gradients to this (None: off).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("AdamW got no parameters that require gradients")
        if lr <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or weight_decay < 0:
            raise ValueError(f"bad AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.max_grad_norm = weight_decay, max_grad_norm
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
