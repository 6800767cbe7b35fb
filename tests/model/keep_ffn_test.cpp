// defines: tests of Model::set_keep_ffn_activations (train.keep_ffn_activations): keeping the FFNs'
//          interiors from forward to backward gives the bits of recomputing them — loss,
//          load-balance loss and every gradient — for every recipe, on the CPU and (when there is
//          one) the GPU, and keeps exactly the h1, h3, a (and routed experts' output) bytes more, and
//          w2's X^T where the forward makes it with X.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

struct Pass {
  ForwardStats st;
  std::vector<float> grad;
  SavedBytes saved;
};

Pass run(const ModelConfig& c, const std::string& recipe, Device dev, bool keep, const Tensor& tokens,
         const Tensor& targets) {
  Model m(c, recipe_by_name(recipe), dev);
  m.set_keep_ffn_activations(keep);
  init_params(m.params(), c, 3);
  m.params().zero_grad();
  Pass p;
  // SR streams of step 5: the recipes that round stochastically draw the same bits both times
  p.st = m.forward(tokens.to(dev), targets.to(dev), SrStreams{9, 5, 0}, true);
  m.backward();
  const Tensor g = m.params().flat_grad().to(Device::CPU);
  p.grad.assign(g.data<float>(), g.data<float>() + g.numel());
  p.saved = m.saved_bytes();
  return p;
}

void expect_same(const ModelConfig& c, Device dev) {
  const Tensor tokens = random_tokens(2, 12, 4);
  const Tensor targets = shifted_targets(tokens, 258);
  const int64_t N = 2 * 12, F = c.d_expert, Fs = c.shared_hidden(), Fd = c.dense_hidden();
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    // Kept: h1, h3 (FP32) and a of each dense FFN [N, Fd] and shared expert [N, Fs]; h1, h3, a
    // [N k, F] and the routed output [N k, D] (FP32) of each MoE layer. a is BF16 in the layers
    // whose GEMMs read it as BF16 (its producer writes the operand), else FP32.
    const Recipe& rec = recipe_by_name(recipe);
    int64_t extra_dense = 0, extra_expert = 0;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      const bool moe = c.is_moe_layer(l);
      const LayerClass cls = moe ? LayerClass::Expert : LayerClass::Dense;
      const int64_t a_bytes = rec.layer(cls, l, c.n_layers).fprop.a.fmt == Format::BF16 ? 2 : 4;
      if (moe)
        extra_expert += N * Fs * (2 * 4 + a_bytes) + N * c.top_k * F * (2 * 4 + a_bytes) + N * c.top_k * c.d_model * 4;
      else
        extra_dense += N * Fd * (2 * 4 + a_bytes);
    }
    const Pass recompute = run(c, recipe, dev, false, tokens, targets);
    const Pass keep = run(c, recipe, dev, true, tokens, targets);
    EXPECT_EQ(recompute.st.loss, keep.st.loss);
    EXPECT_EQ(recompute.st.aux_loss, keep.st.aux_loss);
    ASSERT_EQ(recompute.grad.size(), keep.grad.size());
    EXPECT_EQ(std::memcmp(recompute.grad.data(), keep.grad.data(), keep.grad.size() * 4), 0) << "gradients differ";
    auto at = [](const SavedBytes& s, const char* k) {
      const auto it = s.by_category.find(k);
      return it == s.by_category.end() ? int64_t(0) : it->second;
    };
    EXPECT_EQ(at(keep.saved, "dense") - at(recompute.saved, "dense"), extra_dense);
    EXPECT_EQ(at(keep.saved, "expert") - at(recompute.saved, "expert"), extra_expert);
    // Where w2's X and X^T pair (MXFP8 both, X^T not from the saved X), the forward also keeps
    // X^T: per expert [F, its tokens padded to 32] codes and one scale per 32.
    int64_t a_wgrad_max = 0;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      if (!c.is_moe_layer(l)) continue;
      const LayerRecipe& r = rec.layer(LayerClass::Expert, l, c.n_layers);
      const bool pairs = !r.requant_saved_sr && ops::row_col_one_pass(r.fprop.a, r.wgrad.b);
      if (pairs) a_wgrad_max += F * (N * c.top_k + 31 * c.n_experts) * 33 / 32;
    }
    const int64_t a_wgrad = at(keep.saved, "expert_wgrad");
    EXPECT_EQ(at(recompute.saved, "expert_wgrad"), 0);
    EXPECT_EQ(a_wgrad > 0, a_wgrad_max > 0);
    EXPECT_LE(a_wgrad, a_wgrad_max);
    EXPECT_EQ(keep.saved.total() - recompute.saved.total(), extra_dense + extra_expert + a_wgrad);
  }
}

}  // namespace

TEST(KeepFfnActivations, SameBitsAsRecomputingOnTheCpu) {
  const OmpThreads threads(2);
  expect_same(tiny_moe_config(), Device::CPU);
}

TEST(CudaKeepFfnActivations, SameBitsAsRecomputing) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_same(tiny_moe_config(3, 64), Device::CUDA);
}
