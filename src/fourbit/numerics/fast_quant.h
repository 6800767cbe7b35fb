// defines: fma_rn, fabs_hd, max_abs_nan, e2m1_rne_magnitude, e2m1_magnitude_code,
//          e2m1_decode_fast, ue4m3_encode_fast, e4m3_decode_fast, ue4m3_decode_fast,
//          nvfp4_enc_scale_fast, nvfp4_quantize_block_fast, PhiloxKeys, philox_keys,
//          random_bits4_fast, Mxfp8Sr, mxfp8_encode_sr_fast, mxfp8_encode_rne_x2
// The GPU quantizers' inner loops, written for the instruction budget of a memory-bound kernel
// (a few tens of instructions per element): float adds and compares instead of the integer
// rounding core, for the cases the hot paths meet (finite inputs, RNE E2M1, the E4M3 block
// scale, MXFP8 SR). Each function equals a generic one of minifloat.h / nvfp4.h / mxfp8.h on the
// inputs its comment allows, bit for bit; tests/numerics/fast_quant_test.cpp checks that
// exhaustively where the input range allows it and on millions of random blocks elsewhere.
#pragma once
#include <cmath>

#include "fourbit/numerics/minifloat.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/nvfp4.h"
#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace fourbit::num {

// a * b + c with one rounding (an explicit FMA: the contract forbids only implicit contraction).
FOURBIT_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// |x| (sign bit cleared, as abs_bits), as a float operation: free on the GPU, where it becomes an
// operand modifier of the instruction that uses it.
FOURBIT_HD float fabs_hd(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// max(acc, |x|) where a NaN wins: a block's running maximum ends non-finite exactly when the block
// holds a NaN or an Inf; otherwise it is max_abs_finite's result (one instruction on the GPU).
FOURBIT_HD float max_abs_nan(float acc, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(acc), "f"(fabsf(x)));
  return r;
#else
  const float a = abs_bits(x);
  return (is_nan_bits(acc) || is_nan_bits(a)) ? float_of(0x7fc00000u) : (a > acc ? a : acc);
#endif
}

// ---- E2M1 ------------------------------------------------------------------------------------------

// |E2M1_rne_satfinite(y)| as a float (one of 0, .5, 1, 1.5, 2, 3, 4, 6) for any y but NaN.
// min(|y|, 6) lies in a binade [2^k, 2^(k+1)) whose E2M1 quantum is 2^(k-1) (0.5 below 1, hence
// E = 2^max(k, 0)); adding M = E * 2^22 puts the sum in [2^(k+22), 2^(k+23)), where float32's own
// quantum is that same 2^(k-1), so the adder rounds to the E2M1 grid, ties to even (the sum's last
// bit is the E2M1 mantissa bit), and subtracting M is exact. Clamping first is saturation:
// rounding is monotone and 6 is on the grid.
FOURBIT_HD float e2m1_rne_magnitude(float y) {
  const float a = fminf(fabs_hd(y), 6.0f);
  const float e = fmaxf(float_of(bits_of(a) & 0x7f800000u), 1.0f);
  const float sum = fma_rn(e, 4194304.0f, a);  // e * 2^22 is exact: one rounding, the adder's
  return fma_rn(e, -4194304.0f, sum);
}

// The E2M1 magnitude code of a grid value v: v * 2^-126 is v's E2M1 encoding read as float32
// bits (bias 1 -> bias 127, E2M1's subnormal 0.5 -> float32's subnormal 2^-127), shifted to the
// top: code = bits >> 22.
FOURBIT_HD uint32_t e2m1_magnitude_code(float v) { return bits_of(mul_rn(v, 0x1p-126f)) >> 22; }

// e2m1_decode by the same correspondence, read backwards (sign in bit 3).
FOURBIT_HD float e2m1_decode_fast(uint32_t code) {
  const float mag = mul_rn(float_of((code & 7u) << 22), 0x1p126f);
  return float_of(bits_of(mag) | ((code & 8u) << 28));
}

// ---- E4M3 block scales -----------------------------------------------------------------------------

