// defines: fused forward GEMM tests (set_fused_forward_gemms, stack_fprop_weights): the stacked
//          weight operand of each recipe's w1 | w3 and wq | wk | wv gives, column for column, the
//          bits of the parts' own GEMMs, and is refused where the parts' scales differ; on the CPU
//          a tiny MoE model's inference forwards (Model::logits, the sampler's cached prefill and
//          decode) are the same bytes with the fusion on and off, for every recipe. (The GPU's
//          fused attention path, which needs a BF16 cache: CudaModel.FusedForwardGemmsGiveTheSameBits.)
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "fourbit/model/kv_cache.h"
#include "fourbit/model/linear.h"
#include "fourbit/model/model.h"
#include "model/model_test_util.h"
#include "ops/op_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

// set_fused_forward_gemms and set_shared_expert_grouped for the scope, restored to the defaults
// (on) after.
struct FusedGemms {
  explicit FusedGemms(bool on, bool shared_grouped = true) {
    set_fused_forward_gemms(on);
    set_shared_expert_grouped(shared_grouped);
  }
  ~FusedGemms() {
    set_fused_forward_gemms(true);
    set_shared_expert_grouped(true);
  }
  FusedGemms(const FusedGemms&) = delete;
  FusedGemms& operator=(const FusedGemms&) = delete;
};

QuantSite site(uint64_t s) { return QuantSite{"fused." + std::to_string(s), ops::RngKey{91, s}}; }

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && optest::bitwise_equal(a, b);
}

// ops::grouped_gemm of x with one operand over `offsets` (one group: a 2-D weight).
Tensor gemm_out(const Prepared& x, const Prepared& w, const std::vector<int64_t>& offsets, int64_t n) {
  Tensor c = Tensor::empty({x.op().rows(), n}, DType::F32);
  grouped_gemm(x, w, offsets, c);
  return c;
}

// For weights of `shape_of(rows)` under the fprop spec of `cls` in `recipe` (partners sharing an
// outer scale where `shared`): the stacked operand's GEMM gives each part's GEMM in its columns,
// bit for bit, over a dense layer's one group or an expert stack's groups.
void expect_stacked_gemm_is_the_parts(const char* recipe, LayerClass cls, const std::vector<int64_t>& rows,
                                      int64_t slices, bool shared) {
  SCOPED_TRACE(std::string(recipe) + " " + layer_class_name(cls));
  const LayerRecipe& r = recipe_by_name(recipe).layer(cls, 0, 6);
  const int64_t K = 64, M = 29;
  std::vector<Tensor> ws;
  for (size_t p = 0; p < rows.size(); ++p)
    ws.push_back(optest::random_tensor(slices > 1 ? Shape{slices, rows[p], K} : Shape{rows[p], K}, DType::F32,
                                       500 + p, -3.0, 3.0));
  const Tensor gamax = shared ? shared_outer_amax(ws, r.fprop.b, GemmRole::Fprop) : Tensor{};
  std::vector<Prepared> parts;
  for (size_t p = 0; p < ws.size(); ++p)
    parts.push_back(prepare(ws[p], r.fprop.b, GemmRole::Fprop, 'b', site(p), cls, nullptr,
                            gamax.defined() ? &gamax : nullptr));
  const Prepared fused = stack_fprop_weights(parts, shared);
  ASSERT_TRUE(fused.defined());
  const Prepared x = prepare(optest::random_tensor({M, K}, DType::F32, 510), r.fprop.a, GemmRole::Fprop, 'a', site(9),
                             cls, nullptr);
  std::vector<int64_t> offsets{0};
  for (int64_t s = 0; s < slices; ++s) offsets.push_back(M * (s + 1) / slices);
  int64_t total = 0;
  for (int64_t n : rows) total += n;
  const Tensor all = gemm_out(x, fused, offsets, total);
  int64_t c0 = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    EXPECT_TRUE(same_bytes(optest::column_block(all, c0, rows[p]), gemm_out(x, parts[p], offsets, rows[p])))
        << "part " << p;
    c0 += rows[p];
  }
}

}  // namespace

TEST(FusedForward, StackedOperandsGiveThePartsGemmBits) {
  // an FFN's w1 | w3 (expert stacks per expert, the dense FFN's one matrix), and wq | wk | wv
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    expect_stacked_gemm_is_the_parts(recipe, LayerClass::Expert, {32, 32}, 4, true);
    expect_stacked_gemm_is_the_parts(recipe, LayerClass::Dense, {64, 64}, 1, true);
  }
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd"})
    expect_stacked_gemm_is_the_parts(recipe, LayerClass::Attention, {64, 32, 32}, 1, false);
}

