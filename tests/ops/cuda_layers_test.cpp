// defines: the CudaLayers tests: the CUDA tensor utilities, layers, router, MoE permutation and
//          AdamW against the CPU backend (the same ops:: calls on CUDA and on CPU tensors),
//          determinism (two GPU runs give the same bits) and batch invariance (a row alone and
//          inside a batch of 513 gives the same bits). Plain C++; skipped without a GPU.
//
// Tolerances: |gpu - cpu| / max(|cpu|, 1e-6 * max|cpu|) below 1e-5 for elementwise ops and 1e-4
// for ops that reduce (the floor keeps elements that cancel to ~0 on the tensor's scale). Index
// outputs, copies, and the ops whose float arithmetic is specified step by step (tensor
// utilities, gather/combine sums, AdamW) are compared bit for bit as well or instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "ops/op_test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;
using namespace fourbit::optest;

namespace {

constexpr double kElementwiseTol = 1e-5;
constexpr double kReductionTol = 1e-4;

Tensor gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor host(const Tensor& t) { return t.to(Device::CPU); }

// Worst |got - want| / max(|want|, floor) with floor = 1e-6 * max|want| (and a NaN in either
// where the other has a number counts as infinitely wrong). `got` may live on the GPU.
double rel_err(const Tensor& got_any, const Tensor& want) {
  const Tensor got = host(got_any);
  double scale = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::fabs(at(want, i)));
  const double floor = std::max(1e-6 * scale, 1e-30);
  double worst = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = at(got, i), w = at(want, i);
    if (std::isnan(g) || std::isnan(w)) {
      if (std::isnan(g) != std::isnan(w)) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::fabs(g - w) / std::max(std::fabs(w), floor));
  }
  return worst;
}

void expect_close(const std::string& what, const Tensor& got, const Tensor& want, double tol) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const double err = rel_err(got, want);
  std::printf("[ gpu-cpu  ] %-58s worst rel err %.3g\n", what.c_str(), err);
  EXPECT_LT(err, tol) << what;
}

// Same bytes (either tensor may live on the GPU).
void expect_bits(const std::string& what, const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const Tensor ha = host(a), hb = host(b);
  int64_t differ = 0, first = -1;
  const int64_t es = dtype_size(a.dtype());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(ha.raw()) + i * es,
                    static_cast<const char*>(hb.raw()) + i * es, size_t(es)) != 0) {
      if (first < 0) first = i;
      ++differ;
    }
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.numel()
                       << " elements differ, the first at flat index " << first;
}

// Row r of a 2-D host tensor as a fresh [1, C] GPU tensor (fresh: aligned like any allocation).
Tensor gpu_row(const Tensor& t, int64_t r) {
  const int64_t C = t.size(1);
  return Tensor::from_host(static_cast<const char*>(t.raw()) + r * C * dtype_size(t.dtype()),
                           {1, C}, t.dtype(), Device::CUDA);
}

// Row r of a 2-D tensor (any device) as a host [1, C] tensor.
Tensor host_row(const Tensor& t, int64_t r) { return host(t.slice_rows(r, r + 1)); }

std::string cfg(const char* fmt_str, int64_t a, int64_t b = -1, int64_t c = -1) {
  char buf[128];
  std::snprintf(buf, sizeof buf, fmt_str, (long long)a, (long long)b, (long long)c);
  return buf;
}

}  // namespace

// ---- tensor utilities -----------------------------------------------------------------------------

TEST(CudaLayers, ConvertAddScaleFillMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t(1), int64_t(1000), int64_t(65537), int64_t(1 << 20) + 3}) {
    const Tensor x = random_tensor({n}, DType::F32, 10 + uint64_t(n), -4.0, 4.0);
    const Tensor y = random_tensor({n}, DType::F32, 20 + uint64_t(n), -4.0, 4.0);
    const Tensor xg = gpu(x), yg = gpu(y);
    // F32 -> BF16 -> F32.
    Tensor bc = Tensor::empty({n}, DType::BF16), bg = Tensor::empty({n}, DType::BF16, Device::CUDA);
    ops::convert(x, bc);
    ops::convert(xg, bg);
    expect_bits(cfg("convert f32->bf16 n=%lld", n), bg, bc);
    Tensor fc = Tensor::empty({n}, DType::F32), fg = Tensor::empty({n}, DType::F32, Device::CUDA);
    ops::convert(bc, fc);
    ops::convert(bg, fg);
    expect_bits(cfg("convert bf16->f32 n=%lld", n), fg, fc);
    // add_, scale_ in F32 and BF16.
    Tensor ac = x.clone(), ag = gpu(x);
    ops::add_(ac, y);
    ops::add_(ag, yg);
    expect_bits(cfg("add_ f32 n=%lld", n), ag, ac);
    Tensor b2c = Tensor::empty({n}, DType::BF16), b2g = Tensor::empty({n}, DType::BF16, Device::CUDA);
    ops::convert(y, b2c);
    ops::convert(yg, b2g);
    ops::add_(bc, b2c);
    ops::add_(bg, b2g);
    expect_bits(cfg("add_ bf16 n=%lld", n), bg, bc);
    ops::scale_(ac, 0.37);
    ops::scale_(ag, 0.37);
    expect_bits(cfg("scale_ f32 n=%lld", n), ag, ac);
    ops::scale_(bc, -1.7);
    ops::scale_(bg, -1.7);
    expect_bits(cfg("scale_ bf16 n=%lld", n), bg, bc);
    // fill_: 0.1 is not representable; both round it once (bf16 through round-to-odd).
    ops::fill_(ac, 0.1);
    ops::fill_(ag, 0.1);
    expect_bits(cfg("fill_ f32 n=%lld", n), ag, ac);
    ops::fill_(bc, 0.1 + 1e-12);
    ops::fill_(bg, 0.1 + 1e-12);
    expect_bits(cfg("fill_ bf16 n=%lld", n), bg, bc);
  }
  // A view one element into its storage is not 16-byte aligned: the scalar path must agree.
  const int64_t n = 1001;
  const Tensor x = random_tensor({n + 1}, DType::F32, 30), y = random_tensor({n + 1}, DType::F32, 31);
  Tensor xc = x.clone(), xg = gpu(x);
  Tensor vc = xc.view(1, {n}), vg = xg.view(1, {n});
  ops::add_(vc, y.view(1, {n}));
  ops::add_(vg, gpu(y).view(1, {n}));
  ops::scale_(vc, 3.0);
  ops::scale_(vg, 3.0);
  expect_bits("add_ + scale_ on an unaligned view", xg, xc);
}

TEST(CudaLayers, SumSquaresIsDeterministicAndMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t(1), int64_t(1000), int64_t(16384), int64_t(16385),
                          int64_t(1 << 20) + 3}) {
    const Tensor x = random_tensor({n}, DType::F32, 40 + uint64_t(n), -3.0, 3.0);
    const Tensor xg = gpu(x);
    const double want = ops::sum_squares(x);
    const double got = ops::sum_squares(xg);
    const double err = std::fabs(got - want) / std::max(std::fabs(want), 1e-300);
    std::printf("[ gpu-cpu  ] sum_squares f32 n=%-8lld rel err %.3g\n", (long long)n, err);
    EXPECT_LT(err, kReductionTol);
    EXPECT_EQ(ops::sum_squares(xg), got) << "two GPU runs differ, n=" << n;
    Tensor bc = Tensor::empty({n}, DType::BF16), bg = Tensor::empty({n}, DType::BF16, Device::CUDA);
    ops::convert(x, bc);
    ops::convert(xg, bg);
    const double want_b = ops::sum_squares(bc), got_b = ops::sum_squares(bg);
    EXPECT_LT(std::fabs(got_b - want_b) / std::max(std::fabs(want_b), 1e-300), kReductionTol);
    EXPECT_EQ(ops::sum_squares(bg), got_b) << "two GPU runs differ (bf16), n=" << n;
    // Unaligned view: same value as an aligned copy of the same elements.
    if (n > 1) {
      const Tensor view = xg.view(1, {n - 1});
      EXPECT_EQ(ops::sum_squares(view), ops::sum_squares(gpu(x.view(1, {n - 1}))));
    }
  }
}

// sum_squares_each on the GPU: every tensor's value bit for bit its own sum_squares (the optimizer's
// gradient norm reads them in one synchronisation), empty tensors and BF16 included.
TEST(CudaLayers, SumSquaresEachEqualsEachSumSquares) {
  SKIP_WITHOUT_GPU();
  std::vector<Tensor> ts;
  for (const int64_t n : {int64_t(1), int64_t(0), int64_t(16385), int64_t(1 << 20) + 3, int64_t(777)})
    ts.push_back(gpu(random_tensor({n}, DType::F32, 90 + uint64_t(n), -2.0, 2.0)));
  Tensor b = Tensor::empty({5000}, DType::BF16, Device::CUDA);
  ops::convert(gpu(random_tensor({5000}, DType::F32, 99, -2.0, 2.0)), b);
  ts.push_back(b);
  ts.push_back(ts[3].view(1, {1000}));  // an unaligned view
  ts.push_back(Tensor::empty({0}, DType::F32, Device::CUDA));  // an empty one last (its total: 0)
  const std::vector<double> each = ops::sum_squares_each(ts);
  ASSERT_EQ(each.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_EQ(each[i], ops::sum_squares(ts[i])) << "tensor " << i;
}

// ---- embedding ------------------------------------------------------------------------------------

TEST(CudaLayers, EmbeddingMatchesCpuAndBackwardIsDeterministic) {
  SKIP_WITHOUT_GPU();
  // Token 7 is every third token: 26 uses (one sequential sum), 1000 and 171 uses (spread over a
  // block's warps); the last config sends every token to one id.
  struct Cfg { int64_t V, D, N; bool one_id; };
  for (const Cfg c : {Cfg{260, 64, 77, false}, Cfg{260, 96, 3000, false},
                      Cfg{32000, 1024, 513, false}, Cfg{260, 130, 2000, true}}) {
    const std::string name = cfg("V=%lld D=%lld N=%lld", c.V, c.D, c.N) + (c.one_id ? " one id" : "");
    Tensor tok = random_ints({c.N}, 0, int32_t(c.V), 100 + uint64_t(c.N));
    for (int64_t n = 0; n < c.N; n += c.one_id ? 1 : 3) tok.data<int32_t>()[n] = 7;
    const Tensor table = random_tensor({c.V, c.D}, DType::F32, 101);
    Tensor out_c = Tensor::empty({c.N, c.D}, DType::F32);
    Tensor out_g = Tensor::empty({c.N, c.D}, DType::F32, Device::CUDA);
    const Tensor tok_g = gpu(tok);
    ops::embedding_forward(tok, table, out_c);
    ops::embedding_forward(tok_g, gpu(table), out_g);
    expect_bits("embedding_forward " + name, out_g, out_c);

    const Tensor dout = random_tensor({c.N, c.D}, DType::F32, 102);
    const Tensor dtable0 = random_tensor({c.V, c.D}, DType::F32, 103);
    Tensor dt_c = dtable0.clone();
    ops::embedding_backward(dout, tok, dt_c);
    Tensor dt_g = gpu(dtable0), dt_g2 = gpu(dtable0);
    const Tensor dout_g = gpu(dout);
    ops::embedding_backward(dout_g, tok_g, dt_g);
    ops::embedding_backward(dout_g, tok_g, dt_g2, /*tokens_checked=*/true);  // no record read: the same sums
    expect_close("embedding_backward dtable " + name, dt_g, dt_c, kReductionTol);
    expect_bits("embedding_backward two GPU runs (the second with checked tokens) " + name, dt_g, dt_g2);
  }
  Tensor out = Tensor::empty({4, 8}, DType::F32, Device::CUDA);
  expect_error([&] {
    ops::embedding_forward(gpu(int_tensor({1, 2, 260, 3}, {4})),
                           gpu(random_tensor({260, 8}, DType::F32, 104)), out);
  }, "embedding_forward: tokens[2] = 260 is outside [0, V=260)");
  Tensor dt = Tensor::zeros({260, 8}, DType::F32, Device::CUDA);
  expect_error([&] {
    ops::embedding_backward(gpu(random_tensor({4, 8}, DType::F32, 105)),
                            gpu(int_tensor({1, -2, 5, 3}, {4})), dt);
  }, "embedding_backward: tokens[1] = -2 is outside [0, V=260)");
}

// ---- rmsnorm --------------------------------------------------------------------------------------

TEST(CudaLayers, RmsNormMatchesCpuDeterministicAndBatchInvariant) {
  SKIP_WITHOUT_GPU();
  const float eps = 1e-5f;
  // D = 4100: the backward's two-kernel form (past the one-pass form's 2048)
  for (const int64_t D : {int64_t(64), int64_t(96), int64_t(1024), int64_t(130), int64_t(4100)}) {
    for (const int64_t N : {int64_t(77), int64_t(513)}) {
      const std::string name = cfg("N=%lld D=%lld", N, D);
      const Tensor x = random_tensor({N, D}, DType::F32, 200 + uint64_t(D), -2.0, 2.0);
      const Tensor w = random_tensor({D}, DType::F32, 201, 0.5, 1.5);
      const Tensor dy = random_tensor({N, D}, DType::F32, 202);
      const Tensor dw0 = random_tensor({D}, DType::F32, 203);
      Tensor y_c = Tensor::empty({N, D}, DType::F32), r_c = Tensor::empty({N}, DType::F32);
      ops::rmsnorm_forward(x, w, eps, y_c, r_c);
      const Tensor xg = gpu(x), wg = gpu(w), dyg = gpu(dy);
      Tensor y_g = Tensor::empty({N, D}, DType::F32, Device::CUDA);
      Tensor r_g = Tensor::empty({N}, DType::F32, Device::CUDA);
      ops::rmsnorm_forward(xg, wg, eps, y_g, r_g);
      expect_close("rmsnorm_forward y " + name, y_g, y_c, kReductionTol);
      expect_close("rmsnorm_forward rstd " + name, r_g, r_c, kReductionTol);

      Tensor dx_c = Tensor::empty({N, D}, DType::F32), dw_c = dw0.clone();
      ops::rmsnorm_backward(dy, x, w, r_c, dx_c, dw_c);
      Tensor dx_g = Tensor::empty({N, D}, DType::F32, Device::CUDA), dw_g = gpu(dw0);
      Tensor dx_g2 = Tensor::empty({N, D}, DType::F32, Device::CUDA), dw_g2 = gpu(dw0);
      ops::rmsnorm_backward(dyg, xg, wg, r_g, dx_g, dw_g);
      ops::rmsnorm_backward(dyg, xg, wg, r_g, dx_g2, dw_g2);
      expect_close("rmsnorm_backward dx " + name, dx_g, dx_c, kReductionTol);
      expect_close("rmsnorm_backward dw " + name, dw_g, dw_c, kReductionTol);
      expect_bits("rmsnorm_backward dw two GPU runs " + name, dw_g, dw_g2);
      expect_bits("rmsnorm_backward dx two GPU runs " + name, dx_g, dx_g2);

      if (N != 513) continue;
      // Batch invariance: rows computed alone are the rows of the batch, bit for bit.
      for (const int64_t r : {int64_t(0), int64_t(1), int64_t(255), int64_t(512)}) {
        const Tensor x1 = gpu_row(x, r), dy1 = gpu_row(dy, r);
        Tensor y1 = Tensor::empty({1, D}, DType::F32, Device::CUDA);
        Tensor r1 = Tensor::empty({1}, DType::F32, Device::CUDA);
        ops::rmsnorm_forward(x1, wg, eps, y1, r1);
        expect_bits(cfg("rmsnorm y row %lld alone vs in N=513, D=%lld", r, D), y1, host_row(y_g, r));
        expect_bits(cfg("rmsnorm rstd row %lld alone, D=%lld", r, D), r1, host(r_g).view(r, {1}));
        Tensor dx1 = Tensor::empty({1, D}, DType::F32, Device::CUDA), dw1 = gpu(dw0);
        ops::rmsnorm_backward(dy1, x1, wg, r1, dx1, dw1);
        expect_bits(cfg("rmsnorm dx row %lld alone, D=%lld", r, D), dx1, host_row(dx_g, r));
      }
    }
  }
}

// The forward's order written out on the host: lane l sums the squares of groups l, l + 32, ... in
// order (in double), the 32 lane sums meet in the xor butterfly, rstd = float(1 / sqrt(ss / D +
// eps)) and y = float(x * rstd * w) in double. The kernel loads its groups in batches (all of a
// decode row's at once): rows of one batch (D = 1024), of two (1028: lane 0 has 9 groups; 4100)
// and of one partial group (6) must give these bits exactly, so a group skipped, read twice or
// added to the wrong row fails. (Another order of the same exact squares moves ss by an ulp of a
// double, which shows in the float rstd only in rare rows; the trainer = sampler tests run this
// one kernel on both sides.)
TEST(CudaLayers, RmsNormForwardIsTheLaneOrderBits) {
  SKIP_WITHOUT_GPU();
  const float eps = 1e-5f;
  for (const int64_t D : {int64_t(6), int64_t(1024), int64_t(1028), int64_t(4100)}) {
    for (const int64_t N : {int64_t(1), int64_t(3), int64_t(77)}) {
      const std::string name = cfg("N=%lld D=%lld", N, D);
      // values over ~40 binades, so that the order of the double sums can show in rstd's rounding
      std::mt19937_64 rng(900 + uint64_t(D) * 7 + uint64_t(N));
      std::uniform_real_distribution<double> mant(-1.0, 1.0);
      std::uniform_int_distribution<int> expo(-30, 10);
      Tensor x = Tensor::empty({N, D}, DType::F32);
      for (int64_t i = 0; i < N * D; ++i) x.data<float>()[i] = float(std::ldexp(mant(rng), expo(rng)));
      const Tensor w = random_tensor({D}, DType::F32, 901, 0.5, 1.5);
      Tensor y_want = Tensor::empty({N, D}, DType::F32), r_want = Tensor::empty({N}, DType::F32);
      const int64_t groups = (D + 3) / 4;
      for (int64_t n = 0; n < N; ++n) {
        const float* xr = x.data<float>() + n * D;
        double lane[32] = {};
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t i = 4 * g; i < std::min(4 * g + 4, D); ++i) lane[g % 32] += double(xr[i]) * double(xr[i]);
        for (int offset = 16; offset > 0; offset >>= 1) {
          double next[32];
          for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ offset];
          std::copy(next, next + 32, lane);
        }
        const float rs = float(1.0 / std::sqrt(lane[0] / double(D) + double(eps)));
        r_want.data<float>()[n] = rs;
        for (int64_t i = 0; i < D; ++i)
          y_want.data<float>()[n * D + i] = float(double(xr[i]) * double(rs) * double(w.data<float>()[i]));
      }
      Tensor y = Tensor::empty({N, D}, DType::F32, Device::CUDA), r = Tensor::empty({N}, DType::F32, Device::CUDA);
      ops::rmsnorm_forward(gpu(x), gpu(w), eps, y, r);
      expect_bits("rmsnorm rstd " + name, r, r_want);
      expect_bits("rmsnorm y " + name, y, y_want);
    }
  }
}

