// defines: cpu::adamw_step
// AdamW on F32 parameters and state. The order of operations below is the contract the CUDA
// kernel copies, so both backends give the same bits (every step is one IEEE float operation,
// never fused: host code is built with -ffp-contract=off, the device uses the _rn intrinsics).
//
// Once per call, in double, each rounded to float once:
//   bc1 = float(1 - b1^t),  bc2 = float(1 - b2^t)   with b^t by binary exponentiation of
//                                                   double(b) (exact IEEE multiplies, no pow())
// Once per call, in float:  omb1 = 1 - b1,  omb2 = 1 - b2
// Per element, in float, in this order:
//   m     = b1 * m + omb1 * g
//   v     = b2 * v + omb2 * (g * g)
//   m_hat = m / bc1
//   v_hat = v / bc2
//   u     = m_hat / (sqrt(v_hat) + eps)                 (sqrt correctly rounded)
//   p     = p - lr * (u + wd * p)                       (wd * p uses p before the update)
#include <cmath>

#include "fourbit/numerics/hd.h"
#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/cpu/cpu_ops.h"

namespace fourbit::ops::cpu {
namespace {

// b^t by squaring: a fixed sequence of IEEE double multiplies, reproducible on any backend
// (library pow() is not guaranteed to be correctly rounded).
double pow_by_squaring(double b, int64_t t) {
  double r = 1.0;
  while (t > 0) {
    if (t & 1) r *= b;
    b *= b;
    t >>= 1;
  }
  return r;
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h) {
  const char* op = "adamw_step";
  if (!param.defined() || param.device() != Device::CPU || param.dtype() != DType::F32)
    fail("{}: param must be an f32 cpu tensor, got {}", op,
         param.defined() ? param.str() : "an undefined tensor");
  expect_like(op, "grad", grad, "param", param);
  expect_like(op, "m", m, "param", param);
  expect_like(op, "v", v, "param", param);
  if (h.step < 1) fail("{}: step must be >= 1 (bias correction), got {}", op, h.step);
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f) || !(h.beta2 >= 0.0f && h.beta2 < 1.0f))
    fail("{}: beta1 and beta2 must be in [0, 1), got {} and {}", op, h.beta1, h.beta2);

  const float bc1 = float(1.0 - pow_by_squaring(double(h.beta1), h.step));
  const float bc2 = float(1.0 - pow_by_squaring(double(h.beta2), h.step));
  const float b1 = h.beta1, b2 = h.beta2, omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  const float lr = h.lr, eps = h.eps, wd = h.weight_decay;

  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* mm = m.data<float>();
  float* vv = v.data<float>();
  const int64_t n = param.numel();
  using num::add_rn;
  using num::mul_rn;
  using num::sub_rn;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = add_rn(mul_rn(b1, mm[i]), mul_rn(omb1, gi));
    const float vi = add_rn(mul_rn(b2, vv[i]), mul_rn(omb2, mul_rn(gi, gi)));
    const float m_hat = mi / bc1;
    const float v_hat = vi / bc2;
    const float u = m_hat / add_rn(std::sqrt(v_hat), eps);
    mm[i] = mi;
    vv[i] = vi;
    p[i] = sub_rn(p[i], mul_rn(lr, add_rn(u, mul_rn(wd, p[i]))));
  }
}

}  // namespace fourbit::ops::cpu
