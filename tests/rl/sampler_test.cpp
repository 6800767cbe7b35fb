// defines: KV-cache sampler tests (CPU): the sampler's logits and log-probs equal the trainer's
//          forward on the whole sequence bit for bit for fp32, bf16, mxfp8 and nvfp4-fwd, with
//          ragged prompts, groups of samples, sequences leaving the batch early (stop token,
//          length, context) and any batch composition and order; nvidia-nvfp4 (per-tensor
//          activation scales) is the negative control that the same comparison catches. Also:
//          same seed, same samples whatever the batch or thread count; greedy is the argmax of the trainer's
//          logits; bad requests and options fail before any work.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "fourbit/rl/rollout.h"
#include "fourbit/rl/sampler.h"
#include "model/model_test_util.h"
#include "ops/op_test_util.h"
#include "rl/rl_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using namespace fourbit::rltest;

namespace {

// lengths 5, 3 and 8 of a 12-token context: the 8-token prompt runs out of positions after 5
// tokens and leaves the batch while the others go on for 8; two samples of each prompt.
Mismatch ragged_groups(const std::string& recipe) {
  const OmpThreads one_thread(1);
  TinyModel tm(recipe, Device::CPU);
  return sampler_vs_trainer(tm, {5, 3, 8}, 2, 8);
}

}  // namespace

class SamplerExactness : public ::testing::TestWithParam<const char*> {};

TEST_P(SamplerExactness, LogitsAndLogprobsEqualTheTrainersForward) {
  const Mismatch m = ragged_groups(GetParam());
  EXPECT_EQ(m.tokens, 2 * (8 + 8 + 5));
  EXPECT_EQ(m.logits_rows, 0) << GetParam() << ": " << m.logits_rows << " of " << m.tokens << " logits rows differ";
  EXPECT_EQ(m.logprobs, 0) << GetParam() << ": " << m.logprobs << " of " << m.tokens << " log-probs differ";
}

INSTANTIATE_TEST_SUITE_P(InvariantRecipes, SamplerExactness, ::testing::Values("fp32", "bf16", "mxfp8", "nvfp4-fwd"));

// Negative control: nvidia-nvfp4 scales activations per tensor, so a one-token decode step
// quantizes differently from the whole sequence: the same comparison must see it.
TEST(SamplerExactnessControl, PerTensorActivationScalesMismatch) {
  const Mismatch m = ragged_groups("nvidia-nvfp4");
  EXPECT_GT(m.logits_rows, 0) << "nvidia-nvfp4: the sampler matched the trainer on all " << m.tokens << " rows";
  EXPECT_GT(m.logprobs, 0);
}

// A sequence's samples (tokens, log-probs, logits) are the same alone, in a larger batch, in
// another order, and when a neighbour stops early (leaving the batch and the cache).
TEST(Sampler, SamplesDoNotDependOnTheBatch) {
  const OmpThreads one_thread(1);
  TinyModel tm("nvfp4-fwd", Device::CPU);
  rl::Sampler sampler(tm.model, tm.sr);
  rl::SamplingOptions opt;
  opt.max_new = 6;
  opt.stop_token = -1;
  opt.seed = 5;
  opt.step = 3;
  opt.keep_logits = true;
  const std::vector<rl::SampleRequest> all = {{ragged_prompt(4, 1), 10}, {ragged_prompt(6, 2), 11},
                                              {ragged_prompt(4, 1), 12}, {ragged_prompt(2, 3), 13}};
  const std::vector<rl::Completion> batch = sampler.sample(all, opt);
  const std::vector<rl::Completion> alone = sampler.sample({all[1]}, opt);
  const std::vector<rl::Completion> reordered = sampler.sample({all[3], all[2], all[1], all[0]}, opt);
  expect_same_completion(alone[0], batch[1], "alone vs batch");
  for (size_t i = 0; i < 4; ++i) expect_same_completion(reordered[3 - i], batch[i], "reordered " + std::to_string(i));
  // Same prompt, different sequence ids: different draws (else groups would be copies).
  EXPECT_NE(batch[0].tokens, batch[2].tokens);
  // A stop token taken from sequence 11's own samples ends it there; the others are unchanged.
  opt.stop_token = batch[1].tokens[2];
  const std::vector<rl::Completion> stopped = sampler.sample(all, opt);
  ASSERT_EQ(stopped[1].finish, rl::Finish::Stop);
  for (size_t i = 0; i < 4; ++i) {
    const rl::Completion& s = stopped[i];
    const size_t n = s.tokens.size();
    ASSERT_LE(n, batch[i].tokens.size());
    EXPECT_EQ(s.tokens, std::vector<int32_t>(batch[i].tokens.begin(), batch[i].tokens.begin() + int64_t(n))) << i;
    EXPECT_EQ(std::memcmp(s.logprobs.data(), batch[i].logprobs.data(), n * sizeof(float)), 0) << i;
    EXPECT_EQ(s.finish == rl::Finish::Stop, s.tokens.back() == opt.stop_token) << i;
  }
  // Another step or seed: other samples.
  opt.stop_token = -1;
  opt.step = 4;
  EXPECT_NE(sampler.sample(all, opt)[1].tokens, batch[1].tokens);
}

