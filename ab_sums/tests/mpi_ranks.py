"""Rank program of the MPI tests (launched by tests/helpers.py run_ranks).

    mpiexec -n P python tests/mpi_ranks.py OUT.npz GROUP...

runs the sharded operations of each GROUP ("indexer", "attention",
"engine", "runner": ShardedRunner training steps on packed batches,
"transport", "gpu": indexer and attention on CuPy arrays through host
staging, or "error": rank 1 passes a kv with one row too many) on data
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


def indexer_data(n: int, heads: int = 4, dim: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q float32 [n, heads, dim], k float32 [n, dim], w float32 [n, heads]."""
    rng = np.random.default_rng(n)
    return (rng.standard_normal((n, heads, dim)).astype(np.float32),
            rng.standard_normal((n, dim)).astype(np.float32), rng.standard_normal((n, heads)).astype(np.float32))


# The GPU group: shapes the fused GPU indexer kernel takes (H >= 8, D a multiple of 64).
GPU_N, GPU_HEADS, GPU_DIM = 301, 8, 64


def transport_rows(src: int, dst: int, count: int) -> np.ndarray:
    """bfloat16 [count, 2, 3] rows rank src sends rank dst (small integers: exact in bfloat16)."""
    from hyscale_core._dtypes import bfloat16

    return (src * 100 + dst * 10 + np.arange(count * 6).reshape(count, 2, 3)).astype(bfloat16)


def attention_data(n: int) -> dict[str, np.ndarray]:
    """q [n, h, d_qk], kv [n, d_qk], dout [n, h, d_v] float32; causal int32 indices [n, k] with -1 padding."""
    rng = np.random.default_rng(1000 + n)
    return {"q": rng.standard_normal((n, HEADS, D_QK)).astype(np.float32),
            "kv": rng.standard_normal((n, D_QK)).astype(np.float32),
            "dout": rng.standard_normal((n, HEADS, D_V)).astype(np.float32),
            "indices": causal_selection(rng, n, ATTENTION_K)}


def engine_config(attention_dtype: str = "float32"):
    from hyscale_core.engine.model import DSAConfig

    return DSAConfig(vocab=32, d_model=32, n_layers=2, heads=2, d_v=16, rope_dim=8, d_ff=64, index_heads=2,
                     index_dim=8, topk=8, attention_dtype=attention_dtype)


def engine_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [N], prediction rows [M] (spread over every rank), targets [M]."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, engine_config().vocab, ENGINE_N)
    rows = np.sort(rng.choice(ENGINE_N, ENGINE_TARGETS, replace=False))
    return ids, rows, rng.integers(0, engine_config().vocab, ENGINE_TARGETS)


# (sequence length, sequences) of the ShardedRunner steps: 16-token sequences take the
# balanced layout's whole-row cut (at P = 3 one rank holds none), 150-token ones its
# per-sequence cut; 300 tokens are not a multiple of the 64-token alignment.
RUNNER_BATCHES = [(16, 16), (100, 3), (150, 2)]
RUNNER_TOPK = 8


