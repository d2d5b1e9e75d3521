// Stable LSD radix sort of an index table's entries by key, 8-bit digits
// (hyscale_core/gpu/segments.py runs one pass per digit the key space needs).
//
// A pass over n entries cuts them into tiles of TILE; per pass:
//   ks_digit_counts: counts[d * n_tiles + tile] = entries of the tile whose
//     digit is d (entries < 0 are left out: the first pass drops the -1 slots);
//   ks_digit_offsets: each digit's counts scanned over the tiles (exclusive,
//     in place) and the digit's total;
//   ks_scatter: an entry's place is the entries of smaller digits, plus those
//     of its digit in earlier tiles, plus those of its digit before it in its
//     tile, so equal digits keep their order and every pass is stable.
//     values == nullptr (the first pass) takes an entry's position in the
//     table as its value. The kept entries fill the front of the outputs.
// No float and no atomic decides an order: the output is the same on every run.
#include "select.cuh"

using namespace hs;

namespace {

constexpr int THREADS = 256;  // one per digit value
constexpr int ROUNDS = 16;    // rounds of THREADS entries per tile
constexpr int TILE = THREADS * ROUNDS;
constexpr int WARPS = THREADS / 32;
constexpr int NO_DIGIT = 256;  // the digit of a skipped (< 0) entry or one past n

__device__ __forceinline__ int digit_of(int key, int shift) { return key >= 0 ? (key >> shift) & 255 : NO_DIGIT; }

__device__ __forceinline__ int tile_key(const int* keys, long long n, long long i) { return i < n ? keys[i] : -1; }

}  // namespace

// Grid: n_tiles = ceil(n / TILE) CTAs of THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS)
ks_digit_counts(const int* keys, long long n, int shift, int n_tiles, int* counts) {
    __shared__ int hist[THREADS];
    hist[threadIdx.x] = 0;
    __syncthreads();
    const long long base = (long long)blockIdx.x * TILE;
    for (int r = 0; r < ROUNDS; ++r) {
        const int digit = digit_of(tile_key(keys, n, base + r * THREADS + threadIdx.x), shift);
        const u32 peers = __match_any_sync(FULL_MASK, digit);  // one shared add per distinct digit of the warp
        if (digit != NO_DIGIT && lane_id() == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    counts[(long long)threadIdx.x * n_tiles + blockIdx.x] = hist[threadIdx.x];
}

// Grid: 256 CTAs (one per digit) of THREADS threads. counts as ks_digit_counts
// made them become exclusive sums over the tiles; totals[d] = digit d's entries.
extern "C" __global__ void __launch_bounds__(THREADS) ks_digit_offsets(int* counts, int n_tiles, int* totals) {
    __shared__ u32 scratch[MAX_WARPS + 1];
    int* row = counts + (long long)blockIdx.x * n_tiles;
    u32 carried = 0;
    for (int first = 0; first < n_tiles; first += THREADS) {
        const int i = first + threadIdx.x;
        u32 total;
        const u32 before = block_exclusive_sum(i < n_tiles ? (u32)row[i] : 0u, scratch, &total);
        if (i < n_tiles) row[i] = (int)(carried + before);
        carried += total;
    }
    if (threadIdx.x == 0) totals[blockIdx.x] = (int)carried;
}

// offsets and totals: ks_digit_offsets' results. Writes every entry >= 0 of
// keys_in, with its value, to keys_out / values_out at its place.
extern "C" __global__ void __launch_bounds__(THREADS)
ks_scatter(const int* keys_in, const int* values_in, long long n, int shift, int n_tiles, const int* offsets,
           const int* totals, int* keys_out, int* values_out) {
    __shared__ int next_place[THREADS];         // per digit: where the tile's next entry of it goes
    __shared__ int warp_counts[WARPS][THREADS];  // per round: each warp's entries of each digit
    __shared__ u32 scratch[MAX_WARPS + 1];
    const int lane = lane_id(), warp = warp_id(), d = threadIdx.x;
    u32 all;
    const u32 smaller_digits = block_exclusive_sum((u32)totals[d], scratch, &all);
    next_place[d] = (int)smaller_digits + offsets[(long long)d * n_tiles + blockIdx.x];
    for (int w = 0; w < WARPS; ++w) warp_counts[w][d] = 0;
    __syncthreads();
    const long long base = (long long)blockIdx.x * TILE;
    for (int r = 0; r < ROUNDS; ++r) {
        const long long i = base + r * THREADS + threadIdx.x;
        const int key = tile_key(keys_in, n, i), digit = digit_of(key, shift);
        const u32 peers = __match_any_sync(FULL_MASK, digit);
        const int before = __popc(peers & ((1u << lane) - 1));  // same digit, earlier lanes of this warp
        if (digit != NO_DIGIT && before == 0) warp_counts[warp][digit] = __popc(peers);
        __syncthreads();
        if (digit != NO_DIGIT) {
            int place = next_place[digit] + before;
            for (int w = 0; w < warp; ++w) place += warp_counts[w][digit];
            keys_out[place] = key;
            values_out[place] = values_in != nullptr ? values_in[i] : (int)i;
        }
        __syncthreads();
        int placed = 0;
        for (int w = 0; w < WARPS; ++w) {
            placed += warp_counts[w][d];
            warp_counts[w][d] = 0;
        }
        next_place[d] += placed;
        __syncthreads();
    }
}
