// The fused indexer's candidate buffers (cuda/indexer.cu): the prunes that
// cut a query's candidates back to its top k, and the final sort and write
// of its selection.
#pragma once

#include "indexer_config.cuh"

namespace {

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
// 2528 at the default buffer of 2k + 64), loaded into registers once:
// thread t holds candidates u * THREADS + t. Every load is issued before
// any key is formed, so all are in flight together (a load followed by its
// key at each step made ptxas wait for each load in turn: 16k cycles a
// prune). The passes skip the high bits every key shares (block minimum
// and maximum), so the first one spreads over the bins. Kept small: a
// prune's code evicts the tile loop of both CTAs on the SM from the
// instruction cache.
constexpr int HELD = 40;
struct HeldCandidates {
    u32 key[HELD], idx[HELD];
    u32 n;
    __device__ HeldCandidates(const uint2* c, u32 count) : n(count) {
        const u32 last = max(n, 1u) - 1u;  // past the end: a repeat load of the last pair (or of slot 0)
        uint2 v[HELD];
        #pragma unroll
        for (int u = 0; u < HELD; ++u) v[u] = c[min(u * THREADS + threadIdx.x, last)];
        #pragma unroll
        for (int u = 0; u < HELD; ++u) {
            key[u] = holds(u) ? score_key(v[u].x) : 0u;
            idx[u] = v[u].y;
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
// at most `most` of them where prune_held finds one early. The kept go to
// the other half of the query's buffer; where `stage` is given and the
// candidates are held in registers, to stage instead (then it returns true,
// and the query's count and threshold are set all the same). Not inlined:
// ptxas takes far longer on the kernel with a prune inlined at both callers.
__device__ __noinline__ bool prune(GroupShared& sh, const Buffers& buf, int qi, u32 k, u32 most,
                                   uint2* stage = nullptr) {
    const StoredCandidates c{buf.pairs + buf.at(sh.flip[qi], qi), sh.count[qi]};
    uint2* dst = buf.pairs + buf.at(sh.flip[qi] ^ 1, qi);
    if (c.n <= HELD * THREADS) {
        prune_held(sh, c, stage != nullptr ? stage : dst, qi, k, most);
        return stage != nullptr;
    }
    prune_stored(sh, c, dst, qi, k);
    return false;
}

// The final sort's arrays in the query tile and key stages, free once the
// stream is done (`area`, their start): two (score key, index) array pairs
// of SORT_CAP picks and their ranks. The second pair's room doubles as the
// stage of the final prune's (bits, index) pairs, read before it is sorted into.
struct SortArea {
    u32* words;
    __device__ u32* key(int pair) const { return words + 2 * SORT_CAP * pair; }
    __device__ u32* idx(int pair) const { return words + 2 * SORT_CAP * pair + SORT_CAP; }
    __device__ u32* ranks() const { return words + 4 * SORT_CAP; }
    __device__ uint2* stage() const { return reinterpret_cast<uint2*>(key(1)); }
};

// The spread of the picks' keys and indices (block-wide).
struct PickRange {
    u32 key_lo = 0xFFFFFFFFu, key_hi = 0, idx_lo = 0xFFFFFFFFu, idx_hi = 0;
};

// Load the n pairs `c` into a.key(0) / a.idx(0) and pad them to n_pad, a
// multiple of THREADS, with picks that sort last: the lowest key and an
// index whose sort digits (those of ~(index - idx_lo)) are all zero. The
// pairs come from global memory or the stage, PRUNE_U per thread per round,
// all loads of a round in flight together.
__device__ PickRange load_picks(GroupShared& sh, const SortArea& a, const uint2* c, u32 n, u32 n_pad) {
    PickRange r;
    #pragma unroll 1
    for (u32 base = 0; base < n; base += PRUNE_U * THREADS) {
        uint2 v[PRUNE_U];
        #pragma unroll
        for (int u = 0; u < PRUNE_U; ++u) v[u] = c[min(base + u * THREADS + threadIdx.x, n - 1)];
        #pragma unroll
        for (int u = 0; u < PRUNE_U; ++u) {
            const u32 j = base + u * THREADS + threadIdx.x;
            if (j >= n) break;
            const u32 key = score_key(v[u].x);
            a.key(0)[j] = key;
            a.idx(0)[j] = v[u].y;
            r.key_lo = min(r.key_lo, key);
            r.key_hi = max(r.key_hi, key);
            r.idx_lo = min(r.idx_lo, v[u].y);
            r.idx_hi = max(r.idx_hi, v[u].y);
        }
    }
    block_min_max(r.key_lo, r.key_hi, sh.hist, &r.key_lo, &r.key_hi);
    block_min_max(r.idx_lo, r.idx_hi, sh.hist, &r.idx_lo, &r.idx_hi);
    #pragma unroll 1
    for (u32 j = n + threadIdx.x; j < n_pad; j += THREADS) {
        a.key(0)[j] = r.key_lo;
        a.idx(0)[j] = r.idx_lo - 1u;
    }
    __syncthreads();
    return r;
}

// After the sort by keys: the first n picks' indices with each run of equal
// keys in ascending index order, written to a.idx(at ^ 1). Every position
// finds its run [s, e) and its index's rank r among the run's, and puts its
// index at s + r (indices are distinct, so the ranks are a permutation of
// the run), so a run's cost falls on its own positions' threads. Returns
// false where some run is longer than TIE_RUN_MAX (the caller sorts again
// by index and key). All threads call this.
constexpr u32 TIE_RUN_MAX = 32;
__device__ bool order_tie_runs(const SortArea& a, int at, u32 n) {
    const u32* key = a.key(at);
    const u32* idx = a.idx(at);
    u32* ordered = a.idx(at ^ 1);
    bool too_long = false;
    #pragma unroll 1
    for (u32 j = threadIdx.x; j < n; j += THREADS) {
        const u32 kj = key[j], ij = idx[j];
        u32 s = j;  // the run's start, looked for at most TIE_RUN_MAX back
        while (s > 0 && key[s - 1] == kj && j - s < TIE_RUN_MAX) --s;
        u32 rank = 0, e = s;  // a run past TIE_RUN_MAX takes e to s + TIE_RUN_MAX + 1
        for (; e < n && key[e] == kj && e - s <= TIE_RUN_MAX; ++e) rank += idx[e] < ij;
        if (e - s > TIE_RUN_MAX) too_long = true;
        else ordered[s + rank] = ij;
    }
    return !__syncthreads_or(too_long);
}

// Where the sorted picks lie: keys and indices, n of each, key descending
// then index ascending.
struct SortedPicks {
    const u32* key;
    const u32* idx;
};

// Sort the n loaded picks, key descending then index ascending. Keys alone
// first, then the runs of equal keys put in index order (order_tie_runs);
// only where a run is too long for that does it sort again by index and key
// (stable LSD passes, so the first order does not matter then). Both rounds
// go through one call site, so the sort is inlined once (two calls made the
// tail 1138 -> 1599 SASS instructions).
__device__ SortedPicks sort_picks(GroupShared& sh, const SortArea& a, const PickRange& r, u32 n, u32 n_pad) {
    Probe probe(sh);
    int at = 0;
    #pragma unroll 1
    for (int by_index = 0; by_index < 2 && n > 1; ++by_index) {
        probe.count(N_SORT_ROUNDS, 1);
        probe.count(N_SORT_PASSES, (by_index ? bytes_of(r.idx_hi - r.idx_lo) : 0) + bytes_of(r.key_hi - r.key_lo));
        at ^= block_radix_sort_desc_looped<THREADS / 32>(a.key(at), a.idx(at), a.key(at ^ 1), a.idx(at ^ 1), a.ranks(),
                                                          (int)n_pad, by_index ? bytes_of(r.idx_hi - r.idx_lo) : 0,
                                                          bytes_of(r.key_hi - r.key_lo), r.key_lo, r.idx_lo,
                                                          reinterpret_cast<u16*>(sh.hist), sh.scratch);
        if (!by_index && order_tie_runs(a, at, n)) return SortedPicks{a.key(at), a.idx(at ^ 1)};
    }
    return SortedPicks{a.key(at), a.idx(at)};
}

// Cut query qi's candidates to a superset of its top k, sort them and write
// the first k as its output row. The cut may stop at a radix bucket that
// leaves at most FINAL_SLACK picks past k (the sort orders them with the
// rest, so the first k are the top k in order), and a query with no more
// candidates than that sorts them all, uncut.
constexpr u32 FINAL_SLACK = 64;
__device__ void write_selection(GroupShared& sh, const Buffers& buf, int qi, u32 k, const SortArea& area,
                                int* out_idx, float* out_scores) {
    Probe probe(sh);
    const u32 most = min(k + FINAL_SLACK, (u32)SORT_CAP);  // k <= SORT_CAP; the stage holds SORT_CAP pairs
    if (sh.count[qi] > most) {
        probe.count(N_FINAL_PRUNES, 1);
        probe.count(N_FINAL_CANDIDATES, sh.count[qi]);
    }
    const bool staged = sh.count[qi] > most && prune(sh, buf, qi, k, most, area.stage());
    probe.mark(P_FINAL_PRUNE);
    const u32 n = sh.count[qi];
    const u32 n_pad = max((n + THREADS - 1) / THREADS, 1u) * THREADS;
    const PickRange range = load_picks(sh, area, staged ? area.stage() : buf.pairs + buf.at(sh.flip[qi], qi), n, n_pad);
    probe.mark(P_FINAL_LOAD);
    const SortedPicks sorted = sort_picks(sh, area, range, n, n_pad);
    probe.mark(P_FINAL_SORT);
    #pragma unroll 4
    for (u32 j = threadIdx.x; j < k; j += THREADS) {
        out_idx[j] = j < n ? (int)sorted.idx[j] : -1;
        if (out_scores) out_scores[j] = __uint_as_float(j < n ? key_to_bits(sorted.key[j]) : NEG_INF_BITS);
    }
    __syncthreads();
    probe.mark(P_FINAL_WRITE);
}

}  // namespace
