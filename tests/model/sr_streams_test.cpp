// defines: tests of the stochastic-rounding streams (model/linear.h SrStreams, QuantSite): a stream
//          is a pure function of (seed, step, micro-batch, the quantization point's name); distinct
//          names, steps and micro-batches give distinct streams; and in one training step of every
//          recipe every quantization point draws its own stream: every quantization call is
//          recorded with its site, stream and input, and two calls share a stream only where they
//          are the same point quantizing the same input again (a recomputation in backward).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fourbit/model/linear.h"
#include "fourbit/model/model.h"
#include "fourbit/model/recipe.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

using Stream = std::pair<uint64_t, uint64_t>;  // (Philox key, counter stream)
Stream stream_of(const ops::RngKey& k) { return {k.seed, k.stream}; }

// Every (step, micro, name) of `keys` gets its own stream; reports the first collision.
using Key = std::tuple<uint64_t, uint64_t, std::string>;
void expect_distinct(const std::vector<Key>& keys, const char* what) {
  std::map<Stream, Key> seen;
  int collisions = 0;
  for (const Key& k : keys) {
    const auto& [step, micro, name] = k;
    auto [it, inserted] = seen.emplace(stream_of(SrStreams{1234, step, micro}.key(name)), k);
    if (!inserted && collisions++ == 0) {
      const auto& [s0, m0, n0] = it->second;
      ADD_FAILURE() << what << ": (step " << s0 << ", micro " << m0 << ", " << n0 << ") and (step " << step
                    << ", micro " << micro << ", " << name << ") share one SR stream";
    }
  }
  EXPECT_EQ(collisions, 0) << what << ": " << collisions << " of " << keys.size() << " keys collide";
}

// The names model.cpp gives a layer's quantization points (docs/model.md), for layer l.
std::vector<std::string> layer_site_names(int64_t l, int64_t experts) {
  const std::string p = "layers." + std::to_string(l) + ".";
  std::vector<std::string> weights = {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "moe.w1", "moe.w2", "moe.w3",
                                      "moe.router", "moe.shared.w1", "moe.shared.w2", "moe.shared.w3",
                                      "mlp.w1", "mlp.w2", "mlp.w3"};
  std::vector<std::string> out;
  for (const std::string& w : weights)
    for (const char* op : {"/fprop/X", "/fprop/W", "/dgrad/dY", "/dgrad/W", "/wgrad/dY^T", "/wgrad/X^T"}) {
      out.push_back(p + w + op);
      for (int64_t e = 0; e < experts; ++e) out.push_back(p + w + op + "[" + std::to_string(e) + "]");
    }
  for (const char* g : {"attn.wqkv", "moe.w13", "moe.shared.w13", "mlp.w13"})
    for (const char* op : {"/fprop/X", "/wgrad/X^T"}) out.push_back(p + g + op);
  return out;
}

}  // namespace

TEST(SrStreams, PureFunctionOfTheKey) {
  const ops::RngKey a = SrStreams{7, 3, 1}.key("layers.2.moe.w1/wgrad/dY^T[5]");
  const ops::RngKey b = SrStreams{7, 3, 1}.key("layers.2.moe.w1/wgrad/dY^T[5]");
  EXPECT_EQ(stream_of(a), stream_of(b));
  EXPECT_EQ(a.seed, 7u);
  const ops::RngKey other_seed = SrStreams{8, 3, 1}.key("layers.2.moe.w1/wgrad/dY^T[5]");
  EXPECT_NE(other_seed.seed, a.seed);
  const QuantSite s = SrStreams{7, 3, 1}.site("layers.2.moe.w1/wgrad/dY^T[5]");
  EXPECT_EQ(s.name, "layers.2.moe.w1/wgrad/dY^T[5]");
  EXPECT_EQ(stream_of(s.key), stream_of(a));
}

