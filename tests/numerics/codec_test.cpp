// defines: the scalar codec tests (E2M1, E4M3, E5M2, UE4M3, UE8M0, S2F6, BF16, E2M1 packing)
// Exhaustive scalar codec tests against the format definitions of NUMERICS.md: every code's value
// is computed here from its fields (reference_formats.h), never with fourbit's decoders; every
// code round-trips; every midpoint rounds to the even code and its float32 neighbours to the
// nearer side; saturation, NaN and -0.0 as the contract states. Also UE8M0 (nearest power, ties
// up; RCEIL scale choice against a brute-force search), S2F6, BF16 and the E2M1 nibble order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "fourbit/numerics/bf16.h"
#include "fourbit/numerics/minifloat.h"
#include "fourbit/numerics/mxfp4.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/s2f6.h"
#include "fourbit/numerics/ue8m0.h"
#include "fourbit/ops/ops.h"
#include "numerics/reference_formats.h"

using namespace fourbit;
using namespace fourbit::num;
using test::GridPoint;
using test::RefFormat;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Codec {
  const RefFormat& ref;
  float (*decode)(uint32_t);
  uint32_t (*encode)(float);
  uint32_t max_code;  // +max; the negative one is max_code | sign bit
};

const Codec kCodecs[] = {
    {test::kRefE2M1, [](uint32_t c) { return e2m1_decode(c); }, [](float x) { return uint32_t(e2m1_encode(x)); }, 0x7},
    {test::kRefE4M3, [](uint32_t c) { return e4m3_decode(c); }, [](float x) { return uint32_t(e4m3_encode(x)); }, 0x7E},
    {test::kRefE5M2, [](uint32_t c) { return e5m2_decode(c); }, [](float x) { return uint32_t(e5m2_encode(x)); }, 0x7B},
};

class MiniFloatCodec : public ::testing::TestWithParam<int> {
 protected:
  const Codec& codec() const { return kCodecs[GetParam()]; }
};

std::string codec_name(const ::testing::TestParamInfo<int>& info) { return kCodecs[info.param].ref.name; }

TEST_P(MiniFloatCodec, DecodeEveryCodeFromItsFields) {
  const Codec& c = codec();
  const uint32_t n = 1u << c.ref.code_bits();
  for (uint32_t code = 0; code < n; ++code) {
    const double want = test::ref_decode(c.ref, code);
    const float got = c.decode(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c.ref.name << " code 0x" << std::hex << code;
    } else {
      ASSERT_EQ(double(float(want)), want) << "reference value not a float32";
      EXPECT_EQ(bits_of(got), bits_of(float(want)))
          << c.ref.name << " code 0x" << std::hex << code << ": got " << got << " want " << want;
    }
  }
}

TEST_P(MiniFloatCodec, NanAndInfCodesMatchTheTable) {
  const Codec& c = codec();
  const std::string name = c.ref.name;
  if (name == "e2m1") {
    for (uint32_t code = 0; code < 16; ++code) EXPECT_TRUE(std::isfinite(c.decode(code))) << code;
  } else if (name == "e4m3") {
    for (uint32_t code = 0; code < 256; ++code)
      EXPECT_EQ(std::isnan(c.decode(code)), (code & 0x7F) == 0x7F) << std::hex << code;
  } else {
    EXPECT_EQ(c.decode(0x7C), kInf);
    EXPECT_EQ(c.decode(0xFC), -kInf);
    for (uint32_t code = 0; code < 256; ++code)
      EXPECT_EQ(std::isnan(c.decode(code)), (code & 0x7F) >= 0x7D) << std::hex << code;
  }
}

TEST_P(MiniFloatCodec, EncodeOfEveryDecodedValueGivesItsCode) {
  const Codec& c = codec();
  const uint32_t n = 1u << c.ref.code_bits();
  for (uint32_t code = 0; code < n; ++code) {
    const float v = c.decode(code);
    if (std::isnan(v)) continue;
    if (std::isinf(v)) {
      // E5M2 +-Inf: the encoder is satfinite, so Inf never comes back; it saturates to +-max.
      EXPECT_EQ(c.encode(v), (code & c.ref.sign_bit()) | c.max_code) << std::hex << code;
      continue;
    }
    EXPECT_EQ(c.encode(v), code) << c.ref.name << " value " << v << " code 0x" << std::hex << code;
  }
}

