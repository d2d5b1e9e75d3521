"""The ``hyscale`` console script: ``hyscale info``, ``hyscale demo``, ``hyscale log inspect|diff``."""
from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
import tracemalloc

import numpy as np

from . import __version__
from ._backend import cupy_module


def _version_of(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return "not installed"


def info(_: argparse.Namespace) -> int:
    """Print backends, versions and the GPU, if any."""
    print(f"hyscale-core {__version__} on Python {platform.python_version()} ({platform.machine()})")
    for module in ("numpy", "numba", "h5py", "ml_dtypes", "mpi4py", "cupy"):
        print(f"  {module:<10} {_version_of(module)}")
    import numba

    print(f"backend cpu: Numba, {numba.config.NUMBA_NUM_THREADS} threads")
    cp = cupy_module()
    if cp is None:
        print("backend gpu: not available (no CuPy or no CUDA device)")
    else:
        for device_id in range(cp.cuda.runtime.getDeviceCount()):
            props = cp.cuda.runtime.getDeviceProperties(device_id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            print(f"backend gpu: device {device_id}: {name}, {props['totalGlobalMem'] / 2**30:.1f} GiB, "
                  f"compute capability {props['major']}.{props['minor']}, {props['multiProcessorCount']} SMs")
    from .gpu.module import cuda_source_dir

    print(f"CUDA sources: {cuda_source_dir()}")
    return 0


def _demo_inputs(xp, n: int, heads: int, dim: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, heads, dim), dtype=np.float32)
    k = rng.standard_normal((n, dim), dtype=np.float32)
    w = rng.standard_normal((n, heads), dtype=np.float32) / np.sqrt(heads)
    return tuple(xp.asarray(a) for a in (q, k, w))


def _timed(fn, on_gpu: bool):
    """(result, seconds, peak bytes of the allocations made during the call)."""
    if on_gpu:
        from .gpu.memory import pool_peak

        cp = cupy_module()
        cp.cuda.Device().synchronize()
        with pool_peak() as memory:
            start = time.perf_counter()
            result = fn()
            cp.cuda.Device().synchronize()
            seconds = time.perf_counter() - start
        return result, seconds, memory.peak
    tracemalloc.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def demo(args: argparse.Namespace) -> int:
    """Run indexer_topk on a built-in problem and check it against the materialised path."""
    import hyscale_core as hs

    cp = cupy_module()
    on_gpu = args.backend == "gpu" or (args.backend == "auto" and cp is not None)
    if on_gpu and cp is None:
        print("hyscale demo: --backend gpu needs CuPy and a CUDA device", file=sys.stderr)
        return 2
    n = args.n or (32768 if on_gpu else 4096)
    xp = cp if on_gpu else np
    q, k, w = _demo_inputs(xp, n, args.heads, args.dim, args.seed)
    print(f"demo: causal DSA indexer, N={n}, H={args.heads}, D={args.dim}, topk={args.topk}, "
          f"backend {'gpu' if on_gpu else 'cpu'}")
    hs.indexer_topk(q[:64], k[:64], w[:64], min(args.topk, 64))  # compile outside the timing
    selection, seconds, peak = _timed(lambda: hs.indexer_topk(q, k, w, args.topk), on_gpu)
    table_bytes = 4 * n * n
    print(f"  streaming indexer_topk: {seconds:.3f} s, peak memory {peak / 2**20:.1f} MiB "
          f"(the [N, N] float32 table would be {table_bytes / 2**20:.1f} MiB)")
    start = time.perf_counter()
    scores = hs.indexer_scores(q, k, w)
    values, indices = hs.topk(scores, min(args.topk, n))
    materialised = xp.where(values == -xp.inf, -1, indices).astype(xp.int32)
    if on_gpu:
        cp.cuda.Device().synchronize()
    print(f"  materialised check (indexer_scores + topk): {time.perf_counter() - start:.3f} s")
    same = bool((selection[:, : materialised.shape[1]] == materialised).all())
    print(f"  check: streaming selection {'IDENTICAL to' if same else 'DIFFERS from'} the materialised one")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, versions, GPU").set_defaults(run=info)
    p = sub.add_parser("demo", help="indexer_topk on a built-in problem, checked against the materialised path")
    p.add_argument("--n", type=int, default=0, help="sequence length (default 4096 on CPU, 32768 on GPU)")
    p.add_argument("--heads", type=int, default=64, help="indexer heads H (default 64, DeepSeek-V3.2)")
    p.add_argument("--dim", type=int, default=128, help="indexer head dim D (default 128)")
    p.add_argument("--topk", type=int, default=2048, help="keys kept per query (default 2048)")
    p.add_argument("--backend", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=demo)
    from .io.log_cli import add_commands

    add_commands(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
