// defines: end-to-end tests of run directories through the built CLI (FOURBIT_CLI): --out onto
//          an existing run is refused and the run left byte for byte as it was, --force moves it
//          aside whole; SIGINT inside a step and SIGTERM inside a checkpoint write (raised at a
//          chosen point through FOURBIT_TEST_RAISE, docs/training.md) exit 130/143 with a resume
//          line, and the resumed run ends with the bytes of an uninterrupted one; --resume needs
//          no --config and names every field that differs; --steps extends without a learning-rate
//          jump; --from-checkpoint sets later checkpoints aside; stale temporaries are removed;
//          keep_last prunes; measurements that were not made are absent; the header says how many
//          MoE layers the recipe puts in NVFP4; errors name the flag or file they come from;
//          generate refuses non-finite weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/train/checkpoint.h"
#include "model/model_test_util.h"
#include "tools/cli_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;
using namespace fourbit::clitest;
namespace fs = std::filesystem;

namespace {

// 2 layers (1 dense, 1 MoE), 6 steps of 2 x 16 tokens: a run takes a fraction of a second.
std::string config_text(const std::string& train_extra = "") {
  return "[model]\n"
         "vocab_size = 260\nd_model = 32\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\n"
         "max_seq_len = 16\nn_experts = 4\ntop_k = 2\nd_expert = 32\nn_shared_experts = 1\n"
         "dense_layers = 1\nd_dense = 64\n"
         "[train]\n"
         "batch_size = 2\nseq_len = 16\nsteps = 6\nwarmup_steps = 1\neval_every = 3\n"
         "eval_batches = 1\nlog_every = 1\nseed = 7\n" +
         train_extra +
         "[data]\n"
         "source = \"synthetic\"\n";
}

struct Dir {
  std::string root = fresh_test_dir("runs_cli_tests");
  std::string config(const std::string& name = "c.toml", const std::string& extra = "") const {
    std::ofstream(root + "/" + name) << config_text(extra);
    return root + "/" + name;
  }
};

std::string last_error(const CliRun& r) {
  EXPECT_EQ(r.status, 1) << r.err;
  const auto lines = lines_of(r.err);
  return lines.empty() ? "" : lines.back();
}

std::vector<nlohmann::json> metrics(const std::string& run) {
  std::vector<nlohmann::json> out;
  for (const std::string& l : lines_of(file_bytes(run + "/metrics.jsonl")))
    if (!l.empty()) out.push_back(nlohmann::json::parse(l));
  return out;
}

void expect_same_bytes(const std::string& a, const std::string& b, int64_t step, const std::string& what) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%06lld", (long long)step);
  EXPECT_TRUE(file_bytes(a + "/metrics.jsonl") == file_bytes(b + "/metrics.jsonl")) << what << ": metrics.jsonl";
  for (const char* f : {"model.safetensors", "optim.safetensors"}) {
    const std::string fa = file_bytes(a + "/checkpoints/" + name + "/" + f);
    EXPECT_FALSE(fa.empty()) << what << ": " << f;
    EXPECT_TRUE(fa == file_bytes(b + "/checkpoints/" + name + "/" + f)) << what << ": " << f << " differs";
  }
}

}  // namespace

