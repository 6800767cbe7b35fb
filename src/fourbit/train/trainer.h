// defines: PretrainOptions, TrainSummary, pretrain, evaluate
// The pretraining loop: micro-batches from a TokenSource, forward/backward through the Model,
// AdamW with warmup + cosine, clipping and accumulation, eval loss every N steps, metrics.jsonl,
// atomic checkpoints, resume that continues bit for bit, and a summary at the end. A non-finite
// loss, gradient or quantizer input stops the run with an error before anything is saved.
#pragma once
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/model.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit {

struct PretrainOptions {
  RunConfig config;
  std::string recipe = "nvfp4-fwd";
  std::string out_dir;                 // run directory (created); with resume, the resumed run's
  bool resume = false;                 // continue out_dir from its latest checkpoint
  std::optional<int64_t> steps;        // overrides train.steps
  std::optional<uint64_t> seed;        // overrides train.seed
  Device device = Device::CPU;
  bool quiet = false;                  // no progress output (tests)
};

struct TrainSummary {
  std::string run_dir;
  std::string recipe;
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_eval_loss = 0;
  double unigram_entropy = 0;          // nats per token, of the training targets
  double tokens_per_s = 0;
  double wall_s = 0;
  int64_t params = 0;
  std::map<std::string, int64_t> saved_bytes;  // activation bytes kept for backward, per category
  nlohmann::json to_json() const;
};

TrainSummary pretrain(const PretrainOptions& opt);

// Mean cross-entropy over `batches` fixed batches of the eval split.
double evaluate(Model& m, const RunConfig& cfg, int64_t batches, uint64_t seed);

}  // namespace fourbit
