// defines: tests of the pretraining loop (fourbit::pretrain) on a 4-layer MoE on the synthetic
//          corpus: (a) the same seed gives byte-identical metrics.jsonl and checkpoints, another
//          seed different metrics; (b) stopping and resuming from a checkpoint (or from an earlier
//          checkpoint after a crash) continues bit for bit, and resuming a finished run keeps
//          its results; (c) gradient accumulation covers the same data as one larger batch;
//          (d) saved activation bytes per recipe (the table is printed): nvfp4-fwd keeps fewer
//          expert bytes than bf16 and mxfp8, and each NVFP4 expert layer under 0.35x the bytes
//          of BF16; (e) the loss goes down.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/model.h"
#include "fourbit/train/trainer.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
namespace fs = std::filesystem;

namespace {

TrainSummary train(const RunConfig& cfg, const std::string& recipe, const std::string& dir,
                   std::optional<int64_t> steps = std::nullopt, bool resume = false,
                   std::optional<uint64_t> seed = std::nullopt) {
  PretrainOptions opt;
  opt.config = cfg;
  opt.recipe = recipe;
  opt.out_dir = dir;
  opt.resume = resume;
  opt.steps = steps;
  opt.seed = seed;
  opt.quiet = true;
  return pretrain(opt);
}

// Expert bytes one nvfp4-fwd MoE layer keeps for N tokens: each input row of the routed experts
// (N * top_k rows) and of the shared expert (N rows) as NVFP4 codes (D/2 bytes), E4M3 block
// scales (D/16) and its FP32 per-token scale (4).
int64_t Nvfp4LayerBytes(const ModelConfig& c, int64_t N) {
  const int64_t D = c.d_model, rows = N * c.top_k + (c.n_shared_experts ? N : 0);
  return rows * (D / 2 + D / 16 + 4);
}

std::string metrics_of(const std::string& dir) { return file_bytes(dir + "/metrics.jsonl"); }

std::string checkpoint_file(const std::string& dir, int64_t step, const std::string& name) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06lld", (long long)step);
  return dir + "/checkpoints/" + buf + "/" + name;
}

std::vector<nlohmann::json> metric_lines(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::istringstream in(metrics_of(dir));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The whole run (metrics and every file of the final checkpoint) is byte-identical.
void expect_same_run(const std::string& a, const std::string& b, int64_t final_step, const std::string& what) {
  EXPECT_EQ(metrics_of(a), metrics_of(b)) << what << ": metrics.jsonl differs";
  for (const char* f : {"model.safetensors", "optim.safetensors"}) {
    const std::string fa = file_bytes(checkpoint_file(a, final_step, f)), fb = file_bytes(checkpoint_file(b, final_step, f));
    EXPECT_FALSE(fa.empty()) << what << ": " << f;
    EXPECT_TRUE(fa == fb) << what << ": final " << f << " differs";
  }
}

}  // namespace

// ---- (a) determinism ----------------------------------------------------------------------------

TEST(Trainer, SameSeedSameBytesOtherSeedOtherLosses) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("trainer_tests");
  const RunConfig cfg = tiny_run_config();
  for (const char* recipe : {"nvfp4-fwd", "nvidia-nvfp4"}) {  // both use stochastic rounding
    const std::string a = root + "/" + recipe + "-a", b = root + "/" + recipe + "-b", c = root + "/" + recipe + "-c";
    train(cfg, recipe, a);
    train(cfg, recipe, b);
    expect_same_run(a, b, 6, std::string(recipe) + " same seed");
    EXPECT_EQ(metric_lines(a).size(), 6u);
    train(cfg, recipe, c, std::nullopt, false, 4321);
    EXPECT_NE(metrics_of(a), metrics_of(c)) << recipe << ": a different seed gave the same metrics";
    EXPECT_NE(metric_lines(a)[0]["loss"], metric_lines(c)[0]["loss"]) << recipe << ": the initial model ignores the seed";
  }
}

// ---- (b) resume ---------------------------------------------------------------------------------

TEST(Trainer, StopAndResumeContinuesBitForBit) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("trainer_tests");
  RunConfig cfg = tiny_run_config();
  cfg.train.checkpoint_every = 3;
  // The first 3 steps are warmup, whose learning rates do not depend on train.steps, so a run
  // stopped with steps = 3 has done exactly the first half of the 6-step run.
  cfg.train.warmup_steps = 3;
  for (const char* recipe : {"nvfp4-fwd", "mxfp8"}) {
    const std::string a = root + "/" + recipe + "-a", b = root + "/" + recipe + "-b";
    train(cfg, recipe, a);
    train(cfg, recipe, b, 3);
    EXPECT_EQ(metric_lines(b).size(), 3u);
    EXPECT_TRUE(file_bytes(checkpoint_file(a, 3, "model.safetensors")) ==
                file_bytes(checkpoint_file(b, 3, "model.safetensors")))
        << recipe << ": step-3 checkpoints differ";
    train(cfg, recipe, b, 6, /*resume=*/true);
    expect_same_run(a, b, 6, std::string(recipe) + " stopped at 3, resumed to 6");
  }
}

