// defines: rollouts, problems, evaluate_greedy, forward_logprobs (rollout.h)
#include "fourbit/rl/rollout.h"

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"

namespace fourbit::rl {

std::vector<Rollout> rollouts(Sampler& sampler, const Task& task, const std::vector<Problem>& problems,
                              int64_t group, const SamplingOptions& opt) {
  std::vector<std::vector<int32_t>> prompts;
  for (const Problem& p : problems) prompts.push_back(prompt_tokens(p));
  std::vector<Completion> done = sampler.sample_groups(prompts, group, opt);
  std::vector<Rollout> out(done.size());
  for (size_t i = 0; i < done.size(); ++i) {
    out[i].problem = int64_t(i) / group;
    out[i].score = task.score(problems[size_t(out[i].problem)], done[i].tokens);
    out[i].completion = std::move(done[i]);
  }
  return out;
}

std::vector<Problem> problems(const Task& task, uint64_t seed, Split split, uint64_t first, int64_t count) {
  std::vector<Problem> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(task.problem(seed, split, first + uint64_t(i)));
  return out;
}

EvalResult evaluate_greedy(Sampler& sampler, const Task& task, uint64_t seed, int64_t count, int64_t max_new) {
  const std::vector<Problem> ps = problems(task, seed, Split::Eval, 0, count);
  std::vector<SampleRequest> requests;
  for (size_t i = 0; i < ps.size(); ++i) requests.push_back(SampleRequest{prompt_tokens(ps[i]), uint64_t(i)});
  SamplingOptions opt;
  opt.temperature = 0;
  opt.max_new = max_new;
  const std::vector<Completion> done = sampler.sample(requests, opt);
  EvalResult r;
  for (size_t i = 0; i < done.size(); ++i) {
    const Score s = task.score(ps[i], done[i].tokens);
    r.problems += 1;
    r.correct += s.reward > 0 ? 1 : 0;
    r.well_formed += s.well_formed ? 1 : 0;
  }
  return r;
}

std::vector<float> forward_logprobs(Model& model, const std::vector<int32_t>& prompt,
                                    const std::vector<int32_t>& completion, const SrStreams& sr) {
  if (prompt.empty() || completion.empty()) fail("forward_logprobs: needs a prompt and at least one completion token");
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), completion.begin(), completion.end() - 1);
  const int64_t T = int64_t(seq.size()), P = int64_t(prompt.size()), n = int64_t(completion.size());
  const Tensor tokens = Tensor::from_host(seq.data(), {1, T}, DType::I32, model.device());
  const Tensor logits = model.logits(tokens, sr, /*as_trainer=*/true);
  // targets: the completion tokens at the positions that predict them, -1 (ignored) elsewhere
  std::vector<int32_t> tg(size_t(T), -1);
  for (int64_t i = 0; i < n; ++i) tg[size_t(P - 1 + i)] = completion[size_t(i)];
  const Tensor targets = Tensor::from_host(tg.data(), {T}, DType::I32, model.device());
  Tensor losses = Tensor::empty({T}, DType::F32, model.device());
  ops::cross_entropy(logits, targets, losses, nullptr, 0.0);
  const Tensor h = losses.to(Device::CPU);
  std::vector<float> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(-h.data<float>()[P - 1 + i]);
  return out;
}

}  // namespace fourbit::rl
