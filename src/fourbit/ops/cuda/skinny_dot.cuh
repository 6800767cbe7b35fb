// defines: cuda::skinny_warp_sum, cuda::skinny_dot_lane
// One element of the FP32 skinny GEMM (skinny_gemm.cu: the router's forward, C = A B^T with at most
// 32 output columns) on one warp, shared by its cols_kernel and the fused decode routing (moe.cu),
// which must give the router GEMM's bits: lane l sums the k of 4-column groups l, l + 32, ... of
// each 256-wide K tile in ascending order with FP32 FMAs (zeros past K), then the 32 lane sums are
// added by the xor butterfly, after which every lane holds the element. VEC: A's and B's rows read
// 16 bytes at a time (16-byte aligned rows; the same values in the same order).
#pragma once
#include <cstdint>

namespace fourbit::ops::cuda {

constexpr int kSkinnyTileK = 256;  // the K tile of the skinny GEMM's kernels

__device__ __forceinline__ float skinny_warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Lane `lane`'s partial sum of the row product ar . br over K (before skinny_warp_sum).
template <bool VEC>
__device__ __forceinline__ float skinny_dot_lane(const float* __restrict__ ar, const float* __restrict__ br, int64_t K,
                                                 int lane) {
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kSkinnyTileK) {
    const int64_t kend = K - k0 < kSkinnyTileK ? K - k0 : kSkinnyTileK;
#pragma unroll
    for (int g = 0; g < kSkinnyTileK / 128; ++g) {
      const int kk = 4 * (lane + 32 * g);
      if (kk >= kend) break;
      float a[4], b[4];
      if (VEC && kk + 3 < kend) {
        const float4 qa = *reinterpret_cast<const float4*>(ar + k0 + kk);
        const float4 qb = *reinterpret_cast<const float4*>(br + k0 + kk);
        a[0] = qa.x, a[1] = qa.y, a[2] = qa.z, a[3] = qa.w;
        b[0] = qb.x, b[1] = qb.y, b[2] = qb.z, b[3] = qb.w;
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          a[c] = kk + c < kend ? ar[k0 + kk + c] : 0.0f;
          b[c] = kk + c < kend ? br[k0 + kk + c] : 0.0f;
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) acc = fmaf(a[c], b[c], acc);
    }
  }
  return acc;
}

}  // namespace fourbit::ops::cuda
