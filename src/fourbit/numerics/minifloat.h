// defines: MiniFloatSpec, e2m1_spec, e4m3_spec, e5m2_spec, kE2M1, kE4M3, kE5M2, kE2M1Max, kE4M3Max,
//          kE5M2Max, minifloat_encode, minifloat_decode, e2m1_encode, e2m1_encode_rne, e2m1_decode,
//          e4m3_encode, e4m3_decode, e5m2_encode, e5m2_decode, ue4m3_encode, ue4m3_decode
// Small sign-exponent-mantissa floats (NUMERICS "Scalar element formats"). One encoder serves all
// of them: round-to-nearest-even or stochastic rounding, saturating to the largest finite value
// ("satfinite": overflow and +-Inf never give NaN or Inf), -0.0 keeping its sign bit.
#pragma once
#include "fourbit/numerics/round.h"

namespace fourbit::num {

struct MiniFloatSpec {
  int exp_bits;
  int man_bits;
  int bias;
  uint32_t max_mag_code;  // largest finite magnitude code (sign bit clear)
  uint32_t nan_code;      // magnitude code emitted for NaN input; 0 when the format has no NaN
  bool has_nan;
};

// NUMERICS table: E2M1 max 6 (0x7); E4M3 "fn" max 448 (0x7E), NaN 0x7F; E5M2 max 57344 (0x7B),
// Inf 0x7C and NaN 0x7D-0x7F (we emit 0x7E). Device code must use the functions (a namespace-scope
// constexpr object cannot be read in a kernel); host code may use the k* constants.
FOURBIT_HD constexpr MiniFloatSpec e2m1_spec() { return {2, 1, 1, 0x7u, 0x0u, false}; }
FOURBIT_HD constexpr MiniFloatSpec e4m3_spec() { return {4, 3, 7, 0x7Eu, 0x7Fu, true}; }
FOURBIT_HD constexpr MiniFloatSpec e5m2_spec() { return {5, 2, 15, 0x7Bu, 0x7Eu, true}; }
inline constexpr MiniFloatSpec kE2M1 = e2m1_spec();
inline constexpr MiniFloatSpec kE4M3 = e4m3_spec();
inline constexpr MiniFloatSpec kE5M2 = e5m2_spec();

inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

// Encodes x * 2^exp_adjust (computed exactly, in the exponent, never as a float multiply) to the
// format's code. `rnd` supplies the element's 16 random bits when mode == SR (sr_bits). Returns
// sign | magnitude code.
// NaN gives the format's NaN code, or 0 for formats without one: block quantizers detect
// non-finite input before encoding and report it (ops::QuantReport::nonfinite and the sticky
// flag), they never rely on this value.
FOURBIT_HD uint32_t minifloat_encode(MiniFloatSpec f, float x, int exp_adjust = 0,
                                     Rounding mode = Rounding::RNE, uint32_t rnd = 0) {
  const uint32_t sign = (bits_of(x) >> 31) << (f.exp_bits + f.man_bits);
  if (is_nan_bits(x)) return f.has_nan ? (sign | f.nan_code) : 0u;
  if (!is_finite_bits(x)) return sign | f.max_mag_code;  // satfinite
  if ((bits_of(x) & 0x7fffffffu) == 0) return sign;       // +-0
  const SigExp se = split_normalized(x);
  const int e = se.exp2 + exp_adjust;                     // |x| * 2^exp_adjust = 1.f * 2^e
  const int emin = 1 - f.bias;                            // smallest normal exponent
  if (e > f.bias + 8) return sign | f.max_mag_code;       // far above every format's range
  // One quantum of the target at this magnitude is 2^(max(e, emin) - man_bits); sig's unit is
  // 2^(e - 23), so the count of quanta is sig >> shift, rounded. shift >= 23 - man_bits > 0.
  const int e_q = e > emin ? e : emin;
  const int shift = (e_q - f.man_bits) - (e - 23);
  const uint32_t n = shift_round(se.sig, shift, mode, rnd);
  // Code from count: subnormal range codes are the count itself; a normal value with exponent
  // e has count in [2^m, 2^(m+1)] and code ((e - emin) << m) + count. A carry out of the
  // mantissa lands on the next binade's code automatically.
  const int binade = e_q - emin;
  uint32_t code = (uint32_t(binade) << f.man_bits) + n;
  if (code > f.max_mag_code) code = f.max_mag_code;
  return sign | code;
}

FOURBIT_HD float minifloat_decode(MiniFloatSpec f, uint32_t code) {
  const uint32_t sign_bit = 1u << (f.exp_bits + f.man_bits);
  const uint32_t mag = code & (sign_bit - 1u);
  const bool neg = (code & sign_bit) != 0;
  float v;
  if (f.has_nan && mag > f.max_mag_code) {
    // E4M3 0x7F is NaN; E5M2 0x7C is Inf, 0x7D-0x7F NaN.
    if (f.exp_bits == 5 && mag == 0x7Cu) v = float_of(0x7f800000u);
    else v = float_of(0x7fc00000u);
  } else {
    const uint32_t exp_field = mag >> f.man_bits;
    const uint32_t man = mag & ((1u << f.man_bits) - 1u);
    if (exp_field == 0) {
      v = float(man) * pow2f(1 - f.bias - f.man_bits);  // exact: few bits times a power of two
    } else {
      v = float_of((uint32_t(int(exp_field) - f.bias + 127) << 23) | (man << (23 - f.man_bits)));
    }
  }
  return neg ? -v : v;
}

// E2M1 RNE by comparison with the seven rounding boundaries: strict at the ties whose even
// neighbour is below (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4), inclusive where it is above
// (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4). Same codes as minifloat_encode for every float
// (tests/numerics/codec_test.cpp checks all floats of the rounding range), a quarter of the
// instructions: it is the inner loop of every NVFP4 quantizer.
FOURBIT_HD uint8_t e2m1_encode_rne(float x) {
  if (is_nan_bits(x)) return 0;  // as minifloat_encode: E2M1 has no NaN code
  const float a = abs_bits(x);
  const uint32_t mag = uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) +
                       uint32_t(a >= 1.75f) + uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) +
                       uint32_t(a > 5.0f);
  return uint8_t(((bits_of(x) >> 31) << 3) | mag);
}

