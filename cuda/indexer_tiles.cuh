// The fused indexer's tile loop (cuda/indexer.cu): key tiles streamed through
// shared memory, their products on tensor cores, the head-weighted ReLU sums
// and the quad's sums that leave each lane its own queries' scores.
#pragma once

#include "indexer_config.cuh"
#include "wgmma.cuh"

namespace {

// Start key tile `k_tile` times half HALF of the query tile (accumulator
// columns 128 HALF ..: queries HALF * TQ / 2 ..) as one committed wgmma group
// (the first k-step overwrites, so the previous tile's values go); it is in
// flight on return, and stream_group waits for it.
template <int HALF>
__device__ __forceinline__ void issue_half(float (&acc)[QROWS / 4], const unsigned char* k_tile,
                                           const unsigned char* q_tile) {
    wgmma_fence_operands(acc);
    wgmma_fence();
    // Each k-step's descriptors are a base low word plus a constant, under
    // wgmma_desc's high word, which holds no address bits and so is the same
    // for both operands (the same bits as wgmma_desc_k). The empty asm keeps
    // ptxas from hoisting the 16 query descriptors out of the tile loop into
    // general registers, each then moved to a uniform register (R2UR) before
    // its product; built here they stay in uniform registers.
    const u64 k_desc = wgmma_desc(k_tile), q_desc = wgmma_desc(q_tile + HALF * (QROWS / 2) * 128);
    u32 k_lo = (u32)k_desc, q_lo = (u32)q_desc;
    asm volatile("" : "+r"(k_lo), "+r"(q_lo));
    const u64 hi = k_desc & 0xFFFFFFFF00000000ull;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_m64n128k16<F16>(acc, hi | wgmma_desc_k_lo(k_lo, kk, KT), hi | wgmma_desc_k_lo(q_lo, kk, QROWS), kk > 0);
    wgmma_commit();
    wgmma_fence_operands(acc);
}

// Copy ROWS rows of D 16-bit elements (row r from src + r * D) into the
// swizzled layout; rows at or past `valid_rows` (>= 1) are zero-filled.
// Where a row's CHUNKS 16-byte chunks divide THREADS (D = 64, 128, 256),
// thread t copies chunk t % CHUNKS of rows t / CHUNKS + i * ROW_STEP: the
// same chunk every round, and a row step of 4 or a multiple of 8 changes
// row % 8 by a constant XOR, so each copy is a fixed offset from the
// round-0 addresses (one instruction each, no index arithmetic per copy).
// Otherwise (D = 192) chunk c goes to thread c % THREADS.
template <int ROWS>
__device__ __forceinline__ void load_rows(unsigned char* dst, const u16* src, int valid_rows) {
    constexpr int CHUNKS = D / 8;
    static_assert(ROWS * CHUNKS % THREADS == 0, "whole rounds of chunks");
    constexpr int ROW_STEP = THREADS / CHUNKS;
    if constexpr (THREADS % CHUNKS == 0 && (ROW_STEP % 8 == 0 || ROW_STEP == 4)) {
        const int chunk = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS;
        unsigned char* dst0 = dst + (chunk >> 3) * ROWS * 128 + r0 * 128;
        // A zero-fill copy reads nothing; its address still stays in bounds.
        const u16* src0 = src + (size_t)min(r0, valid_rows - 1) * D + chunk * 8;
        #pragma unroll
        for (int i = 0; i < ROWS / ROW_STEP; ++i) {
            const int swizzle = ((chunk & 7) ^ (r0 & 7) ^ ((i * ROW_STEP) & 7)) << 4;
            const bool valid = r0 + i * ROW_STEP < valid_rows;
            cp_async16(dst0 + i * ROW_STEP * 128 + swizzle, valid ? src0 + (size_t)i * ROW_STEP * D : src0, valid);
        }
    } else {
        for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, chunk = c % CHUNKS;
            const bool valid = r < valid_rows;
            cp_async16(dst + swizzled_offset(r, chunk, ROWS), src + (size_t)(valid ? r : 0) * D + chunk * 8, valid);
        }
    }
}

