"""A small forward/backward engine on raw NumPy/CuPy arrays (no framework).

    >>> from hyscale_core.engine import TinyDSA, DSAConfig, LiveSelection, AdamW, backward
    >>> model = TinyDSA(DSAConfig(vocab=104))
    >>> out = model.forward(ids, rows, targets, LiveSelection(16), recompute=True)
    >>> backward(out.loss); AdamW(model.parameters()).step()

``recompute=True`` checkpoints every block (:func:`checkpoint`): the
backward recomputes it with the forward's selection replayed, never running
the indexer top-k again.
"""
from .checkpoint import checkpoint
from .model import DSABlock, DSAConfig, Forward, TinyDSA
from .optim import AdamW
from .selection import LiveSelection, ReplaySelection, SelectionMismatchError, SelectionStore, checksum
from .tensor import Function, Tensor, backward, backward_many, no_grad

__all__ = ["AdamW", "DSABlock", "DSAConfig", "Forward", "Function", "LiveSelection", "ReplaySelection",
           "SelectionMismatchError", "SelectionStore", "Tensor", "TinyDSA", "backward", "backward_many",
           "checkpoint", "checksum", "no_grad"]
