// defines: tests of what a benchmark reads of a forward's memory traffic: Model::set_routing_observer
//          (each MoE layer's routing, once a forward, in layer order, the sampler's forwards
//          included) and forward_weight_bytes (each linear's forward weight operand as stored, the
//          routed experts per expert).
#include <gtest/gtest.h>

#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/rl/sampler.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

struct Seen {
  int64_t layer, tokens;
  std::vector<int64_t> offsets;
};

}  // namespace

TEST(RoutingObserver, SeesEachMoeLayersRoutingOnceAForward) {
  const ModelConfig c = tiny_moe_config(3);  // layer 0 dense, layers 1 and 2 MoE
  Model m(c, recipe_by_name("mxfp8"), Device::CPU);
  init_params(m.params(), c, 5);
  std::vector<Seen> seen;
  m.set_routing_observer([&](const RoutingEvent& ev) { seen.push_back({ev.layer, ev.tokens, ev.offsets}); });
  const Tensor tokens = random_tokens(2, 12, 8);
  m.logits(tokens, SrStreams{});
  ASSERT_EQ(seen.size(), 2u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].layer, int64_t(i) + 1);
    EXPECT_EQ(seen[i].tokens, 24);
    ASSERT_EQ(seen[i].offsets.size(), size_t(c.n_experts + 1));
    EXPECT_EQ(seen[i].offsets.front(), 0);
    EXPECT_EQ(seen[i].offsets.back(), 24 * c.top_k);
    for (size_t e = 0; e + 1 < seen[i].offsets.size(); ++e) EXPECT_LE(seen[i].offsets[e], seen[i].offsets[e + 1]);
  }
  // The training forward routes the same tokens to the same experts (the same router bits).
  const std::vector<Seen> inference = seen;
  seen.clear();
  m.forward(tokens, shifted_targets(tokens, 258), SrStreams{}, true);
  ASSERT_EQ(seen.size(), inference.size());
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i].offsets, inference[i].offsets) << "layer " << seen[i].layer;
  m.backward();
  // Off again: nothing is called.
  seen.clear();
  m.set_routing_observer({});
  m.logits(tokens, SrStreams{});
  EXPECT_TRUE(seen.empty());
}

TEST(RoutingObserver, SeesThePrefillAndEveryDecodeStepOfTheSampler) {
  const ModelConfig c = tiny_moe_config(3);
  Model m(c, recipe_by_name("nvfp4-fwd"), Device::CPU);
  init_params(m.params(), c, 6);
  std::vector<Seen> seen;
  m.set_routing_observer([&](const RoutingEvent& ev) { seen.push_back({ev.layer, ev.tokens, ev.offsets}); });
  rl::Sampler sampler(m);
  std::vector<rl::SampleRequest> reqs(3);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].sequence_id = i;
    reqs[i].prompt = {int32_t(10 + i), 20, 30, 40};
  }
  rl::SamplingOptions opt;
  opt.temperature = 1.0;
  opt.stop_token = -1;
  opt.max_new = 5;
  sampler.sample(reqs, opt);
  const int64_t steps = sampler.stats().decode_forwards;
  EXPECT_EQ(steps, 4);  // one token from the prefill, four from decode steps
  ASSERT_EQ(int64_t(seen.size()), 2 * (1 + steps));
  // the prefill: three prompts of four tokens; then one token of each sequence a step
  EXPECT_EQ(seen[0].tokens, 12);
  EXPECT_EQ(seen[1].tokens, 12);
  for (size_t i = 2; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].layer, int64_t(i % 2) + 1);
    EXPECT_EQ(seen[i].tokens, 3);
    EXPECT_EQ(seen[i].offsets.back(), 3 * c.top_k);
  }
}

TEST(ForwardWeightBytes, CountsEveryWeightAsTheForwardStoresIt) {
  const ModelConfig c = tiny_moe_config(3);
  const int64_t E = c.n_experts, D = c.d_model, F = c.d_expert;
  // bf16: every linear's operand is its BF16 or F32 matrix, two or four bytes an element.
  {
    Model m(c, recipe_by_name("bf16"), Device::CPU);
    init_params(m.params(), c, 7);
    const ForwardWeightBytes b = forward_weight_bytes(m);
    int64_t other = 0;
    for (const LinearInfo& li : m.linears()) {
      const Format f = m.recipe().layer(li.cls, li.layer, c.n_layers).fprop.b.fmt;
      ASSERT_TRUE(f == Format::BF16 || f == Format::F32) << li.name;
      if (li.weight.dim() == 3) {
        EXPECT_EQ(f, Format::BF16) << li.name;
        continue;
      }
      other += li.weight.numel() * (f == Format::BF16 ? 2 : 4);
    }
    EXPECT_EQ(b.other, other);
    ASSERT_EQ(b.expert_by_layer.size(), 2u);
    for (const auto& [layer, bytes] : b.expert_by_layer) {
      EXPECT_TRUE(c.is_moe_layer(layer));
      EXPECT_EQ(bytes, 3 * D * F * 2) << "layer " << layer;  // w1, w3 [F, D] and w2 [D, F]
    }
    EXPECT_EQ(b.experts_total(), 2 * 3 * D * F * 2);
  }
  // nvfp4-fwd: a routed expert's three matrices as NVFP4 (half a byte a code, an E4M3 scale a block
  // of 16, and the outer scales: four bytes each, at most one a row), and in the recipe's last
  // layers as MXFP8 (a byte a code, a UE8M0 scale a block of 32).
  {
    Model m(c, recipe_by_name("nvfp4-fwd"), Device::CPU);
    init_params(m.params(), c, 7);
    const ForwardWeightBytes b = forward_weight_bytes(m);
    std::vector<Format> seen;
    for (const auto& [layer, bytes] : b.expert_by_layer) {
      const Format f = m.recipe().layer(LayerClass::Expert, layer, c.n_layers).fprop.b.fmt;
      seen.push_back(f);
      if (f == Format::NVFP4) {
        const int64_t packed = 3 * (D * F / 2 + D * F / 16);
        EXPECT_GT(bytes, packed) << "layer " << layer;
        EXPECT_LE(bytes, packed + 4 * (F + F + D)) << "layer " << layer;
      } else {
        EXPECT_EQ(f, Format::MXFP8_E4M3) << "layer " << layer;
        EXPECT_EQ(bytes, 3 * (D * F + D * F / 32)) << "layer " << layer;
      }
    }
    EXPECT_EQ(seen, (std::vector<Format>{Format::NVFP4, Format::MXFP8_E4M3}));  // layer 2 is the last sixth
    // everything together is what the forward's cache holds for the fprop weights
    int64_t cached = 0;
    for (const LinearInfo& li : m.linears()) cached += m.forward_weight(li.name).bytes();
    EXPECT_EQ(b.other + E * b.experts_total(), cached);
  }
}
