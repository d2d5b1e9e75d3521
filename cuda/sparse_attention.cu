// Sparse attention in MLA's MQA layout on tensor cores (wgmma, sm_90a).
//
//   q [N, h, 576], kv [N_kv, 576] (values kv[:, :512]), indices [N, k] int32
//   (-1 = skip); 16-bit data: bfloat16, or float16 with HS_SA_F16=1.
//
// A CTA owns one query t and a group g of 64 heads (heads past h are zero
// rows): the heads are the M of the products, so each gathered kv row is read
// once for 64 heads. Two warpgroups. Selected slots go in blocks of BK = 64;
// a block's kv rows are gathered with cp.async into a 128B-swizzled tile (the
// region layout of wgmma.cuh; slots holding -1 or past k become zero rows),
// which serves as K-major B for q k^T and as MN-major B for p v.
//
// sa_forward: warpgroup w computes the logits of the block's slots
// 32w .. 32w+31 for all 64 heads (m64n32, K = 576), the two exchange row
// maxima through shared memory, write p (16-bit) into a shared tile, and
// each adds p v for its half of the 512 value columns (m64n256, K = 64):
// online softmax in float32, base-2 exponent. With probs, a second walk over
// the blocks recomputes the logits and sums exp(logit - lse) over the heads.
//
// Backward, in three kernels with no float atomics:
// sa_backward_dq recomputes p = exp(logit - lse) and dp = dout v^T per block,
// forms ds = p (dp - delta) (delta = rowsum(dout * out), made first; exactly
// 0 on rows whose valid slots all hold one key), adds
// ds kv into dq (kept in registers), and writes the block's ds and
// p' = p / scale tiles (16-bit, as their swizzled shared-memory image) to a
// scratch buffer. sa_backward_dkv_rows reads those images back and computes
// each slot's dkv row, scale * (ds^T q + p'^T dout), into a per-(query, head
// group, slot) float32 buffer. sa_dkv_segments adds those rows into dkv key
// by key in ascending (query, slot, group) order: bitwise reproducible.
#include "select.cuh"
#include "wgmma.cuh"
#include "sparse_attention_mma.cuh"

using namespace hs;

namespace {

constexpr int D = 576;        // d_qk
constexpr int DV = 512;       // d_v
constexpr int BH = 64;        // heads per CTA: the M of the head-major products
constexpr int BK = 64;        // slots per key block
constexpr int THREADS = 256;  // two warpgroups
constexpr int REGION = 64 * 128;  // one region of a 64-row tile: 64 rows x 64 16-bit elements
constexpr int Q_BYTES = D / 64 * REGION;
constexpr int KV_BYTES = D / 64 * REGION;
constexpr int DO_BYTES = DV / 64 * REGION;
constexpr int P_BYTES = REGION;          // a 64 x 64 tile of p or ds
constexpr int IMAGE_BYTES = 2 * P_BYTES;  // one block's ds tile, then its p' tile
constexpr int K_STEP_ROWS = 16 * 128;    // 16 rows of a region: one k-step of an MN-major operand
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
static_assert(D % 64 == 0 && DV == 512 && DV <= D, "the tile code is written for d_qk = 576, d_v = 512");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// This thread's place in the wgmma accumulator layout (m64nN, float32).
struct Lane {
    int w;     // warpgroup, 0 or 1
    int row0;  // its rows are row0 and row0 + 8
    int cq;    // its columns are 8 j + cq and 8 j + cq + 1
};

__device__ __forceinline__ Lane lane_geometry() {
    const int lane = threadIdx.x & 31;
    return Lane{(int)(threadIdx.x >> 7), 16 * (int)((threadIdx.x >> 5) & 3) + (lane >> 2), 2 * (lane & 3)};
}

// Byte offset of element (row, col), col even, in a 64 x 64 swizzled tile.
__device__ __forceinline__ u32 tile_offset(int row, int col) {
    return (u32)(row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2);
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(FULL_MASK, x, 1);
    return x + __shfl_xor_sync(FULL_MASK, x, 2);
}

// The dynamic shared memory, rounded up to the 1024-byte alignment of the
// swizzled layout (every launch adds 1024 bytes for this).
__device__ __forceinline__ unsigned char* aligned_dynamic_smem() {
    extern __shared__ __align__(16) unsigned char dynamic_smem[];
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(dynamic_smem));
    return dynamic_smem + ((1024 - (addr & 1023)) & 1023);
}

