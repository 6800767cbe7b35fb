// defines: batch-invariance tests (DESIGN "Exactness"): under every recipe with per-token
//          activation scales, a sequence's logits (Model::logits) are bit for bit the same alone
//          (B = 1) and inside a batch of 8 different sequences, at batch positions 0 and 5.
//          Negative controls that show the comparison can fail: nvidia-nvfp4 (per-tensor
//          activation scales depend on the batch) and a split-K GEMM reduction. Also: logits and
//          a training step's gradients are the same bits on 1 and 2 OpenMP threads.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/ops/ops.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

constexpr int64_t kBatch = 8, kT = 16;

// Rows of `batch_logits` that belong to sequence `pos`, compared bytewise with `alone`;
// returns the number of differing rows.
int64_t differing_rows(const Tensor& batch_logits, int64_t pos, const Tensor& alone) {
  const int64_t V = alone.size(1);
  int64_t diff = 0;
  for (int64_t t = 0; t < kT; ++t)
    diff += std::memcmp(batch_logits.data<float>() + (pos * kT + t) * V, alone.data<float>() + t * V,
                        size_t(V) * sizeof(float)) != 0;
  return diff;
}

// For each position: the number of the sequence's kT rows whose logits differ alone vs batched.
std::vector<int64_t> batch_vs_alone(const std::string& recipe) {
  const OmpThreads one_thread(1);
  // 4 layers: layer 0 dense, 1-2 MoE, 3 the tail (nvfp4-fwd runs NVFP4 experts in 1-2).
  ModelConfig c = tiny_moe_config(4, 32);
  Model m(c, recipe_by_name(recipe), Device::CPU);
  init_params(m.params(), c, 21);
  const Tensor batch = random_tokens(kBatch, kT, 99);
  const SrStreams sr{5, 0, 0};
  const Tensor all = m.logits(batch, sr);
  EXPECT_EQ(all.shape(), (Shape{kBatch * kT, c.vocab_size}));
  std::vector<int64_t> out;
  for (int64_t pos : {0, 5}) {
    const Tensor one = batch.view(pos * kT, {1, kT}).clone();
    const Tensor alone = m.logits(one, sr);
    out.push_back(differing_rows(all, pos, alone));
  }
  return out;
}

}  // namespace

TEST(BatchInvariance, LogitsAloneEqualLogitsInABatch) {
  for (const char* recipe : {"fp32", "bf16", "mxfp8", "nvfp4-fwd"}) {
    const std::vector<int64_t> diff = batch_vs_alone(recipe);
    EXPECT_EQ(diff[0], 0) << recipe << ": sequence at batch position 0 differs in " << diff[0] << " of " << kT << " rows";
    EXPECT_EQ(diff[1], 0) << recipe << ": sequence at batch position 5 differs in " << diff[1] << " of " << kT << " rows";
  }
}

// Negative control: nvidia-nvfp4 quantizes activations with ONE FP32 scale per tensor, computed
// from the absmax over every token of the batch, so a token's numerics depend on its neighbours.
// This is why nvfp4-fwd uses per-token activation scales. The test checks that the comparison
// above does detect the difference.
TEST(BatchInvariance, PerTensorActivationScalesAreNotBatchInvariant) {
  const std::vector<int64_t> diff = batch_vs_alone("nvidia-nvfp4");
  EXPECT_GT(diff[0], 0) << "nvidia-nvfp4 logits were batch invariant at position 0";
  EXPECT_GT(diff[1], 0) << "nvidia-nvfp4 logits were batch invariant at position 5";
}

// The other half of "deterministic": the thread count changes nothing, forward (logits) or
// backward (every gradient, through the SR quantizers and the requantized saved operands).
TEST(BatchInvariance, ThreadCountChangesNoBits) {
  ModelConfig c = tiny_moe_config(4, 32);
  Model m(c, recipe_by_name("nvfp4-fwd"), Device::CPU);
  init_params(m.params(), c, 21);
  const Tensor tokens = random_tokens(2, kT, 98);
  const Tensor targets = shifted_targets(tokens, 258);
  const SrStreams sr{5, 3, 0};
  Tensor logits[2], grads[2];
  for (int threads : {1, 2}) {
    const OmpThreads scope(threads);
    logits[threads - 1] = m.logits(tokens, sr);
    m.params().zero_grad();
    m.forward(tokens, targets, sr, true);
    m.backward();
    grads[threads - 1] = m.params().flat_grad().clone();
  }
  EXPECT_EQ(std::memcmp(logits[0].raw(), logits[1].raw(), size_t(logits[0].nbytes())), 0) << "logits";
  EXPECT_EQ(std::memcmp(grads[0].raw(), grads[1].raw(), size_t(grads[0].nbytes())), 0) << "gradients";
}

// Negative control at the GEMM level: reducing K in two halves and adding the partial sums
// (what a split-K kernel does) changes the rounding, so some element's bits differ from the
// single fixed-order chain of ops::gemm.
TEST(BatchInvariance, SplitKReductionChangesBits) {
  const int64_t M = 16, N = 32, K = 256, H = K / 2;
  std::mt19937_64 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Tensor a = Tensor::empty({M, K}, DType::F32), b = Tensor::empty({N, K}, DType::F32);
  for (int64_t i = 0; i < a.numel(); ++i) a.data<float>()[i] = n(rng);
  for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = n(rng);
  Tensor a0 = Tensor::empty({M, H}, DType::F32), a1 = Tensor::empty({M, H}, DType::F32);
  Tensor b0 = Tensor::empty({N, H}, DType::F32), b1 = Tensor::empty({N, H}, DType::F32);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < H; ++k) {
      a0.data<float>()[r * H + k] = a.data<float>()[r * K + k];
      a1.data<float>()[r * H + k] = a.data<float>()[r * K + H + k];
    }
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < H; ++k) {
      b0.data<float>()[r * H + k] = b.data<float>()[r * K + k];
      b1.data<float>()[r * H + k] = b.data<float>()[r * K + H + k];
    }
  Tensor full = Tensor::empty({M, N}, DType::F32), lo = Tensor::empty({M, N}, DType::F32),
         hi = Tensor::empty({M, N}, DType::F32);
  ops::gemm(ops::Operand(a), ops::Operand(b), full);
  ops::gemm(ops::Operand(a0), ops::Operand(b0), lo);
  ops::gemm(ops::Operand(a1), ops::Operand(b1), hi);
  int64_t rows_differing = 0;
  double max_abs = 0;
  for (int64_t r = 0; r < M; ++r) {
    bool row_diff = false;
    for (int64_t c = 0; c < N; ++c) {
      const float split = lo.data<float>()[r * N + c] + hi.data<float>()[r * N + c];
      const float one = full.data<float>()[r * N + c];
      row_diff |= std::memcmp(&split, &one, sizeof(float)) != 0;
      max_abs = std::max(max_abs, double(std::fabs(split - one)));
    }
    rows_differing += row_diff;
  }
  EXPECT_GT(rows_differing, 0) << "split-K gave the same bits as the fixed-order GEMM in every row";
  EXPECT_LT(max_abs, 1e-3) << "the split-K result should differ by rounding only";
  // ... while the fixed-order GEMM itself is row invariant: rows 3..5 alone equal rows 3..5 of all.
  Tensor part = Tensor::empty({3, N}, DType::F32);
  const Tensor a_rows = a.slice_rows(3, 6);
  ops::gemm(ops::Operand(a_rows), ops::Operand(b), part);
  EXPECT_EQ(std::memcmp(part.raw(), full.data<float>() + 3 * N, size_t(part.nbytes())), 0);
}
