// defines: check_sampling_options, sampling_uniform, draw_token (sampling.h)
#include "fourbit/rl/sampling.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cmath>
#include <vector>

#include "fourbit/numerics/philox.h"
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
  // splitmix64's finaliser folds each field in turn (as SrStreams::key does), after a tag no
  // SR stream starts from.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t stream = mix(0x53414D504C45ull /* "SAMPLE" */ ^ step);
  stream = mix(stream ^ sequence_id);
  const num::Philox4x32 r = num::random_bits4(seed, stream, uint64_t(position));
  // 53 bits: the top 27 of word 0 and the top 26 of word 1.
  const uint64_t bits = (uint64_t(r.v[0] >> 5) << 26) | uint64_t(r.v[1] >> 6);
  return double(bits) * 0x1p-53;
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
  // Tokens by decreasing logit, ties by increasing id: the order truncation and the draw walk.
  // The sampler draws every row of a batch on the host between two decode steps while the GPU
  // waits, so this is a radix sort (2.4x a comparison sort at V = 260): 64-bit keys whose high half
  // orders the logits' bits downwards (-0 taken as +0, which compares equal to it) and whose low
  // half is the id, sorted by the high half in four stable 8-bit passes from ids in order, so
  // equal logits keep id order.
  std::vector<uint64_t> keys(static_cast<size_t>(V)), spare(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) {
    const float l = logits[size_t(v)] == 0.0f ? 0.0f : logits[size_t(v)];
    const uint32_t b = std::bit_cast<uint32_t>(l);
    const uint32_t up = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // increases with the value
    keys[size_t(v)] = (uint64_t(~up) << 32) | uint64_t(uint32_t(v));
  }
  for (int shift = 32; shift < 64; shift += 8) {
    std::array<uint32_t, 257> start{};  // start[d + 1]: keys with digit d, then running sums
    for (const uint64_t k : keys) ++start[((k >> shift) & 0xff) + 1];
    for (size_t d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (const uint64_t k : keys) spare[start[(k >> shift) & 0xff]++] = k;
    keys.swap(spare);
  }
  std::vector<int32_t> order(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) order[size_t(i)] = int32_t(uint32_t(keys[size_t(i)]));
  const double max = double(logits[size_t(order[0])]);
  if (!std::isfinite(max)) fail("sampling: every logit of sequence {} at position {} is -inf", sequence_id, position);
  size_t keep = o.top_k > 0 ? size_t(std::min<int64_t>(o.top_k, V)) : size_t(V);
  std::vector<double> p(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((double(logits[size_t(order[i])]) - max) / o.temperature);
    total += p[i];
  }
  if (o.top_p < 1) {
    double cum = 0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += p[i];
      if (cum >= o.top_p * total) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    total = 0;
    for (size_t i = 0; i < keep; ++i) total += p[i];
  }
  // Inverse CDF in the walk order; rounding can leave the target past the last sum, which then
  // takes the last kept token with non-zero probability.
  const double target = sampling_uniform(o.seed, o.step, sequence_id, position) * total;
  double acc = 0;
  size_t pick = keep;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (acc > target) {
      pick = i;
      break;
    }
  }
  if (pick == keep)
    for (pick = keep - 1; pick > 0 && p[pick] == 0; --pick) {
    }
  return TokenDraw{order[pick], std::log(p[pick] / total)};
}

}  // namespace fourbit::rl
