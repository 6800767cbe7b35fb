// defines: the CUDA backend's entry points (same signatures and semantics as ops.h, CUDA tensors),
//          take_nonfinite_flag, native_block_scaled_gemm
// Plain C++ (no CUDA syntax): ops.cpp, compiled by the host compiler, includes it. Kernels run on
// the default stream; results that the host reads (losses, counts) synchronise.
#pragma once
#include "fourbit/ops/ops.h"

namespace fourbit::ops::cuda {

#include "fourbit/ops/backend_ops.inc"  // NOLINT(bugprone-suspicious-include)

// The device-side sticky flag the quantize kernels raise on NaN/Inf input (synchronises).
bool take_nonfinite_flag(bool clear);

// Whether this GPU multiplies NVFP4/MXFP8 operands natively (block-scaled tensor cores, sm_100+).
bool native_block_scaled_gemm();

}  // namespace fourbit::ops::cuda
