// defines: token-choice tests (rl/sampling.h): the draw is a pure function of (logits, options,
//          seed, step, sequence id, position); greedy takes the first maximum; top-k 1 and a tiny
//          top-p are greedy; truncation never draws outside the kept set; draws at temperature 1
//          follow the softmax; a higher temperature flattens; NaN logits fail.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "fourbit/rl/sampling.h"
#include "rl/rl_test_util.h"

using namespace fourbit;
using namespace fourbit::rltest;

namespace {
const std::vector<float> kLogits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, -INFINITY};
}

TEST(Sampling, UniformIsAPureFunctionOfItsKey) {
  const double u = rl::sampling_uniform(1, 2, 3, 4);
  EXPECT_EQ(u, rl::sampling_uniform(1, 2, 3, 4));
  EXPECT_GE(u, 0.0);
  EXPECT_LT(u, 1.0);
  std::set<double> seen = {u};
  seen.insert(rl::sampling_uniform(9, 2, 3, 4));
  seen.insert(rl::sampling_uniform(1, 9, 3, 4));
  seen.insert(rl::sampling_uniform(1, 2, 9, 4));
  seen.insert(rl::sampling_uniform(1, 2, 3, 9));
  seen.insert(rl::sampling_uniform(1, 3, 2, 4));  // step and sequence id are not interchangeable
  EXPECT_EQ(seen.size(), 6u);
}

TEST(Sampling, GreedyTakesTheFirstMaximum) {
  rl::SamplingOptions o;
  o.temperature = 0;
  const rl::TokenDraw d = rl::draw_token(kLogits, o, 0, 0);
  EXPECT_EQ(d.token, 1);  // ids 1 and 3 tie
  EXPECT_EQ(d.sample_logprob, 0.0);
}

TEST(Sampling, TruncationKeepsTheMostLikely) {
  rl::SamplingOptions o;
  o.top_k = 1;
  for (int64_t pos = 0; pos < 50; ++pos) EXPECT_EQ(rl::draw_token(kLogits, o, 7, pos).token, 1);
  o.top_k = 0;
  o.top_p = 1e-6;
  for (int64_t pos = 0; pos < 50; ++pos) EXPECT_EQ(rl::draw_token(kLogits, o, 7, pos).token, 1);
  // top-k 3: ids 1, 3 (logit 2) and 4 (logit 1) only, each seen in 300 draws.
  o.top_p = 1;
  o.top_k = 3;
  std::set<int32_t> drawn;
  for (int64_t pos = 0; pos < 300; ++pos) drawn.insert(rl::draw_token(kLogits, o, 7, pos).token);
  EXPECT_EQ(drawn, (std::set<int32_t>{1, 3, 4}));
  // softmax(kLogits) = {.085, .379, .019, .379, .139, 0}: ids 1 and 3 hold .757, so top-p 0.7
  // keeps those two and top-p 0.8 adds id 4.
  o.top_k = 0;
  o.top_p = 0.8;
  drawn.clear();
  for (int64_t pos = 0; pos < 300; ++pos) drawn.insert(rl::draw_token(kLogits, o, 7, pos).token);
  EXPECT_EQ(drawn, (std::set<int32_t>{1, 3, 4}));
  o.top_p = 0.7;
  drawn.clear();
  for (int64_t pos = 0; pos < 300; ++pos) drawn.insert(rl::draw_token(kLogits, o, 7, pos).token);
  EXPECT_EQ(drawn, (std::set<int32_t>{1, 3}));
  // The draw's log-prob is under the truncated distribution: each of the two at log(1/2).
  EXPECT_NEAR(rl::draw_token(kLogits, o, 7, 0).sample_logprob, std::log(0.5), 1e-12);
}

// 40000 draws at temperature 1 land within 0.01 of the softmax probabilities (the standard
// error is below 0.0025); at temperature 4 the least likely finite token is drawn far more often.
TEST(Sampling, DrawsFollowTheSoftmax) {
  rl::SamplingOptions o;
  double z = 0;
  for (float l : kLogits) z += std::exp(double(l));
  const int64_t n = 40000;
  for (double temp : {1.0, 4.0}) {
    o.temperature = temp;
    std::vector<int64_t> count(kLogits.size(), 0);
    for (int64_t i = 0; i < n; ++i) count[size_t(rl::draw_token(kLogits, o, uint64_t(i % 100), i / 100).token)] += 1;
    EXPECT_EQ(count[5], 0);  // -inf
    if (temp == 1.0) {
      for (size_t v = 0; v < kLogits.size(); ++v)
        EXPECT_NEAR(double(count[v]) / double(n), std::exp(double(kLogits[v])) / z, 0.01) << v;
    } else {
      EXPECT_GT(double(count[2]) / double(n), 0.08);  // 0.02 at temperature 1, ~0.12 at 4
    }
  }
}

TEST(Sampling, BadLogitsFail) {
  rl::SamplingOptions o;
  std::vector<float> nan = kLogits;
  nan[2] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { rl::draw_token(nan, o, 3, 4); }, "the logits of sequence 3 at position 4 hold NaN (token 2)");
  const std::vector<float> dead(3, -INFINITY);
  expect_error([&] { rl::draw_token(dead, o, 3, 4); }, "every logit of sequence 3 at position 4 is -inf");
}
