// defines: ModelConfig, TrainConfig, DataConfig, DistConfig, RunConfig, load_config, parse_config,
//          config_to_json, config_from_json, validate_config, apply_override, set_config_field,
//          config_field_names
// The TOML run configuration: [model] the architecture, [train] the optimisation, [data] where
// tokens come from, [dist] how the processes of a multi-GPU run share the work. Every field is
// checked: unknown fields, wrong types and out-of-range values fail with where the value came
// from (`file:line`, `--set section.key=value`, `--data`), the field and what was expected.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fourbit {

struct ModelConfig {
  int64_t vocab_size = 260;     // bytes 0..255 + specials (train/tokenizer.h)
  int64_t d_model = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;       // < n_heads: grouped-query attention
  int64_t head_dim = 0;         // 0: d_model / n_heads
  int64_t max_seq_len = 128;
  int64_t n_experts = 8;
  int64_t top_k = 2;
  int64_t d_expert = 256;       // hidden size of each routed expert
  int64_t n_shared_experts = 0; // 0 or 1 always-on expert
  int64_t d_shared = 0;         // 0: d_expert
  int64_t dense_layers = 0;     // the first N layers use a dense SwiGLU FFN instead of MoE
  int64_t d_dense = 0;          // 0: 4 * d_model
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = true;
  double aux_loss_coef = 0.01;  // load-balance loss weight
  double init_std = 0.02;

  int64_t hd() const { return head_dim ? head_dim : d_model / n_heads; }
  int64_t shared_hidden() const { return d_shared ? d_shared : d_expert; }
  int64_t dense_hidden() const { return d_dense ? d_dense : 4 * d_model; }
  bool is_moe_layer(int64_t l) const { return l >= dense_layers; }
};

struct TrainConfig {
  int64_t batch_size = 16;      // sequences per micro-batch
  int64_t seq_len = 128;
  int64_t grad_accum = 1;       // micro-batches per optimizer step
  int64_t steps = 300;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;    // cosine decays to lr * min_lr_ratio
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;       // global L2 norm; 0 = off
  int64_t eval_every = 50;
  int64_t eval_batches = 4;
  int64_t checkpoint_every = 100; // 0: only at the end (and when stopped by SIGINT/SIGTERM)
  int64_t keep_last = 3;        // checkpoints kept (older ones are pruned); 0: keep all
  int64_t log_every = 10;
  uint64_t seed = 1234;
  // Keep the FFNs' interiors (h1, h3, SwiGLU's a; the routed experts' outputs) from forward to backward
  // instead of recomputing them there: the same bits, a third less FFN GEMM work in the step, and
  // two FP32 [tokens, d_ff] tensors and SwiGLU's output (BF16 in the bf16 recipe, else FP32) more
  // per FFN kept (Model::set_keep_ffn_activations).
  bool keep_ffn_activations = false;
  // What a training forward keeps of the MXFP8 X^T it makes in one pass with X (attention's
  // inputs, the dense FFN's, the experts' dispatched tokens; and the experts' X, which the
  // backward's recomputation reads): their BF16 decodes, which the backward's GEMMs read as they
  // are (true), or their codes, half the bytes, decoded again in the backward (false: less peak
  // memory, a slower step). The same bits either way (Model::set_saved_x_decodes). Recipes whose
  // X^T is not MXFP8 made with X (bf16, fp32) keep the same either way.
  bool saved_x_decodes = true;
  // On the GPU, where a micro-batch reads nothing back (the bf16 recipe: Model::training_step_capturable),
  // its forward and backward are recorded once as a CUDA graph and replayed in the steps after
  // (StepGraphs): one launch instead of ~1600, the same bits. false: every micro-batch eager.
  bool cuda_graphs = true;
};

struct DataConfig {
  std::string source = "synthetic";  // synthetic | text:FILE | tokens:FILE
  double arithmetic_fraction = 0.4;  // synthetic: share of arithmetic documents
  double eval_fraction = 0.05;       // text/tokens: held-out tail of the file
};

// Expert and data parallelism (docs/distributed.md): ep x dp processes, each with its own tokens;
// rank r holds experts [(r % ep) E / ep, (r % ep + 1) E / ep). The launcher's process count is
// checked against ep x dp at start (dist::check_topology); here only what the file alone decides.
struct DistConfig {
  int64_t ep = 1;  // expert-parallel ranks; must divide model.n_experts
  int64_t dp = 1;  // data-parallel replicas of each expert shard
};

struct RunConfig {
  ModelConfig model;
  TrainConfig train;
  DataConfig data;
  DistConfig dist;
  std::string path;  // where it was read from ("<embedded>" for defaults)
  // Where each field that was set came from, for messages: "train.lr" -> "configs/tiny.toml:23",
  // "--set train.lr=0.01", "--data". Fields left at their defaults have no entry.
  std::map<std::string, std::string> origin;
  // "ORIGIN" of `field` ("FILE:LINE", "--set ...") or, for a default, the config's path.
  std::string where(const std::string& field) const;
};

RunConfig load_config(const std::string& path);
RunConfig parse_config(const std::string& toml_text, const std::string& path_for_messages);
nlohmann::json config_to_json(const RunConfig& c);
// Fields added after a run record was written (train.keep_last) take their defaults when absent;
// any other missing field is an error.
RunConfig config_from_json(const nlohmann::json& j, const std::string& path_for_messages);
// Checks ranges and the cross-field rules (heads divide, top_k <= experts, ...); load/parse call
// it. Messages start with the origin of the offending field.
void validate_config(const RunConfig& c);

// `--set section.key=value`: sets one field from text (integers, numbers, true/false, strings
// with or without quotes) and records the origin "--set section.key=value". Errors name the
// assignment and what was expected. Does not validate (call validate_config after all of them).
void apply_override(RunConfig& c, const std::string& assignment);
// Sets `field` ("section.key") from text, recording `origin` for it; errors start with `origin`.
void set_config_field(RunConfig& c, const std::string& field, const std::string& value,
                      const std::string& origin);
// Every "section.key", in the order config_to_json writes them.
std::vector<std::string> config_field_names();

}  // namespace fourbit
