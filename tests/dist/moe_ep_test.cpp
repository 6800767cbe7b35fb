// defines: the MoeExpertParallel tests: a MoE layer's forward and backward over ep = 2 and 4 ranks
// (LocalGroup threads, the real grouped expert GEMMs of ops/ on the CPU) equal the ep = 1 run of the
// same ranks' tokens as consecutive micro-batches, bit for bit: outputs, input gradients, each
// rank's experts' weight gradients and the all-reduced router gradient; for nvfp4-fwd (NVFP4
// dispatch, RHT-32 + S2F6 combine, MXFP8 dY, S2F6 dX), mxfp8 (MXFP8 dispatch, BF16 combine) and
// fp32 (exact F32 payloads). Also: fp32 payloads change nothing (the layer equals the plain
// single-process computation), the S2F6 combine is really applied (outputs differ from an F32
// combine, within the NUMERICS bound), and a malformed payload is caught by its metadata.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dist/moe_layer.h"
#include "fourbit/dist/local_group.h"

using namespace fourbit;
using namespace fourbit::distest;

namespace {

// The first element where two F32 tensors differ in bits, or -1.
int64_t first_bit_difference(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(a.data<float>() + i, b.data<float>() + i, 4) != 0) return i;
  return -1;
}

#define EXPECT_BITWISE(a, b, what)                                                                        \
  do {                                                                                                   \
    const int64_t at_ = first_bit_difference(a, b);                                                      \
    EXPECT_EQ(at_, -1) << (what) << ": first difference at element " << at_ << ": "                      \
                       << (at_ >= 0 && at_ < (a).numel() ? (a).data<float>()[at_] : 0.0f) << " vs "        \
                       << (at_ >= 0 && at_ < (b).numel() ? (b).data<float>()[at_] : 0.0f);                 \
  } while (0)

