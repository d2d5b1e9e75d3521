// probs of sparse attention (layout: sparse_attention.cuh): the attention
// probability at each selected slot summed over a CTA's heads, from the
// base-2 lse the forward (sparse_attention.cu) wrote.
//
// sa_forward_probs: two warpgroups walk the key blocks of query t; warpgroup
// w computes the logits of the block's slots 32w .. 32w+31 for all 64 heads
// (m64n32, K = 576, base-2 units), and the CTA sums exp2(logit - lse2) over
// the heads in a fixed order.
#include "wgmma.cuh"
#include "sparse_attention.cuh"

namespace {

struct WalkShared {
    int idx[2][BK];  // the keys of the two buffers' slots
};

// Stages the next key block into its buffer (nothing past the last block)
// and commits the thread's cp.async group either way.
struct NextBlockGather {
    unsigned char* tile;
    int* idx;
    const u16* kv;
    int s;
    bool exists;
    __device__ __forceinline__ void operator()() const {
        if (exists) {
            stage_key_row<0, D / 32>(tile, kv, s);
            record_key(idx, s);
        }
        cp_async_commit();
    }
};

// Walk the key blocks of query t: `body(b, tile, idx, gather_next)` works on
// block b and must call gather_next() once, which stages block b + 1 into the
// other buffer (so the body can first issue its products, then the gather).
// The body may use any barrier and must have waited for its own reads of the
// tile (wgmma) before it returns: block b + 1 then reuses block b - 1's
// buffers once every thread is past the next block's barrier. All threads
// must call this.
template <typename Body>
__device__ __forceinline__ void for_each_key_block(unsigned char* kv_tiles, WalkShared& sh, const u16* kv,
                                                   const int* indices, int t, int k, Body&& body) {
    const int nb = (k + BK - 1) / BK;
    const int s_first = slot_key(indices, t, k, 0);
    int s_next = slot_key(indices, t, k, 1);
    stage_key_row<0, D / 32>(kv_tiles, kv, s_first);
    record_key(sh.idx[0], s_first);
    cp_async_commit();
    for (int b = 0; b < nb; ++b) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // block b landed; block b - 1 done everywhere
        const NextBlockGather gather_next{kv_tiles + ((b + 1) & 1) * KV_BYTES, sh.idx[(b + 1) & 1], kv, s_next,
                                          b + 1 < nb};
        s_next = slot_key(indices, t, k, b + 2);
        body(b, kv_tiles + (b & 1) * KV_BYTES, sh.idx[b & 1], gather_next);
    }
    cp_async_wait<0>();
}

// Logits of the block's slots 32w .. 32w+31 in base-2 units (scale * log2 e
// folded in), -inf at skipped slots; the next block's gather is issued while the products run.
__device__ __forceinline__ void block_logits(float (&s)[16], const unsigned char* q_tile, const unsigned char* tile,
                                             const int* idx, const Lane& ln, float sl2,
                                             const NextBlockGather& gather_next) {
    zero(s);
    mma_begin(s);
    issue_rows32<0, D / 16>(s, q_tile, tile + ln.w * 32 * 128);
    wgmma_commit();
    gather_next();
    wgmma_wait_all();
    wgmma_fence_operands(s);
    #pragma unroll
    for (int j = 0; j < 4; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            s[4 * j + e] = idx[ln.w * 32 + 8 * j + ln.cq + (e & 1)] >= 0 ? s[4 * j + e] * sl2 : neg_inf();
}

// probs[slot] of this CTA's heads: sum over heads of exp2(logit - lse2), in a fixed order.
__device__ __forceinline__ void block_probs(const float (&s)[16], const float (&lse2)[2], const bool (&live)[2],
                                            float* col, float* probs_row, int b, int k, const Lane& ln) {
    float cs[8];
    #pragma unroll
    for (int j = 0; j < 4; ++j)
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float p0 = live[0] ? exp2f(s[4 * j + c] - lse2[0]) : 0.f;
            const float p1 = live[1] ? exp2f(s[4 * j + 2 + c] - lse2[1]) : 0.f;
            cs[2 * j + c] = p0 + p1;
        }
    #pragma unroll
    for (int i = 0; i < 8; ++i)
        #pragma unroll
        for (int d = 4; d < 32; d <<= 1) cs[i] += __shfl_xor_sync(FULL_MASK, cs[i], d);
    if ((threadIdx.x & 31) < 4)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int c = 0; c < 2; ++c) col[(threadIdx.x >> 5) * 32 + 8 * j + ln.cq + c] = cs[2 * j + c];
    __syncthreads();
    if (threadIdx.x < BK) {
        const int c = threadIdx.x, first = (c >> 5) * 4;
        const float* part = col + (c & 31);
        const float v = ((part[first * 32] + part[(first + 1) * 32]) + part[(first + 2) * 32]) + part[(first + 3) * 32];
        if (b * BK + c < k) probs_row[b * BK + c] = v;
    }
}

}  // namespace

// Dynamic shared memory: 1024 + Q_BYTES + 2 * KV_BYTES + P_BYTES (ops/sparse_attention/gpu.py).
// Grid: N * groups CTAs (groups = ceil(h / 64)), CTA t * groups + g; THREADS
// threads. lse2 [N, h] float32 (base 2, -inf for a head without a valid
// slot); probs [N, groups, k]: each head group's sum, the caller adds the groups.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_forward_probs(const u16* q, const u16* kv, const int* indices, const float* lse2, float* probs, int h, int k,
                 float scale) {
    __shared__ WalkShared sh;
    unsigned char* q_tile = aligned_dynamic_smem();
    unsigned char* kv_tiles = q_tile + Q_BYTES;
    float* col = reinterpret_cast<float*>(kv_tiles + 2 * KV_BYTES);  // [8 warps][32 columns]
    const int groups = (h + BH - 1) / BH, t = blockIdx.x / groups, g = blockIdx.x % groups;
    const Lane ln = lane_geometry();
    stage_heads<D>(q_tile, q, t, g, h);
    cp_async_commit();
    float row_lse2[2];
    bool live[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head = g * BH + ln.row0 + 8 * r;
        row_lse2[r] = head < h ? lse2[(size_t)t * h + head] : neg_inf();
        live[r] = row_lse2[r] != neg_inf();
    }
    float* probs_row = probs + ((size_t)t * groups + g) * k;
    for_each_key_block(kv_tiles, sh, kv, indices, t, k, [&](int b, const unsigned char* tile, const int* idx,
                                                                   const NextBlockGather& gather_next) {
        float s[16];
        block_logits(s, q_tile, tile, idx, ln, scale * LOG2E, gather_next);
        block_probs(s, row_lse2, live, col, probs_row, b, k, ln);
    });
}
