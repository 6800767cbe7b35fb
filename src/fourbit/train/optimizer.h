// defines: lr_at, Optimizer
// AdamW with FP32 master weights and moments, linear warmup then cosine decay, global-norm
// gradient clipping. The gradient norm is summed parameter by parameter in layout order, so it
// is the same number on every run.
#pragma once
#include "fourbit/model/config.h"
#include "fourbit/model/params.h"

namespace fourbit {

// Learning rate for optimizer step `step` (0-based): linear warmup over warmup_steps to lr, then
// cosine decay to lr * min_lr_ratio at the last step.
double lr_at(const TrainConfig& t, int64_t step);

class Optimizer {
 public:
  Optimizer(ParamStore& params, const TrainConfig& t);
  // Updates the parameters with the gradients clipped inside the update (the gradient tensors are
  // left as they are); returns the pre-clip global norm.
  double step(int64_t step_index);  // step_index: 0-based optimizer step
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }

 private:
  ParamStore& params_;
  TrainConfig t_;
  Tensor m_, v_;
};

}  // namespace fourbit