TEST(RunsCli, OutOntoAnExistingRunIsRefusedAndForceMovesItAside) {
  const Dir d;
  const std::string cfg = d.config(), run = d.root + "/run";
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + run).status, 0);
  const auto before = snapshot(run);
  const std::string msg = last_error(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + run));
  EXPECT_HAS(msg, run + ": holds a fourbit run (pretrain nvfp4-fwd, newest checkpoint step-000006)");
  EXPECT_HAS(msg, "fourbit pretrain --resume " + run);
  EXPECT_HAS(msg, "--force");
  EXPECT_TRUE(snapshot(run) == before) << "the refused command changed the run";
  // Not a run, but not empty either: refused too.
  fs::create_directories(d.root + "/other");
  std::ofstream(d.root + "/other/notes.txt") << "mine";
  EXPECT_HAS(last_error(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + d.root + "/other")),
             "holds 1 entry and no fourbit run");
  // --force: the old run moves to RUN.old-<time>, whole; a new run takes its place.
  const CliRun forced = run_cli(d.root, "pretrain --config " + cfg + " --device cpu --steps 2 --force --out " + run);
  ASSERT_EQ(forced.status, 0) << forced.err;
  EXPECT_HAS(forced.err, "it was moved to " + run + ".old-");
  std::string old;
  for (const auto& e : fs::directory_iterator(d.root))
    if (e.path().filename().string().rfind("run.old-", 0) == 0) old = e.path().string();
  ASSERT_FALSE(old.empty());
  auto moved = snapshot(old);
  EXPECT_TRUE(moved == before) << "the moved-aside run is not the old run byte for byte";
  EXPECT_EQ(metrics(run).size(), 2u);
}

// SIGINT inside step 3: the step finishes, its checkpoint is written, exit 130 with the resume
// command; `fourbit pretrain --resume RUN` (nothing else) completes the run to the bytes of an
// uninterrupted one.
TEST(RunsCli, SigintDuringAStepThenResumeIsBitExact) {
  const Dir d;
  const std::string cfg = d.config();
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + d.root + "/a").status, 0);
  const std::string b = d.root + "/b";
  const CliRun stopped = run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + b, "FOURBIT_TEST_RAISE=SIGINT:step:3");
  EXPECT_EQ(stopped.status, 130) << stopped.err;
  EXPECT_HAS(stopped.err, "stopped by SIGINT after step 3 of 6; checkpoint " + b + "/checkpoints/step-000003 written");
  EXPECT_HAS(stopped.err, "resume with: fourbit pretrain --resume " + b);
  EXPECT_FALSE(fs::exists(b + "/summary.json"));
  EXPECT_EQ(metrics(b).size(), 3u);
  const CliRun resumed = run_cli(d.root, "pretrain --resume " + b + " --device cpu");
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  expect_same_bytes(d.root + "/a", b, 6, "SIGINT at step 3, resumed");
  const auto rec = nlohmann::json::parse(file_bytes(b + "/config.json"));
  ASSERT_EQ(rec["resumes"].size(), 1u);
  EXPECT_EQ(rec["resumes"][0]["step"], 3);
}

// SIGTERM while the step-2 checkpoint is being written: the write completes (the checkpoint is
// whole and loads), no temporary is left, exit 143; the resume ends bit for bit.
TEST(RunsCli, SigtermDuringACheckpointWriteThenResumeIsBitExact) {
  const Dir d;
  const std::string cfg = d.config("c.toml", "checkpoint_every = 2\n");
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + d.root + "/a").status, 0);
  const std::string b = d.root + "/b";
  const CliRun stopped =
      run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + b, "FOURBIT_TEST_RAISE=SIGTERM:checkpoint:2");
  EXPECT_EQ(stopped.status, 143) << stopped.err;
  EXPECT_HAS(stopped.err, "stopped by SIGTERM after step 2 of 6");
  for (const auto& e : fs::directory_iterator(b + "/checkpoints"))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  ParamStore p(load_config(cfg).model, DType::F32, Device::CPU);
  Tensor m = Tensor::zeros({p.numel()}, DType::F32), v = m.clone();
  load_checkpoint(b + "/checkpoints/step-000002", p, &m, &v);  // whole and intact
  ASSERT_EQ(run_cli(d.root, "pretrain --resume " + b + " --device cpu").status, 0);
  expect_same_bytes(d.root + "/a", b, 6, "SIGTERM in the step-2 checkpoint, resumed");
}

