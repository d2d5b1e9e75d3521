// The backward's dq work item (cuda/sparse_attention_bwd.cu, sa_backward_dq):
// row statistics, p and ds from the logits, ds kv into dq, and the block's
// ds and p' image written for the dkv rows. Included by
// sparse_attention_bwd.cu only.
#pragma once

#include "sparse_attention.cuh"
#include "sync.cuh"
#include "wgmma.cuh"

namespace {

struct BwdShared {
    alignas(16) int idx[2][BK];
    float delta[BH];
    float lse2[BH];
    int key_min, key_max;
};

// Whether every valid slot of query t selects one and the same key (one
// valid slot, or copies of one key). Then p is constant under the logit, so
// ds = p (dp - delta) is exactly 0, which the caller writes instead of the
// float32 cancellation of dp - delta. All threads must call this.
__device__ __forceinline__ bool one_key(BwdShared& sh, const int* indices, int t, int k) {
    if (threadIdx.x == 0) {
        sh.key_min = 0x7FFFFFFF;
        sh.key_max = -1;
    }
    __syncthreads();
    int lo = 0x7FFFFFFF, hi = -1;
    for (int i = threadIdx.x; i < k; i += THREADS) {
        const int s = indices[(size_t)t * k + i];
        if (s >= 0) {
            lo = min(lo, s);
            hi = max(hi, s);
        }
    }
    atomicMin(&sh.key_min, lo);  // integer min / max: the result does not depend on the order
    atomicMax(&sh.key_max, hi);
    __syncthreads();
    return sh.key_max >= 0 && sh.key_min == sh.key_max;
}

__device__ __forceinline__ float dot_halves(uint4 a, uint4 b) {
    const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
    float acc = 0.f;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(half_to_float<F16>((u16)(av[i] & 0xFFFF)), half_to_float<F16>((u16)(bv[i] & 0xFFFF)), acc);
        acc = fmaf(half_to_float<F16>((u16)(av[i] >> 16)), half_to_float<F16>((u16)(bv[i] >> 16)), acc);
    }
    return acc;
}

// delta = rowsum(dout * out) and lse in base 2 for the CTA's 64 head rows
// (0 and -inf for heads past h); 4 threads per row, summed in a fixed order.
// A thread's 16 chunks of each row are all requested before the first is
// used: they come from memory, and one at a time would wait 16 times.
__device__ __forceinline__ void row_stats(BwdShared& sh, const u16* out, const u16* dout, const float* lse, int t,
                                          int g, int h) {
    constexpr int CHUNKS = DV / 8 / 4;  // 16-byte chunks per thread and row
    const int r = threadIdx.x >> 2, head = g * BH + r;
    float acc = 0.f;
    if (head < h) {
        const uint4* o4 = reinterpret_cast<const uint4*>(out + ((size_t)t * h + head) * DV) + (threadIdx.x & 3);
        const uint4* d4 = reinterpret_cast<const uint4*>(dout + ((size_t)t * h + head) * DV) + (threadIdx.x & 3);
        uint4 o[CHUNKS], d[CHUNKS];
        #pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            o[i] = o4[4 * i];
            d[i] = d4[4 * i];
        }
        #pragma unroll
        for (int i = 0; i < CHUNKS; ++i) acc += dot_halves(o[i], d[i]);
    }
    acc = quad_sum(acc);
    if ((threadIdx.x & 3) == 0) {
        sh.delta[r] = acc;
        sh.lse2[r] = head < h ? lse[(size_t)t * h + head] * LOG2E : neg_inf();
    }
}

// ds = p (dp - delta) (0 for a one-key row) and p' = p / scale for this
// thread's 16 entries of the block, into the shared ds tile and the p' tile
// after it: the block's image. The slots' keys are read first and every
// exponential is taken, then masked: no branch per entry, so the entries'
// latencies overlap.
__device__ __forceinline__ void write_ds(const float (&s)[16], const float (&dp)[16], const BwdShared& sh,
                                         const int* idx, unsigned char* ds_tile, float sl2, float inv_scale,
                                         bool constant_p, const Lane& ln) {
    int2 keys[4];  // the keys of columns col and col + 1 below
    #pragma unroll
    for (int j = 0; j < 4; ++j) keys[j] = *reinterpret_cast<const int2*>(idx + ln.w * 32 + 8 * j + ln.cq);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ln.row0 + 8 * r;
        const float lse2 = sh.lse2[row], delta = sh.delta[row];
        const bool live = lse2 != neg_inf();
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = ln.w * 32 + 8 * j + ln.cq;
            const bool valid[2] = {live && keys[j].x >= 0, live && keys[j].y >= 0};
            float p[2], ds[2];
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int i = 4 * j + 2 * r + c;
                const float e = exp2f(s[i] * sl2 - lse2);
                p[c] = valid[c] ? e : 0.f;
                ds[c] = constant_p ? 0.f : p[c] * (dp[i] - delta);
            }
            const u32 off = tile_offset(row, col);
            *reinterpret_cast<u32*>(ds_tile + off) = pack_half2<F16>(ds[0], ds[1]);
            *reinterpret_cast<u32*>(ds_tile + P_BYTES + off) = pack_half2<F16>(p[0] * inv_scale, p[1] * inv_scale);
        }
    }
}

