"""Rank program of the MPI tests (tests/test_mpi_sharded.py).

    mpiexec -n P python tests/mpi_ranks.py OUT.npz GROUP...

runs the sharded operations of each GROUP ("indexer", "attention",
"engine", or "error": rank 1 passes a kv with one row too many) on data
from the ``*_data`` functions below, which the tests also use for the
single-process results. Rank 0 writes every result, gathered into global
row order, to OUT.npz. Any exception aborts the whole job.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from helpers import causal_selection

# (name, n, layout, cu_seqlens): indexer shards with the default 64-aligned layouts.
INDEXER_CASES = [
    ("zigzag-7", 7, "zigzag", None),
    ("zigzag-9", 9, "zigzag", None),
    ("zigzag-301", 301, "zigzag", None),
    ("contiguous-301", 301, "contiguous", None),
    ("packed-1000", 1000, "zigzag", [0, 7, 307, 700, 1000]),
]
INDEXER_TOPK = 50

# (name, n, layout): attention shards, unaligned (align=1): every query row is independent.
ATTENTION_CASES = [("zigzag-7", 7, "zigzag"), ("zigzag-9", 9, "zigzag"), ("zigzag-301", 301, "zigzag"),
                   ("contiguous-301", 301, "contiguous")]
ATTENTION_K, HEADS, D_QK, D_V = 16, 2, 24, 16
EXCHANGES = ("allgather", "fetch")

ENGINE_N, ENGINE_TARGETS = 301, 40


def indexer_data(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q float32 [n, 4, 16], k float32 [n, 16], w float32 [n, 4]."""
    rng = np.random.default_rng(n)
    return (rng.standard_normal((n, 4, 16)).astype(np.float32), rng.standard_normal((n, 16)).astype(np.float32),
            rng.standard_normal((n, 4)).astype(np.float32))


def attention_data(n: int) -> dict[str, np.ndarray]:
    """q [n, h, d_qk], kv [n, d_qk], dout [n, h, d_v] float32; causal int32 indices [n, k] with -1 padding."""
    rng = np.random.default_rng(1000 + n)
    return {"q": rng.standard_normal((n, HEADS, D_QK)).astype(np.float32),
            "kv": rng.standard_normal((n, D_QK)).astype(np.float32),
            "dout": rng.standard_normal((n, HEADS, D_V)).astype(np.float32),
            "indices": causal_selection(rng, n, ATTENTION_K)}


def engine_config():
    from hyscale_core.engine.model import DSAConfig

    return DSAConfig(vocab=32, d_model=32, n_layers=2, heads=2, d_v=16, rope_dim=8, d_ff=64, index_heads=2,
                     index_dim=8, topk=8)


def engine_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [N], prediction rows [M] (spread over every rank), targets [M]."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, engine_config().vocab, ENGINE_N)
    rows = np.sort(rng.choice(ENGINE_N, ENGINE_TARGETS, replace=False))
    return ids, rows, rng.integers(0, engine_config().vocab, ENGINE_TARGETS)


