// defines: draw_uniform, draw_key_high, draw_key, kDrawChunk, draw_weight, draw_chunk_sum, DrawPick,
//          draw_pick
// The arithmetic of one token draw (rl/sampling.h: temperature, top-k, top-p, inverse CDF), written
// once for the host and a CUDA kernel so that both draw the same token with the same
// log-probability bits. A draw is:
//   1. the walk order: tokens by decreasing logit, equal logits (-0 equal to +0) by increasing id,
//      i.e. by increasing draw_key; top-k keeps the first k;
//   2. weights p_i = e^((l_i - l_max) / T) in walk order (exp_hd, numerics/exp_log.h);
//   3. the running sum through i, acc_i: the walk is cut into chunks of kDrawChunk tokens, each
//      chunk summed in order from 0, and acc_i = (the sums of the chunks before i's, added in order
//      from 0) + (i's chunk summed in order through i) — every addition a double rounded to
//      nearest. A CUDA kernel sums the chunks in parallel and one thread walks the chunk sums, then
//      one chunk, instead of all V tokens; the host computes the same numbers in one pass;
//   4. the total is acc_(keep-1); top-p keeps the tokens through the first i with
//      acc_i >= top_p * total (the total becomes acc_i); the draw takes the first kept i with
//      acc_i > u * total (u: draw_uniform), else the last kept token of non-zero weight;
//      its log-probability is log_hd(p_i / total).
#pragma once
#include <cstdint>

#include "fourbit/numerics/exp_log.h"
#include "fourbit/numerics/hd.h"
#include "fourbit/numerics/philox.h"

namespace fourbit::num {

// A uniform double in [0, 1) (53 random bits) for the token at `position` of `sequence_id` in
// `step`: Philox-4x32-10 keyed by the seed, counter (position, stream) with the stream folded from
// (step, sequence id) by mix64 (as SrStreams::key folds its fields), after a tag no SR stream
// starts from.
FOURBIT_HD double draw_uniform(uint64_t seed, uint64_t step, uint64_t sequence_id, int64_t position) {
  uint64_t stream = mix64(0x53414D504C45ull /* "SAMPLE" */ ^ step);
  stream = mix64(stream ^ sequence_id);
  const Philox4x32 r = random_bits4(seed, stream, uint64_t(position));
  // the top 27 bits of word 0 and the top 26 of word 1
  const uint64_t bits = (uint64_t(r.v[0] >> 5) << 26) | uint64_t(r.v[1] >> 6);
  return dmul_rn(double(bits), 0x1p-53);
}

// A logit's place in the walk as an unsigned key that increases as the logit decreases (-0 and
// +0 alike). NaN has no place: callers reject it first.
FOURBIT_HD uint32_t draw_key_high(float logit) {
  const uint32_t b = logit == 0.0f ? 0u : bits_of(logit);
  const uint32_t up = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // increases with the value
  return ~up;
}

// The whole walk key: increasing keys are the walk order, ties by increasing id.
FOURBIT_HD uint64_t draw_key(float logit, int32_t id) {
  return (uint64_t(draw_key_high(logit)) << 32) | uint64_t(uint32_t(id));
}

// 64: a kernel's one thread walks at most V/64 chunk sums and 64 tokens (96 at V = 2048, 69 at 260).
inline constexpr int64_t kDrawChunk = 64;

// p = e^((logit - max) / temperature), max the row's largest logit (finite), temperature > 0.
FOURBIT_HD double draw_weight(float logit, double max, double temperature) {
  return exp_hd(ddiv_rn(dsub_rn(double(logit), max), temperature));
}

// p[begin] + ... + p[end - 1], in order from 0: one chunk's sum, [begin, end) within one chunk.
FOURBIT_HD double draw_chunk_sum(const double* p, int64_t begin, int64_t end) {
  double s = 0.0;
  for (int64_t i = begin; i < end; ++i) s = dadd_rn(s, p[i]);
  return s;
}

namespace draw_detail {

struct Crossing {
  int64_t index;  // the first i < n with acc_i past the threshold, n if none
  double acc;     // acc_index, or acc_(n-1) if none
};

// chunk_sums[c]: draw_chunk_sum over chunk c of [0, keep) for some keep >= n; whole chunks are
// skipped by their sums, which are the values a token-by-token walk reaches at their ends.
FOURBIT_HD Crossing first_crossing(const double* p, const double* chunk_sums, int64_t n, double threshold,
                                   bool inclusive) {
  double before = 0.0;  // the sums of the chunks before c0, in order
  int64_t c0 = 0;
  for (; c0 + kDrawChunk <= n; c0 += kDrawChunk) {
    const double after = dadd_rn(before, chunk_sums[c0 / kDrawChunk]);
    if (inclusive ? after >= threshold : after > threshold) break;
    before = after;
  }
  const int64_t end = c0 + kDrawChunk < n ? c0 + kDrawChunk : n;
  double within = 0.0, acc = before;
  for (int64_t i = c0; i < end; ++i) {
    within = dadd_rn(within, p[i]);
    acc = dadd_rn(before, within);
    if (inclusive ? acc >= threshold : acc > threshold) return Crossing{i, acc};
  }
  return Crossing{n, acc};
}

}  // namespace draw_detail

struct DrawPick {
  int64_t index;   // in walk order
  double logprob;  // log of the probability it was drawn with
};

// Steps 3 and 4 above over the weights p[0, keep) in walk order (keep >= 1, p[0] = 1) and their
// chunk sums, for a uniform u in [0, 1) and top_p in (0, 1].
FOURBIT_HD DrawPick draw_pick(const double* p, const double* chunk_sums, int64_t keep, double top_p, double u) {
  const double inf = double_of(0x7ff0000000000000ull);
  double total = draw_detail::first_crossing(p, chunk_sums, keep, inf, false).acc;
  if (top_p < 1.0) {
    // found: top_p * total <= total, the sum through keep - 1
    const draw_detail::Crossing cut = draw_detail::first_crossing(p, chunk_sums, keep, dmul_rn(top_p, total), true);
    keep = cut.index + 1;
    total = cut.acc;
  }
  int64_t pick = draw_detail::first_crossing(p, chunk_sums, keep, dmul_rn(u, total), false).index;
  if (pick == keep)  // rounding left u * total at or past the last sum
    for (pick = keep - 1; pick > 0 && p[pick] == 0.0; --pick) {
    }
  return DrawPick{pick, log_hd(ddiv_rn(p[pick], total))};
}

}  // namespace fourbit::num