// Every name of a 24-layer model with 16 experts, at one step.
TEST(SrStreams, SiteNamesGetDistinctStreams) {
  std::vector<Key> keys;
  for (int64_t layer = 0; layer < 24; ++layer)
    for (const std::string& n : layer_site_names(layer, 16)) keys.emplace_back(5, 0, n);
  for (const char* n : {"lm_head/fprop/X", "lm_head/fprop/W", "lm_head/dgrad/dY", "lm_head/wgrad/dY^T",
                        "lm_head/wgrad/X^T"})
    keys.emplace_back(5, 0, n);
  expect_distinct(keys, "names at step 5");
}

// A run of a few thousand steps with 8 experts per layer: step s expert e must not reuse the
// stream of any other (step, expert). (The default tiny config trains 300 steps.)
TEST(SrStreams, StepsAndExpertsGetDistinctStreams) {
  std::vector<Key> keys;
  for (uint64_t step = 0; step < 2048; ++step)
    for (int64_t expert = 0; expert < 8; ++expert)
      keys.emplace_back(step, 0, "layers.1.moe.w2/wgrad/dY^T[" + std::to_string(expert) + "]");
  expect_distinct(keys, "step x expert");
}

TEST(SrStreams, StepsAndMicroBatchesGetDistinctStreams) {
  std::vector<Key> keys;
  for (uint64_t step = 0; step < 1024; ++step)
    for (uint64_t micro = 0; micro < 8; ++micro) keys.emplace_back(step, micro, "layers.2.moe.w13/fprop/X");
  expect_distinct(keys, "step x micro-batch");
}

// One training step (forward + backward) of a 4-layer model (layer 0 dense, 1-3 MoE with a shared
// expert, the last in the recipe's tail where it has one) under every recipe, every quantization
// call recorded. A stream may serve two calls only when they are one point quantizing the same
// input with the same spec again (the backward's recomputation of the FFN's activation and of the
// router's input); any other sharing is a collision.
TEST(SrStreams, EveryQuantizationPointOfEveryRecipeDrawsItsOwnStream) {
  const OmpThreads one_thread(1);
  for (const std::string& recipe : recipe_names()) {
    SCOPED_TRACE(recipe);
    const ModelConfig c = tiny_moe_config(4, 32);
    Model m(c, recipe_by_name(recipe), Device::CPU);
    init_params(m.params(), c, 3);
    m.quant_log().record_calls = true;
    const Tensor tokens = random_tokens(2, 8, 5);
    m.forward(tokens, shifted_targets(tokens, 258), SrStreams{9, 4, 1}, true);
    m.backward();
    const std::vector<QuantLog::Call>& calls = m.quant_log().calls;
    std::map<Stream, const QuantLog::Call*> by_stream;
    std::set<std::string> names;
    int collisions = 0, recomputed = 0, per_expert = 0;
    for (const QuantLog::Call& call : calls) {
      names.insert(call.site);
      per_expert += call.site.find('[') != std::string::npos;
      auto [it, inserted] = by_stream.emplace(stream_of(call.key), &call);
      if (inserted) continue;
      const QuantLog::Call& first = *it->second;
      if (first.site == call.site && first.spec == call.spec && first.input_hash == call.input_hash) {
        ++recomputed;
        continue;
      }
      if (collisions++ < 5)
        ADD_FAILURE() << "'" << first.site << "' (" << first.spec << ") and '" << call.site << "' (" << call.spec
                      << ") draw the same SR stream";
    }
    EXPECT_EQ(collisions, 0) << collisions << " of " << calls.size() << " calls share a stream";
    // Names are a function of the point: one name, one stream.
    std::map<std::string, Stream> stream_of_name;
    for (const QuantLog::Call& call : calls) {
      auto [it, inserted] = stream_of_name.emplace(call.site, stream_of(call.key));
      EXPECT_EQ(it->second, stream_of(call.key)) << call.site;
    }
    // Every recipe quantizes or converts every operand of every GEMM: the log sees the model's
    // points, the experts' token ranges one by one (3 MoE layers x 4 experts x at least the three
    // dY^T operands, less experts that received no token).
    EXPECT_GT(names.size(), 100u);
    EXPECT_GE(per_expert, 3 * 3 * 3);
    std::printf("[ SR streams %s ] %zu calls, %zu distinct points, %d recomputations\n", recipe.c_str(),
                calls.size(), names.size(), recomputed);
  }
}
