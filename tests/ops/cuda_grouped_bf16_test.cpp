// defines: tests of cuda::grouped_gemm_bf16, the grouped expert GEMM with device-side offsets
// (skipped without a GPU): every element within the FP32-summation error bound of an exact
// (double) sum of the same BF16 products, with ragged and empty groups and N, K off the tile
// sizes; accumulate mode bit for bit; rows outside every group untouched; a row's bits the same
// whatever else is in the launch (M = 1, 7, 64, 1000 and 16384 rows, other groups around it),
// with a split-K negative control that this comparison catches; bad offsets reported by name. The
// first three run each main loop: wgmma (Hopper) and the portable mma.sync; on Hopper the
// training tile's TMA form equals its cp.async form bit for bit, and a B read MN-major in place
// (a dgrad's forward weight) the bits of its K-major copy; outer scales applied in the epilogue in
// the scale epilogue's order. ops::grouped_gemm_device_offsets gives ops::grouped_gemm's bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fourbit/numerics/hd.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "test_util.h"
#if FOURBIT_HAS_CUDA
#include <cuda_runtime.h>

#include "fourbit/ops/cuda/cuda_ops.h"
#include "ops/cuda_grouped_util.h"
#endif

using namespace fourbit;

#if FOURBIT_HAS_CUDA
namespace {

bool have_gpu() { return cuda_device_count() > 0; }

using optest::bytes;
using optest::DecodeTile;
using optest::kDecodeWidths;
using optest::MainLoop;

// A BF16 CUDA tensor of N(0, scale^2) values, each times 2^e for e uniform in [-binades, binades],
// and its values as doubles on the host.
struct Bf16 {
  Tensor dev;
  std::vector<double> host;
};
Bf16 random_bf16(const Shape& s, uint64_t seed, float scale, int binades = 0) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ed(-binades, binades);
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = std::ldexp(nd(g) * scale, ed(g));
  const Tensor f = Tensor::from_host(v.data(), s, DType::F32, Device::CUDA);
  Bf16 out{Tensor::empty(s, DType::BF16, Device::CUDA), {}};
  ops::convert(f, out.dev);
  Tensor back = Tensor::empty(s, DType::F32, Device::CUDA);
  ops::convert(out.dev, back);
  const Tensor h = back.to(Device::CPU);
  out.host.assign(h.data<float>(), h.data<float>() + h.numel());
  return out;
}

Tensor offsets_tensor(const std::vector<int32_t>& off) {
  return Tensor::from_host(off.data(), {int64_t(off.size())}, DType::I32, Device::CUDA);
}

std::vector<float> host_floats(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  return {h.data<float>(), h.data<float>() + h.numel()};
}

// Positive scales in [0.5, 2): NVFP4 outer scales' stand-ins.
Tensor uniform_scales_cuda(const Shape& s, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> ud(0.5f, 2.0f);
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = ud(g);
  return Tensor::from_host(v.data(), s, DType::F32, Device::CUDA);
}

Tensor filled(int64_t m, int64_t n, float v) {
  Tensor t = Tensor::empty({m, n}, DType::F32, Device::CUDA);
  ops::fill_(t, v);
  return t;
}

// Every element of c against the exact sum of its BF16 products: within the bound of a K-term FP32
// sum, (K + 2) * 2^-24 * sum |a_k b_k| (a wrong row, column, group or K tile misses by far more).
void expect_near_exact(const std::vector<float>& c, const Bf16& a, const Bf16& b, const std::vector<int32_t>& off,
                       int64_t N, int64_t K, const char* what) {
  int bad = 0;
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = a.host[size_t(r * K + k)] * b.host[size_t((int64_t(g) * N + n) * K + k)];
          exact += p;
          mag += std::fabs(p);
        }
        const double got = c[size_t(r * N + n)], tol = double(K + 2) * std::ldexp(1.0, -24) * mag + 1e-30;
        if (!(std::fabs(got - exact) <= tol) && bad++ < 5)
          ADD_FAILURE() << what << ": row " << r << " col " << n << " group " << g << ": " << got << " vs exact "
                        << exact << " (bound " << tol << ")";
      }
  EXPECT_EQ(bad, 0) << what;
}

