// Sparse attention backward on tensor cores (layout: sparse_attention.cuh),
// in three kernels with no float atomics:
//
// sa_backward_dq recomputes p = exp(logit - lse) and dp = dout v^T per block,
// forms ds = p (dp - delta) (delta = rowsum(dout * out), made first; exactly
// 0 on rows whose valid slots all hold one key), adds ds kv into dq (kept in
// registers), and writes the block's ds and p' = p / scale tiles (16-bit, as
// their swizzled shared-memory image) to a scratch buffer, by one bulk copy
// from shared memory.
// sa_backward_dkv_rows{1,2}_{f32,bf16} read those images back and compute
// each slot's dkv row, scale * (ds^T q + p'^T dout) summed in float32 over up
// to 128 heads (one or two head groups: one row per slot for h <= 128), into
// a per-(query, head pass, slot) buffer of float32 or bfloat16 rows; a CTA
// computes half of a row's columns. sa_dkv_segments_{f32,bf16} add those rows
// into a float32 dkv key by key in ascending (query, slot, pass) order:
// bitwise reproducible.
#include "sparse_attention.cuh"
#include "sparse_attention_dq.cuh"
#include "sync.cuh"
#include "wgmma.cuh"

// Dynamic shared memory: 1024 + Q_BYTES + DO_BYTES + KV_BYTES + IMAGE_BYTES
// (the block's image: its ds tile, an operand of ds kv, then its p' tile).
// Work items: C * groups (query, head group) pairs over the chunk's queries
// (pointers start at its first query); CTA b takes items b, b + gridDim.x, ...
// (any grid: one CTA per item, or fewer CTAs that leave SMs to other
// kernels). images: [C * groups][ceil(k / 64)] blocks of IMAGE_BYTES; blocks
// without a valid slot are not written.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
sa_backward_dq(const u16* q, const u16* kv, const int* indices, const u16* out, const u16* dout, const float* lse,
               u16* dq, unsigned char* images, int h, int k, float scale, int items) {
    __shared__ BwdShared sh;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        dq_item(sh, q, kv, indices, out, dout, lse, dq, images, h, k, scale, item);
        __syncthreads();  // the tiles and sh are free for the next item
    }
}

namespace {

// Rows 0 .. ROWS-1 (heads head0 + r, zeros past h) of x[t] ([h, width] per
// query), `chunks` 16-byte chunks from feature `first`, into a region layout
// of ROWS rows (region i holds features first + 64 i ..).
template <int ROWS>
__device__ __forceinline__ void stage_head_columns(unsigned char* tile, const u16* x, int width, int t, int head0,
                                                   int h, int first, int chunks) {
    for (int r = threadIdx.x >> 2; r < ROWS; r += THREADS / 4) {
        const int head = head0 + r;
        const bool valid = head < h;
        const u16* src = x + ((size_t)t * h + (valid ? head : 0)) * width + first;
        for (int c = threadIdx.x & 3; c < chunks; c += 4)
            cp_async16(tile + swizzled_offset(r, c, ROWS), src + c * 8, valid);
    }
}

// This warp's 16 rows of an m64n(8 J) accumulator, times `scale`, as Row
// values (float32, or bfloat16 bits rounded once) to columns 0 .. 8 J of
// rows[slot] (slot: the warp's rows 16 (warp % 4) ..; only slots whose key
// is >= 0), through `stage` (2 KB of shared memory the warp owns): in rounds
// of 128 bytes per row, the lanes write their pairs (16-byte chunks XOR-
// swizzled by row, no bank conflicts) and read back 16 bytes each, so each
// store instruction writes four whole 128-byte lines.
template <int J, typename Row>
__device__ __forceinline__ void store_rows(const float (&acc)[4 * J], float scale, unsigned char* stage, Row* rows,
                                           const int* idx, const Lane& ln) {
    constexpr int BLOCKS = 128 / (8 * (int)sizeof(Row));  // column blocks of 8 per round
    const int lane = threadIdx.x & 31, first_slot = 16 * ((threadIdx.x >> 5) & 3);
    bool keep[4];  // whether the slot of this lane's i-th store holds a key
    #pragma unroll
    for (int i = 0; i < 4; ++i) keep[i] = idx[first_slot + 4 * i + (lane >> 3)] >= 0;
    #pragma unroll
    for (int j0 = 0; j0 < J; j0 += BLOCKS) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = (lane >> 2) + 8 * r;
            #pragma unroll
            for (int jj = 0; jj < BLOCKS; ++jj) {
                const int byte = (8 * jj + ln.cq) * (int)sizeof(Row);
                unsigned char* at = stage + row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
                const float a = acc[4 * (j0 + jj) + 2 * r] * scale, b = acc[4 * (j0 + jj) + 2 * r + 1] * scale;
                if constexpr (sizeof(Row) == 2)
                    *reinterpret_cast<u32*>(at) = pack_half2<false>(a, b);
                else
                    *reinterpret_cast<float2*>(at) = make_float2(a, b);
            }
        }
        __syncwarp();
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = 4 * i + (lane >> 3), chunk = lane & 7, slot = first_slot + row;
            const uint4 v = *reinterpret_cast<const uint4*>(stage + row * 128 + (((chunk ^ row) & 7) << 4));
            if (keep[i])  // streaming: each row is read once, by the per-key sums after the chunk
                __stcs(reinterpret_cast<uint4*>(rows + (size_t)slot * D + 8 * j0) + chunk, v);
        }
        __syncwarp();
    }
}

