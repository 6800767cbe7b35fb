// defines: the device_memory.h functions for CUDA builds, with a caching allocator.
// Training allocates and frees the same activation sizes every step; cudaMalloc/cudaFree are
// slow and synchronising, so freed blocks are kept in per-size free lists and reused. Sizes are
// rounded up (512 B granules below 1 MiB, 2 MiB above) so near-equal requests share blocks.
// Also the GPU lanes (device_memory.h): a few non-blocking streams forked from and joined to the
// main stream with events; and CUDA graph capture (GraphCapture), which moves the main stream from
// the default stream to a capturing one and takes memory from a pool kept apart from the shared
// cache: the capture's own, or that of the graph it shares one with.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "fourbit/tensor/device_memory.h"

namespace fourbit {
namespace {

#define FOURBIT_MEM_CHECK(call)                                                                 \
  do {                                                                                          \
    const cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) fail("{}: {}", #call, cudaGetErrorString(e_));                      \
  } while (0)

size_t round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t(2) << 20;
  if (bytes < (size_t(1) << 20)) return (bytes + kSmall - 1) / kSmall * kSmall;
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

struct CapturePool;
struct Cache {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_blocks;
  std::vector<std::pair<size_t, void*>> deferred;  // freed while lanes are open
  size_t cached_bytes = 0;
  int64_t in_use = 0, peak = 0;  // bytes handed out (rounded sizes)
  // The blocks of the capture pools that live (CapturePool::members): one freed outside a capture
  // goes back to its pool, whose graphs may write it, not to free_blocks.
  std::unordered_map<void*, CapturePool*> pool_of;
  void taken(size_t size) {
    in_use += int64_t(size);
    if (in_use > peak) peak = in_use;
  }
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may be freed during static teardown
  return *c;
}

struct Lanes {
  static constexpr int kMax = 8;
  cudaStream_t streams[kMax] = {};
  cudaEvent_t done[kMax] = {};
  cudaEvent_t fork = nullptr;
  int open = 0;     // lanes of the current region (0: none)
  int current = -1;
};

Lanes& lanes() {
  static Lanes* l = new Lanes();  // streams live for the process
  return *l;
}

// The memory of one or more captures (GraphCapture; those after the first share it through
// GraphCapture(share)). A replay writes every block its capture used, so none of them may be
// handed to anything but a capture of the same pool while one of its graphs lives: blocks freed
// while capturing, or freed later by the tensors that held them, go to the pool's free lists, not
// the shared cache. They stay counted in use until the last graph of the pool goes, when its
// destructor gives them back.
struct CapturePool {
  std::map<size_t, std::vector<void*>> free_blocks;
  std::vector<std::pair<size_t, void*>> deferred;  // freed while capturing with lanes open
  std::vector<void*> members;                       // every block a capture of the pool took or freed
  std::vector<void*> pinned;                        // host bytes the recorded uploads copy
  CapturePool() = default;
  CapturePool(const CapturePool&) = delete;
  CapturePool& operator=(const CapturePool&) = delete;
  ~CapturePool();
};
// The capture in progress: the stream it records, its pool, and the blocks it took that no one has
// freed yet (which finish() requires to be the graph's outputs).
struct Capture {
  cudaStream_t stream = nullptr;  // made once, non-blocking
  std::shared_ptr<CapturePool> pool;  // null: not capturing
  std::map<void*, size_t> taken;
};
Capture& capture() {
  static Capture* c = new Capture();  // the stream lives for the process
  return *c;
}

// The last graph of the pool is gone (or the only capture failed): its free blocks go to the
// shared cache, and the blocks tensors still hold will when those are freed.
CapturePool::~CapturePool() {
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto give = [&](size_t size, void* p) {
      c.free_blocks[size].push_back(p);
      c.cached_bytes += size;
      c.in_use -= int64_t(size);
    };
    for (const auto& [size, blocks] : free_blocks)
      for (void* p : blocks) give(size, p);
    for (const auto& [size, p] : deferred) give(size, p);
    for (void* p : members) c.pool_of.erase(p);
  }
  for (void* h : pinned) cudaFreeHost(h);
}

// A block handed out while capturing: the capture's until freed, and its pool's from then on.
void join_capture_pool(Cache& c, void* p, size_t size) {
  Capture& cap = capture();
  if (!cap.pool) return;
  cap.taken[p] = size;
  cap.pool->members.push_back(p);
  c.pool_of[p] = cap.pool.get();
}

// Host-to-GPU copies of up to kSlotBytes go through pinned staging slots, so the host need not
// wait for the GPU: the bytes are copied into a slot at once (the caller may reuse its buffer on
// return) and the GPU copies them from there in stream order. A slot is reused once an event
// recorded behind its copy has fired, which waits only while kSlots copies are still queued. One
// device: the slots' events belong to the device current when they were made.
struct Staging {
  static constexpr size_t kSlotBytes = size_t(1) << 20;
  static constexpr int kSlots = 16;
  std::mutex mu;
  bool tried = false;
  int device = -1;
  char* host = nullptr;  // kSlots * kSlotBytes pinned bytes, or null: copies wait
  cudaEvent_t done[kSlots] = {};
  bool used[kSlots] = {};
  int next = 0;
};

Staging& staging() {
  static Staging* st = new Staging();  // pinned memory and events live for the process
  return *st;
}

// The copy of `bytes` host bytes at src to dst on stream s through a staging slot; false (nothing
// done) where there is none: too large, another device, or no pinned memory to be had.
bool staged_upload(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes > Staging::kSlotBytes) return false;
  Staging& st = staging();
  std::lock_guard<std::mutex> lock(st.mu);
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (!st.tried) {
    st.tried = true;
    st.device = dev;
    void* h = nullptr;
    if (cudaHostAlloc(&h, Staging::kSlotBytes * Staging::kSlots, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    for (cudaEvent_t& e : st.done) FOURBIT_MEM_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    st.host = static_cast<char*>(h);
  }
  if (!st.host || dev != st.device) return false;
  const int slot = st.next;
  st.next = (st.next + 1) % Staging::kSlots;
  if (st.used[slot]) FOURBIT_MEM_CHECK(cudaEventSynchronize(st.done[slot]));
  char* h = st.host + size_t(slot) * Staging::kSlotBytes;
  std::memcpy(h, src, bytes);
  FOURBIT_MEM_CHECK(cudaMemcpyAsync(dst, h, bytes, cudaMemcpyHostToDevice, s));
  FOURBIT_MEM_CHECK(cudaEventRecord(st.done[slot], s));
  st.used[slot] = true;
  return true;
}

// Pinned buffers for read_later, each with the event behind its copy; reused once their reader
// is done.
struct ReadSlot {
  char* host;
  size_t cap;
  cudaEvent_t done;
};
struct ReadPool {
  std::mutex mu;
  std::vector<ReadSlot> free;
};
ReadPool& read_pool() {
  static ReadPool* p = new ReadPool();  // pinned memory lives for the process
  return *p;
}

class PinnedRead final : public PendingRead {
 public:
  explicit PinnedRead(ReadSlot slot) : slot_(slot) {}
  ~PinnedRead() override {
    if (!waited_) cudaEventSynchronize(slot_.done);  // the copy may still be writing the buffer
    ReadPool& p = read_pool();
    std::lock_guard<std::mutex> lock(p.mu);
    p.free.push_back(slot_);
  }
  const void* wait() override {
    if (!waited_) FOURBIT_MEM_CHECK(cudaEventSynchronize(slot_.done));
    waited_ = true;
    return slot_.host;
  }

 private:
  ReadSlot slot_;
  bool waited_ = false;
};

// Where no pinned memory is to be had: the copy done at once (the host waits in read_later).
class DoneRead final : public PendingRead {
 public:
  explicit DoneRead(size_t bytes) : bytes_(bytes) {}
  const void* wait() override { return bytes_.data(); }
  char* data() { return bytes_.data(); }

 private:
  std::vector<char> bytes_;
};

// The stream work goes to outside lanes: the default stream, or the capturing one.
cudaStream_t main_stream() {
  const Capture& cap = capture();
  return cap.pool ? cap.stream : cudaStream_t(0);
}

cudaStream_t stream_now() {
  const Lanes& l = lanes();
  return l.current < 0 ? main_stream() : l.streams[l.current];
}

// Fails naming `what` while a capture is recording (nothing can come back to the host then).
void not_while_capturing(const char* what) {
  if (capture().pool)
    fail("{} while a CUDA graph is being captured: nothing can come back to the host during a capture (it records "
         "work, it does not run it)",
         what);
}

cudaMemcpyKind kind_of(Device dst, Device src) {
  if (dst == Device::CUDA && src == Device::CUDA) return cudaMemcpyDeviceToDevice;
  if (dst == Device::CUDA) return cudaMemcpyHostToDevice;
  if (src == Device::CUDA) return cudaMemcpyDeviceToHost;
  return cudaMemcpyHostToHost;
}

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count() {
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      return 0;
    }
    return count;
  }();
  return n;
}

