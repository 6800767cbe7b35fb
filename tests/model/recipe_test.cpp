// defines: tests of the named recipes: (a) the names, the `fourbit recipes` tables and the tail
//          layer counts; (b) the formats every GEMM operand really runs in, forward and backward,
//          read from the model's QuantLog after one training step of a small model; (c) a GEMM of
//          two prepared operands equals "dequantize both exactly, then an FP32 GEMM" for every
//          GEMM of every quantized recipe (per-token, per-expert and per-tensor outer scales,
//          16x16 weight tiles, the RHT wgrad operands, the requantized nvfp4-fwd operands).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fourbit/model/linear.h"
#include "fourbit/model/model.h"
#include "fourbit/model/recipe.h"
#include "fourbit/ops/ops.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

const std::vector<std::string> kAllRecipes = {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"};

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

}  // namespace

// ---- (a) names, tables, tails ------------------------------------------------------------------

TEST(Recipes, NamesAreTheFiveOfTheDesign) {
  const std::vector<std::string> names = recipe_names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()),
            std::set<std::string>(kAllRecipes.begin(), kAllRecipes.end()));
  EXPECT_EQ(names.size(), kAllRecipes.size());
  for (const std::string& n : kAllRecipes) EXPECT_EQ(recipe_by_name(n).name, n);
}

TEST(Recipes, UnknownNameListsTheKnownOnes) {
  try {
    recipe_by_name("nvfp5");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "nvfp5")) << msg;
    for (const std::string& n : kAllRecipes) EXPECT_TRUE(contains(msg, n)) << msg;
  }
}

TEST(Recipes, TailLayerCounts) {
  EXPECT_EQ(recipe_by_name("nvfp4-fwd").tail_layers(12), 2);
  EXPECT_EQ(recipe_by_name("nvfp4-fwd").tail_layers(4), 1);
  EXPECT_EQ(recipe_by_name("nvfp4-fwd").tail_layers(6), 1);  // 6 * (1/6) is not rounded up to 2
  EXPECT_EQ(recipe_by_name("nvfp4-fwd").tail_layers(1), 1);
  EXPECT_EQ(recipe_by_name("nvidia-nvfp4").tail_layers(12), 2);  // ceil(1.8)
  EXPECT_EQ(recipe_by_name("nvidia-nvfp4").tail_layers(20), 3);
  for (const char* n : {"fp32", "bf16", "mxfp8"}) EXPECT_EQ(recipe_by_name(n).tail_layers(12), 0) << n;
  // layer(): the last tail_layers layers take the tail recipe.
  const Recipe& r = recipe_by_name("nvfp4-fwd");
  EXPECT_EQ(r.layer(LayerClass::Expert, 9, 12).fprop.a.fmt, Format::NVFP4);
  EXPECT_EQ(r.layer(LayerClass::Expert, 10, 12).fprop.a.fmt, Format::MXFP8_E4M3);
  EXPECT_EQ(r.layer(LayerClass::Expert, 11, 12).fprop.a.fmt, Format::MXFP8_E4M3);
}

TEST(Recipes, TablesDescribeEveryRecipe) {
  for (const std::string& n : kAllRecipes) {
    const std::string t = recipe_table(recipe_by_name(n), 12);
    EXPECT_TRUE(contains(t, "recipe " + n + ":")) << t;
    for (const char* cls : {"attention", "expert", "dense ffn", "router", "lm_head"}) EXPECT_TRUE(contains(t, cls)) << n;
    for (const char* g : {"fprop", "dgrad", "wgrad"}) EXPECT_TRUE(contains(t, g)) << n;
  }
  const std::string fwd = recipe_table(recipe_by_name("nvfp4-fwd"), 12);
  EXPECT_TRUE(contains(fwd, "(last 2)")) << fwd;
  EXPECT_TRUE(contains(fwd, "fp32 scale per token, 4/6 mse")) << fwd;
  EXPECT_TRUE(contains(fwd, "fp32 scale per expert")) << fwd;
  EXPECT_TRUE(contains(fwd, "saved nvfp4 -> requantize_transposed -> mxfp8-e4m3")) << fwd;
  const std::string nv = recipe_table(recipe_by_name("nvidia-nvfp4"), 12);
  EXPECT_TRUE(contains(nv, "(last 2)")) << nv;
  EXPECT_TRUE(contains(nv, "16x16 tiles")) << nv;
  EXPECT_TRUE(contains(nv, "RHT-16")) << nv;
  EXPECT_TRUE(contains(nv, "SR")) << nv;
  EXPECT_FALSE(contains(recipe_table(recipe_by_name("mxfp8"), 12), "(last")) << "mxfp8 has no tail";
  EXPECT_EQ(describe(recipe_by_name("bf16").expert.fprop.a), "bf16");
}

