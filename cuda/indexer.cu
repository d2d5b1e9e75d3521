// Fused DSA indexer: scores on tensor cores and each query's exact top-k,
// streamed over key tiles; the [Nq, Nk] table is never held.
//
//   I[t, s] = sum_h w[t, h] * relu(dot(q[t, h, :], k[s, :]))
//
// A CTA is one warpgroup. It owns a group of TQ = 256 / H queries at a time
// (persistent grid, groups handed out longest first) and keeps their TQ * H
// query rows in shared memory as the B operand of wgmma m64n256k16; key tiles
// of 64 rows stream through a two-stage cp.async pipeline as the A operand.
// The accumulator row is a key, the column a (query, head) pair, so the head
// sum is a per-thread sum over its columns plus a two-step quad butterfly.
//
// Selection (indexer_topk_*): a score enters the query's candidate buffer
// only if its key beats the running threshold; when the buffer passes 2k
// entries it is cut back to the top k (by key, then lower index) and the
// threshold rises to the k-th key. Tiles go in ascending key order, so a
// later key equal to the threshold ranks below every kept one: the strict
// test is exact. The end of the stream cuts to k and sorts.
// Scores (indexer_scores_*) run the same tile code and write the table, so
// both give bitwise-identical scores.
#include "select.cuh"
#include "topk_keys.cuh"
#include "wgmma.cuh"

using namespace hs;

#ifndef HS_IDX_HEADS
#define HS_IDX_HEADS 64
#endif
#ifndef HS_IDX_DIM
#define HS_IDX_DIM 128
#endif
#ifndef HS_IDX_F16
#define HS_IDX_F16 0
#endif

