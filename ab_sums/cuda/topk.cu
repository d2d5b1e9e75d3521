// Exact row top-k: one read of the row against a sampled threshold.
//
// Order: key descending, then index ascending, over order-preserving keys
// (topk_keys.cuh). The top k under that total order is unique, so every
// exact step below gives the same output whatever the scheduling.
//
// A block of THREADS threads selects from one chunk of a row (a row is cut
// into `chunks` chunks when there are too few rows to fill the GPU); each of
// its warps owns one contiguous span of the chunk and reads it in 16-byte
// vectors, UNROLL of them in flight per lane.
//   1. Threshold T: the `sample_r`-th largest key of `sample_m` keys read at
//      evenly spaced places of the row (or T = 0, every key, for short rows).
//      sample_r is set so that T lies at or below the k-th key except with
//      negligible probability, and the keys above T number about 1.1-1.6 k.
//   2. One pass: keys > T go to a shared-memory buffer of `cap` entries
//      (key, index); keys == T are only counted, per span. A cheap
//      conservative test on the raw bits sends few elements to the exact key.
//   3. Many chunks: each block copies its buffer and counts to the workspace;
//      the last block of the row (atomic ticket) gathers them and finishes.
//      The ticket only picks which block finishes; the result is the same.
//   4. Finish: if more than k keys are above T, cut the buffer to the top k
//      (radix select of the k-th key, then of the last index among its ties).
//      If fewer, all of them are taken and the k-th key is T: the missing
//      ones are the lowest-index elements equal to T, found by re-reading
//      only the spans that hold them, in index order.
//      If T was too high or the buffer overflowed, the exact k-th key is
//      found by radix-select passes over the row and step 2 runs again with
//      it (rare: only when the sample misrepresents the row).
//   5. Sort the k pairs (LSD radix sort in shared memory), write indices
//      and values.
#include "select.cuh"
#include "topk_keys.cuh"
#include "topk_pass.cuh"

using namespace hs;

// The scalar arguments of an entry point, passed by value as one struct
// (hyscale_core/ops/topk/gpu.py builds it: ARGS_DTYPE, same field order).
struct TopkArgs {
    u32 rows, n, k;  // rows of length n, k kept per row
    u32 chunks;      // blocks per row
    u32 cap;         // buffer entries per block
    u32 sample_m;    // sampled keys per row (0: no sample, T keeps every key)
    u32 sample_r;    // rank of T among them
    u32 k_pad;       // the sort's size: a power of two >= max(k, 128)
    u32 by_key;      // sort by key (else by index)
};

namespace {

#ifndef HS_TOPK_THREADS
#define HS_TOPK_THREADS 512
#endif
constexpr int THREADS = HS_TOPK_THREADS;  // the entry points' block size (256 or 512)
constexpr int BLOCKS_PER_SM = 1024 / THREADS;  // 64 registers per thread at most
constexpr int WARPS = THREADS / 32;
constexpr int MAX_CHUNKS = 64;
constexpr int MAX_SPANS = MAX_CHUNKS * WARPS;
constexpr int META = 1 + WARPS;  // per chunk: keys above T, then ties per span
constexpr u32 NO_INDEX = 0xFFFFFFFFu;
static_assert(WARPS * 256 * sizeof(u16) <= MAX_BINS * sizeof(u32), "the sort's digit counts live in hist");

struct __align__(16) RowShared {
    u32 hist[MAX_BINS];
    u32 scratch[MAX_WARPS + 1];
    u32 found[2];
    u32 n_gt;  // keys above T appended to the buffer (may exceed cap: overflow)
    u32 flag;  // the buffer overflowed
    u32 last;  // this block is the last of its row to finish its chunk
    u32 span_ties[MAX_SPANS];  // keys equal to T in each span
};

__device__ __forceinline__ u32 warp_sum(u32 x) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(FULL_MASK, x, d);
    return x;
}

// Step 2 for the spans of chunk `chunk`, warp w taking span chunk * WARPS + w.
// Leaves sh.n_gt and sh.span_ties of those spans set.
template <class D>
__device__ void run_pass(const typename D::Bits* row, const Layout& L, u32 chunk, const Pass<D>& p, RowShared& sh) {
    const u32 s = chunk * WARPS + warp_id();
    const u32 ties = warp_sum(pass_span<D>(row, L, s, p));
    if (lane_id() == 0) sh.span_ties[s] = ties;
    __syncthreads();
}

