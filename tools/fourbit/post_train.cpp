// defines: add_sft_command, add_rl_command
// `fourbit sft` and `fourbit rl`: post-training on the one training loop (train/loop.h) with the
// sources of rl/sft.h and rl/policy_gradient.h. Both start from another run's weights (--init) and
// take its config unless --config is given; a --resume takes everything from the run's record.
#include <cstdio>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "fourbit/model/recipe.h"
#include "fourbit/rl/policy_gradient.h"
#include "fourbit/rl/sft.h"
#include "fourbit/rl/task_batch.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/run_dir.h"
#include "fourbit/train/stop_signal.h"
#include "tools/fourbit/commands.h"

namespace fourbit::cli {

namespace {

// The options sft and rl share with the training loop.
struct RunArgs {
  std::string init, config, recipe = "nvfp4-fwd", out, resume, from_checkpoint, device = "auto";
  std::vector<std::string> sets;
  bool force = false;
  int64_t steps = -1, seed = -1, eval_every = -1, eval_problems = 200;
  CLI::Option *config_opt = nullptr, *recipe_opt = nullptr, *eval_problems_opt = nullptr;
};

void add_run_options(CLI::App* cmd, RunArgs& a, const char* init_what) {
  cmd->add_option("--init", a.init, init_what);
  a.config_opt = cmd->add_option("--config", a.config, "TOML run config (default: the --init run's)");
  a.recipe_opt = cmd->add_option("--recipe", a.recipe, "precision recipe (default: the --init run's)");
  cmd->add_option("--steps", a.steps, "optimizer steps (overrides train.steps; with --resume: the new length)");
  cmd->add_option("--seed", a.seed, "run seed: training problems and samples (overrides train.seed)");
  cmd->add_option("--set", a.sets, "section.key=value: override any config field (repeatable)");
  cmd->add_option("--eval-every", a.eval_every, "evaluate every K steps (overrides train.eval_every)");
  a.eval_problems_opt = cmd->add_option("--eval-problems", a.eval_problems, "held-out problems per task and evaluation")
                            ->capture_default_str();
  cmd->add_option("--out", a.out, "run directory (required for a new run); must be new or empty");
  cmd->add_flag("--force", a.force, "replace the run in --out (it is moved to DIR.old-<time>, not deleted)");
  cmd->add_option("--resume", a.resume, "continue the run in DIR from its newest valid checkpoint");
  cmd->add_option("--from-checkpoint", a.from_checkpoint, "with --resume: continue from checkpoint step-N");
  cmd->add_option("--device", a.device, "cpu, cuda or auto")->capture_default_str();
  add_threads_option(cmd);
}

// The recipe the weights of run (or checkpoint) `init` were trained with.
std::string recipe_of_run(const std::string& init) {
  if (std::filesystem::exists(std::filesystem::path(init) / "state.json")) return read_checkpoint_state(init).recipe;
  return read_run_record(init).recipe;
}

// The loop's options from the shared flags; `record` gets the resumed run's record.
LoopOptions loop_options(const RunArgs& a, const std::string& command, RunRecord* record) {
  LoopOptions opt;
  opt.command = command;
  opt.command_line = invocation();
  RunConfig cfg;
  const bool resume = !a.resume.empty();
  if (resume) {
    if (!a.out.empty() && a.out != a.resume)
      fail("--resume DIR continues DIR; do not also give a different --out ({})", a.out);
    if (a.force) fail("--force replaces a run and --resume continues one; give only one of them");
    if (!a.init.empty()) fail("--init starts a new run from another run's weights; it cannot be combined with --resume");
    *record = read_run_record(a.resume);
    if (a.config_opt->count()) {
      cfg = load_config(a.config);
    } else {
      cfg = record->config;
      cfg.path = record->path;
      cfg.origin.clear();
    }
    opt.recipe = a.recipe_opt->count() ? a.recipe : record->recipe;
    opt.out_dir = a.resume;
    opt.resume = true;
    opt.from_checkpoint = a.from_checkpoint;
  } else {
    if (a.init.empty())
      fail("--init RUN is required: the run (or checkpoint) whose weights `fourbit {}` starts from", command);
    if (a.out.empty()) fail("--out DIR is required: the directory of the new {} run", command);
    if (!a.from_checkpoint.empty()) fail("--from-checkpoint picks where a --resume continues; give --resume DIR too");
    try {
      cfg = a.config_opt->count() ? load_config(a.config) : config_of_run(a.init);
      opt.recipe = a.recipe_opt->count() ? a.recipe : recipe_of_run(a.init);
    } catch (const Error& e) {
      if (a.config_opt->count()) throw;
      fail("--init {}: {}", a.init, e.what());
    }
    if (!a.config_opt->count()) cfg.origin.clear();
    opt.out_dir = a.out;
    opt.force = a.force;
    opt.init_from = a.init;
  }
  for (const std::string& s : a.sets) {
    apply_override(cfg, s);
    if (resume && cfg.origin["train.steps"] == "--set " + s) opt.steps = cfg.train.steps;
  }
  if (a.eval_every >= 0) set_config_field(cfg, "train.eval_every", std::to_string(a.eval_every), "--eval-every");
  validate_config(cfg);
  opt.config = cfg;
  opt.overrides = a.sets;
  recipe_by_name(opt.recipe);  // unknown names fail before any work
  if (a.steps >= 0) opt.steps = a.steps;
  if (a.seed >= 0) opt.seed = uint64_t(a.seed);
  opt.device = parse_device(a.device);
  return opt;
}

// A flag's value when given, else the resumed run's recorded value (else the default).
template <class T>
T given_or_recorded(const CLI::Option* flag, const T& value, const nlohmann::json& source, const char* key) {
  if (flag->count() || !source.is_object() || !source.contains(key) || source[key].is_null()) return value;
  return source[key].get<T>();
}

void finish(const TrainSummary& s, const std::string& command) {
  if (s.stopped_by) {
    std::fflush(stdout);
    std::fprintf(stderr, "fourbit: stopped by %s after step %lld of %lld; checkpoint %s written\n",
                 signal_name(s.stopped_by), (long long)s.steps_done, (long long)s.steps, s.checkpoint.c_str());
    std::fprintf(stderr, "fourbit: resume with: fourbit %s --resume %s\n", command.c_str(), s.run_dir.c_str());
    throw ExitStatus(128 + s.stopped_by);
  }
  std::printf("\n== %s: %lld steps, recipe %s ==\n", s.run_dir.c_str(), (long long)s.steps, s.recipe.c_str());
  if (s.final_train_loss) std::printf("  final train loss   %.4f\n", *s.final_train_loss);
  for (const auto& [k, v] : s.final_eval.items())
    std::printf("  %-18s %s\n", k.c_str(), v.is_number_float() ? fmt::format("{:.4f}", v.get<double>()).c_str()
                                                                : v.dump().c_str());
  std::printf("  wall time          %.1f s\n", s.wall_s);
}

}  // namespace

void add_sft_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("sft", "supervised fine-tuning on tasks' prompt/answer pairs (loss on the answers)");
  struct Args : RunArgs {
    std::string tasks;
    int64_t max_new = 16;
    CLI::Option *tasks_opt = nullptr, *max_new_opt = nullptr;
  };
  auto a = std::make_shared<Args>();
  a->tasks_opt = cmd->add_option("--task", a->tasks, "task or tasks, comma-separated (add, sub, mul, sort, reverse, countdown), each with options "
                                 "as NAME:KEY=LO-HI, e.g. sort:len=3-5");
  a->max_new_opt = cmd->add_option("--max-new", a->max_new, "greedy evaluation: answer tokens at most (<eos> included)")
                       ->capture_default_str();
  add_run_options(cmd, *a, "the run (or checkpoint) whose weights SFT starts from (pretrain or sft)");
  cmd->callback([a]() {
    RunRecord record;
    if (a->resume.empty() && !a->tasks_opt->count()) fail("--task T[,T...] is required (fourbit sft --help lists the tasks)");
    // Source options before the run is touched: unknown tasks fail here.
    const nlohmann::json recorded = a->resume.empty() ? nlohmann::json() : read_run_record(a->resume).source;
    rl::SftOptions so;
    if (a->tasks_opt->count()) so.tasks = rl::task_list(a->tasks, "--task");
    else if (recorded.is_object() && recorded.contains("tasks")) so.tasks = recorded["tasks"].get<std::vector<std::string>>();
    so.eval_problems = given_or_recorded<int64_t>(a->eval_problems_opt, a->eval_problems, recorded, "eval_problems");
    so.eval_max_new = given_or_recorded<int64_t>(a->max_new_opt, a->max_new, recorded, "eval_max_new");
    const LoopOptions opt = loop_options(*a, "sft", &record);
    rl::SftSource source(so);
    finish(run_training(opt, source), "sft");
  });
}

