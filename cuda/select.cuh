// Device pieces shared by the selection kernels: block-wide scans,
// shared-memory histograms, a radix select and radix sorts (their
// order-preserving keys: topk_keys.cuh).
//
// Every function named block_* must be called by all threads of the block
// (it contains __syncthreads); warp_* by all 32 lanes of a warp.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu

namespace hs {

constexpr int DIGIT_BITS = 11;
constexpr int MAX_BINS = 1 << DIGIT_BITS;
constexpr int MAX_WARPS = 32;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

__device__ __forceinline__ u32 warp_inclusive_sum(u32 x) {
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u32 y = __shfl_up_sync(FULL_MASK, x, d);
        if (lane_id() >= d) x += y;
    }
    return x;
}

// Exclusive prefix sum of `x` in thread order; `*total` gets the block sum.
// `scratch` holds MAX_WARPS + 1 words of shared memory.
__device__ u32 block_exclusive_sum(u32 x, u32* scratch, u32* total) {
    const int n_warps = (blockDim.x + 31) >> 5;
    u32 inclusive = warp_inclusive_sum(x);
    if (lane_id() == 31) scratch[warp_id()] = inclusive;
    __syncthreads();
    if (warp_id() == 0) {
        u32 w = lane_id() < n_warps ? scratch[lane_id()] : 0u;
        u32 w_incl = warp_inclusive_sum(w);
        scratch[lane_id()] = w_incl - w;
        if (lane_id() == 31) scratch[MAX_WARPS] = w_incl;
    }
    __syncthreads();
    u32 result = scratch[warp_id()] + inclusive - x;
    *total = scratch[MAX_WARPS];
    __syncthreads();
    return result;
}

// Block-wide minimum and maximum of x (every thread gets both). `scratch`
// holds 2 * MAX_WARPS words; K is an unsigned integer type.
template <typename K>
__device__ void block_min_max(K x_min, K x_max, K* scratch, K* lo, K* hi) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        x_min = min(x_min, __shfl_xor_sync(FULL_MASK, x_min, d));
        x_max = max(x_max, __shfl_xor_sync(FULL_MASK, x_max, d));
    }
    if (lane_id() == 0) {
        scratch[warp_id()] = x_min;
        scratch[MAX_WARPS + warp_id()] = x_max;
    }
    __syncthreads();
    K a = scratch[0], b = scratch[MAX_WARPS];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
        a = min(a, scratch[w]);
        b = max(b, scratch[MAX_WARPS + w]);
    }
    *lo = a;
    *hi = b;
    __syncthreads();
}

// Bytes needed to hold x (0 for x == 0).
template <typename K>
__device__ __forceinline__ int bytes_of(K x) {
    int bits = 0;
    if constexpr (sizeof(K) == 8) bits = 64 - __clzll((long long)x);
    else bits = 32 - __clz((int)x);
    return (bits + 7) / 8;
}

// Add one count to hist[bin] for every lane with `valid`; a full warp whose
// lanes all hit one bin adds once (sorted or constant data would otherwise
// serialise 32 atomics on one address). All 32 lanes must call this.
__device__ __forceinline__ void warp_histogram_add(u32* hist, u32 bin, bool valid) {
    const u32 active = __ballot_sync(FULL_MASK, valid);
    if (active == 0) return;
    if (active == FULL_MASK) {
        const u32 first = __shfl_sync(FULL_MASK, bin, 0);
        if (__all_sync(FULL_MASK, bin == first)) {
            if (lane_id() == 0) atomicAdd(&hist[first], 32u);
            return;
        }
    }
    if (valid) atomicAdd(&hist[bin], 1u);
}

// A slot in a shared append buffer for every lane with `pred`, one atomic
// per warp; lanes keep their lane order. All 32 lanes must call this.
__device__ __forceinline__ u32 warp_append(u32* counter, bool pred) {
    const u32 mask = __ballot_sync(FULL_MASK, pred);
    if (mask == 0) return 0;
    const int leader = __ffs(mask) - 1;
    u32 base = 0;
    if (lane_id() == leader) base = atomicAdd(counter, (u32)__popc(mask));
    base = __shfl_sync(FULL_MASK, base, leader);
    return base + (u32)__popc(mask & ((1u << lane_id()) - 1u));
}

