// defines: RlSource, group_advantages (policy_gradient.h)
#include "fourbit/rl/policy_gradient.h"

#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "fourbit/rl/sft.h"
#include "fourbit/rl/task_batch.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/tokenizer.h"

namespace fourbit::rl {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0, Device device) {
  if (device == Device::CUDA) device_synchronize();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The entropy (nats) of softmax(logits), in double.
double entropy_of(const float* logits, int64_t V) {
  double mx = logits[0];
  for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(logits[v]));
  double z = 0, s = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double e = std::exp(double(logits[v]) - mx);
    z += e;
    s += e * (double(logits[v]) - mx);
  }
  return std::log(z) - s / z;
}

// A completion as JSON-safe text: ASCII as itself, other bytes as <0xNN> (a sampled byte need
// not be valid UTF-8), specials as <eos>, <bos> ...
std::string completion_text(const std::vector<int32_t>& tokens) {
  std::string out;
  for (const int32_t t : tokens) {
    if (t >= 0 && t < 0x80) out.push_back(char(t));
    else if (t >= 0x80 && t < 256) out += fmt::format("<0x{:02X}>", t);
    else out += data::token_text(t);
  }
  return out;
}

// The row of a rollout: prompt + completion, targets on the completion.
TaskRow rollout_row(const Problem& p, const Rollout& r) {
  TaskRow row;
  row.sequence = prompt_tokens(p);
  row.answer_start = int64_t(row.sequence.size());
  row.sequence.insert(row.sequence.end(), r.completion.tokens.begin(), r.completion.tokens.end());
  return row;
}

}  // namespace

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group, bool std_normalize) {
  if (group < 2 || rewards.size() % size_t(group) != 0)
    fail("group advantages: {} rewards do not form groups of {}", rewards.size(), group);
  std::vector<double> out(rewards.size());
  for (size_t g0 = 0; g0 < rewards.size(); g0 += size_t(group)) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < group; ++i) mean += rewards[g0 + size_t(i)];
    mean /= double(group);
    for (int64_t i = 0; i < group; ++i) var += (rewards[g0 + size_t(i)] - mean) * (rewards[g0 + size_t(i)] - mean);
    const double scale = std_normalize ? 1.0 / (std::sqrt(var / double(group)) + 1e-6) : 1.0;
    for (int64_t i = 0; i < group; ++i) out[g0 + size_t(i)] = var == 0 ? 0.0 : (rewards[g0 + size_t(i)] - mean) * scale;
  }
  return out;
}

RlSource::RlSource(RlOptions opt) : opt_(std::move(opt)) {
  if (opt_.prompts < 1) fail("--prompts: expected at least 1 problem per step, got {}", opt_.prompts);
  if (opt_.group < 2)
    fail("--group: expected at least 2 samples per problem (the baseline is the group's mean reward), got {}",
         opt_.group);
  if (!(opt_.temperature > 0))
    fail("--temperature: RL samples the policy; expected a temperature > 0, got {}", opt_.temperature);
  if (opt_.max_new < 1) fail("--max-new: expected at least 1 token, got {}", opt_.max_new);
  if (opt_.kl_coef && !(*opt_.kl_coef >= 0 && std::isfinite(*opt_.kl_coef)))
    fail("--kl-coef: expected a finite value >= 0, got {}", *opt_.kl_coef);
  if (opt_.eval_problems < 1) fail("--eval-problems: expected at least 1, got {}", opt_.eval_problems);
  if (opt_.sample_rounds < 1)
    fail("--sample-rounds: expected at least 1 round of {} problems per step, got {}", opt_.prompts,
         opt_.sample_rounds);
  if (!(opt_.aux_loss_coef >= 0 && std::isfinite(opt_.aux_loss_coef)))
    fail("--aux-loss-coef: expected a finite value >= 0, got {}", opt_.aux_loss_coef);
  task_ = make_task(opt_.task);
}

RlSource::~RlSource() = default;

std::string RlSource::describe() const {
  return fmt::format("rl on {} ({}): {} problems x {} samples per step, temperature {}, max {} new tokens, "
                     "load-balance loss coefficient {}{}{}{}",
                     task_->spec(), task_->description(), opt_.prompts, opt_.group, opt_.temperature, opt_.max_new,
                     opt_.aux_loss_coef,
                     opt_.sample_rounds > 1
                         ? fmt::format(", up to {} sampling rounds for {} groups with differing rewards",
                                       opt_.sample_rounds, opt_.prompts)
                         : "",
                     opt_.std_normalize ? ", std-normalized advantages" : "",
                     opt_.kl_coef ? fmt::format(", k3 KL coefficient {}", *opt_.kl_coef) : "");
}

