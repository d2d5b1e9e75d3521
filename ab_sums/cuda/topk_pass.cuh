// The read pass of cuda/topk.cu: one warp over one span of a row against a
// threshold T, in 16-byte vectors. Keys above T are appended to a buffer
// (one atomic per warp), keys equal to T counted. Functions named pass_* and
// append_* must be called by all 32 lanes of a warp.
#pragma once

#include "select.cuh"

namespace hs {

constexpr int UNROLL = 4;  // 16-byte vectors per lane per step

// Where a row's elements lie: `head` scalars up to the first 16-byte
// boundary, `nv` whole vectors, `tail` scalars. Span s (of `spans`) holds
// vectors [s * sv, (s + 1) * sv), plus the head (s = 0) and the tail (last s),
// so spans in order cover the row in index order.
struct Layout {
    u32 head, nv, tail, sv, spans;
};

template <class D>
__device__ Layout make_layout(const typename D::Bits* row, u32 n, u32 spans) {
    Layout L;
    const u32 misaligned = (u32)((reinterpret_cast<size_t>(row) / sizeof(typename D::Bits)) % D::VEC);
    L.head = min(n, misaligned ? (u32)D::VEC - misaligned : 0u);
    L.nv = (n - L.head) / D::VEC;
    L.tail = n - L.head - L.nv * D::VEC;
    L.spans = spans;
    L.sv = (L.nv + spans - 1) / spans;
    return L;
}

// Element e of a 16-byte vector: raw bits, and (for keys up to 32 bits) the
// bits shifted to the top of a word, as KeyTraits::pre takes them.
template <class D>
__device__ __forceinline__ typename D::Bits lane_bits(const uint4& v, int e) {
    if constexpr (sizeof(typename D::Bits) == 2) {
        const u32 w = (e >> 1) == 0 ? v.x : (e >> 1) == 1 ? v.y : (e >> 1) == 2 ? v.z : v.w;
        return (u16)((e & 1) ? w >> 16 : w & 0xFFFFu);
    } else if constexpr (sizeof(typename D::Bits) == 4) {
        return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
    } else {
        return e == 0 ? (((u64)v.y << 32) | v.x) : (((u64)v.w << 32) | v.z);
    }
}

template <class D>
__device__ __forceinline__ u32 lane_top(const uint4& v, int e) {
    if constexpr (sizeof(typename D::Bits) == 2) {
        const u32 w = (e >> 1) == 0 ? v.x : (e >> 1) == 1 ? v.y : (e >> 1) == 2 ? v.z : v.w;
        return (e & 1) ? (w & 0xFFFF0000u) : (w << 16);
    } else {
        return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
    }
}

// What one pass compares against and where it appends.
template <class D>
struct Pass {
    typename D::K T;
    u32 pre_bound;  // KeyTraits::bound(T) - NNH
    typename D::K* key;
    u32* idx;
    u32 cap;
    u32* n_gt;
};

template <class D>
__device__ __forceinline__ Pass<D> make_pass(typename D::K T, typename D::K* key, u32* idx, u32 cap, u32* n_gt) {
    u32 pre_bound = 0;
    if constexpr (D::W <= 32) pre_bound = D::bound(T) - D::NNH;
    return Pass<D>{T, pre_bound, key, idx, cap, n_gt};
}

__device__ __forceinline__ u32 pick4(u32 q, u32 a, u32 b, u32 c, u32 d) {
    return (q & 2) ? ((q & 1) ? d : c) : ((q & 1) ? b : a);
}

// Element s (run-time) of x, through selects: indexing x would put it in
// local memory.
template <class D>
__device__ __forceinline__ typename D::Bits slot_bits(const uint4 (&x)[UNROLL], u32 s) {
    static_assert(UNROLL == 4, "pick4 selects among four vectors");
    const u32 q = s / D::VEC, e = s % D::VEC;
    const u32 vx = pick4(q, x[0].x, x[1].x, x[2].x, x[3].x), vy = pick4(q, x[0].y, x[1].y, x[2].y, x[3].y);
    const u32 vz = pick4(q, x[0].z, x[1].z, x[2].z, x[3].z), vw = pick4(q, x[0].w, x[1].w, x[2].w, x[3].w);
    if constexpr (sizeof(typename D::Bits) == 8) {
        return e == 0 ? (((u64)vy << 32) | vx) : (((u64)vw << 32) | vz);
    } else if constexpr (sizeof(typename D::Bits) == 4) {
        return pick4(e, vx, vy, vz, vw);
    } else {
        const u32 w = pick4(e >> 1, vx, vy, vz, vw);
        return (u16)((e & 1) ? w >> 16 : w & 0xFFFFu);
    }
}

// Dense steps (all-equal or sorted rows put most slots at or above T): every
// marked slot classified in place, one warp scan to append. All lanes call this.
template <class D>
__device__ __forceinline__ void append_dense(const uint4 (&x)[UNROLL], u32 maybe, u32 ibase, u32 ustride,
                                             const Pass<D>& p, u32& ties) {
    typedef typename D::K K;
    u32 above = 0;
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        #pragma unroll
        for (int e = 0; e < D::VEC; ++e) {
            if (maybe & (1u << (u * D::VEC + e))) {
                const K key = D::key(lane_bits<D>(x[u], e));
                if (key > p.T) above |= 1u << (u * D::VEC + e);
                else ties += key == p.T;
            }
        }
    }
    const u32 count = __popc(above);
    if (!__any_sync(FULL_MASK, count != 0)) return;
    const u32 inclusive = warp_inclusive_sum(count);
    u32 slot = 0;
    if (lane_id() == 31) slot = atomicAdd(p.n_gt, inclusive);
    slot = __shfl_sync(FULL_MASK, slot, 31) + inclusive - count;
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        #pragma unroll
        for (int e = 0; e < D::VEC; ++e) {
            if (above & (1u << (u * D::VEC + e))) {
                if (slot < p.cap) {
                    p.key[slot] = D::key(lane_bits<D>(x[u], e));
                    p.idx[slot] = ibase + u * ustride + e;
                }
                ++slot;
            }
        }
    }
}

