// defines: skinny_f32_gemm, skinny_f32_wgrad, cuda::rmsnorm_input_wgrad, cuda::set_skinny_wgrad
// FP32 GEMMs C = A B^T with at most 32 output columns and both operands K-major: the router's
// forward (logits = X W^T, E = 16 experts in gpu-small). cuBLASLt runs it on a SIMT tile sized for
// square problems (sm80 ffma 128x32: 49 us for 8192 tokens x 1024 x 16 in the bf16 step's profile,
// 26 us here). A warp takes 4 rows (2 where N > 16); lane l sums the k of 4-column groups
// l, l + 32, ... in ascending order for every column (FP32 FMAs; A read 16 bytes at a time where
// aligned, the same values in the same order either way), then the 32 lane sums are added by the
// warp butterfly: an element's order depends on K alone, so rows are batch invariant.
// Accumulating: C + the sum, one float addition; a stored C is the bits of accumulating into
// zeros. Up to 256 rows (decode) a warp computes one element (cols_kernel), with the same bits.
// The router's weight gradient (M = E rows, K over the tokens): skinny_f32_wgrad, below. Its
// input gradient (K = E) stays on cuBLASLt: a kernel of this kind for it (session 31) was no
// faster.
#include <atomic>
#include <cstdint>

#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/matmul.cuh"
#include "fourbit/ops/cuda/row_math.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileK = 256;            // forward: K columns of W staged in shared memory at a time

__device__ __forceinline__ float warp_sum_f(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// C[m, n] (+)= sum_k A[m, k] B[n, k] for N <= NB: warp w of block b takes rows
// (b * 8 + w) * ROWS .. + ROWS - 1; lane l the k of 4-column groups l, l + 32, ... (one float4
// of each row at a time where A's rows are 16-byte aligned: VEC).
template <int NB, int ROWS, bool VEC>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb,
                float* __restrict__ C, int64_t ldc, int64_t M, int N, int64_t K, bool accumulate) {
  __shared__ __align__(16) float bs[NB][kTileK];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t m0 = (int64_t(blockIdx.x) * (kThreads / 32) + warp) * ROWS;
  float acc[ROWS][NB];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) acc[r][n] = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    __syncthreads();
    for (int i = threadIdx.x; i < NB * kTileK; i += kThreads) {
      const int n = i / kTileK, kk = i % kTileK;
      bs[n][kk] = n < N && k0 + kk < K ? B[int64_t(n) * ldb + k0 + kk] : 0.0f;
    }
    __syncthreads();
    const int64_t kend = K - k0 < kTileK ? K - k0 : kTileK;
#pragma unroll
    for (int g = 0; g < kTileK / 128; ++g) {
      const int kk = 4 * (lane + 32 * g);
      if (kk >= kend) break;
      float a[ROWS][4];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float* ar = A + (m0 + r) * lda + k0 + kk;
        if (m0 + r >= M) {
          a[r][0] = a[r][1] = a[r][2] = a[r][3] = 0.0f;
        } else if (VEC && kk + 3 < kend) {
          const float4 q = *reinterpret_cast<const float4*>(ar);
          a[r][0] = q.x, a[r][1] = q.y, a[r][2] = q.z, a[r][3] = q.w;
        } else {
#pragma unroll
          for (int c = 0; c < 4; ++c) a[r][c] = kk + c < kend ? ar[c] : 0.0f;
        }
      }
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        const float4 b = *reinterpret_cast<const float4*>(&bs[n][kk]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          acc[r][n] = fmaf(a[r][0], b.x, acc[r][n]);
          acc[r][n] = fmaf(a[r][1], b.y, acc[r][n]);
          acc[r][n] = fmaf(a[r][2], b.z, acc[r][n]);
          acc[r][n] = fmaf(a[r][3], b.w, acc[r][n]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      const float v = warp_sum_f(acc[r][n]);
      if (lane == n && n < N && m0 + r < M) {
        float* out = C + (m0 + r) * ldc + n;
        *out = accumulate ? *out + v : v;
      }
    }
  }
}