class Results:
    """Collects arrays on rank 0 in global row order."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.arrays = comm, {}

    def rows(self, key: str, shard: Any, local: np.ndarray) -> None:
        parts = self.comm.gather((shard.positions, np.asarray(local)), root=0)
        if self.comm.Get_rank() == 0:
            out = np.empty((shard.n,) + parts[0][1].shape[1:], dtype=parts[0][1].dtype)
            for positions, block in parts:
                out[positions] = block
            self.arrays[key] = out

    def same(self, key: str, value: Any) -> None:
        """A value every rank holds; rank 0 keeps all of them, [P, ...]."""
        everyone = self.comm.gather(np.asarray(value), root=0)
        if self.comm.Get_rank() == 0:
            self.arrays[key] = np.stack(everyone)


def run_indexer(comm: Any, res: Results) -> None:
    from hyscale_core.mpi import make_shard, sharded_indexer_topk

    for name, n, layout, cu in INDEXER_CASES:
        q, k, w = indexer_data(n)
        shard = make_shard(comm, n, layout=layout, cu_seqlens=cu)
        p = shard.positions
        indices, scores = sharded_indexer_topk(shard, q[p], k[p], w[p], INDEXER_TOPK, return_scores=True)
        res.rows(f"indexer/{name}/indices", shard, indices)
        res.rows(f"indexer/{name}/scores", shard, scores)
        res.same(f"indexer/{name}/bytes", [shard.transport.bytes_sent, shard.transport.bytes_received])


def run_attention(comm: Any, res: Results) -> None:
    from hyscale_core.mpi import make_shard, sharded_sparse_attention, sharded_sparse_attention_backward
    from hyscale_core.mpi.exchange import Fetch

    for name, n, layout in ATTENTION_CASES:
        data = attention_data(n)
        shard = make_shard(comm, n, layout=layout, align=1)
        q, kv, idx, dout = (data[key][shard.positions] for key in ("q", "kv", "indices", "dout"))
        for exchange in EXCHANGES:
            key, t = f"attention/{name}/{exchange}", shard.transport
            before = (t.bytes_sent, t.bytes_received)
            out, lse, probs = sharded_sparse_attention(shard, q, kv, idx, d_v=D_V, return_probs=True,
                                                       exchange=exchange)
            middle = (t.bytes_sent, t.bytes_received)
            dq, dkv = sharded_sparse_attention_backward(shard, q, kv, idx, out, lse, dout, d_v=D_V,
                                                        exchange=exchange)
            res.same(f"{key}/forward_bytes", np.subtract(middle, before))
            res.same(f"{key}/step_bytes", np.subtract((t.bytes_sent, t.bytes_received), before))
            for label, value in (("out", out), ("lse", lse), ("probs", probs), ("dq", dq), ("dkv", dkv)):
                res.rows(f"{key}/{label}", shard, value)
        res.same(f"attention/{name}/fetched", Fetch(shard, idx).want)


def run_engine(comm: Any, res: Results) -> None:
    from hyscale_core.engine.optim import AdamW
    from hyscale_core.engine.model import TinyDSA
    from hyscale_core.mpi import make_shard
    from hyscale_core.mpi.engine import ShardedSelection, ShardedTinyDSA, shard_batch, train_step

    cfg = engine_config()
    shard = make_shard(comm, ENGINE_N)
    for recompute in (False, True):
        model = TinyDSA(cfg, seed=1)
        sharded = ShardedTinyDSA(model, shard)
        selector = ShardedSelection(shard, cfg.topk)
        total, kls = train_step(sharded, AdamW(model.parameters()), shard_batch(shard, *engine_batch()), selector,
                                recompute=recompute)
        key = f"engine/recompute={recompute}"
        res.same(f"{key}/total", [total] + kls)
        for layer in selector.store.layers():
            res.rows(f"{key}/selection/{layer}", shard, selector.store.selection(layer))
        for p in model.parameters():
            res.same(f"{key}/param/{p.name}", p.data)


def run_error(comm: Any, res: Results) -> None:
    from hyscale_core.mpi import make_shard, sharded_sparse_attention

    data = attention_data(9)
    shard = make_shard(comm, 9, align=1)
    kv = data["kv"][shard.positions]
    if comm.Get_rank() == 1:
        kv = np.concatenate([kv, kv[:1]])
    sharded_sparse_attention(shard, data["q"][shard.positions], kv, data["indices"][shard.positions], d_v=D_V)


GROUPS = {"indexer": run_indexer, "attention": run_attention, "engine": run_engine, "error": run_error}


def main(argv: list[str]) -> None:
    from mpi4py import MPI

    from hyscale_core.mpi import abort_on_error

    comm = MPI.COMM_WORLD
    with abort_on_error(comm):
        res = Results(comm)
        for group in argv[1:]:
            GROUPS[group](comm, res)
        if comm.Get_rank() == 0:
            np.savez(argv[0], **res.arrays)


if __name__ == "__main__":
    main(sys.argv[1:])
