"""One streaming indexer top-k and one score-table call on the GPU, to be
run under Nsight Compute (which unit holds the tile loop back).

    ncu --clock-control none -k regex:"indexer_(topk|scores)_kernel" -c 3 --set full \\
        python -m benchmarks.indexer_profile --n 32768 --heads 64

A single causal sequence of bf16 q [n, heads, dim], k [n, dim], float32 w
[n, heads] (benchmarks/indexer_gpu.py's inputs); the top-k runs once per
value of --ks, then the score table once (unless --no-table: it takes
4 N^2 bytes, 64 GiB at N = 131072).
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs

    from .indexer_gpu import inputs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--no-table", action="store_true", help="skip the score table")
    args = parser.parse_args(argv)
    q, k, w = inputs(cp, args.n, args.heads, args.dim)
    for topk in args.ks:
        hs.indexer_topk(q, k, w, topk)
    if not args.no_table:
        hs.indexer_scores(q, k, w, q_pos=np.arange(args.n))
    cp.cuda.Device().synchronize()
    print(f"indexer top-k at k = {args.ks}{'' if args.no_table else ' and the score table'} done: "
          f"n={args.n} heads={args.heads}")


if __name__ == "__main__":
    main()
