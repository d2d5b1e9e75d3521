// Fused DSA indexer: scores on tensor cores and each query's exact top-k,
// streamed over key tiles; the [Nq, Nk] table is never held.
//
//   I[t, s] = sum_h w[t, h] * relu(dot(q[t, h, :], k[s, :]))
//
// A CTA is one warpgroup. It owns a group of TQ = 256 / H queries at a time
// (persistent grid, groups handed out longest first) and keeps their TQ * H
// query rows in shared memory as the B operand of wgmma; key tiles of 64 rows
// stream through a two-stage cp.async pipeline as the A operand. The
// accumulator row is a key, the column a (query, head) pair, so the head sum
// is a per-thread sum over its columns, then two steps across the quad of
// lanes that share a key row (quad_sums), which leave each lane the sums of
// the queries it owns.
//
// Schedule: a tile's products are one wgmma group of m64n256k16 (the key
// tile read from shared memory once per k-step; two m64n128k16 halves read
// it twice and measured 3 % slower). With tile j's scores in
// registers, tile j + 1's group is issued and tile j + 2's load goes into
// tile j's stage; only then does tile j's consume (selection or table
// write) run, so it overlaps tile j + 1's products, and the other CTA on the
// SM keeps the tensor cores busy while this one sums. Contracts: consume
// reads neither the key stages nor the accumulator, and each lane gets the
// scores of the queries it owns (every fourth); one barrier per tile, after
// every warp has waited for tile j's group, precedes the refill of tile j's
// stage and separates consecutive consumes. Each (key, query) score is
// summed in one fixed order (heads within a lane ascending, then quad_sums'),
// whatever the kernel, so the two kernels' scores agree bitwise.
//
// Selection (indexer_topk_*): a score enters the query's candidate buffer
// only if its key beats the running threshold; when the buffer could not
// take another tile (more than cap - KT entries) it is cut back to the top k
// (by key, then lower index) and the threshold rises to the k-th key. Tiles
// go in ascending key order, so a later key equal to the threshold ranks
// below every kept one: the strict test is exact. The end of the stream
// cuts to k and sorts. An append that fills a buffer raises a flag, the
// tile's barrier ORs the flags, and the prunes run right after it, before
// the next tile's products are issued (no per-tile barrier of their own).
//
// Invariant: a query's candidates are every key seen so far that ranks at or
// above one threshold element, so whenever they number at least k they hold
// the top k. The threshold guess uses that: once a query has seen the
// fraction f of its visible keys at which r = ceil(beta * k * f) reaches
// guess_min (if r < k there), a prune keeps only its top r: were the scores
// exchangeable along the row, about beta * k of all its keys would beat that
// threshold. Fewer appends and prunes follow. A query that ends with fewer
// than k candidates after a guess is listed in failed_rows (its row here is
// not its selection); the caller selects those rows again without a guess.
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
constexpr int SORT_CAP = STAGES * K_BYTES / 8;  // (key, index) pairs the final sort holds
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
};

constexpr u32 GUESS_OPEN = 0, GUESS_MADE = 1, GUESS_NONE = 2;

