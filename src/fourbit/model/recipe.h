// defines: GemmRole, gemm_role_name, GemmRecipe, LayerRecipe, LayerClass, layer_class_name, Recipe,
//          recipe_by_name, recipe_names, recipe_table
// Precision recipes as data (STYLE: "recipes are data"). A recipe says, for each class of linear
// layer and each of its three GEMMs, how each operand is quantized; model code asks for the spec
// and never branches on a recipe's name. The named recipes are those of DESIGN.md.
#pragma once
#include <string>
#include <vector>

#include "fourbit/numerics/formats.h"

namespace fourbit {

enum class GemmRole : uint8_t { Fprop, Dgrad, Wgrad };
const char* gemm_role_name(GemmRole r);

// The two operands of one GEMM in NT form. The block axis of each is fixed by the role
// (fprop: both Row; dgrad: dY Row, W Col; wgrad: dY Col, X Col), so specs leave it at Row.
struct GemmRecipe {
  QuantSpec a, b;
};

struct LayerRecipe {
  GemmRecipe fprop, dgrad, wgrad;
  // nvfp4-fwd: the backward's W (dgrad B) and X (wgrad B) come from the saved NVFP4 forward
  // operands through requantize_transposed (exact dequantize, transpose, SR to MXFP8), so only
  // the packed NVFP4 tensors are kept.
  bool requant_saved_sr = false;
};

enum class LayerClass : uint8_t { Attention, Expert, Dense, Router, LmHead };
const char* layer_class_name(LayerClass c);

struct Recipe {
  std::string name;
  std::string description;
  LayerRecipe attention, expert, dense, router, lm_head;
  // The last ceil(tail_fraction * n_layers) layers use these instead (nvfp4-fwd: experts in
  // MXFP8; nvidia-nvfp4: everything in BF16).
  LayerRecipe attention_tail, expert_tail, dense_tail;
  double tail_fraction = 0.0;

  int64_t tail_layers(int64_t n_layers) const;
  const LayerRecipe& layer(LayerClass c, int64_t layer_index, int64_t n_layers) const;
};

const Recipe& recipe_by_name(const std::string& name);  // fails listing the known names
std::vector<std::string> recipe_names();

// The `fourbit recipes` table for one recipe: layer class x GEMM x operand.
std::string recipe_table(const Recipe& r, int64_t n_layers);

}  // namespace fourbit