// One head pass of the dkv rows: GP head groups (GP * 64 heads, the K of the
// products) and one column half of every row: HALF 0 features 0..255, HALF 1
// features 256..575 (rope 512..575 computed by both warpgroups, so they run
// one instruction stream; warpgroup 1 stores it). Warpgroup w owns features
// 128 w .. 128 w + 127 of the half.
template <int GP, int HALF, typename Row>
__device__ __forceinline__ void dkv_rows_half(const u16* q, const u16* dout, const int* indices,
                                              const unsigned char* images, Row* rows, int h, int k, float scale,
                                              int pass, int t) {
    constexpr int KH = GP * BH;   // heads summed by this pass
    constexpr int R = KH * 128;   // one region of the q and dout tiles
    constexpr int FIRST = 256 * HALF;
    __shared__ int idx[2][BK];
    unsigned char* q_tile = aligned_dynamic_smem();
    unsigned char* do_tile = q_tile + 5 * R;
    unsigned char* image_tiles = do_tile + 4 * R;
    const int groups = (h + BH - 1) / BH, passes = (groups + 1) / 2, nb = (k + BK - 1) / BK;
    const Lane ln = lane_geometry();
    stage_head_columns<KH>(q_tile, q, D, t, 2 * pass * BH, h, FIRST, HALF ? (D - 256) / 8 : 32);
    stage_head_columns<KH>(do_tile, dout, DV, t, 2 * pass * BH, h, FIRST, 32);
    cp_async_commit();
    const unsigned char* image = images + ((size_t)t * groups + 2 * pass) * nb * IMAGE_BYTES;
    Row* query_rows = rows + ((size_t)t * passes + pass) * k * D;
    // Stage block b's images of the pass's groups (blocks sa_backward_dq skipped hold garbage, and are
    // skipped here too).
    auto stage = [&](int b, int s) {
        unsigned char* dst = image_tiles + (b & 1) * GP * IMAGE_BYTES;
        #pragma unroll
        for (int gi = 0; gi < GP; ++gi) {
            const unsigned char* src = image + ((size_t)gi * nb + b) * IMAGE_BYTES;
            for (int c = threadIdx.x; c < IMAGE_BYTES / 16; c += THREADS)
                cp_async16(dst + gi * IMAGE_BYTES + 16 * c, src + 16 * c);
        }
        record_key(idx[b & 1], s);
    };
    int s_cur = slot_key(indices, t, k, 0), s_next = slot_key(indices, t, k, 1);
    if (nb > 0) stage(0, s_cur);
    cp_async_commit();
    float acc[64], rope[32];  // each block's products overwrite them (accumulate = 0 at the first k-step)
    zero(acc);
    zero(rope);
    for (int b = 0; b < nb; ++b) {
        cp_async_wait<0>();
        fence_proxy_async();
        const int any = __syncthreads_or(s_cur >= 0);  // block b landed; block b - 1 done everywhere
        if (b + 1 < nb) stage(b + 1, s_next);
        cp_async_commit();
        s_cur = s_next;
        s_next = slot_key(indices, t, k, b + 2);
        if (!any) continue;
        unsigned char* block_images = image_tiles + (b & 1) * GP * IMAGE_BYTES;
        mma_begin(acc);
        wgmma_fence_operands(rope);
        #pragma unroll
        for (int kk = 0; kk < KH / 16; ++kk) {
            const unsigned char* ds_img = block_images + (kk / 4) * IMAGE_BYTES + (kk % 4) * K_STEP_ROWS;
            const u64 a_ds = wgmma_desc_mn(ds_img, REGION), a_p = wgmma_desc_mn(ds_img + P_BYTES, REGION);
            const int n0 = ln.w * 2 * R + kk * K_STEP_ROWS;
            wgmma_m64n128k16<F16, 1, 1>(acc, a_ds, wgmma_desc_mn(q_tile + n0, R), kk > 0);
            wgmma_m64n128k16<F16, 1, 1>(acc, a_p, wgmma_desc_mn(do_tile + n0, R), 1);
            if (HALF)
                wgmma_m64n64k16<F16, 1, 1>(rope, a_ds, wgmma_desc_mn(q_tile + 4 * R + kk * K_STEP_ROWS, R),
                                           kk > 0);
        }
        mma_end();
        wgmma_fence_operands(acc);
        wgmma_fence_operands(rope);
        __syncthreads();  // both warpgroups' products have read the block's images: they become the stores' stage
        unsigned char* store_stage = block_images + (threadIdx.x >> 5) * 2048;
        Row* block_rows = query_rows + (size_t)b * BK * D;
        store_rows<16>(acc, scale, store_stage, block_rows + FIRST + ln.w * 128, idx[b & 1], ln);
        if (HALF && ln.w == 1) store_rows<8>(rope, scale, store_stage, block_rows + DV, idx[b & 1], ln);
    }
    cp_async_wait<0>();
}

}  // namespace