// The bucket holding the `rank`-th largest element (rank counted from 1) of a
// histogram of `n_bins` bins. Returns the bucket; `*above` gets the count in
// higher buckets. Bins are dealt to threads from the top (thread 0 holds the
// highest), so the exclusive prefix over threads counts everything above.
__device__ int block_find_bucket(const u32* hist, int n_bins, u32 rank, u32* scratch,
                                 u32* found, u32* above) {
    const int per = (n_bins + blockDim.x - 1) / blockDim.x;
    const int top = n_bins - 1 - threadIdx.x * per;  // highest bin of this thread
    u32 mine = 0;
    for (int j = 0; j < per; ++j)
        if (top - j >= 0) mine += hist[top - j];
    u32 total;
    u32 before = block_exclusive_sum(mine, scratch, &total);
    if (before < rank && rank <= before + mine) {
        u32 acc = before;
        for (int j = 0; j < per && top - j >= 0; ++j) {
            u32 c = hist[top - j];
            if (rank <= acc + c) {
                found[0] = (u32)(top - j);
                found[1] = acc;
                break;
            }
            acc += c;
        }
    }
    __syncthreads();
    int bucket = (int)found[0];
    *above = found[1];
    __syncthreads();
    return bucket;
}

// The rank-th largest (rank from 1) of a block's WIDTH-bit keys (type K);
// `*above` gets how many keys exceed it and `*equal` (when given) how many
// equal it. An MSB-first radix select with DIGIT_BITS-bit digits, one pass per
// digit. Each pass calls visit(f), which must call f(key, member) for every
// key the thread holds (member = false for slots that hold none); every lane
// of a warp must make the same number of calls (f is warp-collective).
// When every member key starts with the same `known_bits` high bits
// (`known_prefix`, at most WIDTH - DIGIT_BITS of them), the passes start below
// them. AGGREGATE counts a warp whose lanes all hit one bin with one atomic
// (warp_histogram_add); without it each member adds its own (less code, and
// as fast where the bins are spread). `hist` holds MAX_BINS words, `scratch`
// MAX_WARPS + 1, `found` 2.
// With `enough` > 0 the select may stop early, after a pass whose bucket (the
// one holding the rank-th largest) and everything above it count at most
// `enough` keys: it then returns the lowest key of that bucket, sets
// *open_bits to the bucket's unresolved low bits (0 when the result is
// exact), *above to the count above the bucket and *equal to the bucket's.
template <typename K, int WIDTH, bool AGGREGATE = true, typename Visit>
__device__ K block_kth_largest_of(Visit visit, u32 rank, u32* hist, u32* scratch, u32* found, u32* above,
                                  u32* equal = nullptr, int known_bits = 0, K known_prefix = 0, u32 enough = 0,
                                  int* open_bits = nullptr) {
    static_assert(WIDTH <= 8 * (int)sizeof(K), "keys wider than their type");
    K prefix = known_prefix;
    u32 above_total = 0;
    int resolved = known_bits;  // high bits fixed so far
    int bucket = 0;
    while (resolved < WIDTH) {
        const int digit = min(DIGIT_BITS, WIDTH - resolved);
        const int shift = WIDTH - resolved - digit;
        for (int i = threadIdx.x; i < (1 << digit); i += blockDim.x) hist[i] = 0;
        __syncthreads();
        visit([&](K key, bool member) {
            const bool in_prefix = member && (resolved == 0 || (key >> (WIDTH - resolved)) == prefix);
            const u32 bin = (u32)(key >> shift) & ((1u << digit) - 1);
            if constexpr (AGGREGATE)
                warp_histogram_add(hist, bin, in_prefix);
            else if (in_prefix)
                atomicAdd(&hist[bin], 1u);
        });
        __syncthreads();
        u32 above_here;
        bucket = block_find_bucket(hist, 1 << digit, rank, scratch, found, &above_here);
        rank -= above_here;
        above_total += above_here;
        prefix = (prefix << digit) | (K)bucket;
        resolved += digit;
        if (enough != 0 && resolved < WIDTH) {
            const u32 in_bucket = hist[bucket];
            __syncthreads();  // every thread has read it before hist is cleared
            if (above_total + in_bucket <= enough) {
                *open_bits = WIDTH - resolved;
                *above = above_total;
                if (equal != nullptr) *equal = in_bucket;
                return prefix << (WIDTH - resolved);
            }
        }
    }
    if (open_bits != nullptr) *open_bits = 0;
    if (equal != nullptr) {
        *equal = hist[bucket];
        __syncthreads();  // the caller may clear hist next
    }
    *above = above_total;
    return prefix;
}

