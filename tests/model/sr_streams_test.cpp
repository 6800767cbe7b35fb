// defines: tests of SrStreams (model/linear.h), the stochastic-rounding stream keys: "one stream
//          per (step, micro-batch, layer, site, expert)" -- distinct keys must give distinct
//          Philox streams over the ranges a training run uses, and the key is a pure function.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "fourbit/model/linear.h"

using namespace fourbit;

namespace {

using Key = std::tuple<uint64_t, uint64_t, int64_t, int, int64_t>;  // step, micro, layer, site, expert

std::pair<uint64_t, uint64_t> stream_of(uint64_t seed, const Key& k) {
  const auto& [step, micro, layer, site, expert] = k;
  const ops::RngKey r = SrStreams{seed, step, micro}.key(layer, site, expert);
  return {r.seed, r.stream};
}

// Every key of `keys` gets its own stream; reports the first collision.
void expect_distinct(const std::vector<Key>& keys, const char* what) {
  std::map<std::pair<uint64_t, uint64_t>, Key> seen;
  int collisions = 0;
  for (const Key& k : keys) {
    auto [it, inserted] = seen.emplace(stream_of(1234, k), k);
    if (!inserted && collisions++ == 0) {
      const auto& [s0, m0, l0, t0, e0] = it->second;
      const auto& [s1, m1, l1, t1, e1] = k;
      ADD_FAILURE() << what << ": (step " << s0 << ", micro " << m0 << ", layer " << l0 << ", site " << t0
                    << ", expert " << e0 << ") and (step " << s1 << ", micro " << m1 << ", layer " << l1
                    << ", site " << t1 << ", expert " << e1 << ") share one SR stream";
    }
  }
  EXPECT_EQ(collisions, 0) << what << ": " << collisions << " of " << keys.size() << " keys collide";
}

}  // namespace

TEST(SrStreams, PureFunctionOfTheKey) {
  const ops::RngKey a = SrStreams{7, 3, 1}.key(2, 14, 5), b = SrStreams{7, 3, 1}.key(2, 14, 5);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.stream, b.stream);
  EXPECT_EQ(a.seed, 7u);
  const ops::RngKey other_seed = SrStreams{8, 3, 1}.key(2, 14, 5);
  EXPECT_NE(other_seed.seed, a.seed);
}

// The sites of model.cpp go up to ~60, layers to the model depth, experts to n_experts.
TEST(SrStreams, LayersSitesAndExpertsGetDistinctStreams) {
  std::vector<Key> keys;
  for (int64_t layer = 0; layer <= 24; ++layer)
    for (int site = 0; site < 64; ++site)
      for (int64_t expert = 0; expert < 16; ++expert) keys.emplace_back(5, 0, layer, site, expert);
  expect_distinct(keys, "layer x site x expert at step 5");
}

// A run of a few thousand steps with 8 experts per layer: step s expert e must not reuse the
// stream of any other (step, expert). (The default tiny config trains 300 steps.)
TEST(SrStreams, StepsAndExpertsGetDistinctStreams) {
  std::vector<Key> keys;
  for (uint64_t step = 0; step < 2048; ++step)
    for (int64_t expert = 0; expert < 8; ++expert) keys.emplace_back(step, 0, 1, 14, expert);
  expect_distinct(keys, "step x expert");
}

TEST(SrStreams, StepsAndMicroBatchesGetDistinctStreams) {
  std::vector<Key> keys;
  for (uint64_t step = 0; step < 1024; ++step)
    for (uint64_t micro = 0; micro < 8; ++micro) keys.emplace_back(step, micro, 2, 10, 0);
  expect_distinct(keys, "step x micro-batch");
}
