"""A small forward/backward engine on raw NumPy/CuPy arrays (no framework)."""
from .optim import AdamW
from .tensor import Function, Tensor, backward, backward_many, no_grad

__all__ = ["AdamW", "Function", "Tensor", "backward", "backward_many", "no_grad"]
