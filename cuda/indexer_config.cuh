// Build configuration of the fused indexer (cuda/indexer.cu): the shape
// defines, the tile constants derived from them, the order-preserving score
// keys and the per-CTA shared state. Included by indexer.cu only.
#pragma once

#include "select.cuh"
#include "topk_keys.cuh"

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
#ifndef HS_IDX_PROBE
#define HS_IDX_PROBE 0  // 1: the timeline probe (indexer_probe.cuh)
#endif

namespace {

constexpr int H = HS_IDX_HEADS;
constexpr int D = HS_IDX_DIM;
constexpr bool F16 = HS_IDX_F16;   // float16 operands, else bfloat16
constexpr int QROWS = 256;          // query-head rows per group: the accumulator columns
constexpr int TQ = QROWS / H;       // queries per group
constexpr int KT = 64;              // keys per tile: the wgmma M
// Two CTAs per SM at D = 128 need 2 x (dynamic + static ~9 KiB + 1 KiB
// reserved) <= 228 KiB; a third 16 KiB key stage makes that ~248 KiB.
constexpr int STAGES = 2;
constexpr int ROW_BLOCKS = QROWS / 8;    // 8-column blocks of the accumulator row
constexpr int QUERY_BLOCKS = H / 8;      // 8-column blocks per query
constexpr int OWNED = (TQ + 3) / 4;      // queries per quad lane: lane quad owns 4 * m + quad
constexpr int THREADS = 128;
constexpr int Q_BYTES = QROWS * D * 2;
constexpr int K_BYTES = KT * D * 2;
// Picks the final sort holds (ops/indexer/gpu.py sends a larger k elsewhere):
// 20 bytes each (two (key, index) arrays and a rank) in the query tile and
// the key stages.
constexpr int SORT_CAP = STAGES * K_BYTES / 8;
static_assert(SORT_CAP % THREADS == 0 && 20 * SORT_CAP <= Q_BYTES + STAGES * K_BYTES, "sort area");
static_assert(H >= 8 && QROWS % H == 0 && TQ <= 32, "heads must divide 256, at least 8");
static_assert(D % 64 == 0 && D <= 256, "head dim must be a multiple of 64");

constexpr u32 NEG_INF_BITS = 0xFF800000u;
constexpr u32 NEG_INF_KEY = 0x007FFFFFu;  // key of -inf: thresholds start here

__device__ __forceinline__ u32 score_key(u32 bits) { return Float32<false>::key(bits); }

// score_key of a score from tile_scores, which is never -0.0 and whose one
// NaN is 0x7FFFFFFF: there the key without NaN or zero folding (pre) is exact.
__device__ __forceinline__ u32 summed_score_key(u32 bits) { return Float32<false>::pre(bits); }

__device__ __forceinline__ u32 key_to_bits(u32 key) { return (key & 0x80000000u) ? (key ^ 0x80000000u) : ~key; }

struct GroupShared {
    u32 hist[MAX_BINS];
    u32 scratch[MAX_WARPS + 1];
    u32 found[2];
    u32 next_slot;
    int group;
    int lo[TQ], hi[TQ];
    u32 count[TQ], thr[TQ], flip[TQ];
    u32 guess[TQ];  // GUESS_OPEN, then GUESS_MADE or GUESS_NONE once the guess is due
#if HS_IDX_PROBE
    u32 probe[32];  // the timeline probe's slots (indexer_probe.cuh)
#endif
};

constexpr u32 GUESS_OPEN = 0, GUESS_MADE = 1, GUESS_NONE = 2;

}  // namespace

#include "indexer_probe.cuh"