// Step 1: the r-th largest of m keys sampled at evenly spaced vectors.
template <class D>
__device__ typename D::K sample_threshold(const typename D::Bits* row, const Layout& L, u32 m, u32 r,
                                          typename D::K* skey, RowShared& sh) {
    typedef typename D::K K;
    const u32 mv = m / D::VEC;
    const uint4* vec = reinterpret_cast<const uint4*>(row + L.head);
    for (u32 j = threadIdx.x; j < mv; j += blockDim.x) {
        const uint4 x = __ldg(vec + (u32)((u64)j * L.nv / mv));
        #pragma unroll
        for (int e = 0; e < D::VEC; ++e) skey[j * D::VEC + e] = D::key(lane_bits<D>(x, e));
    }
    __syncthreads();
    // Exactly the r-th largest: T is then a key of the row, so a value
    // repeated across the row stays a tie of T instead of crowding the buffer.
    u32 above;
    return block_kth_largest<K, D::W>([&](u32 i) { return skey[i]; }, [](u32) { return true; }, m, r, sh.hist,
                                      sh.scratch, sh.found, &above);
}

// Step 3: publish this chunk; the row's last block gathers every chunk's
// keys above T into its buffer and returns true (others return false).
// The workspace holds, per (row, chunk) slot: cap keys, then cap indices,
// then META counts; `done` one ticket counter per row, zero between launches
// (the last block resets it).
template <class D>
__device__ bool gather_chunks(u32 row_id, u32 chunk, u32 chunks, u32 cap, typename D::K* key, u32* idx,
                              unsigned char* ws, u32 rows, u32* done, RowShared& sh) {
    typedef typename D::K K;
    const size_t slots = (size_t)rows * chunks;
    K* ws_key = reinterpret_cast<K*>(ws);
    u32* ws_idx = reinterpret_cast<u32*>(ws + slots * cap * sizeof(K));
    u32* ws_meta = ws_idx + slots * cap;
    const size_t first = (size_t)row_id * chunks;
    const u32 mine = min(sh.n_gt, cap);
    for (u32 j = threadIdx.x; j < mine; j += blockDim.x) {
        ws_key[(first + chunk) * cap + j] = key[j];
        ws_idx[(first + chunk) * cap + j] = idx[j];
    }
    u32* meta = ws_meta + (first + chunk) * META;
    if (threadIdx.x == 0) meta[0] = sh.n_gt;
    if (threadIdx.x < WARPS) meta[1 + threadIdx.x] = sh.span_ties[chunk * WARPS + threadIdx.x];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) sh.last = atomicAdd(done + row_id, 1u) == chunks - 1;
    __syncthreads();
    if (!sh.last) return false;
    __threadfence();
    // hist[c]: chunks before c hold this many keys above T (c <= chunks).
    const u32 count = threadIdx.x < chunks ? __ldcg(ws_meta + (first + threadIdx.x) * META) : 0u;
    u32 total;
    const u32 before = block_exclusive_sum(count, sh.scratch, &total);
    if (threadIdx.x <= chunks) sh.hist[threadIdx.x] = before;
    const bool overflow = __syncthreads_or(count > cap) || total > cap;
    for (u32 s = threadIdx.x; s < chunks * WARPS; s += blockDim.x)
        sh.span_ties[s] = __ldcg(ws_meta + (first + s / WARPS) * META + 1 + s % WARPS);
    if (!overflow) {
        // GATHER entries per thread per round, all loads issued before any
        // store (3: the most that adds no register spills, ptxas -v).
        constexpr u32 GATHER = 3;
        for (u32 j0 = threadIdx.x; j0 < total; j0 += GATHER * blockDim.x) {
            K k_of[GATHER];
            u32 i_of[GATHER];
            #pragma unroll
            for (u32 g = 0; g < GATHER; ++g) {
                const u32 j = min(j0 + g * blockDim.x, total - 1);  // past the end: a repeat load
                u32 lo = 0, hi = chunks - 1;  // the chunk c with hist[c] <= j < hist[c + 1]
                while (lo < hi) {
                    const u32 mid = (lo + hi + 1) / 2;
                    if (sh.hist[mid] <= j) lo = mid;
                    else hi = mid - 1;
                }
                const size_t at = (first + lo) * cap + (j - sh.hist[lo]);
                k_of[g] = __ldcg(ws_key + at);
                i_of[g] = __ldcg(ws_idx + at);
            }
            #pragma unroll
            for (u32 g = 0; g < GATHER; ++g) {
                const u32 j = j0 + g * blockDim.x;
                if (j < total) {
                    key[j] = k_of[g];
                    idx[j] = i_of[g];
                }
            }
        }
    }
    if (threadIdx.x == 0) {
        sh.n_gt = total;
        sh.flag = overflow;
        done[row_id] = 0;
    }
    __syncthreads();
    return true;
}

