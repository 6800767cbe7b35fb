// defines: tests of `fourbit sft` and `fourbit rl`'s sources (rl/sft.h, rl/policy_gradient.h) on
//          the training loop: (a) SFT rows carry loss only on the answer and its <eos>; (b) SFT
//          and RL stopped by a signal and resumed end with the bytes of an uninterrupted run;
//          (c) in RL the trainer's forward recomputes every sampled token's log-prob with the
//          sampler's bits for fp32, bf16, mxfp8 and nvfp4-fwd (logprob_mismatch_tokens 0 on
//          every step) and not for nvidia-nvfp4 (the negative control); (d) the same seed gives
//          the same metrics and samples; (e) group advantages and the k3 estimator; (f) a step
//          without reward variance does not update, and RL's load-balance coefficient is its own;
//          (g) dynamic sampling trains on groups with differing rewards only.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>

#include "fourbit/rl/task_batch.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/tokenizer.h"
#include "rl/post_train_util.h"
#include "rl/rl_test_util.h"

using namespace fourbit;
using namespace fourbit::rltest;
using fourbit::modeltest::file_bytes;
using fourbit::modeltest::fresh_test_dir;
using fourbit::modeltest::OmpThreads;
namespace fs = std::filesystem;

namespace {

struct RaiseAt {
  explicit RaiseAt(const char* spec) { ::setenv("FOURBIT_TEST_RAISE", spec, 1); }
  ~RaiseAt() { ::unsetenv("FOURBIT_TEST_RAISE"); }
};

}  // namespace

TEST(Sft, LossOnlyOnTheAnswer) {
  RunConfig cfg = post_config();
  cfg.train.batch_size = 6;
  rl::SftOptions so;
  so.tasks = {"add", "sort"};
  rl::SftSource src(so);
  Model model(cfg.model, recipe_by_name("fp32"), Device::CPU);
  src.start(model, cfg);
  StepContext ctx;
  ctx.step = 3;
  ctx.seed = 77;
  ctx.config = &cfg;
  const MicroBatch b = src.micro_batch(ctx, 0);
  ASSERT_EQ(b.tokens.size(0), 6);
  EXPECT_FALSE(b.weights.defined());
  const int64_t T = b.tokens.size(1);
  const auto add = rl::make_task("add"), sort = rl::make_task("sort");
  for (int64_t r = 0; r < 6; ++r) {
    // round-robin over the tasks: the run's problem g = 18 + r is task g % 2's problem g / 2
    const int64_t g = 3 * 6 + r;
    const rl::Problem p = (g % 2 ? *sort : *add).problem(77, rl::Split::Train, uint64_t(g / 2));
    const std::vector<int32_t> prompt = rl::prompt_tokens(p), answer = rl::answer_tokens(p);
    const int64_t P = int64_t(prompt.size()), A = int64_t(answer.size());
    for (int64_t t = 0; t < T; ++t) {
      const int32_t tok = b.tokens.data<int32_t>()[r * T + t], tgt = b.targets.data<int32_t>()[r * T + t];
      if (t < P) EXPECT_EQ(tok, prompt[size_t(t)]);
      else if (t < P + A - 1) EXPECT_EQ(tok, answer[size_t(t - P)]);
      else EXPECT_EQ(tok, data::kPad);
      if (t >= P - 1 && t < P - 1 + A) EXPECT_EQ(tgt, answer[size_t(t - P + 1)]) << "row " << r << " position " << t;
      else EXPECT_EQ(tgt, -1) << "row " << r << " position " << t << ": a prompt or padding token carries loss";
    }
  }
}

TEST(Sft, EvaluatesEachTaskAndResumesBitForBit) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("post_train");
  RunConfig cfg = post_config();
  cfg.train.steps = 4;
  cfg.train.eval_every = 2;
  cfg.train.checkpoint_every = 1;
  rl::SftOptions so;
  so.tasks = {"add", "mul"};
  so.eval_problems = 6;
  so.eval_max_new = 5;
  rl::SftSource a(so);
  run_training(loop_options(cfg, root + "/a", "nvfp4-fwd", "sft"), a);
  const auto m = metrics_lines(root + "/a/metrics.jsonl");
  ASSERT_EQ(m.size(), 4u);
  for (const char* k : {"eval_accuracy", "eval_accuracy_add", "eval_accuracy_mul", "eval_loss"})
    EXPECT_TRUE(m[1].contains(k) && m[3].contains(k)) << k;
  EXPECT_FALSE(m[0].contains("eval_loss"));

  rl::SftSource b1(so);
  {
    const RaiseAt raise("SIGINT:step:2");
    EXPECT_EQ(run_training(loop_options(cfg, root + "/b", "nvfp4-fwd", "sft"), b1).stopped_by, SIGINT);
  }
  rl::SftSource b2(so);
  LoopOptions resume = loop_options(cfg, root + "/b", "nvfp4-fwd", "sft");
  resume.resume = true;
  run_training(resume, b2);
  for (const char* f : {"metrics.jsonl", "checkpoints/step-000004/model.safetensors",
                        "checkpoints/step-000004/optim.safetensors"})
    EXPECT_TRUE(file_bytes(root + "/a/" + f) == file_bytes(root + "/b/" + f)) << f << " differs";
}

