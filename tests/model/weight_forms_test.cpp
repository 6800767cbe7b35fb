// defines: tests of the MXFP8 weight operands that the optimizer makes in its update
//          (Optimizer::write_weight_forms, Model::weight_forms_ahead and
//          invalidate_weight_cache's forms): after each step every entry holds quantize_both's
//          decodes of its updated weight; training with them gives the losses and weights of
//          training that quantizes the weights at the forward, bit for bit; the forward does take
//          them; which weights have entries (the GPU's MXFP8 weights alone); targets and handed
//          operands of the wrong kind are refused.
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

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
}

// Every entry of the optimizer's last operands against quantize_both of its updated weight.
void expect_entries_are_the_weights_forms(Model& m, const Optimizer& optim, const std::string& what) {
  const WeightFormsAhead* made = optim.written_weight_forms();
  ASSERT_NE(made, nullptr) << what;
  const std::vector<ParamInfo>& infos = m.params().infos();
  int checked = 0;
  for (size_t i = 0; i < infos.size(); ++i) {
    if (made->at[i] < 0) continue;
    const WeightFormsAhead::Entry& e = made->entries[size_t(made->at[i])];
    const Tensor w = m.params().view(m.params().flat(), infos[i]);
    const ops::BothAxes want =
        ops::quantize_both(w, e.row_spec, {}, e.col_spec, {}, ops::FormOut::Bf16, ops::FormOut::Bf16);
    EXPECT_TRUE(same_bytes(e.forms.row.bf16, want.row.bf16)) << infos[i].name << " fprop, " << what;
    EXPECT_TRUE(same_bytes(e.forms.col.bf16, want.col.bf16)) << infos[i].name << " dgrad, " << what;
    EXPECT_FALSE(e.forms.row.codes.defined()) << "the decodes alone";
    ++checked;
  }
  EXPECT_GT(checked, 0) << what;
}

struct Trained {
  std::vector<double> losses;
  Tensor weights;  // on the CPU
};

// Three steps of `recipe` on the GPU; with `ahead`, the optimizer makes the MXFP8 weights'
// operands and the model takes them, and each step checks them against quantize_both.
Trained train(const std::string& recipe, bool ahead) {
  const ModelConfig c = tiny_moe_config(kLayers);
  TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 1;
  t.steps = 3;
  Model m(c, recipe_by_name(recipe), Device::CUDA);
  init_params(m.params(), c, 13);
  Optimizer optim(m.params(), t);
  optim.write_slice_amax(m.slice_amax_ahead());  // as the trainer does
  if (ahead) optim.write_weight_forms(m.weight_forms_ahead());
  Trained out;
  out.losses = optimizer_steps(m, optim, Device::CUDA, 3, 30, 5, [&](int64_t step) {
    EXPECT_EQ(optim.written_weight_forms() != nullptr, ahead);
    if (ahead) expect_entries_are_the_weights_forms(m, optim, "step " + std::to_string(step));
  });
  out.weights = m.params().flat().to(Device::CPU);
  return out;
}

}  // namespace

// mxfp8: every linear but the router and the LM head; nvfp4-fwd: attention, the dense FFN and the
// tail's experts.
TEST(CudaWeightForms, OptimizerMadeOperandsTrainAsThePass) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* recipe : {"mxfp8", "nvfp4-fwd"}) {
    SCOPED_TRACE(recipe);
    const Trained passed = train(recipe, false), ahead = train(recipe, true);
    ASSERT_EQ(passed.losses.size(), ahead.losses.size());
    for (size_t i = 0; i < ahead.losses.size(); ++i) EXPECT_EQ(ahead.losses[i], passed.losses[i]) << "step " << i;
    EXPECT_TRUE(same_bytes(ahead.weights, passed.weights));
  }
}

