"""GPU indexer loss (sparse stage) at DSA indexer shapes: hs.indexer_scores_at
("fwd"), hs.indexer_scores_at_backward ("bwd") and hs.indexer_kl_loss ("kl")
on the kernels of cuda/indexer_loss*.cu, against the CuPy-primitive path
(gpu_fallback, float64, what the GPU backend ran before the kernels; timed at
N <= --max-fallback-n only, since it is slow and its KL temporaries grow
with N).

D = 128, k = 2048; H in 64 (DeepSeek-V3.2) and 32 (GLM-5); q, k in bfloat16
(the tensor-core path) and float32 (the float32 FMA path, what the engine's
float32 indexer passes); w and dscores float32. Indices: for query t, k keys
drawn uniformly (with replacement) from [0, max(t + 1, k)), no -1 slots;
probs uniform. Rows give the median time of the public call, the peak bytes
it allocated beyond its inputs (a CuPy memory hook over one call), FLOPs
per second counting 2 N H k D for the forward and 3x that for the backward
(logits again, dq, dk rows), and the gathered key bytes (N k D itemsize)
per second for the forward.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from hyscale_core.gpu.memory import pool_peak

from .common import gpu_device, table, time_gpu, write_results

DIM, TOPK = 128, 2048


def inputs(cp, n: int, h: int, dtype, seed: int = 0):
    """q [n, h, D], k [n, D] in ``dtype``; w [n, h], dscores and probs [n, TOPK] float32; indices int32."""
    from hyscale_core.gpu.convert import narrow

    rng = cp.random.default_rng(seed)
    q = narrow(rng.standard_normal((n, h, DIM), dtype=cp.float32), dtype)
    k = narrow(rng.standard_normal((n, DIM), dtype=cp.float32), dtype)
    w = rng.standard_normal((n, h), dtype=cp.float32)
    span = cp.maximum(cp.arange(1, n + 1, dtype=cp.int32), TOPK)[:, None]
    idx = (rng.random((n, TOPK), dtype=cp.float32) * span).astype(cp.int32)
    idx = cp.minimum(idx, span - 1)
    g = rng.standard_normal((n, TOPK), dtype=cp.float32) / n
    probs = rng.random((n, TOPK), dtype=cp.float32)
    return q, k, w, idx, g, probs


def measure(cp, fn, repeats: int) -> tuple[float, float]:
    """(median ms, peak MiB allocated during one call); the call under the
    memory hook is also the warm-up (kernel compilation) of the timed ones."""
    with pool_peak() as hook:
        fn()
        cp.cuda.Device().synchronize()
    return time_gpu(lambda i: fn(), repeats=repeats, warmup=0), hook.peak / 2**20


def run_config(args, cp, hs, n: int, h: int, dtype_name: str) -> list[dict]:
    from hyscale_core._dtypes import bfloat16
    from hyscale_core.ops.indexer_loss import gpu

    dtype = bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    q, k, w, idx, g, probs = inputs(cp, n, h, dtype)
    scores = hs.indexer_scores_at(q, k, w, idx)
    calls = {"fwd": lambda: hs.indexer_scores_at(q, k, w, idx),
             "bwd": lambda: hs.indexer_scores_at_backward(q, k, w, idx, g),
             "kl": lambda: hs.indexer_kl_loss(scores, probs)}
    flops = {"fwd": 2.0 * n * h * TOPK * DIM, "bwd": 6.0 * n * h * TOPK * DIM, "kl": None}
    config = {"n": n, "h": h, "d": DIM, "k": TOPK, "dtype": dtype_name}
    times, rows = {}, []
    impls = [("hs", "0")] + ([("fallback", "1")] if n <= args.max_fallback_n else [])
    for impl, env in impls:
        os.environ[gpu.FALLBACK_ENV] = env
        try:
            for kind, fn in calls.items():
                ms, peak = measure(cp, fn, args.repeats if impl == "hs" else 1)
                times[(impl, kind)] = ms
                row = {"bench": "indexer_loss_gpu", "config": config, "impl": f"{impl} {kind}",
                       "median_ms": round(ms, 3), "peak_alloc_mib": round(peak, 1)}
                if flops[kind]:
                    row["tflops"] = round(flops[kind] / (ms * 1e-3) / 1e12, 1)
                if kind == "fwd":
                    row["gather_gbs"] = round(n * TOPK * DIM * q.dtype.itemsize / (ms * 1e-3) / 1e9, 1)
                rows.append(row)
                print(f"  N={n} H={h} {dtype_name}: {impl} {kind:3s} {ms:10.2f} ms  peak {peak:9.1f} MiB", flush=True)
        finally:
            os.environ.pop(gpu.FALLBACK_ENV, None)
    for row in rows:
        kind = row["impl"].split()[1]
        if row["impl"].startswith("hs") and ("fallback", kind) in times:
            row["x_fallback"] = round(times[("fallback", kind)] / times[("hs", kind)], 2)
    del q, k, w, idx, g, probs, scores
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-fallback-n", type=int, default=32768, help="time the CuPy-primitive path up to this N")
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = []
    for dtype_name in args.dtypes:
        for h in args.heads:
            for n in args.sizes:
                rows += run_config(args, cp, hs, n, h, dtype_name)
    path = write_results("indexer_loss_gpu", gpu_device(), rows, Path(args.out) if args.out else None)
    short = [{"N": r["config"]["n"], "H": r["config"]["h"], "dtype": r["config"]["dtype"], "impl": r["impl"],
              "ms": r["median_ms"], "peak MiB": r["peak_alloc_mib"], "TFLOP/s": r.get("tflops", ""),
              "gather GB/s": r.get("gather_gbs", ""), "x_fallback": r.get("x_fallback", "")} for r in rows]
    print(table(short, ["N", "H", "dtype", "impl", "ms", "peak MiB", "TFLOP/s", "gather GB/s", "x_fallback"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
