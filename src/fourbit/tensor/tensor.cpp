// defines: Tensor (tensor.h)
#include "fourbit/tensor/tensor.h"

#include <cstdlib>
#include <cstring>

#include "fourbit/tensor/device_memory.h"

namespace fourbit {

class Storage {
 public:
  Storage(size_t bytes, Device dev) : bytes_(bytes), dev_(dev) {
    const size_t n = bytes ? bytes : 1;
    if (dev == Device::CPU) {
      ptr_ = std::aligned_alloc(64, (n + 63) / 64 * 64);
      if (!ptr_) fail("out of host memory allocating {} bytes", bytes);
    } else {
      ptr_ = device_alloc(n);
    }
  }
  ~Storage() {
    if (dev_ == Device::CPU) std::free(ptr_);
    else device_free(ptr_, bytes_ ? bytes_ : 1);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  Device dev_;
};

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::U8: return "u8";
    case DType::I8: return "i8";
    case DType::U16: return "u16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U32: return "u32";
    case DType::F64: return "f64";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    if (d < 0) fail("negative dimension in shape {}", shape_str(shape));
  Tensor t;
  t.storage_ = std::make_shared<Storage>(size_t(shape_numel(shape) * dtype_size(dtype)), device);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::from_host(const void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  copy_bytes(t.raw(), device, data, Device::CPU, size_t(t.nbytes()));
  return t;
}

void* Tensor::raw() const {
  FOURBIT_CHECK(storage_, "use of an undefined tensor");
  return static_cast<char*>(storage_->ptr()) + offset_bytes_;
}

Tensor Tensor::view(int64_t offset_elems, const Shape& shape) const {
  FOURBIT_CHECK(storage_, "view of an undefined tensor");
  const int64_t off = offset_bytes_ + offset_elems * dtype_size(dtype_);
  const int64_t end = off + shape_numel(shape) * dtype_size(dtype_);
  FOURBIT_CHECK(offset_elems >= 0 && end <= int64_t(storage_->bytes()),
                "view {} at offset {} exceeds storage of {} bytes", shape_str(shape), offset_elems,
                storage_->bytes());
  Tensor t = *this;
  t.offset_bytes_ = off;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  FOURBIT_CHECK(dim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
                "slice_rows({}, {}) of {}", begin, end, shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  return view(begin * (numel() / (shape_[0] ? shape_[0] : 1)), s);
}

Tensor Tensor::to(Device d) const {
  Tensor t = empty(shape_, dtype_, d);
  copy_bytes(t.raw(), d, raw(), device_, size_t(nbytes()));
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  FOURBIT_CHECK(src.numel() == numel() && src.dtype() == dtype_, "copy_from {} into {}",
                src.str(), str());
  copy_bytes(raw(), device_, src.raw(), src.device(), size_t(nbytes()));
}

void Tensor::zero_() { zero_bytes(raw(), device_, size_t(nbytes())); }

std::string Tensor::str() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " " + device_name(device_);
}

}  // namespace fourbit
