// defines: tests of the grouped kernel's K-grouped form (cuda::grouped_gemm_k, behind
// ops::gemm_batch_grouped: a MoE layer's expert weight gradients; skipped without a GPU): every
// element within the FP32-summation error bound of the exact (double) sum of its BF16 products,
// for transposed dense BF16 operands (the bf16 recipe's dY and X, token-major) and for Col-axis
// MXFP8 ones (decoded, read along K), with one-token, tile-crossing and off-tile shapes, accumulate
// on and off; on Hopper, gemm_batch_grouped is the one launch (its bits), a problem's bits do not
// depend on the other problems of the launch, runs repeat bit for bit; the TMA form gives the
// cp.async form's bits in both layouts; with device offsets (grouped_wgrad_device_offsets) the bits of
// the host's; empty problems and the shapes it declines.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#include "ops/cuda_grouped_util.h"
#endif

using namespace fourbit;

#if FOURBIT_HAS_CUDA
namespace {

bool have_gpu() { return cuda_device_count() > 0; }

using optest::bytes;
using optest::randn_cuda;

std::vector<double> host_doubles(const Tensor& t) {
  Tensor f = t;
  if (t.dtype() != DType::F32) {
    f = Tensor::empty(t.shape(), DType::F32, t.device());
    ops::convert(t, f);
  }
  const Tensor h = f.to(Device::CPU);
  return {h.data<float>(), h.data<float>() + h.numel()};
}

// Per-expert token ranges of one MoE layer's weight gradients: one token, a K tile and one, a few
// hundred, more than a thousand.
const std::vector<int64_t> kOffsets{0, 1, 66, 400, 1650, 1658};

// The TMA tests' shapes: R x C outputs on and off the tiles (520 rows: row tiles of 128 or 256 and
// 8 rows), problems in one launch and past one TMA launch's 32, accumulate on and off.
struct WgradCase {
  int64_t R, C, problems;
  bool accumulate;
};
const std::vector<WgradCase> kWgradCases{{264, 136, 6, true}, {264, 136, 6, false}, {128, 256, 40, true}, {520, 72, 3, false}};

// The K-grouped form for the scope: the TMA form's tile (128 or 256 columns, or -1: the ping-pong
// form), or 0: the cp.async form; the settings found are restored at its end.
struct WgradForm {
  explicit WgradForm(int tma)
      : tile_before(ops::cuda::set_grouped_wgrad_tma_tile(tma > 0 ? tma : 256)),
        pp_before(ops::cuda::set_grouped_wgrad_tma_pingpong(tma < 0)) {
    ops::cuda::set_grouped_wgrad_tma(tma != 0);
  }
  ~WgradForm() {
    ops::cuda::set_grouped_wgrad_tma(true);
    ops::cuda::set_grouped_wgrad_tma_tile(tile_before);
    ops::cuda::set_grouped_wgrad_tma_pingpong(pp_before);
  }
  WgradForm(const WgradForm&) = delete;
  WgradForm& operator=(const WgradForm&) = delete;
  int tile_before;
  bool pp_before;
};

// grad[e] (before: init[e]) against init + the exact sum over expert e's tokens t of
// a[t, r] * b[t, c] (a: [T, R], b: [T, C] token-major values): within (K + 3) 2^-24 times the sum
// of the magnitudes (a K-term FP32 sum, then the accumulating add).
void expect_near_exact(const std::vector<double>& grad, const std::vector<double>& init, const std::vector<double>& a,
                       const std::vector<double>& b, const std::vector<int64_t>& off, int64_t R, int64_t C,
                       const char* what) {
  int bad = 0;
  for (size_t e = 0; e + 1 < off.size(); ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const size_t i = (e * size_t(R) + size_t(r)) * size_t(C) + size_t(c);
        double exact = init.empty() ? 0.0 : init[i], mag = std::fabs(exact);
        for (int64_t t = off[e]; t < off[e + 1]; ++t) {
          const double p = a[size_t(t * R + r)] * b[size_t(t * C + c)];
          exact += p;
          mag += std::fabs(p);
        }
        const double tol = double(off[e + 1] - off[e] + 3) * std::ldexp(1.0, -24) * mag + 1e-30;
        if (!(std::fabs(grad[i] - exact) <= tol) && bad++ < 5)
          ADD_FAILURE() << what << ": expert " << e << " [" << r << ", " << c << "] = " << grad[i] << ", exact " << exact
                        << ", tolerance " << tol;
      }
  EXPECT_EQ(bad, 0) << what;
}

// Transposed BF16 operands as the bf16 recipe hands them over: dY [T, R] and X [T, C], expert e's
// rows read transposed.
TEST(CudaGroupedWgrad, MatchesTheExactSumOnTransposedBf16Operands) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t T = kOffsets.back(), R = 264, C = 136, E = int64_t(kOffsets.size()) - 1;
  Tensor dy = Tensor::empty({T, R}, DType::BF16, Device::CUDA), x = Tensor::empty({T, C}, DType::BF16, Device::CUDA);
  ops::convert(randn_cuda({T, R}, 1), dy);
  ops::convert(randn_cuda({T, C}, 2), x);
  const std::vector<double> hdy = host_doubles(dy), hx = host_doubles(x);
  const Tensor init = randn_cuda({E, R, C}, 3, 4.0f);
  std::vector<Tensor> dys, xs;
  for (int64_t e = 0; e < E; ++e) {
    dys.push_back(dy.slice_rows(kOffsets[size_t(e)], kOffsets[size_t(e) + 1]));
    xs.push_back(x.slice_rows(kOffsets[size_t(e)], kOffsets[size_t(e) + 1]));
  }
  for (bool accumulate : {true, false}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    Tensor grad = init.clone();
    std::vector<Tensor> outs;
    for (int64_t e = 0; e < E; ++e) outs.push_back(grad.view(e * R * C, {R, C}));
    std::vector<ops::GemmJob> jobs;
    for (int64_t e = 0; e < E; ++e)
      jobs.push_back({ops::Operand(dys[size_t(e)], true), ops::Operand(xs[size_t(e)], true), &outs[size_t(e)], accumulate});
    ops::gemm_batch_grouped(jobs);
    const std::vector<double> got = host_doubles(grad);
    expect_near_exact(got, accumulate ? host_doubles(init) : std::vector<double>{}, hdy, hx, kOffsets, R, C,
                      "bf16, transposed");

    if (!ops::cuda::wgmma_available()) continue;
    // gemm_batch_grouped ran the K-grouped kernel: its bits; run again, the same bits.
    Tensor direct = init.clone();
    std::vector<ops::cuda::KGroupedProblem> problems;
    for (int64_t e = 0; e < E; ++e)
      problems.push_back({dys[size_t(e)].raw(), xs[size_t(e)].raw(), direct.data<float>() + e * R * C, R, C,
                          kOffsets[size_t(e) + 1] - kOffsets[size_t(e)]});
    ASSERT_TRUE(ops::cuda::grouped_gemm_k(true, problems, R, C, C, accumulate));
    EXPECT_EQ(bytes(direct), bytes(grad)) << "gemm_batch_grouped is not the K-grouped kernel";
    Tensor again = init.clone();
    for (auto& p : problems) p.c = again.data<float>() + (p.c - direct.data<float>());
    ASSERT_TRUE(ops::cuda::grouped_gemm_k(true, problems, R, C, C, accumulate));
    EXPECT_EQ(bytes(again), bytes(grad)) << "not deterministic";
    // Each problem alone: the bits it gets among the others.
    for (int64_t e = 0; e < E; ++e) {
      Tensor alone = init.clone();
      ops::cuda::KGroupedProblem p = problems[size_t(e)];
      p.c = alone.data<float>() + e * R * C;
      ASSERT_TRUE(ops::cuda::grouped_gemm_k(true, {p}, R, C, C, accumulate));
      EXPECT_EQ(bytes(alone.view(e * R * C, {R, C})), bytes(grad.view(e * R * C, {R, C}))) << "expert " << e;
    }
  }
}

