// defines: fma_rn, fabs_hd, max_abs_nan, byte_perm, byte_perm_msb, select_bits, e2m1_rne_magnitude, e2m1_magnitude_code,
//          e2m1_decode_fast, Nvfp4DecodeWord, ue4m3_encode_fast, e4m3_decode_fast, ue4m3_decode_fast,
//          nvfp4_enc_scale_fast, div6_rn, ue4m3_rne_value, ue4m3_code_of, FosGroup, fos_group,
//          FosBlockScales, fos_block_scales, fos_bounded, fos_quantize_block, nvfp4_quantize_block_fast,
//          PhiloxKeys, philox_keys,
//          random_bits4_fast, Mxfp8Sr, mxfp8_encode_sr_fast, Mxfp8Rne, E4m3SrWords,
//          mxfp8_encode_rne_x2
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

// prmt.b32 (byte permute, default mode): byte n of the result is byte (s >> 4n) & 7 of the pair
// (b:a), a's bytes numbered 0-3, or with bit 3 of its selector set that byte's top bit copied to
// all 8 (PTX ISA, prmt). One PRMT on the device. byte_perm: selectors 0-7 (CUDA's __byte_perm,
// which the compiler can fold; it reads 3 bits a selector); byte_perm_msb: any selectors.
FOURBIT_HD uint32_t byte_perm_emulated(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t ab = uint64_t(a) | (uint64_t(b) << 32);
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t sel = (s >> (4 * n)) & 15u, byte = uint32_t(ab >> (8 * (sel & 7u))) & 0xffu;
    r |= (sel & 8u ? (byte & 0x80u ? 0xffu : 0u) : byte) << (8 * n);
  }
  return r;
}
FOURBIT_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, s);
#else
  return byte_perm_emulated(a, b, s & 0x7777u);
#endif
}
FOURBIT_HD uint32_t byte_perm_msb(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
#else
  return byte_perm_emulated(a, b, s);
#endif
}

// (a & mask) | (b & ~mask): one LOP3 on the device (ptxas, seeing its callers' masks, made two).
FOURBIT_HD uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t w;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(w) : "r"(a), "r"(b), "r"(mask));
  return w;
#else
  return (a & mask) | (b & ~mask);
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

// nvfp4_dequant (fl(fl(E2M1(c) * sc) * S_dec), sc = E4M3(s_b)) of the 8 codes of a packed word
// (element e in nibble e, sign in its bit 3), for S_dec below 2^120 in magnitude (or not finite;
// exact_for). The code's bits land where float32's put them (magnitude at bits 22..24: the E2M1
// value times 2^-126, sign at bit 31) without e2m1_decode_fast's multiply by 2^126, which moves
// into sc_hi = sc * 2^118 and sd_lo = S_dec * 2^8 (both exact: sc <= 448): the first product is
// the exact E2M1 * sc times 2^-8 (at most 6 significant bits, in [2^-18, 2^12)), signed as
// before, and the second rounds the same real number as fl(E2M1 * sc) * S_dec once.
struct Nvfp4DecodeWord {
  float sc_hi, sd_lo;
  static FOURBIT_HD bool exact_for(float s_dec) { return !(fabs_hd(s_dec) >= 0x1p120f); }
  FOURBIT_HD Nvfp4DecodeWord(float sc, float s_dec)
      : sc_hi(mul_rn(sc, 0x1p118f)), sd_lo(mul_rn(s_dec, 0x1p8f)) {}
  FOURBIT_HD float at(uint32_t word, int e) const {
    const int s = 22 - 4 * e;
    const uint32_t mag = (s >= 0 ? word << s : word >> -s) & 0x01c00000u;
    const uint32_t sign = (word << (28 - 4 * e)) & 0x80000000u;
    return mul_rn(mul_rn(float_of(mag | sign), sc_hi), sd_lo);
  }
};

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