// Every field a resume may not change is named with the run's value and the new one and where
// that came from; the run (config.json included) is untouched by each refusal.
TEST(RunsCli, ResumeMismatchesAreNamed) {
  const Dir d;
  const std::string cfg = d.config(), run = d.root + "/run";
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --steps 3 --out " + run).status, 0);
  {
    std::string wider = config_text();
    wider.replace(wider.find("batch_size = 2"), 14, "batch_size = 4");
    std::ofstream(d.root + "/wider.toml") << wider;
  }
  std::ofstream(d.root + "/text.txt") << "some text for a text source, long enough to hold windows of seq_len 16 tokens.\n";
  const auto before = snapshot(run);
  struct Case {
    std::string args, want;
  };
  for (const Case& c : std::vector<Case>{
           {"--recipe mxfp8", "cannot resume with recipe 'mxfp8': the run was trained with 'nvfp4-fwd'"},
           {"--seed 99", "train.seed: the run has 7, --seed gives 99"},
           {"--set train.lr=0.5", "train.lr: the run has 0.003, --set train.lr=0.5 gives 0.5"},
           {"--set model.n_layers=3", "model.n_layers: the run has 2, --set model.n_layers=3 gives 3"},
           {"--config " + d.root + "/wider.toml", "train.batch_size: the run has 2, " + d.root + "/wider.toml:15 gives 4"},
           {"--data text:" + d.root + "/text.txt", "data.source: the run has synthetic, --data gives text:" + d.root + "/text.txt"},
       }) {
    const std::string msg = last_error(run_cli(d.root, "pretrain --device cpu --steps 6 --resume " + run + " " + c.args));
    EXPECT_HAS(msg, c.want);
    EXPECT_TRUE(snapshot(run) == before) << c.args << " changed the run";
  }
  // Allowed changes are recorded in the resume entry.
  ASSERT_EQ(run_cli(d.root, "pretrain --device cpu --steps 5 --set train.log_every=2 --set train.saved_x_decodes=false "
                            "--set train.cuda_graphs=false --resume " + run).status, 0);
  const auto rec = nlohmann::json::parse(file_bytes(run + "/config.json"));
  EXPECT_EQ(rec["resumes"][0]["changed"]["train.log_every"], nlohmann::json::array({1, 2}));
  EXPECT_EQ(rec["resumes"][0]["changed"]["train.saved_x_decodes"], nlohmann::json::array({true, false}));
  EXPECT_EQ(rec["resumes"][0]["changed"]["train.cuda_graphs"], nlohmann::json::array({true, false}));
  EXPECT_EQ(rec["resumes"][0]["changed"]["train.steps"], nlohmann::json::array({3, 5}));
  EXPECT_EQ(rec["config"]["train"]["steps"], 3) << "config.json's config is written once";
}

// --steps on a resume re-targets the cosine from the resume step: the learning rate goes on from
// where it was (no restart), still decreasing, and ends at lr * min_lr_ratio.
TEST(RunsCli, ExtendingStepsHasNoLearningRateJump) {
  const Dir d;
  const std::string cfg = d.config(), run = d.root + "/run";
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + run).status, 0);
  ASSERT_EQ(run_cli(d.root, "pretrain --resume " + run + " --steps 12 --device cpu").status, 0);
  const auto m = metrics(run);
  ASSERT_EQ(m.size(), 12u);
  for (size_t i = 2; i < m.size(); ++i)
    EXPECT_LE(m[i]["lr"].get<double>(), m[i - 1]["lr"].get<double>()) << "the learning rate rises at step " << i + 1;
  EXPECT_NEAR(m[11]["lr"].get<double>(), 0.003 * 0.1, 1e-15);
  EXPECT_GT(m[6]["lr"].get<double>(), 0.5 * m[5]["lr"].get<double>() - 1e-12) << "a jump at the resume";
  EXPECT_LE(m[6]["lr"].get<double>(), m[5]["lr"].get<double>());
}

