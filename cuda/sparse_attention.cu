// Sparse attention forward on tensor cores (layout: sparse_attention.cuh).
//
// sa_forward: two warpgroups per CTA take the key blocks of query t in
// pairs, block 2i in buffer 0 and block 2i + 1 in buffer 1. Each buffer is
// gathered in two halves (left: features 0..255, right: 256..575), each half
// by the warpgroup that reads it last, as soon as it has (cp.async, landing
// signalled on an mbarrier). Warpgroup w takes block 2i + w of pair i: its logits
// for all 64 heads (m64n64, K = 576), then the online softmax as a chain
// (warpgroup 0's row bases first, warpgroup 1 combines them with its own
// block's maxima, warpgroup 0 picks the pair's bases up; a base rises only by
// more than RAISE_SLACK, so o is seldom rescaled), then value columns 256w ..
// 256w + 255 of both blocks: p v of its own block with p from registers and
// of the other's block with p from the other's shared tile. The first pair's
// gathers go out before the CTA counts its blocks. While one
// warpgroup runs its softmax, the other's products keep the tensor cores
// busy. Online softmax in float32 with a base-2 exponent; p rounded to the
// 16-bit type as an operand. Trailing blocks without a valid slot are
// skipped; an odd block count leaves warpgroup 1 an empty last block.
#include "wgmma.cuh"
#include "sparse_attention.cuh"
#include "sync.cuh"

