// The indexer's sparse-stage KL loss row by row (hyscale_core/ops/indexer_loss):
// for row t with valid slots V (scores > -inf),
//
//   target_i = probs_i / sum_V probs,   log q_i = s_i - max_V s - log sum_V exp(s - max_V s)
//   row_loss = sum_V target_i (log target_i - log q_i)      (0 log 0 = 0)
//   dscores_i = (q_i - target_i) / n   at valid slots, 0 elsewhere
//
// and a row without valid slots or without target mass gives 0 and 0. One CTA
// per row, every value in float64 whatever the input dtypes (float32 or
// float64 each); dscores is rounded once to float32. Sums and maxima go
// per thread over a fixed stride, then a fixed butterfly and the warps in
// order: the same bits on every run. il_sum adds the row losses in float64
// in a fixed order (one CTA).
#include "select.cuh"

namespace {

constexpr int KL_THREADS = 256;
constexpr int SUM_THREADS = 1024;

__device__ __forceinline__ double neg_inf64() { return __longlong_as_double((long long)0xfff0000000000000ULL); }

// Sum (or max) of x over the CTA; every thread gets it. All threads must call this.
template <bool MAX>
__device__ double block_reduce(double x, double* red) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double y = __shfl_xor_sync(FULL_MASK, x, o);
        x = MAX ? fmax(x, y) : x + y;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    double total = red[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) total = MAX ? fmax(total, red[i]) : total + red[i];
    __syncthreads();
    return total;
}

template <typename S, typename P>
__device__ void kl_row(const S* scores, const P* probs, int kk, int n, float* dscores, double* row_loss) {
    __shared__ double red[32];
    const size_t base = (size_t)blockIdx.x * kk;
    const S* s = scores + base;
    const P* p = probs + base;
    float* d = dscores + base;
    double top = neg_inf64(), mass = 0.0;
    for (int i = threadIdx.x; i < kk; i += blockDim.x) {
        const double x = (double)s[i];
        if (x > neg_inf64()) {
            top = fmax(top, x);
            mass += (double)p[i];
        }
    }
    top = block_reduce<true>(top, red);
    mass = block_reduce<false>(mass, red);
    if (!(top > neg_inf64()) || !(mass > 0.0)) {  // the same on every thread
        for (int i = threadIdx.x; i < kk; i += blockDim.x) d[i] = 0.f;
        if (threadIdx.x == 0) row_loss[blockIdx.x] = 0.0;
        return;
    }
    double total = 0.0;
    for (int i = threadIdx.x; i < kk; i += blockDim.x) {
        const double x = (double)s[i];
        if (x > neg_inf64()) total += exp(x - top);
    }
    total = block_reduce<false>(total, red);
    const double log_total = log(total);
    double loss = 0.0;
    for (int i = threadIdx.x; i < kk; i += blockDim.x) {
        const double x = (double)s[i];
        float out = 0.f;
        if (x > neg_inf64()) {
            const double target = (double)p[i] / mass;
            if (target > 0.0) loss += target * (log(target) - (x - top - log_total));
            out = (float)((exp(x - top) / total - target) / (double)n);
        }
        d[i] = out;
    }
    loss = block_reduce<false>(loss, red);
    if (threadIdx.x == 0) row_loss[blockIdx.x] = loss;
}

}  // namespace

// Grid: n CTAs of KL_THREADS (one per row); kk >= 1. scores, probs: [n, kk]
// float32 (f) or float64 (d) as the name says; dscores [n, kk] float32;
// row_loss [n] float64.
#define HS_KL_ENTRY(NAME, S, P)                                                                                \
    extern "C" __global__ void __launch_bounds__(KL_THREADS)                                                 \
    NAME(const S* scores, const P* probs, int kk, int n, float* dscores, double* row_loss) {                  \
        kl_row(scores, probs, kk, n, dscores, row_loss);                                                       \
    }
HS_KL_ENTRY(il_kl_ff, float, float)
HS_KL_ENTRY(il_kl_fd, float, double)
HS_KL_ENTRY(il_kl_df, double, float)
HS_KL_ENTRY(il_kl_dd, double, double)
#undef HS_KL_ENTRY

// total[0] = x[0] + ... + x[n - 1] in a fixed order. Grid: one CTA of SUM_THREADS.
extern "C" __global__ void __launch_bounds__(SUM_THREADS) il_sum(const double* x, int n, double* total) {
    __shared__ double red[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    acc = block_reduce<false>(acc, red);
    if (threadIdx.x == 0) total[0] = acc;
}
