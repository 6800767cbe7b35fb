// defines: the Philox tests: known answers, the counter layout of random_bits and sr_bits
// Philox-4x32-10 against the published known-answer vectors and an independent implementation;
// the (seed, stream, index) -> 32-bit draw mapping of random_bits and RandomBits; a uniformity
// check of the draws.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <random>

#include "fourbit/numerics/philox.h"

using namespace fourbit::num;

namespace {

// Random123 tests/kat_vectors (github.com/DEShawResearch/random123), the "philox4x32 10" lines:
// counter (4 words), key (2 words), expected output (4 words).
struct Kat {
  std::array<uint32_t, 4> ctr;
  std::array<uint32_t, 2> key;
  std::array<uint32_t, 4> out;
};
constexpr Kat kKats[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

std::array<uint32_t, 4> words(const Philox4x32& p) { return {p.v[0], p.v[1], p.v[2], p.v[3]}; }

TEST(Philox, KnownAnswerVectors) {
  for (const Kat& k : kKats) {
    const Philox4x32 out =
        philox4x32_10(Philox4x32{{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}}, k.key[0], k.key[1]);
    EXPECT_EQ(words(out), k.out) << std::hex << "ctr " << k.ctr[0] << " key " << k.key[0];
  }
}

// Written from Salmon et al. (SC'11) in Random123's own order: the key is bumped *before* each of
// rounds 2..10 and the S-box is spelled as a 64-bit product split afterwards.
std::array<uint32_t, 4> reference_philox(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    const uint64_t a = 0xD2511F53ull * c[0], b = 0xCD9E8D57ull * c[2];
    c = {uint32_t(b >> 32) ^ c[1] ^ k[0], uint32_t(b), uint32_t(a >> 32) ^ c[3] ^ k[1], uint32_t(a)};
  }
  return c;
}

TEST(Philox, MatchesAnIndependentImplementation) {
  for (const Kat& k : kKats) ASSERT_EQ(reference_philox(k.ctr, k.key), k.out);
  std::mt19937 gen(8);
  for (int i = 0; i < 20000; ++i) {
    const std::array<uint32_t, 4> c = {uint32_t(gen()), uint32_t(gen()), uint32_t(gen()), uint32_t(gen())};
    const std::array<uint32_t, 2> k = {uint32_t(gen()), uint32_t(gen())};
    ASSERT_EQ(words(philox4x32_10(Philox4x32{{c[0], c[1], c[2], c[3]}}, k[0], k[1])), reference_philox(c, k));
  }
}

// The counter layout is part of the CPU/GPU contract: (group lo, group hi, stream lo, stream hi),
// key (seed lo, seed hi); element i is word i % 4 of group i / 4.
TEST(Philox, RandomBitsLayout) {
  const uint64_t seeds[] = {0, 1, 0x123456789abcdef0ull, ~0ull};
  const uint64_t streams[] = {0, 7, 0xfedcba9876543210ull};
  const uint64_t indices[] = {0, 1, 2, 3, 4, 5, 1023, (1ull << 32) - 1, 1ull << 32, (1ull << 34) + 3,
                              0xffffffffffffffffull};
  for (uint64_t seed : seeds)
    for (uint64_t stream : streams)
      for (uint64_t index : indices) {
        const uint64_t g = index / 4;
        const auto block = reference_philox(
            {uint32_t(g), uint32_t(g >> 32), uint32_t(stream), uint32_t(stream >> 32)},
            {uint32_t(seed), uint32_t(seed >> 32)});
        EXPECT_EQ(random_bits(seed, stream, index), block[index % 4])
            << seed << " " << stream << " " << index;
        EXPECT_EQ(words(random_bits4(seed, stream, g)), block);
      }
}

TEST(Philox, RandomBitsReaderEqualsRandomBits) {
  RandomBits r(99, 5);
  for (uint64_t i = 0; i < 4096; ++i) ASSERT_EQ(r.at(i), random_bits(99, 5, i)) << i;
  // Random access, backwards and repeated indices: no sequential state leaks into a draw.
  std::mt19937_64 gen(3);
  for (int k = 0; k < 4096; ++k) {
    const uint64_t i = k % 3 == 0 ? gen() : gen() % 64;
    ASSERT_EQ(r.at(i), random_bits(99, 5, i)) << i;
  }
  for (uint64_t i = 100; i-- > 0;) ASSERT_EQ(r.at(i), random_bits(99, 5, i)) << i;
}

// NUMERICS "Stochastic rounding": element i draws half i % 2 (the low half first) of word (i / 2) % 4
// of the call for counter group i / 8; SrBits reads the same bits in any order.
TEST(Philox, SrBitsLayout) {
  const uint64_t seeds[] = {0, 0x123456789abcdef0ull};
  const uint64_t streams[] = {3, 0xfedcba9876543210ull};
  for (uint64_t seed : seeds)
    for (uint64_t stream : streams)
      for (uint64_t index : {0ull, 1ull, 2ull, 7ull, 8ull, 9ull, 1023ull, (1ull << 35) + 5, ~0ull}) {
        const uint64_t g = index / 8;
        const auto call = reference_philox({uint32_t(g), uint32_t(g >> 32), uint32_t(stream), uint32_t(stream >> 32)},
                                           {uint32_t(seed), uint32_t(seed >> 32)});
        const uint32_t want = (call[(index / 2) % 4] >> (16 * (index % 2))) & 0xFFFFu;
        EXPECT_EQ(sr_bits(seed, stream, index), want) << seed << " " << stream << " " << index;
      }
  SrBits r(99, 5);
  for (uint64_t i = 0; i < 4096; ++i) ASSERT_EQ(r.at(i), sr_bits(99, 5, i)) << i;
  std::mt19937_64 gen(4);
  for (int k = 0; k < 4096; ++k) {
    const uint64_t i = k % 3 == 0 ? gen() : gen() % 64;
    ASSERT_EQ(r.at(i), sr_bits(99, 5, i)) << i;
  }
}

// The 16-bit draws: mean of N / 2^16 within ~7 sigma of 1/2, every bit a fair coin, and the two
// halves of one word uncorrelated (the mean of their product is 1/4).
TEST(Philox, SrBitsLookUniform) {
  constexpr int kN = 1000000;
  double sum = 0, prod = 0;
  int64_t ones[16] = {};
  for (int i = 0; i < kN; ++i) {
    const uint32_t u = sr_bits(2026, 9, uint64_t(i));
    ASSERT_LT(u, 65536u);
    sum += double(u) / 65536.0;
    for (int b = 0; b < 16; ++b) ones[b] += (u >> b) & 1u;
    if (i % 2 == 1) prod += (double(sr_bits(2026, 9, uint64_t(i - 1))) / 65536.0) * (double(u) / 65536.0);
  }
  EXPECT_NEAR(sum / kN, 0.5, 0.002);
  for (int b = 0; b < 16; ++b) EXPECT_NEAR(double(ones[b]) / kN, 0.5, 0.003) << "bit " << b;
  EXPECT_NEAR(prod / (kN / 2), 0.25, 0.003);
}

// Mean of N uniform draws / 2^32: standard deviation sqrt(1/12 / N) = 2.9e-4 at N = 1e6, so the
// +-0.002 band is ~7 sigma. Each bit is Bernoulli(1/2): std dev of the fraction 0.5/sqrt(N) = 5e-4,
// band +-0.003 = 6 sigma. Sequences along index, along stream and along seed are all checked.
TEST(Philox, DrawsLookUniform) {
  constexpr int kN = 1000000;
  auto check = [&](const char* what, auto draw) {
    double sum = 0;
    int64_t ones[32] = {};
    for (int i = 0; i < kN; ++i) {
      const uint32_t u = draw(uint64_t(i));
      sum += double(u) / 4294967296.0;
      for (int b = 0; b < 32; ++b) ones[b] += (u >> b) & 1u;
    }
    EXPECT_NEAR(sum / kN, 0.5, 0.002) << what;
    for (int b = 0; b < 32; ++b) EXPECT_NEAR(double(ones[b]) / kN, 0.5, 0.003) << what << " bit " << b;
  };
  check("index", [](uint64_t i) { return random_bits(2026, 3, i); });
  check("stream", [](uint64_t i) { return random_bits(2026, i, 17); });
  check("seed", [](uint64_t i) { return random_bits(i, 0, 0); });
}

}  // namespace
