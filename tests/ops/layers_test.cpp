// defines: the CPU layer op tests
// The CPU layer ops of layers.cpp, tensor_utils.cpp and adamw.cpp: finite-difference gradient
// checks in F64, forward checks against naive double references, batch invariance and thread-count
// determinism (bitwise), AdamW against its formula, and the error messages of bad arguments.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "fourbit/numerics/bf16.h"
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

// ---- tensor utilities -----------------------------------------------------------------------------

TEST(LayerUtils, ConvertRoundsOnceToBf16) {
  Tensor x = random_tensor({1000}, DType::F32, 1, -100.0, 100.0);
  Tensor b = Tensor::empty({1000}, DType::BF16);
  ops::convert(x, b);
  for (int64_t i = 0; i < 1000; ++i)
    ASSERT_EQ(b.data<uint16_t>()[i], num::bf16_encode(x.data<float>()[i])) << i;
  Tensor back = Tensor::empty({10, 100}, DType::F32);
  ops::convert(b, back);
  for (int64_t i = 0; i < 1000; ++i)
    ASSERT_EQ(back.data<float>()[i], num::bf16_decode(b.data<uint16_t>()[i]));
  // 1 + 2^-8 + 2^-30 lies just above the bf16 tie 1 + 2^-8: rounding through float would land
  // on the tie and go to even (1.0); one rounding gives 1 + 2^-7.
  const double above_tie = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  Tensor d = Tensor::from_host(&above_tie, {1}, DType::F64);
  Tensor h = Tensor::empty({1}, DType::BF16);
  ops::convert(d, h);
  EXPECT_EQ(h.data<uint16_t>()[0], 0x3F81);
  Tensor f = Tensor::empty({1}, DType::F32);
  ops::convert(d, f);
  EXPECT_EQ(f.data<float>()[0], float(above_tie));
}

TEST(LayerUtils, AddScaleFillSumSquares) {
  Tensor a = random_tensor({300, 200}, DType::F32, 2);
  Tensor b = random_tensor({300, 200}, DType::F32, 3);
  Tensor c = a.clone();
  ops::add_(c, b);
  for (int64_t i = 0; i < a.numel(); ++i)
    ASSERT_EQ(c.data<float>()[i], a.data<float>()[i] + b.data<float>()[i]);
  ops::scale_(c, 0.25);
  for (int64_t i = 0; i < a.numel(); ++i)
    ASSERT_EQ(c.data<float>()[i], (a.data<float>()[i] + b.data<float>()[i]) * 0.25f);
  double naive = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) naive += double(a.data<float>()[i]) * a.data<float>()[i];
  double s1 = 0.0, s2 = 0.0;
  with_threads(1, [&] { s1 = ops::sum_squares(a); });
  with_threads(2, [&] { s2 = ops::sum_squares(a); });
  EXPECT_EQ(s1, s2);
  EXPECT_NEAR(s1, naive, 1e-10 * naive);
  ops::fill_(c, 1.5);
  EXPECT_EQ(ops::sum_squares(c), 2.25 * double(c.numel()));
  // sum_squares_each: each tensor's own sum_squares, empty tensors 0, order kept
  const Tensor empty = Tensor::empty({0}, DType::F32);
  const std::vector<double> each = ops::sum_squares_each({a, empty, c});
  ASSERT_EQ(each.size(), 3u);
  EXPECT_EQ(each[0], s1);
  EXPECT_EQ(each[1], 0.0);
  EXPECT_EQ(each[2], ops::sum_squares(c));
  EXPECT_TRUE(ops::sum_squares_each({}).empty());
  expect_error([&] { ops::sum_squares_each({a, Tensor()}); }, "sum_squares_each: tensor 1 is undefined");
  expect_error([&] { ops::add_(c, random_tensor({200, 300}, DType::F32, 4)); },
               "add_: src must match dst f32[300, 200] cpu");
}

// ---- embedding ------------------------------------------------------------------------------------

TEST(EmbeddingOps, ForwardCopiesRowsAndGradCheck) {
  const int64_t V = 7, D = 5;
  Tensor table = random_tensor({V, D}, DType::F64, 10);
  Tensor tokens = int_tensor({3, 0, 3, 6, 1, 3, 0, 2, 5}, {9});
  Tensor out = Tensor::empty({9, D}, DType::F64);
  Tensor r = random_tensor({9, D}, DType::F64, 11);
  auto fwd = [&] { ops::embedding_forward(tokens, table, out); };
  fwd();
  for (int64_t n = 0; n < 9; ++n)
    EXPECT_TRUE(bitwise_equal_range(out, n * D, table, tokens.data<int32_t>()[n] * D, D));
  Tensor dtable = Tensor::zeros({V, D}, DType::F64);
  ops::embedding_backward(r, tokens, dtable);
  const double worst = fd_check(table, dtable, {{&out, &r}}, fwd);
  report("embedding dtable", worst);
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dtable.data<double>()[4 * D + d], 0.0);  // unused row
}

TEST(EmbeddingOps, BackwardIsThreadCountInvariant) {
  const int64_t N = 3000, V = 50, D = 33;
  Tensor tokens = random_ints({N}, 0, V, 12);
  Tensor dout = random_tensor({N, D}, DType::F32, 13);
  Tensor init = random_tensor({V, D}, DType::F32, 14);
  Tensor d1 = init.clone(), d2 = init.clone();
  with_threads(1, [&] { ops::embedding_backward(dout, tokens, d1); });
  with_threads(2, [&] { ops::embedding_backward(dout, tokens, d2); });
  EXPECT_TRUE(bitwise_equal(d1, d2));
}

TEST(EmbeddingOps, Errors) {
  Tensor table = random_tensor({7, 4}, DType::F32, 15);
  Tensor out = Tensor::empty({3, 4}, DType::F32);
  expect_error([&] { ops::embedding_forward(int_tensor({1, 2, 9}, {3}), table, out); },
               "embedding_forward: tokens[2] = 9 is outside [0, V=7)");
  Tensor bad_out = Tensor::empty({3, 5}, DType::F32);
  expect_error([&] { ops::embedding_forward(int_tensor({1, 2, 3}, {3}), table, bad_out); },
               "embedding_forward: out must be f32[N, D]=[3, 4] cpu, got f32[3, 5] cpu");
}

// ---- rmsnorm --------------------------------------------------------------------------------------

namespace {

std::vector<double> rmsnorm_reference(const Tensor& x, const Tensor& w, double eps) {
  const int64_t N = x.size(0), D = x.size(1);
  std::vector<double> y(static_cast<size_t>(N * D));
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += at(x, n * D + d) * at(x, n * D + d);
    const double rs = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t d = 0; d < D; ++d) y[size_t(n * D + d)] = at(x, n * D + d) * rs * at(w, d);
  }
  return y;
}

}  // namespace

TEST(RmsNormOps, ForwardMatchesReference) {
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor x = random_tensor({6, 48}, dt, 20, -2.0, 2.0);
    Tensor w = random_tensor({48}, dt, 21, 0.5, 1.5);
    Tensor y = Tensor::empty({6, 48}, dt), rstd = Tensor::empty({6}, dt);
    ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
    const double err = max_rel_err(y, rmsnorm_reference(x, w, double(1e-5f)), 1e-3);
    EXPECT_LT(err, dt == DType::F64 ? 1e-14 : 1e-6) << dtype_name(dt);
  }
}

