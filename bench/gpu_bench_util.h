// defines: BENCH_CUDA_CHECK, median_ms, similarity_gap
// What the GPU benchmarks share: a checked CUDA call, and the median time of a piece of GPU work
// measured with CUDA events on the default stream (the stream every fourbit kernel runs on).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "fourbit/tensor/error.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::bench {

#define BENCH_CUDA_CHECK(call)                                                                  \
  do {                                                                                          \
    const cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) ::fourbit::fail("{}:{}: {} failed: {}", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
  } while (0)

// Median milliseconds of fn over `reps` runs after `warmup` runs, each bracketed by CUDA events.
inline double median_ms(const std::function<void()>& fn, int reps, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  BENCH_CUDA_CHECK(cudaEventCreate(&start));
  BENCH_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA_CHECK(cudaEventRecord(start, 0));
    fn();
    BENCH_CUDA_CHECK(cudaEventRecord(stop, 0));
    BENCH_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0.0f;
    BENCH_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  BENCH_CUDA_CHECK(cudaEventDestroy(start));
  BENCH_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// 1 - 2<x,y> / (|x|^2 + |y|^2) between two F32 tensors, as the tests measure it (0: identical), so a
// fast wrong kernel cannot look good in a benchmark.
inline double similarity_gap(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  double xy = 0, xx = 0, yy = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double p = x.data<float>()[i], q = y.data<float>()[i];
    xy += p * q, xx += p * p, yy += q * q;
  }
  return xx + yy == 0 ? 0.0 : 1.0 - 2.0 * xy / (xx + yy);
}

}  // namespace fourbit::bench