// Keep exactly the top k of the n buffer entries, moved to [0, k).
template <class D>
__device__ void cut(typename D::K* key, u32* idx, u32 n, u32 k, RowShared& sh) {
    typedef typename D::K K;
    u32 above, equal;
    const K kth = block_kth_largest<K, D::W>([&](u32 i) { return key[i]; }, [](u32) { return true; }, n, k,
                                             sh.hist, sh.scratch, sh.found, &above, &equal);
    const u32 need = k - above;  // ties of kth to keep: the lowest indices
    u32 last = NO_INDEX;
    if (equal > need) {
        u32 unused;
        last = ~block_kth_largest<u32, 32>([&](u32 i) { return ~idx[i]; }, [&](u32 i) { return key[i] == kth; },
                                           n, need, sh.hist, sh.scratch, sh.found, &unused);
    }
    // Stable compaction in place: an entry only moves down, past entries
    // already read in an earlier round.
    u32 done = 0;
    for (u32 base = 0; base < n; base += blockDim.x) {
        const u32 i = base + threadIdx.x;
        K k_i = 0;
        u32 i_i = 0;
        bool keep = false;
        if (i < n) {
            k_i = key[i];
            i_i = idx[i];
            keep = k_i > kth || (k_i == kth && i_i <= last);
        }
        u32 total;
        const u32 pos = done + block_exclusive_sum(keep ? 1u : 0u, sh.scratch, &total);
        if (keep) {
            key[pos] = k_i;
            idx[pos] = i_i;
        }
        done += total;
    }
    __syncthreads();
}

// Warp w writes the first `take` elements equal to T of span s, in index order.
template <class D>
__device__ void span_ties(const typename D::Bits* row, const Layout& L, u32 s, typename D::K T, u32 take,
                          typename D::K* key, u32* idx) {
    u32 found = 0;
    // One piece: lane's `count` slots of x hold elements ibase + e.
    auto piece = [&](const uint4& x, u32 count, u32 ibase) {
        u32 mine = 0;
        #pragma unroll
        for (int e = 0; e < D::VEC; ++e)
            if (e < (int)count && D::key(lane_bits<D>(x, e)) == T) mine |= 1u << e;
        const u32 c = __popc(mine);
        const u32 inclusive = warp_inclusive_sum(c);
        u32 pos = found + inclusive - c;
        #pragma unroll
        for (int e = 0; e < D::VEC; ++e) {
            if (mine & (1u << e)) {
                if (pos < take) {
                    key[pos] = T;
                    idx[pos] = ibase + e;
                }
                ++pos;
            }
        }
        found += __shfl_sync(FULL_MASK, inclusive, 31);
    };
    auto scalars = [&](u32 first, u32 count) {
        const bool mine = lane_id() < count;
        piece(mine ? scalar_vector<D>(row, first + lane_id()) : uint4{}, mine ? 1u : 0u, first + lane_id());
    };
    if (s == 0 && L.head) scalars(0, L.head);
    const uint4* vec = reinterpret_cast<const uint4*>(row + L.head);
    const u32 v0 = min(s * L.sv, L.nv), v1 = min(v0 + L.sv, L.nv);
    // UNROLL vectors per lane in flight, then taken in index order (the
    // writes stop at `take`, so a step past the last needed tie is harmless).
    for (u32 v = v0; v < v1 && found < take; v += 32 * UNROLL) {
        uint4 x[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 w = v + 32 * u + lane_id();
            x[u] = w < v1 ? __ldg(vec + w) : uint4{};
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 w = v + 32 * u + lane_id();
            piece(x[u], w < v1 ? (u32)D::VEC : 0u, L.head + w * D::VEC);
        }
    }
    if (s == L.spans - 1 && L.tail && found < take) scalars(L.head + L.nv * D::VEC, L.tail);
}

