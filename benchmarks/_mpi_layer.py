"""One DSA layer over MPI ranks, for benchmarks/mpi_scaling.py (not a benchmark itself).

Each rank holds its zigzag shard (64-token aligned) of a sequence of N
tokens and runs, timed per phase by ``hyscale_core.mpi.phases.PhaseLog``
(barrier first, slowest rank reported):

    keys      all-gather of the indexer keys [N, d_I]
    select    hs.indexer_topk of the rank's queries over every key
    kv        the kv rows the selections read (auto: all-gather or fetch
              by the cost model; all-gather when the queries run in chunks)
    attn fwd  hs.sparse_attention            attn bwd  hs.sparse_attention_backward
    dkv       the kv gradient rows back to their owners, summed in rank order

With ``chunk`` the rank's queries go through select / attention in chunks
(the same number on every rank, so the collectives match); the kv table is
gathered once and the chunks' dkv rows are summed in float32 before the
return to the owners. Inputs are a hash of (global position, column, name):
the same values for a token whatever P, the layout or the chunking.
"""
from __future__ import annotations

import argparse
import math
import resource
from typing import Any

import numpy as np

import hyscale_core as hs
from hyscale_core._backend import cupy_module, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.engine.ops import cast
from hyscale_core.mpi import make_shard, use_local_gpu
from hyscale_core.mpi.costmodel import allgather_bytes
from hyscale_core.mpi.exchange import AllGather, modelled_bytes, plan_rows
from hyscale_core.mpi.phases import PhaseLog
from hyscale_core.mpi.transport import select_transport

from .common import cpu_device, gpu_device

# The check's bound on max |sharded - one device| / max |one device| (the selection must be
# bitwise): out, lse, dq: per-query work in another batch may round differently (1e-5 in
# float32, as tests/test_mpi_sharded.py's GPU test; one ulp at the top binade in bfloat16);
# dkv: each of P rank partial sums is rounded to the input dtype before the owner adds
# them and rounds once more, (P + 1) half-ulps (tests/test_mpi_sharded.py's float32 rule).
ULP = {"float32": 2e-7, "bfloat16": 2.0**-8}


def check_tol(dtype: str, ranks: int, name: str) -> float:
    """The bound for array ``name`` (see ULP)."""
    if name == "dkv":
        return (ranks + 1) * ULP[dtype]
    return 1e-5 if dtype == "float32" else ULP[dtype]


