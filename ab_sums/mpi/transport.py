"""Transports: how rows travel between ranks.

One interface, :meth:`Transport.alltoallv` (rows in, rows out, bytes
counted); the classes differ only in ``_alltoallv``, which moves the bytes:

- :class:`HostTransport` (the default): mpi4py on host buffers. NumPy
  arrays go as they are; CuPy arrays are staged through pinned host memory
  after the current stream is synchronised, and copied back to the device.
  Works with any MPI, and with several ranks sharing one GPU.
- :class:`CudaAwareTransport`: mpi4py on the device buffers themselves
  (after a stream sync, since MPI does not know CuPy's stream). Chosen only
  when every rank's MPI reports CUDA support (``MPIX_Query_cuda_support``).
- :class:`NcclTransport`: grouped NCCL send/recv through
  ``cupy.cuda.nccl`` on the current stream, the communicator bootstrapped
  by an mpi4py broadcast of the NCCL id. Chosen only when NCCL imports on
  every rank and every rank drives a distinct GPU.

Counters: ``bytes_sent`` and ``bytes_received`` count the payload rows a
rank sends to and receives from other ranks (its rows to itself are copied
locally and not counted; the small count exchanges are not payload).
"""
from __future__ import annotations

import ctypes
import math
import os
from typing import Any, Sequence

import numpy as np

from .._backend import array_module, cupy_module

TRANSPORT_ENV = "HYSCALE_MPI_TRANSPORT"


