// defines: fill_e2m1_pairs, decode8_scale, decode8_bits
// Exact BF16 decodes of 8 consecutive values of a block-scaled row (NVFP4: 4 code bytes, MXFP8
// E4M3/E5M2: 8), shared by the decode pass of gemm.cu and the grouped GEMM that dequantizes its
// tiles in shared memory (grouped_mma.cu), so the two give the same bits. Each value is the float
// product code x block scale — exact: at most 6 significant bits for E2M1 x E4M3 and 4 for
// E4M3/E5M2 x 2^E — converted once to BF16 (RNE). The byte -> two E2M1 values table lives in
// shared memory; FP8 codes go through the hardware conversion.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/formats.h"

namespace fourbit::ops::cuda {

// The table of byte -> two E2M1 values (NVFP4 only; low nibble first), filled by the whole CTA.
template <Format F>
__device__ __forceinline__ void fill_e2m1_pairs(float2* e2m1_pair) {
  if constexpr (F == Format::NVFP4) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
      e2m1_pair[i] = make_float2(num::e2m1_decode(i & 0xF), num::e2m1_decode(i >> 4));
    __syncthreads();
  }
}

// The block scale's value: UE4M3 for NVFP4, UE8M0 (2^E) for MXFP8.
template <Format F>
__device__ __forceinline__ float decode8_scale(uint8_t s) {
  if constexpr (F == Format::NVFP4)
    return num::ue4m3_decode(s);
  else
    return num::ue8m0_decode(s);
}

// 8 values as 8 BF16 (lowest index in the lowest bits): NVFP4 codes in w.x (two a byte, low
// nibble first), MXFP8 codes in w.x (values 0..3) and w.y (4..7); sv = decode8_scale(block scale).
template <Format F>
__device__ __forceinline__ uint4 decode8_bits(uint2 w, float sv, const float2* e2m1_pair) {
  float v[8];
  if constexpr (F == Format::NVFP4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 p = e2m1_pair[(w.x >> (8 * j)) & 0xFFu];
      v[2 * j] = p.x * sv;
      v[2 * j + 1] = p.y * sv;
    }
  } else {
    const uint32_t words[2] = {w.x, w.y};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_fp8x2_storage_t pair = __nv_fp8x2_storage_t(words[j / 2] >> (16 * (j % 2)));
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, F == Format::MXFP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
      const float2 f = __half22float2(__half2(h));
      v[2 * j] = f.x * sv;
      v[2 * j + 1] = f.y * sv;
    }
  }
  uint4 packed;
  uint32_t* pw = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    pw[j] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return packed;
}

}  // namespace fourbit::ops::cuda