// The TMA form (persistent, a pair of maps a problem whose K ends at the expert's last token), on
// each tile (128 x 256, 256 x 128, and the ping-pong form's 128 x 128 taken by two warpgroups in
// turn), gives the cp.async form's bits, for both layouts: MN-major (token-major dY [T, R] and X [T, C],
// the bf16 recipe's) and K-major ([R, T] and [C, T] with an expert's tokens a column range, the
// decoded MXFP8 operands'); ragged experts (one token, a K tile and one, none; K-major lengths are
// multiples of 8), m and n off the tiles (520 rows: row tiles of 128 or 256 and 8 rows), accumulate
// on and off, and more problems than one TMA launch takes (40: two launches).
TEST(CudaGroupedWgrad, TmaFormIsTheCpAsyncFormBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::wgmma_available()) GTEST_SKIP() << "not a Hopper device with sm_90a code";
  for (const bool mn : {true, false})
    for (const WgradCase& cs : kWgradCases) {
      SCOPED_TRACE(testing::Message() << (mn ? "MN-major" : "K-major") << " R " << cs.R << " C " << cs.C
                                      << " problems " << cs.problems << (cs.accumulate ? " accumulate" : ""));
      const std::vector<int64_t> lens = mn ? std::vector<int64_t>{1, 65, 0, 334, 1250, 8}
                                           : std::vector<int64_t>{8, 72, 0, 336, 1248, 16};
      std::vector<int64_t> off{0};
      for (int64_t j = 0; j < cs.problems; ++j) off.push_back(off.back() + lens[size_t(j) % lens.size()]);
      const int64_t T = off.back();
      const std::vector<int64_t> a_shape = mn ? std::vector<int64_t>{T, cs.R} : std::vector<int64_t>{cs.R, T};
      const std::vector<int64_t> b_shape = mn ? std::vector<int64_t>{T, cs.C} : std::vector<int64_t>{cs.C, T};
      Tensor dy = Tensor::empty(a_shape, DType::BF16, Device::CUDA), x = Tensor::empty(b_shape, DType::BF16, Device::CUDA);
      ops::convert(randn_cuda(a_shape, 11), dy);
      ops::convert(randn_cuda(b_shape, 12), x);
      const Tensor init = randn_cuda({cs.problems, cs.R, cs.C}, 13);
      auto run = [&](int tma) {  // WgradForm's tma
        Tensor grad = init.clone();
        std::vector<ops::cuda::KGroupedProblem> problems;
        for (int64_t j = 0; j < cs.problems; ++j) {
          // the expert's first token: a row (MN-major) or a column (K-major)
          const int64_t a_at = mn ? off[size_t(j)] * cs.R : off[size_t(j)], b_at = mn ? off[size_t(j)] * cs.C : off[size_t(j)];
          problems.push_back({static_cast<const char*>(dy.raw()) + 2 * a_at, static_cast<const char*>(x.raw()) + 2 * b_at,
                              grad.data<float>() + j * cs.R * cs.C, mn ? cs.R : T, mn ? cs.C : T,
                              off[size_t(j) + 1] - off[size_t(j)]});
        }
        const WgradForm form(tma);
        EXPECT_TRUE(ops::cuda::grouped_gemm_k(mn, problems, cs.R, cs.C, cs.C, cs.accumulate));
        return grad;
      };
      const int64_t before = ops::cuda::grouped_wgrad_tma_launches();
      const Tensor with_tma = run(256);
      device_synchronize();
      const int64_t launches = ops::cuda::grouped_wgrad_tma_launches() - before;
      const Tensor with_tall_tile = run(128);
      device_synchronize();
      const int64_t tall_launches = ops::cuda::grouped_wgrad_tma_launches() - before - launches;
      const Tensor with_pingpong = run(-1);
      device_synchronize();
      const int64_t pp_launches = ops::cuda::grouped_wgrad_tma_launches() - before - launches - tall_launches;
      const Tensor with_cp_async = run(0);
      EXPECT_EQ(bytes(with_tma), bytes(with_cp_async));
      EXPECT_EQ(bytes(with_tall_tile), bytes(with_cp_async)) << "the 256 x 128 tile";
      EXPECT_EQ(bytes(with_pingpong), bytes(with_cp_async)) << "the ping-pong form";
      EXPECT_EQ(launches, (cs.problems + 31) / 32) << "the TMA form did not run";
      EXPECT_EQ(tall_launches, (cs.problems + 31) / 32) << "the TMA form's 256 x 128 tile did not run";
      EXPECT_EQ(pp_launches, (cs.problems + 31) / 32) << "the TMA form's ping-pong tiles did not run";
      if (mn && cs.R == 264 && !cs.accumulate) {  // and both are the exact sums (the tolerance above)
        std::vector<double> hdy = host_doubles(dy), hx = host_doubles(x);
        expect_near_exact(host_doubles(with_tma), {}, hdy, hx, off, cs.R, cs.C, "tma form");
      }
    }
}

