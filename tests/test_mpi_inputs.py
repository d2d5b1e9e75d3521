"""Bad arguments to make_shard and ShardedRunner raise on every rank, so no
rank is left waiting in a collective. No MPI: the ranks are threads sharing
an allgather, the one collective these calls make before they raise."""
from __future__ import annotations

import pickle
import re
import threading
from typing import Any, Callable

import numpy as np
import pytest

from hyscale_core.mpi import make_shard, zigzag_layout


def on_ranks(*calls: Callable[[Any], Any]) -> list[Any]:
    """calls[r](comm) on rank r of len(calls) thread ranks; each rank's result
    or exception. A rank left waiting in allgather gets BrokenBarrierError."""
    size = len(calls)
    barrier, slots, results = threading.Barrier(size, timeout=10), [b""] * size, [None] * size

    class Comm:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def Get_rank(self) -> int:
            return self.rank

        def Get_size(self) -> int:
            return size

        def allgather(self, value: Any) -> list[Any]:
            slots[self.rank] = pickle.dumps(value)  # as mpi4py sends Python objects
            barrier.wait()
            everyone = [pickle.loads(s) for s in slots]
            barrier.wait()
            return everyone

    def run(rank: int) -> None:
        try:
            results[rank] = calls[rank](Comm(rank))
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def assert_every_rank_raises(results: list[Any], error: type, message: str) -> None:
    for rank, got in enumerate(results):
        assert isinstance(got, error) and re.search(message, str(got)), f"rank {rank}: {got!r}"


def test_make_shard_rejects_float_cu_seqlens_as_the_indexer_does():
    shard = lambda comm: make_shard(comm, 7, cu_seqlens=[0, 3.9, 7], align=1)  # noqa: E731
    assert_every_rank_raises(on_ranks(shard, shard), TypeError, "cu_seqlens must hold integers, got dtype float64")


@pytest.mark.parametrize("bad, error, message", [
    ({"cu_seqlens": [0, 3.9, 7]}, TypeError, r"cu_seqlens must hold integers, got dtype float64 \(on rank 1\)"),
    ({"n": 7.5}, TypeError, r"n must be an integer, got 7\.5 \(on rank 1\)"),
    ({"n": -1}, ValueError, "n must be >= 0, got -1"),
    ({"align": 2.0}, TypeError, r"align must be an integer, got 2\.0"),
    ({"align": True}, TypeError, "align must be an integer, got True"),
    ({"align": 0}, ValueError, "align must be >= 1, got 0"),
    ({"cu_seqlens": [0, 5]}, ValueError, r"cu_seqlens must run non-decreasing from 0 to n=7, got \[0, 5\]"),
])
def test_make_shard_raises_on_every_rank_when_one_rank_is_bad(bad, error, message):
    good = {"n": 7, "cu_seqlens": [0, 3, 7], "align": 1}
    args = {**good, **bad}
    results = on_ranks(lambda comm: make_shard(comm, **good), lambda comm: make_shard(comm, **args))
    assert_every_rank_raises(results, error, message)


def test_make_shard_takes_integer_arguments():
    shard = lambda comm: make_shard(comm, np.int64(7), cu_seqlens=np.array([0, 3, 7], np.int32),  # noqa: E731
                                    align=np.int64(1))
    expect = zigzag_layout(7, 2, [0, 3, 7])
    for rank, got in enumerate(on_ranks(shard, shard)):
        assert got.n == 7 and got.cu_seqlens.dtype == np.int64
        np.testing.assert_array_equal(got.cu_seqlens, [0, 3, 7])
        np.testing.assert_array_equal(got.positions, expect.positions[rank])


@pytest.mark.parametrize("rows, targets", [([], []), ([2, 6], [])])
def test_runner_rejects_empty_targets_on_every_rank(rows, targets):
    from hyscale_core.engine.model import DSAConfig, TinyDSA
    from hyscale_core.mpi.engine import ShardedRunner

    cfg = DSAConfig(vocab=16, d_model=16, n_layers=1, heads=2, d_v=8, rope_dim=4, d_ff=16, index_heads=2,
                    index_dim=8, topk=4)
    rows, targets = np.array(rows, np.int64), np.array(targets, np.int64)
    step = lambda comm: ShardedRunner(TinyDSA(cfg), comm).run(np.arange(7), rows, targets, cfg.topk,  # noqa: E731
                                                               train=True)
    assert_every_rank_raises(on_ranks(step, step), ValueError,
                             r"targets and rows must hold at least one prediction, got targets of shape \(0,\)")
