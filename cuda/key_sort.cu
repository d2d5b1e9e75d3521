// Stable LSD radix sort of an index table's entries by key, 8-bit digits
// (hyscale_core/gpu/segments.py runs one pass per digit the key space needs).
//
// A pass over n entries cuts them into tiles of TILE; per pass:
//   ks_digit_counts: counts[d * n_tiles + tile] = entries of the tile whose
//     digit is d (entries < 0 are left out: the first pass drops the -1 slots);
//   the host's exclusive scan of counts, in that digit-major order, gives each
//     (digit, tile) its first output place;
//   ks_scatter: each entry goes to its place plus the number of entries of the
//     same digit before it in the tile, so equal digits keep their order and
//     the result of every pass is stable. values == nullptr (the first pass)
//     takes an entry's position in the table as its value.
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

// offsets: the exclusive scan of ks_digit_counts' counts. Writes every entry
// >= 0 of keys_in, with its value, to keys_out / values_out at its place.
extern "C" __global__ void __launch_bounds__(THREADS)
ks_scatter(const int* keys_in, const int* values_in, long long n, int shift, int n_tiles, const int* offsets,
           int* keys_out, int* values_out) {
    __shared__ int next_place[THREADS];         // per digit: where the tile's next entry of it goes
    __shared__ int warp_counts[WARPS][THREADS];  // per round: each warp's entries of each digit
    const int lane = lane_id(), warp = warp_id(), d = threadIdx.x;
    next_place[d] = offsets[(long long)d * n_tiles + blockIdx.x];
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
