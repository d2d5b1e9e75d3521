// Indexer scores at the selected keys and their backward (layout, fragments
// and configuration: indexer_loss.cuh). No float atomics anywhere:
//
// il_scores_at: I[t, i] = sum_h w[t, h] relu(q[t, h] . k[s]), s = indices[t, i]
// (-inf at -1 slots; relu(NaN) = 0). Per block: logits on tensor cores (or
// float32 FMA), then each head m-tile's sum over its 16 heads (a fixed
// butterfly), then the m-tiles added in ascending order.
//
// il_scores_at_backward, with g = dscores, m = (logit > 0):
//   dw[t, h]  = sum_i g_i relu(l_hi)                       (float32, per thread in
//               blocks of slots, then a fixed butterfly and the warps in order)
//   dq[t, h]  = w_h sum_i (g_i m_hi) k[s_i]                (P K; P = g m / g_scale
//               held as hi + lo 16-bit parts, so it keeps ~16 bits)
//   rows[t, i] = g_i sum_h (w_h m_hi) q[t, h]              (W^T q; W = w m / w_scale
//               rounded once to the input type: exact for 16-bit w)
// g_scale and w_scale are the powers of two above max |g| and max |w| of the
// query, so the scaled operands lie in (-1, 1) (no float16 underflow) and the
// scaling itself is exact. dq is summed per block of 64 slots, then over the
// blocks in registers, and rounded once; the rows (float32, one per valid
// (query, slot)) are added into dk key by key in ascending (query, slot)
// order, compensated, by il_dk_segments.
#include "indexer_loss.cuh"

using namespace il;

namespace {

// part[mt][slot] = the sum over head m-tile mt of w_h relu(logit) for the
// warp's slot n-tiles (lanes with g = 0 write).
__device__ __forceinline__ void head_sums(const float (&acc)[NW][4], const float* w_s, float* part, Role role) {
    const int g = lane_g(), c = lane_c();
    const float w0 = w_s[16 * role.mt + g], w8 = w_s[16 * role.mt + g + 8];
    #pragma unroll
    for (int j = 0; j < NW; ++j)
        #pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
            float v = w0 * fmaxf(acc[j][cc], 0.f);
            v = fmaf(w8, fmaxf(acc[j][2 + cc], 0.f), v);
            v += __shfl_xor_sync(FULL_MASK, v, 4);
            v += __shfl_xor_sync(FULL_MASK, v, 8);
            v += __shfl_xor_sync(FULL_MASK, v, 16);
            if (g == 0) part[role.mt * BK + 8 * (role.part * NW + j) + 2 * c + cc] = v;
        }
}

// The block's dw contribution (returned per row of the thread: heads g and
// g + 8 of the m-tile) and its P and W tiles, from the logits.
__device__ __forceinline__ void block_operands(const float (&acc)[NW][4], const int* idx, const float* gsl,
                                               const float* w_s, float g_inv, float w_inv, E* p_tiles, E* wt,
                                               Role role, float (&dw_block)[2]) {
    const int g = lane_g(), c = lane_c();
    dw_block[0] = dw_block[1] = 0.f;
    #pragma unroll
    for (int j = 0; j < NW; ++j) {
        const int col = 8 * (role.part * NW + j) + 2 * c;
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int head = 16 * role.mt + g + 8 * r;
            float pv[2], wv[2];
            #pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const float l = acc[j][2 * r + cc], gv = gsl[col + cc];
                dw_block[r] = fmaf(gv, fmaxf(l, 0.f), dw_block[r]);
                const bool on = l > 0.f && idx[col + cc] >= 0;
                pv[cc] = on ? gv * g_inv : 0.f;
                wv[cc] = on ? w_s[head] * w_inv : 0.f;
            }
            store_parts(p_tiles, head * SP + col, pv[0], pv[1]);
            store_pair(wt + head * SP + col, wv[0], wv[1]);
        }
    }
}

