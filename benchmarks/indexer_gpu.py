"""GPU indexer top-k at DSA shapes: streaming hs.indexer_topk against a plain
torch indexer (chunked bf16 matmul, relu, head-weighted sum, torch.topk),
hs.indexer_scores + torch.topk, hs.indexer_scores + hs.topk (both chunked
over queries so the table chunk fits), and the bf16 GEMM floor in two forms:
the useful, causal FLOPs at the matmul rate measured once per run on
8192^3 products (``floor_ms``, ``x_floor``), and torch bf16 matmuls with
those same FLOPs run back to back in each configuration (``floor_run_ms``,
``x_floor_run``), which last as long as the work they stand for and so run
at the clock the card's power limit allows over that time.

FLOPs: 2 * H * D per visible (query, key) pair; a causal sequence of length L
has L (L + 1) / 2 pairs. Peak memory: device memory the call took beyond its
inputs (CuPy pool high-water; torch peers: torch's max allocated).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .common import gpu_device, matmul_rate_tflops, matmul_run_ms, table, write_results

PACKED = [50000, 30000, 20000, 15000, 10000, 6072]  # 131072 tokens


def inputs(cp, n, heads, dim, seed=0):
    from hyscale_core._dtypes import bfloat16

    rng = cp.random.default_rng(seed)
    q = rng.standard_normal((n, heads, dim), dtype=cp.float32).astype(bfloat16)
    k = rng.standard_normal((n, dim), dtype=cp.float32).astype(bfloat16)
    w = rng.standard_normal((n, heads), dtype=cp.float32) / np.float32(np.sqrt(heads))
    return q, k, w


def ranges(n, lengths):
    from hyscale_core.ops.indexer.ranges import candidate_ranges

    cu = None if lengths is None else np.concatenate([[0], np.cumsum(lengths)])
    return cu, candidate_ranges(n, n, True, None, cu)


def torch_indexer(torch, q, k, w, topk, lo, hi, chunk):
    """Plain torch: per query chunk, logits over the chunk's key range, relu, weighted sum, mask, topk."""
    out = torch.empty((q.shape[0], topk), dtype=torch.int64, device="cuda")
    for t0 in range(0, q.shape[0], chunk):
        t1 = min(t0 + chunk, q.shape[0])
        s0, s1 = int(lo[t0:t1].min()), int(hi[t0:t1].max())
        logits = torch.einsum("thd,sd->ths", q[t0:t1], k[s0:s1]).float().relu_()
        scores = torch.einsum("th,ths->ts", w[t0:t1], logits)
        s = torch.arange(s0, s1, device="cuda")[None, :]
        lo_t = torch.as_tensor(lo[t0:t1], device="cuda")[:, None]
        hi_t = torch.as_tensor(hi[t0:t1], device="cuda")[:, None]
        scores.masked_fill_((s < lo_t) | (s >= hi_t), float("-inf"))
        kept = min(topk, s1 - s0)
        out[t0:t1, :kept] = torch.topk(scores, kept).indices + s0
    return out


def table_then_topk(hs, cp, q, k, w, topk, cu, chunk, use_torch, torch):
    n = q.shape[0]
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        scores = hs.indexer_scores(q[t0:t1], k, w[t0:t1], q_pos=np.arange(t0, t1), cu_seqlens=cu)
        if use_torch:
            torch.topk(torch.from_dlpack(scores), topk)
        else:
            hs.topk(scores, topk)
        del scores


def peak_extra(cp, fn):
    """(ms of one run, peak bytes of the CuPy allocations made during it: the
    output included, the inputs not)."""
    from hyscale_core.gpu.memory import pool_peak

    cp.cuda.Device().synchronize()
    with pool_peak() as memory:
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        ms = (time.perf_counter() - start) * 1e3
    return ms, memory.peak


