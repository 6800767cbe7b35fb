// defines: kUe8m0One, kUe8m0Nan, ue8m0_decode, ue8m0_encode, ue8m0_scale_for_max, ue8m0_scale_floor
// UE8M0: an 8-bit biased exponent, value 2^(code-127), codes 0..254, 0xFF = NaN, no zero.
// The MXFP8 and S2F6 scale rules (NUMERICS "MXFP8", "S2F6 combine payload") pick a code here.
#pragma once
#include "fourbit/numerics/round.h"

namespace fourbit::num {

inline constexpr uint8_t kUe8m0One = 127;  // 2^0; also the scale of an all-zero block
inline constexpr uint8_t kUe8m0Nan = 0xFF;

FOURBIT_HD float ue8m0_decode(uint32_t code) {
  code &= 0xFFu;
  if (code == 0xFFu) return float_of(0x7fc00000u);
  return pow2f(int(code) - 127);  // 2^-127 is a float32 subnormal, still exact
}

// Nearest power of two. A format without mantissa bits has no even mantissa to break a tie
// (x = 1.5 * 2^k) with; ties go up to the larger power, as ml_dtypes' float8_e8m0fnu cast does
// (hardware offers only round-up and round-to-zero for UE8M0). Scale selection never comes here:
// it uses ue8m0_scale_for_max. NaN and negative values (no sign bit) give 0xFF; values below
// 2^-127 round to code 0 or saturate there; above 2^127, and +Inf, saturate to 0xFE (satfinite).
FOURBIT_HD uint8_t ue8m0_encode(float x) {
  if (is_nan_bits(x) || (bits_of(x) >> 31)) return kUe8m0Nan;
  if (!is_finite_bits(x)) return 0xFE;
  if (bits_of(x) == 0) return 0;
  const SigExp se = split_normalized(x);           // x = sig * 2^(e - 23), bit 23 set
  int e = se.exp2;
  if ((se.sig & 0x7fffffu) >= 0x400000u) ++e;   // mantissa >= .5: up (ties included)
  if (e < -127) return 0;
  if (e > 127) return 0xFE;
  return uint8_t(e + 127);
}

// "RCEIL" (NUMERICS MXFP8 / S2F6): the smallest code E such that amax <= max_elem * 2^(E-127),
// i.e. ceil(log2(amax / max_elem)) evaluated exactly (no float division or log), clamped to
// [0, 254]; amax == 0 gives 127. max_elem: any positive normal float (448, 57344, 6, 127/64).
// Rounding up guarantees |x| * 2^-(E-127) <= max_elem for every element: nothing clips, which
// stochastic rounding needs.
FOURBIT_HD uint8_t ue8m0_scale_for_max(float amax, float max_elem) {
  if (!(amax > 0.0f)) return kUe8m0One;
  if (!is_finite_bits(amax)) return 0xFE;
  const SigExp a = split_normalized(amax);
  const SigExp m = split_normalized(max_elem);
  // amax <= max * 2^e  <=>  e >= ea - em when sig_a <= sig_m, else e >= ea - em + 1
  int e = a.exp2 - m.exp2 + (a.sig > m.sig ? 1 : 0);
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return uint8_t(e + 127);
}

// The OCP MX "floor" rule, kept for comparison only: E = floor(log2 amax) - emax_elem, where
// emax_elem is the exponent of the element format's largest normal (8 for E4M3, 15 for E5M2).
// Elements above max_elem * 2^(E-127) saturate under it.
FOURBIT_HD uint8_t ue8m0_scale_floor(float amax, int emax_elem) {
  if (!(amax > 0.0f)) return kUe8m0One;
  if (!is_finite_bits(amax)) return 0xFE;
  int e = split_normalized(amax).exp2 - emax_elem;
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return uint8_t(e + 127);
}

}  // namespace fourbit::num