// A grouped GEMM's shape: M rows in groups at offsets `off`, N columns, K.
struct GroupedCase {
  int64_t M, N, K;
  std::vector<int32_t> off;
};
// gpu-small's expert shape: 16 experts of ragged sizes over 16384 rows.
const GroupedCase kSixteenExperts = {
    16384,
    1024,
    1024,
    {0, 1000, 2100, 3000, 4096, 5000, 6200, 7000, 8192, 9000, 10240, 11000, 12288, 13000, 14336, 15000, 16384}};

}  // namespace

TEST(CudaGroupedBf16, MatchesTheExactSumWithRaggedAndEmptyGroups) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool wgmma : {true, false}) {  // both main loops
    const MainLoop loop(wgmma);
    struct Case {
      int64_t M, N, K;
      std::vector<int32_t> off;
    };
    const std::vector<Case> cases = {
        {200, 40, 96, {0, 37, 37, 140, 141, 141, 200}},  // N, K below one tile; empty groups
        {300, 136, 264, {0, 129, 129, 300}},             // one column and 8 K past a tile
        {1030, 256, 512, {0, 0, 128, 256, 1030, 1030}},  // whole tiles and a long group
    };
    for (const Case& c : cases) {
      const int64_t G = int64_t(c.off.size()) - 1;
      const Bf16 a = random_bf16({c.M, c.K}, 11, 1.0f), b = random_bf16({G, c.N, c.K}, 12, 0.05f);
      for (int width : kDecodeWidths) {  // the first case's groups are decode-sized: every decode tile
        const DecodeTile tile(width);
        Tensor out = filled(c.M, c.N, 0.0f);
        ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(c.off), out, false);
        ops::cuda::check_recorded_index_errors();
        expect_near_exact(host_floats(out), a, b, c.off, c.N, c.K, "grouped");
      }
    }
  }
}

TEST(CudaGroupedBf16, AccumulatesBitForBitAndLeavesOtherRowsAlone) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool wgmma : {true, false}) {  // both main loops
    const MainLoop loop(wgmma);
    const int64_t M = 50, N = 72, K = 64;
    const std::vector<int32_t> off{10, 20, 20, 30};  // rows 0..9 and 30..49 belong to no group
    const Bf16 a = random_bf16({M, K}, 21, 1.0f), b = random_bf16({3, N, K}, 22, 0.1f);
    for (int width : kDecodeWidths) {  // decode-sized groups: every decode tile (N = 72: a part tile at 32 and 128)
      const DecodeTile tile(width);
      const Bf16 c0 = random_bf16({M, N}, 23, 1.0f);
      Tensor c0f = Tensor::empty({M, N}, DType::F32, Device::CUDA);
      ops::convert(c0.dev, c0f);
      Tensor fresh = filled(M, N, 7.0f), acc = c0f.clone();
      ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(off), fresh, false);
      ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(off), acc, true);
      const std::vector<float> f = host_floats(fresh), s = host_floats(acc), init = host_floats(c0f);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < N; ++n) {
          const size_t i = size_t(r * N + n);
          const bool in = r >= 10 && r < 30;
          const float want_fresh = in ? f[i] : 7.0f, want_acc = in ? init[i] + f[i] : init[i];
          ASSERT_EQ(f[i], want_fresh) << "row " << r << " col " << n;
          ASSERT_EQ(0, std::memcmp(&s[i], &want_acc, sizeof(float))) << "row " << r << " col " << n;
        }
    }
  }
}