// The keys key_of(i) of the i < n with member(i), as block_kth_largest_of
// visits them: read by index on every pass, each thread U elements per
// round, all before it counts any (U > 1 keeps several slow loads, of keys in
// global memory, in flight). A functor, not a generic lambda: NVRTC compiles
// those as host code.
template <typename K, int U, typename KeyFn, typename MemberFn>
struct IndexedKeys {
    KeyFn key_of;
    MemberFn member;
    u32 n;
    template <typename Count>
    __device__ void operator()(Count&& count) const {
        for (u32 base = 0; base < n; base += U * blockDim.x) {
            K key[U];
            bool valid[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = base + u * blockDim.x + threadIdx.x;
                valid[u] = i < n && member(i);
                key[u] = valid[u] ? key_of(i) : (K)0;
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) count(key[u], valid[u]);
        }
    }
};

// block_kth_largest_of over the keys key_of(i) of the i < n with member(i).
template <typename K = u32, int WIDTH = 32, int U = 1, typename KeyFn, typename MemberFn>
__device__ K block_kth_largest(KeyFn key_of, MemberFn member, u32 n, u32 rank, u32* hist, u32* scratch,
                               u32* found, u32* above, u32* equal = nullptr) {
    return block_kth_largest_of<K, WIDTH>(IndexedKeys<K, U, KeyFn, MemberFn>{key_of, member, n}, rank, hist,
                                          scratch, found, above, equal);
}

// LSD radix sort, descending, of (key, idx) pairs in shared memory with
// 8-bit digits, stable: the number sorted is the low 8 * key_passes bits of
// key - key_base over the low 8 * idx_passes bits of ~(idx - idx_base), so
// key descending then index ascending, or (key_passes = 0) index ascending.
// The caller picks bases and pass counts that cover the pairs' spread. Each
// pass ranks every pair stably inside its warp (warp_digit_rank), turns the
// per-warp digit counts (`counts`: blockDim.x / 32 * 256 u16 of shared
// memory) into output slots (block_digit_offsets) and scatters from one pair
// of arrays (key, idx) to the other (key2, idx2). Warp w ranks the
// positions of its own contiguous segment in ascending order.

// The digit of pair p in a pass over the index (by_idx) or the key, at bit `shift`.
template <typename K>
__device__ __forceinline__ u32 sort_digit(const K* key, const u32* idx, int p, bool by_idx, int shift, K key_base,
                                          u32 idx_base) {
    return by_idx ? (~(idx[p] - idx_base) >> shift) & 255u : (u32)((key[p] - key_base) >> shift) & 255u;
}

// digit << 16 | the lane's rank among the warp's pairs of digit d so far
// (`mine[d]`, this warp's count, plus the lower lanes with the same digit);
// then mine[d] counts this call's lanes too. All 32 lanes must call this.
__device__ __forceinline__ u32 warp_digit_rank(u32 d, u16* mine) {
    const u32 lower = (1u << lane_id()) - 1u;
    u32 peers = FULL_MASK;
    #pragma unroll
    for (int b = 0; b < 8; ++b) {
        const u32 ones = __ballot_sync(FULL_MASK, (d >> b) & 1u);
        peers &= ((d >> b) & 1u) ? ones : ~ones;
    }
    const u32 rank = d << 16 | (mine[d] + __popc(peers & lower));
    __syncwarp();
    if ((peers & lower) == 0) mine[d] += (u16)__popc(peers);
    __syncwarp();
    return rank;
}

// Each (warp, digit) count becomes the first output slot of that warp's
// pairs of that digit, in (digit descending, warp ascending) order; WARPS,
// where given, is the block's warp count. Call after a barrier that follows
// the counts; ends with a barrier.
template <int WARPS = 0>
__device__ __forceinline__ void block_digit_offsets(u16* counts, u32* scratch) {
    const int n_warps = WARPS > 0 ? WARPS : (int)(blockDim.x >> 5);
    const int per = WARPS > 0 ? 8 : (256 * n_warps) / blockDim.x;  // 256 digits over 32 lanes a warp
    const int first = threadIdx.x * per;
    u32 sum = 0;
    for (int j = first; j < first + per; ++j) sum += counts[(j % n_warps) * 256 + 255 - j / n_warps];
    u32 total;
    u32 run = block_exclusive_sum(sum, scratch, &total);
    for (int j = first; j < first + per; ++j) {
        u16& c = counts[(j % n_warps) * 256 + 255 - j / n_warps];
        const u32 here = c;
        c = (u16)run;
        run += here;
    }
    __syncthreads();
}

