"""Activation recomputation with selection replay.

``checkpoint(block, x, rope, selector)`` runs a DSA block without keeping
its activations: the forward keeps only the block's input and the
selection it made. The backward recomputes the block with that selection
replayed (the indexer top-k never runs again), then back-propagates the
output gradient and the block's indexer loss (weighted by ``kl_weight``)
through the recomputed graph. Parameter gradients land in the parameters
directly; the block input's gradient goes back to the outer tape.

``recompute_selector`` replaces the replay with another selector in the
recompute: what a stack without replay does (it selects again). The replay
diagnostic and the layer benchmark use it as the baseline; a different score
computation there (another precision or kernel) flips selections and moves
the gradients, which replay rules out.
"""
from __future__ import annotations

from typing import Any

from .selection import ReplaySelection, SelectionStore
from .tensor import Function, Tensor, backward_many, no_grad


class _RecordOnly:
    """Wraps a selector for one block: remembers its selection for the replay
    (its ``topk``: the selector's)."""

    def __init__(self, selector: Any, store: SelectionStore) -> None:
        self.selector, self.store = selector, store
        self.topk = getattr(selector, "topk", None)

    def select(self, layer: str, q: Any, k: Any, w: Any) -> Any:
        indices = self.selector.select(layer, q, k, w)
        self.store.put(layer, indices)
        return indices


class Checkpoint(Function):
    """Inputs: the block input and the block's parameters (so the output needs
    a gradient whenever they do). Output: the block output; ``aux['kl']`` is
    the block's indexer loss value."""

    def forward(self, x, *params, block=None, rope=None, selector=None, kl_weight: float = 1.0,
                recompute_selector=None, kl_rows=None):
        store = SelectionStore()
        with no_grad():
            y, kl = block.forward(Tensor(x), rope, _RecordOnly(selector, store), kl_rows)
        replay = ReplaySelection(store, topk=getattr(selector, "topk", None))
        self.save(x, block, rope, recompute_selector or replay, kl_weight, kl_rows)
        return y.data, {"kl": kl.data, "selections": store}

    def backward(self, g):
        x, block, rope, recompute_selector, kl_weight, kl_rows = self.saved
        x_in = Tensor(x, requires_grad=self.needs_input_grad[0])
        y, kl = block.forward(x_in, rope, recompute_selector, kl_rows)
        seeds = [(y, g)]
        if kl.requires_grad:
            seeds.append((kl, kl.data * 0 + kl_weight))
        backward_many(seeds)
        return (x_in.grad,) + (None,) * (len(self.parents) - 1)


def checkpoint(block: Any, x: Tensor, rope: Any, selector: Any, kl_weight: float = 1.0,
               recompute_selector: Any = None, kl_rows: Any = None) -> Tensor:
    """Run ``block`` on ``x`` [N, d] with recomputation and selection replay (see module doc);
    ``rope`` and ``kl_rows`` go to ``block.forward``.

    Returns the block output [N, d]; ``aux['kl']`` is the block's indexer loss
    (a 0-d array) and ``aux['selections']`` the :class:`SelectionStore` of the
    forward's selection (int32 [N, topk] by layer name).
    """
    return Checkpoint.apply(x, *block.parameters(), block=block, rope=rope, selector=selector, kl_weight=kl_weight,
                            recompute_selector=recompute_selector, kl_rows=kl_rows)
