// defines: the CPU MoE permutation op tests
// Router and MoE permutation ops on the CPU: top-k order and ties, finite-difference gradients
// (router, moe_combine, gather_rows_backward), route_plan invariants on random routings, dense
// and quantized gathers (exact bytes), and error messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "fourbit/ops/ops.h"
#include "ops/op_test_util.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::optest;

namespace {

void report(const char* what, double worst) {
  std::printf("[ fd       ] %-34s worst rel err %.3g\n", what, worst);
}

}  // namespace

// ---- router ---------------------------------------------------------------------------------------

TEST(RouterOps, TopkOrderTiesAndWeights) {
  // Row 0 has a three-way tie at the top (experts 1, 3, 4): lower index first.
  std::vector<float> lg = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f, 0.0f,
                           -3.0f, 1.0f, 4.0f, 0.25f, 1.5f, 3.0f};
  Tensor logits = Tensor::from_host(lg.data(), {2, 6}, DType::F32);
  Tensor probs = Tensor::empty({2, 6}, DType::F32), idx = Tensor::empty({2, 3}, DType::I32),
         w = Tensor::empty({2, 3}, DType::F32);
  ops::router_topk(logits, 3, probs, idx, w);
  const int32_t* I = idx.data<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(I, I + 3), (std::vector<int32_t>{1, 3, 4}));
  EXPECT_EQ(std::vector<int32_t>(I + 3, I + 6), (std::vector<int32_t>{2, 5, 4}));
  for (int64_t n = 0; n < 2; ++n) {
    double ps = 0.0, ws = 0.0, sel = 0.0;
    for (int64_t e = 0; e < 6; ++e) ps += probs.data<float>()[n * 6 + e];
    for (int64_t j = 0; j < 3; ++j) {
      ws += w.data<float>()[n * 3 + j];
      sel += probs.data<float>()[n * 6 + I[n * 3 + j]];
    }
    EXPECT_NEAR(ps, 1.0, 1e-6);
    EXPECT_NEAR(ws, 1.0, 1e-6);
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_NEAR(w.data<float>()[n * 3 + j], probs.data<float>()[n * 6 + I[n * 3 + j]] / sel, 1e-7);
  }
  expect_error([&] { ops::router_topk(logits, 7, probs, idx, w); },
               "router_topk: k must be in [1, E=6], got k=7");
}

TEST(RouterOps, GradCheckThroughTopkAndProbs) {
  const int64_t N = 4, E = 6, k = 2;
  // Logits spaced by >= 0.5 (a shuffled ladder plus small noise): the top-k set cannot change
  // under the 1e-6 perturbation.
  std::mt19937_64 rng(700);
  std::vector<double> lg(static_cast<size_t>(N * E));
  std::uniform_real_distribution<double> noise(-0.1, 0.1);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int> ladder(static_cast<size_t>(E));
    std::iota(ladder.begin(), ladder.end(), 0);
    std::shuffle(ladder.begin(), ladder.end(), rng);
    for (int64_t e = 0; e < E; ++e) lg[size_t(n * E + e)] = 0.6 * ladder[size_t(e)] + noise(rng);
  }
  Tensor logits = Tensor::from_host(lg.data(), {N, E}, DType::F64);
  Tensor probs = Tensor::empty({N, E}, DType::F64), idx = Tensor::empty({N, k}, DType::I32),
         w = Tensor::empty({N, k}, DType::F64);
  auto fwd = [&] { ops::router_topk(logits, k, probs, idx, w); };
  fwd();
  const Tensor idx0 = idx.clone();
  Tensor rw = random_tensor({N, k}, DType::F64, 701), rp = random_tensor({N, E}, DType::F64, 702);
  Tensor dlogits = Tensor::empty({N, E}, DType::F64);
  ops::router_backward(probs, idx, w, rw, rp, dlogits);
  report("router d_logits", fd_check(logits, dlogits, {{&w, &rw}, {&probs, &rp}}, fwd));
  EXPECT_TRUE(bitwise_equal(idx, idx0));
  // Only through the top-k weights (undefined d_probs = no extra gradient).
  Tensor dl_w = Tensor::empty({N, E}, DType::F64);
  ops::router_backward(probs, idx, w, rw, Tensor(), dl_w);
  report("router d_logits (top-k weights only)", fd_check(logits, dl_w, {{&w, &rw}}, fwd));
  // d_probs as one [1, E] row every token shares: the bits of that row repeated N times.
  const Tensor row = random_tensor({1, E}, DType::F64, 703);
  Tensor rep = Tensor::empty({N, E}, DType::F64);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) rep.data<double>()[n * E + e] = row.data<double>()[e];
  Tensor dl_row = Tensor::empty({N, E}, DType::F64), dl_rep = Tensor::empty({N, E}, DType::F64);
  ops::router_backward(probs, idx, w, rw, row, dl_row);
  ops::router_backward(probs, idx, w, rw, rep, dl_rep);
  EXPECT_TRUE(bitwise_equal(dl_row, dl_rep));
  EXPECT_NE(testutil::error_of([&] { ops::router_backward(probs, idx, w, rw, random_tensor({2, E}, DType::F64, 704), dl_row); })
                .find("d_probs must be f64[N, E] or [1, E]"),
            std::string::npos);
}

