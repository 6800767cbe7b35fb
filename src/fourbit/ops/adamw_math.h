// defines: AdamWConstants, check_adamw_args, adamw_constants, adamw_update, fill_gate
// The AdamW update as one definition for both backends (ops/cpu/adamw.cpp, ops/cuda/adamw.cu),
// so the two give the same bits. Per call, on the host: bc1 = 1 - b1^t and bc2 = 1 - b2^t in
// double (b^t by repeated squaring: a fixed sequence of IEEE multiplies, unlike pow()), each
// rounded to float once; 1 - b1 and 1 - b2 in float. Per element, in float, in this order, every
// operation rounded on its own (no FMA): g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// m_hat = m / bc1; v_hat = v / bc2; u = m_hat / (sqrt(v_hat) + eps); p = p - lr (u + wd p).
#pragma once
#include <cmath>
#include <cstdint>

#include "fourbit/numerics/hd.h"
#include "fourbit/ops/ops.h"
#include "fourbit/ops/tensor_checks.h"

namespace fourbit::ops {

struct AdamWConstants {
  float b1, b2, omb1, omb2, bc1, bc2, lr, eps, wd, grad_scale;
};

// One F32 parameter tensor and its gradient and moments on `dev`; bias correction needs t >= 1.
inline void check_adamw_args(Device dev, const Tensor& param, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const AdamW& h, const Tensor* param_bf16 = nullptr) {
  const char* op = "adamw_step";
  if (param_bf16 && (!param_bf16->defined() || param_bf16->dtype() != DType::BF16 ||
                     param_bf16->device() != dev || !param.defined() || param_bf16->numel() != param.numel()))
    fail("{}: param_bf16 must be a bf16 {} tensor of param's {} elements, got {}", op, device_name(dev),
         param.defined() ? param.numel() : 0, param_bf16->defined() ? param_bf16->str() : "an undefined tensor");
  if (!param.defined() || param.device() != dev || param.dtype() != DType::F32)
    fail("{}: param must be an f32 {} tensor, got {}", op, device_name(dev),
         param.defined() ? param.str() : "an undefined tensor");
  expect_like_on(dev, op, "grad", grad, "param", param);
  expect_like_on(dev, op, "m", m, "param", param);
  expect_like_on(dev, op, "v", v, "param", param);
  if (h.step < 1) fail("{}: step must be >= 1 (bias correction), got {}", op, h.step);
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f) || !(h.beta2 >= 0.0f && h.beta2 < 1.0f))
    fail("{}: beta1 and beta2 must be in [0, 1), got {} and {}", op, h.beta1, h.beta2);
}

inline AdamWConstants adamw_constants(const AdamW& h) {
  auto pow_by_squaring = [](double b, int64_t t) {
    double r = 1.0;
    for (; t > 0; t >>= 1, b *= b)
      if (t & 1) r *= b;
    return r;
  };
  AdamWConstants k;
  k.bc1 = float(1.0 - pow_by_squaring(double(h.beta1), h.step));
  k.bc2 = float(1.0 - pow_by_squaring(double(h.beta2), h.step));
  k.b1 = h.beta1;
  k.b2 = h.beta2;
  k.omb1 = 1.0f - h.beta1;
  k.omb2 = 1.0f - h.beta2;
  k.lr = h.lr;
  k.eps = h.eps;
  k.wd = h.weight_decay;
  k.grad_scale = h.grad_scale;
  return k;
}

FOURBIT_HD void adamw_update(float& p, float g_raw, float& m, float& v, const AdamWConstants& k) {
  using num::add_rn;
  using num::div_rn;
  using num::mul_rn;
  using num::sub_rn;
  const float g = mul_rn(g_raw, k.grad_scale);  // exact for 1; = scale_(grad) then the update
  m = add_rn(mul_rn(k.b1, m), mul_rn(k.omb1, g));
  v = add_rn(mul_rn(k.b2, v), mul_rn(k.omb2, mul_rn(g, g)));
  const float m_hat = div_rn(m, k.bc1);
  const float v_hat = div_rn(v, k.bc2);
  const float u = div_rn(m_hat, add_rn(num::sqrt_rn(v_hat), k.eps));
  p = sub_rn(p, mul_rn(k.lr, add_rn(u, mul_rn(k.wd, p))));  // wd * p before the update
}

// grad_norm_gate's fields (ops.h) from the per-tensor sums of squares, added in order, the
// quantizers' flag and the clip threshold: one definition for both backends (every step a
// correctly rounded double operation, then the clip factor rounded to float once, as
// Optimizer::step computed it on the host), so the CPU and a one-thread GPU kernel give the same
// bits as the host's loop.
FOURBIT_HD void fill_gate(const double* totals, int64_t count, double max_norm, bool quant_nonfinite, double* gate) {
  double sq = 0.0;
  for (int64_t i = 0; i < count; ++i) sq += totals[i];
  const double norm = sqrt(sq);
  const bool finite = norm <= 1.7976931348623157e308;  // false for NaN and +Inf (norm >= 0)
  gate[kGateNorm] = norm;
  gate[kGateClip] = max_norm > 0.0 && norm > max_norm ? double(float(max_norm / norm)) : 1.0;
  gate[kGateQuantNonfinite] = quant_nonfinite ? 1.0 : 0.0;
  gate[kGateSkip] = quant_nonfinite || !finite ? 1.0 : 0.0;
}

}  // namespace fourbit::ops
