// defines: TrainingSource, StepContext::write, TrainSummary::to_json, run_training,
//          recipe_coverage (loop.h)
#include "fourbit/train/loop.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "fourbit/io/atomic_file.h"
#include "fourbit/model/step_graph.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/metrics.h"
#include "fourbit/train/optimizer.h"
#include "fourbit/train/run_dir.h"
#include "fourbit/train/stop_signal.h"

namespace fourbit {
namespace fs = std::filesystem;

TrainingSource::~TrainingSource() = default;

void StepContext::write(const std::string& file, nlohmann::json line) const {
  if (!outputs) fail("{}: side outputs are written only from inside a training step", file);
  const auto it = outputs->find(file);
  if (it == outputs->end())
    fail("{}: not one of the training source's side_outputs(); declare it there so resume can truncate it", file);
  line["step"] = step + 1;
  it->second->write(line);
}

nlohmann::json TrainSummary::to_json() const {
  nlohmann::json j = {{"run_dir", run_dir}, {"recipe", recipe},      {"steps", steps},
                      {"wall_s", wall_s},   {"params", params},      {"saved_activation_bytes", saved_bytes}};
  if (final_train_loss) j["final_train_loss"] = *final_train_loss;
  if (final_eval_loss) j["final_eval_loss"] = *final_eval_loss;
  if (!final_eval.empty()) j["final_eval"] = final_eval;
  if (tokens_per_s) j["tokens_per_s"] = *tokens_per_s;
  if (cuda_graph_replays) j["cuda_graph_replays"] = *cuda_graph_replays;
  for (const auto& [k, v] : extra.items()) j[k] = v;
  return j;
}

std::string recipe_coverage(const Recipe& recipe, const ModelConfig& model) {
  auto upper = [](std::string_view s) {
    std::string out(s);
    for (char& c : out) c = char(std::toupper(static_cast<unsigned char>(c)));
    return out;
  };
  const Format main = recipe.expert.fprop.b.fmt;  // the recipe's expert weights outside its tail
  int64_t moe = 0, in_main = 0;
  std::map<std::string, int64_t> other;
  for (int64_t l = 0; l < model.n_layers; ++l) {
    if (!model.is_moe_layer(l)) continue;
    ++moe;
    const Format f = recipe.layer(LayerClass::Expert, l, model.n_layers).fprop.b.fmt;
    if (f == main) ++in_main;
    else ++other[upper(format_name(f))];
  }
  std::string out = fmt::format("{}: {} of {} MoE layers in {}", recipe.name, in_main, moe, upper(format_name(main)));
  std::string rest;
  for (const auto& [name, n] : other) rest += fmt::format("{}{} in {}", rest.empty() ? "" : ", ", n, name);
  if (!rest.empty()) out += fmt::format(" ({}, the recipe's tail)", rest);
  if (moe == 0) out += " (the model has no MoE layer)";
  return out;
}

namespace {

[[noreturn]] void nonfinite(int64_t step, const std::string& what, double value) {
  fail("step {}: {} is {} (non-finite). Training stopped; no checkpoint was written for this "
       "step and earlier checkpoints are untouched. Lower train.lr or check the data.",
       step, what, value);
}

std::string resume_hint(const LoopOptions& opt) { return fmt::format("fourbit {} --resume {}", opt.command, opt.out_dir); }

std::string value_text(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// Every key where two source records differ, as "key: the run has A, this command gives B".
void check_source_record(const std::string& run, const nlohmann::json& recorded, const nlohmann::json& given) {
  if (recorded.is_null() || recorded == given) return;
  std::string diffs;
  auto note = [&](const std::string& key, const nlohmann::json* a, const nlohmann::json* b) {
    diffs += fmt::format("{}{}: the run has {}, this command gives {}", diffs.empty() ? "" : "; ", key,
                         a ? value_text(*a) : "nothing", b ? value_text(*b) : "nothing");
  };
  if (!recorded.is_object() || !given.is_object()) {
    note("source", &recorded, &given);
  } else {
    for (const auto& [k, v] : recorded.items())
      if (!given.contains(k) || given[k] != v) note("source." + k, &v, given.contains(k) ? &given[k] : nullptr);
    for (const auto& [k, v] : given.items())
      if (!recorded.contains(k)) note("source." + k, nullptr, &v);
  }
  fail("{}: cannot resume with a different source of batches: {}", run, diffs);
}

// Moves a micro-batch's tensors to the model's device and checks their shapes.
MicroBatch on_device(MicroBatch mb, Device dev, int64_t step, int64_t micro) {
  const std::string where = fmt::format("training source, step {} micro-batch {}", step + 1, micro);
  if (!mb.tokens.defined() || mb.tokens.dim() != 2 || mb.tokens.dtype() != DType::I32)
    fail("{}: tokens must be i32 [B, T], got {}", where, mb.tokens.defined() ? mb.tokens.str() : "nothing");
  if (!mb.targets.defined() || mb.targets.shape() != mb.tokens.shape() || mb.targets.dtype() != DType::I32)
    fail("{}: targets must be i32 {} like the tokens, got {}", where, shape_str(mb.tokens.shape()),
         mb.targets.defined() ? mb.targets.str() : "nothing");
  if (mb.weights.defined() && (mb.weights.shape() != mb.tokens.shape() || mb.weights.dtype() != DType::F32))
    fail("{}: weights must be f32 {} like the tokens, got {}", where, shape_str(mb.tokens.shape()), mb.weights.str());
  if (mb.loss_weight && !std::isfinite(*mb.loss_weight))
    fail("{}: loss_weight must be finite, got {}", where, *mb.loss_weight);
  if (mb.tokens.device() != dev) mb.tokens = mb.tokens.to(dev);
  if (mb.targets.device() != dev) mb.targets = mb.targets.to(dev);
  if (mb.weights.defined() && mb.weights.device() != dev) mb.weights = mb.weights.to(dev);
  return mb;
}

// Fails on a non-finite number among the evaluation's fields.
void check_eval(int64_t step, const nlohmann::json& before, const nlohmann::json& after) {
  for (const auto& [k, v] : after.items())
    if (!before.contains(k) && v.is_number_float() && !std::isfinite(v.get<double>()))
      nonfinite(step, "the evaluation's " + k, v.get<double>());
}

}  // namespace

TrainSummary run_training(const LoopOptions& opt, TrainingSource& source) {
  if (opt.out_dir.empty()) fail("{}: an output directory is required (--out DIR)", opt.command);
  if (opt.resume && opt.force) fail("--force replaces a run and --resume continues one; give only one of them");
  if (opt.resume && !opt.init_from.empty()) fail("--init starts a new run from another run's weights; it cannot be combined with --resume");
  if (!opt.resume && !opt.from_checkpoint.empty()) fail("--from-checkpoint picks the checkpoint a --resume continues from; give --resume too");
  const auto t0 = std::chrono::steady_clock::now();
  TrainSummary sum;
  sum.run_dir = opt.out_dir;
  sum.recipe = opt.recipe;
  auto warn = [&](const std::string& line) {
    sum.warnings.push_back(line);
    if (!opt.quiet) std::fprintf(stderr, "fourbit: %s\n", line.c_str());
  };

  RunConfig cfg = opt.config;
  RunRecord record;
  std::unique_ptr<RunLock> lock;
  nlohmann::json changed = nlohmann::json::object();
  if (opt.resume) {
    record = read_run_record(opt.out_dir);
    // The run's own record decides; the command line may change only the allowed fields.
    if (opt.recipe != record.recipe)
      fail("{}: cannot resume with recipe '{}': the run was trained with '{}'", opt.out_dir, opt.recipe, record.recipe);
    if (opt.command != record.command)
      fail("{}: is a `fourbit {}` run; continue it with `fourbit {} --resume {}`", opt.out_dir, record.command,
           record.command, opt.out_dir);
    if (opt.seed) {  // --seed on a resume must be the run's own; any other value is a change
      cfg.train.seed = *opt.seed;
      cfg.origin["train.seed"] = "--seed";
    }
    std::string mismatches;
    for (const ConfigChange& c : config_changes(record.config, cfg)) {
      if (std::find(kResumeChangeable.begin(), kResumeChangeable.end(), c.field) != kResumeChangeable.end()) {
        changed[c.field] = {c.old_value, c.new_value};
        continue;
      }
      mismatches += fmt::format("{}{}: the run has {}, {} gives {}", mismatches.empty() ? "" : "; ", c.field,
                                value_text(c.old_value), c.origin, value_text(c.new_value));
    }
    if (!mismatches.empty())
      fail("{}: cannot resume with a different config ({}); a resume may change only --steps, --device and {}",
           opt.out_dir, mismatches, [] {
             std::string s;
             for (const auto& f : kResumeChangeable) s += (s.empty() ? "" : ", ") + f;
             return s;
           }());
    check_source_record(opt.out_dir, record.source, source.record());
    if (record.device != device_name(opt.device)) changed["device"] = {record.device, device_name(opt.device)};
    lock = std::make_unique<RunLock>(opt.out_dir);
  } else {
    if (opt.seed) {
      cfg.train.seed = *opt.seed;
      cfg.origin["train.seed"] = "--seed";
    }
    if (opt.steps) {
      cfg.train.steps = *opt.steps;
      cfg.origin["train.steps"] = "--steps";
    }
    // Refuse an occupied directory before any work, leaving it as it was.
    check_new_run_dir(opt.out_dir, opt.force, resume_hint(opt));
  }
  validate_config(cfg);
  const Recipe& recipe = recipe_by_name(opt.recipe);

  Model model(cfg.model, recipe, opt.device);
  model.set_keep_ffn_activations(cfg.train.keep_ffn_activations);
  model.set_saved_x_decodes(cfg.train.saved_x_decodes);
  StepGraphs graphs(model, cfg.train.cuda_graphs);
  Optimizer optim(model.params(), cfg.train);
  optim.write_bf16_copies(model.bf16_weight_copies());  // the update writes the next forward's BF16 weights
  optim.write_slice_amax(model.slice_amax_ahead());      // and its NVFP4 weights' outer-scale amax
  LrSchedule schedule(cfg.train);
  int64_t start_step = 0;
  std::string resumed_from;
  nlohmann::json init_record;
  if (opt.resume) {
    CheckpointState st;
    resumed_from = load_first_valid_checkpoint(
        opt.out_dir, opt.from_checkpoint,
        [&](const std::string& dir) {
          st = read_checkpoint_state(dir);
          if (config_to_json(st.config)["model"] != config_to_json(cfg)["model"])
            throw CheckpointMismatch(fmt::format("{}: its [model] differs from the run record {}", dir, record.path));
          load_checkpoint(dir, model.params(), &optim.m(), &optim.v());
          // the export's calibration-free input_scale keeps its running max across a resume
          if (st.extra.contains("input_amax")) model.load_input_amax(st.extra["input_amax"]);
        },
        &sum.warnings);
    if (!opt.quiet)
      for (const std::string& w : sum.warnings) std::fprintf(stderr, "fourbit: %s\n", w.c_str());
    start_step = st.step;
    // The schedule's first length is the run's; the checkpoint holds the changes made since.
    TrainConfig first = cfg.train;
    first.steps = record.config.train.steps;
    schedule = LrSchedule::from_json(first, st.schedule, resumed_from + "/state.json");
    const int64_t total = opt.steps.value_or(schedule.total_steps());
    if (start_step >= total)
      fail("{}: the run is already at step {} of {}; give a larger --steps to continue it", resumed_from, start_step,
           schedule.total_steps());
    if (total != schedule.total_steps()) changed["train.steps"] = {schedule.total_steps(), total};
    schedule = schedule.with_length(start_step, total);
    source.restore(st.source);
  } else if (!opt.init_from.empty()) {
    CheckpointState st;
    std::vector<std::string> skipped;
    const std::string dir = load_first_valid_checkpoint(
        opt.init_from, "",
        [&](const std::string& d) {
          st = read_checkpoint_state(d);
          for (const ConfigChange& c : config_changes(st.config, cfg))
            if (c.field.rfind("model.", 0) == 0)
              throw CheckpointMismatch(fmt::format("--init {}: {} is {} in that run, but {} gives {}", opt.init_from,
                                                   c.field, value_text(c.old_value), c.origin,
                                                   value_text(c.new_value)));
          load_checkpoint(d, model.params(), nullptr, nullptr);
        },
        &skipped);
    for (const std::string& w : skipped) warn(w);
    init_record = {{"from", opt.init_from}, {"checkpoint", dir}, {"step", st.step}, {"recipe", st.recipe}};
  } else {
    init_params(model.params(), cfg.model, cfg.train.seed);
  }
  cfg.train.steps = schedule.total_steps();
  const TrainConfig& t = cfg.train;
  const uint64_t seed = t.seed;
  source.start(model, cfg);
  for (const std::string& f : source.side_outputs())
    if (f.empty() || f.find('/') != std::string::npos || f.rfind(".", 0) == 0 || f == "metrics.jsonl" ||
        f == "config.json" || f == "summary.json")
      fail("training source: side output '{}' must be a plain file name other than the run's own files", f);

  // The directory is claimed only now, when everything that can be checked has been.
  if (opt.resume) {
    const std::string aside = set_aside_checkpoints_after(opt.out_dir, start_step);
    if (!aside.empty())
      warn(fmt::format("the checkpoints after {} belong to the run's previous course; moved to {}",
                       fs::path(resumed_from).filename().string(), aside));
    nlohmann::json rec = record.json;
    if (!rec.contains("resumes")) rec["resumes"] = nlohmann::json::array();
    rec["resumes"].push_back({{"step", start_step},
                              {"checkpoint", fs::path(resumed_from).filename().string()},
                              {"time", utc_time()},
                              {"device", device_name(opt.device)},
                              {"changed", changed},
                              {"command_line", opt.command_line}});
    write_run_record(opt.out_dir, rec);
  } else {
    const std::string moved = claim_new_run_dir(opt.out_dir, opt.force);
    lock = std::make_unique<RunLock>(opt.out_dir);
    if (!moved.empty()) warn(fmt::format("{} held another run; it was moved to {}", opt.out_dir, moved));
    nlohmann::json rec = {{"format", "fourbit-run-1"},
                          {"command", opt.command},
                          {"config", config_to_json(cfg)},
                          {"recipe", opt.recipe},
                          {"config_path", cfg.path},
                          {"overrides", opt.overrides},
                          {"device", device_name(opt.device)},
                          {"created", utc_time()},
                          {"command_line", opt.command_line},
                          {"source", source.record()},
                          {"resumes", nlohmann::json::array()}};
    if (!init_record.is_null()) rec["init"] = init_record;
    write_run_record(opt.out_dir, rec);
  }
  lock->record_holder();
  if (const int n = remove_stale_temporaries(opt.out_dir); n > 0)
    warn(fmt::format("removed {} temporary file(s) left in {} by a process that was killed", n, opt.out_dir));

  sum.params = model.params().numel();
  sum.steps = t.steps;
  sum.steps_done = start_step;
  JsonlLog metrics((fs::path(opt.out_dir) / "metrics.jsonl").string(), start_step);
  std::map<std::string, std::unique_ptr<JsonlLog>> side;
  std::map<std::string, JsonlLog*> side_ptrs;
  for (const std::string& f : source.side_outputs()) {
    side[f] = std::make_unique<JsonlLog>((fs::path(opt.out_dir) / f).string(), start_step);
    side_ptrs[f] = side[f].get();
  }
  Progress progress(start_step, t.steps, t.log_every);
  if (!opt.quiet) {
    progress.message(fmt::format("fourbit {}: {} params, recipe {}, {} steps x {} x {} x {} tokens, {}, device {}{}",
                                 opt.command, sum.params, opt.recipe, t.steps, t.grad_accum, t.batch_size, t.seq_len,
                                 source.describe(), device_name(opt.device),
                                 opt.resume ? fmt::format(", resuming at step {}", start_step) : ""));
    progress.message("  " + recipe_coverage(recipe, cfg.model));
  }

  StopSignals stop;
  StepContext ctx;
  ctx.total_steps = t.steps;
  ctx.seed = seed;
  ctx.config = &cfg;
  ctx.device = opt.device;
  ctx.outputs = &side_ptrs;
  auto save = [&](int64_t steps_done, const nlohmann::json& extra) {
    CheckpointState cs{cfg, opt.recipe, steps_done, seed, steps_done * t.grad_accum * t.batch_size * t.seq_len,
                       schedule.to_json(), source.state(), extra};
    sum.checkpoint = save_checkpoint(opt.out_dir, model.params(), optim.m(), optim.v(), cs, t.keep_last);
  };
  const auto loop_t0 = std::chrono::steady_clock::now();
  int64_t tokens_done = 0;
  std::optional<double> last_loss;
  nlohmann::json last_eval = nlohmann::json::object();
  ops::nonfinite_seen(true);
  for (int64_t step = start_step; step < t.steps; ++step) {
    ctx.step = step;
    ctx.lr = schedule.lr(step);
    source.before_step(ctx, model);
    model.params().zero_grad();
    const auto fwd_bwd_t0 = std::chrono::steady_clock::now();
    const int64_t micro_batches = source.micro_batches(ctx);
    if (micro_batches < 1) fail("training source: step {} has {} micro-batches; expected at least 1", step + 1, micro_batches);
    double loss = 0, aux = 0;
    for (int64_t micro = 0; micro < micro_batches; ++micro) {
      const MicroBatch b = on_device(source.micro_batch(ctx, micro), opt.device, step, micro);
      // The default share keeps the expressions of the loop before sources existed, bit for bit.
      const float share = b.loss_weight.value_or(1.0f / float(micro_batches));
      // The backward is queued before the host reads the loss back (forward_queued), so the GPU
      // goes on from the forward into it; a non-finite loss still stops the run before the update.
      // On the GPU both may be the replay of a CUDA graph (train.cuda_graphs, StepGraphs).
      PendingForwardStats pending =
          graphs.run(b.tokens, b.targets, b.weights, share, SrStreams{seed, uint64_t(step), uint64_t(micro)}, micro == 0);
      if (const std::string f = graphs.take_failure(); !f.empty()) warn(f);
      const ForwardStats& st = pending.stats();
      if (!std::isfinite(st.loss)) nonfinite(step + 1, "the training loss", st.loss);
      source.micro_batch_done(ctx, micro, st);
      loss += b.loss_weight ? st.loss * double(share) : st.loss / double(micro_batches);
      aux += b.loss_weight ? st.aux_loss * double(share) : st.aux_loss / double(micro_batches);
      tokens_done += st.tokens;
      if (micro == 0) test_signal_point("step", step + 1);  // FOURBIT_TEST_RAISE: a signal mid-step
    }
    const auto optimizer_t0 = std::chrono::steady_clock::now();
    ctx.fwd_bwd_s = std::chrono::duration<double>(optimizer_t0 - fwd_bwd_t0).count();
    const bool update = source.update_weights(ctx);
    // The update checks the quantizers' NaN/Inf flag and the norm itself (on the GPU, without the
    // host waiting for the backward first) and skips itself on either: the checks below stop a
    // run whose parameters are still those of the step before.
    const double gnorm = update ? optim.step(step, ctx.lr) : optim.grad_norm();
    if (update ? optim.quantizer_nonfinite() : ops::nonfinite_seen(true))
      fail("step {}: NaN/Inf reached a quantizer (non-finite activations or gradients). Training "
           "stopped; no checkpoint was written for this step.", step + 1);
    if (!std::isfinite(gnorm)) nonfinite(step + 1, "the gradient norm", gnorm);
    if (update) model.invalidate_weight_cache(optim.wrote_bf16_copies(), optim.wrote_slice_amax());
    ctx.optimizer_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - optimizer_t0).count();
    last_loss = loss;
    nlohmann::json line = {{"step", step + 1}, {"loss", loss}, {"aux_loss", aux}, {"lr", ctx.lr}, {"grad_norm", gnorm}};
    source.after_step(ctx, model, line);
    const bool last = step + 1 == t.steps;
    if (t.eval_every && ((step + 1) % t.eval_every == 0 || last)) {
      const nlohmann::json before = line;
      source.evaluate(ctx, model, line);
      check_eval(step + 1, before, line);
      nlohmann::json fresh = nlohmann::json::object();
      for (const auto& [k, v] : line.items())
        if (!before.contains(k)) fresh[k] = v;
      if (!fresh.empty()) {
        last_eval = fresh;
        if (!opt.quiet) {
          std::string text;
          for (const auto& [k, v] : fresh.items()) {
            std::string label = k;  // "eval_loss" -> "eval loss"
            std::replace(label.begin(), label.end(), '_', ' ');
            text += v.is_number_float() ? fmt::format("  {} {:.4f}", label, v.get<double>())
                                        : fmt::format("  {} {}", label, v.dump());
          }
          progress.message(fmt::format("  step {:5d}  train {:.4f}{}", step + 1, loss, text));
        }
      }
    }
    metrics.write(line);
    sum.steps_done = step + 1;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_t0).count();
    if (!opt.quiet) progress.step(step + 1, loss, secs > 0 ? double(tokens_done) / secs : 0.0);
    int signal = stop.requested();
    if ((t.checkpoint_every && (step + 1) % t.checkpoint_every == 0) || last || signal) {
      nlohmann::json extra = {{"loss", loss}, {"input_amax", model.input_amax_json()}};
      if (last_eval.contains("eval_loss")) extra["eval_loss"] = last_eval["eval_loss"];
      save(step + 1, extra);
      signal = stop.requested();  // one that came during the write: this checkpoint is the one
    }
    if (signal && !last) {
      sum.stopped_by = signal;
      break;
    }
  }
  if (!opt.quiet) progress.finish();
  const double loop_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_t0).count();
  if (sum.stopped_by) {
    sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sum.final_train_loss = last_loss;
    return sum;
  }
  if (t.steps == 0 && start_step == 0) save(0, nlohmann::json::object());  // a 0-step run keeps its initial weights
  sum.final_train_loss = last_loss;
  if (last_eval.empty()) {  // no evaluation at the last step (eval_every 0): one for the summary
    ctx.step = std::max<int64_t>(0, t.steps - 1);
    nlohmann::json fields = nlohmann::json::object();
    source.evaluate(ctx, model, fields);
    check_eval(t.steps, nlohmann::json::object(), fields);
    last_eval = fields;
  }
  sum.final_eval = last_eval;
  if (last_eval.contains("eval_loss")) sum.final_eval_loss = last_eval["eval_loss"].get<double>();
  if (tokens_done > 0 && loop_s > 0) sum.tokens_per_s = double(tokens_done) / loop_s;
  sum.saved_bytes = model.saved_bytes().by_category;
  if (opt.device != Device::CPU) sum.cuda_graph_replays = graphs.replays();
  source.summarize(sum.extra);
  sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  io::write_file_atomic((fs::path(opt.out_dir) / "summary.json").string(), sum.to_json().dump(2) + "\n");
  return sum;
}

}  // namespace fourbit
