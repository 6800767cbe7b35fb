// defines: cuda::launch_rmsnorm_rows_quantized, cuda::launch_swiglu_rows_quantized
// The CUDA backend's producers with a quantized output (ops.h "Quantized outputs"), as layers.cu
// launches them once it has checked the arguments: fused_rows.cu has the kernels. Plain C++.
#pragma once
#include <cstdint>

#include "fourbit/tensor/qtensor.h"

namespace fourbit::ops::cuda {

// rmsnorm_forward_kernel's rows (F32 y, optional BF16 copy yb; b and sum for add_rmsnorm_forward,
// else null), each row then quantized under spec into q (allocated for y's shape). Every row
// pointer 16-byte aligned, D a multiple of 4, row_quant_fused(spec, D).
void launch_rmsnorm_rows_quantized(const float* x, const float* w, double eps, float* y, float* rstd, int64_t N,
                                   int64_t D, uint16_t* yb, bool vec_b, const float* b, float* sum,
                                   const QuantSpec& spec, QTensor& q);
// swiglu_forward_fused's rows (h13 [rows, 2F] gate then up, a [rows, F] F32), each row of a then
// quantized under spec into q; the same conditions on F.
void launch_swiglu_rows_quantized(const float* h13, float* a, int64_t rows, int64_t F, const QuantSpec& spec,
                                  QTensor& q);

}  // namespace fourbit::ops::cuda