// This thread's share of staging one 64-row tile of WIDTH 16-bit columns:
// row threadIdx.x / 4 from `src` (zeros when !valid), 16-byte chunks
// threadIdx.x % 4, + 4, + 8, ...
template <int WIDTH>
__device__ __forceinline__ void stage_row(unsigned char* tile, const u16* src, bool valid) {
    const int r = threadIdx.x >> 2;
    #pragma unroll
    for (int i = 0; i < WIDTH / 32; ++i) {
        const int c = (threadIdx.x & 3) + 4 * i;
        cp_async16(tile + swizzled_offset(r, c, 64), src + c * 8, valid);
    }
}

// Rows g*64 .. g*64+63 of x[t] ([h, WIDTH] per query) into a tile; heads past h are zeros.
template <int WIDTH>
__device__ __forceinline__ void stage_heads(unsigned char* tile, const u16* x, int t, int g, int h) {
    const int head = g * BH + (threadIdx.x >> 2);
    const bool valid = head < h;
    stage_row<WIDTH>(tile, x + ((size_t)t * h + (valid ? head : 0)) * WIDTH, valid);
}

// The key of this thread's slot, b*BK + threadIdx.x / 4, of query t: -1 when
// skipped or past k. Loops load it a block ahead of its use.
__device__ __forceinline__ int slot_key(const int* indices, int t, int k, int b) {
    const int slot = b * BK + (threadIdx.x >> 2);
    return slot < k ? indices[(size_t)t * k + slot] : -1;
}

// This thread's share of gathering kv row s (zeros when s < 0) into row
// threadIdx.x / 4 of a key tile: 16-byte chunks threadIdx.x % 4 + 4 i for
// i in [FIRST, LAST) (i < 8 covers features 0..255, the first 4 regions).
template <int FIRST, int LAST>
__device__ __forceinline__ void stage_key_row(unsigned char* tile, const u16* kv, int s) {
    const int r = threadIdx.x >> 2;
    const u16* src = kv + (size_t)(s >= 0 ? s : 0) * D;
    #pragma unroll
    for (int i = FIRST; i < LAST; ++i) {
        const int c = (threadIdx.x & 3) + 4 * i;
        cp_async16(tile + swizzled_offset(r, c, 64), src + c * 8, s >= 0);
    }
}

__device__ __forceinline__ void record_key(int* idx, int s) {
    if ((threadIdx.x & 3) == 0) idx[threadIdx.x >> 2] = s;
}

// Pull kv row s into L2 ahead of its gather (this thread's 128-byte lines of it); nothing when s < 0.
__device__ __forceinline__ void prefetch_key_row(const u16* kv, int s) {
    if (s < 0) return;
    const char* row = reinterpret_cast<const char*>(kv + (size_t)s * D);
    for (int line = threadIdx.x & 3; line * 128 < D * 2; line += 4)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + line * 128));
}

template <int N>
__device__ __forceinline__ void mma_begin(float (&d)[N]) {
    wgmma_fence_operands(d);
    wgmma_fence();
}

__device__ __forceinline__ void mma_end() {
    wgmma_commit();
    wgmma_wait_all();
}

template <int N>
__device__ __forceinline__ void zero(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) d[i] = 0.f;
}

// acc[64 x 32] (+)= a b^T over k-steps FIRST .. LAST-1 (16 features each): a
// the rows of a 64-row tile, b 32 rows of a 64-row tile (both K-major); k-step
// 0 overwrites acc. Issue only; the caller fences and waits.
template <int FIRST, int LAST>
__device__ __forceinline__ void issue_rows32(float (&acc)[16], const unsigned char* a, const unsigned char* b) {
    #pragma unroll
    for (int kk = FIRST; kk < LAST; ++kk)
        sa_mma_n32<0, 0>(acc, wgmma_desc_k(a, kk, 64), wgmma_desc_k(b, kk, 64), kk > 0);
}

// ---------------------------------------------------------------- forward

struct FwdShared {
    int idx[2][BK];
    float red[2][BH];  // per-warpgroup row maxima, then row sums
};

