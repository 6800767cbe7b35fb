// defines: tests of the training micro-batch as a CUDA graph replay (model/step_graph.h,
//          train.cuda_graphs): (a) a GPU run that replays its micro-batches writes an eager run's
//          metrics bytes (loss, gradient norm, evaluations) step for step, with gradient
//          accumulation, token weights and evaluation forwards of another batch shape after every
//          step, and its summary counts the replays, under the bf16 and the mxfp8 recipe (its
//          experts' pairs on the device offsets, set_moe_pairs_on_device_offsets; its weights'
//          forms made again in place before a replay after an update); (b) a bad
//          token id in a replayed micro-batch fails at its stats, naming it; (c) gradient
//          accumulation's two recorded kinds share one pool of blocks; (d) a recipe whose
//          micro-batch draws SR bits and reads the routing back (nvfp4-fwd; mxfp8 with its pairs
//          on the host's offsets) is never recorded;
//          (e) on the CPU every micro-batch runs eagerly, the bits of forward_queued and backward.
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/step_graph.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/loop.h"
#include "model/model_test_util.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using fourbit::testutil::error_of;

namespace {

// Two micro-batches a step of B = 2 rows of T = 12, a prompt of 3 positions without loss and
// signed per-token weights; every evaluation runs a forward of 3 rows of 7 (another shape, so the
// model's positions for it replace the ones a graph recorded).
class ShapedSource : public TrainingSource {
 public:
  std::string describe() const override { return "graph test batches"; }
  nlohmann::json record() const override { return {{"kind", "graph-test"}}; }
  int64_t micro_batches(const StepContext& ctx) const override {
    (void)ctx;
    return 2;
  }
  MicroBatch micro_batch(const StepContext& ctx, int64_t micro) override {
    const int64_t B = 2, T = 12;
    MicroBatch mb;
    mb.tokens = random_tokens(B, T, ctx.seed * 1000 + uint64_t(ctx.step) * 10 + uint64_t(micro));
    mb.targets = shifted_targets(mb.tokens, 258);
    std::vector<float> w(size_t(B * T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        if (t < 3) mb.targets.data<int32_t>()[b * T + t] = -1;
        w[size_t(b * T + t)] = (b % 2 ? -0.5f : 1.0f) + 0.25f * float(micro);
      }
    mb.weights = Tensor::from_host(w.data(), {B, T}, DType::F32);
    return mb;
  }
  void evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) override {
    const Tensor tokens = random_tokens(3, 7, 99 + uint64_t(ctx.step)).to(ctx.device);
    const Tensor logits = model.logits(tokens, SrStreams{}).to(Device::CPU);
    double sum = 0;
    for (int64_t i = 0; i < logits.numel(); ++i) sum += double(logits.data<float>()[i]);
    line["eval_logit_sum"] = sum;
  }
};

// A model of gpu_test_config() under `recipe` on the GPU with the same micro-batch (B = 2, T = 12)
// run three times, each the first of its step, through StepGraphs: eager, eager and then recorded
// where the model can be, replayed.
struct ThreeMicroBatches {
  Model m;
  StepGraphs graphs;
  Tensor tokens, targets;
  std::vector<double> losses;
  explicit ThreeMicroBatches(const std::string& recipe)
      : m(gpu_test_config(), recipe_by_name(recipe), Device::CUDA), graphs(m, true) {
    init_params(m.params(), gpu_test_config(), 5);
    tokens = random_tokens(2, 12, 6).to(Device::CUDA);
    targets = shifted_targets(random_tokens(2, 12, 6), 258).to(Device::CUDA);
    for (int i = 0; i < 3; ++i) losses.push_back(run(tokens, i).stats().loss);
  }
  PendingForwardStats run(const Tensor& toks, int step) {
    m.params().zero_grad();
    return graphs.run(toks, targets, Tensor(), 1.0f, SrStreams{11, uint64_t(step), 0}, true);
  }
};

TrainSummary run_shaped(const std::string& dir, bool graphs, const std::string& recipe) {
  RunConfig cfg = tiny_run_config(3, 64);
  cfg.model = gpu_test_config();
  cfg.train.steps = 6;
  cfg.train.warmup_steps = 2;
  cfg.train.eval_every = 1;  // an inference forward, which caches stacked operands, before the recording too
  cfg.train.checkpoint_every = 100;
  cfg.train.cuda_graphs = graphs;
  LoopOptions o;
  o.config = cfg;
  o.recipe = recipe;
  o.out_dir = dir;
  o.command = "graph-test";
  o.quiet = true;
  o.device = Device::CUDA;
  ShapedSource src;
  return run_training(o, src);
}

}  // namespace

