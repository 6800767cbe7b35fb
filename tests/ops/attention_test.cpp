// defines: the CPU attention tests
// Causal GQA attention on the CPU: forward against an explicit softmax matrix, finite-difference
// gradients (dq, dk, dv; GQA and MHA), the KV-cache contract (one-token decode and chunked prefill
// give the training forward's bits), batch invariance and thread-count determinism.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "fourbit/ops/ops.h"
#include "ops/op_test_util.h"

using namespace fourbit;
using namespace fourbit::optest;

namespace {

struct Qkv {
  Tensor q, k, v;
};

Qkv random_qkv(int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t hd, DType dt,
               uint64_t seed) {
  return {random_tensor({B, T, Hq, hd}, dt, seed, -1.5, 1.5),
          random_tensor({B, S, Hkv, hd}, dt, seed + 1, -1.5, 1.5),
          random_tensor({B, S, Hkv, hd}, dt, seed + 2)};
}

struct Result {
  Tensor out, lse;
};

Result forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2);
  Result r{Tensor::empty(q.shape(), q.dtype()), Tensor::empty({B, Hq, T}, q.dtype())};
  ops::attention_forward(q, k, v, pos0, r.out, r.lse);
  return r;
}

// Naive reference: the full [T, S] score matrix, masked, softmax by rows, times V.
void reference(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0,
               std::vector<double>& out, std::vector<double>& lse) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), hd = q.size(3);
  const int64_t S = k.size(1), Hkv = k.size(2);
  out.assign(size_t(q.numel()), 0.0);
  lse.assign(size_t(B * Hq * T), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      std::vector<double> P(static_cast<size_t>(T * S));
      for (int64_t t = 0; t < T; ++t) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          double s = -INFINITY;
          if (j <= pos0 + t) {
            s = 0.0;
            for (int64_t d = 0; d < hd; ++d)
              s += at(q, ((b * T + t) * Hq + h) * hd + d) * at(k, ((b * S + j) * Hkv + g) * hd + d);
            s /= std::sqrt(double(hd));
          }
          P[size_t(t * S + j)] = s;
          mx = std::max(mx, s);
        }
        double z = 0.0;
        for (int64_t j = 0; j < S; ++j) z += std::exp(P[size_t(t * S + j)] - mx);
        for (int64_t j = 0; j < S; ++j) P[size_t(t * S + j)] = std::exp(P[size_t(t * S + j)] - mx) / z;
        lse[size_t((b * Hq + h) * T + t)] = mx + std::log(z);
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < hd; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j < S; ++j)
            acc += P[size_t(t * S + j)] * at(v, ((b * S + j) * Hkv + g) * hd + d);
          out[size_t(((b * T + t) * Hq + h) * hd + d)] = acc;
        }
    }
}

}  // namespace

TEST(AttentionOps, ForwardMatchesReference) {
  struct Case {
    int64_t B, T, S, Hq, Hkv, hd, pos0;
  };
  for (DType dt : {DType::F64, DType::F32})
    for (const Case& c : {Case{2, 6, 6, 4, 2, 8, 0}, Case{1, 5, 5, 2, 2, 16, 0},
                          Case{2, 3, 9, 4, 1, 8, 4}}) {
      const Qkv x = random_qkv(c.B, c.T, c.S, c.Hq, c.Hkv, c.hd, dt, 100);
      const Result r = forward(x.q, x.k, x.v, c.pos0);
      std::vector<double> out, lse;
      reference(x.q, x.k, x.v, c.pos0, out, lse);
      const double tol = dt == DType::F64 ? 1e-13 : 1e-6;
      EXPECT_LT(max_rel_err(r.out, out, 1e-2), tol) << dtype_name(dt) << " Hq " << c.Hq;
      EXPECT_LT(max_rel_err(r.lse, lse, 1e-2), tol) << dtype_name(dt) << " Hq " << c.Hq;
    }
}

