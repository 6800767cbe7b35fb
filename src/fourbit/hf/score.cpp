// defines: score_tokens, scoring_model (score.h)
#include "fourbit/hf/score.h"

#include <cmath>

#include "fourbit/hf/effective.h"
#include "fourbit/tensor/error.h"

namespace fourbit::hf {

ScoreResult score_tokens(Model& m, const std::vector<int32_t>& tokens) {
  const int64_t T = int64_t(tokens.size()), V = m.config().vocab_size;
  if (T == 0) fail("score: no tokens to score");
  if (T > m.config().max_seq_len)
    fail("score: {} tokens exceed the model's max_seq_len {}", T, m.config().max_seq_len);
  for (int64_t t = 0; t < T; ++t)
    if (tokens[size_t(t)] < 0 || tokens[size_t(t)] >= V)
      fail("score: token {} at position {} is outside the vocabulary [0, {})", tokens[size_t(t)], t, V);
  const Tensor ids = Tensor::from_host(tokens.data(), {1, T}, DType::I32, m.device());
  ScoreResult r;
  r.logits = m.logits(ids, SrStreams{}).to(Device::CPU);
  const float* lg = r.logits.data<float>();
  double nll = 0;
  for (int64_t t = 0; t + 1 < T; ++t) {
    const float* row = lg + t * V;
    double mx = row[0];
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
    double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - mx);
    const double lp = double(row[tokens[size_t(t + 1)]]) - mx - std::log(z);
    r.logprobs.push_back(float(lp));
    nll -= lp;
  }
  r.mean_nll = T > 1 ? nll / double(T - 1) : 0.0;
  return r;
}

std::unique_ptr<Model> scoring_model(const std::string& run_dir, std::optional<int64_t> step,
                                     const std::string& recipe, Device device) {
  if (recipe != "fp32") return std::move(load_run(run_dir, step, recipe, device).model);
  // Effective weights come from the run's own recipe, on the CPU (the exact dequantization).
  LoadedRun run = load_run(run_dir, step, "", Device::CPU);
  return model_from_weights(effective_weights(*run.model), "fp32", device);
}

}  // namespace fourbit::hf