// ue4m3_encode(t) for t >= 0 (not NaN; +Inf saturates). Normal range: round float32's mantissa
// to 3 bits (add half - 1 + the kept LSB, truncate) and rebias 127 -> 7. Below 2^-6 the E4M3
// quantum is 2^-9: t + 2^14 lands where float32's quantum is 2^-9, so the adder rounds it.
FOURBIT_HD uint8_t ue4m3_encode_fast(float t) {
  const uint32_t u = bits_of(t);
  const uint32_t normal = ((u + 0x7ffffu + ((u >> 20) & 1u)) >> 20) - (120u << 3);
  const uint32_t sub = bits_of(add_rn(t, 16384.0f)) - 0x46800000u;  // 2^14
  const uint32_t c = t < 0x1p-6f ? sub : normal;
  return uint8_t(c > 0x7eu ? 0x7eu : c);
}

// e4m3_decode of a magnitude code 0..0x7E (no NaN): the code read as float32 bits is the value
// times 2^-120, subnormals included.
FOURBIT_HD float e4m3_decode_fast(uint32_t code) { return mul_rn(float_of(code << 20), 0x1p120f); }

// ue4m3_decode for every byte: the sign bit dropped, 0x7F (E4M3's NaN) kept as NaN.
FOURBIT_HD float ue4m3_decode_fast(uint32_t code) {
  code &= 0x7fu;
  return code == 0x7fu ? float_of(0x7fc00000u) : e4m3_decode_fast(code);
}

// nvfp4_enc_scale(s_b, s_dec) given sc = E4M3(s_b) (s_b != 0 decided by the caller).
FOURBIT_HD float nvfp4_enc_scale_fast(float sc, float s_dec) {
  const float r = 1.0f / mul_rn(sc, s_dec);
  return is_finite_bits(r) ? r : 3.40282347e38f;
}

// ---- NVFP4 block, RNE (with or without Four Over Six) ----------------------------------------------

namespace detail {
// Element i's E2M1 code at its place in a 32-bit word of 8 packed codes (element 2k in the low
// nibble of byte k), in two parts: the magnitude code of a grid value v (v * 2^-126 holds it in
// bits 22..24) and the sign bit, which is x's (the sign of x * enc, enc > 0, zeros included).
FOURBIT_HD uint32_t e2m1_magnitude_at(float v, int i) {
  const uint32_t c22 = bits_of(mul_rn(v, 0x1p-126f));
  const int s = 4 * (i % 8);
  return s <= 22 ? c22 >> (22 - s) : c22 << (s - 22);
}
FOURBIT_HD uint32_t e2m1_sign_at(float x, int i) {
  const int s = 4 * (i % 8) + 3;
  return (bits_of(x) >> (31 - s)) & (1u << s);
}
FOURBIT_HD uint64_t words(const uint32_t (&w)[2]) { return uint64_t(w[0]) | (uint64_t(w[1]) << 32); }

// A magnitude code held at bits 22..24 (as e2m1_magnitude_code's product), moved to element i's
// nibble of a word: the fields do not overlap, so callers add (one shift-and-add on the GPU).
FOURBIT_HD uint32_t code22_at(uint32_t c22, int i) {
  const int s = 4 * (i % 8);
  return s <= 22 ? c22 >> (22 - s) : c22 << (s - 22);
}

// (acc << 4) | the top nibble of x (its sign and three exponent bits): fed elements 7, 6, ..., 0
// of a word, the sign of element i ends at bit 4i + 3 (one funnel shift each; the exponent bits
// are masked off once per word).
FOURBIT_HD uint32_t nibble_in(uint32_t acc, float x) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(bits_of(x), acc, 4);
#else
  return (acc << 4) | (bits_of(x) >> 28);
#endif
}

