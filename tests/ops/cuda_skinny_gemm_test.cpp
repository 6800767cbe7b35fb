// defines: tests of the GPU's FP32 GEMMs at the router's shapes, skipped without a GPU: the
// forward (N <= 32: ops/cuda/skinny_gemm.cu), the input gradient (cuBLASLt) and the weight gradient
// (M <= 32 over K >= 256 tokens: skinny_gemm.cu's chunked kernels; fewer: cuBLASLt) against
// the CPU backend (one float-rounding level apart: FP32 sums against the CPU's), accumulate = the
// stored sum added to C, a stored C not read (NaN before), two runs the same bits, and the forward
// and input-gradient forms' rows the same bits whatever M (the forward's few-row and row kernels);
// the weight gradient of a norm's output made in the kernels (rmsnorm_input_wgrad) the bits of the
// norm then the GEMM.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "ops/op_test_util.h"

#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"

using namespace fourbit;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

Tensor randn(const Shape& s, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = nd(g);
  return Tensor::from_host(v.data(), s, DType::F32);
}

// max |x - y| / (max |y| + tiny): a relative bound for FP32 sums of unit-scale products
double rel_err(const Tensor& got, const Tensor& want) {
  const Tensor x = got.to(Device::CPU), y = want.to(Device::CPU);
  double err = 0, scale = 1e-30;
  for (int64_t i = 0; i < x.numel(); ++i) {
    err = std::max(err, std::abs(double(x.data<float>()[i]) - double(y.data<float>()[i])));
    scale = std::max(scale, std::abs(double(y.data<float>()[i])));
  }
  return err / scale;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  return x.numel() == y.numel() && std::memcmp(x.raw(), y.raw(), size_t(x.nbytes())) == 0;
}

struct Form {
  const char* name;
  bool a_trans, b_trans;
};
// the router's three GEMMs: logits = X W^T; dX = dlogits W; dW = dlogits^T X
constexpr Form kForward{"forward (N small)", false, false};
constexpr Form kInputGrad{"input gradient (K small)", false, true};
constexpr Form kWeightGrad{"weight gradient (M small, K-major)", true, true};

// C[M, N] = A . B^T in the form's layouts on both backends; `c0` (CPU) the starting C when accumulating.
void check(const Form& f, int64_t M, int64_t N, int64_t K, uint64_t seed) {
  const std::string what = std::string(f.name) + " M=" + std::to_string(M) + " N=" + std::to_string(N) +
                           " K=" + std::to_string(K);
  const Tensor a = f.a_trans ? randn({K, M}, seed) : randn({M, K}, seed);
  const Tensor b = f.b_trans ? randn({K, N}, seed + 1) : randn({N, K}, seed + 1);
  const Tensor c0 = randn({M, N}, seed + 2);
  Tensor want = Tensor::empty({M, N}, DType::F32);
  ops::gemm(ops::Operand(a, f.a_trans), ops::Operand(b, f.b_trans), want);
  const Tensor ga = a.to(Device::CUDA), gb = b.to(Device::CUDA);
  Tensor got = Tensor::empty({M, N}, DType::F32, Device::CUDA), again = got.clone();
  ops::fill_(got, std::nan(""));  // a stored C is not read
  ops::gemm(ops::Operand(ga, f.a_trans), ops::Operand(gb, f.b_trans), got);
  ops::gemm(ops::Operand(ga, f.a_trans), ops::Operand(gb, f.b_trans), again);
  EXPECT_LT(rel_err(got, want), 2e-6 * std::sqrt(double(K))) << what;
  EXPECT_TRUE(same_bits(got, again)) << what << ": two runs";
  // accumulating: C + the sum; into zeros, the stored bits
  Tensor acc = c0.to(Device::CUDA), zeros = Tensor::zeros({M, N}, DType::F32, Device::CUDA);
  ops::gemm(ops::Operand(ga, f.a_trans), ops::Operand(gb, f.b_trans), acc, true);
  ops::gemm(ops::Operand(ga, f.a_trans), ops::Operand(gb, f.b_trans), zeros, true);
  EXPECT_TRUE(same_bits(zeros, got)) << what << ": accumulated into zeros vs stored";
  Tensor want_acc = c0.clone();
  ops::gemm(ops::Operand(a, f.a_trans), ops::Operand(b, f.b_trans), want_acc, true);
  EXPECT_LT(rel_err(acc, want_acc), 2e-6 * std::sqrt(double(K))) << what << ": accumulate";
}

}  // namespace

