// defines: bf16_encode, bf16_decode, bf16_encode_f64
// BF16 is a storage and compute type here, not a quantizer: encode is the IEEE cast every
// framework uses (round to nearest even, overflow to Inf, NaN kept quiet), so tensors we write
// match what cuBLAS, PyTorch and __float2bfloat16_rn produce.
#pragma once
#include "fourbit/numerics/hd.h"

namespace fourbit::num {

FOURBIT_HD uint16_t bf16_encode(float x) {
  const uint32_t u = bits_of(x);
  if (is_nan_bits(x)) return uint16_t((u >> 16) | 0x0040u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

FOURBIT_HD float bf16_decode(uint16_t h) { return float_of(uint32_t(h) << 16); }

// double -> bf16 with one rounding (host only): round to float with round-to-odd — the float keeps
// 16 more bits than bf16, so rounding it to nearest even then equals rounding the double directly.
inline uint16_t bf16_encode_f64(double x) {
  float f = float(x);
  if (f - f == 0.0f && double(f) != x) {                       // finite and inexact
    if ((double(f) > x) == (x > 0)) f = __builtin_nextafterf(f, 0.0f);  // truncate toward zero
    f = float_of(bits_of(f) | 1u);                                       // sticky bit
  }
  return bf16_encode(f);
}

}  // namespace fourbit::num