nlohmann::json RlSource::record() const {
  nlohmann::json r = {{"kind", "rl"},
                      {"task", task_->spec()},
                      {"prompts", opt_.prompts},
                      {"group", opt_.group},
                      {"temperature", opt_.temperature},
                      {"max_new", opt_.max_new},
                      {"std_normalize", opt_.std_normalize},
                      {"kl_coef", opt_.kl_coef ? nlohmann::json(*opt_.kl_coef) : nlohmann::json(nullptr)},
                      {"aux_loss_coef", opt_.aux_loss_coef},
                      {"eval_problems", opt_.eval_problems},
                      {"eval_seed", kEvalSeed}};
  // recorded only when on, so that runs from before the option resume unchanged
  if (opt_.sample_rounds > 1) r["sample_rounds"] = opt_.sample_rounds;
  return r;
}

void RlSource::start(Model& model, const RunConfig& config) {
  cfg_ = config;
  model.set_aux_loss_coef(opt_.aux_loss_coef);
  check_fits_context(*task_, cfg_.model, cfg_.train.seed, kEvalSeed, std::max<int64_t>(opt_.eval_problems, 256), false);
  if (opt_.kl_coef) {
    reference_ = std::make_unique<Model>(cfg_.model, model.recipe(), model.device());
    if (opt_.reference_checkpoint.empty()) reference_->params().flat().copy_from(model.params().flat());
    else load_checkpoint(opt_.reference_checkpoint, reference_->params(), nullptr, nullptr);
  }
  codes_ = nvfp4_weight_codes(model);
}

