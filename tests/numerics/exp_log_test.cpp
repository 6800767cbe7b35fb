// defines: exp_hd / log_hd tests (numerics/exp_log.h): within one ulp of long double's expl/logl
//          over the whole range (exp under 0.65 ulp, 1 where its result is subnormal; log under
//          0.85) on random exponents, subnormals, the neighbourhoods of 0 and 1 and the sampler's
//          domain; exact at the points that must be; IEEE's special values.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "fourbit/numerics/exp_log.h"

using namespace fourbit;

namespace {

// |got - want| in units of the last place of a double near `want` (the subnormal spacing below
// the normal range), want computed in long double (64-bit significand on x86-64).
double ulp_error(double got, long double want) {
  if (std::fabs(want) > (long double)DBL_MAX)  // rounds to DBL_MAX or overflows to Inf
    return std::fabs(got) >= DBL_MAX ? 0.0 : INFINITY;
  const double w = double(want);
  int exp = 0;
  std::frexp(w == 0 ? DBL_MIN : w, &exp);
  const long double ulp = std::ldexp(1.0L, std::max(exp - 53, -1074));
  return double(std::fabs((long double)got - want) / ulp);
}

struct Worst {
  double ulps = 0, at = 0;
  void see(double e, double x) {
    if (e > ulps) ulps = e, at = x;
  }
};

}  // namespace

TEST(ExpLog, ExpIsWithinOneUlpEverywhere) {
  std::mt19937_64 rng(7);
  std::vector<double> xs;
  std::uniform_real_distribution<double> whole(-746.0, 710.0), sampler(-60.0, 0.0), unit(-1.0, 1.0);
  for (int i = 0; i < 300000; ++i) xs.push_back(whole(rng));
  for (int i = 0; i < 300000; ++i) xs.push_back(sampler(rng));
  for (int i = 0; i < 100000; ++i) xs.push_back(unit(rng));
  for (int i = 0; i < 100000; ++i) xs.push_back(std::ldexp(unit(rng), -int(rng() % 60)));  // tiny |x|
  for (int k = -1076; k <= 1024; ++k)  // either side of the reduction's halfway points
    for (double d : {-1e-9, 0.0, 1e-9}) xs.push_back((k + 0.5) * 0.6931471805599453 + d);
  Worst worst, worst_subnormal;  // results below DBL_MIN are rounded twice (scaled after rounding)
  int64_t differ_from_libm = 0;
  for (double x : xs) {
    const double got = num::exp_hd(x);
    (got < DBL_MIN ? worst_subnormal : worst).see(ulp_error(got, std::exp((long double)x)), x);
    differ_from_libm += got != std::exp(x);
  }
  EXPECT_LT(worst.ulps, 0.65) << "at x = " << worst.at;
  EXPECT_LT(worst_subnormal.ulps, 1.0) << "at x = " << worst_subnormal.at;
  std::printf("exp_hd: max %.3f ulp (at %.17g), %.3f where subnormal (at %.17g); %lld of %zu differ from std::exp\n",
              worst.ulps, worst.at, worst_subnormal.ulps, worst_subnormal.at, (long long)differ_from_libm, xs.size());
}

TEST(ExpLog, LogIsWithinOneUlpEverywhere) {
  std::mt19937_64 rng(8);
  std::vector<double> xs;
  for (int i = 0; i < 400000; ++i) {  // random bits: every binade, subnormals included, equally often
    const double x = num::double_of(rng() & 0x7fefffffffffffffull);
    if (x > 0) xs.push_back(x);
  }
  std::uniform_real_distribution<double> around(0.5, 2.0), prob(0.0, 1.0);
  for (int i = 0; i < 200000; ++i) xs.push_back(around(rng));
  for (int i = 0; i < 200000; ++i) xs.push_back(prob(rng));  // the sampler's domain
  for (int i = 0; i < 100000; ++i) xs.push_back(1.0 + std::ldexp(around(rng) - 1.25, -int(rng() % 50)));
  for (double x : {DBL_MIN, DBL_MAX, DBL_TRUE_MIN, 0x1.6a09e667f3bcdp+0, 0x1.6a09e667f3bcep+0, 0.5, 2.0})
    xs.push_back(x);
  Worst worst;
  int64_t differ_from_libm = 0;
  for (double x : xs) {
    const double got = num::log_hd(x);
    worst.see(ulp_error(got, std::log((long double)x)), x);
    differ_from_libm += got != std::log(x);
  }
  EXPECT_LT(worst.ulps, 0.85) << "at x = " << worst.at;
  std::printf("log_hd: max %.3f ulp (at %.17g), %lld of %zu differ from std::log\n", worst.ulps, worst.at,
              (long long)differ_from_libm, xs.size());
}

TEST(ExpLog, ExactPointsAndSpecialValues) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(num::exp_hd(0.0), 1.0);
  EXPECT_EQ(num::exp_hd(-0.0), 1.0);
  EXPECT_EQ(num::exp_hd(-inf), 0.0);
  EXPECT_EQ(num::exp_hd(inf), inf);
  EXPECT_TRUE(std::isnan(num::exp_hd(nan)));
  EXPECT_EQ(num::exp_hd(710.0), inf);             // above DBL_MAX = e^709.78
  EXPECT_EQ(num::exp_hd(709.78), std::exp(709.78));
  EXPECT_EQ(num::exp_hd(-745.0), DBL_TRUE_MIN);  // e^-745 rounds to the least subnormal
  EXPECT_EQ(num::exp_hd(-745.2), 0.0);
  EXPECT_EQ(num::exp_hd(-800.0), 0.0);
  EXPECT_EQ(num::log_hd(1.0), 0.0);
  EXPECT_EQ(num::log_hd(0.0), -inf);
  EXPECT_EQ(num::log_hd(-0.0), -inf);
  EXPECT_EQ(num::log_hd(inf), inf);
  EXPECT_TRUE(std::isnan(num::log_hd(-1.0)));
  EXPECT_TRUE(std::isnan(num::log_hd(-inf)));
  EXPECT_TRUE(std::isnan(num::log_hd(nan)));
  for (int k = -1074; k <= 1023; ++k)  // log 2^k = k ln2, to the last place
    EXPECT_LE(ulp_error(num::log_hd(std::ldexp(1.0, k)), (long double)k * std::log(2.0L)), 0.5) << k;
}
