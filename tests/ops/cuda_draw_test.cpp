// ops::draw_tokens on the GPU gives the CPU's tokens, statuses and log-prob bits: vocabularies
// from 1 to kGpuDrawMaxVocab (around the 64-token chunks and the 256-thread block), greedy and
// sampled specs with top-k and top-p, rows with ties, +-0, -inf, NaN and no finite logit; each row
// alone and in a batch. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "ops/op_test_util.h"

using namespace fourbit;
using namespace fourbit::optest;

namespace {

// Rows of V logits: N(0, 3) draws, with special rows mixed in.
Tensor rows_of(int64_t A, int64_t V, uint64_t seed) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 3.0f);
  Tensor x = Tensor::empty({A, V}, DType::F32);
  float* p = x.data<float>();
  for (int64_t i = 0; i < A * V; ++i) p[i] = n(rng);
  for (int64_t a = 0; a < A; ++a) {
    float* r = p + a * V;
    switch (a % 8) {
      case 1:  // ties, +0 and -0 among them
        for (int64_t v = 0; v < V; v += 2) r[v] = (v % 4 == 0) ? 0.0f : -0.0f;
        break;
      case 2:  // most tokens impossible
        for (int64_t v = 1; v < V; ++v)
          if (v % 5 != 0) r[v] = -inf;
        break;
      case 3:  // a NaN past the middle
        r[V / 2] = nan;
        if (V > 3) r[V - 1] = nan;
        break;
      case 4:  // nothing finite to draw from
        for (int64_t v = 0; v < V; ++v) r[v] = -inf;
        break;
      case 5:  // a few values only: long runs of ties
        for (int64_t v = 0; v < V; ++v) r[v] = float(int(r[v]) / 2);
        break;
      default: break;
    }
  }
  return x;
}

TEST(CudaDrawTokens, TokensLogprobsAndStatusesAreTheCpus) {
  SKIP_WITHOUT_GPU();
  const std::vector<ops::DrawSpec> specs = {
      {0.0, 0, 1.0, 1, 2},   {1.0, 0, 1.0, 1, 2},  {0.7, 0, 1.0, 4, 0},  {1.0, 5, 1.0, 1, 2},
      {1.0, 600, 1.0, 7, 3}, {1.0, 0, 0.6, 1, 2},  {0.7, 5, 0.6, 9, 9},  {1.0, 1, 1.0, 1, 2},
      {2.5, 0, 0.95, 3, 1},  {0.05, 0, 1.0, 3, 1}, {0.0, 7, 0.5, 1, 2},  {1.0, 0, 1e-9, 2, 2},
  };
  int64_t compared = 0;
  for (const int64_t V : {int64_t(1), int64_t(7), int64_t(64), int64_t(65), int64_t(256), int64_t(260),
                          int64_t(513), int64_t(2048)}) {
    const int64_t A = 24;
    const Tensor logits = rows_of(A, V, uint64_t(V));
    std::vector<int64_t> keys;
    for (int64_t a = 0; a < A; ++a) keys.insert(keys.end(), {int64_t(a * 31 + 5), int64_t(a % 9)});
    for (size_t s = 0; s < specs.size(); ++s) {
      const DrawnRows cpu = draw_rows(Device::CPU, logits, specs[s], keys);
      const DrawnRows gpu = draw_rows(Device::CUDA, logits, specs[s], keys);
      for (int64_t a = 0; a < A; ++a) {
        SCOPED_TRACE(::testing::Message() << "V " << V << " spec " << s << " row " << a);
        ASSERT_EQ(gpu.status[size_t(a)], cpu.status[size_t(a)]);
        ASSERT_EQ(gpu.tokens[size_t(a)], cpu.tokens[size_t(a)]);
        ASSERT_EQ(gpu.logprob_bits[size_t(a)], cpu.logprob_bits[size_t(a)]);
        ++compared;
      }
      // a row alone: the same as in the batch
      const int64_t a = int64_t(s) % A;
      const DrawnRows alone = draw_rows(Device::CUDA, logits.slice_rows(a, a + 1).clone(), specs[s],
                                  {keys[size_t(2 * a)], keys[size_t(2 * a + 1)]});
      EXPECT_EQ(alone.tokens[0], gpu.tokens[size_t(a)]);
      EXPECT_EQ(alone.logprob_bits[0], gpu.logprob_bits[size_t(a)]);
    }
  }
  EXPECT_EQ(compared, 8 * 12 * 24);
}

TEST(CudaDrawTokens, RowsLongerThanTheKernelTakesFail) {
  SKIP_WITHOUT_GPU();
  const int64_t V = ops::kGpuDrawMaxVocab + 1;
  const Tensor logits = Tensor::zeros({2, V}, DType::F32, Device::CUDA);
  const std::vector<int64_t> k(4, 0);
  Tensor tokens = Tensor::empty({2}, DType::I32, Device::CUDA), logprobs = Tensor::empty({2}, DType::F64, Device::CUDA),
         status = Tensor::empty({2}, DType::I32, Device::CUDA);
  expect_error(
      [&] {
        ops::draw_tokens(logits, {}, Tensor::from_host(k.data(), {2, 2}, DType::I64, Device::CUDA), tokens, logprobs,
                         status);
      },
      "draw_tokens: the GPU draws rows of at most 2048 logits");
}

}  // namespace