TEST(RmsNormOps, GradCheck) {
  const int64_t N = 4, D = 8;
  Tensor x = random_tensor({N, D}, DType::F64, 22, -2.0, 2.0);
  Tensor w = random_tensor({D}, DType::F64, 23, 0.5, 1.5);
  Tensor r = random_tensor({N, D}, DType::F64, 24);
  Tensor y = Tensor::empty({N, D}, DType::F64), rstd = Tensor::empty({N}, DType::F64);
  auto fwd = [&] { ops::rmsnorm_forward(x, w, 1e-5f, y, rstd); };
  fwd();
  Tensor dx = Tensor::empty({N, D}, DType::F64), dw = Tensor::zeros({D}, DType::F64);
  ops::rmsnorm_backward(r, x, w, rstd, dx, dw);
  report("rmsnorm dx", fd_check(x, dx, {{&y, &r}}, fwd));
  report("rmsnorm dw", fd_check(w, dw, {{&y, &r}}, fwd));
  // dw accumulates: a second backward adds the same sum again.
  Tensor dw2 = dw.clone();
  ops::rmsnorm_backward(r, x, w, rstd, dx, dw2);
  for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(at(dw2, d), 2.0 * at(dw, d), 1e-14);
}

TEST(RmsNormOps, BatchInvariantAndThreadCountInvariant) {
  const int64_t T = 37, D = 96;
  Tensor x8 = random_tensor({8 * T, D}, DType::F32, 25, -3.0, 3.0);
  Tensor x1 = x8.slice_rows(0, T).clone();
  Tensor w = random_tensor({D}, DType::F32, 26, 0.5, 1.5);
  Tensor y1 = Tensor::empty({T, D}, DType::F32), r1 = Tensor::empty({T}, DType::F32);
  Tensor y8 = Tensor::empty({8 * T, D}, DType::F32), r8 = Tensor::empty({8 * T}, DType::F32);
  ops::rmsnorm_forward(x1, w, 1e-6f, y1, r1);
  ops::rmsnorm_forward(x8, w, 1e-6f, y8, r8);
  EXPECT_TRUE(bitwise_equal_range(y1, 0, y8, 0, T * D));
  EXPECT_TRUE(bitwise_equal_range(r1, 0, r8, 0, T));

  Tensor dy = random_tensor({8 * T, D}, DType::F32, 27);
  Tensor dx1 = Tensor::empty({8 * T, D}, DType::F32), dx2 = dx1.clone();
  Tensor dw1 = Tensor::zeros({D}, DType::F32), dw2 = Tensor::zeros({D}, DType::F32);
  with_threads(1, [&] { ops::rmsnorm_backward(dy, x8, w, r8, dx1, dw1); });
  with_threads(2, [&] { ops::rmsnorm_backward(dy, x8, w, r8, dx2, dw2); });
  EXPECT_TRUE(bitwise_equal(dw1, dw2));
  EXPECT_TRUE(bitwise_equal(dx1, dx2));
}

TEST(RmsNormOps, Errors) {
  Tensor x = random_tensor({4, 64}, DType::F32, 28);
  Tensor y = Tensor::empty({4, 64}, DType::F32), rstd = Tensor::empty({4}, DType::F32);
  expect_error([&] { ops::rmsnorm_forward(x, random_tensor({32}, DType::F32, 1), 1e-5f, y, rstd); },
               "rmsnorm_forward: w must be f32[D]=[64] cpu, got f32[32] cpu");
  expect_error([&] { ops::rmsnorm_forward(x, random_tensor({64}, DType::F64, 1), 1e-5f, y, rstd); },
               "rmsnorm_forward: w must be f32[D]=[64] cpu, got f64[64] cpu");
  expect_error([&] { ops::rmsnorm_forward(int_tensor({1, 2}, {2}), x, 1e-5f, y, rstd); },
               "rmsnorm_forward: x must be a 2-D f32 or f64 cpu tensor [N, D], got i32[2] cpu");
}

// The weight gradient of a linear reading an RMSNorm's output (the router's): the bits of the norm
// then the GEMM, accumulating or not, in F32 and F64; bad arguments named.
TEST(RmsNormOps, InputWgradIsTheNormThenTheGemm) {
  for (const DType dt : {DType::F32, DType::F64})
    for (const bool accumulate : {false, true}) {
      const Tensor x = random_tensor({300, 40}, dt, 31), w = random_tensor({40}, dt, 32, 0.5, 1.5);
      const Tensor dy = random_tensor({300, 6}, dt, 33);
      Tensor y = Tensor::empty({300, 40}, dt), rstd = Tensor::empty({300}, dt);
      ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
      Tensor want = random_tensor({6, 40}, dt, 34), got = want.clone();
      ops::gemm(ops::Operand(dy, true), ops::Operand(y, true), want, accumulate);
      ops::rmsnorm_input_wgrad(dy, x, w, 1e-5f, rstd, got, accumulate);
      EXPECT_TRUE(bitwise_equal(got, want)) << dtype_name(dt) << (accumulate ? " accumulating" : "");
    }
  const Tensor x = random_tensor({8, 16}, DType::F32, 35), w = random_tensor({16}, DType::F32, 36);
  const Tensor dy = random_tensor({8, 3}, DType::F32, 37), rstd = random_tensor({8}, DType::F32, 38);
  Tensor dw = Tensor::empty({3, 16}, DType::F32), wrong = Tensor::empty({3, 15}, DType::F32);
  expect_error([&] { ops::rmsnorm_input_wgrad(dy, x, w, 1e-5f, rstd, wrong, false); },
               "rmsnorm_input_wgrad: dw must be [3, 16], got f32[3, 15] cpu");
  expect_error([&] { ops::rmsnorm_input_wgrad(dy, x, w, 1e-5f, random_tensor({7}, DType::F32, 1), dw, false); },
               "rmsnorm_input_wgrad: rstd must be [8], one a row of x, got f32[7] cpu");
  expect_error([&] { ops::rmsnorm_input_wgrad(dy, x, random_tensor({16}, DType::F64, 1), 1e-5f, rstd, dw, false); },
               "rmsnorm_input_wgrad: every tensor must be f32 on the cpu like x, got f64[16] cpu");
}

// A quantized output (ops.h "Quantized outputs"): on the CPU the op, then quantize, the same bits
// as calling the two; the request is checked before anything runs (somewhere to put it, a
// block-scaled Row-axis spec, an F32 [rows, cols] output).
TEST(RmsNormOps, QuantizedOutputIsTheNormThenQuantize) {
  const Tensor a = random_tensor({5, 96}, DType::F32, 30, -2.0, 2.0), b = random_tensor({5, 96}, DType::F32, 31);
  const Tensor w = random_tensor({96}, DType::F32, 32, 0.5, 1.5);
  QuantSpec nv;
  nv.fmt = Format::NVFP4;
  nv.outer = OuterScale::PerRow;
  nv.four_over_six = true;
  Tensor sum = Tensor::empty({5, 96}, DType::F32), y = sum.clone(), y_ref = sum.clone(), sum_ref = sum.clone();
  Tensor r = Tensor::empty({5}, DType::F32), r_ref = r.clone();
  ops::add_rmsnorm_forward(a, b, sum_ref, w, 1e-5f, y_ref, r_ref);
  QTensor q;
  const ops::RowQuant rq{nv, ops::RngKey{3, 4}, &q};
  ops::add_rmsnorm_forward(a, b, sum, w, 1e-5f, y, r, nullptr, &rq);
  EXPECT_TRUE(bitwise_equal(y, y_ref));
  const QTensor want = ops::quantize(y_ref, nv, rq.rng);
  EXPECT_TRUE(bitwise_equal(q.codes, want.codes) && bitwise_equal(q.block_scales, want.block_scales) &&
              bitwise_equal(q.outer_scales, want.outer_scales));

  QuantSpec mx;
  mx.fmt = Format::MXFP8_E4M3;
  mx.outer = OuterScale::None;
  Tensor h13 = random_tensor({5, 192}, DType::F32, 33, -4.0, 4.0), act = Tensor::empty({5, 96}, DType::F32);
  const ops::RowQuant mx_rq{mx, {}, &q};
  ops::swiglu_forward_fused(h13, act, &mx_rq);
  const QTensor mx_want = ops::quantize(act, mx);
  EXPECT_TRUE(bitwise_equal(q.codes, mx_want.codes) && bitwise_equal(q.block_scales, mx_want.block_scales));

  const ops::RowQuant nowhere{mx, {}, nullptr};
  expect_error([&] { ops::rmsnorm_forward(a, w, 1e-5f, y, r, nullptr, &nowhere); },
               "rmsnorm_forward: the quantized y has nowhere to go (RowQuant::out is null)");
  QuantSpec col = mx;
  col.axis = BlockAxis::Col;
  const ops::RowQuant col_rq{col, {}, &q};
  expect_error([&] { ops::rmsnorm_forward(a, w, 1e-5f, y, r, nullptr, &col_rq); },
               "rmsnorm_forward: the quantized y needs a block-scaled Row-axis spec, got");
  QuantSpec dense;
  dense.fmt = Format::BF16;
  const ops::RowQuant dense_rq{dense, {}, &q};
  expect_error([&] { ops::swiglu_forward_fused(h13, act, &dense_rq); },
               "swiglu_forward_fused: the quantized a needs a block-scaled Row-axis spec, got");
  Tensor y64 = Tensor::empty({5, 96}, DType::F64);
  expect_error([&] {
    ops::rmsnorm_forward(random_tensor({5, 96}, DType::F64, 34), random_tensor({96}, DType::F64, 35), 1e-5f, y64, r,
                         nullptr, &mx_rq);
  }, "rmsnorm_forward: a quantized y needs an f32 [rows, cols] y, got f64[5, 96] cpu");
}

