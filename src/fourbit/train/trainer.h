// defines: PretrainOptions, PretrainSource, pretrain, evaluate
// Pretraining on the training loop (loop.h): micro-batch k of step s is batch s * grad_accum + k
// of the data's train split, every target carries loss, and the eval loss is the mean
// cross-entropy over train.eval_batches fixed batches of the eval split. The loop does the rest
// (run directory, resume, signals, checkpoints, metrics, summary).
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/model.h"
#include "fourbit/train/data.h"
#include "fourbit/train/loop.h"

namespace fourbit {

using PretrainOptions = LoopOptions;

class PretrainSource : public TrainingSource {
 public:
  PretrainSource() = default;
  std::string describe() const override;
  nlohmann::json record() const override { return {{"kind", "pretrain"}}; }
  void start(Model& model, const RunConfig& config) override;
  MicroBatch micro_batch(const StepContext& ctx, int64_t micro) override;
  void evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) override;
  void summarize(nlohmann::json& summary) override;

 private:
  RunConfig cfg_;
  std::unique_ptr<data::TokenSource> train_;
  double unigram_entropy_ = 0;
};

// The data source of a config, with its errors prefixed by where data.source came from
// ("--data: data.source 'text:/tmp': /tmp: is a directory, expected a data file").
std::unique_ptr<data::TokenSource> open_token_source(const RunConfig& cfg, data::Split split);

TrainSummary pretrain(const PretrainOptions& opt);

// Mean cross-entropy over batches 0 .. batches-1 (batches >= 1) of the eval split.
double evaluate(Model& m, const RunConfig& cfg, int64_t batches, uint64_t seed);

}  // namespace fourbit
