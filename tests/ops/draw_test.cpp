// ops::draw_tokens on the CPU: every row is the draw of that row alone (rl::draw_token's, checked
// against a token-by-token walk in tests/rl/sampling_test.cpp), whatever else is in the batch and
// however many threads share it; bad rows get their status, bad arguments a clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fourbit/ops/ops.h"
#include "ops/op_test_util.h"

using namespace fourbit;
using namespace fourbit::optest;

namespace {

DrawnRows draw(const Tensor& logits, const ops::DrawSpec& spec, const std::vector<int64_t>& keys) {
  return draw_rows(Device::CPU, logits, spec, keys);
}

TEST(DrawTokens, EachRowIsItsDrawAloneWhateverTheBatchAndThreads) {
  constexpr int64_t A = 37, V = 300;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n(0.0f, 3.0f);
  Tensor logits = Tensor::empty({A, V}, DType::F32);
  for (int64_t i = 0; i < A * V; ++i) logits.data<float>()[i] = n(rng);
  for (int64_t v = 0; v < V; v += 3) logits.data<float>()[5 * V + v] = 1.5f;  // ties in row 5
  std::vector<int64_t> keys;
  for (int64_t a = 0; a < A; ++a) keys.insert(keys.end(), {int64_t(1000 + 7 * a), int64_t(a % 11)});
  for (const ops::DrawSpec& spec : {ops::DrawSpec{1.0, 0, 1.0, 3, 9}, ops::DrawSpec{0.7, 40, 0.9, 3, 9},
                                    ops::DrawSpec{0.0, 0, 1.0, 3, 9}, ops::DrawSpec{1.3, 0, 0.5, 8, 1}}) {
    DrawnRows batch, one_thread;
    with_threads(4, [&] { batch = draw(logits, spec, keys); });
    with_threads(1, [&] { one_thread = draw(logits, spec, keys); });
    for (int64_t a = 0; a < A; ++a) {
      const Tensor row = logits.slice_rows(a, a + 1).clone();
      const DrawnRows alone = draw(row, spec, {keys[size_t(2 * a)], keys[size_t(2 * a + 1)]});
      SCOPED_TRACE(::testing::Message() << "row " << a << " T " << spec.temperature);
      EXPECT_EQ(batch.status[size_t(a)], ops::kDrawOk);
      EXPECT_EQ(batch.tokens[size_t(a)], alone.tokens[0]);
      EXPECT_EQ(batch.logprob_bits[size_t(a)], alone.logprob_bits[0]);
      EXPECT_EQ(one_thread.tokens[size_t(a)], batch.tokens[size_t(a)]);
      EXPECT_EQ(one_thread.logprob_bits[size_t(a)], batch.logprob_bits[size_t(a)]);
    }
  }
}

TEST(DrawTokens, BadRowsGetTheirStatusAndTheOthersTheirTokens) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> rows = {0.5f, nan, 2.0f, nan,      // first NaN: token 1
                                   -inf, -inf, -inf, -inf,    // no finite largest logit
                                   0.1f, 3.0f, -inf, 3.0f,    // fine
                                   -inf, -1.0f, -inf, -inf};  // fine: one finite logit
  const Tensor logits = Tensor::from_host(rows.data(), {4, 4}, DType::F32);
  const std::vector<int64_t> keys = {1, 0, 2, 0, 3, 0, 4, 0};
  const DrawnRows d = draw(logits, ops::DrawSpec{1.0, 0, 1.0, 0, 0}, keys);
  EXPECT_EQ(d.status, (std::vector<int32_t>{1, ops::kDrawAllNegInf, ops::kDrawOk, ops::kDrawOk}));
  EXPECT_TRUE(d.tokens[2] == 1 || d.tokens[2] == 3);
  EXPECT_EQ(d.tokens[3], 1);
  EXPECT_EQ(d.logprob_bits[3], 0u);  // log 1 = +0
  // greedy: the first largest; all -inf is a row like any other there
  const DrawnRows g = draw(logits, ops::DrawSpec{0.0, 0, 1.0, 0, 0}, keys);
  EXPECT_EQ(g.status, (std::vector<int32_t>{1, ops::kDrawOk, ops::kDrawOk, ops::kDrawOk}));
  EXPECT_EQ(g.tokens[1], 0);
  EXPECT_EQ(g.tokens[2], 1);
  EXPECT_EQ(g.tokens[3], 1);
}

TEST(DrawTokens, BadArgumentsAreClearErrors) {
  const Tensor logits = random_tensor({3, 8}, DType::F32, 1);
  const std::vector<int64_t> k(6, 0);
  Tensor tokens = Tensor::empty({3}, DType::I32), logprobs = Tensor::empty({3}, DType::F64),
         status = Tensor::empty({3}, DType::I32);
  const Tensor keys = Tensor::from_host(k.data(), {3, 2}, DType::I64);
  expect_error([&] { ops::draw_tokens(logits, {1.0, 0, 1.5, 0, 0}, keys, tokens, logprobs, status); },
               "draw_tokens: top_p must be in (0, 1] (1 = all tokens), got 1.5");
  expect_error([&] { ops::draw_tokens(logits, {-1.0, 0, 1.0, 0, 0}, keys, tokens, logprobs, status); },
               "draw_tokens: temperature must be a finite value >= 0 (0 = greedy), got -1");
  expect_error([&] { ops::draw_tokens(logits, {1.0, -2, 1.0, 0, 0}, keys, tokens, logprobs, status); },
               "draw_tokens: top_k must be >= 0 (0 = all tokens), got -2");
  const Tensor short_keys = Tensor::from_host(k.data(), {3}, DType::I64);
  expect_error([&] { ops::draw_tokens(logits, {}, short_keys, tokens, logprobs, status); },
               "draw_tokens: keys must be i64[A, 2]=[3, 2] cpu");
  Tensor f32_logprobs = Tensor::empty({3}, DType::F32);
  expect_error([&] { ops::draw_tokens(logits, {}, keys, tokens, f32_logprobs, status); },
               "draw_tokens: logprobs must be f64[A]=[3] cpu");
  const Tensor empty_rows = Tensor::empty({3, 0}, DType::F32);
  expect_error([&] { ops::draw_tokens(empty_rows, {}, keys, tokens, logprobs, status); },
               "draw_tokens: logits must be f32[A, V] cpu with V >= 1");
}

}  // namespace
