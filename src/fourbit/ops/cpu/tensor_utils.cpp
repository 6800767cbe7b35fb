// defines: cpu::convert, cpu::add_, cpu::add, cpu::scale_, cpu::sum_squares, cpu::sum_squares_each, cpu::fill_, cpu::running_segment_amax
// Elementwise utilities over F32, F64 and BF16 CPU tensors. BF16 values are decoded to float,
// computed on, and encoded once with num::bf16_encode (RNE), so a BF16 result is the rounding of
// the float result.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fourbit/numerics/bf16.h"
#include "fourbit/ops/cpu/cpu_ops.h"
#include "fourbit/ops/tensor_checks.h"

namespace fourbit::ops::cpu {
namespace {

bool is_value_dtype(DType t) { return t == DType::F32 || t == DType::F64 || t == DType::BF16; }

void expect_value(const char* op, const char* name, const Tensor& t) {
  if (!t.defined()) fail("{}: {} is undefined", op, name);
  if (t.device() != Device::CPU || !is_value_dtype(t.dtype()))
    fail("{}: {} must be an f32, f64 or bf16 cpu tensor, got {}", op, name, t.str());
}

// Loads and stores every value dtype as double (exact for all three).
double load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return double(static_cast<const float*>(p)[i]);
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::BF16: return double(num::bf16_decode(static_cast<const uint16_t*>(p)[i]));
    default: break;
  }
  fail("tensor utility: unsupported dtype {}", dtype_name(t));
}

// Stores a value already computed in the destination's arithmetic (see callers).
void store(void* p, DType t, int64_t i, double x) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = float(x); return;
    case DType::F64: static_cast<double*>(p)[i] = x; return;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = num::bf16_encode_f64(x); return;
    default: break;
  }
  fail("tensor utility: unsupported dtype {}", dtype_name(t));
}

// Fixed chunk for sum_squares: partials per chunk, combined in chunk order, so the result is
// the same for every thread count.
constexpr int64_t kSumChunk = 1 << 14;

}  // namespace

void convert(const Tensor& src, Tensor& dst) {
  expect_value("convert", "src", src);
  expect_value("convert", "dst", dst);
  if (src.numel() != dst.numel())
    fail("convert: src {} and dst {} differ in element count", src.str(), dst.str());
  const int64_t n = src.numel();
  const DType st = src.dtype(), dt = dst.dtype();
  if (st == dt) {
    std::memcpy(dst.raw(), src.raw(), size_t(src.nbytes()));
    return;
  }
  const void* s = src.raw();
  void* d = dst.raw();
  // Every value dtype widens exactly to double; the store rounds once (RNE) to the target.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) store(d, dt, i, load(s, st, i));
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  expect_add_args(a, b, out, expect_value);
  const int64_t n = a.numel();
  switch (a.dtype()) {
    case DType::F32: {
      const float *x = a.data<float>(), *y = b.data<float>();
      float* d = out.data<float>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = x[i] + y[i];
      return;
    }
    case DType::F64: {
      const double *x = a.data<double>(), *y = b.data<double>();
      double* d = out.data<double>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = x[i] + y[i];
      return;
    }
    default: {  // BF16: float sum, one rounding
      const uint16_t *x = a.data<uint16_t>(), *y = b.data<uint16_t>();
      uint16_t* d = out.data<uint16_t>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = num::bf16_encode(num::bf16_decode(x[i]) + num::bf16_decode(y[i]));
      return;
    }
  }
}

void add_(Tensor& dst, const Tensor& src) {
  expect_value("add_", "dst", dst);
  expect_value("add_", "src", src);
  expect_add_inplace_args(dst, src);
  add(dst, src, dst);
}

// The factor is rounded to the tensor's arithmetic once (float for F32 and BF16) and every element
// is multiplied by it: the CUDA kernel does the same.
void scale_(Tensor& t, double s) {
  expect_value("scale_", "t", t);
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::F32: {
      float* d = t.data<float>();
      const float f = float(s);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] *= f;
      return;
    }
    case DType::F64: {
      double* d = t.data<double>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] *= s;
      return;
    }
    default: {
      uint16_t* d = t.data<uint16_t>();
      const float f = float(s);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = num::bf16_encode(num::bf16_decode(d[i]) * f);
      return;
    }
  }
}

double sum_squares(const Tensor& t) {
  expect_value("sum_squares", "t", t);
  const int64_t n = t.numel();
  const int64_t chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
  const void* p = t.raw();
  const DType dt = t.dtype();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double acc = 0.0;
    for (int64_t i = c * kSumChunk; i < std::min(n, (c + 1) * kSumChunk); ++i) {
      const double x = load(p, dt, i);
      acc += x * x;
    }
    partial[size_t(c)] = acc;
  }
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

std::vector<double> sum_squares_each(const std::vector<Tensor>& ts) {
  std::vector<double> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(sum_squares(t));
  return out;
}

void fill_(Tensor& t, double v) {
  expect_value("fill_", "t", t);
  const int64_t n = t.numel();
  void* p = t.raw();
  const DType dt = t.dtype();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) store(p, dt, i, v);
}

void running_segment_amax(const Tensor& x, const Tensor& rows, const std::vector<int64_t>& offsets, Tensor& amax) {
  const char* op = "running_segment_amax";
  const int64_t M = expect_segment_amax_args(Device::CPU, op, x, rows, offsets, amax);
  const int64_t R = x.size(0), C = x.size(1);
  const int32_t* idx = rows.defined() ? rows.data<int32_t>() : nullptr;
  if (idx)
    for (int64_t j = 0; j < M; ++j)
      if (idx[j] < 0 || idx[j] >= R) fail("{}: rows[{}] = {} is outside [0, R={})", op, j, idx[j], R);
  const float* xp = x.data<float>();
  float* out = amax.data<float>();
  const int64_t G = int64_t(offsets.size()) - 1;
  // One segment per thread: a max needs no fixed order to be exact.
#pragma omp parallel for schedule(dynamic)
  for (int64_t g = 0; g < G; ++g) {
    float m = out[g];
    for (int64_t j = offsets[size_t(g)]; j < offsets[size_t(g) + 1]; ++j) {
      const float* row = xp + (idx ? int64_t(idx[j]) : j) * C;
      for (int64_t c = 0; c < C; ++c) {
        const float a = std::fabs(row[c]);
        if (std::isfinite(a) && a > m) m = a;
      }
    }
    out[g] = m;
  }
}

}  // namespace fourbit::ops::cpu
