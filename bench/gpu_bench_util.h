// defines: BENCH_CUDA_CHECK, median_ms
// What the GPU benchmarks share: a checked CUDA call, and the median time of a piece of GPU work
// measured with CUDA events on the default stream (the stream every fourbit kernel runs on).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "fourbit/tensor/error.h"

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

}  // namespace fourbit::bench
