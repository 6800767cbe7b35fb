// defines: lr_at, LrSchedule, Optimizer (optimizer.h)
#include "fourbit/train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "fourbit/ops/adamw_math.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

namespace {
constexpr double kPi = 3.14159265358979323846;

double lr_of_phase(const TrainConfig& t, double phase) {
  const double cosine = 0.5 * (1.0 + std::cos(kPi * std::min(1.0, phase)));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}
}  // namespace

double lr_at(const TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  const int64_t decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  const double progress = double(step - t.warmup_steps) / double(decay_steps - 1);
  return lr_of_phase(t, progress);
}

LrSchedule::LrSchedule(const TrainConfig& t) : LrSchedule(t, t.steps, {}) {}

LrSchedule::LrSchedule(const TrainConfig& t, int64_t first_steps, std::vector<Change> changes)
    : t_(t), first_steps_(first_steps), changes_(std::move(changes)) {
  t_.steps = first_steps;
  const int64_t w = t.warmup_steps;
  pieces_.push_back({w, 0.0, first_steps});
  int64_t last_at = 0;
  for (const Change& c : changes_) {
    if (c.at_step < last_at || c.steps <= c.at_step)
      fail("LR schedule: change to {} steps at step {} must come after the previous change (step {}) and "
           "leave steps to run", c.steps, c.at_step, last_at);
    last_at = c.at_step;
    const int64_t from = std::max(c.at_step, w);
    pieces_.push_back({from, phase(from), c.steps});
  }
}

double LrSchedule::phase(int64_t step) const {
  const Piece* p = &pieces_.front();
  for (const Piece& q : pieces_)
    if (q.from <= step) p = &q;
  const int64_t span = p->to - 1 - p->from;
  if (span <= 0) return p->p0;
  const double x = std::min(1.0, double(step - p->from) / double(span));
  // The first piece is lr_at's own expression (p0 = 0), so a run without changes gets its bits.
  return p == &pieces_.front() ? x : p->p0 + (1.0 - p->p0) * x;
}

double LrSchedule::lr(int64_t step) const {
  if (changes_.empty()) return lr_at(t_, step);
  if (step < t_.warmup_steps) return t_.lr * double(step + 1) / double(t_.warmup_steps);
  return lr_of_phase(t_, phase(step));
}

LrSchedule LrSchedule::with_length(int64_t at_step, int64_t steps) const {
  if (steps == total_steps()) return *this;
  if (steps <= at_step)
    fail("the run is at step {}; a new length of {} steps leaves nothing to train (give --steps > {})", at_step,
         steps, at_step);
  std::vector<Change> c = changes_;
  c.push_back({at_step, steps});
  return LrSchedule(t_, first_steps_, std::move(c));
}

nlohmann::json LrSchedule::to_json() const {
  nlohmann::json changes = nlohmann::json::array();
  for (const Change& c : changes_) changes.push_back({{"at_step", c.at_step}, {"steps", c.steps}});
  return {{"steps", first_steps_}, {"changes", changes}};
}

LrSchedule LrSchedule::from_json(const TrainConfig& t, const nlohmann::json& j, const std::string& where) {
  if (j.is_null()) return LrSchedule(t);
  try {
    std::vector<Change> changes;
    for (const auto& c : j.at("changes")) changes.push_back({c.at("at_step").get<int64_t>(), c.at("steps").get<int64_t>()});
    return LrSchedule(t, j.at("steps").get<int64_t>(), std::move(changes));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed LR schedule: {}", where, e.what());
  }
}

Optimizer::Optimizer(ParamStore& params, const TrainConfig& t) : params_(params), t_(t) {
  m_ = Tensor::zeros({params.numel()}, params.flat().dtype(), params.flat().device());
  v_ = Tensor::zeros({params.numel()}, params.flat().dtype(), params.flat().device());
}

double Optimizer::step(int64_t step_index) { return step(step_index, lr_at(t_, step_index)); }

std::vector<Tensor> Optimizer::grad_views() const {
  std::vector<Tensor> grads;
  for (const ParamInfo& p : params_.infos()) grads.push_back(params_.view(params_.flat_grad(), p));
  return grads;
}

double Optimizer::grad_norm() const {
  // Per parameter (fixed order and grouping, so every backend and thread count gives the same
  // norm), read back in one synchronisation on the GPU; the norm from those sums is the gate's
  // (ops::fill_gate), so step() returns this number bit for bit.
  const std::vector<double> totals = ops::sum_squares_each(grad_views());
  double gate[ops::kGateSize];
  ops::fill_gate(totals.data(), int64_t(totals.size()), 0.0, false, gate);
  return gate[ops::kGateNorm];
}

void Optimizer::write_bf16_copies(const Bf16Copies& copies) {
  if (copies.defined()) {
    const std::vector<ParamInfo>& infos = params_.infos();
    if (copies.buffer.dtype() != DType::BF16 || copies.buffer.device() != params_.flat().device() ||
        copies.at.size() != infos.size())
      fail("Optimizer::write_bf16_copies: want a bf16 buffer on {} and a place for each of the {} parameters, "
           "got {} and {}", device_name(params_.flat().device()), infos.size(), copies.buffer.str(), copies.at.size());
    for (size_t i = 0; i < infos.size(); ++i)
      if (copies.at[i] >= 0 && copies.at[i] + infos[i].numel() > copies.buffer.numel())
        fail("Optimizer::write_bf16_copies: the copy of {} runs past the {}-element buffer", infos[i].name,
             copies.buffer.numel());
  }
  bf16_ = copies;
}

