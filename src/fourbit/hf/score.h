// defines: ScoreResult, score_tokens, scoring_model
// `fourbit score`: a run's logits for one token sequence, so fourbit can be compared with any other
// implementation of the same weights (transformers on an export, an inference engine).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fourbit/model/model.h"

namespace fourbit::hf {

struct ScoreResult {
  Tensor logits;                 // F32 [T, V], CPU: position t's next-token logits
  std::vector<float> logprobs;   // [T - 1]: log p(tokens[t + 1] | tokens[..t]), from the logits in double
  double mean_nll = 0;           // -mean(logprobs) (0 for one token)
};

// One causal forward over `tokens` (at most max_seq_len of them) with no activations kept.
ScoreResult score_tokens(Model& m, const std::vector<int32_t>& tokens);

// The model `fourbit score` runs: recipe "" = the run's own (its training forward, bit for bit);
// "fp32" = the run's effective weights (effective.h) in FP32 with unquantized activations, which
// is what an engine holding the `hf --dtype f32` export computes; any other recipe = the run's
// weights under that recipe.
std::unique_ptr<Model> scoring_model(const std::string& run_dir, std::optional<int64_t> step,
                                     const std::string& recipe, Device device);

}  // namespace fourbit::hf
