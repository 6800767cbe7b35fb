// defines: token-choice tests (rl/sampling.h): the draw is a pure function of (logits, options,
//          seed, step, sequence id, position); greedy takes the first maximum; top-k 1 and a tiny
//          top-p are greedy; truncation never draws outside the kept set; draws at temperature 1
//          follow the softmax; a higher temperature flattens; NaN logits fail; the walk is
//          numerics/draw.h's (order, chunked running sums) token by token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "fourbit/numerics/draw.h"
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

namespace {

// The draw after the walk order as numerics/draw.h defines it, token by token: acc_i over chunks
// of kDrawChunk in one pass, then the top-p cut and the inverse CDF by linear scans.
num::DrawPick linear_pick(const std::vector<double>& p, int64_t keep, double top_p, double u) {
  std::vector<double> acc(static_cast<size_t>(keep));
  double before = 0, within = 0;
  for (int64_t j = 0; j < keep; ++j) {
    if (j > 0 && j % num::kDrawChunk == 0) {
      before += within;
      within = 0;
    }
    within += p[size_t(j)];
    acc[size_t(j)] = before + within;
  }
  double total = acc[size_t(keep - 1)];
  if (top_p < 1)
    for (int64_t i = 0; i < keep; ++i)
      if (acc[size_t(i)] >= top_p * total) {
        keep = i + 1;
        total = acc[size_t(i)];
        break;
      }
  int64_t pick = keep;
  for (int64_t i = 0; i < keep; ++i)
    if (acc[size_t(i)] > u * total) {
      pick = i;
      break;
    }
  if (pick == keep)
    for (pick = keep - 1; pick > 0 && p[size_t(pick)] == 0; --pick) {
    }
  return num::DrawPick{pick, num::log_hd(p[size_t(pick)] / total)};
}

}  // namespace

// The walk order (decreasing logit, equal logits by increasing id; -0 equal to +0) written as a
// stable sort on the logits, then the token-by-token walk: every draw, token and log-prob bits,
// equals one taken that way, on rows with many ties, signed zeros and -inf, rows of several
// chunks, under truncation and temperature.
TEST(Sampling, DrawsWalkTheTokensByLogitThenId) {
  auto reference = [](const std::vector<float>& l, const rl::SamplingOptions& o, uint64_t seq, int64_t pos) {
    std::vector<int32_t> order(l.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
    const double max = double(l[size_t(order[0])]);
    const int64_t keep = o.top_k > 0 ? std::min(int64_t(o.top_k), int64_t(l.size())) : int64_t(l.size());
    std::vector<double> p(static_cast<size_t>(keep));
    for (int64_t i = 0; i < keep; ++i) p[size_t(i)] = num::draw_weight(l[size_t(order[size_t(i)])], max, o.temperature);
    const num::DrawPick d = linear_pick(p, keep, o.top_p, rl::sampling_uniform(o.seed, o.step, seq, pos));
    return rl::TokenDraw{order[size_t(d.index)], d.logprob};
  };
  std::mt19937_64 rng(31);
  std::uniform_int_distribution<int> level(-6, 6), kind(0, 19);
  for (int row = 0; row < 400; ++row) {
    std::vector<float> l(size_t(row % 4 == 3 ? 257 + (row * 37) % 1100 : 1 + row % 300));
    for (float& x : l) {  // a few levels only: many ties
      const int k = kind(rng);
      x = k == 0 ? -INFINITY : k == 1 ? -0.0f : k == 2 ? 0.0f : 0.5f * float(level(rng));
    }
    if (std::all_of(l.begin(), l.end(), [](float x) { return x == -INFINITY; })) l[0] = 1.0f;
    rl::SamplingOptions o;
    o.temperature = row % 3 == 0 ? 0.7 : 1.0;
    o.top_k = row % 4 == 1 ? 5 : row % 8 == 7 ? 600 : 0;
    o.top_p = row % 5 == 2 ? 0.6 : 1.0;
    for (int64_t pos = 0; pos < 8; ++pos) {
      const rl::TokenDraw got = rl::draw_token(l, o, uint64_t(row), pos), want = reference(l, o, uint64_t(row), pos);
      ASSERT_EQ(got.token, want.token) << "row " << row << " position " << pos;
      ASSERT_EQ(got.sample_logprob, want.sample_logprob) << "row " << row << " position " << pos;
    }
  }
}

// draw_pick skips whole chunks by their sums: the same pick and log-prob bits as the token-by-token
// walk for every length around chunk boundaries, thresholds landing in every chunk, zero weights.
TEST(Sampling, ChunkedWalkIsTheTokenByTokenWalk) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> weight(0.0, 1.0), unit(0.0, 1.0);
  for (int64_t keep : {1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 2048, 3001}) {
    std::vector<double> p(static_cast<size_t>(keep));
    for (double& x : p) x = rng() % 5 == 0 ? 0.0 : weight(rng);
    p[0] = 1;
    std::vector<double> chunk_sums;
    for (int64_t c = 0; c < keep; c += num::kDrawChunk)
      chunk_sums.push_back(num::draw_chunk_sum(p.data(), c, std::min(c + num::kDrawChunk, keep)));
    for (int t = 0; t < 200; ++t) {
      const double u = t == 0 ? 0.0 : t == 1 ? 0x1.fffffffffffffp-1 : unit(rng);
      const double top_p = t % 3 == 0 ? 1.0 : t % 3 == 1 ? unit(rng) : 1e-9;
      const num::DrawPick got = num::draw_pick(p.data(), chunk_sums.data(), keep, top_p, u);
      const num::DrawPick want = linear_pick(p, keep, top_p, u);
      ASSERT_EQ(got.index, want.index) << keep << " " << t;
      ASSERT_EQ(got.logprob, want.logprob) << keep << " " << t;
    }
  }
}