// ---- rope -----------------------------------------------------------------------------------------

TEST(CudaLayers, RopeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t max_pos = 100;
  for (const int64_t hd : {int64_t(64), int64_t(96), int64_t(6)}) {
    const int64_t N = 77, H = 3;
    const std::string name = cfg("N=%lld H=%lld hd=%lld", N, H, hd);
    const Tensor table_c = ops::rope_table(max_pos, hd, 10000.0, Device::CPU);
    const Tensor table_g = ops::rope_table(max_pos, hd, 10000.0, Device::CUDA);
    const Tensor pos = random_ints({N}, 0, int32_t(max_pos), 300);
    const Tensor pos_g = gpu(pos);
    const Tensor x = random_tensor({N, H, hd}, DType::F32, 301, -2.0, 2.0);
    Tensor xc = x.clone(), xg = gpu(x);
    ops::rope_forward(xc, pos, table_c);
    ops::rope_forward(xg, pos_g, table_g);
    expect_close("rope_forward " + name, xg, xc, kElementwiseTol);
    ops::rope_backward(xc, pos, table_c);
    ops::rope_backward(xg, pos_g, table_g);
    expect_close("rope_backward " + name, xg, xc, kElementwiseTol);
  }
}

namespace {
// N distinct cache rows out of R in a scrambled order: a cached call's destinations, on the GPU.
Tensor scrambled_rows(int64_t N, int64_t R, uint64_t seed) {
  std::vector<int32_t> rows(static_cast<size_t>(R));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), std::mt19937(seed));
  rows.resize(size_t(N));
  return gpu(int_tensor(rows, {N}));
}
}  // namespace

// rope_qkv_to_cache's one kernel gives the bits of the ops it replaces on the GPU (rope_forward
// into BF16 copies, convert, scatter_rows): q's copy and both caches' rows, the rows it does not
// write left as they were; head sizes with and without 16-byte groups (64, 6), GQA heads, the
// cache rows in a scrambled order; a bad cache row or position is reported as those ops report it.
TEST(CudaLayers, RopeQkvToCacheIsTheSeparateOpsBits) {
  SKIP_WITHOUT_GPU();
  const int64_t max_pos = 100, N = 37, Hq = 4, Hkv = 2, R = 150;
  for (const int64_t hd : {int64_t(64), int64_t(6)}) {
    const std::string name = cfg("hd=%lld", hd);
    const Tensor table = ops::rope_table(max_pos, hd, 10000.0, Device::CUDA);
    const Tensor pos = gpu(random_ints({N}, 0, int32_t(max_pos), 310));
    const Tensor dst = scrambled_rows(N, R, 311);
    const Tensor q = gpu(random_tensor({N, Hq, hd}, DType::F32, 312, -2.0, 2.0)),
                 k = gpu(random_tensor({N, Hkv, hd}, DType::F32, 313, -2.0, 2.0)),
                 v = gpu(random_tensor({N, Hkv, hd}, DType::F32, 314, -2.0, 2.0));
    Tensor cache0 = Tensor::empty({R, Hkv, hd}, DType::BF16, Device::CUDA);
    ops::convert(gpu(random_tensor({R, Hkv, hd}, DType::F32, 315)), cache0);
    // the separate ops
    Tensor qa = Tensor::empty(q.shape(), DType::BF16, Device::CUDA);
    Tensor kb = Tensor::empty(k.shape(), DType::BF16, Device::CUDA);
    Tensor vb = Tensor::empty(v.shape(), DType::BF16, Device::CUDA);
    Tensor qq = q, kk = k;
    ops::rope_forward(qq, pos, table, &qa, true);
    ops::rope_forward(kk, pos, table, &kb, true);
    ops::convert(v, vb);
    Tensor kca = cache0.clone(), vca = cache0.clone();
    Tensor kca2 = kca.reshape({R, Hkv * hd}), vca2 = vca.reshape({R, Hkv * hd});
    ops::scatter_rows(kb.reshape({N, Hkv * hd}), dst, kca2);
    ops::scatter_rows(vb.reshape({N, Hkv * hd}), dst, vca2);
    // the one op
    Tensor qf = Tensor::empty(q.shape(), DType::BF16, Device::CUDA), kcf = cache0.clone(), vcf = cache0.clone();
    ops::rope_qkv_to_cache(q, k, v, pos, table, dst, qf, kcf, vcf);
    expect_bits("rope_qkv_to_cache q " + name, qf, qa);
    expect_bits("rope_qkv_to_cache k cache " + name, kcf, kca);
    expect_bits("rope_qkv_to_cache v cache " + name, vcf, vca);
  }
  const int64_t hd = 8;
  const Tensor table = ops::rope_table(max_pos, hd, 10000.0, Device::CUDA);
  const Tensor q = gpu(random_tensor({2, 2, hd}, DType::F32, 320)), k = gpu(random_tensor({2, 1, hd}, DType::F32, 321));
  Tensor qb = Tensor::empty(q.shape(), DType::BF16, Device::CUDA);
  Tensor kc = Tensor::zeros({4, 1, hd}, DType::BF16, Device::CUDA), vc = kc.clone();
  expect_error(
      [&] {
        ops::rope_qkv_to_cache(q, k, k, gpu(int_tensor({0, 1}, {2})), table, gpu(int_tensor({1, 4}, {2})), qb, kc,
                               vc);
        ops::check_index_errors(Device::CUDA);
      },
      "scatter_rows: dst_rows[1] = 4 is outside [0, N=4)");
  expect_error(
      [&] {
        ops::rope_qkv_to_cache(q, k, k, gpu(int_tensor({0, 100}, {2})), table, gpu(int_tensor({1, 2}, {2})), qb, kc,
                               vc);
        ops::check_index_errors(Device::CUDA);
      },
      "rope_forward: positions[1] = 100 is outside [0, max_pos=100)");
}

// rope_fused_qkv_to_cache reads q, k and v in place from the fused projection's rows and writes
// the bits of rope_qkv_to_cache on the three parts: q's copy and both caches' rows, with and
// without float4 groups (hd 64, 6).
TEST(CudaLayers, RopeFusedQkvToCacheIsTheThreePartsBits) {
  SKIP_WITHOUT_GPU();
  const int64_t max_pos = 100, N = 37, Hq = 4, Hkv = 2, R = 150;
  for (const int64_t hd : {int64_t(64), int64_t(6)}) {
    const std::string name = cfg("hd=%lld", hd);
    const Tensor table = ops::rope_table(max_pos, hd, 10000.0, Device::CUDA);
    const Tensor pos = gpu(random_ints({N}, 0, int32_t(max_pos), 330));
    const Tensor dst = scrambled_rows(N, R, 331);
    const Tensor qkv = random_tensor({N, (Hq + 2 * Hkv) * hd}, DType::F32, 332, -2.0, 2.0);
    Tensor cache0 = Tensor::empty({R, Hkv, hd}, DType::BF16, Device::CUDA);
    ops::convert(gpu(random_tensor({R, Hkv, hd}, DType::F32, 333)), cache0);
    Tensor qa = Tensor::empty({N, Hq, hd}, DType::BF16, Device::CUDA), kca = cache0.clone(), vca = cache0.clone();
    ops::rope_qkv_to_cache(gpu(column_block(qkv, 0, Hq * hd)).reshape({N, Hq, hd}),
                           gpu(column_block(qkv, Hq * hd, Hkv * hd)).reshape({N, Hkv, hd}),
                           gpu(column_block(qkv, (Hq + Hkv) * hd, Hkv * hd)).reshape({N, Hkv, hd}), pos, table, dst,
                           qa, kca, vca);
    Tensor qf = Tensor::empty({N, Hq, hd}, DType::BF16, Device::CUDA), kcf = cache0.clone(), vcf = cache0.clone();
    ops::rope_fused_qkv_to_cache(gpu(qkv).reshape({N, Hq + 2 * Hkv, hd}), Hq, pos, table, dst, qf, kcf, vcf);
    expect_bits("rope_fused_qkv_to_cache q " + name, qf, qa);
    expect_bits("rope_fused_qkv_to_cache k cache " + name, kcf, kca);
    expect_bits("rope_fused_qkv_to_cache v cache " + name, vcf, vca);
  }
}

// ---- swiglu ---------------------------------------------------------------------------------------

