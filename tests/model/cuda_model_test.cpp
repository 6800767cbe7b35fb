// defines: GPU model tests (skipped without a GPU): 50 steps of configs/tiny.toml on the GPU track
// the CPU loss curve for every recipe (same first-step loss, curves within a few percent); two GPU
// runs write byte-identical metrics; a sequence's logits on the GPU are bitwise the same alone
// and inside a batch of 8 (every recipe with per-token activation scales).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/model.h"
#include "fourbit/train/trainer.h"
#include "fourbit/tensor/device_memory.h"

using namespace fourbit;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

std::vector<double> losses(const std::string& run_dir, const char* key) {
  std::ifstream in(std::filesystem::path(run_dir) / "metrics.jsonl");
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j[key].get<double>());
  }
  return out;
}

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

TEST_P(CudaTraining, FiftyStepsTrackTheCpuLossCurve) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string recipe = GetParam();
  const std::string root = std::string(FOURBIT_TEST_DATA_DIR) + "/cuda_track_" + recipe;
  PretrainOptions opt = tiny_run(recipe, 50, 25, root);
  opt.device = Device::CPU;
  opt.out_dir = root + "/cpu";
  const TrainSummary cpu = pretrain(opt);
  opt.device = Device::CUDA;
  opt.out_dir = root + "/gpu";
  const TrainSummary gpu = pretrain(opt);
  const auto lc = losses(root + "/cpu", "loss"), lg = losses(root + "/gpu", "loss");
  ASSERT_EQ(lc.size(), 50u);
  ASSERT_EQ(lg.size(), 50u);
  double mean = 0, worst = 0;
  for (size_t i = 0; i < lc.size(); ++i) {
    const double d = std::abs(lg[i] - lc[i]) / lc[i];
    mean += d / double(lc.size());
    worst = std::max(worst, d);
  }
  const double first = std::abs(lg[0] - lc[0]) / lc[0];
  ASSERT_TRUE(cpu.final_eval_loss && gpu.final_eval_loss && cpu.final_train_loss && gpu.final_train_loss);
  const double eval = std::abs(*gpu.final_eval_loss - *cpu.final_eval_loss) / *cpu.final_eval_loss;
  std::printf("%s: step-1 loss cpu %.6f gpu %.6f (rel %.2e); final train cpu %.4f gpu %.4f; final eval cpu %.4f "
              "gpu %.4f (rel %.4f); per-step rel diff mean %.4f worst %.4f\n",
              recipe.c_str(), lc[0], lg[0], first, *cpu.final_train_loss, *gpu.final_train_loss, *cpu.final_eval_loss,
              *gpu.final_eval_loss, eval, mean, worst);
  // Step 1 is one forward pass from the same weights on the same batch: only accumulation order
  // and the BF16 attention core differ. After that, every routing decision that flips on a
  // near-tie sends the two runs down different (equally good) paths, so the curves are compared
  // as curves: measured on an H200 (2026-11-30) the final eval losses differed by 0.8-4.7% and
  // the mean per-step difference stayed within a few percent.
  EXPECT_LT(first, 2e-3);
  EXPECT_LT(mean, 0.06);
  EXPECT_LT(eval, 0.07);
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
