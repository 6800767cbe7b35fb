// defines: DType, Device, dtype_size, dtype_name, Tensor
// A dense row-major tensor on the CPU or a CUDA device. Storage is shared (views of the flat
// parameter buffer share it); a Tensor is always contiguous, a view is an offset plus a shape.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "fourbit/tensor/error.h"

namespace fourbit {

enum class DType : uint8_t { F32, BF16, U8, I8, U16, I32, I64, U32, F64 };
enum class Device : uint8_t { CPU, CUDA };

constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::U8: return 1;
    case DType::I8: return 1;
    case DType::U16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U32: return 4;
    case DType::F64: return 8;
  }
  return 0;
}
const char* dtype_name(DType t);
const char* device_name(Device d);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Storage;

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::CPU);
  // Copies host data of numel() elements into a new tensor on `device`.
  static Tensor from_host(const void* data, const Shape& shape, DType dtype,
                          Device device = Device::CPU);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int64_t numel() const { return shape_numel(shape_); }
  int64_t nbytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_cuda() const { return device_ == Device::CUDA; }

  void* raw() const;
  template <typename T>
  T* data() const { return static_cast<T*>(raw()); }

  // A view of `shape` starting `offset_elems` elements into this tensor (same storage).
  Tensor view(int64_t offset_elems, const Shape& shape) const;
  Tensor reshape(const Shape& shape) const { return view(0, shape); }
  // Rows [begin, end) of the leading dimension.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // Whether both are views of one storage (one allocation, or one flat buffer's).
  bool shares_storage(const Tensor& other) const { return storage_ != nullptr && storage_ == other.storage_; }

  Tensor to(Device d) const;            // a copy on d (a copy even when already there)
  Tensor clone() const { return to(device_); }
  void copy_from(const Tensor& src);    // same numel and dtype; any devices
  void zero_();

  std::string str() const;              // "f32[4, 8] cpu"

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

}  // namespace fourbit
