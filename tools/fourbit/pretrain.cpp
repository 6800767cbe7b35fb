// defines: add_pretrain_command, add_recipes_command, config_of_run
// `fourbit pretrain` and `fourbit recipes`.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "fourbit/model/recipe.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/data.h"
#include "fourbit/train/run_dir.h"
#include "fourbit/train/stop_signal.h"
#include "fourbit/train/trainer.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

namespace {

std::string fmt_opt(const std::optional<double>& v, const char* absent) {
  return v ? fmt::format("{:.4f} nats/token", *v) : std::string(absent);
}

void print_summary(const TrainSummary& s, const RunConfig& cfg) {
  std::printf("\n== %s: %lld steps, recipe %s ==\n", s.run_dir.c_str(), (long long)s.steps, s.recipe.c_str());
  std::printf("  final train loss   %s\n", fmt_opt(s.final_train_loss, "- (no step ran)").c_str());
  const std::string no_eval = cfg.train.eval_batches == 0 ? "- (not measured: train.eval_batches = 0)" : "- (not measured)";
  std::printf("  final eval loss    %s\n", fmt_opt(s.final_eval_loss, no_eval.c_str()).c_str());
  if (s.extra.contains("unigram_entropy_nats")) {
    const double uni = s.extra["unigram_entropy_nats"].get<double>();
    if (s.final_eval_loss)
      std::printf("  unigram entropy    %.4f nats/token (eval loss / unigram = %.3f)\n", uni, *s.final_eval_loss / uni);
    else
      std::printf("  unigram entropy    %.4f nats/token\n", uni);
  }
  if (s.tokens_per_s) std::printf("  throughput         %.0f tokens/s over %.1f s\n", *s.tokens_per_s, s.wall_s);
  else std::printf("  throughput         - (no step ran)\n");
  std::printf("  parameters         %lld\n", (long long)s.params);
  if (s.cuda_graph_replays)
    std::printf("  CUDA graph         %lld micro-batches replayed (train.cuda_graphs)\n", (long long)*s.cuda_graph_replays);
  if (!s.saved_bytes.empty()) {
    int64_t total = 0;
    for (const auto& [k, v] : s.saved_bytes) total += v;
    std::printf("  saved activations  %.2f MiB per micro-batch:", double(total) / 1048576.0);
    for (const auto& [k, v] : s.saved_bytes) std::printf(" %s %.2f", k.c_str(), double(v) / 1048576.0);
    std::printf(" (MiB)\n");
  }
}

}  // namespace

// The config a --init run starts from when no --config is given: the one its weights came with.
RunConfig config_of_run(const std::string& init) {
  if (std::filesystem::exists(std::filesystem::path(init) / "state.json")) {
    RunConfig c = read_checkpoint_state(init).config;
    c.path = init + "/state.json";
    return c;
  }
  RunRecord r = read_run_record(init);
  r.config.path = r.path;
  return r.config;
}

