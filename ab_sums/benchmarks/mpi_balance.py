"""Load balance of the sequence-shard layouts: indexer work per rank.

The indexer scores every visible causal (query, key) pair, so a rank's
selection work is the number of visible pairs of its queries. This is
arithmetic from the layout (hyscale_core.mpi.layout), no timing: for each
N and P, contiguous and zigzag splits (both aligned to the CPU indexer's
64-token query blocks), one sequence and a packed batch of four sequences
of unequal lengths, the largest and smallest rank's work over the mean.
The measured selection time per rank is printed by
examples/mpi_long_context.py.

    python -m benchmarks.run mpi_balance
"""
from __future__ import annotations

import argparse

import numpy as np

from hyscale_core.mpi import QUERY_ALIGN, contiguous_layout, zigzag_layout

from .common import cpu_device, table, write_results


def packed_bounds(n: int) -> np.ndarray:
    """Four sequences of lengths in proportion 1 : 2 : 3 : 4 (cu_seqlens [5])."""
    cut = np.round(np.cumsum([0, 1, 2, 3, 4]) / 10 * n).astype(np.int64)
    cut[-1] = n
    return cut


def balance_rows(n: int, world: int) -> list[dict]:
    rows = []
    cases = [("contiguous", None, contiguous_layout(n, world, align=QUERY_ALIGN)),
             ("zigzag", None, zigzag_layout(n, world, align=QUERY_ALIGN)),
             ("zigzag, 4 packed sequences", packed_bounds(n),
              zigzag_layout(n, world, packed_bounds(n), align=QUERY_ALIGN))]
    for impl, cu, layout in cases:
        work = layout.causal_work(cu)
        ratio = work / work.mean()
        rows.append({"bench": "mpi_balance", "config": {"n": n, "ranks": world, "align": QUERY_ALIGN},
                     "impl": impl, "median_ms": None, "max_over_mean": round(float(ratio.max()), 4),
                     "min_over_mean": round(float(ratio.min()), 4), "pairs_per_rank": work.tolist()})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072, 1048576])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4, 8])
    args = parser.parse_args(argv)
    rows = [row for n in args.sizes for world in args.ranks for row in balance_rows(n, world)]
    flat = [{"N": r["config"]["n"], "P": r["config"]["ranks"], "layout": r["impl"],
             "max/mean": r["max_over_mean"], "min/mean": r["min_over_mean"]} for r in rows]
    print(table(flat, ["N", "P", "layout", "max/mean", "min/mean"]))
    print("wrote", write_results("mpi_balance", cpu_device() + " (arithmetic, no timing)", rows))


if __name__ == "__main__":
    main()
