// Exact row top-k: an MSB-first radix select over order-preserving keys.
//
// One block owns one segment (a row, or a slice of a long row) at a time and
// walks digit levels of DIGIT_BITS bits. A level is a key prefix: its members
// are the keys whose high bits equal it. The first pass histograms the top
// digit of the whole segment. Every later pass reads the members of the
// previous level (from the segment, or from a candidate buffer once they
// fit), sends keys above the current level to the output, and histograms
// (and buffers) the members of the current level; the histogram then picks
// the bucket holding the k-th key. The walk ends early when a bucket is
// taken whole, or when every member shares one key. Keys equal to the final
// threshold are taken lowest index first, so the selected set never depends
// on scheduling; slots are filled by atomics but a final sort on the unique
// (key, index) order fixes the output order.
#include "select.cuh"

using namespace hs;

namespace {

constexpr int THREADS = 512;    // block size the entry points are built for
constexpr int SORT_CAP = 4096;  // selections up to this size are sorted here
constexpr int TIE_CAP = 4096;   // ties up to this many are ranked in shared memory

enum Mode { CONTINUE = 0, ALL_TAKEN = 1, TIES = 2 };
enum SortMode { BY_INDEX = 0, BY_KEY = 1, UNSORTED = 2 };

template <typename K>
struct Level {
    K prefix;
    int shift;  // members: shr(key, shift) == prefix
};

struct RowShared {
    u32 hist[MAX_BINS];
    u32 scratch[MAX_WARPS + 1];
    u64 reduce[MAX_WARPS];
    u32 found[2];
    u32 n_out, n_next, n_ties;
};

// Rows are read in vectors of 4 elements (2 for 64-bit data): 8 or 16 bytes.
template <typename Bits> struct Vec { typedef uint4 type; static constexpr int width = 4; };
template <> struct Vec<u16> { typedef uint2 type; static constexpr int width = 4; };
template <> struct Vec<u64> { typedef uint4 type; static constexpr int width = 2; };

template <typename Bits, typename V>
__device__ __forceinline__ Bits lane_of(const V& v, int u) {
    if constexpr (sizeof(Bits) == 2) {
        const u32 w = (u >> 1) ? v.y : v.x;
        return (Bits)((w >> (16 * (u & 1))) & 0xffffu);
    } else if constexpr (sizeof(Bits) == 4) {
        return (Bits)(u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w);
    } else {
        return u == 0 ? (((u64)v.y << 32) | v.x) : (((u64)v.w << 32) | v.z);
    }
}

template <typename K>
__device__ __forceinline__ void track(K key, bool valid, K& kmin, K& kmax) {
    if (valid) {
        kmin = key < kmin ? key : kmin;
        kmax = key > kmax ? key : kmax;
    }
}

// First pass: histogram of the top digit of every key, and their range.
template <typename K>
struct TopDigit {
    int shift;
    u32* hist;
    K kmin, kmax;

    __device__ __forceinline__ void visit(K key, u32, bool valid) {
        warp_histogram_add(hist, (u32)(key >> shift), valid);
        track(key, valid, kmin, kmax);
    }
};

// A later pass over the members of level `m`, classified against level `c`.
template <typename Bits, typename K>
struct Pass {
    Level<K> m, c;
    int mode, digit;
    bool check_m, write_buf;
    Bits* dst_key;
    u32* dst_idx;
    Bits* out_key;
    u32* out_idx;
    u32 out_cap;
    Bits* tie_key;
    u32* tie_idx;
    RowShared* sh;
    K kmin, kmax;

