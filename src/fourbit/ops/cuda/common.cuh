// defines: FOURBIT_CUDA_CHECK, FOURBIT_LAUNCH_CHECK, FOURBIT_CUBLAS_CHECK, device_attribute,
//          device_sm_count, grid_for, stream, cublas_handle, cublaslt_handle, check_cuda_tensor
// What every CUDA source of the backend needs: error checks that name the call and the file,
// launch sizing, the stream to launch on, and the process-wide cuBLAS handles.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"
#include "fourbit/tensor/tensor.h"

#define FOURBIT_CUDA_CHECK(call)                                                               \
  do {                                                                                         \
    const cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess)                                                                   \
      ::fourbit::fail("{}:{}: {} failed: {}", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
  } while (0)

// After a kernel launch: catches bad launch configurations immediately (cheap, no sync).
#define FOURBIT_LAUNCH_CHECK() FOURBIT_CUDA_CHECK(cudaGetLastError())

#define FOURBIT_CUBLAS_CHECK(call)                                                             \
  do {                                                                                         \
    const cublasStatus_t st_ = (call);                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      ::fourbit::fail("{}:{}: {} failed: {}", __FILE__, __LINE__, #call, cublasGetStatusString(st_)); \
  } while (0)

namespace fourbit::ops::cuda {

// An attribute of the current device (a hardware fact, not a constant), queried once per device
// and attribute.
template <cudaDeviceAttr kAttr>
inline int device_attribute() {
  static std::atomic<int> cached[64];
  int dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  std::atomic<int>& c = cached[dev & 63];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    FOURBIT_CUDA_CHECK(cudaDeviceGetAttribute(&n, kAttr, dev));
    c.store(n, std::memory_order_relaxed);
  }
  return n;
}

// Streaming multiprocessors of the current device.
inline int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

// Blocks for a grid-stride kernel over work_items: one per threads_per_block items, at most
// max_blocks (by default 32 per SM of the device; a grid-stride loop gives the same results for
// any grid).
inline unsigned grid_for(int64_t work_items, int threads_per_block, int64_t max_blocks = 0) {
  if (max_blocks <= 0) max_blocks = int64_t(device_sm_count()) * 32;
  int64_t blocks = (work_items + threads_per_block - 1) / threads_per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return unsigned(blocks);
}

// Every kernel, cuBLASLt call and async copy goes to this stream: the default stream, or the
// current lane's while GPU lanes are open (device_memory.h, ops::Lanes).
inline cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }

cublasHandle_t cublas_handle();
cublasLtHandle_t cublaslt_handle();
void* cublas_workspace(size_t* bytes);  // a device buffer for cuBLASLt (one per lane)

inline void check_cuda_tensor(const Tensor& t, const char* op, const char* name) {
  if (t.device() != Device::CUDA) fail("{}: {} must be a CUDA tensor, got {}", op, name, t.str());
}

}  // namespace fourbit::ops::cuda