void add_rl_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("rl", "on-policy RL with a group baseline on a task with verifiable rewards");
  struct Args : RunArgs {
    std::string task;
    int64_t prompts = 16, group = 8, max_new = 16, sample_rounds = 1;
    double temperature = 1.0, kl_coef = 0, aux_loss_coef = 0;
    bool std_normalize = false;
    CLI::Option *task_opt = nullptr, *prompts_opt = nullptr, *group_opt = nullptr, *max_new_opt = nullptr,
                *temperature_opt = nullptr, *kl_opt = nullptr, *std_opt = nullptr, *aux_opt = nullptr,
                *rounds_opt = nullptr;
  };
  auto a = std::make_shared<Args>();
  a->task_opt = cmd->add_option("--task", a->task, "the task (add, sub, mul, sort, reverse, countdown), with options as NAME:KEY=LO-HI, e.g. sort:len=3-5");
  a->prompts_opt = cmd->add_option("--prompts", a->prompts, "problems per step (P)")->capture_default_str();
  a->group_opt = cmd->add_option("--group", a->group, "samples per problem (G >= 2)")->capture_default_str();
  a->temperature_opt = cmd->add_option("--temperature", a->temperature, "sampling temperature (> 0)")->capture_default_str();
  a->max_new_opt = cmd->add_option("--max-new", a->max_new, "completion tokens at most (<eos> included)")->capture_default_str();
  a->std_opt = cmd->add_flag("--std-normalize", a->std_normalize, "divide advantages by the group's reward std");
  a->rounds_opt = cmd->add_option("--sample-rounds", a->sample_rounds,
                                  "dynamic sampling: up to R rounds of P problems per step until P groups have "
                                  "differing rewards; train on those only (1: the P groups drawn)")
                      ->capture_default_str();
  a->kl_opt = cmd->add_option("--kl-coef", a->kl_coef,
                              "log the k3 KL to the initial policy; > 0: also add coef * k3 to the loss");
  a->aux_opt = cmd->add_option("--aux-loss-coef", a->aux_loss_coef,
                               "MoE load-balance loss coefficient in RL's updates (instead of model.aux_loss_coef)")
                   ->capture_default_str();
  add_run_options(cmd, *a, "the run (or checkpoint) whose weights RL starts from (sft or pretrain)");
  cmd->callback([a]() {
    RunRecord record;
    if (a->resume.empty() && !a->task_opt->count()) fail("--task T is required (fourbit rl --help lists the tasks)");
    const nlohmann::json recorded = a->resume.empty() ? nlohmann::json() : read_run_record(a->resume).source;
    rl::RlOptions ro;
    if (a->task_opt->count()) {
      const std::vector<std::string> tasks = rl::task_list(a->task, "--task");
      if (tasks.size() != 1) fail("--task: rl trains on one task, got {}", a->task);
      ro.task = tasks[0];
    } else if (recorded.is_object() && recorded.contains("task")) {
      ro.task = recorded["task"].get<std::string>();
    }
    ro.prompts = given_or_recorded<int64_t>(a->prompts_opt, a->prompts, recorded, "prompts");
    ro.group = given_or_recorded<int64_t>(a->group_opt, a->group, recorded, "group");
    ro.temperature = given_or_recorded<double>(a->temperature_opt, a->temperature, recorded, "temperature");
    ro.max_new = given_or_recorded<int64_t>(a->max_new_opt, a->max_new, recorded, "max_new");
    ro.std_normalize = given_or_recorded<bool>(a->std_opt, a->std_normalize, recorded, "std_normalize");
    ro.sample_rounds = given_or_recorded<int64_t>(a->rounds_opt, a->sample_rounds, recorded, "sample_rounds");
    ro.eval_problems = given_or_recorded<int64_t>(a->eval_problems_opt, a->eval_problems, recorded, "eval_problems");
    ro.aux_loss_coef = given_or_recorded<double>(a->aux_opt, a->aux_loss_coef, recorded, "aux_loss_coef");
    if (a->kl_opt->count()) ro.kl_coef = a->kl_coef;
    else if (recorded.is_object() && recorded.contains("kl_coef") && !recorded["kl_coef"].is_null())
      ro.kl_coef = recorded["kl_coef"].get<double>();
    rl::RlSource check(ro);  // option errors (G < 2, ...) before the run is touched
    const LoopOptions opt = loop_options(*a, "rl", &record);
    // A resumed run's KL reference is the checkpoint its --init loaded, not the resumed weights.
    if (opt.resume && ro.kl_coef) {
      if (!record.json.contains("init") || !record.json["init"].contains("checkpoint"))
        fail("{}: the run record names no --init checkpoint, the KL reference", opt.out_dir);
      ro.reference_checkpoint = record.json["init"]["checkpoint"].get<std::string>();
    }
    rl::RlSource source(ro);
    finish(run_training(opt, source), "rl");
  });
}

}  // namespace fourbit::cli
