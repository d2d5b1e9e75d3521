"""One sparse-attention forward and backward on the GPU, to be run under
Nsight Compute (the kernels' counters: which unit holds each kernel back).

    ncu --clock-control none \\
        -k regex:"sa_forward|sa_backward_dq|sa_backward_dkv_rows1_bf16|sa_dkv_segments_bf16" -c 4 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python -m benchmarks.sparse_attention_profile --n 4096 --heads 64

bf16 q [n, h, 576], kv [n, 576], dout [n, h, 512], k = 2048 keys per query
drawn uniformly from [0, max(t + 1, k)), as benchmarks/sparse_attention_gpu.py
draws them (CuPy's generator here, so no torch is needed).
"""
from __future__ import annotations

import argparse


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs
    from hyscale_core._dtypes import bfloat16
    from hyscale_core.gpu.convert import narrow

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--topk", type=int, default=2048)
    args = parser.parse_args(argv)
    n, h, k = args.n, args.heads, args.topk
    rng = cp.random.default_rng(0)
    q, kv, dout = (narrow(rng.standard_normal(shape, dtype=cp.float32), bfloat16)
                   for shape in ((n, h, 576), (n, 576), (n, h, 512)))
    span = cp.maximum(cp.arange(1, n + 1), k)[:, None]
    idx = cp.minimum(cp.floor(rng.random((n, k)) * span), span - 1).astype(cp.int32)
    out, lse = hs.sparse_attention(q, kv, idx)
    hs.sparse_attention_backward(q, kv, idx, out, lse, dout)
    cp.cuda.Device().synchronize()
    print(f"forward and backward done: n={n} h={h} k={k}")


if __name__ == "__main__":
    main()
