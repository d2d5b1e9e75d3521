"""Multi-GPU runs of the sequence shards (issue 9): one MPI rank per GPU.

    mpiexec -n P python -m benchmarks.mpi_scaling [--parts check weak strong] --out DIR
    mpiexec -n P python -m benchmarks.mpi_scaling --parts probe --probe-len N --out DIR
    python -m benchmarks.mpi_scaling --report DIR/mpi_scaling.json   # table and efficiencies (no MPI)
    python -m benchmarks.mpi_scaling --plot DIR/mpi_scaling.json     # the PNG (needs matplotlib)
    bash benchmarks/mpi_scaling.sh                                   # all of it on 1, 2 and 4 GPUs

Each rank takes its own GPU (``use_local_gpu``); the transport is chosen by
``hyscale_core.mpi``: NCCL when every rank drives a distinct GPU, host
staging when ranks share one. One DSA layer (``--dtype`` bfloat16 runs the
tensor-core kernels): keys all-gather, ``hs.indexer_topk`` of the rank's
queries, kv rows exchanged, ``hs.sparse_attention`` forward and backward,
dkv rows summed at their owners in rank order (``benchmarks/_mpi_layer.py``).

Parts (each a flag; ``--budget-s`` bounds the timed ones):

- ``check``: at ``--check-len`` tokens, rank 0 runs the layer alone on its
  GPU and compares: selection bitwise, out / lse / dq / dkv within
  ``check_tol`` of the largest value (``_mpi_layer.py``; the check always
  runs, also as the warm-up where kernels compile; its row is kept when
  ``check`` is a part).
- ``weak``: N = P * ``--weak-per-gpu`` (default 262144 tokens per GPU).
- ``strong``: N = ``--strong-len`` (default 1048576). At P = 4 with the
  defaults both are the same run, measured once.
  Weak and strong runs process each rank's queries in chunks of
  ``--query-chunk`` (selection, forward, backward per chunk; kv all-gathered
  once, dkv summed in float32 over chunks): the whole layer at N = 1M does
  not fit one GPU (q, out, dout and dq alone are 288 GB at h = 64), the
  chunked one does, so every P has a time. A run predicted (from the
  previous run's phases) to end past the budget, or estimated not to fit
  the GPU, is skipped with its reason.
- ``probe``: one whole (unchunked) layer at ``--probe-len``: the longest
  sequence is found by the wrapper doubling N in fresh jobs until one
  fails (out of memory aborts that job); memory per GPU is the CuPy pool's
  high-water mark and the device's used bytes at the end.

Time per phase is the slowest rank's; groups: selection (select),
communication (keys, kv, dkv), attention (attn fwd, attn bwd). Bytes are
the transport's payload counters per rank against ``hyscale_core.mpi``'s
cost model. Results: DIR/mpi_scaling.json (benchmarks/common.write_results
shape), rows merged across jobs, a row marked ``started`` before each run
(a job that dies leaves it so: the probe's out-of-memory size).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._mpi_layer import SHAPE, add_shape_args, check, context, layer_run, memory_estimate
from .common import table, write_results

NAME = "mpi_scaling"
GROUPS = {"selection": ("select",), "communication": ("keys", "kv", "dkv"), "attention": ("attn fwd", "attn bwd")}
TARGET_WEAK = 0.85  # issue 9: weak-scaling efficiency at 4 GPUs


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["check", "weak", "strong"],
                   choices=["check", "weak", "strong", "probe"])
    p.add_argument("--check-len", type=int, default=8192)
    p.add_argument("--weak-per-gpu", type=int, default=262144)
    p.add_argument("--strong-len", type=int, default=1048576)
    p.add_argument("--probe-len", type=int, help="tokens of the probe part")
    p.add_argument("--query-chunk", type=int, default=131072, help="queries per chunk of a rank (weak, strong)")
    p.add_argument("--budget-s", type=float, default=100.0, help="seconds for the weak and strong runs of this job")
    add_shape_args(p)
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="inputs (default bfloat16 on GPUs, float32 on CPUs)")
    p.add_argument("--exchange", default="auto", choices=["auto", "allgather", "fetch"])
    p.add_argument("--transport", help="force one (host, cuda-aware, nccl); default auto")
    p.add_argument("--cpu", action="store_true", help="NumPy ranks (a dry run of the harness)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    p.add_argument("--report", type=Path, help="print the table and efficiencies of this JSON, no run")
    p.add_argument("--plot", type=Path, help="draw this JSON to a PNG beside it, no run")
    args = p.parse_args(argv)
    if "probe" in args.parts and not args.probe_len:
        p.error("--parts probe needs --probe-len")
    return args


# ---- results file -------------------------------------------------------------------------------

def row_key(row: dict[str, Any]) -> tuple:
    c = row["config"]
    return c["part"], c["ranks"], c["seq_len"], c.get("query_chunk")


def merge_rows(path: Path, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``path`` (if any) with ``new`` replacing rows of the same key."""
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    keys = {row_key(r) for r in new}
    return [r for r in old if row_key(r) not in keys] + new