void* device_alloc(size_t bytes) {
  if (cuda_device_count() == 0) fail("no CUDA device is visible: cannot allocate {} bytes on the GPU", bytes);
  const size_t size = round_size(bytes);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (CapturePool* pool = capture().pool.get()) {  // the pool's own blocks first (still counted in use)
      auto it = pool->free_blocks.find(size);
      if (it != pool->free_blocks.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        capture().taken[p] = size;
        return p;
      }
    }
    auto it = c.free_blocks.find(size);
    if (it != c.free_blocks.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      c.cached_bytes -= size;
      c.taken(size);
      join_capture_pool(c, p, size);
      return p;
    }
  }
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, size);
  if (e == cudaErrorMemoryAllocation && capture().pool) {
    // The retry below synchronises the device, which would break the capture.
    cudaGetLastError();
    fail("cudaMalloc of {} bytes failed while a CUDA graph was being captured: out of GPU memory", size);
  }
  if (e == cudaErrorMemoryAllocation) {
    // Give the cached blocks back to the driver and try once more.
    cudaGetLastError();
    std::lock_guard<std::mutex> lock(c.mu);
    cudaDeviceSynchronize();
    for (auto& [sz, blocks] : c.free_blocks)
      for (void* b : blocks) cudaFree(b);
    c.free_blocks.clear();
    c.cached_bytes = 0;
    e = cudaMalloc(&p, size);
  }
  if (e != cudaSuccess) fail("cudaMalloc of {} bytes failed: {}", size, cudaGetErrorString(e));
  std::lock_guard<std::mutex> lock(c.mu);
  c.taken(size);
  join_capture_pool(c, p, size);
  return p;
}

