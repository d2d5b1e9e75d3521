"""Sequence shards over MPI (installed as ``hyscale_core.mpi``).

``layout`` holds the pure partition helpers (no MPI needed): who holds which
slice of a long sequence, contiguous or load-balanced (zigzag).
"""
from .layout import Layout, contiguous_layout, zigzag_layout

__all__ = ["Layout", "contiguous_layout", "zigzag_layout"]