// ---- (b) the formats each GEMM operand really runs in ------------------------------------------

namespace {

// "<class>/<role>/<a|b>/<format>" for every role and operand.
std::set<std::string> all_six(const std::string& cls, const std::string& fmt) {
  std::set<std::string> out;
  for (const char* role : {"fprop", "dgrad", "wgrad"})
    for (const char* op : {"a", "b"}) out.insert(cls + "/" + role + "/" + op + "/" + fmt);
  return out;
}

std::set<std::string> operator+(std::set<std::string> a, const std::set<std::string>& b) {
  a.insert(b.begin(), b.end());
  return a;
}

// One training step (forward + backward) of a model with `n_layers` (the first dense) under
// `recipe`, with the quantizer log on; returns the keys that were logged.
std::set<std::string> logged_keys(const std::string& recipe, int64_t n_layers) {
  const OmpThreads one_thread(1);
  ModelConfig c = tiny_moe_config(n_layers, 32);
  Model m(c, recipe_by_name(recipe), Device::CPU);
  init_params(m.params(), c, 3);
  m.quant_log().enabled = true;
  const Tensor tokens = random_tokens(2, 8, 5);
  const Tensor targets = shifted_targets(tokens, 258);
  m.forward(tokens, targets, SrStreams{9, 0, 0}, true);
  m.backward();
  std::set<std::string> keys;
  for (const auto& [k, n] : m.quant_log().counts) {
    EXPECT_GT(n, 0) << k;
    keys.insert(k);
  }
  return keys;
}

std::string show(const std::set<std::string>& s) {
  std::string out;
  for (const auto& k : s) out += "  " + k + "\n";
  return out;
}

void expect_keys(const std::string& recipe, int64_t n_layers, const std::set<std::string>& want) {
  const std::set<std::string> got = logged_keys(recipe, n_layers);
  EXPECT_EQ(got, want) << recipe << " with " << n_layers << " layers\n got:\n" << show(got) << " want:\n" << show(want);
}

}  // namespace

// 4 layers: layer 0 dense, 1-2 MoE, 3 MoE in the tail (ceil(4/6) = 1).
TEST(RecipeFormats, Nvfp4FwdForwardNvfp4BackwardMxfp8FromTheSavedOperands) {
  const std::set<std::string> expert_main = {
      "expert/fprop/a/nvfp4",      "expert/fprop/b/nvfp4",
      "expert/dgrad/a/mxfp8-e4m3", "expert/dgrad/b/mxfp8-e4m3/requant",  // W: saved nvfp4 -> SR
      "expert/wgrad/a/mxfp8-e4m3", "expert/wgrad/b/mxfp8-e4m3/requant",  // X: saved nvfp4 -> SR
  };
  const std::set<std::string> expert_tail = all_six("expert", "mxfp8-e4m3");  // no requant
  expect_keys("nvfp4-fwd", 4,
              expert_main + expert_tail + all_six("attention", "mxfp8-e4m3") + all_six("dense", "mxfp8-e4m3") +
                  all_six("router", "fp32") + all_six("lm_head", "bf16"));
  // With 2 layers the only MoE layer is the tail: its experts are MXFP8 in both passes,
  // quantized from the high-precision tensors (no nvfp4, no requant anywhere).
  expect_keys("nvfp4-fwd", 2,
              expert_tail + all_six("attention", "mxfp8-e4m3") + all_six("dense", "mxfp8-e4m3") +
                  all_six("router", "fp32") + all_six("lm_head", "bf16"));
}

TEST(RecipeFormats, Mxfp8EveryLinearLayerMxfp8) {
  expect_keys("mxfp8", 4,
              all_six("attention", "mxfp8-e4m3") + all_six("expert", "mxfp8-e4m3") + all_six("dense", "mxfp8-e4m3") +
                  all_six("router", "fp32") + all_six("lm_head", "bf16"));
}

TEST(RecipeFormats, Bf16EverythingBf16ButTheRouter) {
  expect_keys("bf16", 4,
              all_six("attention", "bf16") + all_six("expert", "bf16") + all_six("dense", "bf16") +
                  all_six("router", "fp32") + all_six("lm_head", "bf16"));
}

TEST(RecipeFormats, Fp32AllFp32) {
  expect_keys("fp32", 4,
              all_six("attention", "fp32") + all_six("expert", "fp32") + all_six("dense", "fp32") +
                  all_six("router", "fp32") + all_six("lm_head", "fp32"));
}

