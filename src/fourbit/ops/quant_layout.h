// defines: QuantShape, quant_shape, qtensor_layout, alloc_qtensor, requantize_transposed_spec, cublaslt_scale_offset
// The shape bookkeeping shared by the CPU and CUDA quantizers: how a logical [S,] R x C input
// maps to a QTensor's storage, and the allocation of its three buffers.
#pragma once
#include "fourbit/numerics/formats.h"
#include "fourbit/tensor/qtensor.h"

namespace fourbit::ops {

struct QuantShape {
  int64_t slices, rows, cols;  // logical
};

// Validates x (F32, 2-D or 3-D) and spec (the registry's validate) and returns x's logical
// dimensions.
QuantShape quant_shape(const Tensor& x, const QuantSpec& spec);

// The layout fields of spec's QTensor over logical [S,] R x C, no buffers.
QTensor qtensor_layout(const QuantSpec& spec, const QuantShape& s);
// A QTensor for spec over logical [S,] R x C, buffers allocated on `device`, contents undefined.
QTensor alloc_qtensor(const QuantSpec& spec, const QuantShape& s, Device device);
// Whether quantizing to spec keeps each storage row's amax (QTensor::row_amax): NVFP4 with
// per-row scales along rows, no rotation, and no caller's group amax (the rows' own amaxes are
// then what the scales come from).
inline bool keeps_row_amax(const QuantSpec& spec, bool group_amax) {
  return spec.fmt == Format::NVFP4 && spec.outer == OuterScale::PerRow && spec.axis == BlockAxis::Row &&
         spec.hadamard == 0 && !group_amax;
}

// The output spec of requantize_transposed for q (which must be NVFP4): the recipe's target
// (MXFP8 E4M3 or E5M2 with RCEIL scales, SR or RNE, no RHT; anything else fails), with no outer
// scale and blocks along q's other axis.
QuantSpec requantize_transposed_spec(const QTensor& q, const QuantSpec& target);

// Where cuBLASLt's native block-scaled GEMMs (Blackwell: VEC16_UE4M3, VEC32_UE8M0) read the scale
// of row r, block column c of an operand: the rows x blocks scale matrix is cut into 128 x 4
// tiles of 512 bytes, stored tile row by tile row (col_tiles tiles each); inside a tile, row r
// starts at (r % 32) * 16 + (r % 128 / 32) * 4 and holds its four block columns (cuBLAS
// documentation, "1D block scaling factors layout"). Padding rows/columns hold scale 0.
FOURBIT_HD constexpr int64_t cublaslt_scale_offset(int64_t r, int64_t c, int64_t col_tiles) {
  return ((r / 128) * col_tiles + c / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4;
}

}  // namespace fourbit::ops
