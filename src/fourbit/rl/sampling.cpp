// defines: check_sampling_options, sampling_uniform, draw_spec, fail_bad_draw, draw_token (sampling.h)
#include "fourbit/rl/sampling.h"

#include <cstdint>

#include "fourbit/numerics/draw.h"
#include "fourbit/ops/tensor_checks.h"
#include "fourbit/tensor/error.h"

namespace fourbit::rl {

void check_sampling_options(const SamplingOptions& o, int64_t vocab) {
  ops::check_draw_spec("sampling", draw_spec(o));
  if (o.max_new < 0) fail("sampling: max_new must be >= 0, got {}", o.max_new);
  if (o.stop_token < -1 || o.stop_token >= vocab)
    fail("sampling: stop_token must be -1 (none) or a token id below the vocabulary size {}, got {}", vocab,
         o.stop_token);
}

double sampling_uniform(uint64_t seed, uint64_t step, uint64_t sequence_id, int64_t position) {
  return num::draw_uniform(seed, step, sequence_id, position);
}

ops::DrawSpec draw_spec(const SamplingOptions& o) {
  return ops::DrawSpec{o.temperature, o.top_k, o.top_p, o.seed, o.step};
}

void fail_bad_draw(int32_t status, uint64_t sequence_id, int64_t position) {
  if (status == ops::kDrawOk) return;
  if (status == ops::kDrawAllNegInf)
    fail("sampling: every logit of sequence {} at position {} is -inf", sequence_id, position);
  fail("sampling: the logits of sequence {} at position {} hold NaN (token {})", sequence_id, position, status);
}

TokenDraw draw_token(std::span<const float> logits, const SamplingOptions& o, uint64_t sequence_id,
                     int64_t position) {
  const int64_t V = int64_t(logits.size());
  if (V == 0) fail("sampling: empty logits row");
  const Tensor x = Tensor::from_host(logits.data(), {1, V}, DType::F32);
  const int64_t key[2] = {int64_t(sequence_id), position};
  Tensor token = Tensor::empty({1}, DType::I32), logprob = Tensor::empty({1}, DType::F64),
         status = Tensor::empty({1}, DType::I32);
  ops::draw_tokens(x, draw_spec(o), Tensor::from_host(key, {1, 2}, DType::I64), token, logprob, status);
  fail_bad_draw(status.data<int32_t>()[0], sequence_id, position);
  return TokenDraw{token.data<int32_t>()[0], logprob.data<double>()[0]};
}

}  // namespace fourbit::rl
