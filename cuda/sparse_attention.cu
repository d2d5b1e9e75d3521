// Sparse attention forward on tensor cores (layout: sparse_attention.cuh).
//
// sa_forward: warpgroup w computes the logits of the block's slots
// 32w .. 32w+31 for all 64 heads (m64n32, K = 576), the two exchange row
// maxima through shared memory, write p (16-bit) into a shared tile, and
// each adds p v for its half of the 512 value columns (m64n256, K = 64):
// online softmax in float32, base-2 exponent. With probs, a second walk over
// the blocks recomputes the logits and sums exp(logit - lse) over the heads.
#include "wgmma.cuh"
#include "sparse_attention.cuh"

namespace {

struct FwdShared {
    int idx[2][BK];
    float red[2][BH];  // per-warpgroup row maxima, then row sums
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
// buffers once every thread is past the next block's barrier. With
// skip_empty, blocks without a valid slot are passed over. All threads must
// call this.
template <typename Body>
__device__ __forceinline__ void for_each_key_block(unsigned char* kv_tiles, FwdShared& sh, const u16* kv,
                                                   const int* indices, int t, int k, bool skip_empty, Body&& body) {
    const int nb = (k + BK - 1) / BK;
    int s_cur = slot_key(indices, t, k, 0), s_next = slot_key(indices, t, k, 1);
    stage_key_row<0, D / 32>(kv_tiles, kv, s_cur);
    record_key(sh.idx[0], s_cur);
    cp_async_commit();
    for (int b = 0; b < nb; ++b) {
        cp_async_wait<0>();
        fence_proxy_async();
        const int any = __syncthreads_or(s_cur >= 0);  // block b landed; block b - 1 done everywhere
        const NextBlockGather gather_next{kv_tiles + ((b + 1) & 1) * KV_BYTES, sh.idx[(b + 1) & 1], kv, s_next,
                                          b + 1 < nb};
        s_cur = s_next;
        s_next = slot_key(indices, t, k, b + 2);
        if (!any && skip_empty) {
            gather_next();
            continue;
        }
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

// One online-softmax step over a block: new row maxima (shared by both
// warpgroups), p into the shared p tile, l and o rescaled.
__device__ __forceinline__ void softmax_step(float (&s)[16], float (&o)[128], float (&m)[2], float (&l)[2],
                                             FwdShared& sh, unsigned char* p_tile, const Lane& ln) {
    float mx[2] = {neg_inf(), neg_inf()};
    #pragma unroll
    for (int i = 0; i < 16; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
    mx[0] = quad_max(mx[0]);
    mx[1] = quad_max(mx[1]);
    if ((threadIdx.x & 3) == 0) {
        sh.red[ln.w][ln.row0] = mx[0];
        sh.red[ln.w][ln.row0 + 8] = mx[1];
    }
    __syncthreads();
    float alpha[2], base[2], sum[2] = {0.f, 0.f};
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ln.row0 + 8 * r;
        const float mn = fmaxf(m[r], fmaxf(sh.red[0][row], sh.red[1][row]));
        alpha[r] = mn == neg_inf() ? 1.f : exp2f(m[r] - mn);
        base[r] = mn == neg_inf() ? 0.f : mn;
        m[r] = mn;
    }
    #pragma unroll
    for (int j = 0; j < 4; ++j)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float p0 = exp2f(s[4 * j + 2 * r] - base[r]), p1 = exp2f(s[4 * j + 2 * r + 1] - base[r]);
            sum[r] += p0;
            sum[r] += p1;
            *reinterpret_cast<u32*>(p_tile + tile_offset(ln.row0 + 8 * r, ln.w * 32 + 8 * j + ln.cq)) =
                pack_half2<F16>(p0, p1);
        }
    #pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
    #pragma unroll
    for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// o (+)= p v for this warpgroup's 256 value columns.
__device__ __forceinline__ void add_pv(float (&o)[128], const unsigned char* p_tile, const unsigned char* tile,
                                       const Lane& ln) {
    mma_begin(o);
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_m64n256k16<F16, 0, 1>(o, wgmma_desc_k(p_tile, kk, 64),
                                    wgmma_desc_mn(tile + ln.w * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);
    mma_end();
    wgmma_fence_operands(o);
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
// Grid: N * groups CTAs (groups = ceil(h / 64)), CTA t * groups + g. probs
// (nullable) is [N, groups, k]: each head group's sum; the caller adds the groups.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_forward(const u16* q, const u16* kv, const int* indices, u16* out, float* lse, float* probs, int h, int k,
           float scale) {
    __shared__ FwdShared sh;
    unsigned char* q_tile = aligned_dynamic_smem();
    unsigned char* kv_tiles = q_tile + Q_BYTES;
    unsigned char* p_tile = kv_tiles + 2 * KV_BYTES;
    const int groups = (h + BH - 1) / BH, t = blockIdx.x / groups, g = blockIdx.x % groups;
    const Lane ln = lane_geometry();
    const float sl2 = scale * LOG2E;
    stage_heads<D>(q_tile, q, t, g, h);
    cp_async_commit();
    float o[128], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    zero(o);
    for_each_key_block(kv_tiles, sh, kv, indices, t, k, true, [&](int, const unsigned char* tile, const int* idx,
                                                                  const NextBlockGather& gather_next) {
        float s[16];
        block_logits(s, q_tile, tile, idx, ln, sl2, gather_next);
        softmax_step(s, o, m, l, sh, p_tile, ln);
        fence_proxy_async();
        __syncthreads();
        add_pv(o, p_tile, tile, ln);
    });
    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    if ((threadIdx.x & 3) == 0) {
        sh.red[ln.w][ln.row0] = l[0];
        sh.red[ln.w][ln.row0 + 8] = l[1];
    }
    __syncthreads();
    float lse2[2];
    bool live[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ln.row0 + 8 * r, head = g * BH + row;
        const float total = sh.red[0][row] + sh.red[1][row];
        const float inv = total > 0.f ? 1.f / total : 0.f;
        live[r] = head < h && total > 0.f;
        lse2[r] = total > 0.f ? m[r] + log2f(total) : neg_inf();
        if (head >= h) continue;
        u16* dst = out + ((size_t)t * h + head) * DV + ln.w * 256 + ln.cq;
        #pragma unroll
        for (int j = 0; j < 32; ++j)
            *reinterpret_cast<u32*>(dst + 8 * j) = pack_half2<F16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (ln.w == 0 && (threadIdx.x & 3) == 0) lse[(size_t)t * h + head] = lse2[r] * LN2;
    }
    if (probs == nullptr) return;
    float* probs_row = probs + ((size_t)t * groups + g) * k;
    float* col = reinterpret_cast<float*>(p_tile);  // [8 warps][32 columns]; the p tile is unused here
    for_each_key_block(kv_tiles, sh, kv, indices, t, k, false, [&](int b, const unsigned char* tile, const int* idx,
                                                                   const NextBlockGather& gather_next) {
        float s[16];
        block_logits(s, q_tile, tile, idx, ln, sl2, gather_next);
        block_probs(s, lse2, live, col, probs_row, b, k, ln);
    });
}

