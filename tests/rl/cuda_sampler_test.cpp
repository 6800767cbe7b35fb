// defines: GPU sampler tests (skipped without a GPU): on the GPU, the KV-cache sampler's logits
//          and log-probs equal the GPU trainer's forward bit for bit for fp32, bf16, mxfp8 and
//          nvfp4-fwd (head dims 32, 64 and 128, so every fused attention kernel size; prompts
//          and generations that cross 64-key blocks; 1 to 32 rows per decode step); nvidia-nvfp4
//          is caught by the same comparison; samples do not depend on the batch on the GPU
//          either, nor on the decode step's A/B switches (MoE routing waits, attention CTAs,
//          programmatic dependent launches) or on CUDA graphs (the decode as graph replays
//          gives the op-by-op bits; a graph fails, before replaying, on changed weights, a
//          replaced cache or a bad token); and the scatter/gather of the cache agree with the CPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fourbit/model/decode_graph.h"
#include "fourbit/model/model.h"
#include "fourbit/tensor/device_memory.h"
#include "ops/op_test_util.h"
#include "rl/rl_test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;
using namespace fourbit::rltest;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

// d_model 64 / 128 / 256 over 2 q heads and 1 kv head: hd 32, 64, 128 (the fused kernels' sizes);
// 80 positions, so prompts of 30..70 tokens and up to 12 new ones cross the 64-key block edge.
ModelConfig gpu_config(int64_t hd) {
  ModelConfig c = modeltest::tiny_moe_config(4, 2 * hd);
  c.d_expert = 64;
  c.max_seq_len = 80;
  return c;
}

// Prompts of eight lengths, sequence ids id0 + length. With max_seq_len 80 and 12 new tokens, those
// of 70, 72 and 75 tokens stop for the context after 11, 9 and 6 tokens: the decode batch shrinks
// three times (8, 7, 6, then 5 rows).
std::vector<rl::SampleRequest> context_edge_requests(uint64_t salt, uint64_t id0) {
  std::vector<rl::SampleRequest> reqs;
  for (const int64_t len : {20, 40, 66, 70, 72, 75, 30, 50})
    reqs.push_back({ragged_prompt(len, uint64_t(len) + salt), id0 + uint64_t(len)});
  return reqs;
}

// Sampling at temperature 1 without a stop token, keeping every logits row.
rl::SamplingOptions open_ended(int64_t max_new, uint64_t seed) {
  rl::SamplingOptions opt;
  opt.max_new = max_new;
  opt.stop_token = -1;
  opt.seed = seed;
  opt.keep_logits = true;
  return opt;
}

}  // namespace

class CudaSamplerExactness : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaSamplerExactness, LogitsAndLogprobsEqualTheTrainersForward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t hd : {32, 64, 128}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    TinyModel tm(GetParam(), Device::CUDA, gpu_config(hd));
    // 8 prompts x 4 samples = 32 rows in the first decode steps; 61..70-token prompts cross
    // position 64 while decoding, the 70 and 75 ones stop at the context (80) early.
    const Mismatch m = sampler_vs_trainer(tm, {30, 61, 45, 70, 63, 12, 75, 30}, 4, 12);
    EXPECT_GT(m.tokens, 300);
    EXPECT_EQ(m.logits_rows, 0) << GetParam() << ": " << m.logits_rows << " of " << m.tokens << " logits rows differ";
    EXPECT_EQ(m.logprobs, 0) << GetParam() << ": " << m.logprobs << " of " << m.tokens << " log-probs differ";
  }
}

INSTANTIATE_TEST_SUITE_P(InvariantRecipes, CudaSamplerExactness,
                         ::testing::Values("fp32", "bf16", "mxfp8", "nvfp4-fwd"));

TEST(CudaSamplerExactnessControl, PerTensorActivationScalesMismatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TinyModel tm("nvidia-nvfp4", Device::CUDA, gpu_config(64));
  const Mismatch m = sampler_vs_trainer(tm, {30, 61, 12}, 2, 8);
  EXPECT_GT(m.logits_rows, 0) << "nvidia-nvfp4 matched the trainer on all " << m.tokens << " rows";
}