namespace {

constexpr int H = HS_IDX_HEADS;
constexpr int D = HS_IDX_DIM;
constexpr bool F16 = HS_IDX_F16;   // float16 operands, else bfloat16
constexpr int QROWS = 256;          // query-head rows per group: the wgmma N
constexpr int TQ = QROWS / H;       // queries per group
constexpr int KT = 64;              // keys per tile: the wgmma M
constexpr int STAGES = 2;
constexpr int THREADS = 128;
constexpr int Q_BYTES = QROWS * D * 2;
constexpr int K_BYTES = KT * D * 2;
constexpr int SORT_CAP = STAGES * K_BYTES / 8;  // (key, index) pairs the final sort holds
static_assert(H >= 8 && QROWS % H == 0 && TQ <= 32, "heads must divide 256, at least 8");
static_assert(D % 64 == 0 && D <= 256, "head dim must be a multiple of 64");

constexpr u32 NEG_INF_BITS = 0xFF800000u;
constexpr u32 NEG_INF_KEY = 0x007FFFFFu;  // key of -inf: thresholds start here

__device__ __forceinline__ u32 score_key(u32 bits) { return Float32<false>::key(bits); }

__device__ __forceinline__ u32 key_to_bits(u32 key) { return (key & 0x80000000u) ? (key ^ 0x80000000u) : ~key; }

struct GroupShared {
    u32 hist[MAX_BINS];
    u32 scratch[MAX_WARPS + 1];
    u32 found[2];
    u32 next_slot;
    int group;
    int lo[TQ], hi[TQ];
    u32 count[TQ], thr[TQ], flip[TQ];
};

__device__ __forceinline__ void mma_tile(float (&acc)[128], const unsigned char* k_tile, const unsigned char* q_tile) {
    wgmma_fence_operands(acc);
    wgmma_fence();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_m64n256k16<F16>(acc, wgmma_desc_k(k_tile, kk, KT), wgmma_desc_k(q_tile, kk, QROWS), kk > 0);
    wgmma_commit();
    wgmma_wait_all();
    wgmma_fence_operands(acc);
}

// Copy `rows` rows of D 16-bit elements (row r from src + r * D) into the
// swizzled layout; rows at or past `valid_rows` are zero-filled.
__device__ __forceinline__ void load_rows(unsigned char* dst, const u16* src, int rows, int valid_rows) {
    constexpr int CHUNKS = D / 8;
    for (int c = threadIdx.x; c < rows * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, chunk = c % CHUNKS;
        const bool valid = r < valid_rows;
        cp_async16(dst + swizzled_offset(r, chunk, rows), src + (size_t)(valid ? r : 0) * D + chunk * 8, valid);
    }
}

// Head-weighted ReLU sums of the tile: scores[qi][rr] for key rows
// row0 + 8 * rr, identical in the four lanes of a quad.
__device__ __forceinline__ void head_sums(const float (&acc)[128], const float* w_s, float (&scores)[TQ][2]) {
    const int quad = threadIdx.x & 3;
    #pragma unroll
    for (int qi = 0; qi < TQ; ++qi) {
        float s0 = 0.f, s1 = 0.f;
        #pragma unroll
        for (int jj = 0; jj < H / 8; ++jj) {
            const int j = qi * (H / 8) + jj;
            const float2 wv = *reinterpret_cast<const float2*>(w_s + qi * H + 8 * jj + 2 * quad);
            s0 = fmaf(wv.x, fmaxf(acc[4 * j + 0], 0.f), s0);
            s0 = fmaf(wv.y, fmaxf(acc[4 * j + 1], 0.f), s0);
            s1 = fmaf(wv.x, fmaxf(acc[4 * j + 2], 0.f), s1);
            s1 = fmaf(wv.y, fmaxf(acc[4 * j + 3], 0.f), s1);
        }
        s0 += __shfl_xor_sync(FULL_MASK, s0, 1);
        s1 += __shfl_xor_sync(FULL_MASK, s1, 1);
        s0 += __shfl_xor_sync(FULL_MASK, s0, 2);
        s1 += __shfl_xor_sync(FULL_MASK, s1, 2);
        scores[qi][0] = s0 != s0 ? __int_as_float(0x7FFFFFFF) : s0;  // one NaN
        scores[qi][1] = s1 != s1 ? __int_as_float(0x7FFFFFFF) : s1;
    }
}

struct Buffers {
    u32* bits;  // [2][TQ][cap] per CTA
    u32* idx;
    int cap;
    __device__ __forceinline__ size_t at(int flip, int qi) const { return ((size_t)flip * TQ + qi) * cap; }
};

// Cut query qi's candidates back to its top k (score key, then lower index).
__device__ void prune(GroupShared& sh, const Buffers& buf, int qi, u32 k) {
    const u32 n = sh.count[qi];
    const u32* bits = buf.bits + buf.at(sh.flip[qi], qi);
    const u32* idx = buf.idx + buf.at(sh.flip[qi], qi);
    u32* dst_bits = buf.bits + buf.at(sh.flip[qi] ^ 1, qi);
    u32* dst_idx = buf.idx + buf.at(sh.flip[qi] ^ 1, qi);
    u32 above;
    const u32 thr = block_kth_largest([&](u32 i) { return score_key(bits[i]); }, [](u32) { return true; }, n, k,
                                      sh.hist, sh.scratch, sh.found, &above);
    const u32 need = k - above;
    u32 ties_total;
    u32 tie = 0;
    for (u32 i = threadIdx.x; i < n; i += THREADS) tie += score_key(bits[i]) == thr;
    block_exclusive_sum(tie, sh.scratch, &ties_total);
    u32 max_tie_idx = 0xFFFFFFFFu;
    if (ties_total > need) {  // keep the `need` lowest indices among the ties
        u32 unused;
        max_tie_idx = ~block_kth_largest([&](u32 i) { return ~idx[i]; },
                                         [&](u32 i) { return score_key(bits[i]) == thr; }, n, need, sh.hist,
                                         sh.scratch, sh.found, &unused);
    }
    if (threadIdx.x == 0) sh.next_slot = 0;
    __syncthreads();
    for (u32 base = 0; base < n; base += THREADS) {
        const u32 i = base + threadIdx.x;
        const u32 key = i < n ? score_key(bits[i]) : 0u;
        const bool keep = i < n && (key > thr || (key == thr && idx[i] <= max_tie_idx));
        const u32 slot = warp_append(&sh.next_slot, keep);
        if (keep) {
            dst_bits[slot] = bits[i];
            dst_idx[slot] = idx[i];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sh.count[qi] = k;
        sh.thr[qi] = thr;
        sh.flip[qi] ^= 1;
    }
    __syncthreads();
}

// Sort query qi's kept candidates (at most k) and write its output row.
__device__ void write_selection(GroupShared& sh, const Buffers& buf, int qi, u32 k, unsigned char* sort_area,
                                int* out_idx, float* out_scores) {
    if (sh.count[qi] > k) prune(sh, buf, qi, k);
    const u32 n = sh.count[qi];
    const u32* bits = buf.bits + buf.at(sh.flip[qi], qi);
    const u32* idx = buf.idx + buf.at(sh.flip[qi], qi);
    u32* keys = reinterpret_cast<u32*>(sort_area);
    u32* order = keys + SORT_CAP;
    int n_pad = 1;
    while (n_pad < (int)n) n_pad <<= 1;
    for (int j = threadIdx.x; j < n_pad; j += THREADS) {
        keys[j] = j < (int)n ? score_key(bits[j]) : 0u;
        order[j] = j < (int)n ? idx[j] : 0xFFFFFFFFu;
    }
    __syncthreads();
    block_bitonic_sort<true>(keys, order, n_pad);
    for (u32 j = threadIdx.x; j < k; j += THREADS) {
        out_idx[j] = j < n ? (int)order[j] : -1;
        if (out_scores) out_scores[j] = __uint_as_float(j < n ? key_to_bits(keys[j]) : NEG_INF_BITS);
    }
    __syncthreads();
}

struct Problem {
    const u16* q;  // [n_q, H, D]
    const u16* k;  // [n_k, D]
    const float* w;  // [n_q, H]
    const int* lo;   // [n_q] first visible key
    const int* hi;   // [n_q] one past the last visible key
    int n_q, n_k;
};

// Claim the next query group (longest first) and stage its queries, weights and ranges.
__device__ bool next_group(GroupShared& sh, const Problem& p, int* work_counter, unsigned char* q_tile, float* w_s) {
    const int n_groups = (p.n_q + TQ - 1) / TQ;
    if (threadIdx.x == 0) sh.group = n_groups - 1 - atomicAdd(work_counter, 1);
    __syncthreads();
    const int g = sh.group;
    if (g < 0) return false;
    const int t0 = g * TQ;
    load_rows(q_tile, p.q + (size_t)t0 * H * D, QROWS, min(TQ, p.n_q - t0) * H);
    cp_async_commit();
    for (int i = threadIdx.x; i < TQ * H; i += THREADS) w_s[i] = t0 * H + i < p.n_q * H ? p.w[(size_t)t0 * H + i] : 0.f;
    if (threadIdx.x < TQ) {
        const int t = t0 + threadIdx.x;
        sh.lo[threadIdx.x] = t < p.n_q ? p.lo[t] : 0;
        sh.hi[threadIdx.x] = t < p.n_q ? p.hi[t] : 0;
        sh.count[threadIdx.x] = 0;
        sh.thr[threadIdx.x] = NEG_INF_KEY;
        sh.flip[threadIdx.x] = 0;
    }
    __syncthreads();
    return true;
}

// Stream the key tiles of the current group; `consume(s0, scores)` sees each tile.
template <typename Consume>
__device__ void stream_group(GroupShared& sh, const Problem& p, unsigned char* q_tile, unsigned char* k_tiles,
                             const float* w_s, Consume&& consume) {
    int first = 0x7FFFFFFF, last = 0;
    for (int qi = 0; qi < TQ; ++qi)
        if (sh.hi[qi] > sh.lo[qi]) {
            first = min(first, sh.lo[qi]);
            last = max(last, sh.hi[qi]);
        }
    const int begin = first >= last ? 0 : (first / KT) * KT;
    const int n_tiles = first >= last ? 0 : (last - begin + KT - 1) / KT;
    if (n_tiles > 0) load_rows(k_tiles, p.k + (size_t)begin * D, KT, min(KT, p.n_k - begin));
    cp_async_commit();
    float acc[128];
    #pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int j = 0; j < n_tiles; ++j) {
        const int s0 = begin + j * KT;
        if (j + 1 < n_tiles)
            load_rows(k_tiles + ((j + 1) % STAGES) * K_BYTES, p.k + (size_t)(s0 + KT) * D, KT, min(KT, p.n_k - s0 - KT));
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();
        mma_tile(acc, k_tiles + (j % STAGES) * K_BYTES, q_tile);
        float scores[TQ][2];
        head_sums(acc, w_s, scores);
        consume(s0, scores);
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();
}

// The dynamic shared memory, rounded up to the 1024-byte alignment the
// swizzled wgmma layout needs (the launch adds 1024 bytes for this).
__device__ __forceinline__ unsigned char* aligned_dynamic_smem() {
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(dynamic_smem));
    return dynamic_smem + ((1024 - (addr & 1023)) & 1023);
}

__device__ __forceinline__ int key_row(int rr) { return 16 * (threadIdx.x >> 5) + ((threadIdx.x & 31) >> 2) + 8 * rr; }

__device__ void topk_cta(const Problem& p, int topk, int* work_counter, Buffers buf, int* out_idx,
                         float* out_scores) {
    __shared__ GroupShared sh;
    unsigned char* smem = aligned_dynamic_smem();
    unsigned char* q_tile = smem;
    unsigned char* k_tiles = smem + Q_BYTES;
    float* w_s = reinterpret_cast<float*>(smem + Q_BYTES + STAGES * K_BYTES);
    buf.bits += (size_t)blockIdx.x * 2 * TQ * buf.cap;
    buf.idx += (size_t)blockIdx.x * 2 * TQ * buf.cap;
    const u32 k = (u32)topk;
    while (next_group(sh, p, work_counter, q_tile, w_s)) {
        const int t0 = sh.group * TQ;
        stream_group(sh, p, q_tile, k_tiles, w_s, [&](int s0, const float (&scores)[TQ][2]) {
            #pragma unroll
            for (int qi = 0; qi < TQ; ++qi) {
                if ((qi & 3) != (int)(threadIdx.x & 3)) continue;  // each quad lane owns every fourth query
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int s = s0 + key_row(rr);
                    const u32 bits = __float_as_uint(scores[qi][rr]);
                    if (s >= sh.lo[qi] && s < sh.hi[qi] && score_key(bits) > sh.thr[qi]) {
                        const u32 slot = atomicAdd(&sh.count[qi], 1u);
                        buf.bits[buf.at(sh.flip[qi], qi) + slot] = bits;
                        buf.idx[buf.at(sh.flip[qi], qi) + slot] = (u32)s;
                    }
                }
            }
            __syncthreads();
            for (int qi = 0; qi < TQ; ++qi)
                if (sh.count[qi] > 2 * k) prune(sh, buf, qi, k);
        });
        for (int qi = 0; qi < TQ && t0 + qi < p.n_q; ++qi)
            write_selection(sh, buf, qi, k, k_tiles, out_idx + (size_t)(t0 + qi) * topk,
                            out_scores ? out_scores + (size_t)(t0 + qi) * topk : nullptr);
    }
}