// NVIDIA's recipe: NVFP4 in all three GEMMs; the tail layer (3 of 4, ceil(0.6)) in BF16.
TEST(RecipeFormats, NvidiaNvfp4AllGemmsNvfp4TailBf16) {
  expect_keys("nvidia-nvfp4", 4,
              all_six("attention", "nvfp4") + all_six("attention", "bf16") + all_six("expert", "nvfp4") +
                  all_six("expert", "bf16") + all_six("dense", "nvfp4") + all_six("router", "fp32") +
                  all_six("lm_head", "bf16"));
}

// ---- (c) a GEMM of prepared operands = dequantize, then FP32 GEMM ------------------------------

namespace {

// Gaussian values with a spread of magnitudes (x e^{U(-2,2)}) so the block and outer scales vary.
Tensor spread_tensor(const Shape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = float(n(rng) * std::exp(u(rng)));
  return t;
}

double rel_frobenius(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double d = double(got.data<float>()[i]) - double(want.data<float>()[i]);
    num += d * d;
    den += double(want.data<float>()[i]) * double(want.data<float>()[i]);
  }
  return std::sqrt(num / den);
}

bool has_outer(const Prepared& p) { return p.is_quantized() && p.q.outer != OuterScale::None; }

// C = gemm(a, b) against ops::gemm of the exactly dequantized operands as dense F32 ([R, K]
// operands, or [K, R] with trans_a / trans_b as the dequantized logical tensor is laid out).
// RHT operands are compared in the rotated basis (dequantize without undoing the rotation),
// which is what the GEMM of two rotated operands computes.
void expect_gemm_is_dequantized_gemm(const Prepared& a, const Prepared& b, bool trans_a, bool trans_b,
                                     const std::string& what) {
  ASSERT_TRUE(a.is_quantized() && b.is_quantized()) << what;
  const int64_t M = a.op().rows(), N = b.op().rows();
  Tensor c = Tensor::empty({M, N}, DType::F32);
  gemm(a, b, c);
  const Tensor da = ops::dequantize(a.q, false), db = ops::dequantize(b.q, false);
  Tensor ref = Tensor::empty({M, N}, DType::F32);
  ops::gemm(ops::Operand(da, trans_a), ops::Operand(db, trans_b), ref);
  const double err = rel_frobenius(c, ref);
  EXPECT_LT(err, 1e-5) << what;
  if (!has_outer(a) && !has_outer(b)) {
    // Without outer scales both sides are the same FMA chain over the same exact values.
    EXPECT_EQ(std::memcmp(c.raw(), ref.raw(), size_t(c.nbytes())), 0) << what << ": not bitwise equal";
  }
}