// Append to the buffer at [base, base + need) the `need` lowest-index
// elements equal to T, given the count of them in every span.
template <class D>
__device__ void take_ties(const typename D::Bits* row, const Layout& L, typename D::K T, u32 need, u32 base,
                          typename D::K* key, u32* idx, RowShared& sh) {
    u32 run = 0;  // hist[s]: elements equal to T in spans before s
    for (u32 first = 0; first < L.spans; first += blockDim.x) {
        const u32 s = first + threadIdx.x;
        u32 total;
        const u32 before = block_exclusive_sum(s < L.spans ? sh.span_ties[s] : 0u, sh.scratch, &total);
        if (s < L.spans) sh.hist[s] = run + before;
        run += total;
    }
    __syncthreads();
    for (u32 s = warp_id(); s < L.spans; s += WARPS) {
        const u32 off = sh.hist[s];
        if (off >= need || sh.span_ties[s] == 0) continue;
        const u32 take = min(sh.span_ties[s], need - off);
        span_ties<D>(row, L, s, T, take, key + base + off, idx + base + off);
    }
    __syncthreads();
}

// Step 5: sort the k pairs in [0, k) (key descending then index ascending,
// or index ascending), through [k_pad, 2 k_pad) of the buffer, and write them.
// The sort covers only the bytes in which the k keys (indices) differ: it
// runs on offsets from their minimum, and padding sorts last (lowest key,
// offset index all ones).
template <class D, int E>
__device__ void sort_and_write(const typename D::Bits* row, u32 k, u32 k_pad, bool by_key, typename D::K* key,
                               u32* idx, RowShared& sh, i64* out_idx, typename D::Bits* out_val) {
    typedef typename D::K K;
    K key_lo = ~(K)0, key_hi = 0;
    u32 idx_lo = NO_INDEX, idx_hi = 0;
    for (u32 p = threadIdx.x; p < k; p += blockDim.x) {
        key_lo = min(key_lo, key[p]);
        key_hi = max(key_hi, key[p]);
        idx_lo = min(idx_lo, idx[p]);
        idx_hi = max(idx_hi, idx[p]);
    }
    K* wide = reinterpret_cast<K*>(sh.hist);  // 2 * MAX_WARPS keys: 512 bytes of hist, free here
    block_min_max<K>(key_lo, key_hi, wide, &key_lo, &key_hi);
    block_min_max<u32>(idx_lo, idx_hi, sh.hist, &idx_lo, &idx_hi);
    for (u32 p = k + threadIdx.x; p < k_pad; p += blockDim.x) {
        key[p] = key_lo;
        idx[p] = idx_lo - 1u;
    }
    __syncthreads();
    const int idx_passes = bytes_of<u32>(idx_hi - idx_lo);
    const int key_passes = by_key ? bytes_of<K>(key_hi - key_lo) : 0;
    if (block_radix_sort_desc<E>(key, idx, key + k_pad, idx + k_pad, (int)k_pad, idx_passes, key_passes, key_lo,
                                 idx_lo, reinterpret_cast<u16*>(sh.hist), sh.scratch)) {
        key += k_pad;
        idx += k_pad;
    }
    for (u32 p = threadIdx.x; p < k; p += blockDim.x) {
        typename D::Bits b;
        if (!D::bits_of(key[p], b)) b = row[idx[p]];  // NaN payload or the sign of zero
        out_idx[p] = idx[p];
        out_val[p] = b;
    }
}