TEST_P(MiniFloatCodec, MidpointsRoundToEvenAndNeighboursToTheNearerSide) {
  const Codec& c = codec();
  const auto grid = test::ref_grid(c.ref);
  const uint32_t sign = c.ref.sign_bit();
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const GridPoint lo = grid[i], hi = grid[i + 1];
    ASSERT_EQ(hi.code, lo.code + 1);  // adjacent magnitudes have adjacent codes
    const double mid_d = (lo.value + hi.value) / 2;
    const float mid = float(mid_d);
    ASSERT_EQ(double(mid), mid_d) << "midpoint not exact in float32";
    const uint32_t even = (lo.code & 1u) == 0 ? lo.code : hi.code;
    EXPECT_EQ(c.encode(mid), even) << c.ref.name << " midpoint " << mid;
    EXPECT_EQ(c.encode(-mid), sign | even) << c.ref.name << " midpoint " << -mid;
    const float below = std::nextafter(mid, float(lo.value));
    const float above = std::nextafter(mid, float(hi.value));
    EXPECT_EQ(c.encode(below), lo.code) << c.ref.name << " " << below;
    EXPECT_EQ(c.encode(above), hi.code) << c.ref.name << " " << above;
    EXPECT_EQ(c.encode(-below), sign | lo.code) << c.ref.name << " " << -below;
    EXPECT_EQ(c.encode(-above), sign | hi.code) << c.ref.name << " " << -above;
    // The float32 neighbours of a representable value stay on it.
    if (lo.value > 0) {
      EXPECT_EQ(c.encode(std::nextafter(float(lo.value), 0.0f)), lo.code);
      EXPECT_EQ(c.encode(std::nextafter(float(lo.value), kInf)), lo.code);
    }
  }
}

// Random float32s over the whole range (log-uniform magnitudes, float32 subnormals, either sign)
// against the nearest grid value found by search.
TEST_P(MiniFloatCodec, RandomInputsRoundToNearestEven) {
  const Codec& c = codec();
  const auto grid = test::ref_grid(c.ref);
  const double max = grid.back().value, min_sub = grid[1].value;
  std::mt19937 gen(1234 + GetParam());
  std::uniform_real_distribution<double> log2mag(std::log2(min_sub) - 4, std::log2(max) + 2);
  std::uniform_int_distribution<uint32_t> subnormal_bits(1, (1u << 23) - 1);
  int64_t bad = 0;
  for (int i = 0; i < 300000; ++i) {
    float x = i % 16 == 0 ? float_of(subnormal_bits(gen)) : float(std::exp2(log2mag(gen)));
    if (i & 1) x = -x;
    const uint32_t want = test::ref_nearest_code(c.ref, grid, x);
    const uint32_t got = c.encode(x);
    if (got != want && ++bad <= 10)
      ADD_FAILURE() << c.ref.name << " encode(" << x << ") = 0x" << std::hex << got << ", want 0x" << want;
  }
  EXPECT_EQ(bad, 0);
}

TEST_P(MiniFloatCodec, SaturatesToMaxFinite) {
  const Codec& c = codec();
  const float max = float(test::ref_max(c.ref));
  const uint32_t neg_max = c.ref.sign_bit() | c.max_code;
  EXPECT_EQ(c.decode(c.max_code), max);
  const float above[] = {std::nextafter(max, kInf), max * 1.0625f, max * 1.125f, max * 1.5f, max * 2.0f,
                         max * 1e6f, 1e30f, FLT_MAX, kInf};
  for (float x : above) {
    EXPECT_EQ(c.encode(x), c.max_code) << c.ref.name << " " << x;
    EXPECT_EQ(c.encode(-x), neg_max) << c.ref.name << " " << -x;
  }
}

