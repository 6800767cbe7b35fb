// defines: cpu::expect_float, cpu::expect_dims, cpu::expect_like, cpu::expect_index,
//          cpu::expect_out, cpu::f32_stand_in, cpu::with_float
// Argument checks shared by the CPU layer ops, so every op fails with the same kind of message
// ("rmsnorm_forward: w must be f32[D]=[64] cpu, got f32[32] cpu"), and the F32/F64 dispatch.
// Checks run before any OpenMP region: an exception must never leave a parallel region.
#pragma once
#include <string>

#include "fourbit/ops/tensor_checks.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops::cpu {

// A defined CPU tensor of dtype F32 or F64 with `ndim` dimensions; `sym` names them ("[N, D]").
inline DType expect_float(const char* op, const char* name, const Tensor& t, int64_t ndim,
                          const char* sym) {
  if (!t.defined()) fail("{}: {} {} is undefined", op, name, sym);
  if (t.device() != Device::CPU || (t.dtype() != DType::F32 && t.dtype() != DType::F64) ||
      t.dim() != ndim)
    fail("{}: {} must be a {}-D f32 or f64 cpu tensor {}, got {}", op, name, ndim, sym, t.str());
  return t.dtype();
}

inline void expect_dims(const char* op, const char* name, const Tensor& t, DType dt,
                        const Shape& shape, const char* sym) {
  expect_dims_on(Device::CPU, op, name, t, dt, shape, sym);
}
inline void expect_like(const char* op, const char* name, const Tensor& t, const char* ref_name,
                        const Tensor& ref) {
  expect_like_on(Device::CPU, op, name, t, ref_name, ref);
}

// An output of the inputs' dtype `dt`, or BF16 for F32 inputs (ops.h "BF16 outputs"); returns its dtype.
inline DType expect_out(const char* op, const char* name, const Tensor& t, DType dt, const Shape& shape,
                        const char* sym) {
  return expect_out_on(Device::CPU, op, name, t, dt, shape, sym);
}

// The reference computes a BF16 output as its F32 result converted (cpu::convert): `out` itself
// when it is F32, otherwise a new F32 tensor of its shape, to be converted into it afterwards.
inline Tensor f32_stand_in(const Tensor& out) {
  return out.dtype() == DType::BF16 ? Tensor::empty(out.shape(), DType::F32, Device::CPU) : out;
}

// An I32 index tensor of shape `shape`.
inline void expect_index(const char* op, const char* name, const Tensor& t, const Shape& shape,
                         const char* sym) {
  expect_dims(op, name, t, DType::I32, shape, sym);
}

// Calls f(T{}) with T = float or double for a dtype already checked by expect_float.
template <typename F>
void with_float(DType dt, F&& f) {
  if (dt == DType::F64) f(double{});
  else f(float{});
}

}  // namespace fourbit::ops::cpu