template <class D>
__device__ void topk_row(const typename D::Bits* in, const TopkArgs& a, unsigned char* ws, u32* done, i64* out_idx,
                         typename D::Bits* out_val) {
    typedef typename D::K K;
    const u32 rows = a.rows, n = a.n, k = a.k, chunks = a.chunks, cap = a.cap, k_pad = a.k_pad;
    const bool by_key = a.by_key != 0;
    __shared__ RowShared sh;
    extern __shared__ __align__(16) unsigned char smem[];
    K* key = reinterpret_cast<K*>(smem);
    u32* idx = reinterpret_cast<u32*>(smem + (size_t)cap * sizeof(K));
    const u32 row_id = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
    const typename D::Bits* row = in + (size_t)row_id * n;
    Layout L = make_layout<D>(row, n, chunks * WARPS);

    K T = 0;
    if (a.sample_m) T = sample_threshold<D>(row, L, a.sample_m, a.sample_r, key, sh);
    if (threadIdx.x == 0) sh.n_gt = 0;
    __syncthreads();
    run_pass<D>(row, L, chunk, make_pass<D>(T, key, idx, cap, &sh.n_gt), sh);
    if (chunks > 1) {
        if (!gather_chunks<D>(row_id, chunk, chunks, cap, key, idx, ws, rows, done, sh)) return;
    } else {
        if (threadIdx.x == 0) sh.flag = sh.n_gt > cap;
        __syncthreads();
    }
    u32 n_gt = sh.n_gt;
    u32 ties_total;
    u32 mine = 0;
    for (u32 s = threadIdx.x; s < L.spans; s += blockDim.x) mine += sh.span_ties[s];
    block_exclusive_sum(mine, sh.scratch, &ties_total);
    if (sh.flag || n_gt + ties_total < k) {
        // T too high, or too many keys above it: find the exact k-th key.
        u32 above;
        T = block_kth_largest<K, D::W>([&](u32 i) { return D::key(row[i]); }, [](u32) { return true; }, n, k,
                                       sh.hist, sh.scratch, sh.found, &above);
        L = make_layout<D>(row, n, WARPS);
        if (threadIdx.x == 0) sh.n_gt = 0;
        __syncthreads();
        run_pass<D>(row, L, 0, make_pass<D>(T, key, idx, cap, &sh.n_gt), sh);
        n_gt = sh.n_gt;  // == above < k
    }
    if (n_gt > k) cut<D>(key, idx, n_gt, k, sh);
    else if (n_gt < k) take_ties<D>(row, L, T, k - n_gt, n_gt, key, idx, sh);

    out_idx += (size_t)row_id * k;
    out_val += (size_t)row_id * k;
    if (k_pad <= THREADS) sort_and_write<D, 1>(row, k, k_pad, by_key, key, idx, sh, out_idx, out_val);
    else if (k_pad <= 2 * THREADS) sort_and_write<D, 2>(row, k, k_pad, by_key, key, idx, sh, out_idx, out_val);
    else if (k_pad <= 4 * THREADS) sort_and_write<D, 4>(row, k, k_pad, by_key, key, idx, sh, out_idx, out_val);
    else if (k_pad <= 8 * THREADS) sort_and_write<D, 8>(row, k, k_pad, by_key, key, idx, sh, out_idx, out_val);
    else sort_and_write<D, 16>(row, k, k_pad, by_key, key, idx, sh, out_idx, out_val);
}

}  // namespace

// Entry points: one grid of rows * chunks blocks of THREADS threads; `cap`
// buffer entries of dynamic shared memory (cap * (sizeof(K) + 4) bytes).
// With chunks > 1: `ws` of rows * chunks * (cap * (sizeof(K) + 4) + 4 * META)
// bytes, `done` rows zeroed words; else both unused.
#define HS_TOPK_ENTRY(NAME, D)                                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)                                     \
    NAME(const D::Bits* in, TopkArgs args, unsigned char* ws, u32* done, i64* out_idx, D::Bits* out_val) {   \
        topk_row<D>(in, args, ws, done, out_idx, out_val);                                                   \
    }
#define HS_TOPK_ENTRIES(NAME, D)                 \
    HS_TOPK_ENTRY(topk_##NAME##_largest, D<false>) \
    HS_TOPK_ENTRY(topk_##NAME##_smallest, D<true>)

// HS_TOPK_DTYPE (0 float16, 1 bfloat16, 2 float32, 3 float64, 4 int32,
// 5 int64) builds one dtype's entry points; unset builds all.
#if !defined(HS_TOPK_DTYPE) || HS_TOPK_DTYPE == 0
HS_TOPK_ENTRIES(float16, Float16)
#endif
#if !defined(HS_TOPK_DTYPE) || HS_TOPK_DTYPE == 1
HS_TOPK_ENTRIES(bfloat16, BFloat16)
#endif
#if !defined(HS_TOPK_DTYPE) || HS_TOPK_DTYPE == 2
HS_TOPK_ENTRIES(float32, Float32)
#endif
#if !defined(HS_TOPK_DTYPE) || HS_TOPK_DTYPE == 3
HS_TOPK_ENTRIES(float64, Float64)
#endif
#if !defined(HS_TOPK_DTYPE) || HS_TOPK_DTYPE == 4
HS_TOPK_ENTRIES(int32, Int32)
#endif
#if !defined(HS_TOPK_DTYPE) || HS_TOPK_DTYPE == 5
HS_TOPK_ENTRIES(int64, Int64)
#endif
