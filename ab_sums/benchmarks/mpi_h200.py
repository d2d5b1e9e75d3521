"""Sequence shards on one GPU shared by several MPI ranks: time per phase and bytes per rank.

Launched by benchmarks/mpi_h200.sh (``mpiexec -n P python -m benchmarks.mpi_h200``),
P = 2 and 4 ranks sharing the one H200 through host staging. Each rank runs
examples/mpi_long_context.py's layer step (keys all-gather, indexer top-k,
kv exchange, sparse attention forward and backward, dkv return) on its
zigzag shard, with DSA shapes: H_I = 64, d_I = 128, k = 2048, h = 64,
d_qk = 576, d_v = 512, float32 inputs.

First a check at ``--check-len`` tokens: the same layer in one process on
rank 0 against the gathered sharded results (this run also compiles the
kernels). Then one timed run per ``--sizes`` entry, in order, while the
timed runs' predicted end stays within ``--budget-s`` (the previous size's
time times 1.15 N'/N: at k = 2048 the attention, linear in N, dominates
the quadratic indexer below 1M tokens; skipped sizes are reported).
Without a GPU it runs on NumPy (pass small sizes). Results JSON, rewritten after every run so a cut-off
job keeps what it measured: $OUT (or --out) / mpi_h200_np{P}.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Callable

from ._mpi_layer import add_shape_args, shape_argv
from .common import cpu_device, gpu_device, table, write_results

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mpi_long_context.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("mpi_long_context", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--check-len", type=int, default=4096)
    p.add_argument("--budget-s", type=float, default=70.0, help="seconds for the timed sizes (after the check)")
    add_shape_args(p)
    p.add_argument("--transport", default="host")
    p.add_argument("--out", default=os.environ.get("OUT") or None)
    return p.parse_args(argv)


def row(summary: dict[str, Any], kind: str) -> dict[str, Any]:
    phases = {r["phase"]: r for r in summary["phases"]}
    config = summary["config"]
    out = {"bench": "mpi_h200", "config": {**config, "run": kind},
           "impl": f"{config['transport']} / {config['exchange']}",
           "median_ms": round(sum(r["seconds"] for r in phases.values()) * 1e3, 1), "repeats": 1,
           "phase_ms": {k: round(r["seconds"] * 1e3, 1) for k, r in phases.items()},
           "phase_ms_per_rank": {k: [round(s * 1e3, 1) for s in r["seconds_per_rank"]] for k, r in phases.items()},
           "bytes": {k: {f: r[f] for f in r if f.endswith("per_rank") and not f.startswith("seconds")}
                     for k, r in phases.items()},
           "balance": summary["balance"]}
    if "check" in summary:
        out["check"] = summary["check"]
    return out


def run_sizes(comm: Any, example: Any, args: argparse.Namespace, common: list[str],
              emit: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """The check, then the timed sizes within the budget (collective). Rank 0
    prints each run's summary and calls ``emit(rows so far)`` after each."""
    summary = example.run(comm, example.parse(["--seq-len", str(args.check_len), "--check", *common]))
    rows: list[dict[str, Any]] = []
    if summary is not None:
        example.print_summary(summary)
        rows.append(row(summary, "check"))
        emit(rows)
    start, last = time.perf_counter(), None
    for n in args.sizes:
        predicted = 0.0 if last is None else 1.15 * last[1] * n / last[0]
        go = comm.bcast(time.perf_counter() - start + predicted <= args.budget_s, root=0)
        if not go:
            rows.append({"bench": "mpi_h200", "config": {"seq_len": n, "ranks": comm.Get_size()}, "impl": "skipped",
                         "median_ms": None, "predicted_s": round(predicted, 1)})
            continue
        t0 = time.perf_counter()
        summary = example.run(comm, example.parse(["--seq-len", str(n), "--no-warmup", *common]))
        last = (n, time.perf_counter() - t0)
        if summary is not None:
            example.print_summary(summary)
            rows.append(row(summary, "timed"))
            emit(rows)
        if example.cupy_module() is not None:
            example.cupy_module().get_default_memory_pool().free_all_blocks()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    flat = []
    for r in rows:
        c = r["config"]
        if r["impl"] == "skipped":
            flat.append({"N": c["seq_len"], "P": c["ranks"], "run": f"skipped (predicted {r['predicted_s']} s)"})
            continue
        kv_mb = max(r["bytes"]["kv"]["received_per_rank"]) / 1e6
        flat.append({"N": c["seq_len"], "P": c["ranks"], "run": c["run"], "exchange": c["exchange"],
                     **{f"{k} ms": v for k, v in r["phase_ms"].items()}, "total ms": r["median_ms"],
                     "kv MB in/rank": round(kv_mb, 1),
                     "select max/mean": round(max(r["balance"]["select_s_vs_mean"]), 3)})
    columns = list(dict.fromkeys(k for f in flat for k in f))
    print(table(flat, columns), flush=True)


def main(argv: list[str] | None = None) -> None:
    from mpi4py import MPI

    from hyscale_core.mpi import abort_on_error

    comm = MPI.COMM_WORLD
    with abort_on_error(comm):
        args = parse(argv)
        example = load_example()
        common = [*shape_argv(args), "--transport", args.transport]
        gpu = example.cupy_module() is not None
        device = (gpu_device() if gpu else cpu_device()) + f"; {comm.Get_size()} MPI ranks sharing it"
        out = Path(args.out) if args.out else None
        name = f"mpi_h200_np{comm.Get_size()}"
        rows = run_sizes(comm, example, args, common, lambda rows: write_results(name, device, rows, out))
        if comm.Get_rank() == 0:
            print_table(rows)
            print("wrote", write_results(name, device, rows, out))


if __name__ == "__main__":
    main()