// The same elements for few rows (the sampler's decode: one to a few hundred tokens, where
// rows_kernel's 32 rows a block leave all but a few SMs idle while each block reads all of B through
// shared memory, 18 us a call at one row on the H200): a warp per output element (m, n), reading A's
// row m and B's row n straight from global memory. Lane l takes the k that rows_kernel's lane l
// takes, the FMAs in the same order on the same values (zeros past K, as rows_kernel's staged B), and
// the warp adds the 32 sums by the same butterfly (every lane ends with the same sum; lane n stores
// it, as there): each element gets rows_kernel's bits. VEC: A and B read 16 bytes at a time (the
// same values).
template <bool VEC>
__global__ void __launch_bounds__(kThreads)
    cols_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb,
                float* __restrict__ C, int64_t ldc, int64_t M, int N, int64_t K, bool accumulate) {
  dependent_launch_prologue();
  const int lane = threadIdx.x % 32;
  const int64_t e = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (e >= M * N) return;  // the warp's element: all its lanes leave together
  const int64_t m = e / N;
  const int n = int(e % N);
  const float* ar = A + m * lda;
  const float* br = B + int64_t(n) * ldb;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    const int64_t kend = K - k0 < kTileK ? K - k0 : kTileK;
#pragma unroll
    for (int g = 0; g < kTileK / 128; ++g) {
      const int kk = 4 * (lane + 32 * g);
      if (kk >= kend) break;
      float a[4], b[4];
      if (VEC && kk + 3 < kend) {
        const float4 qa = *reinterpret_cast<const float4*>(ar + k0 + kk);
        const float4 qb = *reinterpret_cast<const float4*>(br + k0 + kk);
        a[0] = qa.x, a[1] = qa.y, a[2] = qa.z, a[3] = qa.w;
        b[0] = qb.x, b[1] = qb.y, b[2] = qb.z, b[3] = qb.w;
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          a[c] = kk + c < kend ? ar[k0 + kk + c] : 0.0f;
          b[c] = kk + c < kend ? br[k0 + kk + c] : 0.0f;
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) acc = fmaf(a[c], b[c], acc);
    }
  }
  const float v = warp_sum_f(acc);
  if (lane == n) {
    float* out = C + m * ldc + n;
    *out = accumulate ? *out + v : v;
  }
}

// Up to this many rows, cols_kernel (a warp an element); above, rows_kernel.
constexpr int64_t kColsMaxRows = 256;

// ---- the weight gradient: C[m, n] (+)= sum_k A[k, m] B[k, n], M <= 32, both stored K-row-major ---
// The router's dW = dlogits^T X over the tokens (M = E experts, N = d_model, K = tokens). cuBLASLt
// runs it as a SIMT tile with a split-K pass (47 + 5 us a layer in an H100 step for 8192 tokens x
// 1024 x 16), where reading X once at the copy rate takes ~11. Two launches: CTA (x, y) sums the K
// rows of chunk y (kWgradChunk rows) for 1024 columns, each thread 4 columns and all M rows, FMAs
// in ascending k, into a partial [chunk][M][N]; then a thread an element adds the chunks' partials
// in chunk order and stores (or adds to C once). The chunks are fixed by K, not by the device, so
// the bits are the same on any GPU and in every run; a weight gradient has no rows to keep batch
// invariant. On an H100 (session 56, train_bench --router-wgrad both, one process) they took
// 0.54-0.77 ms off a gpu-small step of bf16 and mxfp8 (with rmsnorm_input_wgrad's norm pass gone).
constexpr int kWgradChunk = 64;
constexpr int kWgradCols = 4 * kThreads;  // columns a CTA covers
constexpr int64_t kWgradMinK = 256;       // below: cuBLASLt (a split over few chunks gains nothing)