namespace {

// Two warpgroups and no gathering warps besides: each thread holds o, the
// logits and p's fragments (176 registers), and with a third warpgroup, or
// even one more warp, ptxas caps every thread at 168 registers.
constexpr int LEFT = 0, RIGHT = 1;       // buffer halves
constexpr float RAISE_SLACK = 8.f;       // log2 of the largest p before a row's base rises
constexpr int LEFT_STEPS = 256 / 16;     // k-steps of the logits in the left half
constexpr int ROPE_REGION = DV / 64;     // the region past the values: warpgroup 0's p tile once its logits are done
enum : int { BAR_MAX0 = 1, BAR_MAX1, BAR_P0, BAR_P1, BAR_L, BAR_OUT };  // named barriers of the two warpgroups
                                                                     // (BAR_OUT + w: warpgroup w alone)

struct PairShared {
    u64 ready[2][2];  // [buffer][half]: the half's rows have landed (128 arrivals: its gatherers)
    float m[BH];      // row bases: warpgroup 0's, then the pair's
    float l[2][BH];   // each warpgroup's row sums, at the end
    int last_slot;    // the last slot of query t holding a key, -1 for none
};

// The shared tiles of a CTA.
struct Tiles {
    unsigned char* q;
    unsigned char* buf[2];  // key blocks 2i and 2i + 1
    unsigned char* p[2];    // each warpgroup's p tile: buffer 0's rope region, then the tile past the buffers
};

// Logits of k-steps FIRST .. LAST-1 (16 features each) of a key block for
// all 64 heads; FRESH: the first step overwrites s. Issue only.
template <int FIRST, int LAST, bool FRESH>
__device__ __forceinline__ void issue_logits(float (&s)[32], const unsigned char* q_tile, const unsigned char* tile) {
    #pragma unroll
    for (int kk = FIRST; kk < LAST; ++kk)
        wgmma_m64n64k16<F16, 0, 0>(s, wgmma_desc_k(q_tile, kk, 64), wgmma_desc_k(tile, kk, 64),
                                   !FRESH || kk > FIRST);
}

// Logits to base-2 units (sl2 = scale * log2 e), -inf at skipped slots; mx: the rows' maxima over the block.
__device__ __forceinline__ void scale_logits(float (&s)[32], u32 valid, float sl2, float (&mx)[2]) {
    mx[0] = mx[1] = neg_inf();
    #pragma unroll
    for (int i = 0; i < 32; ++i) {
        s[i] = (valid >> (2 * (i >> 2) + (i & 1))) & 1 ? s[i] * sl2 : neg_inf();
        mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
    }
    mx[0] = quad_max(mx[0]);
    mx[1] = quad_max(mx[1]);
}

// o and l of each row times c[row]; nothing when every c of the warp is 1
// (the product would be exact).
__device__ __forceinline__ void rescale_rows(float (&o)[128], float (&l)[2], const float (&c)[2]) {
    if (!__any_sync(FULL_MASK, c[0] != 1.f || c[1] != 1.f)) return;
    l[0] *= c[0];
    l[1] *= c[1];
    #pragma unroll
    for (int i = 0; i < 128; ++i) o[i] *= c[(i >> 1) & 1];
}

// A row's base (the m the exponents are taken against) rises to a block's
// maximum only where that exceeds it by more than RAISE_SLACK (base 2), so
// p = exp2(logit - base) stays below 2^RAISE_SLACK and most blocks leave o
// as it is. A row without a key yet (base -inf) takes the maximum.
__device__ __forceinline__ float raised_base(float base, float block_max) {
    return block_max > base + RAISE_SLACK ? block_max : base;
}

// The base m of each row rises to mn: o and l rescaled, m = mn;
// base: the subtrahend of the exponent (mn, or 0 for a row without a key yet).
__device__ __forceinline__ void raise_base(float (&o)[128], float (&l)[2], float (&m)[2], const float (&mn)[2],
                                           float (&base)[2]) {
    float alpha[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        alpha[r] = mn[r] == neg_inf() ? 1.f : exp2f(m[r] - mn[r]);
        base[r] = mn[r] == neg_inf() ? 0.f : mn[r];
        m[r] = mn[r];
    }
    rescale_rows(o, l, alpha);
}

// p = exp2(s - base) in place; l += the thread's part of each row's sum.
__device__ __forceinline__ void exponentiate(float (&s)[32], const float (&base)[2], float (&l)[2]) {
    #pragma unroll
    for (int i = 0; i < 32; ++i) {
        s[i] = exp2f(s[i] - base[(i >> 1) & 1]);
        l[(i >> 1) & 1] += s[i];
    }
}

// p * c[row] rounded to 16 bits as wgmma A fragments: a[4kk .. 4kk+3] cover
// slots 16kk .. 16kk+15 (a[m] holds p[2m], p[2m+1]).
__device__ __forceinline__ void pack_fragment(u32 (&a)[16], const float (&p)[32], const float (&c)[2]) {
    #pragma unroll
    for (int m = 0; m < 16; ++m) a[m] = pack_half2<F16>(p[2 * m] * c[m & 1], p[2 * m + 1] * c[m & 1]);
}

// Keep the compiler from changing a's registers while a wgmma reads them.
__device__ __forceinline__ void hold_fragment(u32 (&a)[16]) {
    #pragma unroll
    for (int m = 0; m < 16; ++m) asm volatile("" : "+r"(a[m])::"memory");
}

// The fragments into a 64 x 64 swizzled tile: row = head, column = slot.
__device__ __forceinline__ void store_p_tile(unsigned char* tile, const u32 (&a)[16], const Lane& ln) {
    #pragma unroll
    for (int m = 0; m < 16; ++m)
        *reinterpret_cast<u32*>(tile + tile_offset(ln.row0 + 8 * (m & 1), 8 * (m >> 1) + ln.cq)) = a[m];
}

// o += p v over a block's 64 slots, value columns 256 half .. 256 half + 255; p from registers. Issue only.
__device__ __forceinline__ void issue_pv_own(float (&o)[128], const u32 (&a)[16], const unsigned char* tile,
                                             int half) {
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const u32 frag[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
        wgmma_m64n256k16_rs<F16, 1>(o, frag, wgmma_desc_mn(tile + half * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);
    }
}

// The same with p from a shared p tile. Issue only.
__device__ __forceinline__ void issue_pv_other(float (&o)[128], const unsigned char* p_tile,
                                               const unsigned char* tile, int half) {
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_m64n256k16<F16, 0, 1>(o, wgmma_desc_k(p_tile, kk, 64),
                                    wgmma_desc_mn(tile + half * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);
}

// Wait until a half of a buffer has landed; then the wgmma of the warpgroup may read it.
__device__ __forceinline__ void wait_half(PairShared& sh, int buf, int half, int parity) {
    mbarrier_wait(&sh.ready[buf][half], parity);
    fence_proxy_async();
    wgmma_fence();
}

// This warpgroup gathers regions R0 .. R1-1 of a block's kv rows (zeros
// where a key is < 0) into buffer `buf`; ready[buf][half] completes once they land.
// Plain copies. Under an L2 evict-last policy (cp_async16's policy overload,
// as the backward gathers) this kernel stopped with an illegal instruction:
// ptxas (13.0) gave the copies a descriptor register it had overwritten,
// beside the buffer address's uniform part. With that address made per
// thread the policy copies ran, 2-5 % slower (benchmarks/NOTES.md).
template <int R0, int R1>
__device__ __forceinline__ void gather_half(PairShared& sh, const Tiles& tl, int buf, int half, const u16* kv,
                                            const int (&keys)[4], const GatherLane& gl) {
    gather_regions<R0, R1>(tl.buf[buf], kv, keys, gl);
    cp_async_arrive(&sh.ready[buf][half]);
}

// Warpgroup 0's logits of block 2i (left half first: it is gathered first).
__device__ __forceinline__ void logits_first(float (&s)[32], const Tiles& tl, PairShared& sh, int parity) {
    wait_half(sh, 0, LEFT, parity);
    mma_begin(s);
    issue_logits<0, LEFT_STEPS, true>(s, tl.q, tl.buf[0]);
    wait_half(sh, 0, RIGHT, parity);
    issue_logits<LEFT_STEPS, D / 16, false>(s, tl.q, tl.buf[0]);
    wgmma_commit();
}

// Warpgroup 0 over `pairs` pairs of blocks; o, l, m as the end leaves them.
__device__ __forceinline__ void run_warpgroup0(float (&o)[128], float (&l)[2], float (&m)[2], const Tiles& tl,
                                               PairShared& sh, const u16* kv, const int* indices, int t, int k,
                                               int pairs, float sl2, const Lane& ln) {
    const GatherLane gl = gather_lane();
    float s[32];
    u32 a[16];
    int keys[2][4];  // the rows this thread gathers of the next pair's blocks
    u32 valid = valid_slots(indices, t, k, 0, ln);
    if (pairs > 0) {  // the first pair's gathers are in flight (stage_first_pair)
        logits_first(s, tl, sh, 0);
        wgmma_wait<0>();
        wgmma_fence_operands(s);
    }
    for (int i = 0; i < pairs; ++i) {
        const bool next = i + 1 < pairs;
        if (next) {
            block_keys(keys[0], indices, t, k, 2 * i + 2, gl);
            block_keys(keys[1], indices, t, k, 2 * i + 3, gl);
        }
        float mx[2], base[2];
        scale_logits(s, valid, sl2, mx);
        const float mn[2] = {raised_base(m[0], mx[0]), raised_base(m[1], mx[1])};
        raise_base(o, l, m, mn, base);
        exponentiate(s, base, l);
        const float one[2] = {1.f, 1.f};
        pack_fragment(a, s, one);
        if ((threadIdx.x & 3) == 0) {
            sh.m[ln.row0] = m[0];
            sh.m[ln.row0 + 8] = m[1];
        }
        bar_arrive(BAR_MAX0, THREADS);
        mma_begin(o);
        hold_fragment(a);
        issue_pv_own(o, a, tl.buf[0], 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        hold_fragment(a);
        if (next) gather_half<0, 4>(sh, tl, 0, LEFT, kv, keys[0], gl);  // block 2i is done with it
        // The pair's bases from warpgroup 1: p of block 2i and o rescaled to them.
        bar_sync(BAR_MAX1, THREADS);
        float c[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float pair_base = sh.m[ln.row0 + 8 * r];
            c[r] = pair_base == neg_inf() ? 1.f : exp2f(m[r] - pair_base);
            m[r] = pair_base;
        }
        pack_fragment(a, s, c);
        store_p_tile(tl.p[0], a, ln);
        fence_proxy_async();
        bar_arrive(BAR_P0, THREADS);
        rescale_rows(o, l, c);
        bar_sync(BAR_P1, THREADS);
        mma_begin(o);
        issue_pv_other(o, tl.p[1], tl.buf[1], 0);
        wgmma_commit();
        if (next) {
            valid = valid_slots(indices, t, k, 2 * i + 2, ln);
            wait_half(sh, 0, LEFT, (i + 1) & 1);
            mma_begin(s);
            issue_logits<0, LEFT_STEPS, true>(s, tl.q, tl.buf[0]);
            wgmma_commit();
            wgmma_wait<1>();
            gather_half<0, 4>(sh, tl, 1, LEFT, kv, keys[1], gl);  // block 2i + 1 is done with it
            wait_half(sh, 0, RIGHT, (i + 1) & 1);
            issue_logits<LEFT_STEPS, D / 16, false>(s, tl.q, tl.buf[0]);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands(s);
        } else {
            wgmma_wait<0>();
        }
        wgmma_fence_operands(o);
    }
}

// Warpgroup 1 over `pairs` pairs of blocks; o, l, m as the end leaves them.
__device__ __forceinline__ void run_warpgroup1(float (&o)[128], float (&l)[2], float (&m)[2], const Tiles& tl,
                                               PairShared& sh, const u16* kv, const int* indices, int t, int k,
                                               int pairs, float sl2, const Lane& ln) {
    const GatherLane gl = gather_lane();
    float s[32];
    u32 a[16];
    int keys[2][4];  // the rows this thread gathers of the next pair's blocks
    for (int i = 0; i < pairs; ++i) {
        const bool next = i + 1 < pairs;
        if (next) {
            block_keys(keys[0], indices, t, k, 2 * i + 2, gl);
            block_keys(keys[1], indices, t, k, 2 * i + 3, gl);
        }
        const u32 valid = valid_slots(indices, t, k, 2 * i + 1, ln);
        // Right half first: warpgroup 0 gathers the left half of buffer 1 last.
        wait_half(sh, 1, RIGHT, i & 1);
        mma_begin(s);
        issue_logits<LEFT_STEPS, D / 16, true>(s, tl.q, tl.buf[1]);
        wait_half(sh, 1, LEFT, i & 1);
        issue_logits<0, LEFT_STEPS, false>(s, tl.q, tl.buf[1]);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(s);
        float mx[2], base[2];
        scale_logits(s, valid, sl2, mx);
        bar_sync(BAR_MAX0, THREADS);
        const float mn[2] = {raised_base(sh.m[ln.row0], mx[0]), raised_base(sh.m[ln.row0 + 8], mx[1])};
        __syncwarp();  // every lane has read its rows' bases before they are overwritten
        if ((threadIdx.x & 3) == 0) {
            sh.m[ln.row0] = mn[0];
            sh.m[ln.row0 + 8] = mn[1];
        }
        bar_arrive(BAR_MAX1, THREADS);
        raise_base(o, l, m, mn, base);
        exponentiate(s, base, l);
        const float one[2] = {1.f, 1.f};
        pack_fragment(a, s, one);
        mma_begin(o);
        hold_fragment(a);
        issue_pv_own(o, a, tl.buf[1], 1);
        wgmma_commit();
        store_p_tile(tl.p[1], a, ln);
        bar_sync(BAR_P0, THREADS);
        issue_pv_other(o, tl.p[0], tl.buf[0], 1);
        wgmma_commit();
        fence_proxy_async();
        bar_arrive(BAR_P1, THREADS);
        wgmma_wait<1>();
        hold_fragment(a);
        if (next) gather_half<4, D / 64>(sh, tl, 1, RIGHT, kv, keys[1], gl);  // block 2i + 1 is done with it
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        if (next) gather_half<4, D / 64>(sh, tl, 0, RIGHT, kv, keys[0], gl);  // block 2i is done with it
    }
}

// The q tile's copies and the first pair's gathers (this warpgroup's halves
// of both buffers, buffer 0 first: warpgroup 0's first logits head the
// softmax chain), issued before the CTA's block count is known. The count's
// loads go out together with the first pair's keys, so the gathers wait for
// one round trip to memory, not two. Rows without a key gather zeros (the
// caller waits for them). Returns the last slot of this thread's (slot =
// thread + i THREADS) that holds a key, -1 for none.
constexpr int COUNT_LOADS = 8;  // index loads per thread before the gathers (k = 2048 in one round)
__device__ __forceinline__ int stage_first_pair(PairShared& sh, const Tiles& tl, const u16* q, const u16* kv,
                                                const int* indices, int t, int g, int h, int k, int w) {
    const GatherLane gl = gather_lane();
    const int* row = indices + (size_t)t * k;
    int keys[2][4], held[COUNT_LOADS];
    block_keys(keys[0], indices, t, k, 0, gl);
    block_keys(keys[1], indices, t, k, 1, gl);
    #pragma unroll
    for (int i = 0; i < COUNT_LOADS; ++i) {
        const int slot = threadIdx.x + i * THREADS;
        held[i] = slot < k ? row[slot] : -1;
    }
    stage_heads<D>(tl.q, q, t, g, h, l2_evict_first());  // read once: no room taken from the kv rows
    cp_async_commit();
    int last = -1;
    #pragma unroll
    for (int i = 0; i < COUNT_LOADS; ++i)
        if (held[i] >= 0) last = threadIdx.x + i * THREADS;
    if (w == 0) {
        gather_half<0, 4>(sh, tl, 0, LEFT, kv, keys[0], gl);
        gather_half<0, 4>(sh, tl, 1, LEFT, kv, keys[1], gl);
    } else {
        gather_half<4, D / 64>(sh, tl, 0, RIGHT, kv, keys[0], gl);
        gather_half<4, D / 64>(sh, tl, 1, RIGHT, kv, keys[1], gl);
    }
    for (int slot = threadIdx.x + COUNT_LOADS * THREADS; slot < k; slot += THREADS)
        if (row[slot] >= 0) last = slot;
    return last;
}

// Blocks of the query up to the last one holding a key, from each thread's
// last key slot (all threads call this).
__device__ __forceinline__ int blocks_with_keys(PairShared& sh, int last) {
    if (last >= 0) atomicMax(&sh.last_slot, last);
    __syncthreads();
    return (sh.last_slot + BK) / BK;
}

// out (this warpgroup's 256 value columns), lse and lse2 (nullable) of the
// CTA's heads from the warpgroups' o, l, m. out goes through shared memory
// (`stage`: the q tile, which no product reads once both warpgroups are past
// BAR_L): each thread puts its 16-bit pairs into a 64-row tile of 512-byte
// rows (16-byte chunks XOR-swizzled by row, so the puts are free of bank
// conflicts), then each warp writes whole rows with 16-byte stores. Stores of
// 4 bytes straight from the accumulator layout took about 5 us per item
// (benchmarks/NOTES.md, "The output through shared memory").
__device__ __forceinline__ void write_output(const float (&o)[128], float (&l)[2], const float (&m)[2],
                                             PairShared& sh, unsigned char* stage, u16* out, float* lse, float* lse2,
                                             int t, int g, int h, const Lane& ln) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = quad_sum(l[r]);
        if ((threadIdx.x & 3) == 0) sh.l[ln.w][ln.row0 + 8 * r] = l[r];
    }
    bar_sync(BAR_L, THREADS);
    unsigned char* tile = stage + ln.w * BH * 512;  // this warpgroup's columns: 64 rows of 256 x 16 bits
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = ln.row0 + 8 * r, head = g * BH + row;
        const float total = sh.l[0][row] + sh.l[1][row];
        const float inv = total > 0.f ? 1.f / total : 0.f;
        #pragma unroll
        for (int j = 0; j < 32; ++j)  // columns 8 j + cq, 8 j + cq + 1: chunk j of the row
            *reinterpret_cast<u32*>(tile + row * 512 + ((j ^ (row & 7)) << 4) + ln.cq * 2) =
                pack_half2<F16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        const float base2 = total > 0.f ? m[r] + log2f(total) : neg_inf();
        if (head < h && ln.w == 0 && (threadIdx.x & 3) == 0) {
            lse[(size_t)t * h + head] = base2 * LN2;
            if (lse2 != nullptr) lse2[(size_t)t * h + head] = base2;
        }
    }
    warpgroup_sync<BAR_OUT>(ln.w);
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    #pragma unroll 4
    for (int row = warp; row < BH && g * BH + row < h; row += 4) {  // lane: the row's 16-byte chunk
        const uint4 v = *reinterpret_cast<const uint4*>(tile + row * 512 + ((lane ^ (row & 7)) << 4));
        // streaming stores: out is not read again, the L2 keeps kv rows instead
        __stcs(reinterpret_cast<uint4*>(out + ((size_t)t * h + g * BH + row) * DV + ln.w * 256) + lane, v);
    }
}

}  // namespace