TEST_P(MiniFloatCodec, NanAndSignedZero) {
  const Codec& c = codec();
  const std::string name = c.ref.name;
  EXPECT_EQ(c.encode(0.0f), 0u);
  EXPECT_EQ(c.encode(-0.0f), c.ref.sign_bit());  // E2M1 0x8, E4M3/E5M2 0x80
  EXPECT_TRUE(std::signbit(c.decode(c.ref.sign_bit())));
  if (name == "e4m3") {
    EXPECT_EQ(c.encode(kNaN), 0x7Fu);
    EXPECT_EQ(c.encode(-kNaN), 0xFFu);
    EXPECT_EQ(c.encode(float_of(0x7f800001u)), 0x7Fu);  // signalling NaN payload
  } else if (name == "e5m2") {
    for (float nan : {kNaN, -kNaN, float_of(0x7f800001u)}) {
      const uint32_t code = c.encode(nan);
      EXPECT_GE(code & 0x7Fu, 0x7Du) << std::hex << code;
      EXPECT_TRUE(std::isnan(c.decode(code)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codec, MiniFloatCodec, ::testing::Values(0, 1, 2), codec_name);

TEST(Ue4m3Codec, DropsTheSignAndUsesTheE4M3Grid) {
  for (uint32_t code = 0; code < 0x7F; ++code) {
    const float v = float(test::ref_decode(test::kRefE4M3, code));
    EXPECT_EQ(ue4m3_decode(code), v);
    EXPECT_EQ(ue4m3_encode(v), code);
    EXPECT_EQ(ue4m3_encode(-v), code);
  }
  EXPECT_EQ(ue4m3_encode(1e9f), 0x7Eu);
}

// ---- UE8M0 ----------------------------------------------------------------------------------

TEST(Ue8m0Codec, DecodeEveryCode) {
  for (uint32_t code = 0; code < 255; ++code) {
    const double want = std::ldexp(1.0, int(code) - 127);  // 2^-127 is a float32 subnormal
    ASSERT_EQ(double(float(want)), want);
    EXPECT_EQ(ue8m0_decode(code), float(want)) << code;
    EXPECT_EQ(ue8m0_encode(float(want)), code) << code;
  }
  EXPECT_TRUE(std::isnan(ue8m0_decode(0xFF)));
  EXPECT_EQ(ue8m0_encode(kNaN), 0xFFu);
  EXPECT_EQ(ue8m0_encode(-kNaN), 0xFFu);
}

TEST(Ue8m0Codec, NearestPowerWithTiesUp) {
  for (int k = -127; k <= 126; ++k) {
    const float tie = float(std::ldexp(1.5, k));  // exact, also for the subnormal 1.5 * 2^-127
    ASSERT_EQ(double(tie), std::ldexp(1.5, k));
    EXPECT_EQ(ue8m0_encode(tie), uint32_t(k + 128)) << "1.5*2^" << k << " ties up";
    EXPECT_EQ(ue8m0_encode(std::nextafter(tie, 0.0f)), uint32_t(k + 127)) << k;
    EXPECT_EQ(ue8m0_encode(std::nextafter(tie, kInf)), uint32_t(k + 128)) << k;
  }
  // float32 subnormals between 2^-127 and 2^-126 go to the nearer power too.
  EXPECT_EQ(ue8m0_encode(float(std::ldexp(1.0001, -127))), 0u);
  EXPECT_EQ(ue8m0_encode(float(std::ldexp(1.4999, -127))), 0u);
  EXPECT_EQ(ue8m0_encode(float(std::ldexp(1.6, -127))), 1u);
  EXPECT_EQ(ue8m0_encode(float(std::ldexp(1.9999, -127))), 1u);
  // Above 2^127 saturate to the largest code.
  EXPECT_EQ(ue8m0_encode(float(std::ldexp(1.5, 127))), 0xFEu);
  EXPECT_EQ(ue8m0_encode(FLT_MAX), 0xFEu);
}

TEST(Ue8m0Codec, RandomInputsGoToTheNearestPower) {
  std::mt19937 gen(77);
  std::uniform_real_distribution<double> log2mag(-127.0, 127.5);
  for (int i = 0; i < 200000; ++i) {
    const float x = float(std::exp2(log2mag(gen)));
    if (!(x >= std::ldexp(1.0, -127)) || !(double(x) < std::ldexp(1.5, 127))) continue;
    int k;
    std::frexp(double(x), &k);
    k -= 1;  // 2^k <= x < 2^(k+1)
    const double down = double(x) - std::ldexp(1.0, k), up = std::ldexp(1.0, k + 1) - double(x);
    const uint32_t want = uint32_t((up <= down ? k + 1 : k) + 127);
    ASSERT_EQ(ue8m0_encode(x), want) << x;
  }
}

// RCEIL: the smallest E in [0, 254] with amax <= max * 2^(E-127), found by trying every E in double;
// when no E fits (amax above max * 2^127) the clamp gives 254.
uint32_t brute_force_scale(double amax, double max) {
  if (amax == 0) return 127;
  for (int e = 0; e <= 254; ++e)
    if (amax <= max * std::ldexp(1.0, e - 127)) return uint32_t(e);
  return 254;
}

TEST(Ue8m0Codec, ScaleForMaxIsTheSmallestSufficientPower) {
  std::mt19937 gen(2024);
  std::uniform_real_distribution<double> log2mag(-149.0, 128.0);
  std::uniform_int_distribution<int> shift(-140, 120);
  for (const float max : {448.0f, 57344.0f, 127.0f / 64.0f}) {
    EXPECT_EQ(ue8m0_scale_for_max(0.0f, max), 127u);
    std::vector<float> amaxes = {FLT_MAX, FLT_MIN, float_of(1u), max, std::nextafter(max, kInf),
                                 std::nextafter(max, 0.0f)};
    for (int i = 0; i < 100000; ++i) amaxes.push_back(float(std::exp2(log2mag(gen))));
    for (int i = 0; i < 5000; ++i) {
      // Exactly max * 2^j and its float32 neighbours: the boundaries where ceil() steps.
      const float m = float(std::ldexp(double(max), shift(gen)));
      amaxes.insert(amaxes.end(), {m, std::nextafter(m, kInf), std::nextafter(m, 0.0f)});
    }
    for (float a : amaxes) {
      if (!(a > 0) || !std::isfinite(a)) continue;
      ASSERT_EQ(uint32_t(ue8m0_scale_for_max(a, max)), brute_force_scale(a, max))
          << "amax " << a << " max " << max;
    }
  }
}

// ---- S2F6 -----------------------------------------------------------------------------------

TEST(S2f6Codec, EveryCodeDecodesAndRoundTrips) {
  for (int s = -128; s <= 127; ++s) {
    const double want = double(s) / 64.0;
    EXPECT_EQ(s2f6_decode(int8_t(s)), float(want)) << s;
    EXPECT_EQ(int(s2f6_encode(float(want))), s) << s;
  }
}

TEST(S2f6Codec, MidpointsRoundToEven) {
  for (int k = -128; k < 127; ++k) {
    const float mid = float((k + 0.5) / 64.0);
    ASSERT_EQ(double(mid), (k + 0.5) / 64.0);
    const int even = (k % 2 == 0) ? k : k + 1;
    EXPECT_EQ(int(s2f6_encode(mid)), even) << k;
    EXPECT_EQ(int(s2f6_encode(std::nextafter(mid, -kInf))), k) << k;
    EXPECT_EQ(int(s2f6_encode(std::nextafter(mid, kInf))), k + 1) << k;
  }
}

TEST(S2f6Codec, SaturatesAndZeros) {
  for (float x : {127.0f / 64.0f, 127.5f / 64.0f, 2.0f, 3.0f, 1e20f, FLT_MAX, kInf})
    EXPECT_EQ(int(s2f6_encode(x)), 127) << x;
  for (float x : {-2.0f, -128.5f / 64.0f, -2.5f, -1e20f, -FLT_MAX, -kInf})
    EXPECT_EQ(int(s2f6_encode(x)), -128) << x;
  EXPECT_EQ(int(s2f6_encode(0.0f)), 0);
  EXPECT_EQ(int(s2f6_encode(-0.0f)), 0);
  EXPECT_EQ(int(s2f6_encode(1.0f / 256.0f)), 0);   // a quarter step rounds to 0
  EXPECT_EQ(int(s2f6_encode(-1.0f / 128.0f)), 0);  // -0.5 step: tie to even 0
}

// The block-scaled codec: q = clamp(rne(y * 64 * 2^-(E-127)), -128, 127), decode q/64 * 2^(E-127).
TEST(S2f6Codec, ScaledEncodeMatchesTheFormula) {
  std::mt19937 gen(5);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> scale(1, 253);
  for (int i = 0; i < 200000; ++i) {
    const uint8_t e = uint8_t(scale(gen));
    const float y = float(std::ldexp(double(nd(gen)), e - 127));
    if (y == 0 || !std::isfinite(y)) continue;
    const double t = std::ldexp(double(y), 6 - (e - 127));  // exact
    const double want = std::clamp(std::nearbyint(t), -128.0, 127.0);  // FE_TONEAREST: ties even
    ASSERT_EQ(double(s2f6_encode_scaled(y, e)), want) << y << " scale " << int(e);
    ASSERT_EQ(double(s2f6_decode_scaled(int8_t(want), e)), std::ldexp(want, e - 127 - 6));
  }
}

// ---- BF16 -----------------------------------------------------------------------------------

TEST(Bf16Codec, KnownBitPatterns) {
  EXPECT_EQ(bf16_encode(1.0f), 0x3F80u);
  EXPECT_EQ(bf16_encode(-2.0f), 0xC000u);
  EXPECT_EQ(bf16_encode(0.0f), 0x0000u);
  EXPECT_EQ(bf16_encode(-0.0f), 0x8000u);
  EXPECT_EQ(bf16_decode(0x3F80), 1.0f);
  EXPECT_EQ(bf16_decode(0x4049), 3.140625f);
  // Ties go to the even bf16 mantissa.
  EXPECT_EQ(bf16_encode(float_of(0x3F808000u)), 0x3F80u);  // 1 + 2^-8: tie, keep even
  EXPECT_EQ(bf16_encode(float_of(0x3F818000u)), 0x3F82u);  // tie, odd rounds up
  EXPECT_EQ(bf16_encode(float_of(0xBF818000u)), 0xBF82u);
  EXPECT_EQ(bf16_encode(float_of(0x3F808001u)), 0x3F81u);  // just above the tie
  EXPECT_EQ(bf16_encode(float_of(0x3F817FFFu)), 0x3F81u);  // just below the tie
  EXPECT_EQ(bf16_encode(float_of(0x00008000u)), 0x0000u);  // subnormal tie to even zero
  EXPECT_EQ(bf16_encode(float_of(0x00018000u)), 0x0002u);
  // NaN stays NaN (quiet), whatever the payload; the sign is kept.
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0x7F80FFFFu, 0xFF800001u}) {
    const uint16_t h = bf16_encode(float_of(nan));
    EXPECT_TRUE(std::isnan(bf16_decode(h))) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h >> 15, nan >> 31);
  }
  // Overflow of the cast is IEEE: to Inf (bf16 is a storage type, not a satfinite quantizer).
  EXPECT_EQ(bf16_encode(FLT_MAX), 0x7F80u);
  EXPECT_EQ(bf16_encode(-FLT_MAX), 0xFF80u);
  EXPECT_EQ(bf16_encode(float_of(0x7F7F8000u)), 0x7F80u);  // tie above the largest bf16: even is Inf
  EXPECT_EQ(bf16_encode(float_of(0x7F7F7FFFu)), 0x7F7Fu);
  EXPECT_EQ(bf16_encode(kInf), 0x7F80u);
  EXPECT_EQ(bf16_encode(-kInf), 0xFF80u);
}

TEST(Bf16Codec, RandomValuesRoundToNearestEven) {
  std::mt19937 gen(9);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = gen();
    const float x = float_of(u);
    if (!std::isfinite(x)) continue;
    const uint16_t h = bf16_encode(x);
    const uint16_t t = uint16_t(u >> 16);  // truncation: the bf16 neighbour toward zero
    const double lo = bf16_decode(t);
    // The neighbour away from zero; past the largest bf16 it is 2^128 (IEEE rounds to Inf there).
    const double hi = ((t + 1) & 0x7FFF) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), double(x))
                                                    : double(bf16_decode(uint16_t(t + 1)));
    const double dlo = std::fabs(double(x) - lo), dhi = std::fabs(hi - double(x));
    const uint16_t want = dlo < dhi ? t : dhi < dlo ? uint16_t(t + 1) : uint16_t(t + (t & 1));
    ASSERT_EQ(h, want) << std::hex << u;
  }
}

