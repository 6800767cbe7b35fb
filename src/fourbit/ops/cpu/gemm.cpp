// defines: cpu::gemm
// The CPU GEMM: C[m, n] = sum_k A(m, k) B(n, k). Each C element is one chain of fused
// multiply-adds over k ascending, starting from zero — the same chain whether it is computed in
// an AVX2 register lane or by std::fma in the scalar path, for any M, N or thread count. That is
// what makes rows batch invariant and runs deterministic (DESIGN "Exactness"); it costs the
// split-K and k-blocking freedom a BLAS uses (see bench/cpu_gemm for the price against OpenBLAS).
//
// Quantized operands are first decoded exactly to float (NVFP4: E2M1 x E4M3 without the outer
// scale; MXFP8/S2F6: element x 2^E); NVFP4 outer scales multiply the finished sum, A's per row
// and then B's per column (NUMERICS "GEMMs"), which is also how the GPU applies them.
#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "fourbit/numerics/bf16.h"
#include "fourbit/ops/cpu/cpu_ops.h"
#include "fourbit/ops/cpu/qdecode.h"

namespace fourbit::ops::cpu {
namespace {

constexpr int64_t kMR = 4;   // rows of C per micro-tile
constexpr int64_t kNR = 16;  // columns of C per micro-tile (two 8-float vectors)

// An operand as a dense row-major [rows, k_eff] matrix of T plus the scale its rows carry.
template <typename T>
struct Dense {
  std::vector<T> owned;
  const T* data = nullptr;
  std::vector<float> row_scale;  // empty: no scale
};

template <typename T>
void decode_qtensor_rows(const QTensor& q, int64_t k_eff, T* out) {
  const QRowDecoder dec(q);
  const int64_t R = q.total_rows(), PC = q.padded_cols();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    dec.row(r, out + r * k_eff, false);
    std::fill(out + r * k_eff + PC, out + (r + 1) * k_eff, T(0));
  }
}

template <typename T>
Dense<T> materialize(const Operand& op, int64_t k_eff) {
  Dense<T> d;
  const int64_t R = op.rows();
  if (const QTensor* q = op.q()) {
    if (q->slices != 1 && q->outer == OuterScale::PerSlice)
      fail("gemm: a multi-slice QTensor with per-slice scales must be sliced first (qtensor_slice)");
    d.owned.resize(size_t(R * k_eff));
    decode_qtensor_rows(*q, k_eff, d.owned.data());
    d.data = d.owned.data();
    if (q->outer != OuterScale::None) {
      const float* s = q->outer_scales.data<float>();
      d.row_scale.resize(size_t(R));
      for (int64_t r = 0; r < R; ++r) d.row_scale[size_t(r)] = s[q->outer_index(r)];
    }
    return d;
  }
  const Tensor& t = *op.dense();
  if (t.dim() != 2) fail("gemm: dense operand must be 2-D, got {}", t.str());
  const int64_t K = op.k();
  const DType dt = t.dtype();
  if (dt != DType::F32 && dt != DType::BF16 && dt != DType::F64)
    fail("gemm: dense operand must be f32, bf16 or f64, got {}", t.str());
  if (std::is_same_v<T, float> && dt == DType::F32 && !op.trans() && K == k_eff) {
    d.data = reinterpret_cast<const T*>(t.data<float>());  // use in place
    return d;
  }
  if (std::is_same_v<T, double> && dt == DType::F64 && !op.trans() && K == k_eff) {
    d.data = reinterpret_cast<const T*>(t.data<double>());
    return d;
  }
  d.owned.assign(size_t(R * k_eff), T(0));
  auto value = [&](int64_t i) -> T {
    switch (dt) {
      case DType::F32: return T(t.data<float>()[i]);
      case DType::F64: return T(t.data<double>()[i]);
      default: return T(num::bf16_decode(t.data<uint16_t>()[i]));
    }
  };
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k)
      d.owned[size_t(r * k_eff + k)] = op.trans() ? value(k * R + r) : value(r * K + k);
  d.data = d.owned.data();
  return d;
}

