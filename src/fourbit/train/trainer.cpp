// defines: PretrainSource, open_token_source, pretrain, evaluate (trainer.h)
#include "fourbit/train/trainer.h"

#include <vector>

#include <fmt/format.h>

#include "fourbit/tensor/error.h"

namespace fourbit {

namespace {

constexpr uint64_t kEvalSeedMix = 0xE7A1u;

MicroBatch load_batch(const data::TokenSource& src, int64_t index, int64_t B, int64_t T, Device dev) {
  std::vector<int32_t> tok(size_t(B * T)), tgt(size_t(B * T));
  src.batch(index, B, T, tok.data(), tgt.data());
  MicroBatch b;
  b.tokens = Tensor::from_host(tok.data(), {B, T}, DType::I32, dev);
  b.targets = Tensor::from_host(tgt.data(), {B, T}, DType::I32, dev);
  return b;
}

}  // namespace

std::unique_ptr<data::TokenSource> open_token_source(const RunConfig& cfg, data::Split split) {
  try {
    return data::make_token_source(cfg.data, split, cfg.train.seed, cfg.model.vocab_size);
  } catch (const Error& e) {
    // The file's own errors name the file; say which flag or config line named the file.
    fail("{}: data.source '{}': {}", cfg.where("data.source"), cfg.data.source, e.what());
  }
}

double evaluate(Model& m, const RunConfig& cfg, int64_t batches, uint64_t seed) {
  if (batches < 1) fail("evaluate: expected at least one eval batch, got {}", batches);
  RunConfig c = cfg;
  c.train.seed = seed;
  const auto src = open_token_source(c, data::Split::Eval);
  double loss_sum = 0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const MicroBatch b = load_batch(*src, i, cfg.train.batch_size, cfg.train.seq_len, m.device());
    const ForwardStats st = m.forward(b.tokens, b.targets, SrStreams{seed ^ kEvalSeedMix, 0, 0}, false);
    loss_sum += st.loss * double(st.tokens);
    tokens += st.tokens;
  }
  if (tokens == 0) fail("evaluate: the eval batches hold no targets");
  return loss_sum / double(tokens);
}

std::string PretrainSource::describe() const {
  return train_ ? "data " + train_->describe() : std::string("data (not opened yet)");
}

void PretrainSource::start(Model& model, const RunConfig& config) {
  (void)model;
  cfg_ = config;
  train_ = open_token_source(cfg_, data::Split::Train);
  unigram_entropy_ = data::unigram_entropy_nats(*train_, 8, cfg_.train.batch_size, cfg_.train.seq_len);
  if (cfg_.train.eval_batches > 0) open_token_source(cfg_, data::Split::Eval);  // its errors now, not at step 50
}

MicroBatch PretrainSource::micro_batch(const StepContext& ctx, int64_t micro) {
  const TrainConfig& t = cfg_.train;
  return load_batch(*train_, ctx.step * t.grad_accum + micro, t.batch_size, t.seq_len, ctx.device);
}

void PretrainSource::evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) {
  if (cfg_.train.eval_batches == 0) return;  // nothing measured: no eval_loss at all
  line["eval_loss"] = fourbit::evaluate(model, cfg_, cfg_.train.eval_batches, ctx.seed);
}

void PretrainSource::summarize(nlohmann::json& summary) { summary["unigram_entropy_nats"] = unigram_entropy_; }

TrainSummary pretrain(const PretrainOptions& opt) {
  PretrainSource source;
  return run_training(opt, source);
}

}  // namespace fourbit