// ---- E2M1 nibble order ------------------------------------------------------------------------

// NUMERICS: element 2k in the low nibble; codes [0x2 (1.0), 0xA (-1.0)] pack to 0xA2. A block with
// amax 6 and S_enc = 1 has the scale E4M3(1.0) = 0x38 and enc_b = 1, so codes are the values.
TEST(E2m1Packing, ElementZeroInTheLowNibble) {
  float x[16] = {1.0f, -1.0f, 6.0f, 0.0f, -0.5f, 3.0f};
  const Nvfp4Block blk = nvfp4_quantize_block(x, 16, 6.0f, 1.0f, 1.0f, false, ScaleMetric::MSE,
                                              Rounding::RNE, 0, 0, 0);
  EXPECT_EQ(blk.scale, 0x38u);
  EXPECT_EQ(blk.packed & 0xFFu, 0xA2u);
  EXPECT_EQ((blk.packed >> 8) & 0xFFu, 0x07u);   // 6.0 = 0x7, then 0.0
  EXPECT_EQ((blk.packed >> 16) & 0xFFu, 0x59u);  // -0.5 = 0x9 low, 3.0 = 0x5 high

  const Tensor t = Tensor::from_host(x, {1, 16}, DType::F32);
  QuantSpec spec;
  spec.fmt = Format::NVFP4;
  spec.outer = OuterScale::None;
  const QTensor q = ops::quantize(t, spec);
  ASSERT_EQ(q.codes.numel(), 8);
  const uint8_t* c = q.codes.data<uint8_t>();
  EXPECT_EQ(c[0], 0xA2u);
  EXPECT_EQ(c[1], 0x07u);
  EXPECT_EQ(c[2], 0x59u);
  for (int k = 3; k < 8; ++k) EXPECT_EQ(c[k], 0u) << k;
  EXPECT_EQ(q.block_scales.data<uint8_t>()[0], 0x38u);
  EXPECT_FALSE(q.outer_scales.defined());
}

}  // namespace

