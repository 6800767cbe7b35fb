// defines: cuda::expect_f32, cuda::expect_dims, cuda::expect_like, cuda::expect_out, cuda::expect_index,
//          cuda::aligned16, cuda::aligned8, cuda::out_aligned, cuda::with_out_type
// Argument checks of the CUDA layer ops. They mirror ops/cpu/checks.h (same wording, so a shape
// error reads the same on either backend), but that header insists on CPU tensors and allows F64;
// the GPU backend takes CUDA tensors and runs F32 only, and says so in the message.
#pragma once
#include <cstdint>
#include <string>

#include "fourbit/ops/tensor_checks.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops::cuda {

// A defined CUDA F32 tensor with `ndim` dimensions; `sym` names them ("[N, D]").
inline void expect_f32(const char* op, const char* name, const Tensor& t, int64_t ndim,
                       const char* sym) {
  if (!t.defined()) fail("{}: {} {} is undefined", op, name, sym);
  if (t.device() != Device::CUDA || t.dtype() != DType::F32 || t.dim() != ndim)
    fail("{}: {} must be a {}-D f32 cuda tensor {} (the GPU backend runs f32 only), got {}", op,
         name, ndim, sym, t.str());
}

inline void expect_dims(const char* op, const char* name, const Tensor& t, DType dt,
                        const Shape& shape, const char* sym) {
  expect_dims_on(Device::CUDA, op, name, t, dt, shape, sym);
}
inline void expect_like(const char* op, const char* name, const Tensor& t, const char* ref_name,
                        const Tensor& ref) {
  expect_like_on(Device::CUDA, op, name, t, ref_name, ref);
}

// An output that is F32 or BF16 (ops.h "BF16 outputs") of shape `shape`; returns its dtype.
inline DType expect_out(const char* op, const char* name, const Tensor& t, const Shape& shape, const char* sym) {
  return expect_out_on(Device::CUDA, op, name, t, DType::F32, shape, sym);
}

// An I32 index tensor of shape `shape` on the GPU.
inline void expect_index(const char* op, const char* name, const Tensor& t, const Shape& shape,
                         const char* sym) {
  expect_dims(op, name, t, DType::I32, shape, sym);
}

// float4 / 16-byte accesses need 16-byte aligned addresses; a view into a larger tensor may not be.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// The same for an output of four BF16 values a group (vec4.cuh's 8-byte store).
inline bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }
// A group's store is vectorisable: 16-byte aligned for F32 outputs, 8-byte for BF16 ones.
inline bool out_aligned(const Tensor& t) { return t.dtype() == DType::BF16 ? aligned8(t.raw()) : aligned16(t.raw()); }
// f(float{}) or f(uint16_t{}) for an F32 or BF16 output: the element type of the kernel to launch.
template <typename F>
void with_out_type(DType dt, F&& f) {
  if (dt == DType::BF16) f(uint16_t{});
  else f(float{});
}

}  // namespace fourbit::ops::cuda
