// defines: hf_tensor_map, check_qwen2_moe_mappable, qwen2_moe_config, model_config_from_qwen2_moe
// (qwen2_moe.h). Field names and defaults are those of transformers' Qwen2MoeConfig
// (configuration_qwen2_moe.py) and the module names those of modeling_qwen2_moe.py.
#include "fourbit/hf/qwen2_moe.h"

#include <fmt/format.h>

#include "fourbit/tensor/error.h"

namespace fourbit::hf {

std::vector<HfTensor> hf_tensor_map(const ModelConfig& c) {
  const int64_t D = c.d_model, V = c.vocab_size, hd = c.hd(), Hq = c.n_heads, Hkv = c.n_kv_heads;
  std::vector<HfTensor> out;
  auto add = [&](std::string name, Shape shape, std::string param, std::string module = "", int64_t expert = -1,
                 float factor = 1.0f) {
    out.push_back({std::move(name), std::move(shape), std::move(param), expert, factor, std::move(module)});
  };
  // A linear layer: "<module>.weight" from param.
  auto linear = [&](const std::string& module, Shape shape, const std::string& param, int64_t expert = -1,
                    float factor = 1.0f) { add(module + ".weight", std::move(shape), param, module, expert, factor); };

  add("model.embed_tokens.weight", {V, D}, "embed");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string m = fmt::format("model.layers.{}.", l), p = fmt::format("layers.{}.", l);
    add(m + "input_layernorm.weight", {D}, p + "attn_norm");
    const struct {
      const char* hf;
      const char* ours;
      int64_t rows;
    } qkv[] = {{"q_proj", "wq", Hq * hd}, {"k_proj", "wk", Hkv * hd}, {"v_proj", "wv", Hkv * hd}};
    for (const auto& t : qkv) {
      linear(m + "self_attn." + t.hf, {t.rows, D}, p + "attn." + t.ours);
      add(m + "self_attn." + t.hf + ".bias", {t.rows}, "");  // qwen2_moe's biases: zero
    }
    linear(m + "self_attn.o_proj", {D, Hq * hd}, p + "attn.wo");
    add(m + "post_attention_layernorm.weight", {D}, p + "ffn_norm");
    if (c.is_moe_layer(l)) {
      const int64_t F = c.d_expert;
      linear(m + "mlp.gate", {c.n_experts, D}, p + "moe.router");
      for (int64_t e = 0; e < c.n_experts; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", m, e);
        linear(x + "gate_proj", {F, D}, p + "moe.w1", e);
        linear(x + "up_proj", {F, D}, p + "moe.w3", e);
        linear(x + "down_proj", {D, F}, p + "moe.w2", e);
      }
      // qwen2_moe always has a shared expert, scaled by sigmoid(gate . x) = 1/2 for a zero gate.
      const bool shared = c.n_shared_experts > 0;
      const int64_t Fs = shared ? c.shared_hidden() : F;
      linear(m + "mlp.shared_expert.gate_proj", {Fs, D}, shared ? p + "moe.shared.w1" : "");
      linear(m + "mlp.shared_expert.up_proj", {Fs, D}, shared ? p + "moe.shared.w3" : "");
      linear(m + "mlp.shared_expert.down_proj", {D, Fs}, shared ? p + "moe.shared.w2" : "", -1, 2.0f);
      linear(m + "mlp.shared_expert_gate", {1, D}, "");
    } else {
      const int64_t Fd = c.dense_hidden();
      linear(m + "mlp.gate_proj", {Fd, D}, p + "mlp.w1");
      linear(m + "mlp.up_proj", {Fd, D}, p + "mlp.w3");
      linear(m + "mlp.down_proj", {D, Fd}, p + "mlp.w2");
    }
  }
  add("model.norm.weight", {D}, "final_norm");
  if (!c.tie_embeddings) linear("lm_head", {V, D}, "lm_head");
  return out;
}

void check_qwen2_moe_mappable(const ModelConfig& c) {
  if (c.head_dim != 0 && c.head_dim * c.n_heads != c.d_model)
    fail("model.head_dim = {} is not d_model / n_heads = {}: qwen2_moe has no head_dim field and derives it, so "
         "this model cannot be written as qwen2_moe",
         c.head_dim, c.d_model / c.n_heads);
}