// A crash after the step-3 checkpoint: the run directory holds metrics of steps 4-6 (and here
// their checkpoint, which `latest` no longer names). Resuming from step 3 truncates the metrics
// and redoes steps 4-6 to the same bytes, with the cosine schedule active (warmup 2).
TEST(Trainer, ResumeAfterACrashRedoesTheLostSteps) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("trainer_tests");
  RunConfig cfg = tiny_run_config();
  cfg.train.checkpoint_every = 3;
  const std::string a = root + "/a", b = root + "/b";
  train(cfg, "nvfp4-fwd", a);
  train(cfg, "nvfp4-fwd", b);
  fs::remove_all(fs::path(checkpoint_file(b, 6, "")).parent_path());
  {
    std::ofstream latest(b + "/checkpoints/latest", std::ios::trunc);
    latest << "step-000003\n";
  }
  {
    std::ofstream torn(b + "/metrics.jsonl", std::ios::app);
    torn << "{\"step\": 7, \"lo";  // a torn line from the crash
  }
  train(cfg, "nvfp4-fwd", b, std::nullopt, /*resume=*/true);
  expect_same_run(a, b, 6, "crash after step 3, resumed");
}

// Resuming a run that already reached train.steps has nothing to train. It must not clobber
// the run's results: either it fails saying so, or it leaves metrics, checkpoints and the
// summary's losses as they were.
TEST(Trainer, ResumingAFinishedRunKeepsItsResults) {
  const OmpThreads one_thread(1);
  const std::string dir = fresh_test_dir("trainer_tests") + "/run";
  RunConfig cfg = tiny_run_config();
  cfg.train.eval_every = 0;
  const TrainSummary first = train(cfg, "nvfp4-fwd", dir, 3);
  const std::string metrics = metrics_of(dir), model = file_bytes(checkpoint_file(dir, 3, "model.safetensors"));
  const nlohmann::json summary = nlohmann::json::parse(file_bytes(dir + "/summary.json"));
  try {
    const TrainSummary again = train(cfg, "nvfp4-fwd", dir, 3, /*resume=*/true);
    EXPECT_EQ(again.final_train_loss, first.final_train_loss) << "the summary of a finished run was rewritten";
    EXPECT_EQ(again.final_eval_loss, first.final_eval_loss);
  } catch (const Error& e) {
    std::printf("  resuming a finished run fails: %s\n", e.what());
  }
  EXPECT_EQ(metrics_of(dir), metrics);
  EXPECT_TRUE(file_bytes(checkpoint_file(dir, 3, "model.safetensors")) == model);
  const nlohmann::json after = nlohmann::json::parse(file_bytes(dir + "/summary.json"));
  EXPECT_EQ(after["final_train_loss"], summary["final_train_loss"]) << "summary.json of a finished run was rewritten";
  EXPECT_EQ(after["saved_activation_bytes"], summary["saved_activation_bytes"]);
}

// ---- (c) gradient accumulation ------------------------------------------------------------------

// Micro-batch i of step s is batch s * grad_accum + i, and the sequence stream does not depend on
// the batch size, so 2 x 2 sequences cover the 4 sequences of one batch of 4. The forward is
// batch invariant, so the first step's loss is the same up to the order of the final sums.
TEST(Trainer, GradientAccumulationSeesTheSameData) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("trainer_tests");
  RunConfig big = tiny_run_config();
  big.train.batch_size = 4;
  big.train.steps = 2;
  big.train.eval_every = 0;
  RunConfig acc = big;
  acc.train.batch_size = 2;
  acc.train.grad_accum = 2;
  train(big, "nvfp4-fwd", root + "/big");
  const TrainSummary s = train(acc, "nvfp4-fwd", root + "/acc");
  const auto lb = metric_lines(root + "/big"), la = metric_lines(root + "/acc");
  ASSERT_EQ(lb.size(), 2u);
  ASSERT_EQ(la.size(), 2u);
  const double l_big = lb[0]["loss"].get<double>(), l_acc = la[0]["loss"].get<double>();
  EXPECT_NEAR(l_acc, l_big, 1e-12 * l_big) << "first-step loss: 1 x 4 sequences vs 2 x 2";
  // After one update the parameters differ by the rounding of the gradient sums only.
  EXPECT_NEAR(la[1]["loss"].get<double>(), lb[1]["loss"].get<double>(), 1e-3 * l_big);
  EXPECT_NEAR(la[0]["grad_norm"].get<double>(), lb[0]["grad_norm"].get<double>(),
              1e-2 * lb[0]["grad_norm"].get<double>());
  ASSERT_TRUE(s.final_train_loss && s.final_eval_loss);
  EXPECT_TRUE(std::isfinite(*s.final_train_loss));
  EXPECT_TRUE(std::isfinite(*s.final_eval_loss));
}

// ---- (d) saved activation bytes -----------------------------------------------------------------