void Optimizer::write_slice_amax(const SliceAmaxAhead& ahead) {
  if (ahead.defined()) {
    const std::vector<ParamInfo>& infos = params_.infos();
    if (ahead.buffer.dtype() != DType::F32 || ahead.buffer.device() != params_.flat().device() ||
        ahead.at.size() != infos.size() || ahead.slice.size() != infos.size())
      fail("Optimizer::write_slice_amax: want an f32 buffer on {} and an entry for each of the {} parameters, got {} "
           "and {}", device_name(params_.flat().device()), infos.size(), ahead.buffer.str(), ahead.at.size());
    for (size_t i = 0; i < infos.size(); ++i) {
      if (ahead.at[i] < 0) continue;
      const int64_t sl = ahead.slice[i];
      if (sl < 1 || infos[i].numel() % sl != 0 || ahead.at[i] + infos[i].numel() / sl > ahead.buffer.numel())
        fail("Optimizer::write_slice_amax: {} ({} elements) in slices of {} from entry {} does not fit the "
             "{}-entry buffer", infos[i].name, infos[i].numel(), sl, ahead.at[i], ahead.buffer.numel());
    }
  }
  amax_ = ahead;
}

double Optimizer::step(int64_t step_index, double lr) {
  wrote_bf16_ = false;
  wrote_amax_ = false;
  quant_nonfinite_ = false;
  params_.settle_grads();  // a step without a backward since zero_grad: zero gradients
  // The gate (norm, clip factor, skip) is computed on the gradients' device and the update reads
  // it there: the host queues the update without waiting, and reads the gate back while the
  // update runs. A non-finite norm or a quantizer's NaN/Inf makes the update skip itself, so the
  // parameters and moments are untouched when the trainer stops.
  const Device dev = params_.flat().device();
  Tensor gate = Tensor::empty({ops::kGateSize}, DType::F64, dev);
  ops::grad_norm_gate(grad_views(), t_.grad_clip, gate);
  const std::shared_ptr<PendingRead> read =
      dev == Device::CPU ? nullptr : read_later(gate.raw(), sizeof(double) * ops::kGateSize);
  // The update is elementwise, so parameters next to each other in the flat buffer with the same
  // decay (and, with BF16 copies, all with copies next to each other there or all without) take
  // one call over their run: the bits of one call each, in a few launches instead of one a
  // parameter (a step of configs/gpu-small.toml: 50 instead of 154).
  // A parameter whose slices' amax the update raises takes a call of its own.
  const std::vector<ParamInfo>& infos = params_.infos();
  const auto copy_at = [&](size_t k) { return bf16_.defined() ? bf16_.at[k] : int64_t(-1); };
  const auto amax_at = [&](size_t k) { return amax_.defined() ? amax_.at[k] : int64_t(-1); };
  if (amax_.defined()) ops::fill_(amax_.buffer, 0.0);
  for (size_t i = 0; i < infos.size();) {
    size_t j = i + 1;
    while (j < infos.size() && amax_at(i) < 0 && amax_at(j) < 0 && infos[j].decay == infos[i].decay &&
           infos[j].offset == infos[j - 1].offset + infos[j - 1].numel() &&
           (copy_at(j) < 0) == (copy_at(i) < 0) &&
           (copy_at(j) < 0 || copy_at(j) == copy_at(j - 1) + infos[j - 1].numel()))
      ++j;
    const int64_t at = infos[i].offset, n = infos[j - 1].offset + infos[j - 1].numel() - at;
    Tensor w = params_.flat().view(at, {n}), g = params_.flat_grad().view(at, {n});
    Tensor m = m_.view(at, {n}), v = v_.view(at, {n});
    Tensor w16 = copy_at(i) >= 0 ? bf16_.buffer.view(copy_at(i), {n}) : Tensor();
    Tensor amax = amax_at(i) >= 0 ? amax_.buffer.view(amax_at(i), {n / amax_.slice[i]}) : Tensor();
    ops::adamw_step(w, g, m, v,
                    ops::AdamW{float(lr), float(t_.beta1), float(t_.beta2), float(t_.adam_eps),
                               infos[i].decay ? float(t_.weight_decay) : 0.0f, step_index + 1},
                    w16.defined() ? &w16 : nullptr, &gate,
                    amax.defined() ? ops::SliceAmax{&amax, amax_.slice[i]} : ops::SliceAmax{});
    i = j;
  }
  const double* gv = static_cast<const double*>(read ? read->wait() : gate.raw());
  quant_nonfinite_ = gv[ops::kGateQuantNonfinite] != 0.0;
  // where the update skipped itself, the copies are still those of the (unchanged) parameters
  wrote_bf16_ = bf16_.defined() && gv[ops::kGateSkip] == 0.0;
  wrote_amax_ = amax_.defined();  // the amax of the parameters as they are now, updated or not
  return gv[ops::kGateNorm];  // the trainer stops on a non-finite norm
}

}  // namespace fourbit
