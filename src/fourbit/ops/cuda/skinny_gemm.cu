// defines: skinny_f32_gemm
// FP32 GEMMs with one dimension of at most 32: the router's, whose E (16 experts in gpu-small)
// is its output width forward, its K in the input gradient and its M in the weight gradient.
// cuBLASLt runs these on SIMT tiles sized for square problems (sm80 ffma 128x32 and 32x64 in the
// bf16 step's profile: 40-50 us each for 8192 tokens x 1024 x 16, 5x what reading the operands
// takes); here each shape has its own kernel, FP32 FMAs in a fixed order, operands read 16 bytes
// at a time where aligned (the same values in the same order either way):
//  - N <= 32 (C = X W^T, forward): a warp per 4 (or 2) rows; lane l sums the k of 4-column groups
//    l, l + 32, ... in ascending order for every column, then the 32 lane sums are added by the
//    warp butterfly. An element's order depends on K alone: rows are batch invariant.
//  - K <= 32 (C = dY W, the input gradient): a thread per 4 columns holds W's K x 4 values and
//    sums k ascending for each row of its block: batch invariant too.
//  - M <= 32 with both operands stored K-major (C = dY^T X over the tokens, the weight gradient):
//    chunks of rows (a function of K only) summed in ascending row order per element, then the
//    chunk sums added in chunk order in double and rounded once. Deterministic; K runs over the
//    batch, so batch invariance does not apply (as for matmul_nt's reduce_over_batch).
// Accumulating: C + the sum, one float addition (the chunked form: in double, one rounding);
// a stored C is the bits of accumulating into zeros. No atomics.
#include <cstdint>

#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/matmul.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileK = 256;            // forward: K columns of W staged in shared memory at a time
constexpr int kRowsPerThreadBlock = 16;  // input gradient: rows a block takes
constexpr int64_t kChunkMinRows = 64;    // weight gradient: rows a chunk at least ...
constexpr int64_t kMaxChunks = 128;      // ... and at most this many chunks
constexpr int kStageRows = 64;         // weight gradient: A rows staged in shared memory at a time
constexpr int kMajorThreads = 128;     // weight gradient: threads a block, 4 columns each

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

// 4 floats at p[0..3] with j + c < n valid, as one float4 where VEC (p 16-byte aligned).
template <bool VEC>
__device__ __forceinline__ void load_cols(const float* p, int64_t j, int64_t n, float v[4]) {
  if (VEC && j + 3 < n) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = j + c < n ? p[c] : 0.0f;
  }
}
template <bool VEC>
__device__ __forceinline__ void store_cols(float* p, int64_t j, int64_t n, const float v[4]) {
  if (VEC && j + 3 < n) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (j + c < n) p[c] = v[c];
  }
}

// C[m, n] (+)= sum_k A[m, k] B[k, n] for K <= KB (B stored K-major): thread t of block (x, y)
// takes columns (x * 256 + t) * 4 .. + 3 and rows y * 16 .. + 15, with B's K x 4 values in
// registers; VEC: B's and C's rows 16-byte aligned.
template <int KB, bool VEC>
__global__ void __launch_bounds__(kThreads)
    small_k_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb,
                   float* __restrict__ C, int64_t ldc, int64_t M, int64_t N, int K, bool accumulate) {
  __shared__ float as[kRowsPerThreadBlock][KB];
  const int64_t n0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 4;
  const int64_t m0 = int64_t(blockIdx.y) * kRowsPerThreadBlock;
  for (int i = threadIdx.x; i < kRowsPerThreadBlock * KB; i += kThreads) {
    const int r = i / KB, k = i % KB;
    as[r][k] = m0 + r < M && k < K ? A[(m0 + r) * lda + k] : 0.0f;
  }
  float b[KB][4];
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    if (k < K && n0 < N) load_cols<VEC>(B + int64_t(k) * ldb + n0, n0, N, b[k]);
    else b[k][0] = b[k][1] = b[k][2] = b[k][3] = 0.0f;
  }
  __syncthreads();
  if (n0 >= N) return;
  const int rows = M - m0 < kRowsPerThreadBlock ? int(M - m0) : kRowsPerThreadBlock;
#pragma unroll 4
  for (int r = 0; r < rows; ++r) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < KB; ++k) {
      const float a = as[r][k];
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c] = fmaf(a, b[k][c], acc[c]);
    }
    float* out = C + (m0 + r) * ldc + n0;
    if (accumulate) {
      float old[4];
      load_cols<VEC>(out, n0, N, old);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c] = old[c] + acc[c];
    }
    store_cols<VEC>(out, n0, N, acc);
  }
}

