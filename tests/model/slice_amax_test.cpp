// defines: tests of the NVFP4 weights' outer-scale amax that the optimizer raises in its update
//          (Optimizer::write_slice_amax, Model::slice_amax_ahead and
//          invalidate_weight_cache(.., true)): after each step every entry is the amax that a pass
//          over its weights gives (ops::outer_amax, an FFN's w1 and w3 together), training with
//          them gives the losses and weights of training that passes over the weights, bit for
//          bit, on the CPU and (when there is one) the GPU; the forward does take them; which
//          weights have entries; a target of the wrong kind is refused.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/optimizer.h"
#include "model/model_test_util.h"
#include "model/optimizer_steps.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

constexpr int64_t kLayers = 4;  // a dense layer, two MoE layers in the recipe's body, one in its tail

const LinearInfo* find_linear(const std::vector<LinearInfo>& ls, const std::string& name) {
  for (const LinearInfo& li : ls)
    if (li.name == name) return &li;
  return nullptr;
}

// Every entry of m's slice_amax_ahead() against ops::outer_amax of its weights (with the FFN
// partner whose entries it shares) under the fprop weight spec.
void expect_entries_are_the_weights_amax(Model& m, const std::string& what) {
  const SliceAmaxAhead& a = m.slice_amax_ahead();
  const std::vector<ParamInfo>& infos = m.params().infos();
  const std::vector<LinearInfo> ls = m.linears();
  const Tensor got = a.buffer.to(Device::CPU);
  int checked = 0;
  for (const LinearInfo& li : ls) {
    const size_t i = m.params().param_index(li.weight);
    if (a.at[i] < 0) continue;
    std::vector<Tensor> group = {li.weight};
    const std::string stem = li.name.substr(0, li.name.size() - 1);
    if (li.name.ends_with(".w1") || li.name.ends_with(".w3"))
      group.push_back(find_linear(ls, stem + (li.name.ends_with(".w1") ? "3" : "1"))->weight);
    QuantSpec spec = m.recipe().layer(li.cls, li.layer, m.config().n_layers).fprop.b;
    const Tensor want = ops::outer_amax(group, spec).to(Device::CPU);
    const int64_t g = infos[i].numel() / a.slice[i];
    ASSERT_EQ(want.numel(), g) << li.name;
    EXPECT_EQ(0, std::memcmp(got.data<float>() + a.at[i], want.raw(), size_t(want.nbytes()))) << li.name << " " << what;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

struct Trained {
  std::vector<double> losses;
  Tensor weights;  // on the CPU
};

// Three steps of `recipe` on `dev`; with `ahead`, the optimizer raises the weights' amax and the
// model takes them, and each step checks them against a pass over the weights.
Trained train(const std::string& recipe, Device dev, bool ahead) {
  const ModelConfig c = tiny_moe_config(kLayers);
  TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 1;
  t.steps = 3;
  Model m(c, recipe_by_name(recipe), dev);
  init_params(m.params(), c, 13);
  Optimizer optim(m.params(), t);
  if (ahead) optim.write_slice_amax(m.slice_amax_ahead());
  Trained out;
  out.losses = optimizer_steps(m, optim, dev, 3, 30, 5, [&](int64_t step) {
    EXPECT_EQ(optim.wrote_slice_amax(), ahead);
    if (ahead) expect_entries_are_the_weights_amax(m, "step " + std::to_string(step));
  });
  out.weights = m.params().flat().to(Device::CPU);
  return out;
}

void expect_amax_ahead_changes_nothing(Device dev) {
  // nvfp4-fwd: the routed and shared experts' per-slice scales; nvidia-nvfp4: those and the
  // per-tensor scales of attention and the dense FFN
  for (const char* recipe : {"nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    const Trained passed = train(recipe, dev, false), ahead = train(recipe, dev, true);
    ASSERT_EQ(passed.losses.size(), ahead.losses.size());
    for (size_t i = 0; i < ahead.losses.size(); ++i) EXPECT_EQ(ahead.losses[i], passed.losses[i]) << "step " << i;
    EXPECT_EQ(0, std::memcmp(ahead.weights.raw(), passed.weights.raw(), size_t(ahead.weights.nbytes())));
  }
}

// After an update that raised the amax, the forward's NVFP4 weights take them: other values in
// the buffer give other outer scales, and a cache made without them (invalidate_weight_cache
// without the flag) the pass's again.
void expect_forward_takes_them(Device dev) {
  const ModelConfig c = tiny_moe_config(kLayers);
  Model m(c, recipe_by_name("nvfp4-fwd"), dev);
  init_params(m.params(), c, 17);
  Optimizer optim(m.params(), TrainConfig{});
  optim.write_slice_amax(m.slice_amax_ahead());
  m.params().zero_grad();
  const Tensor tokens = random_tokens(2, 12, 40);
  (void)m.forward(tokens.to(dev), shifted_targets(tokens, 258).to(dev), SrStreams{5, 0, 0}, true, 1.0f);
  m.backward();
  optim.step(0);
  ASSERT_TRUE(optim.wrote_slice_amax());
  Tensor buffer = m.slice_amax_ahead().buffer;
  const Tensor raised = buffer.clone();
  // the routed experts' w2 (its own entries) and w1 (its pair's), the shared expert's w1
  for (const std::string name : {"layers.1.moe.w2", "layers.1.moe.w1", "layers.2.moe.shared.w1"}) {
    SCOPED_TRACE(name);
    buffer.copy_from(raised);
    m.invalidate_weight_cache(false, true);
    const Tensor taken = m.forward_weight(name).q.outer_scales.to(Device::CPU);
    m.invalidate_weight_cache();
    const Tensor passed = m.forward_weight(name).q.outer_scales.to(Device::CPU);
    EXPECT_EQ(0, std::memcmp(taken.raw(), passed.raw(), size_t(passed.nbytes())));
    ops::scale_(buffer, 2.0);
    m.invalidate_weight_cache(false, true);
    const Tensor doubled = m.forward_weight(name).q.outer_scales.to(Device::CPU);
    ASSERT_EQ(doubled.numel(), passed.numel());
    for (int64_t e = 0; e < passed.numel(); ++e)
      EXPECT_NE(doubled.data<float>()[e], passed.data<float>()[e]) << "group " << e << ": the buffer's amax was taken";
  }
}

}  // namespace

TEST(SliceAmax, OptimizerRaisedAmaxTrainsAsThePassOnTheCpu) {
  const OmpThreads threads(1);
  expect_amax_ahead_changes_nothing(Device::CPU);
}

TEST(CudaSliceAmax, OptimizerRaisedAmaxTrainsAsThePass) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_amax_ahead_changes_nothing(Device::CUDA);
}

TEST(SliceAmax, TheForwardTakesThemOnTheCpu) {
  const OmpThreads threads(1);
  expect_forward_takes_them(Device::CPU);
}

TEST(CudaSliceAmax, TheForwardTakesThem) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_forward_takes_them(Device::CUDA);
}

