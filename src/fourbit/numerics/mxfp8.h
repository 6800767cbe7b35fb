// defines: kMxBlock, MxScaleRule, mxfp8_scale, mxfp8_encode, mxfp8_decode, mxfp8_quantize_block
// MXFP8: E4M3 or E5M2 values in 1x32 blocks with one UE8M0 scale (NUMERICS "MXFP8"). The scale is
// rounded up (RCEIL) by default so no element clips; the OCP floor rule is an option.
#pragma once
#include "fourbit/numerics/minifloat.h"
#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif
#include "fourbit/numerics/philox.h"
#include "fourbit/numerics/ue8m0.h"

namespace fourbit::num {

inline constexpr int kMxBlock = 32;
enum class MxScaleRule : uint8_t { RCEIL = 0, FLOOR = 1 };

FOURBIT_HD uint8_t mxfp8_scale(float block_amax, MiniFloatSpec elem, MxScaleRule rule) {
  const bool e4m3 = elem.exp_bits == 4;
  if (rule == MxScaleRule::FLOOR) return ue8m0_scale_floor(block_amax, e4m3 ? 8 : 15);
  return ue8m0_scale_for_max(block_amax, e4m3 ? kE4M3Max : kE5M2Max);
}

// q = encode(x * 2^-(E-127)); the scaling is applied to the exponent, exactly.
// On Ada/Hopper devices RNE goes through the hardware conversion (cvt.rn.satfinite.e4m3/e5m2):
// x * 2^-(E-127) is exact wherever the result is a normal float, and below 2^-126 both paths give
// (signed) zero, so the codes are the ones minifloat_encode gives (NaN keeps the software path).
// tests/ops/cuda_quantize_test.cpp compares every GPU code with the CPU's.
FOURBIT_HD uint8_t mxfp8_encode(float x, uint8_t scale, MiniFloatSpec elem,
                                Rounding rounding = Rounding::RNE, uint32_t rnd = 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (rounding == Rounding::RNE && !is_nan_bits(x)) {
    const float y = mul_rn(x, pow2f(127 - int(scale)));
    return uint8_t(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, elem.exp_bits == 4 ? __NV_E4M3 : __NV_E5M2));
  }
#endif
  return uint8_t(minifloat_encode(elem, x, 127 - int(scale), rounding, rnd));
}

// x_hat = elem(q) * 2^(E-127): exact in float32 (at least 2^-143 > 2^-149).
FOURBIT_HD float mxfp8_decode(uint8_t code, uint8_t scale, MiniFloatSpec elem) {
  return minifloat_decode(elem, code) * ue8m0_decode(scale);
}

// One block of n <= 32 values: picks the scale from block_amax, writes n codes, returns the scale.
// SR bits: sr_bits(seed, stream, index0 + i).
FOURBIT_HD uint8_t mxfp8_quantize_block(const float* x, int n, float block_amax,
                                        MiniFloatSpec elem, MxScaleRule rule,
                                        Rounding rounding, uint64_t seed, uint64_t stream,
                                        uint64_t index0, uint8_t* codes) {
  const uint8_t scale = mxfp8_scale(block_amax, elem, rule);
  SrBits rnd(seed, stream);
  for (int i = 0; i < n; ++i) {
    const uint32_t r = rounding == Rounding::SR ? rnd.at(index0 + uint64_t(i)) : 0u;
    codes[i] = mxfp8_encode(x[i], scale, elem, rounding, r);
  }
  return scale;
}

}  // namespace fourbit::num