// fl(a / 6) for finite a >= 2^-125 (tests check every float): the product with RN(1/6) corrected
// once (Markstein: the remainder a - 6 q0 is exact in an FMA, RN(1/6) is within half an ulp), three
// FMAs where a division also takes a range check and a slow-path branch. Below 2^-125 the
// quotient can be off in its last subnormal bit (see fos_block_scales for why that never shows).
FOURBIT_HD float div6_rn(float a) {
  constexpr float kSixth = 0x1.555556p-3f;  // RN(1/6)
  const float q0 = mul_rn(a, kSixth);
  return fma_rn(fma_rn(-q0, 6.0f, a), kSixth, q0);
}

// E4M3(ue4m3_encode(t)) as a float, for t >= 0 (not NaN; +Inf saturates): e2m1_rne_magnitude's
// rounding by the adder, with E4M3's quantum e * 2^-3 (e = t's binade, 2^-6 below it: the
// subnormals' 2^-9), after saturation at 448 (on the grid; rounding is monotone).
FOURBIT_HD float ue4m3_rne_value(float t) {
  const float a = fminf(t, 448.0f);
  const float e = fmaxf(float_of(bits_of(a) & 0x7f800000u), 0x1p-6f);
  const float sum = fma_rn(e, 1048576.0f, a);  // e * 2^20 + a: one rounding, the adder's
  return fma_rn(e, -1048576.0f, sum);
}
// The code of an E4M3 grid value: e4m3_decode_fast read backwards.
FOURBIT_HD uint32_t ue4m3_code_of(float sc) { return bits_of(mul_rn(sc, 0x1p-120f)) >> 20; }

// ---- NVFP4 blocks: RNE, Four Over Six --------------------------------------------------------------

// The group's part of the Four Over Six block scales. A nonzero E4M3 value is m * 2^e with m one
// of the eight 1 + k/8 (k: its top three float32 mantissa bits; E4M3's subnormals are float32
// normals), so while every step stays in float32's normal range
//   enc = fl(1 / fl(m 2^e * S_dec)) = 2^-e * fl(1 / fl(m * S_dec)) = 2^-e * R[k]
// (scaling by 2^e commutes with rounding), and detail::FosCandidate's enc * 2^-104 is R[k] with
// 23 - E added to its exponent field (E: the scale's biased exponent, e + 127). `exact`: S_dec in
// [2^-100, 2^13], where that holds for every scale up to 448 (m 2^e S_dec in [2^-109, 2^22), its
// reciprocal in (2^-22, 2^109]) and FosCandidate's limits hold too (enc >= 2^-22, S_dec < 2^102);
// other groups (amax_G beyond ~1.2e7 or below ~1e-27) take the generic quantizer.
// On the device lane l holds R[l % 8] and a lookup is a shuffle within 8 lanes: the whole warp
// builds the group and looks up together (converged). The two layouts never cross host/device.
struct FosGroup {
  float sd;  // S_dec * 2^26
  bool exact;
#if defined(__CUDA_ARCH__)
  uint32_t enc_bits;  // entry lane % 8
  __device__ __forceinline__ uint32_t lookup(uint32_t k) const {
    return uint32_t(__shfl_sync(0xffffffffu, int(enc_bits), int(k), 8));  // lane (l & ~7) | (k & 7)
  }
#else
  uint32_t enc_bits[8];
  uint32_t lookup(uint32_t k) const { return enc_bits[k & 7u]; }
#endif
  // enc * 2^-104 for an E4M3 value sc (bits E << 23 | k << 20, nothing below; 0 for a zero
  // scale, any finite enc_s will do there, see detail::FosCandidate). Entry k holds bits(R[k]) +
  // (23 << 23) + (k << 20), so one subtraction of sc's bits takes off both E and k.
  FOURBIT_HD float enc_s(float sc) const { return float_of(lookup(bits_of(sc) >> 20) - bits_of(sc)); }
};