// --from-checkpoint continues from an earlier checkpoint; the later ones are set aside (not
// deleted, not mixed in); stale temporaries of killed writers are removed; keep_last prunes.
TEST(RunsCli, FromCheckpointStaleTemporariesAndPruning) {
  const Dir d;
  const std::string cfg = d.config("c.toml", "checkpoint_every = 1\n"), run = d.root + "/run";
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + d.root + "/a").status, 0);
  ASSERT_EQ(run_cli(d.root, "pretrain --config " + cfg + " --device cpu --out " + run).status, 0);
  std::vector<std::string> kept;
  for (const auto& [s, dir] : list_checkpoints(run)) kept.push_back(fs::path(dir).filename().string());
  EXPECT_EQ(kept, (std::vector<std::string>{"step-000004", "step-000005", "step-000006"})) << "keep_last = 3";
  fs::create_directories(run + "/checkpoints/.step-000007.tmp-999999999");
  const CliRun r = run_cli(d.root, "pretrain --resume " + run + " --from-checkpoint step-4 --device cpu");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.err, "moved to " + run + "/checkpoints/superseded-");
  EXPECT_HAS(r.err, "removed 1 temporary file(s)");
  EXPECT_FALSE(fs::exists(run + "/checkpoints/.step-000007.tmp-999999999"));
  expect_same_bytes(d.root + "/a", run, 6, "resumed from step 4");
  const std::string none = last_error(run_cli(d.root, "pretrain --resume " + run + " --from-checkpoint step-2 --steps 9"));
  EXPECT_HAS(none, "has no checkpoint step-000002 (it has: step-000004, step-000005, step-000006)");
}

TEST(RunsCli, UnmeasuredNumbersAreAbsentAndTheHeaderSaysWhatIsNvfp4) {
  const Dir d;
  const std::string cfg = d.config(), run = d.root + "/run";
  const CliRun r = run_cli(d.root, "pretrain --config " + cfg + " --device cpu --set train.eval_batches=0 --out " + run);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.err, "nvfp4-fwd: 0 of 1 MoE layers in NVFP4 (1 in MXFP8-E4M3, the recipe's tail)");
  EXPECT_HAS(r.out, "final eval loss    - (not measured: train.eval_batches = 0)");
  const auto sum = nlohmann::json::parse(file_bytes(run + "/summary.json"));
  EXPECT_FALSE(sum.contains("final_eval_loss"));
  EXPECT_TRUE(sum.contains("final_train_loss"));
  for (const auto& line : metrics(run)) EXPECT_FALSE(line.contains("eval_loss")) << line.dump();
  const CliRun summary = run_cli(d.root, "summary " + run);
  ASSERT_EQ(summary.status, 0) << summary.err;
  EXPECT_EQ(summary.out.find("0.0000"), std::string::npos) << summary.out;

  const std::string zero = d.root + "/zero";
  const CliRun z = run_cli(d.root, "pretrain --config " + cfg + " --device cpu --steps 0 --out " + zero);
  ASSERT_EQ(z.status, 0) << z.err;
  EXPECT_HAS(z.out, "final train loss   - (no step ran)");
  EXPECT_HAS(z.out, "throughput         - (no step ran)");
  const auto zs = nlohmann::json::parse(file_bytes(zero + "/summary.json"));
  EXPECT_FALSE(zs.contains("final_train_loss"));
  EXPECT_FALSE(zs.contains("tokens_per_s"));
  EXPECT_TRUE(zs.contains("final_eval_loss")) << "the initial model was evaluated";
  EXPECT_TRUE(fs::exists(zero + "/checkpoints/step-000000/model.safetensors")) << "a 0-step run keeps its weights";
  // The mxfp8 recipe on a model whose MoE layers are all NVFP4 under nvfp4-fwd: said plainly.
  const CliRun mx = run_cli(d.root, "pretrain --config " + cfg + " --device cpu --steps 1 --recipe bf16 --out " + d.root + "/bf16");
  EXPECT_HAS(mx.err, "bf16: 1 of 1 MoE layers in BF16");
}