// One Four Over Six candidate (block scale sc, its encode scale enc, the group's S_dec), in a
// scaled form that saves a multiply per element: with enc_s = enc * 2^-104, sc_s = sc * 2^100 and
// sd = S_dec * 2^26 all exact (the caller checks enc >= 2^-22 or enc = 0, and S_dec < 2^102):
//  - y_s = fl(x * enc_s) is fl(x * enc) * 2^-104 wherever that is a normal float; below it |y| <
//    2^-22 and both give the code 0; above 6 * 2^-104 both saturate.
//  - e2m1_rne_magnitude's steps, scaled by 2^-104 (eps = e * 2^-104, all normal floats, the
//    adder's rounding unchanged), end in fl(sum * 2^-22 - eps) = v * 2^-126 exactly: the value's
//    E2M1 magnitude code at bits 22..24 (e2m1_magnitude_code) straight from the second FMA.
//  - x_hat = fl(fl(v * sc) * S_dec): v * sc is exact, so x_hat is the one rounding of the real
//    v * sc * S_dec, which is also (v * 2^-126 * sc_s) * sd with an exact first product (its
//    range is [2^-36, 2^-14]).
struct FosCandidate {
  float enc_s, sc_s, sd;
  FOURBIT_HD float code22(float x) const {
    const float a = fminf(fabs_hd(mul_rn(x, enc_s)), 6.0f * 0x1p-104f);
    const float eps = fmaxf(float_of(bits_of(a) & 0x7f800000u), 0x1p-104f);
    const float sum = fma_rn(eps, 4194304.0f, a);  // e * 2^22 + a, scaled: one rounding
    return fma_rn(sum, 0x1p-22f, -eps);
  }
  FOURBIT_HD float dequant(float v22) const { return mul_rn(mul_rn(v22, sc_s), sd); }
};
}  // namespace detail

// nvfp4_quantize_block(x, n, block_amax, s_enc, s_dec, kFos, kMetric, RNE, ...) for a block whose
// values are all finite (x[n..16) = +0: the padding; zeros add nothing to the error sums and
// encode as code 0, so the result does not depend on n). block_amax may be a 16x16 tile's.
// Four Over Six: both candidates' values come from e2m1_rne_magnitude's steps in the scaled form
// of detail::FosCandidate (the magnitude code straight from the rounding's second FMA, one multiply
// less per element and candidate); the error of element i is computed on magnitudes,
// d = |x| - fl(fl(v * sc) * S_dec), which is the contract's x - x_hat up to its sign (x_hat has
// x's sign or is zero, and rounding is symmetric), so d^2 and |d| are the same floats, summed in
// element order with the same float32 operations. Both candidates' magnitude codes are packed as
// they are found (no values are kept for later, few registers live); the signs, common to both,
// once, by funnel shifts. SASS (sm_90a, nvdisasm): 417 instructions for the 16 elements (MSE;
// 12 per element and candidate), 473 before the scaled form, plus ~65 per block for the scales.
template <bool kFos, ScaleMetric kMetric = ScaleMetric::MSE>
FOURBIT_HD Nvfp4Block nvfp4_quantize_block_fast(const float (&x)[16], float block_amax, float s_enc,
                                                float s_dec) {
  const float t = mul_rn(block_amax / 6.0f, s_enc);
  const uint8_t s6 = ue4m3_encode_fast(t);
  if constexpr (!kFos) {
    if (s6 == 0) return {0, 0, false};  // NUMERICS: a zero scale stores all-zero codes
    const float enc = nvfp4_enc_scale_fast(e4m3_decode_fast(s6), s_dec);
    uint32_t w[2] = {0u, 0u};
    FOURBIT_UNROLL
    for (int i = 0; i < 16; ++i)
      w[i / 8] |= detail::e2m1_magnitude_at(e2m1_rne_magnitude(mul_rn(x[i], enc)), i) |
                  detail::e2m1_sign_at(x[i], i);
    return {detail::words(w), s6, false};
  } else {
    const uint8_t s4 = ue4m3_encode_fast(mul_rn(t, 1.5f));
    const float sc6 = e4m3_decode_fast(s6), sc4 = e4m3_decode_fast(s4);
    const float enc6 = s6 ? nvfp4_enc_scale_fast(sc6, s_dec) : 0.0f;
    const float enc4 = s4 ? nvfp4_enc_scale_fast(sc4, s_dec) : 0.0f;
    // The scaled forms below need enc * 2^-104 and s_dec * 2^26 exact (see detail::FosCandidate);
    // blocks outside that (element magnitudes above ~2.5e7, or S_dec >= 2^102) take the generic
    // quantizer, which defines the bits.
    if (!(enc6 >= 0x1p-22f || s6 == 0) || !(enc4 >= 0x1p-22f || s4 == 0) || !(s_dec < 0x1p102f)) {
      float copy[16];
      for (int i = 0; i < 16; ++i) copy[i] = x[i];
      return nvfp4_quantize_block(copy, 16, block_amax, s_enc, s_dec, true, kMetric, Rounding::RNE, 0, 0, 0);
    }
    const float sd = mul_rn(s_dec, 0x1p26f);
    const detail::FosCandidate c6{mul_rn(enc6, 0x1p-104f), mul_rn(sc6, 0x1p100f), sd};
    const detail::FosCandidate c4{mul_rn(enc4, 0x1p-104f), mul_rn(sc4, 0x1p100f), sd};
    uint32_t w6[2] = {0u, 0u}, w4[2] = {0u, 0u}, signs[2] = {0u, 0u};
    float err6 = 0.0f, err4 = 0.0f;  // NUMERICS 4/6: summed in element order
    FOURBIT_UNROLL
    for (int i = 0; i < 16; ++i) {
      const float v6 = c6.code22(x[i]), v4 = c4.code22(x[i]);
      const float d6 = sub_rn(fabs_hd(x[i]), c6.dequant(v6));
      const float d4 = sub_rn(fabs_hd(x[i]), c4.dequant(v4));
      // fl(0 + e) = e for the first term (e >= +0), so the sums start at it
      if constexpr (kMetric == ScaleMetric::MSE) {
        err6 = i == 0 ? mul_rn(d6, d6) : add_rn(err6, mul_rn(d6, d6));
        err4 = i == 0 ? mul_rn(d4, d4) : add_rn(err4, mul_rn(d4, d4));
      } else {
        err6 = i == 0 ? fabs_hd(d6) : add_rn(err6, fabs_hd(d6));
        err4 = i == 0 ? fabs_hd(d4) : add_rn(err4, fabs_hd(d4));
      }
      w6[i / 8] += detail::code22_at(bits_of(v6), i);
      w4[i / 8] += detail::code22_at(bits_of(v4), i);
    }
    FOURBIT_UNROLL
    for (int i = 15; i >= 0; --i) signs[i / 8] = detail::nibble_in(signs[i / 8], x[i]);
    const bool four = err4 < err6;  // NUMERICS: ties keep 6
    const uint8_t s = four ? s4 : s6;
    if (s == 0) return {0, 0, four};
    return {(four ? detail::words(w4) : detail::words(w6)) | (detail::words(signs) & 0x8888888888888888ull),
            s, four};
  }
}