// Temperature 0 picks the trainer's argmax at every step, and its log-prob is the trainer's.
// The rows' draws run on every core where a step has 16 rows or more: one thread and two give the
// same samples, log-probs and logits.
TEST(Sampler, DrawsDoNotDependOnTheThreadCount) {
  TinyModel tm("bf16", Device::CPU);
  rl::Sampler sampler(tm.model, tm.sr);
  rl::SamplingOptions opt;
  opt.max_new = 4;
  opt.stop_token = -1;
  opt.keep_logits = true;
  std::vector<rl::SampleRequest> reqs;
  for (uint64_t i = 0; i < 20; ++i) reqs.push_back({ragged_prompt(2 + int64_t(i % 4), i % 3), 700 + i});
  std::vector<rl::Completion> one, two;
  {
    const OmpThreads threads(1);
    one = sampler.sample(reqs, opt);
  }
  {
    const OmpThreads threads(2);
    two = sampler.sample(reqs, opt);
  }
  for (size_t i = 0; i < reqs.size(); ++i) expect_same_completion(one[i], two[i], "1 vs 2 threads");
}

TEST(Sampler, GreedyIsTheArgmaxOfTheTrainersLogits) {
  const OmpThreads one_thread(1);
  TinyModel tm("mxfp8", Device::CPU);
  rl::Sampler sampler(tm.model, tm.sr);
  rl::SamplingOptions opt;
  opt.temperature = 0;
  opt.max_new = 6;
  opt.stop_token = -1;
  const std::vector<int32_t> prompt = ragged_prompt(4, 9);
  const rl::Completion c = sampler.sample({{prompt, 0}}, opt)[0];
  ASSERT_EQ(c.tokens.size(), 6u);
  EXPECT_EQ(c.finish, rl::Finish::Length);
  const Tensor full = trainer_logits(tm.model, prompt, c.tokens, tm.sr);
  const int64_t V = full.size(1);
  for (size_t t = 0; t < c.tokens.size(); ++t) {
    const float* row = full.data<float>() + (int64_t(prompt.size()) - 1 + int64_t(t)) * V;
    EXPECT_EQ(c.tokens[t], int32_t(std::max_element(row, row + V) - row)) << t;
    EXPECT_EQ(c.sample_logprobs[t], 0.0);
  }
  const std::vector<float> lp = rl::forward_logprobs(tm.model, prompt, c.tokens, tm.sr);
  EXPECT_EQ(std::memcmp(lp.data(), c.logprobs.data(), lp.size() * sizeof(float)), 0);
  // The stats count what ran: one prefill of 4 tokens, 5 decode forwards, 6 tokens.
  EXPECT_EQ(sampler.stats().prefill_tokens, 4);
  EXPECT_EQ(sampler.stats().decode_forwards, 5);
  EXPECT_EQ(sampler.stats().sampled_tokens, 6);
}

