// defines: tests of the one training loop (train/loop.h) through a small custom TrainingSource,
//          the way sft and rl plug in: (a) the hooks are called in the documented order with
//          the weights of the step at hand; (b) per-token weights and -1 targets reach the loss
//          (the logged loss is the weighted mean the model computes for that batch) and a
//          custom loss_weight gives a token-mean over the step; (c) extra metrics and a side
//          output land in metrics.jsonl and samples.jsonl; (d) a run stopped by SIGINT (raised
//          in-process mid-step) and resumed ends with the same bytes as an uninterrupted one,
//          side output included; (e) --init starts from another run's weights with fresh
//          moments; (f) the LR schedule's extension is continuous and keeps its end.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/io/safetensors.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/loop.h"
#include "fourbit/train/optimizer.h"
#include "model/model_test_util.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using fourbit::testutil::error_of;
namespace fs = std::filesystem;

namespace {

// Prompt/answer-shaped batches: a row's first half is "prompt" (targets -1), the rest carries
// loss with weight +1 on even rows and -0.5 on odd rows (an RL-like signed advantage). Tokens
// are a pure function of (seed, step, micro), so resume can regenerate them. It records every
// call and the parameters' checksum at before_step.
class FakeSource : public TrainingSource {
 public:
  std::vector<std::string> calls;
  std::vector<double> weight_sums;  // sum of the weights seen by before_step, per step
  bool token_mean = false;          // loss_weight = n_valid(micro) / n_valid(step)

  std::string describe() const override { return "fake prompt/answer batches"; }
  nlohmann::json record() const override { return {{"kind", "fake"}, {"token_mean", token_mean}}; }
  std::vector<std::string> side_outputs() const override { return {"samples.jsonl"}; }
  void start(Model& model, const RunConfig& config) override {
    (void)model;
    cfg_ = config;
    calls.push_back("start");
  }
  void before_step(const StepContext& ctx, Model& model) override {
    calls.push_back("before " + std::to_string(ctx.step));
    weight_sums.push_back(host_sum(model.params().flat()));
  }
  int64_t micro_batches(const StepContext& ctx) const override {
    (void)ctx;
    return 2;
  }
  MicroBatch micro_batch(const StepContext& ctx, int64_t micro) override {
    calls.push_back("batch " + std::to_string(ctx.step) + "." + std::to_string(micro));
    return make(ctx.seed, ctx.step, micro);
  }
  void after_step(const StepContext& ctx, Model& model, nlohmann::json& line) override {
    (void)model;
    calls.push_back("after " + std::to_string(ctx.step));
    line["fake_metric"] = 2 * ctx.step;
    ctx.write("samples.jsonl", {{"text", "sample of step " + std::to_string(ctx.step)}});
  }
  void evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) override {
    calls.push_back("eval " + std::to_string(ctx.step));
    const MicroBatch b = make(ctx.seed ^ 0xE1, 0, 0);
    line["eval_accuracy"] = accuracy(model, b);
  }

  // The micro-batch (seed, step, micro): B = 2 rows of T = 8.
  MicroBatch make(uint64_t seed, int64_t step, int64_t micro) const {
    const int64_t B = 2, T = 8;
    const Tensor tokens = random_tokens(B, T, seed * 1000 + uint64_t(step) * 10 + uint64_t(micro));
    Tensor targets = shifted_targets(tokens, 258);
    std::vector<float> w(size_t(B * T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        if (t < T / 2 + micro) targets.data<int32_t>()[b * T + t] = -1;  // the prompt: no loss
        w[size_t(b * T + t)] = b % 2 ? -0.5f : 1.0f;
      }
    MicroBatch mb;
    mb.tokens = tokens;
    mb.targets = targets;
    mb.weights = Tensor::from_host(w.data(), {B, T}, DType::F32);
    if (token_mean) mb.loss_weight = float(valid(targets)) / float(valid(make_targets(seed, step, 0)) + valid(make_targets(seed, step, 1)));
    return mb;
  }
  Tensor make_targets(uint64_t seed, int64_t step, int64_t micro) const {
    FakeSource plain;
    return plain.make(seed, step, micro).targets;
  }
  static int64_t valid(const Tensor& targets) {
    int64_t n = 0;
    for (int64_t i = 0; i < targets.numel(); ++i) n += targets.data<int32_t>()[i] >= 0;
    return n;
  }
  static double host_sum(const Tensor& t) {
    double s = 0;
    for (int64_t i = 0; i < t.numel(); ++i) s += double(t.data<float>()[i]);
    return s;
  }
  static double accuracy(Model& m, const MicroBatch& b) {
    const Tensor logits = m.logits(b.tokens, SrStreams{});
    const int64_t V = logits.size(1);
    int64_t right = 0, n = 0;
    for (int64_t i = 0; i < b.targets.numel(); ++i) {
      const int32_t t = b.targets.data<int32_t>()[i];
      if (t < 0) continue;
      const float* row = logits.data<float>() + i * V;
      right += std::max_element(row, row + V) - row == t;
      ++n;
    }
    return double(right) / double(n);
  }

 private:
  RunConfig cfg_;
};

RunConfig fake_config() {
  RunConfig c = tiny_run_config(2, 32);
  c.model.d_expert = 32;
  c.train.steps = 4;
  c.train.warmup_steps = 1;
  c.train.eval_every = 2;
  c.train.checkpoint_every = 100;
  return c;
}

LoopOptions options(const RunConfig& cfg, const std::string& dir) {
  LoopOptions o;
  o.config = cfg;
  o.recipe = "mxfp8";
  o.out_dir = dir;
  o.command = "fake";
  o.quiet = true;
  return o;
}

std::vector<nlohmann::json> lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(file_bytes(path));
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(nlohmann::json::parse(l));
  return out;
}

