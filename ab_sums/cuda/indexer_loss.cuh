// Shared pieces of the indexer-loss kernels (cuda/indexer_loss.cu): the
// indexer scores at the selected keys and their backward.
//
//   q [N, H, D] and k [Nk, D]: bfloat16 / float16 bits (u16) or float32;
//   w [N, H] float32; indices [N, kk] int32 (-1 = skip).
//
// Compile-time configuration (defines):
//   HS_IL_TYPE    0 bfloat16, 1 float16 (tensor cores: mma.sync m16n8k16,
//                 float32 accumulators), 2 float32 (float32 FMA, no tensor cores)
//   HS_IL_DIM     D, a multiple of 16 up to 128
//   HS_IL_MTILES  tiles of 16 heads (1, 2, 4 or 8); heads past H are zero rows
//
// A CTA owns one query t. Its H x D rows sit in shared memory; the selected
// key rows are gathered block by block (BK = 64 slots) with cp.async into a
// double-buffered tile, where slots holding -1 or past kk become zero rows.
// Every product is made of 16 x 8 tiles in the accumulator layout of
// mma.m16n8k16: lane (g = lane / 4, c = lane % 4) holds rows g and g + 8,
// columns 2c and 2c + 1. The float32 build computes the same tiles with
// FMA: each k-step of 16 is a dot product from zero added to the tile, the
// blocking of a tensor-core step, so long sums are blocked by 16.
#pragma once

#include "select.cuh"
#include "tiles.cuh"

#ifndef HS_IL_TYPE
#define HS_IL_TYPE 0
#endif
#ifndef HS_IL_DIM
#define HS_IL_DIM 128
#endif
#ifndef HS_IL_MTILES
#define HS_IL_MTILES 4
#endif

namespace il {

using hs::cp_async16;
using hs::cp_async_commit;
using hs::cp_async_wait;
using hs::half_to_float;
using hs::neg_inf;
using hs::pack_half2;

#if HS_IL_TYPE == 2
typedef float E;  // element of q, k and the operand tiles
#else
typedef u16 E;
#endif

constexpr bool F32 = HS_IL_TYPE == 2;
constexpr bool F16 = HS_IL_TYPE == 1;
constexpr int D = HS_IL_DIM;
constexpr int MT = HS_IL_MTILES;
constexpr int HP = 16 * MT;                // heads, padded
constexpr int BK = 64;                     // slots per key block
constexpr int NT = BK / 8;                 // n-tiles of slots in a block
constexpr int DT = D / 8;                  // n-tiles of features
constexpr int WARPS = MT > 4 ? MT : 4;
constexpr int THREADS = 32 * WARPS;
constexpr int WPM = WARPS / MT;            // warps sharing one head m-tile
constexpr int NW = NT / WPM;               // slot n-tiles per warp (logits)
constexpr int DW = (DT + WPM - 1) / WPM;   // feature n-tiles per warp (dq)
constexpr int PAD = F32 ? 4 : 8;           // row padding (elements): conflict-free fragment loads
constexpr int SQ = D + PAD;                // row stride of the query and key tiles
constexpr int SP = BK + PAD;               // row stride of the P and W tiles ([HP][BK])
constexpr int EPC = 16 / (int)sizeof(E);   // elements per 16-byte chunk
constexpr int CH = D / EPC;                // chunks per row
constexpr int PARTS = F32 ? 1 : 2;         // P is held as hi + lo 16-bit parts
// Dynamic shared memory (bytes); gpu.py computes the same numbers.
constexpr int Q_TILE = HP * SQ;            // elements
constexpr int K_TILE = BK * SQ;
constexpr int P_TILE = HP * SP;
constexpr int SMEM_FORWARD = (Q_TILE + 2 * K_TILE) * (int)sizeof(E);
constexpr int SMEM_BACKWARD = (Q_TILE + 2 * K_TILE + (PARTS + 1) * P_TILE) * (int)sizeof(E);
static_assert(D % 16 == 0 && D >= 16 && D <= 128, "HS_IL_DIM must be a multiple of 16 up to 128");
static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8, "HS_IL_MTILES must be 1, 2, 4 or 8");
static_assert(NT % WPM == 0 && THREADS >= HP && THREADS >= BK, "warp roles");
static_assert(SMEM_BACKWARD <= 220 * 1024, "shared memory");

__device__ __forceinline__ int lane_g() { return (threadIdx.x & 31) >> 2; }
__device__ __forceinline__ int lane_c() { return threadIdx.x & 3; }

// A warp's share of the head-major products: head m-tile `mt`, and `part`
// (of WPM) of the slot or feature n-tiles.
struct Role {
    int mt, part;
};

