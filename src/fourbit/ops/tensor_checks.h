// defines: expect_dims_on, expect_like_on, expect_index_on
// Argument checks shared by both backends' layer ops, so a shape error reads the same on either
// ("rmsnorm_forward: w must be f32[D]=[64] cpu, got f32[32] cpu"). Each backend's checks header
// binds the device (cpu/checks.h, cuda/checks.cuh).
#pragma once
#include <string>

#include "fourbit/tensor/tensor.h"

namespace fourbit::ops {

// Exactly dtype `dt` and shape `shape` on `dev`; `sym` is the symbolic shape ("[D]").
inline void expect_dims_on(Device dev, const char* op, const char* name, const Tensor& t, DType dt,
                           const Shape& shape, const char* sym) {
  if (!t.defined())
    fail("{}: {} must be {}{}={} {}, got an undefined tensor", op, name, dtype_name(dt), sym,
         shape_str(shape), device_name(dev));
  if (t.device() != dev || t.dtype() != dt || t.shape() != shape)
    fail("{}: {} must be {}{}={} {}, got {}", op, name, dtype_name(dt), sym, shape_str(shape),
         device_name(dev), t.str());
}

// Same dtype and shape as `ref` (named `ref_name`).
inline void expect_like_on(Device dev, const char* op, const char* name, const Tensor& t,
                           const char* ref_name, const Tensor& ref) {
  const std::string sym = std::string("[like ") + ref_name + "]";
  expect_dims_on(dev, op, name, t, ref.dtype(), ref.shape(), sym.c_str());
}

}  // namespace fourbit::ops
