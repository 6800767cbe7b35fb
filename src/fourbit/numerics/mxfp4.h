// defines: kMxfp4Block, mxfp4_scale, mxfp4_encode, mxfp4_decode, mxfp4_quantize_block
// MXFP4 (OCP Microscaling v1.0): E2M1 values in 1x32 blocks with one UE8M0 scale, no outer scale.
// The scale is rounded up (RCEIL) by default, as for MXFP8, so no element clips and SR stays
// unbiased; the OCP rule, E = floor(log2 amax) - 2 (E2M1's largest exponent), is the option that
// lets a block's largest values saturate at 6. Codes pack two to a byte as NVFP4's do (element 2k
// in the low nibble).
#pragma once
#include "fourbit/numerics/minifloat.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/philox.h"
#include "fourbit/numerics/ue8m0.h"

namespace fourbit::num {

inline constexpr int kMxfp4Block = 32;

// RCEIL: the smallest E with amax <= 6 * 2^(E-127); FLOOR: floor(log2 amax) - 2.
FOURBIT_HD uint8_t mxfp4_scale(float block_amax, MxScaleRule rule) {
  if (rule == MxScaleRule::FLOOR) return ue8m0_scale_floor(block_amax, 2);
  return ue8m0_scale_for_max(block_amax, kE2M1Max);
}

// q = E2M1(x * 2^-(E-127)), the scaling applied to the exponent (exact), RNE or SR (16 bits).
FOURBIT_HD uint8_t mxfp4_encode(float x, uint8_t scale, Rounding rounding = Rounding::RNE, uint32_t rnd16 = 0) {
  return uint8_t(minifloat_encode(e2m1_spec(), x, 127 - int(scale), rounding, rnd16));
}

// x_hat = E2M1(q) * 2^(E-127): exact (two significant bits, at least 2^-128).
FOURBIT_HD float mxfp4_decode(uint32_t code, uint8_t scale) { return e2m1_decode(code & 0xFu) * ue8m0_decode(scale); }

// One block of n <= 32 values: picks the scale from block_amax, writes the 16 packed code bytes
// (codes past n are 0), returns the scale. SR bits: sr_bits(seed, stream, index0 + i).
FOURBIT_HD uint8_t mxfp4_quantize_block(const float* x, int n, float block_amax, MxScaleRule rule,
                                        Rounding rounding, uint64_t seed, uint64_t stream, uint64_t index0,
                                        uint8_t* packed) {
  const uint8_t scale = mxfp4_scale(block_amax, rule);
  SrBits rnd(seed, stream);
  for (int k = 0; k < kMxfp4Block / 2; ++k) packed[k] = 0;
  for (int i = 0; i < n && i < kMxfp4Block; ++i) {
    const uint32_t r = rounding == Rounding::SR ? rnd.at(index0 + uint64_t(i)) : 0u;
    packed[i / 2] |= uint8_t(mxfp4_encode(x[i], scale, rounding, r) << (4 * (i % 2)));
  }
  return scale;
}

}  // namespace fourbit::num
