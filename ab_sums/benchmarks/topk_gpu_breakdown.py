"""Where hs.topk's time goes on the GPU, for one or more configurations.

For each configuration, hs.topk and torch.topk side by side:

- ``call``: what benchmarks/topk_gpu.py reports, CUDA events around one
  call; on an idle GPU that includes the host time before the launch.
- ``host``: host time to issue one call (calls issued back to back, no
  synchronisation, averaged).
- ``device``: device time of one call, from a CUDA graph of ``--graph``
  calls replayed between events (no host work inside).

and, for hs.topk, the launch plan. ``--profile`` prints the host profile of
hs.topk's calls (cProfile, top entries by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from .common import copies_for, gpu_device, time_gpu, write_results
from .topk_gpu import DATA, make_rows


def host_ms(fn, calls: int = 200) -> float:
    """Host milliseconds per call of ``fn`` issued back to back."""
    import cupy as cp

    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    elapsed = (time.perf_counter() - start) / calls * 1e3
    cp.cuda.Device().synchronize()
    return elapsed


def cupy_graph_ms(fn, calls: int, replays: int = 10) -> float:
    """Device milliseconds per call of ``fn`` captured ``calls`` times in a CuPy graph."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(3):  # the pool and the per-stream scratch hold their blocks before capture
            fn(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(calls):
            fn(i)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(replays):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / calls)
    return statistics.median(times)


def torch_graph_ms(torch, fn, calls: int, replays: int = 10) -> float:
    """Device milliseconds per call of ``fn`` captured ``calls`` times in a torch graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def profile_host(fn, calls: int = 500, top: int = 15) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` entries by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(calls):
        fn(i)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def measure(cp, torch, rows: int, n: int, k: int, dtype: str, data: str, graph_calls: int, profile: bool) -> dict:
    """One result row: call, host and device milliseconds of hs.topk and torch.topk."""
    import hyscale_core as hs
    from hyscale_core.gpu.module import multiprocessor_count
    from hyscale_core.ops.topk import gpu

    itemsize = 4 if dtype == "float32" else 2
    inputs = [make_rows(cp, torch, data, (rows, n), dtype, seed) for seed in range(copies_for(rows * n * itemsize))]
    count = len(inputs)

    def hs_call(i):
        return hs.topk(inputs[i % count][0], k)

    def torch_call(i):
        return torch.topk(inputs[i % count][1], k)

    plan = gpu.plan(rows, n, k, itemsize, multiprocessor_count(cp.cuda.Device().id))
    row = {"bench": "topk_gpu_breakdown", "config": {"rows": rows, "n": n, "k": k, "dtype": dtype, "data": data},
           "plan": {"chunks": plan.chunks, "cap": plan.cap, "sample_m": plan.sample_m, "threads": plan.threads}}
    for name, fn, graph in (("hs", hs_call, lambda f: cupy_graph_ms(f, graph_calls)),
                            ("torch", torch_call, lambda f: torch_graph_ms(torch, f, graph_calls))):
        row[name] = {"call_ms": round(time_gpu(fn, repeats=20), 4), "host_ms": round(host_ms(fn), 4),
                     "device_ms": round(graph(fn), 4)}
    line = (f"[{rows}, {n}] {dtype} {data} k={k}: " +
            "; ".join(f"{name} call {row[name]['call_ms']:.4f} host {row[name]['host_ms']:.4f} "
                      f"device {row[name]['device_ms']:.4f} ms" for name in ("hs", "torch")) + f"; {plan}")
    print(line, flush=True)
    if profile:
        print(profile_host(hs_call), flush=True)
    return row


def main(argv=None) -> None:
    import cupy as cp
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1024])
    parser.add_argument("--n", type=int, nargs="+", default=[131072], help="row lengths, one per --rows entry")
    parser.add_argument("--k", type=int, nargs="+", default=[2048])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--data", nargs="+", default=["random"], choices=DATA)
    parser.add_argument("--graph", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--profile", action="store_true", help="print hs.topk's host profile")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    if len(args.rows) != len(args.n):
        parser.error("give one --n per --rows")
    results = []
    for rows, n in zip(args.rows, args.n):
        for dtype in args.dtype:
            for data in args.data:
                for k in args.k:
                    results.append(measure(cp, torch, rows, n, k, dtype, data, args.graph, args.profile))
                cp.get_default_memory_pool().free_all_blocks()
    from pathlib import Path

    print(f"wrote {write_results('topk_gpu_breakdown', gpu_device(), results, Path(args.out) if args.out else None)}")


if __name__ == "__main__":
    main()
