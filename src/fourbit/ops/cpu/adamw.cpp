// defines: cpu::adamw_step, cpu::grad_norm_gate
// AdamW on F32 parameters and state; the update itself is ops/adamw_math.h, shared with the
// CUDA kernel so both backends give the same bits.
#include <cmath>

#include "fourbit/numerics/bf16.h"
#include "fourbit/numerics/hd.h"
#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/adamw_math.h"
#include "fourbit/ops/cpu/cpu_ops.h"

namespace fourbit::ops::cpu {

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h, Tensor* param_bf16,
                const Tensor* gate, const SliceAmax& slice_amax) {
  check_adamw_args(Device::CPU, param, grad, m, v, h, param_bf16);
  float* p = param.data<float>();
  const int64_t n = param.numel();
  if (!(gate && gate->data<double>()[kGateSkip] != 0.0)) {
    AdamWConstants k = adamw_constants(h);
    if (gate) k.grad_scale = float(gate->data<double>()[kGateClip]);  // a float value: exact
    const float* g = grad.data<float>();
    float* mm = m.data<float>();
    float* vv = v.data<float>();
    uint16_t* p16 = param_bf16 ? param_bf16->data<uint16_t>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      adamw_update(p[i], g[i], mm[i], vv[i], k);
      if (p16) p16[i] = num::bf16_encode(p[i]);
    }
  }
  if (slice_amax.amax) {  // a max: the same in any order
    float* amax = slice_amax.amax->data<float>();
    const int64_t sl = slice_amax.slice;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n / sl; ++s) {
      float a = amax[s];
      for (int64_t i = s * sl; i < (s + 1) * sl; ++i) a = num::max_abs_finite(a, p[i]);
      amax[s] = a;
    }
  }
}

void grad_norm_gate(const std::vector<Tensor>& grads, double max_norm, bool host_nonfinite, Tensor& gate) {
  const std::vector<double> totals = sum_squares_each(grads);
  fill_gate(totals.data(), int64_t(totals.size()), max_norm, host_nonfinite, gate.data<double>());
}

}  // namespace fourbit::ops::cpu