// NVFP4 outer scales applied in the kernel's epilogue (how ops::grouped_gemm runs the decoded
// operands of a quantized forward) are the scale epilogue's bits: C (+)= fl(fl(sum * sa[m]) *
// sb[n]), checked against the kernel's unscaled sums scaled on the host in that order, for
// per-row, per-tensor and no A scales, per-row and per-slice B scales per group, accumulate on
// and off, both main loops (the TMA form too: groups of 100 and 200 rows).
TEST(CudaGroupedBf16, OuterScalesInTheEpilogueAreTheScaleEpiloguesOrder) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 300, N = 72, K = 128, G = 3;
  const std::vector<int64_t> off{0, 100, 100, 300};
  const Bf16 a = random_bf16({M, K}, 31, 1.0f), b = random_bf16({G, N, K}, 32, 0.1f);
  const Tensor sa = uniform_scales_cuda({M}, 33), sb = uniform_scales_cuda({G * N}, 34);
  const std::vector<float> hsa = host_floats(sa), hsb = host_floats(sb);
  struct Scales {
    const char* name;
    int a_stride;  // 1 per row, 0 one scale, -1 none
    int b_stride;  // 1 per row of B (group stride N), 0 one a slice (group stride 1)
  };
  for (bool wgmma : {true, false}) {
    const MainLoop loop(wgmma);
    for (const Scales sc : {Scales{"per-row x per-row", 1, 1}, Scales{"per-row x per-slice", 1, 0},
                            Scales{"per-tensor x per-row", 0, 1}, Scales{"none x per-slice", -1, 0}})
      for (bool acc : {false, true}) {
        SCOPED_TRACE(testing::Message() << sc.name << (acc ? " accumulate" : ""));
        ops::cuda::GroupedOperand ga = ops::cuda::GroupedOperand::bf16(a.dev.raw(), K, 0),
                                  gb = ops::cuda::GroupedOperand::bf16(b.dev.raw(), K, N * K);
        Tensor sums = filled(M, N, 0.0f);
        ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ga, gb, off, N, K, sums.data<float>(), N, false));
        if (sc.a_stride >= 0) {
          ga.outer = sa.data<float>();
          ga.outer_stride = sc.a_stride;
        }
        gb.outer = sb.data<float>();
        gb.outer_stride = sc.b_stride;
        gb.outer_group_stride = sc.b_stride ? N : 1;
        const Tensor init = filled(M, N, 0.25f);
        Tensor c = init.clone();
        ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ga, gb, off, N, K, c.data<float>(), N, acc));
        const std::vector<float> got = host_floats(c), raw = host_floats(sums), hinit = host_floats(init);
        int bad = 0;
        for (int64_t m = 0; m < M; ++m) {
          const int64_t g = m < off[1] ? 0 : m < off[2] ? 1 : 2;
          for (int64_t n = 0; n < N; ++n) {
            const size_t i = size_t(m * N + n);
            float v = raw[i];
            if (sc.a_stride >= 0) v = num::mul_rn(v, hsa[size_t(m * sc.a_stride)]);
            v = num::mul_rn(v, hsb[size_t(g * (sc.b_stride ? N : 1) + n * sc.b_stride)]);
            if (acc) v = num::add_rn(hinit[i], v);
            if (std::memcmp(&v, &got[i], sizeof v) != 0 && bad++ < 3)
              ADD_FAILURE() << "row " << m << " col " << n << ": " << got[i] << ", want " << v;
          }
        }
        EXPECT_EQ(bad, 0);
      }
  }
}

