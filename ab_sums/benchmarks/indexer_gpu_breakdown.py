"""Where hs.indexer_topk's time goes on the GPU, at one causal DSA shape: the
streaming kernel at several k (the selection's share grows with k: more
appends and prunes), against the score kernel alone (``hs.indexer_scores``
over query chunks, the table discarded: the same tile loop with a plain
store as its epilogue), and the bf16 GEMM floor of the same useful FLOPs.

    python -m benchmarks.indexer_gpu_breakdown --n 131072 --heads 64
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .common import gpu_device, matmul_rate_tflops, table, write_results
from .indexer_gpu import inputs


def wall_ms(cp, fn, repeats: int) -> float:
    """Median wall milliseconds of ``fn()`` with the device synchronised around it."""
    times = []
    for _ in range(repeats):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def scores_only(hs, q, k, w, chunk: int) -> None:
    for t0 in range(0, q.shape[0], chunk):
        t1 = min(t0 + chunk, q.shape[0])
        hs.indexer_scores(q[t0:t1], k[:t1], w[t0:t1], q_pos=np.arange(t0, t1))


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[256, 2048, 4096])
    parser.add_argument("--chunk", type=int, default=16384, help="query chunk of the score-only run")
    parser.add_argument("--buffer-ks", type=int, nargs="+", default=None,
                        help="candidate buffer sizes to sweep, in multiples of k (default: the library's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    rate = matmul_rate_tflops(torch)
    q, k, w = inputs(cp, args.n, args.heads, args.dim)
    flops = 2.0 * args.heads * args.dim * args.n * (args.n + 1) / 2
    floor_ms = flops / (rate * 1e12) * 1e3
    hs.indexer_topk(q[:256], k[:256], w[:256], 64, q_pos=np.arange(256))  # compile
    hs.indexer_scores(q[:256], k[:256], w[:256], q_pos=np.arange(256))
    from hyscale_core.ops.indexer import gpu as indexer_gpu

    def with_buffer(kk: int, ks: int):
        def run():
            default, indexer_gpu.BUFFER_KS = indexer_gpu.BUFFER_KS, ks
            try:
                return hs.indexer_topk(q, k, w, kk)
            finally:
                indexer_gpu.BUFFER_KS = default
        return run

    runs = {}
    for kk in args.ks:
        for ks in args.buffer_ks or [indexer_gpu.BUFFER_KS]:
            runs[f"hs.indexer_topk k={kk} buffer {ks}k"] = with_buffer(kk, ks)
    runs["hs.indexer_scores alone (chunked, table discarded)"] = lambda: scores_only(hs, q, k, w, args.chunk)
    rows = []
    config = {"n": args.n, "heads": args.heads, "dim": args.dim, "mask": "causal"}
    for impl, fn in runs.items():
        fn()  # warm-up
        ms = wall_ms(cp, fn, args.repeats)
        rows.append({"bench": "indexer_gpu_breakdown", "config": config, "impl": impl, "median_ms": round(ms, 2),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "floor_ms": round(floor_ms, 2),
                     "x_floor": round(ms / floor_ms, 2)})
        print(f"  {impl:52s} {ms:9.1f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s  x{rows[-1]['x_floor']} floor",
              flush=True)
    from pathlib import Path

    path = write_results("indexer_gpu_breakdown", gpu_device(), rows, Path(args.out) if args.out else None)
    print(table([{"impl": r["impl"], "ms": r["median_ms"], "TFLOP/s": r["tflops"], "x_floor": r["x_floor"]}
                 for r in rows], ["impl", "ms", "TFLOP/s", "x_floor"]))
    print(f"floor {floor_ms:.1f} ms at {rate:.0f} TFLOP/s; wrote {path}")


if __name__ == "__main__":
    main()
