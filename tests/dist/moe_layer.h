// defines: distest::MoeWeights, distest::MoeGrads, distest::MoeLayerSpec, distest::MoeResult,
//          distest::random_moe_weights, distest::zero_grads, distest::moe_layer
// A MoE layer (router + routed SwiGLU experts, no shared expert or load-balance loss) run forward
// and backward over an expert-parallel group, written the way model.cpp's moe_forward /
// moe_backward run it with the dist layer in between (docs/distributed.md "Model integration"):
// the source quantizes its tokens once and dispatches them, the experts' rows are computed
// expert-major, per-row work runs over all of them at once, and everything that sums over tokens
// (the weight gradients) runs per (expert, source) segment with the source's SR keys, sources in
// rank order. The expert weights' dgrad operands are re-quantized once per step and expert (SR key
// without the micro-batch, one per expert), so they do not depend on who holds the expert.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "fourbit/dist/expert_parallel.h"
#include "fourbit/model/linear.h"
#include "fourbit/model/recipe.h"
#include "fourbit/ops/ops.h"

namespace fourbit::distest {

struct MoeWeights {
  Tensor router;  // [E, D]
  Tensor w1, w3;  // [E, F, D]
  Tensor w2;      // [E, D, F]
};
using MoeGrads = MoeWeights;

struct MoeLayerSpec {
  const LayerRecipe* r = nullptr;
  dist::MoeCodecs codecs;
  int64_t E = 8, K = 2, D = 64, F = 32;
  uint64_t seed = 7, step = 3;
};

struct MoeResult {
  Tensor out;  // [N, D]
  Tensor dxn;  // [N, D]
};

inline Tensor random_normal(const Shape& shape, double stddev, std::mt19937_64& gen) {
  std::normal_distribution<float> nd(0.0f, float(stddev));
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(gen);
  return t;
}

inline MoeWeights random_moe_weights(const MoeLayerSpec& s, uint64_t seed) {
  std::mt19937_64 gen(seed);
  return MoeWeights{random_normal({s.E, s.D}, 0.5, gen), random_normal({s.E, s.F, s.D}, 0.15, gen),
                    random_normal({s.E, s.F, s.D}, 0.15, gen), random_normal({s.E, s.D, s.F}, 0.15, gen)};
}

inline MoeGrads zero_grads(const MoeLayerSpec& s) {
  return MoeGrads{Tensor::zeros({s.E, s.D}, DType::F32), Tensor::zeros({s.E, s.F, s.D}, DType::F32),
                  Tensor::zeros({s.E, s.F, s.D}, DType::F32), Tensor::zeros({s.E, s.D, s.F}, DType::F32)};
}

namespace detail {

enum Site : int { kX = 10, kA = 12, kDy = 14, kDh = 16, kXw = 18, kAw = 20, kW = 22 };

inline bool wgrad_from_saved_fwd(const LayerRecipe& r) {
  return r.requant_saved_sr || (!r.fprop.a.quantized() && !r.wgrad.b.quantized() && r.fprop.a.fmt == r.wgrad.b.fmt);
}

// Expert e's [R, C] slice of an [E, R, C] tensor.
inline Tensor expert_slice(const Tensor& t, int64_t e) {
  const int64_t n = t.size(1) * t.size(2);
  return t.view(e * n, {t.size(1), t.size(2)});
}

}  // namespace detail

// This rank's MoE layer over its N tokens xn [N, D] with upstream gradient dout [N, D]. The
// source rank p of the group ran micro-batch micro_base + p of the step (its SR streams).
// Gradients accumulate into g: the router's in full (this rank's tokens), the experts' only in
// this rank's experts' slices.
inline MoeResult moe_layer(dist::ExpertParallel& ep, const MoeLayerSpec& s, const MoeWeights& w, MoeGrads& g,
                           const Tensor& xn, const Tensor& dout, int64_t micro_base) {
  using namespace detail;
  const LayerRecipe& r = *s.r;
  const LayerClass cls = LayerClass::Expert;
  const dist::ExpertShard& sh = ep.shard();
  const int64_t N = xn.size(0), E = s.E, K = s.K, D = s.D, F = s.F, L = sh.per_rank(), first = sh.first();
  // The quantization point's stream: point `site` of expert `expert`, in source micro-batch `micro`.
  auto key = [&](int64_t micro, int site, int64_t expert) {
    return SrStreams{s.seed, s.step, uint64_t(micro)}.site("moe.site" + std::to_string(site) + "[" +
                                                            std::to_string(expert) + "]");
  };
  const int64_t my_micro = micro_base + sh.rank;

  // ---- source: router, route plan, dispatch ----
  Tensor logits = Tensor::empty({N, E}, DType::F32);
  ops::gemm(ops::Operand(xn), ops::Operand(w.router), logits);
  Tensor probs = Tensor::empty({N, E}, DType::F32), topk_idx = Tensor::empty({N, K}, DType::I32),
         topk_w = Tensor::empty({N, K}, DType::F32);
  ops::router_topk(logits, K, probs, topk_idx, topk_w);
  const ops::RoutePlan route = ops::route_plan(topk_idx, E);
  dist::ExchangePlan plan = ep.plan(route, topk_idx);
  Prepared x_perm;
  Tensor x_rows;  // high-precision expert rows, when a wgrad operand is made from them
  if (s.codecs.dispatch.packs_qtensor()) {
    const Prepared px = prepare(xn, r.fprop.a, GemmRole::Fprop, 'a', key(my_micro, kX, 0), cls, nullptr);
    x_perm.q = ep.dispatch(plan, px.q, s.codecs.dispatch).q;
    if (!wgrad_from_saved_fwd(r)) x_rows = ops::dequantize(x_perm.q);
  } else {
    x_rows = ep.dispatch(plan, xn, s.codecs.dispatch).dense;
    x_perm = prepare(x_rows, r.fprop.a, GemmRole::Fprop, 'a', QuantSite{}, cls, nullptr);
  }

  // ---- experts: rows expert-major ----
  const std::vector<int64_t>& off = plan.expert_offsets;
  const std::vector<int64_t>& seg = plan.segment_offsets;
  const int64_t M = plan.expert_rows();
  const Tensor w1l = w.w1.view(first * F * D, {L, F, D}), w3l = w.w3.view(first * F * D, {L, F, D}),
               w2l = w.w2.view(first * D * F, {L, D, F});
  const Prepared w1p = prepare(w1l, r.fprop.b, GemmRole::Fprop, 'b', {}, cls, nullptr);
  const Prepared w3p = prepare(w3l, r.fprop.b, GemmRole::Fprop, 'b', {}, cls, nullptr);
  const Prepared w2p = prepare(w2l, r.fprop.b, GemmRole::Fprop, 'b', {}, cls, nullptr);
  Tensor h1 = Tensor::empty({M, F}, DType::F32), h3 = Tensor::empty({M, F}, DType::F32),
         a = Tensor::empty({M, F}, DType::F32), y = Tensor::empty({M, D}, DType::F32);
  grouped_gemm(x_perm, w1p, off, h1);
  grouped_gemm(x_perm, w3p, off, h3);
  ops::swiglu_forward(h1, h3, a);
  const Prepared pa = prepare(a, r.fprop.a, GemmRole::Fprop, 'a', {}, cls, nullptr);
  grouped_gemm(pa, w2p, off, y);

  // ---- combine at the source ----
  Tensor y_received;  // kept for backward, as the model keeps it (8.25 bits a value for S2F6)
  const Tensor y_slots = ep.combine(plan, y, s.codecs.combine, &y_received);
  MoeResult res;
  res.out = Tensor::empty({N, D}, DType::F32);
  ops::moe_combine(y_slots, route.slot_of, topk_w, res.out);

  // ==== backward ====
  Tensor dy_slots = Tensor::empty({N * K, D}, DType::F32), d_topk_w = Tensor::empty({N, K}, DType::F32);
  ops::moe_combine_backward(dout, dist::decode_slots(y_received, s.codecs.combine), route.slot_of, topk_w, dy_slots,
                            d_topk_w);
  const Tensor dy_rows = ep.dispatch_grad(plan, dy_slots, s.codecs.grad_dispatch);

  // The experts' dgrad weights: per expert, keyed by the step (no micro-batch) and the global expert.
  auto dgrad_weights = [&](const Tensor& wl, const Prepared& wfwd, int site) {
    std::vector<Prepared> out(static_cast<size_t>(L));
    for (int64_t e = 0; e < L; ++e) {
      const QuantSite k = key(0, site, first + e);
      out[size_t(e)] = r.requant_saved_sr
                           ? requantize_saved(wfwd.slice(e), r.dgrad.b, GemmRole::Dgrad, 'b', k, cls, nullptr)
                           : prepare(expert_slice(wl, e), r.dgrad.b, GemmRole::Dgrad, 'b', k, cls, nullptr);
    }
    return out;
  };
  // Per-segment SR keys: segment (e, p) draws from source p's micro-batch and expert first + e.
  auto seg_keys = [&](int site) {
    std::vector<QuantSite> keys;
    for (int64_t sg = 0; sg + 1 < int64_t(seg.size()); ++sg)
      keys.push_back(key(micro_base + plan.segment_source(sg), site, plan.segment_expert(sg)));
    return keys;
  };
  auto wgrad_b = [&](const Prepared& fwd, const Tensor& rows, int site) {
    if (r.requant_saved_sr)
      return requantize_saved_segments(fwd, seg, r.wgrad.b, GemmRole::Wgrad, 'b', seg_keys(site), cls, nullptr);
    if (wgrad_from_saved_fwd(r)) {  // the dense forward operand, transposed
      std::vector<Prepared> out(seg.size() - 1);
      for (size_t sg = 0; sg + 1 < seg.size(); ++sg)
        if (seg[sg] < seg[sg + 1]) {
          out[sg] = fwd.rows(seg[sg], seg[sg + 1]);
          out[sg].trans = true;
        }
      return out;
    }
    return prepare_segments(rows, seg, r.wgrad.b, GemmRole::Wgrad, 'b', seg_keys(site), cls, nullptr);
  };
  // grad[e] += a[seg] . b[seg]^T, sources in rank order, each source's experts in one batch.
  auto experts_wgrad = [&](const std::vector<Prepared>& wa, const std::vector<Prepared>& wb, Tensor& grad) {
    for (int p = 0; p < sh.ep; ++p) {
      std::vector<Tensor> outs;
      outs.reserve(size_t(L));
      std::vector<ops::GemmJob> jobs;
      for (int64_t e = 0; e < L; ++e) {
        const size_t sg = size_t(e * sh.ep + p);
        if (seg[sg] == seg[sg + 1]) continue;
        outs.push_back(expert_slice(grad, first + e));
        jobs.push_back(ops::GemmJob{wa[sg].op(), wb[sg].op(), &outs.back(), true});
      }
      ops::gemm_batch(jobs);
    }
  };
  // C rows of expert e (+)= A rows . B_e^T, one gemm per expert (what grouped_gemm computes).
  auto per_expert_gemm = [&](const Prepared& A, const std::vector<Prepared>& B, Tensor& C, bool acc) {
    for (int64_t e = 0; e < L; ++e) {
      if (off[size_t(e)] == off[size_t(e + 1)]) continue;
      Tensor c = C.slice_rows(off[size_t(e)], off[size_t(e + 1)]);
      gemm(A.rows(off[size_t(e)], off[size_t(e + 1)]), B[size_t(e)], c, acc);
    }
  };

  const std::vector<Prepared> w2d = dgrad_weights(w2l, w2p, kW);
  const std::vector<Prepared> w1d = dgrad_weights(w1l, w1p, kW + 1);
  const std::vector<Prepared> w3d = dgrad_weights(w3l, w3p, kW + 2);
  const Prepared pdy = prepare(dy_rows, r.dgrad.a, GemmRole::Dgrad, 'a', {}, cls, nullptr);
  Tensor da = Tensor::empty({M, F}, DType::F32);
  per_expert_gemm(pdy, w2d, da, false);
  const std::vector<Prepared> dyt =
      prepare_segments(dy_rows, seg, r.wgrad.a, GemmRole::Wgrad, 'a', seg_keys(kDy + 1), cls, nullptr);
  experts_wgrad(dyt, wgrad_b(pa, a, kAw), g.w2);
  Tensor dh1 = Tensor::empty({M, F}, DType::F32), dh3 = Tensor::empty({M, F}, DType::F32);
  ops::swiglu_backward(da, h1, h3, dh1, dh3);
  const Prepared pdh1 = prepare(dh1, r.dgrad.a, GemmRole::Dgrad, 'a', {}, cls, nullptr);
  const Prepared pdh3 = prepare(dh3, r.dgrad.a, GemmRole::Dgrad, 'a', {}, cls, nullptr);
  Tensor dx_rows = Tensor::empty({M, D}, DType::F32);
  per_expert_gemm(pdh1, w1d, dx_rows, false);
  per_expert_gemm(pdh3, w3d, dx_rows, true);
  const std::vector<Prepared> x_w = wgrad_b(x_perm, x_rows, kXw);
  experts_wgrad(prepare_segments(dh1, seg, r.wgrad.a, GemmRole::Wgrad, 'a', seg_keys(kDh + 2), cls, nullptr), x_w,
                g.w1);
  experts_wgrad(prepare_segments(dh3, seg, r.wgrad.a, GemmRole::Wgrad, 'a', seg_keys(kDh + 3), cls, nullptr), x_w,
                g.w3);

  // ---- back at the source ----
  const Tensor dx_slots = ep.combine(plan, dx_rows, s.codecs.grad_combine);
  res.dxn = Tensor::empty({N, D}, DType::F32);
  ops::gather_rows_backward(dx_slots, route.slot_of, res.dxn);
  Tensor d_logits = Tensor::empty({N, E}, DType::F32);
  ops::router_backward(probs, topk_idx, topk_w, d_topk_w, Tensor(), d_logits);
  ops::gemm(ops::Operand(d_logits, true), ops::Operand(xn, true), g.router, true);
  ops::gemm(ops::Operand(d_logits), ops::Operand(w.router, true), res.dxn, true);
  return res;
}

}  // namespace fourbit::distest
