// defines: skinny_matmul_f32
// FP32 GEMMs with one dimension of at most 32: a MoE router's, whose experts are the output
// columns of the forward (logits = X Wr^T, N = experts), the reduction of the input gradient
// (dX += dL Wr, K = experts) and the output rows of the weight gradient (dWr += dL^T X, M =
// experts). cuBLASLt's FP32 kernels tile them like square GEMMs and reach a fifth of the memory
// bandwidth these are bound by; here each is one pass over its large operand.
//
// Every output is one FP32 sum in a fixed order: the forward's is a sequence per lane over
// K / 128 float4 steps followed by a fixed butterfly over the 32 lanes; the input gradient's runs over
// k in order; the weight gradient's runs over k in order within chunks of kChunk tokens, then
// over the chunks in order. The first two depend on a row alone (batch invariant, as matmul_nt's
// fixed cuBLASLt kernels are); the third reduces over the tokens, where invariance does not apply.
#include <cuda_runtime.h>

#include <cstdint>

#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/matmul.cuh"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 128;  // weight gradient: tokens per partial sum

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// C[m, n] (+)= sum_k A[m, k] B[n, k] for N <= NB: one warp per RPW rows, lane l taking the float4s
// l, l + 32, ... of a row (coalesced) and every column's partial for its rows; then the lanes'
// partials added by an XOR butterfly, column n's sum taken from lane n (a fixed tree).
template <int NB, int RPW>
__global__ void __launch_bounds__(kThreads) narrow_n_kernel(const float* __restrict__ a, int64_t lda,
                                                            const float* __restrict__ b, int64_t ldb,
                                                            float* __restrict__ c, int64_t ldc, int64_t M, int N,
                                                            int64_t K, bool accumulate) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t m0 = (int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32) * RPW;
  if (m0 >= M) return;
  float acc[RPW][NB];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) acc[r][n] = 0.0f;
  for (int64_t k = 4 * int64_t(lane); k < K; k += 128) {
    float4 x[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
      x[r] = m0 + r < M ? *reinterpret_cast<const float4*>(a + (m0 + r) * lda + k) : make_float4(0, 0, 0, 0);
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      if (n >= N) break;
      const float4 w = *reinterpret_cast<const float4*>(b + int64_t(n) * ldb + k);
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        float s = acc[r][n];
        s = fmaf(x[r].x, w.x, s);
        s = fmaf(x[r].y, w.y, s);
        s = fmaf(x[r].z, w.z, s);
        s = fmaf(x[r].w, w.w, s);
        acc[r][n] = s;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      float s = acc[r][n];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (n < N && lane == n && m0 + r < M) {
        float* out = c + (m0 + r) * ldc + n;
        *out = accumulate ? *out + s : s;
      }
    }
}

// C[m, n..n+3] (+)= sum_{k < K} A[m, k] B_t[k, n..n+3] for K <= 32 (B stored [K, N]): one thread
// per four columns of a row, k in order.
__global__ void __launch_bounds__(kThreads) narrow_k_kernel(const float* __restrict__ a, int64_t lda,
                                                            const float* __restrict__ bt, int64_t ldb,
                                                            float* __restrict__ c, int64_t ldc, int64_t M,
                                                            int64_t N, int K, bool accumulate) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x, q = N / 4;
  if (i >= M * q) return;
  const int64_t m = i / q, n = (i % q) * 4;
  float4 s = make_float4(0, 0, 0, 0);
  const float* ar = a + m * lda;
  for (int k = 0; k < K; ++k) {
    const float x = ar[k];
    const float4 w = *reinterpret_cast<const float4*>(bt + int64_t(k) * ldb + n);
    s.x = fmaf(x, w.x, s.x);
    s.y = fmaf(x, w.y, s.y);
    s.z = fmaf(x, w.z, s.z);
    s.w = fmaf(x, w.w, s.w);
  }
  float4* out = reinterpret_cast<float4*>(c + m * ldc + n);
  if (accumulate) {
    const float4 o = *out;
    s = make_float4(o.x + s.x, o.y + s.y, o.z + s.z, o.w + s.w);
  }
  *out = s;
}