// Dynamic shared memory: 1024 + 13 * GP * 64 * 128 (q and dout columns of
// the half, two blocks of GP images). Grid: 2 C CTAs over the chunk's queries,
// CTA 2 t + half. rows: [C, passes, k, 576] (passes = ceil(groups / 2));
// row (t, pass, slot) = scale * (ds^T q + p'^T dout) of that slot over
// the pass's heads 128 pass .. 128 pass + 64 GP - 1, written for valid slots
// only; _bf16 entries write bfloat16 rows (u16 bits, each value rounded once
// from float32). GP = 1 runs two CTAs per SM.
#define HS_DKV_ROWS(GP, ROW, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 3 - GP)                                                    \
    NAME(const u16* q, const u16* dout, const int* indices, const unsigned char* images, ROW* rows, int h, int k,   \
         float scale, int pass) {                                                                                   \
        const int t = blockIdx.x >> 1;                                                                               \
        if (blockIdx.x & 1)                                                                                          \
            dkv_rows_half<GP, 1>(q, dout, indices, images, rows, h, k, scale, pass, t);                              \
        else                                                                                                         \
            dkv_rows_half<GP, 0>(q, dout, indices, images, rows, h, k, scale, pass, t);                              \
    }
HS_DKV_ROWS(1, float, sa_backward_dkv_rows1_f32)
HS_DKV_ROWS(2, float, sa_backward_dkv_rows2_f32)
HS_DKV_ROWS(1, u16, sa_backward_dkv_rows1_bf16)
HS_DKV_ROWS(2, u16, sa_backward_dkv_rows2_bf16)
#undef HS_DKV_ROWS

namespace {

// Four consecutive values of a row: float32, or bfloat16 bits.
__device__ __forceinline__ float4 load4(const float* row, int c) { return reinterpret_cast<const float4*>(row)[c]; }

__device__ __forceinline__ float4 load4(const u16* row, int c) {
    const uint2 v = reinterpret_cast<const uint2*>(row)[c];
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xFFFF0000u));
}

// The row of term u (u / passes: the pair, u % passes: the pass) of a key
// whose pairs start at pairs[first]: pair e = t * k + i (query t of the
// chunk, slot i, < 2^31) has rows (t * passes + p) * k + i, p ascending.
__device__ __forceinline__ u32 term_row(const int* pairs, int first, int u, int passes, int k) {
    const int pair = pairs[first + u / passes];
    const int t = passes == 1 ? 0 : pair / k;  // one pass: the row is the pair
    return (u32)(pair + t * (passes - 1) * k + (u % passes) * k);
}