TEST(CudaLayers, SwigluMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (const Shape& s : {Shape{77, 96}, Shape{513, 1024}, Shape{3, 5}, Shape{7}}) {
    const std::string name = "swiglu " + shape_str(s);
    const Tensor h1 = random_tensor(s, DType::F32, 400, -8.0, 8.0);
    const Tensor h3 = random_tensor(s, DType::F32, 401, -2.0, 2.0);
    const Tensor da = random_tensor(s, DType::F32, 402);
    Tensor a_c = Tensor::empty(s, DType::F32), a_g = Tensor::empty(s, DType::F32, Device::CUDA);
    ops::swiglu_forward(h1, h3, a_c);
    const Tensor h1g = gpu(h1), h3g = gpu(h3);
    ops::swiglu_forward(h1g, h3g, a_g);
    expect_close(name + " forward", a_g, a_c, kElementwiseTol);
    Tensor d1c = Tensor::empty(s, DType::F32), d3c = Tensor::empty(s, DType::F32);
    Tensor d1g = Tensor::empty(s, DType::F32, Device::CUDA), d3g = Tensor::empty(s, DType::F32, Device::CUDA);
    ops::swiglu_backward(da, h1, h3, d1c, d3c);
    ops::swiglu_backward(gpu(da), h1g, h3g, d1g, d3g);
    expect_close(name + " backward dh1", d1g, d1c, kElementwiseTol);
    expect_close(name + " backward dh3", d3g, d3c, kElementwiseTol);
  }
}

// swiglu_forward_fused reads the gate and up halves of each fused row in place and gives
// swiglu_forward's bits on the two halves, F32 and BF16 outputs: F a multiple of 4 (float4 groups)
// and not (element by element).
TEST(CudaLayers, SwigluFusedIsSwigluForwardsBits) {
  SKIP_WITHOUT_GPU();
  for (const int64_t F : {int64_t(1024), int64_t(64), int64_t(13), int64_t(6)}) {
    const int64_t N = 77;
    const std::string name = cfg("N=%lld F=%lld", N, F);
    const Tensor h13 = random_tensor({N, 2 * F}, DType::F32, 410, -8.0, 8.0);
    const Tensor h1 = gpu(column_block(h13, 0, F)), h3 = gpu(column_block(h13, F, F)), h13g = gpu(h13);
    for (const DType out : {DType::F32, DType::BF16}) {
      Tensor a = Tensor::empty({N, F}, out, Device::CUDA), af = Tensor::empty({N, F}, out, Device::CUDA);
      ops::swiglu_forward(h1, h3, a);
      ops::swiglu_forward_fused(h13g, af);
      expect_bits("swiglu_forward_fused " + name + " " + dtype_name(out), af, a);
    }
  }
}

// ---- fused forms: out-of-place add, the norm backward accumulating into dx ------------------------

TEST(CudaLayers, FusedAddsAreTheirTwoStepForms) {
  SKIP_WITHOUT_GPU();
  // D = 4100: past the one-pass backward's 2048 (the two-kernel form)
  for (const int64_t D : {int64_t(1024), int64_t(13), int64_t(4100)}) {
    const int64_t N = 77;
    const std::string name = cfg("N=%lld D=%lld", N, D);
    const Tensor a = gpu(random_tensor({N, D}, DType::F32, 950)), b = gpu(random_tensor({N, D}, DType::F32, 951));
    Tensor want = a.clone(), got = Tensor::empty({N, D}, DType::F32, Device::CUDA);
    ops::add_(want, b);
    ops::add(a, b, got);
    expect_bits("add vs add_ " + name, got, want);
    const Tensor x = gpu(random_tensor({N, D}, DType::F32, 952, -2.0, 2.0)), w = gpu(random_tensor({D}, DType::F32, 953));
    const Tensor dy = gpu(random_tensor({N, D}, DType::F32, 954));
    const Tensor rstd = gpu(random_tensor({N}, DType::F32, 955, 0.5, 1.5));
    Tensor tmp = Tensor::empty({N, D}, DType::F32, Device::CUDA);
    Tensor dw1 = gpu(Tensor::zeros({D}, DType::F32)), dw2 = gpu(Tensor::zeros({D}, DType::F32));
    Tensor dx_two = a.clone(), dx_one = a.clone();
    ops::rmsnorm_backward(dy, x, w, rstd, tmp, dw1);
    ops::add_(dx_two, tmp);
    ops::rmsnorm_backward(dy, x, w, rstd, dx_one, dw2, true);
    expect_bits("rmsnorm_backward accumulating dx " + name, dx_one, dx_two);
    expect_bits("rmsnorm_backward dw " + name, dw2, dw1);
    // dw_accumulate false over a NaN-filled dw (a stale gradient): the sum added to zeros
    Tensor dw3 = Tensor::empty({D}, DType::F32, Device::CUDA), dx_three = a.clone();
    ops::fill_(dw3, std::nan(""));
    ops::rmsnorm_backward(dy, x, w, rstd, dx_three, dw3, true, false);
    expect_bits("rmsnorm_backward stored dw " + name, dw3, dw1);
    expect_bits("rmsnorm_backward dx with a stored dw " + name, dx_three, dx_two);
  }
}

// ---- BF16 outputs (ops.h): the GEMM operand written by its producer -------------------------------

// An op writing a BF16 output gives the bits of convert() of its F32 output, on aligned tensors
// (8-byte stores) and on views one element off (element stores), for lengths off the groups of 4.
TEST(CudaLayers, Bf16OutputsAreTheConvertedF32Outputs) {
  SKIP_WITHOUT_GPU();
  auto converted = [](const Tensor& f32) {
    Tensor b = Tensor::empty(f32.shape(), DType::BF16, Device::CUDA);
    ops::convert(f32, b);
    return b;
  };
  // A [R, C] BF16 view starting one element into a larger allocation (not 8-byte aligned).
  auto offset_bf16 = [](int64_t R, int64_t C) {
    Tensor big = Tensor::empty({R * C + 1}, DType::BF16, Device::CUDA);
    return big.view(1, {R, C});
  };
  for (const bool shifted : {false, true}) {
    // 2100: the norm backward's two-kernel form (D > 2048)
    for (const int64_t D : {int64_t(1024), int64_t(96), int64_t(13), int64_t(2100)}) {
      const int64_t N = 77;
      const std::string name = cfg("N=%lld D=%lld shifted=%lld", N, D, shifted ? 1 : 0);
      auto out16 = [&](int64_t R, int64_t C) {
        return shifted ? offset_bf16(R, C) : Tensor::empty({R, C}, DType::BF16, Device::CUDA);
      };
      const Tensor x = gpu(random_tensor({N, D}, DType::F32, 900 + uint64_t(D), -2.0, 2.0));
      const Tensor w = gpu(random_tensor({D}, DType::F32, 901, 0.5, 1.5));
      Tensor y = Tensor::empty({N, D}, DType::F32, Device::CUDA), r = Tensor::empty({N}, DType::F32, Device::CUDA);
      Tensor y16 = out16(N, D), r2 = Tensor::empty({N}, DType::F32, Device::CUDA);
      ops::rmsnorm_forward(x, w, 1e-5f, y, r);
      ops::rmsnorm_forward(x, w, 1e-5f, y16, r2);
      expect_bits("rmsnorm y bf16 " + name, y16, converted(y));
      expect_bits("rmsnorm rstd with a bf16 y " + name, r2, r);
      // the F32 y and its BF16 copy (y_bf16), and the backward's dx with its copy (dx_bf16)
      Tensor y_both = Tensor::empty({N, D}, DType::F32, Device::CUDA), y_copy = out16(N, D);
      ops::rmsnorm_forward(x, w, 1e-5f, y_both, r2, &y_copy);
      expect_bits("rmsnorm y with a bf16 copy " + name, y_both, y);
      expect_bits("rmsnorm y's bf16 copy " + name, y_copy, converted(y));
      const Tensor dyn = gpu(random_tensor({N, D}, DType::F32, 911 + uint64_t(D)));
      const Tensor dx0 = gpu(random_tensor({N, D}, DType::F32, 912));
      Tensor dx_plain = dx0.clone(), dx_both = dx0.clone(), dx_copy = out16(N, D);
      Tensor dw_plain = Tensor::zeros({D}, DType::F32, Device::CUDA), dw_both = dw_plain.clone();
      ops::rmsnorm_backward(dyn, x, w, r, dx_plain, dw_plain, true, true);
      ops::rmsnorm_backward(dyn, x, w, r, dx_both, dw_both, true, true, &dx_copy);
      expect_bits("rmsnorm dx with a bf16 copy " + name, dx_both, dx_plain);
      expect_bits("rmsnorm dx's bf16 copy " + name, dx_copy, converted(dx_plain));
      expect_bits("rmsnorm dw with a bf16 dx copy " + name, dw_both, dw_plain);

      const Tensor h1 = gpu(random_tensor({N, D}, DType::F32, 902, -8.0, 8.0));
      const Tensor h3 = gpu(random_tensor({N, D}, DType::F32, 903, -2.0, 2.0));
      const Tensor da = gpu(random_tensor({N, D}, DType::F32, 904));
      Tensor a = Tensor::empty({N, D}, DType::F32, Device::CUDA), a16 = out16(N, D);
      ops::swiglu_forward(h1, h3, a);
      ops::swiglu_forward(h1, h3, a16);
      expect_bits("swiglu a bf16 " + name, a16, converted(a));
      Tensor d1 = Tensor::empty({N, D}, DType::F32, Device::CUDA), d3 = Tensor::empty({N, D}, DType::F32, Device::CUDA);
      Tensor d1_16 = out16(N, D), d3_16 = out16(N, D);
      ops::swiglu_backward(da, h1, h3, d1, d3);
      ops::swiglu_backward(da, h1, h3, d1_16, d3_16);
      expect_bits("swiglu dh1 bf16 " + name, d1_16, converted(d1));
      expect_bits("swiglu dh3 bf16 " + name, d3_16, converted(d3));

      const int64_t k = 2, M = N * k;
      const ops::RoutePlan plan = ops::route_plan(gpu(random_routing(N, 8, k, 905)), 8);
      const Tensor dout = gpu(random_tensor({N, D}, DType::F32, 906)), yp = gpu(random_tensor({M, D}, DType::F32, 907));
      const Tensor tw = gpu(random_tensor({N, k}, DType::F32, 908, 0.0, 1.0));
      Tensor dyp = Tensor::empty({M, D}, DType::F32, Device::CUDA), dw = Tensor::empty({N, k}, DType::F32, Device::CUDA);
      Tensor dyp16 = out16(M, D), dw2 = Tensor::empty({N, k}, DType::F32, Device::CUDA);
      ops::moe_combine_backward(dout, yp, plan.slot_of, tw, dyp, dw);
      ops::moe_combine_backward(dout, yp, plan.slot_of, tw, dyp16, dw2);
      expect_bits("moe_combine_backward dy_perm bf16 " + name, dyp16, converted(dyp));
      expect_bits("moe_combine_backward dw with a bf16 dy_perm " + name, dw2, dw);

      // rope's BF16 copy: hd = D / 16 (64, 6) or D (13 is odd: skipped), three heads
      const int64_t hd = D % 16 == 0 ? D / 16 : D, H = 3;
      if (hd % 2 != 0) continue;
      const Tensor table = ops::rope_table(N, hd, 10000.0, Device::CUDA);
      const Tensor pos = gpu(random_ints({N}, 0, int32_t(N), 909));
      const Tensor xr = gpu(random_tensor({N, H, hd}, DType::F32, 910, -2.0, 2.0));
      Tensor plain = xr.clone(), with = xr.clone();
      Tensor with16 = shifted ? offset_bf16(N * H, hd).reshape({N, H, hd}) : Tensor::empty({N, H, hd}, DType::BF16, Device::CUDA);
      ops::rope_forward(plain, pos, table);
      ops::rope_forward(with, pos, table, &with16);
      expect_bits("rope_forward x with a bf16 copy " + name, with, plain);
      expect_bits("rope_forward bf16 copy " + name, with16, converted(plain));
      ops::rope_backward(plain, pos, table);
      ops::rope_backward(with, pos, table, &with16);
      expect_bits("rope_backward x with a bf16 copy " + name, with, plain);
      expect_bits("rope_backward bf16 copy " + name, with16, converted(plain));
      // bf16_only: the same copy, x as it was
      for (const bool backward : {false, true}) {
        Tensor rotated = xr.clone(), kept = xr.clone();
        Tensor only16 = shifted ? offset_bf16(N * H, hd).reshape({N, H, hd}) : Tensor::empty({N, H, hd}, DType::BF16, Device::CUDA);
        backward ? ops::rope_backward(rotated, pos, table) : ops::rope_forward(rotated, pos, table);
        backward ? ops::rope_backward(kept, pos, table, &only16, true) : ops::rope_forward(kept, pos, table, &only16, true);
        expect_bits("rope bf16_only leaves x " + name, kept, xr);
        expect_bits("rope bf16_only copy " + name, only16, converted(rotated));
      }
    }
  }
}

