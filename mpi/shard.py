"""A rank's view of a sharded sequence: communicator, layout, transport.

:func:`make_shard` is a collective call: every rank passes the same
sequence length, layout and packing, and gets back a :class:`Shard` holding
its own positions and the maps the row exchanges use. :func:`abort_on_error`
turns an exception on any rank into ``MPI_Abort`` of the whole job, so a
failing rank never leaves the others waiting in a collective.
:func:`launched_world` tells a program started by ``mpiexec -n P`` (P > 1)
from a plain run.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any, Iterator

import numpy as np

from .layout import (QUERY_ALIGN, Layout, balanced_layout, check_bounds, check_sizes, contiguous_layout,
                     zigzag_layout)
from .transport import Transport, select_transport


class Shard:
    """This rank's part of a sequence of ``layout.n`` tokens.

    positions   int64 [n_local]  the global positions this rank holds, ascending
                                 (its rows of every sharded array, in this order).
    owner, local_index, rank_major : int64 [n] maps of the layout (see Layout).
    rank_major_order : int64 [n]     the global positions in rank-major order
                                     (rank_major's inverse).
    xp          numpy or cupy: the array module of the sharded arrays.
    """

    def __init__(self, comm: Any, layout: Layout, transport: Transport, cu_seqlens: Any = None,
                 xp: Any = np) -> None:
        layout.check()
        if layout.world_size != comm.Get_size():
            raise ValueError(f"layout has {layout.world_size} ranks, the communicator {comm.Get_size()}")
        self.comm, self.layout, self.transport, self.xp = comm, layout, transport, xp
        self.rank, self.size, self.n = comm.Get_rank(), comm.Get_size(), layout.n
        self.cu_seqlens = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
        self.positions = layout.positions[self.rank]
        self.counts = layout.counts
        self.owner, self.local_index, self.rank_major = layout.owner(), layout.local_index(), layout.rank_major()
        self.rank_major_order = np.concatenate(layout.positions).astype(np.int64)
        self._on_device: dict[str, Any] = {}

    @property
    def n_local(self) -> int:
        return int(self.positions.shape[0])

    def device(self, name: str) -> Any:
        """One of the int64 maps (``owner``, ``local_index``, ``rank_major``,
        ``rank_major_order``, ``positions``) as an ``xp`` array, copied to the device once."""
        if name not in self._on_device:
            self._on_device[name] = self.xp.asarray(getattr(self, name))
        return self._on_device[name]

    def check_rows(self, name: str, array: Any) -> None:
        """ValueError unless ``array`` has one row per local position."""
        if array.ndim < 1 or array.shape[0] != self.n_local:
            raise ValueError(f"{name} must have one row per local position ({self.n_local} on rank "
                             f"{self.rank}), got shape {tuple(array.shape)}")

    def close(self) -> None:
        self.transport.close()


def make_shard(comm: Any, n: int, *, layout: str | Layout = "zigzag", cu_seqlens: Any = None,
               align: int = QUERY_ALIGN, xp: Any = np, transport: str | Transport | None = None) -> Shard:
    """Shard a sequence of ``n`` tokens over the ranks of ``comm`` (collective).

    layout     : "zigzag" (load-balanced for causal attention), "balanced"
                 (zigzag per sequence or over the whole packed row, whichever
                 leaves the busiest rank less work: many short packed
                 sequences), "contiguous", or a ready :class:`Layout`.
    cu_seqlens : int [B+1] packed-sequence bounds in global positions (zigzag
                 balances each sequence); passed on to the indexer.
    align      : chunk boundaries at multiples of this (QUERY_ALIGN = 64 makes
                 the CPU indexer's selection bitwise identical to one process).
    xp         : numpy or cupy, the array module of the sharded arrays.
    transport  : see :func:`select_transport` (default: auto), or a ready
                 :class:`Transport` on ``comm`` (shards sharing one transport:
                 close it once, not through each shard).

    Every rank must pass the same n, layout, cu_seqlens and align; a rank
    that differs, or a bad one of them on any rank, makes every rank raise
    (ValueError, or the TypeError of a non-integer).
    """
    n, cu, align = _agreed_args(comm, n, layout, cu_seqlens, align)
    size = comm.Get_size()
    if isinstance(layout, Layout):
        chosen = layout
    elif layout == "zigzag":
        chosen = zigzag_layout(n, size, cu, align=align)
    elif layout == "balanced":
        chosen = balanced_layout(n, size, cu, align=align)
    elif layout == "contiguous":
        if cu is not None:
            raise ValueError("the contiguous layout splits the token axis; pass layout='zigzag' for cu_seqlens")
        chosen = contiguous_layout(n, size, align=align)
    else:
        raise ValueError(f"layout must be 'zigzag', 'balanced', 'contiguous' or a Layout, got {layout!r}")
    if not isinstance(transport, Transport):
        transport = select_transport(comm, xp, transport)
    return Shard(comm, chosen, transport, cu, xp)


def _agreed_args(comm: Any, n: Any, layout: Any, cu_seqlens: Any, align: Any) -> tuple[int, Any, int]:
    """``(n, cu_seqlens int64 [B+1] or None, align)`` checked, the same on every
    rank (collective): a check failing on any rank, or ranks that differ,
    raise on every rank, so none is left waiting in a later collective."""
    try:
        n, _, align = check_sizes(n, comm.Get_size(), align)
        cu = None if cu_seqlens is None else check_bounds(n, cu_seqlens)
        key = (n, layout if isinstance(layout, str) else "custom", None if cu is None else cu.tolist(), align)
    except (TypeError, ValueError) as exc:
        key = exc
    everyone = comm.allgather(key)
    for rank, other in enumerate(everyone):
        if isinstance(other, Exception):
            raise type(other)(f"{other} (on rank {rank})")
    if any(other != key for other in everyone):
        raise ValueError(f"ranks disagree on (n, layout, cu_seqlens, align): {everyone}")
    return n, cu, align


# Set by the launchers of Open MPI, MPICH / Intel MPI (Hydra) and PMIx-based ones (e.g. srun --mpi=pmix).
LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def launched_world() -> Any | None:
    """``MPI.COMM_WORLD`` when an MPI launcher started this process among
    several, else None. A plain run (no launcher variable set) returns None
    without importing mpi4py, so it needs no MPI at all."""
    if not any(name in os.environ for name in LAUNCHER_ENV):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def use_local_gpu(comm: Any) -> int:
    """Select GPU (local rank mod device count) for this rank; returns its id.
    Ranks on one host beyond the device count share GPUs."""
    import cupy as cp
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = local.Get_rank() % cp.cuda.runtime.getDeviceCount()
    local.Free()
    cp.cuda.Device(device).use()
    return device


ABORT_GRACE_S = 1.0  # seconds between a failing rank's message and MPI_Abort


@contextlib.contextmanager
def abort_on_error(comm: Any = None) -> Iterator[None]:
    """Run the block; on any exception print it with the rank and ``MPI_Abort``
    the whole job (exit code 1), so no rank waits forever in a collective."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        from mpi4py import MPI

        comm = comm or MPI.COMM_WORLD
        # One write: mpiexec may stop forwarding this rank's output once
        # Abort begins, so a header written apart could arrive alone. The
        # pause lets the launcher drain the pipe before Abort kills the job
        # (without it the message was lost once in a loaded CI run).
        sys.stderr.write(f"[rank {comm.Get_rank()}] aborting the job:\n{traceback.format_exc()}")
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        comm.Abort(1)
