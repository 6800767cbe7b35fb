// defines: CPU tests of ops::grouped_gemm: each group's rows equal a gemm with that group's slice
// of B (quantized, dense, dense transposed [G, K, N], dense [G * N, K]), grouped_gemm_device_offsets
// gives its bits, and malformed offsets or shapes fail with a message naming what was expected;
// grouped_wgrad_device_offsets is a gemm of each group's transposed rows.
// (The GPU's implementation, one decode, one launch of the grouped kernel, one epilogue, is checked
// group by group in CudaGroupedGemm.*.)
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "fourbit/ops/ops.h"
#include "ops/op_test_util.h"
#include "test_util.h"

using namespace fourbit;
using fourbit::optest::random_tensor;
using fourbit::testutil::error_of;

namespace {

// C rows of group g computed alone with ops::gemm.
Tensor per_group(const ops::Operand& a, const std::vector<const Tensor*>& b_dense, const std::vector<QTensor>& b_q,
                 const std::vector<int64_t>& offsets, int64_t n, bool trans) {
  Tensor c = Tensor::empty({offsets.back(), n}, DType::F32);
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    if (offsets[g] == offsets[g + 1]) continue;
    Tensor cg = c.slice_rows(offsets[g], offsets[g + 1]);
    QTensor qa;
    Tensor da;
    if (a.q()) qa = ops::qtensor_rows(*a.q(), offsets[g], offsets[g + 1]);
    else da = a.dense()->slice_rows(offsets[g], offsets[g + 1]);
    const ops::Operand b = b_q.empty() ? ops::Operand(*b_dense[g], trans) : ops::Operand(b_q[g]);
    ops::gemm(a.q() ? ops::Operand(qa) : ops::Operand(da), b, cg);
  }
  return c;
}

bool same_bits(const Tensor& x, const Tensor& y) {
  return x.nbytes() == y.nbytes() && std::memcmp(x.raw(), y.raw(), size_t(x.nbytes())) == 0;
}

}  // namespace

TEST(GroupedGemm, EachGroupEqualsItsOwnGemm) {
  const int64_t K = 48, N = 24, G = 4;
  const std::vector<int64_t> offsets{0, 9, 9, 30, 33};
  const Tensor x = random_tensor({33, K}, DType::F32, 1), w = random_tensor({G, N, K}, DType::F32, 2);
  const Tensor wt = random_tensor({G, K, N}, DType::F32, 3);
  std::vector<Tensor> w_views, wt_views;
  std::vector<const Tensor*> w_ptrs, wt_ptrs;
  for (int64_t g = 0; g < G; ++g) {
    w_views.push_back(w.view(g * N * K, {N, K}));
    wt_views.push_back(wt.view(g * N * K, {K, N}));
  }
  for (int64_t g = 0; g < G; ++g) {
    w_ptrs.push_back(&w_views[size_t(g)]);
    wt_ptrs.push_back(&wt_views[size_t(g)]);
  }
  Tensor c = Tensor::empty({33, N}, DType::F32);
  ops::grouped_gemm(x, w, offsets, c);
  EXPECT_TRUE(same_bits(c, per_group(x, w_ptrs, {}, offsets, N, false))) << "dense [G, N, K]";
  ops::grouped_gemm(x, w.reshape({G * N, K}), offsets, c);
  EXPECT_TRUE(same_bits(c, per_group(x, w_ptrs, {}, offsets, N, false))) << "dense [G * N, K]";
  ops::grouped_gemm(x, ops::Operand(wt, true), offsets, c);
  EXPECT_TRUE(same_bits(c, per_group(x, wt_ptrs, {}, offsets, N, true))) << "dense [G, K, N] transposed";

  QuantSpec sx, sw;
  sx.fmt = sw.fmt = Format::NVFP4;
  sx.outer = OuterScale::PerRow;
  sw.outer = OuterScale::PerSlice;
  const QTensor xq = ops::quantize(x, sx), wq = ops::quantize(w, sw);
  std::vector<QTensor> slices;
  for (int64_t g = 0; g < G; ++g) slices.push_back(ops::qtensor_slice(wq, g));
  ops::grouped_gemm(xq, wq, offsets, c);
  EXPECT_TRUE(same_bits(c, per_group(ops::Operand(xq), {}, slices, offsets, N, false))) << "nvfp4";
}