// Walk the key blocks of query t, gathering block b + 1 while `body(b, tile,
// idx)` works on block b. The body may use any barrier and must have waited
// for its own reads of the tile (wgmma) before it returns: block b + 1 then
// reuses block b - 1's buffers once every thread is past the next block's
// barrier. With skip_empty, blocks without a valid slot are passed over.
// All threads must call this.
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
        if (b + 1 < nb) {
            stage_key_row<0, D / 32>(kv_tiles + ((b + 1) & 1) * KV_BYTES, kv, s_next);
            record_key(sh.idx[(b + 1) & 1], s_next);
        }
        cp_async_commit();
        s_cur = s_next;
        s_next = slot_key(indices, t, k, b + 2);
        if (!any && skip_empty) continue;
        body(b, kv_tiles + (b & 1) * KV_BYTES, sh.idx[b & 1]);
    }
    cp_async_wait<0>();
}

// Logits of the block's slots 32w .. 32w+31 in base-2 units (scale * log2 e
// folded in), -inf at skipped slots.
__device__ __forceinline__ void block_logits(float (&s)[16], const unsigned char* q_tile, const unsigned char* tile,
                                             const int* idx, const Lane& ln, float sl2) {
    zero(s);
    mma_begin(s);
    issue_rows32<0, D / 16>(s, q_tile, tile + ln.w * 32 * 128);
    mma_end();
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
                pack_half2(p0, p1);
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
        sa_mma_n256<0, 1>(o, wgmma_desc_k(p_tile, kk, 64),
                          wgmma_desc_mn(tile + ln.w * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);
    mma_end();
    wgmma_fence_operands(o);
}

// probs[slot] of this CTA's heads: sum over heads of exp2(logit - lse2), in a fixed order.
__device__ __forceinline__ void block_probs(const float (&s)[16], const float (&lse2)[2], const bool (&live)[2], float* col,
                            float* probs_row, int b, int k, const Lane& ln) {
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
    for_each_key_block(kv_tiles, sh, kv, indices, t, k, true, [&](int, const unsigned char* tile, const int* idx) {
        float s[16];
        block_logits(s, q_tile, tile, idx, ln, sl2);
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
            *reinterpret_cast<u32*>(dst + 8 * j) = pack_half2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (ln.w == 0 && (threadIdx.x & 3) == 0) lse[(size_t)t * h + head] = lse2[r] * LN2;
    }
    if (probs == nullptr) return;
    float* probs_row = probs + ((size_t)t * groups + g) * k;
    float* col = reinterpret_cast<float*>(p_tile);  // [8 warps][32 columns]; the p tile is unused here
    for_each_key_block(kv_tiles, sh, kv, indices, t, k, false, [&](int b, const unsigned char* tile, const int* idx) {
        float s[16];
        block_logits(s, q_tile, tile, idx, ln, sl2);
        block_probs(s, lse2, live, col, probs_row, b, k, ln);
    });
}

// ---------------------------------------------------------------- backward

namespace {

struct BwdShared {
    int idx[2][BK];
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
        acc = fmaf(half_to_float((u16)(av[i] & 0xFFFF)), half_to_float((u16)(bv[i] & 0xFFFF)), acc);
        acc = fmaf(half_to_float((u16)(av[i] >> 16)), half_to_float((u16)(bv[i] >> 16)), acc);
    }
    return acc;
}

// delta = rowsum(dout * out) and lse in base 2 for the CTA's 64 head rows
// (0 and -inf for heads past h); 4 threads per row, summed in a fixed order.
__device__ __forceinline__ void row_stats(BwdShared& sh, const u16* out, const u16* dout, const float* lse, int t, int g, int h) {
    const int r = threadIdx.x >> 2, head = g * BH + r;
    float acc = 0.f;
    if (head < h) {
        const uint4* o4 = reinterpret_cast<const uint4*>(out + ((size_t)t * h + head) * DV);
        const uint4* d4 = reinterpret_cast<const uint4*>(dout + ((size_t)t * h + head) * DV);
        for (int c = threadIdx.x & 3; c < DV / 8; c += 4) acc += dot_halves(o4[c], d4[c]);
    }
    acc = quad_sum(acc);
    if ((threadIdx.x & 3) == 0) {
        sh.delta[r] = acc;
        sh.lse2[r] = head < h ? lse[(size_t)t * h + head] * LOG2E : neg_inf();
    }
}

// ds = p (dp - delta) (0 for a one-key row) and p' = p / scale for this
// thread's 16 entries of the block, into the shared ds tile and the block's
// global image (ds, then p').
__device__ __forceinline__ void write_ds(const float (&s)[16], const float (&dp)[16], const BwdShared& sh,
                                         const int* idx, unsigned char* ds_tile, unsigned char* image, float sl2,
                                         float inv_scale, bool constant_p, const Lane& ln) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ln.row0 + 8 * r;
        const float lse2 = sh.lse2[row], delta = sh.delta[row];
        const bool live = lse2 != neg_inf();
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = ln.w * 32 + 8 * j + ln.cq;
            float p[2], ds[2];
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int i = 4 * j + 2 * r + c;
                p[c] = live && idx[col + c] >= 0 ? exp2f(s[i] * sl2 - lse2) : 0.f;
                ds[c] = constant_p ? 0.f : p[c] * (dp[i] - delta);
            }
            const u32 off = tile_offset(row, col), ds2 = pack_half2(ds[0], ds[1]);
            *reinterpret_cast<u32*>(ds_tile + off) = ds2;
            *reinterpret_cast<u32*>(image + off) = ds2;
            *reinterpret_cast<u32*>(image + P_BYTES + off) = pack_half2(p[0] * inv_scale, p[1] * inv_scale);
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
        sa_mma_n256<0, 1>(acc, a, wgmma_desc_mn(tile + ln.w * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);
        sa_mma_n64<0, 1>(rope, a, wgmma_desc_mn(tile + 8 * REGION + kk * K_STEP_ROWS, REGION), 1);
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
        for (int j = 0; j < 8; ++j) store(DV + 8 * j + ln.cq, rope[4 * j + 2 * r] * scale, rope[4 * j + 2 * r + 1] * scale);
}

}  // namespace

