// defines: cuda::kFullMask, cuda::warp_sum, cuda::warp_max, cuda::block_sum, cuda::block_max
// Fixed-tree reductions for the row kernels (DESIGN "Exactness": a row is reduced one row per
// thread group in an order that never depends on the number of rows).
//  - warp: an xor butterfly over the 32 lanes. Each step adds a lane's value to its partner's,
//    a + b on one lane and b + a on the other: IEEE addition is commutative, so every lane ends
//    with the same bits, and the tree is the same for every row and every launch.
//  - block: each warp's total goes to shared memory; then every warp reduces those totals with the
//    same butterfly (so no second broadcast is needed). Missing lanes contribute 0 (or -inf for
//    max), which leaves the result unchanged.
// Sums run in double: the CPU reference accumulates in double, and a double tree differs from its
// sequential sum by ~1e-16 relative, far below float resolution, so results match it after the
// final rounding to float in all but rare ties.
#pragma once
#include <cuda_runtime.h>

namespace fourbit::ops::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// fmaxf ignores a NaN operand; callers that need NaN to propagate get it through a later sum.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// kThreads (a multiple of 32, at most 1024) threads of the block all call this with their partial;
// all get the total. `scratch` holds kThreads / 32 values; it is free again when this returns.
template <int kThreads>
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block_sum: whole warps only");
  constexpr int kWarps = kThreads / 32;
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  double t = lane < kWarps ? scratch[lane] : 0.0;
  t = warp_sum(t);
  __syncthreads();  // scratch may be reused by the caller's next reduction
  return t;
}

template <int kThreads>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block_max: whole warps only");
  constexpr int kWarps = kThreads / 32;
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  float t = lane < kWarps ? scratch[lane] : -INFINITY;
  t = warp_max(t);
  __syncthreads();
  return t;
}

}  // namespace fourbit::ops::cuda