// ---- rope -----------------------------------------------------------------------------------------

TEST(RopeOps, ForwardMatchesRotationAndGradCheck) {
  const int64_t N = 3, H = 2, hd = 8;
  Tensor table = ops::rope_table(16, hd, 10000.0, Device::CPU);
  Tensor pos = int_tensor({0, 5, 15}, {N});
  Tensor x = random_tensor({N, H, hd}, DType::F64, 30);
  Tensor y = Tensor::empty({N, H, hd}, DType::F64);
  auto fwd = [&] {
    y.copy_from(x);
    ops::rope_forward(y, pos, table);
  };
  fwd();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < hd / 2; ++i) {
        const int64_t p = pos.data<int32_t>()[n], o = (n * H + h) * hd;
        const double ang = double(p) * std::pow(10000.0, -double(2 * i) / double(hd));
        const double a = at(x, o + i), b = at(x, o + i + hd / 2);
        EXPECT_NEAR(at(y, o + i), a * std::cos(ang) - b * std::sin(ang), 1e-6);
        EXPECT_NEAR(at(y, o + i + hd / 2), b * std::cos(ang) + a * std::sin(ang), 1e-6);
      }
  Tensor r = random_tensor({N, H, hd}, DType::F64, 31);
  Tensor g = r.clone();
  ops::rope_backward(g, pos, table);
  report("rope dx", fd_check(x, g, {{&y, &r}}, fwd));
  expect_error([&] { ops::rope_forward(y, int_tensor({0, 16, 1}, {N}), table); },
               "rope_forward: positions[1] = 16 is outside [0, max_pos=16)");
}

// rope_qkv_to_cache on the CPU: q's rotated BF16 copy and the cache rows of k's and v's, each the
// BF16 rounding of rope_forward's and v's values; untouched cache rows stay; malformed arguments
// are clear errors. (The GPU's one kernel against the separate ops: CudaLayers.RopeQkvToCache*.)
TEST(RopeOps, QkvToCacheWritesTheRotatedCopies) {
  const int64_t N = 3, Hq = 2, Hkv = 1, hd = 8, R = 5;
  const Tensor table = ops::rope_table(16, hd, 10000.0, Device::CPU);
  const Tensor pos = int_tensor({0, 5, 15}, {N}), dst = int_tensor({4, 0, 2}, {N});
  const Tensor q = random_tensor({N, Hq, hd}, DType::F32, 40), k = random_tensor({N, Hkv, hd}, DType::F32, 41),
               v = random_tensor({N, Hkv, hd}, DType::F32, 42);
  Tensor qb = Tensor::empty({N, Hq, hd}, DType::BF16), kc = Tensor::zeros({R, Hkv, hd}, DType::BF16),
         vc = Tensor::zeros({R, Hkv, hd}, DType::BF16);
  ops::rope_qkv_to_cache(q, k, v, pos, table, dst, qb, kc, vc);
  Tensor qr = q.clone(), kr = k.clone();
  ops::rope_forward(qr, pos, table);
  ops::rope_forward(kr, pos, table);
  const auto bf16_at = [](const Tensor& t, int64_t i) { return num::bf16_decode(t.data<uint16_t>()[i]); };
  for (int64_t i = 0; i < N * Hq * hd; ++i)
    EXPECT_EQ(bf16_at(qb, i), num::bf16_decode(num::bf16_encode(qr.data<float>()[i]))) << "q " << i;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < hd; ++j) {
      const int64_t row = dst.data<int32_t>()[n];
      EXPECT_EQ(bf16_at(kc, row * hd + j), num::bf16_decode(num::bf16_encode(kr.data<float>()[n * hd + j])));
      EXPECT_EQ(bf16_at(vc, row * hd + j), num::bf16_decode(num::bf16_encode(v.data<float>()[n * hd + j])));
    }
  for (int64_t j = 0; j < hd; ++j) EXPECT_EQ(bf16_at(kc, 1 * hd + j), 0.0f) << "cache row 1 is not written";
  Tensor kc_f32 = Tensor::zeros({R, Hkv, hd}, DType::F32);
  expect_error([&] { ops::rope_qkv_to_cache(q, k, v, pos, table, dst, qb, kc_f32, vc); },
               "rope_qkv_to_cache: k_cache must be a bf16 [rows, Hkv=1, hd=8] tensor");
  expect_error([&] { ops::rope_qkv_to_cache(q, k, q, pos, table, dst, qb, kc, vc); },
               "rope_qkv_to_cache: k and v must be [N=3, Hkv, hd=8] alike");
}


// rope_fused_qkv_to_cache on the fused projection's rows writes the bits of rope_qkv_to_cache on
// its three parts: q's copy and the cache rows (the GPU's reading in place:
// CudaLayers.RopeFusedQkvToCacheIsTheThreePartsBits); a row of another head count is refused.
TEST(RopeOps, FusedQkvToCacheIsTheThreePartsBits) {
  const int64_t N = 3, Hq = 4, Hkv = 2, hd = 8, R = 5;
  const Tensor table = ops::rope_table(16, hd, 10000.0, Device::CPU);
  const Tensor pos = int_tensor({0, 5, 15}, {N}), dst = int_tensor({4, 0, 2}, {N});
  const Tensor qkv = random_tensor({N, Hq + 2 * Hkv, hd}, DType::F32, 43);
  Tensor qa = Tensor::empty({N, Hq, hd}, DType::BF16), kca = Tensor::zeros({R, Hkv, hd}, DType::BF16),
         vca = kca.clone();
  const Tensor rows = qkv.reshape({N, (Hq + 2 * Hkv) * hd});
  ops::rope_qkv_to_cache(column_block(rows, 0, Hq * hd).reshape({N, Hq, hd}),
                         column_block(rows, Hq * hd, Hkv * hd).reshape({N, Hkv, hd}),
                         column_block(rows, (Hq + Hkv) * hd, Hkv * hd).reshape({N, Hkv, hd}), pos, table, dst, qa, kca,
                         vca);
  Tensor qf = Tensor::empty({N, Hq, hd}, DType::BF16), kcf = Tensor::zeros({R, Hkv, hd}, DType::BF16),
         vcf = kcf.clone();
  ops::rope_fused_qkv_to_cache(qkv, Hq, pos, table, dst, qf, kcf, vcf);
  EXPECT_TRUE(bitwise_equal(qf, qa));
  EXPECT_TRUE(bitwise_equal(kcf, kca));
  EXPECT_TRUE(bitwise_equal(vcf, vca));
  expect_error([&] { ops::rope_fused_qkv_to_cache(qkv, 3, pos, table, dst, qf, kcf, vcf); },
               "rope_fused_qkv_to_cache: qkv f32[3, 8, 8] cpu must hold Hq=3 query heads and then the caches' Hkv=2 "
               "key and Hkv value heads a row");
  Tensor v_wrong = vcf.reshape({R, 1, 2 * hd});
  expect_error([&] { ops::rope_fused_qkv_to_cache(qkv, Hq, pos, table, dst, qa, kcf, v_wrong); },
               "rope_fused_qkv_to_cache: v_cache must be a bf16 [rows, Hkv=2, hd=8] tensor");
}

