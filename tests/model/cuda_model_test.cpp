// defines: GPU model tests (skipped without a GPU): 30 lockstep steps of configs/tiny.toml on the
// GPU against the CPU for every recipe (the same loss on the same weights, no drift); two GPU
// runs write byte-identical metrics; a sequence's logits on the GPU are bitwise the same alone
// and inside a batch of 8 (every recipe with per-token activation scales); the fused forward GEMMs
// give the bits of the GEMMs apart; a training forward's cached weight forms (decodes alone, or
// with them) give forward_weight's readers the CPU's codes and an inference forward its bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/kv_cache.h"
#include "fourbit/model/model.h"
#include "fourbit/train/trainer.h"
#include "fourbit/tensor/device_memory.h"
#include "model/lockstep.h"

using namespace fourbit;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

// configs/tiny.toml for `steps` steps of `recipe`, quiet; `root` (where the runs go) is emptied.
PretrainOptions tiny_run(const std::string& recipe, int64_t steps, int64_t eval_every, const std::string& root) {
  PretrainOptions opt;
  opt.config = load_config(std::string(FOURBIT_SOURCE_DIR) + "/configs/tiny.toml");
  opt.config.train.steps = steps;
  opt.config.train.eval_every = eval_every;
  opt.recipe = recipe;
  opt.quiet = true;
  std::filesystem::remove_all(root);
  return opt;
}

}  // namespace

class CudaTraining : public ::testing::TestWithParam<std::string> {};

// The GPU trains like the CPU, step by step (tests/model/lockstep.h: free-running curves of this
// model are chaotic, so they are compared in lockstep). Each step's loss on the same weights
// agrees to 2e-3 (measured on an H200: 1e-6 for fp32 up to 2e-4 for nvidia-nvfp4 at step 1), and
// the drift, the loss the GPU's steps give up against the CPU's summed over 30 steps that cover
// the warmup and the peak learning rate, stays within 0.5%, so a defect that costs 1% fails.
TEST_P(CudaTraining, LockstepStepsDoNotDriftFromTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string recipe = GetParam();
  RunConfig cfg = load_config(std::string(FOURBIT_SOURCE_DIR) + "/configs/tiny.toml");
  const modeltest::LockstepDrift d = modeltest::lockstep_drift(cfg, recipe, Device::CUDA, cfg.train, 30);
  double worst_delta = 0;
  for (double x : d.delta) worst_delta = std::max(worst_delta, std::abs(x));
  std::printf("%s: lockstep over %zu steps: worst step loss diff %.2e, drift %+.2e, worst step delta %.2e\n",
              recipe.c_str(), d.delta.size(), d.worst_loss_rel(), d.drift(), worst_delta);
  EXPECT_LT(d.worst_loss_rel(), 2e-3);
  EXPECT_LT(std::abs(d.drift()), 5e-3);
}

// GPU training is deterministic: two runs from the same seed write byte-identical metrics (every
// loss and gradient norm to full precision) although the experts' GEMMs and quantizers run on
// concurrent lanes and the weight-gradient GEMMs may split K.
TEST_P(CudaTraining, TwoRunsWriteTheSameMetrics) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string recipe = GetParam();
  const std::string root = std::string(FOURBIT_TEST_DATA_DIR) + "/cuda_determinism_" + recipe;
  PretrainOptions opt = tiny_run(recipe, 12, 6, root);
  opt.config.train.log_every = 1;
  opt.device = Device::CUDA;
  std::string text[2];
  for (int run = 0; run < 2; ++run) {
    opt.out_dir = root + "/run" + std::to_string(run);
    pretrain(opt);
    std::ifstream in(std::filesystem::path(opt.out_dir) / "metrics.jsonl");
    text[run].assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_FALSE(text[0].empty());
  EXPECT_EQ(text[0], text[1]);
}

INSTANTIATE_TEST_SUITE_P(Recipes, CudaTraining,
                         ::testing::Values("fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& c : s)
                             if (c == '-') c = '_';
                           return s;
                         });

class CudaBatchInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaBatchInvariance, LogitsAloneEqualLogitsInBatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  RunConfig cfg = load_config(std::string(FOURBIT_SOURCE_DIR) + "/configs/tiny.toml");
  Model m(cfg.model, recipe_by_name(GetParam()), Device::CUDA);
  init_params(m.params(), cfg.model, 5);
  const int64_t B = 8, T = 64, V = cfg.model.vocab_size;
  std::mt19937 g(9);
  std::vector<int32_t> tok(size_t(B * T));
  for (auto& t : tok) t = int32_t(g() % 256);
  const Tensor batch = Tensor::from_host(tok.data(), {B, T}, DType::I32, Device::CUDA);
  const Tensor all = m.logits(batch, SrStreams{}).to(Device::CPU);
  for (int64_t s : {0, 5}) {
    const Tensor one = Tensor::from_host(tok.data() + s * T, {1, T}, DType::I32, Device::CUDA);
    const Tensor alone = m.logits(one, SrStreams{}).to(Device::CPU);
    EXPECT_EQ(0, std::memcmp(alone.data<float>(), all.data<float>() + s * T * V, size_t(T * V) * 4))
        << GetParam() << ": sequence " << s;
  }
}

// nvidia-nvfp4 scales activations per tensor, so it is batch dependent by design (the CPU
// batch-invariance test holds it as the negative control).
INSTANTIATE_TEST_SUITE_P(Recipes, CudaBatchInvariance, ::testing::Values("fp32", "bf16", "mxfp8", "nvfp4-fwd"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& c : s)
                             if (c == '-') c = '_';
                           return s;
                         });

// The fused forward GEMMs on the GPU (set_fused_forward_gemms): the sampler's cached prefill and
// decode steps on a BF16 cache, where wq | wk | wv run as one GEMM into
// rope_fused_qkv_to_cache, and every FFN's w1 | w3 as one into swiglu_forward_fused, with the
// block-scaled fprop inputs quantized by the norms and SwiGLUs that write them (ops.h "Quantized
// outputs": mxfp8 and nvfp4-fwd), give the bytes of the GEMMs and quantizers run apart, on the
// grouped kernel's decode and training tiles alike, and so do those of a MoE layer's shared expert
// run as one more group of the routed experts' GEMMs (or apart); so do Model::logits. NVIDIA's recipe keeps its
// per-tensor-scaled q, k and v apart (and its inputs' quantizers: per-tensor scales), fp32 every GEMM.
TEST(CudaModel, FusedForwardGemmsGiveTheSameBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  RunConfig cfg = load_config(std::string(FOURBIT_SOURCE_DIR) + "/configs/tiny.toml");
  const ModelConfig& c = cfg.model;
  std::mt19937 g(21);
  const int64_t B = 4, P = 24;
  std::vector<int32_t> prompt(size_t(B * P));
  for (auto& t : prompt) t = int32_t(g() % 256);
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    Model m(c, recipe_by_name(recipe), Device::CUDA);
    init_params(m.params(), c, 6);
    const auto run = [&] {
      std::vector<Tensor> out;
      KvCache cache(c, B, 40, DType::F32, Device::CUDA);
      out.push_back(m.forward_cached(Tensor::from_host(prompt.data(), {B, P}, DType::I32, Device::CUDA),
                                     KvBatch{P, {{0, B, 0}}}, cache, SrStreams{})
                        .to(Device::CPU));
      for (int64_t step = 0; step < 4; ++step) {
        std::vector<int32_t> next(static_cast<size_t>(B));
        for (auto& t : next) t = int32_t(g() % 256);
        out.push_back(m.forward_cached(Tensor::from_host(next.data(), {B, 1}, DType::I32, Device::CUDA),
                                       KvBatch{1, {{0, B, P + step}}}, cache, SrStreams{})
                          .to(Device::CPU));
      }
      out.push_back(m.logits(Tensor::from_host(prompt.data(), {B, P}, DType::I32, Device::CUDA), SrStreams{})
                        .to(Device::CPU));
      return out;
    };
    const std::mt19937 g0 = g;
    set_fused_forward_gemms(true);
    const std::vector<Tensor> fused = run();
    if (std::string(recipe) == "fp32") {  // F32 operands: cuBLASLt, its algorithm chosen per N
      EXPECT_TRUE(m.fused_weights().empty());
    } else {
      const auto wqkv = m.fused_weights().find("layers.1.attn.wqkv/fprop");
      ASSERT_TRUE(wqkv != m.fused_weights().end());
      EXPECT_EQ(wqkv->second.defined(), std::string(recipe) != "nvidia-nvfp4");
      // the shared expert runs as one more group of the routed experts' GEMMs (set_shared_expert_grouped)
      // but with NVIDIA's per-tensor token scales
      const bool grouped = std::string(recipe) != "nvidia-nvfp4";
      const auto w13 = m.fused_weights().find(grouped ? "layers.1.moe.w13+shared/fprop" : "layers.1.moe.w13/fprop");
      EXPECT_TRUE(w13 != m.fused_weights().end() && w13->second.defined());
    }
    g = g0;  // the same decode tokens
    m.invalidate_weight_cache();
    set_shared_expert_grouped(false);
    const std::vector<Tensor> ungrouped = run();
    set_shared_expert_grouped(true);
    g = g0;
    set_fused_forward_gemms(false);
    const std::vector<Tensor> apart = run();
    set_fused_forward_gemms(true);
    ASSERT_EQ(fused.size(), apart.size());
    ASSERT_EQ(ungrouped.size(), apart.size());
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(fused[i].raw(), apart[i].raw(), size_t(fused[i].nbytes()))) << "call " << i;
      EXPECT_EQ(0, std::memcmp(ungrouped[i].raw(), apart[i].raw(), size_t(fused[i].nbytes()))) << "call " << i;
    }
  }
}