    // All 32 lanes of every warp call this in step.
    __device__ __forceinline__ void visit(K key, u32 idx, bool valid) {
        if (check_m) valid = valid && shr(key, m.shift) == m.prefix;
        const K hi = shr(key, c.shift);
        const bool member = valid && hi == c.prefix;
        const bool to_out = (valid && hi > c.prefix) || (member && mode == ALL_TAKEN);
        const u32 slot = warp_append(&sh->n_out, to_out);
        if (to_out && slot < out_cap) {
            out_key[slot] = (Bits)key;
            out_idx[slot] = idx;
        }
        if (mode == CONTINUE) {
            const u32 bin = (u32)((key >> (c.shift - digit)) & (((K)1 << digit) - 1));
            warp_histogram_add(sh->hist, bin, member);
            if (write_buf) {
                const u32 s = warp_append(&sh->n_next, member);
                if (member) {
                    dst_key[s] = (Bits)key;
                    dst_idx[s] = idx;
                }
            }
            track(key, member, kmin, kmax);
        } else if (mode == TIES) {
            const u32 s = warp_append(&sh->n_ties, member);
            if (member && s < TIE_CAP) {
                tie_key[s] = (Bits)key;
                tie_idx[s] = idx;
            }
        }
    }
};

// Visit every element of a row in index order. Aligned rows are read in
// vectors, the next one loaded while the current one is visited.
template <typename Bits, typename K, typename Visitor>
__device__ void visit_row(const Bits* row, i64 len, const KeyCodec<K>& codec, Visitor& v) {
    typedef typename Vec<Bits>::type VecT;
    constexpr int W = Vec<Bits>::width;
    i64 done = 0;
    if ((reinterpret_cast<size_t>(row) & (sizeof(VecT) - 1)) == 0) {
        const VecT* vec = reinterpret_cast<const VecT*>(row);
        const i64 n_vec = len / W;
        i64 i = threadIdx.x;
        VecT cur = i < n_vec ? __ldg(vec + i) : VecT{};
        for (i64 base = 0; base < n_vec; base += blockDim.x, i += blockDim.x) {
            const i64 next = i + blockDim.x;
            const VecT nxt = next < n_vec ? __ldg(vec + next) : VecT{};
            #pragma unroll
            for (int u = 0; u < W; ++u)
                v.visit(codec.key((K)lane_of<Bits>(cur, u)), (u32)(i * W + u), i < n_vec);
            cur = nxt;
        }
        done = n_vec * W;
    }
    for (i64 base = done; base < len; base += blockDim.x) {
        const i64 j = base + threadIdx.x;
        const bool valid = j < len;
        v.visit(valid ? codec.key((K)row[j]) : (K)0, (u32)j, valid);
    }
}

template <typename Bits, typename K, typename Visitor>
__device__ void visit_buffer(const Bits* keys, const u32* idx, u32 count, Visitor& v) {
    for (u32 base = 0; base < count; base += blockDim.x) {
        const u32 i = base + threadIdx.x;
        const bool valid = i < count;
        v.visit(valid ? (K)keys[i] : (K)0, valid ? idx[i] : 0u, valid);
    }
}

// Take the `need` lowest indices whose key equals `thr`, scanning in index order.
template <typename Bits, typename K>
__device__ void take_ties_in_order(const Bits* row, i64 len, const KeyCodec<K>& codec, K thr, u32 need,
                                   Bits* out_key, u32* out_idx, u32 out_base, RowShared& sh) {
    u32 taken = 0;
    for (i64 base = 0; base < len && taken < need; base += blockDim.x) {
        const i64 i = base + threadIdx.x;
        const bool tie = i < len && codec.key((K)row[i]) == thr;
        u32 total;
        const u32 pos = block_exclusive_sum(tie ? 1u : 0u, sh.scratch, &total);
        if (tie && taken + pos < need) {
            out_key[out_base + taken + pos] = (Bits)thr;
            out_idx[out_base + taken + pos] = (u32)i;
        }
        taken += total;
    }
}

// Of the n <= TIE_CAP ties gathered in shared memory, take the `need` lowest.
template <typename Bits>
__device__ void take_ties_from_shared(Bits* tie_key, u32* tie_idx, u32 n, u32 need, Bits thr, Bits* out_key,
                                      u32* out_idx, u32 out_base) {
    int n_pad = 1;
    while (n_pad < (int)n) n_pad <<= 1;
    for (int i = n + threadIdx.x; i < n_pad; i += blockDim.x) tie_idx[i] = 0xffffffffu;
    __syncthreads();
    block_bitonic_sort<false>(tie_key, tie_idx, n_pad);
    for (u32 j = threadIdx.x; j < need; j += blockDim.x) {
        out_key[out_base + j] = thr;
        out_idx[out_base + j] = tie_idx[j];
    }
    __syncthreads();
}

// Order the k picks held in out_key/out_idx and write the final results.
// Index order goes through a bitmap of the segment when it fits the work
// area, else (like key order) through a bitonic sort.
template <typename Bits>
__device__ void write_result(const Bits* row, i64 len, const Bits* out_key, u32* out_idx, u32 k, int sort_mode,
                             Bits* work_key, u32* work_idx, RowShared& sh, i64 index_offset, i64* final_idx,
                             Bits* final_val) {
    constexpr u32 WORK_BITS = SORT_CAP * (sizeof(Bits) + 4) * 8;
    if (sort_mode == UNSORTED) {
        for (u32 j = threadIdx.x; j < k; j += blockDim.x) {
            final_idx[j] = index_offset + out_idx[j];
            final_val[j] = row[out_idx[j]];
        }
        return;
    }
    if (sort_mode == BY_INDEX && len <= (i64)WORK_BITS) {
        block_sort_positions(out_idx, k, (u32)len, reinterpret_cast<u32*>(work_key), sh.scratch, out_idx);
        for (u32 j = threadIdx.x; j < k; j += blockDim.x) {
            final_idx[j] = index_offset + out_idx[j];
            final_val[j] = row[out_idx[j]];
        }
        return;
    }
    int n_pad = 1;
    while (n_pad < (int)k) n_pad <<= 1;
    for (int j = threadIdx.x; j < n_pad; j += blockDim.x) {
        const bool real = j < (int)k;
        work_key[j] = real ? out_key[j] : (Bits)0;
        work_idx[j] = real ? out_idx[j] : 0xffffffffu;
    }
    __syncthreads();
    if (sort_mode == BY_KEY) block_bitonic_sort<true>(work_key, work_idx, n_pad);
    else block_bitonic_sort<false>(work_key, work_idx, n_pad);
    for (u32 j = threadIdx.x; j < k; j += blockDim.x) {
        final_idx[j] = index_offset + work_idx[j];
        final_val[j] = row[work_idx[j]];
    }
}

template <typename K>
__device__ __forceinline__ K block_min(K x, RowShared& sh) {
    return (K)block_reduce((u64)x, sh.reduce, [](u64 a, u64 b) { return a < b ? a : b; });
}

template <typename K>
__device__ __forceinline__ K block_max(K x, RowShared& sh) {
    return (K)block_reduce((u64)x, sh.reduce, [](u64 a, u64 b) { return a > b ? a : b; });
}

// Select the top k (< len) of one segment into out_key/out_idx (any order).
template <typename Bits, typename K>
__device__ void select_segment(const Bits* row, i64 len, u32 k, const KeyCodec<K>& codec, int width,
                               Bits* buf_key, u32* buf_idx, u32 cap, Bits* out_key, u32* out_idx,
                               Bits* tie_key, u32* tie_idx, RowShared& sh) {
    for (int i = threadIdx.x; i < MAX_BINS; i += blockDim.x) sh.hist[i] = 0;
    if (threadIdx.x == 0) sh.n_out = 0;
    __syncthreads();
    const int top = min(DIGIT_BITS, width);
    TopDigit<K> first{width - top, sh.hist, (K)~(K)0, (K)0};
    visit_row(row, len, codec, first);
    __syncthreads();

    Level<K> m = {(K)0, width}, c = {(K)0, width};
    int mode = CONTINUE, digit = top;
    int written = -1;       // candidate-buffer half holding the members of c, or -1
    u64 c_size = (u64)len;  // members of level c
    u32 k_rem = k;
    K kmin = block_min(first.kmin, sh), kmax = block_max(first.kmax, sh);
    for (;;) {
        // The histogram holds the members of c: pick the bucket of the k-th key.
        u32 above;
        const int bucket = block_find_bucket(sh.hist, 1 << digit, k_rem, sh.scratch, sh.found, &above);
        k_rem -= above;
        const u64 count = sh.hist[bucket];
        const int src = written;  // -1: read the segment itself
        const u32 src_count = (u32)c_size;
        m = c;
        c = kmin == kmax ? Level<K>{kmin, 0} : Level<K>{(K)((c.prefix << digit) | (K)bucket), c.shift - digit};
        c_size = count;
        mode = count == k_rem ? ALL_TAKEN : (c.shift == 0 ? TIES : CONTINUE);

        // Pass over the members of m, classified against the new c.
        digit = mode == CONTINUE ? min(DIGIT_BITS, c.shift) : 0;
        const bool write_buf = mode == CONTINUE && c_size <= cap;
        const int dst = src == 0 ? 1 : 0;
        __syncthreads();
        for (int i = threadIdx.x; i < (1 << digit); i += blockDim.x) sh.hist[i] = 0;
        if (threadIdx.x == 0) sh.n_next = sh.n_ties = 0;
        __syncthreads();
        Pass<Bits, K> p{m, c, mode, digit, src == -1 && m.shift < width, write_buf,
                        buf_key + (size_t)dst * cap, buf_idx + (size_t)dst * cap, out_key, out_idx, k,
                        tie_key, tie_idx, &sh, (K)~(K)0, (K)0};
        if (src == -1) visit_row(row, len, codec, p);
        else visit_buffer<Bits, K>(buf_key + (size_t)src * cap, buf_idx + (size_t)src * cap, src_count, p);
        __syncthreads();
        if (mode != CONTINUE) break;
        kmin = block_min(p.kmin, sh);
        kmax = block_max(p.kmax, sh);
        written = write_buf ? dst : -1;
    }
    if (mode == TIES) {
        const u32 base = sh.n_out;
        const u32 n_ties = sh.n_ties;
        __syncthreads();
        if (n_ties <= TIE_CAP)
            take_ties_from_shared(tie_key, tie_idx, n_ties, k_rem, (Bits)c.prefix, out_key, out_idx, base);
        else
            take_ties_in_order(row, len, codec, c.prefix, k_rem, out_key, out_idx, base, sh);
    }
    __syncthreads();
}

template <typename Bits>
__device__ void topk_segments(const Bits* base, i64 row_len, i64 seg_len, int segs_per_row, int n_segments,
                              int k, const KeyCodec<typename KeyOf<Bits>::type>& codec, int width,
                              Bits* buf_key, u32* buf_idx, int cap, Bits* out_key_all, u32* out_idx_all,
                              int sort_mode, i64* final_idx, Bits* final_val, i64 out_row_stride) {
    __shared__ RowShared sh;
    extern __shared__ __align__(16) unsigned char work[];
    Bits* work_key = reinterpret_cast<Bits*>(work);
    u32* work_idx = reinterpret_cast<u32*>(work + SORT_CAP * sizeof(Bits));
    Bits* my_buf_key = buf_key + (size_t)blockIdx.x * 2 * cap;
    u32* my_buf_idx = buf_idx + (size_t)blockIdx.x * 2 * cap;
    Bits* out_key = out_key_all + (size_t)blockIdx.x * k;
    u32* out_idx = out_idx_all + (size_t)blockIdx.x * k;
    for (int seg = blockIdx.x; seg < n_segments; seg += gridDim.x) {
        const i64 r = seg / segs_per_row, b = seg % segs_per_row;
        const i64 start = b * seg_len;
        const i64 len = min(seg_len, row_len - start);
        const Bits* row = base + r * row_len + start;
        const u32 k_eff = (u32)min((i64)k, len);
        if (k_eff == len) {
            for (i64 i = threadIdx.x; i < len; i += blockDim.x) {
                out_key[i] = (Bits)codec.key((typename KeyOf<Bits>::type)row[i]);
                out_idx[i] = (u32)i;
            }
            __syncthreads();
        } else {
            select_segment(row, len, k_eff, codec, width, my_buf_key, my_buf_idx, (u32)cap, out_key, out_idx,
                           work_key, work_idx, sh);
        }
        const i64 off = r * out_row_stride + b * k;
        write_result(row, len, out_key, out_idx, k_eff, sort_mode, work_key, work_idx, sh, start,
                     final_idx + off, final_val + off);
        __syncthreads();
    }
}

}  // namespace

