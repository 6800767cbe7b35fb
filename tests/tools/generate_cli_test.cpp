// defines: end-to-end tests of `fourbit generate` on the KV-cache sampler: greedy output is
//          reproducible; --n samples at a temperature are reproducible from --seed and change
//          with it; --sep and --logprobs shape the output; bad options and a prompt longer than
//          the context fail with one "fourbit: error:" line.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "model/model_test_util.h"
#include "tools/cli_test_util.h"

using namespace fourbit::clitest;
using namespace fourbit::modeltest;

namespace {

// A 2-layer MoE (16-token context) trained for 2 steps: a checkpoint to sample from.
std::string trained_run(const std::string& dir) {
  const std::string config = dir + "/tiny.toml", run = dir + "/run";
  std::ofstream(config) << "[model]\n"
                           "vocab_size = 260\nd_model = 32\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\n"
                           "max_seq_len = 16\nn_experts = 4\ntop_k = 2\nd_expert = 32\nn_shared_experts = 1\n"
                           "dense_layers = 1\nd_dense = 64\n"
                           "[train]\n"
                           "batch_size = 2\nseq_len = 16\nsteps = 2\nwarmup_steps = 2\neval_every = 0\n"
                           "eval_batches = 1\nlog_every = 1\nseed = 7\n"
                           "[data]\nsource = \"synthetic\"\n";
  const CliRun r = run_cli(dir, "pretrain --config " + config + " --recipe nvfp4-fwd --device cpu --out " + run);
  EXPECT_EQ(r.status, 0) << r.err;
  return run;
}

std::string one_error(const CliRun& r) {
  EXPECT_EQ(r.status, 1) << r.err;
  const std::vector<std::string> lines = lines_of(r.err);
  EXPECT_EQ(lines.size(), 1u) << r.err;
  return lines.empty() ? "" : lines.back();
}

}  // namespace

TEST(GenerateCli, SamplesAreReproducibleAndErrorsAreClear) {
  const std::string dir = fresh_test_dir("cli_tests");
  const std::string run = trained_run(dir);
  const std::string base = "generate --run " + run + " --device cpu --max-new 6 --prompt 12+3= --prompt 'the cat'";

  const CliRun greedy = run_cli(dir, base);
  ASSERT_EQ(greedy.status, 0) << greedy.err;
  const std::vector<std::string> g = lines_of(greedy.out);
  ASSERT_EQ(g.size(), 2u) << greedy.out;
  EXPECT_EQ(g[0].rfind("  12+3=|", 0), 0u) << g[0];
  EXPECT_EQ(g[1].rfind("  the cat|", 0), 0u) << g[1];
  EXPECT_EQ(run_cli(dir, base).out, greedy.out);

  const CliRun s4 = run_cli(dir, base + " --n 3 --temperature 1 --seed 4 --logprobs --sep");
  ASSERT_EQ(s4.status, 0) << s4.err;
  // six samples (a sample of this barely trained model may hold a newline: count the markers)
  size_t samples = 0, logprobs = 0;
  for (size_t at = 0; (at = s4.out.find("(log-prob ", at)) != std::string::npos; ++at) ++logprobs;
  for (const std::string& l : lines_of(s4.out)) samples += l.rfind("  [", 0) == 0;
  EXPECT_EQ(samples, 6u) << s4.out;
  EXPECT_EQ(logprobs, 6u) << s4.out;
  EXPECT_HAS(s4.out, "  [2] 12+3=<sep>|");
  EXPECT_HAS(s4.out, "  [0] the cat<sep>|");
  EXPECT_EQ(run_cli(dir, base + " --n 3 --temperature 1 --seed 4 --logprobs --sep").out, s4.out);
  EXPECT_NE(run_cli(dir, base + " --n 3 --temperature 1 --seed 5 --logprobs --sep").out, s4.out);

  EXPECT_HAS(one_error(run_cli(dir, base + " --n 2")), "--n 2 with --temperature 0");
  EXPECT_HAS(one_error(run_cli(dir, base + " --n 0")), "--n: expected at least 1");
  EXPECT_HAS(one_error(run_cli(dir, base + " --temperature -1")), "temperature must be a finite value >= 0");
  EXPECT_HAS(one_error(run_cli(dir, base + " --temperature 1 --top-p 0")), "top_p must be in (0, 1]");
  EXPECT_HAS(one_error(run_cli(dir, base + " --temperature 1 --top-k -3")), "top_k must be >= 0");
  EXPECT_HAS(one_error(run_cli(dir, "generate --run " + run + " --device cpu --prompt 0123456789abcdefghij")),
             "a prompt of 21 tokens does not fit the model's context (max_seq_len 16)");
  EXPECT_HAS(one_error(run_cli(dir, "generate --run " + dir + "/nothing --prompt x")), "nothing");
}