// ---- swiglu ---------------------------------------------------------------------------------------

// swiglu_forward_fused on the fused gate|up rows gives swiglu_forward's bits on the two halves, in
// every dtype and into a BF16 output; an odd last dimension is refused.
TEST(SwigluOps, FusedHalvesAreSwigluForwardsBits) {
  const int64_t N = 7, F = 13;
  for (const DType dt : {DType::F32, DType::F64}) {
    const Tensor h13 = random_tensor({N, 2 * F}, dt, 44, -8.0, 8.0);
    const Tensor h1 = column_block(h13, 0, F), h3 = column_block(h13, F, F);
    Tensor a = Tensor::empty({N, F}, dt), af = a.clone();
    ops::swiglu_forward(h1, h3, a);
    ops::swiglu_forward_fused(h13, af);
    EXPECT_TRUE(bitwise_equal(af, a)) << dtype_name(dt);
    if (dt == DType::F32) {
      Tensor a16 = Tensor::empty({N, F}, DType::BF16), af16 = a16.clone();
      ops::swiglu_forward(h1, h3, a16);
      ops::swiglu_forward_fused(h13, af16);
      EXPECT_TRUE(bitwise_equal(af16, a16));
    }
  }
  Tensor a = Tensor::empty({N, F}, DType::F32);
  expect_error([&] { ops::swiglu_forward_fused(random_tensor({N, 2 * F + 1}, DType::F32, 45), a); },
               "swiglu_forward_fused: h13 must be [..., 2F] (gate then up), an even last dimension, got f32[7, 27] cpu");
  Tensor a_wrong = a.reshape({F, N});
  expect_error([&] { ops::swiglu_forward_fused(random_tensor({N, 2 * F}, DType::F32, 45), a_wrong); },
               "swiglu_forward_fused: a must be");
}

TEST(SwigluOps, GradCheck) {
  Tensor h1 = random_tensor({4, 6}, DType::F64, 40, -4.0, 4.0);
  Tensor h3 = random_tensor({4, 6}, DType::F64, 41, -2.0, 2.0);
  Tensor a = Tensor::empty({4, 6}, DType::F64), r = random_tensor({4, 6}, DType::F64, 42);
  auto fwd = [&] { ops::swiglu_forward(h1, h3, a); };
  fwd();
  for (int64_t i = 0; i < 24; ++i) {
    const double z = at(h1, i);
    EXPECT_NEAR(at(a, i), z / (1.0 + std::exp(-z)) * at(h3, i), 1e-15);
  }
  Tensor dh1 = Tensor::empty({4, 6}, DType::F64), dh3 = Tensor::empty({4, 6}, DType::F64);
  ops::swiglu_backward(r, h1, h3, dh1, dh3);
  report("swiglu dh1", fd_check(h1, dh1, {{&a, &r}}, fwd));
  report("swiglu dh3", fd_check(h3, dh3, {{&a, &r}}, fwd));
  expect_error([&] { ops::swiglu_forward(h1, random_tensor({4, 5}, DType::F64, 1), a); },
               "swiglu_forward: h3 must be f64[like h1]=[4, 6] cpu, got f64[4, 5] cpu");
}

// ---- fused forms: out-of-place add, the norm backward accumulating into dx ------------------------

TEST(LayerUtils, FusedAddsAreTheirTwoStepForms) {
  for (const DType dt : {DType::F32, DType::F64}) {
    const Tensor a = random_tensor({7, 33}, dt, 80), b = random_tensor({7, 33}, dt, 81);
    Tensor want = a.clone(), got = Tensor::empty({7, 33}, dt);
    ops::add_(want, b);
    ops::add(a, b, got);
    EXPECT_TRUE(bitwise_equal(got, want)) << dtype_name(dt);
    // rmsnorm_backward(..., dx_accumulate) = dx + (its dx into a temporary), bit for bit
    const Tensor x = random_tensor({7, 33}, dt, 82, -2.0, 2.0), w = random_tensor({33}, dt, 83);
    const Tensor dy = random_tensor({7, 33}, dt, 84), rstd_in = random_tensor({7}, dt, 85, 0.5, 1.5);
    Tensor tmp = Tensor::empty({7, 33}, dt), dw1 = Tensor::zeros({33}, dt), dw2 = Tensor::zeros({33}, dt);
    Tensor dx_two = a.clone(), dx_one = a.clone();
    ops::rmsnorm_backward(dy, x, w, rstd_in, tmp, dw1);
    ops::add_(dx_two, tmp);
    ops::rmsnorm_backward(dy, x, w, rstd_in, dx_one, dw2, true);
    EXPECT_TRUE(bitwise_equal(dx_one, dx_two)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(dw2, dw1)) << dtype_name(dt);
    // dw_accumulate false: dw = the sum over a NaN-filled dw (a stale gradient), the bits of
    // adding it to zeros, and dx as before
    Tensor dw3 = Tensor::empty({33}, dt), dx_three = a.clone();
    ops::fill_(dw3, std::nan(""));
    ops::rmsnorm_backward(dy, x, w, rstd_in, dx_three, dw3, true, false);
    EXPECT_TRUE(bitwise_equal(dw3, dw1)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(dx_three, dx_two)) << dtype_name(dt);
  }
  Tensor out = Tensor::empty({7, 32}, DType::F32);
  expect_error([&] { ops::add(random_tensor({7, 33}, DType::F32, 1), random_tensor({7, 33}, DType::F32, 2), out); },
               "add: b and out must match a f32[7, 33] cpu, got f32[7, 33] cpu and f32[7, 32] cpu");
}

// ---- BF16 outputs (ops.h) --------------------------------------------------------------------------

namespace {
// Every element of the BF16 tensor `got` is the RNE encoding of the F32 tensor's element.
void expect_encoded(const char* what, const Tensor& got, const Tensor& f32) {
  ASSERT_EQ(got.dtype(), DType::BF16) << what;
  ASSERT_EQ(got.shape(), f32.shape()) << what;
  int64_t differ = 0;
  for (int64_t i = 0; i < f32.numel(); ++i)
    differ += got.data<uint16_t>()[i] != num::bf16_encode(f32.data<float>()[i]) ? 1 : 0;
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << f32.numel() << " elements";
}
Tensor bf16_like(const Tensor& t) { return Tensor::empty(t.shape(), DType::BF16); }
}  // namespace

// convert_each: each pair as convert does it, mixed kinds; a size mismatch is reported by pair.
TEST(LayerUtils, ConvertEachConvertsEveryPair) {
  const Tensor x = random_tensor({300}, DType::F32, 2, -100.0, 100.0), y = random_tensor({7}, DType::F64, 3);
  std::vector<Tensor> dst{Tensor::empty({300}, DType::BF16), Tensor::empty({7}, DType::F32)};
  ops::convert_each({x, y}, dst);
  for (int64_t i = 0; i < 300; ++i) ASSERT_EQ(dst[0].data<uint16_t>()[i], num::bf16_encode(x.data<float>()[i])) << i;
  for (int64_t i = 0; i < 7; ++i) ASSERT_EQ(dst[1].data<float>()[i], float(y.data<double>()[i])) << i;
  std::vector<Tensor> bad{Tensor::empty({299}, DType::BF16)};
  EXPECT_HAS(testutil::error_of([&] { ops::convert_each({x}, bad); }), "convert_each: pair 0");
}