__device__ __forceinline__ Role warp_role() {
    const int w = threadIdx.x >> 5;
    return Role{w % MT, w / MT};
}

// ---- staging ------------------------------------------------------------------------------------

// Chunk `ch` of a D-element row into a tile row: copied from `src_row` when
// valid, zeros otherwise (a plain store: `src_row` is not read then).
__device__ __forceinline__ void stage_chunk(E* dst_row, const E* src_row, bool valid, int ch) {
    E* dst = dst_row + ch * EPC;
    if (valid)
        cp_async16(dst, src_row + ch * EPC);
    else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
}

// Query t's H rows into the query tile; rows past h are zeros.
__device__ __forceinline__ void stage_queries(E* qs, const E* q, int t, int h) {
    for (int i = threadIdx.x; i < HP * CH; i += THREADS) {
        const int r = i / CH, ch = i % CH;
        stage_chunk(qs + r * SQ, q + ((size_t)t * h + (r < h ? r : 0)) * D, r < h, ch);
    }
}

// The key of slot `slot` of query t: -1 when skipped or past kk.
__device__ __forceinline__ int slot_key(const int* indices, int t, int kk, int slot) {
    return slot < kk ? indices[(size_t)t * kk + slot] : -1;
}

// Block b of query t's selected key rows into a key tile, its keys into
// idx[BK], and (when gsl is not null) dscores at its slots into gsl[BK]
// (0 at skipped slots).
__device__ __forceinline__ void stage_keys(E* kb, int* idx, float* gsl, const E* k, const int* indices,
                                           const float* dscores, int t, int kk, int b) {
    for (int i = threadIdx.x; i < BK * CH; i += THREADS) {
        const int r = i / CH, ch = i % CH;
        const int s = slot_key(indices, t, kk, b * BK + r);
        stage_chunk(kb + r * SQ, k + (size_t)(s >= 0 ? s : 0) * D, s >= 0, ch);
    }
    if (threadIdx.x < BK) {
        const int slot = b * BK + threadIdx.x, s = slot_key(indices, t, kk, slot);
        idx[threadIdx.x] = s;
        if (gsl != nullptr) gsl[threadIdx.x] = s >= 0 ? dscores[(size_t)t * kk + slot] : 0.f;
    }
}

// ---- fragments and the 16 x 8 x 16 product ------------------------------------------------------

#if HS_IL_TYPE == 2
struct FragA {
    float v[2][16];  // A(g + 8 r, k), k = 0..15
};
struct FragB {
    float v[2][16];  // B(k, 2 c + j), k = 0..15
};
#else
struct FragA {
    u32 r[4];
};
struct FragB {
    u32 r[2];
};

// Two 16-bit elements, p[0] in the low half and p[STEP] in the high half.
template <int STEP>
__device__ __forceinline__ u32 pair16(const u16* p) {
    if constexpr (STEP == 1)
        return *reinterpret_cast<const u32*>(p);
    else
        return (u32)p[0] | ((u32)p[STEP] << 16);
}
#endif

// Fragment of a 16 x 16 operand A(m, k) = a[m * AM + k * AK].
template <int AM, int AK>
__device__ __forceinline__ void load_a(FragA& f, const E* a) {
    const int g = lane_g(), c = lane_c();
#if HS_IL_TYPE == 2
    (void)c;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float* row = a + (g + 8 * r) * AM;
        if constexpr (AK == 1) {
            #pragma unroll
            for (int k = 0; k < 16; k += 4) {
                const float4 x = *reinterpret_cast<const float4*>(row + k);
                f.v[r][k] = x.x;
                f.v[r][k + 1] = x.y;
                f.v[r][k + 2] = x.z;
                f.v[r][k + 3] = x.w;
            }
        } else {
            #pragma unroll
            for (int k = 0; k < 16; ++k) f.v[r][k] = row[k * AK];
        }
    }
#else
    f.r[0] = pair16<AK>(a + g * AM + 2 * c * AK);
    f.r[1] = pair16<AK>(a + (g + 8) * AM + 2 * c * AK);
    f.r[2] = pair16<AK>(a + g * AM + (2 * c + 8) * AK);
    f.r[3] = pair16<AK>(a + (g + 8) * AM + (2 * c + 8) * AK);
#endif
}

