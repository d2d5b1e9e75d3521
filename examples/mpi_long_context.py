"""Selection and one DSA layer, forward and backward, over P ranks.

    mpiexec -n P python examples/mpi_long_context.py --seq-len N

Each rank holds the tokens of its shard (zigzag by default) and runs

    keys      all-gather the indexer keys (d_I values per token)
    select    hs.indexer_topk of its queries over every key, q_pos = its
              positions (keys + select = sharded_indexer_topk: exact)
    kv        the latent kv rows its selections use: all-gather or fetch,
              chosen by the cost model (hyscale_core/mpi/costmodel.py)
    attn fwd  hs.sparse_attention of its queries over those rows
    attn bwd  hs.sparse_attention_backward
    dkv       the kv gradient rows back to their owners, summed in rank order

then prints the time per phase (slowest rank), the payload bytes each rank
sent and received (the transport's counters, and the cost model's figure)
and the load balance (visible causal pairs and selection time per rank
against the mean). ``--check`` also runs the layer in one process on rank 0
and compares. ``--json PATH`` writes the summary (into an existing folder).
A value the layer cannot run (a size or k below 1, k above MAX_TOPK, d_v >
d_qk, a negative seed, a transport, by option or by $HYSCALE_MPI_TRANSPORT,
that is unknown or moves CuPy arrays in a NumPy run, a --json path that
cannot be written) is a usage error: exit status 2 on every rank before any
work.

Arrays are NumPy (CPU backend) unless CuPy sees a GPU (``--cpu`` forces
NumPy); ranks on one host share its GPUs. Inputs are random, drawn per block
of 1024 tokens from a fixed seed, so they do not depend on P.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

import hyscale_core as hs
from hyscale_core._backend import cupy_module, to_host
from hyscale_core.mpi import abort_on_error, make_shard, use_local_gpu
from hyscale_core.mpi.costmodel import allgather_bytes
from hyscale_core.mpi.exchange import AllGather, modelled_bytes, plan_rows
from hyscale_core.mpi.phases import PhaseLog
from hyscale_core.mpi.transport import TRANSPORT_ENV, TRANSPORTS
from hyscale_core.ops.indexer import MAX_TOPK

GEN_BLOCK = 1024
# (seq_len, topk, index_heads, heads): DSA shapes on the GPU, a small layer on the CPU.
DEFAULTS = {"gpu": (32768, 2048, 64, 64), "cpu": (2048, 256, 16, 8)}


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: the option's text as an int in [low, high] (high None:
    no upper bound); outside it a usage error naming the bound."""
    def convert(text: str) -> int:
        value = int(text)  # ValueError: argparse reports "invalid int value"
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    convert.__name__ = "int"
    return convert


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    positive = bounded_int(1)
    p.add_argument("--seq-len", type=positive, help="tokens N (default 32768 on a GPU, 2048 on the CPU)")
    p.add_argument("--topk", type=bounded_int(1, MAX_TOPK),
                   help="selected keys per query (default 2048 GPU, 256 CPU)")
    p.add_argument("--index-heads", type=positive, help="indexer heads H_I (default 64 GPU, 16 CPU)")
    p.add_argument("--index-dim", type=positive, default=128, help="indexer head dim d_I")
    p.add_argument("--heads", type=positive, help="attention heads h (default 64 GPU, 8 CPU)")
    p.add_argument("--d-qk", type=positive, default=576, help="latent width d_qk")
    p.add_argument("--d-v", type=positive, default=512, help="value width d_v (at most d_qk)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--exchange", default="auto", choices=["auto", "allgather", "fetch"])
    p.add_argument("--transport", default=None, choices=["auto", *TRANSPORTS],
                   help=f"auto (default; ${TRANSPORT_ENV} overrides), host, cuda-aware or nccl")
    p.add_argument("--cpu", action="store_true", help="NumPy arrays even where a GPU exists")
    p.add_argument("--check", action="store_true", help="compare with one process on rank 0")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed first run on 128 tokens per rank (loads and compiles the kernels)")
    p.add_argument("--json", help="write the summary (rank 0) to this path (its folder must exist)")
    p.add_argument("--seed", type=bounded_int(0), default=0)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The options, each value checked against argv alone: a bad one is a usage
    error (exit status 2, no traceback) before MPI starts, the same on every
    rank. Checks that depend on the host wait for :func:`refuse_host_problems`."""
    p = make_parser()
    args = p.parse_args(argv)
    if args.d_v > args.d_qk:
        p.error(f"argument --d-v: must be at most --d-qk ({args.d_qk}), got {args.d_v}")
    args.gpu = not args.cpu and cupy_module() is not None
    for name, value in zip(("seq_len", "topk", "index_heads", "heads"), DEFAULTS["gpu" if args.gpu else "cpu"]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def chosen_transport(args: argparse.Namespace) -> str:
    """--transport, else $HYSCALE_MPI_TRANSPORT, else auto (as make_shard chooses)."""
    return args.transport or os.environ.get(TRANSPORT_ENV) or "auto"


def host_problem(args: argparse.Namespace, rank: int) -> str | None:
    """Why this rank's host cannot run these options, as a usage error message
    (None: it can): a $HYSCALE_MPI_TRANSPORT that names no transport; a GPU
    transport for NumPy arrays (--cpu, or no GPU here); on rank 0, which
    writes it, a --json path that is a folder, lies in no folder, or cannot
    be written."""
    transport = chosen_transport(args)
    source = "argument --transport" if args.transport else f"${TRANSPORT_ENV}"
    if transport not in ("auto", *TRANSPORTS):
        return f"{source}: must be auto or one of {', '.join(TRANSPORTS)}, got {transport!r}"
    if not args.gpu and transport in ("cuda-aware", "nccl"):
        return (f"{source}: {transport} moves CuPy arrays; this run uses NumPy arrays "
                f"({'--cpu' if args.cpu else 'no GPU'}): use host or auto")
    if rank == 0 and args.json is not None:
        return json_path_problem(Path(args.json))
    return None


def json_path_problem(path: Path) -> str | None:
    """Why the summary cannot be written to `path` (None: it can)."""
    if path.is_dir():
        return f"argument --json: {str(path)!r} is a folder, not a file path"
    folder = path.parent
    if not folder.is_dir():
        return f"argument --json: folder {str(folder)!r} does not exist"
    if not os.access(path if path.exists() else folder, os.W_OK):
        return f"argument --json: {str(path if path.exists() else folder)!r} is not writable"
    return None


def refuse_host_problems(comm: Any, args: argparse.Namespace) -> None:
    """Collective, before any work: if any rank has a :func:`host_problem`,
    every rank exits with the lowest such rank's usage error (status 2). The
    ranks agree first because a rank that quits alone leaves the others
    waiting in MPI (MPICH's MPI_Init waits for every rank)."""
    problems = [problem for problem in comm.allgather(host_problem(args, comm.Get_rank())) if problem]
    if problems:
        make_parser().error(problems[0])


def random_rows(xp: Any, positions: np.ndarray, shape: tuple[int, ...], seed: int) -> Any:
    """float32 [len(positions), *shape]: standard normal rows at global positions,
    the same whatever the layout (block b of GEN_BLOCK tokens from seed (seed, b))."""
    out = xp.empty((len(positions),) + shape, dtype=np.float32)
    blocks = positions // GEN_BLOCK
    for b in np.unique(blocks):
        mine = np.flatnonzero(blocks == b)
        rng = xp.random.default_rng(seed * 1_000_003 + int(b))
        block = rng.standard_normal((GEN_BLOCK,) + shape, dtype=np.float32)
        out[xp.asarray(mine)] = block[xp.asarray(positions[mine] - b * GEN_BLOCK)]
    return out


def make_inputs(xp: Any, positions: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """The layer's inputs at ``positions`` (indexer q/k/w, attention q/kv, dout)."""
    shapes = {"iq": (args.index_heads, args.index_dim), "ik": (args.index_dim,), "iw": (args.index_heads,),
              "q": (args.heads, args.d_qk), "kv": (args.d_qk,), "dout": (args.heads, args.d_v)}
    return {name: random_rows(xp, positions, shape, 10 * args.seed + i)
            for i, (name, shape) in enumerate(shapes.items())}


def layer_step(shard: Any, data: dict[str, Any], args: argparse.Namespace, log: PhaseLog) -> dict[str, Any]:
    """Selection and the attention forward + backward of this rank's queries (collective)."""
    with log.phase("keys"):
        k_all = AllGather(shard, global_order=True).gather(data["ik"])
    with log.phase("select"):
        selection = hs.indexer_topk(data["iq"], k_all, data["iw"], args.topk, q_pos=shard.positions,
                                    cu_seqlens=shard.cu_seqlens)
    row_bytes = data["kv"].dtype.itemsize * data["kv"].shape[1]
    with log.phase("kv"):
        plan = plan_rows(shard, selection, row_bytes, args.exchange)
        table, local = plan.gather(data["kv"]), plan.remap(selection)
    with log.phase("attn fwd"):
        out, lse = hs.sparse_attention(data["q"], table, local, d_v=args.d_v)
    with log.phase("attn bwd"):
        dq, dtable = hs.sparse_attention_backward(data["q"], table, local, out, lse, data["dout"], d_v=args.d_v)
    with log.phase("dkv"):
        dkv = plan.to_owners(dtable)
    model = modelled_bytes(plan, row_bytes)
    keys = allgather_bytes(shard.counts, data["ik"].dtype.itemsize * args.index_dim)
    return {"selection": selection, "out": out, "lse": lse, "dq": dq, "dkv": dkv, "exchange": plan.mode,
            "model": {"keys": keys, "kv": model["gather"], "dkv": model["to_owners"]}}


def check_against_one_process(shard: Any, xp: Any, args: argparse.Namespace, result: dict[str, Any]) -> dict | None:
    """Rank 0: the layer on all N tokens in one process against the gathered
    sharded results (selection exact; attention max relative differences)."""
    names = ("selection", "out", "lse", "dq", "dkv")
    parts = shard.comm.gather((shard.positions, {k: to_host(result[k]) for k in names}), root=0)
    if parts is None:
        return None
    data = make_inputs(xp, np.arange(shard.n), args)
    sel = hs.indexer_topk(data["iq"], data["ik"], data["iw"], args.topk, cu_seqlens=shard.cu_seqlens)
    out, lse = hs.sparse_attention(data["q"], data["kv"], sel, d_v=args.d_v)
    dq, dkv = hs.sparse_attention_backward(data["q"], data["kv"], sel, out, lse, data["dout"], d_v=args.d_v)
    ref = {k: to_host(v) for k, v in zip(names, (sel, out, lse, dq, dkv))}
    report = {}
    for k in names:
        got = np.empty_like(ref[k])
        for positions, arrays in parts:
            got[positions] = arrays[k]
        finite = np.isfinite(ref[k])
        scale = max(float(np.abs(ref[k][finite]).max(initial=0.0)), 1e-30)
        report[k] = {"bitwise": got.tobytes() == ref[k].tobytes(),
                     "max_rel_diff": float(np.abs(got[finite] - ref[k][finite]).max(initial=0.0)) / scale}
    return report


def summarise(shard: Any, log: PhaseLog, result: dict[str, Any], args: argparse.Namespace) -> dict | None:
    """Rank 0: phases with measured and modelled bytes, load balance; None elsewhere."""
    phases = log.report()
    select_s = log.phases["select"]["seconds"]
    select_all = shard.comm.gather(select_s, root=0)
    if phases is None:
        return None
    for row in phases:
        if row["phase"] in result["model"]:
            sent, received = result["model"][row["phase"]]
            row["model_sent_per_rank"], row["model_received_per_rank"] = sent.tolist(), received.tolist()
    work = shard.layout.causal_work(shard.cu_seqlens)
    config = {k: getattr(args, k) for k in ("seq_len", "topk", "index_heads", "index_dim", "heads", "d_qk",
                                             "d_v", "layout")}
    return {"config": {**config, "ranks": shard.size, "device": "gpu" if args.gpu else "cpu",
                       "transport": shard.transport.name, "exchange": result["exchange"]},
            "phases": phases,
            "balance": {"causal_pairs_per_rank": work.tolist(), "pairs_vs_mean": (work / work.mean()).tolist(),
                        "select_s_vs_mean": (np.array(select_all) / np.mean(select_all)).tolist()}}


def print_summary(summary: dict[str, Any]) -> None:
    mb = lambda values: "/".join(f"{v / 1e6:.2f}" for v in values)  # noqa: E731
    c = summary["config"]
    print(f"N={c['seq_len']} P={c['ranks']} {c['layout']} {c['device']} transport={c['transport']} "
          f"kv exchange={c['exchange']} (H_I={c['index_heads']}, d_I={c['index_dim']}, k={c['topk']}, "
          f"h={c['heads']}, d_qk={c['d_qk']})")
    print(f"{'phase':9} {'time s':>8}  sent MB per rank / model       received MB per rank / model")
    for row in summary["phases"]:
        model_s, model_r = row.get("model_sent_per_rank"), row.get("model_received_per_rank")
        sent = mb(row["sent_per_rank"]) + (f" / {mb(model_s)}" if model_s else "")
        received = mb(row["received_per_rank"]) + (f" / {mb(model_r)}" if model_r else "")
        print(f"{row['phase']:9} {row['seconds']:8.3f}  {sent:30} {received}")
    b = summary["balance"]
    print("indexer work (causal pairs) per rank / mean:", " ".join(f"{v:.3f}" for v in b["pairs_vs_mean"]))
    print("selection time per rank / mean:            ", " ".join(f"{v:.3f}" for v in b["select_s_vs_mean"]))
    if "check" in summary:
        diffs = {k: "bitwise" if v["bitwise"] else f"max rel diff {v['max_rel_diff']:.1e}"
                 for k, v in summary["check"].items()}
        print("vs one process:", ", ".join(f"{k} {d}" for k, d in diffs.items()))


def warm_up(comm: Any, xp: Any, args: argparse.Namespace) -> None:
    """The layer once on 128 tokens per rank, untimed: kernels load or compile here."""
    small = argparse.Namespace(**{**vars(args), "seq_len": 128 * comm.Get_size()})
    shard = make_shard(comm, small.seq_len, layout=args.layout, xp=xp, transport=args.transport)
    layer_step(shard, make_inputs(xp, shard.positions, small), small, PhaseLog(shard))
    shard.close()


def run(comm: Any, args: argparse.Namespace) -> dict | None:
    """Shard, run the layer once (after a warm-up), summarise (rank 0 gets the summary)."""
    xp = np
    if args.gpu:
        use_local_gpu(comm)
        xp = cupy_module()
    if args.warmup:
        warm_up(comm, xp, args)
    shard = make_shard(comm, args.seq_len, layout=args.layout, xp=xp, transport=args.transport)
    log = PhaseLog(shard)
    result = layer_step(shard, make_inputs(xp, shard.positions, args), args, log)
    summary = summarise(shard, log, result, args)
    check = check_against_one_process(shard, xp, args, result) if args.check else None
    shard.close()
    if summary is not None and check is not None:
        summary["check"] = check
    return summary


def main(argv: list[str]) -> None:
    # Parse first, outside abort_on_error: every rank reads the same argv, so a
    # usage error exits 2 on each rank by itself (no MPI_Abort, no traceback);
    # the host checks follow once the ranks can agree on them.
    args = parse(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    refuse_host_problems(comm, args)
    with abort_on_error(comm):
        summary = run(comm, args)
        if summary is not None:
            print_summary(summary)
            if args.json is not None:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
