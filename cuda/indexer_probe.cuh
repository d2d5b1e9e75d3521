// The fused indexer's timeline probe (benchmarks/indexer_timeline.py): with
// HS_IDX_PROBE=1, warp 0 of each CTA reads %clock between the steps of its
// work and thread 0 sums each step's cycles (and a few counts) in shared
// memory; at the end the CTA adds them to the global hs_idx_probe. With
// HS_IDX_PROBE=0 (the library's build) every mark compiles to nothing.
// The score kernel runs the same marks into slots it never zeroes or
// reports. Included by indexer_config.cuh, after GroupShared.
#pragma once

namespace {

// Slots of hs_idx_probe: cycles of a step, or a count (N_*). The order is
// benchmarks/indexer_timeline.py's.
enum ProbeSlot {
    P_ISSUE, P_TILE_SCORES, P_WAIT_LO, P_LO_SUMS, P_CONSUME, P_WAIT_HI, P_HI_SUMS, P_COPY_WAIT, P_BARRIER,
    P_SETTLE, P_FINAL, P_NEXT_GROUP, P_FINAL_PRUNE, P_FINAL_LOAD, P_FINAL_SORT, P_FINAL_WRITE,
    N_TILES, N_GROUPS, N_TOTAL_CYCLES, N_FINAL_PRUNES, N_FINAL_CANDIDATES, N_SORT_ROUNDS, N_SORT_PASSES,
    PROBE_SLOTS
};
static_assert(PROBE_SLOTS <= 32, "GroupShared holds 32 probe slots");

#if HS_IDX_PROBE
__device__ __forceinline__ u32 probe_clock() {
    u32 t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t)::"memory");
    return t;
}

// Marks: the cycles since the last mark (or since construction) go to a slot.
// Loads, stores and wgmma stay on their side of a mark (volatile, memory
// clobber); ptxas may move arithmetic across one.
struct Probe {
    u32* slots;
    u32 t;
    __device__ explicit Probe(GroupShared& sh) : slots(sh.probe), t(probe_clock()) {}
    __device__ __forceinline__ void restart() { t = probe_clock(); }
    __device__ __forceinline__ void mark(ProbeSlot slot) {
        const u32 now = probe_clock();
        if (threadIdx.x == 0) slots[slot] += now - t;
        t = now;
    }
    __device__ __forceinline__ void count(ProbeSlot slot, u32 n) {
        if (threadIdx.x == 0) slots[slot] += n;
    }
};

// Zero the CTA's slots (all threads, before any mark); returns the clock the
// CTA's cycles count from.
__device__ u32 probe_begin(GroupShared& sh) {
    for (int i = threadIdx.x; i < PROBE_SLOTS; i += blockDim.x) sh.probe[i] = 0;
    __syncthreads();
    return probe_clock();
}
#else
struct Probe {
    __device__ explicit Probe(GroupShared&) {}
    __device__ __forceinline__ void restart() {}
    __device__ __forceinline__ void mark(ProbeSlot) {}
    __device__ __forceinline__ void count(ProbeSlot, u32) {}
};
__device__ __forceinline__ u32 probe_begin(GroupShared&) { return 0; }
#endif

}  // namespace

#if HS_IDX_PROBE
extern "C" {
__device__ unsigned long long hs_idx_probe[PROBE_SLOTS];
}
#endif

namespace {
// Add the CTA's slots and its cycles since `start` to hs_idx_probe (all threads).
__device__ __forceinline__ void probe_end(GroupShared& sh, u32 start) {
#if HS_IDX_PROBE
    __syncthreads();
    if (threadIdx.x == 0) {
        sh.probe[N_TOTAL_CYCLES] = probe_clock() - start;
        for (int i = 0; i < PROBE_SLOTS; ++i) atomicAdd(&hs_idx_probe[i], (unsigned long long)sh.probe[i]);
    }
#else
    (void)sh;
    (void)start;
#endif
}
}  // namespace