// The KV cache in BF16 (the GPU's default: K and V as attention reads them) and in F32 give the
// same samples and log-probs, bit for bit, in half the bytes; the prompts cross 64-key blocks.
TEST(CudaSampler, KvCacheStorageDoesNotChangeSamples) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const char* recipe : {"bf16", "nvfp4-fwd"}) {
    SCOPED_TRACE(recipe);
    TinyModel tm(recipe, Device::CUDA, gpu_config(64));
    rl::Sampler sampler(tm.model, tm.sr);
    const rl::SamplingOptions opt = open_ended(12, 9);
    std::vector<rl::SampleRequest> reqs;
    for (uint64_t i = 0; i < 6; ++i) reqs.push_back({ragged_prompt(20 + int64_t(i) * 9, i), 300 + i});
    const std::vector<rl::Completion> bf16 = sampler.sample(reqs, opt);
    sampler.set_kv_storage(DType::F32);
    const std::vector<rl::Completion> f32 = sampler.sample(reqs, opt);
    for (size_t i = 0; i < reqs.size(); ++i) expect_same_completion(bf16[i], f32[i], "bf16 vs f32 cache");
    const ModelConfig& c = tm.model.config();
    EXPECT_EQ(KvCache(c, 2, 16, DType::F32, Device::CUDA).bytes() * 2,
              KvCache(c, 2, 16, DType::F32, Device::CUDA, DType::F32).bytes());
  }
}

#if FOURBIT_HAS_CUDA
// The decode step's two A/B switches change no bit: the MoE layers on the routing's GPU offsets
// with no read-back (set_moe_routing_waits_deferred) against a wait for the counts in every layer,
// and the one-token attention a CTA per kv head group (set_flash_head_rows) against one per q
// head; every recipe, nvidia-nvfp4 and fp32 included.
TEST(CudaSampler, RoutingWaitsAndAttentionCtasDoNotChangeSamples) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  struct Restore {
    ~Restore() {
      set_moe_routing_waits_deferred(true);
      ops::cuda::set_flash_head_rows(true);
    }
  } restore;
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    TinyModel tm(recipe, Device::CUDA, gpu_config(64));
    rl::Sampler sampler(tm.model, tm.sr);
    const rl::SamplingOptions opt = open_ended(10, 11);
    std::vector<rl::SampleRequest> reqs;
    for (uint64_t i = 0; i < 8; ++i) reqs.push_back({ragged_prompt(15 + int64_t(i) * 7, i), 500 + i});
    const std::vector<rl::Completion> fast = sampler.sample(reqs, opt);
    set_moe_routing_waits_deferred(false);
    ops::cuda::set_flash_head_rows(false);
    const std::vector<rl::Completion> before = sampler.sample(reqs, opt);
    set_moe_routing_waits_deferred(true);
    ops::cuda::set_flash_head_rows(true);
    for (size_t i = 0; i < reqs.size(); ++i) expect_same_completion(fast[i], before[i], "deferred/group vs layer/head");
  }
}

// The decode step's kernels as programmatic dependent launches (the default) give the samples of
// plain launches, op by op and as CUDA graphs (captured with the launches' programmatic edges: no
// capture failed), with the batch shrinking as sequences reach the context's end.
TEST(CudaSampler, DependentLaunchesDoNotChangeSamples) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  struct Restore {
    ~Restore() { ops::cuda::set_dependent_launches(true); }
  } restore;
  for (const char* recipe : {"bf16", "mxfp8", "nvfp4-fwd"}) {
    SCOPED_TRACE(recipe);
    TinyModel tm(recipe, Device::CUDA, gpu_config(64));
    rl::Sampler sampler(tm.model, tm.sr);
    const rl::SamplingOptions opt = open_ended(12, 29);
    const std::vector<rl::SampleRequest> reqs = context_edge_requests(5, 800);
    ops::cuda::set_dependent_launches(false);
    sampler.set_cuda_graphs(false);
    const std::vector<rl::Completion> plain = sampler.sample(reqs, opt);
    ops::cuda::set_dependent_launches(true);
    for (const bool graphs : {false, true}) {
      SCOPED_TRACE(graphs ? "graphs" : "op by op");
      sampler.set_cuda_graphs(graphs);
      sampler.reset_stats();
      const std::vector<rl::Completion> dependent = sampler.sample(reqs, opt);
      EXPECT_EQ(sampler.stats().graph_error, "");
      EXPECT_EQ(sampler.stats().graph_replays, graphs ? 7 : 0);
      for (size_t i = 0; i < reqs.size(); ++i)
        expect_same_completion(dependent[i], plain[i], "dependent vs plain launches");
    }
  }
}
#endif

