// defines: test helpers for the layer ops: random tensors and routings, bitwise comparison, error-message
//          expectations, column_block, time_slice, with_threads, SKIP_WITHOUT_GPU, draw_rows, and fd_check (central finite differences of L = sum(r * outputs)).
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"

// Skips a GPU test where no CUDA device is visible (CI, this machine without one).
#define SKIP_WITHOUT_GPU()                                                                \
  do {                                                                                    \
    if (::fourbit::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device is visible"; \
  } while (0)

namespace fourbit::optest {

inline Tensor random_tensor(const Shape& shape, DType dt, uint64_t seed, double lo = -1.0,
                            double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  Tensor t = Tensor::empty(shape, dt);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dt == DType::F64) t.data<double>()[i] = u(rng);
    else t.data<float>()[i] = float(u(rng));
  }
  return t;
}

inline Tensor int_tensor(const std::vector<int32_t>& v, const Shape& shape) {
  return Tensor::from_host(v.data(), shape, DType::I32);
}

// I32 [N, k] host routing: each token picks k distinct experts of E at random.
inline Tensor random_routing(int64_t N, int64_t E, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> idx(static_cast<size_t>(N * k)), experts(static_cast<size_t>(E));
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t n = 0; n < N; ++n) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy_n(experts.begin(), k, idx.begin() + n * k);
  }
  return int_tensor(idx, {N, k});
}

// Runs f with n OpenMP threads, then restores the thread count.
template <typename F>
void with_threads(int n, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(saved);
}

inline Tensor random_ints(const Shape& shape, int32_t lo, int32_t hi_exclusive, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> u(lo, hi_exclusive - 1);
  std::vector<int32_t> v(size_t(shape_numel(shape)));
  for (auto& x : v) x = u(rng);
  return int_tensor(v, shape);
}

inline double at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : double(t.data<float>()[i]);
}
inline void set(Tensor& t, int64_t i, double x) {
  if (t.dtype() == DType::F64) t.data<double>()[i] = x;
  else t.data<float>()[i] = float(x);
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0;
}
// Bytes [off, off + n) of two tensors, in elements of a's dtype.
inline bool bitwise_equal_range(const Tensor& a, int64_t a_off, const Tensor& b, int64_t b_off,
                                int64_t n) {
  const int64_t es = dtype_size(a.dtype());
  return std::memcmp(static_cast<const char*>(a.raw()) + a_off * es,
                     static_cast<const char*>(b.raw()) + b_off * es, size_t(n * es)) == 0;
}

// Columns [c0, c0 + count) of a host [R, C] tensor, copied: a fused GEMM output's part.
inline Tensor column_block(const Tensor& x, int64_t c0, int64_t count) {
  const int64_t R = x.size(0), C = x.size(1);
  Tensor out = Tensor::empty({R, count}, x.dtype());
  for (int64_t r = 0; r < R; ++r) out.view(r * count, {count}).copy_from(x.view(r * C + c0, {count}));
  return out;
}

// Positions [t0, t1) of a host [B, L, H, hd] tensor, copied.
inline Tensor time_slice(const Tensor& x, int64_t t0, int64_t t1) {
  const int64_t B = x.size(0), L = x.size(1), row = x.size(2) * x.size(3);
  Tensor out = Tensor::empty({B, t1 - t0, x.size(2), x.size(3)}, x.dtype());
  for (int64_t b = 0; b < B; ++b)
    out.view(b * (t1 - t0) * row, {(t1 - t0) * row}).copy_from(x.view((b * L + t0) * row, {(t1 - t0) * row}));
  return out;
}

inline double max_rel_err(const Tensor& got, const std::vector<double>& want, double floor) {
  double worst = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i)
    worst = std::max(worst, std::fabs(at(got, i) - want[size_t(i)]) /
                                std::max(std::fabs(want[size_t(i)]), floor));
  return worst;
}

// Runs f, expects a fourbit::Error whose message contains `needle`.
inline void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
  }
}

// An output of the function under test and the weights r of L = sum(r * output).
struct Weighted {
  const Tensor* out;
  const Tensor* r;
};

// Gradients smaller than this are compared absolutely: the central difference of an F64
// function with h = 1e-6 carries a rounding error of about 1e-10 * |output|.
constexpr double kFdFloor = 1e-3;
constexpr double kFdStep = 1e-6;

// Checks `analytic` = dL/dx for every element of the F64 tensor x by central differences:
// forward() recomputes the outputs from x. Returns the worst relative error
// |fd - analytic| / max(|analytic|, kFdFloor). The difference of L is taken output by output,
// so outputs that x does not reach cancel exactly.
inline double fd_check(Tensor& x, const Tensor& analytic, const std::vector<Weighted>& outs,
                       const std::function<void()>& forward) {
  EXPECT_EQ(x.dtype(), DType::F64);
  EXPECT_EQ(analytic.numel(), x.numel());
  double* xd = x.data<double>();
  std::vector<std::vector<double>> plus(outs.size());
  double worst = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = xd[i];
    xd[i] = x0 + kFdStep;
    forward();
    for (size_t o = 0; o < outs.size(); ++o) {
      const Tensor& t = *outs[o].out;
      plus[o].assign(t.data<double>(), t.data<double>() + t.numel());
    }
    xd[i] = x0 - kFdStep;
    forward();
    xd[i] = x0;
    long double diff = 0.0L;
    for (size_t o = 0; o < outs.size(); ++o) {
      const Tensor& t = *outs[o].out;
      const double* r = outs[o].r->data<double>();
      for (int64_t j = 0; j < t.numel(); ++j)
        diff += (long double)r[j] * ((long double)plus[o][size_t(j)] - t.data<double>()[j]);
    }
    const double fd = double(diff / (2.0L * kFdStep));
    const double an = at(analytic, i);
    const double err = std::fabs(fd - an) / std::max(std::fabs(an), kFdFloor);
    EXPECT_LT(err, 1e-6) << "element " << i << ": finite difference " << fd << ", analytic " << an;
    worst = std::max(worst, err);
  }
  forward();  // leave the outputs at x
  return worst;
}


// ops::draw_tokens on `dev` over logits [A, V] (copied there) with keys {sequence id, position}
// a row, read back: tokens, statuses and the log-probs' bits.
struct DrawnRows {
  std::vector<int32_t> tokens, status;
  std::vector<uint64_t> logprob_bits;
};
inline DrawnRows draw_rows(Device dev, const Tensor& logits, const ops::DrawSpec& spec,
                           const std::vector<int64_t>& keys) {
  const int64_t A = logits.size(0);
  Tensor tokens = Tensor::empty({A}, DType::I32, dev), logprobs = Tensor::empty({A}, DType::F64, dev),
         status = Tensor::empty({A}, DType::I32, dev);
  ops::draw_tokens(logits.to(dev), spec, Tensor::from_host(keys.data(), {A, 2}, DType::I64, dev), tokens, logprobs,
                   status);
  const Tensor t = tokens.to(Device::CPU), l = logprobs.to(Device::CPU), st = status.to(Device::CPU);
  DrawnRows d;
  d.tokens.assign(t.data<int32_t>(), t.data<int32_t>() + A);
  d.status.assign(st.data<int32_t>(), st.data<int32_t>() + A);
  d.logprob_bits.resize(size_t(A));
  std::memcpy(d.logprob_bits.data(), l.data<double>(), size_t(A) * sizeof(double));
  return d;
}

}  // namespace fourbit::optest
