// defines: MicroBatch, StepContext, TrainingSource, LoopOptions, TrainSummary, run_training,
//          recipe_coverage
// The one training loop of pretrain, sft and rl. Everything a run does besides deciding what to
// learn from is here, written once: the run directory (refusing to overwrite, --force, the run
// record and its resume entries), weights from scratch, from a checkpoint (resume, bit for bit)
// or from another run (--init), the LR schedule and its extension, micro-batch accumulation,
// non-finite checks, the optimizer, metrics.jsonl and side outputs, evaluation, progress,
// atomic checkpoints with pruning, SIGINT/SIGTERM, and summary.json.
//
// What differs between the three commands is a TrainingSource: which tokens each micro-batch
// holds, which targets carry loss and with what weight, what happens before a step (RL samples
// rollouts with the current weights), which extra metrics a step reports and how the model is
// evaluated. Order of the calls for step s (0-based; metrics and checkpoints call it s + 1):
//
//   before_step(ctx, model)                       the weights step s will update
//   for micro in 0 .. micro_batches(ctx) - 1:
//     micro_batch(ctx, micro) -> forward (loss_weight, per-token weights) -> backward queued
//     micro_batch_done(ctx, micro, forward's stats)  (its loss read back once the backward is queued)
//   optimizer update (lr = the schedule's rate for s), unless update_weights(ctx) says no
//   after_step(ctx, model, line)                  add fields to the step's metrics line
//   evaluate(ctx, model, line)                    every train.eval_every steps and the last
//   metrics.jsonl gets `line`; a checkpoint when due, at the last step, or on a stop signal
//
// Resume is bit for bit when the source's batches are a pure function of (seed, step, micro)
// and of the weights (as RL's samples are) or when state()/restore() carry what else it keeps.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/model.h"

namespace fourbit {

// One micro-batch. Tokens and targets may live on any device (the loop moves them).
struct MicroBatch {
  Tensor tokens;   // I32 [B, T]
  Tensor targets;  // I32 [B, T]: the next token, or -1 where no loss is taken (prompt, padding)
  // Optional F32 [B, T]: each target's weight on its cross-entropy (SFT: none, the -1 targets
  // mask; RL: the advantage of the rollout the token belongs to). Undefined = all 1.
  Tensor weights;
  // This micro-batch's share of the step's loss: its gradient is of
  //   loss_weight * sum_i weights_i * CE_i / (its number of targets != -1).
  // Default 1 / micro_batches: the mean over micro-batches of their mean losses. RL's token-mean
  // over a whole step uses n_valid(micro) / n_valid(step).
  std::optional<float> loss_weight;
};

class JsonlLog;

// What a source may know about the step at hand.
struct StepContext {
  int64_t step = 0;         // 0-based index of this optimizer step
  int64_t total_steps = 0;  // the run's length
  uint64_t seed = 0;        // the run's seed (data, SR and sampling streams derive from it)
  double lr = 0;            // this step's learning rate
  const RunConfig* config = nullptr;
  Device device = Device::CPU;
  // Seconds this step spent in forward + backward and in the optimizer update (set before
  // after_step; the device is synchronised by the loss and the gradient norm the loop reads).
  double fwd_bwd_s = 0, optimizer_s = 0;
  // Appends `line` (with "step": step + 1 set) to the side output `file`, one of the source's
  // side_outputs(). Only seed-determined content belongs there if runs are to be comparable.
  void write(const std::string& file, nlohmann::json line) const;
  std::map<std::string, JsonlLog*>* outputs = nullptr;  // the loop's open side outputs
};

class TrainingSource {
 public:
  virtual ~TrainingSource();
  // One line for the run's header: what the batches are ("synthetic (train split) ...").
  virtual std::string describe() const = 0;
  // What the run record keeps about this source ({"kind": "pretrain"} at least). A resume builds
  // the source again from its command line and must give an equal record; each differing key is
  // named in the error.
  virtual nlohmann::json record() const = 0;
  // JSON-lines files under the run directory that the source writes through ctx.write; a resume
  // truncates them to its step like metrics.jsonl.
  virtual std::vector<std::string> side_outputs() const { return {}; }
  // Once, with the weights in place (fresh, resumed or --init), before the first step.
  virtual void start(Model& model, const RunConfig& config) {
    (void)model;
    (void)config;
  }
  // Before step ctx.step, with the weights that step updates (RL: sample the rollouts here).
  virtual void before_step(const StepContext& ctx, Model& model) {
    (void)ctx;
    (void)model;
  }
  // How many micro-batches step ctx.step accumulates (default train.grad_accum).
  virtual int64_t micro_batches(const StepContext& ctx) const { return ctx.config->train.grad_accum; }
  virtual MicroBatch micro_batch(const StepContext& ctx, int64_t micro) = 0;
  // After the training forward of micro-batch `micro` and with its backward queued (the host reads
  // the loss back behind it): the forward's stats, with each position's cross-entropy (RL compares
  // them with the sampler's log-probs).
  virtual void micro_batch_done(const StepContext& ctx, int64_t micro, const ForwardStats& stats) {
    (void)ctx;
    (void)micro;
    (void)stats;
  }
  // After the micro-batches, before the optimizer: whether this step updates the weights. false
  // leaves weights and optimizer moments as they are (no momentum or weight-decay move either);
  // the step is otherwise a step (metrics, evaluation, checkpoint). RL says no when the step's
  // loss carries no gradient (every group's rewards equal, nothing else in the loss).
  virtual bool update_weights(const StepContext& ctx) const {
    (void)ctx;
    return true;
  }
  // After the optimizer update: extra fields for the step's metrics line (reward, lengths ...).
  virtual void after_step(const StepContext& ctx, Model& model, nlohmann::json& line) {
    (void)ctx;
    (void)model;
    (void)line;
  }
  // Held-out measurements (eval_loss, eval_accuracy ...) into `line`; add nothing when nothing
  // was measured. Called every train.eval_every steps and after the last one; with eval_every 0,
  // once at the end for the summary only.
  virtual void evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) {
    (void)ctx;
    (void)model;
    (void)line;
  }
  // Whatever the source keeps between steps that is not a function of (seed, step, weights):
  // saved in each checkpoint, handed back on resume. Stateless sources keep the defaults.
  virtual nlohmann::json state() const { return nullptr; }
  virtual void restore(const nlohmann::json& state) { (void)state; }
  // Extra fields for summary.json (pretrain: the corpus's unigram entropy).
  virtual void summarize(nlohmann::json& summary) { (void)summary; }
};