TEST(CudaStepGraphs, ReplayedRunWritesTheEagerRunsMetrics) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const bool pairs_before = set_moe_pairs_on_device_offsets(true);  // mxfp8's micro-batch reads nothing back
  for (const std::string recipe : {"bf16", "mxfp8"}) {
    SCOPED_TRACE(recipe);
    const std::string root = fresh_test_dir("step_graph_tests_" + recipe);
    const TrainSummary eager = run_shaped(root + "/eager", false, recipe);
    const TrainSummary replayed = run_shaped(root + "/graphs", true, recipe);
    // steps 1-2 run eagerly (the second records both kinds: the first micro-batch and the
    // accumulating one), steps 3-6 replay them
    ASSERT_TRUE(replayed.cuda_graph_replays.has_value());
    EXPECT_EQ(*replayed.cuda_graph_replays, 8);
    EXPECT_EQ(eager.cuda_graph_replays.value_or(-1), 0);
    const std::string want = file_bytes(root + "/eager/metrics.jsonl"),
                      got = file_bytes(root + "/graphs/metrics.jsonl");
    EXPECT_EQ(got, want) << "the replays' metrics differ from the eager run's";
    std::istringstream lines(got);
    int n = 0;
    for (std::string l; std::getline(lines, l);) n += !l.empty();
    EXPECT_EQ(n, 6);
    EXPECT_EQ(nlohmann::json::parse(file_bytes(root + "/graphs/summary.json"))["cuda_graph_replays"], 8);
  }
  set_moe_pairs_on_device_offsets(pairs_before);
}

TEST(CudaStepGraphs, ABadTokenInAReplayFailsAtItsStats) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ThreeMicroBatches t("bf16");
  ASSERT_TRUE(t.m.training_step_capturable());
  EXPECT_EQ(t.losses[1], t.losses[0]);
  EXPECT_EQ(t.losses[2], t.losses[0]) << "the replay";
  EXPECT_EQ(t.graphs.graphs(), 1);
  EXPECT_EQ(t.graphs.replays(), 1);
  EXPECT_EQ(t.graphs.take_failure(), "");
  Tensor bad = random_tokens(2, 12, 6);
  bad.data<int32_t>()[5] = int32_t(t.m.config().vocab_size) + 3;
  PendingForwardStats p = t.run(bad.to(Device::CUDA), 3);
  EXPECT_EQ(t.graphs.replays(), 2);
  EXPECT_HAS(error_of([&] { (void)p.stats(); }), "embedding_forward: tokens[5] = 263 is outside [0, V=260)");
  // the next replay reads a fresh record
  EXPECT_EQ(t.run(t.tokens, 4).stats().loss, t.losses[0]);
}