// partial[chunk][m][n..n+3] = sum over the chunk's tokens k (in order) of A_t[k, m] B_t[k, n..n+3]
// for M <= MB (A_t stored [K, M], B_t [K, N]): a CTA per (chunk, kThreads * 4 columns), the
// chunk's A_t rows staged in shared memory.
template <int MB>
__global__ void __launch_bounds__(kThreads) narrow_m_partials_kernel(const float* __restrict__ at, int64_t lda,
                                                                     const float* __restrict__ bt, int64_t ldb,
                                                                     int M, int64_t N, int64_t K,
                                                                     float* __restrict__ partial) {
  __shared__ float as[kChunk][MB];
  const int64_t chunk = blockIdx.y, k0 = chunk * kChunk;
  const int kn = int(K - k0 < kChunk ? K - k0 : kChunk);
  for (int i = int(threadIdx.x); i < kChunk * MB; i += kThreads) {
    const int k = i / MB, m = i % MB;
    as[k][m] = k < kn && m < M ? at[(k0 + k) * lda + m] : 0.0f;
  }
  __syncthreads();
  const int64_t n = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 4;
  if (n >= N) return;
  float4 acc[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) acc[m] = make_float4(0, 0, 0, 0);
  for (int k = 0; k < kn; ++k) {
    const float4 w = *reinterpret_cast<const float4*>(bt + (k0 + k) * ldb + n);
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      const float x = as[k][m];
      acc[m].x = fmaf(x, w.x, acc[m].x);
      acc[m].y = fmaf(x, w.y, acc[m].y);
      acc[m].z = fmaf(x, w.z, acc[m].z);
      acc[m].w = fmaf(x, w.w, acc[m].w);
    }
  }
#pragma unroll
  for (int m = 0; m < MB; ++m)
    if (m < M) *reinterpret_cast<float4*>(partial + (chunk * M + m) * N + n) = acc[m];
}

// C[m, n] (+)= the chunks' partials of (m, n) added in chunk order.
__global__ void __launch_bounds__(kThreads) narrow_m_finish_kernel(const float* __restrict__ partial,
                                                                   int64_t chunks, int64_t M, int64_t N,
                                                                   float* __restrict__ c, int64_t ldc,
                                                                   bool accumulate) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= M * N) return;
  const int64_t m = i / N, n = i % N;
  float s = 0.0f;
  for (int64_t ch = 0; ch < chunks; ++ch) s += partial[(ch * M + m) * N + n];
  float* out = c + m * ldc + n;
  *out = accumulate ? *out + s : s;
}

unsigned blocks(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

}  // namespace

bool skinny_matmul_f32(const MatmulOperand& a, const MatmulOperand& b, float* c, int64_t ldc, int64_t M, int64_t N,
                       int64_t K, float beta) {
  if (M <= 0 || N <= 0 || K <= 0 || (beta != 0.0f && beta != 1.0f)) return false;
  const bool acc = beta == 1.0f;
  const float* pa = static_cast<const float*>(a.ptr);
  const float* pb = static_cast<const float*>(b.ptr);
  const bool vec_a = aligned16(pa) && a.ld % 4 == 0, vec_b = aligned16(pb) && b.ld % 4 == 0;
  if (!a.trans && !b.trans && N <= 32 && K >= 256 && K % 4 == 0 && vec_a && vec_b) {  // the forward
    const int64_t warps = (M + 3) / 4;
    if (N <= 8)
      narrow_n_kernel<8, 4><<<blocks(warps * 32), kThreads, 0, stream()>>>(pa, a.ld, pb, b.ld, c, ldc, M, int(N), K, acc);
    else if (N <= 16)
      narrow_n_kernel<16, 4><<<blocks(warps * 32), kThreads, 0, stream()>>>(pa, a.ld, pb, b.ld, c, ldc, M, int(N), K, acc);
    else
      narrow_n_kernel<32, 2><<<blocks((M + 1) / 2 * 32), kThreads, 0, stream()>>>(pa, a.ld, pb, b.ld, c, ldc, M, int(N), K,
                                                                                 acc);
    FOURBIT_LAUNCH_CHECK();
    return true;
  }
  if (!a.trans && b.trans && K <= 32 && N >= 256 && N % 4 == 0 && vec_b && aligned16(c) && ldc % 4 == 0) {
    narrow_k_kernel<<<blocks(M * (N / 4)), kThreads, 0, stream()>>>(pa, a.ld, pb, b.ld, c, ldc, M, N, int(K), acc);
    FOURBIT_LAUNCH_CHECK();
    return true;
  }
  if (a.trans && b.trans && M <= 32 && K >= 1024 && N % 4 == 0 && vec_b) {  // the weight gradient
    const int64_t chunks = (K + kChunk - 1) / kChunk;
    if (chunks > 65535) return false;
    Tensor partial = Tensor::empty({chunks * M * N}, DType::F32, Device::CUDA);
    const dim3 grid(blocks(N / 4), unsigned(chunks));
    if (M <= 16)
      narrow_m_partials_kernel<16><<<grid, kThreads, 0, stream()>>>(pa, a.ld, pb, b.ld, int(M), N, K,
                                                                   partial.data<float>());
    else
      narrow_m_partials_kernel<32><<<grid, kThreads, 0, stream()>>>(pa, a.ld, pb, b.ld, int(M), N, K,
                                                                   partial.data<float>());
    FOURBIT_LAUNCH_CHECK();
    narrow_m_finish_kernel<<<blocks(M * N), kThreads, 0, stream()>>>(partial.data<float>(), chunks, M, N, c, ldc, acc);
    FOURBIT_LAUNCH_CHECK();
    return true;
  }
  return false;
}

}  // namespace fourbit::ops::cuda