// The gpu-small expert shape (16 experts, 16384 routed rows, N = K = 1024): every row of the full
// launch equals the same row computed with only the first m rows of its group (m = 1, 7, 64,
// 1000), alone or between two other groups. A's values spread over 17 binades, so that the products
// an MMA step adds differ widely in exponent: every decode configuration must align and round its
// terms as the training tile does (the streaming kernel's mma.sync, the weights its A operand, as
// wgmma with the tokens as A). Then the negative control: the same launch with K split in two
// halves summed afterwards (split-K) differs, so the comparison would catch it.
TEST(CudaGroupedBf16, RowsAreTheSameWhateverElseIsInTheLaunch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool wgmma : {true, false}) {  // both main loops
    const MainLoop loop(wgmma);
    const int64_t G = 16, N = 1024, K = 1024, M = 16384;
    std::mt19937 rng(5);
    std::vector<int32_t> off{0};
    for (int64_t g = 0; g + 1 < G; ++g) off.push_back(off.back() + (g == 5 ? 1200 : int32_t(500 + rng() % 500)));
    off.push_back(int32_t(M));  // the last group takes the rest (at least 1384 rows)
    const Bf16 a = random_bf16({M, K}, 31, 1.0f, 8), b = random_bf16({G, N, K}, 32, 0.03f);
    Tensor full = filled(M, N, 0.0f);
    ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(off), full, false);
    const std::vector<float> fh = host_floats(full);
    const int64_t g = 5, r0 = off[size_t(g)];
    ASSERT_GE(off[size_t(g) + 1] - r0, 1000);
    const Tensor bg = b.dev.view(g * N * K, {1, N, K});
    for (int64_t m : {1, 7, 64, 1000}) {
      // alone: a launch of m rows, one group (both of the wgmma loop's decode tiles where m <= 64)
      for (int width : kDecodeWidths) {
        const DecodeTile tile(width);
        Tensor out = filled(m, N, 0.0f);
        ops::cuda::grouped_gemm_bf16(a.dev.slice_rows(r0, r0 + m), bg, offsets_tensor({0, int32_t(m)}), out, false);
        const std::vector<float> oh = host_floats(out);
        EXPECT_EQ(0, std::memcmp(oh.data(), fh.data() + r0 * N, size_t(m * N) * sizeof(float))) << "alone, m = " << m;
      }
      // between other experts' rows: groups 2, 5, 9 over rows [0, 3), [3, 3 + m), [3 + m, 3 + m + 130)
      const int64_t rows = 3 + m + 130;
      Tensor a3 = Tensor::empty({rows, K}, DType::BF16, Device::CUDA);
      a3.slice_rows(0, 3).copy_from(a.dev.slice_rows(0, 3));
      a3.slice_rows(3, 3 + m).copy_from(a.dev.slice_rows(r0, r0 + m));
      a3.slice_rows(3 + m, rows).copy_from(a.dev.slice_rows(200, 330));
      Tensor b3 = Tensor::empty({3, N, K}, DType::BF16, Device::CUDA);
      const int64_t experts[3] = {2, 5, 9};
      for (int64_t i = 0; i < 3; ++i) b3.view(i * N * K, {N, K}).copy_from(b.dev.view(experts[i] * N * K, {N, K}));
      Tensor out3 = filled(rows, N, 0.0f);
      ops::cuda::grouped_gemm_bf16(a3, b3, offsets_tensor({0, 3, int32_t(3 + m), int32_t(rows)}), out3, false);
      const std::vector<float> o3 = host_floats(out3);
      EXPECT_EQ(0, std::memcmp(o3.data() + 3 * N, fh.data() + r0 * N, size_t(m * N) * sizeof(float)))
          << "among others, m = " << m;
    }
    ops::cuda::check_recorded_index_errors();
    // the negative control: K in two halves, the second accumulated onto the first
    Tensor split = filled(M, N, 0.0f);
    ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(off), split, false, 0, K / 2);
    ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(off), split, true, K / 2, K);
    const std::vector<float> sh = host_floats(split);
    int64_t differ = 0;
    for (size_t i = 0; i < sh.size(); ++i) differ += std::memcmp(&sh[i], &fh[i], sizeof(float)) != 0;
    EXPECT_GT(differ, 0) << "split-K gave the same bits: the invariance comparison could not see a changed order";
  }
}

