// Synchronisation between the warps of a CTA (sm_90): mbarriers in shared
// memory that cp.async copies arrive on, named barriers (bar.sync /
// bar.arrive over a subset of the CTA's warps), and bulk stores from shared
// memory with their waits.
#pragma once

#include "select.cuh"

namespace hs {

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// One thread initialises an mbarrier that completes a phase after `count` arrivals.
__device__ __forceinline__ void mbarrier_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// An arrival once every earlier cp.async of this thread has landed (counts
// against the expected arrivals: the barrier's count includes this thread).
__device__ __forceinline__ void cp_async_arrive(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Wait until the phase of parity `parity` has completed (acquire). A fresh
// barrier is in phase 0, so waiting on parity 1 returns at once.
__device__ __forceinline__ void mbarrier_wait(u64* bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads
// (a multiple of 32): bar_sync waits for all of them, bar_arrive only counts
// this warp in. Memory accesses before either are seen by threads past the sync.
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Named barrier ID0 + w over warpgroup w's 128 threads (w = 0 or 1). The ids
// stay constants in each branch: ptxas counts the barriers a kernel uses.
template <int ID0>
__device__ __forceinline__ void warpgroup_sync(int w) {
    if (w == 0) bar_sync(ID0, 128);
    else bar_sync(ID0 + 1, 128);
}

// One thread: `bytes` (a multiple of 16, both addresses 16-byte aligned)
// from shared to global memory by the bulk-copy engine, as a bulk group of
// its own. The shared source must be fenced (fence.proxy.async) after its
// writes and left alone until bulk_wait_read.
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem_addr(smem)),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until this thread's bulk stores have read their shared source.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until this thread's bulk stores are complete (written to global memory).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace hs