// Start key tile `k_tile` times the query tile as one committed wgmma group
// (the first k-step overwrites, so the previous tile's values go); it is in
// flight on return, and tile_scores waits for it.
__device__ __forceinline__ void issue_tile(float (&acc)[QROWS / 2], const unsigned char* k_tile,
                                           const unsigned char* q_tile) {
    wgmma_fence_operands(acc);
    wgmma_fence();
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_m64n256k16<F16>(acc, wgmma_desc_k(k_tile, kk, KT), wgmma_desc_k(q_tile, kk, QROWS), kk > 0);
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
// key_row(rr): its columns, 8-column blocks in ascending order.
__device__ __forceinline__ void head_sums(const float (&acc)[QROWS / 2], const float* w_s, float (&s)[TQ][2]) {
    static_assert(ROW_BLOCKS % 2 == 0, "blocks in pairs");
    const int quad = threadIdx.x & 3;
    #pragma unroll
    for (int pair = 0; pair < ROW_BLOCKS / 2; ++pair) {
        const float4 w4 = *reinterpret_cast<const float4*>(w_s + 16 * pair + 4 * quad);
        #pragma unroll
        for (int b = 0; b < 2; ++b) {
            const int j = 2 * pair + b, qi = j / QUERY_BLOCKS;  // block j of query qi
            const float w0 = b ? w4.z : w4.x, w1 = b ? w4.w : w4.y;
            s[qi][0] = fmaf(w0, fmaxf(acc[4 * j + 0], 0.f), s[qi][0]);
            s[qi][0] = fmaf(w1, fmaxf(acc[4 * j + 1], 0.f), s[qi][0]);
            s[qi][1] = fmaf(w0, fmaxf(acc[4 * j + 2], 0.f), s[qi][1]);
            s[qi][1] = fmaf(w1, fmaxf(acc[4 * j + 3], 0.f), s[qi][1]);
        }
    }
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

// Wait for the tile issue_tile started and leave this lane's scores in
// owned (quad_sums), with one NaN (0x7FFFFFFF) and no -0.0 (a sum that
// underflowed from below reads +0.0). The accumulator is free on return.
__device__ __forceinline__ void tile_scores(float (&acc)[QROWS / 2], const float* w_s, float (&owned)[OWNED][2]) {
    float part[TQ][2];
    #pragma unroll
    for (int qi = 0; qi < TQ; ++qi) part[qi][0] = part[qi][1] = 0.f;
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    head_sums(acc, w_s, part);
    quad_sums(part, owned);
    #pragma unroll
    for (int m = 0; m < OWNED; ++m)
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const float v = owned[m][rr] + 0.f;  // -0.0 + +0.0 is +0.0; every other value stays
            owned[m][rr] = v != v ? __int_as_float(0x7FFFFFFF) : v;
        }
}

// Candidate buffers: (bits, index) pairs, [2][TQ][cap] per CTA; at() counts
// pairs from the start of the grid's buffer (below 2^32: the host checks).
struct Buffers {
    uint2* pairs;
    int cap;
    u32 cta_base;  // this CTA's first pair
    __device__ __forceinline__ u32 at(u32 flip, int qi) const { return cta_base + (flip * TQ + qi) * (u32)cap; }
};

// A query's candidates as a prune visits them in its buffer (global memory):
// keys(f) calls f(key, valid) and pairs(f) calls f(key, index, valid) for
// every candidate of the calling thread, making the same calls in every lane
// of a warp (f may be warp-collective). Every visit reads the buffer again,
// PRUNE_U candidates per thread per round so that several loads are in
// flight.
constexpr int PRUNE_U = 4;
struct StoredCandidates {
    const uint2* c;
    u32 n;
    template <typename F>
    __device__ void keys(F&& f) const {
        for (u32 base = 0; base < n; base += PRUNE_U * THREADS) {
            u32 b[PRUNE_U];
            #pragma unroll
            for (int u = 0; u < PRUNE_U; ++u) b[u] = c[min(base + u * THREADS + threadIdx.x, n - 1)].x;
            #pragma unroll
            for (int u = 0; u < PRUNE_U; ++u) f(score_key(b[u]), base + u * THREADS + threadIdx.x < n);
        }
    }
    template <typename F>
    __device__ void pairs(F&& f) const {
        for (u32 base = 0; base < n; base += PRUNE_U * THREADS) {
            u32 b[PRUNE_U], x[PRUNE_U];
            #pragma unroll
            for (int u = 0; u < PRUNE_U; ++u) {
                const uint2 v = c[min(base + u * THREADS + threadIdx.x, n - 1)];  // past the end: a repeat load
                b[u] = v.x;
                x[u] = v.y;
            }
            #pragma unroll
            for (int u = 0; u < PRUNE_U; ++u) f(score_key(b[u]), x[u], base + u * THREADS + threadIdx.x < n);
        }
    }
};

// The visits block_kth_largest_of makes: every candidate's key; the
// complemented index of every candidate whose key equals `thr`.
template <typename C>
struct CandidateKeys {
    const C& c;
    template <typename F>
    __device__ void operator()(F&& f) const { c.keys(f); }
};
struct TiedIndices {
    const StoredCandidates& c;
    u32 thr;
    template <typename F>
    __device__ void operator()(F&& f) const {
        c.pairs([&](u32 key, u32 index, bool valid) { f(~index, valid && key == thr); });
    }
};

// The largest index kept among the candidates whose key is the k-th's
// (`thr`): of `ties` such candidates, `need` are kept, the lowest indices.
__device__ u32 max_kept_tie(GroupShared& sh, const StoredCandidates& c, u32 thr, u32 need, u32 ties) {
    if (ties <= need) return 0xFFFFFFFFu;
    u32 unused;
    return ~block_kth_largest_of<u32, 32>(TiedIndices{c, thr}, need, sh.hist, sh.scratch, sh.found, &unused);
}

// The last step of every prune: query qi holds `kept` candidates (its top
// k, or a superset of them) in the other half of its buffer, all with keys
// above threshold key `thr`.
__device__ void prune_done(GroupShared& sh, int qi, u32 kept, u32 thr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        sh.count[qi] = kept;
        sh.thr[qi] = thr;
        sh.flip[qi] ^= 1;
    }
    __syncthreads();
}

