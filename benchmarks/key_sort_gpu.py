"""The key sort of the GPU backwards (hyscale_core.gpu.segments.key_segments:
an index table's entries grouped by key, positions ascending) on tables
shaped like one backward chunk at h = 64, k = 2048: as many queries as the
16 GiB of bfloat16 dkv rows hold, keys drawn as benchmarks/sparse_attention_gpu.py
draws them (uniform over the causal prefix) for the chunk ending at N.

    python -m benchmarks.key_sort_gpu --n 32768 131072

Per table: device ms per call (calls back to back between two events, so
the host's launch work overlaps the device's), the radix passes, and the
bytes each pass must move (keys and positions read and written, the digit
counts' read of the keys) over that time, against the copy rate measured in
the run.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import copy_bandwidth_gbs, gpu_device, table, write_results

CHUNK_QUERIES = (16 << 30) // (2048 * 576 * 2)  # queries whose bfloat16 rows fill 16 GiB at k = 2048


def chunk_table(cp, n: int, k: int, queries: int, seed: int = 0):
    """int32 [queries, k]: the last ``queries`` rows of an N-query causal table."""
    rng = cp.random.default_rng(seed)
    t = cp.arange(max(0, n - queries), n)[:, None]
    span = cp.maximum(t + 1, k)
    return cp.minimum(cp.floor(rng.random((t.shape[0], k)) * span), span - 1).astype(cp.int32)


def main(argv=None) -> None:
    import cupy as cp

    from hyscale_core.gpu.segments import digit_width, key_segments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=CHUNK_QUERIES)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for n in args.n:
        idx = chunk_table(cp, n, args.topk, min(n, args.queries))
        key_segments(idx, cp.int32, n)  # compile and warm the pool
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(args.calls):
            key_segments(idx, cp.int32, n)
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop) / args.calls
        passes = max(1, -(-int(n - 1).bit_length() // digit_width(n)))
        entries = idx.size
        moved = entries * 4 * (1 + 2 + 4 * (passes - 1))  # table read + pass 1 writes; later passes read and write 16 B
        moved += entries * 4 * passes  # each pass's digit counts read the keys
        rows.append({"bench": "key_sort_gpu", "config": {"n_keys": n, "queries": int(idx.shape[0]), "k": args.topk},
                     "impl": "key_segments", "ms_per_call": round(ms, 3), "passes": passes,
                     "gb_moved": round(moved / 1e9, 3), "x_floor": round(ms / (moved / (copy_gbs * 1e9) * 1e3), 2)})
        print(f"  N={n}: {ms:.3f} ms per call, {passes} passes", flush=True)
    for r in rows:
        r["copy_gbs"] = round(copy_gbs, 1)
    path = write_results("key_sort_gpu", gpu_device(), rows, Path(args.out) if args.out else None)
    print(table([{"N": r["config"]["n_keys"], "queries": r["config"]["queries"], "ms": r["ms_per_call"],
                  "passes": r["passes"], "GB": r["gb_moved"], "x_floor": r["x_floor"]} for r in rows],
                ["N", "queries", "ms", "passes", "GB", "x_floor"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