// Dynamic shared memory: 1024 + Q_BYTES + DO_BYTES + KV_BYTES + P_BYTES.
// Grid: C * groups CTAs over the chunk's queries (pointers start at its first
// query). images: [C * groups][ceil(k / 64)] blocks of IMAGE_BYTES; blocks
// without a valid slot are not written.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_backward_dq(const u16* q, const u16* kv, const int* indices, const u16* out, const u16* dout, const float* lse,
               u16* dq, unsigned char* images, int h, int k, float scale) {
    __shared__ BwdShared sh;
    unsigned char* q_tile = aligned_dynamic_smem();
    unsigned char* do_tile = q_tile + Q_BYTES;
    unsigned char* kv_tile = do_tile + DO_BYTES;
    unsigned char* ds_tile = kv_tile + KV_BYTES;
    const int groups = (h + BH - 1) / BH, t = blockIdx.x / groups, g = blockIdx.x % groups;
    const int nb = (k + BK - 1) / BK;
    const Lane ln = lane_geometry();
    const float sl2 = scale * LOG2E;
    stage_heads<D>(q_tile, q, t, g, h);
    stage_heads<DV>(do_tile, dout, t, g, h);
    cp_async_commit();
    row_stats(sh, out, dout, lse, t, g, h);
    const bool constant_p = one_key(sh, indices, t, k);
    unsigned char* image = images + (size_t)blockIdx.x * nb * IMAGE_BYTES;
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
        prefetch_key_row(kv, s_next);
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
        write_ds(s, dp, sh, sh.idx[0], ds_tile, image + (size_t)b * IMAGE_BYTES, sl2, 1.f / scale, constant_p, ln);
        fence_proxy_async();
        __syncthreads();
        add_ds_kv(acc, rope, ds_tile, kv_tile, ln);
        __syncthreads();  // the kv and ds tiles are free for the next block
    }
    cp_async_wait<0>();
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head = g * BH + ln.row0 + 8 * r;
        if (head >= h) continue;
        u16* dst = dq + ((size_t)t * h + head) * D;
        store_row(acc, rope, r, scale, ln, [&](int c, float a, float v) {
            *reinterpret_cast<u32*>(dst + c) = pack_half2(a, v);
        });
    }
}

