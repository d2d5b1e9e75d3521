// probs of sparse attention (layout: sparse_attention.cuh): the attention
// probability at each selected slot summed over a CTA's heads, from the
// base-2 lse the forward (sparse_attention.cu) wrote.
//
// sa_forward_probs: warpgroup w takes the key blocks w, w + 2, w + 4, ... of
// query t, each into its own buffer, and needs no barrier of the other
// warpgroup: the logits of a block for all 64 heads (m64n64, K = 576, the
// left half's k-steps as soon as features 0..255 have landed), the next
// block's left half gathered once the left k-steps have read the buffer and
// its right half once all have, then the head sums of exp2(logit - lse2)
// while that gather is in flight. While one warpgroup waits for its rows,
// the other's products keep the tensor cores busy.
//
// The sums come in one fixed order: a thread's two rows, then the lanes of a
// column (strides 4, 8, 16 of the lane index), then the warpgroup's four
// warps in ascending order.
#include "wgmma.cuh"
#include "sparse_attention.cuh"
#include "sync.cuh"

namespace {

constexpr int LEFT_STEPS = 256 / 16;  // k-steps of the logits in a buffer's left half (regions 0..3)
constexpr int LEFT_REGIONS = 4;

// gather_regions of the rows `keys` into `tile`, committed as one cp.async group of this thread.
template <int R0, int R1>
__device__ __forceinline__ void gather_group(unsigned char* tile, const u16* kv, const int (&keys)[4],
                                             const GatherLane& gl) {
    gather_regions<R0, R1>(tile, kv, keys, gl);
    cp_async_commit();
}

constexpr int BAR_WARPGROUP = 1;  // named barriers 1 and 2: warpgroup 0's and 1's

// This warpgroup's cp.async groups up to the newest `pending` have landed
// (every thread's), and the async proxy sees them.
template <int PENDING>
__device__ __forceinline__ void wait_rows(int w) {
    cp_async_wait<PENDING>();
    fence_proxy_async();
    warpgroup_sync<BAR_WARPGROUP>(w);
    wgmma_fence();
}

// v[0 .. N-1] (N a power of two) summed over the 8 lanes of a column (lane
// bits 2..4), each lane keeping N / 8 of the sums: at each stride a lane
// keeps one half of its values and adds the partner's copy of that half,
// the same pairs, in the same tree, as an all-reduce by stride 4, 8, 16.
// Lane bits b4, b8, b16 keep entries 8 b4 + 4 b8 + 2 b16 + {0, 1} of 16.
template <int N, int STRIDE = 4>
__device__ __forceinline__ void column_sums(float (&v)[N]) {
    constexpr int HALF = 2 * N / STRIDE;  // half of the entries still held: N / 2, N / 4, N / 8
    const bool upper = threadIdx.x & STRIDE;
    #pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float keep = upper ? v[i + HALF] : v[i], send = upper ? v[i] : v[i + HALF];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, STRIDE);
    }
    if constexpr (STRIDE < 16) column_sums<N, 2 * STRIDE>(v);
}

// probs[slot] of block b's slots over this warpgroup's heads: p = exp2(s -
// lse2) (s in base-2 units, -inf at skipped slots; 0 on a row without a
// key), the column sums of each warp into col[warp][64], then the four
// warps' added in order by threads 0..63 of the warpgroup. col is free again
// once every thread of the warpgroup is past its next barrier (wait_rows').
__device__ __forceinline__ void block_probs(const float (&s)[32], const float (&lse2)[2], const bool (&live)[2],
                                            float* col, float* probs_row, int b, int k, const Lane& ln) {
    float cs[16];  // entry 2j + c: column 8j + cq + c over this thread's two rows
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float p0 = live[0] ? exp2f(s[4 * j + c] - lse2[0]) : 0.f;
            const float p1 = live[1] ? exp2f(s[4 * j + 2 + c] - lse2[1]) : 0.f;
            cs[2 * j + c] = p0 + p1;
        }
    column_sums(cs);
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int j = 4 * ((lane >> 2) & 1) + 2 * ((lane >> 3) & 1) + ((lane >> 4) & 1);
    *reinterpret_cast<float2*>(col + warp * BK + 8 * j + ln.cq) = make_float2(cs[0], cs[1]);
    warpgroup_sync<BAR_WARPGROUP>(ln.w);
    const int c = threadIdx.x & 127;
    if (c < BK && b * BK + c < k)
        probs_row[b * BK + c] = ((col[c] + col[BK + c]) + col[2 * BK + c]) + col[3 * BK + c];
}