TEST(Trainer, SavedActivationBytesPerRecipe) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("trainer_tests");
  RunConfig cfg = tiny_run_config();  // 4 layers: 0 dense, 1-2 MoE, 3 MoE in nvfp4-fwd's MXFP8 tail
  cfg.train.eval_every = 0;
  std::map<std::string, std::map<std::string, int64_t>> bytes;
  const std::vector<std::string> recipes = {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"};
  for (const std::string& r : recipes) bytes[r] = train(cfg, r, root + "/" + r, 1).saved_bytes;
  std::printf("  saved activation bytes per micro-batch (B=%lld, T=%lld, d_model=%lld, %lld layers):\n",
              (long long)cfg.train.batch_size, (long long)cfg.train.seq_len, (long long)cfg.model.d_model,
              (long long)cfg.model.n_layers);
  std::printf("  %-10s", "category");
  for (const auto& r : recipes) std::printf(" %13s", r.c_str());
  std::printf("\n");
  for (const char* cat : {"residual", "attention", "router", "expert", "dense", "lm_head"}) {
    std::printf("  %-10s", cat);
    for (const auto& r : recipes) std::printf(" %13lld", (long long)bytes[r][cat]);
    std::printf("\n");
  }
  const int64_t fwd = bytes["nvfp4-fwd"]["expert"], bf16 = bytes["bf16"]["expert"], mx = bytes["mxfp8"]["expert"];
  std::printf("  expert bytes: nvfp4-fwd / bf16 = %.3f, nvfp4-fwd / mxfp8 = %.3f, mxfp8 / bf16 = %.3f\n",
              double(fwd) / double(bf16), double(fwd) / double(mx), double(mx) / double(bf16));
  ASSERT_GT(bf16, 0);
  EXPECT_LT(fwd, mx);
  EXPECT_LT(fwd, bf16);
  // Not < 0.35 x bf16 for the whole model: the last ceil(L/6) layers (here layer 3 of 1-3) run
  // their experts in MXFP8, which keeps the input twice (row- and column-blocked: 2 x 8.25 bits,
  // 1.03x bf16, plus per-expert padding to 32 tokens: 1.375x here), so at any depth at least one
  // layer in six costs >= 1.03x and the whole-model ratio is >= (5 x 0.31 + 1.03) / 6 = 0.43.
  // The 0.35 bound holds per NVFP4 layer: the next test checks it exactly.
}

// The per-layer claim behind (d), without the MXFP8 tail: an nvfp4-fwd MoE layer keeps each
// expert input row as NVFP4 codes (D/2 bytes) + E4M3 block scales (D/16) + a per-token FP32 scale
// (4): for the routed rows (N*k) and the shared expert's (N). BF16 keeps 2 bytes per value.
TEST(Trainer, Nvfp4ExpertLayersKeepPackedInputsOnly) {
  const OmpThreads one_thread(1);
  ModelConfig c = tiny_run_config().model;
  Recipe no_tail = recipe_by_name("nvfp4-fwd");  // recipes are data: the same recipe, no tail
  no_tail.tail_fraction = 0;
  const Tensor tokens = random_tokens(2, 16, 8);
  const Tensor targets = shifted_targets(tokens, 258);
  auto expert_bytes = [&](const Recipe& r) {
    Model m(c, r, Device::CPU);
    init_params(m.params(), c, 1);
    m.forward(tokens, targets, SrStreams{1, 0, 0}, true);
    m.backward();
    return m.saved_bytes().by_category.at("expert");
  };
  const int64_t N = 32, rows = N * c.top_k + N, moe_layers = c.n_layers - c.dense_layers;
  const int64_t fwd = expert_bytes(no_tail), bf16 = expert_bytes(recipe_by_name("bf16"));
  EXPECT_EQ(fwd, moe_layers * Nvfp4LayerBytes(c, N));
  EXPECT_EQ(bf16, moe_layers * rows * c.d_model * 2);
  EXPECT_LT(double(fwd), 0.35 * double(bf16));
}

// ---- (e) it learns ------------------------------------------------------------------------------

TEST(Trainer, LossDecreasesUnderNvfp4Fwd) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("trainer_tests");
  RunConfig cfg = tiny_run_config();
  cfg.train.steps = 30;
  cfg.train.lr = 1e-2;
  cfg.train.warmup_steps = 3;
  cfg.train.eval_every = 0;
  const TrainSummary s = train(cfg, "nvfp4-fwd", root + "/run");
  const auto lines = metric_lines(root + "/run");
  ASSERT_EQ(lines.size(), 30u);
  const double first = lines.front()["loss"].get<double>();
  ASSERT_TRUE(s.final_train_loss && s.final_eval_loss);
  std::printf("  nvfp4-fwd: first-step loss %.4f, final %.4f, eval %.4f, unigram entropy %.4f\n", first,
              *s.final_train_loss, *s.final_eval_loss, s.extra["unigram_entropy_nats"].get<double>());
  EXPECT_NEAR(first, std::log(260.0), 0.3) << "an untrained model should be near uniform";
  EXPECT_LT(*s.final_train_loss, first - 0.5);
  EXPECT_LT(*s.final_eval_loss, first - 0.5);
}
