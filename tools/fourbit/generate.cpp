// defines: add_generate_command
// `fourbit generate`: samples from a trained run through the KV-cache sampler (rl/sampler.h),
// i.e. the training forward with a cache: greedy by default, or at a temperature with top-k /
// top-p, several samples per prompt, reproducible from --seed.
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "fourbit/model/recipe.h"
#include "fourbit/rl/sampler.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/tokenizer.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "sample from a trained run (KV-cache sampler on the training forward)");
  struct Args {
    std::string run, checkpoint, device = "auto";
    std::vector<std::string> prompts;
    int64_t max_new = 48, n = 1, top_k = 0;
    double temperature = 0, top_p = 1;
    uint64_t seed = 0;
    bool sep = false, logprobs = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--run", a->run, "run directory (its newest valid checkpoint) or a checkpoint directory")
      ->required();
  cmd->add_option("--checkpoint", a->checkpoint, "which checkpoint of the run: step-N");
  cmd->add_option("--prompt", a->prompts, "prompt text, after <bos> (repeatable)")->required();
  cmd->add_option("--max-new", a->max_new, "tokens to generate at most (<eos> ends a sample earlier)")
      ->capture_default_str();
  cmd->add_option("--temperature", a->temperature, "0 = greedy; else sample softmax(logits / T)")
      ->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "sample among the k most likely tokens (0 = all)")->capture_default_str();
  cmd->add_option("--top-p", a->top_p, "sample among the most likely tokens holding this probability (1 = all)")
      ->capture_default_str();
  cmd->add_option("--n", a->n, "samples per prompt (needs --temperature > 0 when above 1)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "seed of the random draws (same seed, same samples)")->capture_default_str();
  cmd->add_flag("--sep", a->sep, "end each prompt with <sep>, the task format of SFT/RL models");
  cmd->add_flag("--logprobs", a->logprobs, "print each sample's summed log-prob (the policy's, temperature 1)");
  cmd->add_option("--device", a->device, "cpu, cuda or auto")->capture_default_str();
  add_threads_option(cmd);
  cmd->callback([a]() {
    if (a->n < 1) fail("--n: expected at least 1 sample per prompt, got {}", a->n);
    if (a->n > 1 && a->temperature == 0)
      fail("--n {} with --temperature 0: greedy decoding gives one answer; sample with --temperature > 0", a->n);
    if (a->max_new < 1) fail("--max-new: expected at least 1 token, got {}", a->max_new);
    rl::SamplingOptions opt;
    opt.temperature = a->temperature;
    opt.top_k = a->top_k;
    opt.top_p = a->top_p;
    opt.max_new = a->max_new;
    opt.seed = a->seed;
    opt.stop_token = data::kEos;
    rl::check_sampling_options(opt, data::kVocabSize);  // option errors before loading anything

    const Device device = parse_device(a->device);
    std::unique_ptr<Model> model;
    std::vector<std::string> warnings;
    load_first_valid_checkpoint(
        a->run, a->checkpoint,
        [&](const std::string& dir) {
          const CheckpointState st = read_checkpoint_state(dir);
          auto loaded = std::make_unique<Model>(st.config.model, recipe_by_name(st.recipe), device);
          load_checkpoint(dir, loaded->params(), nullptr, nullptr);  // checksums; NaN weights refused
          model = std::move(loaded);
        },
        &warnings);
    for (const std::string& w : warnings) std::fprintf(stderr, "fourbit: %s\n", w.c_str());
    Model& m = *model;
    std::vector<rl::SampleRequest> requests;
    for (size_t i = 0; i < a->prompts.size(); ++i) {
      std::vector<int32_t> prompt = {data::kBos};
      for (int32_t t : data::encode(a->prompts[i])) prompt.push_back(t);
      if (a->sep) prompt.push_back(data::kSep);
      for (int64_t g = 0; g < a->n; ++g)
        requests.push_back(rl::SampleRequest{prompt, uint64_t(i) * uint64_t(a->n) + uint64_t(g)});
    }
    rl::Sampler sampler(m);
    const std::vector<rl::Completion> out = sampler.sample(requests, opt);
    for (size_t r = 0; r < out.size(); ++r) {
      const std::string& p = a->prompts[r / size_t(a->n)];
      std::string line = a->n > 1 ? fmt::format("  [{}] ", r % size_t(a->n)) : std::string("  ");
      line += fmt::format("{}{}|{}", p, a->sep ? "<sep>" : "", data::decode(out[r].tokens));
      if (a->logprobs) {
        double sum = 0;
        for (float lp : out[r].logprobs) sum += lp;
        line += fmt::format("   (log-prob {:.4f} over {} tokens)", sum, out[r].tokens.size());
      }
      std::printf("%s\n", line.c_str());
    }
  });
}

}  // namespace fourbit::cli
