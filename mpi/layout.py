"""Partition helpers for sequence shards: pure functions, no MPI.

A :class:`Layout` says which global token positions each rank holds. Under
causal attention the work of a query grows with its position, so a
contiguous split leaves the last rank the most work; the zigzag split cuts
the sequence (or each packed sequence) into 2P chunks and gives rank i the
chunks i and 2P-1-i, pairing a cheap chunk with an expensive one.

Alignment: ``align=a`` moves every chunk boundary to the nearest multiple
of ``a`` (global position), so each rank holds whole blocks of ``a``
tokens. The CPU indexer scores queries in blocks of ``QUERY_ALIGN`` (its
BLAS calls' shapes depend on the block), so with ``align=QUERY_ALIGN`` a
rank's query blocks are exactly the single process's blocks and the
sharded selection is bitwise identical (see ``ops.py``). A packed
sequence shorter than ``align`` then goes whole to one rank.

Many short packed sequences (each shorter than 2P aligned chunks) cannot
be cut per sequence: :func:`balanced_layout` then cuts the whole packed row
into 2P chunks instead, each holding whole sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import check_int
from ..ops.indexer.ranges import host_ints

# The CPU indexer's query block (hyscale_core/ops/indexer/cpu.py Q_BLOCK;
# tests/test_mpi_layout.py checks they agree).
QUERY_ALIGN = 64


def split_sizes(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` near-equal contiguous pieces of ``n`` (first pieces larger)."""
    n, parts = check_int(n, "n", 0), check_int(parts, "parts", 1)
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

    @property
    def counts(self) -> np.ndarray:
        """int64 [P]: rows held by each rank."""
        return np.array([len(p) for p in self.positions], dtype=np.int64)

    def owner(self) -> np.ndarray:
        """int64 [n]: the rank holding each global position."""
        owner = np.empty(self.n, dtype=np.int64)
        for rank, pos in enumerate(self.positions):
            owner[pos] = rank
        return owner

    def local_index(self) -> np.ndarray:
        """int64 [n]: each global position's row on its owner."""
        local = np.empty(self.n, dtype=np.int64)
        for pos in self.positions:
            local[pos] = np.arange(len(pos))
        return local

    def rank_major(self) -> np.ndarray:
        """int64 [n]: each global position's row in the rank-major concatenation
        (rank 0's rows, then rank 1's, ...), the order an all-gather delivers."""
        order = np.empty(self.n, dtype=np.int64)
        if self.n:
            order[np.concatenate(self.positions)] = np.arange(self.n)
        return order

    def causal_work(self, cu_seqlens: np.ndarray | None = None) -> np.ndarray:
        """int64 [P]: causal query-key pairs each rank's queries score."""
        starts = _sequence_starts(self.n, cu_seqlens)
        return np.array([int((pos - starts[pos] + 1).sum()) for pos in self.positions], dtype=np.int64)

    def check(self) -> None:
        """Raise ValueError unless the positions are ascending and partition 0..n-1."""
        every = np.concatenate(self.positions) if self.positions else np.empty(0, np.int64)
        if not all((np.diff(p) > 0).all() for p in self.positions):
            raise ValueError("layout positions must be ascending on every rank")
        if every.size != self.n or not np.array_equal(np.sort(every), np.arange(self.n)):
            raise ValueError(f"layout positions must cover 0..{self.n - 1} exactly once")


def _sequence_starts(n: int, cu_seqlens: Any) -> np.ndarray:
    """int64 [n]: start position of the packed sequence holding each token."""
    cu = check_bounds(n, cu_seqlens)
    return cu[np.searchsorted(cu, np.arange(n), side="right") - 1]


def check_sizes(n: Any, world_size: Any, align: Any) -> tuple[int, int, int]:
    """``n`` (tokens, >= 0), ``world_size`` (>= 1) and ``align`` (>= 1) as Python
    ints; TypeError for a non-integer (bool and float included), ValueError below the bound."""
    return check_int(n, "n", 0), check_int(world_size, "world_size", 1), check_int(align, "align", 1)


def check_bounds(n: int, cu_seqlens: Any) -> np.ndarray:
    """int64 [B+1]: ``cu_seqlens`` (None: one sequence) checked to hold integers
    (TypeError, as ``hs.indexer_topk``) running non-decreasing from 0 to ``n``."""
    cu = np.array([0, n], dtype=np.int64) if cu_seqlens is None else host_ints(cu_seqlens, "cu_seqlens")
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != n or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens must run non-decreasing from 0 to n={n}, got {cu.tolist()}")
    return cu


def _aligned(bounds: np.ndarray, align: int, n: int) -> np.ndarray:
    """Boundaries moved to the nearest multiple of ``align`` (n stays n); monotone."""
    return np.where(bounds == n, n, np.minimum((bounds + align // 2) // align * align, n))


def _from_chunks(n: int, world_size: int, bounds: np.ndarray, ranks: np.ndarray) -> Layout:
    """Chunk c = [bounds[c], bounds[c+1]) goes to ranks[c]."""
    held: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for c, rank in enumerate(ranks):
        held[rank].append(np.arange(bounds[c], bounds[c + 1]))
    return Layout(n, tuple(np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in held))


def contiguous_layout(n: int, world_size: int, align: int = 1) -> Layout:
    """Rank r holds one contiguous slice; sizes differ by at most one (by at
    most ``align`` + 1 with alignment)."""
    n, world_size, align = check_sizes(n, world_size, align)
    bounds = np.concatenate([[0], np.cumsum(split_sizes(n, world_size))])
    return _from_chunks(n, world_size, _aligned(bounds, align, n), np.arange(world_size))


def zigzag_layout(n: int, world_size: int, cu_seqlens=None, align: int = 1) -> Layout:
    """Load-balanced causal layout: each (packed) sequence cut into 2P chunks,
    rank i holding chunks i and 2P-1-i of every sequence."""
    n, world_size, align = check_sizes(n, world_size, align)
    cu = check_bounds(n, cu_seqlens)
    pairs = np.concatenate([np.arange(world_size), np.arange(world_size)[::-1]])
    bounds, ranks = [np.zeros(1, np.int64)], []
    for start, stop in zip(cu[:-1], cu[1:]):
        bounds.append(start + np.cumsum(split_sizes(int(stop - start), 2 * world_size)))
        ranks.append(pairs)
    return _from_chunks(n, world_size, _aligned(np.concatenate(bounds), align, n), np.concatenate(ranks))


def balanced_layout(n: int, world_size: int, cu_seqlens=None, align: int = 1) -> Layout:
    """The zigzag layout whose busiest rank scores the fewest causal pairs:
    each packed sequence cut into 2P chunks (``zigzag_layout(n, P, cu_seqlens)``),
    or the whole packed row cut into 2P chunks (``zigzag_layout(n, P)``, the
    chunks holding whole short sequences). Ties keep the per-sequence cut.

    With alignment, sequences shorter than 2P * align tokens cut per sequence
    all go to one rank (every aligned boundary falls at their ends); a batch
    of them is balanced by the whole-row cut.
    """
    per_sequence = zigzag_layout(n, world_size, cu_seqlens, align=align)
    if cu_seqlens is None:
        return per_sequence
    whole_row = zigzag_layout(n, world_size, align=align)
    busiest = lambda layout: int(layout.causal_work(cu_seqlens).max(initial=0))  # noqa: E731
    return whole_row if busiest(whole_row) < busiest(per_sequence) else per_sequence