// Dynamic shared memory: 1024 + Q_BYTES + 2 * KV_BYTES + P_BYTES (ops/sparse_attention/gpu.py).
// Grid: N * groups CTAs (groups = ceil(h / 64)), CTA t * groups + g; THREADS threads.
// out [N, h, 512] (q's 16-bit type), lse [N, h] float32 (natural log; -inf
// for a head without a valid slot); lse2 (nullable) [N, h] float32: the
// same in base 2, exactly as the softmax used it (sa_forward_probs reads it).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_forward(const u16* q, const u16* kv, const int* indices, u16* out, float* lse, float* lse2, int h, int k,
           float scale) {
    __shared__ PairShared sh;
    Tiles tl;
    tl.q = aligned_dynamic_smem();
    tl.buf[0] = tl.q + Q_BYTES;
    tl.buf[1] = tl.buf[0] + KV_BYTES;
    tl.p[0] = tl.buf[0] + ROPE_REGION * REGION;
    tl.p[1] = tl.buf[1] + KV_BYTES;
    const int groups = (h + BH - 1) / BH, t = blockIdx.x / groups, g = blockIdx.x % groups;
    if (threadIdx.x == 0) {
        #pragma unroll
        for (int b = 0; b < 2; ++b)
            #pragma unroll
            for (int half = 0; half < 2; ++half) mbarrier_init(&sh.ready[b][half], 128);
        sh.last_slot = -1;
    }
    __syncthreads();  // the barriers are initialised before any copy arrives on them
    const Lane ln = lane_geometry();
    const int last = stage_first_pair(sh, tl, q, kv, indices, t, g, h, k, ln.w);
    const int pairs = (blocks_with_keys(sh, last) + 1) / 2;
    if (pairs == 0)  // no pair waits for the first pair's copies (zeros): they land before the CTA ends
        for (int b = 0; b < 2; ++b)
            for (int half = 0; half < 2; ++half) mbarrier_wait(&sh.ready[b][half], 0);
    cp_async_wait<0>();  // the q tile (the gathers are not committed to groups)
    fence_proxy_async();
    __syncthreads();
    float o[128], l[2] = {0.f, 0.f}, m[2] = {neg_inf(), neg_inf()};
    zero(o);
    if (ln.w == 0)
        run_warpgroup0(o, l, m, tl, sh, kv, indices, t, k, pairs, scale * LOG2E, ln);
    else
        run_warpgroup1(o, l, m, tl, sh, kv, indices, t, k, pairs, scale * LOG2E, ln);
    write_output(o, l, m, sh, tl.q, out, lse, lse2, t, g, h, ln);
}