# The layer's shape flags and their defaults: DeepSeek-V3.2's DSA (H_I = 64, d_I = 128,
# k = 2048) and MLA (h = 64, d_qk = 576, d_v = 512).
SHAPE = {"topk": 2048, "index_heads": 64, "index_dim": 128, "heads": 64, "d_qk": 576, "d_v": 512}


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """--topk, --index-heads, --index-dim, --heads, --d-qk, --d-v (ints, SHAPE's defaults)."""
    for name, default in SHAPE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def shape_argv(args: argparse.Namespace) -> list[str]:
    """The shape of ``args`` as the command-line flags :func:`add_shape_args` reads."""
    return [item for name in SHAPE for item in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


GEN_ROWS = 2048  # rows generated per block (bounds the uint64 temporaries)
NAMES = ("ik", "kv", "iq", "iw", "q", "dout")
WORKSPACE = 4 << 30  # the GPU backward's scratch, counted high (sparse_attention/gpu.py rows_budget: 1 GiB of rows, 1.25 GiB of scratch at least, more only from free memory)
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def context(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """This job's array module, input dtype, device facts and transport (collective)."""
    cp = None if args.cpu else cupy_module()
    xp, device_bytes = np, 0
    if cp is not None:
        use_local_gpu(comm)
        xp, device_bytes = cp, cp.cuda.Device().mem_info[1]
    where = (cp.cuda.Device().pci_bus_id if cp is not None else "cpu")
    import socket

    gpus = len(set(comm.allgather((socket.gethostname(), where)))) if cp is not None else 0
    dtype = args.dtype or ("bfloat16" if cp is not None else "float32")
    device = gpu_device() + f"; {cp.cuda.runtime.getDeviceCount()} on the host" if cp is not None else cpu_device()
    return {"xp": xp, "dtype": dtype, "gpus": gpus, "device": device, "device_bytes": device_bytes,
            "transport": select_transport(comm, xp, args.transport)}


def _uniform(xp: Any, positions: Any, width: int, seed: int) -> Any:
    """float32 [len(positions), width], uniform with unit variance: splitmix64 of
    (position * width + column, seed)."""
    z = positions.astype(xp.uint64)[:, None] * np.uint64(width) + xp.arange(width, dtype=xp.uint64)
    z = z + np.uint64((seed + 1) * _GOLDEN % 2**64)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(xp.float32) * np.float32(2 * 3**0.5 / 2**24) - np.float32(3**0.5)


def make(xp: Any, positions: Any, shape: tuple[int, ...], name: str, dtype: str) -> Any:
    """The input ``name`` [len(positions), *shape] at global positions (device int64), in ``dtype``."""
    n, width = int(positions.shape[0]), math.prod(shape)
    target = bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    store = np.uint16 if dtype == "bfloat16" else target
    out = xp.empty((n, width), dtype=store)
    for start in range(0, n, GEN_ROWS):
        block = _uniform(xp, positions[start:start + GEN_ROWS], width, NAMES.index(name))
        out[start:start + GEN_ROWS] = cast(block, target).view(store)
    return out.view(target).reshape((n,) + shape)


def _chunks(shard: Any, chunk: int | None) -> list[slice]:
    """This rank's query rows in as many chunks as the busiest rank needs (every rank the same count)."""
    count = 1 if not chunk else max(1, math.ceil(int(shard.counts.max()) / chunk))
    per = max(1, math.ceil(shard.n_local / count))
    return [slice(min(i * per, shard.n_local), min((i + 1) * per, shard.n_local)) for i in range(count)]


class _KvRows:
    """The kv rows the chunks' selections read (planned and gathered at the first
    chunk: by the cost model for one chunk, all-gathered for several) and their
    gradient (one chunk's as it is, several chunks' summed in float32)."""

    def __init__(self, shard: Any, kv: Any, exchange: str, chunks: int) -> None:
        self.shard, self.kv, self.exchange, self.chunks = shard, kv, exchange, chunks
        self.plan = self.table = self.grad = None

    def remap(self, selection: Any) -> Any:
        """Global selection -> rows of the table (plans and gathers on the first call; collective)."""
        if self.plan is None:
            row_bytes = self.kv.dtype.itemsize * self.kv.shape[1]
            self.plan = (plan_rows(self.shard, selection, row_bytes, self.exchange) if self.chunks == 1
                         else AllGather(self.shard))
            self.table = self.plan.gather(self.kv)
        return self.plan.remap(selection)

    def add_grad(self, dtable: Any) -> None:
        if self.chunks == 1:
            self.grad = dtable
            return
        xp = self.shard.xp
        self.grad = xp.zeros(self.table.shape, dtype=np.float32) if self.grad is None else self.grad
        self.grad += cast(dtable, np.float32)

    def model(self) -> tuple[Any, Any]:
        """Modelled (sent, received) per rank of the gather and of the gradients' return (collective)."""
        kv_row, grad_row = (a.dtype.itemsize * self.kv.shape[1] for a in (self.kv, self.grad))
        return modelled_bytes(self.plan, kv_row)["gather"], modelled_bytes(self.plan, grad_row)["to_owners"]


def layer_step(shard: Any, ctx: dict[str, Any], args: argparse.Namespace, log: PhaseLog, chunk: int | None,
               keep: bool = False) -> dict[str, Any]:
    """The layer on this rank's shard (collective). Returns the exchange used, the
    modelled bytes per phase and, with ``keep``, this rank's selection / out / lse / dq / dkv."""
    xp, dtype = ctx["xp"], ctx["dtype"]
    pos = shard.device("positions")
    ik, kv = make(xp, pos, (args.index_dim,), "ik", dtype), make(xp, pos, (args.d_qk,), "kv", dtype)
    with log.phase("keys"):
        k_all = AllGather(shard, global_order=True).gather(ik)
    chunks = _chunks(shard, chunk)
    rows_of_kv = _KvRows(shard, kv, args.exchange, len(chunks))
    kept: dict[str, list[Any]] = {name: [] for name in ("selection", "out", "lse", "dq")}
    for rows in chunks:
        p = pos[rows]
        iq = make(xp, p, (args.index_heads, args.index_dim), "iq", dtype)
        iw = make(xp, p, (args.index_heads,), "iw", "float32")  # head weights stay float32
        with log.phase("select"):
            selection = hs.indexer_topk(iq, k_all, iw, args.topk, q_pos=shard.positions[rows])
        del iq, iw
        with log.phase("kv"):
            local = rows_of_kv.remap(selection)
        q, dout = make(xp, p, (args.heads, args.d_qk), "q", dtype), make(xp, p, (args.heads, args.d_v), "dout", dtype)
        with log.phase("attn fwd"):
            out, lse = hs.sparse_attention(q, rows_of_kv.table, local, d_v=args.d_v)
        with log.phase("attn bwd"):
            dq, dtable = hs.sparse_attention_backward(q, rows_of_kv.table, local, out, lse, dout, d_v=args.d_v)
        rows_of_kv.add_grad(dtable)
        if keep:
            for name, value in (("selection", selection), ("out", out), ("lse", lse), ("dq", dq)):
                kept[name].append(to_host(value))
        del q, dout, out, lse, dq, dtable, local, selection
    with log.phase("dkv"):
        dkv = rows_of_kv.plan.to_owners(rows_of_kv.grad)
    kv_model, dkv_model = rows_of_kv.model()
    keys_model = allgather_bytes(shard.counts, ik.dtype.itemsize * args.index_dim)
    kept = {**{name: np.concatenate(parts) for name, parts in kept.items()}, "dkv": to_host(dkv)} if keep else {}
    return {"exchange": rows_of_kv.plan.mode, "kept": kept,
            "model": {"keys": keys_model, "kv": kv_model, "dkv": dkv_model}}


def _memory(ctx: dict[str, Any]) -> dict[str, float]:
    """This rank's memory after a run: CuPy pool high-water and device bytes in use (GPU),
    the process's peak resident set (CPU), GiB."""
    if ctx["xp"] is np:
        return {"peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    free, total = ctx["xp"].cuda.Device().mem_info
    return {"peak_gib": round(ctx["xp"].get_default_memory_pool().total_bytes() / 2**30, 3),
            "device_used_gib": round((total - free) / 2**30, 3)}


def layer_run(comm: Any, ctx: dict[str, Any], args: argparse.Namespace, n: int, chunk: int | None,
              keep: bool = False) -> dict[str, Any] | None:
    """Shard n tokens, run the layer, gather phases, bytes, work and memory (collective).
    Rank 0 gets the result (with ``keep``: every kept array in global order); None elsewhere."""
    xp = ctx["xp"]
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()  # the pool's high-water mark is then this run's
    shard = make_shard(comm, n, xp=xp, transport=ctx["transport"])
    log = PhaseLog(shard)
    step = layer_step(shard, ctx, args, log, chunk, keep)
    phases = log.report()
    memory = comm.gather(_memory(ctx), root=0)
    kept = comm.gather((shard.positions, step["kept"]), root=0)
    if phases is None:
        return None
    nbytes, match = {}, True
    for row in phases:
        if row["phase"] in step["model"]:
            sent, received = (np.asarray(v).tolist() for v in step["model"][row["phase"]])
            nbytes[row["phase"]] = {"sent_per_rank": row["sent_per_rank"],
                                    "received_per_rank": row["received_per_rank"],
                                    "model_sent_per_rank": sent, "model_received_per_rank": received}
            match &= sent == row["sent_per_rank"] and received == row["received_per_rank"]
    return {"n": n, "ranks": shard.size, "gpus": ctx["gpus"], "transport": shard.transport.name,
            "exchange": step["exchange"], "query_chunk": chunk, "dtype": ctx["dtype"], "phases": phases,
            "bytes": nbytes, "bytes_match_model": bool(match),
            "work": {"causal_pairs_per_rank": shard.layout.causal_work().tolist(),
                     "queries_per_rank": shard.counts.tolist()},
            "memory": {"peak_gib": max(m["peak_gib"] for m in memory),
                       "per_rank": memory},
            "kept": _in_global_order(n, kept) if keep else None}


def _in_global_order(n: int, parts: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    out = {}
    for name, first in parts[0][1].items():
        whole = np.empty((n,) + first.shape[1:], dtype=first.dtype)
        for positions, arrays in parts:
            whole[positions] = arrays[name]
        out[name] = whole
    return out


def one_device(ctx: dict[str, Any], args: argparse.Namespace, n: int) -> dict[str, np.ndarray]:
    """The same layer on all n tokens in this process (the single-GPU result)."""
    xp, dtype = ctx["xp"], ctx["dtype"]
    pos = xp.arange(n, dtype=xp.int64)
    data = {name: make(xp, pos, shape, name, "float32" if name == "iw" else dtype) for name, shape in (
        ("iq", (args.index_heads, args.index_dim)), ("ik", (args.index_dim,)), ("iw", (args.index_heads,)),
        ("q", (args.heads, args.d_qk)), ("kv", (args.d_qk,)), ("dout", (args.heads, args.d_v)))}
    selection = hs.indexer_topk(data["iq"], data["ik"], data["iw"], args.topk)
    out, lse = hs.sparse_attention(data["q"], data["kv"], selection, d_v=args.d_v)
    dq, dkv = hs.sparse_attention_backward(data["q"], data["kv"], selection, out, lse, data["dout"], d_v=args.d_v)
    return {name: to_host(v) for name, v in zip(("selection", "out", "lse", "dq", "dkv"), (selection, out, lse, dq, dkv))}


def check(comm: Any, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any] | None:
    """The whole layer at ``--check-len`` over the ranks against rank 0 alone (collective;
    the result on rank 0 with ``check``: per array bitwise and max relative difference)."""
    result = layer_run(comm, ctx, args, args.check_len, None, keep=True)
    if result is None:
        return None
    got, ref = result.pop("kept"), one_device(ctx, args, args.check_len)
    report = {}
    for name, r in ref.items():
        g, r = got[name].astype(np.float64), r.astype(np.float64)
        finite = np.isfinite(r)
        scale = max(float(np.abs(r[finite]).max(initial=0.0)), 1e-30)
        report[name] = {"bitwise": got[name].tobytes() == ref[name].tobytes(),
                        "max_rel_diff": float(np.abs(g[finite] - r[finite]).max(initial=0.0)) / scale}
    for name, entry in report.items():
        entry["tolerance"] = 0.0 if name == "selection" else check_tol(ctx["dtype"], comm.Get_size(), name)
    ok = all(v["bitwise"] or v["max_rel_diff"] <= v["tolerance"] for v in report.values())
    return {**result, "check": report, "check_ok": bool(ok)}


def memory_estimate(args: argparse.Namespace, dtype: str, n: int, ranks: int, chunk: int | None,
                    gpu: bool = True) -> int:
    """Bytes per rank the layer holds at once (an estimate, to skip what cannot fit):
    a query chunk's inputs and outputs, the rank's rows, the all-gathered tables and
    (``gpu``) the backward's dkv-rows workspace."""
    b = 2 if dtype == "bfloat16" else 4
    n_local = math.ceil(n / ranks)
    rows = min(chunk or n_local, n_local)
    per_query = (args.index_heads * (args.index_dim * b + 4) + args.heads * (2 * args.d_qk + 2 * args.d_v) * b
                 + args.heads * 4 + 2 * args.topk * 4)  # iq, iw; q, dq, out, dout; lse; selection, remapped
    per_local = (args.index_dim + args.d_qk) * b + args.d_qk * (8 + 4 * ranks)  # ik, kv; dkv sums, rows received
    per_token = args.index_dim * b + args.d_qk * (b + 8)  # keys, kv table; float32 dkv table and backward buffer
    return rows * per_query + n_local * per_local + n * per_token + (WORKSPACE if gpu else 0)
