// defines: kNvfp4Block, ScaleMetric, nvfp4_s_enc, nvfp4_s_dec, nvfp4_block_scale,
//          nvfp4_block_scale_4, nvfp4_enc_scale, nvfp4_dequant, Nvfp4Block, nvfp4_quantize_block
//          (the block decoder over these products: formats.h nvfp4_decode_block)
// NVFP4: E2M1 values in 1x16 blocks, one UE4M3 scale per block, one FP32 outer scale per group
// (tensor, token row or expert slice). Every step below is the formula of NUMERICS "NVFP4",
// in its order, each operation rounded to float32.
#pragma once
#include <cmath>

#include "fourbit/numerics/minifloat.h"
#include "fourbit/numerics/philox.h"

namespace fourbit::num {

inline constexpr int kNvfp4Block = 16;
enum class ScaleMetric : uint8_t { MSE = 0, MAE = 1 };

// S_enc = fl(6 * Emax / amax_G), Emax = 448, or 256 under Four Over Six so the 1.5x candidate
// still fits E4M3; 1 when amax_G is 0 or not finite; FLT_MAX when the quotient overflows (amax_G
// below ~8e-36: TransformerEngine's rule, so such a group still quantizes instead of flushing).
FOURBIT_HD float nvfp4_s_enc(float amax_g, bool four_over_six) {
  const float six_emax = four_over_six ? 1536.0f : 2688.0f;  // 6*256, 6*448: exact
  // fminf takes +Inf (the overflow) to FLT_MAX and leaves every finite quotient; amax_G = 0 or
  // Inf (quotient Inf or 0) and NaN take the first branch
  const float s = fminf(six_emax / amax_g, 3.40282347e38f);
  return (amax_g == 0.0f || !is_finite_bits(amax_g)) ? 1.0f : s;
}
FOURBIT_HD float nvfp4_s_dec(float s_enc) { return 1.0f / s_enc; }

// s_b = E4M3_rne_satfinite(fl(fl(block_amax / 6) * S_enc))   ("map max to 6")
FOURBIT_HD uint8_t nvfp4_block_scale(float block_amax, float s_enc) {
  return ue4m3_encode(mul_rn(block_amax / 6.0f, s_enc));
}
// s_b4 = E4M3_rne_satfinite(fl(fl(fl(block_amax / 6) * S_enc) * 1.5))   ("map max to 4")
FOURBIT_HD uint8_t nvfp4_block_scale_4(float block_amax, float s_enc) {
  return ue4m3_encode(mul_rn(mul_rn(block_amax / 6.0f, s_enc), 1.5f));
}

// enc_b = fl(1 / fl(E4M3(s_b) * S_dec)), 0 for a zero scale. Stated choice beyond NUMERICS: when
// the reciprocal overflows (only for groups with amax below ~1e-33) it is clamped to FLT_MAX so
// the block still encodes finite codes instead of NaN for its zeros.
FOURBIT_HD float nvfp4_enc_scale(uint8_t s_b, float s_dec) {
  if (s_b == 0) return 0.0f;
  const float r = 1.0f / mul_rn(ue4m3_decode(s_b), s_dec);
  return is_finite_bits(r) ? r : 3.40282347e38f;
}

// x_hat = E2M1(q) * E4M3(s_b) * S_dec: the first product is exact (2 x 4 significant bits).
FOURBIT_HD float nvfp4_dequant(uint32_t code, uint8_t s_b, float s_dec) {
  return mul_rn(e2m1_decode(code) * ue4m3_decode(s_b), s_dec);
}

struct Nvfp4Block {
  uint64_t packed;  // 16 E2M1 codes, element 2k in the low nibble of byte k
  uint8_t scale;    // UE4M3
  bool chose_four;  // Four Over Six picked the 1.5x scale
};

// Quantizes n <= 16 values x[0..n) (missing tail values count as zeros and get code 0).
// block_amax is max |x| over the block, or over the 16x16 tile for 2D weight scales.
// Four Over Six candidates are compared with RNE codes; the chosen scale is then used with
// `rounding` (RNE or SR). SR bits: sr_bits(seed, stream, index0 + i).
FOURBIT_HD Nvfp4Block nvfp4_quantize_block(const float* x, int n, float block_amax, float s_enc,
                                           float s_dec, bool four_over_six, ScaleMetric metric,
                                           Rounding rounding, uint64_t seed, uint64_t stream,
                                           uint64_t index0) {
  Nvfp4Block out{0, nvfp4_block_scale(block_amax, s_enc), false};
  const int m = n < kNvfp4Block ? n : kNvfp4Block;
  if (four_over_six) {
    const uint8_t s4 = nvfp4_block_scale_4(block_amax, s_enc);
    const float enc6 = nvfp4_enc_scale(out.scale, s_dec);
    const float enc4 = nvfp4_enc_scale(s4, s_dec);
    const float sc6 = ue4m3_decode(out.scale), sc4 = ue4m3_decode(s4);
    uint64_t packed6 = 0, packed4 = 0;  // the RNE candidates, reused when rounding is RNE
    float err6 = 0.0f, err4 = 0.0f;     // summed in element order (NUMERICS 4/6 metric)
    for (int i = 0; i < m; ++i) {
      const uint32_t c6 = out.scale ? e2m1_encode(mul_rn(x[i], enc6)) : 0u;
      const uint32_t c4 = s4 ? e2m1_encode(mul_rn(x[i], enc4)) : 0u;
      packed6 |= uint64_t(c6) << (4 * i);
      packed4 |= uint64_t(c4) << (4 * i);
      // x_hat = fl(E2M1 * E4M3) * S_dec, as nvfp4_dequant (the scale decoded once per block)
      const float d6 = sub_rn(x[i], mul_rn(e2m1_decode(c6) * sc6, s_dec));
      const float d4 = sub_rn(x[i], mul_rn(e2m1_decode(c4) * sc4, s_dec));
      if (metric == ScaleMetric::MSE) {
        err6 = add_rn(err6, mul_rn(d6, d6));
        err4 = add_rn(err4, mul_rn(d4, d4));
      } else {
        err6 = add_rn(err6, abs_bits(d6));
        err4 = add_rn(err4, abs_bits(d4));
      }
    }
    const bool four = err4 < err6;  // NUMERICS: ties keep 6
    if (four) {
      out.scale = s4;
      out.chose_four = true;
    }
    if (rounding == Rounding::RNE) {
      out.packed = four ? packed4 : packed6;
      return out;
    }
  }
  if (out.scale == 0) return out;  // NUMERICS: a zero scale stores all-zero codes
  const float enc = nvfp4_enc_scale(out.scale, s_dec);
  SrBits rnd(seed, stream);
  for (int i = 0; i < m; ++i) {
    const uint32_t r = rounding == Rounding::SR ? rnd.at(index0 + uint64_t(i)) : 0u;
    const uint64_t code = e2m1_encode(mul_rn(x[i], enc), rounding, r);
    out.packed |= code << (4 * i);
  }
  return out;
}

}  // namespace fourbit::num