// The sort with E pairs per thread ranked in registers: n a power of two,
// 32 * E <= n <= E * blockDim.x; thread t of warp w ranks positions
// w * 32 * E + e * 32 + lane. Returns whether the result is in key2/idx2.
// All threads call this.
template <int E, typename K>
__device__ bool block_radix_sort_desc(K* key, u32* idx, K* key2, u32* idx2, int n, int idx_passes, int key_passes,
                                      K key_base, u32 idx_base, u16* counts, u32* scratch) {
    const int w = warp_id(), lane = lane_id();
    const bool active = w * 32 * E < n;  // whole warps
    u16* mine = counts + w * 256;
    bool flipped = false;
    for (int pass = 0; pass < idx_passes + key_passes; ++pass) {
        K* src_key = flipped ? key2 : key;
        u32* src_idx = flipped ? idx2 : idx;
        const bool by_idx = pass < idx_passes;
        const int shift = 8 * (by_idx ? pass : pass - idx_passes);
        for (int d = lane; d < 256; d += 32) mine[d] = 0;
        __syncwarp();
        u32 rank[E];  // digit << 16 | rank among this warp's pairs of that digit
        if (active) {
            #pragma unroll
            for (int e = 0; e < E; ++e)
                rank[e] = warp_digit_rank(
                    sort_digit(src_key, src_idx, w * 32 * E + e * 32 + lane, by_idx, shift, key_base, idx_base),
                    mine);
        }
        __syncthreads();
        block_digit_offsets(counts, scratch);
        K* dst_key = flipped ? key : key2;
        u32* dst_idx = flipped ? idx : idx2;
        if (active) {
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                const int p = w * 32 * E + e * 32 + lane;
                const u32 at = mine[rank[e] >> 16] + (rank[e] & 0xFFFFu);
                dst_key[at] = src_key[p];
                dst_idx[at] = src_idx[p];
            }
        }
        __syncthreads();
        flipped = !flipped;
    }
    return flipped;
}

// The same sort in a block of WARPS warps for any n that is a multiple of
// 32 * WARPS (at most 65536), its ranks kept in shared memory (`ranks`: n
// words) instead of registers: loops, compact code for a kernel whose
// instruction cache is precious. Warp w ranks positions [w n / WARPS,
// (w + 1) n / WARPS). Returns whether the result is in key2/idx2. All
// threads call this.
template <int WARPS, typename K>
__device__ bool block_radix_sort_desc_looped(K* key, u32* idx, K* key2, u32* idx2, u32* ranks, int n,
                                             int idx_passes, int key_passes, K key_base, u32 idx_base,
                                             u16* counts, u32* scratch) {
    const int w = warp_id(), lane = lane_id();
    const int per_warp = n / WARPS;
    const int begin = w * per_warp + lane, end = (w + 1) * per_warp;
    u16* mine = counts + w * 256;
    bool flipped = false;
    #pragma unroll 1
    for (int pass = 0; pass < idx_passes + key_passes; ++pass) {
        K* src_key = flipped ? key2 : key;
        u32* src_idx = flipped ? idx2 : idx;
        const bool by_idx = pass < idx_passes;
        const int shift = 8 * (by_idx ? pass : pass - idx_passes);
        for (int d = lane; d < 256; d += 32) mine[d] = 0;
        __syncwarp();
        // Each digit is read one step ahead, so its load is not behind the
        // previous step's barrier-like __syncwarp.
        u32 digit = begin < end ? sort_digit(src_key, src_idx, begin, by_idx, shift, key_base, idx_base) : 0u;
        #pragma unroll 1
        for (int p = begin; p < end; p += 32) {
            const u32 next = p + 32 < end ? sort_digit(src_key, src_idx, p + 32, by_idx, shift, key_base, idx_base) : 0u;
            ranks[p] = warp_digit_rank(digit, mine);
            digit = next;
        }
        __syncthreads();
        block_digit_offsets<WARPS>(counts, scratch);
        K* dst_key = flipped ? key : key2;
        u32* dst_idx = flipped ? idx : idx2;
        #pragma unroll 4
        for (int p = begin; p < end; p += 32) {
            const u32 at = mine[ranks[p] >> 16] + (ranks[p] & 0xFFFFu);
            dst_key[at] = src_key[p];
            dst_idx[at] = src_idx[p];
        }
        __syncthreads();
        flipped = !flipped;
    }
    return flipped;
}

}  // namespace hs