// NORM: B's element (k, n) is rmsnorm_value(x[k, n], rs[k], wn[n]), RMSNorm's output computed as
// rmsnorm_forward computes it (row_math.cuh), from its input x (the B pointer), its stored rstd
// and its weight: the bits of the norm's output read from memory.
template <int MB, bool VEC, bool NORM>
__global__ void __launch_bounds__(kThreads)
    wgrad_partials_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb,
                          const float* __restrict__ rs, const float* __restrict__ wn, float* __restrict__ P, int64_t M,
                          int64_t N, int64_t K) {
  __shared__ float as[kWgradChunk][MB];
  __shared__ float rss[kWgradChunk];
  const int64_t k0 = int64_t(blockIdx.y) * kWgradChunk;
  const int kn = int(K - k0 < kWgradChunk ? K - k0 : kWgradChunk);
  for (int i = int(threadIdx.x); i < kWgradChunk * MB; i += kThreads) {
    const int kk = i / MB, m = i % MB;
    as[kk][m] = kk < kn && m < M ? A[(k0 + kk) * lda + m] : 0.0f;
  }
  if (NORM && int(threadIdx.x) < kWgradChunk) rss[threadIdx.x] = int(threadIdx.x) < kn ? rs[k0 + threadIdx.x] : 0.0f;
  __syncthreads();
  const int64_t n0 = int64_t(blockIdx.x) * kWgradCols + 4 * int64_t(threadIdx.x);
  if (n0 >= N) return;
  const bool whole = n0 + 3 < N;
  float wv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (NORM)
#pragma unroll
    for (int c = 0; c < 4; ++c) wv[c] = n0 + c < N ? wn[n0 + c] : 0.0f;
  auto load = [&](int kk, float (&b)[4]) {
    const float* br = B + (k0 + kk) * ldb + n0;
    if (VEC && whole) {
      const float4 q = *reinterpret_cast<const float4*>(br);
      b[0] = q.x, b[1] = q.y, b[2] = q.z, b[3] = q.w;
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) b[c] = n0 + c < N ? br[c] : 0.0f;
    }
  };
  auto value = [&](int kk, float (&b)[4]) {  // B's values from what load() read
    if (NORM)
#pragma unroll
      for (int c = 0; c < 4; ++c) b[c] = rmsnorm_value(b[c], rss[kk], wv[c]);
  };
  float acc[MB][4];
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;
  auto fma_row = [&](int kk, const float (&b)[4]) {
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      const float a = as[kk][m];
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][c] = fmaf(a, b[c], acc[m][c]);
    }
  };
  // G rows' loads issued before their FMAs, so that G loads a thread are in flight at once
  constexpr int G = MB <= 16 ? 8 : 4;
  int kk = 0;
  for (; kk + G <= kn; kk += G) {
    float b[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) load(kk + g, b[g]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      value(kk + g, b[g]);
      fma_row(kk + g, b[g]);
    }
  }
  for (; kk < kn; ++kk) {
    float b[4];
    load(kk, b);
    value(kk, b);
    fma_row(kk, b);
  }
  float* pc = P + int64_t(blockIdx.y) * M * N + n0;
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    if (m >= M) break;
    if (VEC && whole) {
      *reinterpret_cast<float4*>(pc + m * N) = make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (n0 + c < N) pc[m * N + c] = acc[m][c];
    }
  }
}

// C[m, n] = the chunks' partials of element (m, n) added in chunk order (+ C's value, accumulating).
__global__ void __launch_bounds__(kThreads)
    wgrad_reduce_kernel(const float* __restrict__ P, int64_t chunks, float* __restrict__ C, int64_t ldc, int64_t M,
                        int64_t N, bool accumulate) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= M * N) return;
  const int64_t m = i / N, n = i % N;
  float s = P[i];
#pragma unroll 8
  for (int64_t p = 1; p < chunks; ++p) s += P[p * M * N + i];
  float* out = C + m * ldc + n;
  *out = accumulate ? *out + s : s;
}

// The two launches for C (+)= A^T B over K rows (A stored [K, M], B [K, N]); with rs and wn, B's
// values are RMSNorm's outputs of the rows B holds (NORM above).
void launch_wgrad(const float* A, int64_t lda, const float* B, int64_t ldb, const float* rs, const float* wn,
                  float* c, int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate) {
  const int64_t chunks = (K + kWgradChunk - 1) / kWgradChunk, col_blocks = (N + kWgradCols - 1) / kWgradCols;
  Tensor partials = Tensor::empty({chunks * M * N}, DType::F32, Device::CUDA);
  float* P = partials.data<float>();
  const bool vec = reinterpret_cast<uintptr_t>(B) % 16 == 0 && ldb % 4 == 0 && N % 4 == 0;
  const dim3 grid{unsigned(col_blocks), unsigned(chunks), 1u};
  const auto go = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream()>>>(A, lda, B, ldb, rs, wn, P, M, N, K);
  };
  if (rs) {
    if (M <= 16) vec ? go(wgrad_partials_kernel<16, true, true>) : go(wgrad_partials_kernel<16, false, true>);
    else vec ? go(wgrad_partials_kernel<32, true, true>) : go(wgrad_partials_kernel<32, false, true>);
  } else {
    if (M <= 16) vec ? go(wgrad_partials_kernel<16, true, false>) : go(wgrad_partials_kernel<16, false, false>);
    else vec ? go(wgrad_partials_kernel<32, true, false>) : go(wgrad_partials_kernel<32, false, false>);
  }
  FOURBIT_LAUNCH_CHECK();
  wgrad_reduce_kernel<<<unsigned((M * N + kThreads - 1) / kThreads), kThreads, 0, stream()>>>(P, chunks, c, ldc, M, N,
                                                                                              accumulate);
  FOURBIT_LAUNCH_CHECK();
}