// Where the weight of accumulator column `col` (query col / H, head col % H)
// sits in w_s: the four weights a quad lane multiplies in blocks 2p and
// 2p + 1 (columns 8 j + 2 quad + {0, 1}) are 16 contiguous bytes, one
// shared-memory load per block pair instead of two.
__device__ __forceinline__ int w_slot(int col) {
    const int j = col >> 3, quad = (col >> 1) & 3;
    return 16 * (j >> 1) + 4 * quad + 2 * (j & 1) + (col & 1);
}

// This lane's part of the head-weighted ReLU sums s[qi][rr] of key rows
// key_row(rr) over half HALF of its columns (acc: that half's accumulator),
// 8-column blocks in ascending order. The low half's sums come first, so
// each query's sum takes the order of the whole row (H = 256: one query
// over both halves).
template <int HALF>
__device__ __forceinline__ void head_sums(const float (&acc)[QROWS / 4], const float* w_s, float (&s)[TQ][2]) {
    static_assert(ROW_BLOCKS % 4 == 0, "half rows of whole block pairs");
    const int quad = threadIdx.x & 3;
    #pragma unroll
    for (int hp = 0; hp < ROW_BLOCKS / 4; ++hp) {
        const int pair = HALF * ROW_BLOCKS / 4 + hp;
        const float4 w4 = *reinterpret_cast<const float4*>(w_s + 16 * pair + 4 * quad);
        #pragma unroll
        for (int b = 0; b < 2; ++b) {
            const int j = 2 * hp + b, qi = (2 * pair + b) / QUERY_BLOCKS;  // block j of the half, of query qi
            const float w0 = b ? w4.z : w4.x, w1 = b ? w4.w : w4.y;
            s[qi][0] = fmaf(w0, fmaxf(acc[4 * j + 0], 0.f), s[qi][0]);
            s[qi][0] = fmaf(w1, fmaxf(acc[4 * j + 1], 0.f), s[qi][0]);
            s[qi][1] = fmaf(w0, fmaxf(acc[4 * j + 2], 0.f), s[qi][1]);
            s[qi][1] = fmaf(w1, fmaxf(acc[4 * j + 3], 0.f), s[qi][1]);
        }
    }
}

// Wait for the low half issue_half<0> started (the high half may stay in
// flight) and leave this lane's head sums of its queries in part (the high
// half's queries zero, for head_sums<1> to add).
__device__ __forceinline__ void low_sums(float (&lo_acc)[QROWS / 4], const float* w_s, float (&part)[TQ][2],
                                         Probe& probe) {
    #pragma unroll
    for (int qi = 0; qi < TQ; ++qi) part[qi][0] = part[qi][1] = 0.f;
    wgmma_wait<1>();
    wgmma_fence_operands(lo_acc);
    probe.mark(P_WAIT_LO);
    head_sums<0>(lo_acc, w_s, part);
    probe.mark(P_LO_SUMS);
}

// owned[m][rr]: the sum over the four lanes of a quad of their parts
// part[4 m + quad][rr], where that query exists; each lane consumes only its
// own queries. With TQ a multiple of 4, recursive halving: a lane sends its
// partner (quad ^ 2, then quad ^ 1) the parts the partner keeps, and query c
// = quad sums to (p_c + p_{c^2}) + (p_{c^1} + p_{c^3}), each sum formed in one
// lane. Otherwise the butterfly gives every lane every sum, then a select.
// Either way one (key, query) always gets the same bits.
__device__ __forceinline__ void quad_sums(const float (&part)[TQ][2], float (&owned)[OWNED][2]) {
    const int quad = threadIdx.x & 3;
    if constexpr (TQ % 4 == 0) {
        const bool high = quad & 2, odd = quad & 1;
        #pragma unroll
        for (int m = 0; m < OWNED; ++m) {
            float half[2][2];  // [c][rr]: query 4 m + c + (high ? 2 : 0) over lanes quad and quad ^ 2
            #pragma unroll
            for (int c = 0; c < 2; ++c)
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const float lo = part[4 * m + c][rr], hi = part[4 * m + c + 2][rr];
                    half[c][rr] = (high ? hi : lo) + __shfl_xor_sync(FULL_MASK, high ? lo : hi, 2);
                }
            #pragma unroll
            for (int rr = 0; rr < 2; ++rr)
                owned[m][rr] = (odd ? half[1][rr] : half[0][rr]) +
                               __shfl_xor_sync(FULL_MASK, odd ? half[0][rr] : half[1][rr], 1);
        }
    } else {
        float sums[TQ][2];
        #pragma unroll
        for (int qi = 0; qi < TQ; ++qi)
            #pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float v = part[qi][rr] + __shfl_xor_sync(FULL_MASK, part[qi][rr], 1);
                sums[qi][rr] = v + __shfl_xor_sync(FULL_MASK, v, 2);
            }
        #pragma unroll
        for (int m = 0; m < OWNED; ++m)
            #pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                float v = sums[4 * m][rr];
                #pragma unroll
                for (int c = 1; c < 4; ++c)
                    if (4 * m + c < TQ) v = quad == c ? sums[4 * m + c][rr] : v;
                owned[m][rr] = v;
            }
    }
}

