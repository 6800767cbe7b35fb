// defines: cpu::adamw_step
// AdamW on F32 parameters and state; the update itself is ops/adamw_math.h, shared with the
// CUDA kernel so both backends give the same bits.
#include <cmath>

#include "fourbit/numerics/hd.h"
#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/adamw_math.h"
#include "fourbit/ops/cpu/cpu_ops.h"

namespace fourbit::ops::cpu {

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

  const AdamWConstants k = adamw_constants(h);
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* mm = m.data<float>();
  float* vv = v.data<float>();
  const int64_t n = param.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) adamw_update(p[i], g[i], mm[i], vv[i], k);
}

}  // namespace fourbit::ops::cpu
