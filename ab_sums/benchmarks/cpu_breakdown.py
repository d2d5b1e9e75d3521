"""Where the CPU top-k and CPU indexer spend their time, pass by pass.

top-k, [4096, 32768] float32 (the topk_cpu shape), parallel over rows:
  keys                  the key transform alone
  keys + histogram      the top-digit histogram counted in the key loop (v3)
                        or in a loop of its own (what ``hs.topk`` runs)
indexer, N=8192, H=64, D=128, causal (the indexer_cpu shape):
  gemm                  the BLAS logits of every tile the causal mask keeps
  gemm + epilogue, fresh buffers    a new logits and tile array per tile
  gemm + epilogue, reused buffers   the library's tile loop (``_blocks``)
"""
from __future__ import annotations

import argparse

import numpy as np
from numba import njit, prange

from hyscale_core.ops.indexer import cpu as indexer_cpu
from hyscale_core.ops.topk.cpu import sort_key, top_digit_histogram

from .common import cpu_device, table, time_cpu, write_results

F32 = (np.uint64(0xFFFFFFFF), np.uint64(1 << 31), np.uint64(0x7F800000), np.uint64(0x007FFFFF), True, False)


@njit(cache=True, parallel=True)
def _keys(bits, ones, sign, exp_mask, mant_mask, is_float, invert, histogram):
    """Keys of every row and, by ``histogram``, the top-digit histogram:
    0 none; 1 counted in the key loop (the v3 library); 2 counted in a loop
    of its own (``top_digit_histogram``, the library now). Returns a checksum
    of every key row's last key and every count, so none of it is dead code."""
    n_rows, n = bits.shape
    sh = np.uint64(21)
    weights = np.arange(2048, dtype=np.int64)
    total = 0
    for r in prange(n_rows):
        keys = np.empty(n, bits.dtype)
        hist = np.zeros(2048, np.int64)
        for i in range(n):
            key = sort_key(np.uint64(bits[r, i]), ones, sign, exp_mask, mant_mask, is_float, invert)
            keys[i] = key
            if histogram == 1:
                hist[key >> sh] += 1
        if histogram == 2:
            hist = top_digit_histogram(keys, sh, 2048)
        total += (hist * weights).sum() + keys[n - 1]
    return total


def _causal_tiles(n: int):
    """(t0, s0, s1) of every (query block, key tile) the causal mask keeps."""
    blk, tile = indexer_cpu.Q_BLOCK, indexer_cpu.K_TILE
    for t0 in range(0, n, blk):
        for s0 in range(0, min(t0 + blk, n), tile):
            yield t0, s0, min(s0 + tile, n)


def indexer_variants(q, k, w):
    """The three tile loops above, as callables over the same inputs."""
    cpu = indexer_cpu
    n, heads, dim = q.shape
    lo, hi = np.zeros(n, np.int64), np.arange(1, n + 1, dtype=np.int64)
    blk = cpu.Q_BLOCK

    def gemm():
        for t0, s0, s1 in _causal_tiles(n):
            q[t0:t0 + blk].reshape(-1, dim) @ k[s0:s1].T

    def fresh():
        for t0, s0, s1 in _causal_tiles(n):
            logits = q[t0:t0 + blk].reshape(-1, dim) @ k[s0:s1].T
            tile = np.empty((min(blk, n - t0), s1 - s0), np.float32)
            cpu.weighted_relu(logits, w[t0:t0 + blk], lo[t0:t0 + blk], hi[t0:t0 + blk], s0, tile)

    def reused():
        for _, _, tiles in cpu._blocks(q, k, w, lo, hi):
            for _ in tiles:
                pass

    return {"gemm": gemm, "gemm + epilogue, fresh buffers": fresh, "gemm + epilogue, reused buffers": reused}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    bits = rng.standard_normal((args.rows, args.n), dtype=np.float32).view(np.uint32)
    rows = []
    variants = (("keys", 0), ("keys + histogram in the key loop (v3)", 1),
                ("keys, then histogram in its own loop (now)", 2))
    for name, histogram in variants:
        _keys(bits[:2], *F32, histogram)  # compile outside the timing
        ms = time_cpu(lambda: _keys(bits, *F32, histogram), repeats=args.repeats)
        rows.append({"bench": "cpu_breakdown", "config": {"op": "topk", "rows": args.rows, "n": args.n},
                     "impl": name, "median_ms": round(ms, 1)})
        print(f"topk    {name:34s} {ms:8.1f} ms", flush=True)
    n, heads, dim = args.tokens, 64, 128
    q = rng.standard_normal((n, heads, dim), dtype=np.float32)
    k = rng.standard_normal((n, dim), dtype=np.float32)
    w = rng.standard_normal((n, heads), dtype=np.float32)
    for name, fn in indexer_variants(q, k, w).items():
        ms = time_cpu(fn, repeats=args.repeats)
        rows.append({"bench": "cpu_breakdown", "config": {"op": "indexer", "n": n, "heads": heads, "dim": dim},
                     "impl": name, "median_ms": round(ms, 1)})
        print(f"indexer {name:34s} {ms:8.1f} ms", flush=True)
    path = write_results("cpu_breakdown", cpu_device(), rows)
    print(table(rows, ["impl", "median_ms"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
