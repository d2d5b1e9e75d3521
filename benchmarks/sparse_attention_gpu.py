"""GPU sparse attention at MLA shapes (d_qk = 576, d_v = 512, k = 2048, bf16):
hs.sparse_attention forward and hs.sparse_attention_backward (tensor-core
kernels, deterministic dkv) against a torch gather + einsum implementation
of the same function (forward; autograd backward), and the floor.

FLOPs as FlashMLA counts them: 2 h k (d_qk + d_v) per query forward, 2.5x
that backward. Floor: the larger of the FLOPs at the bf16 matmul rate and
the gathered kv bytes (k d_qk 2 per query, read once for all heads) plus q
and out at the copy bandwidth, both rates measured in the same run.

Rows: "hs fwd" is the public call without probs (its argument checks
included; the backend then skips the probs pass); "hs fwd+probs" the public
call with return_probs=True (a second pass recomputes the logits once lse
is known); "hs bwd" the public backward (bfloat16 dkv rows), "hs bwd
precise" the same with precise_dkv=True (float32 rows). With --breakdown,
"hs bwd phase: ..." rows estimate each of the default backward's three
phases, the key sort alone (part of the third) and a plain write of the
rows' bytes (the rows kernel's memory floor), from its first query chunk
timed, times the chunk count (--phases: only the named ones); "hs bwd one
stream" is the backward without SMs set aside for its per-key sums beside
the dq kernel (--set-aside sets their number). torch runs chunked over
queries (the gathered [C, k, 576] block bounds memory); "torch
bwd" is its forward + autograd backward minus its forward. --impls times
only the named hs rows (for A/B runs of one kernel; the flag alone, with
--breakdown, times only the phases).

Indices (--table): "uniform" (default), for query t k keys drawn uniformly
(with replacement) from [0, max(t + 1, k)); "indexer", the selection of
hs.indexer_topk on random bf16 indexer inputs (H_I = 64, D = 128, weights
N(0, 1 / H_I)) with query t at position max(t, k - 1), so that it selects
from the same range, distinct keys, best first. Both are causal after the
first k rows and have no -1 slots. A key of larger norm scores higher for
every query, so the indexer's table could favour some keys; with random
keys it barely does (NOTES.md). The config records the largest count of one
key and the share of the slots held by the 16384 most selected keys (19 MB
of kv rows). The uniform table is the L2's worst case.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from time import perf_counter

import numpy as np

from .common import copy_bandwidth_gbs, gpu_device, matmul_rate_tflops, table, time_gpu, write_results

D_QK, D_V = 576, 512
IMPLS = ("hs fwd", "hs fwd+probs", "hs bwd", "hs bwd precise", "hs bwd one stream")


def inputs(torch, n, h, k, seed=0):
    """bf16 q [n, h, 576], kv [n, 576], dout [n, h, 512] (torch) and int32 indices [n, k]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((n, h, D_QK), generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn((n, D_QK), generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn((n, h, D_V), generator=gen, device="cuda", dtype=torch.bfloat16)
    span = torch.clamp(torch.arange(1, n + 1, device="cuda"), min=k)[:, None]
    idx = (torch.rand((n, k), generator=gen, device="cuda") * span).floor_().to(torch.int32)
    return q, kv, dout, torch.minimum(idx, span.to(torch.int32) - 1)


INDEXER_HEADS, INDEXER_DIM = 64, 128
HOT_KEYS = 16384


def indexer_table(cp, torch, hs, n, k, seed=0):
    """int32 [n, k] (torch): hs.indexer_topk on random indexer inputs, query t
    at position max(t, k - 1) (see the module's docstring)."""
    from hyscale_core._dtypes import bfloat16

    rng = cp.random.default_rng(seed)
    q = rng.standard_normal((n, INDEXER_HEADS, INDEXER_DIM), dtype=cp.float32).astype(bfloat16)
    keys = rng.standard_normal((n, INDEXER_DIM), dtype=cp.float32).astype(bfloat16)
    w = rng.standard_normal((n, INDEXER_HEADS), dtype=cp.float32) / np.float32(np.sqrt(INDEXER_HEADS))
    q_pos = cp.maximum(cp.arange(n, dtype=cp.int32), k - 1)
    idx = hs.indexer_topk(q, keys, w, k, causal=True, q_pos=q_pos)
    if int(idx.min()) < 0:
        raise RuntimeError("the indexer table has -1 slots; N must be at least k")
    return torch.from_dlpack(idx)


def table_stats(torch, idx, n):
    """How unevenly the table selects keys: the largest count of one key, and
    the share of slots whose key is among the HOT_KEYS most selected."""
    counts = torch.bincount(idx.reshape(-1).long(), minlength=n)
    hot = torch.topk(counts, min(HOT_KEYS, n)).values.sum()
    return {"max_key_count": int(counts.max()), "hot_keys": min(HOT_KEYS, n),
            "hot_key_slot_share": round(float(hot) / idx.numel(), 4)}


def forward_flops(n: int, h: int, k: int) -> float:
    """The forward's FLOPs as FlashMLA counts them: 2 h k (d_qk + d_v) per query (the backward: 2.5x)."""
    return 2.0 * h * k * (D_QK + D_V) * n


def to_cupy(cp, x, torch):
    """Zero-copy CuPy view of a torch tensor (bf16 through its bits)."""
    from hyscale_core._dtypes import bfloat16

    if x.dtype == torch.bfloat16:
        return cp.from_dlpack(x.view(torch.int16)).view(cp.uint16).view(bfloat16)
    return cp.from_dlpack(x)


def torch_attention(torch, q, kv, idx, scale):
    """out [C, h, 512] (bf16) and lse of a query chunk: gather, einsum, softmax, einsum."""
    sel = kv[idx.long()]
    logits = torch.einsum("thd,tkd->thk", q, sel).float() * scale
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("thk,tkd->thd", p.to(q.dtype), sel[..., :D_V]), torch.logsumexp(logits, dim=-1)


def torch_forward(torch, q, kv, idx, scale, chunk):
    with torch.no_grad():
        for t0 in range(0, q.shape[0], chunk):
            torch_attention(torch, q[t0:t0 + chunk], kv, idx[t0:t0 + chunk], scale)


def torch_forward_backward(torch, q, kv, idx, dout, scale, chunk):
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    for t0 in range(0, q.shape[0], chunk):
        out, _ = torch_attention(torch, q[t0:t0 + chunk], kv, idx[t0:t0 + chunk], scale)
        out.backward(dout[t0:t0 + chunk])


def one_stream_backward(hs, q, kv, idx, out, lse, dout):
    """The backward with every chunk's kernels on the current stream (no SMs
    set aside for the per-key sums): what running them beside the dq kernel buys."""
    from hyscale_core.ops.sparse_attention import gpu

    spare, gpu.SET_ASIDE_SMS = gpu.SET_ASIDE_SMS, 0
    try:
        return hs.sparse_attention_backward(q, kv, idx, out, lse, dout)
    finally:
        gpu.SET_ASIDE_SMS = spare


PHASES = {"dq": "dq kernel", "rows": "dkv rows kernel", "sort": "key sort", "sums": "sort + per-key sums",
          "fill": "write of the rows' bytes (fill)"}


def backward_phases(cp, q, kv, idx, out, lse, dout, scale, repeats, only=None):
    """ms of the backward's phases (``only``: keys of PHASES, default all) on
    its first query chunk, times the number of chunks: {phase name: (ms,
    chunk queries)}."""
    from hyscale_core.gpu.segments import key_segments
    from hyscale_core.ops.sparse_attention import gpu

    n, h, _ = q.shape
    keys = only or list(PHASES)
    passes, rows_as = gpu.head_passes(h), gpu.dkv_rows_dtype(q, precise_dkv=False)
    defines, out16, dout16, lse32 = gpu.backward_operands(q, kv, out, lse, dout, D_V, scale)
    c = next(gpu.query_chunks(n, passes * idx.shape[1], rows_as))[1]
    part = slice(0, c)
    dq = cp.empty(q[part].shape, dtype=cp.uint16)
    operands = (q[part], kv, idx[part], out16[part], dout16[part], lse32[part], dq, scale, defines)
    phases = {"dq": lambda i: gpu.dq_and_images(*operands),
              "sort": lambda i: key_segments(idx[part], cp.int32, kv.shape[0])}
    if {"rows", "sums", "fill"} & set(keys):  # these start from a chunk's images and rows
        images = gpu.dq_and_images(*operands)
        rows = gpu.dkv_rows(q[part], dout16[part], idx[part], images, scale, defines, rows_as)
        dkv = cp.zeros(kv.shape, dtype=cp.float32)
        phases.update(rows=lambda i: gpu.dkv_rows(q[part], dout16[part], idx[part], images, scale, defines, rows_as),
                      sums=lambda i: gpu.add_rows_by_key(idx[part], rows, passes, dkv, defines),
                      fill=lambda i: rows.fill(0))
    return {PHASES[key]: (time_gpu(phases[key], repeats=repeats, warmup=1) * n / c, c) for key in keys}


def run_config(args, cp, torch, hs, n, h, rates):
    k, scale = args.topk, 1.0 / np.sqrt(D_QK)
    tq, tkv, tdout, tidx = inputs(torch, n, h, k)
    if args.table == "indexer":
        if n < k:
            raise SystemExit(f"--table indexer needs N >= k, got N = {n}, k = {k}")
        print(f"  N={n} h={h}: the indexer's table ...", end="", flush=True)
        start = perf_counter()
        tidx = indexer_table(cp, torch, hs, n, k)
        print(f" {perf_counter() - start:.1f} s", flush=True)
    stats = table_stats(torch, tidx, n)
    q, kv, dout, idx = (to_cupy(cp, x, torch) for x in (tq, tkv, tdout, tidx))
    fwd_flops = forward_flops(n, h, k)
    fwd_bytes = n * (k * D_QK * 2 + h * (D_QK + D_V) * 2)
    floors = {"fwd": max(fwd_flops / rates["flops"], fwd_bytes / rates["bytes"]) * 1e3}
    floors["fwd+probs"] = floors["fwd"]
    floors["bwd"] = max(2.5 * fwd_flops / rates["flops"], 2 * fwd_bytes / rates["bytes"]) * 1e3
    out, lse = hs.sparse_attention(q, kv, idx)
    impls = {
        "hs fwd": lambda i: hs.sparse_attention(q, kv, idx),
        "hs fwd+probs": lambda i: hs.sparse_attention(q, kv, idx, return_probs=True),
        "hs bwd": lambda i: hs.sparse_attention_backward(q, kv, idx, out, lse, dout),
        "hs bwd precise": lambda i: hs.sparse_attention_backward(q, kv, idx, out, lse, dout, precise_dkv=True),
    }
    if args.breakdown:
        impls["hs bwd one stream"] = lambda i: one_stream_backward(hs, q, kv, idx, out, lse, dout)
    if args.impls is not None:
        impls = {name: fn for name, fn in impls.items() if name in args.impls}
    check = {}
    if n <= args.max_peer_n:
        c = args.chunk
        ref_out, ref_lse = torch_attention(torch, tq[:c], tkv, tidx[:c], scale)
        check = {"out_max_diff_vs_torch": float((torch.from_dlpack(out[:c].view(cp.int16)).view(torch.bfloat16)
                                                 .float() - ref_out.float()).abs().max()),
                 "lse_max_diff_vs_torch": float((torch.from_dlpack(lse[:c]) - ref_lse).abs().max())}
        impls["torch fwd"] = lambda i: torch_forward(torch, tq, tkv, tidx, scale, c)
        impls["torch fwd+bwd"] = lambda i: torch_forward_backward(torch, tq, tkv, tidx, tdout, scale, c)
    times = {}
    for name, fn in impls.items():
        times[name] = time_gpu(fn, repeats=args.repeats, warmup=1)
        print(f"  N={n} h={h}: {name:14s} {times[name]:10.2f} ms", flush=True)
    if "torch fwd+bwd" in times:
        times["torch bwd"] = times.pop("torch fwd+bwd") - times["torch fwd"]
    phases = backward_phases(cp, q, kv, idx, out, lse, dout, scale, args.repeats, args.phases) if args.breakdown else {}
    from hyscale_core.ops.sparse_attention import gpu

    config = {"n": n, "h": h, "d_qk": D_QK, "d_v": D_V, "k": k, "dtype": "bfloat16", "table": args.table,
              "set_aside_sms": getattr(gpu, "SET_ASIDE_SMS", None), "min_chunks": getattr(gpu, "MIN_CHUNKS", None),
              **stats}
    rows = []
    for name, ms in times.items():
        kind = "bwd" if "bwd" in name else ("fwd+probs" if "probs" in name else "fwd")
        flops = fwd_flops * (2.5 if kind == "bwd" else 1.0)
        peer = times.get("torch " + ("bwd" if kind == "bwd" else "fwd"))
        rows.append({"bench": "sparse_attention_gpu", "config": config, "impl": name, "median_ms": round(ms, 3),
                     "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "floor_ms": round(floors[kind], 3),
                     "x_floor": round(ms / floors[kind], 2),
                     "x_torch": round(peer / ms, 2) if peer and name.startswith("hs") else None, **check})
    for name, (ms, chunk) in phases.items():
        share = round(ms / times["hs bwd"], 3) if "hs bwd" in times else None
        rows.append({"bench": "sparse_attention_gpu", "config": config, "impl": f"hs bwd phase: {name}",
                     "median_ms": round(ms, 3), "share_of_bwd": share,
                     "estimate": f"first chunk of {chunk} queries x {n / chunk:.2f}"})
    del q, kv, dout, idx, out, lse, tq, tkv, tdout, tidx
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--table", choices=("uniform", "indexer"), default="uniform",
                        help="the index table (see above; default uniform)")
    parser.add_argument("--chunk", type=int, default=128, help="query chunk of the torch peer")
    parser.add_argument("--max-peer-n", type=int, default=131072, help="the torch peer runs up to this N")
    parser.add_argument("--breakdown", action="store_true", help="also time the backward's phases")
    parser.add_argument("--impls", nargs="*", default=None, choices=IMPLS,
                        help="time only these of hs's rows (default: all; none with the flag alone; the torch "
                             "rows follow --max-peer-n)")
    parser.add_argument("--phases", nargs="+", default=None, choices=sorted(PHASES),
                        help="with --breakdown, only these phases (default: all)")
    parser.add_argument("--set-aside", type=int, default=None,
                        help="SMs the backward's per-key sums take beside the dq kernel (default: the library's "
                             "SET_ASIDE_SMS; 0: one stream)")
    parser.add_argument("--min-chunks", type=int, default=None,
                        help="the backward's query chunks at least where SMs are set aside (default: the library's "
                             "MIN_CHUNKS)")
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    from hyscale_core.ops.sparse_attention import gpu

    if args.set_aside is not None:
        gpu.SET_ASIDE_SMS = args.set_aside
    if args.min_chunks is not None:
        gpu.MIN_CHUNKS = args.min_chunks
    rates = {"flops": matmul_rate_tflops(torch) * 1e12, "bytes": copy_bandwidth_gbs() * 1e9}
    print(f"bf16 matmul {rates['flops'] / 1e12:.0f} TFLOP/s (8192^3), copy {rates['bytes'] / 1e9:.0f} GB/s",
          flush=True)
    rows = []
    for h in args.heads:
        for n in args.sizes:
            rows += run_config(args, cp, torch, hs, n, h, rates)
    for r in rows:
        r["matmul_tflops"] = round(rates["flops"] / 1e12, 1)
        r["copy_gbs"] = round(rates["bytes"] / 1e9, 1)
    path = write_results("sparse_attention_gpu", gpu_device(), rows, Path(args.out) if args.out else None)
    short = [{"N": r["config"]["n"], "h": r["config"]["h"], "table": r["config"]["table"], "impl": r["impl"],
              "ms": r["median_ms"],
              "TFLOP/s": r.get("tflops", ""), "x_floor": r.get("x_floor", ""), "x_torch": r.get("x_torch") or ""}
             for r in rows]
    print(table(short, ["N", "h", "table", "impl", "ms", "TFLOP/s", "x_floor", "x_torch"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
