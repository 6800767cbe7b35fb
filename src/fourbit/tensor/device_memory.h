// defines: cuda_built, cuda_device_count, device_alloc, device_free, copy_bytes, copy_bytes_2d, zero_bytes,
//          PendingRead, read_later, device_synchronize, device_bytes_in_use, device_peak_bytes, lanes_begin, lanes_use,
//          lanes_end, lanes_open, current_lane, current_stream, DeviceGraph, GraphCapture, graph_capturing
// The only door from tensor/ to a GPU. With CUDA built, device_memory_cuda.cu implements these
// with a caching allocator and the GPU streams; without it, device_memory_none.cpp answers
// "no GPU" and every device request fails with a clear message (the lane calls do nothing).
#pragma once
#include <cstddef>
#include <memory>
#include <vector>

#include "fourbit/tensor/tensor.h"

namespace fourbit {

bool cuda_built();            // compiled with the CUDA backend
int cuda_device_count();      // 0 when not built or no device is visible
void* device_alloc(size_t bytes);
void device_free(void* p, size_t bytes);
// A copy on the current stream, ordered there like a kernel. GPU to host: the host waits for it
// (it reads the bytes on return). Host to GPU: the bytes are taken on return (the host may reuse
// its buffer; up to 1 MiB through pinned staging without waiting for the GPU, larger copies wait).
// GPU to GPU: the host goes on.
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
// `height` rows of `width` bytes from src (rows src_pitch bytes apart) to dst (dst_pitch apart),
// both on `dev`: one strided copy on the current stream (one call for every row), ordered there
// like a kernel.
void copy_bytes_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Device dev);
void zero_bytes(void* p, Device dev, size_t bytes);
// A GPU-to-host copy the host collects later: read_later queues it on the current stream into
// pinned memory and returns at once, so that work queued after it keeps the GPU busy while the
// host waits in wait(), which returns the bytes (valid while the PendingRead lives). Dropping a
// PendingRead without waiting waits for the copy first (its buffer is then reused).
class PendingRead {
 public:
  virtual ~PendingRead() = default;
  virtual const void* wait() = 0;
};
std::shared_ptr<PendingRead> read_later(const void* src, size_t bytes);
void device_synchronize();
// Bytes of GPU tensors alive now (and of the blocks a CUDA graph's capture took, which its
// replays write: held until the graph goes), and the most at once since the last reset.
int64_t device_bytes_in_use();
int64_t device_peak_bytes(bool reset = false);

// Concurrent GPU lanes, for independent pieces of work too small to fill the GPU one at a time
// (the per-expert GEMMs of a MoE layer). Between lanes_begin(n) and lanes_end(), the work issued
// after lanes_use(i) goes to stream i % n; each lane first waits for everything issued before
// lanes_begin, and lanes_end makes the default stream wait for every lane. Memory freed while
// lanes are open is not reused before lanes_end (a lane may still read it). Lanes do not nest;
// one host thread issues GPU work. ops::Lanes is the scoped front end.
void lanes_begin(int n);
void lanes_use(int i);
void lanes_end();
bool lanes_open();
int current_lane();      // -1 outside lanes
void* current_stream();  // the cudaStream_t kernels go to now; null = the default stream

// CUDA graphs. The GPU work the host issues between a GraphCapture's start and finish() (kernels,
// cuBLASLt calls, copies and memsets, on the current stream and its lanes) is recorded, not run,
// into a DeviceGraph whose replay() runs all of it again with one launch and no host work per op.
//  - Memory taken while capturing comes from a pool kept apart from the shared cache: a replay
//    writes the same addresses, so none of it goes back to the cache while a graph of the pool
//    lives. Blocks still taken when the capture finishes must hold tensors of `keep` (the graph's
//    outputs, which the graph keeps alive); any other fails finish() (a replay would write memory
//    that something else may be given).
//  - GraphCapture(share) takes its memory from the pool of the live graph `share` (and its
//    temporaries' blocks first), so graphs that never run at once hold one set of blocks between
//    them, not one each. Each may then write what the others took, outputs included: replay them
//    one at a time on the stream, and read a graph's outputs (read_later queued behind its replay
//    will do) before another of the pool replays.
//  - A host-to-GPU copy while capturing is recorded from a pinned copy of the bytes that the graph
//    owns: every replay copies the bytes the capture saw. Inputs that change between replays go
//    into fixed buffers (tensors made before the capture) before replay().
//  - Nothing comes back to the host while capturing: a GPU-to-host copy, a read_later or a
//    device_synchronize fails, naming the call, and the capture is discarded. A kernel's recorded
//    index error (ops::check_index_errors) is left to the caller to check after replay().
// One capture at a time, outside lanes, on the thread that issues GPU work.
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  virtual void replay() = 0;  // queued on the default stream, ordered like a kernel
};
class GraphCapture {
 public:
  // fails without a GPU, while lanes are open or inside another capture; share: see above
  explicit GraphCapture(const DeviceGraph* share = nullptr);
  ~GraphCapture();  // discards a capture not finished (an exception left it)
  GraphCapture(const GraphCapture&) = delete;
  GraphCapture& operator=(const GraphCapture&) = delete;
  std::unique_ptr<DeviceGraph> finish(const std::vector<Tensor>& keep);

 private:
  bool open_ = false;
};
bool graph_capturing();

}  // namespace fourbit
