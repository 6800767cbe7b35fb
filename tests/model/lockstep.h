// defines: LockstepDrift, lockstep_drift (tests/model: how much worse a candidate backend trains
//          than the CPU reference, one step at a time from the reference's own states)
// Free-running loss curves cannot compare two backends to 1%: this model's training is chaotic,
// and two CPU runs whose initial weights differ by 1e-6 (relative) are 3-8% apart in loss by step
// 25 (measured on configs/tiny.toml, with and without routing decisions). So the comparison is
// made in lockstep. At every step s the candidate is given the reference's weights and AdamW
// moments, both take step s on the same batch, and both new weight sets are scored by the same
// CPU forward on a held-out batch. Δ_s = (L(θ_candidate) − L(θ_reference)) / L(θ_reference) is the
// loss the candidate's step gives up; their sum over the run is the drift a free-running
// candidate would accumulate to first order, without the chaos. The candidate's training loss at
// each step (its forward on the reference weights) is compared directly as well.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/train/data.h"
#include "fourbit/train/optimizer.h"

namespace fourbit::modeltest {

struct LockstepDrift {
  std::vector<double> loss_rel;  // |candidate loss − reference loss| / reference loss, per step
  std::vector<double> delta;     // Δ_s, per step
  double drift() const {
    double d = 0;
    for (double x : delta) d += x;
    return d;
  }
  double worst_loss_rel() const { return loss_rel.empty() ? 0 : *std::max_element(loss_rel.begin(), loss_rel.end()); }
};

// Trains `steps` steps of cfg under `recipe` on the CPU (the reference) and, in lockstep, on
// `candidate` with the candidate's TrainConfig `cand_train` (normally cfg.train; a test plants a
// defect by changing it). Batches come from cfg.data's train split, the scoring batch from its
// eval split.
inline LockstepDrift lockstep_drift(const RunConfig& cfg, const std::string& recipe, Device candidate,
                                    const TrainConfig& cand_train, int64_t steps) {
  const Recipe& r = recipe_by_name(recipe);
  Model ref(cfg.model, r, Device::CPU), cand(cfg.model, r, candidate), score(cfg.model, r, Device::CPU);
  Optimizer ref_opt(ref.params(), cfg.train), cand_opt(cand.params(), cand_train);
  init_params(ref.params(), cfg.model, cfg.train.seed);
  const int64_t B = cfg.train.batch_size, T = cfg.train.seq_len;
  const auto train = data::make_token_source(cfg.data, data::Split::Train, cfg.train.seed, cfg.model.vocab_size);
  const auto eval = data::make_token_source(cfg.data, data::Split::Eval, cfg.train.seed, cfg.model.vocab_size);
  auto batch = [&](const data::TokenSource& src, int64_t index, Device dev, Tensor* targets) {
    std::vector<int32_t> tok(size_t(B * T)), tgt(size_t(B * T));
    src.batch(index, B, T, tok.data(), tgt.data());
    *targets = Tensor::from_host(tgt.data(), {B, T}, DType::I32, dev);
    return Tensor::from_host(tok.data(), {B, T}, DType::I32, dev);
  };
  Tensor held_targets;
  const Tensor held = batch(*eval, 0, Device::CPU, &held_targets);
  auto score_loss = [&](const Tensor& flat) {
    score.params().flat().copy_from(flat);
    score.invalidate_weight_cache();
    return score.forward(held, held_targets, SrStreams{cfg.train.seed, 0, 0}, false).loss;
  };

  LockstepDrift out;
  for (int64_t s = 0; s < steps; ++s) {
    const SrStreams sr{cfg.train.seed, uint64_t(s), 0};
    // the candidate steps from the reference's state
    cand.params().flat().copy_from(ref.params().flat());
    cand_opt.m().copy_from(ref_opt.m());
    cand_opt.v().copy_from(ref_opt.v());
    cand.invalidate_weight_cache();
    Tensor ct, rt;
    const Tensor ctok = batch(*train, s, candidate, &ct), rtok = batch(*train, s, Device::CPU, &rt);
    cand.params().zero_grad();
    const double cand_loss = cand.forward(ctok, ct, sr, true).loss;
    cand.backward();
    cand_opt.step(s);
    ref.params().zero_grad();
    const double ref_loss = ref.forward(rtok, rt, sr, true).loss;
    ref.backward();
    ref_opt.step(s);
    ref.invalidate_weight_cache();
    const double l_cand = score_loss(cand.params().flat()), l_ref = score_loss(ref.params().flat());
    out.loss_rel.push_back(std::abs(cand_loss - ref_loss) / ref_loss);
    out.delta.push_back((l_cand - l_ref) / l_ref);
  }
  return out;
}

}  // namespace fourbit::modeltest