// ---- route plan -----------------------------------------------------------------------------------

// prob_sums: per expert, chunks of kProbSumChunk tokens summed in token order, then the chunk
// sums in order (written out here from ops.h's words), for F32 and F64 probabilities, token
// counts around the chunk; within a few ulps of the exact sum; and the order matters (a plain
// running sum over the tokens differs for some expert of the large case).
TEST(MoeOps, RoutePlanProbabilitySumsInTheirFixedOrder) {
  bool order_seen = false;
  for (const DType dt : {DType::F32, DType::F64})
    for (const int64_t N : {int64_t(1), int64_t(63), int64_t(64), int64_t(65), int64_t(1000)}) {
      const int64_t E = 5, k = 2;
      const Tensor probs = random_tensor({N, E}, dt, 950 + uint64_t(N), 0.0, 1.0);
      const ops::RoutePlan plan = ops::route_plan(random_routing(N, E, k, 960), E, probs);
      ASSERT_EQ(plan.prob_sums.size(), size_t(E));
      for (int64_t e = 0; e < E; ++e) {
        auto p = [&](int64_t n) { return dt == DType::F64 ? probs.data<double>()[n * E + e] : double(probs.data<float>()[n * E + e]); };
        double want = 0, running = 0;
        long double exact = 0;
        for (int64_t c0 = 0; c0 < N; c0 += ops::kProbSumChunk) {
          double chunk = 0;
          for (int64_t n = c0; n < std::min(N, c0 + ops::kProbSumChunk); ++n) chunk += p(n);
          want += chunk;
        }
        for (int64_t n = 0; n < N; ++n) {
          running += p(n);
          exact += p(n);
        }
        EXPECT_EQ(plan.prob_sums[size_t(e)], want) << "N " << N << " expert " << e;
        EXPECT_NEAR(plan.prob_sums[size_t(e)], double(exact), 1e-13 * double(exact) + 1e-300);
        order_seen = order_seen || running != want;
      }
    }
  EXPECT_TRUE(order_seen) << "no case where the order changes a sum: the test cannot tell the orders apart";
  EXPECT_TRUE(ops::route_plan(random_routing(3, 4, 1, 970), 4).prob_sums.empty());
  EXPECT_NE(testutil::error_of([&] { ops::route_plan(random_routing(3, 4, 1, 971), 4, random_tensor({3, 5}, DType::F32, 972)); })
                .find("route_plan: probs must be a float [N=3, E=4] tensor"),
            std::string::npos);
}

