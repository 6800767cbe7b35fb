// TEMPORARY (build scaffolding): compiled only while ops/cuda/quantize.cu does not exist, so CUDA
// builds link while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cuda/cuda_ops.h"
namespace fourbit::ops::cuda {
QTensor quantize(const Tensor&, const QuantSpec&, RngKey, QuantReport*) { fail("cuda quantize: not implemented yet"); }
Tensor dequantize(const QTensor&, bool) { fail("cuda dequantize: not implemented yet"); }
QTensor requantize_transposed(const QTensor&, RngKey) { fail("cuda requantize_transposed: not implemented yet"); }
bool take_nonfinite_flag(bool) { fail("cuda take_nonfinite_flag: not implemented yet"); }
}  // namespace fourbit::ops::cuda