// Leave this lane's scores in owned from its parts (quad_sums), with one NaN
// (0x7FFFFFFF) and no -0.0 (a sum that underflowed from below reads +0.0).
__device__ __forceinline__ void tile_scores(const float (&part)[TQ][2], float (&owned)[OWNED][2]) {
    quad_sums(part, owned);
    #pragma unroll
    for (int m = 0; m < OWNED; ++m)
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const float v = owned[m][rr] + 0.f;  // -0.0 + +0.0 is +0.0; every other value stays
            owned[m][rr] = v != v ? __int_as_float(0x7FFFFFFF) : v;
        }
}

struct Problem {
    const u16* q;  // [n_q, H, D]
    const u16* k;  // [n_k, D]
    const float* w;  // [n_q, H]
    const int* lo;   // [n_q] first visible key
    const int* hi;   // [n_q] one past the last visible key
    int n_q, n_k;
};

// Load key tile j of the stream starting at key `begin` into its stage and commit it as one group.
__device__ __forceinline__ void load_key_tile(unsigned char* k_tiles, const Problem& p, int begin, int j) {
    const int s0 = begin + j * KT;
    load_rows<KT>(k_tiles + (j % STAGES) * K_BYTES, p.k + (size_t)s0 * D, min(KT, p.n_k - s0));
    cp_async_commit();
}

// Claim the next query group (longest first) and stage its queries, weights and ranges.
__device__ bool next_group(GroupShared& sh, const Problem& p, int* work_counter, unsigned char* q_tile, float* w_s) {
    const int n_groups = (p.n_q + TQ - 1) / TQ;
    if (threadIdx.x == 0) sh.group = n_groups - 1 - atomicAdd(work_counter, 1);
    __syncthreads();
    const int g = sh.group;
    if (g < 0) return false;
    const int t0 = g * TQ;
    load_rows<QROWS>(q_tile, p.q + (size_t)t0 * H * D, min(TQ, p.n_q - t0) * H);
    cp_async_commit();
    for (int i = threadIdx.x; i < TQ * H; i += THREADS)
        w_s[w_slot(i)] = t0 * H + i < p.n_q * H ? p.w[(size_t)t0 * H + i] : 0.f;
    if (threadIdx.x < TQ) {
        const int t = t0 + threadIdx.x;
        sh.lo[threadIdx.x] = t < p.n_q ? p.lo[t] : 0;
        sh.hi[threadIdx.x] = t < p.n_q ? p.hi[t] : 0;
        sh.count[threadIdx.x] = 0;
        sh.thr[threadIdx.x] = NEG_INF_KEY;
        sh.flip[threadIdx.x] = 0;
        sh.guess[threadIdx.x] = GUESS_OPEN;
    }
    __syncthreads();
    return true;
}