// After an update, the training forward's weight cache holds the optimizer's operands themselves
// (the same storage), and other values there give another loss; a cache invalidated without them
// quantizes the weights again.
TEST(CudaWeightForms, TheForwardTakesThem) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = tiny_moe_config(kLayers);
  Model m(c, recipe_by_name("mxfp8"), Device::CUDA);
  init_params(m.params(), c, 17);
  Optimizer optim(m.params(), TrainConfig{});
  optim.write_weight_forms(m.weight_forms_ahead());
  const Tensor tokens = random_tokens(2, 12, 40);
  const Tensor tok = tokens.to(Device::CUDA), tgt = shifted_targets(tokens, 258).to(Device::CUDA);
  m.params().zero_grad();
  (void)m.forward(tok, tgt, SrStreams{5, 0, 0}, true, 1.0f);
  m.backward();
  optim.step(0);
  const WeightFormsAhead* made = optim.written_weight_forms();
  ASSERT_NE(made, nullptr);
  const ParamStore& ps = m.params();
  const std::string name = "layers.1.moe.w2";
  const WeightFormsAhead::Entry& e = made->entries[size_t(made->at[ps.param_index(m.linear(name).weight)])];

  m.invalidate_weight_cache(false, false, made);
  const double taken = m.forward(tok, tgt, SrStreams{5, 1, 0}, true, 1.0f).loss;
  EXPECT_EQ(m.weight_cache().at(name + "/fprop").q.bf16.raw(), e.forms.row.bf16.raw());
  EXPECT_EQ(m.weight_cache().at(name + "/dgrad").q.bf16.raw(), e.forms.col.bf16.raw());
  m.invalidate_weight_cache();
  const double passed = m.forward(tok, tgt, SrStreams{5, 1, 0}, true, 1.0f).loss;
  EXPECT_NE(m.weight_cache().at(name + "/fprop").q.bf16.raw(), e.forms.row.bf16.raw());
  EXPECT_EQ(taken, passed);

  WeightFormsAhead changed = *made;  // its operands' storage
  Tensor decodes = changed.entries[size_t(made->at[ps.param_index(m.linear(name).weight)])].forms.row.bf16;
  ops::fill_(decodes, 0.0);
  m.invalidate_weight_cache(false, false, &changed);
  const double zeroed = m.forward(tok, tgt, SrStreams{5, 1, 0}, true, 1.0f).loss;
  EXPECT_NE(zeroed, passed) << "the forward read the handed operand";
}

TEST(CudaWeightForms, OnlyForTheGpusMxfp8Weights) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* none : {"fp32", "bf16", "nvidia-nvfp4"}) {
    Model m(tiny_moe_config(kLayers), recipe_by_name(none), Device::CUDA);
    EXPECT_FALSE(m.weight_forms_ahead().defined()) << none;
  }
  const ModelConfig c = tiny_moe_config(kLayers);
  for (const char* recipe : {"mxfp8", "nvfp4-fwd"}) {
    SCOPED_TRACE(recipe);
    Model m(c, recipe_by_name(recipe), Device::CUDA);
    const WeightFormsAhead& f = m.weight_forms_ahead();
    ASSERT_TRUE(f.defined());
    EXPECT_EQ(&m.weight_forms_ahead(), &f) << "made once";
    const auto at = [&](const std::string& name) { return f.at[m.params().param_index(m.linear(name).weight)]; };
    const bool body_experts = std::string(recipe) == "mxfp8";  // nvfp4-fwd's body: NVFP4 forward
    for (const char* name : {"layers.1.attn.wq", "layers.2.attn.wo", "layers.0.mlp.w1", "layers.0.mlp.w2",
                             "layers.3.moe.w1", "layers.3.moe.w3", "layers.3.moe.shared.w2"})
      EXPECT_GE(at(name), 0) << name;
    for (const char* name : {"layers.1.moe.w1", "layers.2.moe.w2", "layers.1.moe.shared.w3"})
      EXPECT_EQ(at(name) >= 0, body_experts) << name;
    for (const char* name : {"layers.1.moe.router", "lm_head"}) EXPECT_LT(at(name), 0) << name;
    const WeightFormsAhead::Entry& e = f.entries[size_t(at("layers.1.attn.wq"))];
    EXPECT_EQ(e.row_spec.fmt, Format::MXFP8_E4M3);
    EXPECT_EQ(e.row_spec.axis, BlockAxis::Row);
    EXPECT_EQ(e.col_spec.axis, BlockAxis::Col);
  }
}

// The CPU makes no weight operand ahead (its training step quantizes each as it goes), and both
// ends refuse entries of the wrong kind.
TEST(WeightForms, NoneOnTheCpuAndWrongEntriesRefused) {
  const ModelConfig c = tiny_moe_config(kLayers);
  for (const char* recipe : {"bf16", "mxfp8", "nvfp4-fwd"}) {
    Model m(c, recipe_by_name(recipe), Device::CPU);
    EXPECT_FALSE(m.weight_forms_ahead().defined()) << recipe;
  }
  Model m(c, recipe_by_name("mxfp8"), Device::CPU);
  Optimizer optim(m.params(), TrainConfig{});
  const size_t n = m.params().infos().size();
  WeightFormsAhead wrong;
  wrong.at.assign(n - 1, -1);
  wrong.entries.resize(1);
  EXPECT_THROW(optim.write_weight_forms(wrong), Error) << "an index a parameter";
  wrong.at.assign(n, -1);
  wrong.at[2] = 1;
  EXPECT_THROW(optim.write_weight_forms(wrong), Error) << "an entry past the list";
  wrong.at[2] = 0;
  optim.write_weight_forms(wrong);
  EXPECT_EQ(optim.written_weight_forms(), nullptr) << "nothing written before a step";
  EXPECT_THROW(m.invalidate_weight_cache(false, false, &wrong), Error) << "not the model's entries";
  m.invalidate_weight_cache(false, false, nullptr);
}
