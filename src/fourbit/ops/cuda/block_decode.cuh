// defines: fill_e2m1_pairs, bf16x2_bits, ue4m3_bf16x2, ue4m3x4_bf16x2, e2m1x2_times, decode8_scale, decode2_bits,
//          decode8_bits
// Exact BF16 decodes of 8 consecutive values of a block-scaled row (NVFP4: 4 code bytes, MXFP8
// E4M3/E5M2: 8), shared by the decode pass of gemm.cu and the grouped GEMM that dequantizes its
// tiles in shared memory (grouped_mma.cu), so the two give the same bits. Each value is the float
// product code x block scale — exact: at most 6 significant bits for E2M1 x E4M3 and 4 for
// E4M3/E5M2 x 2^E — converted once to BF16 (RNE). The byte -> two E2M1 values table lives in
// shared memory; FP8 codes go through the hardware conversion. The grouped GEMM's streaming kernel
// decodes two values at a time into its MMA fragments: MXFP8 with decode2_bits, NVFP4 with
// e2m1x2_times, the same products formed in BF16 arithmetic without a table (exact there, so the
// same bits).
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

// Two floats as a BF16 pair's bits (lo in the low 16 bits), each rounded to nearest even.
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// A UE4M3 block scale (the low byte of code) as a BF16 pair of its value, exact: E4M3 -> FP16
// (hardware, exact), -> FP32, -> BF16 (4 significant bits at most). The sign bit is dropped and
// 0x7F stays NaN, as ue4m3_decode.
__device__ __forceinline__ uint32_t ue4m3_bf16x2(uint32_t code) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(code & 0x7Fu), __NV_E4M3);
  const float f = __half2float(__half(__half_raw{r.x}));
  return bf16x2_bits(f, f);
}

// The four UE4M3 block scales of a word (byte i: scale i) as ue4m3_bf16x2 pairs, two a conversion.
__device__ __forceinline__ void ue4m3x4_bf16x2(uint32_t word, uint32_t (&s)[4]) {
  word &= 0x7F7F7F7Fu;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(word >> (16 * h)), __NV_E4M3);
    const float2 f = __half22float2(__half2(r));
    s[2 * h] = bf16x2_bits(f.x, f.x);
    s[2 * h + 1] = bf16x2_bits(f.y, f.y);
  }
}

// The two E2M1 values of code byte `byte` of `word` times a UE4M3 scale (a BF16 pair,
// ue4m3_bf16x2), as a BF16 pair (low nibble in the low 16 bits), in integer and BF16-pair
// arithmetic only. The nibbles are moved into a BF16 pair (sign to bit 15, exponent and mantissa
// bits to bits 8..6, the lowest exponent bits), which reads each value times 2^-126 exactly (the
// zero-exponent codes 0 and 0.5 land on BF16 subnormals); one FMA by 2^126 gives the E2M1 values,
// a second their product with the scale, both with a -0 addend and exact (at most 6 significant
// bits, magnitudes in [2^-10, 2688]): decode2_bits' bits, the sign of a zero kept. (A table of
// the 256 byte pairs in shared memory took 10-23% longer in the streaming kernel, H100: its
// lookups queued on the shared-memory pipe and conflicted on its banks.)
__device__ __forceinline__ uint32_t e2m1x2_times(uint32_t word, int byte, uint32_t scale) {
  const uint32_t y = __byte_perm(word, 0u, 0x4440u | uint32_t(byte));  // the byte, alone
  const uint32_t em = (y * 0x00040040u) & 0x01C001C0u;                   // y << 6 | y << 18
  const uint32_t x = em | ((y * 0x01001000u) & 0x80008000u);             // signs: y << 12 | y << 24
  uint32_t v, d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(v) : "r"(x), "r"(0x7E807E80u), "r"(0x80008000u));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(v), "r"(scale), "r"(0x80008000u));
  return d;
}

// The block scale's value: UE4M3 for NVFP4, UE8M0 (2^E) for MXFP8.
template <Format F>
__device__ __forceinline__ float decode8_scale(uint8_t s) {
  if constexpr (F == Format::NVFP4)
    return num::ue4m3_decode(s);
  else
    return num::ue8m0_decode(s);
}

// 2 values as two BF16 (the lower index in the low 16 bits): an NVFP4 code byte (low nibble
// first) or two MXFP8 codes (the lower in the low byte) in `codes`, times sv = decode8_scale(block
// scale). The grouped GEMM's streaming decode kernel builds mma.sync fragments from these.
template <Format F>
__device__ __forceinline__ uint32_t decode2_bits(uint32_t codes, float sv, const float2* e2m1_pair) {
  float2 f;
  if constexpr (F == Format::NVFP4) {
    f = e2m1_pair[codes & 0xFFu];
  } else {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes & 0xFFFFu),
                                                     F == Format::MXFP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
    f = __half22float2(__half2(h));
  }
  return bf16x2_bits(f.x * sv, f.y * sv);
}

// 8 values as 8 BF16 (lowest index in the lowest bits): NVFP4 codes in w.x (two a byte, low
// nibble first), MXFP8 codes in w.x (values 0..3) and w.y (4..7); sv = decode8_scale(block scale).
template <Format F>
__device__ __forceinline__ uint4 decode8_bits(uint2 w, float sv, const float2* e2m1_pair) {
  uint4 packed;
  uint32_t* pw = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (F == Format::NVFP4) pw[j] = decode2_bits<F>(w.x >> (8 * j), sv, e2m1_pair);
    else pw[j] = decode2_bits<F>((j < 2 ? w.x : w.y) >> (16 * (j % 2)), sv, e2m1_pair);
  }
  return packed;
}

}  // namespace fourbit::ops::cuda