def run_config(args, cp, torch, hs, n, heads, lengths, rate):
    q, k, w = inputs(cp, n, heads, args.dim)
    cu, (lo, hi) = ranges(n, lengths)
    pairs = float((hi - lo).sum())
    flops = 2.0 * heads * args.dim * pairs
    floor_ms = flops / (rate * 1e12) * 1e3
    label = "packed" if lengths else "causal"
    config = {"n": n, "heads": heads, "dim": args.dim, "topk": args.topk, "mask": label}
    hs.indexer_topk(q[:256], k[:256], w[:256], args.topk, q_pos=np.arange(256))  # compile
    impls = {"hs.indexer_topk": lambda: hs.indexer_topk(q, k, w, args.topk, cu_seqlens=cu)}
    floor_run = matmul_run_ms(torch, flops, 1 if n >= 1 << 20 else args.repeats)
    torch.cuda.empty_cache()
    print(f"  N={n} H={heads} {label}: {'bf16 matmul, same FLOPs':30s} {floor_run:10.1f} ms  "
          f"{flops / (floor_run * 1e-3) / 1e12:6.1f} TFLOP/s", flush=True)
    if n <= args.max_peer_n:
        tq, tk, tw = (torch.from_dlpack(x) for x in (q, k, w))
        impls["torch plain indexer"] = lambda: torch_indexer(torch, tq, tk, tw, args.topk, lo, hi, args.chunk)
        impls["hs.indexer_scores+torch.topk"] = lambda: table_then_topk(hs, cp, q, k, w, args.topk, cu, 16384, True, torch)
        impls["hs.indexer_scores+hs.topk"] = lambda: table_then_topk(hs, cp, q, k, w, args.topk, cu, 16384, False, torch)
    rows = []
    for impl, fn in impls.items():
        repeats = 1 if n >= 1 << 20 else args.repeats
        if n < 1 << 20:
            fn()  # warm-up (kernels were compiled on the small problem above)
        runs = [peak_extra(cp, fn) for _ in range(repeats)]
        ms = float(np.median([r[0] for r in runs]))
        if impl.startswith("torch"):
            torch.cuda.reset_peak_memory_stats()
            fn()
            extra = torch.cuda.max_memory_allocated()
        else:
            extra = max(r[1] for r in runs)
        torch.cuda.empty_cache()  # give the torch peer's cache back before the next impl
        cp.get_default_memory_pool().free_all_blocks()
        rows.append({"bench": "indexer_gpu", "config": config, "impl": impl, "median_ms": round(ms, 2),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "x_floor": round(ms / floor_ms, 2),
                     "floor_ms": round(floor_ms, 2), "x_floor_run": round(ms / floor_run, 2),
                     "floor_run_ms": round(floor_run, 2), "peak_extra_gib": round(extra / 2**30, 2),
                     "index_table_gib": round(n * args.topk * 4 / 2**30, 2)})
        print(f"  N={n} H={heads} {label}: {impl:30s} {ms:10.1f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s  "
              f"x{rows[-1]['x_floor']} floor  x{rows[-1]['x_floor_run']} run floor  "
              f"extra {rows[-1]['peak_extra_gib']} GiB", flush=True)
    hs_ms = rows[0]["median_ms"]
    for r in rows:
        r["hs_speedup"] = round(r["median_ms"] / hs_ms, 2)
    del q, k, w
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=128, help="query chunk of the torch peer")
    parser.add_argument("--max-peer-n", type=int, default=131072, help="peers run up to this N")
    parser.add_argument("--no-packed", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rate = matmul_rate_tflops(torch)
    print(f"bf16 matmul rate {rate:.0f} TFLOP/s (8192^3)", flush=True)
    rows = []
    for heads in args.heads:
        for n in args.sizes:
            rows += run_config(args, cp, torch, hs, n, heads, None, rate)
        if not args.no_packed:
            rows += run_config(args, cp, torch, hs, sum(PACKED), heads, PACKED, rate)
    from pathlib import Path

    path = write_results("indexer_gpu", gpu_device(), rows, Path(args.out) if args.out else None)
    short = [{"N": r["config"]["n"], "H": r["config"]["heads"], "mask": r["config"]["mask"], "impl": r["impl"],
              "ms": r["median_ms"], "TFLOP/s": r["tflops"], "floor": r["floor_ms"], "x_floor": r["x_floor"],
              "run_floor": r["floor_run_ms"], "x_run_floor": r["x_floor_run"], "hs_x": r["hs_speedup"],
              "extraGiB": r["peak_extra_gib"]} for r in rows]
    print(table(short, ["N", "H", "mask", "impl", "ms", "TFLOP/s", "floor", "x_floor", "run_floor", "x_run_floor",
                        "hs_x", "extraGiB"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