// grouped_gemm_device_offsets with the offsets in a tensor on the CPU reads them and gives
// grouped_gemm's bits, for dense and block-scaled operands (the GPU's forms:
// CudaGroupedBf16.DeviceOffsetsGiveTheHostOffsetsBits, CudaGroupedFused.DeviceOffsets*); an
// offsets tensor that does not match B's slices is a clear error.
TEST(GroupedGemm, OffsetsInATensorGiveTheSameBits) {
  const int64_t K = 64, N = 16, G = 3;
  const std::vector<int64_t> offsets{0, 5, 5, 12};
  const std::vector<int32_t> off32(offsets.begin(), offsets.end());
  const Tensor off_t = Tensor::from_host(off32.data(), {G + 1}, DType::I32, Device::CPU);
  const Tensor x = random_tensor({12, K}, DType::F32, 8), w = random_tensor({G, N, K}, DType::F32, 9);
  QuantSpec sx, sw;
  sx.fmt = sw.fmt = Format::MXFP8_E4M3;
  const QTensor xq = ops::quantize(x, sx), wq = ops::quantize(w, sw);
  for (const auto& [a, b] :
       {std::pair{ops::Operand(x), ops::Operand(w)}, std::pair{ops::Operand(xq), ops::Operand(wq)}}) {
    Tensor want = Tensor::empty({12, N}, DType::F32), got = Tensor::empty({12, N}, DType::F32);
    ops::grouped_gemm(a, b, offsets, want);
    ops::grouped_gemm_device_offsets(a, b, off_t, got);
    EXPECT_TRUE(same_bits(got, want)) << (a.q() ? "mxfp8" : "f32");
  }
  Tensor c = Tensor::empty({12, N}, DType::F32);
  const Tensor short_off = Tensor::from_host(off32.data(), {G}, DType::I32, Device::CPU);
  EXPECT_NE(error_of([&] { ops::grouped_gemm_device_offsets(xq, wq, short_off, c); })
                .find("offsets must be I32 [G + 1] = [4]"),
            std::string::npos);
}

TEST(GroupedGemm, BadOffsetsAndShapesAreClearErrors) {
  const Tensor x = random_tensor({10, 16}, DType::F32, 4), w = random_tensor({2, 8, 16}, DType::F32, 5);
  Tensor c = Tensor::empty({10, 8}, DType::F32);
  EXPECT_NE(error_of([&] { ops::grouped_gemm(x, w, {0, 6, 4}, c); }).find("must not decrease"), std::string::npos);
  EXPECT_NE(error_of([&] { ops::grouped_gemm(x, w, {0, 4, 9}, c); }).find("from 0 to A's 10 rows"), std::string::npos);
  EXPECT_NE(error_of([&] { ops::grouped_gemm(x, w, {0, 2, 4, 10}, c); }).find("B has 2 slices for 3 groups"),
            std::string::npos);
  Tensor bad = Tensor::empty({10, 9}, DType::F32);
  EXPECT_NE(error_of([&] { ops::grouped_gemm(x, w, {0, 4, 10}, bad); }).find("does not match [10, 8]"),
            std::string::npos);
}