TEST(SliceAmax, OnlyForNvfp4WeightsWithTensorOrSliceScales) {
  for (const char* none : {"fp32", "bf16", "mxfp8"}) {
    Model m(tiny_moe_config(kLayers), recipe_by_name(none), Device::CPU);
    EXPECT_FALSE(m.slice_amax_ahead().defined()) << none;
  }
  const ModelConfig c = tiny_moe_config(kLayers);
  Model m(c, recipe_by_name("nvfp4-fwd"), Device::CPU);
  const SliceAmaxAhead& a = m.slice_amax_ahead();
  ASSERT_TRUE(a.defined());
  EXPECT_EQ(&m.slice_amax_ahead(), &a) << "made once";
  const ParamStore& ps = m.params();
  const auto at = [&](const std::string& name) { return a.at[ps.param_index(m.linear(name).weight)]; };
  // the body's MoE layers (1, 2): the routed experts' w1 and w3 share one entry an expert, w2
  // has its own; the shared expert's w1 and w3 share one, w2 one; the tail (3), attention, the
  // dense layer (MXFP8), the routers and the LM head have none
  for (const int l : {1, 2}) {
    const std::string p = "layers." + std::to_string(l) + ".moe.";
    EXPECT_GE(at(p + "w1"), 0);
    EXPECT_EQ(at(p + "w1"), at(p + "w3"));
    EXPECT_NE(at(p + "w1"), at(p + "w2"));
    EXPECT_EQ(a.slice[ps.param_index(m.linear(p + "w2").weight)], c.d_model * c.d_expert) << "a slice an expert";
    EXPECT_EQ(at(p + "shared.w1"), at(p + "shared.w3"));
    EXPECT_GE(at(p + "shared.w2"), 0);
  }
  for (const char* none : {"layers.3.moe.w1", "layers.3.moe.w2", "layers.1.attn.wq", "layers.0.mlp.w1",
                           "layers.1.moe.router", "lm_head"})
    EXPECT_LT(at(none), 0) << none;
  EXPECT_EQ(a.buffer.numel(), 2 * (2 * c.n_experts + 2));

  Optimizer optim(m.params(), TrainConfig{});
  SliceAmaxAhead wrong = a;
  wrong.buffer = Tensor::zeros({a.buffer.numel()}, DType::BF16);
  EXPECT_THROW(optim.write_slice_amax(wrong), Error);
  wrong.buffer = Tensor::zeros({3}, DType::F32);
  EXPECT_THROW(optim.write_slice_amax(wrong), Error);
  wrong = a;
  wrong.slice[ps.param_index(m.linear("layers.1.moe.w2").weight)] = 7;
  EXPECT_THROW(optim.write_slice_amax(wrong), Error);
  wrong.slice.pop_back();
  EXPECT_THROW(optim.write_slice_amax(wrong), Error);
}
