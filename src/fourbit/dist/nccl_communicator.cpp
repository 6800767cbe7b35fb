// defines: nccl_available, nccl_unique_id, make_nccl_communicator (nccl_communicator.h): the NCCL
//          Communicator, its ordered all-reduce and its monitor thread
// Compiled only when CMake finds NCCL. Every NCCL call happens under call_mu_, so the monitor
// thread can abort the communicator (ncclCommAbort) between two of them and never while one
// runs; after an abort every method throws the recorded cause.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>

#include <fmt/format.h>

#include "fourbit/dist/codec_cuda.h"
#include "fourbit/dist/nccl_communicator.h"
#include "fourbit/tensor/device_memory.h"

namespace fourbit::dist {
namespace {

using Clock = std::chrono::steady_clock;

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw DistError(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

std::string nccl_message(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) s += fmt::format(" ({})", last);
  return s;
}

class NcclCommunicator final : public Communicator {
 public:
  // A new communicator from a unique id (ncclCommInitRankConfig), or one made by a split.
  NcclCommunicator(int rank, int world, std::shared_ptr<Health> health, std::chrono::milliseconds timeout)
      : rank_(rank), size_(world), health_(std::move(health)), timeout_(timeout) {
    cuda_ok(cudaGetDevice(&device_), "NCCL communicator: cudaGetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "NCCL communicator: cudaStreamCreate");
  }

  void init(const std::string& unique_id) {
    if (unique_id.size() != NCCL_UNIQUE_ID_BYTES)
      throw DistError(fmt::format("NCCL communicator: the unique id has {} bytes, NCCL's has {}", unique_id.size(),
                                  NCCL_UNIQUE_ID_BYTES));
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // calls return at once; waits poll, so a dead peer can be noticed
    ncclResult_t r;
    {
      std::lock_guard<std::mutex> lk(call_mu_);
      r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    }
    settle(r, "ncclCommInitRankConfig (every rank must join)");
    monitor_ = std::thread([this] { monitor(); });
  }

  void adopt(ncclComm_t comm) {
    comm_ = comm;
    monitor_ = std::thread([this] { monitor(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (monitor_.joinable()) monitor_.join();
    if (!aborted_.load() && comm_) {
      // A clean end: let the stream drain (bounded by the timeout), then finalize; a group that
      // failed meanwhile is aborted instead.
      try {
        drain("shutdown");
        std::lock_guard<std::mutex> lk(call_mu_);
        ncclResult_t r = ncclCommFinalize(comm_);
        ncclResult_t state = r;
        const auto deadline = Clock::now() + timeout_;
        while (state == ncclInProgress && Clock::now() < deadline) ncclCommGetAsyncError(comm_, &state);
        if (state == ncclSuccess) ncclCommDestroy(comm_);
        else ncclCommAbort(comm_);
      } catch (...) {
        abort_comm();
      }
    }
    for (Pending& p : pending_) cudaEventDestroy(p.done);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::CUDA; }

  void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_bytes, Tensor& recv,
                    const std::vector<int64_t>& recv_bytes) override {
    const char* op = "all_to_all_v";
    check_args(op, send_bytes, recv_bytes, send, recv);
    order_after_caller();
    enqueue(op, [&] {
      ncclGroupStart();
      int64_t so = 0, ro = 0;
      for (int p = 0; p < size_; ++p) {
        const int64_t sb = send_bytes[size_t(p)], rb = recv_bytes[size_t(p)];
        if (sb > 0) group_call(ncclSend(static_cast<const char*>(send.raw()) + so, size_t(sb), ncclUint8, p, comm_, stream_));
        if (rb > 0) group_call(ncclRecv(static_cast<char*>(recv.raw()) + ro, size_t(rb), ncclUint8, p, comm_, stream_));
        so += sb;
        ro += rb;
      }
      return ncclGroupEnd();
    });
    finish(op, true);
  }

  void all_reduce_sum(Tensor& x) override { reduce(x, true); }
  void all_reduce_sum_start(Tensor& x) override { reduce(x, false); }
  void wait_pending() override {
    health_->check(where("wait_pending"));
    if (last_unwaited_) {
      cuda_ok(cudaStreamWaitEvent(caller_stream(), last_unwaited_, 0), "NCCL communicator: cudaStreamWaitEvent");
      cudaEventDestroy(last_unwaited_);
      last_unwaited_ = nullptr;
    }
  }

  void wait_host() override { drain("wait_host"); }

  void broadcast(Tensor& x, int root) override {
    const char* op = "broadcast";
    if (root < 0 || root >= size_) throw DistError(fmt::format("{}: root {} outside {} ranks", where(op), root, size_));
    expect_cuda(op, "x", x);
    order_after_caller();
    enqueue(op, [&] { return ncclBroadcast(x.raw(), x.raw(), size_t(x.nbytes()), ncclUint8, root, comm_, stream_); });
    finish(op, true);
  }

  void barrier() override {
    if (!token_.defined()) token_ = Tensor::zeros({1}, DType::F32, Device::CUDA);
    order_after_caller();
    enqueue("barrier", [&] {
      return ncclAllReduce(token_.raw(), token_.raw(), 1, ncclFloat32, ncclSum, comm_, stream_);
    });
    finish("barrier", true);
    drain("barrier");
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    if (color < 0) throw DistError(fmt::format("{}: colors are >= 0, got {}", where("split"), color));
    drain("split");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    ncclResult_t r;
    {
      std::lock_guard<std::mutex> lk(call_mu_);
      live_or_throw("split");
      r = ncclCommSplit(comm_, color, key, &child, &config);
    }
    settle(r, "ncclCommSplit");
    // the child initializes like a new communicator: wait for it before asking its rank
    ncclResult_t state = ncclInProgress;
    const auto deadline = Clock::now() + timeout_;
    while (state == ncclInProgress) {
      ncclCommGetAsyncError(child, &state);
      if (state == ncclInProgress && Clock::now() > deadline) {
        ncclCommAbort(child);
        fail(fmt::format("{}: ncclCommSplit did not complete within {} s", where("split"), seconds()));
      }
    }
    if (state != ncclSuccess) fail(fmt::format("{}: ncclCommSplit: {}", where("split"), nccl_message(state, child)));
    int crank = 0, csize = 0;
    ncclCommUserRank(child, &crank);
    ncclCommCount(child, &csize);
    auto out = std::make_unique<NcclCommunicator>(crank, csize, health_, timeout_);
    out->adopt(child);
    return out;
  }

  void abort(const std::string& why) override {
    health_->fail(fmt::format("rank {} aborted: {}", rank_, why));
    abort_comm();
  }

 private:
  struct Pending {
    std::string op;
    Clock::time_point start;
    cudaEvent_t done;
  };

  std::string where(const std::string& op) const { return fmt::format("rank {}: NCCL {}", rank_, op); }
  double seconds() const { return double(timeout_.count()) / 1000.0; }
  static cudaStream_t caller_stream() { return static_cast<cudaStream_t>(current_stream()); }

  void expect_cuda(const char* op, const char* name, const Tensor& t) const {
    if (t.defined() && t.device() != Device::CUDA)
      throw DistError(fmt::format("{}: {} must be a CUDA tensor, got {}", where(op), name, t.str()));
  }
  void check_args(const char* op, const std::vector<int64_t>& sb, const std::vector<int64_t>& rb, const Tensor& send,
                  const Tensor& recv) const {
    if (int(sb.size()) != size_ || int(rb.size()) != size_)
      throw DistError(fmt::format("{}: {} send and {} receive counts for {} ranks", where(op), sb.size(), rb.size(), size_));
    int64_t st = 0, rt = 0;
    for (int p = 0; p < size_; ++p) {
      if (sb[size_t(p)] < 0 || rb[size_t(p)] < 0) throw DistError(fmt::format("{}: a negative count", where(op)));
      st += sb[size_t(p)];
      rt += rb[size_t(p)];
    }
    expect_cuda(op, "send", send);
    expect_cuda(op, "recv", recv);
    if (st > (send.defined() ? send.nbytes() : 0) || rt > (recv.defined() ? recv.nbytes() : 0))
      throw DistError(fmt::format("{}: counts of {} / {} bytes exceed the buffers", where(op), st, rt));
  }

  // Throws the recorded cause once the group failed; caller holds call_mu_ or not.
  void live_or_throw(const std::string& op) const {
    health_->check(where(op));
    if (aborted_.load()) throw DistError(where(op) + ": the communicator was aborted");
  }

  [[noreturn]] void fail(const std::string& message) {
    health_->fail(message);
    abort_comm();
    throw DistError(message);
  }

  void abort_comm() {
    std::lock_guard<std::mutex> lk(call_mu_);
    if (aborted_.exchange(true) || !comm_) return;
    ncclCommAbort(comm_);  // ends this rank's NCCL kernels; peers learn through their own watch
  }

  // Waits for a non-blocking NCCL call to finish its host side.
  void settle(ncclResult_t r, const std::string& op) {
    ncclResult_t state = r;
    const auto deadline = Clock::now() + timeout_;
    while (state == ncclInProgress) {
      if (health_->failed()) fail(health_->message());
      if (Clock::now() > deadline)
        fail(fmt::format("{}: {} did not complete within {} s (a rank missing or stuck?)", where(op), op, seconds()));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::lock_guard<std::mutex> lk(call_mu_);
      if (aborted_.load()) break;
      ncclCommGetAsyncError(comm_, &state);
    }
    live_or_throw(op);  // an abort meanwhile: its cause, not the state it left
    if (state != ncclSuccess) fail(fmt::format("{}: {}", where(op), nccl_message(state, comm_)));
  }

  // Records the first failing call of a group (later ones return the same error).
  void group_call(ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress && group_error_ == ncclSuccess) group_error_ = r;
  }

  template <typename F>
  void enqueue(const std::string& op, F&& calls) {
    ncclResult_t r;
    {
      std::lock_guard<std::mutex> lk(call_mu_);
      live_or_throw(op);
      group_error_ = ncclSuccess;
      r = calls();
      if (group_error_ != ncclSuccess) r = group_error_;
    }
    settle(r, op);
  }

  // The communicator's stream waits for the work the caller issued so far.
  void order_after_caller() {
    cudaEvent_t ev;
    cuda_ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "NCCL communicator: cudaEventCreate");
    cuda_ok(cudaEventRecord(ev, caller_stream()), "NCCL communicator: cudaEventRecord");
    cuda_ok(cudaStreamWaitEvent(stream_, ev, 0), "NCCL communicator: cudaStreamWaitEvent");
    cudaEventDestroy(ev);
  }

  // Marks the end of a collective on the communicator's stream: the monitor watches it, and the
  // caller's stream waits for it (caller_waits) or only at wait_pending().
  void finish(const std::string& op, bool caller_waits) {
    cudaEvent_t watch, order;
    cuda_ok(cudaEventCreateWithFlags(&watch, cudaEventDisableTiming), "NCCL communicator: cudaEventCreate");
    cuda_ok(cudaEventRecord(watch, stream_), "NCCL communicator: cudaEventRecord");
    cuda_ok(cudaEventCreateWithFlags(&order, cudaEventDisableTiming), "NCCL communicator: cudaEventCreate");
    cuda_ok(cudaEventRecord(order, stream_), "NCCL communicator: cudaEventRecord");
    {
      std::lock_guard<std::mutex> lk(mu_);
      pending_.push_back(Pending{op, Clock::now(), watch});
    }
    if (caller_waits) {
      cuda_ok(cudaStreamWaitEvent(caller_stream(), order, 0), "NCCL communicator: cudaStreamWaitEvent");
      cudaEventDestroy(order);
    } else {
      if (last_unwaited_) cudaEventDestroy(last_unwaited_);
      last_unwaited_ = order;  // the stream is in order: the last event covers the earlier ones
    }
  }

  // Host wait for everything issued on the communicator's stream; the monitor enforces the timeout.
  void drain(const std::string& op) {
    for (;;) {
      live_or_throw(op);
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) fail(fmt::format("{}: {}", where(op), cudaGetErrorString(e)));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    live_or_throw(op);
  }

  // x <- the left fold over ranks: reduce-scatter (grouped send/recv into a [ranks, chunk]
  // scratch), fold on the GPU in rank order, all-gather (grouped send/recv), all on stream_.
  void reduce(Tensor& x, bool caller_waits) {
    const char* op = "all_reduce_sum";
    if (!x.defined() || (x.dtype() != DType::F32 && x.dtype() != DType::F64))
      throw DistError(fmt::format("{}: needs an f32 or f64 tensor", where(op)));
    expect_cuda(op, "x", x);
    if (size_ == 1) return;
    const int64_t n = x.numel(), es = dtype_size(x.dtype()), cl = (n + size_ - 1) / size_;
    auto len = [&](int p) { return std::clamp<int64_t>(n - int64_t(p) * cl, 0, cl); };
    ensure_scratch(int64_t(size_) * cl * es);
    char* xb = static_cast<char*>(x.raw());
    char* sb = static_cast<char*>(scratch_.raw());
    order_after_caller();
    enqueue(op, [&] {
      ncclGroupStart();
      for (int q = 0; q < size_; ++q)
        if (len(q) > 0) group_call(ncclSend(xb + q * cl * es, size_t(len(q) * es), ncclUint8, q, comm_, stream_));
      for (int p = 0; p < size_; ++p)
        if (len(rank_) > 0) group_call(ncclRecv(sb + p * cl * es, size_t(len(rank_) * es), ncclUint8, p, comm_, stream_));
      return ncclGroupEnd();
    });
    cuda::fold_rank_chunks(sb, size_, len(rank_), cl, x.dtype(), xb + rank_ * cl * es, stream_);
    enqueue(op, [&] {
      ncclGroupStart();
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        if (len(rank_) > 0) group_call(ncclSend(xb + rank_ * cl * es, size_t(len(rank_) * es), ncclUint8, p, comm_, stream_));
        if (len(p) > 0) group_call(ncclRecv(xb + p * cl * es, size_t(len(p) * es), ncclUint8, p, comm_, stream_));
      }
      return ncclGroupEnd();
    });
    finish(op, caller_waits);
  }