// grouped_wgrad_device_offsets (the experts' weight gradients, offsets in a tensor): each group's
// c[g] is gemm of its transposed row ranges (accumulating or not), a group without rows gets zeros
// (or keeps c[g]), rows past the last offset are not read, and bad offsets and shapes fail naming
// what was expected.
TEST(GroupedWgrad, EachGroupIsTheGemmOfItsTransposedRows) {
  const int64_t M = 40, R = 12, C = 20;
  const std::vector<int32_t> off{0, 7, 7, 31, 36};  // rows 36 .. 39 belong to no group
  const int64_t G = int64_t(off.size()) - 1;
  const Tensor off_t = Tensor::from_host(off.data(), {G + 1}, DType::I32, Device::CPU);
  const Tensor a = random_tensor({M, R}, DType::F32, 21), b = random_tensor({M, C}, DType::F32, 22);
  const Tensor init = random_tensor({G, R, C}, DType::F32, 23);
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    Tensor got = init.clone(), want = init.clone();
    ops::grouped_wgrad_device_offsets(a, b, off_t, got, accumulate);
    for (int64_t g = 0; g < G; ++g) {
      Tensor cg = want.view(g * R * C, {R, C});
      if (off[size_t(g)] == off[size_t(g) + 1]) {
        if (!accumulate) std::memset(cg.raw(), 0, size_t(cg.nbytes()));
        continue;
      }
      const Tensor ag = a.slice_rows(off[size_t(g)], off[size_t(g) + 1]), bg = b.slice_rows(off[size_t(g)], off[size_t(g) + 1]);
      ops::gemm(ops::Operand(ag, true), ops::Operand(bg, true), cg, accumulate);
    }
    EXPECT_TRUE(same_bits(got, want));
  }
  Tensor c = init.clone();
  const std::vector<int32_t> decreasing{0, 9, 5, 30, 36}, past{0, 7, 7, 31, 41};
  EXPECT_NE(error_of([&] {
              ops::grouped_wgrad_device_offsets(a, b, Tensor::from_host(decreasing.data(), {G + 1}, DType::I32, Device::CPU), c);
            }).find("offsets[2] = 5 must lie in [9, 40]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ops::grouped_wgrad_device_offsets(a, b, Tensor::from_host(past.data(), {G + 1}, DType::I32, Device::CPU), c);
            }).find("offsets[4] = 41 must lie in [31, 40]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::grouped_wgrad_device_offsets(a, b.slice_rows(0, 39), off_t, c); })
                .find("a and b must be [M, R] and [M, C] tensors"),
            std::string::npos);
  Tensor wrong = Tensor::empty({G, C, R}, DType::F32);
  EXPECT_NE(error_of([&] { ops::grouped_wgrad_device_offsets(a, b, off_t, wrong); }).find("c must be f32 [4, 12, 20]"),
            std::string::npos);
  const Tensor f_off = Tensor::empty({G + 1}, DType::F32);
  EXPECT_NE(error_of([&] { ops::grouped_wgrad_device_offsets(a, b, f_off, c); }).find("offsets must be I32 [G + 1]"),
            std::string::npos);
}

// gemm_batch runs every job as ops::gemm would (an operand shared by two jobs, accumulation on
// and off), and a job that gemm would refuse is refused with gemm's message.
TEST(GemmBatch, EachJobEqualsItsOwnGemmAndBadJobsAreClearErrors) {
  const Tensor a = random_tensor({12, 16}, DType::F32, 6), b1 = random_tensor({8, 16}, DType::F32, 7),
               b2 = random_tensor({5, 16}, DType::F32, 8);
  QuantSpec s;
  s.fmt = Format::MXFP8_E4M3;
  const QTensor qa = ops::quantize(a, s), qb = ops::quantize(b1, s);
  Tensor c1 = random_tensor({12, 8}, DType::F32, 9), c2 = Tensor::empty({12, 5}, DType::F32);
  Tensor w1 = c1.clone(), w2 = c2.clone();
  ops::gemm_batch({{ops::Operand(qa), ops::Operand(qb), &c1, true}, {ops::Operand(a), ops::Operand(b2), &c2, false}});
  ops::gemm(qa, qb, w1, true);
  ops::gemm(a, b2, w2, false);
  EXPECT_TRUE(same_bits(c1, w1));
  EXPECT_TRUE(same_bits(c2, w2));
  ops::gemm_batch({});  // nothing to do
  Tensor bad = Tensor::empty({12, 9}, DType::F32);
  EXPECT_NE(error_of([&] { ops::gemm_batch({{ops::Operand(a), ops::Operand(b1), &bad, false}}); })
                .find("does not match [12, 8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::gemm_batch({{ops::Operand(a), ops::Operand(b1), nullptr, false}}); }).find("no output"),
            std::string::npos);
}
