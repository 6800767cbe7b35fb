// defines: optimizer_steps (a few training steps of a tiny model with its optimizer, for the
//          tests of what the optimizer writes ahead for the next forward)
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/train/optimizer.h"
#include "model/model_test_util.h"

namespace fourbit::modeltest {

// `steps` steps of m on `dev`: batches of 2 x 12 random tokens (seed token_seed + step), SR
// streams {sr_seed, step, 0}; after each optimizer step check(step) runs, then the weight cache is
// invalidated with what the optimizer wrote ahead (its BF16 copies, its slice amaxes) as the
// trainer does. Returns the losses.
inline std::vector<double> optimizer_steps(Model& m, Optimizer& optim, Device dev, int64_t steps,
                                           uint64_t token_seed, uint64_t sr_seed,
                                           const std::function<void(int64_t)>& check) {
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    m.params().zero_grad();
    const Tensor tokens = random_tokens(2, 12, token_seed + uint64_t(step));
    const ForwardStats st = m.forward(tokens.to(dev), shifted_targets(tokens, 258).to(dev),
                                      SrStreams{sr_seed, uint64_t(step), 0}, true, 1.0f);
    losses.push_back(st.loss);
    m.backward();
    optim.step(step);
    check(step);
    m.invalidate_weight_cache(optim.wrote_bf16_copies(), optim.wrote_slice_amax());
  }
  return losses;
}

}  // namespace fourbit::modeltest
