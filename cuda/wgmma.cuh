// Hopper warpgroup matrix instructions (wgmma, sm_90a) and the shared-memory
// layout they read. The operand lists of the wgmma wrappers are written out
// by a script; everything else is by hand.
//
// Layout: a tile of R rows x 64 elements (128 bytes) of 16-bit data, rows
// K-major (the 64 elements of a row contiguous), 128-byte swizzled: the
// 16-byte chunk c of row r sits at chunk c ^ (r % 8). Tiles start 1024-byte
// aligned. A row of D elements spans D / 64 such tiles ("regions").
// All functions named wgmma_* must be called by all 128 threads of a
// warpgroup.
#pragma once

#include "select.cuh"
#include "tiles.cuh"

namespace hs {

// Matrix descriptor of a K-major, 128B-swizzled operand starting at `smem`.
__device__ __forceinline__ u64 wgmma_desc(const void* smem) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    u64 desc = (u64)((addr & 0x3FFFF) >> 4);
    desc |= (u64)1 << 16;            // leading byte offset (unused when swizzled)
    desc |= (u64)(1024 >> 4) << 32;  // stride byte offset: 8 rows x 128 bytes
    desc |= (u64)1 << 62;            // 128-byte swizzle
    return desc;
}

// Descriptor of an MN-major (transposed) 128B-swizzled operand in the region
// layout: 64 elements of M or N per 128-byte row, K along the rows.
// `region_bytes` is the distance between consecutive 64-element blocks of M
// or N (the leading byte offset); 8-row groups of K are 1024 bytes apart (the
// stride byte offset). `smem` must sit on a 1024-byte boundary of a region.
__device__ __forceinline__ u64 wgmma_desc_mn(const void* smem, u32 region_bytes) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    u64 desc = (u64)((addr & 0x3FFFF) >> 4);
    desc |= (u64)(region_bytes >> 4) << 16;
    desc |= (u64)(1024 >> 4) << 32;
    desc |= (u64)1 << 62;
    return desc;
}

// Byte offset of 16-byte chunk `chunk` (of D/8) of row `row` in a region layout of `rows` rows.
__device__ __forceinline__ u32 swizzled_offset(int row, int chunk, int rows) {
    const int region = chunk >> 3, c = chunk & 7;
    return (u32)(region * rows * 128 + row * 128 + ((c ^ (row & 7)) << 4));
}

// `desc` moved on by `bytes` (a multiple of 16): the start address field
// (bits 0-13, the shared address over 16) takes the offset without a carry
// while the operand stays in the 256 KiB shared window, so only the low word
// changes, and with a constant offset that is one add per k-step.
__device__ __forceinline__ u64 wgmma_desc_advance(u64 desc, u32 bytes) {
    const u32 lo = (u32)desc + (bytes >> 4), hi = (u32)(desc >> 32);
    return ((u64)hi << 32) | lo;
}

// Byte offset of k-step `kk` (16 elements) in an operand of `rows` rows in
// the region layout: four k-steps to a 128-byte row, then the next region.
__device__ __forceinline__ u32 wgmma_k_step_bytes(int kk, int rows) {
    return (u32)((kk >> 2) * rows * 128 + (kk & 3) * 32);
}

// Descriptor for k-step `kk` of an operand of `rows` rows: the same bits as
// wgmma_desc at that k-step's address.
__device__ __forceinline__ u64 wgmma_desc_k(const unsigned char* base, int kk, int rows) {
    return wgmma_desc_advance(wgmma_desc(base), wgmma_k_step_bytes(kk, rows));
}

// The low word of wgmma_desc_k's result, from the low word of the base's
// descriptor (the high word does not depend on the address).
__device__ __forceinline__ u32 wgmma_desc_k_lo(u32 base_lo, int kk, int rows) {
    return base_lo + (wgmma_k_step_bytes(kk, rows) >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Wait until at most N committed wgmma groups of this thread are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keep the compiler from moving accumulator reads or writes across the
// asynchronous wgmma (it sees no dependency on the wait otherwise).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Make ordinary shared-memory stores (cp.async too) visible to the tensor cores.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// D[64 x 32] (+)= A[64 x 16] * B[16 x 32], both from shared memory; 16-bit
// operands (float16 when F16, else bfloat16), float32 accumulators. TA / TB = 1
// reads A / B MN-major (transposed), 0 K-major. accumulate = 0 overwrites D.
template <bool F16, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], u64 desc_a, u64 desc_b, int accumulate) {
#define HS_WGMMA(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
        "}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TA), "n"(TB))
    if constexpr (F16)
        HS_WGMMA("f16");
    else
        HS_WGMMA("bf16");
#undef HS_WGMMA
}

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64], both from shared memory; 16-bit
// operands (float16 when F16, else bfloat16), float32 accumulators. TA / TB = 1
// reads A / B MN-major (transposed), 0 K-major. accumulate = 0 overwrites D.
template <bool F16, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
#define HS_WGMMA(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TA), "n"(TB))
    if constexpr (F16)
        HS_WGMMA("f16");
    else
        HS_WGMMA("bf16");
#undef HS_WGMMA
}

// D[64 x 128] (+)= A[64 x 16] * B[16 x 128], both from shared memory; 16-bit
// operands (float16 when F16, else bfloat16), float32 accumulators. TA / TB = 1
// reads A / B MN-major (transposed), 0 K-major. accumulate = 0 overwrites D.
template <bool F16, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
#define HS_WGMMA(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TA), "n"(TB))
    if constexpr (F16)
        HS_WGMMA("f16");
    else
        HS_WGMMA("bf16");
#undef HS_WGMMA
}

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], both from shared memory; 16-bit
// operands (float16 when F16, else bfloat16), float32 accumulators. TA / TB = 1
// reads A / B MN-major (transposed), 0 K-major. accumulate = 0 overwrites D.
template <bool F16, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 desc_a, u64 desc_b, int accumulate) {
#define HS_WGMMA(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TA), "n"(TB))
    if constexpr (F16)
        HS_WGMMA("f16");
    else
        HS_WGMMA("bf16");
#undef HS_WGMMA
}


// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], A from registers (a: the
// thread's four 16-bit pairs of A in the wgmma fragment layout, see
// pack_fragment), B from shared memory (TB = 1 reads it MN-major); float16
// when F16, else bfloat16; float32 accumulators. accumulate = 0 overwrites
// D. The registers of a must hold still until the wgmma has been waited for.
template <bool F16, int TB = 0>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const u32 (&a)[4], u64 desc_b, int accumulate) {
#define HS_WGMMA(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TB))
    if constexpr (F16)
        HS_WGMMA("f16");
    else
        HS_WGMMA("bf16");
#undef HS_WGMMA
}

}  // namespace hs