// The load-balance term and its d/dprobs from a plan's offsets (ops/load_balance_math.h), written
// out here from ops.h's words for a routing with an empty expert; F32 and F64 d_probs; the target
// count and the cross-entropy's gradient scale made from it, and that scale read from its tensor
// gives the gradient of the same scale passed by value; bad arguments are named.
TEST(MoeOps, LoadBalanceTermsAndTargetCountAreTheirFormulas) {
  const Tensor offsets = int_tensor({0, 3, 3, 8}, {4});  // E = 3, 8 assignments, expert 1 empty
  const double sums[3] = {1.5, 0.25, 2.25};
  const Tensor prob_sums = Tensor::from_host(sums, {3}, DType::F64);
  const int64_t tokens = 4, assignments = 8;
  const double coef = 0.01;
  Tensor terms = Tensor::zeros({3}, DType::F64);
  ops::load_balance_term(offsets, prob_sums, tokens, assignments, coef, terms, 1);
  const double f[3] = {3.0 / 8.0, 0.0 / 8.0, 5.0 / 8.0};
  const double want = coef * 3.0 * (f[0] * sums[0] / 4.0 + f[1] * sums[1] / 4.0 + f[2] * sums[2] / 4.0);
  EXPECT_EQ(terms.data<double>()[0], 0.0);
  EXPECT_EQ(terms.data<double>()[1], want);
  EXPECT_EQ(terms.data<double>()[2], 0.0);
  const float lw = 0.5f;
  for (const DType dt : {DType::F32, DType::F64}) {
    Tensor dp = Tensor::empty({1, 3}, dt);
    ops::load_balance_dprobs(offsets, tokens, assignments, lw, coef, dp);
    for (int e = 0; e < 3; ++e) {
      const double d = double(lw) * coef * 3.0 * f[e] / 4.0;
      if (dt == DType::F64) EXPECT_EQ(dp.data<double>()[e], d) << e;
      else EXPECT_EQ(dp.data<float>()[e], float(d)) << e;
    }
  }
  Tensor count = Tensor::empty({1}, DType::F64), scale = Tensor::empty({1}, DType::F32);
  ops::count_targets(int_tensor({-1, 3, 0, -1, 7}, {5}), lw, count, scale);
  EXPECT_EQ(count.data<double>()[0], 3.0);
  EXPECT_EQ(scale.data<float>()[0], float(0.5 / 3.0));
  ops::count_targets(int_tensor({-1, -1}, {2}), lw, count, scale);
  EXPECT_EQ(count.data<double>()[0], 0.0);
  EXPECT_EQ(scale.data<float>()[0], 0.0f);
  const Tensor logits = random_tensor({5, 9}, DType::F32, 1210);
  const Tensor tg = int_tensor({-1, 3, 0, -1, 7}, {5});
  Tensor l1 = Tensor::empty({5}, DType::F32), l2 = Tensor::empty({5}, DType::F32);
  Tensor d1 = Tensor::empty({5, 9}, DType::F32), d2 = Tensor::empty({5, 9}, DType::F32);
  ops::count_targets(tg, lw, count, scale);
  ops::cross_entropy(logits, tg, l1, &d1, double(scale.data<float>()[0]));
  ops::cross_entropy(logits, tg, l2, &d2, 123.0, nullptr, &scale);
  EXPECT_EQ(std::memcmp(d1.raw(), d2.raw(), size_t(d1.nbytes())), 0);
  EXPECT_EQ(std::memcmp(l1.raw(), l2.raw(), size_t(l1.nbytes())), 0);
  expect_error([&] { ops::load_balance_term(offsets, prob_sums, tokens, assignments, coef, terms, 3); },
               "load_balance_term: terms must be f64 with an entry 3");
  expect_error([&] { ops::load_balance_term(offsets, Tensor::zeros({2}, DType::F64), tokens, assignments, coef, terms, 0); },
               "load_balance_term: prob_sums must be f64 [E=3]");
  Tensor dp_bad = Tensor::empty({1, 4}, DType::F32);
  expect_error([&] { ops::load_balance_dprobs(offsets, tokens, assignments, lw, coef, dp_bad); },
               "load_balance_dprobs: d_probs must be [1, E=3]");
  expect_error([&] { ops::load_balance_dprobs(offsets, 0, assignments, lw, coef, dp_bad); },
               "load_balance_dprobs: tokens and assignments must be positive, got 0 and 8");
  Tensor c32 = Tensor::empty({1}, DType::F32);
  expect_error([&] { ops::count_targets(tg, lw, c32, scale); }, "count_targets: count must be one f64 on cpu");
  expect_error([&] { ops::cross_entropy(logits, tg, l1, &d1, 1.0, nullptr, &count); },
               "cross_entropy: scale must be one f32 on the logits' device (cpu)");
}