// A prompt that fills the context gets exactly one token; one past it is refused.
TEST(Sampler, ContextLimits) {
  const OmpThreads one_thread(1);
  TinyModel tm("bf16", Device::CPU);
  rl::Sampler sampler(tm.model, tm.sr);
  rl::SamplingOptions opt;
  opt.stop_token = -1;
  const int64_t ctx = tm.model.config().max_seq_len;
  const rl::Completion c = sampler.sample({{ragged_prompt(ctx, 1), 0}}, opt)[0];
  EXPECT_EQ(c.tokens.size(), 1u);
  EXPECT_EQ(c.finish, rl::Finish::Context);
  expect_error([&] { sampler.sample({{ragged_prompt(ctx + 1, 1), 0}}, opt); },
               "a prompt of 13 tokens does not fit the model's context (max_seq_len 12)");
  opt.max_new = 0;
  EXPECT_TRUE(sampler.sample({{ragged_prompt(3, 1), 0}}, opt)[0].tokens.empty());
}

TEST(Sampler, BadRequestsAndOptionsFail) {
  TinyModel tm("fp32", Device::CPU);
  rl::Sampler sampler(tm.model, tm.sr);
  const rl::SamplingOptions ok;
  expect_error([&] { sampler.sample({{{}, 0}}, ok); }, "request 0 has an empty prompt");
  expect_error([&] { sampler.sample({{{1, 2}, 0}, {{3, 260}, 1}}, ok); },
               "request 1: prompt token 1 is 260, outside the vocabulary [0, 260)");
  expect_error([&] { sampler.sample({{{1, 2}, 4}, {{3}, 4}}, ok); }, "request 1 repeats sequence id 4");
  expect_error([&] { sampler.sample_groups({{1, 2}}, 1, ok); }, "a group needs at least 2 samples per prompt");
  auto with = [&](auto edit) {
    rl::SamplingOptions o;
    edit(o);
    return o;
  };
  expect_error([&] { sampler.sample({{{1}, 0}}, with([](auto& o) { o.temperature = -1; })); }, "temperature");
  expect_error([&] { sampler.sample({{{1}, 0}}, with([](auto& o) { o.top_p = 0; })); }, "top_p must be in (0, 1]");
  expect_error([&] { sampler.sample({{{1}, 0}}, with([](auto& o) { o.top_k = -2; })); }, "top_k must be >= 0");
  expect_error([&] { sampler.sample({{{1}, 0}}, with([](auto& o) { o.stop_token = 260; })); }, "stop_token");
  expect_error([&] { sampler.sample({{{1}, 0}}, with([](auto& o) { o.max_new = -1; })); }, "max_new");
}

// The cached forward's own checks: groups must cover the rows, positions must fit the cache.
TEST(KvCache, ForwardCachedChecksItsBatch) {
  TinyModel tm("fp32", Device::CPU);
  Model& m = tm.model;
  KvCache cache(m.config(), 2, 6, DType::F32, Device::CPU);
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  const Tensor tokens = Tensor::from_host(ids.data(), {2, 2}, DType::I32);
  expect_error([&] { m.forward_cached(tokens, KvBatch{2, {{0, 1, 0}}}, cache, tm.sr); },
               "the batch has 1 rows but the cache 2 slots");
  expect_error([&] { m.forward_cached(tokens, KvBatch{2, {{0, 1, 0}, {2, 2, 0}}}, cache, tm.sr); },
               "groups must cover rows 0..2 in order");
  expect_error([&] { m.forward_cached(tokens, KvBatch{2, {{0, 2, 5}}}, cache, tm.sr); },
               "positions 5..6 of rows [0, 2) do not fit the cache capacity 6");
  expect_error([&] { m.forward_cached(tokens, KvBatch{2, {{0, 2, 0}}}, cache, tm.sr, {4}); },
               "logit row 4 is outside [0, 4)");
  expect_error([&] { KvCache(m.config(), 1, 13, DType::F32, Device::CPU); },
               "capacity 13 exceeds the model's max_seq_len 12");
  // The CPU's attention computes from F32: its cache stores F32, and no other storage is taken.
  EXPECT_EQ(cache.storage(), DType::F32);
  EXPECT_EQ(KvCache::default_storage(DType::F32, Device::CUDA), DType::BF16);
  EXPECT_EQ(KvCache::default_storage(DType::F64, Device::CUDA), DType::F64);
  expect_error([&] { KvCache(m.config(), 1, 6, DType::F32, Device::CPU, DType::BF16); },
               "kv cache: bf16 storage for a f32 model on the cpu: a cache stores the model's dtype or f32");
  // gather_slots copies whole slots.
  m.forward_cached(tokens, KvBatch{2, {{0, 2, 0}}}, cache, tm.sr);
  const KvCache g = cache.gather_slots({1, 1, 0});
  EXPECT_EQ(g.slots(), 3);
  const int64_t slot = cache.capacity() * m.config().n_kv_heads * m.config().hd();
  for (int64_t l = 0; l < g.layers(); ++l) {
    EXPECT_EQ(std::memcmp(g.k(l).data<float>(), cache.k(l).data<float>() + slot, size_t(slot) * 4), 0);
    EXPECT_EQ(std::memcmp(g.v(l).data<float>() + 2 * slot, cache.v(l).data<float>(), size_t(slot) * 4), 0);
  }
  expect_error([&] { cache.gather_slots({2}); }, "slot 2 is outside [0, 2)");
}

