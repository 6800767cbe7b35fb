// defines: lr_at, Optimizer (optimizer.h)
#include "fourbit/train/optimizer.h"

#include <cmath>

#include "fourbit/ops/ops.h"

namespace fourbit {

double lr_at(const TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  const int64_t decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  const double progress = double(step - t.warmup_steps) / double(decay_steps - 1);
  const double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * std::min(1.0, progress)));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

Optimizer::Optimizer(ParamStore& params, const TrainConfig& t) : params_(params), t_(t) {
  m_ = Tensor::zeros({params.numel()}, params.flat().dtype(), params.flat().device());
  v_ = Tensor::zeros({params.numel()}, params.flat().dtype(), params.flat().device());
}

double Optimizer::step(int64_t step_index) {
  double sq = 0;
  for (const ParamInfo& p : params_.infos()) sq += ops::sum_squares(params_.view(params_.flat_grad(), p));
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) return norm;  // the trainer stops on a non-finite norm
  // Clipping scales the gradient inside the update (the same float product as scaling it first,
  // without another pass over every gradient).
  const float clip = t_.grad_clip > 0 && norm > t_.grad_clip ? float(t_.grad_clip / norm) : 1.0f;
  const double lr = lr_at(t_, step_index);
  for (const ParamInfo& p : params_.infos()) {
    Tensor w = params_.view(params_.flat(), p), g = params_.view(params_.flat_grad(), p);
    Tensor m = params_.view(m_, p), v = params_.view(v_, p);
    ops::adamw_step(w, g, m, v,
                    ops::AdamW{float(lr), float(t_.beta1), float(t_.beta2), float(t_.adam_eps),
                               p.decay ? float(t_.weight_decay) : 0.0f, step_index + 1, clip});
  }
  return norm;
}

}  // namespace fourbit
