// defines: pretrain, evaluate, TrainSummary::to_json
#include "fourbit/train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <vector>

#include <fmt/format.h>

#include "fourbit/io/atomic_file.h"
#include "fourbit/ops/ops.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/data.h"
#include "fourbit/train/metrics.h"
#include "fourbit/train/optimizer.h"

namespace fourbit {
namespace fs = std::filesystem;

namespace {

struct Batch {
  Tensor tokens, targets;
};

Batch load_batch(const data::TokenSource& src, int64_t index, int64_t B, int64_t T, Device dev) {
  std::vector<int32_t> tok(size_t(B * T)), tgt(size_t(B * T));
  src.batch(index, B, T, tok.data(), tgt.data());
  return {Tensor::from_host(tok.data(), {B, T}, DType::I32, dev),
          Tensor::from_host(tgt.data(), {B, T}, DType::I32, dev)};
}

[[noreturn]] void nonfinite(int64_t step, const std::string& what, double value) {
  fail("step {}: {} is {} (non-finite). Training stopped; no checkpoint was written for this "
       "step and earlier checkpoints are untouched. Lower train.lr or check the data.",
       step, what, value);
}

constexpr uint64_t kEvalSeedMix = 0xE7A1u;

}  // namespace

double evaluate(Model& m, const RunConfig& cfg, int64_t batches, uint64_t seed) {
  const auto src = data::make_token_source(cfg.data, data::Split::Eval, seed, cfg.model.vocab_size);
  double loss_sum = 0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const Batch b = load_batch(*src, i, cfg.train.batch_size, cfg.train.seq_len, m.device());
    const ForwardStats st = m.forward(b.tokens, b.targets, SrStreams{seed ^ kEvalSeedMix, 0, 0}, false);
    loss_sum += st.loss * double(st.tokens);
    tokens += st.tokens;
  }
  return tokens ? loss_sum / double(tokens) : 0.0;
}

nlohmann::json TrainSummary::to_json() const {
  return {{"run_dir", run_dir},
          {"recipe", recipe},
          {"steps", steps},
          {"final_train_loss", final_train_loss},
          {"final_eval_loss", final_eval_loss},
          {"unigram_entropy_nats", unigram_entropy},
          {"tokens_per_s", tokens_per_s},
          {"wall_s", wall_s},
          {"params", params},
          {"saved_activation_bytes", saved_bytes}};
}

