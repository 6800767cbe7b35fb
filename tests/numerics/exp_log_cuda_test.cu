// exp_hd and log_hd (numerics/exp_log.h) compiled by nvcc and run on the GPU return the host's
// bits: random bit patterns (every exponent, subnormals, NaN and Inf among them), the sampler's
// domains ((l - max) / T for exp, probabilities for log) and the neighbourhoods of 0 and 1.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "fourbit/numerics/exp_log.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/tensor.h"

using namespace fourbit;

namespace {

__global__ void exp_log_kernel(const double* x, int64_t n, double* e, double* l) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    e[i] = num::exp_hd(x[i]);
    l[i] = num::log_hd(x[i]);
  }
}

uint64_t bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

}  // namespace

TEST(CudaExpLog, DeviceBitsAreTheHosts) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device is visible";
  std::vector<double> x;
  std::mt19937_64 rng(11);
  for (int i = 0; i < 1000000; ++i) {
    const uint64_t u = rng();
    double d;
    std::memcpy(&d, &u, sizeof d);
    x.push_back(d);
  }
  std::uniform_real_distribution<double> exp_domain(-745.0, 1.0), unit(0.0, 1.0), near(-1e-6, 1e-6);
  for (int i = 0; i < 400000; ++i) x.push_back(exp_domain(rng));
  for (int i = 0; i < 400000; ++i) x.push_back(unit(rng));
  for (int i = 0; i < 50000; ++i) x.push_back(near(rng)), x.push_back(1.0 + near(rng));
  for (const double d : {0.0, -0.0, 1.0, -1.0, 709.78, 709.79, -745.2, -708.4, 1e-310, 5e-324})
    x.push_back(d);
  const int64_t n = int64_t(x.size());
  const Tensor dx = Tensor::from_host(x.data(), {n}, DType::F64, Device::CUDA);
  Tensor de = Tensor::empty({n}, DType::F64, Device::CUDA), dl = Tensor::empty({n}, DType::F64, Device::CUDA);
  exp_log_kernel<<<264, 256, 0, static_cast<cudaStream_t>(current_stream())>>>(dx.data<double>(), n, de.data<double>(),
                                                                   dl.data<double>());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const Tensor he = de.to(Device::CPU), hl = dl.to(Device::CPU);
  int64_t exp_diff = 0, log_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = num::exp_hd(x[size_t(i)]), l = num::log_hd(x[size_t(i)]);
    // NaN results: any NaN payload is the same answer
    if (bits(he.data<double>()[i]) != bits(e) && !(e != e && he.data<double>()[i] != he.data<double>()[i]))
      if (exp_diff++ < 5) ADD_FAILURE() << "exp_hd(" << x[size_t(i)] << ") differs";
    if (bits(hl.data<double>()[i]) != bits(l) && !(l != l && hl.data<double>()[i] != hl.data<double>()[i]))
      if (log_diff++ < 5) ADD_FAILURE() << "log_hd(" << x[size_t(i)] << ") differs";
  }
  EXPECT_EQ(exp_diff, 0);
  EXPECT_EQ(log_diff, 0);
}
