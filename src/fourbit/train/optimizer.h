// defines: lr_at, LrSchedule, Optimizer
// AdamW with FP32 master weights and moments, linear warmup then cosine decay, global-norm
// gradient clipping. The gradient norm is summed parameter by parameter in layout order, so it
// is the same number on every run.
#pragma once
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/params.h"

namespace fourbit {

// Learning rate for optimizer step `step` (0-based): linear warmup over warmup_steps to lr, then
// cosine decay to lr * min_lr_ratio at the last step.
double lr_at(const TrainConfig& t, int64_t step);

// lr_at's schedule plus the changes of the run's length made on resume (`--steps`). The cosine
// is a function of its phase p in [0, 1] (lr = min + (lr - min) (1 + cos(pi p)) / 2). A change at
// step r to a new total S keeps the phase reached at r and spreads the rest of it evenly over the
// steps left: p(s) = p(r) + (1 - p(r)) (s - r) / (S - 1 - r) for s >= r. So the learning rate is
// continuous at r (no restart, no jump), still ends at lr * min_lr_ratio on the new last step,
// and the steps before r keep their rates (a resumed run repeats them bit for bit). A change
// during warmup is the plain schedule of the new length; a run extended after it finished (p = 1)
// continues at the minimum rate.
class LrSchedule {
 public:
  struct Change {
    int64_t at_step;  // first step (0-based) under the new length
    int64_t steps;    // the new total
  };
  explicit LrSchedule(const TrainConfig& t);  // t.steps: the run's first length
  LrSchedule(const TrainConfig& t, int64_t first_steps, std::vector<Change> changes);

  double lr(int64_t step) const;
  int64_t total_steps() const { return changes_.empty() ? first_steps_ : changes_.back().steps; }
  // This schedule with the run's length changed to `steps` from step `at_step` on (no change
  // when it is already `steps`). Fails unless steps > at_step and at_step >= the last change's.
  LrSchedule with_length(int64_t at_step, int64_t steps) const;
  const std::vector<Change>& changes() const { return changes_; }

  // {"steps": first length, "changes": [{"at_step": r, "steps": S}, ...]}
  nlohmann::json to_json() const;
  // Reads to_json's form; null gives LrSchedule(t). `where` names the file in errors.
  static LrSchedule from_json(const TrainConfig& t, const nlohmann::json& j, const std::string& where);

 private:
  double phase(int64_t step) const;  // for step >= warmup
  TrainConfig t_;
  int64_t first_steps_;
  std::vector<Change> changes_;
  // One cosine piece per change: from step `from`, phase p0 + (1 - p0) (s - from) / (to - 1 - from).
  struct Piece {
    int64_t from;
    double p0;
    int64_t to;
  };
  std::vector<Piece> pieces_;
};

class Optimizer {
 public:
  Optimizer(ParamStore& params, const TrainConfig& t);
  // Updates the parameters with the gradients clipped inside the update (the gradient tensors are
  // left as they are); returns the pre-clip global norm. The first form takes lr_at(t, step).
  // Where the norm is not finite, or a quantizer met NaN/Inf since the flag was last cleared
  // (quantizer_nonfinite()), nothing is updated. On the GPU the update is queued before the host
  // reads the norm (ops::grad_norm_gate): no host round trip between the backward and the update.
  double step(int64_t step_index);  // step_index: 0-based optimizer step
  double step(int64_t step_index, double lr);
  // The global norm of the gradients (what step() returns, without updating).
  double grad_norm() const;
  // The last step() found the quantizers' NaN/Inf flag raised (and cleared it): nothing was
  // updated, as ops::nonfinite_seen(true) would have told before the step.
  bool quantizer_nonfinite() const { return quant_nonfinite_; }
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }
  // From now on every step also writes the BF16 rounding of the updated parameters that have a
  // copy in `copies` (Model::bf16_weight_copies) there, in the update's own pass; undefined: not
  // (the default). wrote_bf16_copies(): the last step() did, so the model may take them
  // (Model::invalidate_weight_cache(true)) instead of converting its weights again.
  void write_bf16_copies(const Bf16Copies& copies);
  bool wrote_bf16_copies() const { return wrote_bf16_; }
  // From now on every step also zeroes `ahead`'s buffer and raises it to each slice's amax of the
  // updated parameters that have entries there (Model::slice_amax_ahead: the NVFP4 weights' outer
  // scale groups), in the update's own pass; written also where the gate skips the update (the
  // amax of the unchanged parameters). wrote_slice_amax(): the last step() did, so the model may
  // take them (Model::invalidate_weight_cache) instead of a pass over the weights.
  void write_slice_amax(const SliceAmaxAhead& ahead);
  bool wrote_slice_amax() const { return wrote_amax_; }

 private:
  std::vector<Tensor> grad_views() const;  // every parameter's gradient, in layout order
  ParamStore& params_;
  TrainConfig t_;
  Tensor m_, v_;
  Bf16Copies bf16_;  // write_bf16_copies' target
  bool wrote_bf16_ = false;
  SliceAmaxAhead amax_;  // write_slice_amax's target
  bool wrote_amax_ = false;
  bool quant_nonfinite_ = false;
};

}  // namespace fourbit