nlohmann::json qwen2_moe_config(const ModelConfig& c, const std::string& torch_dtype) {
  check_qwen2_moe_mappable(c);
  nlohmann::json mlp_only = nlohmann::json::array();
  for (int64_t l = 0; l < c.dense_layers; ++l) mlp_only.push_back(l);
  nlohmann::json j = {
      {"architectures", {"Qwen2MoeForCausalLM"}},
      {"model_type", "qwen2_moe"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.d_model},
      {"num_hidden_layers", c.n_layers},
      {"num_attention_heads", c.n_heads},
      {"num_key_value_heads", c.n_kv_heads},
      {"hidden_act", "silu"},
      {"max_position_embeddings", c.max_seq_len},
      {"initializer_range", c.init_std},
      {"rms_norm_eps", c.norm_eps},
      {"use_cache", true},
      {"tie_word_embeddings", c.tie_embeddings},
      // transformers 4.x reads rope_theta, 5.x rope_parameters; both say the same.
      {"rope_theta", c.rope_theta},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
      {"use_sliding_window", false},
      {"sliding_window", nullptr},
      {"max_window_layers", c.n_layers},
      {"attention_dropout", 0.0},
      // the dense FFN's width (transformers requires the field even when no layer is dense)
      {"intermediate_size", c.dense_hidden()},
      {"decoder_sparse_step", 1},
      {"mlp_only_layers", mlp_only},
      {"moe_intermediate_size", c.d_expert},
      {"shared_expert_intermediate_size", c.n_shared_experts ? c.shared_hidden() : c.d_expert},
      {"num_experts", c.n_experts},
      {"num_experts_per_tok", c.top_k},
      {"norm_topk_prob", true},
      {"output_router_logits", false},
      // transformers' load-balancing loss sums over the k choices, fourbit's averages over them.
      {"router_aux_loss_coef", c.aux_loss_coef / double(c.top_k)},
      {"qkv_bias", true},
      // the config's dtype under both names: "dtype" (transformers 5), "torch_dtype" (4.x)
      {"torch_dtype", torch_dtype},
      {"dtype", torch_dtype},
  };
  return j;
}

namespace {

// Typed reads of config.json fields with messages that name the file and the field.
struct Fields {
  const nlohmann::json& j;
  const std::string& path;

  const nlohmann::json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  int64_t integer(const char* key) const {
    const nlohmann::json* v = find(key);
    if (!v) fail("{}: missing field '{}'", path, key);
    if (!v->is_number_integer()) fail("{}: field '{}' must be an integer, got {}", path, key, v->dump());
    return v->get<int64_t>();
  }
  int64_t integer(const char* key, int64_t dflt) const { return find(key) ? integer(key) : dflt; }
  double number(const char* key) const {
    const nlohmann::json* v = find(key);
    if (!v) fail("{}: missing field '{}'", path, key);
    if (!v->is_number()) fail("{}: field '{}' must be a number, got {}", path, key, v->dump());
    return v->get<double>();
  }
  double number(const char* key, double dflt) const { return find(key) ? number(key) : dflt; }
  bool boolean(const char* key, bool dflt) const {
    const nlohmann::json* v = find(key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail("{}: field '{}' must be true or false, got {}", path, key, v->dump());
    return v->get<bool>();
  }
  std::string string(const char* key, const std::string& dflt) const {
    const nlohmann::json* v = find(key);
    if (!v) return dflt;
    if (!v->is_string()) fail("{}: field '{}' must be a string, got {}", path, key, v->dump());
    return v->get<std::string>();
  }
};

}  // namespace

ModelConfig model_config_from_qwen2_moe(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object()) fail("{}: expected a JSON object, got {}", path, j.type_name());
  const Fields f{j, path};
  const std::string type = f.string("model_type", "");
  if (type != "qwen2_moe") {
    const std::string arch = j.contains("architectures") ? j["architectures"].dump() : "none given";
    fail("{}: unsupported architecture: model_type '{}' (architectures {}); fourbit imports qwen2_moe "
         "(Qwen2MoeForCausalLM) checkpoints",
         path, type.empty() ? "(missing)" : type, arch);
  }
  const std::string act = f.string("hidden_act", "silu");
  if (act != "silu") fail("{}: hidden_act '{}' is not supported (fourbit's experts are SwiGLU: silu)", path, act);
  if (f.boolean("use_sliding_window", false))
    fail("{}: use_sliding_window is true: sliding-window attention is not supported (fourbit attends to every "
         "earlier position)",
         path);
  if (const nlohmann::json* lt = f.find("layer_types")) {
    if (!lt->is_array()) fail("{}: field 'layer_types' must be an array, got {}", path, lt->dump());
    for (size_t i = 0; i < lt->size(); ++i)
      if ((*lt)[i] != "full_attention")
        fail("{}: layer_types[{}] is {}: only full_attention is supported (no sliding windows)", path, i,
             (*lt)[i].dump());
  }
  if (const nlohmann::json* rs = f.find("rope_scaling"))
    fail("{}: rope_scaling {} is not supported (fourbit's RoPE is the default, unscaled one)", path, rs->dump());
  double theta = 0;
  if (const nlohmann::json* rp = f.find("rope_parameters")) {
    if (!rp->is_object()) fail("{}: field 'rope_parameters' must be an object, got {}", path, rp->dump());
    const Fields r{*rp, path};
    const std::string rt = r.string("rope_type", "default");
    if (rt != "default")
      fail("{}: rope_parameters.rope_type '{}' is not supported (fourbit's RoPE is the default one)", path, rt);
    if (r.find("rope_theta")) theta = r.number("rope_theta");
  }
  if (f.find("rope_theta")) {
    const double t = f.number("rope_theta");
    if (theta != 0 && t != theta)
      fail("{}: rope_theta ({}) and rope_parameters.rope_theta ({}) disagree", path, t, theta);
    theta = t;
  }
  if (theta == 0) fail("{}: missing field 'rope_theta' (or rope_parameters.rope_theta)", path);
  if (!f.boolean("norm_topk_prob", false))
    fail("{}: norm_topk_prob is false (or missing, transformers' default): the top-k routing weights are not "
         "renormalised, and fourbit's router always renormalises them",
         path);

