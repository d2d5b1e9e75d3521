// The public calls' checks of an index table (and of the forward's lse) in one
// pass, so that the host waits for the device once per call:
//   flags[0] = 1 if an entry of the int32 indices [N, k] is < -1 or >= n_keys;
//   flags[1] = 1 if a row that selects a key (an entry >= 0) has an entry of
//              lse [N, h] that is not finite (lse == nullptr: not checked).
// A flag is only ever set to 1 (atomicOr), so it does not depend on the order
// of the CTAs. Grid: one CTA per row, THREADS threads; flags start at 0.

namespace {
constexpr int THREADS = 256;
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
hs_check_rows(const int* indices, int k, long long n_keys, const float* lse, int h, int* flags) {
    const long long t = blockIdx.x;
    bool out_of_range = false, selects = false;
    for (int i = threadIdx.x; i < k; i += THREADS) {
        const int s = indices[t * k + i];
        out_of_range |= s < -1 || s >= n_keys;
        selects |= s >= 0;
    }
    const int row_out_of_range = __syncthreads_or(out_of_range);
    const int row_selects = __syncthreads_or(selects);
    bool bad_lse = false;
    if (lse != nullptr && row_selects)
        for (int j = threadIdx.x; j < h; j += THREADS) bad_lse |= !isfinite(lse[t * h + j]);
    const int row_bad_lse = __syncthreads_or(bad_lse);
    if (threadIdx.x == 0) {
        if (row_out_of_range) atomicOr(flags, 1);
        if (row_bad_lse) atomicOr(flags + 1, 1);
    }
}