def runner_batches() -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per step: ids [N], rows [M] (the last two tokens of every sequence), targets [M], cu_seqlens [B+1]."""
    rng = np.random.default_rng(11)
    vocab, out = engine_config().vocab, []
    for length, count in RUNNER_BATCHES:
        cu = np.arange(count + 1) * length
        rows = np.sort(np.concatenate([cu[1:] - 2, cu[1:] - 1]))
        out.append((rng.integers(0, vocab, cu[-1]), rows, rng.integers(0, vocab, rows.size), cu))
    return out


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


# (recompute, kl_on_loss_rows, attention_dtype) of the "engine" group's training steps.
ENGINE_VARIANTS = [(False, False, "float32"), (True, False, "float32"), (False, True, "float32"),
                   (True, True, "float32"), (False, False, "bfloat16"), (True, True, "bfloat16")]


def engine_key(recompute: bool, kl_on_loss_rows: bool, attention_dtype: str) -> str:
    return f"engine/recompute={recompute}/kl_on_loss_rows={kl_on_loss_rows}/{attention_dtype}"


def run_engine(comm: Any, res: Results) -> None:
    from hyscale_core.engine.model import TinyDSA
    from hyscale_core.engine.optim import AdamW
    from hyscale_core.mpi import make_shard
    from hyscale_core.mpi.engine import ShardedSelection, ShardedTinyDSA, shard_batch, train_step

    shard = make_shard(comm, ENGINE_N)
    for recompute, kl_rows, attention_dtype in ENGINE_VARIANTS:
        cfg = engine_config(attention_dtype)
        model = TinyDSA(cfg, seed=1)
        sharded = ShardedTinyDSA(model, shard)
        selector = ShardedSelection(shard, cfg.topk)
        total, kls = train_step(sharded, AdamW(model.parameters()), shard_batch(shard, *engine_batch()), selector,
                                recompute=recompute, kl_on_loss_rows=kl_rows)
        key = engine_key(recompute, kl_rows, attention_dtype)
        res.same(f"{key}/total", [total] + kls)
        for layer in selector.store.layers():
            res.rows(f"{key}/selection/{layer}", shard, selector.store.selection(layer))
        for p in model.parameters():
            res.same(f"{key}/param/{p.name}", p.data)


def run_runner(comm: Any, res: Results) -> None:
    """ShardedRunner training steps (recompute on even steps) and AdamW, as the example runs them."""
    from hyscale_core.engine.model import TinyDSA
    from hyscale_core.engine.optim import AdamW
    from hyscale_core.mpi.engine import ShardedRunner

    model = TinyDSA(engine_config(), seed=1)
    runner, opt = ShardedRunner(model, comm), AdamW(model.parameters())
    for step, (ids, rows, targets, cu) in enumerate(runner_batches()):
        out, selections = runner.run(ids, rows, targets, RUNNER_TOPK, cu, train=True, recompute=step % 2 == 0,
                                     kl_on_loss_rows=True)
        opt.step()
        res.same(f"runner/{step}/total", [out.total] + out.kls)
        res.same(f"runner/{step}/logits", out.logits)
        for layer in selections.layers():
            res.same(f"runner/{step}/selection/{layer}", selections.selection(layer))
        res.same(f"runner/{step}/params", np.concatenate([p.data.reshape(-1) for p in model.parameters()]))
    runner.close()


def run_transport(comm: Any, res: Results) -> None:
    """Irregular counts (rank r sends rank p (r + p) % 3 rows) of bfloat16 rows."""
    from hyscale_core.mpi.transport import HostTransport

    t = HostTransport(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = [(rank + p) % 3 for p in range(size)]
    send = np.concatenate([transport_rows(rank, p, counts[p]) for p in range(size)])
    recv = t.alltoallv(send, counts, t.exchange_counts(counts))
    for r, (got, moved) in enumerate(comm.gather((recv.view(np.uint16), (t.bytes_sent, t.bytes_received)), root=0)
                                     or []):
        res.arrays[f"transport/recv/{r}"], res.arrays[f"transport/bytes/{r}"] = got, np.array(moved)
    t.close()


def run_gpu(comm: Any, res: Results) -> None:
    """Indexer and attention (both exchanges) on CuPy arrays, ranks sharing the GPUs, host staging."""
    import cupy as cp

    from hyscale_core.mpi import (make_shard, sharded_indexer_topk, sharded_sparse_attention,
                                  sharded_sparse_attention_backward, use_local_gpu)

    use_local_gpu(comm)
    shard = make_shard(comm, GPU_N, xp=cp, transport="host")
    p = cp.asarray(shard.positions)
    q, k, w = (cp.asarray(a)[p] for a in indexer_data(GPU_N, GPU_HEADS, GPU_DIM))
    res.rows("gpu/indices", shard, sharded_indexer_topk(shard, q, k, w, INDEXER_TOPK).get())
    data = {key: cp.asarray(value)[p] for key, value in attention_data(GPU_N).items()}
    for exchange in EXCHANGES:
        out, lse = sharded_sparse_attention(shard, data["q"], data["kv"], data["indices"], d_v=D_V, exchange=exchange)
        dq, dkv = sharded_sparse_attention_backward(shard, data["q"], data["kv"], data["indices"], out, lse,
                                                    data["dout"], d_v=D_V, exchange=exchange)
        for label, value in (("out", out), ("lse", lse), ("dq", dq), ("dkv", dkv)):
            res.rows(f"gpu/{exchange}/{label}", shard, value.get())
    shard.close()


def run_error(comm: Any, res: Results) -> None:
    from hyscale_core.mpi import make_shard, sharded_sparse_attention

    data = attention_data(9)
    shard = make_shard(comm, 9, align=1)
    kv = data["kv"][shard.positions]
    if comm.Get_rank() == 1:
        kv = np.concatenate([kv, kv[:1]])
    sharded_sparse_attention(shard, data["q"][shard.positions], kv, data["indices"][shard.positions], d_v=D_V)


GROUPS = {"indexer": run_indexer, "attention": run_attention, "engine": run_engine, "runner": run_runner,
          "transport": run_transport, "gpu": run_gpu, "error": run_error}


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