// The Hopper loop's training tile fed by TMA in two-CTA clusters (the default) gives the bits of the
// same tile fed by cp.async, in each of its tiles (128 x 256 on m64n256k16, the default, 256 x 128
// on m64n128k16, and the ping-pong form's 128 x 128 taken by two warpgroups in turn), persistent (more tiles than clusters, slots past the last row tile between bands)
// or a cluster a tile, in every tile order (bands of column pairs, the last band narrower, or
// launch order): ragged and empty groups, one column tile (the cluster's second CTA has no
// columns), a column tile and a part, K past a whole tile, accumulate on and off.
TEST(CudaGroupedBf16, TmaClustersEqualTheCpAsyncLoopBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::wgmma_available()) GTEST_SKIP() << "not a Hopper device with sm_90a code";
  const std::vector<GroupedCase> cases = {
      {3000, 200, 136, {0, 700, 700, 1999, 2000, 3000}},
      {1030, 72, 512, {0, 0, 515, 1030}},
      {1500, 2200, 200, {0, 300, 300, 1100, 1500}},  // 9 column pairs: bands of 8 + 1, or 3 x 3
      kSixteenExperts,
  };
  for (const GroupedCase& c : cases) {
    const int64_t G = int64_t(c.off.size()) - 1;
    const Bf16 a = random_bf16({c.M, c.K}, 41, 1.0f), b = random_bf16({G, c.N, c.K}, 42, 0.05f);
    const Bf16 c0 = random_bf16({c.M, c.N}, 43, 1.0f);
    for (bool accumulate : {false, true}) {
      Tensor cp = Tensor::empty({c.M, c.N}, DType::F32, Device::CUDA);
      ops::convert(c0.dev, cp);
      ops::cuda::set_grouped_tma(false);
      ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(c.off), cp, accumulate);
      ops::cuda::set_grouped_tma(true);
      const std::vector<float> q = host_floats(cp);
      // the default (persistent, bands of 8 pairs), launch order, narrower bands, a cluster a tile
      const std::vector<std::pair<bool, int>> forms = {{true, 8}, {true, 0}, {true, 3}, {false, 8}};
      for (const int tile : optest::kTmaTiles)
      for (const auto& [persistent, band] : forms) {
        Tensor tma = Tensor::empty({c.M, c.N}, DType::F32, Device::CUDA);
        ops::convert(c0.dev, tma);
        const int64_t launches = ops::cuda::grouped_tma_launches();
        ops::cuda::set_grouped_tile_band(band);
        ops::cuda::set_grouped_tma_persistent(persistent);
        {
          const optest::TmaTile scope(tile);
          ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor(c.off), tma, accumulate);
        }
        ops::cuda::set_grouped_tile_band(8);
        ops::cuda::set_grouped_tma_persistent(true);
        EXPECT_EQ(ops::cuda::grouped_tma_launches(), launches + 1) << "the TMA form did not run";
        ops::cuda::check_recorded_index_errors();
        const std::vector<float> t = host_floats(tma);
        EXPECT_EQ(0, std::memcmp(t.data(), q.data(), t.size() * sizeof(float)))
            << "M " << c.M << " N " << c.N << " K " << c.K << ", " << optest::tma_tile_name(tile) << ", band " << band
            << (persistent ? ", persistent" : ", a cluster a tile") << (accumulate ? ", accumulate" : "");
        if (!accumulate && c.M < 5000 && band == 8 && persistent && tile == 256)
          expect_near_exact(t, a, b, c.off, c.N, c.K, "tma");
      }
    }
  }
}

