// defines: whole-model finite-difference gradient checks. An F64 model under the fp32 recipe
//          (CPU) runs forward + backward; the gradient of CE mean + load-balance loss against
//          every parameter tensor (at least 4 elements each, plus ~200 random elements) is
//          compared with central differences. Configurations: tied embeddings with a shared
//          expert, untied embeddings, no shared expert, all-MoE with top-1, signed per-token
//          weights (RL's advantage-weighted loss); and a check that the F64 gradient carries no
//          systematic FP32 rounding.
// Routing is piecewise constant: a perturbation that flips a top-k decision makes the loss jump.
// Such elements are detected (central differences at h and h/2 disagree) and skipped; at least
// 95% of the sampled elements must be checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

struct Worst {
  double rel = 0;
  int64_t index = -1;
  double analytic = 0, numeric = 0;
  int checked = 0;
};

struct GradCheck {
  int sampled = 0, checked = 0, skipped_jump = 0;
  std::vector<double> rel_dev;  // (a - n) / n where |n| > 1e-3
};

// Central differences at h and h/2, combined by Richardson extrapolation (the h^2 error term
// cancels). The rounding noise of the F64 loss (~1e-15) puts ~2e-11 of noise on the estimate.
constexpr double kH = 1e-4;
// |a - n| / max(|a|, |n|, kFloor) < kRelTol: a relative error of 1e-5 for gradients above 1e-5,
// and an absolute 1e-10 (5x the noise) below, where a relative error would measure the noise.
constexpr double kRelTol = 1e-5;
constexpr double kFloor = 1e-5;

// Parameters from `seed` with the router weights spread so top-k decisions sit far from ties
// (init_std-sized router logits make all experts nearly equally likely, and every perturbation a
// potential flip), and a batch of 2 x 8 tokens with one ignored target.
Tensor make_inputs(Model& m, const ModelConfig& cfg, uint64_t seed, Tensor* targets) {
  init_params(m.params(), cfg, seed);
  ParamStore& ps = m.params();
  double* w = ps.flat().data<double>();
  for (const ParamInfo& p : ps.infos())
    if (p.name.ends_with("moe.router"))
      for (int64_t i = 0; i < p.numel(); ++i) w[p.offset + i] *= 25.0;
  const Tensor tokens = random_tokens(2, 8, seed + 7);
  *targets = shifted_targets(tokens, 258);
  targets->data<int32_t>()[3] = -1;  // an ignored target contributes nothing
  return tokens;
}

// RL's per-token weights: group advantages of both signs (and some zeros), one value per row's
// completion as policy_gradient.cpp writes them, here varying along the row as a KL term makes them.
Tensor signed_token_weights(int64_t B, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> w(size_t(B * T));
  for (float& x : w) x = float(int(rng() % 7) - 3) * 0.25f;  // -0.75 .. 0.75 in steps of 1/4
  return Tensor::from_host(w.data(), {B, T}, DType::F32);
}

GradCheck run_grad_check(const ModelConfig& cfg, uint64_t seed, int random_elements = 200, bool print = true,
                         bool signed_weights = false) {
  const OmpThreads one_thread(1);
  Model m(cfg, recipe_by_name("fp32"), Device::CPU, DType::F64);
  Tensor targets;
  const Tensor tokens = make_inputs(m, cfg, seed, &targets);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  ParamStore& ps = m.params();
  const Tensor weights = signed_weights ? signed_token_weights(B, T, seed + 3) : Tensor();

  ps.zero_grad();
  const ForwardStats st0 = m.forward(tokens, targets, SrStreams{}, true, 1.0f, weights);
  m.backward();
  EXPECT_TRUE(std::isfinite(st0.loss));
  if (cfg.aux_loss_coef > 0) {
    EXPECT_GT(st0.aux_loss, 0.0);
  }
  EXPECT_EQ(st0.tokens, B * T - 1);
  const std::vector<double> grad = host_doubles(ps.flat_grad());

  auto loss_at = [&]() {
    m.invalidate_weight_cache();
    const ForwardStats st = m.forward(tokens, targets, SrStreams{}, false, 1.0f, weights);
    return st.loss + st.aux_loss;
  };
  // The unperturbed loss through the forward-only path equals the one backward differentiated.
  EXPECT_EQ(loss_at(), st0.loss + st0.aux_loss);

  // Sample: 4 elements of every tensor (for the embedding, rows of tokens in the batch, whose
  // gradient is not zero when untied), then elements uniformly over the flat buffer.
  std::mt19937_64 rng(seed * 31 + 5);
  std::vector<std::pair<int64_t, std::string>> sample;
  std::set<int32_t> used_tokens;
  for (int64_t i = 0; i < B * T; ++i) used_tokens.insert(tokens.data<int32_t>()[i]);
  const std::vector<int32_t> used(used_tokens.begin(), used_tokens.end());
  for (const ParamInfo& p : ps.infos()) {
    for (int j = 0; j < 4; ++j) {
      int64_t i = int64_t(rng() % uint64_t(p.numel()));
      if (p.name == "embed")
        i = int64_t(used[rng() % used.size()]) * cfg.d_model + int64_t(rng() % uint64_t(cfg.d_model));
      sample.emplace_back(p.offset + i, p.name);
    }
  }
  for (int j = 0; j < random_elements; ++j) {
    const int64_t i = int64_t(rng() % uint64_t(ps.numel()));
    for (const ParamInfo& p : ps.infos())
      if (i >= p.offset && i < p.offset + p.numel()) sample.emplace_back(i, p.name);
  }

  GradCheck r;
  std::map<std::string, Worst> worst;
  double* w = ps.flat().data<double>();
  for (const auto& [idx, name] : sample) {
    ++r.sampled;
    const double orig = w[idx];
    auto at = [&](double d) {
      w[idx] = orig + d;
      const double l = loss_at();
      w[idx] = orig;
      return l;
    };
    const double n1 = (at(kH) - at(-kH)) / (2 * kH);
    const double n2 = (at(kH / 2) - at(-kH / 2)) / kH;
    // Smooth: n1 - n2 = h^2/8 L''' + noise, far below 1e-7 here. A routing flip within +-h adds
    // jump/(2h) or jump/h to one of them.
    if (std::fabs(n1 - n2) > 1e-7 + 1e-4 * std::max(std::fabs(n1), std::fabs(n2))) {
      ++r.skipped_jump;
      continue;
    }
    const double n = (4 * n2 - n1) / 3;
    const double a = grad[size_t(idx)];
    const int64_t elem = idx - ps.info(name).offset;
    Worst& wt = worst[name];
    ++wt.checked;
    ++r.checked;
    if (std::fabs(n) > 1e-3) r.rel_dev.push_back((a - n) / n);
    const double rel = std::fabs(a - n) / std::max({std::fabs(a), std::fabs(n), kFloor});
    EXPECT_LT(rel, kRelTol) << name << " element " << elem << ": analytic " << a << " numeric " << n;
    if (rel >= wt.rel) wt = Worst{rel, elem, a, n, wt.checked};
  }
  for (const ParamInfo& p : ps.infos()) EXPECT_GT(worst[p.name].checked, 0) << p.name << " was never checked";
  if (print) {
    std::printf("  %-26s %8s %9s %8s %14s %14s\n", "tensor", "checked", "worst rel", "element", "analytic", "numeric");
    for (const ParamInfo& p : ps.infos()) {
      const Worst& wt = worst[p.name];
      std::printf("  %-26s %8d %9.2e %8lld %14.6e %14.6e\n", p.name.c_str(), wt.checked, wt.rel, (long long)wt.index,
                  wt.analytic, wt.numeric);
    }
    std::printf("  sampled %d, checked %d, skipped for a routing flip %d\n", r.sampled, r.checked, r.skipped_jump);
  }
  EXPECT_GE(double(r.checked), 0.95 * double(r.sampled)) << "too many elements skipped for routing flips";
  return r;
}