// acc (the warp's heads x its feature n-tiles) += P K over the block's slots:
// the block's product is made from zero, GROUP n-tiles at a time, and then
// added, so dq sums its slots in blocks of 64 (then blocks in order).
__device__ __forceinline__ void add_dq(float (&acc)[DW][4], const E* p_tiles, const E* kb, Role role) {
    constexpr int GROUP = DW < (F32 ? 4 : 8) ? DW : (F32 ? 4 : 8);
    #pragma unroll
    for (int j0 = 0; j0 < DW; j0 += GROUP) {
        float part[GROUP][4];
        zero_tiles(part);
        #pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            FragA a[PARTS];
            #pragma unroll
            for (int p = 0; p < PARTS; ++p) load_a<SP, 1>(a[p], p_tiles + p * P_TILE + 16 * role.mt * SP + 16 * ks);
            #pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                const int dt = role.part * DW + j0 + j;
                if (j0 + j < DW && dt < DT) {
                    FragB b;
                    load_b<SQ, 1>(b, kb + 16 * ks * SQ + 8 * dt);
                    #pragma unroll
                    for (int p = 0; p < PARTS; ++p) mma(part[j], a[p], b);
                }
            }
        }
        #pragma unroll
        for (int j = 0; j < GROUP; ++j)
            if (j0 + j < DW)
                #pragma unroll
                for (int i = 0; i < 4; ++i) acc[j0 + j][i] += part[j][i];
    }
}

// rows_t[slot] = (g_slot w_scale) (W^T q)[slot] for the block's valid slots
// (rows_t: query t's [kk, D] rows, from slot 0). Warp w takes slot m-tile
// w % 4 and its share of the feature n-tiles, GROUP n-tiles at a time.
__device__ __forceinline__ void write_rows(float* rows_t, const E* wt, const E* qs, const int* idx, const float* gsl,
                                           float w_scale, int b) {
    constexpr int SPLIT = WARPS / 4;
    constexpr int TILES = (DT + SPLIT - 1) / SPLIT;
    constexpr int GROUP = TILES < 8 ? TILES : 8;
    const int w = threadIdx.x >> 5, st = w % 4, first = (w / 4) * TILES;
    const int g = lane_g(), c = lane_c();
    #pragma unroll 1
    for (int d0 = 0; d0 < TILES; d0 += GROUP) {
        float acc[GROUP][4];
        zero_tiles(acc);
        #pragma unroll
        for (int ks = 0; ks < MT; ++ks) {
            FragA a;
            load_a<1, SP>(a, wt + 16 * ks * SP + 16 * st);
            #pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                const int dt = first + d0 + j;
                if (d0 + j < TILES && dt < DT) {
                    FragB bf;
                    load_b<SQ, 1>(bf, qs + 16 * ks * SQ + 8 * dt);
                    mma(acc[j], a, bf);
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int slot = 16 * st + g + 8 * r;
            if (idx[slot] < 0) continue;
            const float f = gsl[slot] * w_scale;
            float* dst = rows_t + (size_t)(b * BK + slot) * D;
            #pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                const int dt = first + d0 + j;
                if (d0 + j < TILES && dt < DT)
                    *reinterpret_cast<float2*>(dst + 8 * dt + 2 * c) =
                        make_float2(acc[j][2 * r] * f, acc[j][2 * r + 1] * f);
            }
        }
    }
}

}  // namespace