void RlSource::before_step(const StepContext& ctx, Model& model) {
  const Device dev = model.device();
  if (ctx.step == 0) {
    Sampler eval(model, kEvalStreams);
    init_accuracy_ = evaluate_greedy(eval, *task_, kEvalSeed, opt_.eval_problems, opt_.max_new).accuracy();
  }
  fields_ = nlohmann::json::object();
  mismatch_max_ = 0;
  mismatch_tokens_ = 0;

  // ---- sample G completions of P problems with the weights this step updates ----
  // Round r of step s draws problems (s * R + r) * P ... of the train split (s * P ... when
  // R = 1) with sequence ids (r * P + i) * G + g, so every round's draws are new and a step's
  // rollouts stay a pure function of (seed, step, weights). With R > 1 the rounds stop once P
  // groups have differing rewards, and only those (the first P) are trained on.
  const int64_t P = opt_.prompts, G = opt_.group, R = opt_.sample_rounds;
  SamplingOptions so;
  so.temperature = opt_.temperature;
  so.max_new = opt_.max_new;
  so.seed = ctx.seed;
  so.step = uint64_t(ctx.step);
  so.keep_logits = true;  // the entropy below
  Sampler sampler(model, SrStreams{ctx.seed, uint64_t(ctx.step), 0});
  drawn_problems_.clear();
  drawn_.clear();
  double sample_s = 0, reward_s = 0;
  int64_t informative = 0;
  std::vector<char> group_informative;  // per drawn group: its rewards differ
  for (int64_t r = 0; r < R && (r == 0 || informative < P); ++r) {
    const std::vector<Problem> round = problems(*task_, ctx.seed, Split::Train, uint64_t((ctx.step * R + r) * P), P);
    std::vector<std::vector<int32_t>> prompts;
    for (const Problem& p : round) prompts.push_back(prompt_tokens(p));
    auto t0 = Clock::now();
    std::vector<Completion> done = sampler.sample_groups(prompts, G, so, uint64_t(r * P * G));
    sample_s += seconds_since(t0, dev);
    t0 = Clock::now();
    const size_t first = drawn_.size();
    for (size_t i = 0; i < done.size(); ++i) {
      Rollout ro;
      ro.problem = int64_t(drawn_problems_.size() + i / size_t(G));
      ro.score = task_->score(round[i / size_t(G)], done[i].tokens);
      ro.completion = std::move(done[i]);
      drawn_.push_back(std::move(ro));
    }
    reward_s += seconds_since(t0, dev);
    drawn_problems_.insert(drawn_problems_.end(), round.begin(), round.end());
    for (int64_t p = 0; p < P; ++p) {
      bool same = true;
      const size_t at = first + size_t(p * G);
      for (int64_t g = 1; g < G; ++g) same = same && drawn_[at + size_t(g)].score.reward == drawn_[at].score.reward;
      informative += !same;
      group_informative.push_back(!same);
    }
  }

  // What the sampled rollouts say about the policy (all of them), then the groups trained on.
  const int64_t V = cfg_.model.vocab_size;
  double entropy_sum = 0, reward_sum = 0;
  int64_t tokens = 0;
  for (Rollout& ro : drawn_) {
    Completion& c = ro.completion;
    for (size_t t = 0; t < c.tokens.size(); ++t) entropy_sum += entropy_of(c.logits.data() + t * size_t(V), V);
    tokens += int64_t(c.tokens.size());
    reward_sum += ro.score.reward;
    c.logits = {};
  }
  trained_.assign(drawn_.size(), R == 1);
  if (R > 1) {
    int64_t kept = 0;
    for (size_t grp = 0; grp < group_informative.size() && kept < P; ++grp) {
      if (!group_informative[grp]) continue;
      for (int64_t g = 0; g < G; ++g) trained_[grp * size_t(G) + size_t(g)] = true;
      ++kept;
    }
    // No group with a signal in any round: the first round goes through the trainer anyway (its
    // log-prob check), with a zero gradient and no update.
    if (kept == 0) std::fill(trained_.begin(), trained_.begin() + P * G, char(1));
  }
  problems_.clear();
  rollouts_.clear();
  std::vector<double> rewards;
  for (size_t i = 0; i < drawn_.size(); i += size_t(G)) {
    if (!trained_[i]) continue;
    problems_.push_back(drawn_problems_[size_t(drawn_[i].problem)]);
    for (int64_t g = 0; g < G; ++g) {
      Rollout ro = drawn_[i + size_t(g)];
      ro.problem = int64_t(problems_.size()) - 1;
      rewards.push_back(ro.score.reward);
      rollouts_.push_back(std::move(ro));
    }
  }
  has_signal_ = informative > 0;
  advantages_ = group_advantages(rewards, G, opt_.std_normalize);

  // ---- rows, micro-batches of train.batch_size rollouts ----
  const size_t rows_per = size_t(cfg_.train.batch_size);
  std::vector<TaskRow> rows;
  for (const Rollout& r : rollouts_) rows.push_back(rollout_row(problems_[size_t(r.problem)], r));
  micro_rows_.clear();
  for (size_t first = 0; first < rows.size(); first += rows_per) {
    std::vector<size_t> ids;
    for (size_t i = first; i < std::min(rows.size(), first + rows_per); ++i) ids.push_back(i);
    micro_rows_.push_back(ids);
  }
  // The initial policy's log-probs of the sampled tokens (k3 KL), from its training forward.
  double kl_sum = 0, reference_s = 0;
  if (reference_) {
    const auto t0 = Clock::now();
    for (const std::vector<size_t>& ids : micro_rows_) {
      std::vector<TaskRow> part;
      for (size_t i : ids) part.push_back(rows[i]);
      const MicroBatch b = task_micro_batch(part);
      const ForwardStats st =
          reference_->forward(b.tokens.to(dev), b.targets.to(dev), SrStreams{ctx.seed, uint64_t(ctx.step), 0}, false);
      const Tensor losses = st.token_losses.to(Device::CPU);
      const int64_t T = b.tokens.size(1);
      for (size_t k = 0; k < ids.size(); ++k) {
        TaskRow& row = rows[ids[k]];
        const Completion& c = rollouts_[ids[k]].completion;
        row.weights.resize(c.tokens.size());
        for (size_t j = 0; j < c.tokens.size(); ++j) {
          const double ref = -double(losses.data<float>()[int64_t(k) * T + row.answer_start - 1 + int64_t(j)]);
          const double lp = double(c.logprobs[j]);
          kl_sum += k3(lp, ref);
          // d k3 / d logprob = 1 - pi_ref / pi; the loss's weight w enters as -w * logprob.
          row.weights[j] = float(advantages_[ids[k]] + *opt_.kl_coef * (std::exp(ref - lp) - 1.0));
        }
      }
    }
    reference_s = seconds_since(t0, dev);
  } else {
    for (size_t i = 0; i < rows.size(); ++i) rows[i].weights.assign(rollouts_[i].completion.tokens.size(), float(advantages_[i]));
  }
  int64_t trained_tokens = 0;
  for (const Rollout& r : rollouts_) trained_tokens += int64_t(r.completion.tokens.size());
  micro_.clear();
  for (const std::vector<size_t>& ids : micro_rows_) {
    std::vector<TaskRow> part;
    int64_t n = 0;
    for (size_t i : ids) {
      part.push_back(rows[i]);
      n += int64_t(rollouts_[i].completion.tokens.size());
    }
    MicroBatch b = task_micro_batch(part);
    b.loss_weight = float(double(n) / double(trained_tokens));  // token-mean over the step's trained rollouts
    micro_.push_back(std::move(b));
  }

  fields_["reward"] = reward_sum / double(drawn_.size());
  fields_["zero_variance_groups"] = int64_t(group_informative.size()) - informative;
  if (R > 1) {
    fields_["sampled_groups"] = int64_t(drawn_.size()) / G;
    fields_["trained_groups"] = int64_t(rollouts_.size()) / G;
  }
  fields_["mean_length"] = double(tokens) / double(drawn_.size());
  fields_["entropy"] = entropy_sum / double(tokens);
  if (reference_) {
    fields_["kl"] = trained_tokens ? kl_sum / double(trained_tokens) : 0.0;
    fields_["reference_s"] = reference_s;
  }
  fields_["sampled_tokens"] = tokens;
  fields_["sample_s"] = sample_s;
  fields_["reward_s"] = reward_s;
  fields_["sampled_tokens_per_s"] = sample_s > 0 ? double(tokens) / sample_s : 0.0;
}

