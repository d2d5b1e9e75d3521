"""Random kv-row gathers against the L2's size: does a row read from SMs on
both halves of the chip take room in both L2 partitions?

The sparse-attention forward at N = 131072 hits L2 on 46 % of its gathers,
which fits a cache of about 25 MB for uniformly drawn rows: half the
H200's 50 MB, as if every row sat in both partitions (benchmarks/NOTES.md,
"Six changes to the forward"). This benchmark gathers random 1152-byte
rows (d_qk = 576 in bfloat16) from a table of W bytes, every warp of every
SM reading rows drawn uniformly, and reports the rate. Modes restrict which
rows a CTA reads, by row parity, without changing how the rows spread over
the table:

- "all": any row;
- "cta parity": row parity = the CTA's index parity (a control: both
  halves of the chip still read every row);
- "smid bit b": row parity = bit b of the SM's id (%smid). If the SMs with
  that bit set are one half of the chip, each row is read from one half
  only, and a table up to the whole L2 should keep gathering at L2 rates
  where "all" has fallen to DRAM's.

A mode that stays fast to a larger W than "all" names a split of the SMs
that the partitions follow.

    python -m benchmarks.l2_gather --mb 8 16 24 32 40 48 64 96 160
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import gpu_device, table, time_gpu, write_results

ROW_BYTES = 576 * 2
THREADS, ROWS_PER_STEP = 256, 4
_SOURCE = r"""
// Draw i's row: a 32-bit integer hash of i (no table of draws, which would
// stream through the L2 beside the rows) reduced to [0, n_rows).
__device__ __forceinline__ unsigned int drawn_row(unsigned long long i, unsigned int seed, unsigned int n_rows) {
    unsigned int x = (unsigned int)i * 0x9E3779B1u ^ (unsigned int)(i >> 32) ^ seed;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return (unsigned int)(((unsigned long long)x * n_rows) >> 32);
}

extern "C" __global__ void __launch_bounds__(256)
gather(const uint4* table, unsigned int n_rows, long long n_draws, unsigned int seed, int mode, int bit,
       unsigned int* sink) {
    // mode 0: the drawn row; 1: its parity set to the CTA's; 2: its parity set to bit `bit` of the SM id.
    constexpr int CHUNKS = 72;  // 16-byte pieces of a 1152-byte row
    unsigned int smid;
    asm("mov.u32 %0, %%smid;" : "=r"(smid));
    const unsigned int side = mode == 1 ? (blockIdx.x & 1) : ((smid >> bit) & 1);
    const int lane = threadIdx.x & 31;
    const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    unsigned int acc = 0;
    for (long long first = warp * 4; first < n_draws; first += warps * 4) {
        uint4 v[4][3];
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            unsigned int row = drawn_row(first + r, seed, n_rows);
            if (mode != 0) row = (row & ~1u) | side;
            const uint4* src = table + (size_t)row * CHUNKS;
            #pragma unroll
            for (int c = 0; c < 3; ++c) {
                const int chunk = lane + 32 * c;
                v[r][c] = chunk < CHUNKS ? __ldcg(src + chunk) : make_uint4(0, 0, 0, 0);
            }
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r)
            #pragma unroll
            for (int c = 0; c < 3; ++c) acc ^= v[r][c].x ^ v[r][c].y ^ v[r][c].z ^ v[r][c].w;
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;  // keeps the loads
}
"""


def modes(bits: int) -> list[tuple[str, int, int]]:
    """(name, mode, bit) of every mode timed: all rows, the control, then one per SM id bit."""
    return [("all", 0, 0), ("cta parity", 1, 0)] + [(f"smid bit {b}", 2, b) for b in range(bits)]


def main(argv=None) -> None:
    import cupy as cp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, nargs="+", default=[8, 16, 24, 32, 40, 48, 64, 96, 160],
                        help="table sizes in MiB")
    parser.add_argument("--draws", type=int, default=1 << 22, help="rows gathered per timing")
    parser.add_argument("--bits", type=int, default=7, help="SM id bits tried as the split (0 .. bits-1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    kernel = cp.RawKernel(_SOURCE, "gather")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    blocks = sms * (2048 // THREADS)
    sink = cp.empty(blocks * THREADS, dtype=cp.uint32)
    cp.random.seed(0)
    rows = []
    for mb in args.mb:
        n_rows = max(2, int(mb * 2**20) // ROW_BYTES) & ~1
        data = cp.random.random(n_rows * ROW_BYTES // 4, dtype=cp.float32).view(cp.uint32)  # not compressible
        for name, mode, bit in modes(args.bits):
            launch = (data, cp.uint32(n_rows), cp.int64(args.draws), cp.uint32(len(rows) + 1), cp.int32(mode),
                      cp.int32(bit), sink)
            ms = time_gpu(lambda i: kernel((blocks,), (THREADS,), launch), repeats=args.repeats, warmup=2)
            gbs = args.draws * ROW_BYTES / (ms * 1e-3) / 1e9
            rows.append({"bench": "l2_gather", "config": {"table_mib": mb, "rows": n_rows, "mode": name,
                                                          "draws": args.draws, "ctas": blocks},
                         "median_ms": round(ms, 4), "gbs": round(gbs, 1)})
            print(f"  {mb:6.0f} MiB  {name:12s} {gbs:9.1f} GB/s", flush=True)
        del data
    path = write_results("l2_gather", gpu_device(), rows, Path(args.out) if args.out else None)
    short = [{"MiB": r["config"]["table_mib"], "mode": r["config"]["mode"], "GB/s": r["gbs"]} for r in rows]
    print(table(short, ["MiB", "mode", "GB/s"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