// Sparse steps (random rows: a few marked slots per warp): one marked slot
// per lane per round, appended with one atomic per warp. All lanes call this.
template <class D>
__device__ __forceinline__ void append_sparse(const uint4 (&x)[UNROLL], u32 maybe, u32 ibase, u32 ustride,
                                              const Pass<D>& p, u32& ties) {
    typedef typename D::K K;
    while (__any_sync(FULL_MASK, maybe != 0)) {
        bool above = false;
        K key = 0;
        u32 index = 0;
        if (maybe) {
            const u32 s = __ffs(maybe) - 1;
            maybe &= maybe - 1;
            key = D::key(slot_bits<D>(x, s));
            index = ibase + (s / D::VEC) * ustride + s % D::VEC;
            above = key > p.T;
            ties += key == p.T;
        }
        const u32 slot = warp_append(p.n_gt, above);
        if (above && slot < p.cap) {
            p.key[slot] = key;
            p.idx[slot] = index;
        }
    }
}

// One step of a warp over its span: UNROLL vectors per lane (or, for the
// head and tail, one scalar in slot 0 of x[0]). `valid` has a bit per slot
// u * VEC + e; slot s holds element ibase + u * ustride + e. A cheap test
// marks the slots that may hold a key >= T; of those, keys above T are
// appended and keys equal to T counted in `ties`, by whichever of the two
// appends costs less for how many slots the busiest lane marked.
// All 32 lanes call this.
template <class D>
__device__ __forceinline__ void pass_step(const uint4 (&x)[UNROLL], u32 valid, u32 ibase, u32 ustride,
                                          const Pass<D>& p, u32& ties) {
    u32 maybe = 0;
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        #pragma unroll
        for (int e = 0; e < D::VEC; ++e) {
            bool hit;
            if constexpr (D::W <= 32) hit = D::pre(lane_top<D>(x[u], e)) - D::NNH >= p.pre_bound;
            else hit = D::key(lane_bits<D>(x[u], e)) >= p.T;
            maybe |= (u32)hit << (u * D::VEC + e);
        }
    }
    maybe &= valid;
    // A sparse round costs about 1/16 of classifying every slot in place
    // (f32: ~47 against ~430 instructions); break even near half the slots.
    if (__reduce_max_sync(FULL_MASK, __popc(maybe)) > (u32)(D::VEC * UNROLL / 2))
        append_dense<D>(x, maybe, ibase, ustride, p, ties);
    else
        append_sparse<D>(x, maybe, ibase, ustride, p, ties);
}

// Element i of a row as a vector of one element (slot 0, the rest zero), for
// the head and tail scalars of a row.
template <class D>
__device__ __forceinline__ uint4 scalar_vector(const typename D::Bits* row, u32 i) {
    const typename D::Bits b = row[i];
    uint4 x = {};
    x.x = (u32)b;
    if constexpr (sizeof(b) == 8) x.y = (u32)(b >> 32);
    return x;
}

// One scalar per lane (lanes < count): elements first + lane.
template <class D>
__device__ __forceinline__ void pass_scalars(const typename D::Bits* row, u32 first, u32 count, const Pass<D>& p,
                                             u32& ties) {
    uint4 x[UNROLL] = {};
    const bool mine = lane_id() < count;
    if (mine) x[0] = scalar_vector<D>(row, first + lane_id());
    pass_step<D>(x, mine ? 1u : 0u, first + lane_id(), 0, p, ties);
}

// Warp pass over span s; returns this lane's count of keys equal to T.
template <class D>
__device__ u32 pass_span(const typename D::Bits* row, const Layout& L, u32 s, const Pass<D>& p) {
    u32 ties = 0;
    if (s == 0 && L.head) pass_scalars<D>(row, 0, L.head, p, ties);
    const uint4* vec = reinterpret_cast<const uint4*>(row + L.head);
    const u32 v0 = min(s * L.sv, L.nv), v1 = min(v0 + L.sv, L.nv);
    constexpr u32 STEP = 32 * UNROLL;
    constexpr u32 ALL = D::VEC * UNROLL == 32 ? FULL_MASK : (1u << (D::VEC * UNROLL)) - 1;
    u32 v = v0;
    for (; v + STEP <= v1; v += STEP) {
        uint4 x[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) x[u] = __ldg(vec + v + lane_id() + 32 * u);
        pass_step<D>(x, ALL, L.head + (v + lane_id()) * D::VEC, 32 * D::VEC, p, ties);
    }
    if (v < v1) {
        uint4 x[UNROLL];
        u32 valid = 0;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 w = v + lane_id() + 32 * u;
            x[u] = w < v1 ? __ldg(vec + w) : uint4{};
            if (w < v1) valid |= ((1u << D::VEC) - 1) << (u * D::VEC);
        }
        pass_step<D>(x, valid, L.head + (v + lane_id()) * D::VEC, 32 * D::VEC, p, ties);
    }
    if (s == L.spans - 1 && L.tail) pass_scalars<D>(row, L.head + L.nv * D::VEC, L.tail, p, ties);
    return ties;
}

}  // namespace hs