// Col-axis MXFP8 operands (the mxfp8 and nvfp4-fwd recipes' wgrad dY^T and X^T, blocks along the
// tokens): decoded to BF16 copies read along K, K padded to whole blocks.
TEST(CudaGroupedWgrad, MatchesTheExactSumOnDecodedMxfp8Operands) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t T = kOffsets.back(), R = 200, C = 72, E = int64_t(kOffsets.size()) - 1;
  const Tensor dy = randn_cuda({T, R}, 4), x = randn_cuda({T, C}, 5);
  for (Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2}) {
    SCOPED_TRACE(format_name(f));
    QuantSpec col;
    col.fmt = f;
    col.axis = BlockAxis::Col;
    std::vector<QTensor> qdy, qx;
    std::vector<double> hdy, hx;  // the decoded values, token-major like dy and x
    for (int64_t e = 0; e < E; ++e) {
      const int64_t b = kOffsets[size_t(e)], end = kOffsets[size_t(e) + 1];
      qdy.push_back(ops::quantize(dy.slice_rows(b, end), col));
      qx.push_back(ops::quantize(x.slice_rows(b, end), col));
      for (double v : host_doubles(ops::dequantize(qdy.back()))) hdy.push_back(v);
      for (double v : host_doubles(ops::dequantize(qx.back()))) hx.push_back(v);
    }
    ASSERT_EQ(hdy.size(), size_t(T * R));
    ASSERT_EQ(hx.size(), size_t(T * C));
    const Tensor init = randn_cuda({E, R, C}, 6, 4.0f);
    Tensor grad = init.clone();
    std::vector<Tensor> outs;
    for (int64_t e = 0; e < E; ++e) outs.push_back(grad.view(e * R * C, {R, C}));
    std::vector<ops::GemmJob> jobs;
    for (int64_t e = 0; e < E; ++e)
      jobs.push_back({ops::Operand(qdy[size_t(e)]), ops::Operand(qx[size_t(e)]), &outs[size_t(e)], true});
    ops::gemm_batch_grouped(jobs);
    expect_near_exact(host_doubles(grad), host_doubles(init), hdy, hx, kOffsets, R, C, "mxfp8, decoded");
  }
}

