// defines: cpu::draw_tokens (ops.h)
// The rows' draws are independent (each its own stream of uniforms), so they are spread over the
// cores, an even share of the rows each. Each thread's buffers are allocated before the parallel
// region: nothing inside it can throw.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "fourbit/numerics/draw.h"
#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/cpu/cpu_ops.h"

namespace fourbit::ops::cpu {
namespace {

struct RowBuffers {
  std::vector<uint64_t> keys, spare;
  std::vector<double> p, chunk_sums;
  explicit RowBuffers(int64_t V)
      : keys(size_t(V)), spare(size_t(V)), p(size_t(V)), chunk_sums(size_t((V + num::kDrawChunk - 1) / num::kDrawChunk)) {}
};

struct RowDraw {
  int32_t token = 0;
  double logprob = 0.0;
  int32_t status = kDrawOk;
};

RowDraw draw_row(const float* x, int64_t V, const DrawSpec& s, uint64_t sequence_id, int64_t position,
                 RowBuffers& b) {
  for (int64_t v = 0; v < V; ++v)
    if (std::isnan(x[v])) return RowDraw{0, 0.0, int32_t(v)};
  if (s.temperature == 0)  // max_element returns the first maximum: ties go to the lowest id
    return RowDraw{int32_t(std::max_element(x, x + V) - x), 0.0, kDrawOk};
  // The walk order (numerics/draw.h) by a radix sort (2.4x a comparison sort at V = 260): the
  // keys' high halves in four stable 8-bit passes from ids in order, so equal logits keep id order.
  uint64_t* keys = b.keys.data();
  uint64_t* spare = b.spare.data();
  for (int64_t v = 0; v < V; ++v) keys[v] = num::draw_key(x[v], int32_t(v));
  for (int shift = 32; shift < 64; shift += 8) {
    std::array<uint32_t, 257> start{};  // start[d + 1]: keys with digit d, then running sums
    for (int64_t v = 0; v < V; ++v) ++start[((keys[v] >> shift) & 0xff) + 1];
    for (size_t d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (int64_t v = 0; v < V; ++v) spare[start[(keys[v] >> shift) & 0xff]++] = keys[v];
    std::swap(keys, spare);
  }
  const auto token = [&](int64_t i) { return int32_t(uint32_t(keys[i])); };
  const double max = double(x[token(0)]);
  if (!std::isfinite(max)) return RowDraw{0, 0.0, kDrawAllNegInf};
  const int64_t keep = s.top_k > 0 ? std::min<int64_t>(s.top_k, V) : V;
  double* p = b.p.data();
  for (int64_t i = 0; i < keep; ++i) p[i] = num::draw_weight(x[token(i)], max, s.temperature);
  for (int64_t c = 0; c < keep; c += num::kDrawChunk)
    b.chunk_sums[size_t(c / num::kDrawChunk)] = num::draw_chunk_sum(p, c, std::min(c + num::kDrawChunk, keep));
  const double u = num::draw_uniform(s.seed, s.step, sequence_id, position);
  const num::DrawPick pick = num::draw_pick(p, b.chunk_sums.data(), keep, s.top_p, u);
  return RowDraw{token(pick.index), pick.logprob, kDrawOk};
}

}  // namespace

void draw_tokens(const Tensor& logits, const DrawSpec& spec, const Tensor& keys, Tensor& tokens, Tensor& logprobs,
                 Tensor& status) {
  const int64_t V = expect_draw_args(Device::CPU, "draw_tokens", logits, spec, keys, tokens, logprobs, status);
  const int64_t A = logits.size(0);
  if (A == 0) return;
  int threads = 1;
#ifdef _OPENMP
  threads = A >= 16 ? std::min<int>(omp_get_max_threads(), int(A)) : 1;
#endif
  std::vector<RowBuffers> buffers;
  buffers.reserve(size_t(threads));
  for (int t = 0; t < threads; ++t) buffers.emplace_back(V);
  const float* x = logits.data<float>();
  const int64_t* key = keys.data<int64_t>();
  int32_t* tok = tokens.data<int32_t>();
  double* lp = logprobs.data<double>();
  int32_t* st = status.data<int32_t>();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
#pragma omp for schedule(static)
    for (int64_t a = 0; a < A; ++a) {
      const RowDraw d = draw_row(x + a * V, V, spec, uint64_t(key[2 * a]), key[2 * a + 1], buffers[size_t(t)]);
      tok[a] = d.token;
      lp[a] = d.logprob;
      st[a] = d.status;
    }
  }
}

}  // namespace fourbit::ops::cpu
