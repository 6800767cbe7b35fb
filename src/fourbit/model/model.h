// defines: Model, ForwardStats, SavedBytes
// The decoder-only MoE transformer, forward and backward written out layer by layer over the
// ops/ interface (llm.c style): embedding; L x [RMSNorm -> causal GQA attention with RoPE ->
// residual -> RMSNorm -> MoE FFN (router softmax top-k, SwiGLU experts, optional shared expert,
// load-balance loss) or dense SwiGLU FFN -> residual]; final RMSNorm; LM head (optionally tied).
// Every linear GEMM takes its operand formats from the Recipe; the model never names a recipe.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fourbit/model/config.h"
#include "fourbit/model/linear.h"
#include "fourbit/model/params.h"
#include "fourbit/model/recipe.h"

namespace fourbit {

struct ForwardStats {
  double loss = 0;      // mean cross-entropy over the target tokens (nats); with per-token
                        // weights, sum(weight * CE) / tokens
  double aux_loss = 0;  // load-balance loss summed over MoE layers (already weighted)
  int64_t tokens = 0;   // target tokens counted (targets != -1)
  Tensor token_losses;  // F32/F64 [B*T] on the model's device: each position's unweighted
                        // cross-entropy, -log p(target) (0 where the target is -1)
};

// Bytes kept between forward and backward, by what keeps them.
struct SavedBytes {
  std::map<std::string, int64_t> by_category;  // residual, attention, router, expert, dense, lm_head
  int64_t total() const {
    int64_t t = 0;
    for (const auto& [k, v] : by_category) t += v;
    return t;
  }
};

class Model {
 public:
  // dtype F32 normally; F64 (with the fp32 recipe, CPU only) for finite-difference checks.
  Model(const ModelConfig& cfg, const Recipe& recipe, Device device, DType dtype = DType::F32);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const Recipe& recipe() const { return recipe_; }
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }
  ParamStore& params() { return params_; }

  // tokens, targets: I32 [B, T] on the model's device (targets -1 = no loss). With
  // for_backward the activations are kept and the gradient of loss_weight * (CE + aux) is ready
  // for backward(), which accumulates into params().flat_grad(); CE is the mean over the targets.
  // token_weights (optional F32 [B, T] on the model's device) weight each target's
  // cross-entropy: the gradient is then of loss_weight * (sum_i w_i CE_i / tokens + aux), e.g.
  // the advantages of a policy-gradient step. Without them the results are unchanged bits.
  ForwardStats forward(const Tensor& tokens, const Tensor& targets, const SrStreams& sr,
                       bool for_backward, float loss_weight = 1.0f, const Tensor& token_weights = Tensor());
  void backward();

  // Logits F32 [B*T, V] for tokens [B, T] (a full causal forward); no activations kept.
  Tensor logits(const Tensor& tokens, const SrStreams& sr);

  // Quantized weights are cached until the weights change: call after every optimizer step.
  void invalidate_weight_cache() { weight_cache_.clear(); }
  const SavedBytes& saved_bytes() const { return saved_bytes_; }
  QuantLog& quant_log() { return quant_log_; }

  struct Saved;  // activations kept for backward (model.cpp)

 private:
  friend struct ModelRunner;
  Prepared weight(const Tensor& w, const std::string& name, GemmRole role, const QuantSpec& spec,
                  LayerClass cls);
  ModelConfig cfg_;
  const Recipe& recipe_;
  Device device_;
  DType dtype_;
  ParamStore params_;
  Tensor rope_;
  std::map<std::string, Prepared> weight_cache_;
  std::unique_ptr<Saved> saved_;
  SavedBytes saved_bytes_;
  QuantLog quant_log_;
};

}  // namespace fourbit