// Grid: N CTAs of THREADS; dynamic shared memory SMEM_FORWARD. kk >= 1.
extern "C" __global__ void __launch_bounds__(THREADS)
il_scores_at(const E* q, const E* k, const float* w, const int* indices, float* scores, int h, int kk) {
    __shared__ int idx[2][BK];
    __shared__ float w_s[HP];
    __shared__ float part[MT * BK];
    extern __shared__ __align__(16) unsigned char smem[];
    E* qs = reinterpret_cast<E*>(smem);
    E* kbuf = qs + Q_TILE;
    const int t = blockIdx.x, nb = (kk + BK - 1) / BK;
    const Role role = warp_role();
    stage_queries(qs, q, t, h);
    stage_keys(kbuf, idx[0], nullptr, k, indices, nullptr, t, kk, 0);
    cp_async_commit();
    if (threadIdx.x < HP) w_s[threadIdx.x] = (int)threadIdx.x < h ? w[(size_t)t * h + threadIdx.x] : 0.f;
    for (int b = 0; b < nb; ++b) {
        const int buf = b & 1;
        if (b + 1 < nb) stage_keys(kbuf + (buf ^ 1) * K_TILE, idx[buf ^ 1], nullptr, k, indices, nullptr, t, kk, b + 1);
        cp_async_commit();
        cp_async_wait<1>();  // block b (and the query rows) landed for this thread; the barrier publishes them
        if (__syncthreads_or(threadIdx.x < BK && idx[buf][threadIdx.x] >= 0)) {
            float acc[NW][4];
            block_logits(acc, qs, kbuf + buf * K_TILE, role.mt, role.part * NW);
            head_sums(acc, w_s, part, role);
        }
        __syncthreads();
        const int slot = b * BK + threadIdx.x;
        if (threadIdx.x < BK && slot < kk) {
            float s = neg_inf();
            if (idx[buf][threadIdx.x] >= 0) {
                s = part[threadIdx.x];
                #pragma unroll
                for (int m = 1; m < MT; ++m) s += part[m * BK + threadIdx.x];
            }
            scores[(size_t)t * kk + slot] = s;
        }
        __syncthreads();  // part, key buffer `buf` and idx[buf] are free for block b + 2
    }
    cp_async_wait<0>();
}