ModelConfig grad_config() {
  ModelConfig c = tiny_moe_config(2, 16);
  c.d_expert = 16;
  c.d_dense = 32;
  c.init_std = 0.1;       // gradients well above the finite-difference noise
  c.aux_loss_coef = 0.1;  // the load-balance term's gradient is not lost in the CE's
  return c;
}

}  // namespace

TEST(ModelGrad, TiedEmbeddingsWithSharedExpert) {
  const ModelConfig c = grad_config();
  ASSERT_TRUE(c.tie_embeddings);
  ASSERT_EQ(c.n_shared_experts, 1);
  run_grad_check(c, 11);
}

TEST(ModelGrad, UntiedEmbeddings) {
  ModelConfig c = grad_config();
  c.tie_embeddings = false;
  run_grad_check(c, 12);
}

TEST(ModelGrad, NoSharedExpert) {
  ModelConfig c = grad_config();
  c.n_shared_experts = 0;
  run_grad_check(c, 13);
}

// Two MoE layers in a row (no dense layer) and top-1 routing: the gradient through a single
// expert's weight (renormalised to 1, so only the aux loss reaches the router from top-k) and
// through stacked MoE blocks.
TEST(ModelGrad, AllMoeLayersTop1) {
  ModelConfig c = grad_config();
  c.dense_layers = 0;
  c.top_k = 1;
  run_grad_check(c, 14);
}

// The RL surrogate: cross-entropy weighted per token by signed advantages (the loss is
// -sum(A * log p) / tokens), so the gradient must follow each weight's sign and size, through the
// LM head, the experts and the router alike.
TEST(ModelGrad, SignedTokenWeightsOfTheRlLoss) {
  const ModelConfig c = grad_config();
  run_grad_check(c, 16, 200, true, true);
}

// An F64 model exists for these checks, so its gradient should be F64-accurate. With 15 target
// tokens (one ignored) the cross-entropy gradient scale is 1/15. The finite differences resolve
// the gradient to ~1e-9 relative where |g| > 1e-3, so a systematic deviation of the analytic
// gradient (the same sign and size on every element, as a scale rounded to FP32 gives: 5.2e-8
// for 1/15) shows in the median of (analytic - numeric) / numeric.
TEST(ModelGrad, F64GradientHasNoFp32Rounding) {
  ModelConfig c = grad_config();
  c.aux_loss_coef = 0;  // the cross-entropy alone: every element scales with 1/15
  const GradCheck r = run_grad_check(c, 15, 100, false);
  std::vector<double> dev = r.rel_dev;
  ASSERT_GE(dev.size(), 20u);
  std::sort(dev.begin(), dev.end());
  const double median = dev[dev.size() / 2];
  std::printf("  median (analytic - numeric) / numeric over %zu elements with |g| > 1e-3: %.3e\n", dev.size(), median);
  EXPECT_LT(std::fabs(median), 1e-8) << "the F64 gradient carries a systematic relative error";
}