std::atomic<bool> g_skinny_wgrad{true};

bool wgrad_fits(int64_t M, int64_t N, int64_t K) {
  return g_skinny_wgrad.load(std::memory_order_relaxed) && M > 0 && M <= 32 && N > 0 && K >= kWgradMinK &&
         (K + kWgradChunk - 1) / kWgradChunk <= 65535 && (N + kWgradCols - 1) / kWgradCols <= INT32_MAX;
}
}  // namespace

bool skinny_f32_gemm(const MatmulOperand& a, const MatmulOperand& b, float* c, int64_t ldc, int64_t M,
                     int64_t N, int64_t K, bool accumulate) {
  if (M <= 0 || N <= 0 || K <= 0) return false;
  const auto* A = static_cast<const float*>(a.ptr);
  const auto* B = static_cast<const float*>(b.ptr);
  const auto aligned = [](const void* p, int64_t ld) { return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 4 == 0; };
  if (!a.trans && !b.trans && N <= 32) {
    const bool vec = aligned(A, a.ld);
    if (M <= kColsMaxRows) {
      const unsigned grid = unsigned((M * N + kThreads / 32 - 1) / (kThreads / 32));
      if (vec && aligned(B, b.ld))
        launch_dependent(cols_kernel<true>, grid, kThreads, 0, A, a.ld, B, b.ld, c, ldc, M, int(N), K, accumulate);
      else
        launch_dependent(cols_kernel<false>, grid, kThreads, 0, A, a.ld, B, b.ld, c, ldc, M, int(N), K, accumulate);
    } else if (N <= 16) {
      constexpr int kRows = 4;
      const unsigned grid = unsigned((M + 8 * kRows - 1) / (8 * kRows));
      if (vec) rows_kernel<16, kRows, true><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, int(N), K, accumulate);
      else rows_kernel<16, kRows, false><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, int(N), K, accumulate);
    } else {
      constexpr int kRows = 2;
      const unsigned grid = unsigned((M + 8 * kRows - 1) / (8 * kRows));
      if (vec) rows_kernel<32, kRows, true><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, int(N), K, accumulate);
      else rows_kernel<32, kRows, false><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, int(N), K, accumulate);
    }
    FOURBIT_LAUNCH_CHECK();
    return true;
  }
  return false;
}

bool set_skinny_wgrad(bool on) { return g_skinny_wgrad.exchange(on, std::memory_order_relaxed); }

bool skinny_f32_wgrad(const MatmulOperand& a, const MatmulOperand& b, float* c, int64_t ldc, int64_t M,
                      int64_t N, int64_t K, bool accumulate) {
  if (!a.trans || !b.trans || !wgrad_fits(M, N, K)) return false;
  launch_wgrad(static_cast<const float*>(a.ptr), a.ld, static_cast<const float*>(b.ptr), b.ld, nullptr, nullptr, c, ldc,
               M, N, K, accumulate);
  return true;
}

bool rmsnorm_input_wgrad(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dw,
                         bool accumulate) {
  // (shapes, dtypes and devices checked by ops::rmsnorm_input_wgrad)
  if (x.dtype() != DType::F32) return false;
  const int64_t K = x.size(0), N = x.size(1), M = dy.size(1);
  if (!wgrad_fits(M, N, K)) return false;
  launch_wgrad(dy.data<float>(), M, x.data<float>(), N, rstd.data<float>(), w.data<float>(), dw.data<float>(), N, M, N,
               K, accumulate);
  return true;
}

}  // namespace fourbit::ops::cuda