// The decode as CUDA graph replays gives the bits of the decode issued op by op, for every recipe
// (fp32, whose FP32 experts read the routing counts back, decodes op by op and says why):
// prompts of eight lengths (attention reads each row's position on the GPU) and sequences that
// reach the context's end at three different steps (the batch shrinks, and each new batch is
// captured anew at its second step). No capture failed, and the replays ran the steps counted.
TEST(CudaSampler, GraphsGiveTheEagerSamples) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    TinyModel tm(recipe, Device::CUDA, gpu_config(64));
    rl::Sampler sampler(tm.model, tm.sr);
    const rl::SamplingOptions opt = open_ended(12, 17);
    const std::vector<rl::SampleRequest> reqs = context_edge_requests(0, 700);
    sampler.set_cuda_graphs(false);
    const std::vector<rl::Completion> eager = sampler.sample(reqs, opt);
    EXPECT_EQ(sampler.stats().graph_captures, 0);
    sampler.reset_stats();
    sampler.set_cuda_graphs(true);
    const std::vector<rl::Completion> graphs = sampler.sample(reqs, opt);
    const rl::SamplerStats& s = sampler.stats();
    EXPECT_EQ(s.decode_forwards, 11);
    if (std::string(recipe) == "fp32") {  // FP32 experts read the routing counts back: no graphs
      EXPECT_FALSE(tm.model.forward_cached_stays_on_device());
      EXPECT_NE(s.graph_error.find("reads the MoE routing counts back"), std::string::npos) << s.graph_error;
      EXPECT_EQ(s.graph_captures, 0);
      EXPECT_EQ(s.graph_replays, 0);
    } else {
      EXPECT_EQ(s.graph_error, "");
      // 11 decode forwards over batches of 8, 7, 6 and 5 rows for 5, 3, 2 and 1 steps: each
      // batch's first step op by op, the rest replays of the graph captured at its second
      EXPECT_EQ(s.graph_captures, 3);
      EXPECT_EQ(s.graph_replays, 7);
    }
    for (size_t i = 0; i < reqs.size(); ++i) expect_same_completion(eager[i], graphs[i], "graphs vs op by op");
    EXPECT_EQ(graphs[5].finish, rl::Finish::Context);
    EXPECT_EQ(graphs[5].tokens.size(), 6u);
  }
}

// Tokens drawn on the GPU (ops::draw_tokens, the default) are the host's draws: the same tokens,
// policy and draw log-prob bits, finishes and logits, greedy and sampled with temperature, top-k,
// top-p and a stop token, with and without kept logits, eager and as graphs.
TEST(CudaSampler, GpuDrawsGiveTheHostsSamples) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const char* recipe : {"bf16", "nvfp4-fwd"}) {
    TinyModel tm(recipe, Device::CUDA, gpu_config(64));
    rl::Sampler sampler(tm.model, tm.sr);
    std::vector<rl::SampleRequest> reqs;
    for (const int64_t len : {20, 40, 66, 75, 30, 50, 9, 33})
      reqs.push_back({ragged_prompt(len, uint64_t(len) + 3), 900 + uint64_t(len)});
    std::vector<rl::SamplingOptions> opts(5, open_ended(10, 23));
    opts[1].temperature = 0.0;
    opts[2].temperature = 0.7, opts[2].top_k = 5;
    opts[3].top_p = 0.6, opts[3].keep_logits = false;
    opts[4].keep_logits = false;  // and a stop token sequence 0 meets: its 4th token of options 0
    for (size_t o = 0; o < opts.size(); ++o) {
      if (o == 4) {
        sampler.set_gpu_draws(false);
        opts[4].stop_token = sampler.sample(reqs, opts[0])[0].tokens[3];
      }
      for (const bool graphs : {false, true}) {
        SCOPED_TRACE(::testing::Message() << recipe << " options " << o << " graphs " << graphs);
        sampler.set_cuda_graphs(graphs);
        sampler.set_gpu_draws(false);
        const std::vector<rl::Completion> host = sampler.sample(reqs, opts[o]);
        sampler.set_gpu_draws(true);
        const std::vector<rl::Completion> gpu = sampler.sample(reqs, opts[o]);
        for (size_t i = 0; i < reqs.size(); ++i) expect_same_completion(gpu[i], host[i], "gpu vs host draws");
        if (o == 4) {
          EXPECT_EQ(gpu[0].finish, rl::Finish::Stop);
        }
      }
    }
  }
}