// B read MN-major in place (each group stored [K, N]: a dgrad's forward weight) gives the bits of
// its K-major copy, in the TMA form (each tile, the ping-pong form's too), the cp.async form and the decode tile: ragged and empty
// groups, one group, N and K off the tiles (K rows past a group's K are zeros, not the next
// group's), accumulate on and off; and ops::grouped_gemm takes a transposed dense B this way.
TEST(CudaGroupedBf16, MnMajorBIsTheBitsOfItsKMajorCopy) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::wgmma_available()) GTEST_SKIP() << "not a Hopper device with sm_90a code";
  const std::vector<GroupedCase> cases = {
      {3000, 200, 136, {0, 700, 700, 1999, 2000, 3000}},
      {1030, 72, 520, {0, 0, 515, 1030}},
      {500, 128, 200, {0, 500}},
      {40, 256, 1024, {0, 3, 3, 20, 40}},  // the decode tile (at most 64 rows a group)
      kSixteenExperts,
  };
  for (const GroupedCase& c : cases) {
    const int64_t G = int64_t(c.off.size()) - 1, M = c.M, N = c.N, K = c.K;
    const Bf16 a = random_bf16({M, K}, 51, 1.0f), b = random_bf16({G, N, K}, 52, 0.05f);
    std::vector<float> t(size_t(G * K * N));  // b's values stored [G, K, N]
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) t[size_t((g * K + k) * N + n)] = float(b.host[size_t((g * N + n) * K + k)]);
    Tensor bt = Tensor::empty({G, K, N}, DType::BF16, Device::CUDA);
    ops::convert(Tensor::from_host(t.data(), {G, K, N}, DType::F32, Device::CUDA), bt);
    const Bf16 c0 = random_bf16({M, N}, 53, 1.0f);
    std::vector<int64_t> off(c.off.begin(), c.off.end());
    const auto ga = ops::cuda::GroupedOperand::bf16(a.dev.raw(), K, 0);
    auto gt = ops::cuda::GroupedOperand::bf16(bt.raw(), N, K * N);
    gt.trans = true;
    const bool training_tile = ops::cuda::grouped_rows_per_group(off) > 64;
    const optest::TrainingTile training;  // the TMA form where groups exceed 64 rows, however few tiles
    for (bool accumulate : {false, true})
      for (const int tma : {256, 128, optest::kPingPongTile, 0}) {  // the TMA form's tile, or 0: the cp.async form
        SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << (accumulate ? ", accumulate" : "")
                                        << (tma ? ", TMA, " + optest::tma_tile_name(tma) : ", cp.async"));
        Tensor kmajor = Tensor::empty({M, N}, DType::F32, Device::CUDA);
        ops::convert(c0.dev, kmajor);
        Tensor mnmajor = kmajor.clone();
        ops::cuda::set_grouped_tma(tma != 0);
        const optest::TmaTile scope(tma != 0 ? tma : 256);
        ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ga, ops::cuda::GroupedOperand::bf16(b.dev.raw(), K, N * K), off, N, K,
                                                 kmajor.data<float>(), N, accumulate));
        const int64_t launches = ops::cuda::grouped_tma_launches();
        ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ga, gt, off, N, K, mnmajor.data<float>(), N, accumulate));
        EXPECT_EQ(ops::cuda::grouped_tma_launches(), launches + (tma != 0 && training_tile ? 1 : 0));
        ops::cuda::set_grouped_tma(true);
        ops::cuda::check_recorded_index_errors();
        const std::vector<float> x = host_floats(kmajor), y = host_floats(mnmajor);
        EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float)));
        if (!accumulate && M < 5000) expect_near_exact(y, a, b, c.off, N, K, "MN-major B");
      }
    Tensor via_t = Tensor::empty({M, N}, DType::F32, Device::CUDA), via_k = via_t.clone();
    ops::grouped_gemm(ops::Operand(a.dev), ops::Operand(bt, true), off, via_t);
    ops::grouped_gemm(ops::Operand(a.dev), ops::Operand(b.dev), off, via_k);
    EXPECT_EQ(bytes(via_t), bytes(via_k)) << "ops::grouped_gemm, transposed dense B, M " << M;
  }
}

// On a Hopper GPU the default build runs the wgmma loop (the tests above would otherwise compare
// mma.sync with itself).
TEST(CudaGroupedBf16, HopperRunsTheWgmmaLoop) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int dev = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  if (major != 9) GTEST_SKIP() << "not a Hopper GPU (compute capability " << major << ".x)";
  EXPECT_TRUE(ops::cuda::wgmma_available())
      << "compute capability 9.x but no sm_90a code: build with CMAKE_CUDA_ARCHITECTURES including 90a";
}

TEST(CudaGroupedBf16, BadOffsetsAreReportedByName) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 64, N = 16, K = 32;
  const Bf16 a = random_bf16({M, K}, 41, 1.0f), b = random_bf16({3, N, K}, 42, 0.1f);
  Tensor out = filled(M, N, 0.0f);
  ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor({0, 40, 30, 64}), out, false);
  std::string msg = testutil::error_of([] { ops::cuda::check_recorded_index_errors(); });
  EXPECT_HAS(msg, "grouped_gemm_bf16: offsets[2] = 30 is below offsets[1] = 40");
  ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor({0, 10, 20, 65}), out, false);
  msg = testutil::error_of([] { ops::cuda::check_recorded_index_errors(); });
  EXPECT_HAS(msg, "offsets[3] = 65 is outside [0, M + 1=65)");
  // the record is cleared once reported
  ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor({0, 10, 20, 64}), out, false);
  ops::cuda::check_recorded_index_errors();
  EXPECT_HAS(testutil::error_of([&] {
               ops::cuda::grouped_gemm_bf16(a.dev, b.dev, offsets_tensor({0, 64}), out, false);
             }),
             "offsets must be an I32 [G + 1] = [4] tensor");
}