void check_layer_recipe(const std::string& rname, const LayerRecipe& lr, LayerClass cls) {
  const std::string where = rname + " " + layer_class_name(cls);
  const int64_t M = 64, K = 96, N = 48, S = 4;
  const Tensor X = spread_tensor({M, K}, 1), W = spread_tensor({N, K}, 2), W3 = spread_tensor({S, N, K}, 3);
  const Tensor dY = spread_tensor({M, N}, 4);
  auto key = [](uint64_t s) { return QuantSite{"test." + std::to_string(s), ops::RngKey{77, s}}; };

  // fprop: Y[M, N] = X . W^T (2-D weight, then each slice of a 3-D expert weight)
  const Prepared x = prepare(X, lr.fprop.a, GemmRole::Fprop, 'a', key(1), cls, nullptr);
  const Prepared w = prepare(W, lr.fprop.b, GemmRole::Fprop, 'b', key(2), cls, nullptr);
  expect_gemm_is_dequantized_gemm(x, w, false, false, where + " fprop");
  const Prepared w3 = prepare(W3, lr.fprop.b, GemmRole::Fprop, 'b', key(3), cls, nullptr);
  const Tensor w3_all = ops::dequantize(w3.q);
  for (int64_t s = 0; s < S; ++s) {
    const Prepared ws = w3.slice(s);
    expect_gemm_is_dequantized_gemm(x, ws, false, false, where + " fprop, expert slice " + std::to_string(s));
    const Tensor d = ops::dequantize(ws.q);
    EXPECT_EQ(std::memcmp(d.raw(), w3_all.data<float>() + s * N * K, size_t(d.nbytes())), 0)
        << where << ": slice " << s << " dequantizes differently from the whole";
  }

  // dgrad: dX[M, K] = dY . W (W blocked along N, stored transposed)
  const Prepared dy = prepare(dY, lr.dgrad.a, GemmRole::Dgrad, 'a', key(4), cls, nullptr);
  const Prepared wd = prepare(W, lr.dgrad.b, GemmRole::Dgrad, 'b', key(5), cls, nullptr);
  expect_gemm_is_dequantized_gemm(dy, wd, false, true, where + " dgrad");
  const Prepared wd3 = prepare(W3, lr.dgrad.b, GemmRole::Dgrad, 'b', key(6), cls, nullptr);
  expect_gemm_is_dequantized_gemm(dy, wd3.slice(2), false, true, where + " dgrad, expert slice 2");

  // wgrad: dW[N, K] = dY^T . X (both blocked along the M tokens)
  const Prepared dyt = prepare(dY, lr.wgrad.a, GemmRole::Wgrad, 'a', key(7), cls, nullptr);
  const Prepared xt = prepare(X, lr.wgrad.b, GemmRole::Wgrad, 'b', key(8), cls, nullptr);
  expect_gemm_is_dequantized_gemm(dyt, xt, true, true, where + " wgrad");

  if (lr.requant_saved_sr) {
    // nvfp4-fwd: W for dgrad and X for wgrad come from the saved NVFP4 forward operands.
    const Prepared wr = requantize_saved(w3, lr.dgrad.b, GemmRole::Dgrad, 'b', key(9), cls, nullptr);
    EXPECT_EQ(wr.q.fmt, Format::MXFP8_E4M3);
    expect_gemm_is_dequantized_gemm(dy, wr.slice(1), false, true, where + " dgrad from the saved nvfp4 weight");
    const Prepared xr = requantize_saved(x, lr.wgrad.b, GemmRole::Wgrad, 'b', key(10), cls, nullptr);
    EXPECT_EQ(xr.q.fmt, Format::MXFP8_E4M3);
    expect_gemm_is_dequantized_gemm(dyt, xr, true, true, where + " wgrad from the saved nvfp4 input");
    // ... and a row segment of the saved input (one expert's tokens), as the MoE backward uses it
    const Prepared xs = requantize_saved(x.rows(8, 40), lr.wgrad.b, GemmRole::Wgrad, 'b', key(11), cls, nullptr);
    const Prepared dys = prepare(dY.slice_rows(8, 40), lr.wgrad.a, GemmRole::Wgrad, 'a', key(12), cls, nullptr);
    expect_gemm_is_dequantized_gemm(dys, xs, true, true, where + " wgrad from a row segment of the saved input");
  }
}

}  // namespace