// zero_each: every tensor zeroed, the memory around them untouched.
TEST(LayerUtils, ZeroEachZeroesEveryTensor) {
  Tensor pool = random_tensor({100}, DType::F32, 4, 1.0, 2.0);
  std::vector<Tensor> ts{pool.view(3, {10}), pool.view(40, {0}), pool.view(50, {7})};
  ops::zero_each(ts);
  for (int64_t i = 0; i < 100; ++i) {
    const bool zeroed = (i >= 3 && i < 13) || (i >= 50 && i < 57);
    ASSERT_EQ(pool.data<float>()[i] == 0.0f, zeroed) << i;
  }
}

TEST(Bf16Outputs, AreTheF32OutputsRoundedOnce) {
  const Tensor x = random_tensor({37, 24}, DType::F32, 70, -3.0, 3.0), w = random_tensor({24}, DType::F32, 71);
  Tensor y = Tensor::empty({37, 24}, DType::F32), r = Tensor::empty({37}, DType::F32);
  Tensor y16 = bf16_like(y), r16 = Tensor::empty({37}, DType::F32);
  ops::rmsnorm_forward(x, w, 1e-5f, y, r);
  ops::rmsnorm_forward(x, w, 1e-5f, y16, r16);
  expect_encoded("rmsnorm y", y16, y);
  EXPECT_TRUE(bitwise_equal(r16, r)) << "rstd stays f32";
  Tensor y_both = Tensor::empty({37, 24}, DType::F32), y_copy = bf16_like(y);
  ops::rmsnorm_forward(x, w, 1e-5f, y_both, r16, &y_copy);
  EXPECT_TRUE(bitwise_equal(y_both, y)) << "rmsnorm y with a copy";
  expect_encoded("rmsnorm y's copy", y_copy, y);
  const Tensor dyn = random_tensor({37, 24}, DType::F32, 84);
  Tensor dx_plain = random_tensor({37, 24}, DType::F32, 85), dx_both = dx_plain.clone(), dx_copy = bf16_like(y);
  Tensor dw_plain = Tensor::zeros({24}, DType::F32), dw_both = dw_plain.clone();
  ops::rmsnorm_backward(dyn, x, w, r, dx_plain, dw_plain, true, true);
  ops::rmsnorm_backward(dyn, x, w, r, dx_both, dw_both, true, true, &dx_copy);
  EXPECT_TRUE(bitwise_equal(dx_both, dx_plain)) << "rmsnorm dx with a copy";
  expect_encoded("rmsnorm dx's copy", dx_copy, dx_plain);
  // add_rmsnorm_forward: the add, then the norm
  const Tensor xb = random_tensor({37, 24}, DType::F32, 86, -3.0, 3.0);
  Tensor sum_ref = Tensor::empty({37, 24}, DType::F32), sum = sum_ref.clone(), y_ref = sum_ref.clone(),
         y_add = sum_ref.clone(), r_ref = r.clone(), r_add = r.clone();
  ops::add(x, xb, sum_ref);
  ops::rmsnorm_forward(sum_ref, w, 1e-5f, y_ref, r_ref);
  ops::add_rmsnorm_forward(x, xb, sum, w, 1e-5f, y_add, r_add, &y_copy);
  EXPECT_TRUE(bitwise_equal(sum, sum_ref) && bitwise_equal(y_add, y_ref) && bitwise_equal(r_add, r_ref));
  expect_encoded("add_rmsnorm y's copy", y_copy, y_ref);
  expect_error([&] { ops::rmsnorm_forward(x, w, 1e-5f, y16, r16, &y_copy); },
               "rmsnorm_forward: y_bf16 must be a BF16 tensor of the f32 output's shape [37, 24] on its device, got "
               "bf16[37, 24] cpu for bf16[37, 24] cpu");

  const Tensor h1 = random_tensor({5, 33}, DType::F32, 72, -8.0, 8.0), h3 = random_tensor({5, 33}, DType::F32, 73);
  const Tensor da = random_tensor({5, 33}, DType::F32, 74);
  Tensor a = Tensor::empty({5, 33}, DType::F32), a16 = bf16_like(a);
  ops::swiglu_forward(h1, h3, a);
  ops::swiglu_forward(h1, h3, a16);
  expect_encoded("swiglu a", a16, a);
  Tensor d1 = Tensor::empty({5, 33}, DType::F32), d3 = d1.clone(), d1_16 = bf16_like(d1), d3_16 = bf16_like(d1);
  ops::swiglu_backward(da, h1, h3, d1, d3);
  ops::swiglu_backward(da, h1, h3, d1_16, d3_16);
  expect_encoded("swiglu dh1", d1_16, d1);
  expect_encoded("swiglu dh3", d3_16, d3);

  const int64_t N = 29, D = 20, k = 2, M = N * k;
  const ops::RoutePlan plan = ops::route_plan(random_routing(N, 4, k, 75), 4);
  const Tensor dout = random_tensor({N, D}, DType::F32, 76), yp = random_tensor({M, D}, DType::F32, 77);
  const Tensor tw = random_tensor({N, k}, DType::F32, 78, 0.0, 1.0);
  Tensor dyp = Tensor::empty({M, D}, DType::F32), dw = Tensor::empty({N, k}, DType::F32);
  Tensor dyp16 = bf16_like(dyp), dw2 = dw.clone();
  ops::moe_combine_backward(dout, yp, plan.slot_of, tw, dyp, dw);
  ops::moe_combine_backward(dout, yp, plan.slot_of, tw, dyp16, dw2);
  expect_encoded("moe_combine_backward dy_perm", dyp16, dyp);
  EXPECT_TRUE(bitwise_equal(dw2, dw)) << "dw stays f32";

  // rope's and attention's BF16 copies (ops.h): the F32 results rounded; the F32 ones unchanged.
  const Tensor table = ops::rope_table(16, 8, 10000.0, Device::CPU);
  const Tensor pos = random_ints({6}, 0, 16, 80);
  const Tensor xr = random_tensor({6, 2, 8}, DType::F32, 81, -2.0, 2.0);
  Tensor plain = xr.clone(), with = xr.clone(), with16 = bf16_like(xr);
  ops::rope_forward(plain, pos, table);
  ops::rope_forward(with, pos, table, &with16);
  EXPECT_TRUE(bitwise_equal(with, plain)) << "rope_forward x";
  expect_encoded("rope_forward copy", with16, plain);
  ops::rope_backward(plain, pos, table);
  ops::rope_backward(with, pos, table, &with16);
  EXPECT_TRUE(bitwise_equal(with, plain)) << "rope_backward x";
  expect_encoded("rope_backward copy", with16, plain);
  // bf16_only: the same copy, x as it was
  for (const bool backward : {false, true}) {
    Tensor rotated = xr.clone(), kept = xr.clone(), only16 = bf16_like(xr);
    backward ? ops::rope_backward(rotated, pos, table) : ops::rope_forward(rotated, pos, table);
    backward ? ops::rope_backward(kept, pos, table, &only16, true) : ops::rope_forward(kept, pos, table, &only16, true);
    EXPECT_TRUE(bitwise_equal(kept, xr)) << "bf16_only left x as it was " << backward;
    expect_encoded("rope bf16_only copy", only16, rotated);
  }
  expect_error([&] { ops::rope_forward(with, pos, table, nullptr, true); },
               "rope_forward: bf16_only writes only x_bf16, and none was given");
  Tensor short16 = Tensor::empty({6, 2, 7}, DType::BF16);
  expect_error([&] { ops::rope_forward(with, pos, table, &short16); },
               "rope_forward: x_bf16 must be a BF16 tensor of the f32 output's shape [6, 2, 8] on its device, got "
               "bf16[6, 2, 7] cpu for f32[6, 2, 8] cpu");
  const Tensor q = random_tensor({1, 5, 2, 8}, DType::F32, 82), kv = random_tensor({1, 5, 1, 8}, DType::F32, 83);
  Tensor out = Tensor::empty(q.shape(), DType::F32), lse = Tensor::empty({1, 2, 5}, DType::F32), out16 = bf16_like(out);
  ops::attention_forward(q, kv, kv, 0, out, lse, &out16);
  expect_encoded("attention out", out16, out);
  EXPECT_FALSE(ops::attention_reads_bf16(Device::CPU));

  // Only F32 inputs may write BF16, and only an output may be BF16.
  const Tensor h64 = random_tensor({5, 33}, DType::F64, 79);
  expect_error([&] { ops::swiglu_forward(h64, h64, a16); },
               "swiglu_forward: a must be f64[like h1]=[5, 33] cpu, got bf16[5, 33] cpu");
  Tensor a64 = Tensor::empty({5, 33}, DType::F64);
  expect_error([&] { ops::swiglu_forward(h1, h3, a64); },
               "swiglu_forward: a must be f32 or bf16[like h1]=[5, 33] cpu, got f64[5, 33] cpu");
  expect_error([&] { ops::swiglu_backward(da, h1, h3, d1_16, d3); },
               "swiglu_backward: dh3 must be bf16[like dh1]=[5, 33] cpu, got f32[5, 33] cpu");
}