// A decode graph reads the model's cached weights where the capture found them: once the weights
// change (invalidate_weight_cache) it fails rather than read freed memory; a token id outside the
// vocabulary is reported after the replay, as the op-by-op forward reports it.
TEST(CudaDecodeGraph, FailsOnChangedWeightsAndBadTokens) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TinyModel tm("bf16", Device::CUDA, gpu_config(64));
  Model& m = tm.model;
  KvCache cache(m.config(), 2, 16, DType::F32, Device::CUDA);
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  m.forward_cached(Tensor::from_host(ids.data(), {2, 3}, DType::I32, Device::CUDA), KvBatch{3, {{0, 2, 0}}}, cache,
                   tm.sr);
  // one step op by op first, as the sampler's first step (the one-token kernels loaded before the capture)
  const std::vector<int32_t> step1 = {7, 8}, step2 = {9, 10};
  m.forward_cached(Tensor::from_host(step1.data(), {2, 1}, DType::I32, Device::CUDA), KvBatch{1, {{0, 2, 3}}}, cache,
                   tm.sr);
  DecodeGraph graph(m, cache, tm.sr);
  const Tensor replayed = graph.run(step2, {4, 4}).to(Device::CPU);
  EXPECT_EQ(replayed.shape(), (Shape{2, m.config().vocab_size}));
  // the same step op by op (its K/V rows written again with the same bits): the same logits
  const Tensor eager = m.forward_cached(Tensor::from_host(step2.data(), {2, 1}, DType::I32, Device::CUDA),
                                        KvBatch{1, {{0, 2, 4}}}, cache, tm.sr)
                           .to(Device::CPU);
  EXPECT_TRUE(optest::bitwise_equal(replayed, eager));
  expect_error([&] { graph.run({7, int32_t(m.config().vocab_size)}, {5, 5}); },
               "slot 1's token id 260 is outside the vocabulary [0, 260)");
  expect_error([&] { graph.run({7, 8}, {5, 16}); }, "do not fit the cache capacity 16");
  KvCache saved = cache;
  cache = cache.gather_slots({1, 0});
  expect_error([&] { graph.run({7, 8}, {5, 5}); }, "the KV cache holds other tensors than at the capture");
  cache = saved;
  m.invalidate_weight_cache();
  expect_error([&] { graph.run({7, 8}, {5, 5}); }, "the model's weights changed after the capture");
}

TEST(CudaSampler, SamplesDoNotDependOnTheBatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TinyModel tm("nvfp4-fwd", Device::CUDA, gpu_config(64));
  rl::Sampler sampler(tm.model, tm.sr);
  const rl::SamplingOptions opt = open_ended(10, 5);
  std::vector<rl::SampleRequest> all;
  for (uint64_t i = 0; i < 24; ++i) all.push_back({ragged_prompt(10 + int64_t(i % 5) * 13, i % 7), 100 + i});
  const std::vector<rl::Completion> batch = sampler.sample(all, opt);
  const std::vector<rl::Completion> alone = sampler.sample({all[17]}, opt);
  expect_same_completion(alone[0], batch[17], "alone vs batch of 24");
  std::vector<rl::SampleRequest> rev(all.rbegin(), all.rend());
  const std::vector<rl::Completion> reversed = sampler.sample(rev, opt);
  for (size_t i = 0; i < all.size(); ++i) expect_same_completion(reversed[all.size() - 1 - i], batch[i], "reversed");
}
