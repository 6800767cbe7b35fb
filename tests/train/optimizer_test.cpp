// defines: tests of Optimizer::step's gate (ops::grad_norm_gate): the norm it returns is
//          grad_norm()'s, and a step whose gradient norm is not finite, or after a quantizer met
//          NaN/Inf, changes no parameter, moment or BF16 copy (the trainer then stops with the
//          weights of the step before), on the CPU and (when there is one) the GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/train/optimizer.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
}

// One forward and backward of the bf16 recipe (its optimizer writes BF16 weight copies).
void backward_once(Model& m, Device dev, uint64_t seed) {
  m.params().zero_grad();
  const Tensor tokens = random_tokens(2, 12, seed);
  m.forward(tokens.to(dev), shifted_targets(tokens, 258).to(dev), SrStreams{4, seed, 0}, true, 1.0f);
  m.backward();
}

void expect_gated_steps(Device dev) {
  const ModelConfig c = tiny_moe_config();
  TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 1;
  t.grad_clip = 0.01;  // clips: the clip factor comes from the gate too
  Model m(c, recipe_by_name("bf16"), dev);
  init_params(m.params(), c, 11);
  Optimizer optim(m.params(), t);
  optim.write_bf16_copies(m.bf16_weight_copies());
  ops::nonfinite_seen(true);

  // A clean step: the norm is grad_norm()'s, and the weights move.
  backward_once(m, dev, 1);
  const double want = optim.grad_norm();
  ASSERT_GT(want, t.grad_clip);
  const Tensor w0 = m.params().flat().clone();
  EXPECT_EQ(optim.step(0), want);
  EXPECT_FALSE(optim.quantizer_nonfinite());
  EXPECT_TRUE(optim.wrote_bf16_copies());
  EXPECT_FALSE(same_bytes(w0, m.params().flat()));
  m.invalidate_weight_cache(optim.wrote_bf16_copies());

  // What a skipped step must leave as it was.
  auto snapshot = [&] {
    return std::vector<Tensor>{m.params().flat().clone(), optim.m().clone(), optim.v().clone(),
                               m.bf16_weight_copies().buffer.clone()};
  };
  auto expect_unchanged = [&](const std::vector<Tensor>& before, const std::string& what) {
    const char* names[] = {"parameters", "first moments", "second moments", "BF16 copies"};
    const std::vector<Tensor> after = snapshot();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(same_bytes(before[i], after[i])) << what << ": " << names[i];
  };

  // A NaN in one gradient: a NaN norm, nothing updated.
  backward_once(m, dev, 2);
  const float nan = std::nanf("");
  copy_bytes(m.params().flat_grad().raw(), dev, &nan, Device::CPU, sizeof nan);
  std::vector<Tensor> before = snapshot();
  EXPECT_TRUE(std::isnan(optim.step(1)));
  EXPECT_FALSE(optim.quantizer_nonfinite());
  expect_unchanged(before, "NaN gradient");

  // A quantizer met an Inf during the step: a finite norm, the flag reported, nothing updated.
  backward_once(m, dev, 3);
  Tensor x = Tensor::zeros({2, 32}, DType::F32);
  x.data<float>()[3] = INFINITY;
  QuantSpec spec;
  spec.fmt = Format::NVFP4;
  (void)ops::quantize(x.to(dev), spec);
  before = snapshot();
  EXPECT_TRUE(std::isfinite(optim.step(2)));
  EXPECT_TRUE(optim.quantizer_nonfinite());
  expect_unchanged(before, "a quantizer's Inf");
  EXPECT_FALSE(ops::nonfinite_seen(true)) << "the step took the flag";

  // And the next clean step updates again.
  EXPECT_TRUE(std::isfinite(optim.step(2)));
  EXPECT_FALSE(optim.quantizer_nonfinite());
  EXPECT_FALSE(same_bytes(before[0], m.params().flat()));
}

}  // namespace

TEST(OptimizerGate, NonFiniteStepsChangeNothingOnTheCpu) {
  const OmpThreads threads(2);
  expect_gated_steps(Device::CPU);
}

TEST(CudaOptimizerGate, NonFiniteStepsChangeNothing) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_gated_steps(Device::CUDA);
}
