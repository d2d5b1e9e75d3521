"""Transport argument checks and choice (no MPI: a stand-in communicator;
the transports move data in tests/test_mpi_sharded.py)."""
from __future__ import annotations

import numpy as np
import pytest

from hyscale_core.mpi.transport import HostTransport, select_transport


class TwoRanks:
    """Rank 0 of 2; any call that would communicate fails the test."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def __getattr__(self, name):
        raise AssertionError(f"communicated ({name}) before checking its arguments")


def test_alltoallv_checks_counts_before_communicating():
    t = HostTransport(TwoRanks())
    rows = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="rank 0 sends itself 1 rows but expects 2"):
        t.alltoallv(rows, [1, 1], [2, 1])
    with pytest.raises(ValueError, match="send has 3 rows, fewer than"):
        t.alltoallv(rows, [2, 2], [2, 0])
    with pytest.raises(ValueError, match="send_counts must hold 2 non-negative counts"):
        t.alltoallv(rows, [1, -1], [1, 0])
    assert t.bytes_sent == t.bytes_received == t.calls == 0


def test_numpy_arrays_take_the_host_transport(monkeypatch):
    monkeypatch.delenv("HYSCALE_MPI_TRANSPORT", raising=False)
    assert isinstance(select_transport(TwoRanks(), np), HostTransport)
    with pytest.raises(ValueError, match="moves CuPy arrays"):
        select_transport(TwoRanks(), np, "nccl")
    with pytest.raises(ValueError, match="transport must be 'auto' or one of"):
        select_transport(TwoRanks(), np, "carrier-pigeon")
    monkeypatch.setenv("HYSCALE_MPI_TRANSPORT", "cuda-aware")
    with pytest.raises(ValueError, match="'cuda-aware' moves CuPy arrays"):
        select_transport(TwoRanks(), np)
