// defines: kS2f6Block, kS2f6Max, round_to_int8_grid, s2f6_encode, s2f6_decode, s2f6_scale,
//          s2f6_encode_scaled, s2f6_decode_scaled, s2f6_quantize_block
// S2F6: two's-complement int8 read as s/64 (range -2 .. 127/64, step 1/64). As the expert-combine
// payload it is block-scaled: 32 values share a UE8M0 scale chosen by RCEIL so nothing clips,
// optionally after a 32-point RHT (NUMERICS "S2F6 combine payload").
#pragma once
#include "fourbit/numerics/round.h"
#include "fourbit/numerics/ue8m0.h"

namespace fourbit::num {

inline constexpr int kS2f6Block = 32;
inline constexpr float kS2f6Max = 127.0f / 64.0f;

// clamp(rne(x * 2^-quantum_exp), -128, 127): x on the grid of step 2^quantum_exp, int8 count.
FOURBIT_HD int8_t round_to_int8_grid(float x, int quantum_exp) {
  if (is_nan_bits(x)) return 0;  // callers report non-finite input before encoding
  const bool neg = (bits_of(x) >> 31) != 0;
  uint32_t n;
  if ((bits_of(x) & 0x7fffffffu) == 0) {
    n = 0;
  } else if (!is_finite_bits(x)) {
    n = 255;
  } else {
    const SigExp se = split_normalized(x);
    const int shift = quantum_exp - (se.exp2 - 23);
    n = shift < 0 ? 255u : shift_round_rne(se.sig, shift);  // shift < 0: |x| >= 2^24 quanta
  }
  if (neg) return int8_t(n >= 128 ? -128 : -int(n));
  return int8_t(n >= 127 ? 127 : int(n));
}

// Unscaled scalar codec: value = s / 64.
FOURBIT_HD int8_t s2f6_encode(float x) { return round_to_int8_grid(x, -6); }
FOURBIT_HD float s2f6_decode(int8_t s) { return float(s) * 0.015625f; }

// UE8M0 block scale: smallest E with amax * 64 * 2^-(E-127) <= 127.
FOURBIT_HD uint8_t s2f6_scale(float block_amax) { return ue8m0_scale_for_max(block_amax, kS2f6Max); }

// q = clamp(rne(y * 64 * 2^-(E-127)), -128, 127); decode q / 64 * 2^(E-127).
FOURBIT_HD int8_t s2f6_encode_scaled(float y, uint8_t scale) {
  return round_to_int8_grid(y, int(scale) - 127 - 6);
}
FOURBIT_HD float s2f6_decode_scaled(int8_t q, uint8_t scale) {
  return float(q) * pow2f(int(scale) - 127 - 6);  // exact: <= 8 significant bits, >= 2^-133
}

// One block of n <= 32 values (already rotated by the caller when the payload uses RHT-32):
// writes n int8 codes, returns the UE8M0 scale.
FOURBIT_HD uint8_t s2f6_quantize_block(const float* y, int n, float block_amax, int8_t* codes) {
  const uint8_t scale = s2f6_scale(block_amax);
  for (int i = 0; i < n; ++i) codes[i] = s2f6_encode_scaled(y[i], scale);
  return scale;
}

}  // namespace fourbit::num