// Warpgroup w's blocks of query t: w, w + 2, ... < nb, block w's copies
// already issued into `tile` (left half, then right half, two groups).
__device__ __forceinline__ void run_warpgroup(const unsigned char* q_tile, unsigned char* tile, float* col,
                                              const u16* kv, const int* indices, float* probs_row,
                                              const float (&lse2)[2], const bool (&live)[2], int t, int k, int nb,
                                              float sl2, const Lane& ln) {
    const GatherLane gl = gather_lane();
    int keys[4];
    for (int b = ln.w; b < nb; b += 2) {
        const bool next = b + 2 < nb;
        if (next) block_keys(keys, indices, t, k, b + 2, gl);
        const u32 valid = valid_slots(indices, t, k, b, ln);
        float s[32];
        wait_rows<1>(ln.w);  // the left half
        mma_begin(s);
        issue_rows64<0, LEFT_STEPS>(s, q_tile, tile);
        wgmma_commit();
        wait_rows<0>(ln.w);  // the right half
        issue_rows64<LEFT_STEPS, D / 16>(s, q_tile, tile);
        wgmma_commit();
        wgmma_wait<1>();  // the left k-steps have read the left half
        if (next) gather_group<0, LEFT_REGIONS>(tile, kv, keys, gl);
        else cp_async_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(s);
        if (next) gather_group<LEFT_REGIONS, D / 64>(tile, kv, keys, gl);
        else cp_async_commit();
        #pragma unroll
        for (int i = 0; i < 32; ++i)
            s[i] = (valid >> (2 * (i >> 2) + (i & 1))) & 1 ? s[i] * sl2 : neg_inf();
        block_probs(s, lse2, live, col, probs_row, b, k, ln);
    }
    cp_async_wait<0>();
}

}  // namespace

// Dynamic shared memory: 1024 + Q_BYTES + 2 * KV_BYTES + P_BYTES (ops/sparse_attention/gpu.py).
// Grid: N * groups CTAs (groups = ceil(h / 64)), CTA t * groups + g; THREADS
// threads. lse2 [N, h] float32 (base 2, -inf for a head without a valid
// slot); probs [N, groups, k]: each head group's sum, the caller adds the groups.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_forward_probs(const u16* q, const u16* kv, const int* indices, const float* lse2, float* probs, int h, int k,
                 float scale) {
    unsigned char* q_tile = aligned_dynamic_smem();
    const Lane ln = lane_geometry();
    unsigned char* tile = q_tile + Q_BYTES + ln.w * KV_BYTES;  // this warpgroup's buffer
    float* col = reinterpret_cast<float*>(q_tile + Q_BYTES + 2 * KV_BYTES) + ln.w * 4 * BK;  // [4 warps][64 slots]
    const int groups = (h + BH - 1) / BH, t = blockIdx.x / groups, g = blockIdx.x % groups;
    const int nb = (k + BK - 1) / BK;
    stage_heads<D>(q_tile, q, t, g, h);
    cp_async_commit();
    const GatherLane gl = gather_lane();
    int keys[4];
    block_keys(keys, indices, t, k, ln.w, gl);  // past the last block: zeros, never read, drained at the end
    gather_group<0, LEFT_REGIONS>(tile, kv, keys, gl);
    gather_group<LEFT_REGIONS, D / 64>(tile, kv, keys, gl);
    float row_lse2[2];
    bool live[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head = g * BH + ln.row0 + 8 * r;
        row_lse2[r] = head < h ? lse2[(size_t)t * h + head] : neg_inf();
        live[r] = row_lse2[r] != neg_inf();
    }
    cp_async_wait<2>();  // the q tile
    fence_proxy_async();
    __syncthreads();
    run_warpgroup(q_tile, tile, col, kv, indices, probs + ((size_t)t * groups + g) * k, row_lse2, live, t, k, nb,
                  scale * LOG2E, ln);
}