struct Case {
  std::string recipe;
  Format combine;
  int ep;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string n = info.param.recipe + "_" + std::string(format_name(info.param.combine)) + "_ep" +
                  std::to_string(info.param.ep);
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

MoeLayerSpec spec_for(const Recipe& recipe, Format combine) {
  MoeLayerSpec s;
  s.r = &recipe.expert;
  s.codecs = dist::moe_codecs(s.r->fprop.a, s.r->dgrad.a, combine, s.D, dist::payload_rht_signs(s.seed, 0, false),
                              dist::payload_rht_signs(s.seed, 0, true));
  return s;
}

// Rank r's tokens and upstream gradient: a few more tokens on later ranks, so the ranks' shares
// of every expert differ.
std::vector<Tensor> rank_inputs(const MoeLayerSpec& s, int ranks, uint64_t seed, double stddev) {
  std::mt19937_64 gen(seed);
  std::vector<Tensor> v;
  for (int r = 0; r < ranks; ++r) v.push_back(random_normal({20 + 3 * r, s.D}, stddev, gen));
  return v;
}

class MoeExpertParallel : public testing::TestWithParam<Case> {};

TEST_P(MoeExpertParallel, EqualsEpOneBitForBit) {
  const Case c = GetParam();
  const Recipe& recipe = recipe_by_name(c.recipe);
  const MoeLayerSpec s = spec_for(recipe, c.combine);
  const MoeWeights w = random_moe_weights(s, 11);
  const std::vector<Tensor> xs = rank_inputs(s, c.ep, 21, 1.0), douts = rank_inputs(s, c.ep, 31, 0.05);

  // ep = 1: one process runs the ranks' tokens as micro-batches 0 .. ep-1 of the step.
  MoeGrads g1 = zero_grads(s);
  std::vector<MoeResult> r1;
  {
    dist::LocalGroup one(1);
    auto comm = one.communicator(0);
    dist::ExpertParallel ep(*comm, s.E);
    for (int m = 0; m < c.ep; ++m) r1.push_back(moe_layer(ep, s, w, g1, xs[size_t(m)], douts[size_t(m)], m));
  }

  // ep = c.ep: rank r runs micro-batch r; the router gradient is all-reduced in rank order.
  std::vector<MoeGrads> gs;
  for (int r = 0; r < c.ep; ++r) gs.push_back(zero_grads(s));
  std::vector<MoeResult> rs(static_cast<size_t>(c.ep));
  dist::LocalGroup::run(c.ep, [&](dist::Communicator& comm) {
    const int r = comm.rank();
    dist::ExpertParallel ep(comm, s.E);
    rs[size_t(r)] = moe_layer(ep, s, w, gs[size_t(r)], xs[size_t(r)], douts[size_t(r)], 0);
    comm.all_reduce_sum(gs[size_t(r)].router);
  });

  const int64_t L = s.E / c.ep;
  for (int r = 0; r < c.ep; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_BITWISE(rs[size_t(r)].out, r1[size_t(r)].out, "forward output");
    EXPECT_BITWISE(rs[size_t(r)].dxn, r1[size_t(r)].dxn, "input gradient");
    EXPECT_BITWISE(gs[size_t(r)].router, g1.router, "router gradient (all-reduced)");
    auto experts = [&](const Tensor& t) {
      const int64_t n = t.size(1) * t.size(2);
      return t.view(r * L * n, {L, t.size(1), t.size(2)}).clone();
    };
    EXPECT_BITWISE(experts(gs[size_t(r)].w1), experts(g1.w1), "w1 gradient of this rank's experts");
    EXPECT_BITWISE(experts(gs[size_t(r)].w3), experts(g1.w3), "w3 gradient of this rank's experts");
    EXPECT_BITWISE(experts(gs[size_t(r)].w2), experts(g1.w2), "w2 gradient of this rank's experts");
  }
  // The comparison is not vacuous: every expert got tokens and gradients are not zero.
  double sum_sq = 0;
  for (int64_t i = 0; i < g1.w2.numel(); ++i) sum_sq += double(g1.w2.data<float>()[i]) * g1.w2.data<float>()[i];
  EXPECT_GT(sum_sq, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoeExpertParallel,
                         testing::Values(Case{"nvfp4-fwd", Format::S2F6, 2}, Case{"nvfp4-fwd", Format::S2F6, 4},
                                         Case{"mxfp8", Format::BF16, 2}, Case{"mxfp8", Format::S2F6, 4},
                                         Case{"fp32", Format::F32, 2}, Case{"bf16", Format::BF16, 4}),
                         case_name);

// With fp32 payloads the exchange is lossless: the layer's forward output equals the plain
// computation of one process (gather rows, one GEMM per expert, combine by rank of choice).
TEST(MoeExpertParallelExact, Fp32PayloadsChangeNothing) {
  const MoeLayerSpec s = spec_for(recipe_by_name("fp32"), Format::F32);
  const MoeWeights w = random_moe_weights(s, 5);
  const std::vector<Tensor> xs = rank_inputs(s, 2, 6, 1.0), douts = rank_inputs(s, 2, 7, 0.1);
  std::vector<MoeResult> rs(2);
  std::vector<MoeGrads> gs{zero_grads(s), zero_grads(s)};
  dist::LocalGroup::run(2, [&](dist::Communicator& comm) {
    dist::ExpertParallel ep(comm, s.E);
    rs[size_t(comm.rank())] = moe_layer(ep, s, w, gs[size_t(comm.rank())], xs[size_t(comm.rank())],
                                        douts[size_t(comm.rank())], 0);
  });
  for (int r = 0; r < 2; ++r) {
    const Tensor& x = xs[size_t(r)];
    const int64_t N = x.size(0);
    Tensor logits = Tensor::empty({N, s.E}, DType::F32), probs = Tensor::empty({N, s.E}, DType::F32),
           idx = Tensor::empty({N, s.K}, DType::I32), tw = Tensor::empty({N, s.K}, DType::F32);
    ops::gemm(ops::Operand(x), ops::Operand(w.router), logits);
    ops::router_topk(logits, s.K, probs, idx, tw);
    const ops::RoutePlan plan = ops::route_plan(idx, s.E);
    Tensor xp = Tensor::empty({N * s.K, s.D}, DType::F32), h1 = Tensor::empty({N * s.K, s.F}, DType::F32),
           h3 = Tensor::empty({N * s.K, s.F}, DType::F32), a = Tensor::empty({N * s.K, s.F}, DType::F32),
           y = Tensor::empty({N * s.K, s.D}, DType::F32), out = Tensor::empty({N, s.D}, DType::F32);
    ops::gather_rows(x, plan.token_of_slot, xp);
    ops::grouped_gemm(ops::Operand(xp), ops::Operand(w.w1), plan.offsets, h1);
    ops::grouped_gemm(ops::Operand(xp), ops::Operand(w.w3), plan.offsets, h3);
    ops::swiglu_forward(h1, h3, a);
    ops::grouped_gemm(ops::Operand(a), ops::Operand(w.w2), plan.offsets, y);
    ops::moe_combine(y, plan.slot_of, tw, out);
    EXPECT_BITWISE(rs[size_t(r)].out, out, "fp32 payloads: output of rank " + std::to_string(r));
  }
}

// The S2F6 combine is applied at ep = 1 too: the output differs from the F32-combined one, but
// only by a few percent of the row (each decoded expert row is within sqrt(32)/127 of itself per
// chunk, tests/dist/payload_test.cpp checks that bound exactly; this is the sanity check on the sum).
TEST(MoeExpertParallelExact, S2f6CombineRunsAtEpOne) {
  const Recipe& recipe = recipe_by_name("nvfp4-fwd");
  const MoeLayerSpec s2f6 = spec_for(recipe, Format::S2F6), f32 = spec_for(recipe, Format::F32);
  const MoeWeights w = random_moe_weights(s2f6, 9);
  const std::vector<Tensor> xs = rank_inputs(s2f6, 1, 10, 1.0), douts = rank_inputs(s2f6, 1, 12, 0.1);
  dist::LocalGroup one(1);
  auto comm = one.communicator(0);
  dist::ExpertParallel ep(*comm, s2f6.E);
  MoeGrads ga = zero_grads(s2f6), gb = zero_grads(s2f6);
  const MoeResult a = moe_layer(ep, s2f6, w, ga, xs[0], douts[0], 0);
  const MoeResult b = moe_layer(ep, f32, w, gb, xs[0], douts[0], 0);
  EXPECT_NE(first_bit_difference(a.out, b.out), -1) << "the S2F6 codec changed nothing: was it applied?";
  const int64_t N = a.out.size(0), D = a.out.size(1);
  for (int64_t n = 0; n < N; ++n) {
    double err = 0, ref = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double e = double(a.out.data<float>()[n * D + d]) - b.out.data<float>()[n * D + d];
      err += e * e;
      ref += double(b.out.data<float>()[n * D + d]) * b.out.data<float>()[n * D + d];
    }
    EXPECT_GT(std::sqrt(ref), 0.0);
    EXPECT_LT(std::sqrt(err), 0.2 * std::sqrt(ref)) << "row " << n;
  }
}

}  // namespace