class Results:
    """Rank 0's rows of this job, merged into DIR/mpi_scaling.json after every change."""

    def __init__(self, out: Path | None, device: str) -> None:
        from .common import RESULTS

        self.dir, self.device, self.rows = out or RESULTS, device, []

    def put(self, row: dict[str, Any]) -> None:
        self.rows = [r for r in self.rows if row_key(r) != row_key(row)] + [row]
        merged = merge_rows(self.dir / f"{NAME}.json", self.rows)
        write_results(NAME, self.device, merged, self.dir)


# ---- one run ------------------------------------------------------------------------------------

def summarise(part: str, result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A results row from rank 0's ``layer_run`` result."""
    phase_ms = {p["phase"]: round(p["seconds"] * 1e3, 2) for p in result["phases"]}
    groups = {g: round(sum(phase_ms.get(p, 0.0) for p in names), 2) for g, names in GROUPS.items()}
    config = {"part": part, "seq_len": result["n"], "ranks": result["ranks"], "gpus": result["gpus"],
              "transport": result["transport"], "exchange": result["exchange"],
              "query_chunk": result["query_chunk"], "dtype": result["dtype"],
              **{k: getattr(args, k) for k in SHAPE}}
    return {"bench": NAME, "config": config, "impl": f"{result['transport']} / {result['exchange']}",
            "median_ms": round(sum(phase_ms.values()), 2), "repeats": 1, "status": "ok",
            "phase_ms": phase_ms, "group_ms": groups,
            "phase_ms_per_rank": {p["phase"]: [round(s * 1e3, 2) for s in p["seconds_per_rank"]]
                                  for p in result["phases"]},
            "bytes": result["bytes"], "bytes_match_model": result["bytes_match_model"],
            "work": result["work"], "memory": result["memory"]}


def started(part: str, n: int, ranks: int, chunk: int | None, estimate_gib: float) -> dict[str, Any]:
    return {"bench": NAME, "config": {"part": part, "seq_len": n, "ranks": ranks, "query_chunk": chunk},
            "impl": "started", "median_ms": None, "status": "started, not finished (the job ended)",
            "memory": {"estimate_gib": round(estimate_gib, 2)}}


def predicted_s(last: dict[str, Any] | None, n: int, ranks: int) -> float:
    """Seconds of a run at n tokens on ``ranks`` ranks, scaled from the last run's phases:
    selection by causal pairs per rank, attention by queries per rank, communication by n."""
    if last is None:
        return 0.0
    c, g = last["config"], last["group_ms"]
    pairs = (n * n / 2 / ranks) / (c["seq_len"] ** 2 / 2 / c["ranks"])
    queries = (n / ranks) / (c["seq_len"] / c["ranks"])
    return 1.15 * (g["selection"] * pairs + g["attention"] * queries + g["communication"] * n / c["seq_len"]) / 1e3


def skip_reason(ctx: dict[str, Any], args: argparse.Namespace, n: int, ranks: int, chunk: int,
                elapsed: float, last: dict[str, Any] | None) -> str | None:
    """Why a timed run should not start: predicted past the budget, or estimated not to fit."""
    need = predicted_s(last, n, ranks)
    estimate = memory_estimate(args, ctx["dtype"], n, ranks, chunk, ctx["xp"] is not np)
    if elapsed + need > args.budget_s:
        return f"predicted {need:.0f} s, past the {args.budget_s:.0f} s budget"
    if ctx["device_bytes"] and estimate > 0.95 * ctx["device_bytes"]:
        return f"estimated {estimate / 2**30:.0f} GiB per GPU, the GPU has {ctx['device_bytes'] / 2**30:.0f}"
    return None


def timed_runs(comm: Any, ctx: dict[str, Any], args: argparse.Namespace, results: Results | None) -> None:
    """The weak and strong runs of this job, smaller N first, within the budget (collective)."""
    ranks = comm.Get_size()
    sizes: dict[int, list[str]] = {}
    if "weak" in args.parts:
        sizes.setdefault(ranks * args.weak_per_gpu, []).append("weak")
    if "strong" in args.parts:
        sizes.setdefault(args.strong_len, []).append("strong")
    start, last = time.perf_counter(), None
    for n, parts in sorted(sizes.items()):
        chunk = min(args.query_chunk, math.ceil(n / ranks))
        estimate = memory_estimate(args, ctx["dtype"], n, ranks, chunk, ctx["xp"] is not np) / 2**30
        reason = comm.bcast(skip_reason(ctx, args, n, ranks, chunk, time.perf_counter() - start, last)
                            if results is not None else None, root=0)
        for part in parts:
            if results is not None:
                row = started(part, n, ranks, chunk, estimate)
                results.put({**row, "impl": "skipped", "status": f"skipped: {reason}"} if reason else row)
                if reason:
                    print(f"{part} N={n} P={ranks}: skipped ({reason})", flush=True)
        if reason:
            continue
        result = layer_run(comm, ctx, args, n, chunk)
        if results is not None:
            rows = [summarise(part, result, args) for part in parts]
            for row in rows:
                row["memory"]["estimate_gib"] = round(estimate, 2)
                results.put(row)
            print_rows(rows)
            last = rows[-1]


def run_check(comm: Any, ctx: dict[str, Any], args: argparse.Namespace, results: Results | None) -> None:
    """The check (also the warm-up: kernels compile here); a row when ``check`` is a part."""
    result = check(comm, ctx, args)
    if result is None or "check" not in args.parts:
        return
    row = summarise("check", result, args)
    row["check"], row["check_ok"] = result["check"], result["check_ok"]
    results.put(row)
    print_rows([row])
    diffs = ", ".join(f"{k} " + ("bitwise" if v["bitwise"] else f"{v['max_rel_diff']:.1e} (<= {v['tolerance']:.1e})")
                      for k, v in result["check"].items())
    verdict = "ok" if result["check_ok"] else "FAILED"
    print(f"check vs one device, N={args.check_len}: {diffs} -> {verdict}", flush=True)


def run_probe(comm: Any, ctx: dict[str, Any], args: argparse.Namespace, results: Results | None) -> None:
    """One whole layer at --probe-len (a ``started`` row first: an out-of-memory abort leaves it)."""
    n, ranks = args.probe_len, comm.Get_size()
    estimate = memory_estimate(args, ctx["dtype"], n, ranks, None, ctx["xp"] is not np) / 2**30
    if results is not None:
        results.put(started("probe", n, ranks, None, estimate))
        print(f"probe N={n} P={ranks}: estimated {estimate:.1f} GiB per rank", flush=True)
    result = layer_run(comm, ctx, args, n, None)
    if results is not None:
        row = summarise("probe", result, args)
        row["memory"]["estimate_gib"] = round(estimate, 2)
        results.put(row)
        print_rows([row])


def run_job(comm: Any, args: argparse.Namespace) -> None:
    """The parts named by ``--parts`` on the ranks of ``comm`` (collective)."""
    ctx = context(comm, args)
    results = Results(args.out, ctx["device"]) if comm.Get_rank() == 0 else None
    run_check(comm, ctx, args, results)
    timed_runs(comm, ctx, args, results)
    if "probe" in args.parts:
        run_probe(comm, ctx, args, results)
    ctx["transport"].close()


# ---- report and plot ----------------------------------------------------------------------------

def print_rows(rows: list[dict[str, Any]]) -> None:
    flat = []
    for r in rows:
        c, m = r["config"], r.get("memory", {})
        line = {"part": c["part"], "P": c["ranks"], "N": c["seq_len"], "status": r["status"][:48]}
        if r["status"] == "ok":
            kv = r["bytes"].get("kv", {})
            line.update({"transport": c["transport"], **{f"{g} s": round(v / 1e3, 3) for g, v in r["group_ms"].items()},
                         "total s": round(r["median_ms"] / 1e3, 3),
                         "kv MB in/rank": round(max(kv.get("received_per_rank", [0])) / 1e6, 1),
                         "bytes = model": r["bytes_match_model"],
                         "GiB/GPU": m.get("peak_gib"), "est GiB": m.get("estimate_gib")})
        if "check_ok" in r:
            line["check"] = "ok" if r["check_ok"] else "FAILED"
        flat.append(line)
    columns = list(dict.fromkeys(k for f in flat for k in f))
    print(table(flat, columns), flush=True)


def efficiencies(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Strong: T(P0) P0 / (T(P) P), P0 the fewest ranks measured at that N. Weak: T(1) / T(P)
    (plain) and per unit of work: the time P = 1 would take for the busiest rank's work at P
    (selection scaled by causal pairs, attention by queries, the rest as at P = 1) over T(P).
    Under weak scaling the selection per GPU grows as P (every query scores every earlier
    key), so the plain figure falls towards 1 / P where the selection dominates."""
    ok = [r for r in rows if r["status"] == "ok"]
    out: dict[str, dict[int, float]] = {"strong": {}, "weak": {}, "weak_work": {}}
    strong = sorted((r for r in ok if r["config"]["part"] == "strong"), key=lambda r: r["config"]["ranks"])
    if strong:
        base = strong[0]["median_ms"] * strong[0]["config"]["ranks"]
        out["strong"] = {r["config"]["ranks"]: base / (r["median_ms"] * r["config"]["ranks"]) for r in strong}
    weak = {r["config"]["ranks"]: r for r in ok if r["config"]["part"] == "weak"}
    if 1 in weak:
        one = weak[1]
        for p, r in weak.items():
            out["weak"][p] = one["median_ms"] / r["median_ms"]
            ratio = {k: max(r["work"][k]) / max(one["work"][k]) for k in ("causal_pairs_per_rank", "queries_per_rank")}
            sel, attn = one["group_ms"]["selection"], one["group_ms"]["attention"]
            ideal = (one["median_ms"] - sel - attn + sel * ratio["causal_pairs_per_rank"]
                     + attn * ratio["queries_per_rank"])
            out["weak_work"][p] = ideal / r["median_ms"]
    return out


def report(path: Path) -> tuple[dict[str, dict[int, float]], bool]:
    """Print the rows, the efficiencies and the probe's longest N; store the efficiencies in the
    rows. Returns the efficiencies and whether every check passed."""
    payload = json.loads(path.read_text())
    rows = sorted(payload["rows"], key=lambda r: (r["config"]["part"], r["config"]["ranks"], r["config"]["seq_len"]))
    print(f"{path} ({payload['device']}, commit {payload['commit']}, {payload['date']})")
    print_rows(rows)
    eff = efficiencies(rows)
    for kind, label in (("strong", "strong scaling efficiency"), ("weak", "weak scaling efficiency, T(1) / T(P)"),
                        ("weak_work", "weak scaling efficiency, per unit of work")):
        if eff[kind]:
            print(f"{label}: " + ", ".join(f"P={p}: {e:.1%}" for p, e in sorted(eff[kind].items())))
    if 4 in eff["weak_work"]:
        verdict = "meets" if eff["weak_work"][4] >= TARGET_WEAK else "misses"
        print(f"target: weak scaling efficiency >= {TARGET_WEAK:.0%} at 4 GPUs: {verdict} it per unit of work "
              f"({eff['weak_work'][4]:.1%}); plain T(1) / T(4) {eff['weak'][4]:.1%}")
    for r in rows:
        part, p = r["config"]["part"], r["config"]["ranks"]
        r.pop("efficiency", None)
        if part in ("strong", "weak") and p in eff[part]:
            r["efficiency"] = {"plain": round(eff[part][p], 4),
                               **({"per_work": round(eff["weak_work"][p], 4)} if part == "weak" else {})}
    probes = [r for r in rows if r["config"]["part"] == "probe"]
    for p in sorted({r["config"]["ranks"] for r in probes}):
        mine = [r for r in probes if r["config"]["ranks"] == p]
        ran = [r for r in mine if r["status"] == "ok"]
        failed = [r["config"]["seq_len"] for r in mine if r["status"] != "ok"]
        if ran:
            best = max(ran, key=lambda r: r["config"]["seq_len"])
            print(f"longest sequence, one DSA layer fwd + bwd on P={p}: N={best['config']['seq_len']} "
                  f"({best['memory']['peak_gib']} GiB per GPU at most); did not run: {sorted(failed) or 'none tried'}")
    payload["rows"] = rows
    path.write_text(json.dumps(payload, indent=1) + "\n")
    failed = [r["config"]["ranks"] for r in rows if r.get("check_ok") is False]
    if failed:
        print(f"the check against one device FAILED at P = {failed}")
    return eff, not failed


def plot(path: Path) -> None:
    """Time per group against P (strong, weak) and memory per GPU against N (probe), to PATH.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install \"hyscale-core[plot]\")")
        return
    payload = json.loads(path.read_text())
    rows = [r for r in payload["rows"] if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, part in zip(axes[:2], ("strong", "weak")):
        mine = sorted((r for r in rows if r["config"]["part"] == part), key=lambda r: r["config"]["ranks"])
        bottom = np.zeros(len(mine))
        x = np.arange(len(mine))
        for i, group in enumerate(GROUPS):
            values = np.array([r["group_ms"][group] / 1e3 for r in mine])
            ax.bar(x, values, 0.6, bottom=bottom, color=f"C{i}", label=group)
            bottom += values
        for xi, r, top in zip(x, mine, bottom):
            eff = r.get("efficiency", {})
            label = "/".join(f"{v:.0%}" for v in eff.values())
            ax.text(xi, top, label, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [f"P={r['config']['ranks']}\nN={r['config']['seq_len']:,}" for r in mine])
        ax.set(ylabel="seconds (slowest rank per phase)", title=f"{part} scaling" + (
            " (efficiency plain / per work)" if part == "weak" else " (efficiency)"))
        ax.legend(fontsize=8)
    probes = sorted((r for r in rows if r["config"]["part"] == "probe"), key=lambda r: r["config"]["seq_len"])
    for p in sorted({r["config"]["ranks"] for r in probes}):
        mine = [r for r in probes if r["config"]["ranks"] == p]
        axes[2].plot([r["config"]["seq_len"] for r in mine], [r["memory"]["peak_gib"] for r in mine], "o-",
                     label=f"P={p}")
    axes[2].set(xscale="log", xlabel="N (one whole layer)", ylabel="GiB per GPU (peak)", title="longest-sequence probe")
    if probes:
        axes[2].legend(fontsize=8)
    fig.suptitle(f"One DSA layer fwd + bwd over MPI ranks ({payload['device']})", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.report or args.plot:
        checks_passed = report(args.report)[1] if args.report else True
        if args.plot:
            plot(args.plot)
        if not checks_passed:
            raise SystemExit(1)
        return
    from mpi4py import MPI

    from hyscale_core.mpi import abort_on_error

    comm = MPI.COMM_WORLD
    with abort_on_error(comm):
        run_job(comm, args)


if __name__ == "__main__":
    main()