// acc[i][j] = fma chain over k of a[i][k] * bt[k][j] for a 4 x 16 tile; bt is the packed panel.
template <typename T>
void micro_tile(const T* const a_rows[kMR], const T* bt, int64_t K, T acc[kMR][kNR]) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    __m256 c[kMR][2];
    for (int i = 0; i < kMR; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(bt + k * kNR);
      const __m256 b1 = _mm256_loadu_ps(bt + k * kNR + 8);
      for (int i = 0; i < kMR; ++i) {
        const __m256 ai = _mm256_broadcast_ss(a_rows[i] + k);
        c[i][0] = _mm256_fmadd_ps(ai, b0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(ai, b1, c[i][1]);
      }
    }
    for (int i = 0; i < kMR; ++i) {
      _mm256_storeu_ps(acc[i], c[i][0]);
      _mm256_storeu_ps(acc[i] + 8, c[i][1]);
    }
    return;
  }
#endif
  for (int i = 0; i < kMR; ++i)
    for (int j = 0; j < kNR; ++j) acc[i][j] = T(0);
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < kMR; ++i) {
      const T ai = a_rows[i][k];
      for (int j = 0; j < kNR; ++j) acc[i][j] = std::fma(ai, bt[k * kNR + j], acc[i][j]);
    }
}

template <typename T>
void gemm_typed(const Operand& a, const Operand& b, Tensor& c, bool accumulate) {
  auto padded = [](const Operand& op) { return op.q() ? op.q()->padded_cols() : op.k(); };
  const int64_t k_eff = std::max(padded(a), padded(b));
  const Dense<T> A = materialize<T>(a, k_eff);
  const Dense<T> B = materialize<T>(b, k_eff);
  const int64_t M = a.rows(), N = b.rows();
  T* C = c.data<T>();
  const std::vector<T> zero_row(size_t(k_eff), T(0));
  const int64_t n_panels = (N + kNR - 1) / kNR;

#pragma omp parallel
  {
    std::vector<T> bt(size_t(k_eff * kNR));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < n_panels; ++p) {
      const int64_t n0 = p * kNR, nn = std::min(kNR, N - n0);
      for (int64_t k = 0; k < k_eff; ++k)
        for (int64_t j = 0; j < kNR; ++j)
          bt[size_t(k * kNR + j)] = j < nn ? B.data[(n0 + j) * k_eff + k] : T(0);
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int64_t mm = std::min(kMR, M - m0);
        const T* rows[kMR];
        for (int64_t i = 0; i < kMR; ++i) rows[i] = i < mm ? A.data + (m0 + i) * k_eff : zero_row.data();
        T acc[kMR][kNR];
        micro_tile<T>(rows, bt.data(), k_eff, acc);
        for (int64_t i = 0; i < mm; ++i)
          for (int64_t j = 0; j < nn; ++j) {
            T r = acc[i][j];
            if (!A.row_scale.empty()) r = r * T(A.row_scale[size_t(m0 + i)]);
            if (!B.row_scale.empty()) r = r * T(B.row_scale[size_t(n0 + j)]);
            T& dst = C[(m0 + i) * N + n0 + j];
            dst = accumulate ? dst + r : r;
          }
      }
    }
  }
}

bool is_f64(const Operand& op) { return op.dense() && op.dense()->dtype() == DType::F64; }

}  // namespace

void gemm(const Operand& a, const Operand& b, Tensor& c, bool accumulate) {
  if (is_f64(a) != is_f64(b)) fail("gemm: f64 operands must be paired with f64 operands");
  if (is_f64(a)) {
    if (c.dtype() != DType::F64) fail("gemm: f64 operands need an f64 output, got {}", c.str());
    gemm_typed<double>(a, b, c, accumulate);
  } else {
    if (c.dtype() != DType::F32) fail("gemm: output must be f32, got {}", c.str());
    gemm_typed<float>(a, b, c, accumulate);
  }
}

}  // namespace fourbit::ops::cpu
