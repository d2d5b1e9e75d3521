"""Where the fused indexer top-k's time goes, step by step: the kernels
built with the timeline probe (``cuda/indexer_probe.cuh``), one timed
``hs.indexer_topk``, and warp 0's cycles per step of the tile loop and of
each query's final selection, summed over all CTAs.

    python -m benchmarks.indexer_timeline --n 131072 --heads 64 --k 2048

The probe reads ``%clock`` about ten times a tile and costs some 10 % of
the wall time; ptxas may move arithmetic across a mark, so neighbouring
steps can trade cycles. ``--ctas-per-sm 1`` launches one CTA per SM (no
other CTA beside it). Prints the steps as a share of warp 0's cycles and
as cycles per CTA-tile, then the final selection's pieces per query;
``--out FOLDER`` also writes a results JSON.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

# The slots of hs_idx_probe, in cuda/indexer_probe.cuh's order.
STEPS = ["issue", "tile_scores", "wait_lo", "lo_sums", "consume", "wait_hi", "hi_sums", "copy_wait", "barrier",
         "settle", "final", "next_group", "final_prune", "final_load", "final_sort", "final_write"]
COUNTS = ["tiles", "groups", "total_cycles", "final_prunes", "final_candidates", "sort_rounds", "sort_passes"]
SLOTS = STEPS + COUNTS
LOOP_STEPS = STEPS[:12]  # the stream's steps, the final selection and the next group: all of a CTA's time
FINAL_PIECES = STEPS[12:]
MAX_N = 262144  # about 1 s of kernel at H = 64: well inside a CTA's 32-bit cycle sums


def summarise(slots, queries: int) -> dict:
    """The probe's slot sums as shares of warp 0's cycles, cycles per
    CTA-tile, and the final selection's pieces per query."""
    c = dict(zip(SLOTS, (float(x) for x in slots)))
    total, tiles = c["total_cycles"], max(c["tiles"], 1.0)
    steps = {name: {"share_pct": round(100 * c[name] / total, 2), "cycles_per_tile": round(c[name] / tiles, 1)}
             for name in LOOP_STEPS}
    return {
        "steps": steps,
        "cycles_per_tile": round(total / tiles, 1),
        "unaccounted_pct": round(100 * (total - sum(c[name] for name in LOOP_STEPS)) / total, 2),
        "final_per_query": {name: round(c[name] / queries) for name in ["final", *FINAL_PIECES]},
        "final_prunes": int(c["final_prunes"]),
        "candidates_per_final_prune": round(c["final_candidates"] / max(c["final_prunes"], 1.0), 1),
        "sort_rounds": int(c["sort_rounds"]),
        "sort_passes_per_query": round(c["sort_passes"] / queries, 2),
        "tiles": int(c["tiles"]),
        "groups": int(c["groups"]),
    }


def report(summary: dict) -> str:
    lines = [f"{'step':<12} {'% of warp 0':>11} {'cycles/tile':>12}"]
    for name, row in summary["steps"].items():
        lines.append(f"{name:<12} {row['share_pct']:>11.2f} {row['cycles_per_tile']:>12.1f}")
    lines.append(f"{'all':<12} {100 - summary['unaccounted_pct']:>11.2f} {summary['cycles_per_tile']:>12.1f}")
    lines.append("final selection per query: " + ", ".join(f"{k} {v}" for k, v in summary["final_per_query"].items()))
    lines.append(f"final prunes {summary['final_prunes']} from {summary['candidates_per_final_prune']} candidates "
                 f"on average; {summary['sort_rounds']} sort rounds, {summary['sort_passes_per_query']} passes a query")
    return "\n".join(lines)


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs
    from hyscale_core.gpu import module
    from hyscale_core.ops.indexer import gpu

    from .indexer_gpu import inputs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--ctas-per-sm", type=int, default=gpu.CTAS_PER_SM)
    parser.add_argument("--out", default=None, help="folder for a results JSON")
    args = parser.parse_args(argv)
    if args.n > MAX_N:
        raise SystemExit(f"indexer_timeline: --n {args.n} is past {MAX_N}: each CTA sums its cycles in 32 bits, "
                         "which a longer kernel can wrap")

    gpu.PROBE = True
    gpu.CTAS_PER_SM = args.ctas_per_sm
    q, k, w = inputs(cp, args.n, args.heads, args.dim)
    hs.indexer_topk(q[:1024], k[:1024], w[:1024], args.k, q_pos=np.arange(1024))  # compile
    config = gpu._config(q, args.k)
    if config is None:
        raise SystemExit(f"indexer_timeline: the fused kernel is not built for H={args.heads}, D={args.dim}, "
                         f"k={args.k}")
    defines = config[0]
    slots = cp.ndarray((len(SLOTS),), dtype=cp.uint64,
                       memptr=module._load("indexer", cp.cuda.Device().id, tuple(defines)).get_global("hs_idx_probe"))
    hs.indexer_topk(q, k, w, args.k)  # warm
    slots.fill(0)
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    hs.indexer_topk(q, k, w, args.k)
    cp.cuda.Device().synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    summary = summarise(slots.get(), args.n)
    print(f"indexer top-k with the probe: n={args.n} heads={args.heads} k={args.k} "
          f"ctas_per_sm={args.ctas_per_sm}: {wall_ms:.2f} ms")
    print(report(summary))
    if args.out:
        from pathlib import Path

        from .common import gpu_device, write_results

        row = {"impl": "indexer_topk with the timeline probe", "config": {"n": args.n, "heads": args.heads,
               "dim": args.dim, "topk": args.k, "ctas_per_sm": args.ctas_per_sm}, "wall_ms": round(wall_ms, 2),
               **summary}
        print("wrote", write_results("indexer_timeline", gpu_device(), [row], Path(args.out)))


if __name__ == "__main__":
    main()
