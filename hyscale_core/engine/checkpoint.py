"""Activation recomputation with selection replay.

``checkpoint(block, x, rope, selector)`` runs a DSA block without keeping
its activations: the forward keeps only the block's input and the
selection it made. The backward recomputes the block with that selection
replayed (the indexer top-k never runs again), then back-propagates the
output gradient and the block's indexer loss (weighted by ``kl_weight``)
through the recomputed graph. Parameter gradients land in the parameters
directly; the block input's gradient goes back to the outer tape.
"""
from __future__ import annotations

from typing import Any

from .selection import ReplaySelection, SelectionStore
from .tensor import Function, Tensor, backward_many, no_grad


class _RecordOnly:
    """Wraps a selector for one block: remembers its selection for the replay."""

    def __init__(self, selector: Any, store: SelectionStore) -> None:
        self.selector, self.store = selector, store

    def select(self, layer: str, q: Any, k: Any, w: Any) -> Any:
        indices = self.selector.select(layer, q, k, w)
        self.store.put(layer, indices)
        return indices


class Checkpoint(Function):
    """Inputs: the block input and the block's parameters (so the output needs
    a gradient whenever they do). Output: the block output; ``aux['kl']`` is
    the block's indexer loss value."""

    def forward(self, x, *params, block=None, rope=None, selector=None, kl_weight: float = 1.0):
        store = SelectionStore()
        with no_grad():
            y, kl = block.forward(Tensor(x), rope, _RecordOnly(selector, store))
        self.save(x, block, rope, store, kl_weight)
        return y.data, {"kl": kl.data}

    def backward(self, g):
        x, block, rope, store, kl_weight = self.saved
        x_in = Tensor(x, requires_grad=self.needs_input_grad[0])
        y, kl = block.forward(x_in, rope, ReplaySelection(store))
        seeds = [(y, g)]
        if kl.requires_grad:
            seeds.append((kl, kl.data * 0 + kl_weight))
        backward_many(seeds)
        return (x_in.grad,) + (None,) * (len(self.parents) - 1)


def checkpoint(block: Any, x: Tensor, rope: Any, selector: Any, kl_weight: float = 1.0) -> Tensor:
    """Run ``block`` on ``x`` with recomputation and selection replay (see module doc)."""
    return Checkpoint.apply(x, *block.parameters(), block=block, rope=rope, selector=selector, kl_weight=kl_weight)
