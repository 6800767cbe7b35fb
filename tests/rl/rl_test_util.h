// defines: TinyModel, ragged_prompt, trainer_logits, expect_same_completion, expect_error,
//          Mismatch, sampler_vs_trainer (helpers for tests/rl)
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/rl/rollout.h"
#include "fourbit/rl/sampler.h"
#include "model/model_test_util.h"
#include "test_util.h"

namespace fourbit::rltest {

// configs like tests/model's tiny MoE (dense layer 0, MoE layers 1-2 with a shared expert, the
// tail layer 3; GQA) with a 12-token context, seeded weights, on `device`.
struct TinyModel {
  ModelConfig config;
  Model model;
  SrStreams sr{5, 2, 0};
  static ModelConfig make_config() {
    ModelConfig c = modeltest::tiny_moe_config(4, 32);
    c.max_seq_len = 12;
    return c;
  }
  TinyModel(const std::string& recipe, Device device, const ModelConfig& c = make_config())
      : config(c), model(config, recipe_by_name(recipe), device) {
    init_params(model.params(), config, 21);
  }
};

// `n` token ids in [0, 256) from `seed`.
inline std::vector<int32_t> ragged_prompt(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> u(0, 255);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = u(rng);
  return p;
}

// The trainer's logits (Model::logits by the training forward's path, on the host) over prompt +
// completion without its last token: row prompt.size() - 1 + i is the distribution completion[i]
// was drawn from.
inline Tensor trainer_logits(Model& m, const std::vector<int32_t>& prompt, const std::vector<int32_t>& completion,
                             const SrStreams& sr) {
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), completion.begin(), completion.end() - 1);
  const Tensor tokens = Tensor::from_host(seq.data(), {1, int64_t(seq.size())}, DType::I32, m.device());
  return m.logits(tokens, sr, /*as_trainer=*/true).to(Device::CPU);
}

// Tokens, finish, and the bits of the log-probs and kept logits.
inline void expect_same_completion(const rl::Completion& a, const rl::Completion& b, const std::string& what) {
  EXPECT_EQ(a.sequence_id, b.sequence_id) << what;
  EXPECT_EQ(a.tokens, b.tokens) << what;
  EXPECT_EQ(a.finish, b.finish) << what;
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << what;
  EXPECT_EQ(std::memcmp(a.logprobs.data(), b.logprobs.data(), a.logprobs.size() * sizeof(float)), 0) << what;
  ASSERT_EQ(a.sample_logprobs.size(), b.sample_logprobs.size()) << what;
  EXPECT_EQ(std::memcmp(a.sample_logprobs.data(), b.sample_logprobs.data(), a.sample_logprobs.size() * sizeof(double)),
            0)
      << what;
  ASSERT_EQ(a.logits.size(), b.logits.size()) << what;
  EXPECT_EQ(std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)), 0) << what;
}

// fn fails with a message containing `needle`.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  const std::string msg = testutil::error_of(fn);
  EXPECT_NE(msg.find(needle), std::string::npos) << "'" << msg << "' lacks '" << needle << "'";
}

// Bits that differ between the sampler and the trainer's forward: logits rows and log-probs,
// over every sampled token.
struct Mismatch {
  int64_t tokens = 0, logits_rows = 0, logprobs = 0;
};

// `group` samples (temperature 1, no stop token) of prompts of the given lengths, each token's
// logits and log-prob compared with Model::logits / forward_logprobs on the whole sequence.
inline Mismatch sampler_vs_trainer(TinyModel& tm, const std::vector<int64_t>& prompt_lengths, int64_t group,
                                   int64_t max_new) {
  rl::Sampler sampler(tm.model, tm.sr);
  rl::SamplingOptions opt;
  opt.temperature = 1.0;
  opt.max_new = max_new;
  opt.stop_token = -1;
  opt.seed = 11;
  opt.keep_logits = true;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < prompt_lengths.size(); ++i) prompts.push_back(ragged_prompt(prompt_lengths[i], i + 1));
  const std::vector<rl::Completion> out = sampler.sample_groups(prompts, group, opt);
  Mismatch m;
  for (size_t i = 0; i < out.size(); ++i) {
    const std::vector<int32_t>& prompt = prompts[i / size_t(group)];
    const rl::Completion& c = out[i];
    const std::vector<float> trainer = rl::forward_logprobs(tm.model, prompt, c.tokens, tm.sr);
    const Tensor full = trainer_logits(tm.model, prompt, c.tokens, tm.sr);
    const int64_t V = full.size(1), P = int64_t(prompt.size());
    for (size_t t = 0; t < c.tokens.size(); ++t) {
      m.tokens += 1;
      m.logits_rows += std::memcmp(c.logits.data() + t * size_t(V), full.data<float>() + (P - 1 + int64_t(t)) * V,
                                   size_t(V) * sizeof(float)) != 0;
      m.logprobs += std::memcmp(&c.logprobs[t], &trainer[t], sizeof(float)) != 0;
    }
  }
  return m;
}

}  // namespace fourbit::rltest