// Cut query qi's n > k candidates `c` back to its top k (score key, then
// lower index) into dst, reading the buffer on every pass.
__device__ void prune_stored(GroupShared& sh, const StoredCandidates& c, uint2* dst, int qi, u32 k) {
    u32 above, ties;
    const u32 thr = block_kth_largest_of<u32, 32>(CandidateKeys<StoredCandidates>{c}, k, sh.hist, sh.scratch,
                                                  sh.found, &above, &ties);
    const u32 max_tie_idx = max_kept_tie(sh, c, thr, k - above, ties);
    if (threadIdx.x == 0) sh.next_slot = 0;
    __syncthreads();
    c.pairs([&](u32 key, u32 index, bool valid) {
        const bool keep = valid && (key > thr || (key == thr && index <= max_tie_idx));
        const u32 slot = warp_append(&sh.next_slot, keep);
        if (keep) dst[slot] = make_uint2(key_to_bits(key), index);
    });
    prune_done(sh, qi, k, thr);
}

// The same cut for a buffer of at most HELD * THREADS candidates (k up to
// 2528 at the default buffer of 2k + 64), loaded into registers once, all
// loads in flight together: thread t holds candidates u * THREADS + t. The
// passes skip the high bits every key shares (block minimum and maximum),
// so the first one spreads over the bins. Kept small: a prune's code evicts
// the tile loop of both CTAs on the SM from the instruction cache.
constexpr int HELD = 40;
struct HeldCandidates {
    u32 key[HELD], idx[HELD];
    u32 n;
    __device__ HeldCandidates(const uint2* c, u32 count) : n(count) {
        #pragma unroll
        for (int u = 0; u < HELD; ++u) {
            const u32 i = u * THREADS + threadIdx.x;
            const uint2 v = i < n ? c[i] : make_uint2(0u, 0u);
            key[u] = i < n ? score_key(v.x) : 0u;
            idx[u] = v.y;
        }
    }
    __device__ bool holds(int u) const { return u * THREADS + threadIdx.x < n; }
    __device__ bool round_empty(int u) const { return u * THREADS >= n; }  // the same in every thread
    template <typename F>
    __device__ void keys(F&& f) const {
        #pragma unroll
        for (int u = 0; u < HELD && !round_empty(u); ++u) f(key[u], holds(u));
    }
};

