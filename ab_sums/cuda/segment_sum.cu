// Deterministic per-key sums: out[s, :] += sum of rows[starts[s] ..
// starts[s+1]) in ascending row order. One thread per (key, column), so
// every sum has one fixed order and no atomics touch floats.
#include "select.cuh"

template <typename T>
__device__ void segment_sum(const T* rows, const long long* starts, int n_keys, int width, T* out) {
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n_keys * width) return;
    const int s = (int)(id / width), c = (int)(id % width);
    if (starts[s] == starts[s + 1]) return;  // a key no slot selected
    T acc = 0;
    for (long long r = starts[s]; r < starts[s + 1]; ++r) acc += rows[r * width + c];
    out[(long long)s * width + c] += acc;
}

extern "C" __global__ void segment_sum_f32(const float* rows, const long long* starts, int n_keys, int width,
                                           float* out) {
    segment_sum(rows, starts, n_keys, width, out);
}

extern "C" __global__ void segment_sum_f64(const double* rows, const long long* starts, int n_keys, int width,
                                           double* out) {
    segment_sum(rows, starts, n_keys, width, out);
}
