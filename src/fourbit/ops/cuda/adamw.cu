// defines: cuda::adamw_step
// AdamW on GPU F32 parameters and state, with the order of operations that ops/cpu/adamw.cpp
// fixes as the contract (see the comment there): every step is one IEEE float operation, never
// fused (num::mul_rn/add_rn/sub_rn, __fdiv_rn, __fsqrt_rn), and the two bias corrections are
// computed on the host exactly as the CPU computes them. The two backends therefore give the same
// bits. Elementwise, four elements per thread (float4 when the four tensors are 16-byte aligned);
// optionally also the updated parameters' BF16 rounding (the bf16 recipe's weight copies), and
// optionally gated on the device by grad_norm_gate (tensor_utils.cu): skipped, or clipped.
#include "fourbit/ops/adamw_math.h"
#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/vec4.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* param, const float* grad, float* m, float* v, uint16_t* param_bf16, int64_t n, bool vec,
                 bool vec_bf16, AdamWConstants k, const double* gate) {
  if (gate) {  // grad_norm_gate's verdict, read where the update runs: no host round trip first
    if (gate[kGateSkip] != 0.0) return;
    k.grad_scale = float(gate[kGateClip]);  // a float value: exact
  }
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    float p[4], gr[4], mm[4], vv[4];
    load4(param, 4 * g, n, vec, p);
    load4(grad, 4 * g, n, vec, gr);
    load4(m, 4 * g, n, vec, mm);
    load4(v, 4 * g, n, vec, vv);
#pragma unroll
    for (int c = 0; c < 4; ++c) adamw_update(p[c], gr[c], mm[c], vv[c], k);
    store4(param, 4 * g, n, vec, p);
    store4(m, 4 * g, n, vec, mm);
    store4(v, 4 * g, n, vec, vv);
    if (param_bf16) store4(param_bf16, 4 * g, n, vec_bf16, p);  // bf16_encode of each: convert's bits
  }
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h, Tensor* param_bf16,
                const Tensor* gate) {
  check_adamw_args(Device::CUDA, param, grad, m, v, h, param_bf16);
  const int64_t n = param.numel();
  if (n == 0) return;

  const AdamWConstants k = adamw_constants(h);
  const bool vec = aligned16(param.raw()) && aligned16(grad.raw()) && aligned16(m.raw()) &&
                   aligned16(v.raw());
  uint16_t* p16 = param_bf16 ? param_bf16->data<uint16_t>() : nullptr;
  const bool vec_bf16 = p16 && reinterpret_cast<uintptr_t>(p16) % 8 == 0;
  adamw_kernel<<<grid_for((n + 3) / 4, kThreads), kThreads, 0, stream()>>>(
      param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), p16, n, vec, vec_bf16, k,
      gate ? gate->data<double>() : nullptr);
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace fourbit::ops::cuda