TEST(MoeOps, RoutePlanInvariants) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const int64_t N = 1 + int64_t(seed * 7 % 61), E = 2 + int64_t(seed % 9), k = 1 + int64_t(seed % std::min<int64_t>(E, 4));
    const Tensor idx = random_routing(N, E, k, 800 + seed);
    const ops::RoutePlan plan = ops::route_plan(idx, E);
    ASSERT_EQ(plan.offsets.size(), size_t(E + 1));
    EXPECT_EQ(plan.offsets.front(), 0);
    EXPECT_EQ(plan.offsets.back(), N * k);
    const int32_t* I = idx.data<int32_t>();
    const int32_t* slot = plan.slot_of.data<int32_t>();
    const int32_t* tok = plan.token_of_slot.data<int32_t>();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t count = std::count(I, I + N * k, int32_t(e));
      EXPECT_EQ(plan.offsets[size_t(e + 1)] - plan.offsets[size_t(e)], count) << "expert " << e;
      // Tokens ascending within an expert.
      for (int64_t s = plan.offsets[size_t(e)] + 1; s < plan.offsets[size_t(e + 1)]; ++s)
        EXPECT_LT(tok[s - 1], tok[s]);
    }
    std::vector<int> seen(size_t(N * k), 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < k; ++j) {
        const int32_t s = slot[n * k + j];
        ASSERT_GE(s, 0);
        ASSERT_LT(s, N * k);
        ++seen[size_t(s)];
        EXPECT_EQ(tok[s], n);
        const int32_t e = I[n * k + j];
        EXPECT_GE(s, plan.offsets[size_t(e)]);
        EXPECT_LT(s, plan.offsets[size_t(e + 1)]);
      }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  }
}

// extra_rows (ops.h): one more group after the experts' slots, tokens 0 .. extra_rows - 1 in
// order; the experts' part of the plan is route_plan's without it.
TEST(MoeOps, RoutePlanExtraRowsAreOneMoreGroupOfTheFirstTokens) {
  const int64_t N = 23, E = 5, k = 2;
  const Tensor idx = random_routing(N, E, k, 870);
  const ops::RoutePlan base = ops::route_plan(idx, E);
  for (const int64_t extra : {int64_t(0), int64_t(1), int64_t(N)}) {
    const ops::RoutePlan plan = ops::route_plan_end(ops::route_plan_begin(idx, E, Tensor(), true, extra));
    std::vector<int64_t> want = base.offsets;
    if (extra > 0) want.push_back(N * k + extra);
    EXPECT_EQ(plan.offsets, want) << extra;
    ASSERT_EQ(plan.token_of_slot.numel(), N * k + extra);
    EXPECT_EQ(0, std::memcmp(plan.token_of_slot.raw(), base.token_of_slot.raw(), size_t(N * k) * sizeof(int32_t)));
    for (int64_t t = 0; t < extra; ++t) EXPECT_EQ(plan.token_of_slot.data<int32_t>()[N * k + t], t);
    EXPECT_EQ(0, std::memcmp(plan.slot_of.raw(), base.slot_of.raw(), size_t(N * k) * sizeof(int32_t)));
  }
  for (const int64_t bad : {int64_t(-1), N + 1})
    EXPECT_NE(testutil::error_of([&] { ops::route_plan_begin(idx, E, Tensor(), true, bad); })
                  .find("route_plan: extra_rows must be in [0, N=23] (rows of the tokens), got"),
              std::string::npos);
}

