// defines: HfTensor, hf_tensor_map, qwen2_moe_config, model_config_from_qwen2_moe,
//          check_qwen2_moe_mappable
// fourbit's model as Hugging Face transformers' `qwen2_moe` (Qwen2MoeForCausalLM): the config.json
// fields and the tensor names, both ways. The architectures agree where it matters (docs/export.md
// has the table): RMSNorm, rotate-half RoPE (pairs i and i + hd/2 in both), grouped-query
// attention, softmax router with top-k weights renormalised (`norm_topk_prob: true`), SwiGLU
// experts, dense first layers (`mlp_only_layers`), tied or untied LM head. Two gaps close exactly:
// qwen2_moe's attention has q/k/v biases (written as zeros) and its shared expert is scaled by
// sigmoid(shared_expert_gate . x) (a zero gate gives exactly 1/2, so the shared down projection is
// written doubled, a power of two: exact). A model without a shared expert is written with an
// all-zero one, which adds exactly zero.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::hf {

// One tensor of the qwen2_moe checkpoint and where its values come from in fourbit:
// hf = factor * param[expert] (the whole parameter when expert < 0), or all zeros when param is
// empty (q/k/v biases, the shared expert gate, the shared expert of a model that has none).
struct HfTensor {
  std::string name;    // "model.layers.3.mlp.experts.5.gate_proj.weight"
  Shape shape;
  std::string param;   // "layers.3.moe.w1"; "" for a constant zero tensor
  int64_t expert = -1; // slice of an [E, R, C] expert parameter
  float factor = 1.0f; // 2 for the shared expert's down projection (the gate's 1/2 undone)
  // The module a quantized export quantizes ("model.layers.3.mlp.experts.5.gate_proj"), "" for
  // tensors that are not a linear layer's weight (norms, embeddings, biases).
  std::string module;
};

// Every tensor of the checkpoint for config c, in a fixed order (embedding, layers, norm, head).
// lm_head.weight is listed only when the embeddings are not tied.
std::vector<HfTensor> hf_tensor_map(const ModelConfig& c);

// Fails, naming the field, for a model qwen2_moe cannot express exactly (a head_dim other than
// d_model / n_heads: qwen2_moe derives it).
void check_qwen2_moe_mappable(const ModelConfig& c);

// config.json for c; torch_dtype "float32" or "bfloat16".
nlohmann::json qwen2_moe_config(const ModelConfig& c, const std::string& torch_dtype);

// The fourbit ModelConfig of a qwen2_moe config.json (`path` for messages). Features fourbit
// does not have (other architectures, sliding windows, RoPE scaling, activations other than
// SiLU, top-k weights not renormalised, MoE layers that are not the last ones) fail with one
// clear error naming them. shared_expert_intermediate_size is kept as d_shared with one shared
// expert; the importer drops an all-zero shared expert.
ModelConfig model_config_from_qwen2_moe(const nlohmann::json& j, const std::string& path);

}  // namespace fourbit::hf