namespace {

void grad_check(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, const char* name) {
  Qkv x = random_qkv(B, T, T, Hq, Hkv, hd, DType::F64, 200);
  Tensor out = Tensor::empty(x.q.shape(), DType::F64), lse = Tensor::empty({B, Hq, T}, DType::F64);
  auto fwd = [&] { ops::attention_forward(x.q, x.k, x.v, 0, out, lse); };
  fwd();
  Tensor r = random_tensor(out.shape(), DType::F64, 210);
  Tensor dq = Tensor::empty(x.q.shape(), DType::F64), dk = Tensor::empty(x.k.shape(), DType::F64),
         dv = Tensor::empty(x.v.shape(), DType::F64);
  ops::attention_backward(r, x.q, x.k, x.v, out, lse, dq, dk, dv);
  const double eq = fd_check(x.q, dq, {{&out, &r}}, fwd);
  const double ek = fd_check(x.k, dk, {{&out, &r}}, fwd);
  const double ev = fd_check(x.v, dv, {{&out, &r}}, fwd);
  std::printf("[ fd       ] attention %-24s worst rel err dq %.3g dk %.3g dv %.3g\n", name, eq,
              ek, ev);
}

}  // namespace

TEST(AttentionOps, GradCheckGqa) { grad_check(2, 5, 4, 2, 8, "GQA Hq=4 Hkv=2"); }
TEST(AttentionOps, GradCheckMha) { grad_check(1, 6, 2, 2, 8, "MHA Hq=Hkv=2"); }

TEST(AttentionOps, KvCacheDecodeAndPrefillAreBitwise) {
  const int64_t T = 9, Hq = 4, Hkv = 2, hd = 16;
  for (int64_t B : {1, 3}) {
    const Qkv x = random_qkv(B, T, T, Hq, Hkv, hd, DType::F32, 300 + uint64_t(B));
    const Result full = forward(x.q, x.k, x.v, 0);
    auto expect_rows = [&](const Result& part, int64_t t0, int64_t n, const char* what) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          EXPECT_TRUE(bitwise_equal_range(part.lse, (b * Hq + h) * n, full.lse,
                                          (b * Hq + h) * T + t0, n))
              << what << " lse b " << b << " h " << h << " t0 " << t0;
      EXPECT_TRUE(bitwise_equal(part.out, time_slice(full.out, t0, t0 + n)))
          << what << " out t0 " << t0;
    };
    // One-token decode against a cache of exactly t + 1 positions.
    for (int64_t t = 0; t < T; ++t) {
      Tensor kc, vc;
      if (B == 1) {  // a prefix of the batch's own K/V is a view
        kc = x.k.view(0, {1, t + 1, Hkv, hd});
        vc = x.v.view(0, {1, t + 1, Hkv, hd});
      } else {
        kc = time_slice(x.k, 0, t + 1);
        vc = time_slice(x.v, 0, t + 1);
      }
      expect_rows(forward(time_slice(x.q, t, t + 1), kc, vc, t), t, 1, "decode");
    }
    // Chunked prefill against a longer cache whose unwritten tail is NaN: never read.
    const int64_t S = T + 4;
    Tensor kc = Tensor::empty({B, S, Hkv, hd}, DType::F32), vc = kc.clone();
    ops::fill_(kc, std::numeric_limits<double>::quiet_NaN());
    ops::fill_(vc, std::numeric_limits<double>::quiet_NaN());
    for (int64_t b = 0; b < B; ++b) {
      kc.view(b * S * Hkv * hd, {T * Hkv * hd}).copy_from(x.k.view(b * T * Hkv * hd, {T * Hkv * hd}));
      vc.view(b * S * Hkv * hd, {T * Hkv * hd}).copy_from(x.v.view(b * T * Hkv * hd, {T * Hkv * hd}));
    }
    for (int64_t t0 : {0, 4, 7}) {
      const int64_t t1 = std::min(T, t0 + 4);
      expect_rows(forward(time_slice(x.q, t0, t1), kc, vc, t0), t0, t1 - t0, "prefill");
    }
  }
}

TEST(AttentionOps, BatchInvariant) {
  const int64_t T = 11, Hq = 4, Hkv = 2, hd = 16;
  const Qkv x8 = random_qkv(8, T, T, Hq, Hkv, hd, DType::F32, 400);
  const Qkv x1{x8.q.slice_rows(0, 1).clone(), x8.k.slice_rows(0, 1).clone(),
               x8.v.slice_rows(0, 1).clone()};
  const Result r8 = forward(x8.q, x8.k, x8.v, 0), r1 = forward(x1.q, x1.k, x1.v, 0);
  EXPECT_TRUE(bitwise_equal_range(r1.out, 0, r8.out, 0, r1.out.numel()));
  EXPECT_TRUE(bitwise_equal_range(r1.lse, 0, r8.lse, 0, r1.lse.numel()));
}