def _ints(values: Sequence[int], size: int, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.shape[0] != size or (arr < 0).any():
        raise ValueError(f"{name} must hold {size} non-negative counts, got {arr.tolist()}")
    return arr


def _starts(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _bytes(x: Any) -> Any:
    """The C-contiguous array ``x`` as a flat uint8 view."""
    return x.reshape(-1).view(np.uint8)


def as_bits(x: Any) -> Any:
    """``x`` viewed as unsigned integers of its item size (1, 2, 4 or 8 bytes; other
    sizes as they are): moving rows by their bits needs no support for the dtype
    from the array module (bfloat16 on CuPy)."""
    size = x.dtype.itemsize
    return x.view(np.dtype(f"u{size}")) if size in (1, 2, 4, 8) else x


class Transport:
    """Moves rows between the ranks of ``comm`` (a collective interface:
    every rank calls the same methods in the same order)."""

    name = "abstract"

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.bytes_sent = self.bytes_received = self.calls = 0
        self._row_types: dict[int, Any] = {}

    def alltoallv(self, send: Any, send_counts: Sequence[int], recv_counts: Sequence[int],
                  send_displs: Sequence[int] | None = None) -> Any:
        """Rows of ``send`` [S, ...] to every rank; returns the rows received.

        send_counts[p] rows starting at send_displs[p] (default: the prefix
        sums of send_counts; blocks may overlap, so one block can go to every
        rank) go to rank p; recv_counts[p] rows come from rank p and land in
        rank order. Returns an array [sum(recv_counts), ...] of send's dtype
        and array type. Counts must match across ranks (what p sends to q is
        what q expects from p), and send_counts[rank] == recv_counts[rank].
        """
        xp = array_module(send)
        dtype = send.dtype
        send = xp.ascontiguousarray(as_bits(send))
        sc = _ints(send_counts, self.size, "send_counts")
        rc = _ints(recv_counts, self.size, "recv_counts")
        sd = _starts(sc) if send_displs is None else _ints(send_displs, self.size, "send_displs")
        if send.ndim < 1 or (sd + sc > send.shape[0]).any():
            raise ValueError(f"send has {send.shape[0] if send.ndim else 0} rows, fewer than send_displs + "
                             f"send_counts = {(sd + sc).tolist()} asks for")
        if sc[self.rank] != rc[self.rank]:
            raise ValueError(f"rank {self.rank} sends itself {sc[self.rank]} rows but expects {rc[self.rank]}")
        row_shape = tuple(send.shape[1:])
        row_bytes = send.dtype.itemsize * math.prod(row_shape)
        recv = xp.empty((int(rc.sum()),) + row_shape, dtype=send.dtype)
        others = np.arange(self.size) != self.rank
        self.bytes_sent += int(sc[others].sum()) * row_bytes
        self.bytes_received += int(rc[others].sum()) * row_bytes
        self.calls += 1
        if row_bytes:
            self._alltoallv(send, sc, sd, recv, rc, _starts(rc), row_bytes)
        return recv.view(dtype)

    def exchange_counts(self, counts: Sequence[int]) -> np.ndarray:
        """int64 [P]: counts[p] is what this rank sends rank p; returns what each rank sends this one."""
        return np.array(self.comm.alltoall([int(c) for c in counts]), dtype=np.int64)

    def close(self) -> None:
        """Free the MPI datatypes this transport made."""
        for row_type in self._row_types.values():
            row_type.Free()
        self._row_types.clear()

    def _row_type(self, row_bytes: int) -> Any:
        """An MPI datatype of one row (counts go in rows: no 2**31-byte limit per message)."""
        if row_bytes not in self._row_types:
            from mpi4py import MPI

            self._row_types[row_bytes] = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        return self._row_types[row_bytes]

    def _mpi_alltoallv(self, send_buf: Any, sc, sd, recv_buf: Any, rc, rd, row_bytes: int) -> None:
        row = self._row_type(row_bytes)
        self.comm.Alltoallv([send_buf, (sc.tolist(), sd.tolist()), row],
                            [recv_buf, (rc.tolist(), rd.tolist()), row])

    def _alltoallv(self, send: Any, sc, sd, recv: Any, rc, rd, row_bytes: int) -> None:
        """Move the bytes: rows sd[p] .. sd[p]+sc[p] of send to rank p, rows from
        rank p into recv at rd[p] (counts and displacements in rows)."""
        raise NotImplementedError


class HostTransport(Transport):
    """mpi4py on host memory; CuPy rows staged through reused pinned buffers."""

    name = "host"

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self._pinned: dict[str, np.ndarray] = {}

    def _host(self, which: str, nbytes: int) -> np.ndarray:
        buf = self._pinned.get(which)
        if buf is None or buf.size < nbytes:
            import cupyx

            buf = self._pinned[which] = cupyx.empty_pinned((max(nbytes, 1),), dtype=np.uint8)
        return buf[:nbytes]

    def _alltoallv(self, send, sc, sd, recv, rc, rd, row_bytes):
        if isinstance(send, np.ndarray):
            self._mpi_alltoallv(_bytes(send), sc, sd, _bytes(recv), rc, rd, row_bytes)
            return
        stream = cupy_module().cuda.get_current_stream()
        stream.synchronize()  # every kernel writing send has finished
        host_send, host_recv = self._host("send", send.nbytes), self._host("recv", recv.nbytes)
        _bytes(send).get(out=host_send)
        self._mpi_alltoallv(host_send, sc, sd, host_recv, rc, rd, row_bytes)
        _bytes(recv).set(host_recv)
        stream.synchronize()  # the copy has left the pinned buffer before it is reused


class CudaAwareTransport(Transport):
    """mpi4py on CuPy device buffers (the MPI library reads and writes GPU memory)."""

    name = "cuda-aware"

    def _alltoallv(self, send, sc, sd, recv, rc, rd, row_bytes):
        cupy_module().cuda.get_current_stream().synchronize()  # MPI does not order itself after CuPy's stream
        self._mpi_alltoallv(_bytes(send), sc, sd, _bytes(recv), rc, rd, row_bytes)


class NcclTransport(Transport):
    """Grouped NCCL send/recv on the current CuPy stream (one GPU per rank)."""

    name = "nccl"

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        from cupy.cuda import nccl

        uid = comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)

    def _alltoallv(self, send, sc, sd, recv, rc, rd, row_bytes):
        from cupy.cuda import nccl

        stream = cupy_module().cuda.get_current_stream()
        sb, rb, me = _bytes(send), _bytes(recv), self.rank
        rb[rd[me] * row_bytes:(rd[me] + rc[me]) * row_bytes] = sb[sd[me] * row_bytes:(sd[me] + sc[me]) * row_bytes]
        nccl.groupStart()
        for peer in range(self.size):
            if peer != me and sc[peer]:
                self._nccl.send(sb.data.ptr + int(sd[peer]) * row_bytes, int(sc[peer]) * row_bytes,
                                nccl.NCCL_UINT8, peer, stream.ptr)
            if peer != me and rc[peer]:
                self._nccl.recv(rb.data.ptr + int(rd[peer]) * row_bytes, int(rc[peer]) * row_bytes,
                                nccl.NCCL_UINT8, peer, stream.ptr)
        nccl.groupEnd()

    def close(self) -> None:
        super().close()
        self._nccl.destroy()


def mpi_reports_cuda_support() -> bool:
    """Whether this process's MPI library says it handles CUDA buffers
    (``MPIX_Query_cuda_support``, offered by Open MPI and MPICH; False where absent)."""
    from mpi4py import MPI

    query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
    if query is None:
        return False
    query.restype = ctypes.c_int
    return bool(query())


def _nccl_here() -> tuple[bool, tuple[str, str]]:
    """(NCCL imports, this rank's GPU identity: host name and PCI bus id)."""
    from mpi4py import MPI

    try:
        from cupy.cuda import nccl

        ok = bool(nccl.available)
    except ImportError:
        ok = False
    return ok, (MPI.Get_processor_name(), cupy_module().cuda.Device().pci_bus_id)


def usable_transports(comm: Any) -> dict[str, bool]:
    """Which GPU transports every rank of ``comm`` can use (a collective call)."""
    nccl_ok, gpu = _nccl_here()
    everyone = comm.allgather((nccl_ok, gpu, mpi_reports_cuda_support()))
    return {
        "nccl": all(e[0] for e in everyone) and len({e[1] for e in everyone}) == comm.Get_size(),
        "cuda-aware": all(e[2] for e in everyone),
    }


TRANSPORTS = {"host": HostTransport, "cuda-aware": CudaAwareTransport, "nccl": NcclTransport}


def select_transport(comm: Any, xp: Any = np, kind: str | None = None) -> Transport:
    """The transport for arrays of module ``xp`` (a collective call).

    kind: "auto" (default; $HYSCALE_MPI_TRANSPORT overrides), "host",
    "cuda-aware" or "nccl". Auto picks, for CuPy arrays, NCCL when usable,
    then CUDA-aware MPI when usable, else host staging; for NumPy arrays
    always the host transport. Asking for a transport that is not usable
    raises RuntimeError on every rank.
    """
    kind = kind or os.environ.get(TRANSPORT_ENV) or "auto"
    if kind not in ("auto", *TRANSPORTS):
        raise ValueError(f"transport must be 'auto' or one of {sorted(TRANSPORTS)}, got {kind!r}")
    if kind == "host":
        return HostTransport(comm)
    if xp is np:
        if kind != "auto":
            raise ValueError(f"transport {kind!r} moves CuPy arrays; these arrays are NumPy arrays")
        return HostTransport(comm)
    usable = usable_transports(comm)
    for name in (["nccl", "cuda-aware"] if kind == "auto" else [kind]):
        if usable[name]:
            return TRANSPORTS[name](comm)
    if kind != "auto":
        raise RuntimeError(f"transport {kind!r} is not usable on every rank here "
                           "(nccl: NCCL on every rank and one distinct GPU per rank; "
                           "cuda-aware: MPIX_Query_cuda_support() true on every rank)")
    return HostTransport(comm)