TEST(FusedForward, StackingIsAViewWhereTheBuffersAdjoinAndRefusedWhereScalesDiffer) {
  // dense parts back to back in one buffer: a view of it, no copy
  const Tensor flat = optest::random_tensor({3 * 8 * 16}, DType::F32, 520);
  std::vector<Prepared> adj(3);
  for (int64_t p = 0; p < 3; ++p) adj[size_t(p)].dense = flat.view(p * 8 * 16, {8, 16});
  const Prepared view = stack_fprop_weights(adj, false);
  ASSERT_TRUE(view.defined());
  EXPECT_EQ(view.dense.shape(), (Shape{24, 16}));
  EXPECT_EQ(view.dense.raw(), flat.raw());
  // the same parts out of order are copied, each part's rows where stacking puts them
  const Prepared copied = stack_fprop_weights({adj[1], adj[0]}, false);
  ASSERT_TRUE(copied.defined());
  EXPECT_NE(copied.dense.raw(), flat.raw());
  EXPECT_EQ(0, std::memcmp(copied.dense.data<float>(), adj[1].dense.raw(), 8 * 16 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(copied.dense.data<float>() + 8 * 16, adj[0].dense.raw(), 8 * 16 * sizeof(float)));

  // NVIDIA's per-tensor weight scales: each part its own unless they were quantized sharing one
  const LayerRecipe& nv = recipe_by_name("nvidia-nvfp4").attention;
  const Tensor a = optest::random_tensor({32, 64}, DType::F32, 521), b = optest::random_tensor({32, 64}, DType::F32, 522);
  const Prepared pa = prepare(a, nv.fprop.b, GemmRole::Fprop, 'b', site(1), LayerClass::Attention, nullptr);
  const Prepared pb = prepare(b, nv.fprop.b, GemmRole::Fprop, 'b', site(2), LayerClass::Attention, nullptr);
  EXPECT_FALSE(stack_fprop_weights({pa, pb}, false).defined());
  // different formats, a Col-axis operand, a transposed dense one, dense with quantized
  const LayerRecipe& mx = recipe_by_name("mxfp8").attention;
  const Prepared pm = prepare(b, mx.fprop.b, GemmRole::Fprop, 'b', site(3), LayerClass::Attention, nullptr);
  EXPECT_FALSE(stack_fprop_weights({pa, pm}, true).defined());
  const Prepared col = prepare(b, mx.dgrad.b, GemmRole::Dgrad, 'b', site(4), LayerClass::Attention, nullptr);
  EXPECT_FALSE(stack_fprop_weights({pm, col}, false).defined());
  Prepared trans = adj[1];
  trans.trans = true;
  EXPECT_FALSE(stack_fprop_weights({adj[0], trans}, false).defined());
  EXPECT_FALSE(stack_fprop_weights({adj[0], pm}, false).defined());
}

// A MoE layer's routed experts' fprop weights (4 slices) and its shared expert's (one matrix)
// appended: each group of a grouped GEMM over the result gives its part's own GEMM, bit for bit.
TEST(FusedForward, AppendedSlicesGiveEachPartsGemmBits) {
  const int64_t K = 64, R = 32, M = 37;
  for (const char* recipe : {"bf16", "mxfp8", "nvfp4-fwd"}) {
    SCOPED_TRACE(recipe);
    const LayerRecipe& r = recipe_by_name(recipe).layer(LayerClass::Expert, 0, 6);
    const Prepared routed = prepare(optest::random_tensor({4, R, K}, DType::F32, 530, -3.0, 3.0), r.fprop.b,
                                    GemmRole::Fprop, 'b', site(1), LayerClass::Expert, nullptr);
    const Prepared shared = prepare(optest::random_tensor({R, K}, DType::F32, 531, -2.0, 2.0), r.fprop.b,
                                    GemmRole::Fprop, 'b', site(2), LayerClass::Expert, nullptr);
    const Prepared all = append_weight_slices({routed, shared});
    ASSERT_TRUE(all.defined());
    EXPECT_EQ(all.is_quantized() ? all.q.slices : all.dense.size(0), 5);
    const Prepared x = prepare(optest::random_tensor({M, K}, DType::F32, 532), r.fprop.a, GemmRole::Fprop, 'a',
                               site(3), LayerClass::Expert, nullptr);
    const std::vector<int64_t> offsets{0, 5, 5, 17, 24, M};  // an empty expert; the shared group last
    const Tensor got = gemm_out(x, all, offsets, R);
    const Tensor want_routed = gemm_out(x.rows(0, 24), routed, {0, 5, 5, 17, 24}, R);
    const Tensor want_shared = gemm_out(x.rows(24, M), shared, {0, M - 24}, R);
    EXPECT_TRUE(same_bytes(got.slice_rows(0, 24), want_routed));
    EXPECT_TRUE(same_bytes(got.slice_rows(24, M), want_shared));
  }
  // refused: different formats, row counts, per-tensor outer scales, F32 dense parts
  const LayerRecipe& mx = recipe_by_name("mxfp8").expert;
  const LayerRecipe& fp = recipe_by_name("nvfp4-fwd").expert;
  const Tensor w = optest::random_tensor({R, K}, DType::F32, 533);
  const Prepared pm = prepare(w, mx.fprop.b, GemmRole::Fprop, 'b', site(4), LayerClass::Expert, nullptr);
  const Prepared pf = prepare(w, fp.fprop.b, GemmRole::Fprop, 'b', site(5), LayerClass::Expert, nullptr);
  EXPECT_FALSE(append_weight_slices({pm, pf}).defined());
  const Prepared short_m = prepare(optest::random_tensor({R / 2, K}, DType::F32, 534), mx.fprop.b, GemmRole::Fprop,
                                   'b', site(6), LayerClass::Expert, nullptr);
  EXPECT_FALSE(append_weight_slices({pm, short_m}).defined());
  const LayerRecipe& nv = recipe_by_name("nvidia-nvfp4").attention;  // per-tensor weight scales
  const Prepared pt = prepare(w, nv.fprop.b, GemmRole::Fprop, 'b', site(7), LayerClass::Attention, nullptr);
  EXPECT_FALSE(append_weight_slices({pt, pt}).defined());
  Prepared f32;
  f32.dense = w;
  EXPECT_FALSE(append_weight_slices({f32, f32}).defined());
}

// Inference forwards on the CPU, fusion on and off, and with the shared expert as a group of the
// routed experts' GEMMs or apart: the same logits, bytes, for every recipe; the FFNs' w1 | w3 ran
// stacked but for fp32 (the attention's need the GPU's BF16 cache), and the shared expert with the
// routed experts where the recipe quantizes tokens per row (not NVIDIA's per-tensor scales).
TEST(FusedForward, InferenceForwardsAreTheSameBytesOnAndOff) {
  const ModelConfig c = tiny_moe_config(4, 32);  // layer 0 dense, 1-2 MoE with a shared expert, 3 the tail
  const Tensor tokens = random_tokens(2, 8, 11);
  const std::vector<int32_t> prompt = {5, 17, 3, 250, 9, 1, 77, 64};
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    Model m(c, recipe_by_name(recipe), Device::CPU);
    init_params(m.params(), c, 41);
    const SrStreams sr{5, 0, 0};
    // the prompt as a prefill of 2 slots, then 3 decode steps
    const auto sample = [&] {
      std::vector<Tensor> out;
      KvCache cache(c, 2, 12, DType::F32, Device::CPU);
      out.push_back(m.forward_cached(Tensor::from_host(prompt.data(), {2, 4}, DType::I32), KvBatch{4, {{0, 2, 0}}},
                                     cache, sr));
      for (int32_t step = 0; step < 3; ++step) {
        const std::vector<int32_t> next = {int32_t(10 + step), int32_t(200 - step)};
        out.push_back(m.forward_cached(Tensor::from_host(next.data(), {2, 1}, DType::I32),
                                       KvBatch{1, {{0, 2, 4 + step}}}, cache, sr));
      }
      out.push_back(m.logits(tokens, sr));
      return out;
    };
    // fp32's F32 operands run apart (on the GPU its GEMMs are cuBLASLt's, chosen per N)
    const bool fp32 = std::string(recipe) == "fp32";
    // NVIDIA's recipe quantizes tokens with per-tensor scales, but its tail layer (3) is BF16
    const bool nvidia = std::string(recipe) == "nvidia-nvfp4";
    const auto made = [&](const char* key) {
      const auto it = m.fused_weights().find(key);
      return it != m.fused_weights().end() && it->second.defined();
    };
    std::vector<Tensor> fused, ungrouped, apart;
    {
      const FusedGemms on(true);
      fused = sample();
    }
    EXPECT_EQ(m.fused_weights().empty(), fp32);
    EXPECT_TRUE(fp32 || made("layers.0.mlp.w13/fprop"));
    for (const char* layer : {"layers.1.moe", "layers.2.moe", "layers.3.moe"}) {
      const std::string l = layer;
      SCOPED_TRACE(l);
      const bool grouped = !fp32 && (!nvidia || l == "layers.3.moe");
      EXPECT_EQ(made((l + ".w13+shared/fprop").c_str()), grouped);
      EXPECT_EQ(made((l + ".w2+shared/fprop").c_str()), grouped);
      EXPECT_EQ(made((l + ".w13/fprop").c_str()), !fp32 && !grouped);
      EXPECT_EQ(made((l + ".shared.w13/fprop").c_str()), !fp32 && !grouped);
    }
    m.invalidate_weight_cache();
    {
      const FusedGemms on_apart(true, false);
      ungrouped = sample();
    }
    EXPECT_TRUE(fp32 || (made("layers.1.moe.w13/fprop") && made("layers.2.moe.shared.w13/fprop")));
    EXPECT_FALSE(made("layers.1.moe.w13+shared/fprop"));
    m.invalidate_weight_cache();
    {
      const FusedGemms off(false);
      apart = sample();
    }
    EXPECT_TRUE(m.fused_weights().empty());
    ASSERT_EQ(fused.size(), apart.size());
    ASSERT_EQ(ungrouped.size(), apart.size());
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_TRUE(same_bytes(fused[i], apart[i])) << "call " << i;
      EXPECT_TRUE(same_bytes(ungrouped[i], apart[i])) << "call " << i;
    }
  }
}
