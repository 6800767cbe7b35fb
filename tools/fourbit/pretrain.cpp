// defines: add_pretrain_command, add_recipes_command
// `fourbit pretrain` and `fourbit recipes`.
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "fourbit/model/recipe.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/data.h"
#include "fourbit/train/trainer.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

void add_pretrain_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("pretrain", "train a MoE language model from a TOML config");
  struct Args {
    std::string config = "configs/tiny.toml", recipe = "nvfp4-fwd", data, out, resume, device = "auto";
    int64_t steps = -1;
    int64_t seed = -1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--config", a->config, "TOML run config")->capture_default_str();
  cmd->add_option("--recipe", a->recipe, "precision recipe (fourbit recipes lists them)")->capture_default_str();
  cmd->add_option("--data", a->data, "synthetic | text:FILE | tokens:FILE (overrides data.source)");
  cmd->add_option("--steps", a->steps, "optimizer steps (overrides train.steps)");
  cmd->add_option("--seed", a->seed, "run seed (overrides train.seed)");
  cmd->add_option("--out", a->out, "run directory (metrics.jsonl, checkpoints/, summary.json)");
  cmd->add_option("--resume", a->resume, "continue the run in DIR from its latest checkpoint");
  cmd->add_option("--device", a->device, "cpu, cuda or auto")->capture_default_str();
  cmd->callback([a]() {
    PretrainOptions opt;
    opt.config = load_config(a->config);
    if (!a->data.empty()) {
      opt.config.data.source = a->data;
      validate_config(opt.config);
    }
    opt.recipe = a->recipe;
    recipe_by_name(a->recipe);  // unknown names fail before any work
    if (a->steps >= 0) opt.steps = a->steps;
    if (a->seed >= 0) opt.seed = uint64_t(a->seed);
    if (!a->resume.empty()) {
      if (!a->out.empty() && a->out != a->resume) fail("--resume DIR continues DIR; do not also give a different --out");
      opt.out_dir = a->resume;
      opt.resume = true;
    } else {
      opt.out_dir = a->out.empty() ? fmt::format("runs/{}-{}", std::filesystem::path(a->config).stem().string(), a->recipe)
                                   : a->out;
    }
    opt.device = parse_device(a->device);
    const TrainSummary s = pretrain(opt);
    std::printf("\n== %s: %lld steps, recipe %s ==\n", s.run_dir.c_str(), (long long)s.steps, s.recipe.c_str());
    std::printf("  final train loss   %.4f nats/token\n", s.final_train_loss);
    std::printf("  final eval loss    %.4f nats/token\n", s.final_eval_loss);
    std::printf("  unigram entropy    %.4f nats/token (eval loss / unigram = %.3f)\n", s.unigram_entropy,
                s.final_eval_loss / s.unigram_entropy);
    std::printf("  throughput         %.0f tokens/s over %.1f s\n", s.tokens_per_s, s.wall_s);
    std::printf("  parameters         %lld\n", (long long)s.params);
    int64_t total = 0;
    for (const auto& [k, v] : s.saved_bytes) total += v;
    std::printf("  saved activations  %.2f MiB per micro-batch:", double(total) / 1048576.0);
    for (const auto& [k, v] : s.saved_bytes) std::printf(" %s %.2f", k.c_str(), double(v) / 1048576.0);
    std::printf(" (MiB)\n");
  });
}

void add_recipes_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("recipes", "print every precision recipe: layer class x GEMM x operand format");
  auto layers = std::make_shared<int64_t>(12);
  auto only = std::make_shared<std::string>();
  cmd->add_option("--layers", *layers, "model depth, for the tail-layer counts")->capture_default_str();
  cmd->add_option("--recipe", *only, "print only this recipe");
  cmd->callback([layers, only]() {
    for (const std::string& name : recipe_names()) {
      if (!only->empty() && *only != name) continue;
      std::printf("%s\n", recipe_table(recipe_by_name(name), *layers).c_str());
    }
    if (!only->empty()) recipe_by_name(*only);
  });
}

}  // namespace fourbit::cli
