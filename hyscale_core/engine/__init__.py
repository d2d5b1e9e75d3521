"""A small forward/backward engine on raw NumPy/CuPy arrays (no framework)."""
from .optim import AdamW
from .tensor import Function, Tensor, backward, no_grad

__all__ = ["AdamW", "Function", "Tensor", "backward", "no_grad"]
