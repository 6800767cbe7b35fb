// defines: check_sampling_options, sampling_uniform, draw_token (sampling.h)
#include "fourbit/rl/sampling.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <vector>

#include "fourbit/numerics/draw.h"
#include "fourbit/tensor/error.h"

namespace fourbit::rl {

void check_sampling_options(const SamplingOptions& o, int64_t vocab) {
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    fail("sampling: temperature must be a finite value >= 0 (0 = greedy), got {}", o.temperature);
  if (o.top_k < 0) fail("sampling: top_k must be >= 0 (0 = all tokens), got {}", o.top_k);
  if (!(o.top_p > 0 && o.top_p <= 1)) fail("sampling: top_p must be in (0, 1] (1 = all tokens), got {}", o.top_p);
  if (o.max_new < 0) fail("sampling: max_new must be >= 0, got {}", o.max_new);
  if (o.stop_token < -1 || o.stop_token >= vocab)
    fail("sampling: stop_token must be -1 (none) or a token id below the vocabulary size {}, got {}", vocab,
         o.stop_token);
}

double sampling_uniform(uint64_t seed, uint64_t step, uint64_t sequence_id, int64_t position) {
  return num::draw_uniform(seed, step, sequence_id, position);
}

TokenDraw draw_token(std::span<const float> logits, const SamplingOptions& o, uint64_t sequence_id,
                     int64_t position) {
  const int64_t V = int64_t(logits.size());
  if (V == 0) fail("sampling: empty logits row");
  for (int64_t v = 0; v < V; ++v)
    if (std::isnan(logits[size_t(v)]))
      fail("sampling: the logits of sequence {} at position {} hold NaN (token {})", sequence_id, position, v);
  if (o.temperature == 0) {
    // max_element returns the first maximum: ties go to the lowest id
    const int32_t t = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    return TokenDraw{t, 0.0};
  }
  // The walk order (numerics/draw.h). The sampler draws every row of a batch on the host between
  // two decode steps while the GPU waits, so this is a radix sort (2.4x a comparison sort at
  // V = 260): the keys' high halves in four stable 8-bit passes from ids in order, so equal logits
  // keep id order.
  std::vector<uint64_t> keys(static_cast<size_t>(V)), spare(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) keys[size_t(v)] = num::draw_key(logits[size_t(v)], int32_t(v));
  for (int shift = 32; shift < 64; shift += 8) {
    std::array<uint32_t, 257> start{};  // start[d + 1]: keys with digit d, then running sums
    for (const uint64_t k : keys) ++start[((k >> shift) & 0xff) + 1];
    for (size_t d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (const uint64_t k : keys) spare[start[(k >> shift) & 0xff]++] = k;
    keys.swap(spare);
  }
  const auto token = [&](int64_t i) { return int32_t(uint32_t(keys[size_t(i)])); };
  const double max = double(logits[size_t(token(0))]);
  if (!std::isfinite(max)) fail("sampling: every logit of sequence {} at position {} is -inf", sequence_id, position);
  const int64_t keep = o.top_k > 0 ? std::min<int64_t>(o.top_k, V) : V;
  std::vector<double> p(static_cast<size_t>(keep));
  for (int64_t i = 0; i < keep; ++i) p[size_t(i)] = num::draw_weight(logits[size_t(token(i))], max, o.temperature);
  std::vector<double> chunk_sums;
  for (int64_t c = 0; c < keep; c += num::kDrawChunk)
    chunk_sums.push_back(num::draw_chunk_sum(p.data(), c, std::min(c + num::kDrawChunk, keep)));
  const double u = sampling_uniform(o.seed, o.step, sequence_id, position);
  const num::DrawPick pick = num::draw_pick(p.data(), chunk_sums.data(), keep, o.top_p, u);
  return TokenDraw{token(pick.index), pick.logprob};
}

}  // namespace fourbit::rl