// add_rmsnorm_forward: the bits of add, then rmsnorm_forward (y F32 with its BF16 copy, or y BF16),
// on aligned tensors and on views one element off (element loads and stores).
TEST(CudaLayers, AddRmsNormIsAddThenRmsNorm) {
  SKIP_WITHOUT_GPU();
  auto offset_f32 = [](int64_t R, int64_t C) {
    Tensor big = Tensor::empty({R * C + 1}, DType::F32, Device::CUDA);
    return big.view(1, {R, C});
  };
  for (const bool shifted : {false, true}) {
    for (const int64_t D : {int64_t(1024), int64_t(96), int64_t(13)}) {
      const int64_t N = 77;
      const std::string name = cfg("N=%lld D=%lld shifted=%lld", N, D, shifted ? 1 : 0);
      Tensor a = shifted ? offset_f32(N, D) : Tensor::empty({N, D}, DType::F32, Device::CUDA);
      a.copy_from(gpu(random_tensor({N, D}, DType::F32, 920 + uint64_t(D), -2.0, 2.0)));
      const Tensor b = gpu(random_tensor({N, D}, DType::F32, 921, -2.0, 2.0));
      const Tensor w = gpu(random_tensor({D}, DType::F32, 922, 0.5, 1.5));
      Tensor sum_ref = Tensor::empty({N, D}, DType::F32, Device::CUDA), y_ref = sum_ref.clone(),
             r_ref = Tensor::empty({N}, DType::F32, Device::CUDA);
      ops::add(a, b, sum_ref);
      ops::rmsnorm_forward(sum_ref, w, 1e-5f, y_ref, r_ref);
      Tensor y16_ref = Tensor::empty({N, D}, DType::BF16, Device::CUDA);
      ops::convert(y_ref, y16_ref);
      Tensor sum = shifted ? offset_f32(N, D) : Tensor::empty({N, D}, DType::F32, Device::CUDA);
      Tensor y = Tensor::empty({N, D}, DType::F32, Device::CUDA), r = r_ref.clone();
      Tensor y16 = Tensor::empty({N, D}, DType::BF16, Device::CUDA);
      ops::add_rmsnorm_forward(a, b, sum, w, 1e-5f, y, r, &y16);
      expect_bits("add_rmsnorm sum " + name, sum, sum_ref);
      expect_bits("add_rmsnorm y " + name, y, y_ref);
      expect_bits("add_rmsnorm rstd " + name, r, r_ref);
      expect_bits("add_rmsnorm y copy " + name, y16, y16_ref);
      Tensor y_only16 = Tensor::empty({N, D}, DType::BF16, Device::CUDA);
      ops::add_rmsnorm_forward(a, b, sum, w, 1e-5f, y_only16, r);
      expect_bits("add_rmsnorm bf16 y " + name, y_only16, y16_ref);
    }
  }
}

// ---- quantized outputs (ops.h "Quantized outputs") --------------------------------------------------

namespace {
// Row-axis specs: the ones fused_rows.cu takes (MXFP8 E4M3 / E5M2 under both scale rules, per-token
// NVFP4 with and without Four Over Six) and one it does not (MXFP8 under SR: the op, then quantize).
std::vector<QuantSpec> row_quant_specs() {
  std::vector<QuantSpec> out;
  for (const Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2})
    for (const num::MxScaleRule rule : {num::MxScaleRule::RCEIL, num::MxScaleRule::FLOOR}) {
      QuantSpec s;
      s.fmt = f;
      s.outer = OuterScale::None;
      s.mx_rule = rule;
      out.push_back(s);
    }
  for (const int variant : {0, 1, 2}) {  // 4/6 by MSE, 4/6 by MAE, no 4/6
    QuantSpec s;
    s.fmt = Format::NVFP4;
    s.outer = OuterScale::PerRow;
    s.four_over_six = variant < 2;
    s.metric = variant == 1 ? num::ScaleMetric::MAE : num::ScaleMetric::MSE;
    out.push_back(s);
  }
  QuantSpec sr = out[0];
  sr.rounding = num::Rounding::SR;
  out.push_back(sr);
  return out;
}

// (rows, cols) of the quantized-output tests: widths the fused kernels take (96, 1000, 1024, 4096,
// 12288: one to 24 warp runs, more runs than warps, partial blocks and runs, a stage past 48 KB of
// shared memory) and widths they do not (13, 16388: the op, then quantize), 1, 5 and 77 rows
// (the widest rows not 77 of them).
std::vector<std::pair<int64_t, int64_t>> row_quant_shapes() {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const int64_t cols : {96, 1000, 1024, 4096, 12288, 13, 16388})
    for (const int64_t rows : {1, 5, 77})
      if (cols <= 4096 || rows < 77) out.emplace_back(rows, cols);
  return out;
}

// The quantized output equals quantize of the op's F32 output on the CPU (the reference numerics),
// codes, block scales and outer scales byte for byte.
void expect_quantized_rows(const std::string& what, const QTensor& got, const Tensor& y, const ops::RowQuant& rq) {
  const QTensor want = ops::quantize(host(y), rq.spec, rq.rng);
  ASSERT_EQ(got.device(), Device::CUDA) << what;
  ASSERT_EQ(got.logical_shape(), want.logical_shape()) << what;
  expect_bits(what + " codes", got.codes, want.codes);
  expect_bits(what + " block scales", got.block_scales, want.block_scales);
  ASSERT_EQ(got.outer_scales.defined(), want.outer_scales.defined()) << what;
  if (want.outer_scales.defined()) expect_bits(what + " outer scales", got.outer_scales, want.outer_scales);
}

// Columns of w (or of h13's gate half) that drive rows' blocks off the quantizers' fast paths:
// huge values (the per-token group outside Four Over Six's exact range), tiny ones (subnormal
// block scales), and a NaN (non-finite blocks, the sticky flag).
Tensor with_columns(Tensor t, int64_t rows, int64_t cols, const std::vector<std::pair<int64_t, float>>& cols_vals) {
  for (int64_t r = 0; r < rows; ++r)
    for (const auto& [c, v] : cols_vals)
      if (c < cols) t.data<float>()[r * cols + c] = v;
  return t;
}
}  // namespace

// rmsnorm_forward and add_rmsnorm_forward with y quantized: y, rstd, the sum and y's BF16 copy are
// the plain op's bits, and the quantized y is quantize(y)'s, for every spec on rows the fused kernel
// takes and rows it does not (row_quant_shapes). The weights' variants put huge, tiny and NaN
// values in rows, and a NaN raises the non-finite flag.
TEST(CudaLayers, NormQuantizedOutputIsTheNormThenQuantize) {
  SKIP_WITHOUT_GPU();
  const std::vector<QuantSpec> specs = row_quant_specs();
  for (const auto& [N, D] : row_quant_shapes()) {
    const Tensor a = gpu(random_tensor({N, D}, DType::F32, 930 + uint64_t(D + N), -2.0, 2.0));
    const Tensor b = gpu(random_tensor({N, D}, DType::F32, 931, -2.0, 2.0));
    const Tensor w_plain = random_tensor({D}, DType::F32, 932, 0.5, 1.5);
    for (const int wv : {0, 1, 2}) {  // plain weights, huge and tiny columns, a NaN column
      const Tensor w = gpu(wv == 0   ? w_plain
                           : wv == 1 ? with_columns(w_plain.clone(), 1, D, {{3, 3e30f}, {40, 1e-32f}})
                                     : with_columns(w_plain.clone(), 1, D, {{7, NAN}}));
      for (const bool add : {false, true}) {
        Tensor sum_ref = Tensor::empty({N, D}, DType::F32, Device::CUDA), y_ref = sum_ref.clone();
        Tensor r_ref = Tensor::empty({N}, DType::F32, Device::CUDA);
        Tensor y16_ref = Tensor::empty({N, D}, DType::BF16, Device::CUDA);
        if (add) ops::add_rmsnorm_forward(a, b, sum_ref, w, 1e-5f, y_ref, r_ref, &y16_ref);
        else ops::rmsnorm_forward(a, w, 1e-5f, y_ref, r_ref, &y16_ref);
        for (const QuantSpec& spec : specs) {
          const std::string name =
              cfg("N=%lld D=%lld weights %lld ", N, D, wv) + (add ? "add_rmsnorm " : "rmsnorm ") + describe(spec);
          SCOPED_TRACE(name);
#if FOURBIT_HAS_CUDA
          EXPECT_EQ(ops::cuda::row_quant_fused(spec, D),
                    spec.rounding == num::Rounding::RNE && D % 4 == 0 && D <= 16384);
#endif
          Tensor sum = Tensor::empty({N, D}, DType::F32, Device::CUDA), y = sum.clone(), r = r_ref.clone();
          Tensor y16 = y16_ref.clone();
          QTensor q;
          const ops::RowQuant rq{spec, ops::RngKey{11, 7}, &q};
          ops::nonfinite_seen(true);
          if (add) ops::add_rmsnorm_forward(a, b, sum, w, 1e-5f, y, r, &y16, &rq);
          else ops::rmsnorm_forward(a, w, 1e-5f, y, r, &y16, &rq);
          EXPECT_EQ(ops::nonfinite_seen(true), wv == 2);
          expect_bits(name + " y", y, y_ref);
          expect_bits(name + " rstd", r, r_ref);
          expect_bits(name + " y copy", y16, y16_ref);
          if (add) expect_bits(name + " sum", sum, sum_ref);
          expect_quantized_rows(name, q, y_ref, rq);
        }
      }
    }
  }
}

// swiglu_forward_fused with a quantized: a is the plain op's bits and the quantized a is
// quantize(a)'s, on row_quant_shapes and gate values that are huge, tiny or NaN in some columns.
TEST(CudaLayers, SwigluQuantizedOutputIsTheSwigluThenQuantize) {
  SKIP_WITHOUT_GPU();
  const std::vector<QuantSpec> specs = row_quant_specs();
  for (const auto& [N, F] : row_quant_shapes()) {
    const Tensor h13_plain = random_tensor({N, 2 * F}, DType::F32, 940 + uint64_t(F + N), -6.0, 6.0);
    for (const int hv : {0, 1, 2}) {
      const Tensor h13 =
          gpu(hv == 0   ? h13_plain
              : hv == 1 ? with_columns(h13_plain.clone(), N, 2 * F, {{5, 4e30f}, {F + 5, 1e3f}, {33, 1e-35f}})
                        : with_columns(h13_plain.clone(), N, 2 * F, {{F + 9, NAN}}));
      Tensor a_ref = Tensor::empty({N, F}, DType::F32, Device::CUDA);
      ops::swiglu_forward_fused(h13, a_ref);
      for (const QuantSpec& spec : specs) {
        const std::string name = cfg("N=%lld F=%lld gate %lld ", N, F, hv) + describe(spec);
        SCOPED_TRACE(name);
        Tensor a = Tensor::empty({N, F}, DType::F32, Device::CUDA);
        QTensor q;
        const ops::RowQuant rq{spec, ops::RngKey{12, 9}, &q};
        ops::nonfinite_seen(true);
        ops::swiglu_forward_fused(h13, a, &rq);
        EXPECT_EQ(ops::nonfinite_seen(true), hv == 2);
        expect_bits(name + " a", a, a_ref);
        expect_quantized_rows(name, q, a_ref, rq);
      }
    }
  }
}

// attention_step with a quantized out: out, lse and out's BF16 copy are the plain step's bits, and
// the quantized out is quantize(out)'s over its [B, Hq * hd] rows, for every row_quant_specs spec
// (the step's epilogue takes the MXFP8 ones rounded to nearest), every head size, a CTA a q head
// (group 1) and the head-rows CTA (group 4), both engines, positions in the first and the last key
// block, and values a kv head of v scales huge or tiny, or an Inf in v (non-finite blocks, the
// sticky flag).
TEST(CudaLayers, AttentionStepQuantizedOutputIsTheStepThenQuantize) {
  SKIP_WITHOUT_GPU();
#if FOURBIT_HAS_CUDA
  struct Restore {
    ~Restore() { ops::cuda::set_flash_wgmma(true); }
  } restore;
  const std::vector<QuantSpec> specs = row_quant_specs();
  const int64_t B = 3, S = 150, Hkv = 2;
  const Tensor positions = gpu(int_tensor({0, 77, 149}, {B}));
  for (const int64_t hd : {32, 64, 128})
    for (const int64_t group : {1, 4}) {
      const int64_t Hq = Hkv * group;
      const Tensor q = gpu(random_tensor({B, 1, Hq, hd}, DType::F32, 950 + uint64_t(hd), -2.0, 2.0));
      const Tensor k = gpu(random_tensor({B, S, Hkv, hd}, DType::F32, 951, -2.0, 2.0));
      const Tensor v_plain = random_tensor({B, S, Hkv, hd}, DType::F32, 952, -2.0, 2.0);
      for (const int vv : {0, 1, 2}) {  // plain; kv head 0 huge and 1 tiny; an Inf at key 10
        Tensor vh = v_plain.clone();
        float* pv = vh.data<float>();
        for (int64_t i = 0; i < vh.numel(); ++i) {
          const int64_t head = i / hd % Hkv, key = i / (hd * Hkv) % S;
          if (vv == 1) pv[i] *= head == 0 ? 1e30f : 1e-35f;
          if (vv == 2 && head == 0 && key == 10 && i % hd == 5) pv[i] = INFINITY;
        }
        const Tensor v = gpu(vh);
        for (const bool wgmma : {true, false}) {
          ops::cuda::set_flash_wgmma(wgmma);
          Tensor out_ref = Tensor::empty(q.shape(), DType::F32, Device::CUDA),
                 lse_ref = Tensor::empty({B, Hq, 1}, DType::F32, Device::CUDA),
                 o16_ref = Tensor::empty(q.shape(), DType::BF16, Device::CUDA);
          ops::attention_step(q, k, v, positions, out_ref, lse_ref, &o16_ref);
          for (const QuantSpec& spec : specs) {
            const std::string name = cfg("hd=%lld group=%lld values %lld ", hd, group, vv) +
                                     (wgmma ? "wgmma " : "mma.sync ") + describe(spec);
            SCOPED_TRACE(name);
            EXPECT_EQ(ops::cuda::attention_step_quant_fused(spec, hd),
                      spec.fmt != Format::NVFP4 && spec.rounding == num::Rounding::RNE);
            Tensor out = Tensor::empty(q.shape(), DType::F32, Device::CUDA),
                   lse = Tensor::empty({B, Hq, 1}, DType::F32, Device::CUDA),
                   o16 = Tensor::empty(q.shape(), DType::BF16, Device::CUDA);
            QTensor oq;
            const ops::RowQuant rq{spec, ops::RngKey{13, 5}, &oq};
            ops::nonfinite_seen(true);
            ops::attention_step(q, k, v, positions, out, lse, &o16, &rq);
            EXPECT_EQ(ops::nonfinite_seen(true), vv == 2);
            expect_bits(name + " out", out, out_ref);
            expect_bits(name + " lse", lse, lse_ref);
            expect_bits(name + " out copy", o16, o16_ref);
            expect_quantized_rows(name, oq, out_ref.reshape({B, Hq * hd}), rq);
          }
        }
      }
    }
#endif
}