#define HS_TOPK_ENTRY(NAME, BITS, WIDTH)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 2)                                                \
    NAME(const BITS* base, i64 row_len, i64 seg_len, int segs_per_row, int n_segments, int k, u64 ones,     \
         u64 sign, u64 exp_mask, u64 mant_mask, int is_float, int invert, BITS* buf_key, u32* buf_idx,      \
         int cap, BITS* out_key, u32* out_idx, int sort_mode, i64* final_idx, BITS* final_val,              \
         i64 out_row_stride) {                                                                              \
        typedef KeyOf<BITS>::type K;                                                                        \
        const KeyCodec<K> codec{(K)ones, (K)sign, (K)exp_mask, (K)mant_mask, is_float != 0, invert != 0};   \
        topk_segments<BITS>(base, row_len, seg_len, segs_per_row, n_segments, k, codec, WIDTH, buf_key,    \
                            buf_idx, cap, out_key, out_idx, sort_mode, final_idx, final_val,               \
                            out_row_stride);                                                              \
    }

// HS_TOPK_WIDTH (16, 32 or 64) builds one entry point only; unset builds all.
#if !defined(HS_TOPK_WIDTH) || HS_TOPK_WIDTH == 16
HS_TOPK_ENTRY(topk_select_u16, u16, 16)
#endif
#if !defined(HS_TOPK_WIDTH) || HS_TOPK_WIDTH == 32
HS_TOPK_ENTRY(topk_select_u32, u32, 32)
#endif
#if !defined(HS_TOPK_WIDTH) || HS_TOPK_WIDTH == 64
HS_TOPK_ENTRY(topk_select_u64, u64, 64)
#endif
