// defines: forward_gemm tests: on the CPU, the model's forward GEMMs through forward_gemm (one
//          group of ops::grouped_gemm) give ops::gemm's bits, so routing them to the GPU's grouped
//          kernel family changed no CPU result: a tiny MoE model's logits are the same bytes with
//          set_forward_gemms_grouped on and off, for every recipe.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "fourbit/model/model.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

// forward_gemm's path for the scope, restored to the default (grouped) after.
struct ForwardGemms {
  explicit ForwardGemms(bool grouped) { set_forward_gemms_grouped(grouped); }
  ~ForwardGemms() { set_forward_gemms_grouped(true); }
  ForwardGemms(const ForwardGemms&) = delete;
  ForwardGemms& operator=(const ForwardGemms&) = delete;
};

}  // namespace

TEST(ForwardGemm, OnTheCpuItIsGemmsBits) {
  // 4 layers: layer 0 dense, 1-2 MoE (a shared expert), 3 the tail; the LM head tied.
  const ModelConfig c = tiny_moe_config(4, 32);
  const Tensor tokens = random_tokens(3, 16, 7);
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    Model m(c, recipe_by_name(recipe), Device::CPU);
    init_params(m.params(), c, 31);
    const SrStreams sr{3, 0, 0};
    Tensor grouped, plain;
    {
      const ForwardGemms path(true);
      grouped = m.logits(tokens, sr);
    }
    {
      const ForwardGemms path(false);
      plain = m.logits(tokens, sr);
    }
    ASSERT_EQ(grouped.shape(), plain.shape());
    EXPECT_EQ(0, std::memcmp(grouped.raw(), plain.raw(), size_t(grouped.nbytes())));
  }
}
