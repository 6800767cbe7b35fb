// defines: tests of ParamStore's lazily zeroed gradients (zero_grad marks them stale; the
//          backward's first write to each stores instead of adding; settle_grads zeroes what no
//          write reached): the bookkeeping itself, and whole backward passes — one, and two
//          micro-batches into the same gradients — equal to those into gradients zeroed by writing
//          zeros, for every recipe, on the CPU and (when there is one) the GPU, including experts
//          that receive no tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

std::vector<float> host_floats(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

TEST(LazyGrad, StaleUntilTheFirstWriteThenAccumulate) {
  const ModelConfig c = tiny_moe_config();
  ParamStore ps(c, DType::F32, Device::CPU);
  ModelWeights g = ps.grads();
  // a fresh store's gradients are zeros, not stale: writes add
  EXPECT_TRUE(ps.grad_accumulate(g.layers[1].w2));
  ps.zero_grad();
  EXPECT_TRUE(std::isnan(g.final_norm.data<float>()[0])) << "the CPU poisons stale gradients";
  EXPECT_FALSE(ps.grad_accumulate(g.layers[1].w2));
  EXPECT_TRUE(ps.grad_accumulate(g.layers[1].w2));
  // one expert's slice belongs to the same parameter, already claimed
  EXPECT_TRUE(ps.grad_accumulate(g.layers[1].w2.view(0, {c.d_model, c.d_expert})));
  ps.zero_if_stale(g.final_norm);
  for (float v : host_floats(g.final_norm)) EXPECT_EQ(v, 0.0f);
  g.final_norm.data<float>()[0] = 5.0f;
  ps.zero_if_stale(g.final_norm);  // no longer stale: left alone
  EXPECT_EQ(g.final_norm.data<float>()[0], 5.0f);
  // w2 was claimed (its values are the caller's to write); everything else settles to zeros
  g.layers[1].w2.data<float>()[0] = 7.0f;
  ps.settle_grads();
  EXPECT_EQ(g.layers[1].w2.data<float>()[0], 7.0f);
  EXPECT_EQ(g.final_norm.data<float>()[0], 5.0f);
  for (const Tensor* t : {&g.embed, &g.layers[0].wq, &g.layers[1].w1, &g.layers[1].ffn_norm})
    for (float v : host_floats(*t)) ASSERT_EQ(v, 0.0f);
  EXPECT_TRUE(ps.grad_accumulate(g.layers[1].w1));  // settled: no longer stale
}

TEST(LazyGrad, RejectsWhatIsNotOneParametersGradient) {
  ParamStore ps(tiny_moe_config(), DType::F32, Device::CPU);
  const ModelWeights w = ps.weights(), g = ps.grads();
  EXPECT_THROW(ps.grad_accumulate(w.final_norm), Error);  // a weight, not a gradient
  EXPECT_THROW(ps.grad_accumulate(Tensor::zeros({4}, DType::F32)), Error);
  // the last norm's gradient and the parameter after it
  const ParamInfo& fn = ps.info("final_norm");
  EXPECT_THROW(ps.zero_if_stale(ps.flat_grad().view(fn.offset - 1, {2})), Error);
}

// The flat gradients after micro-batches `batches` (each a forward and backward into the same
// gradients) that start from zero_grad over NaN-filled gradients (lazy: any write that adds to a
// stale gradient, on either device, shows) or from written zeros.
std::vector<float> gradients(const ModelConfig& c, const std::string& recipe, Device dev, bool lazy,
                             const std::vector<Tensor>& batches) {
  Model m(c, recipe_by_name(recipe), dev);
  init_params(m.params(), c, 5);
  Tensor& flat = m.params().flat_grad();
  if (lazy) {  // stale gradients holding garbage (the GPU's zero_grad leaves the last values there)
    const std::vector<float> nan(size_t(flat.numel()), std::nanf(""));
    flat.copy_from(Tensor::from_host(nan.data(), flat.shape(), DType::F32));
    m.params().zero_grad();
  } else {
    flat.zero_();  // a fresh store's gradients: zeros, added to
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    const Tensor& tokens = batches[i];
    m.forward(tokens.to(dev), shifted_targets(tokens, 258).to(dev), SrStreams{3, 1, uint64_t(i)}, true,
              1.0f / float(batches.size()));
    m.backward();
  }
  return host_floats(m.params().flat_grad());
}

void expect_lazy_equals_zeroed(const ModelConfig& c, Device dev) {
  // 1 x 3 tokens top-2 over 16 experts: most experts receive none
  const std::vector<std::vector<Tensor>> runs = {{random_tokens(2, 12, 4)},
                                                 {random_tokens(2, 12, 4), random_tokens(2, 12, 8)},
                                                 {random_tokens(1, 3, 6)}};
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    for (size_t r = 0; r < runs.size(); ++r) {
      SCOPED_TRACE(std::string(recipe) + ", run " + std::to_string(r));
      const std::vector<float> zeroed = gradients(c, recipe, dev, false, runs[r]);
      const std::vector<float> lazy = gradients(c, recipe, dev, true, runs[r]);
      ASSERT_EQ(zeroed.size(), lazy.size());
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < lazy.size(); ++i)
        if (!(lazy[i] == zeroed[i])) {  // == : a stored -0 where 0 + -0 gave +0 is the same gradient
          if (bad++ == 0) first = i;
        }
      EXPECT_EQ(bad, 0u) << "first at " << first << ": " << lazy[first] << " vs " << zeroed[first];
    }
  }
}

ModelConfig many_experts(int64_t d_model) {
  ModelConfig c = tiny_moe_config(3, d_model);
  c.n_experts = 16;
  return c;
}

}  // namespace

TEST(LazyGrad, BackwardEqualsZeroedGradientsOnTheCpu) {
  const OmpThreads threads(2);
  expect_lazy_equals_zeroed(many_experts(32), Device::CPU);
}

TEST(CudaLazyGrad, BackwardEqualsZeroedGradients) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_lazy_equals_zeroed(many_experts(64), Device::CUDA);
}
