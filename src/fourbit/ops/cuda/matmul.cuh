// defines: matmul_nt, skinny_f32_gemm, skinny_f32_wgrad
// The one cuBLASLt entry point of the backend (gemm.cu, attention.cu). Row-major operands in the
// NT form the rest of fourbit uses: C[b][m, n] = alpha * sum_k A[b](m, k) B[b](n, k) + beta * C[b].
//
// Batch invariance (DESIGN "Exactness"): the algorithm is chosen once per (N, K, batch-free
// layout, types) from the heuristic for a fixed reference M and a fixed reference batch count,
// with split-K forced off, and then used for every M and batch count. A C element is then
// reduced in the same order whatever the number of rows or sequences, so a row's bits do not
// depend on what else is in the batch.
#pragma once
#include <cublasLt.h>

#include <cstdint>

namespace fourbit::ops::cuda {

struct MatmulOperand {
  const void* ptr = nullptr;
  bool trans = false;   // false: row-major [rows, K] (ld >= K); true: row-major [K, rows] (ld >= rows)
  int64_t ld = 0;       // leading dimension in elements (row stride)
  int64_t batch_stride = 0;  // elements between batch entries
};

// ab_type: CUDA_R_16BF or CUDA_R_32F (both operands the same); C is CUDA_R_32F, row-major
// [M, N] with row stride ldc. beta = 0 or 1. reduce_over_batch: K runs over the batch (a weight
// gradient, C = dY^T X over the tokens), so no output row belongs to one sequence and batch
// invariance does not apply: the algorithm is the heuristic's for this M, split-K allowed
// (deterministic either way). A transposed, unbatched A implies it.
void matmul_nt(const MatmulOperand& a, const MatmulOperand& b, void* c, int64_t ldc,
               int64_t c_batch_stride, int64_t M, int64_t N, int64_t K, int batch,
               cudaDataType_t ab_type, float alpha, float beta, bool reduce_over_batch = false);

// C (+)= A B^T for FP32 operands (matmul_nt's layouts, one batch entry) with N <= 32 and both
// operands K-major (skinny_gemm.cu: the router's forward); false, nothing done, otherwise.
bool skinny_f32_gemm(const MatmulOperand& a, const MatmulOperand& b, float* c, int64_t ldc, int64_t M,
                     int64_t N, int64_t K, bool accumulate);

// C (+)= A B^T for FP32 operands with M <= 32, both transposed (stored [K, M] and [K, N]) and K at
// least 256: a weight gradient over the tokens such as the router's dlogits^T X (skinny_gemm.cu);
// false, nothing done, otherwise.
bool skinny_f32_wgrad(const MatmulOperand& a, const MatmulOperand& b, float* c, int64_t ldc, int64_t M,
                      int64_t N, int64_t K, bool accumulate);

}  // namespace fourbit::ops::cuda
