// defines: QuantShape, quant_shape, alloc_qtensor, requantize_transposed_spec
// The shape bookkeeping shared by the CPU and CUDA quantizers: how a logical [S,] R x C input
// maps to a QTensor's storage, and the allocation of its three buffers.
#pragma once
#include "fourbit/numerics/formats.h"
#include "fourbit/tensor/qtensor.h"

namespace fourbit::ops {

struct QuantShape {
  int64_t slices, rows, cols;  // logical
};

// Validates x (F32, 2-D or 3-D, spec is a block format) and returns its logical dimensions.
QuantShape quant_shape(const Tensor& x, const QuantSpec& spec);

// A QTensor for spec over logical [S,] R x C, buffers allocated on `device`, contents undefined.
QTensor alloc_qtensor(const QuantSpec& spec, const QuantShape& s, Device device);

// The output spec of requantize_transposed for q (which must be NVFP4): MXFP8 E4M3 with RCEIL
// scales and stochastic rounding, blocks along q's other axis.
QuantSpec requantize_transposed_spec(const QTensor& q);

}  // namespace fourbit::ops