TEST(AttentionOps, BackwardIsThreadCountInvariant) {
  const int64_t B = 2, T = 33, Hq = 4, Hkv = 2, hd = 16;
  const Qkv x = random_qkv(B, T, T, Hq, Hkv, hd, DType::F32, 500);
  const Result r = forward(x.q, x.k, x.v, 0);
  const Tensor dout = random_tensor(x.q.shape(), DType::F32, 510);
  Tensor dq[2], dk[2], dv[2];
  for (int i = 0; i < 2; ++i) {
    dq[i] = Tensor::empty(x.q.shape(), DType::F32);
    dk[i] = Tensor::empty(x.k.shape(), DType::F32);
    dv[i] = Tensor::empty(x.v.shape(), DType::F32);
    with_threads(i + 1, [&] {
      ops::attention_backward(dout, x.q, x.k, x.v, r.out, r.lse, dq[i], dk[i], dv[i]);
    });
  }
  EXPECT_TRUE(bitwise_equal(dk[0], dk[1]));
  EXPECT_TRUE(bitwise_equal(dv[0], dv[1]));
  EXPECT_TRUE(bitwise_equal(dq[0], dq[1]));
}

TEST(AttentionOps, Errors) {
  const Qkv x = random_qkv(2, 4, 4, 4, 2, 8, DType::F32, 600);
  Tensor out = Tensor::empty(x.q.shape(), DType::F32), lse = Tensor::empty({2, 4, 4}, DType::F32);
  Tensor k_bad = random_tensor({2, 4, 2, 16}, DType::F32, 1);
  expect_error([&] { ops::attention_forward(x.q, k_bad, x.v, 0, out, lse); },
               "attention_forward: k must be f32[B, S, Hkv, hd] with B=2, hd=8");
  Tensor k3 = random_tensor({2, 4, 3, 8}, DType::F32, 2);
  expect_error([&] { ops::attention_forward(x.q, k3, k3, 0, out, lse); },
               "Hq=4 must be a multiple of kv heads Hkv=3");
  expect_error([&] { ops::attention_forward(x.q, x.k, x.v, 1, out, lse); },
               "k/v hold S=4 positions but queries at pos0=1 with T=4 need S >= 5");
  Tensor lse_bad = Tensor::empty({2, 4, 5}, DType::F32);
  expect_error([&] { ops::attention_forward(x.q, x.k, x.v, 0, out, lse_bad); },
               "attention_forward: lse must be f32[B, Hq, T]=[2, 4, 4] cpu, got f32[2, 4, 5] cpu");
}

// attention_step (a decode step over sequences at their own positions, read from a tensor): row b
// is the bits of attention_forward on that row alone at pos0 = positions[b], with repeated,
// ascending and scattered positions (runs of equal ones go together on the CPU), the BF16 copy of
// out too; a position outside the keys and bad shapes fail naming the argument.
TEST(AttentionOps, StepIsEachRowAtItsOwnPosition) {
  const int64_t B = 6, S = 20, Hq = 4, Hkv = 2, hd = 8;
  const Qkv x = random_qkv(B, 1, S, Hq, Hkv, hd, DType::F32, 700);
  const std::vector<int32_t> pos{3, 3, 0, 19, 7, 7};
  const Tensor positions = int_tensor(pos, {B});
  Tensor out = Tensor::empty(x.q.shape(), DType::F32), lse = Tensor::empty({B, Hq, 1}, DType::F32),
         out16 = Tensor::empty(x.q.shape(), DType::BF16);
  ops::attention_step(x.q, x.k, x.v, positions, out, lse, &out16);
  for (int64_t b = 0; b < B; ++b) {
    Tensor o = Tensor::empty({1, 1, Hq, hd}, DType::F32), l = Tensor::empty({1, Hq, 1}, DType::F32),
           o16 = Tensor::empty({1, 1, Hq, hd}, DType::BF16);
    ops::attention_forward(x.q.slice_rows(b, b + 1), x.k.slice_rows(b, b + 1), x.v.slice_rows(b, b + 1),
                           pos[size_t(b)], o, l, &o16);
    EXPECT_TRUE(bitwise_equal_range(out, b * Hq * hd, o, 0, Hq * hd)) << "row " << b;
    EXPECT_TRUE(bitwise_equal_range(lse, b * Hq, l, 0, Hq)) << "row " << b;
    EXPECT_EQ(0, std::memcmp(static_cast<const char*>(out16.raw()) + b * Hq * hd * 2, o16.raw(), size_t(Hq * hd * 2)))
        << "row " << b;
  }
  expect_error([&] { ops::attention_step(x.q, x.k, x.v, int_tensor({3, 3, 0, 20, 7, 7}, {B}), out, lse); },
               "attention_step: positions[3] = 20 is outside [0, S=20)");
  expect_error([&] { ops::attention_step(x.q, x.k, x.v, int_tensor({3, 3, 0}, {3}), out, lse); },
               "attention_step: positions must be i32 [6] on q's device (cpu), got i32[3] cpu");
  const Qkv two = random_qkv(B, 2, S, Hq, Hkv, hd, DType::F32, 710);
  expect_error([&] { ops::attention_step(two.q, two.k, two.v, positions, out, lse); },
               "attention_step: q must be [B, 1, Hq, hd]");
  Tensor lse_bad = Tensor::empty({B, Hq, 2}, DType::F32);
  expect_error([&] { ops::attention_step(x.q, x.k, x.v, positions, out, lse_bad); },
               "attention_step: out must be [6, 1, 4, 8] and lse [6, 4, 1]");
}

