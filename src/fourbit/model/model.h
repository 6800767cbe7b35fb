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
  double loss = 0;      // mean cross-entropy over the target tokens (nats)
  double aux_loss = 0;  // load-balance loss summed over MoE layers (already weighted)
  int64_t tokens = 0;   // target tokens counted
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
  // for backward(), which accumulates into params().flat_grad().
  ForwardStats forward(const Tensor& tokens, const Tensor& targets, const SrStreams& sr,
                       bool for_backward, float loss_weight = 1.0f);
  void backward();

  // Logits F32 [B*T, V] for tokens [B, T] (a full causal forward); no activations kept.
  Tensor logits(const Tensor& tokens, const SrStreams& sr);

  // Quantized weights are cached until the weights change: call after every optimizer step.
  void invalidate_weight_cache() { weight_cache_.clear(); }
  // The cached operand of weight `name` for a GEMM ("layers.1.moe.w1/fprop"), or null (tests).
  const Prepared* cached_weight(const std::string& key) const {
    const auto it = weight_cache_.find(key);
    return it == weight_cache_.end() ? nullptr : &it->second;
  }
  const SavedBytes& saved_bytes() const { return saved_bytes_; }
  QuantLog& quant_log() { return quant_log_; }

  struct Saved;  // activations kept for backward (model.cpp)

 private:
  friend struct ModelRunner;
  // The weight operand for role under spec, cached until invalidate_weight_cache(); partner: the
  // weight that shares its outer scale (an FFN's w1 and w3).
  Prepared weight(const Tensor& w, const std::string& name, GemmRole role, const QuantSpec& spec,
                  LayerClass cls, const SrStreams& sr, const Tensor* partner);
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
