"""GPU sparse attention on one index table given in several slot orders.

Each query's keys are gathered block by block in slot order, so the order of
a row decides which kv rows the queries in flight read at the same time,
and so the L2 hit rate once kv outgrows the L2 (151 MB at N = 131072). The
outputs differ only by rounding: a row's keys are the same multiset.

Orders (--orders):
- "given": the benchmark's uniform table (benchmarks/sparse_attention_gpu.py)
  as drawn;
- "sorted": each row's keys ascending (-1 slots last);
- "swept:Q": sorted, then rotated left by floor(t k / Q) mod v slots (v the
  row's count of keys), so that if Q queries are in flight and start at an
  even rate, each starts at the keys the others are reading.

Rows: "hs fwd" (hs.sparse_attention) and "hs bwd" (hs.sparse_attention_backward,
out and lse from the same order's forward) per order; TFLOP/s as in
sparse_attention_gpu (2 h k (d_qk + d_v) per query forward, 2.5x backward).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import gpu_device, table, time_gpu, write_results
from .sparse_attention_gpu import forward_flops, inputs, to_cupy


def sorted_rows(torch, idx):
    """idx [n, k] int32 with each row ascending, -1 slots last."""
    top = torch.iinfo(torch.int32).max
    rows = torch.where(idx < 0, top, idx).sort(dim=1).values
    return torch.where(rows == top, -1, rows)


def swept_rows(torch, idx, in_flight: int):
    """sorted_rows(idx) with row t rotated left by floor(t k / in_flight) mod v slots among its v keys."""
    rows = sorted_rows(torch, idx)
    n, k = rows.shape
    v = (rows >= 0).sum(dim=1, keepdim=True).clamp(min=1)
    t = torch.arange(n, device=rows.device, dtype=torch.int64)[:, None]
    shift = (t * k // in_flight) % v
    j = torch.arange(k, device=rows.device, dtype=torch.int64)[None, :]
    source = torch.where(j < v, (j + shift) % v, j)
    return rows.gather(1, source)


def ordered(torch, idx, order: str):
    if order == "given":
        return idx
    if order == "sorted":
        return sorted_rows(torch, idx)
    if order.startswith("swept:"):
        return swept_rows(torch, idx, int(order.split(":", 1)[1]))
    raise SystemExit(f"unknown order {order!r}: given, sorted or swept:Q")


def run_config(args, cp, torch, hs, n, h):
    tq, tkv, tdout, tidx = inputs(torch, n, h, args.topk)
    q, kv, dout = (to_cupy(cp, x, torch) for x in (tq, tkv, tdout))
    fwd_flops = forward_flops(n, h, args.topk)
    rows = []
    for order in args.orders:
        idx = to_cupy(cp, ordered(torch, tidx, order).contiguous(), torch)
        times = {"hs fwd": time_gpu(lambda i: hs.sparse_attention(q, kv, idx), repeats=args.repeats, warmup=1)}
        if not args.forward_only:
            out, lse = hs.sparse_attention(q, kv, idx)
            times["hs bwd"] = time_gpu(lambda i: hs.sparse_attention_backward(q, kv, idx, out, lse, dout),
                                       repeats=args.repeats, warmup=1)
            del out, lse
        for name, ms in times.items():
            flops = fwd_flops * (2.5 if name == "hs bwd" else 1.0)
            rows.append({"bench": "sparse_attention_order", "config": {"n": n, "h": h, "k": args.topk,
                                                                         "order": order},
                         "impl": name, "median_ms": round(ms, 3), "tflops": round(flops / (ms * 1e-3) / 1e12, 1)})
            print(f"  N={n} h={h} {order:10s} {name}: {ms:9.2f} ms", flush=True)
        del idx
    del q, kv, dout, tq, tkv, tdout, tidx
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--orders", nargs="+", default=["given", "sorted", "swept:132"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-only", action="store_true", help="time only the forward")
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = []
    for h in args.heads:
        for n in args.sizes:
            rows += run_config(args, cp, torch, hs, n, h)
    path = write_results("sparse_attention_order", gpu_device(), rows, Path(args.out) if args.out else None)
    short = [{"N": r["config"]["n"], "h": r["config"]["h"], "order": r["config"]["order"], "impl": r["impl"],
              "ms": r["median_ms"], "TFLOP/s": r["tflops"]} for r in rows]
    print(table(short, ["N", "h", "order", "impl", "ms", "TFLOP/s"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