// attention_step with a quantized out (ops.h "Quantized outputs"): on the CPU the step, then
// quantize of out's [B, Hq * hd] rows, the same bits; a request with nowhere to put it, or a spec
// whose blocks do not run along the rows, fails naming it.
TEST(AttentionOps, StepQuantizedOutputIsTheStepThenQuantize) {
  const int64_t B = 3, S = 40, Hq = 4, Hkv = 2, hd = 32;
  const Qkv x = random_qkv(B, 1, S, Hq, Hkv, hd, DType::F32, 720);
  const Tensor positions = int_tensor({5, 39, 0}, {B});
  Tensor out_ref = Tensor::empty(x.q.shape(), DType::F32), lse_ref = Tensor::empty({B, Hq, 1}, DType::F32);
  ops::attention_step(x.q, x.k, x.v, positions, out_ref, lse_ref);
  for (const Format f : {Format::MXFP8_E4M3, Format::NVFP4}) {
    QuantSpec spec;
    spec.fmt = f;
    spec.outer = f == Format::NVFP4 ? OuterScale::PerRow : OuterScale::None;
    QTensor q;
    const ops::RowQuant rq{spec, ops::RngKey{3, 4}, &q};
    Tensor out = Tensor::empty(x.q.shape(), DType::F32), lse = Tensor::empty({B, Hq, 1}, DType::F32);
    ops::attention_step(x.q, x.k, x.v, positions, out, lse, nullptr, &rq);
    EXPECT_TRUE(bitwise_equal(out, out_ref));
    EXPECT_TRUE(bitwise_equal(lse, lse_ref));
    const QTensor want = ops::quantize(out_ref.reshape({B, Hq * hd}), spec, rq.rng);
    EXPECT_EQ(q.logical_shape(), want.logical_shape());
    EXPECT_TRUE(bitwise_equal(q.codes, want.codes));
    EXPECT_TRUE(bitwise_equal(q.block_scales, want.block_scales));
  }
  Tensor out = Tensor::empty(x.q.shape(), DType::F32), lse = Tensor::empty({B, Hq, 1}, DType::F32);
  QuantSpec spec;
  spec.fmt = Format::MXFP8_E4M3;
  const ops::RowQuant nowhere{spec, ops::RngKey{}, nullptr};
  expect_error([&] { ops::attention_step(x.q, x.k, x.v, positions, out, lse, nullptr, &nowhere); },
               "attention_step: the quantized out has nowhere to go (RowQuant::out is null)");
  QTensor q;
  spec.axis = BlockAxis::Col;
  const ops::RowQuant cols{spec, ops::RngKey{}, &q};
  expect_error([&] { ops::attention_step(x.q, x.k, x.v, positions, out, lse, nullptr, &cols); },
               "attention_step: the quantized out needs a block-scaled Row-axis spec");
}