// The comparison-based E2M1 encoder (the NVFP4 hot path) against the generic rounding core: every
// float32 whose magnitude lies in [2^-3, 2^3) — all seven rounding boundaries and their
// neighbourhoods — both signs, plus specials and a random sample of everything else.
TEST(E2m1FastPath, EqualsGenericEncoderOnEveryFloatOfTheRoundingRange) {
  int64_t bad = 0;
  for (uint32_t e = 124; e < 130; ++e)
    for (uint32_t m = 0; m < (1u << 23); ++m)
      for (uint32_t sign : {0u, 0x80000000u}) {
        const float x = float_of(sign | (e << 23) | m);
        if (e2m1_encode_rne(x) != uint8_t(minifloat_encode(e2m1_spec(), x)) && ++bad < 5)
          ADD_FAILURE() << "x = " << x;
      }
  std::mt19937 g(7);
  for (int i = 0; i < 2000000; ++i) {
    const float x = float_of(uint32_t(g()));
    if (e2m1_encode_rne(x) != uint8_t(minifloat_encode(e2m1_spec(), x)) && ++bad < 5)
      ADD_FAILURE() << "x bits = " << bits_of(x);
  }
  for (float x : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX, FLT_MIN, 1e-45f})
    EXPECT_EQ(e2m1_encode_rne(x), uint8_t(minifloat_encode(e2m1_spec(), x))) << x;
  EXPECT_EQ(bad, 0);
}