// ---- cross entropy --------------------------------------------------------------------------------

TEST(CudaLayers, CrossEntropyMatchesCpuAndIsBatchInvariant) {
  SKIP_WITHOUT_GPU();
  struct Cfg { int64_t N, V; };
  for (const Cfg c : {Cfg{513, 260}, Cfg{77, 32000}, Cfg{33, 1001}}) {
    const std::string name = cfg("N=%lld V=%lld", c.N, c.V);
    Tensor logits = random_tensor({c.N, c.V}, DType::F32, 500 + uint64_t(c.V), -8.0, 8.0);
    Tensor tgt = random_ints({c.N}, 0, int32_t(c.V), 501);
    for (int64_t n = 4; n < c.N; n += 5) tgt.data<int32_t>()[n] = -1;  // ignored rows
    if (c.V == 1001)  // masked logits (-inf) away from the target: probability 0, gradient 0
      for (int64_t n = 0; n < c.N; ++n)
        for (int64_t v = n % 7; v < c.V; v += 97)
          if (v != tgt.data<int32_t>()[n]) logits.data<float>()[n * c.V + v] = -INFINITY;
    const float gs = 1.0f / float(c.N);
    Tensor loss_c = Tensor::empty({c.N}, DType::F32), dl_c = Tensor::empty({c.N, c.V}, DType::F32);
    ops::cross_entropy(logits, tgt, loss_c, &dl_c, gs);
    const Tensor lg = gpu(logits), tg = gpu(tgt);
    Tensor loss_g = Tensor::empty({c.N}, DType::F32, Device::CUDA);
    Tensor dl_g = Tensor::empty({c.N, c.V}, DType::F32, Device::CUDA);
    ops::cross_entropy(lg, tg, loss_g, &dl_g, gs);
    expect_close("cross_entropy losses " + name, loss_g, loss_c, kReductionTol);
    expect_close("cross_entropy dlogits " + name, dl_g, dl_c, kReductionTol);
    Tensor loss_only = Tensor::empty({c.N}, DType::F32, Device::CUDA);
    ops::cross_entropy(lg, tg, loss_only, nullptr, gs);
    expect_bits("cross_entropy losses without dlogits " + name, loss_only, loss_g);

    if (c.N != 513) continue;
    for (const int64_t r : {int64_t(0), int64_t(4), int64_t(300), int64_t(512)}) {
      Tensor l1 = Tensor::empty({1}, DType::F32, Device::CUDA);
      Tensor d1 = Tensor::empty({1, c.V}, DType::F32, Device::CUDA);
      const Tensor t1 = gpu(tgt.view(r, {1}));
      ops::cross_entropy(gpu_row(logits, r), t1, l1, &d1, gs);
      expect_bits(cfg("cross_entropy loss row %lld alone vs in N=513", r), l1, host(loss_g).view(r, {1}));
      expect_bits(cfg("cross_entropy dlogits row %lld alone vs in N=513", r), d1, host_row(dl_g, r));
    }
  }
  {
    // Per-token weights (RL advantages): the GPU's weighted gradient tracks the CPU's like the
    // unweighted one; weights of 1 give the unweighted bits; the losses stay unweighted.
    const int64_t N = 129, V = 260;
    const Tensor logits = random_tensor({N, V}, DType::F32, 510, -8.0, 8.0);
    Tensor tgt = random_ints({N}, 0, int32_t(V), 511);
    for (int64_t n = 3; n < N; n += 7) tgt.data<int32_t>()[n] = -1;
    const Tensor w = random_tensor({N}, DType::F32, 512, -2.0, 2.0);
    std::vector<float> ones_v(size_t(N), 1.0f);
    const Tensor ones = Tensor::from_host(ones_v.data(), {N}, DType::F32);
    const float gs = 1.0f / float(N);
    Tensor loss_c = Tensor::empty({N}, DType::F32), dl_c = Tensor::empty({N, V}, DType::F32);
    ops::cross_entropy(logits, tgt, loss_c, &dl_c, gs, &w);
    const Tensor lg = gpu(logits), tg = gpu(tgt), wg = gpu(w), og = gpu(ones);
    Tensor loss_w = Tensor::empty({N}, DType::F32, Device::CUDA), dl_w = Tensor::empty({N, V}, DType::F32, Device::CUDA);
    Tensor loss_p = Tensor::empty({N}, DType::F32, Device::CUDA), dl_p = Tensor::empty({N, V}, DType::F32, Device::CUDA);
    Tensor loss_1 = Tensor::empty({N}, DType::F32, Device::CUDA), dl_1 = Tensor::empty({N, V}, DType::F32, Device::CUDA);
    ops::cross_entropy(lg, tg, loss_w, &dl_w, gs, &wg);
    ops::cross_entropy(lg, tg, loss_p, &dl_p, gs);
    ops::cross_entropy(lg, tg, loss_1, &dl_1, gs, &og);
    expect_close("cross_entropy weighted dlogits", dl_w, dl_c, kReductionTol);
    expect_bits("cross_entropy weighted losses = unweighted", loss_w, loss_p);
    expect_bits("cross_entropy weights of 1 = no weights (dlogits)", dl_1, dl_p);
  }
#if FOURBIT_HAS_CUDA
  {
    // The block a row is sized by V (128 threads for V = 260); every size with a thread for each
    // group of 4 logits gives the bits of 1024 threads (cuda::cross_entropy_threads).
    EXPECT_EQ(ops::cuda::cross_entropy_threads(260), 128);
    EXPECT_EQ(ops::cuda::cross_entropy_threads(1001), 256);
    EXPECT_EQ(ops::cuda::cross_entropy_threads(2048), 512);
    EXPECT_EQ(ops::cuda::cross_entropy_threads(32000), 1024);
    for (const int64_t V : {int64_t(5), int64_t(260), int64_t(513), int64_t(1001), int64_t(2049)}) {
      const int64_t N = 300;
      Tensor logits = random_tensor({N, V}, DType::F32, 520 + uint64_t(V), -8.0, 8.0);
      Tensor tgt = random_ints({N}, 0, int32_t(V), 521);
      for (int64_t n = 2; n < N; n += 9) tgt.data<int32_t>()[n] = -1;
      const Tensor lg = gpu(logits), tg = gpu(tgt), wg = gpu(random_tensor({N}, DType::F32, 522, -2.0, 2.0));
      Tensor l[2], d[2];
      for (int i = 0; i < 2; ++i) {
        ops::cuda::set_cross_entropy_threads(i == 0 ? 0 : 1024);
        l[i] = Tensor::empty({N}, DType::F32, Device::CUDA);
        d[i] = Tensor::empty({N, V}, DType::F32, Device::CUDA);
        ops::cross_entropy(lg, tg, l[i], &d[i], 1.0 / double(N), &wg);
      }
      ops::cuda::set_cross_entropy_threads(0);
      const std::string name = cfg("%lld threads vs 1024, V=%lld", ops::cuda::cross_entropy_threads(V), V);
      expect_bits("cross_entropy losses, " + name, l[0], l[1]);
      expect_bits("cross_entropy dlogits, " + name, d[0], d[1]);
    }
    expect_error([] { ops::cuda::set_cross_entropy_threads(100); }, "set_cross_entropy_threads: 0 (by V)");
  }
#endif
  Tensor loss = Tensor::empty({4}, DType::F32, Device::CUDA);
  expect_error([&] {
    ops::cross_entropy(gpu(random_tensor({4, 260}, DType::F32, 502)),
                       gpu(int_tensor({1, -1, 5, 260}, {4})), loss, nullptr, 1.0f);
  }, "cross_entropy: targets[3] = 260 is outside [0, V=260) and is not -1 (ignored)");
}

// ---- router ---------------------------------------------------------------------------------------

TEST(CudaLayers, RouterMatchesCpuAndIsBatchInvariant) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 513;
  for (const int64_t E : {int64_t(8), int64_t(64)}) {
    for (const int64_t k : {int64_t(1), int64_t(2), int64_t(4)}) {
      const std::string name = cfg("N=%lld E=%lld k=%lld", N, E, k);
      Tensor logits = random_tensor({N, E}, DType::F32, 600 + uint64_t(E * 10 + k), -3.0, 3.0);
      // Exact ties in every 7th row: experts 1, 3 and E-1 share the row's largest logit.
      for (int64_t n = 0; n < N; n += 7) {
        float* row = logits.data<float>() + n * E;
        for (const int64_t e : {int64_t(1), int64_t(3), E - 1}) row[e] = 3.5f;
      }
      Tensor p_c = Tensor::empty({N, E}, DType::F32), i_c = Tensor::empty({N, k}, DType::I32),
             w_c = Tensor::empty({N, k}, DType::F32);
      ops::router_topk(logits, k, p_c, i_c, w_c);
      const Tensor lg = gpu(logits);
      Tensor p_g = Tensor::empty({N, E}, DType::F32, Device::CUDA);
      Tensor i_g = Tensor::empty({N, k}, DType::I32, Device::CUDA);
      Tensor w_g = Tensor::empty({N, k}, DType::F32, Device::CUDA);
      ops::router_topk(lg, k, p_g, i_g, w_g);
      expect_close("router_topk probs " + name, p_g, p_c, kReductionTol);
      expect_bits("router_topk topk_idx " + name, i_g, i_c);
      expect_close("router_topk topk_w " + name, w_g, w_c, kReductionTol);

      // Backward from the CPU's forward outputs on both sides, with and without d_probs.
      const Tensor dw = random_tensor({N, k}, DType::F32, 610);
      const Tensor dp = random_tensor({N, E}, DType::F32, 611);
      Tensor dl_c = Tensor::empty({N, E}, DType::F32);
      Tensor dl_g = Tensor::empty({N, E}, DType::F32, Device::CUDA);
      ops::router_backward(p_c, i_c, w_c, dw, dp, dl_c);
      ops::router_backward(gpu(p_c), gpu(i_c), gpu(w_c), gpu(dw), gpu(dp), dl_g);
      expect_close("router_backward d_logits " + name, dl_g, dl_c, kReductionTol);
      ops::router_backward(p_c, i_c, w_c, dw, Tensor(), dl_c);
      ops::router_backward(gpu(p_c), gpu(i_c), gpu(w_c), gpu(dw), Tensor(), dl_g);
      expect_close("router_backward d_logits (no d_probs) " + name, dl_g, dl_c, kReductionTol);
      // d_probs as one row every token shares: the bits of the row repeated
      const Tensor dp1 = random_tensor({1, E}, DType::F32, 612);
      Tensor dp_rep = Tensor::empty({N, E}, DType::F32);
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(dp_rep.data<float>() + n * E, dp1.data<float>(), size_t(E) * sizeof(float));
      Tensor dl_row = Tensor::empty({N, E}, DType::F32, Device::CUDA);
      ops::router_backward(gpu(p_c), gpu(i_c), gpu(w_c), gpu(dw), gpu(dp1), dl_row);
      ops::router_backward(gpu(p_c), gpu(i_c), gpu(w_c), gpu(dw), gpu(dp_rep), dl_g);
      expect_bits("router_backward d_logits, [1, E] d_probs " + name, dl_row, dl_g);

      for (const int64_t r : {int64_t(0), int64_t(1), int64_t(511)}) {
        Tensor p1 = Tensor::empty({1, E}, DType::F32, Device::CUDA);
        Tensor i1 = Tensor::empty({1, k}, DType::I32, Device::CUDA);
        Tensor w1 = Tensor::empty({1, k}, DType::F32, Device::CUDA);
        ops::router_topk(gpu_row(logits, r), k, p1, i1, w1);
        expect_bits(cfg("router probs row %lld alone vs in N=513", r), p1, host_row(p_g, r));
        expect_bits(cfg("router topk_idx row %lld alone", r), i1, host_row(i_g, r));
        expect_bits(cfg("router topk_w row %lld alone", r), w1, host_row(w_g, r));
      }
    }
  }
}

// ---- route plan -----------------------------------------------------------------------------------

TEST(CudaLayers, RoutePlanEqualsCpuExactly) {
  SKIP_WITHOUT_GPU();
  struct Cfg { int64_t N, E, k; bool skew; };
  for (const Cfg c : {Cfg{1, 8, 1, false}, Cfg{77, 8, 2, false}, Cfg{513, 64, 4, false},
                      Cfg{5000, 64, 2, true}, Cfg{20000, 64, 4, false}, Cfg{3000, 8, 4, true},
                      Cfg{0, 8, 2, false}}) {
    const std::string name = cfg("N=%lld E=%lld k=%lld", c.N, c.E, c.k) + (c.skew ? " skewed" : "");
    Tensor idx = random_routing(c.N, c.E, c.k, 700 + uint64_t(c.N));
    if (c.skew)  // rank 0 of most tokens goes to expert 3 (duplicates within a token allowed)
      for (int64_t n = 0; n < c.N; n += 1 + n % 3) idx.data<int32_t>()[n * c.k] = 3;
    const ops::RoutePlan want = ops::route_plan(idx, c.E);
    const ops::RoutePlan got = ops::route_plan(gpu(idx), c.E);
    EXPECT_EQ(got.offsets, want.offsets) << name;
    EXPECT_EQ(got.slot_of.device(), Device::CUDA);
    EXPECT_EQ(got.token_of_slot.device(), Device::CUDA);
    expect_bits("route_plan slot_of " + name, got.slot_of, want.slot_of);
    expect_bits("route_plan token_of_slot " + name, got.token_of_slot, want.token_of_slot);
  }
  expect_error([&] { ops::route_plan(gpu(int_tensor({0, 1, 64, 2}, {2, 2})), 64); },
               "route_plan: topk_idx[1, 0] = 64 is outside [0, n_experts=64)");
}