// partial[chunk, m, n] = sum over the chunk's rows k (ascending) of A[k, m] B[k, n] for M <= MB
// (both stored K-major): thread t of block (x, y) takes columns (x * 128 + t) * 4 .. + 3 and
// chunk y, A's rows staged in shared memory; VEC: B's rows 16-byte aligned.
template <int MB, bool VEC>
__global__ void __launch_bounds__(kMajorThreads)
    k_major_partials_kernel(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb,
                            int64_t M, int64_t N, int64_t K, int64_t rows_per_chunk, float* __restrict__ partial) {
  __shared__ float as[kStageRows][MB];
  const int64_t n0 = (int64_t(blockIdx.x) * kMajorThreads + threadIdx.x) * 4;
  const int64_t chunk = blockIdx.y, k0 = chunk * rows_per_chunk;
  const int64_t k1 = k0 + rows_per_chunk < K ? k0 + rows_per_chunk : K;
  float acc[MB][4];
#pragma unroll
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
  for (int64_t s = k0; s < k1; s += kStageRows) {
    __syncthreads();
    for (int i = threadIdx.x; i < kStageRows * MB; i += kMajorThreads) {
      const int r = i / MB, m = i % MB;
      as[r][m] = s + r < k1 && m < M ? A[(s + r) * lda + m] : 0.0f;
    }
    __syncthreads();
    if (n0 < N) {
      const int rows = int(k1 - s < kStageRows ? k1 - s : kStageRows);
#pragma unroll 8
      for (int r = 0; r < rows; ++r) {
        float b[4];
        load_cols<VEC>(B + (s + r) * ldb + n0, n0, N, b);
#pragma unroll
        for (int m = 0; m < MB; ++m)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[m][c] = fmaf(as[r][m], b[c], acc[m][c]);
      }
    }
  }
  if (n0 < N)
#pragma unroll
    for (int m = 0; m < MB; ++m)
      if (m < M) store_cols<false>(partial + (chunk * M + m) * N + n0, n0, N, acc[m]);
}

// C[m, n] (+)= the chunks' partials added in chunk order in double, rounded once.
__global__ void __launch_bounds__(kThreads)
    k_major_finish_kernel(const float* __restrict__ partial, int64_t chunks, int64_t M, int64_t N,
                          float* __restrict__ C, int64_t ldc, bool accumulate) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < M * N; i += int64_t(gridDim.x) * kThreads) {
    const int64_t m = i / N, n = i % N;
    double total = 0.0;
#pragma unroll 8
    for (int64_t c = 0; c < chunks; ++c) total += double(partial[c * M * N + i]);
    float* out = C + m * ldc + n;
    *out = accumulate ? float(double(*out) + total) : float(total);
  }
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
    if (N <= 16) {
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
  if (!a.trans && b.trans && K <= 32) {
    const dim3 grid(unsigned((N + 4 * kThreads - 1) / (4 * kThreads)),
                    unsigned((M + kRowsPerThreadBlock - 1) / kRowsPerThreadBlock));
    if (grid.y > 65535u) return false;  // over a million rows: cuBLASLt
    const bool vec = aligned(B, b.ld) && aligned(c, ldc);
    if (K <= 16) {
      if (vec) small_k_kernel<16, true><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, N, int(K), accumulate);
      else small_k_kernel<16, false><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, N, int(K), accumulate);
    } else {
      if (vec) small_k_kernel<32, true><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, N, int(K), accumulate);
      else small_k_kernel<32, false><<<grid, kThreads, 0, stream()>>>(A, a.ld, B, b.ld, c, ldc, M, N, int(K), accumulate);
    }
    FOURBIT_LAUNCH_CHECK();
    return true;
  }
  if (a.trans && b.trans && M <= 32) {
    // the chunking is a function of K alone: a given problem always sums in the same order
    int64_t rows_per_chunk = (K + kMaxChunks - 1) / kMaxChunks;
    if (rows_per_chunk < kChunkMinRows) rows_per_chunk = kChunkMinRows;
    const int64_t chunks = (K + rows_per_chunk - 1) / rows_per_chunk;
    Tensor partial = Tensor::empty({chunks * M * N}, DType::F32, Device::CUDA);
    const dim3 grid(unsigned((N + 4 * kMajorThreads - 1) / (4 * kMajorThreads)), unsigned(chunks));
    const bool vec = aligned(B, b.ld);
    float* p = partial.data<float>();
    if (M <= 16) {
      if (vec) k_major_partials_kernel<16, true><<<grid, kMajorThreads, 0, stream()>>>(A, a.ld, B, b.ld, M, N, K, rows_per_chunk, p);
      else k_major_partials_kernel<16, false><<<grid, kMajorThreads, 0, stream()>>>(A, a.ld, B, b.ld, M, N, K, rows_per_chunk, p);
    } else {
      if (vec) k_major_partials_kernel<32, true><<<grid, kMajorThreads, 0, stream()>>>(A, a.ld, B, b.ld, M, N, K, rows_per_chunk, p);
      else k_major_partials_kernel<32, false><<<grid, kMajorThreads, 0, stream()>>>(A, a.ld, B, b.ld, M, N, K, rows_per_chunk, p);
    }
    FOURBIT_LAUNCH_CHECK();
    k_major_finish_kernel<<<grid_for(M * N, kThreads), kThreads, 0, stream()>>>(p, chunks, M, N, c, ldc, accumulate);
    FOURBIT_LAUNCH_CHECK();
    return true;
  }
  return false;
}

}  // namespace fourbit::ops::cuda
