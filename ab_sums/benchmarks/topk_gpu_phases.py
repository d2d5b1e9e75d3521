"""Where one hs.topk launch spends its time, phase by phase, on the GPU.

Builds an instrumented copy of cuda/topk.cu (the same source with a
``%globaltimer`` read by thread 0 of every block at each phase boundary,
after a block barrier), runs the default plan of each configuration, checks
its indices against the real kernel's, and reports, for the blocks that
finish a row (the only block of a row, or its last chunk), the median over
launches of each phase in microseconds:

    sample     the threshold from the sampled keys
    pass       the read pass (keys above T to the buffer)
    gather     chunked rows: waiting for the row's other blocks and
               gathering their candidates (0 with one block per row)
    fallback   the exact radix-select path when the sample missed
    resolve    cut to k, or the ties of T taken
    sort       the final sort and the output write
    total      from the first block's start to this block's end

The marks add barriers, so the total runs a little above the real kernel's
device time (benchmarks/topk_gpu_breakdown.py measures that).

    python -m benchmarks.topk_gpu_phases
    python -m benchmarks.topk_gpu_phases --rows 1 --n 1048576 --k 4096 --dtype bfloat16 --data random ascending
"""
from __future__ import annotations

import argparse

import numpy as np

from .common import gpu_device, write_results
from .topk_gpu import DATA, add_shape_arguments, make_rows

PHASES = ["sample", "pass", "gather", "fallback", "resolve", "sort"]
CONFIGS = [(1, 1 << 20, 4096, "bfloat16"), (1, 1 << 20, 4096, "float32"), (64, 131072, 4096, "bfloat16"),
           (1024, 131072, 2048, "float32")]
MAX_BLOCKS = 1 << 16  # the instrumented build records this many blocks

# (anchor in cuda/topk.cu, whether the mark goes before it, else after it):
# marks 0..6 in order bound the phases.
_ANCHORS = [
    ("    Layout L = make_layout<D>(row, n, chunks * WARPS);\n", False),
    ("    if (threadIdx.x == 0) sh.n_gt = 0;\n    __syncthreads();\n    run_pass<D>", True),
    ("    if (chunks > 1) {\n        if (!gather_chunks", True),
    ("    u32 n_gt = sh.n_gt;\n", True),
    ("    if (n_gt > k) cut<D>", True),
    ("    out_idx += (size_t)row_id * k;\n", True),
    ("    else sort_and_write<D, 16>(row, k, k_pad, by_key, key, idx, sh, out_idx, out_val);\n", False),
]
_PRELUDE = f"""
__device__ unsigned long long hs_phase[{MAX_BLOCKS} * 8];
__device__ __forceinline__ unsigned long long hs_now() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}}
#define MARK(i) do {{ __syncthreads(); if (threadIdx.x == 0) hs_phase[blockIdx.x * 8 + (i)] = hs_now(); }} while (0)
"""


def instrumented_source(source: str) -> str:
    """cuda/topk.cu with the phase marks; fails if an anchor has moved."""
    for i, (anchor, before) in enumerate(_ANCHORS):
        if source.count(anchor) != 1:
            raise RuntimeError(f"cuda/topk.cu changed: anchor not found once: {anchor!r}")
        mark = f"    MARK({i});\n"
        source = source.replace(anchor, mark + anchor if before else anchor + mark)
    return source.replace("namespace {\n", _PRELUDE + "namespace {\n", 1)


def measure(cp, torch, gpu, rows: int, n: int, k: int, dtype: str, data: str, launches: int) -> dict:
    from hyscale_core.gpu.module import cuda_source_dir, multiprocessor_count

    x = make_rows(cp, torch, data, (rows, n), dtype, 0)[0]
    device = cp.cuda.Device().id
    plan = gpu.plan(rows, n, k, x.dtype.itemsize, multiprocessor_count(device))
    launch = gpu.prepare(rows, n, k, x.dtype, True, True, plan, device)
    if launch.grid[0] > MAX_BLOCKS:
        raise ValueError(f"{launch.grid[0]} blocks: the instrumented build records {MAX_BLOCKS}")
    folder = cuda_source_dir()
    options = ("-std=c++17", f"-I{folder}", f"-DHS_TOPK_DTYPE={gpu._DTYPE_CODES[dtype]}",
               f"-DHS_TOPK_THREADS={plan.threads}")
    module = cp.RawModule(code=instrumented_source((folder / "topk.cu").read_text()), options=options)
    kernel = module.get_function(f"topk_{dtype}_largest")
    kernel.max_dynamic_shared_size_bytes = gpu.MAX_DYNAMIC_SMEM
    marks = cp.ndarray((MAX_BLOCKS * 8,), cp.uint64, module.get_global("hs_phase"))
    ws = done = gpu.null_pointer()
    if launch.ws_bytes:
        ws, done = gpu._scratch(cp, rows, launch.ws_bytes, device)
    out_idx, out_val = cp.empty((rows, k), cp.int64), cp.empty((rows, k), x.dtype)
    per_launch = []
    for _ in range(launches + 1):  # the first launch warms up
        marks.fill(0)
        kernel(launch.grid, launch.block, (x, launch.args, ws, done, out_idx, out_val), shared_mem=launch.smem)
        t = marks[: launch.grid[0] * 8].get().reshape(-1, 8).astype(np.int64)
        finishing = t[t[:, 6] != 0]
        spans = np.diff(finishing[:, :7], axis=1)
        if plan.chunks == 1:
            spans[:, 2] = 0  # no gather without chunks
        totals = finishing[:, 6] - t[:, 0].min()
        per_launch.append(np.concatenate([np.median(spans, axis=0), [np.median(totals)]]) / 1e3)
    if not bool((gpu.run(cp, x, k, launch, device)[1] == out_idx).all()):
        raise AssertionError(f"[{rows}, {n}] {dtype} {data} k={k}: the instrumented build selected differently")
    us = np.median(np.array(per_launch[1:]), axis=0)
    row = {"bench": "topk_gpu_phases", "config": {"rows": rows, "n": n, "k": k, "dtype": dtype, "data": data},
           "plan": {"chunks": plan.chunks, "threads": plan.threads, "sample_m": plan.sample_m, "cap": plan.cap},
           "phases_us": {name: round(float(v), 1) for name, v in zip(PHASES + ["total"], us)}}
    print(f"[{rows}, {n}] {dtype:8s} k={k:<5d} {data:12s} chunks {plan.chunks:2d} threads {plan.threads}: " +
          " ".join(f"{name} {v:6.1f}" for name, v in zip(PHASES + ["total"], us)) + " us", flush=True)
    return row


def main(argv=None) -> None:
    import cupy as cp
    import torch

    from hyscale_core.ops.topk import gpu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--data", nargs="+", default=["random", "ascending"], choices=DATA)
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    configs = [(args.rows, args.n, args.k, args.dtype)] if args.rows else CONFIGS
    results = [measure(cp, torch, gpu, *config, data, args.launches) for config in configs for data in args.data]
    from pathlib import Path

    print(f"wrote {write_results('topk_gpu_phases', gpu_device(), results, Path(args.out) if args.out else None)}")


if __name__ == "__main__":
    main()
