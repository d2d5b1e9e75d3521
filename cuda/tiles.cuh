// Device pieces shared by the tiled kernels (indexer, sparse attention,
// indexer loss): 16-byte asynchronous copies global -> shared memory
// (cp.async, sm_80+), 16-bit float conversions (float16 when F16, else
// bfloat16) and -inf.
#pragma once

#include "select.cuh"

namespace hs {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 16-byte asynchronous copy global -> shared.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem) : "memory");
}
// 16-byte asynchronous copy global -> shared; zero-fills when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
// An L2 cache policy under which lines outlast those of evict_normal accesses
// (for data read many times, as gathered kv rows).
__device__ __forceinline__ u64 l2_evict_last() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// An L2 cache policy under which lines go before those of evict_normal accesses
// (for data read once, as a query's q rows).
__device__ __forceinline__ u64 l2_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// cp_async16 with zero fill, under an L2 cache policy, with a 256-byte L2
// fetch on a miss (for whole rows of 256 bytes or more).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid, u64 policy) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(addr),
                 "l"(gmem), "r"(valid ? 16 : 0), "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Two floats rounded to nearest-even 16-bit values, packed (lo in the low half).
template <bool F16>
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 out;
    if constexpr (F16)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

// The float value of 16-bit bits.
template <bool F16>
__device__ __forceinline__ float half_to_float(u16 bits) {
    if constexpr (F16) {
        float out;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(out) : "h"(bits));
        return out;
    } else {
        return __uint_as_float((u32)bits << 16);
    }
}

}  // namespace hs
