"""CPU indexer top-k: streaming hs.indexer_topk against materialising the
[N, N] scores with NumPy (chunked matmul, relu, head-weighted sum, causal
mask) followed by np.argpartition. N=8192, H=64, D=128, k=2048, causal.
Peak memory is traced with tracemalloc (NumPy allocations included)."""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from .common import cpu_device, table, write_results


def numpy_materialised(q, k, w, topk: int, chunk: int = 128):
    n, heads, dim = q.shape
    table_ = np.empty((n, k.shape[0]), dtype=np.float32)
    for t0 in range(0, n, chunk):
        logits = q[t0:t0 + chunk].reshape(-1, dim) @ k.T
        np.maximum(logits, 0, out=logits)
        table_[t0:t0 + chunk] = np.matmul(w[t0:t0 + chunk, None, :], logits.reshape(-1, heads, k.shape[0]))[:, 0]
    table_[np.triu_indices(n, 1, k.shape[0])] = -np.inf
    return np.argpartition(table_, k.shape[0] - topk, axis=1)[:, k.shape[0] - topk:]


def measure(fn):
    tracemalloc.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


def main(argv=None) -> None:
    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((args.n, args.heads, args.dim), dtype=np.float32)
    k = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    w = rng.standard_normal((args.n, args.heads), dtype=np.float32)
    hs.indexer_topk(q[:128], k[:128], w[:128], 64)  # compile outside the timing
    impls = {"hs.indexer_topk (streaming)": lambda: hs.indexer_topk(q, k, w, args.topk),
             "numpy materialise + argpartition": lambda: numpy_materialised(q, k, w, args.topk)}
    config = {"n": args.n, "heads": args.heads, "dim": args.dim, "topk": args.topk, "causal": True}
    causal_flops = args.n * (args.n + 1) / 2 * args.heads * args.dim * 2
    rows = []
    for impl, fn in impls.items():
        runs = [measure(fn) for _ in range(args.repeats)]
        seconds = float(np.median([r[0] for r in runs]))
        peak = max(r[1] for r in runs)
        rows.append({"bench": "indexer_cpu", "config": config, "impl": impl, "median_ms": round(seconds * 1e3, 1),
                     "peak_mib": round(peak / 2**20, 1), "causal_gflops": round(causal_flops / seconds / 1e9, 1)})
        print(f"{impl:34s} {seconds:7.2f} s  peak {peak / 2**20:8.1f} MiB", flush=True)
    for r in rows:
        r["hs_speedup"] = round(r["median_ms"] / rows[0]["median_ms"], 2)
    print(f"[N, N] float32 table: {args.n * args.n * 4 / 2**20:.0f} MiB; int32 selection: "
          f"{args.n * args.topk * 4 / 2**20:.0f} MiB")
    path = write_results("indexer_cpu", cpu_device(), rows)
    print(table(rows, ["impl", "median_ms", "peak_mib", "causal_gflops", "hs_speedup"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
