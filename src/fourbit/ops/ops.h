// defines: RngKey, QuantReport, quantize, dequantize, requantize_transposed
// Every operator fourbit runs, declared once. A call dispatches on the device of its tensors to
// ops/cpu/ or ops/cuda/, which implement the same functions with the same numerics (the
// quantizers bit for bit; GEMMs and reductions within documented tolerances).
#pragma once
#include <cstdint>

#include "fourbit/numerics/formats.h"
#include "fourbit/tensor/qtensor.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops {

// Where stochastic rounding draws its bits: random_bits(seed, stream, storage element index).
struct RngKey {
  uint64_t seed = 0;
  uint64_t stream = 0;
};

// Counts a quantizer can report. Non-finite inputs are never silently mapped: they are counted
// here and in the process-wide sticky flag (nonfinite_seen), which the trainer checks each step.
struct QuantReport {
  int64_t values = 0;
  int64_t nonfinite = 0;
  int64_t blocks = 0;
  int64_t blocks_chose_four = 0;  // Four Over Six picked the 1.5x scale
};

// ---- quantization (NUMERICS.md; layouts in docs/numerics.md) ----------------------------------
// x: F32 [R, C] or [S, R, C] (S slices, e.g. experts). Blocks run along C for BlockAxis::Row and
// along R for BlockAxis::Col (stored transposed). Sizes that are not a multiple of the block are
// padded with zeros (code 0) to a whole block.
QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng = {},
                 QuantReport* report = nullptr);

// Exact dequantization to F32 in the logical shape; undo_hadamard applies the inverse RHT
// for QTensors quantized behind one (otherwise the values stay in the rotated basis, which is
// what a GEMM of two rotated operands wants).
Tensor dequantize(const QTensor& q, bool undo_hadamard = true);

// NVFP4 -> exact dequantize -> transpose -> MXFP8 E4M3 (RCEIL, elementwise SR). The result is the
// same logical tensor quantized along the other axis: blocks now run along the old rows.
QTensor requantize_transposed(const QTensor& q, RngKey rng);

// Sticky flag raised by any quantizer that met NaN/Inf; read-and-clear.
bool nonfinite_seen(bool clear = true);

}  // namespace fourbit::ops