FOURBIT_HD uint8_t e2m1_encode(float x, Rounding m = Rounding::RNE, uint32_t r = 0) {
  if (m == Rounding::RNE) return e2m1_encode_rne(x);
  return uint8_t(minifloat_encode(e2m1_spec(), x, 0, m, r));
}
// E2M1 decode without branches (it sits in the Four Over Six inner loop): exponent field e,
// mantissa bit m; e > 0 is (1 + m/2) * 2^(e-1), e == 0 is m/2. Same values as minifloat_decode.
// e2m1_bits is the value's float32 bit pattern, at compile time too (the GPU's tables of E2M1
// values are built from it).
FOURBIT_HD constexpr uint32_t e2m1_bits(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t normal = ((e + 126u) << 23) | (m << 22);
  const uint32_t mag = e ? normal : (m ? 0x3F000000u : 0u);
  return mag | ((code & 8u) << 28);
}
FOURBIT_HD float e2m1_decode(uint32_t code) { return float_of(e2m1_bits(code)); }
FOURBIT_HD uint8_t e4m3_encode(float x, Rounding m = Rounding::RNE, uint32_t r = 0) {
  return uint8_t(minifloat_encode(e4m3_spec(), x, 0, m, r));
}
FOURBIT_HD float e4m3_decode(uint32_t code) { return minifloat_decode(e4m3_spec(), code & 0xFFu); }
FOURBIT_HD uint8_t e5m2_encode(float x, Rounding m = Rounding::RNE, uint32_t r = 0) {
  return uint8_t(minifloat_encode(e5m2_spec(), x, 0, m, r));
}
FOURBIT_HD float e5m2_decode(uint32_t code) { return minifloat_decode(e5m2_spec(), code & 0xFFu); }

// UE4M3: the E4M3 grid without a sign (NVFP4 block scales). Scales are never negative; the sign
// of the input is dropped.
FOURBIT_HD uint8_t ue4m3_encode(float x) { return uint8_t(e4m3_encode(abs_bits(x)) & 0x7Fu); }
FOURBIT_HD float ue4m3_decode(uint32_t code) { return e4m3_decode(code & 0x7Fu); }

}  // namespace fourbit::num