// dkv[s, :] += the rows of key s's pairs, pairs[starts[s]] .. pairs[starts[s +
// 1] - 1] one after another, each pair's passes in order (term_row). One CTA
// of D / 4 threads per key (4 columns each). The CTA turns D / 4 terms at a
// time into row numbers in shared memory, then
// each thread keeps LOADS rows in flight (16 bytes each for float32 rows, 8
// for bfloat16) and adds them in order into float32; no atomics.
template <typename Row>
__device__ __forceinline__ void dkv_segments(const Row* rows, const int* pairs, const int* starts, int k, int passes,
                                             float* dkv) {
    constexpr int LOADS = sizeof(Row) == 4 ? 4 : 8, BATCH = D / 4;
    __shared__ int row_of[BATCH];
    const int s = blockIdx.x, c = threadIdx.x;
    const int first = starts[s], terms = (starts[s + 1] - first) * passes;
    if (terms == 0) return;  // a key no slot selected
    float4* dst = reinterpret_cast<float4*>(dkv) + (size_t)s * (D / 4) + c;
    float4 acc = *dst;
    for (int base = 0; base < terms; base += BATCH) {
        const int n = min(BATCH, terms - base);
        __syncthreads();  // the previous batch's row numbers are read
        if (c < n) row_of[c] = (int)term_row(pairs, first, base + c, passes, k);
        __syncthreads();
        for (int j0 = 0; j0 < n; j0 += LOADS) {
            float4 v[LOADS];
            #pragma unroll
            for (int j = 0; j < LOADS; ++j)  // past the batch: a repeat, loaded but not added
                v[j] = load4(rows + (size_t)row_of[min(j0 + j, n - 1)] * D, c);
            #pragma unroll
            for (int j = 0; j < LOADS; ++j) {
                if (j0 + j < n) {
                    acc.x += v[j].x;
                    acc.y += v[j].y;
                    acc.z += v[j].z;
                    acc.w += v[j].w;
                }
            }
        }
    }
    *dst = acc;
}

__device__ __forceinline__ uint4 load16(const void* p) {
    uint4 v;  // each row is read once: no L1 line
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

}  // namespace

// The per-key sums of dkv_segments for bfloat16 rows on a few SMs set aside
// beside the dq kernel: one CTA per SM (SET_ASIDE_THREADS threads at 78
// registers; two do not fit one register file), each of LANES lanes of D / 8
// threads, 8 columns per thread (one 16-byte load per row). Lane l of CTA b
// takes keys b LANES + l, then every gridDim.x LANES keys after it. Each
// thread keeps LOADS rows in flight and loads the pair numbers of the next
// LOADS terms under them. The same adds in the same order as dkv_segments:
// the same bits.
constexpr int SET_ASIDE_THREADS = 720;

extern "C" __global__ void __launch_bounds__(SET_ASIDE_THREADS, 1)
sa_dkv_segments_set_aside_bf16(const u16* rows, const int* pairs, const int* starts, int k, int passes, int n_keys,
                               float* dkv) {
    constexpr int C = 8, PER_KEY = D / C, LANES = SET_ASIDE_THREADS / PER_KEY, LOADS = 8;
    const int lane = threadIdx.x / PER_KEY, c = threadIdx.x % PER_KEY;
    if (lane >= LANES) return;
    const u16* column = rows + C * c;
    for (int s = blockIdx.x * LANES + lane; s < n_keys; s += gridDim.x * LANES) {
        const int first = starts[s], terms = (starts[s + 1] - first) * passes;
        if (terms == 0) continue;  // a key no slot selected
        float4* dst = reinterpret_cast<float4*>(dkv + (size_t)s * D + C * c);
        float acc[C];
        #pragma unroll
        for (int i = 0; i < C / 4; ++i) {
            const float4 a = dst[i];
            acc[4 * i] = a.x;
            acc[4 * i + 1] = a.y;
            acc[4 * i + 2] = a.z;
            acc[4 * i + 3] = a.w;
        }
        u32 next[LOADS];
        #pragma unroll
        for (int j = 0; j < LOADS; ++j) next[j] = term_row(pairs, first, min(j, terms - 1), passes, k);
        for (int u0 = 0; u0 < terms; u0 += LOADS) {
            uint4 v[LOADS];
            #pragma unroll
            for (int j = 0; j < LOADS; ++j) v[j] = load16(column + (size_t)next[j] * D);
            #pragma unroll
            for (int j = 0; j < LOADS; ++j)  // past the end: a repeat, loaded but not added
                next[j] = term_row(pairs, first, min(u0 + LOADS + j, terms - 1), passes, k);
            #pragma unroll
            for (int j = 0; j < LOADS; ++j) {
                if (u0 + j >= terms) break;
                const u32 w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
                #pragma unroll
                for (int i = 0; i < C; ++i) acc[i] += __uint_as_float(i & 1 ? w[i / 2] & 0xFFFF0000u : w[i / 2] << 16);
            }
        }
        #pragma unroll
        for (int i = 0; i < C / 4; ++i) dst[i] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
    }
}

extern "C" __global__ void __launch_bounds__(D / 4, 8)
sa_dkv_segments_f32(const float* rows, const int* pairs, const int* starts, int k, int passes, float* dkv) {
    dkv_segments(rows, pairs, starts, k, passes, dkv);
}

extern "C" __global__ void __launch_bounds__(D / 4, 8)
sa_dkv_segments_bf16(const u16* rows, const int* pairs, const int* starts, int k, int passes, float* dkv) {
    dkv_segments(rows, pairs, starts, k, passes, dkv);
}