// Cut the held candidates to the top k; with most > k, to the candidates from
// the lowest key of a radix bucket up, where a pass of the select finds a
// bucket that leaves at most `most` (a superset of the top k, for a settle:
// the selection's last prune is exact).
__device__ void prune_held(GroupShared& sh, const StoredCandidates& stored, uint2* dst, int qi, u32 k, u32 most) {
    const HeldCandidates c(stored.c, stored.n);
    u32 lo = 0xFFFFFFFFu, hi = 0;
    #pragma unroll
    for (int u = 0; u < HELD && !c.round_empty(u); ++u)
        if (c.holds(u)) {
            lo = min(lo, c.key[u]);
            hi = max(hi, c.key[u]);
        }
    block_min_max(lo, hi, sh.hist, &lo, &hi);  // hist is free between passes
    const int known = min(lo == hi ? 32 : __clz(lo ^ hi), 32 - DIGIT_BITS);
    u32 above, ties;
    int open_bits;
    const u32 thr = block_kth_largest_of<u32, 32, false>(CandidateKeys<HeldCandidates>{c}, k, sh.hist, sh.scratch,
                                                         sh.found, &above, &ties, known,
                                                         known == 0 ? 0u : hi >> (32 - known), most > k ? most : 0,
                                                         &open_bits);
    // A bucket cut keeps every key from the bucket's lowest (thr) up.
    const u32 max_tie_idx = open_bits > 0 ? 0xFFFFFFFFu : max_kept_tie(sh, stored, thr, k - above, ties);
    u32 kept = 0;
    #pragma unroll
    for (int u = 0; u < HELD && !c.round_empty(u); ++u)
        kept += c.holds(u) && (c.key[u] > thr || (c.key[u] == thr && c.idx[u] <= max_tie_idx));
    u32 total;
    u32 slot = block_exclusive_sum(kept, sh.scratch, &total);
    #pragma unroll
    for (int u = 0; u < HELD && !c.round_empty(u); ++u)
        if (c.holds(u) && (c.key[u] > thr || (c.key[u] == thr && c.idx[u] <= max_tie_idx))) {
            dst[slot++] = make_uint2(key_to_bits(c.key[u]), c.idx[u]);
        }
    // A bucket cut leaves fewer than all candidates, so thr > 0 and appends need a key > thr - 1; the
    // threshold never falls (every candidate is above the old one).
    if (open_bits > 0)
        prune_done(sh, qi, total, max(sh.thr[qi], thr - 1));
    else
        prune_done(sh, qi, k, thr);
}

// Cut query qi's candidates back to its top k, or (most > k) to a superset of
// at most `most` of them where prune_held finds one early. Not inlined: ptxas
// takes far longer on the kernel with a prune inlined at both callers.
__device__ __noinline__ void prune(GroupShared& sh, const Buffers& buf, int qi, u32 k, u32 most) {
    const StoredCandidates c{buf.pairs + buf.at(sh.flip[qi], qi), sh.count[qi]};
    uint2* dst = buf.pairs + buf.at(sh.flip[qi] ^ 1, qi);
    if (c.n <= HELD * THREADS)
        prune_held(sh, c, dst, qi, k, most);
    else
        prune_stored(sh, c, dst, qi, k);
}

