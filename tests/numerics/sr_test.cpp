// defines: the StochasticRounding tests
// Stochastic rounding (NUMERICS "Stochastic rounding", 16 random bits an element): results are one
// of the two neighbours, P(round up) counted over every draw, the
// mean over N draws converges to x within 5 standard deviations of the mean of N Bernoulli draws
// (and the error shrinks with N), representable values never move, draws are a pure function of
// (seed, stream, index); MXFP8 with RCEIL scales never clips, so its SR is unbiased at the block
// max, while the OCP floor scale is shown to be biased there (the check has teeth).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numbers>
#include <random>
#include <vector>

#include "fourbit/numerics/minifloat.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/philox.h"
#include "fourbit/numerics/round.h"
#include "numerics/reference_formats.h"

using namespace fourbit;
using namespace fourbit::num;
using test::RefFormat;

namespace {

struct Target {
  const MiniFloatSpec& spec;
  const RefFormat& ref;
  std::vector<float> xs;  // normal range, target-subnormal range, exact grid values, near max
};

std::vector<Target> targets() {
  return {
      {kE2M1, test::kRefE2M1,
       {1.25f, 2.2f, 3.7f, -2.6f, 4.9f, 0.3f, 0.1f, -0.37f, 0.5f, 1.5f, 4.0f, 6.0f, -3.0f, 0.0f,
        5.9f, std::nextafter(6.0f, 0.0f), -5.99f}},
      {kE4M3, test::kRefE4M3,
       {1.1f, 3.3f, -17.7f, 300.5f, 0.003f, float(std::ldexp(1.37, -8)), -0.0041f,
        float(std::ldexp(1.37, -19)),  // 2^10 below the quantum: the >32-bit-shift path
        float(std::ldexp(1.0, -9)), 448.0f, -0.875f, 240.0f, 440.0f, 447.9f, -433.0f}},
      {kE5M2, test::kRefE5M2,
       {1.1f, 3.3f, -1000.7f, 40000.5f, 3e-5f, 1e-5f, -4.1e-5f, float(std::ldexp(1.0, -16)),
        57344.0f, -1.25f, 57000.0f, 57343.0f, -50000.0f}},
  };
}

// lo <= x <= hi (signed, on the grid) and P(hi) = (x - lo) / (hi - lo).
struct Neighbours {
  double lo, hi, p;
};
Neighbours neighbours(const std::vector<test::GridPoint>& grid, double x) {
  const auto b = test::ref_neighbours(grid, std::fabs(x));
  const double lo = x < 0 ? -b.hi.value : b.lo.value;
  const double hi = x < 0 ? -b.lo.value : b.hi.value;
  const double p = hi == lo ? 0.0 : (x - lo) / (hi - lo);
  return {lo, hi, p};
}

float sr_encode_decode(const MiniFloatSpec& spec, float x, uint32_t rnd) {
  return minifloat_decode(spec, minifloat_encode(spec, x, 0, Rounding::SR, rnd));
}

TEST(StochasticRounding, ResultsAreNeighboursAndTheMeanConverges) {
  constexpr int kCheckpoints[] = {1000, 10000, 100000};
  for (const Target& t : targets()) {
    double z_sum_small = 0, z_sum_large = 0;  // normalised errors at N = 1e3 and 1e5
    int inexact = 0;
    const auto grid = test::ref_grid(t.ref);
    for (size_t k = 0; k < t.xs.size(); ++k) {
      const float x = t.xs[k];
      const Neighbours nb = neighbours(grid, x);
      const double sigma = std::sqrt(nb.p * (1 - nb.p)) * (nb.hi - nb.lo);  // one draw's std dev
      double sum = 0;
      int n = 0;
      for (int cp : kCheckpoints) {
        for (; n < cp; ++n) {
          const float v = sr_encode_decode(t.spec, x, sr_bits(/*seed=*/11, /*stream=*/k, n));
          ASSERT_TRUE(v == float(nb.lo) || v == float(nb.hi))
              << t.ref.name << " x=" << x << " gave " << v << ", neighbours " << nb.lo << " " << nb.hi;
          sum += v;
        }
        const double err = std::fabs(sum / cp - double(x));
        EXPECT_LE(err, 5 * sigma / std::sqrt(double(cp)))
            << t.ref.name << " x=" << x << " N=" << cp << " mean " << sum / cp << " p=" << nb.p;
        if (sigma > 0 && cp == 1000) z_sum_small += err / sigma;
        if (sigma > 0 && cp == 100000) z_sum_large += err / sigma;
      }
      inexact += sigma > 0;
    }
    // Shrinking like 1/sqrt(N): E|mean - x| / sigma = sqrt(2/(pi N)), so the average over the x
    // set should drop ~sqrt(100) = 10x from N = 1e3 to 1e5. Requiring 3x leaves room for the
    // sampling spread of an average over ~10 values, and fails for any bias that does not shrink.
    ASSERT_GT(inexact, 5);
    EXPECT_LT(z_sum_large, z_sum_small / 3) << t.ref.name << ": error did not shrink with N";
    std::printf("[ SR %s ] mean |err|/sigma: N=1e3 %.4f, N=1e5 %.5f (expected %.4f, %.5f)\n",
                t.ref.name, z_sum_small / inexact, z_sum_large / inexact,
                std::sqrt(2 / (std::numbers::pi * 1e3)), std::sqrt(2 / (std::numbers::pi * 1e5)));
  }
}

TEST(StochasticRounding, RepresentableValuesNeverMove) {
  for (const Target& t : targets()) {
    for (const auto& g : test::ref_grid(t.ref)) {
      for (double v : {g.value, -g.value}) {
        const uint32_t rne = minifloat_encode(t.spec, float(v));
        for (uint32_t rnd : {0u, 1u, 0x7FFFu, 0x8000u, 0xFFFFu})
          ASSERT_EQ(minifloat_encode(t.spec, float(v), 0, Rounding::SR, rnd), rne)
              << t.ref.name << " " << v << " rnd " << rnd;
        for (uint64_t i = 0; i < 200; ++i)
          ASSERT_EQ(minifloat_encode(t.spec, float(v), 0, Rounding::SR, sr_bits(3, 4, i)), rne);
      }
    }
  }
}

// NUMERICS: 16 random bits per element. The extreme draws 0 and 2^16 - 1 give lo and hi for any x
// strictly between whose P(round up) is at least 2^-16 (below that the remainder's top 16 bits
// are 0 and the value rounds toward zero: the truncation the contract allows).
TEST(StochasticRounding, ExtremeDrawsGiveTheTwoNeighbours) {
  for (const Target& t : targets()) {
    const auto grid = test::ref_grid(t.ref);
    for (float x : t.xs) {
      const Neighbours nb = neighbours(grid, x);
      if (nb.lo == nb.hi || nb.p < 0x1p-16 || nb.p > 1 - 0x1p-16) continue;
      EXPECT_EQ(double(sr_encode_decode(t.spec, x, 0u)), std::fabs(nb.lo) < std::fabs(nb.hi) ? nb.lo : nb.hi)
          << t.ref.name << " " << x;
      EXPECT_EQ(double(sr_encode_decode(t.spec, x, 0xFFFFu)),
                std::fabs(nb.lo) < std::fabs(nb.hi) ? nb.hi : nb.lo)
          << t.ref.name << " " << x;
    }
  }
}

// The rule itself, over all 2^16 draws: at most 16 dropped bits round up for exactly rem * 2^(16 -
// shift) draws (P(up) = rem / 2^shift), more dropped bits for exactly floor(rem / 2^(shift - 16))
// draws (the remainder's top 16 bits: P(up) short of rem / 2^shift by less than 2^-16). Bits of
// the draw above the 16th are ignored.
TEST(StochasticRounding, SixteenBitRuleCountsEveryDraw) {
  std::mt19937 gen(5);
  for (int shift = 1; shift <= 39; ++shift)
    for (int rep = 0; rep < 12; ++rep) {
      uint32_t sig = (uint32_t(gen()) & 0xFFFFFFu) | 0x800000u;
      if (rep == 0) sig = 0x800000u;  // remainder 0 for shifts up to 23
      if (rep == 1) sig = 0xFFFFFFu;
      const uint64_t rem = shift >= 32 ? sig : sig & ((1ull << shift) - 1);
      const uint32_t down = shift >= 32 ? 0u : sig >> shift;
      const uint64_t want_up = shift <= 16 ? rem << (16 - shift) : rem >> (shift - 16);
      uint64_t up = 0;
      for (uint32_t r = 0; r < 65536; ++r) {
        const uint32_t n = shift_round_sr(sig, shift, r);
        ASSERT_TRUE(n == down || n == down + 1) << "sig " << sig << " shift " << shift << " r " << r;
        up += n - down;
        if (r % 4099 == 0) {
          ASSERT_EQ(shift_round_sr(sig, shift, r | (uint32_t(gen()) << 16)), n);
        }
      }
      EXPECT_EQ(up, want_up) << "sig 0x" << std::hex << sig << std::dec << " shift " << shift;
      const double bias = double(rem) / std::ldexp(1.0, shift) - double(up) / 65536.0;
      EXPECT_GE(bias, 0.0);
      EXPECT_LT(bias, 0x1p-16) << "shift " << shift;
    }
}

TEST(StochasticRounding, ReproducibleFromSeedStreamIndex) {
  const float x = 1.25f;  // E2M1 p = 0.5: two independent sequences differ in about half the draws
  auto sequence = [&](uint64_t seed, uint64_t stream) {
    std::vector<uint32_t> codes;
    for (uint64_t i = 0; i < 1000; ++i)
      codes.push_back(minifloat_encode(kE2M1, x, 0, Rounding::SR, sr_bits(seed, stream, i)));
    return codes;
  };
  const auto a = sequence(42, 1);
  EXPECT_EQ(a, sequence(42, 1));
  // Any element recomputed alone gives the same code (no hidden sequential state).
  for (uint64_t i : {0, 1, 2, 3, 4, 517, 999})
    EXPECT_EQ(a[i], minifloat_encode(kE2M1, x, 0, Rounding::SR, sr_bits(42, 1, i)));
  auto differences = [&](const std::vector<uint32_t>& b) {
    int d = 0;
    for (size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
    return d;
  };
  // Two independent p = 1/2 sequences of 1000 differ in Binomial(1000, 1/2) places: 500 +- 16.
  EXPECT_GT(differences(sequence(42, 2)), 400);
  EXPECT_GT(differences(sequence(43, 1)), 400);
  EXPECT_GT(differences(sequence(1, 42)), 400);  // seed and stream are not interchangeable
}

// ---- MXFP8: RCEIL scales never clip -------------------------------------------------------------

std::vector<std::vector<float>> mx_blocks() {
  std::mt19937 gen(31);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  std::chi_squared_distribution<float> chi2(2.0f);
  std::vector<std::vector<float>> blocks;
  for (int rep = 0; rep < 6; ++rep) {
    const float s = float(std::ldexp(1.0, rep * 7 - 20));
    std::vector<float> normal(32), uniform(32), student(32), outlier(32), at_max(32), above_pow(32);
    for (int i = 0; i < 32; ++i) {
      normal[i] = nd(gen) * s;
      uniform[i] = ud(gen) * s;
      student[i] = nd(gen) / std::sqrt(chi2(gen) / 2.0f) * s;  // Student t, 2 degrees of freedom
      outlier[i] = nd(gen) * s;
      at_max[i] = nd(gen) * s;
      above_pow[i] = ud(gen) * s;
    }
    outlier[rep] = 1000.0f * s;
    // amax exactly a power of two times the element max: x / scale lands on max itself.
    at_max[5] = float(std::ldexp(1.0, rep * 7 - 20)) * 448.0f;
    at_max[9] = -float(std::ldexp(1.0, rep * 7 - 20)) * 57344.0f / 128.0f;
    // amax just above a power of two (the largest block elements near the top binade).
    above_pow[0] = std::nextafter(float(std::ldexp(1.0, rep * 7 - 18)), 1e30f);
    blocks.insert(blocks.end(), {normal, uniform, student, outlier, at_max, above_pow});
  }
  return blocks;
}

struct MxCase {
  const MiniFloatSpec& spec;
  const RefFormat& ref;
};

// For every element: each SR draw decodes to a finite value that is one of the two neighbours of x
// on the scaled grid; the mean over the draws is within 5 sigma of x. Returns the number of
// elements whose mean is off by more than that (0 unless the scale clips).
int64_t check_mx_sr(const MxCase& c, MxScaleRule rule, bool expect_unclipped) {
  constexpr int kDraws = 4000;
  const auto grid = test::ref_grid(c.ref);
  const double max = grid.back().value;
  int64_t biased = 0;
  int block_id = 0;
  for (const auto& xb : mx_blocks()) {
    float amax = 0;
    for (float v : xb) amax = std::max(amax, std::fabs(v));
    const uint8_t scale = mxfp8_scale(amax, c.spec, rule);
    const double s = std::ldexp(1.0, int(scale) - 127);
    // Neighbours of x / scale (exact: a power-of-two scale) on the element grid. Above max (only
    // under the floor rule) the one reachable value is the clipped max: sigma 0 there.
    std::vector<Neighbours> nb(32);
    for (int i = 0; i < 32; ++i) {
      const double xs = double(xb[i]) / s;
      if (expect_unclipped) {
        EXPECT_LE(std::fabs(xs), max) << c.ref.name << ": RCEIL scale leaves x above max";
      }
      nb[i] = neighbours(grid, std::clamp(xs, -max, max));
    }
    std::vector<double> sum(32, 0.0);
    uint8_t codes[32];
    for (int d = 0; d < kDraws; ++d) {
      const uint8_t sc = mxfp8_quantize_block(xb.data(), 32, amax, c.spec, rule, Rounding::SR,
                                              /*seed=*/d, /*stream=*/block_id, 0, codes);
      EXPECT_EQ(sc, scale);
      for (int i = 0; i < 32; ++i) {
        const float v = mxfp8_decode(codes[i], sc, c.spec);
        if (!std::isfinite(v) || !(v == float(nb[i].lo * s) || v == float(nb[i].hi * s))) {
          ADD_FAILURE() << c.ref.name << " block " << block_id << " x=" << xb[i] << " -> " << v
                        << ", neighbours " << nb[i].lo * s << " " << nb[i].hi * s;
          return -1;
        }
        sum[i] += v;
      }
    }
    for (int i = 0; i < 32; ++i) {
      const double sigma = std::sqrt(nb[i].p * (1 - nb[i].p)) * (nb[i].hi - nb[i].lo) * s;
      const double err = std::fabs(sum[i] / kDraws - double(xb[i]));
      if (err > 5 * sigma / std::sqrt(double(kDraws))) {
        ++biased;
        if (expect_unclipped)
          ADD_FAILURE() << c.ref.name << " block " << block_id << " x=" << xb[i] << " mean "
                        << sum[i] / kDraws << " err " << err << " sigma " << sigma;
      }
    }
    ++block_id;
  }
  return biased;
}

TEST(StochasticRounding, Mxfp8RceilScalesNeverClip) {
  for (const MxCase& c : {MxCase{kE4M3, test::kRefE4M3}, MxCase{kE5M2, test::kRefE5M2}})
    EXPECT_EQ(check_mx_sr(c, MxScaleRule::RCEIL, true), 0) << c.ref.name;
}

// Negative control: the OCP floor scale puts the block max above the element max for blocks whose
// amax mantissa is above max's (E4M3: amax in (448, 512) * 2^k), and SR's mean there is biased.
TEST(StochasticRounding, Mxfp8FloorScaleClipsAndTheCheckSeesIt) {
  EXPECT_GT(check_mx_sr(MxCase{kE4M3, test::kRefE4M3}, MxScaleRule::FLOOR, false), 0);
}

}  // namespace
