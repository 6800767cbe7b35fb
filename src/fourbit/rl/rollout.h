// defines: Rollout, rollouts, problems, EvalResult, evaluate_greedy, forward_logprobs
// What an RL step (or an evaluation) asks of the sampler and a task, in one call each.
// rollouts(): G samples of each of B problems with the model's current weights, scored; the
// per-token log-probs come from the sampler (sampler.h: the trainer's, bit for bit, for the
// batch-invariant recipes). forward_logprobs(): the trainer's side of that comparison.
#pragma once
#include <cstdint>
#include <vector>

#include "fourbit/rl/sampler.h"
#include "fourbit/rl/task.h"

namespace fourbit::rl {

struct Rollout {
  int64_t problem = 0;  // index into the problems passed
  Completion completion;
  Score score;
};

// problems[i]'s prompt sampled `group` (>= 2) times; result i * G + g (sequence id i * G + g).
std::vector<Rollout> rollouts(Sampler& sampler, const Task& task, const std::vector<Problem>& problems,
                              int64_t group, const SamplingOptions& opt);

// Problems first .. first + count - 1 of a split.
std::vector<Problem> problems(const Task& task, uint64_t seed, Split split, uint64_t first, int64_t count);

struct EvalResult {
  int64_t problems = 0, correct = 0, well_formed = 0;
  double accuracy() const { return problems ? double(correct) / double(problems) : 0.0; }
};
// Greedy answers to eval problems 0 .. count - 1 (max_new tokens each), scored.
EvalResult evaluate_greedy(Sampler& sampler, const Task& task, uint64_t seed, int64_t count, int64_t max_new);

// The trainer's log-prob of every completion token: Model::logits (as_trainer) over prompt + completion
// (without its last token) and -ops::cross_entropy of each completion position, as a float.
std::vector<float> forward_logprobs(Model& model, const std::vector<int32_t>& prompt,
                                    const std::vector<int32_t>& completion, const SrStreams& sr);

}  // namespace fourbit::rl