FOURBIT_HD FosGroup fos_group(float s_dec) {
  FosGroup g{};
  g.sd = mul_rn(s_dec, 0x1p26f);
  g.exact = s_dec >= 0x1p-100f && s_dec <= 0x1p13f;
  auto entry = [s_dec](uint32_t k) {
    const float m = 1.0f + float(k) * 0.125f;  // bits: 127 << 23 | k << 20 (taken from m: two fewer
                                                // SASS instructions a row than k << 20)
    return bits_of(nvfp4_enc_scale_fast(m, s_dec)) + (bits_of(m) - (127u << 23)) + (23u << 23);
  };
#if defined(__CUDA_ARCH__)
  g.enc_bits = entry(threadIdx.x & 7u);  // lane % 8 (one-dimensional blocks)
#else
  for (uint32_t k = 0; k < 8; ++k) g.enc_bits[k] = entry(k);
#endif
  return g;
}

namespace detail {
// Element i's E2M1 code at its place in a 32-bit word of 8 packed codes (element 2k in the low
// nibble of byte k), in two parts: the magnitude code of a grid value v (v * 2^-126 holds it in
// bits 22..24) and the sign bit, which is x's (the sign of x * enc, enc > 0, zeros included).
// A magnitude code held at bits 22..24 (as e2m1_magnitude_code's product), moved to element i's
// nibble of a word: the fields do not overlap, so callers add (one shift-and-add on the GPU).
FOURBIT_HD uint32_t code22_at(uint32_t c22, int i) {
  const int s = 4 * (i % 8);
  return s <= 22 ? c22 >> (22 - s) : c22 << (s - 22);
}
FOURBIT_HD uint32_t e2m1_magnitude_at(float v, int i) { return code22_at(bits_of(mul_rn(v, 0x1p-126f)), i); }
FOURBIT_HD uint32_t e2m1_sign_at(float x, int i) {
  const int s = 4 * (i % 8) + 3;
  return (bits_of(x) >> (31 - s)) & (1u << s);
}
FOURBIT_HD uint64_t words(const uint32_t (&w)[2]) { return uint64_t(w[0]) | (uint64_t(w[1]) << 32); }

// The signs of elements 0..7 of x, element i's at bit 4i + 3 (with the nibble's other bits: callers
// mask with 0x88888888), by byte moves: sign-replicated top bytes (0x00 or 0xFF) of elements 0, 2,
// 4, 6 in e and of 1, 3, 5, 7 in o, byte k of the word taking e's low nibble and o's high one. Three
// PRMTs a four elements and a LOP3 a word: 7 instructions where a funnel shift an element took 8.
FOURBIT_HD uint32_t sign_word(const float* x) {
  auto pair = [](float a, float b) { return byte_perm_msb(bits_of(a), bits_of(b), 0xfbfbu); };  // [a, b, a, b]
  const uint32_t e = byte_perm(pair(x[0], x[2]), pair(x[4], x[6]), 0x5410u);
  const uint32_t o = byte_perm(pair(x[1], x[3]), pair(x[5], x[7]), 0x5410u);
  return select_bits(0x0f0f0f0fu, e, o);
}

// One Four Over Six candidate (block scale sc, its encode scale enc, the group's S_dec), in a
// scaled form that saves a multiply per element: with enc_s = enc * 2^-104, sc_s = sc * 2^100 and
// sd = S_dec * 2^26 all exact (enc >= 2^-22 and S_dec < 2^102: FosGroup::exact):
//  - y_s = fl(x * enc_s) is fl(x * enc) * 2^-104 wherever that is a normal float; below it |y| <
//    2^-22 and both give the code 0; above 6 * 2^-104 both saturate.
//  - e2m1_rne_magnitude's steps, scaled by 2^-104 (eps = e * 2^-104, all normal floats, the
//    adder's rounding unchanged), end in fl(sum * 2^-22 - eps) = v * 2^-126 exactly: the value's
//    E2M1 magnitude code at bits 22..24 (e2m1_magnitude_code) straight from the second FMA.
//  - x_hat = fl(fl(v * sc) * S_dec): v * sc is exact, so x_hat is the one rounding of the real
//    v * sc * S_dec, which is also (v * 2^-126 * sc_s) * sd with an exact first product (its
//    range is [2^-36, 2^-14]).
// A zero scale (sc_s = 0) makes every x_hat 0 whatever enc_s is (finite), as the generic codes 0
// do: its codes are then not used, so enc_s need not be 0.
// kClamp false (the caller checked fos_bounded: every |y_s| below 7 * 2^-104) drops the
// saturation, one instruction an element and candidate: a |y_s| in (6, 7) * 2^-104 lies in the
// binade of 4 * 2^-104, whose quantum 2 * 2^-104 rounds it to 6 * 2^-104 (less than half a quantum
// away), as the clamp did; at 7 (a tie, to 8) and above the clamp is needed.
struct FosCandidate {
  float enc_s, sc_s, sd;
  template <bool kClamp = true>
  FOURBIT_HD float code22(float x) const {
    const float y = mul_rn(x, enc_s);
    const float a = kClamp ? fminf(fabs_hd(y), 6.0f * 0x1p-104f) : fabs_hd(y);
    const float eps = fmaxf(float_of(bits_of(kClamp ? a : y) & 0x7f800000u), 0x1p-104f);
    const float sum = fma_rn(eps, 4194304.0f, a);  // e * 2^22 + a, scaled: one rounding
    return fma_rn(sum, 0x1p-22f, -eps);
  }
  FOURBIT_HD float dequant(float v22) const { return mul_rn(mul_rn(v22, sc_s), sd); }
};
}  // namespace detail

