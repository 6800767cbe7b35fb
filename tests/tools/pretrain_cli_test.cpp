// defines: end-to-end tests of `fourbit pretrain`, `fourbit recipes` and `fourbit plot`: the built
//          CLI (FOURBIT_CLI) is run as a user would, its exit status, stdout and stderr captured.
//          Every user error (malformed TOML, unknown field or recipe, wrong type, empty or
//          non-UTF-8 data, a loss that goes non-finite, no loadable checkpoint) ends in exactly
//          one "fourbit: error:" line naming what is wrong and exit status 1, and leaves the
//          checkpoints already on disk byte for byte as they were; a truncated newest checkpoint
//          is skipped with a warning and kept.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fourbit/io/safetensors.h"
#include "tools/cli_test_util.h"
#include "model/model_test_util.h"

using namespace fourbit::modeltest;
namespace fs = std::filesystem;

using namespace fourbit::clitest;

namespace {

void write_text(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

// A 2-layer MoE that trains in well under a second.
std::string good_config(const std::string& train_extra = "", int checkpoint_every = 1) {
  return "[model]\n"
         "vocab_size = 260\nd_model = 32\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\n"
         "max_seq_len = 16\nn_experts = 4\ntop_k = 2\nd_expert = 32\nn_shared_experts = 1\n"
         "dense_layers = 1\nd_dense = 64\n"
         "[train]\n"
         "batch_size = 2\nseq_len = 16\nsteps = 2\nwarmup_steps = 2\neval_every = 0\n"
         "eval_batches = 1\nlog_every = 1\nseed = 7\ncheckpoint_every = " + std::to_string(checkpoint_every) + "\n" +
         train_extra +
         "[data]\n"
         "source = \"synthetic\"\n";
}

// The error contract: stderr's last line is the only "fourbit: error:" line, exit status 1.
// With `alone`, nothing else was written to stderr (the error came before any work).
std::string expect_one_error(const CliRun& r, bool alone = true) {
  EXPECT_EQ(r.status, 1) << r.err;
  const std::vector<std::string> lines = lines_of(r.err);
  int n_error = 0;
  for (const auto& l : lines) n_error += l.rfind("fourbit: error:", 0) == 0;
  EXPECT_EQ(n_error, 1) << "stderr:\n" << r.err;
  if (alone) {
    EXPECT_EQ(lines.size(), 1u) << "stderr:\n" << r.err;
  }
  if (lines.empty()) return "";
  EXPECT_EQ(lines.back().rfind("fourbit: error:", 0), 0u) << "the error is not the last line:\n" << r.err;
  return lines.back();
}

std::vector<std::string> names_of(const std::map<std::string, std::string>& snap) {
  std::vector<std::string> out;
  for (const auto& [k, v] : snap) out.push_back(k);
  return out;
}

}  // namespace

// A fresh test dir for a pretrain run that must fail: file() writes an input and returns its
// path, pretrain_error() runs `pretrain ARGS --out DIR/run` and returns its one error line.
struct FailingRun {
  std::string dir = fresh_test_dir("cli_tests");
  std::string file(const std::string& name, const std::string& text) const {
    write_text(dir + "/" + name, text);
    return dir + "/" + name;
  }
  std::string pretrain_error(const std::string& args) const {
    return expect_one_error(run_cli(dir, "pretrain " + args + " --out " + dir + "/run"));
  }
};

TEST(PretrainCli, MalformedTomlNamesTheFileAndLine) {
  const FailingRun run;
  const std::string msg = run.pretrain_error("--config " + run.file("broken.toml", "[model]\nd_model = 32\nn_layers = = 2\n"));
  EXPECT_HAS(msg, "broken.toml:3");
  EXPECT_HAS(msg, "malformed TOML");
  EXPECT_FALSE(fs::exists(run.dir + "/run"));
}

TEST(PretrainCli, UnknownFieldIsNamed) {
  const FailingRun run;
  const std::string msg = run.pretrain_error("--config " + run.file("typo.toml", "[model]\nd_model = 32\nd_modle = 64\n"));
  EXPECT_HAS(msg, "typo.toml:3");
  EXPECT_HAS(msg, "model.d_modle");
  EXPECT_HAS(msg, "unknown field");
}

TEST(PretrainCli, UnknownRecipeListsTheKnownOnes) {
  const FailingRun run;
  const std::string msg = run.pretrain_error("--config " + run.file("ok.toml", good_config()) + " --recipe nvfp5");
  EXPECT_HAS(msg, "nvfp5");
  for (const char* n : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) EXPECT_HAS(msg, n);
  EXPECT_FALSE(fs::exists(run.dir + "/run"));
}

TEST(PretrainCli, WrongTypeSaysWhatWasExpected) {
  const FailingRun run;
  const std::string msg = run.pretrain_error("--config " + run.file("type.toml", "[train]\nsteps = \"many\"\n"));
  EXPECT_HAS(msg, "type.toml:2");
  EXPECT_HAS(msg, "train.steps");
  EXPECT_HAS(msg, "expected an integer");
}

TEST(PretrainCli, EmptyTextDataIsNamed) {
  const FailingRun run;
  const std::string msg =
      run.pretrain_error("--config " + run.file("ok.toml", good_config()) + " --data text:" + run.file("empty.txt", ""));
  EXPECT_HAS(msg, run.dir + "/empty.txt");
  EXPECT_HAS(msg, "empty");
}

TEST(PretrainCli, NonUtf8TextDataIsNamed) {
  const FailingRun run;
  const std::string msg = run.pretrain_error(
      "--config " + run.file("ok.toml", good_config()) + " --data text:" +
      run.file("latin1.txt", std::string("caf\xe9 au lait, na\xefve text that is not UTF-8\n")));
  EXPECT_HAS(msg, run.dir + "/latin1.txt");
  EXPECT_HAS(msg, "not valid UTF-8");
}

// A truncated newest checkpoint: the resume falls back to the previous one with a warning that
// names the broken file, and moves the broken one aside byte for byte (it belongs to the run's
// abandoned course); with no intact checkpoint left, one error names each failure and nothing
// in the run changes.
TEST(PretrainCli, TruncatedCheckpointFallsBackAndIsKept) {
  const std::string dir = fresh_test_dir("cli_tests");
  write_text(dir + "/ok.toml", good_config());
  const std::string run = dir + "/run";
  const CliRun first = run_cli(dir, "pretrain --config " + dir + "/ok.toml --recipe nvfp4-fwd --device cpu --out " + run);
  ASSERT_EQ(first.status, 0) << first.err;
  const std::string model = run + "/checkpoints/step-000002/model.safetensors";
  ASSERT_TRUE(fs::exists(model));
  fs::resize_file(model, fs::file_size(model) / 2);
  const std::string truncated = file_bytes(model);
  const CliRun r = run_cli(dir, "pretrain --device cpu --steps 4 --resume " + run);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.err, "warning: skipping a corrupt checkpoint: " + model);
  EXPECT_HAS(r.err, "using step-000001");
  bool kept = false;
  for (const auto& e : fs::recursive_directory_iterator(run + "/checkpoints"))
    if (e.path().filename() == "model.safetensors" && e.path().string().find("superseded-") != std::string::npos)
      kept = kept || file_bytes(e.path().string()) == truncated;
  EXPECT_TRUE(kept) << "the truncated checkpoint was not kept under checkpoints/superseded-*";