int64_t RlSource::micro_batches(const StepContext& ctx) const {
  (void)ctx;
  return int64_t(micro_.size());
}

MicroBatch RlSource::micro_batch(const StepContext& ctx, int64_t micro) {
  (void)ctx;
  return micro_.at(size_t(micro));
}

void RlSource::micro_batch_done(const StepContext& ctx, int64_t micro, const ForwardStats& stats) {
  (void)ctx;
  // The trainer's log-prob of each sampled token: its per-position cross-entropy, negated,
  // against the sampler's (the same op on what must be the same logits row).
  const Tensor losses = stats.token_losses.to(Device::CPU);
  const std::vector<size_t>& ids = micro_rows_.at(size_t(micro));
  const int64_t T = micro_[size_t(micro)].tokens.size(1);
  for (size_t k = 0; k < ids.size(); ++k) {
    const Rollout& r = rollouts_[ids[k]];
    const int64_t start = int64_t(prompt_tokens(problems_[size_t(r.problem)]).size());
    for (size_t j = 0; j < r.completion.tokens.size(); ++j) {
      const float trainer = -losses.data<float>()[int64_t(k) * T + start - 1 + int64_t(j)];
      const float sampler = r.completion.logprobs[j];
      if (std::memcmp(&trainer, &sampler, sizeof(float)) != 0) {
        mismatch_tokens_ += 1;
        mismatch_max_ = std::max(mismatch_max_, std::abs(double(trainer) - double(sampler)));
      }
    }
  }
}

bool RlSource::update_weights(const StepContext& ctx) const {
  (void)ctx;
  // With equal rewards in every group each advantage is 0, and so is the gradient unless a KL
  // or load-balance term is in the loss: an optimizer step would only replay Adam's momentum
  // (and weight decay) with no evidence behind it.
  return has_signal_ || (opt_.kl_coef && *opt_.kl_coef > 0) || opt_.aux_loss_coef > 0;
}

void RlSource::after_step(const StepContext& ctx, Model& model, nlohmann::json& line) {
  for (const auto& [k, v] : fields_.items()) line[k] = v;
  line["updated"] = update_weights(ctx);
  line["logprob_mismatch_max"] = mismatch_max_;
  line["logprob_mismatch_tokens"] = mismatch_tokens_;
  line["fwd_bwd_s"] = ctx.fwd_bwd_s;
  line["optimizer_s"] = ctx.optimizer_s;
  if (ctx.step == 0 && init_accuracy_) line["init_eval_accuracy"] = *init_accuracy_;
  // How many NVFP4 weight codes the update moved (absent for recipes without NVFP4 weights).
  WeightCodes after = nvfp4_weight_codes(model);
  if (!after.empty()) line["weight_codes_changed"] = fraction_changed(codes_, after);
  codes_ = std::move(after);
  for (size_t i = 0; i < drawn_.size(); ++i) {
    const Rollout& r = drawn_[i];
    nlohmann::json s = {{"prompt", drawn_problems_[size_t(r.problem)].prompt},
                        {"completion", completion_text(r.completion.tokens)},
                        {"reward", r.score.reward},
                        {"finish", finish_name(r.completion.finish)}};
    if (opt_.sample_rounds > 1) s["trained"] = bool(trained_[i]);
    ctx.write("samples.jsonl", s);
  }
}

void RlSource::evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) {
  (void)ctx;
  Sampler sampler(model, kEvalStreams);
  const EvalResult r = evaluate_greedy(sampler, *task_, kEvalSeed, opt_.eval_problems, opt_.max_new);
  line["eval_accuracy"] = r.accuracy();
  line["eval_well_formed"] = double(r.well_formed) / double(r.problems);
}

}  // namespace fourbit::rl
