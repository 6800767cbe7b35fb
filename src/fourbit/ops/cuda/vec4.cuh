// defines: cuda::load4, cuda::store4
// Groups of four consecutive floats, the unit of work of the memory-bound kernels: group g of a
// row (or of a flat array) covers elements [4g, 4g + 4). With `vec` (the caller checked 16-byte
// alignment of the group's address) a full group moves as one float4; otherwise, and for the last
// partial group, element by element. Both paths load the same values into the same slots, so a
// kernel's arithmetic (and its reduction order) does not depend on which one ran: an unaligned
// view gives the same bits as an aligned copy.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fourbit/numerics/bf16.h"

namespace fourbit::ops::cuda {

// v[c] = p[i + c] for i + c < n; 0 beyond the end.
__device__ __forceinline__ void load4(const float* p, int64_t i, int64_t n, bool vec, float v[4]) {
  if (vec && i + 3 < n) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    return;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = i + c < n ? p[i + c] : 0.0f;
}

// p[i + c] = v[c] for i + c < n.
__device__ __forceinline__ void store4(float* p, int64_t i, int64_t n, bool vec, const float v[4]) {
  if (vec && i + 3 < n) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (i + c < n) p[i + c] = v[c];
}

// p[i + c] = the BF16 encoding (RNE, num::bf16_encode) of v[c] for i + c < n: an op's F32 result
// written as the BF16 operand of the next GEMM, the bits of ops::convert of the F32 output. With
// `vec` (the caller checked 8-byte alignment) a full group moves as one 8-byte store.
__device__ __forceinline__ void store4(uint16_t* p, int64_t i, int64_t n, bool vec, const float v[4]) {
  uint16_t h[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) h[c] = num::bf16_encode(v[c]);
  if (vec && i + 3 < n) {
    *reinterpret_cast<uint2*>(p + i) = make_uint2(h[0] | uint32_t(h[1]) << 16, h[2] | uint32_t(h[3]) << 16);
    return;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (i + c < n) p[i + c] = h[c];
}

}  // namespace fourbit::ops::cuda