  // Every checkpoint broken: an error naming each, the run left as it is.
  std::vector<std::string> broken;
  for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
    if (e.path().filename().string().rfind("step-", 0) == 0) broken.push_back(e.path().filename().string());
  ASSERT_EQ(broken.size(), 3u) << "keep_last = 3";
  for (const std::string& d : broken) fs::resize_file(run + "/checkpoints/" + d + "/model.safetensors", 100);
  const auto before = snapshot(run);
  const std::string msg = expect_one_error(run_cli(dir, "pretrain --device cpu --steps 8 --resume " + run));
  EXPECT_HAS(msg, "no checkpoint can be loaded");
  for (const std::string& d : broken) EXPECT_HAS(msg, d + "/model.safetensors");
  EXPECT_TRUE(snapshot(run) == before) << "a failed resume changed the run";
}

// A run that diverges: a new run started (--init) from a sane run's weights with an absurd
// learning rate. The error names the cause and the step; the sane run's checkpoints are
// byte-identical afterwards and the new run has no checkpoint for the failing step.
TEST(PretrainCli, NonFiniteLossStopsWithoutTouchingCheckpoints) {
  const std::string dir = fresh_test_dir("cli_tests");
  write_text(dir + "/ok.toml", good_config());
  write_text(dir + "/diverge.toml", good_config("lr = 1e30\nmin_lr_ratio = 1.0\n", /*checkpoint_every=*/1));
  const std::string run = dir + "/run";
  const CliRun first = run_cli(dir, "pretrain --config " + dir + "/ok.toml --recipe nvfp4-fwd --device cpu --out " + run);
  ASSERT_EQ(first.status, 0) << first.err;
  const auto before = snapshot(run + "/checkpoints");
  ASSERT_TRUE(before.count("step-000001/model.safetensors"));
  ASSERT_TRUE(before.count("step-000002/model.safetensors"));
  const CliRun r = run_cli(dir, "pretrain --config " + dir + "/diverge.toml --recipe nvfp4-fwd --device cpu --steps 8 --init " +
                                    run + " --out " + dir + "/diverged");
  const std::string msg = expect_one_error(r, /*alone=*/false);  // progress lines come first
  EXPECT_HAS(msg, "non-finite");
  EXPECT_HAS(msg, "step ");
  std::printf("  %s\n", msg.c_str());
  const auto after = snapshot(run + "/checkpoints");
  EXPECT_EQ(names_of(after), names_of(before)) << "checkpoint files appeared or vanished";
  EXPECT_TRUE(after == before) << "an existing checkpoint changed";
  // The diverged run keeps only finite checkpoints of the steps before the failure. They load;
  // with weights grown by lr = 1e30 their forward may overflow, which the sampler reports as NaN
  // logits (a model error, not a checkpoint error).
  if (!fs::exists(dir + "/diverged/checkpoints")) return;
  for (const auto& e : fs::directory_iterator(dir + "/diverged/checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    for (const auto& [tname, t] : fourbit::io::read_safetensors((e.path() / "model.safetensors").string()).tensors) {
      ASSERT_EQ(t.dtype(), fourbit::DType::F32) << name << ": " << tname;  // checkpoints hold FP32 masters
      const float* p = t.data<float>();
      int64_t bad = 0;
      for (int64_t i = 0; i < t.numel(); ++i) bad += !std::isfinite(p[i]);
      EXPECT_EQ(bad, 0) << name << ": " << tname << " holds non-finite weights";
    }
    const CliRun g = run_cli(dir, "generate --run " + e.path().string() + " --prompt x --max-new 1 --device cpu");
    if (g.status != 0) {
      EXPECT_NE(g.err.find("sampling: the logits of sequence 0"), std::string::npos) << name << " is not a loadable checkpoint: " << g.err;
    }
  }
}