  // The scratch is reused in stream order; it grows only once the stream is idle, so a block
  // the stream still reads is never handed back to the allocator.
  void ensure_scratch(int64_t bytes) {
    if (scratch_.defined() && scratch_.nbytes() >= bytes) return;
    drain("all_reduce_sum (scratch)");
    scratch_ = Tensor::empty({bytes}, DType::U8, Device::CUDA);
  }

  // Every 20 ms: retire completed collectives, fail one that outlived the timeout, and abort on
  // an NCCL asynchronous error or a failure someone else reported (the rendezvous watchdog).
  void monitor() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::milliseconds(20));
      if (stop_) break;
      std::string cause;
      while (!pending_.empty()) {
        const cudaError_t e = cudaEventQuery(pending_.front().done);
        if (e == cudaErrorNotReady) {
          if (Clock::now() - pending_.front().start > timeout_)
            cause = fmt::format("{}: did not complete within {} s: a peer is stuck, dead or out of step",
                                where(pending_.front().op), seconds());
          break;
        }
        if (e != cudaSuccess) cause = fmt::format("{}: {}", where(pending_.front().op), cudaGetErrorString(e));
        cudaEventDestroy(pending_.front().done);
        pending_.pop_front();
        if (!cause.empty()) break;
      }
      if (cause.empty() && !aborted_.load()) {
        std::lock_guard<std::mutex> call(call_mu_);
        ncclResult_t state = ncclSuccess;
        if (comm_ && ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress)
          cause = fmt::format("rank {}: NCCL error: {}", rank_, nccl_message(state, comm_));
      }
      if (!cause.empty()) health_->fail(cause);
      if (health_->failed() && !aborted_.load()) {
        lk.unlock();
        abort_comm();
        lk.lock();
      }
    }
  }

  int rank_, size_, device_ = 0;
  std::shared_ptr<Health> health_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex call_mu_;  // held around every NCCL call
  ncclResult_t group_error_ = ncclSuccess;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;  // pending_, stop_
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  std::thread monitor_;
  cudaEvent_t last_unwaited_ = nullptr;
  Tensor scratch_, token_;
};

}  // namespace

bool nccl_available() { return true; }

std::string nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw DistError(fmt::format("ncclGetUniqueId: {}", ncclGetErrorString(r)));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world, const std::string& unique_id, int gpu,
                                                     std::shared_ptr<Health> health,
                                                     std::chrono::milliseconds timeout) {
  cuda_ok(cudaSetDevice(gpu), "NCCL communicator: cudaSetDevice");
  auto c = std::make_unique<NcclCommunicator>(rank, world, std::move(health), timeout);
  c->init(unique_id);
  return c;
}

}  // namespace fourbit::dist