TEST(RunsCli, ErrorsNameTheFlagOrFileTheyComeFrom) {
  const Dir d;
  const std::string cfg = d.config();
  auto err = [&](const std::string& args) { return last_error(run_cli(d.root, args)); };
  EXPECT_HAS(err("pretrain --config " + cfg + " --device cpu --data text:/tmp --out " + d.root + "/r"),
             "--data: data.source 'text:/tmp': /tmp: is a directory, expected a data file");
  EXPECT_HAS(err("pretrain --config " + cfg + " --device cpu --data text:/dev/zero --out " + d.root + "/r"),
             "/dev/zero: is not a regular file");
  EXPECT_HAS(err("pretrain --config " + cfg + " --device cpu --data bogus --out " + d.root + "/r"),
             "--data: data.source must be 'synthetic', 'text:FILE' or 'tokens:FILE', got 'bogus'");
  {
    std::string text = config_text();
    text.replace(text.find("source = \"synthetic\""), 20, "source = \"text:" + d.root + "/missing.txt\"");
    std::ofstream(d.root + "/missing.toml") << text;
  }
  EXPECT_HAS(err("pretrain --config " + d.root + "/missing.toml --device cpu --out " + d.root + "/r"),
             d.root + "/missing.toml:24: data.source 'text:" + d.root + "/missing.txt': " + d.root +
                 "/missing.txt: cannot open data file");
  std::ofstream(d.root + "/range.toml") << config_text("lr = -0.5\n");
  EXPECT_HAS(err("pretrain --config " + d.root + "/range.toml --device cpu --out " + d.root + "/r"),
             d.root + "/range.toml:23: train.lr must be positive, got -0.5");
  EXPECT_HAS(err("pretrain --config " + cfg + " --set train.lr --out " + d.root + "/r"),
             "--set train.lr: expected section.key=value");
  EXPECT_HAS(err("pretrain --config " + cfg + " --set train.warmup_steps=-1 --out " + d.root + "/r"),
             "--set train.warmup_steps=-1: train.warmup_steps must be >= 0, got -1");
  EXPECT_HAS(err("pretrain --config " + d.root + " --out " + d.root + "/r"), d.root + ": is a directory, expected a TOML config file");
  EXPECT_HAS(err("recipes --threads 0"), "--threads: expected a positive number of threads, got 0");
  EXPECT_HAS(err("plot " + d.root + "/none --out /proc/x.png"), "--out /proc/x.png");
  EXPECT_HAS(err("pretrain --resume " + d.root + "/nothing"), d.root + "/nothing: no such run directory");
  EXPECT_HAS(err("pretrain --from-checkpoint step-3 --config " + cfg + " --out " + d.root + "/r"),
             "--from-checkpoint picks where a --resume continues");
  EXPECT_HAS(err("pretrain --resume " + d.root + "/r --force"), "give only one of them");
  EXPECT_HAS(err("pretrain --resume " + d.root + "/r --init " + d.root + "/q"), "cannot be combined with --resume");
  EXPECT_FALSE(fs::exists(d.root + "/r")) << "a refused command created its run directory";
  const CliRun ok = run_cli(d.root, "recipes --recipe mxfp8 --threads 1");
  EXPECT_EQ(ok.status, 0) << ok.err;
}

// A checkpoint whose weights hold a NaN (its checksums intact: written that way) is refused by
// generate with the tensor's name, instead of printing an empty completion.
TEST(RunsCli, GenerateRefusesNonFiniteWeights) {
  const Dir d;
  const RunConfig cfg = load_config(d.config());
  ParamStore p(cfg.model, DType::F32, Device::CPU);
  init_params(p, cfg.model, 1);
  p.flat().data<float>()[p.info("embed").offset + 3] = NAN;
  const Tensor zeros = Tensor::zeros({p.numel()}, DType::F32);
  save_checkpoint(d.root + "/nan", p, zeros, zeros, CheckpointState{cfg, "mxfp8", 1, 1, 0, nullptr, nullptr, nullptr});
  const std::string msg = last_error(run_cli(d.root, "generate --run " + d.root + "/nan --prompt 12+3= --device cpu"));
  EXPECT_HAS(msg, "model.safetensors: tensor 'embed' holds a non-finite value (nan) at element 3");
}
