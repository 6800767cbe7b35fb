// defines: the CPU backend's entry points (same signatures and semantics as ops.h, CPU tensors).
// ops.cpp dispatches here; the CUDA backend declares the same set in ops/cuda/cuda_ops.h.
#pragma once
#include "fourbit/ops/ops.h"

namespace fourbit::ops::cpu {

#include "fourbit/ops/backend_ops.inc"  // NOLINT(bugprone-suspicious-include)

}  // namespace fourbit::ops::cpu
