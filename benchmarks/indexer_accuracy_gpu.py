"""Accuracy of the GPU indexer against a float64 reference: how far
``hs.indexer_scores`` is from the exact scores of its (rounded) inputs, and
how many of ``hs.indexer_topk``'s picks lie outside the exact top-k.

    python -m benchmarks.indexer_accuracy_gpu --n 4096 --heads 64 32 --ks 256 2048

Inputs: random bfloat16 q [N, H, D] and k [N, D] (standard normal), float32
w [N, H] ~ N(0, 1/H), one causal sequence. The reference is computed on the
GPU in float64 from the same rounded values. Per row: the largest |error|
over the row's largest |reference score|, both over the row's visible
keys; reported as the largest and the median over rows. Picks outside: over the rows with
more than k visible keys, the fraction of the selected keys that are not
in the reference's top k (exact ties in float64 are vanishingly rare for
random inputs, so this counts disagreements, not tie order). A kernel
change that trades score precision for speed shows here first (NOTES.md,
"the head sums on the tensor cores").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .common import gpu_device, write_results

QUERY_CHUNK = 64  # queries per float64 reference block ([chunk, H, N] float64 in memory)


def inputs(n: int, heads: int, dim: int, seed: int):
    from hyscale_core._dtypes import bfloat16

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, heads, dim)).astype(bfloat16)
    k = rng.standard_normal((n, dim)).astype(bfloat16)
    w = (rng.standard_normal((n, heads)) / np.sqrt(heads)).astype(np.float32)
    return q, k, w


def reference_scores(cp, q, k, w):
    """float64 [N, N] causal indexer scores on the device, -inf above the diagonal."""
    n = q.shape[0]
    q64, k64, w64 = (cp.asarray(x.astype(np.float64)) for x in (q, k, w))
    ref = cp.empty((n, n), cp.float64)
    for t0 in range(0, n, QUERY_CHUNK):
        dots = cp.einsum("thd,sd->ths", q64[t0:t0 + QUERY_CHUNK], k64)
        ref[t0:t0 + QUERY_CHUNK] = cp.einsum("th,ths->ts", w64[t0:t0 + QUERY_CHUNK], cp.maximum(dots, 0))
    visible = cp.arange(n)[None, :] <= cp.arange(n)[:, None]
    return cp.where(visible, ref, -cp.inf), visible


def row_errors(cp, scores, ref, visible):
    """Per row: max |scores - ref| over the row's max |ref| (float64 [N])."""
    err = cp.where(visible, cp.abs(scores.astype(cp.float64) - ref), 0).max(axis=1)
    scale = cp.where(visible, cp.abs(ref), 0).max(axis=1)
    return cp.asnumpy(err / cp.maximum(scale, 1e-300))


def picks_outside(selection, ref_rows, topk: int) -> float:
    """Fraction of the selected keys not in the reference's top ``topk`` (host arrays)."""
    best = np.argpartition(-ref_rows, topk - 1, axis=1)[:, :topk]
    outside = sum(topk - np.intersect1d(mine, exact).size for mine, exact in zip(selection, best))
    return outside / selection.size


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    if any(k >= args.n for k in args.ks):
        parser.error(f"every k must be below --n ({args.n}), got {args.ks}")
    rows = []
    for heads in args.heads:
        q, k, w = inputs(args.n, heads, args.dim, args.seed)
        qd, kd, wd = cp.asarray(q), cp.asarray(k), cp.asarray(w)
        ref, visible = reference_scores(cp, q, k, w)
        errors = row_errors(cp, hs.indexer_scores(qd, kd, wd), ref, visible)
        row = {"bench": "indexer_accuracy_gpu", "config": {"n": args.n, "heads": heads, "dim": args.dim},
               "impl": "hs.indexer_scores / hs.indexer_topk", "max_row_rel_err": float(errors.max()),
               "median_row_rel_err": float(np.median(errors))}
        line = f"N={args.n} H={heads}: row error max {errors.max():.3e}, median {np.median(errors):.3e}"
        for topk in args.ks:
            selection = cp.asnumpy(hs.indexer_topk(qd, kd, wd, topk)[topk:])  # rows with more than k keys
            row[f"picks_outside_k{topk}"] = picks_outside(selection, cp.asnumpy(ref[topk:]), topk)
            line += f"; k={topk}: {row[f'picks_outside_k{topk}']:.2e} of picks outside the float64 top-k"
        print(line, flush=True)
        rows.append(row)
        del ref, visible
        cp.get_default_memory_pool().free_all_blocks()
    path = write_results("indexer_accuracy_gpu", gpu_device(), rows, Path(args.out) if args.out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
