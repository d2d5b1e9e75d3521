// Deterministic segmented sums: out[key[s], :] += sum of rows[starts[s] ..
// starts[s+1]) in ascending row order. One thread per (segment, column), so
// every sum has one fixed order and no atomics touch floats.
#include "select.cuh"

template <typename T>
__device__ void segment_sum(const T* rows, const long long* starts, const long long* keys, int n_segments,
                            int width, T* out) {
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)n_segments * width) return;
    const int s = (int)(id / width), c = (int)(id % width);
    T acc = 0;
    for (long long r = starts[s]; r < starts[s + 1]; ++r) acc += rows[r * width + c];
    out[keys[s] * width + c] += acc;
}

extern "C" __global__ void segment_sum_f32(const float* rows, const long long* starts, const long long* keys,
                                           int n_segments, int width, float* out) {
    segment_sum(rows, starts, keys, n_segments, width, out);
}

extern "C" __global__ void segment_sum_f64(const double* rows, const long long* starts, const long long* keys,
                                           int n_segments, int width, double* out) {
    segment_sum(rows, starts, keys, n_segments, width, out);
}