TEST(RecipeGemm, PreparedGemmEqualsDequantizedGemm) {
  const OmpThreads one_thread(1);
  for (const char* name : {"mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    const Recipe& r = recipe_by_name(name);
    check_layer_recipe(name, r.expert, LayerClass::Expert);
    check_layer_recipe(name, r.attention, LayerClass::Attention);
    if (r.expert_tail.fprop.a.quantized())  // nvidia-nvfp4's tail is BF16
      check_layer_recipe(std::string(name) + " (tail)", r.expert_tail, LayerClass::Expert);
  }
  // the scale granularities the recipes promise
  const Recipe& fwd = recipe_by_name("nvfp4-fwd");
  EXPECT_EQ(fwd.expert.fprop.a.outer, OuterScale::PerRow);
  EXPECT_TRUE(fwd.expert.fprop.a.four_over_six);
  EXPECT_EQ(fwd.expert.fprop.b.outer, OuterScale::PerSlice);
  const Recipe& nv = recipe_by_name("nvidia-nvfp4");
  EXPECT_TRUE(nv.expert.fprop.b.tile_2d);
  EXPECT_EQ(nv.expert.fprop.a.outer, OuterScale::Tensor);
  EXPECT_EQ(nv.expert.wgrad.a.hadamard, 16);
}

// ---- (d) the recipe owns its specs; w1 and w3 share an outer scale ----------------------------

// The requantize target is the recipe's dgrad.b / wgrad.b: a recipe whose fields say E5M2 (dgrad)
// and RNE (wgrad) runs exactly that, and the log says so.
TEST(Recipes, RequantizeTargetComesFromTheRecipe) {
  const OmpThreads one_thread(1);
  Recipe r = recipe_by_name("nvfp4-fwd");
  r.name = "nvfp4-fwd-e5m2-dgrad";
  r.expert.dgrad.b.fmt = Format::MXFP8_E5M2;
  r.expert.wgrad.b.rounding = num::Rounding::RNE;
  const ModelConfig c = tiny_moe_config(4, 32);
  Model m(c, r, Device::CPU);
  init_params(m.params(), c, 3);
  m.quant_log().enabled = true;
  m.quant_log().record_calls = true;
  const Tensor tokens = random_tokens(2, 8, 5);
  m.forward(tokens, shifted_targets(tokens, 258), SrStreams{9, 0, 0}, true);
  m.backward();
  EXPECT_GT(m.quant_log().counts.count("expert/dgrad/b/mxfp8-e5m2/requant"), 0u);
  EXPECT_EQ(m.quant_log().counts.count("expert/dgrad/b/mxfp8-e4m3/requant"), 0u);
  int wgrad_rne = 0;
  for (const QuantLog::Call& call : m.quant_log().calls)
    if (call.site.find("/wgrad/X^T") != std::string::npos && call.spec.find("mxfp8-e4m3") == 0)
      wgrad_rne += call.spec.find("SR") == std::string::npos;
  EXPECT_GT(wgrad_rne, 0) << "the wgrad target's RNE did not reach the requantization";
  // A target the op cannot honour fails loudly instead of running something else.
  r.expert.dgrad.b.mx_rule = num::MxScaleRule::FLOOR;
  Model bad(c, r, Device::CPU);
  init_params(bad.params(), c, 3);
  bad.forward(tokens, shifted_targets(tokens, 258), SrStreams{9, 0, 0}, true);
  EXPECT_THROW(bad.backward(), Error);
}

// NUMERICS "NVFP4": an FFN's w1 and w3 form one outer-scale group. After a step under nvfp4-fwd
// (per-expert weight scales) and nvidia-nvfp4 (per-tensor), each layer's w1 and w3 operands carry
// the same S_dec bytes, one per expert for the routed experts (and those differ between experts),
// and S_dec is the joint amax's: the smaller of the two separate ones.
TEST(Recipes, W1AndW3ShareOneOuterScale) {
  const OmpThreads one_thread(1);
  for (const char* name : {"nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = tiny_moe_config(4, 32);
    Model m(c, recipe_by_name(name), Device::CPU);
    init_params(m.params(), c, 3);
    const Tensor tokens = random_tokens(2, 8, 5);
    m.forward(tokens, shifted_targets(tokens, 258), SrStreams{9, 0, 0}, true);
    m.backward();
    int pairs = 0;
    for (const char* ffn : {"layers.1.moe.", "layers.1.moe.shared.", "layers.0.mlp."}) {
      const auto i1 = m.weight_cache().find(std::string(ffn) + "w1/fprop");
      const auto i3 = m.weight_cache().find(std::string(ffn) + "w3/fprop");
      ASSERT_TRUE(i1 != m.weight_cache().end() && i3 != m.weight_cache().end()) << ffn;
      const Prepared *w1 = &i1->second, *w3 = &i3->second;
      if (!w1->is_quantized() || w1->q.outer == OuterScale::None) continue;  // nvfp4-fwd's dense FFN is MXFP8
      ++pairs;
      const Tensor& s1 = w1->q.outer_scales;
      const Tensor& s3 = w3->q.outer_scales;
      ASSERT_EQ(s1.numel(), s3.numel()) << ffn;
      EXPECT_EQ(std::memcmp(s1.raw(), s3.raw(), size_t(s1.nbytes())), 0) << ffn << ": w1 and w3 scales differ";
      if (std::string(ffn) == "layers.1.moe." && s1.numel() > 1) {
        EXPECT_NE(s1.data<float>()[0], s1.data<float>()[1]) << "experts share one scale";
      }
      // the joint group's S_dec is the larger of the two separate ones (S_dec rises with amax)
      const LayerWeights lw = m.params().weights().layers[std::string(ffn) == "layers.0.mlp." ? 0 : 1];
      const bool routed = std::string(ffn) == "layers.1.moe.", shared = std::string(ffn) == "layers.1.moe.shared.";
      const Tensor& t1 = routed ? lw.w1 : shared ? lw.sw1 : lw.dw1;
      const Tensor& t3 = routed ? lw.w3 : shared ? lw.sw3 : lw.dw3;
      const Recipe& rec = recipe_by_name(name);
      const QuantSpec spec = (std::string(ffn) == "layers.0.mlp." ? rec.layer(LayerClass::Dense, 0, 4)
                                                                  : rec.layer(LayerClass::Expert, 1, 4)).fprop.b;
      const Tensor a1 = ops::quantize(t1, spec).outer_scales, a3 = ops::quantize(t3, spec).outer_scales;
      for (int64_t g = 0; g < s1.numel(); ++g)
        EXPECT_EQ(s1.data<float>()[g], std::max(a1.data<float>()[g], a3.data<float>()[g])) << ffn << " group " << g;
    }
    EXPECT_GE(pairs, 2);
  }
}