// One block's two candidates: the scales as E4M3 values, and their scaled forms.
struct FosBlockScales {
  detail::FosCandidate c6, c4;
  float sc6, sc4;
};

// nvfp4_quantize_block's Four Over Six scales for a group with g.exact: t = fl(fl(block_amax / 6)
// * S_enc), s_b = E4M3(t), s_b4 = E4M3(fl(t * 1.5)), held as values (ue4m3_rne_value), and the
// encode scales from the group's table (no division). A block amax below 2^-125, where div6_rn
// may miss by a subnormal ulp, has t < 2^-27 either way (S_enc <= 2^100 in an exact group): both
// scales are 0. On the device: the whole warp together (FosGroup::lookup). SASS (sm_90a, inlined
// in nvfp4_row_fast_kernel): ~27 instructions a block (two shuffles), where the division by 6 and
// the two reciprocals with their range checks and slow-path branches took ~65; fos_group ~22 a
// group (one reciprocal per lane).
FOURBIT_HD FosBlockScales fos_block_scales(float block_amax, float s_enc, const FosGroup& g) {
  const float t = mul_rn(div6_rn(block_amax), s_enc);
  const float sc6 = ue4m3_rne_value(t), sc4 = ue4m3_rne_value(mul_rn(t, 1.5f));
  return {{g.enc_s(sc6), mul_rn(sc6, 0x1p100f), g.sd}, {g.enc_s(sc4), mul_rn(sc4, 0x1p100f), g.sd}, sc6, sc4};
}

// Whether both candidates' scaled values fl(x * enc_s) stay below 7 * 2^-104 for every |x| <=
// bound (block_amax: rounding is monotone), so fos_quantize_block may skip the saturation
// (detail::FosCandidate::code22). Nearly every block: with a normal E4M3 scale fl(x * enc) is at
// most ~6.4 (6 for the 6 candidate, ~4.3 for the 4 candidate, up to E4M3's rounding of s_b);
// subnormal scales (blocks ~10^5 below the group's amax) round s_b down by up to a half.
FOURBIT_HD bool fos_bounded(float bound, const FosBlockScales& s) {
  return mul_rn(bound, fmaxf(s.c6.enc_s, s.c4.enc_s)) < 7.0f * 0x1p-104f;
}