// ---- cross entropy --------------------------------------------------------------------------------

TEST(CrossEntropyOps, ForwardMatchesReference) {
  for (DType dt : {DType::F64, DType::F32}) {
    const int64_t N = 6, V = 11;
    Tensor logits = random_tensor({N, V}, dt, 50, -5.0, 5.0);
    Tensor tg = int_tensor({0, 10, -1, 3, 7, 3}, {N});
    Tensor losses = Tensor::empty({N}, dt);
    ops::cross_entropy(logits, tg, losses, nullptr, 1.0f);
    std::vector<double> want(N, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      const int32_t t = tg.data<int32_t>()[n];
      if (t < 0) continue;
      double s = 0.0;
      for (int64_t v = 0; v < V; ++v) s += std::exp(at(logits, n * V + v));
      want[size_t(n)] = std::log(s) - at(logits, n * V + t);
    }
    EXPECT_LT(max_rel_err(losses, want, 1e-3), dt == DType::F64 ? 1e-13 : 1e-6);
    EXPECT_EQ(at(losses, 2), 0.0);
  }
  // Max subtraction: huge logits give the same loss as shifted ones.
  std::vector<float> big = {1000.0f, 1001.0f, 999.0f}, small = {0.0f, 1.0f, -1.0f};
  Tensor lb = Tensor::from_host(big.data(), {1, 3}, DType::F32);
  Tensor ls = Tensor::from_host(small.data(), {1, 3}, DType::F32);
  Tensor t = int_tensor({2}, {1}), o1 = Tensor::empty({1}, DType::F32), o2 = o1.clone();
  ops::cross_entropy(lb, t, o1, nullptr, 1.0f);
  ops::cross_entropy(ls, t, o2, nullptr, 1.0f);
  EXPECT_TRUE(std::isfinite(o1.data<float>()[0]));
  EXPECT_NEAR(o1.data<float>()[0], o2.data<float>()[0], 1e-5);
}

TEST(CrossEntropyOps, GradCheckWithIgnoredRows) {
  const int64_t N = 5, V = 7;
  const float gs = 0.7f;
  Tensor logits = random_tensor({N, V}, DType::F64, 51, -3.0, 3.0);
  Tensor tg = int_tensor({2, -1, 6, 0, -1}, {N});
  Tensor losses = Tensor::empty({N}, DType::F64), dlogits = Tensor::empty({N, V}, DType::F64);
  Tensor r = Tensor::empty({N}, DType::F64);
  ops::fill_(r, double(gs));  // L = grad_scale * sum(losses)
  auto fwd = [&] { ops::cross_entropy(logits, tg, losses, nullptr, gs); };
  ops::cross_entropy(logits, tg, losses, &dlogits, gs);
  for (int64_t n : {1, 4}) {
    EXPECT_EQ(at(losses, n), 0.0);
    for (int64_t v = 0; v < V; ++v) EXPECT_EQ(at(dlogits, n * V + v), 0.0);
  }
  report("cross_entropy dlogits", fd_check(logits, dlogits, {{&losses, &r}}, fwd));
}

// Per-token weights (the trainer's RL advantages, possibly negative): the gradient is of
// grad_scale * sum(w * losses); the losses stay unweighted; weights of 1 give the unweighted bits.
TEST(CrossEntropyOps, PerTokenWeights) {
  const int64_t N = 6, V = 9;
  const float gs = 0.3f;
  Tensor logits = random_tensor({N, V}, DType::F64, 55, -3.0, 3.0);
  Tensor tg = int_tensor({2, -1, 8, 0, 5, 1}, {N});
  const std::vector<float> wv = {1.5f, 2.0f, -0.75f, 0.0f, 1.0f, 0.25f};
  const Tensor w = Tensor::from_host(wv.data(), {N}, DType::F32);
  Tensor losses = Tensor::empty({N}, DType::F64), dlogits = Tensor::empty({N, V}, DType::F64);
  Tensor plain = Tensor::empty({N}, DType::F64);
  ops::cross_entropy(logits, tg, losses, &dlogits, gs, &w);
  ops::cross_entropy(logits, tg, plain, nullptr, gs);
  EXPECT_TRUE(bitwise_equal_range(losses, 0, plain, 0, N)) << "weights must not change the losses";
  Tensor r = Tensor::empty({N}, DType::F64);
  for (int64_t n = 0; n < N; ++n) r.data<double>()[n] = double(gs) * double(wv[size_t(n)]);
  auto fwd = [&] { ops::cross_entropy(logits, tg, losses, nullptr, gs, &w); };
  report("cross_entropy weighted dlogits", fd_check(logits, dlogits, {{&losses, &r}}, fwd));
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(at(dlogits, 3 * V + v), 0.0) << "weight 0: no gradient";

  // All-ones weights: the same bits as no weights, in F32 as the trainer runs it.
  Tensor l32 = random_tensor({N, V}, DType::F32, 56, -3.0, 3.0);
  const std::vector<float> ones(size_t(N), 1.0f);
  const Tensor w1 = Tensor::from_host(ones.data(), {N}, DType::F32);
  Tensor oa = Tensor::empty({N}, DType::F32), ob = oa.clone();
  Tensor ga = Tensor::empty({N, V}, DType::F32), gb = ga.clone();
  ops::cross_entropy(l32, tg, oa, &ga, gs);
  ops::cross_entropy(l32, tg, ob, &gb, gs, &w1);
  EXPECT_TRUE(bitwise_equal_range(oa, 0, ob, 0, N));
  EXPECT_TRUE(bitwise_equal_range(ga, 0, gb, 0, N * V));
  Tensor bad = Tensor::empty({N + 1}, DType::F32);
  expect_error([&] { ops::cross_entropy(l32, tg, oa, &ga, gs, &bad); }, "cross_entropy: weights must be f32[N]=[6]");
}