namespace {

// What each named recipe's experts send (docs/distributed.md "What travels").
TEST(MoeExpertParallelExact, CodecsFollowTheRecipes) {
  struct Want {
    const char* recipe;
    Format dispatch, dy;
  };
  for (const Want& w : {Want{"nvfp4-fwd", Format::NVFP4, Format::MXFP8_E4M3}, Want{"mxfp8", Format::MXFP8_E4M3, Format::MXFP8_E4M3},
                        Want{"bf16", Format::BF16, Format::BF16}, Want{"fp32", Format::F32, Format::F32},
                        Want{"nvidia-nvfp4", Format::BF16, Format::BF16}}) {
    const LayerRecipe& r = recipe_by_name(w.recipe).expert;
    const dist::MoeCodecs c = dist::moe_codecs(r.fprop.a, r.dgrad.a, Format::S2F6, 64, 1u, 2u);
    EXPECT_EQ(c.dispatch.fmt, w.dispatch) << w.recipe;
    EXPECT_EQ(c.grad_dispatch.fmt, w.dy) << w.recipe;
    EXPECT_EQ(c.combine.hadamard, 32);
    EXPECT_NE(c.combine.hadamard_signs, c.grad_combine.hadamard_signs);
  }
  EXPECT_NE(dist::payload_rht_signs(1, 0, false), dist::payload_rht_signs(1, 1, false));  // per layer
  EXPECT_NE(dist::payload_rht_signs(1, 0, false), dist::payload_rht_signs(2, 0, false));  // per run
}

}  // namespace