// nvfp4_quantize_block(x, n, block_amax, s_enc, s_dec, true, kMetric, RNE, ...) for a block whose
// values are all finite (x[n..16) = +0: the padding; zeros add nothing to the error sums and
// encode as code 0, so the result does not depend on n), with s = fos_block_scales(block_amax,
// s_enc, fos_group(s_dec)) of an exact group. Both candidates' values come from
// e2m1_rne_magnitude's steps in the scaled form of detail::FosCandidate (the magnitude code
// straight from the rounding's second FMA); the error of element i is computed on magnitudes,
// d = |x| - fl(fl(v * sc) * S_dec), which is the contract's x - x_hat up to its sign (x_hat has
// x's sign or is zero, and rounding is symmetric), so d^2 and |d| are the same floats, summed in
// element order with the same float32 operations. Both candidates' magnitude codes are packed as
// they are found (no values are kept for later, few registers live); the signs, common to both,
// once, by byte moves (detail::sign_word). kBounded: the caller checked fos_bounded (no saturation
// clamp). SASS (sm_90a, nvdisasm, MSE): 11 instructions per element and candidate bounded (12 with
// the clamp), 7 per 8 elements for the signs, ~10 a block for the choice and the packing.
template <ScaleMetric kMetric = ScaleMetric::MSE, bool kBounded = false>
FOURBIT_HD Nvfp4Block fos_quantize_block(const float (&x)[16], const FosBlockScales& s) {
  const detail::FosCandidate c6 = s.c6, c4 = s.c4;
  uint32_t w6[2] = {0u, 0u}, w4[2] = {0u, 0u}, signs[2];
  float err6 = 0.0f, err4 = 0.0f;  // NUMERICS 4/6: summed in element order
  FOURBIT_UNROLL
  for (int i = 0; i < 16; ++i) {
    const float v6 = c6.code22<!kBounded>(x[i]), v4 = c4.code22<!kBounded>(x[i]);
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
  signs[0] = detail::sign_word(x);
  signs[1] = detail::sign_word(x + 8);
  const bool four = err4 < err6;  // NUMERICS: ties keep 6
  const uint32_t code = ue4m3_code_of(four ? s.sc4 : s.sc6);
  const uint64_t packed =
      (four ? detail::words(w4) : detail::words(w6)) | (detail::words(signs) & 0x8888888888888888ull);
  return {code == 0 ? 0 : packed, uint8_t(code), four};  // NUMERICS: a zero scale stores all-zero codes
}

// nvfp4_quantize_block(x, n, block_amax, s_enc, s_dec, kFos, kMetric, RNE, ...) for a block whose
// values are all finite (x[n..16) = +0, see fos_quantize_block). block_amax may be a 16x16 tile's.
// Four Over Six: fos_quantize_block, or the generic quantizer for a group outside FosGroup::exact;
// on the device only with the whole warp converged (kernels build the group once per group
// instead, see nvfp4_row_fast_kernel).
template <bool kFos, ScaleMetric kMetric = ScaleMetric::MSE>
FOURBIT_HD Nvfp4Block nvfp4_quantize_block_fast(const float (&x)[16], float block_amax, float s_enc,
                                                float s_dec) {
  if constexpr (!kFos) {
    const uint8_t s6 = ue4m3_encode_fast(mul_rn(block_amax / 6.0f, s_enc));
    if (s6 == 0) return {0, 0, false};  // NUMERICS: a zero scale stores all-zero codes
    const float enc = nvfp4_enc_scale_fast(e4m3_decode_fast(s6), s_dec);
    uint32_t w[2] = {0u, 0u};
    FOURBIT_UNROLL
    for (int i = 0; i < 16; ++i)
      w[i / 8] |= detail::e2m1_magnitude_at(e2m1_rne_magnitude(mul_rn(x[i], enc)), i) |
                  detail::e2m1_sign_at(x[i], i);
    return {detail::words(w), s6, false};
  } else {
    const FosGroup g = fos_group(s_dec);
    if (!g.exact) {
      float copy[16];
      for (int i = 0; i < 16; ++i) copy[i] = x[i];
      return nvfp4_quantize_block(copy, 16, block_amax, s_enc, s_dec, true, kMetric, Rounding::RNE, 0, 0, 0);
    }
    const FosBlockScales s = fos_block_scales(block_amax, s_enc, g);
    return fos_bounded(block_amax, s) ? fos_quantize_block<kMetric, true>(x, s)
                                      : fos_quantize_block<kMetric>(x, s);
  }
}

// ---- MXFP8 -----------------------------------------------------------------------------------------

// Philox-4x32-10 (philox.h) with the key schedule computed once per thread (no key additions in
// the rounds). Each 32x32 -> 64-bit product is one 64-bit product in the source, so that it is
// one IMAD.WIDE.U32 on the device (its halves are a register pair); written as __umulhi and a
// 32-bit product it was two instructions (IMAD.HI.U32 + IMAD): SASS, sm_90a, in
// requantize_transposed_kernel: ~59 instructions a call before, ~39 now (20 products, 20
// three-way XORs, less what a caller's constant stream and keys let the compiler hoist).
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
    const uint64_t p0 = uint64_t(kMul0) * c0, p1 = uint64_t(kMul1) * c2;
    c0 = uint32_t(p1 >> 32) ^ c1 ^ keys.k0[round];
    c1 = uint32_t(p1);
    c2 = uint32_t(p0 >> 32) ^ c3 ^ keys.k1[round];
    c3 = uint32_t(p0);
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// MXFP8 stochastic rounding, minifloat_encode(elem, x, 127 - scale, SR, rnd16) (= mxfp8_encode
// with SR; rnd16: the element's 16 random bits, sr_bits), for finite x, in two parts. The caller
// forms u = bits(|x| * x_scale), x_scale = pow2f(127 - scale): that product is exact whenever it
// is a normal float, and below 2^-126 both the generic encoder and these give a count of 0.
// kExpBits: 4 (E4M3) or 5 (E5M2).
template <int kExpBits>
struct Mxfp8Sr {
  static constexpr int kMan = kExpBits == 4 ? 3 : 2;
  static constexpr int kBias = kExpBits == 4 ? 7 : 15;
  static constexpr int kMaxCode = kExpBits == 4 ? 0x7e : 0x7b;
  static constexpr int kEminBiased = 1 - kBias + 127;  // the target's smallest normal, float32-biased
  static constexpr uint32_t kMinNormalBits = uint32_t(kEminBiased) << 23;
  // The common form drops 23 - m > 16 bits: the random bits go in 7 - m bits above the bottom.
  static constexpr int kRandomShift = 7 - kMan;
  static_assert(23 - kMan > 16, "the common form truncates the remainder to its top 16 bits");

  // The general form, for every u. With u's biased exponent eb and significand sig (implicit bit
  // included), the generic count is shift_round_sr(sig, shift, rnd16), shift = 23 - m +
  // max(eb, emin) - eb, which is the high half of floor(sig * 2^(16 - shift)) + rnd16 (round.h).
  static FOURBIT_HD uint32_t code_wide(uint32_t u, uint32_t rnd16) {
    const int eb = int(u >> 23);
    const int eqb = eb > kEminBiased ? eb : kEminBiased;
    const uint32_t shift = uint32_t(23 - kMan + eqb - eb);
    const uint32_t sig = (u & 0x7fffffu) | 0x800000u;  // u below 2^-126: shift >= 120, count 0
    const uint64_t scaled = (uint64_t(sig) << 16) >> (shift < 63u ? shift : 63u);
    const uint32_t n = uint32_t((scaled + rnd16) >> 16);
    const uint32_t code = (uint32_t(eqb - kEminBiased) << kMan) + n;
    return code > uint32_t(kMaxCode) ? uint32_t(kMaxCode) : code;
  }

  // Whether u needs code_wide: a nonzero value below the target's smallest normal.
  static FOURBIT_HD bool needs_wide(uint32_t u) { return u - 1u < kMinNormalBits - 1u; }

  // The common form, for u = 0 or u at or above the smallest normal: the shift is 23 - m, so the
  // kept bits of u, rebiased, are the code (a carry out of the mantissa lands on the next
  // binade's code), and the dropped 23 - m bits take rnd16 * 2^(7 - m): the carry into the kept
  // bits happens exactly when their top 16 bits plus rnd16 reach 2^16, the truncated remainder
  // of round.h's rule. u = 0 goes negative and is clamped to code 0.
  static FOURBIT_HD uint32_t code_normal(uint32_t u, uint32_t rnd16) {
    const int c = int((u + (rnd16 << kRandomShift)) >> (23 - kMan)) - ((127 - kBias) << kMan);
    return uint32_t(c < 0 ? 0 : c > kMaxCode ? kMaxCode : c);
  }

  static FOURBIT_HD uint8_t encode(float x, float x_scale, uint32_t rnd16) {
    const uint32_t u = bits_of(mul_rn(fabs_hd(x), x_scale));
    const uint32_t code = needs_wide(u) ? code_wide(u, rnd16) : code_normal(u, rnd16);
    return uint8_t(code | ((bits_of(x) >> 24) & 0x80u));
  }
};

template <int kExpBits>
FOURBIT_HD uint8_t mxfp8_encode_sr_fast(float x, float x_scale, uint32_t rnd16) {
  return Mxfp8Sr<kExpBits>::encode(x, x_scale, rnd16);
}

// MXFP8 round-to-nearest-even, minifloat_encode(elem, x, 127 - scale, RNE) (= mxfp8_encode), for
// every x, from u = bits(|x| * x_scale) as Mxfp8Sr forms it: the CPU's block loop (the GPU
// converts in hardware). At or above the smallest normal the kept bits of u are the code after
// adding half a quantum less one plus the kept lsb (ties go to the even code; a carry lands on
// the next binade's code); below it the count is sig shifted by more, rounded the same way, and
// 0 once the shift reaches 25 (sig < 2^24 is then below half a quantum), so the shift is clamped
// there rather than branched on. Both forms are computed and selected, as is the NaN code: no
// branch on the value, and the loop over a block vectorizes.
template <int kExpBits>
struct Mxfp8Rne {
  using Sr = Mxfp8Sr<kExpBits>;
  static constexpr uint32_t kNanCode = kExpBits == 4 ? e4m3_spec().nan_code : e5m2_spec().nan_code;
  static FOURBIT_HD uint32_t round_shift(uint32_t v, uint32_t shift) {
    return (v + (1u << (shift - 1)) - 1u + ((v >> shift) & 1u)) >> shift;
  }
  static FOURBIT_HD uint32_t code_wide(uint32_t u) {  // u nonzero below the smallest normal
    const uint32_t s = uint32_t(23 - Sr::kMan + Sr::kEminBiased) - (u >> 23);
    return round_shift((u & 0x7fffffu) | 0x800000u, s < 25u ? s : 25u);
  }
  static FOURBIT_HD uint32_t code_normal(uint32_t u) {  // u = 0 or at or above the smallest normal
    const int c = int(round_shift(u, 23 - Sr::kMan)) - ((127 - Sr::kBias) << Sr::kMan);
    return uint32_t(c < 0 ? 0 : c > Sr::kMaxCode ? Sr::kMaxCode : c);
  }
  static FOURBIT_HD uint8_t encode(float x, float x_scale) {
    const uint32_t u = bits_of(mul_rn(fabs_hd(x), x_scale));
    const uint32_t code = is_nan_bits(x) ? kNanCode : Sr::needs_wide(u) ? code_wide(u) : code_normal(u);
    return uint8_t(code | ((bits_of(x) >> 24) & 0x80u));
  }
};

// MXFP8 E4M3 stochastic rounding four codes at a time, for blocks whose RCEIL scale leaves every
// value at most 448 (nothing clips, so no clamp) and none of them below E4M3's smallest normal
// 2^-6 but zeros (needs_wide says which block is not one: it takes Mxfp8Sr). Equal to
// Mxfp8Sr<4>::encode(x, pow2f(127 - scale), rnd16) there:
//  - y8 = bits of |x| * 2^(119 - scale): Mxfp8Sr's u with 8 taken off its exponent field
//    (exact: u is a normal float here, and so is u * 2^-8 >= 2^-14; a zero stays zero, and a
//    value whose product underflows had u < 2^-126, where Mxfp8Sr's count is 0 too).
//  - r8 = rnd16 << 8 (random_at_8: one byte move from the Philox word), z = (y8 << 4) + r8: its
//    bits 4..31 are bits 0..27 of y8 + (rnd16 << 4), so bits 24..30 are those of field =
//    (y8 + (rnd16 << 4)) >> 20. code_normal is ((u + (rnd16 << 4)) >> 20) - 960 = field + 64 -
//    960 = field - 7 * 128, and the code is below 128: code = field mod 128, z's bits 24..30. No
//    subtraction and no clamp (a zero's field is 0, where the clamp gave 0; 448 has no bits below
//    to carry).
//  - the sign: bit 31 of x's bits. Byte moves (PRMT) gather the four z's and the four x's top
//    bytes, one LOP3 merges them under the mask 0x7f7f7f7f.
struct E4m3SrWords {
  static constexpr uint32_t kNormalBits = Mxfp8Sr<4>::kMinNormalBits - (8u << 23);  // E4M3's smallest normal * 2^-8

  static FOURBIT_HD float x_scale8(uint8_t scale) { return pow2f(119 - int(scale)); }
  static FOURBIT_HD uint32_t scaled(float x, float x_scale8) { return bits_of(mul_rn(fabs_hd(x), x_scale8)); }
  // A nonzero y8 below the target's smallest normal.
  static FOURBIT_HD bool needs_wide(uint32_t y8) { return y8 - 1u < kNormalBits - 1u; }
  // sr_bits_of(r, k) << 8: bytes 0 and 1 (k even) or 2 and 3 (k odd) of word k / 2 moved to bytes
  // 1 and 2, zeros around them (selector nibble 4: byte 0 of the zero operand).
  static FOURBIT_HD uint32_t random_at_8(const Philox4x32& r, int k) {
    return byte_perm(r.v[(k >> 1) & 3], 0u, (k & 1) ? 0x4324u : 0x4104u);
  }
  static FOURBIT_HD uint32_t code_at_24(uint32_t y8, uint32_t r8) { return (y8 << 4) + r8; }
  // Codes of elements 0..3 (z: code_at_24, xb: the inputs' bits) as one word, element e in byte e.
  static FOURBIT_HD uint32_t pack(uint32_t z0, uint32_t z1, uint32_t z2, uint32_t z3, uint32_t xb0,
                                  uint32_t xb1, uint32_t xb2, uint32_t xb3) {
    const uint32_t codes = byte_perm(byte_perm(z0, z1, 0x0073u), byte_perm(z2, z3, 0x7300u), 0x7610u);
    const uint32_t signs = byte_perm(byte_perm(xb0, xb1, 0x0073u), byte_perm(xb2, xb3, 0x7300u), 0x7610u);
    return select_bits(0x7f7f7f7fu, codes, signs);
  }
};

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
