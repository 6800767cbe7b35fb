// defines: tests of Model::forward's per-token loss weights (what SFT masks and RL advantages
//          use): all-ones weights give the unweighted run's loss and gradient bits; weights of 2
//          and of -1 scale the gradient exactly (fp32 recipe, no load-balance loss, so the
//          gradient is linear in them); the reported loss is sum(w * CE) / tokens over the
//          returned per-token losses; bad weights are refused; Model::forward_queued (the loss
//          read back after the backward is queued) gives forward()'s bits.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/tensor/device_memory.h"
#include "model/model_test_util.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using fourbit::testutil::error_of;

namespace {

struct Pass {
  ForwardStats st;
  std::vector<float> grad;
};

Pass run(const ModelConfig& c, const std::string& recipe, const Tensor& tokens, const Tensor& targets,
         const Tensor& weights) {
  Model m(c, recipe_by_name(recipe), Device::CPU);
  init_params(m.params(), c, 3);
  m.params().zero_grad();
  Pass p;
  p.st = m.forward(tokens, targets, SrStreams{9, 0, 0}, true, 1.0f, weights);
  m.backward();
  const Tensor& g = m.params().flat_grad();
  p.grad.assign(g.data<float>(), g.data<float>() + g.numel());
  return p;
}

Tensor filled(int64_t B, int64_t T, float v) {
  std::vector<float> w(size_t(B * T), v);
  return Tensor::from_host(w.data(), {B, T}, DType::F32);
}

}  // namespace

TEST(TokenWeights, OnesAreTheUnweightedBitsAndScalingIsExact) {
  const OmpThreads one_thread(1);
  ModelConfig c = tiny_moe_config();
  const Tensor tokens = random_tokens(2, 12, 4);
  Tensor targets = shifted_targets(tokens, 258);
  targets.data<int32_t>()[3] = -1;
  for (const char* recipe : {"nvfp4-fwd", "mxfp8"}) {
    const Pass plain = run(c, recipe, tokens, targets, Tensor());
    const Pass ones = run(c, recipe, tokens, targets, filled(2, 12, 1.0f));
    EXPECT_EQ(plain.st.loss, ones.st.loss) << recipe;
    EXPECT_EQ(std::memcmp(plain.grad.data(), ones.grad.data(), plain.grad.size() * 4), 0) << recipe << ": gradients differ";
  }
  // Linear in the weights when nothing else is (fp32 GEMMs, aux loss off): exact factors 2, -1.
  c.aux_loss_coef = 0;
  const Pass base = run(c, "fp32", tokens, targets, Tensor());
  const Pass twice = run(c, "fp32", tokens, targets, filled(2, 12, 2.0f));
  const Pass neg = run(c, "fp32", tokens, targets, filled(2, 12, -1.0f));
  size_t bad2 = 0, badn = 0;
  for (size_t i = 0; i < base.grad.size(); ++i) {
    bad2 += twice.grad[i] != 2.0f * base.grad[i];
    badn += neg.grad[i] != -base.grad[i];
  }
  EXPECT_EQ(bad2, 0u);
  EXPECT_EQ(badn, 0u);
  EXPECT_EQ(twice.st.loss, 2.0 * base.st.loss);
}

TEST(TokenWeights, LossIsTheWeightedMeanOfTheTokenLosses) {
  const OmpThreads one_thread(1);
  const ModelConfig c = tiny_moe_config();
  const Tensor tokens = random_tokens(2, 10, 5);
  Tensor targets = shifted_targets(tokens, 258);
  std::vector<float> w(20);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 5) - 2) * 0.5f;
  for (int i : {0, 1, 2, 10, 11}) targets.data<int32_t>()[i] = -1;  // prompts
  const Pass p = run(c, "nvfp4-fwd", tokens, targets, Tensor::from_host(w.data(), {2, 10}, DType::F32));
  ASSERT_EQ(p.st.tokens, 15);
  ASSERT_EQ(p.st.token_losses.numel(), 20);
  double sum = 0;
  for (int64_t i = 0; i < 20; ++i) {
    const float l = p.st.token_losses.data<float>()[i];
    if (targets.data<int32_t>()[i] < 0) EXPECT_EQ(l, 0.0f);
    else EXPECT_GT(l, 0.0f);
    sum += double(w[size_t(i)]) * double(l);
  }
  EXPECT_DOUBLE_EQ(p.st.loss, sum / 15.0);
  Model m(c, recipe_by_name("nvfp4-fwd"), Device::CPU);
  EXPECT_NE(error_of([&] { m.forward(tokens, targets, SrStreams{}, false, 1.0f, filled(2, 9, 1.0f)); })
                .find("token weights must be f32 [2, 10]"),
            std::string::npos);
}

// Model::forward_queued, the trainer's order (the backward queued, then the loss read back): the
// same loss, load-balance loss, token count and gradient bits as forward() then backward(), with
// and without token weights, on the CPU and, where there is one, on the GPU (where the read-back
// is what moves). stats() is summed once.
TEST(QueuedForward, BackwardBeforeTheLossReadGivesTheSameBits) {
  const OmpThreads one_thread(1);
  const ModelConfig c = tiny_moe_config(3);
  const Tensor tokens = random_tokens(2, 12, 6);
  Tensor targets = shifted_targets(tokens, 258);
  targets.data<int32_t>()[5] = -1;
  std::vector<float> w(24);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 7) - 3) * 0.25f;
  const Tensor weights = Tensor::from_host(w.data(), {2, 12}, DType::F32);
  std::vector<Device> devices{Device::CPU};
  if (cuda_device_count() > 0) devices.push_back(Device::CUDA);
  for (const Device dev : devices)
    for (const char* recipe : {"bf16", "nvfp4-fwd"})
      for (const bool weighted : {false, true}) {
        const std::string at = std::string(device_name(dev)) + " " + recipe + (weighted ? " weighted" : "");
        const Tensor tw = weighted ? weights.to(dev) : Tensor();
        auto grads = [](Model& m) {
          const Tensor g = m.params().flat_grad().to(Device::CPU);
          return std::vector<float>(g.data<float>(), g.data<float>() + g.numel());
        };
        Model a(c, recipe_by_name(recipe), dev), b(c, recipe_by_name(recipe), dev);
        init_params(a.params(), c, 3);
        init_params(b.params(), c, 3);
        a.params().zero_grad();
        b.params().zero_grad();
        const ForwardStats sa = a.forward(tokens.to(dev), targets.to(dev), SrStreams{9, 1, 0}, true, 0.5f, tw);
        a.backward();
        PendingForwardStats pending = b.forward_queued(tokens.to(dev), targets.to(dev), SrStreams{9, 1, 0}, true, 0.5f, tw);
        b.backward();
        const ForwardStats& sb = pending.stats();
        EXPECT_EQ(sa.loss, sb.loss) << at;
        EXPECT_EQ(sa.aux_loss, sb.aux_loss) << at;
        EXPECT_EQ(sa.tokens, sb.tokens) << at;
        EXPECT_GT(sb.aux_loss, 0.0) << at;
        EXPECT_EQ(&pending.stats(), &sb) << at;
        EXPECT_EQ(pending.stats().loss, sa.loss) << at;
        const std::vector<float> ga = grads(a), gb = grads(b);
        ASSERT_EQ(ga.size(), gb.size());
        EXPECT_EQ(std::memcmp(ga.data(), gb.data(), ga.size() * 4), 0) << at << ": gradients differ";
      }
}
