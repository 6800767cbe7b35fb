// defines: the FastQuant* tests: numerics/fast_quant.h against the generic numerics
// The GPU hot-path numerics (numerics/fast_quant.h) against the generic codecs and block
// quantizers they replace, bit for bit: exhaustively over every float32 where the input range
// allows (E2M1 rounding: all 2^31 magnitudes; E4M3 scale encoding: every float of the binades
// that reach a code; every code for the decoders), and on millions of random and constructed
// NVFP4 blocks (ties on the E2M1 grid, Four Over Six error ties, zero / subnormal / saturated
// scales, float32 subnormal and huge inputs, partial blocks, 16x16-tile amaxes, the limits of
// the scaled Four Over Six form and of its group table), MXFP8 SR
// elements (every scale, target-subnormal values, the >32-bit shift path, extreme random words)
// and Philox words.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "fourbit/numerics/fast_quant.h"
#include "fourbit/numerics/formats.h"

using namespace fourbit::num;

namespace {

constexpr float kInf = INFINITY;

uint8_t fast_e2m1_code(float y) {
  return uint8_t(((bits_of(y) >> 28) & 8u) | e2m1_magnitude_code(e2m1_rne_magnitude(y)));
}

// Every float32 magnitude but NaN (OpenMP threads over ranges of bit patterns), with both signs on
// the rounding range [2^-3, 2^3).
TEST(FastQuantE2m1, RoundingEqualsTheGenericEncoderOnEveryFloat) {
  constexpr int64_t kChunks = 256, kEnd = int64_t(0x7f800000u) + 1;
  int64_t bad = 0, first_bad = -1;
#pragma omp parallel for schedule(dynamic) reduction(+ : bad)
  for (int64_t chunk = 0; chunk < kChunks; ++chunk) {
    for (int64_t b = chunk * kEnd / kChunks; b < (chunk + 1) * kEnd / kChunks; ++b) {
      const float y = float_of(uint32_t(b));
      const uint8_t want = e2m1_encode_rne(y);
      if (fast_e2m1_code(y) != want ||
          bits_of(e2m1_rne_magnitude(y)) != bits_of(abs_bits(e2m1_decode(want)))) {
        ++bad;
#pragma omp critical
        if (first_bad < 0 || b < first_bad) first_bad = b;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "first at bits 0x" << std::hex << first_bad;
  for (uint32_t u = 0x3e000000u; u < 0x41000000u; ++u) {
    const float y = float_of(u | 0x80000000u);
    if (fast_e2m1_code(y) != e2m1_encode_rne(y) && ++bad <= 5) ADD_FAILURE() << "y = " << y;
  }
  for (float y : {-0.0f, -kInf, -FLT_MAX, -FLT_MIN, -1e-45f, -0.25f, -0.75f, -5.0f, -6.0f})
    EXPECT_EQ(fast_e2m1_code(y), e2m1_encode_rne(y)) << y;
  EXPECT_EQ(bad, 0);
}

TEST(FastQuantE2m1, DecodeEqualsTheGenericDecoder) {
  for (uint32_t c = 0; c < 16; ++c) EXPECT_EQ(bits_of(e2m1_decode_fast(c)), bits_of(e2m1_decode(c))) << c;
}

// Block scales: every non-negative float of [2^-14, 2^10) (everything below rounds to 0 and is
// sampled, everything above saturates and is sampled), +0, +Inf, FLT_MAX.
TEST(FastQuantE4m3, ScaleEncodeEqualsTheGenericEncoder) {
  int64_t bad = 0;
  auto check = [&](uint32_t u) {
    const float t = float_of(u);
    if (ue4m3_encode_fast(t) != ue4m3_encode(t) && ++bad <= 5)
      ADD_FAILURE() << "t = " << t << " (0x" << std::hex << u << "): fast 0x" << int(ue4m3_encode_fast(t))
                    << " generic 0x" << int(ue4m3_encode(t));
  };
  for (uint32_t u = 0x38800000u; u < 0x44800000u; ++u) check(u);  // 2^-14 .. 2^10
  std::mt19937 g(5);
  for (int i = 0; i < 4000000; ++i) check(uint32_t(g()) % 0x7f800001u);
  for (uint32_t u : {0u, 1u, 0x7f800000u, 0x7f7fffffu, 0x00800000u, 0x387fffffu}) check(u);
  EXPECT_EQ(bad, 0);
}

// The scale as a value (and its code back from it): the same ranges as the encoder's test.
TEST(FastQuantE4m3, ScaleValueEqualsTheGenericEncoderAndDecoder) {
  int64_t bad = 0;
  auto check = [&](uint32_t u) {
    const float t = float_of(u);
    const uint8_t want = ue4m3_encode(t);
    const float v = ue4m3_rne_value(t);
    if ((bits_of(v) != bits_of(ue4m3_decode(want)) || ue4m3_code_of(v) != want) && ++bad <= 5)
      ADD_FAILURE() << "t = " << t << " (0x" << std::hex << u << "): value " << v << " code 0x"
                    << ue4m3_code_of(v) << ", generic 0x" << int(want);
  };
  for (uint32_t u = 0x38800000u; u < 0x44800000u; ++u) check(u);  // 2^-14 .. 2^10
  std::mt19937 g(6);
  for (int i = 0; i < 4000000; ++i) check(uint32_t(g()) % 0x7f800001u);
  for (uint32_t u : {0u, 1u, 0x7f800000u, 0x7f7fffffu, 0x00800000u, 0x387fffffu, 0x43e00000u, 0x43e80000u})
    check(u);
  EXPECT_EQ(bad, 0);
}

// div6_rn is the correctly rounded quotient on every float from 2^-125 up; below, the block scale
// it feeds is 0 either way (it stays below 2^-127, see fos_block_scales).
TEST(FastQuantNvfp4, DivisionBySixOnEveryFloat) {
  constexpr int64_t kChunks = 256, kBegin = 0x01000000, kEnd = 0x7f800000;  // [2^-125, Inf)
  int64_t bad = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : bad)
  for (int64_t chunk = 0; chunk < kChunks; ++chunk)
    for (int64_t b = kBegin + chunk * (kEnd - kBegin) / kChunks; b < kBegin + (chunk + 1) * (kEnd - kBegin) / kChunks; ++b) {
      const float a = float_of(uint32_t(b));
      if (bits_of(div6_rn(a)) != bits_of(a / 6.0f)) ++bad;
    }
  EXPECT_EQ(bad, 0);
  for (uint32_t b = 0; b < 0x01000000u; b += 7) ASSERT_LE(div6_rn(float_of(b)), 0x1p-127f) << b;
}

// The group table's encode scales are nvfp4_enc_scale's, times 2^-104, for every scale code, on
// groups across the exact range and at its ends; outside it the group is not exact.
TEST(FastQuantNvfp4, FourOverSixGroupTableEqualsTheReciprocal) {
  std::mt19937 g(71);
  std::vector<float> sdecs = {0x1p-100f, 0x1p13f, 1.0f, nvfp4_s_dec(nvfp4_s_enc(1.0f, true)),
                              std::nextafter(0x1p13f, 0.0f), std::nextafter(0x1p-100f, 1.0f)};
  for (int i = 0; i < 20000; ++i) sdecs.push_back(std::ldexp(1.0f + float(g() % (1u << 23)) * 0x1p-23f, int(g() % 113) - 100));
  for (int i = 0; i < 2000; ++i)  // from group amaxes, as the kernels form them
    sdecs.push_back(nvfp4_s_dec(nvfp4_s_enc(std::ldexp(1.0f + float(g() % 1000) / 1000.0f, int(g() % 100) - 80), true)));
  int64_t bad = 0;
  for (float s_dec : sdecs) {
    const FosGroup grp = fos_group(s_dec);
    if (!grp.exact) continue;  // only the generated ones past 2^13
    for (uint32_t code = 1; code <= 0x7e; ++code) {
      const float sc = ue4m3_decode(code);
      const float want = mul_rn(nvfp4_enc_scale(uint8_t(code), s_dec), 0x1p-104f);
      const float got = grp.enc_s(sc);
      if ((bits_of(got) != bits_of(want) || nvfp4_enc_scale(uint8_t(code), s_dec) < 0x1p-22f) && ++bad <= 5)
        ADD_FAILURE() << "s_dec " << s_dec << " code 0x" << std::hex << code;
    }
  }
  EXPECT_EQ(bad, 0);
  for (float s_dec : {std::nextafter(0x1p13f, 1e30f), std::nextafter(0x1p-100f, 0.0f), 0x1p14f, 0x1p-120f})
    EXPECT_FALSE(fos_group(s_dec).exact) << s_dec;
}

TEST(FastQuantE4m3, DecodeEqualsTheGenericDecoder) {
  for (uint32_t c = 0; c <= 0x7e; ++c) EXPECT_EQ(bits_of(e4m3_decode_fast(c)), bits_of(e4m3_decode(c))) << c;
  for (uint32_t c = 0; c < 256; ++c) {
    const float want = ue4m3_decode(c), got = ue4m3_decode_fast(c);
    EXPECT_TRUE(bits_of(got) == bits_of(want) || (std::isnan(got) && std::isnan(want))) << c;
  }
}

TEST(FastQuantPhilox, SplitProductsGiveTheSameWords) {
  std::mt19937_64 g(3);
  for (int i = 0; i < 1000000; ++i) {
    const uint64_t seed = g(), stream = i % 3 == 0 ? uint64_t(i) : g(), group = i % 2 ? uint64_t(i) : g();
    const Philox4x32 a = random_bits4(seed, stream, group);
    const Philox4x32 b = random_bits4_fast(philox_keys(seed), stream, group);
    for (int k = 0; k < 4; ++k) ASSERT_EQ(a.v[k], b.v[k]) << i;
  }
}

TEST(FastQuantAmax, NanPropagatingMaxFindsNonFiniteBlocksAndOtherwiseEqualsTheFiniteMax) {
  std::mt19937 g(11);
  std::normal_distribution<float> nd;
  const float specials[] = {NAN, -NAN, kInf, -kInf};
  for (int trial = 0; trial < 200000; ++trial) {
    float x[16];
    for (float& v : x) v = nd(g) * std::ldexp(1.0f, int(g() % 40) - 20);
    const int k = int(g() % 4);  // 0..3 non-finite values
    for (int j = 0; j < k; ++j) x[g() % 16] = specials[g() % 4];
    float fast = 0.0f, finite = 0.0f;
    bool any = false;
    for (float v : x) {
      fast = max_abs_nan(fast, v);
      finite = max_abs_finite(finite, v);
      any = any || !is_finite_bits(v);
    }
    ASSERT_EQ(!is_finite_bits(fast), any) << trial;
    if (!any) {
      ASSERT_EQ(bits_of(fast), bits_of(finite)) << trial;
    }
  }
}

// ---- NVFP4 blocks -------------------------------------------------------------------------------

struct BlockCase {
  float x[16];
  int n;
  float block_amax, s_enc, s_dec;
};

// E2M1 grid values, their midpoints, and the 4/6 candidate's grid (1.5x): ties and exact values.
const float kSpecialMultiples[] = {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f,
                                   2.25f, 2.5f, 3.0f, 3.5f, 4.5f, 5.0f, 6.0f, 0.375f, 1.125f,
                                   2.625f, 3.75f, 5.25f};

BlockCase random_block(std::mt19937& g, int kind) {
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  BlockCase c{};
  c.n = g() % 8 == 0 ? 1 + int(g() % 16) : 16;
  const int scale_exp = int(g() % 300) - 160;  // magnitudes 2^-160 (zero after rounding) .. 2^140
  switch (kind) {
    case 0:  // Gaussian at a random magnitude, some exact zeros and -0
      for (int i = 0; i < c.n; ++i) {
        c.x[i] = std::ldexp(nd(g), scale_exp % 130);
        if (g() % 10 == 0) c.x[i] = (g() & 1) ? 0.0f : -0.0f;
      }
      break;
    case 1: {  // multiples of a power-of-two scale: E2M1 ties when enc is exact
      const float sc = std::ldexp(1.0f, int(g() % 18) - 9);
      for (int i = 0; i < c.n; ++i) {
        const float m = kSpecialMultiples[g() % (sizeof kSpecialMultiples / sizeof(float))];
        c.x[i] = (g() & 1 ? -m : m) * sc;
      }
      c.x[g() % c.n] = 6.0f * sc;
      break;
    }
    case 2:  // float32 subnormals and tiny values
      for (int i = 0; i < c.n; ++i) c.x[i] = float_of(uint32_t(g()) & 0x80ffffffu) * float(1 + g() % 3);
      break;
    case 3:  // huge values
      for (int i = 0; i < c.n; ++i) c.x[i] = std::ldexp(nd(g), 100 + int(g() % 27));
      break;
    case 4:  // heavy-tailed: one outlier
      for (int i = 0; i < c.n; ++i) c.x[i] = nd(g) * 0.01f;
      c.x[g() % c.n] = nd(g) * 100.0f;
      break;
    default:  // random bit patterns of finite floats
      for (int i = 0; i < c.n; ++i) {
        uint32_t b;
        do b = uint32_t(g()); while ((b & 0x7f800000u) == 0x7f800000u);
        c.x[i] = float_of(b);
      }
  }
  float a = 0.0f;
  for (int i = 0; i < c.n; ++i) a = max_abs_finite(a, c.x[i]);
  // A 16x16 tile's amax is at least the block's.
  c.block_amax = g() % 6 == 0 ? a * (1.0f + 4.0f * u01(g)) : a;
  if (!is_finite_bits(c.block_amax)) c.block_amax = a;
  return c;
}

// The outer scale: none (S_enc = 1), or from a group amax at or above the block amax (per-token,
// per-tensor; huge ratios give zero and subnormal block scales).
void pick_outer(std::mt19937& g, BlockCase& c, bool fos) {
  const int kind = int(g() % 4);
  if (kind == 0) {
    c.s_enc = 1.0f;
  } else {
    float group = c.block_amax;
    if (kind >= 2) group = group * std::ldexp(1.0f + float(g() % 1000) / 1000.0f, int(g() % 40));
    if (!is_finite_bits(group)) group = FLT_MAX;
    c.s_enc = nvfp4_s_enc(group, fos);
  }
  c.s_dec = nvfp4_s_dec(c.s_enc);
}

// Whether nvfp4_quantize_block_fast gives the generic quantizer's block for case c (block t);
// the first five mismatches of a run (counted in *bad) are reported with their inputs.
template <bool kFos, ScaleMetric kMetric>
void expect_fast_block(const BlockCase& c, int64_t t, int64_t* bad) {
  const Nvfp4Block want =
      nvfp4_quantize_block(c.x, c.n, c.block_amax, c.s_enc, c.s_dec, kFos, kMetric, Rounding::RNE, 0, 0, 0);
  const Nvfp4Block got = nvfp4_quantize_block_fast<kFos, kMetric>(c.x, c.block_amax, c.s_enc, c.s_dec);
  if (want.packed == got.packed && want.scale == got.scale && want.chose_four == got.chose_four) return;
  if (++*bad > 5) return;
  std::string xs;
  for (int i = 0; i < 16; ++i) xs += std::to_string(c.x[i]) + " ";
  ADD_FAILURE() << "block " << t << " n " << c.n << " amax " << c.block_amax << " s_enc " << c.s_enc
                << " s_dec " << c.s_dec << ": packed 0x" << std::hex << want.packed << " / 0x" << got.packed
                << ", scale 0x" << int(want.scale) << " / 0x" << int(got.scale) << std::dec << ", four "
                << want.chose_four << " / " << got.chose_four << "\n  x: " << xs;
}

template <bool kFos, ScaleMetric kMetric>
int64_t compare_blocks(int64_t count, uint32_t seed) {
  std::mt19937 g(seed);
  int64_t bad = 0;
  for (int64_t t = 0; t < count; ++t) {
    BlockCase c = random_block(g, int(t % 6));
    pick_outer(g, c, kFos);
    expect_fast_block<kFos, kMetric>(c, t, &bad);
  }
  return bad;
}

TEST(FastQuantNvfp4, RneBlocksEqualTheGenericQuantizer) {
  EXPECT_EQ((compare_blocks<false, ScaleMetric::MSE>(3000000, 1)), 0);
}

TEST(FastQuantNvfp4, FourOverSixMseBlocksEqualTheGenericQuantizer) {
  EXPECT_EQ((compare_blocks<true, ScaleMetric::MSE>(2000000, 2)), 0);
}

TEST(FastQuantNvfp4, FourOverSixMaeBlocksEqualTheGenericQuantizer) {
  EXPECT_EQ((compare_blocks<true, ScaleMetric::MAE>(2000000, 3)), 0);
}

// count Four Over Six blocks made by make(t, g, nd, c) (c: 16 values, block amax, S_enc, S_dec)
// against the generic quantizer; returns the mismatches.
template <ScaleMetric kMetric, typename Make>
int64_t compare_fos_cases(int count, uint32_t seed, Make make) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  int64_t bad = 0;
  for (int t = 0; t < count; ++t) {
    BlockCase c{};
    c.n = 16;
    make(t, g, nd, c);
    expect_fast_block<true, kMetric>(c, t, &bad);
  }
  return bad;
}

// Four Over Six computes in a scaled form that needs enc >= 2^-22 and S_dec < 2^102 and hands other
// blocks to the generic quantizer: blocks on both sides of those limits (block amaxes around
// 6 * 2^22, group amaxes around 1536 * 2^102, tiny groups with subnormal S_dec), both metrics.
template <ScaleMetric kMetric>
int64_t compare_fos_limits(uint32_t seed) {
  return compare_fos_cases<kMetric>(400000, seed, [](int t, std::mt19937& g, std::normal_distribution<float>& nd,
                                                     BlockCase& c) {
    const int e = t % 4 == 0 ? 20 + int(g() % 6) : t % 4 == 1 ? 95 + int(g() % 20) : t % 4 == 2
                                                   ? -140 + int(g() % 30) : int(g() % 40) - 20;
    for (int i = 0; i < 16; ++i) c.x[i] = std::ldexp(nd(g), e);
    if (t % 7 == 0) c.x[g() % 16] = std::ldexp(6.0f, e + 2) * (1.0f - float(g() % 64) / 1024.0f);
    float a = 0.0f;
    for (float v : c.x) a = max_abs_finite(a, v);
    c.block_amax = a;
    float group = a * std::ldexp(1.0f + float(g() % 1000) / 1000.0f, int(g() % 24));
    if (!is_finite_bits(group)) group = FLT_MAX;
    c.s_enc = t % 5 == 0 ? 1.0f : nvfp4_s_enc(group, true);
    c.s_dec = nvfp4_s_dec(c.s_enc);
  });
}

// Groups at both ends of FosGroup::exact (S_dec around 2^13 and 2^-100): group amaxes around
// 1536 * 2^13 and 1536 * 2^-100, block amaxes from the group's down to zero scales.
template <ScaleMetric kMetric>
int64_t compare_fos_group_edges(uint32_t seed) {
  return compare_fos_cases<kMetric>(200000, seed, [](int t, std::mt19937& g, std::normal_distribution<float>& nd,
                                                     BlockCase& c) {
    const float group = std::ldexp(1.0f + float(g() % 4096) / 4096.0f, (t % 2 ? 23 : -90) + int(g() % 3) - 2);
    c.s_enc = nvfp4_s_enc(group, true);
    c.s_dec = nvfp4_s_dec(c.s_enc);
    const int e = int(std::ilogb(group)) - int(g() % 30);
    for (int i = 0; i < 16; ++i) c.x[i] = std::ldexp(nd(g), e);
    float a = 0.0f;
    for (float v : c.x) a = max_abs_finite(a, v);
    if (a > group) {
      for (float& v : c.x) v = v / a * group;
      a = 0.0f;
      for (float v : c.x) a = max_abs_finite(a, v);
    }
    c.block_amax = a;
  });
}

TEST(FastQuantNvfp4, FourOverSixAtTheGroupTablesLimits) {
  EXPECT_EQ(compare_fos_group_edges<ScaleMetric::MSE>(81), 0);
  EXPECT_EQ(compare_fos_group_edges<ScaleMetric::MAE>(82), 0);
}

TEST(FastQuantNvfp4, FourOverSixAtTheScaledFormsLimits) {
  EXPECT_EQ(compare_fos_limits<ScaleMetric::MSE>(61), 0);
  EXPECT_EQ(compare_fos_limits<ScaleMetric::MAE>(62), 0);
}

// Both candidates exact (values on both grids) tie at zero error: 6 is kept. All-zero blocks.
TEST(FastQuantNvfp4, FourOverSixTiesKeepSix) {
  float x[16] = {0.0f, 1.5f, -3.0f, 6.0f, 0.0f, -1.5f, 3.0f, 6.0f, 0.0f, 1.5f, 3.0f, -6.0f, 0, 0, 0, 0};
  const Nvfp4Block b = nvfp4_quantize_block_fast<true>(x, 6.0f, 1.0f, 1.0f);
  const Nvfp4Block w =
      nvfp4_quantize_block(x, 16, 6.0f, 1.0f, 1.0f, true, ScaleMetric::MSE, Rounding::RNE, 0, 0, 0);
  EXPECT_FALSE(b.chose_four);
  EXPECT_EQ(b.packed, w.packed);
  EXPECT_EQ(b.scale, w.scale);
  float z[16] = {};
  const Nvfp4Block bz = nvfp4_quantize_block_fast<true>(z, 0.0f, 1.0f, 1.0f);
  EXPECT_EQ(bz.packed, 0u);
  EXPECT_EQ(bz.scale, 0u);
  EXPECT_FALSE(bz.chose_four);
}

// fos_bounded's unclamped rounding (FosCandidate::code22<false>) gives the clamped one's value on
// every float32 y_s (as the candidate's product with enc_s = 1) of magnitude below 7 * 2^-104,
// both signs, so a block quantizer that sees only such values gives the same codes and errors
// with or without the clamp; at 7 * 2^-104 (a tie, to 8) the clamp is needed.
TEST(FastQuantNvfp4, FourOverSixUnclampedRoundingBelowSeven) {
  const detail::FosCandidate c{1.0f, 0.0f, 0.0f};
  const uint32_t end = bits_of(7.0f * 0x1p-104f);
  constexpr int64_t kChunks = 256;
  int64_t bad = 0, first_bad = -1;
#pragma omp parallel for schedule(dynamic) reduction(+ : bad)
  for (int64_t chunk = 0; chunk < kChunks; ++chunk) {
    for (int64_t b = chunk * end / kChunks; b < (chunk + 1) * end / kChunks; ++b) {
      for (uint32_t sign : {0u, 0x80000000u}) {
        const float y = float_of(uint32_t(b) | sign);
        if (bits_of(c.code22<false>(y)) != bits_of(c.code22<true>(y))) {
          ++bad;
#pragma omp critical
          if (first_bad < 0 || b < first_bad) first_bad = b;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "first at bits 0x" << std::hex << first_bad;
  EXPECT_NE(bits_of(c.code22<false>(7.0f * 0x1p-104f)), bits_of(c.code22<true>(7.0f * 0x1p-104f)));
}

// Four Over Six blocks with subnormal and small block scales (a block amax 2^-15 .. 2^-3 times
// S_dec, on or off the grid), where fl(x * enc) reaches 6 .. 9 and fos_bounded decides: blocks on
// both sides, and blocks whose largest scaled value lies in (6, 7) (the clamp-free range) or at 7
// (the tie the clamp must take), against the generic quantizer, both metrics.
template <ScaleMetric kMetric>
int64_t compare_fos_bound_edges(uint32_t seed, int64_t* bounded, int64_t* in_six_seven, int64_t* at_seven) {
  return compare_fos_cases<kMetric>(400000, seed, [&](int t, std::mt19937& g, std::normal_distribution<float>& nd,
                                                      BlockCase& c) {
    c.s_enc = t % 3 == 0 ? 1.0f : std::ldexp(1.0f, int(g() % 40) - 20);
    c.s_dec = nvfp4_s_dec(c.s_enc);
    // the largest value: random, or k/2 * 2^-8 (block scales 0 .. 11 * 2^-9 on or between the
    // candidates' grids and their ties; k = 7: 7 * 2^-9 on the scale 2^-9)
    const float unit = std::ldexp(1.0f, -8) * c.s_dec;
    const float top = t % 2 ? float(1 + g() % 64) * 0.5f * unit
                            : std::ldexp(0.5f + 0.5f * float(g() % 4096) / 4096.0f, -int(g() % 12) - 3) * c.s_dec;
    for (int i = 0; i < 16; ++i) {
      const float m = g() % 3 == 0 ? float(g() % 16) * 0.25f * unit : nd(g) * top * 0.4f;
      c.x[i] = std::fabs(m) > top ? top : m;
    }
    c.x[g() % 16] = g() & 1 ? top : -top;
    float a = 0.0f;
    for (float v : c.x) a = max_abs_finite(a, v);
    c.block_amax = a;
    const FosGroup grp = fos_group(c.s_dec);
    if (!grp.exact) return;
    const FosBlockScales s = fos_block_scales(a, c.s_enc, grp);
    const float y = mul_rn(a, std::fmax(s.c6.enc_s, s.c4.enc_s));
    if (fos_bounded(a, s)) ++*bounded;
    if (y > 6.0f * 0x1p-104f && y < 7.0f * 0x1p-104f) ++*in_six_seven;
    if (y == 7.0f * 0x1p-104f) ++*at_seven;
  });
}

TEST(FastQuantNvfp4, FourOverSixUnclampedOnlyWhereBounded) {
  int64_t bounded = 0, in_six_seven = 0, at_seven = 0;
  EXPECT_EQ(compare_fos_bound_edges<ScaleMetric::MSE>(91, &bounded, &in_six_seven, &at_seven), 0);
  EXPECT_EQ(compare_fos_bound_edges<ScaleMetric::MAE>(92, &bounded, &in_six_seven, &at_seven), 0);
  EXPECT_GT(bounded, 100000);
  EXPECT_LT(bounded, 700000);  // both sides of the bound
  EXPECT_GT(in_six_seven, 1000);
  EXPECT_GT(at_seven, 100);
  // One at 7: S_dec = 1, block scale 2^-9 (subnormal), enc = 2^9. The 4 candidate (2^-8) ties
  // at the same errors, so 6 is kept and its code must be 7 (6), not the unclamped 8.
  float x[16];
  for (float& v : x) v = 7.0f * 0x1p-9f;
  const FosBlockScales s = fos_block_scales(x[0], 1.0f, fos_group(1.0f));
  EXPECT_FALSE(fos_bounded(x[0], s));
  const Nvfp4Block want =
      nvfp4_quantize_block(x, 16, x[0], 1.0f, 1.0f, true, ScaleMetric::MSE, Rounding::RNE, 0, 0, 0);
  EXPECT_EQ(nvfp4_quantize_block_fast<true>(x, x[0], 1.0f, 1.0f).packed, want.packed);
  EXPECT_NE((fos_quantize_block<ScaleMetric::MSE, true>(x, s).packed), want.packed);
}

// ---- MXFP8 SR -----------------------------------------------------------------------------------

template <int kExpBits>
int64_t compare_sr(int64_t count, uint32_t seed) {
  const MiniFloatSpec f = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  const float max_elem = kExpBits == 4 ? kE4M3Max : kE5M2Max;
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  int64_t bad = 0;
  for (int64_t t = 0; t < count; ++t) {
    float x;
    switch (t % 4) {
      case 0: x = std::ldexp(nd(g), int(g() % 280) - 150); break;
      case 1: {
        uint32_t b;
        do b = uint32_t(g()); while ((b & 0x7f800000u) == 0x7f800000u);
        x = float_of(b);
        break;
      }
      case 2: x = float_of(uint32_t(g()) & 0x807fffffu); break;  // float32 subnormals
      default: x = (g() & 1 ? -1.0f : 1.0f) * float(g() % 64) * std::ldexp(1.0f, int(g() % 60) - 30);
    }
    // The block's RCEIL scale for an amax at or above |x| (the kernels' case), or any scale.
    uint8_t scale;
    if (t % 3 != 2) {
      const float amax = abs_bits(x) * (t % 3 == 0 ? 1.0f : 1.0f + float(g() % 100000));
      scale = ue8m0_scale_for_max(is_finite_bits(amax) ? amax : abs_bits(x), max_elem);
    } else {
      scale = uint8_t(g() % 255);
    }
    const uint32_t r = t % 7 == 0 ? 0u : t % 7 == 1 ? 0xffffu : uint32_t(g()) & 0xffffu;  // 16 SR bits
    const uint8_t want = uint8_t(minifloat_encode(f, x, 127 - int(scale), Rounding::SR, r));
    const uint8_t got = mxfp8_encode_sr_fast<kExpBits>(x, pow2f(127 - int(scale)), r);
    if (want != got && ++bad <= 5)
      ADD_FAILURE() << "x = " << x << " (0x" << std::hex << bits_of(x) << ") scale 0x" << int(scale)
                    << " rnd 0x" << r << ": generic 0x" << int(want) << " fast 0x" << int(got);
  }
  return bad;
}

// The general form alone, on every input (the composed encoder uses it only below the normals).
template <int kExpBits>
int64_t compare_wide(int64_t count, uint32_t seed) {
  const MiniFloatSpec f = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  std::mt19937 g(seed);
  int64_t bad = 0;
  for (int64_t t = 0; t < count; ++t) {
    uint32_t b;
    do b = uint32_t(g()) & 0x7fffffffu; while ((b & 0x7f800000u) == 0x7f800000u);
    if (t % 2) b = (b & 0x807fffffu) | ((100u + uint32_t(g() % 40)) << 23);  // near the target range
    const uint32_t r = t % 5 == 0 ? 0xffffu : uint32_t(g()) & 0xffffu;
    const uint32_t want = minifloat_encode(f, float_of(b), 0, Rounding::SR, r);
    if (Mxfp8Sr<kExpBits>::code_wide(b, r) != want && ++bad <= 5)
      ADD_FAILURE() << "u 0x" << std::hex << b << " rnd 0x" << r;
    if (!Mxfp8Sr<kExpBits>::needs_wide(b) && Mxfp8Sr<kExpBits>::code_normal(b, r) != want && ++bad <= 5)
      ADD_FAILURE() << "normal form: u 0x" << std::hex << b << " rnd 0x" << r;
  }
  return bad;
}

TEST(FastQuantMxfp8, GeneralAndNormalFormsEqualTheGenericEncoder) {
  EXPECT_EQ(compare_wide<4>(6000000, 51), 0);
  EXPECT_EQ(compare_wide<5>(6000000, 52), 0);
}

TEST(FastQuantMxfp8, StochasticE4m3EqualsTheGenericEncoder) { EXPECT_EQ(compare_sr<4>(12000000, 21), 0); }
TEST(FastQuantMxfp8, StochasticE5m2EqualsTheGenericEncoder) { EXPECT_EQ(compare_sr<5>(12000000, 22), 0); }

// Every E4M3 / E5M2 magnitude code's value and its neighbours, at every scale that keeps it in
// range, with random words: the rounding boundaries of both the normal and subnormal ranges.
template <int kExpBits>
int64_t grid_sr(uint32_t seed) {
  const MiniFloatSpec f = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  std::mt19937 g(seed);
  int64_t bad = 0;
  for (uint32_t code = 0; code <= f.max_mag_code; ++code) {
    const float v = minifloat_decode(f, code);
    for (int scale = 0; scale < 255; scale += 1) {
      const float x0 = std::ldexp(v, scale - 127);
      if (!is_finite_bits(x0)) continue;
      for (float x : {x0, std::nextafter(x0, 0.0f), std::nextafter(x0, kInf), -x0}) {
        if (!is_finite_bits(x)) continue;
        const uint32_t r = uint32_t(g()) & 0xffffu;
        const uint8_t want = uint8_t(minifloat_encode(f, x, 127 - scale, Rounding::SR, r));
        if (mxfp8_encode_sr_fast<kExpBits>(x, pow2f(127 - scale), r) != want && ++bad <= 5)
          ADD_FAILURE() << "code 0x" << std::hex << code << " scale " << std::dec << scale << " x " << x;
      }
    }
  }
  return bad;
}

TEST(FastQuantMxfp8, StochasticOnAndAroundEveryGridValue) {
  EXPECT_EQ(grid_sr<4>(31), 0);
  EXPECT_EQ(grid_sr<5>(32), 0);
}

// Mxfp8Rne's two forms on every scaled magnitude u that can give a code other than 0 or the
// largest (the binades from a quarter of the smallest subnormal to twice the largest normal),
// and on random u elsewhere; then the composed encoder on random x and scales, and on every
// grid value, its neighbours and the midpoints between grid values (the ties) at every scale.
template <int kExpBits>
int64_t compare_rne_every_u() {
  using Rne = Mxfp8Rne<kExpBits>;
  const MiniFloatSpec f = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  const int64_t lo = int64_t(Mxfp8Sr<kExpBits>::kEminBiased - f.man_bits - 2) << 23;
  const int64_t hi = int64_t(127 + f.bias + 2) << 23;
  int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
  for (int64_t b = lo; b < hi; ++b) {
    const uint32_t u = uint32_t(b);
    const uint32_t got = Mxfp8Sr<kExpBits>::needs_wide(u) ? Rne::code_wide(u) : Rne::code_normal(u);
    bad += got != minifloat_encode(f, float_of(u), 0, Rounding::RNE);
  }
  std::mt19937 g(61);
  for (int t = 0; t < 2000000; ++t) {
    const uint32_t u = uint32_t(g()) & 0x7fffffffu;
    if (u > 0x7f800000u) continue;  // NaN
    const uint32_t got = Mxfp8Sr<kExpBits>::needs_wide(u) ? Rne::code_wide(u) : Rne::code_normal(u);
    if (got != minifloat_encode(f, float_of(u), 0, Rounding::RNE) && ++bad <= 5)
      ADD_FAILURE() << "u 0x" << std::hex << u;
  }
  return bad;
}

template <int kExpBits>
int64_t compare_rne_encode(uint32_t seed) {
  const MiniFloatSpec f = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  auto check = [&](float x, int scale) {
    const uint8_t want = uint8_t(minifloat_encode(f, x, 127 - scale, Rounding::RNE));
    const uint8_t got = Mxfp8Rne<kExpBits>::encode(x, pow2f(127 - scale));
    if (want == got) return int64_t(0);
    ADD_FAILURE() << "x = " << x << " (0x" << std::hex << bits_of(x) << ") scale " << std::dec << scale;
    return int64_t(1);
  };
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  int64_t bad = 0;
  for (int t = 0; t < 3000000 && bad < 5; ++t) {
    float x;
    do x = t % 3 == 0 ? std::ldexp(nd(g), int(g() % 280) - 150) : float_of(uint32_t(g()));
    while (is_nan_bits(x));
    bad += check(x, t % 2 ? int(ue8m0_scale_for_max(abs_bits(x), kExpBits == 4 ? kE4M3Max : kE5M2Max)) : int(g() % 255));
  }
  for (uint32_t code = 0; code <= f.max_mag_code && bad < 5; ++code) {
    const float v = minifloat_decode(f, code), next = minifloat_decode(f, code + 1);  // code + 1: past the max, NaN/Inf
    for (int scale = 0; scale < 255; ++scale) {
      const float x0 = std::ldexp(v, scale - 127), mid = std::ldexp(0.5f * (v + next), scale - 127);
      for (float x : {x0, std::nextafter(x0, 0.0f), std::nextafter(x0, kInf), -x0, mid, std::nextafter(mid, 0.0f),
                      std::nextafter(mid, kInf), -mid})
        if (!is_nan_bits(x)) bad += check(x, scale);
    }
  }
  for (float x : {kInf, -kInf, FLT_MAX, -FLT_MAX, 0.0f, -0.0f, 1e-45f, -1e-45f, std::nanf(""), -std::nanf("")})
    bad += check(x, 127) + check(x, 0);
  return bad;
}

TEST(FastQuantMxfp8, RneFormsEqualTheGenericEncoderOnEveryScaledMagnitude) {
  EXPECT_EQ(compare_rne_every_u<4>(), 0);
  EXPECT_EQ(compare_rne_every_u<5>(), 0);
}

TEST(FastQuantMxfp8, RneEncoderEqualsTheGenericEncoder) {
  EXPECT_EQ(compare_rne_encode<4>(71), 0);
  EXPECT_EQ(compare_rne_encode<5>(72), 0);
}

// The CPU's MXFP8 block decoder (a table of the 256 element values) against mxfp8_decode for
// every code at every scale, NaN scale included.
TEST(FastQuantMxfp8, BlockDecodeTableEqualsTheGenericDecoder) {
  for (int scale = 0; scale < 256; ++scale)
    for (int base = 0; base < 256; base += kMxBlock) {
      uint8_t codes[kMxBlock];
      float out4[kMxBlock], out5[kMxBlock];
      for (int i = 0; i < kMxBlock; ++i) codes[i] = uint8_t(base + i);
      mxfp8_decode_block<4>(codes, uint8_t(scale), 1.0f, out4);
      mxfp8_decode_block<5>(codes, uint8_t(scale), 1.0f, out5);
      for (int i = 0; i < kMxBlock; ++i) {
        // a NaN code or scale decodes to a NaN; its sign bit is not part of the contract
        const auto same = [](float a, float b) { return std::isnan(a) ? bool(std::isnan(b)) : bits_of(a) == bits_of(b); };
        ASSERT_TRUE(same(out4[i], mxfp8_decode(codes[i], uint8_t(scale), e4m3_spec()))) << base + i << " scale " << scale;
        ASSERT_TRUE(same(out5[i], mxfp8_decode(codes[i], uint8_t(scale), e5m2_spec()))) << base + i << " scale " << scale;
      }
    }
}

TEST(FastQuantMxfp8, RnePairsEqualTheSingleEncoder) {
  std::mt19937 g(41);
  std::normal_distribution<float> nd;
  for (int i = 0; i < 100000; ++i) {
    const float a = std::ldexp(nd(g), int(g() % 60) - 30), b = std::ldexp(nd(g), int(g() % 60) - 30);
    const uint8_t scale = ue8m0_scale_for_max(std::max(std::fabs(a), std::fabs(b)), kE4M3Max);
    const uint32_t w = mxfp8_encode_rne_x2<4>(a, b, scale, pow2f(127 - int(scale)));
    ASSERT_EQ(w & 0xffu, mxfp8_encode(a, scale, kE4M3));
    ASSERT_EQ(w >> 8, mxfp8_encode(b, scale, kE4M3));
  }
}

}  // namespace

namespace {

// byte_perm's host form against the PTX definition written out, on random words and selectors.
TEST(FastQuantMxfp8, BytePermMovesTheSelectedBytes) {
  std::mt19937 g(61);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t a = uint32_t(g()), b = uint32_t(g()), s = uint32_t(g()) & 0x7777u;
    const uint8_t bytes[8] = {uint8_t(a), uint8_t(a >> 8), uint8_t(a >> 16), uint8_t(a >> 24),
                              uint8_t(b), uint8_t(b >> 8), uint8_t(b >> 16), uint8_t(b >> 24)};
    const uint32_t want = uint32_t(bytes[s & 7]) | uint32_t(bytes[(s >> 4) & 7]) << 8 |
                          uint32_t(bytes[(s >> 8) & 7]) << 16 | uint32_t(bytes[(s >> 12) & 7]) << 24;
    ASSERT_EQ(byte_perm(a, b, s), want) << std::hex << a << " " << b << " " << s;
    // with bit 3 of a selector set: that byte's top bit replicated (prmt's sign mode)
    const uint32_t t = s | 0x8888u;
    uint32_t want_sign = 0;
    for (int n = 0; n < 4; ++n) want_sign |= (((want >> (8 * n + 7)) & 1u) ? 0xffu : 0u) << (8 * n);
    ASSERT_EQ(byte_perm_msb(a, b, t), want_sign) << std::hex << a << " " << b << " " << t;
    ASSERT_EQ(byte_perm_msb(a, b, s), want) << std::hex << a << " " << b << " " << s;
  }
}

// sign_word against the sign bits placed one by one: every pattern of the 8 signs (the only bits
// it reads: byte 3's top bit of each input), over random other bits, zeros of both signs included.
TEST(FastQuantNvfp4, SignWordPlacesEachSign) {
  std::mt19937 g(63);
  for (uint32_t pattern = 0; pattern < 256; ++pattern) {
    for (int rep = 0; rep < 2000; ++rep) {
      float x[8];
      uint32_t want = 0;
      for (int i = 0; i < 8; ++i) {
        const uint32_t rest = rep == 0 ? 0u : rep == 1 ? 0x7fffffffu : uint32_t(g()) & 0x7fffffffu;
        x[i] = float_of(rest | (((pattern >> i) & 1u) << 31));
        want |= ((pattern >> i) & 1u) << (4 * i + 3);
      }
      ASSERT_EQ(detail::sign_word(x) & 0x88888888u, want) << std::hex << pattern << " rep " << rep;
    }
  }
}

// E4m3SrWords (requantize_transposed's encoder) against the generic SR encoder and Mxfp8Sr, on
// blocks of four whose RCEIL scale comes from an amax at or above every |x| (the kernel's case):
// random floats of every binade (and target-subnormal ones, which must be flagged), zeros of both
// signs, values on and next to the E4M3 grid up to 448, extreme random words.
int64_t compare_sr_words(int64_t count, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  int64_t bad = 0, words = 0, wide = 0;
  for (int64_t t = 0; t < count; ++t) {
    float x[4];
    const int e0 = int(g() % 250) - 125;
    for (float& v : x) {
      switch (g() % 6) {
        case 0: v = g() & 1 ? 0.0f : -0.0f; break;
        case 1: v = std::ldexp(nd(g), e0 - int(g() % 24)); break;  // below the amax, sometimes subnormal in E4M3
        case 2: {  // an E4M3 grid value or its neighbour, at the block's scale
          const float q = minifloat_decode(e4m3_spec(), uint32_t(g() % 0x7f)) * (g() & 1 ? 1.0f : -1.0f);
          v = std::ldexp(q, e0 - 8);
          if (g() & 1) v = std::nextafter(v, g() & 1 ? 0.0f : kInf);
          break;
        }
        default: v = std::ldexp(nd(g), e0);
      }
      if (!is_finite_bits(v)) v = 1.0f;
    }
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    if (t % 5 == 0) amax = std::min(amax * float(1 + g() % 1000), 3.0e38f);  // headroom: any larger amax
    const uint8_t scale = ue8m0_scale_for_max(amax, kE4M3Max);
    const float xs8 = E4m3SrWords::x_scale8(scale);
    // The four draws from a Philox word pair as the kernel takes them: elements 0..3 of a call
    // (random_at_8: the 16 bits moved to bits 8..23) or 4..7 (the call's other half).
    const Philox4x32 call{{uint32_t(g()), uint32_t(g()), uint32_t(g()), uint32_t(g())}};
    const int k0 = t % 2 ? 4 : 0;
    uint32_t y8[4], r[4], r8[4];
    bool any_wide = false, want_wide = false;
    for (int e = 0; e < 4; ++e) {
      y8[e] = E4m3SrWords::scaled(x[e], xs8);
      any_wide |= E4m3SrWords::needs_wide(y8[e]);
      const float u = std::fabs(x[e]) * pow2f(127 - int(scale));
      want_wide |= u != 0.0f && u < 0x1p-6f && std::fabs(x[e]) * xs8 != 0.0f;
      r[e] = sr_bits_of(call, k0 + e);
      r8[e] = E4m3SrWords::random_at_8(call, k0 + e);
      if (t % 7 < 2) r[e] = t % 7 == 0 ? 0u : 0xffffu, r8[e] = r[e] << 8;  // the extreme draws
      if (r8[e] != r[e] << 8 && ++bad <= 5) ADD_FAILURE() << "random_at_8 of element " << k0 + e;
    }
    if (any_wide != want_wide && ++bad <= 5) ADD_FAILURE() << "needs_wide at t = " << t;
    if (any_wide) {
      ++wide;
      continue;
    }
    ++words;
    const uint32_t w = E4m3SrWords::pack(
        E4m3SrWords::code_at_24(y8[0], r8[0]), E4m3SrWords::code_at_24(y8[1], r8[1]),
        E4m3SrWords::code_at_24(y8[2], r8[2]), E4m3SrWords::code_at_24(y8[3], r8[3]), bits_of(x[0]),
        bits_of(x[1]), bits_of(x[2]), bits_of(x[3]));
    for (int e = 0; e < 4; ++e) {
      const uint8_t want = uint8_t(minifloat_encode(e4m3_spec(), x[e], 127 - int(scale), Rounding::SR, r[e]));
      const uint8_t fast = Mxfp8Sr<4>::encode(x[e], pow2f(127 - int(scale)), r[e]);
      const uint8_t got = uint8_t(w >> (8 * e));
      if ((got != want || fast != want) && ++bad <= 5)
        ADD_FAILURE() << "x = " << x[e] << " (0x" << std::hex << bits_of(x[e]) << ") scale 0x" << int(scale)
                      << " rnd 0x" << r[e] << ": generic 0x" << int(want) << " words 0x" << int(got);
    }
  }
  EXPECT_GT(words, count / 2);  // the cases reach both forms
  EXPECT_GT(wide, count / 100);
  return bad;
}

TEST(FastQuantMxfp8, StochasticE4m3WordsEqualTheGenericEncoder) { EXPECT_EQ(compare_sr_words(6000000, 71), 0); }

}  // namespace

namespace {

// Nvfp4DecodeWord (requantize_transposed's exact decode) against nvfp4_dequant: every code at
// every position of a word, every scale byte (NaN 0x7F and zero included), S_dec of every binade
// the helper takes (subnormal, up to just below 2^120, both signs, Inf, NaN) and random ones.
TEST(FastQuantNvfp4, WordDecodeEqualsTheGenericDecoder) {
  std::mt19937 g(81);
  std::vector<float> sdecs = {1.0f, -1.0f, 0.0f, kInf, -kInf, NAN, 0x1p-149f, 0x1p-130f, 0x1.fffffep119f,
                              -0x1.fffffep119f, 0x1p119f, 3.0e-39f, FLT_MIN};
  for (int i = 0; i < 3000; ++i) sdecs.push_back(std::ldexp(float(g() % 0xffffffu + 1) * 0x1p-24f, int(g() % 270) - 150));
  int64_t bad = 0;
  for (float sd : sdecs) {
    if (!Nvfp4DecodeWord::exact_for(sd)) {  // the kernel's other path
      ASSERT_GE(std::fabs(sd), 0x1p120f);
      continue;
    }
    for (uint32_t sb = 0; sb < 256; ++sb) {
      const Nvfp4DecodeWord d(ue4m3_decode_fast(sb), sd);
      const uint32_t word = uint32_t(g());
      for (int e = 0; e < 8; ++e) {
        for (uint32_t c : {(word >> (4 * e)) & 15u, uint32_t(e), uint32_t(e + 8)}) {
          const uint32_t w = (word & ~(15u << (4 * e))) | (c << (4 * e));
          const float want = nvfp4_dequant(c, uint8_t(sb), sd), got = d.at(w, e);
          if (!(bits_of(got) == bits_of(want) || (std::isnan(got) && std::isnan(want))) && ++bad <= 5)
            ADD_FAILURE() << "code " << c << " at " << e << " s_b 0x" << std::hex << sb << " s_dec " << sd
                          << ": 0x" << bits_of(want) << " vs 0x" << bits_of(got);
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_FALSE(Nvfp4DecodeWord::exact_for(0x1p120f));
  EXPECT_FALSE(Nvfp4DecodeWord::exact_for(-FLT_MAX));
}

}  // namespace
