"""hs.topk's launch plan on the GPU: block size, sample size and blocks per row
swept at a few configurations, each variant checked bitwise against the
default plan's output and timed by CUDA events (medians, rotated inputs).

What it answers: whether the defaults of ``hyscale_core.ops.topk.gpu.plan``
are the fastest of their neighbours. Times are of the kernel launch alone
(outputs allocated, no argument checks), so variants compare like for like.

    python -m benchmarks.topk_gpu_plans            # the default configurations
    python -m benchmarks.topk_gpu_plans --rows 1 --n 1048576 --k 4096 --dtype bfloat16 --data ascending
"""
from __future__ import annotations

import argparse
import itertools

from .common import copies_for, gpu_device, table, time_gpu, write_results
from .topk_gpu import DATA, add_shape_arguments, make_rows

CONFIGS = [
    (1024, 131072, 2048, "float32"),
    (1024, 131072, 256, "float32"),
    (1024, 131072, 4096, "float32"),
    (1, 1 << 20, 4096, "bfloat16"),
    (1, 1 << 20, 2048, "float32"),
    (16384, 32768, 4096, "float32"),
    (4096, 131072, 4096, "bfloat16"),
    (64, 131072, 256, "bfloat16"),
]
THREADS = (512, 256)
SAMPLE_M = (4096, 8192, 16384)
CHUNKS = (16, 32, 64)


def variants(gpu, rows: int, n: int, k: int, itemsize: int, sms: int, chunk_counts=CHUNKS):
    """(label, plan) of the default plan, then every swept neighbour."""
    default = gpu.plan(rows, n, k, itemsize, sms)
    yield "default", default
    ms = SAMPLE_M if default.sample_m else (0,)
    chunks = chunk_counts if default.chunks > 1 else (1,)
    for threads, m, c in itertools.product(THREADS, ms, chunks):
        p = gpu.plan(rows, n, k, itemsize, sms, threads=threads, sample_m=m or None, chunks=c)
        if p != default:
            yield f"t{threads} m{p.sample_m} c{p.chunks}", p


def make_inputs(cp, rows: int, n: int, dtype: str, data: str):
    import torch

    itemsize = 4 if dtype == "float32" else 2
    return [make_rows(cp, torch, data, (rows, n), dtype, seed)[0] for seed in range(copies_for(rows * n * itemsize))]


def sweep(cp, gpu, device: int, sms: int, config, repeats: int, chunk_counts=CHUNKS) -> list[dict]:
    """Rows of every plan variant at one configuration."""
    rows, n, k, dtype, data = config
    xs = make_inputs(cp, rows, n, dtype, data)
    itemsize = xs[0].dtype.itemsize
    expected = base_ms = None
    out = []
    for label, p in variants(gpu, rows, n, k, itemsize, sms, chunk_counts):
        launch = gpu.prepare(rows, n, k, xs[0].dtype, True, True, p, device)
        got = gpu.run(cp, xs[0], k, launch, device)[1]
        if expected is None:
            expected = got
        elif not bool((got == expected).all()):
            raise AssertionError(f"[{rows}, {n}] k={k} {dtype} {data} {label}: indices differ from the default plan's")
        ms = time_gpu(lambda i: gpu.run(cp, xs[i % len(xs)], k, launch, device), repeats=repeats)
        base_ms = base_ms or ms
        out.append({"bench": "topk_gpu_plans", "config": {"rows": rows, "n": n, "k": k, "dtype": dtype, "data": data},
                    "impl": label, "threads": p.threads, "sample_m": p.sample_m, "chunks": p.chunks,
                    "cap": p.cap, "median_ms": round(ms, 4), "vs_default": round(base_ms / ms, 3)})
        print(f"[{rows}, {n}] k={k} {dtype:8s} {data:12s} {label:16s} cap {p.cap:6d} {ms:8.4f} ms "
              f"({base_ms / ms:.3f}x default)", flush=True)
    return out


def run(configs, repeats: int, chunk_counts=CHUNKS) -> list[dict]:
    import cupy as cp

    from hyscale_core.gpu.module import multiprocessor_count
    from hyscale_core.ops.topk import gpu

    device = cp.cuda.Device().id
    sms = multiprocessor_count(device)
    out = []
    for config in configs:
        out += sweep(cp, gpu, device, sms, config, repeats, chunk_counts)
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--data", default="random", choices=DATA, help="input kind (benchmarks/topk_gpu.py)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS),
                        help="blocks per row to sweep where the default cuts rows into chunks")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    configs = [(args.rows, args.n, args.k, args.dtype, args.data)] if args.rows else [c + ("random",) for c in CONFIGS]
    rows = run(configs, args.repeats, tuple(args.chunks))
    from pathlib import Path

    path = write_results("topk_gpu_plans", gpu_device(), rows, Path(args.out) if args.out else None)
    best = {}
    for r in rows:
        c = r["config"]
        key = f"{c['rows']}x{c['n']} k={c['k']} {c['dtype']}"
        if key not in best or r["median_ms"] < best[key]["best_ms"]:
            best[key] = {"config": key, "best": r["impl"], "best_ms": r["median_ms"],
                         "vs_default": r["vs_default"]}
    print(table(list(best.values()), ["config", "best", "best_ms", "vs_default"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