struct LoopOptions {
  // The run's config. New run: as given. Resume: what the command line asks for, compared with
  // the run record field by field (train.steps excepted: see `steps`).
  RunConfig config;
  std::string recipe = "nvfp4-fwd";
  std::string out_dir;                 // the run directory
  bool resume = false;                 // continue out_dir from a checkpoint
  bool force = false;                  // new run over an existing directory: move it aside first
  std::string from_checkpoint;         // resume: "step-N" or "N" (default: the newest valid one)
  std::string init_from;               // new run: weights (not moments) of this run or checkpoint
  std::optional<int64_t> steps;        // new run: train.steps; resume: the run's new length
  std::optional<uint64_t> seed;        // new run: train.seed
  Device device = Device::CPU;
  bool quiet = false;                  // no progress or warnings on stderr (tests)
  std::string command = "pretrain";    // the command, for the record and for messages
  std::string command_line;            // recorded in config.json
  std::vector<std::string> overrides;  // the --set assignments, recorded
};

struct TrainSummary {
  std::string run_dir;
  std::string recipe;
  int64_t steps = 0;                         // the run's length
  int64_t steps_done = 0;                    // steps completed (< steps when stopped by a signal)
  std::optional<double> final_train_loss;    // absent when no step ran in this session
  std::optional<double> final_eval_loss;     // absent when nothing was evaluated
  nlohmann::json final_eval = nlohmann::json::object();  // the last evaluation's fields
  std::optional<double> tokens_per_s;
  double wall_s = 0;
  int64_t params = 0;
  std::map<std::string, int64_t> saved_bytes;  // activation bytes kept for backward, per category
  // GPU runs: the micro-batches that ran as a CUDA graph's replay (train.cuda_graphs, StepGraphs)
  std::optional<int64_t> cuda_graph_replays;
  nlohmann::json extra = nlohmann::json::object();  // the source's summary fields
  int stopped_by = 0;          // SIGINT / SIGTERM when a signal stopped the run, else 0
  std::string checkpoint;      // the newest checkpoint this session wrote ("" if none)
  std::vector<std::string> warnings;  // checkpoint fallbacks and the like (printed unless quiet)
  nlohmann::json to_json() const;     // absent measurements are absent keys
};

// Runs (or resumes) a training run with `source` providing the batches. Throws Error for every
// user error, naming the file, flag or field. A stop signal ends the loop after the current step
// and its checkpoint: the summary says so (stopped_by) and summary.json is not written.
TrainSummary run_training(const LoopOptions& opt, TrainingSource& source);

// "nvfp4-fwd: 2 of 3 MoE layers in NVFP4 (1 in MXFP8, the recipe's tail)": which format the
// recipe gives the expert weights of each MoE layer of this model.
std::string recipe_coverage(const Recipe& recipe, const ModelConfig& model);

}  // namespace fourbit