void add_pretrain_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("pretrain", "train a MoE language model from a TOML config");
  struct Args {
    std::string config = "configs/tiny.toml", recipe = "nvfp4-fwd", data, out, resume, from_checkpoint, init,
                device = "auto";
    std::vector<std::string> sets;
    bool force = false;
    int64_t steps = -1;
    int64_t seed = -1;
    CLI::Option *config_opt = nullptr, *recipe_opt = nullptr;
  };
  auto a = std::make_shared<Args>();
  a->config_opt = cmd->add_option("--config", a->config, "TOML run config (a --resume reads the run's own)")
                      ->capture_default_str();
  a->recipe_opt = cmd->add_option("--recipe", a->recipe, "precision recipe (fourbit recipes lists them)")
                      ->capture_default_str();
  cmd->add_option("--data", a->data, "synthetic | text:FILE | tokens:FILE (overrides data.source)");
  cmd->add_option("--steps", a->steps, "optimizer steps (overrides train.steps; with --resume: the new length)");
  cmd->add_option("--seed", a->seed, "run seed (overrides train.seed)");
  cmd->add_option("--set", a->sets, "section.key=value: override any config field (repeatable)");
  cmd->add_option("--out", a->out, "run directory (default runs/<config>-<recipe>); must be new or empty");
  cmd->add_flag("--force", a->force, "replace the run in --out (it is moved to DIR.old-<time>, not deleted)");
  cmd->add_option("--resume", a->resume, "continue the run in DIR from its newest valid checkpoint");
  cmd->add_option("--from-checkpoint", a->from_checkpoint, "with --resume: continue from checkpoint step-N");
  cmd->add_option("--init", a->init, "start a new run from the weights of run (or checkpoint) RUN, fresh optimizer");
  cmd->add_option("--device", a->device, "cpu, cuda or auto")->capture_default_str();
  add_threads_option(cmd);
  cmd->callback([a]() {
    PretrainOptions opt;
    opt.command = "pretrain";
    opt.command_line = invocation();
    const bool resume = !a->resume.empty();
    RunConfig cfg;
    if (resume) {
      if (!a->out.empty() && a->out != a->resume)
        fail("--resume DIR continues DIR; do not also give a different --out ({})", a->out);
      if (a->force) fail("--force replaces a run and --resume continues one; give only one of them");
      if (!a->init.empty()) fail("--init starts a new run from another run's weights; it cannot be combined with --resume");
      const RunRecord rec = read_run_record(a->resume);
      if (a->config_opt->count()) {
        cfg = load_config(a->config);
      } else {
        cfg = rec.config;  // the run's own config: nothing to repeat on the command line
        cfg.path = rec.path;
        cfg.origin.clear();
      }
      opt.recipe = a->recipe_opt->count() ? a->recipe : rec.recipe;
      opt.out_dir = a->resume;
      opt.resume = true;
      opt.from_checkpoint = a->from_checkpoint;
    } else {
      if (!a->from_checkpoint.empty()) fail("--from-checkpoint picks where a --resume continues; give --resume DIR too");
      if (!a->init.empty() && !a->config_opt->count()) {
        cfg = config_of_run(a->init);
        cfg.origin.clear();
      } else {
        cfg = load_config(a->config);
      }
      opt.recipe = a->recipe;
      opt.out_dir = a->out.empty() ? fmt::format("runs/{}-{}", std::filesystem::path(a->config).stem().string(), a->recipe)
                                   : a->out;
      opt.force = a->force;
      opt.init_from = a->init;
    }
    if (!a->data.empty()) set_config_field(cfg, "data.source", a->data, "--data");
    for (const std::string& s : a->sets) {
      apply_override(cfg, s);
      // On a resume the run's length changes through the schedule, like --steps.
      if (resume && cfg.origin["train.steps"] == "--set " + s) opt.steps = cfg.train.steps;
    }
    validate_config(cfg);
    opt.config = cfg;
    opt.overrides = a->sets;
    recipe_by_name(opt.recipe);  // unknown names fail before any work
    if (a->steps >= 0) opt.steps = a->steps;
    if (a->seed >= 0) opt.seed = uint64_t(a->seed);
    opt.device = parse_device(a->device);
    const TrainSummary s = pretrain(opt);
    if (s.stopped_by) {
      std::fflush(stdout);
      std::fprintf(stderr, "fourbit: stopped by %s after step %lld of %lld; checkpoint %s written\n",
                   signal_name(s.stopped_by), (long long)s.steps_done, (long long)s.steps, s.checkpoint.c_str());
      std::fprintf(stderr, "fourbit: resume with: fourbit pretrain --resume %s\n", s.run_dir.c_str());
      throw ExitStatus(128 + s.stopped_by);
    }
    print_summary(s, cfg);
  });
}

void add_recipes_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("recipes", "print every precision recipe: layer class x GEMM x operand format");
  auto layers = std::make_shared<int64_t>(12);
  auto only = std::make_shared<std::string>();
  cmd->add_option("--layers", *layers, "model depth, for the tail-layer counts")->capture_default_str();
  cmd->add_option("--recipe", *only, "print only this recipe");
  add_threads_option(cmd);
  cmd->callback([layers, only]() {
    for (const std::string& name : recipe_names()) {
      if (!only->empty() && *only != name) continue;
      std::printf("%s\n", recipe_table(recipe_by_name(name), *layers).c_str());
    }
    if (!only->empty()) recipe_by_name(*only);
  });
}

}  // namespace fourbit::cli
