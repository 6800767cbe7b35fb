// defines: end-to-end tests of `fourbit sft` and `fourbit rl` through the built CLI: a pretrain ->
//          sft -> rl pipeline on a tiny model writes the documented files and fields, and each
//          bad input (unknown task, --init missing or not a run, a config that does not match
//          the checkpoint, prompts longer than the context, G < 2, an occupied --out) ends in
//          one "fourbit: error:" line with nothing created or written over.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/model_test_util.h"
#include "tools/cli_test_util.h"

using namespace fourbit::clitest;
using fourbit::modeltest::file_bytes;
using fourbit::modeltest::fresh_test_dir;
namespace fs = std::filesystem;

namespace {

std::string config_text(int64_t d_model, int64_t max_seq_len) {
  return fmt::format(
      "[model]\nvocab_size = 260\nd_model = {}\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\nmax_seq_len = {}\n"
      "n_experts = 4\ntop_k = 2\nd_expert = 32\nn_shared_experts = 1\ndense_layers = 1\nd_dense = 64\n"
      "[train]\nbatch_size = 8\nseq_len = 16\nsteps = 2\nwarmup_steps = 1\neval_every = 0\neval_batches = 1\n"
      "log_every = 1\nseed = 7\n[data]\nsource = \"synthetic\"\n",
      d_model, max_seq_len);
}

// A directory with a 2-step pretrained base run (max_seq_len 16) and its config.
struct Base {
  std::string dir = fresh_test_dir("cli_tests");
  std::string config = dir + "/base.toml", run = dir + "/base";
  Base() {
    std::ofstream(config) << config_text(32, 16);
    const CliRun r = run_cli(dir, "pretrain --config " + config + " --device cpu --out " + run);
    EXPECT_EQ(r.status, 0) << r.err;
  }
};

// The one error line of a run that must fail before any work.
std::string one_error(const CliRun& r) {
  EXPECT_EQ(r.status, 1) << r.err;
  const std::vector<std::string> lines = lines_of(r.err);
  EXPECT_EQ(lines.size(), 1u) << "stderr:\n" << r.err;
  if (lines.empty()) return "";
  EXPECT_EQ(lines.back().rfind("fourbit: error:", 0), 0u) << r.err;
  return lines.back();
}

}  // namespace

TEST(PostTrainCli, PretrainSftRlPipeline) {
  const Base base;
  const std::string sft = base.dir + "/sft", rl = base.dir + "/rl";
  CliRun r = run_cli(base.dir, "sft --init " + base.run + " --task add,mul --steps 2 --eval-every 2 --eval-problems 4 "
                                   "--device cpu --out " + sft);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.out, "eval_accuracy_add");
  r = run_cli(base.dir, "rl --init " + sft + " --task add --steps 2 --prompts 2 --group 3 --max-new 6 "
                            "--eval-every 1 --eval-problems 4 --kl-coef 0.01 --device cpu --out " + rl);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json rec = nlohmann::json::parse(file_bytes(rl + "/config.json"));
  EXPECT_EQ(rec["command"], "rl");
  EXPECT_EQ(rec["source"]["group"], 3);
  EXPECT_EQ(rec["recipe"], "nvfp4-fwd") << "the --init run's recipe by default";
  const std::vector<std::string> metrics = lines_of(file_bytes(rl + "/metrics.jsonl"));
  ASSERT_EQ(metrics.size(), 2u);
  const nlohmann::json last = nlohmann::json::parse(metrics[1]);
  for (const char* k : {"reward", "eval_accuracy", "zero_variance_groups", "mean_length", "entropy", "kl",
                        "logprob_mismatch_max", "logprob_mismatch_tokens", "sample_s", "reward_s", "fwd_bwd_s",
                        "optimizer_s", "sampled_tokens_per_s"})
    EXPECT_TRUE(last.contains(k)) << k;
  EXPECT_EQ(last["logprob_mismatch_tokens"], 0);
  EXPECT_EQ(lines_of(file_bytes(rl + "/samples.jsonl")).size(), 12u);
  // The resume of a finished run with a larger --steps takes everything else from the record.
  r = run_cli(base.dir, "rl --resume " + rl + " --steps 3 --device cpu");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(lines_of(file_bytes(rl + "/samples.jsonl")).size(), 18u);
  // An occupied --out is refused and left as it was.
  const auto before = snapshot(rl);
  const std::string msg = one_error(run_cli(base.dir, "rl --init " + sft + " --task add --device cpu --out " + rl));
  EXPECT_HAS(msg, rl);
  EXPECT_TRUE(snapshot(rl) == before) << "a refused run wrote into the existing one";
}

TEST(PostTrainCli, BadInputIsOneErrorAndCreatesNothing) {
  const Base base;
  const std::string out = base.dir + "/out", empty = base.dir + "/empty", wider = base.dir + "/wider.toml";
  fs::create_directories(empty);
  std::ofstream(wider) << config_text(64, 16);
  auto err = [&](const std::string& args) {
    const std::string msg = one_error(run_cli(base.dir, args + " --device cpu --out " + out));
    EXPECT_FALSE(fs::exists(out)) << args;
    return msg;
  };
  std::string m = err("sft --init " + base.run + " --task add,nope");
  EXPECT_HAS(m, "--task: unknown task 'nope'");
  EXPECT_HAS(m, "countdown");
  EXPECT_HAS(err("rl --init " + base.run + " --task nope"), "unknown task 'nope'");
  EXPECT_HAS(err("rl --task add"), "--init RUN is required");
  EXPECT_HAS(err("sft --init " + empty + " --task add"), "not a fourbit run directory");
  EXPECT_HAS(err("rl --init " + base.dir + "/missing --task add"), "no such run");
  m = err("sft --init " + base.run + " --config " + wider + " --task add");
  EXPECT_HAS(m, "model.d_model is 32 in that run");
  EXPECT_HAS(m, "gives 64");
  m = err("rl --init " + base.run + " --task reverse");
  EXPECT_HAS(m, "longer than the model's context (model.max_seq_len 16)");
  EXPECT_HAS(err("sft --init " + base.run + " --task sort"), "model.max_seq_len 16");
  EXPECT_HAS(err("rl --init " + base.run + " --task add --group 1"), "--group: expected at least 2 samples");
  EXPECT_HAS(err("rl --init " + base.run + " --task sort:len=5-3"), "--task: task sort: len=5-3: expected LO-HI");
  EXPECT_HAS(err("sft --init " + base.run + " --task add,sort:size=3"), "task sort: unknown option 'size'");
  EXPECT_HAS(err("rl --init " + base.run + " --task add --aux-loss-coef -1"), "--aux-loss-coef: expected a finite");
  EXPECT_HAS(err("rl --init " + base.run + " --task add --sample-rounds 0"), "--sample-rounds: expected at least 1");
}
