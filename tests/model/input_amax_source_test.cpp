// defines: tests of where a training forward's running record of its NVFP4 inputs' amax
//          (Model::input_amax) comes from (set_input_amax_from_quantizers): the per-row amaxes
//          the inputs' quantizers kept (QTensor::row_amax) give the record of reading the inputs
//          again, bit for bit, over several forwards, for nvfp4-fwd and nvidia-nvfp4, on the CPU
//          and (when there is one) the GPU.
#include <gtest/gtest.h>

#include <string>

#include "fourbit/model/model.h"
#include "fourbit/tensor/device_memory.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

// The input amax record after three training forwards of `recipe` (two MoE layers in the body).
nlohmann::json recorded(const std::string& recipe, Device dev, bool from_quantizers) {
  const bool before = set_input_amax_from_quantizers(from_quantizers);
  const ModelConfig c = tiny_moe_config(4);
  Model m(c, recipe_by_name(recipe), dev);
  init_params(m.params(), c, 19);
  for (int64_t step = 0; step < 3; ++step) {
    const Tensor tokens = random_tokens(2, 12, 50 + uint64_t(step));
    m.params().zero_grad();
    (void)m.forward(tokens.to(dev), shifted_targets(tokens, 258).to(dev), SrStreams{7, uint64_t(step), 0}, true, 1.0f);
    m.backward();
  }
  set_input_amax_from_quantizers(before);
  return m.input_amax_json();
}

void expect_same_record(Device dev) {
  for (const char* recipe : {"nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    const nlohmann::json read = recorded(recipe, dev, false), kept = recorded(recipe, dev, true);
    EXPECT_FALSE(read.empty());
    EXPECT_EQ(kept, read);
  }
  // nvfp4-fwd's inputs all have per-token scales, so every key has its quantizer's row amaxes:
  // the routed experts' x (by expert, through the routing) and a, the shared expert's x and a
  const nlohmann::json j = recorded("nvfp4-fwd", dev, true);
  for (const char* key : {"layers.1.moe.x", "layers.1.moe.a", "layers.1.moe.shared.x", "layers.2.moe.shared.a"})
    EXPECT_TRUE(j.contains(key)) << key;
}

}  // namespace

TEST(InputAmaxSource, QuantizersRowAmaxesRecordWhatReadingTheInputsDoesOnTheCpu) {
  const OmpThreads threads(1);
  expect_same_record(Device::CPU);
}

TEST(CudaInputAmaxSource, QuantizersRowAmaxesRecordWhatReadingTheInputsDoes) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_same_record(Device::CUDA);
}