// Every RL step compares each sampled token's sampler log-prob with the trainer's forward.
TEST(Rl, SamplerLogprobsAreTheTrainersForInvariantRecipes) {
  const OmpThreads one_thread(1);
  register_first_digit();
  const std::string root = fresh_test_dir("post_train");
  for (const std::string recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) {
    SCOPED_TRACE(recipe);
    run_sft(root + "/sft-" + recipe, recipe, 12);
    RunConfig cfg = post_config();
    cfg.train.steps = 2;
    cfg.train.eval_every = 2;
    cfg.train.batch_size = 8;  // two micro-batches of the 16 rollouts
    LoopOptions o = loop_options(cfg, root + "/rl-" + recipe, recipe, "rl");
    o.init_from = root + "/sft-" + recipe;
    rl::RlSource src(rl_options());
    run_training(o, src);
    const auto m = metrics_lines(root + "/rl-" + recipe + "/metrics.jsonl");
    ASSERT_EQ(m.size(), 2u);
    int64_t mismatched = 0;
    double codes_changed = 0;
    for (const auto& l : m) {
      for (const char* k : {"reward", "zero_variance_groups", "mean_length", "entropy", "logprob_mismatch_max",
                            "sample_s", "reward_s", "fwd_bwd_s", "optimizer_s", "sampled_tokens_per_s"})
        EXPECT_TRUE(l.contains(k)) << k;
      // The fraction of NVFP4 weight codes the step changed; absent without NVFP4 weights.
      EXPECT_EQ(l.contains("weight_codes_changed"), recipe == "nvfp4-fwd" || recipe == "nvidia-nvfp4");
      codes_changed += l.value("weight_codes_changed", 0.0);
      EXPECT_GT(l["sampled_tokens"].get<int64_t>(), 16);
      mismatched += l["logprob_mismatch_tokens"].get<int64_t>();
      if (recipe != "nvidia-nvfp4") {
        EXPECT_EQ(l["logprob_mismatch_tokens"], 0) << "step " << l["step"];
        EXPECT_EQ(l["logprob_mismatch_max"], 0.0);
      }
    }
    if (recipe == "nvidia-nvfp4") {
      EXPECT_GT(mismatched, 0) << "the negative control found no mismatch";
    }
    if (recipe == "nvfp4-fwd") {
      EXPECT_GT(codes_changed, 0.0);
    }
    EXPECT_LT(codes_changed, 2.0);
    EXPECT_TRUE(m[0].contains("init_eval_accuracy"));
    EXPECT_TRUE(m[1].contains("eval_accuracy"));
    EXPECT_EQ(metrics_lines(root + "/rl-" + recipe + "/samples.jsonl").size(), 32u);
  }
}

// Same seed: the same metrics (wall-clock fields aside) and samples, bit for bit; a run stopped
// by a signal and resumed (with a k3 KL term in the loss, whose reference the resume reloads
// from the --init checkpoint) gives the same bytes again; another seed gives other samples.
TEST(Rl, SameSeedSameRunAndResumeIsBitExact) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("post_train");
  RunConfig cfg = sft_then_rl_config(root, 40, 3);
  cfg.train.eval_every = 2;
  cfg.train.checkpoint_every = 1;
  rl::RlOptions ro = rl_options();
  ro.kl_coef = 0.1;
  ro.std_normalize = true;
  auto run = [&](const std::string& name, uint64_t seed, const char* raise) {
    RunConfig c = cfg;
    c.train.seed = seed;
    LoopOptions o = loop_options(c, root + "/" + name, "nvfp4-fwd", "rl");
    o.init_from = root + "/sft";
    rl::RlSource src(ro);
    if (!raise) return run_training(o, src);
    const RaiseAt at(raise);
    return run_training(o, src);
  };
  run("a", 5, nullptr);
  run("b", 5, nullptr);
  run("c", 6, nullptr);
  EXPECT_EQ(without_timings(root + "/a/metrics.jsonl"), without_timings(root + "/b/metrics.jsonl"));
  EXPECT_TRUE(file_bytes(root + "/a/samples.jsonl") == file_bytes(root + "/b/samples.jsonl"));
  EXPECT_FALSE(file_bytes(root + "/a/samples.jsonl") == file_bytes(root + "/c/samples.jsonl"));
  const auto m = metrics_lines(root + "/a/metrics.jsonl");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_TRUE(m[0].contains("kl"));
  EXPECT_LT(m[0]["zero_variance_groups"].get<int64_t>() + m[1]["zero_variance_groups"].get<int64_t>() +
                m[2]["zero_variance_groups"].get<int64_t>(),
            12)
      << "every group had equal rewards: nothing to learn from, a weak test";

  EXPECT_EQ(run("d", 5, "SIGINT:step:2").stopped_by, SIGINT);
  RunConfig c5 = cfg;
  c5.train.seed = 5;
  LoopOptions resume = loop_options(c5, root + "/d", "nvfp4-fwd", "rl");
  resume.resume = true;
  ro.reference_checkpoint = nlohmann::json::parse(file_bytes(root + "/d/config.json"))["init"]["checkpoint"];
  rl::RlSource src(ro);
  run_training(resume, src);
  EXPECT_EQ(without_timings(root + "/a/metrics.jsonl"), without_timings(root + "/d/metrics.jsonl"));
  for (const char* f : {"samples.jsonl", "checkpoints/step-000003/model.safetensors",
                        "checkpoints/step-000003/optim.safetensors"})
    EXPECT_TRUE(file_bytes(root + "/a/" + f) == file_bytes(root + "/d/" + f)) << f << " differs";
}

