// defines: the CPU backend's entry points; ops.cpp dispatches here for CPU tensors.
#pragma once
#include "fourbit/ops/ops.h"

namespace fourbit::ops::cpu {

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report);
Tensor dequantize(const QTensor& q, bool undo_hadamard);
QTensor requantize_transposed(const QTensor& q, RngKey rng);

}  // namespace fourbit::ops::cpu