// Gradient accumulation's two kinds (a step's first micro-batch, which stores the gradients, and
// the next, which adds to them) are recorded on one pool of blocks: the second recording takes
// little memory of its own, and the replays, one after the other, give the eager losses.
TEST(CudaStepGraphs, TheSecondKindSharesTheFirstsMemory) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Model m(gpu_test_config(), recipe_by_name("bf16"), Device::CUDA);
  init_params(m.params(), gpu_test_config(), 5);
  StepGraphs graphs(m, true);
  std::vector<Tensor> tokens, targets;
  for (uint64_t i = 0; i < 2; ++i) {
    tokens.push_back(random_tokens(2, 12, 20 + i).to(Device::CUDA));
    targets.push_back(shifted_targets(random_tokens(2, 12, 20 + i), 258).to(Device::CUDA));
  }
  struct Micro {
    double loss;
    int64_t grew;  // device bytes in use after the micro-batch, less before
  };
  auto micro = [&](int step, int i) {
    const bool first = i == 0;
    if (first) m.params().zero_grad();
    const int64_t before = device_bytes_in_use();
    const double loss = graphs.run(tokens[size_t(i)], targets[size_t(i)], Tensor(), 0.5f,
                                   SrStreams{11, uint64_t(step), uint64_t(i)}, first)
                            .stats()
                            .loss;
    return Micro{loss, device_bytes_in_use() - before};
  };
  const Micro a0 = micro(0, 0), b0 = micro(0, 1);
  const Micro a1 = micro(1, 0), b1 = micro(1, 1);  // each recorded after its eager run
  ASSERT_EQ(graphs.graphs(), 2) << graphs.take_failure();
  EXPECT_GT(a1.grew, 0) << "the first recording holds its micro-batch's activations";
  EXPECT_LT(b1.grew, a1.grew / 4) << "the second recording took its own blocks, not the first's";
  for (int step = 2; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Micro a = micro(step, 0), b = micro(step, 1);
    EXPECT_EQ(a.loss, a0.loss);
    EXPECT_EQ(b.loss, b0.loss);
    EXPECT_EQ(a.grew, 0);
    EXPECT_EQ(b.grew, 0);
  }
  EXPECT_EQ(graphs.replays(), 4);
  EXPECT_EQ(a1.loss, a0.loss);
  EXPECT_EQ(b1.loss, b0.loss);
}

TEST(CudaStepGraphs, AMicroBatchThatReadsBackIsNeverRecorded) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ThreeMicroBatches t("nvfp4-fwd");
  EXPECT_FALSE(t.m.training_step_capturable());
  EXPECT_EQ(t.graphs.graphs(), 0);
  EXPECT_EQ(t.graphs.replays(), 0);
  // mxfp8's reads its counts back with its experts' pairs on the host's offsets (the default)
  const bool pairs_before = set_moe_pairs_on_device_offsets(false);
  Model x(gpu_test_config(), recipe_by_name("mxfp8"), Device::CUDA);
  EXPECT_FALSE(x.training_step_capturable());
  set_moe_pairs_on_device_offsets(pairs_before);
  // the bf16 recipe's micro-batch reads its counts back too with the host-offset MoE backward
  const bool before = set_moe_backward_device_offsets(false);
  Model b(gpu_test_config(), recipe_by_name("bf16"), Device::CUDA);
  EXPECT_FALSE(b.training_step_capturable());
  set_moe_backward_device_offsets(before);
}

TEST(StepGraphs, OnTheCpuEveryMicroBatchRunsEagerly) {
  const OmpThreads threads(2);
  const ModelConfig c = tiny_moe_config(2);
  const Tensor tokens = random_tokens(2, 8, 3);
  const Tensor targets = shifted_targets(tokens, 258);
  Model a(c, recipe_by_name("bf16"), Device::CPU), b(c, recipe_by_name("bf16"), Device::CPU);
  init_params(a.params(), c, 5);
  init_params(b.params(), c, 5);
  EXPECT_FALSE(a.training_step_capturable());
  StepGraphs graphs(a, true);
  for (int micro = 0; micro < 3; ++micro) {
    const SrStreams sr{1, 0, uint64_t(micro)};
    if (micro == 0) {
      a.params().zero_grad();
      b.params().zero_grad();
    }
    const double got = graphs.run(tokens, targets, Tensor(), 0.5f, sr, micro == 0).stats().loss;
    const double want = b.forward_queued(tokens, targets, sr, true, 0.5f).stats().loss;
    b.backward();
    EXPECT_EQ(got, want);
  }
  EXPECT_EQ(graphs.graphs(), 0);
  EXPECT_EQ(std::memcmp(a.params().flat_grad().raw(), b.params().flat_grad().raw(), size_t(a.params().flat_grad().nbytes())), 0);
}