// ---- MXFP8 -----------------------------------------------------------------------------------------

// Philox-4x32-10 (philox.h) with the key schedule computed once per thread and the 32x32 ->
// 64-bit products taken as high and low 32-bit halves: the same words from 20 multiply-high/low
// pairs and 20 three-way XORs a call (40-60 SASS instructions), where philox.h's 64-bit products
// and key additions compile to roughly twice that.
struct PhiloxKeys {
  uint32_t k0[10], k1[10];
};

FOURBIT_HD PhiloxKeys philox_keys(uint64_t seed) {
  PhiloxKeys k{};
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  FOURBIT_UNROLL
  for (int round = 0; round < 10; ++round) {
    k.k0[round] = k0;
    k.k1[round] = k1;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return k;
}

// random_bits4(seed, stream, group) with keys = philox_keys(seed).
FOURBIT_HD Philox4x32 random_bits4_fast(const PhiloxKeys& keys, uint64_t stream, uint64_t group) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  uint32_t c0 = uint32_t(group), c1 = uint32_t(group >> 32), c2 = uint32_t(stream),
           c3 = uint32_t(stream >> 32);
  FOURBIT_UNROLL
  for (int round = 0; round < 10; ++round) {
#if defined(__CUDA_ARCH__)
    const uint32_t hi0 = __umulhi(kMul0, c0), hi1 = __umulhi(kMul1, c2);
#else
    const uint32_t hi0 = uint32_t((uint64_t(kMul0) * c0) >> 32);
    const uint32_t hi1 = uint32_t((uint64_t(kMul1) * c2) >> 32);
#endif
    const uint32_t lo0 = kMul0 * c0, lo1 = kMul1 * c2;
    c0 = hi1 ^ c1 ^ keys.k0[round];
    c1 = lo1;
    c2 = hi0 ^ c3 ^ keys.k1[round];
    c3 = lo0;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// MXFP8 stochastic rounding, minifloat_encode(elem, x, 127 - scale, SR, rnd) (= mxfp8_encode with
// SR), for finite x, in two parts. The caller forms u = bits(|x| * x_scale), x_scale =
// pow2f(127 - scale): that product is exact whenever it is a normal float, and below 2^-126 both
// the generic encoder and these give a count of 0. kExpBits: 4 (E4M3) or 5 (E5M2).
template <int kExpBits>
struct Mxfp8Sr {
  static constexpr int kMan = kExpBits == 4 ? 3 : 2;
  static constexpr int kBias = kExpBits == 4 ? 7 : 15;
  static constexpr int kMaxCode = kExpBits == 4 ? 0x7e : 0x7b;
  static constexpr int kEminBiased = 1 - kBias + 127;  // the target's smallest normal, float32-biased
  static constexpr uint32_t kMinNormalBits = uint32_t(kEminBiased) << 23;

  // The general form, for every u. With u's biased exponent eb and significand sig (implicit bit
  // included), the generic count is shift_round_sr(sig, shift, rnd), shift = 23 - m + max(eb,
  // emin) - eb, which is the high word of floor(sig * 2^(32 - shift)) + rnd: the low bits of rnd
  // that a right shift drops cannot carry into the kept ones.
  static FOURBIT_HD uint32_t code_wide(uint32_t u, uint32_t rnd) {
    const int eb = int(u >> 23);
    const int eqb = eb > kEminBiased ? eb : kEminBiased;
    const uint32_t shift = uint32_t(23 - kMan + eqb - eb);
    const uint32_t sig = (u & 0x7fffffu) | 0x800000u;  // u below 2^-126: shift >= 120, count 0
    const uint64_t wide = (uint64_t(sig) << 32) >> (shift < 63u ? shift : 63u);
    const uint32_t n = uint32_t((wide + rnd) >> 32);
    const uint32_t code = (uint32_t(eqb - kEminBiased) << kMan) + n;
    return code > uint32_t(kMaxCode) ? uint32_t(kMaxCode) : code;
  }

  // Whether u needs code_wide: a nonzero value below the target's smallest normal.
  static FOURBIT_HD bool needs_wide(uint32_t u) { return u - 1u < kMinNormalBits - 1u; }

  // The common form, for u = 0 or u at or above the smallest normal: the shift is 23 - m, so the
  // random bits add straight onto float32's mantissa field and the kept bits, rebiased, are the
  // code (a carry out of the mantissa lands on the next binade's code). u = 0 goes negative and
  // is clamped to code 0.
  static FOURBIT_HD uint32_t code_normal(uint32_t u, uint32_t rnd) {
    const int c = int((u + (rnd >> (9 + kMan))) >> (23 - kMan)) - ((127 - kBias) << kMan);
    return uint32_t(c < 0 ? 0 : c > kMaxCode ? kMaxCode : c);
  }

  static FOURBIT_HD uint8_t encode(float x, float x_scale, uint32_t rnd) {
    const uint32_t u = bits_of(mul_rn(fabs_hd(x), x_scale));
    const uint32_t code = needs_wide(u) ? code_wide(u, rnd) : code_normal(u, rnd);
    return uint8_t(code | ((bits_of(x) >> 24) & 0x80u));
  }
};

template <int kExpBits>
FOURBIT_HD uint8_t mxfp8_encode_sr_fast(float x, float x_scale, uint32_t rnd) {
  return Mxfp8Sr<kExpBits>::encode(x, x_scale, rnd);
}

// mxfp8_encode(a, scale, elem) | mxfp8_encode(b, scale, elem) << 8 (RNE) for a, b not NaN, with
// x_scale = pow2f(127 - scale). On sm_89+ one hardware conversion of the pair (the conversion
// mxfp8_encode itself uses on the device, see there).
template <int kExpBits>
FOURBIT_HD uint32_t mxfp8_encode_rne_x2(float a, float b, uint8_t scale, float x_scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  (void)scale;
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(mul_rn(a, x_scale), mul_rn(b, x_scale)),
                                           __NV_SATFINITE, kExpBits == 4 ? __NV_E4M3 : __NV_E5M2));
#else
  (void)x_scale;
  const MiniFloatSpec f = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  return uint32_t(mxfp8_encode(a, scale, f)) | (uint32_t(mxfp8_encode(b, scale, f)) << 8);
#endif
}

}  // namespace fourbit::num
