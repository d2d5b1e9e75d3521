"""Row exchanges: bring the rows a rank's selections need, send gradients home.

A plan is built collectively for one exchange and then used both ways:

    table = plan.gather(local_rows)       # [T, ...] rows this rank may read
    local = plan.remap(indices)           # global positions -> rows of table
    grad  = plan.to_owners(dtable)        # [n_local, ...] summed over ranks

:class:`AllGather` delivers every row (rank-major, or in global position
order for the indexer keys); :class:`Fetch` delivers only the distinct rows
an index table uses. :func:`plan_rows` picks one by the cost model
(``costmodel.py``). ``to_owners`` sums the contributions of all ranks to a
row in float64, in rank order 0 .. P-1, and rounds once to the rows'
dtype: the result is deterministic, identical for both plans, and the
same on every run.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._backend import array_module
from .costmodel import allgather_bytes, choose_exchange, fetch_backward_bytes, fetch_bytes
from .shard import Shard
from .transport import as_bits


def _wide(x: Any) -> Any:
    """x as float64 (bfloat16 by its bits on the GPU)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    from ..gpu.convert import widen

    return widen(x, np.float64)


def _narrow(x: Any, dtype: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.astype(dtype)
    from ..gpu.convert import narrow

    return narrow(x, dtype)


def take_rows(x: Any, rows: Any) -> Any:
    """x[rows] (int rows), moved by their bits (any dtype, bfloat16 on CuPy included)."""
    return as_bits(x)[rows].view(x.dtype)


def sum_in_rank_order(blocks: Any, dtype: Any) -> Any:
    """Sum [P, m, ...] over the first axis in order, in float64, rounded once to dtype."""
    total = array_module(blocks).zeros(blocks.shape[1:], dtype=np.float64)
    for block in blocks:
        total += _wide(block)
    return _narrow(total, dtype)


class AllGather:
    """Every rank receives all N rows.

    global_order=False: the table is rank-major (the order the all-gather
    delivers) and ``remap`` renumbers the indices; True: the table is in
    global position order (the indexer needs it: ranges and ties follow
    positions) and indices stay as they are.
    """

    mode = "allgather"

    def __init__(self, shard: Shard, global_order: bool = False) -> None:
        self.shard, self.global_order = shard, global_order

    def gather(self, local: Any) -> Any:
        """local [n_local, ...] -> table [N, ...]."""
        s = self.shard
        s.check_rows("local rows", local)
        recv = s.transport.alltoallv(local, [s.n_local] * s.size, s.counts, send_displs=[0] * s.size)
        return take_rows(recv, s.device("rank_major")) if self.global_order else recv

    def remap(self, indices: Any) -> Any:
        """int32 [T, k] global positions (or -1) -> rows of the table (or -1)."""
        if self.global_order:
            return indices
        xp = self.shard.xp
        return xp.where(indices >= 0, self.shard.device("rank_major")[xp.maximum(indices, 0)], -1).astype(np.int32)

    def to_owners(self, dtable: Any) -> Any:
        """dtable [N, ...] (this rank's gradient at every row) -> [n_local, ...]."""
        s = self.shard
        if self.global_order:
            dtable = take_rows(dtable, s.device("rank_major_order"))
        recv = s.transport.alltoallv(dtable, s.counts, [s.n_local] * s.size)
        return sum_in_rank_order(recv.reshape((s.size, s.n_local) + tuple(recv.shape[1:])), dtable.dtype)


class Fetch:
    """Each rank receives the distinct rows its index table uses (built collectively).

    wanted  : global positions this rank reads, owner-major, ascending per owner.
    want    : int64 [P] how many of them each rank holds; serve : int64 [P]
              how many of this rank's rows each rank reads.
    """

    mode = "fetch"

    def __init__(self, shard: Shard, indices: Any) -> None:
        xp, s = shard.xp, shard
        self.shard = s
        ids = xp.unique(indices[indices >= 0]).astype(np.int64)
        owners = s.device("owner")[ids]
        order = xp.argsort(owners * s.n + ids)  # owner-major, ascending per owner (unique keys)
        self.ids, self.wanted = ids, ids[order].astype(np.int32)
        self.slot = xp.empty_like(order)
        self.slot[order] = xp.arange(order.shape[0])
        self.want = np.bincount(owners if xp is np else owners.get(), minlength=s.size).astype(np.int64)
        self.serve = s.transport.exchange_counts(self.want)
        served = s.transport.alltoallv(self.wanted, self.want, self.serve)
        self.serve_rows = s.device("local_index")[served.astype(np.int64)]

    def gather(self, local: Any) -> Any:
        """local [n_local, ...] -> table [len(wanted), ...]."""
        self.shard.check_rows("local rows", local)
        return self.shard.transport.alltoallv(take_rows(local, self.serve_rows), self.serve, self.want)

    def remap(self, indices: Any) -> Any:
        xp = self.shard.xp
        if self.ids.size == 0:
            return indices
        pos = xp.searchsorted(self.ids, xp.maximum(indices, 0).astype(np.int64))
        return xp.where(indices >= 0, self.slot[xp.minimum(pos, self.ids.size - 1)], -1).astype(np.int32)

    def to_owners(self, dtable: Any) -> Any:
        """dtable [len(wanted), ...] -> [n_local, ...]: contributions summed in rank order."""
        s, xp = self.shard, self.shard.xp
        recv = s.transport.alltoallv(dtable, self.want, self.serve)
        total = xp.zeros((s.n_local,) + tuple(dtable.shape[1:]), dtype=np.float64)
        start = 0
        for count in self.serve:  # rank order; rows of one rank are distinct
            rows = self.serve_rows[start:start + count]
            total[rows] += _wide(recv[start:start + count])
            start += count
        return _narrow(total, dtable.dtype)


def plan_rows(shard: Shard, indices: Any, row_bytes: int, exchange: str = "auto") -> AllGather | Fetch:
    """The exchange for an index table (collective).

    exchange : "allgather", "fetch", or "auto" (the cost model's choice from
    every rank's count of foreign rows, one small all-gather).
    """
    if exchange not in ("auto", "allgather", "fetch"):
        raise ValueError(f"exchange must be 'auto', 'allgather' or 'fetch', got {exchange!r}")
    if exchange == "auto":
        xp = shard.xp
        ids = xp.unique(indices[indices >= 0])
        foreign = int((shard.device("owner")[ids] != shard.rank).sum())
        exchange = choose_exchange(shard.counts, np.array(shard.comm.allgather(foreign)), row_bytes)
    return AllGather(shard) if exchange == "allgather" else Fetch(shard, indices)


def modelled_bytes(plan: AllGather | Fetch, row_bytes: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The cost model's ``{"gather": (sent, received), "to_owners": (sent, received)}``,
    int64 [P] bytes per rank, for ``plan`` moving rows of ``row_bytes`` (collective
    for a Fetch: every rank's ``want`` is all-gathered)."""
    if isinstance(plan, AllGather):
        forward = allgather_bytes(plan.shard.counts, row_bytes)
        return {"gather": forward, "to_owners": forward[::-1]}
    fetched = np.array(plan.shard.comm.allgather(plan.want.tolist()), dtype=np.int64)
    return {"gather": fetch_bytes(fetched, row_bytes), "to_owners": fetch_backward_bytes(fetched, row_bytes)}