TEST(CudaSkinnyGemm, FormsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // gpu-small's router (8192 tokens, d_model 1024, 16 experts), then edges: 1, 17 (past the
  // 16-wide form), 32, K past a 256-wide tile, K not a multiple of 4, a ragged last chunk
  check(kForward, 8192, 16, 1024, 10);
  check(kForward, 77, 1, 13, 11);
  check(kForward, 33, 17, 300, 12);
  check(kForward, 5, 32, 1024, 13);
  check(kForward, 300, 20, 300, 14);  // past the few-row form's 256 rows, past 16 columns
  check(kInputGrad, 8192, 1024, 16, 20);
  check(kInputGrad, 77, 1030, 1, 21);
  check(kInputGrad, 17, 13, 17, 22);
  check(kInputGrad, 3, 2049, 32, 23);
  // the weight gradient on cuBLASLt and on the chunked kernels (set_skinny_wgrad): 16- and 32-row
  // forms, 16-byte rows and not (N = 1030), a last chunk of one row (8193) or of 4 (4100), columns
  // past one CTA's 1024, and K below the kernels' reach (cuBLASLt either way)
  for (const bool kernels : {false, true}) {
    SCOPED_TRACE(kernels ? "chunked kernels" : "cuBLASLt");
    const bool before = ops::cuda::set_skinny_wgrad(kernels);
    check(kWeightGrad, 16, 1024, 8192, 30);
    check(kWeightGrad, 1, 7, 1, 31);
    check(kWeightGrad, 17, 300, 8193, 32);
    check(kWeightGrad, 32, 1030, 129, 33);
    check(kWeightGrad, 5, 64, 300, 34);
    check(kWeightGrad, 20, 1024, 1000, 35);
    check(kWeightGrad, 32, 1030, 4100, 36);
    check(kWeightGrad, 16, 2052, 256, 37);
    ops::cuda::set_skinny_wgrad(before);
  }
}

// Forward and input gradient: a row's bits do not depend on how many rows are multiplied (the
// forward's 1, 7 and 64 rows take the few-row form, a warp an element; 1000 and 4096 the row
// form; 16 and 20 columns).
TEST(CudaSkinnyGemm, RowsAreBatchInvariant) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const auto& [f, forward_n] : {std::pair{kForward, 16}, std::pair{kForward, 20}, std::pair{kInputGrad, 0}}) {
    const int64_t N = f.b_trans ? 1024 : forward_n, K = f.b_trans ? 16 : 1024, M = 4096;
    const Tensor a = randn({M, K}, 40).to(Device::CUDA);
    const Tensor b = (f.b_trans ? randn({K, N}, 41) : randn({N, K}, 41)).to(Device::CUDA);
    Tensor full = Tensor::empty({M, N}, DType::F32, Device::CUDA);
    ops::gemm(ops::Operand(a), ops::Operand(b, f.b_trans), full);
    const Tensor full_h = full.to(Device::CPU);
    for (const int64_t m : {int64_t(1), int64_t(7), int64_t(64), int64_t(1000)}) {
      for (const int64_t first : {int64_t(0), int64_t(1001)}) {
        const Tensor rows = a.slice_rows(first, first + m);
        Tensor part = Tensor::empty({m, N}, DType::F32, Device::CUDA);
        ops::gemm(ops::Operand(rows), ops::Operand(b, f.b_trans), part);
        const Tensor ph = part.to(Device::CPU);
        EXPECT_EQ(0, std::memcmp(ph.data<float>(), full_h.data<float>() + first * N, size_t(m * N) * 4))
            << f.name << " rows " << first << " .. " << first + m - 1;
      }
    }
  }
}

// ops::rmsnorm_input_wgrad on the GPU: the norm's output made where the weight-gradient kernels
// read it gives the bits of rmsnorm_forward then the GEMM (at most 32 rows over at least 256
// tokens; elsewhere the op is those two), stored or accumulated: gpu-small's router, a ragged
// chunk, rows not 16-byte aligned, 32 rows, and a K below the kernels' reach.
TEST(CudaSkinnyGemm, NormInputWgradIsTheNormThenTheGemm) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const bool before = ops::cuda::set_skinny_wgrad(true);
  struct Case {
    int64_t M, D, N;
  };
  for (const Case& k : {Case{16, 1024, 8192}, Case{5, 64, 300}, Case{20, 1030, 1000}, Case{32, 256, 4100},
                        Case{16, 100, 200}}) {
    const std::string what = "M=" + std::to_string(k.M) + " D=" + std::to_string(k.D) + " N=" + std::to_string(k.N);
    const Tensor x = randn({k.N, k.D}, 50).to(Device::CUDA), dy = randn({k.N, k.M}, 51).to(Device::CUDA);
    Tensor w = randn({k.D}, 52);
    for (int64_t i = 0; i < k.D; ++i) w.data<float>()[i] = 1.0f + 0.25f * w.data<float>()[i];
    w = w.to(Device::CUDA);
    Tensor y = Tensor::empty({k.N, k.D}, DType::F32, Device::CUDA), rstd = Tensor::empty({k.N}, DType::F32, Device::CUDA);
    ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
    for (const bool accumulate : {false, true}) {
      const Tensor c0 = randn({k.M, k.D}, 53).to(Device::CUDA);
      Tensor want = c0.clone(), got = c0.clone();
      ops::gemm(ops::Operand(dy, true), ops::Operand(y, true), want, accumulate);
      ops::rmsnorm_input_wgrad(dy, x, w, 1e-5f, rstd, got, accumulate);
      EXPECT_TRUE(same_bits(got, want)) << what << (accumulate ? " accumulating" : "");
    }
  }
  ops::cuda::set_skinny_wgrad(before);
}

#endif  // FOURBIT_HAS_CUDA
