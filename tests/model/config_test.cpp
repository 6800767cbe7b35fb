// defines: tests of the run config's command-line overrides and messages: `--set section.key=value`
//          for every kind of field (integers, numbers, booleans, strings with or without quotes),
//          each parsing error naming the assignment and what was expected, range errors starting
//          with where the value came from (file:line, --set, the config's path for defaults), and
//          run records written before train.keep_last (or train.saved_x_decodes,
//          train.cuda_graphs) existed still loading, and train.saved_x_decodes and train.cuda_graphs
//          read from a file.
#include <gtest/gtest.h>

#include <string>

#include "fourbit/model/config.h"
#include "test_util.h"

using namespace fourbit;
using fourbit::testutil::error_of;

TEST(ConfigOverride, SetsEveryKindOfField) {
  RunConfig c = parse_config("[train]\nlr = 0.01\n", "run.toml");
  apply_override(c, "train.lr=0.002");
  apply_override(c, "train.steps=12");
  apply_override(c, "model.tie_embeddings=false");
  apply_override(c, "data.source=text:corpus.txt");
  apply_override(c, "train.seed = 99");
  EXPECT_EQ(c.train.lr, 0.002);
  EXPECT_EQ(c.train.steps, 12);
  EXPECT_FALSE(c.model.tie_embeddings);
  EXPECT_EQ(c.data.source, "text:corpus.txt");
  EXPECT_EQ(c.train.seed, 99u);
  apply_override(c, "data.source=\"synthetic\"");  // TOML-style quotes are optional
  EXPECT_EQ(c.data.source, "synthetic");
  EXPECT_EQ(c.origin.at("train.lr"), "--set train.lr=0.002");
  EXPECT_EQ(c.where("train.lr"), "--set train.lr=0.002");
  EXPECT_EQ(c.where("train.batch_size"), "run.toml");  // a default: the config's path
  validate_config(c);
}

TEST(ConfigOverride, ErrorsNameTheAssignmentAndWhatWasExpected) {
  RunConfig c;
  c.path = "run.toml";
  struct Case {
    std::string set, want;
  };
  for (const Case& k : std::vector<Case>{
           {"train.lr", "--set train.lr: expected section.key=value"},
           {"lr=0.1", "--set lr=0.1: expected section.key=value (e.g. train.lr=0.001), got the name 'lr'"},
           {"trian.lr=0.1", "--set trian.lr=0.1: unknown section 'trian' (expected model, train or data)"},
           {"train.lrr=0.1", "--set train.lrr=0.1: unknown field train.lrr (known in [train]:"},
           {"train.lr=fast", "--set train.lr=fast: train.lr: expected a finite number, got 'fast'"},
           {"train.lr=nan", "expected a finite number, got 'nan'"},
           {"train.steps=1.5", "--set train.steps=1.5: train.steps: expected an integer, got '1.5'"},
           {"train.steps=", "train.steps: expected an integer, got ''"},
           {"train.seed=-3", "--set train.seed=-3: train.seed: expected a non-negative integer, got -3"},
           {"model.tie_embeddings=yes", "model.tie_embeddings: expected true or false, got 'yes'"},
           {".lr=1", "expected section.key=value"},
       }) {
    EXPECT_HAS(error_of([&] { apply_override(c, k.set); }), k.want);
  }
}

TEST(ConfigOverride, RangeErrorsStartWithWhereTheValueCameFrom) {
  // From the file: file:line.
  EXPECT_HAS(error_of([] { parse_config("[model]\nd_model = 64\n\n[train]\nlr = -1.0\n", "run.toml"); }),
             "run.toml:5: train.lr must be positive, got -1");
  EXPECT_HAS(error_of([] { parse_config("[train]\nseq_len = 256\n", "run.toml"); }),
             "run.toml:2: train.seq_len (256) exceeds model.max_seq_len (128)");
  EXPECT_HAS(error_of([] { parse_config("[model]\nmax_seq_len = 64\n[train]\nseq_len = 100\n", "run.toml"); }),
             "run.toml:4: train.seq_len (100) exceeds model.max_seq_len (64, run.toml:2)");
  EXPECT_HAS(error_of([] { parse_config("[model]\nn_heads = 4\nn_kv_heads = 3\n", "run.toml"); }),
             "run.toml:2: model.n_heads (4) must be a multiple of model.n_kv_heads (3, run.toml:3)");
  EXPECT_HAS(error_of([] { parse_config("[data]\neval_fraction = 1.5\n", "run.toml"); }),
             "run.toml:2: data.eval_fraction must be in (0, 1), got 1.5");
  // From --set: the assignment.
  RunConfig c = parse_config("", "run.toml");
  apply_override(c, "train.warmup_steps=-4");
  EXPECT_HAS(error_of([&] { validate_config(c); }), "--set train.warmup_steps=-4: train.warmup_steps must be >= 0, got -4");
  c = parse_config("", "run.toml");
  set_config_field(c, "data.source", "bogus", "--data");
  EXPECT_HAS(error_of([&] { validate_config(c); }), "--data: data.source must be 'synthetic', 'text:FILE' or 'tokens:FILE', got 'bogus'");
}

TEST(ConfigRecord, OlderRecordsWithoutKeepLastTakeTheDefault) {
  RunConfig c;
  c.train.keep_last = 7;
  c.train.saved_x_decodes = false;
  c.train.cuda_graphs = false;
  nlohmann::json j = config_to_json(c);
  EXPECT_EQ(j["train"]["keep_last"], 7);
  EXPECT_EQ(j["train"]["saved_x_decodes"], false);
  EXPECT_EQ(j["train"]["cuda_graphs"], false);
  EXPECT_FALSE(config_from_json(j, "old/config.json").train.saved_x_decodes);
  EXPECT_FALSE(config_from_json(j, "old/config.json").train.cuda_graphs);
  j["train"].erase("keep_last");
  j["train"].erase("saved_x_decodes");
  j["train"].erase("cuda_graphs");
  const RunConfig old = config_from_json(j, "old/config.json");
  EXPECT_EQ(old.train.keep_last, TrainConfig{}.keep_last);
  EXPECT_TRUE(old.train.saved_x_decodes);
  EXPECT_TRUE(old.train.cuda_graphs);
  j["train"].erase("lr");  // any other missing field is still an error
  EXPECT_HAS(error_of([&] { config_from_json(j, "old/config.json"); }), "old/config.json: config has no field 'train.lr'");
}

// What the forward keeps of its MXFP8 X^T: the decodes unless the file says otherwise; a value
// that is not a boolean names the field.
TEST(ConfigFile, SavedXDecodes) {
  EXPECT_TRUE(parse_config("", "run.toml").train.saved_x_decodes);
  EXPECT_FALSE(parse_config("[train]\nsaved_x_decodes = false\n", "run.toml").train.saved_x_decodes);
  EXPECT_HAS(error_of([] { parse_config("[train]\nsaved_x_decodes = 1\n", "run.toml"); }), "saved_x_decodes");
}

// The GPU step as a CUDA graph where it can be recorded: on unless the file says otherwise.
TEST(ConfigFile, CudaGraphs) {
  EXPECT_TRUE(parse_config("", "run.toml").train.cuda_graphs);
  EXPECT_FALSE(parse_config("[train]\ncuda_graphs = false\n", "run.toml").train.cuda_graphs);
  EXPECT_HAS(error_of([] { parse_config("[train]\ncuda_graphs = \"yes\"\n", "run.toml"); }), "cuda_graphs");
}