// MXFP4 (numerics/mxfp4.h): every code at every scale decodes to E2M1(code) * 2^(scale - 127)
// exactly (where that is a float) and encodes back to its code (-0 to 0x8); the RCEIL scale is the smallest E with
// amax <= 6 * 2^(E-127), the floor scale floor(log2 amax) - 2, on random and boundary amaxes.
TEST(Mxfp4Codec, EveryCodeAtEveryScaleRoundTrips) {
  for (uint32_t scale = 0; scale <= 254; ++scale)
    for (uint32_t code = 0; code < 16; ++code) {
      const double want = std::ldexp(test::ref_decode(test::kRefE2M1, code), int(scale) - 127);
      if (std::fabs(want) > double(FLT_MAX)) continue;  // 2 * 2^127 and up are not floats
      const float v = mxfp4_decode(code, uint8_t(scale));
      ASSERT_EQ(double(v), want) << "code " << code << " scale " << scale;
      ASSERT_EQ(mxfp4_encode(v, uint8_t(scale)), code) << "code " << code << " scale " << scale;
      ASSERT_EQ(mxfp4_encode(v, uint8_t(scale), Rounding::SR, 0xFFFFu), code) << "grid values never move under SR";
    }
}

TEST(Mxfp4Codec, ScaleRulesPickTheirPower) {
  std::mt19937 gen(9);
  std::vector<float> amaxes = {6.0f, std::nextafter(6.0f, 7.0f), 3.0f, 1.0f, 12.0f, 1e-30f, 3e30f, 0x1p-140f};
  for (int i = 0; i < 20000; ++i) amaxes.push_back(std::ldexp(float(gen() % 0xffffffu + 1) * 0x1p-24f, int(gen() % 200) - 100));
  for (float a : amaxes) {
    int e = 0;
    while (e < 254 && !(double(a) <= 6.0 * std::ldexp(1.0, e - 127))) ++e;  // RCEIL by search
    EXPECT_EQ(int(mxfp4_scale(a, MxScaleRule::RCEIL)), e) << a;
    int f2;
    std::frexp(double(a), &f2);  // a = m * 2^f2, m in [0.5, 1): floor(log2 a) = f2 - 1
    EXPECT_EQ(int(mxfp4_scale(a, MxScaleRule::FLOOR)), std::clamp(f2 - 1 - 2, -127, 127) + 127) << a;
  }
  EXPECT_EQ(mxfp4_scale(0.0f, MxScaleRule::RCEIL), kUe8m0One);
}