TEST(MoeOps, GatherAndCombineOnRandomRoutings) {
  const int64_t N = 37, E = 5, k = 2, D = 12;
  const Tensor idx = random_routing(N, E, k, 900);
  const ops::RoutePlan plan = ops::route_plan(idx, E);
  const Tensor x = random_tensor({N, D}, DType::F32, 901);
  Tensor xp = Tensor::empty({N * k, D}, DType::F32);
  ops::gather_rows(x, plan.token_of_slot, xp);
  for (int64_t s = 0; s < N * k; ++s)
    EXPECT_TRUE(bitwise_equal_range(xp, s * D, x, plan.token_of_slot.data<int32_t>()[s] * D, D));
  // Combining the gathered rows with weights w gives (sum_j w_j) x in rank order.
  const Tensor w = random_tensor({N, k}, DType::F32, 902, 0.0, 1.0);
  Tensor out = Tensor::empty({N, D}, DType::F32);
  ops::moe_combine(xp, plan.slot_of, w, out);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) {
      float want = 0.0f;
      for (int64_t j = 0; j < k; ++j) want += w.data<float>()[n * k + j] * x.data<float>()[n * D + d];
      ASSERT_EQ(out.data<float>()[n * D + d], want) << n << " " << d;
    }
  // plus: the sum, then + plus (add_'s bits)
  const Tensor plus = random_tensor({N, D}, DType::F32, 903);
  Tensor out_plus = Tensor::empty({N, D}, DType::F32), want_plus = out.clone();
  ops::add_(want_plus, plus);
  ops::moe_combine(xp, plan.slot_of, w, out_plus, &plus);
  EXPECT_TRUE(bitwise_equal(out_plus, want_plus));
  const Tensor plus_short = random_tensor({N - 1, D}, DType::F32, 904);
  expect_error([&] { ops::moe_combine(xp, plan.slot_of, w, out_plus, &plus_short); },
               "moe_combine: plus must match out");
  // gather_rows_backward of the gathered rows sums k copies of each token row.
  Tensor dx = Tensor::empty({N, D}, DType::F32);
  ops::gather_rows_backward(xp, plan.slot_of, dx);
  for (int64_t i = 0; i < N * D; ++i) ASSERT_EQ(dx.data<float>()[i], 2.0f * x.data<float>()[i]);
}

// scatter_rows writes row s to dst_rows[s] and leaves the other rows alone (the KV-cache write);
// it takes any dtype and refuses repeated or out-of-range rows.
TEST(MoeOps, ScatterRowsWritesOnlyItsRows) {
  const int64_t N = 9, M = 4, D = 6;
  const Tensor x = random_tensor({M, D}, DType::F32, 950);
  Tensor out = random_tensor({N, D}, DType::F32, 951);
  const Tensor before = out.clone();
  const std::vector<int32_t> dst = {7, 0, 3, 8};
  ops::scatter_rows(x, int_tensor(dst, {M}), out);
  for (int64_t n = 0; n < N; ++n) {
    const auto it = std::find(dst.begin(), dst.end(), int32_t(n));
    if (it == dst.end()) EXPECT_TRUE(bitwise_equal_range(out, n * D, before, n * D, D)) << n;
    else EXPECT_TRUE(bitwise_equal_range(out, n * D, x, (it - dst.begin()) * D, D)) << n;
  }
  std::vector<uint8_t> bytes = {1, 2, 3, 4, 5, 6};
  Tensor ob = Tensor::zeros({3, 3}, DType::U8);
  ops::scatter_rows(Tensor::from_host(bytes.data(), {2, 3}, DType::U8), int_tensor({2, 0}, {2}), ob);
  EXPECT_EQ((std::vector<uint8_t>(ob.data<uint8_t>(), ob.data<uint8_t>() + 9)),
            (std::vector<uint8_t>{4, 5, 6, 0, 0, 0, 1, 2, 3}));
  expect_error([&] { ops::scatter_rows(x, int_tensor({1, 2, 1, 3}, {M}), out); },
               "scatter_rows: dst_rows[2] = 1 repeats an earlier entry");
  expect_error([&] { ops::scatter_rows(x, int_tensor({1, 2, 9, 3}, {M}), out); },
               "scatter_rows: dst_rows[2] = 9 is outside [0, N=9)");
  Tensor narrow = Tensor::empty({N, D - 1}, DType::F32);
  expect_error([&] { ops::scatter_rows(x, int_tensor(dst, {M}), narrow); },
               "scatter_rows: x must be f32[M, D]=[4, 5] cpu, got f32[4, 6] cpu");
}