// The router probabilities' sums (ops.h "prob_sums") are the CPU's bits; in two halves, with work
// queued between them and two plans pending at once, the plans are route_plan's.
TEST(CudaLayers, RoutePlanProbabilitySumsAndTwoHalvesEqualCpu) {
  SKIP_WITHOUT_GPU();
  for (const int64_t N : {int64_t(0), int64_t(1), int64_t(65), int64_t(8192), int64_t(20001)}) {
    const int64_t E = 16, k = 2;
    const std::string name = cfg("N=%lld", N);
    const Tensor idx = random_routing(N, E, k, 980 + uint64_t(N));
    const Tensor probs = random_tensor({N, E}, DType::F32, 990 + uint64_t(N), 0.0, 1.0);
    const ops::RoutePlan want = ops::route_plan(idx, E, probs);
    const ops::RoutePlan got = ops::route_plan(gpu(idx), E, gpu(probs));
    EXPECT_EQ(got.offsets, want.offsets) << name;
    ASSERT_EQ(got.prob_sums.size(), size_t(E)) << name;
    for (int64_t e = 0; e < E; ++e)
      EXPECT_EQ(got.prob_sums[size_t(e)], want.prob_sums[size_t(e)]) << name << " expert " << e;
  }
  const int64_t N = 4096, E = 8, k = 2;
  const Tensor idx_a = random_routing(N, E, k, 995), idx_b = random_routing(N, E, k, 996);
  const Tensor probs = random_tensor({N, E}, DType::F32, 997, 0.0, 1.0);
  const ops::RoutePlan want_a = ops::route_plan(idx_a, E, probs), want_b = ops::route_plan(idx_b, E);
  ops::PendingRoutePlan a = ops::route_plan_begin(gpu(idx_a), E, gpu(probs));
  ops::PendingRoutePlan b = ops::route_plan_begin(gpu(idx_b), E);
  const Tensor big = random_tensor({1 << 22}, DType::F32, 998);  // queued behind both read-backs
  Tensor big16 = Tensor::empty({1 << 22}, DType::BF16, Device::CUDA);
  for (int i = 0; i < 8; ++i) ops::convert(gpu(big), big16);
  const ops::RoutePlan got_b = ops::route_plan_end(std::move(b)), got_a = ops::route_plan_end(std::move(a));
  EXPECT_EQ(got_a.offsets, want_a.offsets);
  EXPECT_EQ(got_a.prob_sums, want_a.prob_sums);
  EXPECT_EQ(got_b.offsets, want_b.offsets);
  EXPECT_TRUE(got_b.prob_sums.empty());
  expect_bits("two halves: token_of_slot", got_a.token_of_slot, want_a.token_of_slot);
  expect_bits("two halves: slot_of", got_b.slot_of, want_b.slot_of);
  // A plan begun and dropped unfinished waits for its read-back before its buffer is reused.
  { ops::PendingRoutePlan dropped = ops::route_plan_begin(gpu(idx_a), E, gpu(probs)); }
  EXPECT_EQ(ops::route_plan(gpu(idx_b), E).offsets, want_b.offsets);
}

// A plan begun without its read-back (the sampler's MoE layers) has the CPU's slot maps and, on
// the GPU only, its offsets (one-warp sort up to 4096 assignments, the multi-kernel one above);
// the host's offsets stay empty, and a bad expert id is reported by check_index_errors.
TEST(CudaLayers, RoutePlanWithoutReadBackKeepsTheOffsetsOnTheGpu) {
  SKIP_WITHOUT_GPU();
  for (const int64_t N : {int64_t(1), int64_t(256), int64_t(2048), int64_t(2049), int64_t(9000)}) {
    const int64_t E = 16, k = 2;
    const std::string name = cfg("N=%lld", N);
    const Tensor idx = random_routing(N, E, k, 1100 + uint64_t(N));
    const ops::RoutePlan want = ops::route_plan(idx, E);
    const ops::PendingRoutePlan got = ops::route_plan_begin(gpu(idx), E, Tensor(), false);
    EXPECT_TRUE(got.plan.offsets.empty()) << name;
    EXPECT_FALSE(got.finish) << name;
    const Tensor off = got.plan.device_offsets.to(Device::CPU);
    EXPECT_EQ(std::vector<int64_t>(off.data<int32_t>(), off.data<int32_t>() + off.numel()), want.offsets) << name;
    expect_bits("no read-back: token_of_slot " + name, got.plan.token_of_slot, want.token_of_slot);
    expect_bits("no read-back: slot_of " + name, got.plan.slot_of, want.slot_of);
  }
  ops::check_index_errors(Device::CUDA);  // nothing recorded
  expect_error(
      [&] {
        const ops::PendingRoutePlan bad =
            ops::route_plan_begin(gpu(int_tensor({0, 1, 64, 2}, {2, 2})), 64, Tensor(), false);
        ops::check_index_errors(Device::CUDA);
      },
      "route_plan: topk_idx[1, 0] = 64 is outside [0, n_experts=64)");
}

// A plan begun without its read-back keeps its probability sums on the GPU (device_prob_sums: the
// CPU's), and the load-balance term and d/dprobs made from the device's offsets and sums are the
// CPU's bits; so are the target count and gradient scale (count_targets), and the cross-entropy
// reading that scale gives the bits of the same scale passed by value. In a DeferIndexChecks
// scope a bad token id or target does not fail its op; check_index_errors_later names the first
// as the op would have, and the record is clear after it.
TEST(CudaLayers, LoadBalanceTermsAndTargetCountOnTheGpuEqualCpu) {
  SKIP_WITHOUT_GPU();
  for (const int64_t N : {int64_t(1), int64_t(65), int64_t(2049), int64_t(9000)}) {
    const int64_t E = 16, k = 2;
    const std::string name = cfg("N=%lld", N);
    const Tensor idx = random_routing(N, E, k, 1130 + uint64_t(N));
    const Tensor probs = random_tensor({N, E}, DType::F32, 1140 + uint64_t(N), 0.0, 1.0);
    const ops::RoutePlan want = ops::route_plan(idx, E, probs);
    const ops::PendingRoutePlan got = ops::route_plan_begin(gpu(idx), E, gpu(probs), false);
    EXPECT_TRUE(got.plan.offsets.empty()) << name;
    ASSERT_TRUE(got.plan.device_prob_sums.defined()) << name;
    const Tensor sums = host(got.plan.device_prob_sums);
    EXPECT_EQ(std::vector<double>(sums.data<double>(), sums.data<double>() + E), want.prob_sums) << name;
    std::vector<int32_t> off32(want.offsets.begin(), want.offsets.end());
    const Tensor off = int_tensor(off32, {E + 1});
    const Tensor psum = Tensor::from_host(want.prob_sums.data(), {E}, DType::F64);
    Tensor terms_c = Tensor::zeros({2}, DType::F64), terms_g = Tensor::zeros({2}, DType::F64, Device::CUDA);
    ops::load_balance_term(off, psum, N, N * k, 0.01, terms_c, 1);
    ops::load_balance_term(got.plan.device_offsets, got.plan.device_prob_sums, N, N * k, 0.01, terms_g, 1);
    expect_bits("load_balance_term " + name, terms_g, terms_c);
    Tensor dp_c = Tensor::empty({1, E}, DType::F32), dp_g = Tensor::empty({1, E}, DType::F32, Device::CUDA);
    ops::load_balance_dprobs(off, N, N * k, 0.25f, 0.01, dp_c);
    ops::load_balance_dprobs(got.plan.device_offsets, N, N * k, 0.25f, 0.01, dp_g);
    expect_bits("load_balance_dprobs " + name, dp_g, dp_c);
  }
  for (const int64_t N : {int64_t(1), int64_t(1000), int64_t(8192), int64_t(20001)}) {
    const std::string name = cfg("N=%lld", N);
    Tensor tgt = random_ints({N}, 0, 260, 1150 + uint64_t(N));
    for (int64_t n = 3; n < N; n += 7) tgt.data<int32_t>()[n] = -1;
    Tensor count_c = Tensor::empty({1}, DType::F64), scale_c = Tensor::empty({1}, DType::F32);
    Tensor count_g = Tensor::empty({1}, DType::F64, Device::CUDA), scale_g = Tensor::empty({1}, DType::F32, Device::CUDA);
    ops::count_targets(tgt, 0.75f, count_c, scale_c);
    const Tensor tg = gpu(tgt);
    ops::count_targets(tg, 0.75f, count_g, scale_g);
    expect_bits("count_targets count " + name, count_g, count_c);
    expect_bits("count_targets scale " + name, scale_g, scale_c);
    const Tensor lg = gpu(random_tensor({N, 260}, DType::F32, 1160 + uint64_t(N), -8.0, 8.0));
    Tensor l1 = Tensor::empty({N}, DType::F32, Device::CUDA), l2 = Tensor::empty({N}, DType::F32, Device::CUDA);
    Tensor d1 = Tensor::empty({N, 260}, DType::F32, Device::CUDA), d2 = Tensor::empty({N, 260}, DType::F32, Device::CUDA);
    ops::cross_entropy(lg, tg, l1, &d1, double(scale_c.data<float>()[0]));
    ops::cross_entropy(lg, tg, l2, &d2, 99.0, nullptr, &scale_g);
    expect_bits("cross_entropy with the scale on the GPU: dlogits " + name, d2, d1);
    expect_bits("cross_entropy with the scale on the GPU: losses " + name, l2, l1);
  }
  const Tensor table = gpu(random_tensor({10, 4}, DType::F32, 1170));
  Tensor out = Tensor::empty({3, 4}, DType::F32, Device::CUDA);
  std::function<void()> later;
  {
    const ops::DeferIndexChecks defer;
    EXPECT_TRUE(ops::index_checks_deferred());
    ops::embedding_forward(gpu(int_tensor({1, 12, 3}, {3})), table, out);  // no failure yet
    Tensor losses = Tensor::empty({3}, DType::F32, Device::CUDA);
    ops::cross_entropy(gpu(random_tensor({3, 10}, DType::F32, 1171)), gpu(int_tensor({0, 1, 40}, {3})), losses,
                       nullptr, 1.0);
    later = ops::check_index_errors_later(Device::CUDA);
  }
  EXPECT_FALSE(ops::index_checks_deferred());
  ASSERT_TRUE(later);
  expect_error(later, "embedding_forward: tokens[1] = 12 is outside [0, V=10)");
  ops::check_index_errors(Device::CUDA);  // the record was cleared
  ops::check_index_errors_later(Device::CUDA)();
}

// With extra rows (a MoE layer's shared expert as one more group), the one-warp sort, the
// multi-kernel one and an empty routing give the CPU's plan, with and without the read-back.
TEST(CudaLayers, RoutePlanExtraRowsEqualCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t E = 16, k = 2;
  for (const int64_t N : {int64_t(0), int64_t(1), int64_t(64), int64_t(2048), int64_t(2049), int64_t(9000)}) {
    const Tensor idx = random_routing(N, E, k, 1150 + uint64_t(N));
    for (const int64_t extra : {N, N / 2}) {
      const std::string name = cfg("N=%lld extra=%lld", N, extra);
      const ops::RoutePlan want = ops::route_plan_end(ops::route_plan_begin(idx, E, Tensor(), true, extra));
      const ops::RoutePlan got = ops::route_plan_end(ops::route_plan_begin(gpu(idx), E, Tensor(), true, extra));
      EXPECT_EQ(got.offsets, want.offsets) << name;
      expect_bits("extra rows: token_of_slot " + name, got.token_of_slot, want.token_of_slot);
      expect_bits("extra rows: slot_of " + name, got.slot_of, want.slot_of);
      const ops::PendingRoutePlan dev = ops::route_plan_begin(gpu(idx), E, Tensor(), false, extra);
      const Tensor off = dev.plan.device_offsets.to(Device::CPU);
      EXPECT_EQ(std::vector<int64_t>(off.data<int32_t>(), off.data<int32_t>() + off.numel()), want.offsets) << name;
      expect_bits("extra rows, no read-back: token_of_slot " + name, dev.plan.token_of_slot, want.token_of_slot);
    }
  }
  ops::check_index_errors(Device::CUDA);  // nothing recorded
}

// ---- gather / combine -----------------------------------------------------------------------------

// The KV-cache write: the same rows land in the same places as on the CPU, for the 16-byte,
// 4-byte and byte paths, and rows not written keep their bytes.
TEST(CudaLayers, ScatterRowsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (const int64_t D : {64, 3, 13}) {
    const DType dt = D == 13 ? DType::U8 : DType::F32;
    const int64_t N = 700, M = 300;
    std::vector<int32_t> dst(static_cast<size_t>(M));
    for (int64_t s = 0; s < M; ++s) dst[size_t(s)] = int32_t((s * 9 + 3) % N);  // distinct: 9 and 700 are coprime
    const Tensor idx = int_tensor(dst, {M});
    Tensor x = Tensor::empty({M, D}, dt), out_c = Tensor::empty({N, D}, dt);
    for (int64_t i = 0; i < x.nbytes(); ++i) static_cast<uint8_t*>(x.raw())[i] = uint8_t(i * 31 + 7);
    for (int64_t i = 0; i < out_c.nbytes(); ++i) static_cast<uint8_t*>(out_c.raw())[i] = uint8_t(i * 13 + 5);
    Tensor out_g = gpu(out_c);
    ops::scatter_rows(x, idx, out_c);
    ops::scatter_rows(gpu(x), gpu(idx), out_g);
    expect_bits(cfg("scatter_rows D=%lld", D), out_g, out_c);
  }
}