TEST(CrossEntropyOps, BatchInvariant) {
  const int64_t T = 13, V = 301;
  Tensor l8 = random_tensor({8 * T, V}, DType::F32, 52, -8.0, 8.0);
  Tensor t8 = random_ints({8 * T}, 0, V, 53);
  Tensor l1 = l8.slice_rows(0, T).clone(), t1 = t8.slice_rows(0, T).clone();
  Tensor o1 = Tensor::empty({T}, DType::F32), g1 = Tensor::empty({T, V}, DType::F32);
  Tensor o8 = Tensor::empty({8 * T}, DType::F32), g8 = Tensor::empty({8 * T, V}, DType::F32);
  ops::cross_entropy(l1, t1, o1, &g1, 0.01f);
  ops::cross_entropy(l8, t8, o8, &g8, 0.01f);
  EXPECT_TRUE(bitwise_equal_range(o1, 0, o8, 0, T));
  EXPECT_TRUE(bitwise_equal_range(g1, 0, g8, 0, T * V));
}

TEST(CrossEntropyOps, Errors) {
  Tensor logits = random_tensor({3, 5}, DType::F32, 54);
  Tensor losses = Tensor::empty({3}, DType::F32);
  expect_error([&] { ops::cross_entropy(logits, int_tensor({0, 9, 1}, {3}), losses, nullptr, 1.0f); },
               "cross_entropy: targets[1] = 9 is outside [0, V=5)");
  expect_error([&] { ops::cross_entropy(logits, int_tensor({0, -2, 1}, {3}), losses, nullptr, 1.0f); },
               "targets[1] = -2");
  Tensor bad = Tensor::empty({3, 4}, DType::F32);
  expect_error([&] { ops::cross_entropy(logits, int_tensor({0, 1, 1}, {3}), losses, &bad, 1.0f); },
               "cross_entropy: dlogits must be f32[N, V]=[3, 5] cpu, got f32[3, 4] cpu");
}

// ---- adamw ----------------------------------------------------------------------------------------

// Gradient clipping inside the update: grad_scale s gives the bits of scaling the gradient by s
// first (ops::scale_) and stepping with scale 1, and leaves the gradient as it was.
TEST(AdamWOps, GradScaleEqualsScalingTheGradientFirst) {
  const int64_t n = 777;
  const Tensor p0 = random_tensor({n}, DType::F32, 70, -1.0, 1.0), g0 = random_tensor({n}, DType::F32, 71, -3.0, 3.0);
  const Tensor m0 = random_tensor({n}, DType::F32, 72, -0.1, 0.1), v0 = random_tensor({n}, DType::F32, 73, 0.0, 0.1);
  const double s = 0.123456789;
  Tensor pa = p0.clone(), ma = m0.clone(), va = v0.clone(), ga = g0.clone();
  ops::scale_(ga, s);
  ops::adamw_step(pa, ga, ma, va, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 4});
  Tensor pb = p0.clone(), mb = m0.clone(), vb = v0.clone(), gb = g0.clone();
  ops::adamw_step(pb, gb, mb, vb, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 4, float(s)});
  EXPECT_TRUE(bitwise_equal_range(pa, 0, pb, 0, n));
  EXPECT_TRUE(bitwise_equal_range(ma, 0, mb, 0, n));
  EXPECT_TRUE(bitwise_equal_range(va, 0, vb, 0, n));
  EXPECT_TRUE(bitwise_equal_range(gb, 0, g0, 0, n));   // the gradient is not scaled in place
  EXPECT_FALSE(bitwise_equal_range(pa, 0, p0, 0, n));  // the step did move the parameters
}

// grad_norm_gate: the norm is the square root of sum_squares_each's totals added in order (the
// optimizer's host expression, bit for bit), the clip factor float(max / norm) only above the
// threshold, and a skip for a non-finite norm or a quantizer's NaN/Inf (whose flag it takes).
// A gated update is the update with grad_scale = the clip factor, bit for bit, or nothing at all.
TEST(AdamWOps, GateIsTheNormClipAndSkipOfTheHostExpression) {
  std::vector<Tensor> gs = {random_tensor({777}, DType::F32, 80, -1.0, 1.0), Tensor::empty({0}, DType::F32),
                            random_tensor({40000}, DType::F32, 81, -0.5, 0.5), random_tensor({3}, DType::F32, 82)};
  const std::vector<double> each = ops::sum_squares_each(gs);
  double sq = 0;
  for (double x : each) sq += x;
  const double norm = std::sqrt(sq);
  Tensor gate = Tensor::empty({ops::kGateSize}, DType::F64);
  const double* gv = gate.data<double>();
  ops::nonfinite_seen(true);
  for (const double max_norm : {0.0, norm / 3.0, norm * 2.0}) {
    ops::grad_norm_gate(gs, max_norm, gate);
    EXPECT_EQ(gv[ops::kGateNorm], norm);
    EXPECT_EQ(gv[ops::kGateClip], max_norm > 0 && norm > max_norm ? double(float(max_norm / norm)) : 1.0);
    EXPECT_EQ(gv[ops::kGateQuantNonfinite], 0.0);
    EXPECT_EQ(gv[ops::kGateSkip], 0.0);
    if (max_norm == norm / 3.0) {
      EXPECT_LT(gv[ops::kGateClip], 0.34);
    }
  }

  // Gated updates: clipped = grad_scale, and a skip writes nothing (not even the BF16 copy).
  const int64_t n = gs[2].numel();
  const Tensor p0 = random_tensor({n}, DType::F32, 83, -1.0, 1.0), m0 = random_tensor({n}, DType::F32, 84, -0.1, 0.1);
  const Tensor v0 = random_tensor({n}, DType::F32, 85, 0.0, 0.1);
  ops::grad_norm_gate(gs, norm / 3.0, gate);
  Tensor pa = p0.clone(), ma = m0.clone(), va = v0.clone(), pb = p0.clone(), mb = m0.clone(), vb = v0.clone();
  Tensor ba = Tensor::zeros({n}, DType::BF16), bb = Tensor::zeros({n}, DType::BF16);
  ops::adamw_step(pa, gs[2], ma, va, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 3, float(gv[ops::kGateClip])}, &ba);
  ops::adamw_step(pb, gs[2], mb, vb, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 3}, &bb, &gate);
  for (const auto& [a, b] : {std::pair{pa, pb}, {ma, mb}, {va, vb}, {ba, bb}})
    EXPECT_TRUE(bitwise_equal_range(a, 0, b, 0, n));
  EXPECT_FALSE(bitwise_equal_range(pa, 0, p0, 0, n));
  expect_error([&] { ops::adamw_step(pb, gs[2], mb, vb, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 3, 0.5f}, nullptr, &gate); },
               "adamw_step: with a gate the clip factor comes from it; grad_scale must be 1, got 0.5");

  // A NaN or Inf gradient: a non-finite norm, and the update skips itself.
  for (const float bad : {std::nanf(""), INFINITY}) {
    std::vector<Tensor> bad_gs = gs;
    bad_gs[0] = gs[0].clone();
    bad_gs[0].data<float>()[5] = bad;
    ops::grad_norm_gate(bad_gs, 1.0, gate);
    EXPECT_FALSE(std::isfinite(gv[ops::kGateNorm]));
    EXPECT_EQ(gv[ops::kGateSkip], 1.0);
    EXPECT_EQ(gv[ops::kGateQuantNonfinite], 0.0);
    Tensor p = p0.clone(), m = m0.clone(), v = v0.clone(), b = Tensor::zeros({n}, DType::BF16);
    ops::adamw_step(p, gs[2], m, v, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 3}, &b, &gate);
    EXPECT_TRUE(bitwise_equal_range(p, 0, p0, 0, n));
    EXPECT_TRUE(bitwise_equal_range(m, 0, m0, 0, n));
    EXPECT_TRUE(bitwise_equal_range(v, 0, v0, 0, n));
    EXPECT_TRUE(bitwise_equal_range(b, 0, Tensor::zeros({n}, DType::BF16), 0, n));
  }

  // A quantizer that met NaN: the gate takes the flag (skip, and the flag is down after).
  Tensor x = random_tensor({4, 32}, DType::F32, 86);
  x.data<float>()[9] = std::nanf("");
  QuantSpec spec;
  spec.fmt = Format::NVFP4;
  (void)ops::quantize(x, spec);
  ops::grad_norm_gate(gs, 0.0, gate);
  EXPECT_EQ(gv[ops::kGateQuantNonfinite], 1.0);
  EXPECT_EQ(gv[ops::kGateSkip], 1.0);
  EXPECT_EQ(gv[ops::kGateNorm], norm);
  EXPECT_FALSE(ops::nonfinite_seen(true)) << "the gate took the flag";

  Tensor small = Tensor::empty({3}, DType::F64);
  expect_error([&] { ops::grad_norm_gate(gs, 1.0, small); }, "grad_norm_gate: gate must be f64[4]=[4] cpu, got f64[3] cpu");
  expect_error([&] { ops::grad_norm_gate(gs, -1.0, gate); }, "grad_norm_gate: max_norm must be >= 0");
}

