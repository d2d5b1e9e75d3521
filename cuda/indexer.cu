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
// Schedule: a tile's products are two wgmma groups of m64n128k16, the low and
// high halves of the accumulator's columns (whole queries each at H <= 128).
// Once tile j's high half is summed and the tile's barrier passed, tile j +
// 1's two groups are issued and tile j + 2's load goes into tile j's stage;
// then come tile j's quad sums, tile j + 1's low-half head sums (under its
// high half's products) and tile j's consume (selection or table write). So
// only the high half's sums run with none of this CTA's products in flight,
// and the other CTA on the SM keeps the tensor cores busy then. (One
// m64n256k16 group summed whole after its wait reads the key tile once per
// k-step, and measured 3 % slower on the top-k at H = 64, 5 % on the scores.)
// Contracts: consume reads neither the key stages nor the accumulators, and
// each lane gets the scores of the queries it owns (every fourth); one barrier
// per tile, after every warp has waited for tile j's groups, precedes the
// refill of tile j's stage and separates consecutive consumes. Each (key,
// query) score is summed in one fixed order (heads within a lane ascending,
// then quad_sums'), whatever the kernel, so the two kernels' scores agree
// bitwise.
//
// Selection (indexer_topk_*): a score enters the query's candidate buffer
// only if its key beats the running threshold; when the buffer could not
// take another tile (more than cap - KT entries) it is cut back to the top k
// (by key, then lower index) and the threshold rises to the k-th key. Tiles
// go in ascending key order, so a later key equal to the threshold ranks
// below every kept one: the strict test is exact. The end of the stream
// cuts to at most k + FINAL_SLACK (a radix bucket), sorts, and writes the
// first k. An append that fills a buffer raises a flag, the
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
//
// Pieces: indexer_config.cuh (shape, constants, shared state),
// indexer_tiles.cuh (the tile loop), indexer_candidates.cuh (prunes and the
// final sort); here the threshold guess, the two CTAs' work and the entry
// points.
#include "indexer_candidates.cuh"
#include "indexer_config.cuh"
#include "indexer_tiles.cuh"
#include "wgmma.cuh"

namespace {

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
    const SortArea sort_area{reinterpret_cast<u32*>(smem)};  // the query tile and key stages, after a stream
    const u32 probe_t0 = probe_begin(sh);
    Probe probe(sh);
    while (next_group(sh, p, work_counter, q_tile, w_s)) {
        probe.mark(P_NEXT_GROUP);
        probe.count(N_GROUPS, 1);
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
        probe.restart();
        for (int qi = 0; qi < TQ && t0 + qi < p.n_q; ++qi) {
            // Fewer than k candidates after a guess: the threshold was too high.
            if (threadIdx.x == 0 && sh.guess[qi] == GUESS_MADE && sh.count[qi] < k)
                guess.failed_rows[atomicAdd(guess.failed_count, 1)] = t0 + qi;
            write_selection(sh, buf, qi, k, sort_area, out_idx + (size_t)(t0 + qi) * topk,
                            out_scores ? out_scores + (size_t)(t0 + qi) * topk : nullptr);
        }
        probe.mark(P_FINAL);
    }
    probe_end(sh, probe_t0);
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