TEST(CudaLayers, GatherAndCombineMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  struct Cfg { int64_t N, D, E, k; };
  for (const Cfg c : {Cfg{77, 64, 8, 2}, Cfg{513, 96, 64, 4}, Cfg{300, 1024, 8, 1}, Cfg{45, 13, 8, 2}}) {
    const std::string name = cfg("N=%lld D=%lld k=%lld", c.N, c.D, c.k);
    const int64_t M = c.N * c.k;
    const Tensor idx = random_routing(c.N, c.E, c.k, 800 + uint64_t(c.N));
    const ops::RoutePlan plan = ops::route_plan(idx, c.E);
    const ops::RoutePlan plan_g = ops::route_plan(gpu(idx), c.E);

    const Tensor x = random_tensor({c.N, c.D}, DType::F32, 801);
    Tensor xp_c = Tensor::empty({M, c.D}, DType::F32), xp_g = Tensor::empty({M, c.D}, DType::F32, Device::CUDA);
    ops::gather_rows(x, plan.token_of_slot, xp_c);
    ops::gather_rows(gpu(x), plan_g.token_of_slot, xp_g);
    expect_bits("gather_rows f32 " + name, xp_g, xp_c);
    // Any dtype is a row copy: odd-length u8 rows take the byte path.
    std::vector<uint8_t> bytes(size_t(c.N * 13));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 37 + 11);
    const Tensor xb = Tensor::from_host(bytes.data(), {c.N, 13}, DType::U8);
    Tensor xbp_c = Tensor::empty({M, 13}, DType::U8), xbp_g = Tensor::empty({M, 13}, DType::U8, Device::CUDA);
    ops::gather_rows(xb, plan.token_of_slot, xbp_c);
    ops::gather_rows(gpu(xb), plan_g.token_of_slot, xbp_g);
    expect_bits("gather_rows u8 " + name, xbp_g, xbp_c);

    const Tensor dxp = random_tensor({M, c.D}, DType::F32, 802);
    Tensor dx_c = Tensor::empty({c.N, c.D}, DType::F32);
    Tensor dx_g = Tensor::empty({c.N, c.D}, DType::F32, Device::CUDA);
    Tensor dx_g2 = Tensor::empty({c.N, c.D}, DType::F32, Device::CUDA);
    ops::gather_rows_backward(dxp, plan.slot_of, dx_c);
    ops::gather_rows_backward(gpu(dxp), plan_g.slot_of, dx_g);
    ops::gather_rows_backward(gpu(dxp), plan_g.slot_of, dx_g2);
    expect_close("gather_rows_backward " + name, dx_g, dx_c, kElementwiseTol);
    expect_bits("gather_rows_backward vs cpu " + name, dx_g, dx_c);
    expect_bits("gather_rows_backward two GPU runs " + name, dx_g, dx_g2);

    const Tensor yp = random_tensor({M, c.D}, DType::F32, 803);
    const Tensor w = random_tensor({c.N, c.k}, DType::F32, 804, 0.0, 1.0);
    Tensor out_c = Tensor::empty({c.N, c.D}, DType::F32);
    Tensor out_g = Tensor::empty({c.N, c.D}, DType::F32, Device::CUDA);
    ops::moe_combine(yp, plan.slot_of, w, out_c);
    ops::moe_combine(gpu(yp), plan_g.slot_of, gpu(w), out_g);
    expect_close("moe_combine " + name, out_g, out_c, kElementwiseTol);
    expect_bits("moe_combine vs cpu " + name, out_g, out_c);
    // with the shared expert's output added in the same pass: the bits of add_ after the sum
    const Tensor plus = random_tensor({c.N, c.D}, DType::F32, 806);
    Tensor out_plus_c = out_c.clone(), out_plus_g = Tensor::empty({c.N, c.D}, DType::F32, Device::CUDA);
    ops::add_(out_plus_c, plus);
    const Tensor plus_g = gpu(plus);
    ops::moe_combine(gpu(yp), plan_g.slot_of, gpu(w), out_plus_g, &plus_g);
    expect_bits("moe_combine with plus vs combine then add_ " + name, out_plus_g, out_plus_c);

    const Tensor dout = random_tensor({c.N, c.D}, DType::F32, 805);
    Tensor dyp_c = Tensor::empty({M, c.D}, DType::F32), dw_c = Tensor::empty({c.N, c.k}, DType::F32);
    Tensor dyp_g = Tensor::empty({M, c.D}, DType::F32, Device::CUDA);
    Tensor dw_g = Tensor::empty({c.N, c.k}, DType::F32, Device::CUDA);
    ops::moe_combine_backward(dout, yp, plan.slot_of, w, dyp_c, dw_c);
    ops::moe_combine_backward(gpu(dout), gpu(yp), plan_g.slot_of, gpu(w), dyp_g, dw_g);
    expect_bits("moe_combine_backward dy_perm " + name, dyp_g, dyp_c);
    expect_close("moe_combine_backward dw " + name, dw_g, dw_c, kReductionTol);
  }
}

// moe_combine_backward over more slots than assignments (M > N k): the slots no assignment
// points at are zeros whatever dy_perm held, the others the CPU's bits; with M = N k (a route
// plan's slot map) the zeroing is skipped and every slot is written (the test above, into
// uninitialised memory).
TEST(CudaLayers, MoeCombineBackwardZeroesOnlyUnclaimedSlots) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 5, k = 2, D = 12, M = N * k + 3;
  // assignments a -> slots 3 a + 1 mod 13 (injective; slots 0, 2, 12... left over)
  std::vector<int32_t> slots(size_t(N * k));
  for (int64_t a = 0; a < N * k; ++a) slots[size_t(a)] = int32_t((3 * a + 1) % M);
  const Tensor slot_of = int_tensor(slots, {N, k});
  const Tensor dout = random_tensor({N, D}, DType::F32, 1301), yp = random_tensor({M, D}, DType::F32, 1302);
  const Tensor w = random_tensor({N, k}, DType::F32, 1303, 0.0, 1.0);
  Tensor dyp_c = Tensor::empty({M, D}, DType::F32), dw_c = Tensor::empty({N, k}, DType::F32);
  ops::moe_combine_backward(dout, yp, slot_of, w, dyp_c, dw_c);
  Tensor dyp_g = gpu(random_tensor({M, D}, DType::F32, 1304)), dw_g = Tensor::empty({N, k}, DType::F32, Device::CUDA);
  ops::moe_combine_backward(gpu(dout), gpu(yp), gpu(slot_of), gpu(w), dyp_g, dw_g);
  expect_bits("moe_combine_backward dy_perm, M > N k", dyp_g, dyp_c);
  const Tensor h = dyp_g.to(Device::CPU);
  int unclaimed = 0;
  for (int64_t s = 0; s < M; ++s)
    if (std::find(slots.begin(), slots.end(), int32_t(s)) == slots.end()) {
      ++unclaimed;
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(h.data<float>()[s * D + d], 0.0f) << "slot " << s;
    }
  EXPECT_EQ(unclaimed, 3);
}

TEST(CudaLayers, QTensorGatherMatchesCpuBytes) {
  SKIP_WITHOUT_GPU();
  // One launch copies a row's codes, block scales and per-row outer scale, each part in its own
  // copy unit: 96 columns make 48-byte NVFP4 code rows (16-byte units) and 6-byte scale rows
  // (bytes), 1024 columns 16-byte units throughout.
  const int64_t N = 77, E = 8, k = 2;
  const Tensor idx = random_routing(N, E, k, 901);
  const ops::RoutePlan plan = ops::route_plan(idx, E);
  const ops::RoutePlan plan_g = ops::route_plan(gpu(idx), E);
  for (const int64_t C : {int64_t(96), int64_t(1024)})
    for (const Format fmt : {Format::NVFP4, Format::MXFP8_E4M3})
      for (const OuterScale outer : {OuterScale::PerRow, OuterScale::Tensor}) {
        if (fmt != Format::NVFP4 && outer != OuterScale::Tensor) continue;
        const Tensor x = random_tensor({N, C}, DType::F32, 900 + C, -3.0, 3.0);
        QuantSpec spec;
        spec.fmt = fmt;
        if (fmt == Format::NVFP4) spec.outer = outer;
        const QTensor q = ops::quantize(x, spec);  // on the CPU; the GPU gets a copy of the bytes
        const QTensor g_c = ops::gather_rows(q, plan.token_of_slot);
        const QTensor g_g = ops::gather_rows(q.to(Device::CUDA), plan_g.token_of_slot);
        const std::string name = std::string(format_name(fmt)) + ", " + std::to_string(C) + " columns, " +
                                 (outer == OuterScale::PerRow ? "per-row outer" : "tensor outer");
        EXPECT_EQ(g_g.rows, g_c.rows);
        EXPECT_EQ(g_g.cols, g_c.cols);
        EXPECT_EQ(g_g.outer, g_c.outer);
        EXPECT_EQ(g_g.device(), Device::CUDA);
        expect_bits("gather_rows QTensor codes, " + name, g_g.codes, g_c.codes);
        expect_bits("gather_rows QTensor block scales, " + name, g_g.block_scales, g_c.block_scales);
        EXPECT_EQ(g_g.outer_scales.defined(), g_c.outer_scales.defined()) << name;
        if (g_c.outer_scales.defined())
          expect_bits("gather_rows QTensor outer scales, " + name, g_g.outer_scales, g_c.outer_scales);
      }
  // A slot naming a token out of range: recorded, and every part of its row is zeros.
  QuantSpec spec;
  spec.fmt = Format::NVFP4;
  spec.outer = OuterScale::PerRow;
  const QTensor q = ops::quantize(random_tensor({4, 96}, DType::F32, 902, -3.0, 3.0), spec).to(Device::CUDA);
  const QTensor g = ops::gather_rows(q, gpu(int_tensor({2, 4}, {2})));
  expect_error([&] { ops::route_plan(gpu(int_tensor({0, 1}, {1, 2})), 2); },
               "gather_rows: token_of_slot[1] = 4 is outside [0, N=4)");
  const QTensor h = g.to(Device::CPU), want = ops::quantize(random_tensor({4, 96}, DType::F32, 902, -3.0, 3.0), spec);
  for (int64_t b = 0; b < h.code_row_bytes(); ++b) {
    EXPECT_EQ(h.codes.data<uint8_t>()[b], want.codes.data<uint8_t>()[2 * want.code_row_bytes() + b]);
    EXPECT_EQ(h.codes.data<uint8_t>()[h.code_row_bytes() + b], 0u) << "byte " << b;
  }
  for (int64_t b = 0; b < h.blocks_per_row(); ++b)
    EXPECT_EQ(h.block_scales.data<uint8_t>()[h.blocks_per_row() + b], 0u) << "scale " << b;
  EXPECT_EQ(h.outer_scales.data<float>()[0], want.outer_scales.data<float>()[2]);
  EXPECT_EQ(h.outer_scales.data<float>()[1], 0.0f);
}

TEST(CudaLayers, DeferredIndexErrorsAreReportedAtTheNextCheck) {
  SKIP_WITHOUT_GPU();
  // gather_rows does not synchronise; its bad index surfaces at the next route_plan.
  const Tensor x = gpu(random_tensor({4, 3}, DType::F32, 1200));
  Tensor xp = Tensor::empty({2, 3}, DType::F32, Device::CUDA);
  ops::gather_rows(x, gpu(int_tensor({0, 4}, {2})), xp);
  expect_error([&] { ops::route_plan(gpu(int_tensor({0, 1}, {1, 2})), 2); },
               "gather_rows: token_of_slot[1] = 4 is outside [0, N=4)");
  // The record was cleared: the next plan succeeds.
  EXPECT_EQ(ops::route_plan(gpu(int_tensor({0, 1}, {1, 2})), 2).offsets,
            (std::vector<int64_t>{0, 1, 2}));
  // A slot shared by two assignments (slot_of not injective) in moe_combine_backward.
  Tensor dyp = Tensor::empty({2, 3}, DType::F32, Device::CUDA);
  Tensor dw = Tensor::empty({1, 2}, DType::F32, Device::CUDA);
  ops::moe_combine_backward(gpu(random_tensor({1, 3}, DType::F32, 1201)), xp,
                            gpu(int_tensor({1, 1}, {1, 2})),
                            gpu(random_tensor({1, 2}, DType::F32, 1202)), dyp, dw);
  // (Which of the two claimants is named depends on scheduling; that one is, does not.)
  expect_error([&] { ops::route_plan(gpu(int_tensor({0, 1}, {1, 2})), 2); },
               "= 1 is also the slot of another assignment");
}

