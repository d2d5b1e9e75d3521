// Shared pieces of the sparse-attention kernels (sparse_attention.cu: forward,
// sparse_attention_bwd.cu: backward), MLA's MQA layout on tensor cores (wgmma,
// sm_90a):
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
#pragma once

#include "select.cuh"
#include "wgmma.cuh"

#ifndef HS_SA_F16
#define HS_SA_F16 0
#endif

using namespace hs;

namespace {

constexpr int D = 576;        // d_qk
constexpr int DV = 512;       // d_v
constexpr int BH = 64;        // heads per CTA: the M of the head-major products
constexpr int BK = 64;        // slots per key block
constexpr int THREADS = 256;  // two warpgroups
constexpr bool F16 = HS_SA_F16;  // float16 data, else bfloat16
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

// This thread's share of staging a row into one 64-row tile: row
// threadIdx.x / 4 from `src` (zeros when !valid), 16-byte chunks
// threadIdx.x % 4 + 4 i for i in [FIRST, LAST) (i < WIDTH / 32 covers a row
// of WIDTH 16-bit columns). `policy`: none, or an L2 cache policy for the
// copies (cp_async16's overloads).
template <int FIRST, int LAST, typename... Policy>
__device__ __forceinline__ void stage_row(unsigned char* tile, const u16* src, bool valid, Policy... policy) {
    const int r = threadIdx.x >> 2;
    #pragma unroll
    for (int i = FIRST; i < LAST; ++i) {
        const int c = (threadIdx.x & 3) + 4 * i;
        cp_async16(tile + swizzled_offset(r, c, 64), src + c * 8, valid, policy...);
    }
}

// Rows g*64 .. g*64+63 of x[t] ([h, WIDTH] per query) into a tile; heads past h are zeros.
// `policy`: none, or an L2 cache policy for the copies (stage_row's).
template <int WIDTH, typename... Policy>
__device__ __forceinline__ void stage_heads(unsigned char* tile, const u16* x, int t, int g, int h, Policy... policy) {
    const int head = g * BH + (threadIdx.x >> 2);
    const bool valid = head < h;
    stage_row<0, WIDTH / 32>(tile, x + ((size_t)t * h + (valid ? head : 0)) * WIDTH, valid, policy...);
}

// The key of slot `slot` of query t: -1 when skipped or past k.
__device__ __forceinline__ int slot_key_at(const int* indices, int t, int k, int slot) {
    return slot < k ? indices[(size_t)t * k + slot] : -1;
}

// The key of this thread's slot, b*BK + threadIdx.x / 4, of query t: -1 when
// skipped or past k. Loops load it a block ahead of its use.
__device__ __forceinline__ int slot_key(const int* indices, int t, int k, int b) {
    return slot_key_at(indices, t, k, b * BK + (threadIdx.x >> 2));
}

// This thread's place in its warpgroup's gathers of a key block: rows
// group + 16 r (r < 4), 16-byte chunk `chunk` of each 128-byte region row
// (8 threads per row).
struct GatherLane {
    int group, chunk;
};

__device__ __forceinline__ GatherLane gather_lane() {
    return GatherLane{(int)(threadIdx.x & 127) >> 3, (int)threadIdx.x & 7};
}

// The keys of this thread's rows of block b of query t (-1: skipped or past k).
__device__ __forceinline__ void block_keys(int (&keys)[4], const int* indices, int t, int k, int b,
                                           const GatherLane& gl) {
    #pragma unroll
    for (int r = 0; r < 4; ++r) keys[r] = slot_key_at(indices, t, k, b * BK + gl.group + 16 * r);
}

// This thread's copies of regions R0 .. R1-1 (64 features each) of the rows
// `keys` into a key tile's region layout (zeros where a key is < 0); the
// caller commits them or has them arrive on a barrier.
template <int R0, int R1>
__device__ __forceinline__ void gather_regions(unsigned char* tile, const u16* kv, const int (&keys)[4],
                                               const GatherLane& gl) {
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = gl.group + 16 * r;
        const u16* src = kv + (size_t)(keys[r] >= 0 ? keys[r] : 0) * D + gl.chunk * 8;
        #pragma unroll
        for (int region = R0; region < R1; ++region)
            cp_async16(tile + region * REGION + row * 128 + ((gl.chunk ^ (row & 7)) << 4), src + region * 64,
                       keys[r] >= 0);
    }
}

// This thread's share of gathering kv row s (zeros when s < 0) into row
// threadIdx.x / 4 of a key tile, chunks as stage_row's (i < 8 covers
// features 0..255, the first 4 regions). The rows are kept in L2 over
// evict-normal lines (each is gathered by many queries) and fetched from
// memory 256 bytes at a time.
template <int FIRST, int LAST>
__device__ __forceinline__ void stage_key_row(unsigned char* tile, const u16* kv, int s) {
    stage_row<FIRST, LAST>(tile, kv + (size_t)(s >= 0 ? s : 0) * D, s >= 0, l2_evict_last());
}

__device__ __forceinline__ void record_key(int* idx, int s) {
    if ((threadIdx.x & 3) == 0) idx[threadIdx.x >> 2] = s;
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
        wgmma_m64n32k16<F16, 0, 0>(acc, wgmma_desc_k(a, kk, 64), wgmma_desc_k(b, kk, 64), kk > 0);
}

// acc[64 x 64] (+)= a b^T over k-steps FIRST .. LAST-1 as issue_rows32's, b
// all 64 rows of its tile. Issue only; the caller fences and waits.
template <int FIRST, int LAST>
__device__ __forceinline__ void issue_rows64(float (&acc)[32], const unsigned char* a, const unsigned char* b) {
    #pragma unroll
    for (int kk = FIRST; kk < LAST; ++kk)
        wgmma_m64n64k16<F16, 0, 0>(acc, wgmma_desc_k(a, kk, 64), wgmma_desc_k(b, kk, 64), kk > 0);
}

// Bit 2j + e: slot b * BK + 8j + cq + e of query t holds a key (the columns of this thread's logits).
__device__ __forceinline__ u32 valid_slots(const int* indices, int t, int k, int b, const Lane& ln) {
    const int* row = indices + (size_t)t * k;
    u32 bits = 0;
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int slot = b * BK + 8 * j + ln.cq + e;
            if (slot < k && __ldg(row + slot) >= 0) bits |= 1u << (2 * j + e);
        }
    return bits;
}

}  // namespace
