"""Partition helpers for sequence shards: pure functions, no MPI.

A :class:`Layout` says which global token positions each rank holds. Under
causal attention the work of a query grows with its position, so a
contiguous split leaves the last rank the most work; the zigzag split cuts
the sequence (or each packed sequence) into 2P chunks and gives rank i the
chunks i and 2P-1-i, pairing a cheap chunk with an expensive one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def split_sizes(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` near-equal contiguous pieces of ``n`` (first pieces larger)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    sizes = np.full(parts, n // parts, dtype=np.int64)
    sizes[: n % parts] += 1
    return sizes


@dataclass(frozen=True)
class Layout:
    """Global positions held by each rank, in the order the rank stores them.

    positions[r] : int64 [n_r], ascending, disjoint across ranks, covering 0..n-1.
    """

    n: int
    positions: tuple[np.ndarray, ...]

    @property
    def world_size(self) -> int:
        return len(self.positions)

    def owner(self) -> np.ndarray:
        """int64 [n]: the rank holding each global position."""
        owner = np.empty(self.n, dtype=np.int64)
        for rank, pos in enumerate(self.positions):
            owner[pos] = rank
        return owner

    def causal_work(self, cu_seqlens: np.ndarray | None = None) -> np.ndarray:
        """int64 [P]: causal query-key pairs each rank's queries score."""
        starts = _sequence_starts(self.n, cu_seqlens)
        return np.array([int((pos - starts[pos] + 1).sum()) for pos in self.positions], dtype=np.int64)


def _sequence_starts(n: int, cu_seqlens: np.ndarray | None) -> np.ndarray:
    """int64 [n]: start position of the packed sequence holding each token."""
    if cu_seqlens is None:
        return np.zeros(n, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    seq = np.searchsorted(cu, np.arange(n), side="right") - 1
    return cu[seq]


def _check_bounds(n: int, cu_seqlens) -> np.ndarray:
    cu = np.array([0, n], dtype=np.int64) if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != n or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens must run non-decreasing from 0 to n={n}, got {cu.tolist()}")
    return cu


def contiguous_layout(n: int, world_size: int) -> Layout:
    """Rank r holds one contiguous slice; sizes differ by at most one."""
    bounds = np.concatenate([[0], np.cumsum(split_sizes(n, world_size))])
    return Layout(n, tuple(np.arange(bounds[r], bounds[r + 1]) for r in range(world_size)))


def zigzag_layout(n: int, world_size: int, cu_seqlens=None) -> Layout:
    """Load-balanced causal layout: each (packed) sequence cut into 2P chunks,
    rank i holding chunks i and 2P-1-i of every sequence."""
    cu = _check_bounds(n, cu_seqlens)
    held: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for start, stop in zip(cu[:-1], cu[1:]):
        bounds = start + np.concatenate([[0], np.cumsum(split_sizes(int(stop - start), 2 * world_size))])
        for rank in range(world_size):
            for chunk in (rank, 2 * world_size - 1 - rank):
                held[rank].append(np.arange(bounds[chunk], bounds[chunk + 1]))
    return Layout(n, tuple(np.sort(np.concatenate(parts)) for parts in held))