// Grid: C CTAs (a chunk of queries; every pointer starts at the chunk's first
// query, k and dk excepted); dynamic shared memory SMEM_BACKWARD. Writes dq
// [C, h, D] (E), dw [C, h] and, for every valid slot, rows [C, kk, D]
// (float32; rows of -1 slots are not written). kk >= 0.
extern "C" __global__ void __launch_bounds__(THREADS)
il_scores_at_backward(const E* q, const E* k, const float* w, const int* indices, const float* dscores, E* dq,
                      float* dw, float* rows, int h, int kk) {
    __shared__ int idx[2][BK];
    __shared__ float gsl[2][BK];
    __shared__ float w_s[HP];
    __shared__ float dw_part[WPM][HP];
    __shared__ float red[WARPS];
    extern __shared__ __align__(16) unsigned char smem[];
    E* qs = reinterpret_cast<E*>(smem);
    E* kbuf = qs + Q_TILE;
    E* p_tiles = kbuf + 2 * K_TILE;
    E* wt = p_tiles + PARTS * P_TILE;
    const int t = blockIdx.x, nb = (kk + BK - 1) / BK;
    const Role role = warp_role();
    const int g = lane_g(), c = lane_c();
    stage_queries(qs, q, t, h);
    if (nb > 0) stage_keys(kbuf, idx[0], gsl[0], k, indices, dscores, t, kk, 0);
    cp_async_commit();
    if (threadIdx.x < HP) w_s[threadIdx.x] = (int)threadIdx.x < h ? w[(size_t)t * h + threadIdx.x] : 0.f;
    float g_max = 0.f, w_max = 0.f;
    for (int i = threadIdx.x; i < kk; i += THREADS)
        if (indices[(size_t)t * kk + i] >= 0) g_max = fmaxf(g_max, fabsf(dscores[(size_t)t * kk + i]));
    for (int i = threadIdx.x; i < h; i += THREADS) w_max = fmaxf(w_max, fabsf(w[(size_t)t * h + i]));
    const float g_scale = pow2_above(block_max(g_max, red)), w_scale = pow2_above(block_max(w_max, red));
    const float g_inv = 1.f / g_scale, w_inv = 1.f / w_scale;
    float dq_acc[DW][4], dw_acc[2] = {0.f, 0.f};
    zero_tiles(dq_acc);
    for (int b = 0; b < nb; ++b) {
        const int buf = b & 1;
        const E* kb = kbuf + buf * K_TILE;
        if (b + 1 < nb)
            stage_keys(kbuf + (buf ^ 1) * K_TILE, idx[buf ^ 1], gsl[buf ^ 1], k, indices, dscores, t, kk, b + 1);
        cp_async_commit();
        cp_async_wait<1>();
        // A block without valid slots adds nothing; skipping it reads no shared memory past the barrier.
        if (!__syncthreads_or(threadIdx.x < BK && idx[buf][threadIdx.x] >= 0)) continue;
        float acc[NW][4], dw_block[2];
        block_logits(acc, qs, kb, role.mt, role.part * NW);
        block_operands(acc, idx[buf], gsl[buf], w_s, g_inv, w_inv, p_tiles, wt, role, dw_block);
        dw_acc[0] += dw_block[0];
        dw_acc[1] += dw_block[1];
        __syncthreads();
        add_dq(dq_acc, p_tiles, kb, role);
        write_rows(rows + (size_t)t * kk * D, wt, qs, idx[buf], gsl[buf], w_scale, b);
        __syncthreads();  // P, W, key buffer `buf` and its idx / gsl are free for block b + 2
    }
    cp_async_wait<0>();
    #pragma unroll
    for (int j = 0; j < DW; ++j) {
        const int dt = role.part * DW + j;
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int head = 16 * role.mt + g + 8 * r;
            if (dt < DT && head < h) {
                const float f = w_s[head] * g_scale;
                store_pair(dq + ((size_t)t * h + head) * D + 8 * dt + 2 * c, dq_acc[j][2 * r] * f,
                           dq_acc[j][2 * r + 1] * f);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float v = dw_acc[r];
        v += __shfl_xor_sync(FULL_MASK, v, 1);
        v += __shfl_xor_sync(FULL_MASK, v, 2);
        if (c == 0) dw_part[role.part][16 * role.mt + g + 8 * r] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < h) {
        float s = dw_part[0][threadIdx.x];
        #pragma unroll
        for (int p = 1; p < WPM; ++p) s += dw_part[p][threadIdx.x];
        dw[(size_t)t * h + threadIdx.x] = s;
    }
}

// One compensated (Kahan) add: sum + x with the running error comp.
__device__ __forceinline__ void kahan_add(float& sum, float& comp, float x) {
    const float y = x - comp, t = sum + y;
    comp = (t - sum) - y;
    sum = t;
}

// dk[s, :] += the rows of key s's pairs, pairs[starts[s]] .. pairs[starts[s +
// 1] - 1] one after another, compensated: comp [Nk, D] carries each key's
// running error across chunks (the sum is dk - comp). Pair e is pairs[e] = t * kk + i
// (query t of the chunk, slot i), its row rows[pairs[e], :]. One CTA of D / 4
// threads per key, so no two CTAs touch one dk row.
extern "C" __global__ void __launch_bounds__(D / 4)
il_dk_segments(const float* rows, const int* pairs, const int* starts, float* dk, float* comp) {
    const int s = blockIdx.x, col = threadIdx.x;
    if (starts[s] == starts[s + 1]) return;  // a key no slot selected
    const size_t at = (size_t)s * (D / 4) + col;
    const float4* src = reinterpret_cast<const float4*>(rows) + col;
    float4 sum = reinterpret_cast<float4*>(dk)[at], err = reinterpret_cast<float4*>(comp)[at];
    for (int e = starts[s]; e < starts[s + 1]; ++e) {
        const float4 v = src[(size_t)pairs[e] * (D / 4)];
        kahan_add(sum.x, err.x, v.x);
        kahan_add(sum.y, err.y, v.y);
        kahan_add(sum.z, err.z, v.z);
        kahan_add(sum.w, err.w, v.w);
    }
    reinterpret_cast<float4*>(dk)[at] = sum;
    reinterpret_cast<float4*>(comp)[at] = err;
}