TrainSummary pretrain(const PretrainOptions& opt) {
  RunConfig cfg = opt.config;
  if (opt.steps) cfg.train.steps = *opt.steps;
  if (opt.seed) cfg.train.seed = *opt.seed;
  validate_config(cfg);
  const TrainConfig& t = cfg.train;
  const Recipe& recipe = recipe_by_name(opt.recipe);
  if (opt.out_dir.empty()) fail("pretrain: an output directory is required (--out DIR)");

  Model model(cfg.model, recipe, opt.device);
  Optimizer optim(model.params(), t);
  int64_t start_step = 0;
  if (opt.resume) {
    const std::string dir = latest_checkpoint(opt.out_dir);
    const CheckpointState st = read_checkpoint_state(dir);
    if (st.recipe != opt.recipe)
      fail("{}: checkpoint was trained with recipe '{}', not '{}'", dir, st.recipe, opt.recipe);
    if (config_to_json(st.config)["model"] != config_to_json(cfg)["model"])
      fail("{}: the checkpoint's [model] config differs from the one given", dir);
    if (st.step >= cfg.train.steps)
      fail("{}: the run is already at step {}; give a larger --steps to continue it", dir, st.step);
    load_checkpoint(dir, model.params(), &optim.m(), &optim.v());
    if (st.extra.contains("input_amax")) model.load_input_amax(st.extra["input_amax"]);  // export's input_scale
    start_step = st.step;
    cfg.train.seed = st.seed;
  } else {
    init_params(model.params(), cfg.model, t.seed);
  }
  const uint64_t seed = cfg.train.seed;
  std::error_code ec;
  fs::create_directories(opt.out_dir, ec);
  if (ec) fail("{}: cannot create run directory: {}", opt.out_dir, ec.message());
  {
    nlohmann::json run = {{"config", config_to_json(cfg)}, {"recipe", opt.recipe},
                          {"config_path", cfg.path}, {"device", device_name(opt.device)}};
    io::write_file_atomic((fs::path(opt.out_dir) / "config.json").string(), run.dump(2) + "\n");
  }

  const auto train_src = data::make_token_source(cfg.data, data::Split::Train, seed, cfg.model.vocab_size);
  TrainSummary sum;
  sum.run_dir = opt.out_dir;
  sum.recipe = opt.recipe;
  sum.params = model.params().numel();
  sum.unigram_entropy = data::unigram_entropy_nats(*train_src, 8, t.batch_size, t.seq_len);

  MetricsLog metrics(opt.out_dir, start_step);
  Progress progress(start_step, t.steps, t.log_every);
  if (!opt.quiet)
    progress.message(fmt::format("fourbit pretrain: {} params, recipe {}, {} steps x {} x {} x {} tokens, "
                                 "data {}, device {}",
                                 sum.params, opt.recipe, t.steps, t.grad_accum, t.batch_size, t.seq_len,
                                 train_src->describe(), device_name(opt.device)));

  const auto t0 = std::chrono::steady_clock::now();
  int64_t tokens_done = 0;
  double last_loss = 0, last_eval = std::nan("");
  ops::nonfinite_seen(true);
  for (int64_t step = start_step; step < t.steps; ++step) {
    model.params().zero_grad();
    double loss = 0, aux = 0;
    for (int64_t micro = 0; micro < t.grad_accum; ++micro) {
      const Batch b = load_batch(*train_src, step * t.grad_accum + micro, t.batch_size, t.seq_len, opt.device);
      const ForwardStats st = model.forward(b.tokens, b.targets, SrStreams{seed, uint64_t(step), uint64_t(micro)},
                                            true, 1.0f / float(t.grad_accum));
      if (!std::isfinite(st.loss)) nonfinite(step + 1, "the training loss", st.loss);
      model.backward();
      loss += st.loss / double(t.grad_accum);
      aux += st.aux_loss / double(t.grad_accum);
      tokens_done += st.tokens;
    }
    if (ops::nonfinite_seen(true))
      fail("step {}: NaN/Inf reached a quantizer (non-finite activations or gradients). Training "
           "stopped; no checkpoint was written for this step.", step + 1);
    const double lr = lr_at(t, step);
    const double gnorm = optim.step(step);
    if (!std::isfinite(gnorm)) nonfinite(step + 1, "the gradient norm", gnorm);
    model.invalidate_weight_cache();
    last_loss = loss;
    nlohmann::json line = {{"step", step + 1}, {"loss", loss}, {"aux_loss", aux}, {"lr", lr},
                           {"grad_norm", gnorm}};
    const bool last = step + 1 == t.steps;
    if (t.eval_every && ((step + 1) % t.eval_every == 0 || last)) {
      last_eval = evaluate(model, cfg, t.eval_batches, seed);
      if (!std::isfinite(last_eval)) nonfinite(step + 1, "the eval loss", last_eval);
      line["eval_loss"] = last_eval;
      if (!opt.quiet) progress.message(fmt::format("  step {:5d}  train {:.4f}  eval {:.4f}", step + 1, loss, last_eval));
    }
    metrics.write(line);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!opt.quiet) progress.step(step + 1, loss, secs > 0 ? double(tokens_done) / secs : 0.0);
    if ((t.checkpoint_every && (step + 1) % t.checkpoint_every == 0) || last) {
      CheckpointState cs{cfg, opt.recipe, step + 1, seed, (step + 1) * t.grad_accum * t.batch_size * t.seq_len,
                         {{"loss", loss}, {"eval_loss", std::isfinite(last_eval) ? nlohmann::json(last_eval) : nlohmann::json()},
                          {"input_amax", model.input_amax_json()}}};
      save_checkpoint(opt.out_dir, model.params(), optim.m(), optim.v(), cs);
    }
  }
  if (!opt.quiet) progress.finish();
  sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  sum.steps = t.steps;
  sum.final_train_loss = last_loss;
  if (std::isnan(last_eval)) last_eval = evaluate(model, cfg, std::max<int64_t>(1, t.eval_batches), seed);
  sum.final_eval_loss = last_eval;
  sum.tokens_per_s = sum.wall_s > 0 ? double(tokens_done) / sum.wall_s : 0.0;
  sum.saved_bytes = model.saved_bytes().by_category;
  io::write_file_atomic((fs::path(opt.out_dir) / "summary.json").string(), sum.to_json().dump(2) + "\n");
  return sum;
}

}  // namespace fourbit
