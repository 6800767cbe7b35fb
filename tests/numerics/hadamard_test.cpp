// defines: the Hadamard tests
// Hadamard transforms against the explicit Sylvester matrix H[i][j] = (-1)^popcount(i & j) / sqrt(n)
// in double; the RHT round trip and norm preservation (NUMERICS "Random Hadamard transform").
// Errors are measured relative to the vector norm: the float32 butterfly rounds each of its
// log2(n) stages, so a single output that cancels to near zero has no meaningful relative error.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "fourbit/numerics/hadamard.h"

using namespace fourbit::num;

namespace {

template <int N>
std::vector<double> sylvester_times(const float* x, uint32_t signs) {
  std::vector<double> y(N, 0.0);
  for (int j = 0; j < N; ++j)
    for (int i = 0; i < N; ++i) {
      const double s = ((signs >> i) & 1u) ? -1.0 : 1.0;
      const double h = (std::popcount(uint32_t(i & j)) & 1) ? -1.0 : 1.0;
      y[j] += s * double(x[i]) * h;  // (x . s) H: row vector times matrix
    }
  for (double& v : y) v /= std::sqrt(double(N));
  return y;
}

double norm(const std::vector<double>& v) {
  double s = 0;
  for (double a : v) s += a * a;
  return std::sqrt(s);
}

template <int N>
std::vector<float> random_chunk(std::mt19937& gen, int kind) {
  std::normal_distribution<float> nd;
  std::vector<float> x(N);
  for (int i = 0; i < N; ++i) x[i] = nd(gen);
  if (kind == 1) x[gen() % N] *= 1000.0f;             // one outlier
  if (kind == 2) for (float& v : x) v *= 1e-20f;        // tiny values
  if (kind == 3) {  // a basis vector
    const int k = int(gen() % N);
    for (int i = 0; i < N; ++i) x[i] = i == k ? 1.0f : 0.0f;
  }
  return x;
}

template <int N>
void check_matches_matrix() {
  std::mt19937 gen(N);
  for (int t = 0; t < 2000; ++t) {
    auto x = random_chunk<N>(gen, t % 4);
    const uint32_t signs = t % 3 == 0 ? 0u : uint32_t(gen());
    const auto want = sylvester_times<N>(x.data(), 0u);
    auto y = x;
    hadamard_transform<N>(y.data());
    std::vector<double> diff(N);
    for (int i = 0; i < N; ++i) diff[i] = double(y[i]) - want[i];
    ASSERT_LT(norm(diff) / norm(want), 1e-6) << "n=" << N << " trial " << t;

    const auto want_rht = sylvester_times<N>(x.data(), signs);
    auto z = x;
    rht_forward<N>(z.data(), signs);
    for (int i = 0; i < N; ++i) diff[i] = double(z[i]) - want_rht[i];
    ASSERT_LT(norm(diff) / norm(want_rht), 1e-6) << "n=" << N << " trial " << t;
  }
}

TEST(Hadamard, Transform16MatchesSylvesterMatrix) { check_matches_matrix<16>(); }
TEST(Hadamard, Transform32MatchesSylvesterMatrix) { check_matches_matrix<32>(); }

TEST(Hadamard, BasisVectorGivesAMatrixRow) {
  // H e_k / sqrt(n) is row k of H scaled: exact for n = 16 (0.25), float(1/sqrt(32)) for n = 32.
  for (int k = 0; k < 16; ++k) {
    float x[16] = {};
    x[k] = 1.0f;
    hadamard_transform<16>(x);
    for (int j = 0; j < 16; ++j) EXPECT_EQ(x[j], (std::popcount(uint32_t(k & j)) & 1) ? -0.25f : 0.25f);
  }
  for (int k = 0; k < 32; ++k) {
    float x[32] = {};
    x[k] = 1.0f;
    hadamard_transform<32>(x);
    const float h = float(1 / std::sqrt(32.0));
    for (int j = 0; j < 32; ++j) EXPECT_EQ(x[j], (std::popcount(uint32_t(k & j)) & 1) ? -h : h);
  }
}

template <int N>
void check_round_trip(uint32_t signs, std::mt19937& gen) {
  for (int t = 0; t < 500; ++t) {
    const auto x = random_chunk<N>(gen, t % 3);
    auto y = x;
    rht_forward<N>(y.data(), signs);
    std::vector<double> xd(x.begin(), x.end()), yd(y.begin(), y.end());
    // The RHT is orthogonal: the L2 norm is preserved.
    ASSERT_NEAR(norm(yd) / norm(xd), 1.0, 1e-6) << "n=" << N << " signs " << signs;
    rht_inverse<N>(y.data(), signs);
    double max_err = 0, max_x = 0;
    for (int i = 0; i < N; ++i) {
      max_err = std::max(max_err, std::fabs(double(y[i]) - double(x[i])));
      max_x = std::max(max_x, std::fabs(double(x[i])));
    }
    ASSERT_LT(max_err / max_x, 1e-6) << "n=" << N << " signs " << std::hex << signs;
  }
}

TEST(Hadamard, RhtInverseUndoesForward) {
  std::mt19937 gen(17);
  check_round_trip<16>(kNvidiaRht16Signs, gen);
  check_round_trip<16>(0u, gen);
  check_round_trip<16>(0xFFFFu, gen);
  check_round_trip<32>(0xFFFFFFFFu, gen);
  for (int s = 0; s < 20; ++s) {
    check_round_trip<16>(rht_signs(1234, s, 16), gen);
    check_round_trip<32>(rht_signs(1234, s, 32), gen);
  }
}

TEST(Hadamard, SignMasks) {
  // NVIDIA's fixed 16-point mask, bit i set => s_i = -1.
  EXPECT_EQ(kNvidiaRht16Signs, 0xD7E8u);
  float x[16], want[16];
  for (int i = 0; i < 16; ++i) {
    x[i] = float(i + 1);
    want[i] = ((0xD7E8u >> i) & 1u) ? -float(i + 1) : float(i + 1);
  }
  rht_forward<16>(x, kNvidiaRht16Signs);
  hadamard_transform<16>(x);  // H H / 16 = I exactly here (small integers, power-of-two norm)
  for (int i = 0; i < 16; ++i) EXPECT_EQ(x[i], want[i]) << i;
  // Seeded masks: n bits, reproducible, different per stream.
  EXPECT_EQ(rht_signs(5, 1, 16) >> 16, 0u);
  EXPECT_EQ(rht_signs(5, 1, 16), rht_signs(5, 1, 16));
  EXPECT_NE(rht_signs(5, 1, 32), rht_signs(5, 2, 32));
}

}  // namespace