// Sets FOURBIT_TEST_RAISE for one scope.
struct RaiseAt {
  explicit RaiseAt(const char* spec) { ::setenv("FOURBIT_TEST_RAISE", spec, 1); }
  ~RaiseAt() { ::unsetenv("FOURBIT_TEST_RAISE"); }
};

}  // namespace

TEST(TrainingLoop, HooksRunInOrderWithTheStepsWeights) {
  const OmpThreads one_thread(1);
  const std::string dir = fresh_test_dir("loop_tests") + "/run";
  FakeSource src;
  RunConfig cfg = fake_config();
  cfg.train.steps = 3;
  const TrainSummary s = run_training(options(cfg, dir), src);
  const std::vector<std::string> want = {"start",     "before 0",  "batch 0.0", "batch 0.1", "after 0",
                                         "before 1",  "batch 1.0", "batch 1.1", "after 1",   "eval 1",
                                         "before 2",  "batch 2.0", "batch 2.1", "after 2",   "eval 2"};
  EXPECT_EQ(src.calls, want);
  // before_step sees the weights its step updates: each step's differ from the previous.
  ASSERT_EQ(src.weight_sums.size(), 3u);
  EXPECT_NE(src.weight_sums[0], src.weight_sums[1]);
  EXPECT_NE(src.weight_sums[1], src.weight_sums[2]);
  EXPECT_EQ(s.steps_done, 3);
  EXPECT_TRUE(s.final_eval.contains("eval_accuracy"));
  EXPECT_FALSE(s.final_eval_loss) << "the source measured no eval loss; none may be reported";
}

// The loop's logged loss for step 1 is what the model computes for the source's batches with
// their weights and masks: mean over micro-batches of sum(w * CE) / n_valid; with a token-mean
// loss_weight, sum over the step of w * CE / n_valid(step).
TEST(TrainingLoop, WeightsAndMasksReachTheLoss) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("loop_tests");
  RunConfig cfg = fake_config();
  cfg.train.steps = 1;
  for (const bool token_mean : {false, true}) {
    FakeSource src;
    src.token_mean = token_mean;
    run_training(options(cfg, root + (token_mean ? "/mean" : "/plain")), src);
    const double logged = lines(root + (token_mean ? "/mean" : "/plain") + "/metrics.jsonl")[0]["loss"].get<double>();

    Model m(cfg.model, recipe_by_name("mxfp8"), Device::CPU);
    init_params(m.params(), cfg.model, cfg.train.seed);
    double want = 0, masked = 0;
    int64_t step_valid = 0;
    for (int64_t micro = 0; micro < 2; ++micro) {
      const MicroBatch b = src.make(cfg.train.seed, 0, micro);
      const ForwardStats st = m.forward(b.tokens, b.targets, SrStreams{cfg.train.seed, 0, uint64_t(micro)}, false);
      const ForwardStats sw = m.forward(b.tokens, b.targets, SrStreams{cfg.train.seed, 0, uint64_t(micro)}, false, 1.0f, b.weights);
      // Recompute sum(w * CE) / n from the per-token losses: the weights and the mask as given.
      double sum = 0;
      for (int64_t i = 0; i < b.targets.numel(); ++i)
        if (b.targets.data<int32_t>()[i] >= 0)
          sum += double(b.weights.data<float>()[i]) * double(sw.token_losses.data<float>()[i]);
        else
          EXPECT_EQ(sw.token_losses.data<float>()[i], 0.0f) << "a -1 target carries no loss";
      EXPECT_NEAR(sw.loss, sum / double(sw.tokens), 1e-12);
      EXPECT_NE(sw.loss, st.loss) << "the weights changed nothing";
      step_valid += sw.tokens;
      masked += sum;
      want += token_mean ? sw.loss * double(*b.loss_weight) : sw.loss / 2.0;
    }
    EXPECT_EQ(logged, want) << (token_mean ? "token-mean" : "mean of micro-batches");
    if (token_mean) {
      EXPECT_NEAR(logged, masked / double(step_valid), 1e-6) << "token-mean over the step";
    }
  }
}