// ops::grouped_gemm_device_offsets (the forward's expert GEMMs queued before the router's counts
// reach the host) gives ops::grouped_gemm's bits with the same offsets given on the host: at
// training sizes (the TMA form), at decode sizes, with empty groups, and accumulating; and with
// the grouped kernel switched off it reads the offsets back and runs grouped_gemm's other path.
TEST(CudaGroupedBf16, DeviceOffsetsGiveTheHostOffsetsBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t K = 256, N = 192, G = 5;
  for (const std::vector<int32_t>& off :
       {std::vector<int32_t>{0, 700, 700, 1500, 2100, 2600}, std::vector<int32_t>{0, 3, 3, 9, 9, 40}}) {
    const int64_t M = off.back();
    SCOPED_TRACE("M = " + std::to_string(M));
    const Bf16 a = random_bf16({M, K}, 11, 1.0f), b = random_bf16({G, N, K}, 12, 0.05f);
    const std::vector<int64_t> host(off.begin(), off.end());
    const Tensor dev_off = offsets_tensor(off);
    for (const bool grouped_kernel : {true, false}) {
      ops::cuda::set_grouped_kernel(grouped_kernel);
      Tensor want = Tensor::zeros({M, N}, DType::F32, Device::CUDA), got = want.clone();
      ops::grouped_gemm(ops::Operand(a.dev), ops::Operand(b.dev), host, want);
      ops::grouped_gemm_device_offsets(ops::Operand(a.dev), ops::Operand(b.dev), dev_off, got);
      EXPECT_EQ(bytes(want), bytes(got)) << "grouped kernel " << grouped_kernel;
      ops::grouped_gemm(ops::Operand(a.dev), ops::Operand(b.dev), host, want, true);
      ops::grouped_gemm_device_offsets(ops::Operand(a.dev), ops::Operand(b.dev), dev_off, got, true);
      EXPECT_EQ(bytes(want), bytes(got)) << "accumulating, grouped kernel " << grouped_kernel;
    }
    ops::cuda::set_grouped_kernel(true);
  }
  // where the grouped kernel does not take the shape (K not a multiple of 8, more than 128 groups)
  // the offsets are read back and grouped_gemm's other path runs: still its bits
  EXPECT_FALSE(ops::grouped_gemm_reads_device_offsets(Device::CUDA, 129, K));
  EXPECT_FALSE(ops::grouped_gemm_reads_device_offsets(Device::CUDA, G, 20));
  EXPECT_TRUE(ops::grouped_gemm_reads_device_offsets(Device::CUDA, G, K));
  for (const auto& [groups, k] : {std::pair<int64_t, int64_t>{129, 64}, std::pair<int64_t, int64_t>{3, 20}}) {
    std::vector<int32_t> off(size_t(groups + 1));
    for (int64_t g = 0; g <= groups; ++g) off[size_t(g)] = int32_t(3 * g - (g > 1 ? 2 : 0) * (g % 2));
    const int64_t M = off.back();
    const Bf16 a = random_bf16({M, k}, 21, 1.0f), b = random_bf16({groups, 16, k}, 22, 0.05f);
    Tensor want = Tensor::zeros({M, 16}, DType::F32, Device::CUDA), got = want.clone();
    ops::grouped_gemm(ops::Operand(a.dev), ops::Operand(b.dev), std::vector<int64_t>(off.begin(), off.end()), want);
    ops::grouped_gemm_device_offsets(ops::Operand(a.dev), ops::Operand(b.dev), offsets_tensor(off), got);
    EXPECT_EQ(bytes(want), bytes(got)) << groups << " groups, K " << k;
  }
  const Bf16 a = random_bf16({8, K}, 1, 1.0f), b = random_bf16({G, N, K}, 2, 0.05f);
  Tensor out = Tensor::zeros({8, N}, DType::F32, Device::CUDA);
  EXPECT_HAS(testutil::error_of([&] {
               ops::grouped_gemm_device_offsets(ops::Operand(a.dev), ops::Operand(b.dev), offsets_tensor({0, 8}), out);
             }),
             "offsets must be I32 [G + 1] = [6]");
}
#endif
