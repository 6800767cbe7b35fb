// defines: cuda::adamw_step
// AdamW on GPU F32 parameters and state, with the order of operations that ops/cpu/adamw.cpp
// fixes as the contract (see the comment there): every step is one IEEE float operation, never
// fused (num::mul_rn/add_rn/sub_rn, __fdiv_rn, __fsqrt_rn), and the two bias corrections are
// computed on the host exactly as the CPU computes them. The two backends therefore give the same
// bits. Elementwise, four elements per thread (float4 when the four tensors are 16-byte aligned);
// optionally also the updated parameters' BF16 rounding (the bf16 recipe's weight copies) and each
// slice's amax (the next forward's NVFP4 outer scales), and optionally gated on the device by
// grad_norm_gate (tensor_utils.cu): skipped, or clipped.
#include "fourbit/numerics/hd.h"
#include "fourbit/ops/adamw_math.h"
#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/vec4.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
// Elements a CTA of adamw_amax_kernel: 4 groups of four a thread, ~4 000 CTAs for an expert
// weight's update (16 M elements in gpu-small), as many as the grid-stride update fills the GPU
// with. On an H100, 16 groups ran at ~0.9 of the grid-stride update's rate and 64 groups (256
// CTAs, two an SM) at half of it (bench/results/cuda-log.md, session 52).
constexpr int64_t kAmaxChunk = 4 * 4 * kThreads;

// The four elements from i (of n): updated unless `skip`, and (kAmax) their max |p| after it
// folded into a (elements past n load as zeros, which leave a max of magnitudes as it is).
template <bool kAmax>
__device__ __forceinline__ void adamw_four(float* param, const float* grad, float* m, float* v, uint16_t* param_bf16,
                                           int64_t i, int64_t n, bool vec, bool vec_bf16, const AdamWConstants& k,
                                           bool skip, float& a) {
  float p[4];
  load4(param, i, n, vec, p);
  if (!skip) {
    float gr[4], mm[4], vv[4];
    load4(grad, i, n, vec, gr);
    load4(m, i, n, vec, mm);
    load4(v, i, n, vec, vv);
#pragma unroll
    for (int c = 0; c < 4; ++c) adamw_update(p[c], gr[c], mm[c], vv[c], k);
    store4(param, i, n, vec, p);
    store4(m, i, n, vec, mm);
    store4(v, i, n, vec, vv);
    if (param_bf16) store4(param_bf16, i, n, vec_bf16, p);  // bf16_encode of each: convert's bits
  }
  if constexpr (kAmax) {
#pragma unroll
    for (int c = 0; c < 4; ++c) a = num::max_abs_finite(a, p[c]);
  }
}

__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* param, const float* grad, float* m, float* v, uint16_t* param_bf16, int64_t n, bool vec,
                 bool vec_bf16, AdamWConstants k, const double* gate) {
  if (gate) {  // grad_norm_gate's verdict, read where the update runs: no host round trip first
    if (gate[kGateSkip] != 0.0) return;
    k.grad_scale = float(gate[kGateClip]);  // a float value: exact
  }
  float unused = 0.0f;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; 4 * g < n; g += int64_t(gridDim.x) * blockDim.x)
    adamw_four<false>(param, grad, m, v, param_bf16, 4 * g, n, vec, vec_bf16, k, false, unused);
}

// The update with each slice's amax (ops::SliceAmax): CTA b takes chunk b % chunks of slice
// b / chunks and raises amax[slice] (float bits: non-negative floats order as their bits) to the
// chunk's max. Where the gate skips the update, the amax of the unchanged parameters.
__global__ void __launch_bounds__(kThreads)
    adamw_amax_kernel(float* param, const float* grad, float* m, float* v, uint16_t* param_bf16, int64_t slice,
                      int64_t chunks, bool vec, bool vec_bf16, AdamWConstants k, const double* gate, uint32_t* amax) {
  bool skip = false;
  if (gate) {
    skip = gate[kGateSkip] != 0.0;
    k.grad_scale = float(gate[kGateClip]);
  }
  const int64_t s = blockIdx.x / chunks, lo = s * slice + (blockIdx.x % chunks) * kAmaxChunk;
  const int64_t len = (s + 1) * slice - lo < kAmaxChunk ? (s + 1) * slice - lo : kAmaxChunk;
  float a = 0.0f;
  for (int64_t i = 4 * int64_t(threadIdx.x); i < len; i += 4 * kThreads)
    adamw_four<true>(param + lo, grad + lo, m + lo, v + lo, param_bf16 ? param_bf16 + lo : nullptr, i, len, vec,
                     vec_bf16, k, skip, a);
  __shared__ uint32_t warp_max[kThreads / 32];
  const uint32_t w = __reduce_max_sync(0xffffffffu, num::bits_of(a));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = w;
  __syncthreads();
  if (threadIdx.x < 32) {
    const uint32_t all = __reduce_max_sync(0xffffffffu, threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u);
    if (threadIdx.x == 0 && all) atomicMax(amax + s, all);
  }
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h, Tensor* param_bf16,
                const Tensor* gate, const SliceAmax& slice_amax) {
  check_adamw_args(Device::CUDA, param, grad, m, v, h, param_bf16);
  const int64_t n = param.numel();
  if (n == 0) return;

  const AdamWConstants k = adamw_constants(h);
  const bool vec = aligned16(param.raw()) && aligned16(grad.raw()) && aligned16(m.raw()) &&
                   aligned16(v.raw());
  uint16_t* p16 = param_bf16 ? param_bf16->data<uint16_t>() : nullptr;
  const bool vec_bf16 = p16 && reinterpret_cast<uintptr_t>(p16) % 8 == 0;
  const double* g = gate ? gate->data<double>() : nullptr;
  if (slice_amax.amax) {
    // a chunk starts at a multiple of 4 elements of its slice: at 16 (8) bytes where slices do
    const int64_t sl = slice_amax.slice, chunks = (sl + kAmaxChunk - 1) / kAmaxChunk, ctas = (n / sl) * chunks;
    if (ctas >= (int64_t(1) << 31)) fail("adamw_step: {} elements in slices of {} need too many blocks", n, sl);
    adamw_amax_kernel<<<unsigned(ctas), kThreads, 0, stream()>>>(
        param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), p16, sl, chunks,
        vec && sl % 4 == 0, vec_bf16 && sl % 4 == 0, k, g, reinterpret_cast<uint32_t*>(slice_amax.amax->data<float>()));
  } else {
    adamw_kernel<<<grid_for((n + 3) / 4, kThreads), kThreads, 0, stream()>>>(
        param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), p16, n, vec, vec_bf16, k, g);
  }
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace fourbit::ops::cuda