// Dynamic shared memory: 1024 + Q_BYTES + DO_BYTES + 2 * IMAGE_BYTES.
// Grid as sa_backward_dq. rows: [C * groups, k, 576] float32; row (cta, slot)
// = scale * (ds^T q + p'^T dout) of that slot, written for valid slots only.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_backward_dkv_rows(const u16* q, const u16* dout, const int* indices, const unsigned char* images, float* rows,
                     int h, int k, float scale) {
    __shared__ BwdShared sh;
    unsigned char* q_tile = aligned_dynamic_smem();
    unsigned char* do_tile = q_tile + Q_BYTES;
    unsigned char* image_tiles = do_tile + DO_BYTES;
    const int groups = (h + BH - 1) / BH, t = blockIdx.x / groups, g = blockIdx.x % groups;
    const int nb = (k + BK - 1) / BK;
    const Lane ln = lane_geometry();
    stage_heads<D>(q_tile, q, t, g, h);
    stage_heads<DV>(do_tile, dout, t, g, h);
    cp_async_commit();
    const unsigned char* image = images + (size_t)blockIdx.x * nb * IMAGE_BYTES;
    float* cta_rows = rows + (size_t)blockIdx.x * k * D;
    // Stage block b's images (blocks sa_backward_dq skipped hold garbage, and are skipped here too).
    auto stage = [&](int b, int s) {
        unsigned char* dst = image_tiles + (b & 1) * IMAGE_BYTES;
        const unsigned char* src = image + (size_t)b * IMAGE_BYTES;
        for (int c = threadIdx.x; c < IMAGE_BYTES / 16; c += THREADS) cp_async16(dst + 16 * c, src + 16 * c, true);
        record_key(sh.idx[b & 1], s);
    };
    int s_cur = slot_key(indices, t, k, 0), s_next = slot_key(indices, t, k, 1);
    if (nb > 0) stage(0, s_cur);
    cp_async_commit();
    float acc[128], rope[32];  // each block's products overwrite them (accumulate = 0 at the first k-step)
    zero(acc);
    zero(rope);
    for (int b = 0; b < nb; ++b) {
        cp_async_wait<0>();
        fence_proxy_async();
        const int any = __syncthreads_or(s_cur >= 0);  // block b landed; block b - 1 done everywhere
        if (b + 1 < nb) stage(b + 1, s_next);
        cp_async_commit();
        s_cur = s_next;
        s_next = slot_key(indices, t, k, b + 2);
        if (!any) continue;
        const unsigned char* ds_img = image_tiles + (b & 1) * IMAGE_BYTES;
        mma_begin(acc);
        wgmma_fence_operands(rope);
        #pragma unroll
        for (int kk = 0; kk < BH / 16; ++kk) {
            const u64 a_ds = wgmma_desc_mn(ds_img + kk * K_STEP_ROWS, REGION);
            const u64 a_p = wgmma_desc_mn(ds_img + P_BYTES + kk * K_STEP_ROWS, REGION);
            const int n0 = ln.w * 4 * REGION + kk * K_STEP_ROWS;
            sa_mma_n256<1, 1>(acc, a_ds, wgmma_desc_mn(q_tile + n0, REGION), kk > 0);
            sa_mma_n256<1, 1>(acc, a_p, wgmma_desc_mn(do_tile + n0, REGION), 1);
            sa_mma_n64<1, 1>(rope, a_ds, wgmma_desc_mn(q_tile + 8 * REGION + kk * K_STEP_ROWS, REGION), kk > 0);
        }
        mma_end();
        wgmma_fence_operands(acc);
        wgmma_fence_operands(rope);
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int slot = ln.row0 + 8 * r;
            if (sh.idx[b & 1][slot] < 0) continue;
            float* dst = cta_rows + (size_t)(b * BK + slot) * D;
            store_row(acc, rope, r, scale, ln, [&](int c, float a, float v) {
                *reinterpret_cast<float2*>(dst + c) = make_float2(a, v);
            });
        }
    }
    cp_async_wait<0>();
}

// dkv[keys[s], :] += the rows of segment s's pairs, one after another in the
// segment's order: pair e is pairs[e] = t * k + i < 2^31 (query t of the chunk,
// slot i); its rows (t * groups + g) * k + i, g ascending, follow each other.
// One CTA of D / 4 threads per segment (4 columns each); no atomics.
extern "C" __global__ void __launch_bounds__(D / 4)
sa_dkv_segments(const float* rows, const int* pairs, const int* starts, const int* keys, int k, int groups,
                float* dkv) {
    const int s = blockIdx.x, c = threadIdx.x;
    float4* dst = reinterpret_cast<float4*>(dkv) + (size_t)keys[s] * (D / 4) + c;
    const float4* src = reinterpret_cast<const float4*>(rows) + c;
    float4 acc = *dst;
    for (int e = starts[s]; e < starts[s + 1]; ++e) {
        const int t = pairs[e] / k, i = pairs[e] - t * k;
        for (int g = 0; g < groups; ++g) {
            const float4 v = src[(((size_t)t * groups + g) * k + i) * (D / 4)];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
    }
    *dst = acc;
}
