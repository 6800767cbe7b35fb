// defines: cuda_built, cuda_device_count, device_alloc, device_free, copy_bytes, zero_bytes,
//          device_synchronize, device_bytes_in_use, device_peak_bytes
// The only door from tensor/ to a GPU. With CUDA built, device_memory_cuda.cu implements these
// with a caching allocator on the default stream; without it, device_memory_none.cpp answers
// "no GPU" and every device request fails with a clear message.
#pragma once
#include <cstddef>

#include "fourbit/tensor/tensor.h"

namespace fourbit {

bool cuda_built();            // compiled with the CUDA backend
int cuda_device_count();      // 0 when not built or no device is visible
void* device_alloc(size_t bytes);
void device_free(void* p, size_t bytes);
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
void zero_bytes(void* p, Device dev, size_t bytes);
void device_synchronize();
// Bytes of GPU tensors alive now, and the most alive at once since the last reset.
int64_t device_bytes_in_use();
int64_t device_peak_bytes(bool reset = false);

}  // namespace fourbit