// ops::grouped_wgrad_device_offsets on the GPU (the K-grouped form reading device offsets: each
// problem's arguments and TMA maps made by a kernel) gives the bits of the same problems with the
// host's offsets (gemm_batch_grouped of each expert's transposed rows: grouped_gemm_k), on every
// TMA tile and the cp.async form, two sets of operands (an FFN's w1 and w3 gradients: two dY, one X)
// in one launch whatever the number of problems; ragged experts (one token, a K tile and one,
// none), m and n off the tiles, rows past the last offset, accumulate on and off. Bad offsets are
// recorded and reported by check_index_errors.
TEST(CudaGroupedWgrad, DeviceOffsetsGiveTheHostOffsetsBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::wgmma_available()) GTEST_SKIP() << "not a Hopper device with sm_90a code";
  for (const WgradCase& cs : kWgradCases) {
    SCOPED_TRACE(testing::Message() << "R " << cs.R << " C " << cs.C << " problems " << cs.problems
                                    << (cs.accumulate ? " accumulate" : ""));
    const std::vector<int64_t> lens{1, 65, 0, 334, 1250, 8};
    std::vector<int32_t> off{0};
    for (int64_t j = 0; j < cs.problems; ++j) off.push_back(off.back() + int32_t(lens[size_t(j) % lens.size()]));
    const int64_t T = off.back() + 5;  // rows past the last offset: read by no problem
    std::vector<Tensor> dy;  // two sets' dY, one X
    for (uint64_t seed : {31, 36}) {
      dy.push_back(Tensor::empty({T, cs.R}, DType::BF16, Device::CUDA));
      ops::convert(randn_cuda({T, cs.R}, seed), dy.back());
    }
    Tensor x = Tensor::empty({T, cs.C}, DType::BF16, Device::CUDA);
    ops::convert(randn_cuda({T, cs.C}, 32), x);
    const Tensor offsets = Tensor::from_host(off.data(), {cs.problems + 1}, DType::I32, Device::CPU).to(Device::CUDA);
    const Tensor init = randn_cuda({cs.problems, cs.R, cs.C}, 33);
    for (const int tma : {256, 128, -1, 0}) {  // the TMA form's tiles (-1: ping-pong), 0: the cp.async form
      SCOPED_TRACE(testing::Message() << "tile " << tma);
      const WgradForm form(tma);
      std::vector<Tensor> want{init.clone(), init.clone()}, got{init.clone(), init.clone()};
      std::vector<Tensor> dys, xs, outs, empty;
      dys.reserve(size_t(2 * cs.problems));
      xs.reserve(size_t(2 * cs.problems));
      outs.reserve(size_t(2 * cs.problems));
      std::vector<ops::GemmJob> jobs;
      for (size_t s = 0; s < 2; ++s)
        for (int64_t j = 0; j < cs.problems; ++j) {
          Tensor slice = want[s].view(j * cs.R * cs.C, {cs.R, cs.C});
          if (off[size_t(j)] == off[size_t(j) + 1]) {
            if (!cs.accumulate) empty.push_back(slice);
            continue;
          }
          dys.push_back(dy[s].slice_rows(off[size_t(j)], off[size_t(j) + 1]));
          xs.push_back(x.slice_rows(off[size_t(j)], off[size_t(j) + 1]));
          outs.push_back(slice);
          jobs.push_back({ops::Operand(dys.back(), true), ops::Operand(xs.back(), true), &outs.back(), cs.accumulate});
        }
      ops::zero_each(empty);
      ops::gemm_batch_grouped(jobs);
      device_synchronize();
      const int64_t before = ops::cuda::grouped_wgrad_tma_launches();
      ops::grouped_wgrad_device_offsets({{&dy[0], &x, &got[0]}, {&dy[1], &x, &got[1]}}, offsets, cs.accumulate);
      device_synchronize();
      const int64_t launches = ops::cuda::grouped_wgrad_tma_launches() - before;
      EXPECT_EQ(bytes(got[0]), bytes(want[0])) << "set 0";
      EXPECT_EQ(bytes(got[1]), bytes(want[1])) << "set 1";
      EXPECT_EQ(launches, tma != 0 ? 1 : 0) << "the TMA form with device-made maps did not run once";
    }
  }
  // A decreasing offset: recorded, nothing read outside the operands, reported at the check.
  const std::vector<int32_t> bad{0, 40, 20, 64};
  Tensor a = Tensor::empty({64, 64}, DType::BF16, Device::CUDA), b = Tensor::empty({64, 32}, DType::BF16, Device::CUDA);
  ops::convert(randn_cuda({64, 64}, 34), a);
  ops::convert(randn_cuda({64, 32}, 35), b);
  Tensor c = Tensor::empty({3, 64, 32}, DType::F32, Device::CUDA);
  ops::grouped_wgrad_device_offsets(a, b, Tensor::from_host(bad.data(), {4}, DType::I32, Device::CPU).to(Device::CUDA),
                                    c);
  const std::string err = testutil::error_of([] { ops::check_index_errors(Device::CUDA); });
  EXPECT_NE(err.find("offsets"), std::string::npos) << err;
}