// Dynamic sampling (sample_rounds R > 1): a step samples rounds of P problems until P groups have
// differing rewards (or R rounds), trains on those groups only, and marks them in samples.jsonl;
// its first round is the R = 1 step's rollouts (same problems, same sequence ids); the trainer
// still recomputes every trained token's log-prob with the sampler's bits.
TEST(Rl, DynamicSamplingTrainsOnTheGroupsWithASignal) {
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("post_train");
  RunConfig cfg = sft_then_rl_config(root, 40, 3);
  cfg.train.eval_every = 0;
  const int64_t R = 3;
  std::map<int64_t, std::vector<nlohmann::json>> by_step[2];
  for (const int64_t rounds : {int64_t(1), R}) {
    const std::string dir = root + (rounds == 1 ? "/plain" : "/dynamic");
    LoopOptions o = loop_options(cfg, dir, "nvfp4-fwd", "rl");
    o.init_from = root + "/sft";
    rl::RlOptions ro = rl_options();
    ro.sample_rounds = rounds;
    rl::RlSource src(ro);
    run_training(o, src);
    for (const nlohmann::json& l : metrics_lines(dir + "/samples.jsonl"))
      by_step[rounds > 1][l["step"].get<int64_t>()].push_back(l);
    if (rounds == 1) continue;
    const auto m = metrics_lines(dir + "/metrics.jsonl");
    ASSERT_EQ(m.size(), 3u);
    const int64_t P = ro.prompts, G = ro.group;
    bool some_trained = false;
    for (const nlohmann::json& line : m) {
      SCOPED_TRACE(line.dump());
      const std::vector<nlohmann::json>& s = by_step[1][line["step"].get<int64_t>()];
      const int64_t drawn = line["sampled_groups"].get<int64_t>();
      ASSERT_EQ(int64_t(s.size()), drawn * G);
      ASSERT_EQ(drawn % P, 0);
      int64_t informative = 0, trained = 0, informative_before_last_round = 0;
      for (int64_t grp = 0; grp < drawn; ++grp) {
        bool differ = false;
        for (int64_t g = 1; g < G; ++g) differ |= s[size_t(grp * G + g)]["reward"] != s[size_t(grp * G)]["reward"];
        for (int64_t g = 1; g < G; ++g)
          ASSERT_EQ(s[size_t(grp * G + g)]["trained"], s[size_t(grp * G)]["trained"]) << "a group is trained whole";
        const bool t = s[size_t(grp * G)]["trained"].get<bool>();
        informative += differ;
        if (grp < drawn - P) informative_before_last_round += differ;
        trained += t;
        if (informative > 0) {
          EXPECT_TRUE(!t || differ) << "group " << grp << ": trained without a signal";
        }
      }
      EXPECT_EQ(line["zero_variance_groups"].get<int64_t>(), drawn - informative);
      EXPECT_EQ(trained, line["trained_groups"].get<int64_t>());
      EXPECT_EQ(trained, informative > 0 ? std::min(informative, P) : P);
      EXPECT_TRUE(drawn == P * R || informative >= P) << "stopped early without P groups";
      EXPECT_LT(informative_before_last_round, P) << "sampled a round after P groups were found";
      EXPECT_EQ(line["updated"].get<bool>(), informative > 0);
      EXPECT_EQ(line["logprob_mismatch_tokens"], 0);
      some_trained |= informative > 0 && drawn > P;
    }
    EXPECT_TRUE(some_trained) << "no step needed a second round: a weak test";
  }
  // Step 0 starts from the same weights: round 0 is the plain step's rollouts.
  const std::vector<nlohmann::json>& plain = by_step[0][1], &dynamic = by_step[1][1];
  ASSERT_GE(dynamic.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    nlohmann::json d = dynamic[i];
    d.erase("trained");
    EXPECT_EQ(d, plain[i]) << i;
  }
}