// convert_each: every pair the bits of its own convert (the CPU's), in one launch, for sizes
// around the kernel's chunk and its 8-value units, an empty tensor, and views 4 bytes off the
// 16-byte alignment; a pair that is not F32 -> BF16 takes the per-pair path.
TEST(CudaLayers, ConvertEachIsOneConvertPerPair) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> sizes{1, 7, 8, 8191, 8192, 8193, 0, 300001, 1024 * 1024};
  const Tensor pool = random_tensor({3 * 1024 * 1024}, DType::F32, 1401, -1e3, 1e3);
  const Tensor pool_g = gpu(pool);
  std::vector<Tensor> src, dst, want;
  int64_t at = 1;  // 4 bytes past the 16-byte grain
  for (const int64_t n : sizes) {
    src.push_back(pool_g.view(at, {n}));
    dst.push_back(Tensor::empty({n}, DType::BF16, Device::CUDA));
    Tensor w = Tensor::empty({n}, DType::BF16);
    ops::convert(pool.view(at, {n}), w);
    want.push_back(w);
    at += n + (n % 2);
  }
  ops::convert_each(src, dst);
  for (size_t i = 0; i < sizes.size(); ++i) expect_bits(cfg("convert_each n=%lld", sizes[i]), dst[i], want[i]);
  // BF16 -> F32 pairs: not the kernel's; the same results through convert
  std::vector<Tensor> back{Tensor::empty({7}, DType::F32, Device::CUDA)};
  ops::convert_each({dst[1]}, back);
  Tensor back_c = Tensor::empty({7}, DType::F32);
  ops::convert(want[1], back_c);
  expect_bits("convert_each bf16 -> f32", back[0], back_c);
  std::vector<Tensor> short_dst;
  expect_error([&] { ops::convert_each(src, short_dst); }, "convert_each: 9 sources for 0 destinations");
}

// zero_each: aligned tensors of sizes around the kernel's chunk zeroed in one launch and the
// memory between them untouched; an unaligned one sends all through Tensor::zero_.
TEST(CudaLayers, ZeroEachZeroesEveryTensor) {
  SKIP_WITHOUT_GPU();
  const Tensor pool = random_tensor({3 * 1024 * 1024}, DType::F32, 1402, 1.0, 2.0);
  for (const bool unaligned : {false, true}) {
    Tensor pool_g = gpu(pool);
    std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) of each tensor
    std::vector<Tensor> ts;
    int64_t at = 4;
    for (const int64_t n : {int64_t(4), int64_t(0), int64_t(4096), int64_t(4100), int64_t(1024 * 1024), int64_t(12)}) {
      ranges.push_back({at, at + n});
      ts.push_back(pool_g.view(at, {n}));
      at += n + 8;
    }
    if (unaligned) {
      ranges.push_back({at + 1, at + 4});
      ts.push_back(pool_g.view(at + 1, {3}));
    }
    ops::zero_each(ts);
    const Tensor got = host(pool_g);
    int64_t wrong = 0;
    for (int64_t i = 0; i < pool.numel(); ++i) {
      bool zeroed = false;
      for (const auto& [b, e] : ranges) zeroed = zeroed || (i >= b && i < e);
      wrong += (got.data<float>()[i] == 0.0f) != zeroed;
    }
    EXPECT_EQ(wrong, 0) << (unaligned ? "with an unaligned tensor" : "all aligned");
  }
}

// ---- AdamW ----------------------------------------------------------------------------------------

TEST(CudaLayers, AdamWMatchesCpuOverThreeSteps) {
  SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t(1000), int64_t(4097), int64_t(1 << 20)}) {
    for (const bool unaligned : {false, true}) {
      const std::string name = cfg("n=%lld", n) + (unaligned ? " (unaligned view)" : "");
      const int64_t off = unaligned ? 1 : 0;
      Tensor p_c = random_tensor({n + off}, DType::F32, 1300 + uint64_t(n));
      Tensor m_c = Tensor::zeros({n + off}, DType::F32), v_c = Tensor::zeros({n + off}, DType::F32);
      Tensor p_g = gpu(p_c), m_g = gpu(m_c), v_g = gpu(v_c);
      Tensor pc = p_c.view(off, {n}), mc = m_c.view(off, {n}), vc = v_c.view(off, {n});
      Tensor pg = p_g.view(off, {n}), mg = m_g.view(off, {n}), vg = v_g.view(off, {n});
      for (int64_t step = 1; step <= 3; ++step) {
        const Tensor g = random_tensor({n}, DType::F32, 1310 + uint64_t(step), -0.1, 0.1);
        const ops::AdamW h{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, step == 2 ? 0.37f : 1.0f};  // step 2 clipped
        ops::adamw_step(pc, g, mc, vc, h);
        ops::adamw_step(pg, gpu(g), mg, vg, h);
      }
      expect_close("adamw param after 3 steps " + name, pg, pc, 1e-6);
      expect_close("adamw m after 3 steps " + name, mg, mc, 1e-6);
      expect_close("adamw v after 3 steps " + name, vg, vc, 1e-6);
      // The order of operations is the shared contract: expect the same bits.
      expect_bits("adamw param bits " + name, pg, pc);
    }
  }
}

// SliceAmax on the GPU: the CPU's update bits and its amax of each slice, for slices of several
// CTAs' chunks, of one chunk and less, an odd slice length (scalar loads), an unaligned view, and a
// skipped update (the amax of the unchanged parameters, a NaN among them left out).
TEST(CudaLayers, AdamWSliceAmaxIsTheCpusAmax) {
  SKIP_WITHOUT_GPU();
  for (const auto& [slices, slice] : {std::pair<int64_t, int64_t>{2, (3 << 16) + 12}, {4, 1 << 16}, {16, 1024}, {3, 40003}, {1, 5}}) {
    for (const bool unaligned : {false, true}) {
      for (const bool skip : {false, true}) {
        const int64_t n = slices * slice, off = unaligned ? 1 : 0;
        const std::string name = cfg("%lld slices of %lld", slices, slice) + (unaligned ? ", unaligned" : "") +
                                 (skip ? ", skipped" : "");
        Tensor p_c = random_tensor({n + off}, DType::F32, 1350 + uint64_t(n), -2.0, 2.0);
        if (skip) p_c.data<float>()[off + n / 2] = std::nanf("");  // left as it is, and out of the max
        Tensor m_c = random_tensor({n + off}, DType::F32, 1351, -0.1, 0.1);
        Tensor v_c = random_tensor({n + off}, DType::F32, 1352, 0.0, 0.1);
        Tensor p_g = gpu(p_c), m_g = gpu(m_c), v_g = gpu(v_c);
        Tensor pc = p_c.view(off, {n}), mc = m_c.view(off, {n}), vc = v_c.view(off, {n});
        Tensor pg = p_g.view(off, {n}), mg = m_g.view(off, {n}), vg = v_g.view(off, {n});
        const Tensor g = random_tensor({n}, DType::F32, 1353, -0.5, 0.5);
        Tensor gate_c = Tensor::zeros({ops::kGateSize}, DType::F64);
        gate_c.data<double>()[ops::kGateClip] = 0.75;
        gate_c.data<double>()[ops::kGateSkip] = skip ? 1.0 : 0.0;
        const Tensor gate_g = gpu(gate_c);
        Tensor ac = Tensor::zeros({slices}, DType::F32), ag = gpu(ac);
        const ops::AdamW h{3e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 2};
        ops::adamw_step(pc, g, mc, vc, h, nullptr, &gate_c, ops::SliceAmax{&ac, slice});
        ops::adamw_step(pg, gpu(g), mg, vg, h, nullptr, &gate_g, ops::SliceAmax{&ag, slice});
        expect_bits("adamw param bits " + name, pg, pc);
        expect_bits("adamw m bits " + name, mg, mc);
        expect_bits("slice amax " + name, ag, ac);
        EXPECT_GT(ac.data<float>()[0], 0.5f) << name;
      }
    }
  }
}

// grad_norm_gate on the GPU: the norm of the GPU's sum_squares_each added on the host, the same
// clip factor, and the skip for a NaN gradient or a GPU quantizer's NaN (the device flag, taken
// without a host read). A gated update is the CPU's gated update, bit for bit, or nothing.
TEST(CudaLayers, GradNormGateIsTheHostsNormAndGatesTheUpdate) {
  SKIP_WITHOUT_GPU();
  std::vector<Tensor> gs;
  for (const int64_t n : {int64_t(1000), int64_t(0), int64_t(1 << 20) + 3, int64_t(5)})
    gs.push_back(gpu(random_tensor({n}, DType::F32, 1400 + uint64_t(n), -0.1, 0.1)));
  gs.push_back(gs[2].view(1, {4097}));  // an unaligned view
  const std::vector<double> each = ops::sum_squares_each(gs);
  double sq = 0;
  for (double x : each) sq += x;
  const double norm = std::sqrt(sq);
  Tensor gate = Tensor::empty({ops::kGateSize}, DType::F64, Device::CUDA);
  ops::nonfinite_seen(true);
  for (const double max_norm : {0.0, norm / 4.0, norm * 2.0}) {
    ops::grad_norm_gate(gs, max_norm, gate);
    const Tensor h = gate.to(Device::CPU);
    const double* gv = h.data<double>();
    EXPECT_EQ(gv[ops::kGateNorm], norm) << max_norm;
    EXPECT_EQ(gv[ops::kGateClip], max_norm > 0 && norm > max_norm ? double(float(max_norm / norm)) : 1.0);
    EXPECT_EQ(gv[ops::kGateQuantNonfinite], 0.0);
    EXPECT_EQ(gv[ops::kGateSkip], 0.0);
  }

  // The gated update on both backends (the CPU gate holds the GPU gate's values): the same bits.
  const int64_t n = gs[0].numel();
  const Tensor p0 = random_tensor({n}, DType::F32, 1410), g = gs[0].to(Device::CPU);
  ops::grad_norm_gate(gs, norm / 4.0, gate);
  const Tensor gate_c = gate.to(Device::CPU);
  Tensor pc = p0.clone(), mc = Tensor::zeros({n}, DType::F32), vc = Tensor::zeros({n}, DType::F32);
  Tensor pg = gpu(p0), mg = gpu(mc), vg = gpu(vc), bg = Tensor::zeros({n}, DType::BF16, Device::CUDA);
  const ops::AdamW h{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 2};
  ops::adamw_step(pc, g, mc, vc, h, nullptr, &gate_c);
  ops::adamw_step(pg, gs[0], mg, vg, h, &bg, &gate);
  expect_bits("gated adamw param", pg, pc);
  expect_bits("gated adamw v", vg, vc);
  Tensor bc = Tensor::empty({n}, DType::BF16);
  ops::convert(pc, bc);
  expect_bits("gated adamw bf16 copy", bg, bc);

  // A NaN gradient, then a GPU quantizer's NaN: skipped updates, the flag taken by the gate.
  auto expect_skip = [&](const std::vector<Tensor>& grads, bool quant, const char* what) {
    ops::grad_norm_gate(grads, 1.0, gate);
    const Tensor before = pg.to(Device::CPU), before_m = mg.to(Device::CPU);
    ops::adamw_step(pg, gs[0], mg, vg, {3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3}, &bg, &gate);
    const Tensor hg = gate.to(Device::CPU);
    const double* gv = hg.data<double>();
    EXPECT_EQ(gv[ops::kGateSkip], 1.0) << what;
    EXPECT_EQ(gv[ops::kGateQuantNonfinite], quant ? 1.0 : 0.0) << what;
    expect_bits(std::string(what) + ": param untouched", pg, before);
    expect_bits(std::string(what) + ": m untouched", mg, before_m);
    EXPECT_FALSE(ops::nonfinite_seen(true)) << what;
  };
  std::vector<Tensor> bad = gs;
  Tensor g_nan = random_tensor({n}, DType::F32, 1411);
  g_nan.data<float>()[17] = std::nanf("");
  bad[0] = gpu(g_nan);
  expect_skip(bad, false, "NaN gradient");
  Tensor x = random_tensor({4, 64}, DType::F32, 1412);
  x.data<float>()[70] = INFINITY;
  QuantSpec spec;
  spec.fmt = Format::MXFP8_E4M3;
  (void)ops::quantize(gpu(x), spec);
  expect_skip(gs, true, "a quantizer's Inf");
  ops::grad_norm_gate(gs, 1.0, gate);  // the flag is down again
  EXPECT_EQ(gate.to(Device::CPU).data<double>()[ops::kGateSkip], 0.0);
}

// ---- argument errors ------------------------------------------------------------------------------

TEST(CudaLayers, ArgumentErrorsNameTheTensor) {
  SKIP_WITHOUT_GPU();
  const Tensor x64 = Tensor::zeros({4, 64}, DType::F64, Device::CUDA);
  Tensor y = Tensor::empty({4, 64}, DType::F32, Device::CUDA), r = Tensor::empty({4}, DType::F32, Device::CUDA);
  const Tensor w = Tensor::zeros({64}, DType::F32, Device::CUDA);
  expect_error([&] { ops::rmsnorm_forward(x64, w, 1e-5f, y, r); },
               "rmsnorm_forward: x must be a 2-D f32 cuda tensor [N, D] (the GPU backend runs f32 only)");
  const Tensor x = Tensor::zeros({4, 64}, DType::F32, Device::CUDA);
  expect_error([&] { ops::rmsnorm_forward(x, Tensor::zeros({64}, DType::F32), 1e-5f, y, r); },
               "rmsnorm_forward: w must be f32[D]=[64] cuda, got f32[64] cpu");
  Tensor b64 = Tensor::empty({4}, DType::F64, Device::CUDA);
  expect_error([&] { ops::fill_(b64, 1.0); }, "fill_: t must be an f32 or bf16 cuda tensor");
  Tensor probs = Tensor::empty({4, 8}, DType::F32, Device::CUDA), idx = Tensor::empty({4, 9}, DType::I32, Device::CUDA);
  Tensor tw = Tensor::empty({4, 9}, DType::F32, Device::CUDA);
  expect_error([&] { ops::router_topk(Tensor::zeros({4, 8}, DType::F32, Device::CUDA), 9, probs, idx, tw); },
               "router_topk: k must be in [1, E=8], got k=9");
}