TEST(TrainingLoop, ExtraMetricsAndSideOutputs) {
  const OmpThreads one_thread(1);
  const std::string dir = fresh_test_dir("loop_tests") + "/run";
  FakeSource src;
  run_training(options(fake_config(), dir), src);
  const auto m = lines(dir + "/metrics.jsonl");
  ASSERT_EQ(m.size(), 4u);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(m[size_t(i)]["step"], i + 1);
    EXPECT_EQ(m[size_t(i)]["fake_metric"], 2 * i);
    EXPECT_EQ(m[size_t(i)].contains("eval_accuracy"), i == 1 || i == 3);
    EXPECT_FALSE(m[size_t(i)].contains("eval_loss"));
  }
  const auto samples = lines(dir + "/samples.jsonl");
  ASSERT_EQ(samples.size(), 4u);
  EXPECT_EQ(samples[2]["step"], 3);
  EXPECT_EQ(samples[2]["text"], "sample of step 2");
  const nlohmann::json rec = nlohmann::json::parse(file_bytes(dir + "/config.json"));
  EXPECT_EQ(rec["command"], "fake");
  EXPECT_EQ(rec["source"]["kind"], "fake");
}

// SIGINT raised inside step 2 (after its first micro-batch): the loop finishes step 2, writes
// its checkpoint and returns; the resume (from the run's own record) redoes nothing and ends
// with the bytes of an uninterrupted run: metrics, side output and the final checkpoint.
TEST(TrainingLoop, StoppedBySignalAndResumedIsBitExact) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("loop_tests");
  const RunConfig cfg = fake_config();
  FakeSource a;
  run_training(options(cfg, root + "/a"), a);
  FakeSource b1;
  TrainSummary stopped;
  {
    const RaiseAt raise("SIGINT:step:2");
    stopped = run_training(options(cfg, root + "/b"), b1);
  }
  EXPECT_EQ(stopped.stopped_by, SIGINT);
  EXPECT_EQ(stopped.steps_done, 2);
  EXPECT_EQ(fs::path(stopped.checkpoint).filename(), "step-000002");
  EXPECT_FALSE(fs::exists(root + "/b/summary.json")) << "an interrupted run has no summary";
  EXPECT_EQ(lines(root + "/b/metrics.jsonl").size(), 2u);
  FakeSource b2;
  LoopOptions resume = options(cfg, root + "/b");
  resume.resume = true;
  const TrainSummary done = run_training(resume, b2);
  EXPECT_EQ(done.stopped_by, 0);
  EXPECT_EQ(b2.calls.front(), "start");
  EXPECT_EQ(b2.calls[1], "before 2") << "the resume starts at the step after the checkpoint";
  for (const char* f : {"metrics.jsonl", "samples.jsonl", "checkpoints/step-000004/model.safetensors",
                        "checkpoints/step-000004/optim.safetensors"})
    EXPECT_TRUE(file_bytes(root + "/a/" + f) == file_bytes(root + "/b/" + f)) << f << " differs";
  const nlohmann::json rec = nlohmann::json::parse(file_bytes(root + "/b/config.json"));
  ASSERT_EQ(rec["resumes"].size(), 1u);
  EXPECT_EQ(rec["resumes"][0]["step"], 2);
  EXPECT_EQ(rec["resumes"][0]["changed"], nlohmann::json::object());
  // A resume whose source differs is refused, naming the key.
  FakeSource other;
  other.token_mean = true;
  LoopOptions again = options(cfg, root + "/b");
  again.resume = true;
  again.steps = 6;
  EXPECT_NE(error_of([&] { run_training(again, other); }).find("source.token_mean: the run has false, this command gives true"),
            std::string::npos);
}