// A step whose every group has equal rewards carries no gradient once the load-balance term is
// out of the loss (--aux-loss-coef 0, RL's default): it does not update, so weights and moments
// stay the --init weights' bits. With the term in, the same steps move the weights.
TEST(Rl, AStepWithoutSignalDoesNotUpdate) {
  class NoReward : public FirstDigitTask {
   public:
    std::string name() const override { return "no_reward"; }

   protected:
    rl::Score check(const rl::Problem&, std::string_view) const override { return rl::Score{0, true, "never"}; }
  };
  const std::vector<std::string> names = rl::task_names();
  if (std::find(names.begin(), names.end(), "no_reward") == names.end())
    rl::register_task("no_reward", [] { return std::make_unique<NoReward>(); });
  const OmpThreads one_thread(1);
  const std::string root = fresh_test_dir("post_train");
  run_sft(root + "/sft", "nvfp4-fwd", 6);
  RunConfig cfg = post_config();
  cfg.train.steps = 2;
  const ModelConfig mc = cfg.model;
  auto params_of = [&](const std::string& run, Tensor* m) {
    ParamStore p(mc, DType::F32, Device::CPU);
    Tensor v = m ? Tensor::zeros(m->shape(), DType::F32, Device::CPU) : Tensor();
    load_checkpoint(latest_checkpoint(run), p, m, m ? &v : nullptr);
    return p.flat().to(Device::CPU);
  };
  const Tensor init = params_of(root + "/sft", nullptr);
  for (const double aux : {0.0, 0.01}) {
    SCOPED_TRACE(aux);
    const std::string dir = root + (aux > 0 ? "/rl-aux" : "/rl");
    LoopOptions o = loop_options(cfg, dir, "nvfp4-fwd", "rl");
    o.init_from = root + "/sft";
    rl::RlOptions ro = rl_options();
    ro.task = "no_reward";
    ro.aux_loss_coef = aux;
    rl::RlSource src(ro);
    run_training(o, src);
    for (const auto& l : metrics_lines(dir + "/metrics.jsonl")) {
      EXPECT_EQ(l["zero_variance_groups"], ro.prompts);
      EXPECT_EQ(l["updated"], aux > 0);
      EXPECT_EQ(l["aux_loss"].get<double>() > 0, aux > 0);
    }
    EXPECT_EQ(nlohmann::json::parse(file_bytes(dir + "/config.json"))["config"]["model"]["aux_loss_coef"],
              mc.aux_loss_coef)
        << "the run's [model] stays the --init run's";
    Tensor m = Tensor::zeros(init.shape(), DType::F32, Device::CPU);
    const Tensor after = params_of(dir, &m);
    const bool same = std::memcmp(init.data<float>(), after.data<float>(), size_t(init.numel()) * 4) == 0;
    EXPECT_EQ(same, aux == 0);
    double m_abs = 0;
    for (int64_t i = 0; i < m.numel(); ++i) m_abs += std::abs(m.data<float>()[i]);
    EXPECT_EQ(m_abs == 0, aux == 0) << "Adam's moments";
  }
  Model model(mc, recipe_by_name("fp32"), Device::CPU);
  rltest::expect_error([&] { model.set_aux_loss_coef(-1); }, "expected a finite value >= 0, got -1");
}

TEST(Rl, GroupAdvantagesAndK3) {
  const std::vector<double> r = {1, 0, 0, 1, 1, 1, 0, 0, 0};
  const std::vector<double> a = rl::group_advantages(r, 3, false);
  EXPECT_NEAR(a[0], 2.0 / 3, 1e-15);
  EXPECT_NEAR(a[1], -1.0 / 3, 1e-15);
  EXPECT_EQ(a[3], 0.0);  // a group of equal rewards teaches nothing
  EXPECT_EQ(a[8], 0.0);
  const std::vector<double> n = rl::group_advantages(r, 3, true);
  EXPECT_NEAR(n[0], (2.0 / 3) / (std::sqrt(2.0 / 9) + 1e-6), 1e-12);
  EXPECT_EQ(rl::k3(-1.5, -1.5), 0.0);
  EXPECT_GT(rl::k3(-1.0, -2.0), 0.0);
  EXPECT_GT(rl::k3(-2.0, -1.0), 0.0);
  EXPECT_NEAR(rl::k3(-1.0, -1.0 + 1e-3), 0.5e-6, 1e-9);  // k3 ~ (log r)^2 / 2 near r = 1
  rltest::expect_error([] { rl::group_advantages({1, 0, 1}, 2, false); }, "do not form groups of 2");
}
