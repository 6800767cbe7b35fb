// defines: RlOptions, RlSource, group_advantages, k3
// On-policy RL on the training loop (train/loop.h). Step s:
//   before_step  problems s * P .. s * P + P - 1 of the task's train split (seed = the run's), G
//                samples of each through the sampler with the weights the step updates (the
//                prepared weights the trainer's forward then reuses: quantized once per step),
//                scored; advantage = reward - group mean (optionally / group std); rollouts cut
//                into micro-batches of train.batch_size sequences. With sample_rounds R > 1
//                (dynamic sampling), rounds of P more problems until P groups have differing
//                rewards, and only those are trained on.
//   micro-batch  prompt + completion per row, targets on the completion, weight = advantage
//                (+ kl_coef * (pi_ref / pi - 1), the gradient of k3 when it is in the loss),
//                loss_weight = the micro-batch's share of the step's completion tokens: the
//                token-mean of -A * log pi over the step, one optimizer step per batch.
//   forward      every completion token's log-prob recomputed by the training forward is
//                compared with the sampler's, bit for bit (logprob_mismatch_*).
//   update       skipped (weights and moments unchanged) when the loss has no gradient: every
//                group's rewards equal, and no KL or load-balance term in the loss.
//   after_step   metrics (docs/post-training.md lists them), every rollout to samples.jsonl.
//   evaluate     greedy accuracy on the task's held-out problems (the same set for every seed).
// Rollouts are a pure function of (seed, step, weights), so a resume continues bit for bit.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fourbit/rl/rollout.h"
#include "fourbit/rl/task.h"
#include "fourbit/rl/weight_codes.h"
#include "fourbit/train/loop.h"

namespace fourbit::rl {

struct RlOptions {
  std::string task;
  int64_t prompts = 16;        // P problems per step
  int64_t group = 8;           // G samples of each (>= 2)
  double temperature = 1.0;    // > 0; 1 samples the policy itself
  int64_t max_new = 16;        // completion tokens at most (<eos> included)
  bool std_normalize = false;  // divide advantages by the group's reward std
  // Dynamic sampling: up to R rounds of P problems per step, stopping once P groups have
  // differing rewards; only those P groups are trained on (groups whose rewards are all equal
  // carry no gradient). 1: the P groups drawn, whatever their rewards.
  int64_t sample_rounds = 1;
  std::optional<double> kl_coef;  // set: k3 KL to the initial policy logged; > 0: also in the loss
  // The MoE load-balance loss's coefficient in RL's updates (Model::set_aux_loss_coef), in place
  // of the config's model.aux_loss_coef. Default 0: the routing was balanced by pretraining, and
  // with few rollouts carrying reward the balance term alone would steer Adam's full-size steps.
  double aux_loss_coef = 0;
  int64_t eval_problems = 200;    // held-out problems per evaluation
  // Where the KL reference's weights come from: "" = the weights at start() (a new run's --init
  // weights); a checkpoint directory on resume (the run record's init checkpoint).
  std::string reference_checkpoint;
};

class RlSource : public TrainingSource {
 public:
  explicit RlSource(RlOptions opt);
  ~RlSource() override;
  std::string describe() const override;
  nlohmann::json record() const override;
  std::vector<std::string> side_outputs() const override { return {"samples.jsonl"}; }
  void start(Model& model, const RunConfig& config) override;
  void before_step(const StepContext& ctx, Model& model) override;
  int64_t micro_batches(const StepContext& ctx) const override;
  MicroBatch micro_batch(const StepContext& ctx, int64_t micro) override;
  void micro_batch_done(const StepContext& ctx, int64_t micro, const ForwardStats& stats) override;
  bool update_weights(const StepContext& ctx) const override;
  void after_step(const StepContext& ctx, Model& model, nlohmann::json& line) override;
  void evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) override;

 private:
  RlOptions opt_;
  std::unique_ptr<Task> task_;
  std::unique_ptr<Model> reference_;  // the initial policy, when kl_coef is set
  RunConfig cfg_;
  // The step at hand.
  std::vector<Problem> drawn_problems_;  // every round's problems
  std::vector<Rollout> drawn_;           // G rollouts of each, .problem indexing drawn_problems_
  std::vector<char> trained_;            // per drawn rollout: in the trainer's batch
  std::vector<Problem> problems_;        // the trained groups' problems
  std::vector<Rollout> rollouts_;        // the trained rollouts, .problem indexing problems_
  std::vector<double> advantages_;
  std::vector<MicroBatch> micro_;
  std::vector<std::vector<size_t>> micro_rows_;  // rollouts of each micro-batch
  nlohmann::json fields_;                        // metrics gathered before the update
  bool has_signal_ = false;                      // some group's rewards differ
  double mismatch_max_ = 0;
  int64_t mismatch_tokens_ = 0;
  WeightCodes codes_;                            // NVFP4 codes of the weights the step started from
  std::optional<double> init_accuracy_;
};

// reward - mean of its group (of `group` consecutive rewards), divided by the group's standard
// deviation (population, + 1e-6) when std_normalize; zero for a group whose rewards are equal.
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group, bool std_normalize);

// The k3 estimator of KL(pi || pi_ref) for a token sampled from pi: r - 1 - log r with
// r = pi_ref / pi = exp(ref_logprob - logprob) (Schulman's "Approximating KL divergence").
inline double k3(double logprob, double ref_logprob) {
  const double d = ref_logprob - logprob;
  return std::exp(d) - 1.0 - d;
}

}  // namespace fourbit::rl
