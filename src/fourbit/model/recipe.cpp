// defines: the named recipes (fp32, bf16, mxfp8, nvfp4-fwd, nvidia-nvfp4) and their tables
#include "fourbit/model/recipe.h"

#include <cmath>

#include <fmt/format.h>

#include "fourbit/numerics/hadamard.h"
#include "fourbit/tensor/error.h"

namespace fourbit {
namespace {

using num::Rounding;

QuantSpec dense_spec(Format f) {
  QuantSpec s;
  s.fmt = f;
  s.outer = OuterScale::None;
  return s;
}

LayerRecipe uniform(const QuantSpec& s) {
  LayerRecipe r;
  r.fprop = r.dgrad = r.wgrad = GemmRecipe{s, s};
  return r;
}

QuantSpec mxfp8(Rounding rnd = Rounding::RNE) {
  QuantSpec s;
  s.fmt = Format::MXFP8_E4M3;
  s.outer = OuterScale::None;
  s.rounding = rnd;
  return s;
}

QuantSpec nvfp4(OuterScale outer, bool four_over_six, Rounding rnd = Rounding::RNE) {
  QuantSpec s;
  s.fmt = Format::NVFP4;
  s.outer = outer;
  s.four_over_six = four_over_six;
  s.metric = num::ScaleMetric::MSE;
  s.rounding = rnd;
  return s;
}

// DESIGN "The recipe": NVFP4 forward with per-token activation scales and Four Over Six,
// per-expert weight scales; MXFP8 backward with the saved operands re-quantized by SR.
LayerRecipe nvfp4_fwd_expert() {
  LayerRecipe r;
  r.fprop = {nvfp4(OuterScale::PerRow, true), nvfp4(OuterScale::PerSlice, false)};
  r.dgrad = {mxfp8(), mxfp8(Rounding::SR)};  // b: requantize_transposed of the saved weight
  r.wgrad = {mxfp8(), mxfp8(Rounding::SR)};  // b: requantize_transposed of the saved input
  r.requant_saved_sr = true;
  return r;
}

// NVIDIA's published NVFP4 recipe: NVFP4 in all three GEMMs, 16x16 weight tiles, per-tensor
// scales, SR on gradients, 16-point RHT (fixed signs) on both wgrad operands.
LayerRecipe nvidia_nvfp4_layer(OuterScale weight_outer) {
  QuantSpec w = nvfp4(weight_outer, false);
  w.tile_2d = true;
  QuantSpec grad_sr = nvfp4(OuterScale::Tensor, false, Rounding::SR);
  QuantSpec grad_rht = grad_sr;
  grad_rht.hadamard = 16;
  grad_rht.hadamard_signs = num::kNvidiaRht16Signs;
  QuantSpec act_rht = nvfp4(OuterScale::Tensor, false);
  act_rht.hadamard = 16;
  act_rht.hadamard_signs = num::kNvidiaRht16Signs;
  LayerRecipe r;
  r.fprop = {nvfp4(OuterScale::Tensor, false), w};
  r.dgrad = {grad_sr, w};
  r.wgrad = {grad_rht, act_rht};
  return r;
}

// Built on first use (all_recipes' function-local static), so a caller that runs during static
// initialization — a namespace-scope constant in another file — sees the full tables; namespace-scope
// LayerRecipe constants here would not be initialized yet in that case.
std::vector<Recipe> build_recipes() {
  const LayerRecipe kF32 = uniform(dense_spec(Format::F32));
  const LayerRecipe kBf16 = uniform(dense_spec(Format::BF16));
  const LayerRecipe kMxfp8 = uniform(mxfp8());
  std::vector<Recipe> out;
  {
    Recipe r;
    r.name = "fp32";
    r.description = "every GEMM in FP32 (the reference; gradient checks)";
    r.attention = r.expert = r.dense = r.router = r.lm_head = kF32;
    r.attention_tail = r.expert_tail = r.dense_tail = kF32;
    out.push_back(r);
  }
  {
    Recipe r;
    r.name = "bf16";
    r.description = "every GEMM with BF16 operands, FP32 accumulation; router in FP32";
    r.attention = r.expert = r.dense = r.lm_head = kBf16;
    r.router = kF32;
    r.attention_tail = r.expert_tail = r.dense_tail = kBf16;
    out.push_back(r);
  }
  {
    Recipe r;
    r.name = "mxfp8";
    r.description = "every linear layer MXFP8 E4M3 (1x32 UE8M0, RCEIL) in all three GEMMs";
    r.attention = r.expert = r.dense = kMxfp8;
    r.attention_tail = r.expert_tail = r.dense_tail = kMxfp8;
    r.router = kF32;
    r.lm_head = kBf16;
    out.push_back(r);
  }
  {
    Recipe r;
    r.name = "nvfp4-fwd";
    r.description = "experts: NVFP4 forward (per-token scales, 4/6), MXFP8 backward from the saved "
                    "NVFP4 by SR; last sixth of layers' experts and all attention in MXFP8";
    r.expert = nvfp4_fwd_expert();
    r.attention = r.dense = kMxfp8;
    r.attention_tail = r.expert_tail = r.dense_tail = kMxfp8;
    r.router = kF32;
    r.lm_head = kBf16;
    r.tail_fraction = 1.0 / 6.0;
    out.push_back(r);
  }
  {
    Recipe r;
    r.name = "nvidia-nvfp4";
    r.description = "NVIDIA's recipe: NVFP4 in all GEMMs, 16x16 weight scales, RHT-16 on wgrad, SR "
                    "on gradients, per-tensor scales; last ~15% of layers in BF16";
    r.attention = r.dense = nvidia_nvfp4_layer(OuterScale::Tensor);
    r.expert = nvidia_nvfp4_layer(OuterScale::PerSlice);
    r.attention_tail = r.expert_tail = r.dense_tail = kBf16;
    r.router = kF32;
    r.lm_head = kBf16;
    r.tail_fraction = 0.15;
    out.push_back(r);
  }
  return out;
}

const std::vector<Recipe>& all_recipes() {
  static const std::vector<Recipe> recipes = build_recipes();
  return recipes;
}

}  // namespace

const char* gemm_role_name(GemmRole r) {
  switch (r) {
    case GemmRole::Fprop: return "fprop";
    case GemmRole::Dgrad: return "dgrad";
    case GemmRole::Wgrad: return "wgrad";
  }
  return "?";
}

const char* layer_class_name(LayerClass c) {
  switch (c) {
    case LayerClass::Attention: return "attention";
    case LayerClass::Expert: return "expert";
    case LayerClass::Dense: return "dense";
    case LayerClass::Router: return "router";
    case LayerClass::LmHead: return "lm_head";
  }
  return "?";
}

int64_t Recipe::tail_layers(int64_t n_layers) const {
  if (tail_fraction <= 0) return 0;
  // ceil with a guard against 6 * (1/6) landing a hair above an integer
  return std::min<int64_t>(n_layers, int64_t(std::ceil(tail_fraction * double(n_layers) - 1e-9)));
}

const LayerRecipe& Recipe::layer(LayerClass c, int64_t layer_index, int64_t n_layers) const {
  const bool tail = layer_index >= n_layers - tail_layers(n_layers);
  switch (c) {
    case LayerClass::Attention: return tail ? attention_tail : attention;
    case LayerClass::Expert: return tail ? expert_tail : expert;
    case LayerClass::Dense: return tail ? dense_tail : dense;
    case LayerClass::Router: return router;
    case LayerClass::LmHead: return lm_head;
  }
  fail("unknown layer class");
}

const Recipe& recipe_by_name(const std::string& name) {
  for (const Recipe& r : all_recipes())
    if (r.name == name) return r;
  std::string known;
  for (const Recipe& r : all_recipes()) known += (known.empty() ? "" : ", ") + r.name;
  fail("unknown recipe '{}' (known: {})", name, known);
}

std::vector<std::string> recipe_names() {
  std::vector<std::string> out;
  for (const Recipe& r : all_recipes()) out.push_back(r.name);
  return out;
}

std::string recipe_table(const Recipe& r, int64_t n_layers) {
  const int64_t tail = r.tail_layers(n_layers);
  std::string out = fmt::format("recipe {}: {}\n", r.name, r.description);
  out += fmt::format("  {:<18} {:<6} {:<46} {}\n", "layer class", "gemm", "operand A", "operand B");
  auto rows = [&](const char* cls, const LayerRecipe& lr) {
    const GemmRecipe* g[3] = {&lr.fprop, &lr.dgrad, &lr.wgrad};
    const char* names[3] = {"fprop", "dgrad", "wgrad"};
    const char* a_name[3] = {"X", "dY", "dY^T"};
    const char* b_name[3] = {"W", "W", "X^T"};
    for (int i = 0; i < 3; ++i) {
      std::string b = describe(g[i]->b);
      if (lr.requant_saved_sr && i > 0) b = "saved nvfp4 -> requantize_transposed -> " + b;
      out += fmt::format("  {:<18} {:<6} {:<46} {}\n", cls, names[i],
                         fmt::format("{}: {}", a_name[i], describe(g[i]->a)),
                         fmt::format("{}: {}", b_name[i], b));
    }
  };
  rows("attention", r.attention);
  rows("expert", r.expert);
  rows("dense ffn", r.dense);
  if (tail > 0) {
    const std::string suffix = fmt::format(" (last {})", tail);
    rows(("attention" + suffix).c_str(), r.attention_tail);
    rows(("expert" + suffix).c_str(), r.expert_tail);
    rows(("dense ffn" + suffix).c_str(), r.dense_tail);
  }
  rows("router", r.router);
  rows("lm_head", r.lm_head);
  return out;
}

}  // namespace fourbit