// Stream the key tiles of the current group. `consume(s0, owned)` sees each
// tile: owned[m][rr] is the score of query qi = 4 * m + (lane & 3), where
// qi < TQ, and key s0 + key_row(rr); it must not touch the key stages or
// block-wide barriers, and returns a flag. When any thread's flag from
// consume(j - 1) was set, `settle(seen_end)` runs (all threads, block-wide
// barriers allowed) after consume(j - 1) and before consume(j), at a point
// where no products are in flight, so it has the accumulators' registers to
// itself; keys below seen_end have been consumed, none above.
template <typename Consume, typename Settle>
__device__ void stream_group(GroupShared& sh, const Problem& p, unsigned char* q_tile, unsigned char* k_tiles,
                             const float* w_s, Consume&& consume, Settle&& settle) {
    Probe probe(sh);
    int first = 0x7FFFFFFF, last = 0;
    for (int qi = 0; qi < TQ; ++qi)
        if (sh.hi[qi] > sh.lo[qi]) {
            first = min(first, sh.lo[qi]);
            last = max(last, sh.hi[qi]);
        }
    const int begin = first >= last ? 0 : (first / KT) * KT;
    const int n_tiles = first >= last ? 0 : (last - begin + KT - 1) / KT;
    for (int j = 0; j < min(n_tiles, STAGES); ++j)  // one committed group per tile, empty ones too
        load_key_tile(k_tiles, p, begin, j);
    for (int j = n_tiles; j < STAGES; ++j) cp_async_commit();
    float lo_acc[QROWS / 4], hi_acc[QROWS / 4];  // the two halves' accumulators
    #pragma unroll
    for (int i = 0; i < QROWS / 4; ++i) lo_acc[i] = hi_acc[i] = 0.f;
    float part[TQ][2];  // this lane's head sums of the tile in hand (low half first)
    if (n_tiles > 0) {
        cp_async_wait<STAGES - 1>();  // the query tile and key tile 0
        fence_proxy_async();
        __syncthreads();
        issue_half<0>(lo_acc, k_tiles, q_tile);
        issue_half<1>(hi_acc, k_tiles, q_tile);
        probe.mark(P_ISSUE);
        low_sums(lo_acc, w_s, part, probe);
        int flag = 0;
        // A wait that leaves a group in flight (wgmma_wait<1>) sees only
        // groups issued in the same pass of the loop; at the back edge only
        // a high half is in flight, and the loop's first wait takes it. In
        // other forms ptxas serialises every wgmma of the kernel (C7514).
        for (int j = 0;; ++j) {
            wgmma_wait<0>();  // tile j's high half
            wgmma_fence_operands(hi_acc);
            probe.mark(P_WAIT_HI);
            head_sums<1>(hi_acc, w_s, part);
            probe.mark(P_HI_SUMS);
            cp_async_wait<STAGES - 2>();  // key tile j + 1, where there is one
            fence_proxy_async();
            probe.mark(P_COPY_WAIT);
            probe.count(N_TILES, 1);
            // Every warp is past tile j's products and consume(j - 1); the
            // barrier ORs consume(j - 1)'s flags.
            const bool settle_now = __syncthreads_or(flag);
            probe.mark(P_BARRIER);
            if (settle_now) {
                settle(begin + j * KT);
                probe.mark(P_SETTLE);
            }
            float owned[OWNED][2];
            if (j + 1 == n_tiles) {  // the last tile: nothing left to overlap
                tile_scores(part, owned);
                consume(begin + j * KT, owned);
                probe.mark(P_CONSUME);
                break;
            }
            const unsigned char* next = k_tiles + ((j + 1) % STAGES) * K_BYTES;
            issue_half<0>(lo_acc, next, q_tile);
            issue_half<1>(hi_acc, next, q_tile);
            if (j + STAGES < n_tiles) load_key_tile(k_tiles, p, begin, j + STAGES);  // into tile j's stage
            else cp_async_commit();
            probe.mark(P_ISSUE);
            tile_scores(part, owned);
            probe.mark(P_TILE_SCORES);
            low_sums(lo_acc, w_s, part, probe);     // overlaps tile j + 1's high half
            flag = consume(begin + j * KT, owned);
            probe.mark(P_CONSUME);
        }
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

// The visible key ranges [lo, hi) of the queries this lane owns (4 * m +
// quad; empty past TQ), held in registers for the whole group.
struct OwnedRanges {
    int lo[OWNED], hi[OWNED];
    __device__ explicit OwnedRanges(const GroupShared& sh) {
        #pragma unroll
        for (int m = 0; m < OWNED; ++m) {
            const int qi = 4 * m + (int)(threadIdx.x & 3);
            lo[m] = qi < TQ ? sh.lo[qi] : 0;
            hi[m] = qi < TQ ? sh.hi[qi] : 0;
        }
    }
    __device__ bool visible(int m, int s) const { return s >= lo[m] && s < hi[m]; }
};

}  // namespace