// dq (+)= ds kv for this warpgroup's columns 256 w .. 256 w + 255, and for
// columns 512..575 in rope. Both warpgroups compute rope (only warpgroup 0
// stores it): the two then run one instruction stream, which ptxas keeps
// pipelined (a wgmma under a warpgroup branch serializes them all); the
// duplicate costs no time, as warpgroup 0 needs those columns anyway.
__device__ __forceinline__ void add_ds_kv(float (&acc)[128], float (&rope)[32], const unsigned char* ds_tile,
                                          const unsigned char* tile, const Lane& ln) {
    mma_begin(acc);
    wgmma_fence_operands(rope);
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const u64 a = wgmma_desc_k(ds_tile, kk, 64);
        wgmma_m64n256k16<F16, 0, 1>(acc, a, wgmma_desc_mn(tile + ln.w * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);
        wgmma_m64n64k16<F16, 0, 1>(rope, a, wgmma_desc_mn(tile + 8 * REGION + kk * K_STEP_ROWS, REGION), 1);
    }
    mma_end();
    wgmma_fence_operands(acc);
    wgmma_fence_operands(rope);
}

// Write row row0 + 8 r of a [64 x 576] product held as acc (columns 256 w ..)
// and rope (columns 512 .., stored by warpgroup 0), times `scale`, through
// store(column, value, value at column + 1).
template <typename Store>
__device__ __forceinline__ void store_row(const float (&acc)[128], const float (&rope)[32], int r, float scale,
                                          const Lane& ln, Store&& store) {
    #pragma unroll
    for (int j = 0; j < 32; ++j)
        store(ln.w * 256 + 8 * j + ln.cq, acc[4 * j + 2 * r] * scale, acc[4 * j + 2 * r + 1] * scale);
    if (ln.w == 0)
        #pragma unroll
        for (int j = 0; j < 8; ++j)
            store(DV + 8 * j + ln.cq, rope[4 * j + 2 * r] * scale, rope[4 * j + 2 * r + 1] * scale);
}

// Work item `item` (query t = item / groups, head group g = item % groups) of
// sa_backward_dq.
__device__ __forceinline__ void dq_item(BwdShared& sh, const u16* q, const u16* kv, const int* indices,
                                        const u16* out, const u16* dout, const float* lse, u16* dq,
                                        unsigned char* images, int h, int k, float scale, int item) {
    unsigned char* q_tile = aligned_dynamic_smem();
    unsigned char* do_tile = q_tile + Q_BYTES;
    unsigned char* kv_tile = do_tile + DO_BYTES;
    unsigned char* ds_tile = kv_tile + KV_BYTES;
    const int groups = (h + BH - 1) / BH, t = item / groups, g = item % groups;
    const int nb = (k + BK - 1) / BK;
    const Lane ln = lane_geometry();
    const float sl2 = scale * LOG2E;
    stage_heads<D>(q_tile, q, t, g, h);
    stage_heads<DV>(do_tile, dout, t, g, h);
    cp_async_commit();
    row_stats(sh, out, dout, lse, t, g, h);
    const bool constant_p = one_key(sh, indices, t, k);
    unsigned char* image = images + (size_t)item * nb * IMAGE_BYTES;
    float acc[128], rope[32];
    zero(acc);
    zero(rope);
    const unsigned char* rows = kv_tile + ln.w * 32 * 128;  // this warpgroup's 32 slots
    int s_cur = slot_key(indices, t, k, 0);
    for (int b = 0; b < nb; ++b) {
        // Gather block b in two groups: features 0..255 first, so their
        // products start while features 256..575 land.
        stage_key_row<0, 8>(kv_tile, kv, s_cur);
        cp_async_commit();
        stage_key_row<8, D / 32>(kv_tile, kv, s_cur);
        cp_async_commit();
        record_key(sh.idx[0], s_cur);
        const int s_next = slot_key(indices, t, k, b + 1);
        cp_async_wait<1>();
        fence_proxy_async();
        const int any = __syncthreads_or(s_cur >= 0);
        s_cur = s_next;
        if (!any) {
            cp_async_wait<0>();  // a thread restages only its own chunks, after they landed
            continue;
        }
        float s[16], dp[16];
        zero(s);
        zero(dp);
        mma_begin(s);
        wgmma_fence_operands(dp);
        issue_rows32<0, 16>(s, q_tile, rows);
        issue_rows32<0, 16>(dp, do_tile, rows);
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        issue_rows32<16, D / 16>(s, q_tile, rows);
        issue_rows32<16, DV / 16>(dp, do_tile, rows);
        mma_end();
        wgmma_fence_operands(s);
        wgmma_fence_operands(dp);
        write_ds(s, dp, sh, sh.idx[0], ds_tile, sl2, 1.f / scale, constant_p, ln);
        fence_proxy_async();
        __syncthreads();
        if (threadIdx.x == 0) bulk_store(image + (size_t)b * IMAGE_BYTES, ds_tile, IMAGE_BYTES);
        add_ds_kv(acc, rope, ds_tile, kv_tile, ln);
        if (threadIdx.x == 0) bulk_wait_read();
        __syncthreads();  // the kv tile and the image are free for the next block
    }
    cp_async_wait<0>();
    if (threadIdx.x == 0) bulk_wait();
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head = g * BH + ln.row0 + 8 * r;
        if (head >= h) continue;
        u16* dst = dq + ((size_t)t * h + head) * D;
        store_row(acc, rope, r, scale, ln, [&](int c, float a, float v) {
            *reinterpret_cast<u32*>(dst + c) = pack_half2<F16>(a, v);
        });
    }
}

}  // namespace