// A step bound to fixed position and cache-row buffers (KvStep's forms for a CUDA graph's inputs)
// gives forward_cached's bits: the buffers are written by the checking constructor and read as
// they are by the bound one; the checks and the buffers' shapes still fail by name. Also the
// weights' version that a graph of the forward checks.
TEST(KvCache, StepOnFixedBuffersIsTheCachedForward) {
  TinyModel tm("nvfp4-fwd", Device::CPU);
  Model& m = tm.model;
  const std::vector<int32_t> prompt = {5, 9, 2, 7, 1, 3};
  auto prefilled = [&] {
    KvCache c(m.config(), 3, 10, DType::F32, Device::CPU);
    std::vector<int32_t> ids;
    for (int b = 0; b < 3; ++b) ids.insert(ids.end(), prompt.begin(), prompt.end());
    m.forward_cached(Tensor::from_host(ids.data(), {3, 6}, DType::I32), KvBatch{6, {{0, 3, 0}}}, c, tm.sr);
    return c;
  };
  KvCache a = prefilled(), b = prefilled();
  const std::vector<int32_t> next = {11, 12, 13};
  const Tensor tokens = Tensor::from_host(next.data(), {3, 1}, DType::I32);
  // rows at positions 2, 6, 6 (the first rewrites a prompt position, as a decode never does, but
  // the rows only need distinct caches)
  const KvBatch batch{1, {{0, 1, 2}, {1, 3, 6}}};
  const Tensor want = m.forward_cached(tokens, batch, a, tm.sr);
  Tensor pos = Tensor::zeros({3}, DType::I32), dst = Tensor::zeros({3}, DType::I32);
  const KvStep written(b, batch, m.config().max_seq_len, pos, dst);
  EXPECT_EQ(std::vector<int32_t>(pos.data<int32_t>(), pos.data<int32_t>() + 3), (std::vector<int32_t>{2, 6, 6}));
  EXPECT_EQ(std::vector<int32_t>(dst.data<int32_t>(), dst.data<int32_t>() + 3), (std::vector<int32_t>{2, 16, 26}));
  const KvStep bound = KvStep::bound(b, KvBatch{1, {{0, 3, 0}}}, pos, dst);
  const Tensor got = m.forward_cached(tokens, bound, tm.sr);
  EXPECT_TRUE(optest::bitwise_equal(got, want));
  for (int64_t l = 0; l < a.layers(); ++l) {
    EXPECT_TRUE(optest::bitwise_equal(a.k(l), b.k(l))) << "layer " << l;
    EXPECT_TRUE(optest::bitwise_equal(a.v(l), b.v(l))) << "layer " << l;
  }
  Tensor short_pos = Tensor::zeros({2}, DType::I32);
  expect_error([&] { KvStep(b, batch, m.config().max_seq_len, short_pos, dst); },
               "a step's positions and cache rows go into i32 [3] tensors on the cpu, got i32[2] cpu");
  expect_error([&] { KvStep(b, KvBatch{1, {{0, 3, 10}}}, m.config().max_seq_len, pos, dst); },
               "positions 10..10 of rows [0, 3) do not fit the cache capacity 10");
  expect_error([&] { m.forward_cached(Tensor::from_host(next.data(), {1, 3}, DType::I32), bound, tm.sr); },
               "tokens must be i32 [3, 1] on the cpu (the step's rows and T), got i32[1, 3] cpu");
  const uint64_t version = m.weights_version();
  m.invalidate_weight_cache();
  EXPECT_EQ(m.weights_version(), version + 1);
}
