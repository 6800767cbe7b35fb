// defines: SamplingOptions, TokenDraw, check_sampling_options, sampling_uniform, draw_spec, fail_bad_draw,
//          draw_token
// Choosing the next token from one row of logits: greedy, or a draw at a temperature with
// optional top-k / top-p truncation. The draw is a pure function of the logits row, the options
// and (seed, step, sequence id, position): one Philox-4x32-10 call per token, so a sequence's
// samples never depend on which other sequences share its batch, on the batch order or on the
// backend's thread layout. Its arithmetic is numerics/draw.h's (exp and log from IEEE operations,
// running sums in chunks of 64 tokens), which a GPU kernel can compute to the same bits.
#pragma once
#include <cstdint>
#include <span>

#include "fourbit/ops/ops.h"
#include "fourbit/train/tokenizer.h"

namespace fourbit::rl {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (argmax, ties to the lowest id); else softmax(logits / T)
  int64_t top_k = 0;         // > 0: only the k most likely tokens (ties to the lower id); 0: all
  double top_p = 1.0;        // < 1: the smallest most-likely prefix with probability >= top_p; 1: all
  int64_t max_new = 64;      // tokens per completion at most (the stop token included)
  int32_t stop_token = data::kEos;  // -1: never stop before max_new or the context
  uint64_t seed = 0;         // the random draws' key, with the step ...
  uint64_t step = 0;         // ... (an RL step; 0 for one-off generation), sequence id and position
  bool keep_logits = false;  // keep each sampled token's logits row (tests, diagnostics)
};

// Fails with the field and the allowed range (vocab: the model's vocabulary size).
void check_sampling_options(const SamplingOptions& o, int64_t vocab);

struct TokenDraw {
  int32_t token = 0;
  // log of the probability the token was drawn with (after temperature and truncation; 0 when
  // greedy). Not the policy's log-prob: that is the model's temperature-1 softmax (sampler.h).
  double sample_logprob = 0;
};

// A uniform double in [0, 1) (53 random bits) for the token at absolute `position` of sequence
// `sequence_id` in `step`: Philox-4x32-10 keyed by the seed, counter (position, stream) with the
// stream mixed from (step, sequence id) and a tag that keeps it apart from the SR streams
// (num::draw_uniform).
double sampling_uniform(uint64_t seed, uint64_t step, uint64_t sequence_id, int64_t position);

// The draw's fields of the options, for ops::draw_tokens (the backends' draws of a batch of rows).
ops::DrawSpec draw_spec(const SamplingOptions& o);

// Fails with the row's message where a draw's status is not ops::kDrawOk: a NaN logit (naming the
// first), or no finite largest logit.
void fail_bad_draw(int32_t status, uint64_t sequence_id, int64_t position);

// The next token from logits [V] (fails on a NaN logit; -inf logits are never drawn): one row of
// ops::draw_tokens on the CPU.
TokenDraw draw_token(std::span<const float> logits, const SamplingOptions& o, uint64_t sequence_id,
                     int64_t position);

}  // namespace fourbit::rl