TEST(CudaGroupedWgrad, EmptyProblemsAndWhatItDeclines) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::wgmma_available()) GTEST_SKIP() << "not a Hopper device with sm_90a code";
  const int64_t R = 64, C = 32;
  Tensor a = Tensor::empty({16, R}, DType::BF16, Device::CUDA), b = Tensor::empty({16, C}, DType::BF16, Device::CUDA);
  ops::convert(randn_cuda({16, R}, 7), a);
  ops::convert(randn_cuda({16, C}, 8), b);
  const Tensor init = randn_cuda({R, C}, 9);
  // No tokens: C = 0, or C untouched when accumulating.
  Tensor c = init.clone();
  ASSERT_TRUE(ops::cuda::grouped_gemm_k(true, {{a.raw(), b.raw(), c.data<float>(), R, C, 0}}, R, C, C, true));
  EXPECT_EQ(bytes(c), bytes(init));
  ASSERT_TRUE(ops::cuda::grouped_gemm_k(true, {{a.raw(), b.raw(), c.data<float>(), R, C, 0}}, R, C, C, false));
  for (double v : host_doubles(c)) ASSERT_EQ(v, 0.0);
  // Declined, nothing written: n odd; MN-major m not a multiple of 8; K-major k not a multiple of
  // 8; a misaligned operand.
  c = init.clone();
  const auto* a8 = static_cast<const char*>(a.raw());
  EXPECT_FALSE(ops::cuda::grouped_gemm_k(true, {{a.raw(), b.raw(), c.data<float>(), R, C, 16}}, R, C - 1, C, false));
  EXPECT_FALSE(ops::cuda::grouped_gemm_k(true, {{a.raw(), b.raw(), c.data<float>(), R, C, 16}}, R - 4, C, C, false));
  EXPECT_FALSE(ops::cuda::grouped_gemm_k(false, {{a.raw(), b.raw(), c.data<float>(), 16, 16, 12}}, R, C, C, false));
  EXPECT_FALSE(ops::cuda::grouped_gemm_k(true, {{a8 + 2, b.raw(), c.data<float>(), R, C, 8}}, R, C, C, false));
  device_synchronize();
  EXPECT_EQ(bytes(c), bytes(init));
}

}  // namespace
#endif