void device_free(void* p, size_t bytes) {
  if (!p) return;
  // Freed memory may still be read by queued kernels. Outside lanes every kernel is on the default
  // stream, and a later allocation's use is queued after them on that stream, so reuse is
  // ordered. While lanes are open another stream could receive the block, so it waits for
  // lanes_end (after which the default stream is behind every lane).
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const size_t size = round_size(bytes);
  const auto owner = c.pool_of.find(p);
  if (CapturePool* pool = capture().pool.get()) {
    // A block freed while capturing becomes the pool's, whenever it was taken: the graph may
    // write it (and it is reused only by later work of the same pool's captures, ordered after
    // this). It stays counted in use until the pool gives it back (~CapturePool). A block of
    // another pool (an output of another live graph) goes back to that one.
    capture().taken.erase(p);
    if (owner != c.pool_of.end() && owner->second != pool) {
      owner->second->free_blocks[size].push_back(p);
      return;
    }
    if (owner == c.pool_of.end()) {
      pool->members.push_back(p);
      c.pool_of[p] = pool;
    }
    if (lanes().open) pool->deferred.emplace_back(size, p);
    else pool->free_blocks[size].push_back(p);
    return;
  }
  if (owner != c.pool_of.end()) {
    // a graph's output, freed while a graph of its pool lives (which may write the block): the
    // pool's again. No capture runs now, and one begins only outside lanes.
    owner->second->free_blocks[size].push_back(p);
    return;
  }
  c.in_use -= int64_t(size);
  if (lanes().open) c.deferred.emplace_back(size, p);
  else c.free_blocks[size].push_back(p);
  c.cached_bytes += size;
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (!bytes) return;
  if (dst_dev == Device::CPU && src_dev == Device::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const cudaStream_t s = stream_now();
  if (CapturePool* pool = capture().pool.get()) {
    if (dst_dev == Device::CPU) not_while_capturing("a GPU-to-host copy");
    if (src_dev == Device::CPU) {  // recorded from a pinned copy the graph keeps: replays copy these bytes
      void* h = nullptr;
      FOURBIT_MEM_CHECK(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
      pool->pinned.push_back(h);
      std::memcpy(h, src, bytes);
      src = h;
    }
    FOURBIT_MEM_CHECK(cudaMemcpyAsync(dst, src, bytes, kind_of(dst_dev, src_dev), s));
    return;
  }
  // Host to GPU: through a pinned staging slot where one takes it, without waiting.
  if (src_dev == Device::CPU && staged_upload(dst, src, bytes, s)) return;
  FOURBIT_MEM_CHECK(cudaMemcpyAsync(dst, src, bytes, kind_of(dst_dev, src_dev), s));
  // GPU to GPU: stream-ordered like the kernels around it (the allocator's block reuse is ordered
  // the same way), so no wait: a wait here idles the GPU until the host launches again.
  if (dst_dev == Device::CPU || src_dev == Device::CPU) FOURBIT_MEM_CHECK(cudaStreamSynchronize(s));
}

void copy_bytes_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Device dev) {
  if (!width || !height) return;
  if (dev == Device::CPU) {
    for (size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
    return;
  }
  FOURBIT_MEM_CHECK(
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice, stream_now()));
}

void zero_bytes(void* p, Device dev, size_t bytes) {
  if (!bytes) return;
  if (dev == Device::CPU) {
    std::memset(p, 0, bytes);
    return;
  }
  FOURBIT_MEM_CHECK(cudaMemsetAsync(p, 0, bytes, stream_now()));
}

std::shared_ptr<PendingRead> read_later(const void* src, size_t bytes) {
  not_while_capturing("read_later");
  const cudaStream_t s = stream_now();
  ReadSlot slot{nullptr, 0, nullptr};
  {
    ReadPool& p = read_pool();
    std::lock_guard<std::mutex> lock(p.mu);
    const auto it = std::find_if(p.free.begin(), p.free.end(), [&](const ReadSlot& r) { return r.cap >= bytes; });
    if (it != p.free.end()) {
      slot = *it;
      p.free.erase(it);
    }
  }
  if (!slot.host) {
    slot.cap = std::max<size_t>(bytes, 4096);
    void* h = nullptr;
    if (cudaHostAlloc(&h, slot.cap, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      auto r = std::make_shared<DoneRead>(bytes);
      copy_bytes(r->data(), Device::CPU, src, Device::CUDA, bytes);
      return r;
    }
    slot.host = static_cast<char*>(h);
    FOURBIT_MEM_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
  auto r = std::make_shared<PinnedRead>(slot);  // from here on it returns the slot to the pool
  if (bytes) FOURBIT_MEM_CHECK(cudaMemcpyAsync(slot.host, src, bytes, cudaMemcpyDeviceToHost, s));
  FOURBIT_MEM_CHECK(cudaEventRecord(slot.done, s));
  return r;
}

void device_synchronize() {
  not_while_capturing("device_synchronize");
  if (cuda_device_count() > 0) FOURBIT_MEM_CHECK(cudaDeviceSynchronize());
}

void lanes_begin(int n) {
  Lanes& l = lanes();
  if (l.open) fail("lanes_begin: GPU lanes do not nest");
  if (n < 1 || n > Lanes::kMax) fail("lanes_begin: {} lanes requested, 1..{} supported", n, Lanes::kMax);
  if (!l.fork) {
    FOURBIT_MEM_CHECK(cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming));
    for (int i = 0; i < Lanes::kMax; ++i) {
      FOURBIT_MEM_CHECK(cudaStreamCreateWithFlags(&l.streams[i], cudaStreamNonBlocking));
      FOURBIT_MEM_CHECK(cudaEventCreateWithFlags(&l.done[i], cudaEventDisableTiming));
    }
  }
  FOURBIT_MEM_CHECK(cudaEventRecord(l.fork, main_stream()));
  for (int i = 0; i < n; ++i) FOURBIT_MEM_CHECK(cudaStreamWaitEvent(l.streams[i], l.fork, 0));
  l.open = n;
  l.current = -1;
}

void lanes_use(int i) {
  Lanes& l = lanes();
  if (!l.open) fail("lanes_use: no lanes are open");
  l.current = i % l.open;
}

void lanes_end() {
  Lanes& l = lanes();
  if (!l.open) return;
  // The lanes are closed whatever happens below, so that work after an error (a failed capture's
  // clean-up, the sampler's op-by-op fallback) does not run on them.
  const int n = l.open;
  l.open = 0;
  l.current = -1;
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < n; ++i) {
    cudaError_t e = cudaEventRecord(l.done[i], l.streams[i]);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(main_stream(), l.done[i], 0);
    if (err == cudaSuccess) err = e;
  }
  // Without the joins the blocks freed while the lanes were open may still be read by them: they
  // stay out of use.
  if (err != cudaSuccess) fail("lanes_end: joining the GPU lanes to the main stream failed: {}", cudaGetErrorString(err));
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (const auto& [size, p] : c.deferred) c.free_blocks[size].push_back(p);
  c.deferred.clear();
  if (CapturePool* pool = capture().pool.get()) {
    for (const auto& [size, p] : pool->deferred) pool->free_blocks[size].push_back(p);
    pool->deferred.clear();
  }
}

bool lanes_open() { return lanes().open > 0; }

namespace {

class CudaGraph final : public DeviceGraph {
 public:
  CudaGraph(cudaGraphExec_t exec, std::shared_ptr<CapturePool> pool, std::vector<Tensor> keep)
      : exec_(exec), pool_(std::move(pool)), keep_(std::move(keep)) {}
  ~CudaGraph() override {
    cudaDeviceSynchronize();  // a replay in flight still reads the pinned bytes and writes the blocks
    cudaGraphExecDestroy(exec_);
    keep_.clear();  // the outputs' blocks go back to the pool (the last graph's, to the cache next)
    pool_.reset();
  }
  void replay() override {
    if (capture().pool) fail("a CUDA graph cannot be replayed while another is being captured");
    if (lanes_open()) fail("a CUDA graph replays on the default stream, not inside GPU lanes");
    FOURBIT_MEM_CHECK(cudaGraphLaunch(exec_, cudaStream_t(0)));
  }
  const std::shared_ptr<CapturePool>& pool() const { return pool_; }

 private:
  cudaGraphExec_t exec_;
  std::shared_ptr<CapturePool> pool_;
  std::vector<Tensor> keep_;  // the outputs: their blocks are written by every replay
};

}  // namespace

GraphCapture::GraphCapture(const DeviceGraph* share) {
  if (cuda_device_count() == 0) fail("no CUDA device is visible: cannot capture a CUDA graph");
  Capture& cap = capture();
  if (cap.pool) fail("a CUDA graph is already being captured: captures do not nest");
  if (lanes_open()) fail("a CUDA graph capture cannot begin while GPU lanes are open");
  std::shared_ptr<CapturePool> pool;
  if (share) {
    const auto* g = dynamic_cast<const CudaGraph*>(share);
    if (!g) fail("GraphCapture: the graph to share memory with is not a CUDA graph");
    pool = g->pool();
  } else {
    pool = std::make_shared<CapturePool>();
  }
  if (!cap.stream) FOURBIT_MEM_CHECK(cudaStreamCreateWithFlags(&cap.stream, cudaStreamNonBlocking));
  // Relaxed: the allocator may still cudaMalloc a block the cache lacks while capturing.
  FOURBIT_MEM_CHECK(cudaStreamBeginCapture(cap.stream, cudaStreamCaptureModeRelaxed));
  cap.pool = std::move(pool);
  cap.taken.clear();
  open_ = true;
}

GraphCapture::~GraphCapture() {
  if (!open_) return;
  Capture& cap = capture();
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(cap.stream, &g);  // fails where the capture was invalidated; nothing to keep either way
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();
  cap.taken.clear();
  cap.pool.reset();  // an unshared pool gives its blocks back here
}

std::unique_ptr<DeviceGraph> GraphCapture::finish(const std::vector<Tensor>& keep) {
  if (!open_) fail("GraphCapture::finish: this capture has already finished");
  if (lanes_open()) fail("GraphCapture::finish: GPU lanes are still open (lanes_end joins them first)");
  Capture& cap = capture();
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(cap.stream, &g);
  open_ = false;
  std::shared_ptr<CapturePool> pool = std::move(cap.pool);
  std::map<void*, size_t> taken_now;
  taken_now.swap(cap.taken);
  auto discard = [&] {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    pool.reset();  // an unshared pool gives its blocks back here
  };
  if (e != cudaSuccess || !g) {
    discard();
    fail("CUDA graph capture failed: {} (a call the capture could not record)", cudaGetErrorString(e));
  }
  for (const auto& taken : taken_now) {
    const char* begin = static_cast<const char*>(taken.first);
    const size_t size = taken.second;
    const bool held = std::any_of(keep.begin(), keep.end(), [&](const Tensor& t) {
      const char* r = t.defined() && t.device() == Device::CUDA ? static_cast<const char*>(t.raw()) : nullptr;
      return r && r >= begin && r < begin + size;
    });
    if (!held) {
      discard();
      fail("CUDA graph capture: a GPU buffer of {} bytes taken during the capture is still in use and is not one of the "
           "graph's outputs (replays would write memory the graph does not own)",
           size);
    }
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ie = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  g = nullptr;
  if (ie != cudaSuccess) {
    discard();
    fail("CUDA graph instantiation failed: {}", cudaGetErrorString(ie));
  }
  return std::make_unique<CudaGraph>(exec, std::move(pool), keep);
}

bool graph_capturing() { return capture().pool != nullptr; }
int current_lane() { return lanes().current; }
void* current_stream() { return stream_now(); }

int64_t device_bytes_in_use() {
  std::lock_guard<std::mutex> lock(cache().mu);
  return cache().in_use;
}

int64_t device_peak_bytes(bool reset) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const int64_t p = c.peak;
  if (reset) c.peak = c.in_use;
  return p;
}

}  // namespace fourbit
