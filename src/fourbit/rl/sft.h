// defines: kEvalSeed, kEvalStreams, SftOptions, SftSource, evaluate_tasks
// Supervised fine-tuning on the training loop (train/loop.h): micro-batch k of step s holds
// problems (s * grad_accum + k) * B .. + B - 1 of the tasks' train splits (round-robin over the
// tasks, seed = the run's), one `<bos> prompt <sep> answer <eos>` per row, loss only on the answer
// and its <eos>. Evaluation: greedy held-out accuracy per task through the sampler, and the
// cross-entropy of the reference answers of the same problems.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fourbit/rl/task.h"
#include "fourbit/train/loop.h"

namespace fourbit::rl {

// The seed of every evaluation's problems: the same held-out set whatever the run's seed, so runs
// with different seeds are scored on the same problems.
inline constexpr uint64_t kEvalSeed = 0;
// The streams of evaluation forwards (forward quantizers round to nearest: only fixed keys matter).
inline constexpr SrStreams kEvalStreams{0xE7A1u, 0, 0};

struct SftOptions {
  std::vector<std::string> tasks;  // at least one
  int64_t eval_problems = 200;     // held-out problems per task and evaluation
  int64_t eval_max_new = 16;       // greedy answer length at most (<eos> included)
};

class SftSource : public TrainingSource {
 public:
  explicit SftSource(SftOptions opt);
  std::string describe() const override;
  nlohmann::json record() const override;
  void start(Model& model, const RunConfig& config) override;
  MicroBatch micro_batch(const StepContext& ctx, int64_t micro) override;
  void evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) override;

 private:
  SftOptions opt_;
  std::vector<std::unique_ptr<Task>> tasks_;
  RunConfig cfg_;
};

// Held-out fields of every task into `line`: eval_accuracy_<task spec> (greedy, exact answers),
// eval_accuracy (their mean) and eval_loss (mean cross-entropy of the reference answers' tokens,
// <eos> included, over all tasks' problems).
void evaluate_tasks(Model& model, const std::vector<const Task*>& tasks, int64_t problems, int64_t max_new,
                    nlohmann::json& line);

}  // namespace fourbit::rl
