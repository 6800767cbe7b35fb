// defines: the device_memory.h functions for builds without CUDA.
#include <cstring>

#include "fourbit/tensor/device_memory.h"

namespace fourbit {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void* device_alloc(size_t) { fail("this fourbit was built without CUDA: no GPU tensors"); }
void device_free(void*, size_t) {}
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (dst_dev != Device::CPU || src_dev != Device::CPU)
    fail("this fourbit was built without CUDA: no GPU tensors");
  if (bytes) std::memcpy(dst, src, bytes);
}
void copy_bytes_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Device dev) {
  if (dev != Device::CPU) fail("this fourbit was built without CUDA: no GPU tensors");
  for (size_t r = 0; r < height; ++r)
    std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
}
void zero_bytes(void* p, Device dev, size_t bytes) {
  if (dev != Device::CPU) fail("this fourbit was built without CUDA: no GPU tensors");
  if (bytes) std::memset(p, 0, bytes);
}
std::shared_ptr<PendingRead> read_later(const void*, size_t) {
  fail("this fourbit was built without CUDA: no GPU tensors");
}
void device_synchronize() {}
void lanes_begin(int) {}
void lanes_use(int) {}
void lanes_end() {}
bool lanes_open() { return false; }
int current_lane() { return -1; }
void* current_stream() { return nullptr; }
GraphCapture::GraphCapture(const DeviceGraph*) { fail("this fourbit was built without CUDA: no CUDA graphs"); }
GraphCapture::~GraphCapture() = default;
std::unique_ptr<DeviceGraph> GraphCapture::finish(const std::vector<Tensor>&) {
  fail("this fourbit was built without CUDA: no CUDA graphs");
}
bool graph_capturing() { return false; }
int64_t device_bytes_in_use() { return 0; }
int64_t device_peak_bytes(bool) { return 0; }

}  // namespace fourbit