// Sort query qi's kept candidates (at most k) and write its output row.
__device__ void write_selection(GroupShared& sh, const Buffers& buf, int qi, u32 k, unsigned char* sort_area,
                                int* out_idx, float* out_scores) {
    if (sh.count[qi] > k) prune(sh, buf, qi, k, k);
    const u32 n = sh.count[qi];
    const uint2* c = buf.pairs + buf.at(sh.flip[qi], qi);
    u32* keys = reinterpret_cast<u32*>(sort_area);
    u32* order = keys + SORT_CAP;
    int n_pad = 1;
    while (n_pad < (int)n) n_pad <<= 1;
    for (int j = threadIdx.x; j < n_pad; j += THREADS) {
        const uint2 v = j < (int)n ? c[j] : make_uint2(0u, 0xFFFFFFFFu);
        keys[j] = j < (int)n ? score_key(v.x) : 0u;
        order[j] = v.y;
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
    float acc[QROWS / 2];
    #pragma unroll
    for (int i = 0; i < QROWS / 2; ++i) acc[i] = 0.f;
    // Every issue_tile reaches tile_scores' waits on every path through the
    // loop's back edge, with no exit in between: ptxas serialises every wgmma
    // of the kernel (C7514, C7518) when it cannot see that.
    if (n_tiles > 0) {
        cp_async_wait<STAGES - 1>();  // the query tile and key tile 0
        fence_proxy_async();
        __syncthreads();
        issue_tile(acc, k_tiles, q_tile);
        int flag = 0;
        for (int j = 0;; ++j) {
            float owned[OWNED][2];
            tile_scores(acc, w_s, owned);
            cp_async_wait<STAGES - 2>();  // key tile j + 1, where there is one
            fence_proxy_async();
            // Every warp is past tile j's group and consume(j - 1); the
            // barrier ORs consume(j - 1)'s flags.
            if (__syncthreads_or(flag)) settle(begin + j * KT);
            if (j + 1 == n_tiles) {  // the last tile: nothing left to overlap
                consume(begin + j * KT, owned);
                break;
            }
            issue_tile(acc, k_tiles + ((j + 1) % STAGES) * K_BYTES, q_tile);
            if (j + STAGES < n_tiles) load_key_tile(k_tiles, p, begin, j + STAGES);  // into tile j's stage
            else cp_async_commit();
            flag = consume(begin + j * KT, owned);  // overlaps tile j + 1's products
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

// The threshold guess (see the head of the file).
struct Guess {
    float beta;  // 0: never guess
    u32 min_kept;
    int* failed_count;
    int* failed_rows;
};

// The key below which a query with visible keys [lo, hi) has seen enough for
// a guess to keep min_kept candidates, or NO_GUESS where a guess there would
// keep k or more.
constexpr int NO_GUESS = 0x7FFFFFFF;
__device__ int guess_point(int lo, int hi, u32 k, const Guess& guess) {
    if (guess.beta <= 0.f || guess.min_kept >= k) return NO_GUESS;
    const float visible = (float)(hi - lo);
    const float seen = ceilf((float)guess.min_kept * visible / (guess.beta * (float)k));
    return seen < visible / guess.beta ? lo + (int)seen : NO_GUESS;
}

// How many candidates query qi keeps under a guess made once the keys below
// seen_end are consumed: ceil(beta * k * f), at least min_kept.
__device__ u32 guess_keep(const GroupShared& sh, int qi, int seen_end, u32 k, const Guess& guess) {
    const int lo = sh.lo[qi], hi = sh.hi[qi];
    const float seen = (float)(min(seen_end, hi) - lo), visible = (float)(hi - lo);
    return max(guess.min_kept, (u32)ceilf(guess.beta * (float)k * (seen / visible)));
}

__device__ void topk_cta(const Problem& p, int topk, int* work_counter, Buffers buf, Guess guess, int* out_idx,
                         float* out_scores) {
    __shared__ GroupShared sh;
    unsigned char* smem = aligned_dynamic_smem();
    unsigned char* q_tile = smem;
    unsigned char* k_tiles = smem + Q_BYTES;
    float* w_s = reinterpret_cast<float*>(smem + Q_BYTES + STAGES * K_BYTES);
    buf.cta_base = blockIdx.x * 2 * TQ * (u32)buf.cap;
    const u32 k = (u32)topk;
    while (next_group(sh, p, work_counter, q_tile, w_s)) {
        const int t0 = sh.group * TQ;
        const OwnedRanges range(sh);
        // The owned queries' append state in registers; only a settle changes
        // it, and reads it again at its end.
        int guess_at[OWNED];  // a guess is due from this key on; NO_GUESS once made or given up
        u32 thr_of[OWNED];    // the threshold key
        u32 half_at[OWNED];   // buf.at() of the buffer half taking appends
        #pragma unroll
        for (int m = 0; m < OWNED; ++m) guess_at[m] = guess_point(range.lo[m], range.hi[m], k, guess);
        auto read_state = [&]() {
            #pragma unroll
            for (int m = 0; m < OWNED; ++m) {
                const int qi = min(4 * m + (int)(threadIdx.x & 3), TQ - 1);  // past TQ: never appends
                thr_of[m] = sh.thr[qi];
                half_at[m] = buf.at(sh.flip[qi], qi);
                if (sh.guess[qi] != GUESS_OPEN) guess_at[m] = NO_GUESS;
            }
        };
        read_state();
        // Appends: a score enters when its key beats the threshold; the flag
        // says a buffer could not take another tile (count + KT > cap) or a
        // guess is due, and settle prunes before the next tile's appends.
        auto append = [&](int s0, const float (&owned)[OWNED][2]) {
            int full = 0;
            #pragma unroll
            for (int m = 0; m < OWNED; ++m) {
                const int qi = 4 * m + (int)(threadIdx.x & 3);
                if (qi >= TQ) continue;
                full |= s0 + KT >= guess_at[m];
                bool take[2];
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr)
                    take[rr] = range.visible(m, s0 + key_row(rr)) &&
                               summed_score_key(__float_as_uint(owned[m][rr])) > thr_of[m];
                if (take[0] || take[1]) {  // both rows' appends in one place: one atomic, one branch
                    u32 slot = atomicAdd(&sh.count[qi], (u32)take[0] + (u32)take[1]);
                    #pragma unroll
                    for (int rr = 0; rr < 2; ++rr)
                        if (take[rr])
                            buf.pairs[half_at[m] + slot++] = make_uint2(__float_as_uint(owned[m][rr]),
                                                                         (u32)(s0 + key_row(rr)));
                    full |= slot + KT > (u32)buf.cap;  // slot: this query's count after them
                }
            }
            return full;
        };
        // A settle may keep up to half the free room beyond k (a bucket cut),
        // or under a guess up to half as many again as the guess keeps.
        const u32 most = k + ((u32)buf.cap - KT - k) / 2;
        auto settle = [&](int seen_end) {
            for (int qi = 0; qi < TQ; ++qi) {
                const bool due = sh.guess[qi] == GUESS_OPEN && seen_end >= guess_point(sh.lo[qi], sh.hi[qi], k, guess);
                const u32 r = due ? guess_keep(sh, qi, seen_end, k, guess) : k;
                const bool guess_now = due && r < k && r < sh.count[qi];  // else the guess keeps them all
                if (guess_now) prune(sh, buf, qi, r, r + r / 2);
                else if (sh.count[qi] + KT > (u32)buf.cap) prune(sh, buf, qi, k, most);
                if (due) {
                    __syncthreads();  // every thread has read the state
                    if (threadIdx.x == 0) sh.guess[qi] = guess_now ? GUESS_MADE : GUESS_NONE;
                }
            }
            __syncthreads();  // every thread has read the counts before the next appends
            read_state();
        };
        stream_group(sh, p, q_tile, k_tiles, w_s, append, settle);
        for (int qi = 0; qi < TQ && t0 + qi < p.n_q; ++qi) {
            // Fewer than k candidates after a guess: the threshold was too high.
            if (threadIdx.x == 0 && sh.guess[qi] == GUESS_MADE && sh.count[qi] < k)
                guess.failed_rows[atomicAdd(guess.failed_count, 1)] = t0 + qi;
            write_selection(sh, buf, qi, k, k_tiles, out_idx + (size_t)(t0 + qi) * topk,
                            out_scores ? out_scores + (size_t)(t0 + qi) * topk : nullptr);
        }
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
        const OwnedRanges range(sh);
        auto store = [&](int s0, const float (&owned)[OWNED][2]) {
            #pragma unroll
            for (int m = 0; m < OWNED; ++m) {
                const int qi = 4 * m + (int)(threadIdx.x & 3);
                if (qi >= TQ || t0 + qi >= p.n_q) continue;
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int s = s0 + key_row(rr);
                    if (s < p.n_k)
                        table[(size_t)(t0 + qi) * p.n_k + s] =
                            range.visible(m, s) ? owned[m][rr] : __uint_as_float(NEG_INF_BITS);
                }
            }
            return 0;
        };
        stream_group(sh, p, q_tile, k_tiles, w_s, store, [](int) {});
    }
}

}  // namespace

// Both entry points take 1024 + Q_BYTES + STAGES * K_BYTES + TQ * H * 4 bytes
// of dynamic shared memory (ops/indexer/gpu.py computes the same).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
indexer_topk_kernel(const u16* q, const u16* k, const float* w, const int* lo, const int* hi, int n_q, int n_k,
                    int topk, int* work_counter, uint2* buf_pairs, int cap, float guess_beta,
                    int guess_min, int* failed_count, int* failed_rows, int* out_idx, float* out_scores) {
    const Problem p{q, k, w, lo, hi, n_q, n_k};
    topk_cta(p, topk, work_counter, Buffers{buf_pairs, cap, 0u},
             Guess{guess_beta, (u32)max(guess_min, 1), failed_count, failed_rows}, out_idx, out_scores);
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
indexer_scores_kernel(const u16* q, const u16* k, const float* w, const int* lo, const int* hi, int n_q, int n_k,
                      int* work_counter, float* table) {
    const Problem p{q, k, w, lo, hi, n_q, n_k};
    scores_cta(p, work_counter, table);
}