  ModelConfig c;
  c.vocab_size = f.integer("vocab_size");
  c.d_model = f.integer("hidden_size");
  c.n_layers = f.integer("num_hidden_layers");
  c.n_heads = f.integer("num_attention_heads");
  c.n_kv_heads = f.integer("num_key_value_heads", c.n_heads);
  if (c.n_heads <= 0 || c.d_model % c.n_heads)
    fail("{}: hidden_size ({}) must be a positive multiple of num_attention_heads ({})", path, c.d_model, c.n_heads);
  if (f.find("head_dim") && f.integer("head_dim") != c.d_model / c.n_heads)
    fail("{}: head_dim ({}) differs from hidden_size / num_attention_heads ({}): not supported", path,
         f.integer("head_dim"), c.d_model / c.n_heads);
  c.head_dim = 0;
  c.max_seq_len = f.integer("max_position_embeddings", 32768);
  c.n_experts = f.integer("num_experts");
  c.top_k = f.integer("num_experts_per_tok");
  c.d_expert = f.integer("moe_intermediate_size");
  c.d_dense = f.integer("intermediate_size");
  c.n_shared_experts = 1;
  c.d_shared = f.integer("shared_expert_intermediate_size", 5632);
  c.rope_theta = theta;
  c.norm_eps = f.number("rms_norm_eps", 1e-6);
  c.tie_embeddings = f.boolean("tie_word_embeddings", false);
  c.aux_loss_coef = f.number("router_aux_loss_coef", 0.001) * double(c.top_k);
  c.init_std = f.number("initializer_range", 0.02);
  if (c.n_experts <= 0) fail("{}: num_experts is {}: a qwen2_moe without experts is not supported", path, c.n_experts);
  if (c.d_shared <= 0)
    fail("{}: shared_expert_intermediate_size is {}: expected a positive size", path, c.d_shared);

  // Which layers are MoE: transformers' rule; fourbit's dense layers must be the first ones.
  const int64_t step = f.integer("decoder_sparse_step", 1);
  if (step <= 0) fail("{}: decoder_sparse_step must be positive, got {}", path, step);
  std::vector<bool> dense(size_t(std::max<int64_t>(c.n_layers, 0)), false);
  if (const nlohmann::json* mo = f.find("mlp_only_layers")) {
    if (!mo->is_array()) fail("{}: field 'mlp_only_layers' must be an array of layer indices, got {}", path, mo->dump());
    for (const auto& v : *mo) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.n_layers)
        fail("{}: mlp_only_layers holds {}, not a layer index in [0, {})", path, v.dump(), c.n_layers);
      dense[size_t(v.get<int64_t>())] = true;
    }
  }
  for (int64_t l = 0; l < c.n_layers; ++l)
    if ((l + 1) % step != 0) dense[size_t(l)] = true;
  c.dense_layers = 0;
  while (c.dense_layers < c.n_layers && dense[size_t(c.dense_layers)]) ++c.dense_layers;
  for (int64_t l = c.dense_layers; l < c.n_layers; ++l)
    if (dense[size_t(l)])
      fail("{}: layer {} is dense but layer {} before it is MoE (mlp_only_layers / decoder_sparse_step): fourbit's "
           "dense layers must be the first ones",
           path, l, c.dense_layers);

  RunConfig rc;
  rc.model = c;
  rc.path = path;
  rc.train.seq_len = std::min<int64_t>(rc.train.seq_len, std::max<int64_t>(c.max_seq_len, 1));
  validate_config(rc);  // heads divide, top_k <= experts, positive sizes
  return c;
}

}  // namespace fourbit::hf
