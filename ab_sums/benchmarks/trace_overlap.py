"""Diagnostic (branch sums-beside-dq): whether the per-key sums' CTAs ran on
an SM beside a dq-kernel CTA during one backward.

    python -m benchmarks.trace_overlap [--n 32768] [--heads 64]

Needs the hs_trace records of cuda/sparse_attention_bwd.cu on this branch:
each CTA of sa_backward_dq and sa_dkv_segments_bf16 appends (kind, SM,
clock64 at its start and end). Per SM the clocks are one counter, so a sums
CTA overlapped a dq CTA when their intervals on the same SM intersect.
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs
    from hyscale_core.gpu import module

    from .sparse_attention_gpu import inputs, to_cupy

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=64)
    args = parser.parse_args(argv)
    tq, tkv, tdout, tidx = inputs(torch, args.n, args.heads, 2048)
    q, kv, dout, idx = (to_cupy(cp, x, torch) for x in (tq, tkv, tdout, tidx))
    out, lse = hs.sparse_attention(q, kv, idx)
    hs.sparse_attention_backward(q, kv, idx, out, lse, dout)  # compiles and warms up
    cp.cuda.Device().synchronize()
    mod = module._load("sparse_attention_bwd", cp.cuda.Device().id, ("HS_SA_F16=0",))
    count = cp.ndarray((1,), cp.uint32, memptr=mod.get_global("hs_trace_count"))
    trace = cp.ndarray((1 << 20, 3), cp.uint64, memptr=mod.get_global("hs_trace"))
    count.fill(0)
    cp.cuda.Device().synchronize()
    hs.sparse_attention_backward(q, kv, idx, out, lse, dout)
    cp.cuda.Device().synchronize()
    n_rec = min(int(count.get()[0]), 1 << 20)
    rec = trace[:n_rec].get()
    kind, sm = rec[:, 0] >> np.uint64(32), rec[:, 0] & np.uint64(0xFFFFFFFF)
    t0, t1 = rec[:, 1].astype(np.int64), rec[:, 2].astype(np.int64)
    dq, sums = kind == 0, kind == 1
    beside, beside_cycles, sums_cycles = 0, 0, 0
    for s in np.unique(sm):
        d = np.where(dq & (sm == s))[0]
        u = np.where(sums & (sm == s))[0]
        if d.size == 0 or u.size == 0:
            continue
        d0, d1 = t0[d], t1[d]
        order = np.argsort(d0)
        d0, d1 = d0[order], d1[order]
        for i in u:
            j = np.searchsorted(d0, t1[i])  # dq CTAs that started before this sums CTA ended
            overlap = np.clip(np.minimum(d1[:j], t1[i]) - np.maximum(d0[:j], t0[i]), 0, None).sum()
            sums_cycles += t1[i] - t0[i]
            if overlap > 0:
                beside += 1
                beside_cycles += min(overlap, t1[i] - t0[i])
    print(f"N={args.n} h={args.heads}: {n_rec} records, {int(dq.sum())} dq CTAs, {int(sums.sum())} sums CTAs")
    print(f"sums CTAs that ran beside a dq CTA on their SM: {beside} of {int(sums.sum())} "
          f"({100.0 * beside / max(1, int(sums.sum())):.1f} %), "
          f"{100.0 * beside_cycles / max(1, sums_cycles):.1f} % of the sums' CTA cycles")


if __name__ == "__main__":
    main()
