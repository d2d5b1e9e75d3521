// Stable LSD radix sort of an index table's entries by key, digits of
// HS_KS_BITS = 8 or 9 bits (hyscale_core/gpu/segments.py picks the width that
// needs fewer passes, 8 where both need as many, and runs one pass per digit).
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
//     A tile is first ordered by digit in shared memory, so that each run of
//     one digit is written to consecutive places by consecutive threads.
// No float and no atomic decides an order: the output is the same on every run.
#include "select.cuh"

using namespace hs;

namespace {

#ifndef HS_KS_BITS
#define HS_KS_BITS 8
#endif
constexpr int BITS = HS_KS_BITS;  // digit width
constexpr int RADIX = 1 << BITS;
constexpr int THREADS = 256;
constexpr int PER_THREAD = RADIX / THREADS;  // thread t owns digits PER_THREAD t .. PER_THREAD (t + 1) - 1
constexpr int ROUNDS = 16;                   // rounds of THREADS entries per tile
constexpr int TILE = THREADS * ROUNDS;
constexpr int WARPS = THREADS / 32;
constexpr int NO_DIGIT = RADIX;  // the digit of a skipped (< 0) entry or one past n
static_assert(BITS == 8 || BITS == 9, "HS_KS_BITS is 8 or 9");

__device__ __forceinline__ int digit_of(int key, int shift) {
    return key >= 0 ? (key >> shift) & (RADIX - 1) : NO_DIGIT;
}

__device__ __forceinline__ int tile_key(const int* keys, long long n, long long i) { return i < n ? keys[i] : -1; }

// The lanes of the warp whose digit (0 .. NO_DIGIT: BITS + 1 bits) equals this
// lane's, one ballot per bit (the sort took 14 % less time than with match.any, H200).
__device__ __forceinline__ u32 same_digit_lanes(int digit) {
    u32 peers = FULL_MASK;
    #pragma unroll
    for (int bit = 0; bit <= BITS; ++bit) {
        const bool one = (digit >> bit) & 1;
        const u32 ones = __ballot_sync(FULL_MASK, one);
        peers &= one ? ones : ~ones;
    }
    return peers;
}

}  // namespace

// Grid: n_tiles = ceil(n / TILE) CTAs of THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS)
ks_digit_counts(const int* keys, long long n, int shift, int n_tiles, int* counts) {
    __shared__ int hist[RADIX];
    const long long base = (long long)blockIdx.x * TILE;
    int tile_keys[ROUNDS];  // every load in flight before the first is used
    #pragma unroll
    for (int r = 0; r < ROUNDS; ++r) tile_keys[r] = tile_key(keys, n, base + r * THREADS + threadIdx.x);
    #pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) hist[threadIdx.x + j * THREADS] = 0;
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int digit = digit_of(tile_keys[r], shift);
        const u32 peers = same_digit_lanes(digit);  // one shared add per distinct digit of the warp
        if (digit != NO_DIGIT && lane_id() == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int d = threadIdx.x + j * THREADS;
        counts[(long long)d * n_tiles + blockIdx.x] = hist[d];
    }
}

// Grid: RADIX CTAs (one per digit) of THREADS threads. counts as ks_digit_counts
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
// keys_in, with its value, to keys_out / values_out at its place. Warp w ranks
// the tile's entries w * SPAN .. (w + 1) * SPAN - 1 in order, counting each
// digit's entries in its own row of shared counters (no CTA barrier per
// round); the rows then become each warp's start per digit within the tile's
// digit-ordered copy in shared memory, which the CTA writes out in order.
extern "C" __global__ void __launch_bounds__(THREADS)
ks_scatter(const int* keys_in, const int* values_in, long long n, int shift, int n_tiles, const int* offsets,
           const int* totals, int* keys_out, int* values_out) {
    constexpr int SPAN = TILE / WARPS;  // entries a warp ranks
    constexpr int STEPS = SPAN / 32;    // of 32 entries, one per lane
    static_assert(TILE < 32768, "warp_next holds ranks in the tile as 16-bit values");
    __shared__ short warp_next[WARPS][RADIX];  // per warp and digit: its next entry's rank in the tile
    __shared__ int tile_start[RADIX];          // per digit: its first rank in the tile
    __shared__ int place_of_start[RADIX];      // per digit: the output place of that rank
    __shared__ int sorted_keys[TILE], sorted_values[TILE];
    __shared__ u32 scratch[MAX_WARPS + 1];
    const int lane = lane_id(), warp = warp_id(), tile = blockIdx.x;
    const int first_digit = PER_THREAD * threadIdx.x;  // this thread's digits, consecutive for the scans
    // The warp's span, keys and values, requested before anything waits on them.
    const long long base = (long long)tile * TILE + warp * SPAN;
    int keys[STEPS], values[STEPS], ranks[STEPS];
    #pragma unroll
    for (int j = 0; j < STEPS; ++j) keys[j] = tile_key(keys_in, n, base + j * 32 + lane);
    #pragma unroll
    for (int j = 0; j < STEPS; ++j) {
        const long long i = base + j * 32 + lane;
        values[j] = values_in == nullptr ? (int)i : i < n ? values_in[i] : 0;
    }
    int count[PER_THREAD], total[PER_THREAD], offset[PER_THREAD];  // per own digit: in this tile, in all, before
    u32 own_total = 0, own_count = 0;
    #pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int d = first_digit + j;
        const long long at = (long long)d * n_tiles + tile;
        offset[j] = offsets[at];
        total[j] = totals[d];
        count[j] = (tile + 1 < n_tiles ? offsets[at + 1] : total[j]) - offset[j];
        own_total += (u32)total[j];
        own_count += (u32)count[j];
    }
    u32 all, kept;
    u32 smaller_digits = block_exclusive_sum(own_total, scratch, &all);
    u32 start = block_exclusive_sum(own_count, scratch, &kept);
    #pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int d = first_digit + j;
        tile_start[d] = (int)start;
        place_of_start[d] = (int)smaller_digits + offset[j];
        start += (u32)count[j];
        smaller_digits += (u32)total[j];
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) warp_next[w][d] = 0;
    }
    __syncthreads();
    // Each warp ranks its span: ranks[j] counts the span's earlier entries of the same digit.
    #pragma unroll
    for (int j = 0; j < STEPS; ++j) {
        const int digit = digit_of(keys[j], shift);
        const u32 peers = same_digit_lanes(digit);
        const int before = __popc(peers & ((1u << lane) - 1));  // same digit, earlier lanes
        ranks[j] = digit == NO_DIGIT ? 0 : warp_next[warp][digit] + before;
        __syncwarp();
        if (digit != NO_DIGIT && before == 0) warp_next[warp][digit] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int d = first_digit + j;
        int running = tile_start[d];  // the warps' counts become their starts, in warp order
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int c = warp_next[w][d];
            warp_next[w][d] = (short)running;
            running += c;
        }
    }
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < STEPS; ++j) {
        const int digit = digit_of(keys[j], shift);
        if (digit == NO_DIGIT) continue;
        const int rank = warp_next[warp][digit] + ranks[j];
        sorted_keys[rank] = keys[j];
        sorted_values[rank] = values[j];
    }
    __syncthreads();
    for (int r = threadIdx.x; r < (int)kept; r += THREADS) {
        const int key = sorted_keys[r], digit = digit_of(key, shift);
        const int place = place_of_start[digit] + r - tile_start[digit];
        keys_out[place] = key;
        values_out[place] = sorted_values[r];
    }
}
