// defines: BENCH_CUDA_CHECK, median_event_ms, median_ms, median_queued_ms, copy_bandwidth_gbs, similarity_gap
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

// The median of `reps` samples in milliseconds, each sample(start, stop) recording its work between
// the two CUDA events (on the default stream, the stream every fourbit kernel runs on) and
// returning how many calls of the work they bracket.
inline double median_event_ms(int reps, const std::function<int(cudaEvent_t, cudaEvent_t)>& sample) {
  cudaEvent_t start, stop;
  BENCH_CUDA_CHECK(cudaEventCreate(&start));
  BENCH_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const int calls = sample(start, stop);
    BENCH_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0.0f;
    BENCH_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(double(t) / calls);
  }
  BENCH_CUDA_CHECK(cudaEventDestroy(start));
  BENCH_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Median milliseconds of fn over `reps` runs after `warmup` runs, each bracketed by CUDA events.
inline double median_ms(const std::function<void()>& fn, int reps, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  return median_event_ms(reps, [&](cudaEvent_t start, cudaEvent_t stop) {
    BENCH_CUDA_CHECK(cudaEventRecord(start, 0));
    fn();
    BENCH_CUDA_CHECK(cudaEventRecord(stop, 0));
    return 1;
  });
}

// Median GPU milliseconds of one fn: each of `reps` samples queues `busy` (long GPU work, e.g. a
// large GEMM), then times `batch` fns back to back between two events. The host issues the fns
// while the GPU is still on `busy`, so the host's own cost per call (checks, launch) is hidden
// as under a CUDA graph, and the samples see the kernels and the gaps between them only.
inline double median_queued_ms(const std::function<void()>& fn, const std::function<void()>& busy, int reps,
                               int batch = 20) {
  fn();
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  return median_event_ms(reps, [&](cudaEvent_t start, cudaEvent_t stop) {
    busy();
    BENCH_CUDA_CHECK(cudaEventRecord(start, 0));
    for (int j = 0; j < batch; ++j) fn();
    BENCH_CUDA_CHECK(cudaEventRecord(stop, 0));
    return batch;
  });
}

// A device-to-device copy's bandwidth (GB/s of bytes read plus written, 1 GiB copied, median of
// reps): the memory ceiling the benchmarks' ratios are taken against.
inline double copy_bandwidth_gbs(int reps) {
  const size_t bytes = size_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA_CHECK(cudaMalloc(&src, bytes));
  BENCH_CUDA_CHECK(cudaMalloc(&dst, bytes));
  BENCH_CUDA_CHECK(cudaMemset(src, 1, bytes));
  const double ms = median_ms([&] { BENCH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0)); },
                              reps);
  BENCH_CUDA_CHECK(cudaFree(src));
  BENCH_CUDA_CHECK(cudaFree(dst));
  return 2.0 * double(bytes) / (ms * 1e6);
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
