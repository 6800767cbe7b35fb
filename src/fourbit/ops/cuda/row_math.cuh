// defines: kNormBatch, rmsnorm_row_rstd, rmsnorm_value, rmsnorm_row, sigmoid, swiglu_value, swiglu_grads
// The per-row formulas of rmsnorm_forward and swiglu_forward, shared by their kernels (layers.cu)
// and the kernels that also quantize the rows they write (fused_rows.cu), so that both give the
// same bits: arithmetic in double, each output rounded once to float (layers.cu's header).
#pragma once
#include <cstdint>

#include "fourbit/numerics/bf16.h"
#include "fourbit/ops/cuda/reduce.cuh"
#include "fourbit/ops/cuda/vec4.cuh"

namespace fourbit::ops::cuda {
namespace {

// RMSNorm of row n of x [N, D] (with b: of x + b, add_'s F32 sum, written to `sum` and read back
// from the thread's own writes in the second pass) by one warp. A lane sums its groups of four
// g = lane, lane + 32, ... in that order, then the warp's butterfly: the order fixes the bits. The
// groups go kNormBatch at a time, all their loads issued before the first use: at decode sizes (a
// few rows, D = 1024: 8 groups a lane) the row is one batch, so a pass costs one memory latency
// instead of 8 in a row.
constexpr int kNormBatch = 8;

// The first pass: the row's rstd, rounded to float (the stored value, which backward sees, so y
// is computed from it too), stored by lane 0 and returned to every lane.
__device__ __forceinline__ float rmsnorm_row_rstd(const float* x, double eps, float* rstd, int64_t n, int64_t D,
                                                  bool vec, const float* b, float* sum) {
  const int lane = int(threadIdx.x % 32);
  const int64_t groups = (D + 3) / 4;
  double ss = 0.0;
  for (int64_t g0 = lane; g0 < groups; g0 += 32 * kNormBatch) {
    float v[kNormBatch][4];
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int64_t g = g0 + 32 * u;
      if (g >= groups) continue;
      load4(x + n * D, 4 * g, D, vec, v[u]);
      if (b) {
        float bv[4];
        load4(b + n * D, 4 * g, D, vec, bv);
#pragma unroll
        for (int c = 0; c < 4; ++c) v[u][c] = num::add_rn(v[u][c], bv[c]);
        store4(sum + n * D, 4 * g, D, vec, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u)
      if (g0 + 32 * u < groups)
#pragma unroll
        for (int c = 0; c < 4; ++c) ss += double(v[u][c]) * double(v[u][c]);
  }
  ss = warp_sum(ss);
  const float rs = float(1.0 / sqrt(ss / double(D) + eps));
  if (lane == 0) rstd[n] = rs;
  return rs;
}

// y = x * rstd * w of one element, in double, rounded once.
__device__ __forceinline__ float rmsnorm_value(float x, float rs, float w) {
  return float(double(x) * double(rs) * double(w));
}

// The whole row by one warp: the first pass, then emit(g, out) takes group g's four outputs
// (columns 4g .. 4g + 3, fewer in a last partial group).
template <typename Emit>
__device__ __forceinline__ void rmsnorm_row(const float* x, const float* w, double eps, float* rstd, int64_t n,
                                            int64_t D, bool vec, const float* b, float* sum, Emit&& emit) {
  const int lane = int(threadIdx.x % 32);
  const int64_t groups = (D + 3) / 4;
  const float* xr = b ? sum + n * D : x + n * D;
  const float rs = rmsnorm_row_rstd(x, eps, rstd, n, D, vec, b, sum);
  for (int64_t g0 = lane; g0 < groups; g0 += 32 * kNormBatch) {
    float xv[kNormBatch][4], wv[kNormBatch][4];
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int64_t g = g0 + 32 * u;
      if (g >= groups) continue;
      load4(xr, 4 * g, D, vec, xv[u]);
      load4(w, 4 * g, D, vec, wv[u]);
    }
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int64_t g = g0 + 32 * u;
      if (g >= groups) continue;
      float out[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) out[c] = rmsnorm_value(xv[u][c], rs, wv[u][c]);
      emit(g, out);
    }
  }
}

__device__ __forceinline__ double sigmoid(double z) { return 1.0 / (1.0 + exp(-z)); }

// silu(z) * u in double, rounded once: swiglu_forward's element.
__device__ __forceinline__ float swiglu_value(float z, float u) {
  const double zz = double(z);
  return float(zz * sigmoid(zz) * double(u));
}

// swiglu_backward's two elements, in double, each rounded once: dh1 = da u silu'(z) and
// dh3 = da silu(z), with silu'(z) = s (1 + z (1 - s)), s = sigmoid(z).
__device__ __forceinline__ void swiglu_grads(float da, float z, float u, float& dh1, float& dh3) {
  const double zz = double(z), s = sigmoid(zz), gg = double(da);
  const double dsilu = s * (1.0 + zz * (1.0 - s));
  dh1 = float(gg * double(u) * dsilu);
  dh3 = float(gg * zz * s);
}

}  // namespace
}  // namespace fourbit::ops::cuda