// --init: the new run's step 0 holds the old run's final weights and zero moments; its record
// says where they came from; a [model] that differs is refused naming the field.
TEST(TrainingLoop, InitStartsFromAnotherRunsWeights) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("loop_tests");
  const RunConfig cfg = fake_config();
  FakeSource a;
  run_training(options(cfg, root + "/a"), a);
  FakeSource b;
  LoopOptions o = options(cfg, root + "/b");
  o.init_from = root + "/a";
  o.steps = 0;
  run_training(o, b);
  const auto old_w = io::read_safetensors(root + "/a/checkpoints/step-000004/model.safetensors");
  const auto new_w = io::read_safetensors(root + "/b/checkpoints/step-000000/model.safetensors");
  ASSERT_EQ(old_w.tensors.size(), new_w.tensors.size());
  for (size_t i = 0; i < old_w.tensors.size(); ++i) {
    const Tensor& x = old_w.tensors[i].second;
    EXPECT_EQ(std::memcmp(x.raw(), new_w.tensors[i].second.raw(), size_t(x.nbytes())), 0) << old_w.tensors[i].first;
  }
  for (const auto& [name, t] : io::read_safetensors(root + "/b/checkpoints/step-000000/optim.safetensors").tensors)
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.data<float>()[i], 0.0f) << name << ": moments must start fresh";
  const nlohmann::json rec = nlohmann::json::parse(file_bytes(root + "/b/config.json"));
  EXPECT_EQ(rec["init"]["step"], 4);
  EXPECT_EQ(rec["init"]["from"], root + "/a");
  RunConfig wider = cfg;
  wider.model.d_model = 64;
  wider.origin["model.d_model"] = "new.toml:3";
  LoopOptions bad = options(wider, root + "/c");
  bad.init_from = root + "/a";
  EXPECT_NE(error_of([&] { run_training(bad, b); }).find("model.d_model is 32 in that run, but new.toml:3 gives 64"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(root + "/c")) << "a refused --init must not create its run directory";
}

// ---- the learning-rate schedule and its extension -------------------------------------------

TEST(LrSchedule, WithoutChangesItIsLrAtBitForBit) {
  TrainConfig t;
  t.steps = 50;
  t.warmup_steps = 5;
  const LrSchedule s(t);
  for (int64_t i = 0; i < 60; ++i) EXPECT_EQ(s.lr(i), lr_at(t, i)) << i;
}

TEST(LrSchedule, ExtendingKeepsTheRateContinuousAndEndsAtTheMinimum) {
  TrainConfig t;
  t.steps = 300;
  t.warmup_steps = 20;
  t.lr = 3e-3;
  t.min_lr_ratio = 0.1;
  const LrSchedule first(t);
  for (const int64_t at : {20, 150, 299}) {
    const LrSchedule longer = first.with_length(at, 600);
    EXPECT_EQ(longer.total_steps(), 600);
    for (int64_t i = 0; i <= at; ++i) ASSERT_EQ(longer.lr(i), first.lr(i)) << "steps before " << at << " changed";
    // No jump: the step after the change moves by no more than the old schedule's steepest step.
    double steepest = 0;
    for (int64_t i = 21; i < 300; ++i) steepest = std::max(steepest, first.lr(i - 1) - first.lr(i));
    EXPECT_LE(std::abs(longer.lr(at + 1) - longer.lr(at)), steepest) << at;
    for (int64_t i = t.warmup_steps + 1; i < 600; ++i) ASSERT_LE(longer.lr(i), longer.lr(i - 1)) << "rises at " << i;
    EXPECT_NEAR(longer.lr(599), t.lr * t.min_lr_ratio, 1e-15);
  }
  // Extended again, and shortened: both from where the previous change left it.
  const LrSchedule twice = first.with_length(100, 400).with_length(250, 320);
  EXPECT_EQ(twice.lr(250), first.with_length(100, 400).lr(250));
  EXPECT_NEAR(twice.lr(319), t.lr * t.min_lr_ratio, 1e-15);
  const LrSchedule back = LrSchedule::from_json(t, twice.to_json(), "state.json");
  for (int64_t i = 0; i < 320; ++i) ASSERT_EQ(back.lr(i), twice.lr(i));
  // A change during warmup is the plain schedule of the new length.
  TrainConfig t600 = t;
  t600.steps = 600;
  const LrSchedule early = first.with_length(10, 600);
  for (int64_t i = 0; i < 600; ++i) ASSERT_EQ(early.lr(i), lr_at(t600, i)) << i;
  // After the end: the minimum rate on.
  const LrSchedule after = first.with_length(300, 350);
  EXPECT_EQ(after.lr(300), t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.0));
  EXPECT_NE(error_of([&] { first.with_length(150, 150); }).find("give --steps > 150"), std::string::npos);
}
