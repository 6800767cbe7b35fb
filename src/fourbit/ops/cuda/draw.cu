// defines: cuda::draw_tokens (ops.h)
// One block a row of logits, held in shared memory (kGpuDrawMaxVocab at most). The draw is
// numerics/draw.h's, so the tokens and log-prob bits are the CPU's:
//   - the walk order: each token's rank is the number of walk keys below its own (the keys are
//     distinct, ids breaking ties, so the order depends on nothing else), found by every thread
//     counting for its tokens against all keys (broadcast reads of shared memory);
//   - the weights in walk order in parallel, each chunk of kDrawChunk summed in order by one
//     thread, then one thread runs draw_pick over the chunk sums and one chunk;
//   - greedy: the first largest logit, by a block reduction that keeps the lower id among equals.
#include <cstdint>

#include "fourbit/numerics/draw.h"
#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kDrawThreads = 256;
constexpr int kMaxV = int(kGpuDrawMaxVocab);
constexpr int kPerThread = kMaxV / kDrawThreads;  // tokens a thread ranks
constexpr int kMaxChunks = int((kGpuDrawMaxVocab + num::kDrawChunk - 1) / num::kDrawChunk);

// (value, id) a is before b in a greedy argmax's order: larger, or equal (-0 == +0) and a lower id.
__device__ __forceinline__ bool greedy_before(float av, int ai, float bv, int bi) {
  return bv < av || (!(av < bv) && ai < bi);
}

__global__ void __launch_bounds__(kDrawThreads)
    draw_tokens_kernel(const float* __restrict__ logits, int V, DrawSpec spec, const int64_t* __restrict__ keys,
                       int32_t* __restrict__ tokens, double* __restrict__ logprobs, int32_t* __restrict__ status) {
  dependent_launch_prologue();
  __shared__ float x[kMaxV];
  __shared__ __align__(8) unsigned char key_or_p[kMaxV * 8];  // walk keys, then the weights in walk order
  __shared__ int order[kMaxV];
  __shared__ double chunk_sums[kMaxChunks];
  __shared__ float best_v[kDrawThreads];
  __shared__ int best_i[kDrawThreads];
  __shared__ int first_nan;
  const int row = int(blockIdx.x), t = int(threadIdx.x);
  const float* lx = logits + int64_t(row) * V;
  if (t == 0) first_nan = V;
  __syncthreads();
  for (int v = t; v < V; v += kDrawThreads) {
    const float l = lx[v];
    x[v] = l;
    if (l != l) atomicMin(&first_nan, v);
  }
  __syncthreads();
  if (first_nan < V) {  // the same for every thread
    if (t == 0) tokens[row] = 0, logprobs[row] = 0.0, status[row] = first_nan;
    return;
  }
  if (spec.temperature == 0.0) {
    float bv = x[t < V ? t : 0];
    int bi = t < V ? t : 0;
    for (int v = t + kDrawThreads; v < V; v += kDrawThreads)
      if (greedy_before(x[v], v, bv, bi)) bv = x[v], bi = v;
    best_v[t] = bv, best_i[t] = bi;
    __syncthreads();
    for (int half = kDrawThreads / 2; half > 0; half /= 2) {
      if (t < half && greedy_before(best_v[t + half], best_i[t + half], best_v[t], best_i[t]))
        best_v[t] = best_v[t + half], best_i[t] = best_i[t + half];
      __syncthreads();
    }
    if (t == 0) tokens[row] = best_i[0], logprobs[row] = 0.0, status[row] = kDrawOk;
    return;
  }
  uint64_t* key = reinterpret_cast<uint64_t*>(key_or_p);
  for (int v = t; v < V; v += kDrawThreads) key[v] = num::draw_key(x[v], v);
  __syncthreads();
  {
    uint64_t mine[kPerThread];
    int below[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int v = t + j * kDrawThreads;
      mine[j] = v < V ? key[v] : 0;
      below[j] = 0;
    }
    for (int u = 0; u < V; ++u) {
      const uint64_t k = key[u];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) below[j] += k < mine[j];
    }
    __syncthreads();  // every key read before the weights overwrite them
#pragma unroll
    for (int j = 0; j < kPerThread; ++j)
      if (t + j * kDrawThreads < V) order[below[j]] = t + j * kDrawThreads;
  }
  __syncthreads();
  const float top = x[order[0]];
  if (!num::is_finite_bits(top)) {  // the same for every thread
    if (t == 0) tokens[row] = 0, logprobs[row] = 0.0, status[row] = kDrawAllNegInf;
    return;
  }
  const double max = double(top);
  const int keep = spec.top_k > 0 && spec.top_k < V ? int(spec.top_k) : V;
  double* p = reinterpret_cast<double*>(key_or_p);
  for (int i = t; i < keep; i += kDrawThreads) p[i] = num::draw_weight(x[order[i]], max, spec.temperature);
  __syncthreads();
  const int chunks = int((keep + num::kDrawChunk - 1) / num::kDrawChunk);
  if (t < chunks) {
    const int64_t c0 = int64_t(t) * num::kDrawChunk;
    chunk_sums[t] = num::draw_chunk_sum(p, c0, c0 + num::kDrawChunk < keep ? c0 + num::kDrawChunk : keep);
  }
  __syncthreads();
  if (t == 0) {
    const double u = num::draw_uniform(spec.seed, spec.step, uint64_t(keys[2 * row]), keys[2 * row + 1]);
    const num::DrawPick pick = num::draw_pick(p, chunk_sums, keep, spec.top_p, u);
    tokens[row] = order[pick.index], logprobs[row] = pick.logprob, status[row] = kDrawOk;
  }
}

}  // namespace

void draw_tokens(const Tensor& logits, const DrawSpec& spec, const Tensor& keys, Tensor& tokens, Tensor& logprobs,
                 Tensor& status) {
  const char* op = "draw_tokens";
  const int64_t V = expect_draw_args(Device::CUDA, op, logits, spec, keys, tokens, logprobs, status);
  if (V > kGpuDrawMaxVocab)
    fail("{}: the GPU draws rows of at most {} logits (one block a row, the row in shared memory), got V = {}; "
         "draw on the CPU",
         op, kGpuDrawMaxVocab, V);
  const int64_t A = logits.size(0);
  if (A == 0) return;
  if (A > 0x7fffffff) fail("{}: {} rows exceed the grid", op, A);
  launch_dependent(draw_tokens_kernel, unsigned(A), kDrawThreads, 0, logits.data<float>(), int(V), spec,
                   keys.data<int64_t>(), tokens.data<int32_t>(), logprobs.data<double>(), status.data<int32_t>());
}

}  // namespace fourbit::ops::cuda
