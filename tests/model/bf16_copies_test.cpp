// defines: tests of the BF16 weight copies the optimizer writes in its update
//          (Optimizer::write_bf16_copies, Model::bf16_weight_copies and
//          invalidate_weight_cache(true)): after each step the copies are the bits of converting
//          the updated weights, and training with them gives the losses and weights of training
//          that converts the weights every forward, bit for bit, for the recipes with BF16
//          operands, on the CPU and (when there is one) the GPU; a recipe without BF16 forward
//          weights has no copies; a copy target of the wrong kind is refused.
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

struct Trained {
  std::vector<double> losses;
  Tensor weights;  // on the CPU
};

// Three steps of `recipe` on `dev`; with `copies`, the optimizer writes the BF16 weight copies
// and the model takes them, and each step checks them against converting the weights.
Trained train(const std::string& recipe, Device dev, bool copies) {
  const ModelConfig c = tiny_moe_config();
  TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 1;
  t.steps = 3;
  Model m(c, recipe_by_name(recipe), dev);
  init_params(m.params(), c, 11);
  Optimizer optim(m.params(), t);
  if (copies) optim.write_bf16_copies(m.bf16_weight_copies());
  Trained out;
  out.losses = optimizer_steps(m, optim, dev, 3, 20, 4, [&](int64_t step) {
    EXPECT_EQ(optim.wrote_bf16_copies(), copies);
    if (copies) {  // every copy: the bits of converting its updated parameter
      const Bf16Copies& cp = m.bf16_weight_copies();
      const std::vector<ParamInfo>& infos = m.params().infos();
      for (size_t i = 0; i < infos.size(); ++i) {
        if (cp.at[i] < 0) continue;
        Tensor want = Tensor::empty({infos[i].numel()}, DType::BF16, dev);
        ops::convert(m.params().flat().view(infos[i].offset, {infos[i].numel()}), want);
        const Tensor got = cp.buffer.view(cp.at[i], {infos[i].numel()}).to(Device::CPU), w = want.to(Device::CPU);
        EXPECT_EQ(0, std::memcmp(got.raw(), w.raw(), size_t(w.nbytes()))) << infos[i].name << " step " << step;
      }
    }
  });
  out.weights = m.params().flat().to(Device::CPU);
  return out;
}

void expect_copies_change_nothing(Device dev) {
  // bf16: every linear's weights; mxfp8: the (tied) LM head's, among parameters without copies
  for (const char* recipe : {"bf16", "mxfp8"}) {
    SCOPED_TRACE(recipe);
    const Trained converted = train(recipe, dev, false), copied = train(recipe, dev, true);
    ASSERT_EQ(converted.losses.size(), copied.losses.size());
    for (size_t i = 0; i < copied.losses.size(); ++i) EXPECT_EQ(copied.losses[i], converted.losses[i]) << "step " << i;
    EXPECT_EQ(0, std::memcmp(copied.weights.raw(), converted.weights.raw(), size_t(copied.weights.nbytes())));
  }
}

}  // namespace

TEST(Bf16Copies, OptimizerWrittenCopiesTrainAsConversionOnTheCpu) {
  const OmpThreads threads(2);
  expect_copies_change_nothing(Device::CPU);
}

TEST(CudaBf16Copies, OptimizerWrittenCopiesTrainAsConversion) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_copies_change_nothing(Device::CUDA);
}

TEST(Bf16Copies, OnlyForParametersOfLinearsWithBf16Weights) {
  Model fp32(tiny_moe_config(), recipe_by_name("fp32"), Device::CPU);
  EXPECT_FALSE(fp32.bf16_weight_copies().defined());
  Model bf16(tiny_moe_config(), recipe_by_name("bf16"), Device::CPU);
  const Bf16Copies& all = bf16.bf16_weight_copies();
  ASSERT_TRUE(all.defined());
  const std::vector<ParamInfo>& infos = bf16.params().infos();
  for (size_t i = 0; i < infos.size(); ++i) {  // norms are not linears; the router is FP32
    const bool none = infos[i].name.ends_with("norm") || infos[i].name.ends_with("router");
    EXPECT_EQ(all.at[i] >= 0, !none) << infos[i].name;
  }
  EXPECT_EQ(&bf16.bf16_weight_copies(), &all) << "made once";
  Model mx(tiny_moe_config(), recipe_by_name("mxfp8"), Device::CPU);
  const Bf16Copies& lm = mx.bf16_weight_copies();
  ASSERT_TRUE(lm.defined());
  EXPECT_EQ(lm.buffer.numel(), mx.params().info("embed").numel()) << "the tied LM head's only";
  Optimizer optim(bf16.params(), TrainConfig{});
  Bf16Copies wrong = all;
  wrong.buffer = Tensor::empty({all.buffer.numel()}, DType::F32);
  EXPECT_THROW(optim.write_bf16_copies(wrong), Error);
  wrong.buffer = Tensor::empty({3}, DType::BF16);
  EXPECT_THROW(optim.write_bf16_copies(wrong), Error);
  wrong.at.pop_back();
  EXPECT_THROW(optim.write_bf16_copies(wrong), Error);
}