// After a training forward on the GPU, before the weights change: the MXFP8 weights sit in the
// cache as their decodes alone and nvfp4-fwd's NVFP4 fprop weights with codes and decodes
// (Model::quantize_weights_ahead, ModelRunner::weight_decodes); forward_weight still hands its
// readers (export, the RL weight-code snapshots) the CPU's codes, and an inference forward with
// the fused GEMMs, which stacks cached parts, gives the logits it gives from a fresh cache.
TEST(CudaModel, TrainingWeightFormsServeEveryReader) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  RunConfig cfg = load_config(std::string(FOURBIT_SOURCE_DIR) + "/configs/tiny.toml");
  const ModelConfig& c = cfg.model;
  std::vector<int32_t> toks(2 * 16);
  std::mt19937 g(5);
  for (auto& t : toks) t = int32_t(g() % 256);
  std::vector<int32_t> next(toks.begin() + 1, toks.end());
  next.push_back(0);
  const Tensor tokens = Tensor::from_host(toks.data(), {2, 16}, DType::I32, Device::CUDA);
  const Tensor targets = Tensor::from_host(next.data(), {2, 16}, DType::I32, Device::CUDA);
  for (const char* recipe : {"mxfp8", "nvfp4-fwd"}) {
    SCOPED_TRACE(recipe);
    Model gpu(c, recipe_by_name(recipe), Device::CUDA), cpu(c, recipe_by_name(recipe), Device::CPU);
    init_params(gpu.params(), c, 8);
    init_params(cpu.params(), c, 8);
    gpu.forward(tokens, targets, SrStreams{3, 1, 0}, true);
    int decode_alone = 0, with_both = 0;
    for (const auto& [key, p] : gpu.weight_cache()) {
      if (!p.is_quantized()) continue;
      decode_alone += !p.q.codes.defined() && p.q.bf16.defined();
      with_both += p.q.codes.defined() && p.q.bf16.defined();
    }
    EXPECT_GT(decode_alone, 0);  // both recipes have MXFP8 layers (attention)
    if (std::string(recipe) == "nvfp4-fwd") {
      EXPECT_GT(with_both, 0);
    }
    for (const LinearInfo& li : gpu.linears()) {
      const Prepared pg = gpu.forward_weight(li.name), pc = cpu.forward_weight(li.name);
      ASSERT_EQ(pg.is_quantized(), pc.is_quantized()) << li.name;
      if (!pc.is_quantized()) continue;
      ASSERT_TRUE(pg.q.codes.defined()) << li.name;
      const Tensor a = pg.q.codes.to(Device::CPU), b = pc.q.codes;
      ASSERT_EQ(a.nbytes(), b.nbytes()) << li.name;
      EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), size_t(a.nbytes()))) << li.name << ": codes";
    }
    set_fused_forward_gemms(true);
    const Tensor after_training = gpu.logits(tokens, SrStreams{}).to(Device::CPU);
    gpu.invalidate_weight_cache();
    const Tensor fresh = gpu.logits(tokens, SrStreams{}).to(Device::CPU);
    ASSERT_EQ(after_training.nbytes(), fresh.nbytes());
    EXPECT_EQ(0, std::memcmp(after_training.raw(), fresh.raw(), size_t(fresh.nbytes()))) << "logits";
  }
}