TEST(RecipesCli, ListsAllFiveRecipes) {
  const std::string dir = fresh_test_dir("cli_tests");
  const CliRun r = run_cli(dir, "recipes");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* n : {"fp32", "bf16", "mxfp8", "nvfp4-fwd", "nvidia-nvfp4"}) EXPECT_HAS(r.out, std::string("recipe ") + n + ":");
  EXPECT_HAS(r.out, "(last 2)");  // --layers defaults to 12
  const CliRun one = run_cli(dir, "recipes --recipe mxfp8 --layers 4");
  EXPECT_EQ(one.status, 0) << one.err;
  EXPECT_HAS(one.out, "recipe mxfp8:");
  EXPECT_EQ(one.out.find("recipe bf16:"), std::string::npos);
  expect_one_error(run_cli(dir, "recipes --recipe nvfp5"));
}

TEST(PlotCli, WritesAPng) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "gnuplot is not installed";
  const std::string dir = fresh_test_dir("cli_tests");
  write_text(dir + "/ok.toml", good_config());
  const std::string run = dir + "/run";
  const CliRun train = run_cli(dir, "pretrain --config " + dir + "/ok.toml --recipe mxfp8 --device cpu --steps 3 --out " + run);
  ASSERT_EQ(train.status, 0) << train.err;
  const CliRun r = run_cli(dir, "plot " + run + " --out " + dir + "/loss.png");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string png = file_bytes(dir + "/loss.png");
  ASSERT_GE(png.size(), 8u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  const std::string msg = expect_one_error(run_cli(dir, "plot " + dir + "/no-such-run --out " + dir + "/x.png"));
  EXPECT_HAS(msg, "no-such-run/metrics.jsonl");
}
