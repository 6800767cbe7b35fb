// defines: post_config, FirstDigitTask, register_first_digit, sft_options, rl_options, run_sft,
//          sft_then_rl_config, metrics_lines, without_timings (helpers for tests/rl's SFT and RL tests)
// A 3-layer MoE (dense, NVFP4 under nvfp4-fwd, the MXFP8 tail) small enough that a few SFT and RL steps take well under a second each: SFT
// teaches it the answer format (digits then <eos>), and the `first_digit` task (reward 1 when
// the answer's first digit is right) then gives groups with unequal rewards to learn from.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/rl/policy_gradient.h"
#include "fourbit/rl/sft.h"
#include "fourbit/rl/tasks.h"
#include "fourbit/train/loop.h"
#include "model/model_test_util.h"

namespace fourbit::rltest {

inline RunConfig post_config() {
  RunConfig c = modeltest::tiny_run_config(3, 32);
  c.model.d_expert = 32;
  c.model.max_seq_len = 24;
  c.train.batch_size = 16;
  c.train.seq_len = 24;
  c.train.steps = 30;
  c.train.lr = 1e-2;
  c.train.warmup_steps = 2;
  c.train.eval_every = 0;
  c.train.checkpoint_every = 0;
  return c;
}

// "47+38=" -> "85"; reward 1 when a well-formed number starts with the right digit.
class FirstDigitTask : public rl::Task {
 public:
  std::string name() const override { return "first_digit"; }
  std::string description() const override { return "two-digit sums, rewarded on the first digit"; }

 protected:
  rl::Problem draw(const std::function<uint32_t()>& rand) const override {
    const uint32_t a = 10 + rl::draw_below(rand, 90), b = 10 + rl::draw_below(rand, 90);
    const std::string prompt = std::to_string(a) + "+" + std::to_string(b) + "=";
    return rl::Problem{prompt, std::to_string(a + b), prompt};
  }
  std::string format_error(std::string_view text) const override {
    if (text.empty() || !std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      return "not a number";
    return "";
  }
  rl::Score check(const rl::Problem& p, std::string_view text) const override {
    if (const std::string e = format_error(text); !e.empty()) return rl::Score{0, false, e};
    const bool right = text[0] == p.answer[0];
    return rl::Score{right ? 1.0 : 0.0, true, right ? "correct" : "wrong answer"};
  }
};

inline void register_first_digit() {
  const std::vector<std::string> names = rl::task_names();
  if (std::find(names.begin(), names.end(), "first_digit") == names.end())
    rl::register_task("first_digit", [] { return std::make_unique<FirstDigitTask>(); });
}

inline LoopOptions loop_options(const RunConfig& cfg, const std::string& dir, const std::string& recipe,
                                const std::string& command) {
  LoopOptions o;
  o.config = cfg;
  o.recipe = recipe;
  o.out_dir = dir;
  o.command = command;
  o.quiet = true;
  return o;
}

inline rl::RlOptions rl_options() {
  rl::RlOptions o;
  o.task = "first_digit";
  o.prompts = 4;
  o.group = 4;
  o.max_new = 4;
  o.eval_problems = 8;
  return o;
}

// An SFT run of `steps` steps on `add` from fresh weights into dir (the RL tests' --init).
inline void run_sft(const std::string& dir, const std::string& recipe, int64_t steps) {
  RunConfig cfg = post_config();
  cfg.train.steps = steps;
  rl::SftOptions so;
  so.tasks = {"add"};
  so.eval_problems = 8;
  so.eval_max_new = 5;
  rl::SftSource src(so);
  run_training(loop_options(cfg, dir, recipe, "sft"), src);
}

// The RL tests' start: `first_digit` registered, an SFT run of `sft_steps` (nvfp4-fwd) under
// root/sft, and the post_config() of a `steps`-step RL run on it.
inline RunConfig sft_then_rl_config(const std::string& root, int64_t sft_steps, int64_t steps) {
  register_first_digit();
  run_sft(root + "/sft", "nvfp4-fwd", sft_steps);
  RunConfig cfg = post_config();
  cfg.train.steps = steps;
  return cfg;
}

inline std::vector<nlohmann::json> metrics_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(modeltest::file_bytes(path));
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(nlohmann::json::parse(l));
  return out;
}

// metrics.jsonl without its wall-clock fields: what two runs of the same seed must share.
inline std::string without_timings(const std::string& path) {
  std::string out;
  for (nlohmann::json l : metrics_lines(path)) {
    for (const char* k : {"sample_s", "reward_s", "reference_s", "fwd_bwd_s", "optimizer_s", "sampled_tokens_per_s"})
      l.erase(k);
    out += l.dump() + "\n";
  }
  return out;
}

}  // namespace fourbit::rltest