// Fragment of a 16 x 8 operand B(k, n) = b[k * BKS + n * BN].
template <int BKS, int BN>
__device__ __forceinline__ void load_b(FragB& f, const E* b) {
    const int g = lane_g(), c = lane_c();
#if HS_IL_TYPE == 2
    (void)g;
    if constexpr (BKS == 1) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float* col = b + (2 * c + j) * BN;
            #pragma unroll
            for (int k = 0; k < 16; k += 4) {
                const float4 x = *reinterpret_cast<const float4*>(col + k);
                f.v[j][k] = x.x;
                f.v[j][k + 1] = x.y;
                f.v[j][k + 2] = x.z;
                f.v[j][k + 3] = x.w;
            }
        }
    } else if constexpr (BN == 1) {
        #pragma unroll
        for (int k = 0; k < 16; ++k) {
            const float2 x = *reinterpret_cast<const float2*>(b + k * BKS + 2 * c);
            f.v[0][k] = x.x;
            f.v[1][k] = x.y;
        }
    } else {
        #pragma unroll
        for (int j = 0; j < 2; ++j)
            #pragma unroll
            for (int k = 0; k < 16; ++k) f.v[j][k] = b[k * BKS + (2 * c + j) * BN];
    }
#else
    f.r[0] = pair16<BKS>(b + 2 * c * BKS + g * BN);
    f.r[1] = pair16<BKS>(b + (2 * c + 8) * BKS + g * BN);
#endif
}

// acc (a 16 x 8 tile in the accumulator layout) += A B over one k-step of 16.
__device__ __forceinline__ void mma(float (&acc)[4], const FragA& a, const FragB& b) {
#if HS_IL_TYPE == 2
    #pragma unroll
    for (int r = 0; r < 2; ++r)
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            float dot = 0.f;
            #pragma unroll
            for (int k = 0; k < 16; ++k) dot = fmaf(a.v[r][k], b.v[j][k], dot);
            acc[2 * r + j] += dot;
        }
#else
#if HS_IL_TYPE == 1
#define HS_IL_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
#define HS_IL_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
    asm(HS_IL_MMA "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
#undef HS_IL_MMA
#endif
}

template <int N>
__device__ __forceinline__ void zero_tiles(float (&acc)[N][4]) {
    #pragma unroll
    for (int j = 0; j < N; ++j)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
}

// ---- element stores ------------------------------------------------------------------------------

// dst[0], dst[1] = x0, x1 rounded once to E (dst 2-element aligned).
__device__ __forceinline__ void store_pair(E* dst, float x0, float x1) {
#if HS_IL_TYPE == 2
    *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);
#else
    *reinterpret_cast<u32*>(dst) = pack_half2<F16>(x0, x1);
#endif
}

// x0, x1 into the P tiles at `offset`: part 0 the values rounded to E, part 1
// (16-bit builds) the rounded remainders, so part 0 + part 1 carries about
// 16 bits of each value.
__device__ __forceinline__ void store_parts(E* tiles, int offset, float x0, float x1) {
#if HS_IL_TYPE == 2
    store_pair(tiles + offset, x0, x1);
#else
    const u32 hi = pack_half2<F16>(x0, x1);
    *reinterpret_cast<u32*>(tiles + offset) = hi;
    *reinterpret_cast<u32*>(tiles + P_TILE + offset) =
        pack_half2<F16>(x0 - half_to_float<F16>((u16)(hi & 0xFFFFu)), x1 - half_to_float<F16>((u16)(hi >> 16)));
#endif
}

// ---- block-wide pieces ---------------------------------------------------------------------------

// Max of x over the CTA; every thread gets it. All threads must call this.
__device__ __forceinline__ float block_max(float x, float* red) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    float m = red[0];
    #pragma unroll
    for (int i = 1; i < WARPS; ++i) m = fmaxf(m, red[i]);
    __syncthreads();
    return m;
}

// The smallest power of two above m >= 0 (1 for m = 0), kept in [2^-125, 2^126]
// so that it and its inverse are normal: scaling by either is exact.
__device__ __forceinline__ float pow2_above(float m) {
    if (!(m > 0.f)) return 1.f;
    int e;
    frexpf(m, &e);  // m = f 2^e, f in [0.5, 1)
    return ldexpf(1.f, min(max(e, -125), 126));
}

// acc[j] = the logits q k^T of the warp's head m-tile and the block's slot
// n-tiles n0 + j (kb: the block's key tile).
template <int N>
__device__ __forceinline__ void block_logits(float (&acc)[N][4], const E* qs, const E* kb, int mt, int n0) {
    zero_tiles(acc);
    for (int ks = 0; ks < D / 16; ++ks) {
        FragA a;
        load_a<SQ, 1>(a, qs + 16 * mt * SQ + 16 * ks);
        #pragma unroll
        for (int j = 0; j < N; ++j) {
            FragB b;
            load_b<1, SQ>(b, kb + 8 * (n0 + j) * SQ + 16 * ks);
            mma(acc[j], a, b);
        }
    }
}

}  // namespace il