TEST(MoeOps, GradCheckCombineAndGatherBackward) {
  const int64_t N = 6, E = 4, k = 2, D = 5;
  const Tensor idx = random_routing(N, E, k, 1000);
  const ops::RoutePlan plan = ops::route_plan(idx, E);
  Tensor yp = random_tensor({N * k, D}, DType::F64, 1001);
  Tensor w = random_tensor({N, k}, DType::F64, 1002);
  Tensor out = Tensor::empty({N, D}, DType::F64), r = random_tensor({N, D}, DType::F64, 1003);
  auto fwd = [&] { ops::moe_combine(yp, plan.slot_of, w, out); };
  fwd();
  Tensor dyp = Tensor::empty({N * k, D}, DType::F64), dw = Tensor::empty({N, k}, DType::F64);
  ops::moe_combine_backward(r, yp, plan.slot_of, w, dyp, dw);
  report("moe_combine dy_perm", fd_check(yp, dyp, {{&out, &r}}, fwd));
  report("moe_combine dw", fd_check(w, dw, {{&out, &r}}, fwd));

  Tensor x = random_tensor({N, D}, DType::F64, 1004);
  Tensor xp = Tensor::empty({N * k, D}, DType::F64), rp = random_tensor({N * k, D}, DType::F64, 1005);
  auto gather = [&] { ops::gather_rows(x, plan.token_of_slot, xp); };
  gather();
  Tensor dx = Tensor::empty({N, D}, DType::F64);
  ops::gather_rows_backward(rp, plan.slot_of, dx);
  report("gather_rows_backward dx", fd_check(x, dx, {{&xp, &rp}}, gather));
}

TEST(MoeOps, QTensorGatherCopiesExactBytes) {
  const int64_t N = 19, C = 64, E = 4, k = 2;
  const Tensor x = random_tensor({N, C}, DType::F32, 1100, -3.0, 3.0);
  QuantSpec spec;
  spec.fmt = Format::NVFP4;
  spec.outer = OuterScale::PerRow;
  const QTensor q = ops::quantize(x, spec);
  const ops::RoutePlan plan = ops::route_plan(random_routing(N, E, k, 1101), E);
  const QTensor g = ops::gather_rows(q, plan.token_of_slot);
  ASSERT_EQ(g.rows, N * k);
  EXPECT_EQ(g.cols, q.cols);
  EXPECT_EQ(g.fmt, q.fmt);
  EXPECT_EQ(g.outer, OuterScale::PerRow);
  ASSERT_EQ(g.codes.shape(), (Shape{N * k, q.code_row_bytes()}));
  ASSERT_EQ(g.block_scales.shape(), (Shape{N * k, q.blocks_per_row()}));
  ASSERT_EQ(g.outer_scales.shape(), (Shape{N * k}));
  const Tensor xq = ops::dequantize(q), gq = ops::dequantize(g);
  for (int64_t s = 0; s < N * k; ++s) {
    const int64_t n = plan.token_of_slot.data<int32_t>()[s];
    EXPECT_TRUE(bitwise_equal_range(g.codes, s * q.code_row_bytes(), q.codes,
                                    n * q.code_row_bytes(), q.code_row_bytes()));
    EXPECT_TRUE(bitwise_equal_range(g.block_scales, s * q.blocks_per_row(), q.block_scales,
                                    n * q.blocks_per_row(), q.blocks_per_row()));
    EXPECT_TRUE(bitwise_equal_range(g.outer_scales, s, q.outer_scales, n, 1));
    EXPECT_TRUE(bitwise_equal_range(gq, s * C, xq, n * C, C));
  }
  // A tensor-scale QTensor keeps its one scale.
  spec.outer = OuterScale::Tensor;
  const QTensor qt = ops::quantize(x, spec);
  const QTensor gt = ops::gather_rows(qt, plan.token_of_slot);
  EXPECT_TRUE(bitwise_equal(gt.outer_scales, qt.outer_scales));
}

TEST(MoeOps, Errors) {
  expect_error([&] { ops::route_plan(int_tensor({0, 1, 4, 2}, {2, 2}), 4); },
               "route_plan: topk_idx[1, 0] = 4 is outside [0, n_experts=4)");
  const Tensor x = random_tensor({4, 3}, DType::F32, 1200);
  Tensor xp = Tensor::empty({2, 3}, DType::F32);
  expect_error([&] { ops::gather_rows(x, int_tensor({0, 4}, {2}), xp); },
               "gather_rows: token_of_slot[1] = 4 is outside [0, N=4)");
  Tensor out = Tensor::empty({4, 3}, DType::F32);
  expect_error([&] {
    ops::moe_combine(xp, int_tensor({0, 1, 1, 0, 0, 1, 1, 0}, {4, 2}),
                     random_tensor({4, 3}, DType::F32, 1), out);
  }, "moe_combine: w must be f32[N, k]=[4, 2] cpu, got f32[4, 3] cpu");
}