// SliceAmax: each slice's max |p| over finite values after the update raises amax (never lowers
// it; two tensors into one amax give the joint max), with the update's bits unchanged; a skipped
// update gives the amax of the unchanged parameters.
TEST(AdamWOps, SliceAmaxIsEachSlicesFiniteMaxAfterTheUpdate) {
  const int64_t slices = 3, slice = 1001, n = slices * slice;
  Tensor p0 = random_tensor({n}, DType::F32, 90, -1.0, 1.0);
  p0.data<float>()[7] = std::nanf("");    // non-finite values take no part in a max
  p0.data<float>()[slice + 9] = INFINITY;
  const Tensor g = random_tensor({n}, DType::F32, 91, -0.5, 0.5), m0 = random_tensor({n}, DType::F32, 92, -0.1, 0.1);
  const Tensor v0 = random_tensor({n}, DType::F32, 93, 0.0, 0.1);
  const ops::AdamW h{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2};
  const auto want = [&](const Tensor& p, int64_t s, float from) {
    float a = from;
    for (int64_t i = s * slice; i < (s + 1) * slice; ++i)
      if (std::isfinite(p.data<float>()[i])) a = std::max(a, std::fabs(p.data<float>()[i]));
    return a;
  };
  Tensor pa = p0.clone(), ma = m0.clone(), va = v0.clone(), pb = p0.clone(), mb = m0.clone(), vb = v0.clone();
  Tensor amax = Tensor::zeros({slices}, DType::F32);
  amax.data<float>()[2] = 100.0f;  // raised, never lowered
  ops::adamw_step(pa, g, ma, va, h);
  ops::adamw_step(pb, g, mb, vb, h, nullptr, nullptr, ops::SliceAmax{&amax, slice});
  for (const auto& [a, b] : {std::pair{pa, pb}, {ma, mb}, {va, vb}}) EXPECT_TRUE(bitwise_equal_range(a, 0, b, 0, n));
  EXPECT_FALSE(bitwise_equal_range(pa, 0, p0, 0, n));
  for (int64_t s = 0; s < 2; ++s) {
    EXPECT_EQ(amax.data<float>()[s], want(pb, s, 0.0f)) << "slice " << s;
    EXPECT_GT(amax.data<float>()[s], 0.5f);
  }
  EXPECT_EQ(amax.data<float>()[2], 100.0f);
  // a second tensor into the same amax: the joint max
  Tensor q = random_tensor({n}, DType::F32, 94, -3.0, 3.0), mq = m0.clone(), vq = v0.clone();
  ops::adamw_step(q, g, mq, vq, h, nullptr, nullptr, ops::SliceAmax{&amax, slice});
  for (int64_t s = 0; s < 2; ++s) EXPECT_EQ(amax.data<float>()[s], want(q, s, want(pb, s, 0.0f))) << "slice " << s;
  // a skipped update: nothing written but the amax, of the parameters as they are
  Tensor gate = Tensor::zeros({ops::kGateSize}, DType::F64);
  gate.data<double>()[ops::kGateClip] = 1.0;
  gate.data<double>()[ops::kGateSkip] = 1.0;
  Tensor pc = p0.clone(), mc = m0.clone(), vc = v0.clone(), ac = Tensor::zeros({slices}, DType::F32);
  ops::adamw_step(pc, g, mc, vc, {1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2}, nullptr, &gate, ops::SliceAmax{&ac, slice});
  EXPECT_TRUE(bitwise_equal_range(pc, 0, p0, 0, n));
  for (int64_t s = 0; s < slices; ++s) EXPECT_EQ(ac.data<float>()[s], want(p0, s, 0.0f)) << "slice " << s;

  expect_error([&] { ops::adamw_step(pa, g, ma, va, h, nullptr, nullptr, ops::SliceAmax{&amax, 1000}); },
               "adamw_step: the amax slice must divide param's 3003 elements, got 1000");
  Tensor two = Tensor::zeros({2}, DType::F32);
  expect_error([&] { ops::adamw_step(pa, g, ma, va, h, nullptr, nullptr, ops::SliceAmax{&two, slice}); },
               "adamw_step: slice_amax must be an f32 tensor of 3 elements (one a slice of 1001) on param's device, "
               "got f32[2] cpu");
}

TEST(AdamWOps, MatchesDoubleFormula) {
  for (float wd : {0.0f, 0.1f}) {
    const int64_t n = 1000;
    Tensor p = random_tensor({n}, DType::F32, 60, 0.5, 1.5);
    Tensor m = Tensor::zeros({n}, DType::F32), v = Tensor::zeros({n}, DType::F32);
    std::vector<double> rp(p.data<float>(), p.data<float>() + n), rm(n, 0.0), rv(n, 0.0);
    ops::AdamW h{1e-2f, 0.9f, 0.999f, 1e-8f, wd, 0};
    for (int64_t step = 1; step <= 5; ++step) {
      // Gradients keep one sign per element, so m never cancels to ~0 (relative error stays
      // meaningful).
      Tensor g = random_tensor({n}, DType::F32, 61 + uint64_t(step), 0.1, 1.0);
      for (int64_t i = 0; i < n; i += 2) g.data<float>()[i] = -g.data<float>()[i];
      h.step = step;
      ops::adamw_step(p, g, m, v, h);
      const double b1 = h.beta1, b2 = h.beta2;
      for (int64_t i = 0; i < n; ++i) {
        const double gi = g.data<float>()[i];
        rm[i] = b1 * rm[i] + (1 - b1) * gi;
        rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
        const double mh = rm[i] / (1 - std::pow(b1, double(step)));
        const double vh = rv[i] / (1 - std::pow(b2, double(step)));
        rp[i] -= double(h.lr) * (mh / (std::sqrt(vh) + double(h.eps)) + double(wd) * rp[i]);
      }
      const double ep = max_rel_err(p, rp, 0.0), em = max_rel_err(m, rm, 0.0),
                   ev = max_rel_err(v, rv, 0.0);
      EXPECT_LT(ep, 1e-6) << "wd " << wd << " step " << step;
      EXPECT_LT(em, 1e-6) << "wd " << wd << " step " << step;
      EXPECT_LT(ev, 1e-6) << "wd " << wd << " step " << step;
    }
  }
  Tensor p = Tensor::zeros({4}, DType::F32), g = Tensor::zeros({5}, DType::F32);
  Tensor m = p.clone(), v = p.clone();
  expect_error([&] { ops::adamw_step(p, g, m, v, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1}); },
               "adamw_step: grad must be f32[like param]=[4] cpu, got f32[5] cpu");
  expect_error([&] { ops::adamw_step(p, p, m, v, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0}); },
               "step must be >= 1");
}