__device__ void scores_cta(const Problem& p, int* work_counter, float* table) {
    __shared__ GroupShared sh;
    unsigned char* smem = aligned_dynamic_smem();
    unsigned char* q_tile = smem;
    unsigned char* k_tiles = smem + Q_BYTES;
    float* w_s = reinterpret_cast<float*>(smem + Q_BYTES + STAGES * K_BYTES);
    while (next_group(sh, p, work_counter, q_tile, w_s)) {
        const int t0 = sh.group * TQ;
        stream_group(sh, p, q_tile, k_tiles, w_s, [&](int s0, const float (&scores)[TQ][2]) {
            #pragma unroll
            for (int qi = 0; qi < TQ; ++qi) {
                if ((qi & 3) != (int)(threadIdx.x & 3)) continue;
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int s = s0 + key_row(rr);
                    if (t0 + qi < p.n_q && s < p.n_k) {
                        const bool visible = s >= sh.lo[qi] && s < sh.hi[qi];
                        table[(size_t)(t0 + qi) * p.n_k + s] = visible ? scores[qi][rr] : __uint_as_float(NEG_INF_BITS);
                    }
                }
            }
        });
    }
}

}  // namespace

// Both entry points take 1024 + Q_BYTES + STAGES * K_BYTES + TQ * H * 4 bytes
// of dynamic shared memory (ops/indexer/gpu.py computes the same).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
indexer_topk_kernel(const u16* q, const u16* k, const float* w, const int* lo, const int* hi, int n_q, int n_k,
                    int topk, int* work_counter, u32* buf_bits, u32* buf_idx, int cap, int* out_idx,
                    float* out_scores) {
    const Problem p{q, k, w, lo, hi, n_q, n_k};
    topk_cta(p, topk, work_counter, Buffers{buf_bits, buf_idx, cap}, out_idx, out_scores);
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
indexer_scores_kernel(const u16* q, const u16* k, const float* w, const int* lo, const int* hi, int n_q, int n_k,
                      int* work_counter, float* table) {
    const Problem p{q, k, w, lo, hi, n_q, n_k};
    scores_cta(p, work_counter, table);
}
