// defines: DistError, Health, Communicator, all_to_all_counts
// The collectives expert and data parallelism need, over byte and float buffers held in Tensors,
// with two implementations: LocalGroup (ranks as threads of one process: the CPU tests) and
// NcclCommunicator (one process per GPU). Every collective is called by every rank of the group in
// the same order; a rank that fails, leaves or stalls must end the others' waits with an error that
// says which rank and why, never a hang (docs/distributed.md "Failures").
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fourbit/tensor/error.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::dist {

// A collective that cannot complete: a peer failed or left, a timeout, a transport error.
class DistError : public Error {
 public:
  using Error::Error;
};

// The failure state one process shares between its communicators and its rendezvous watchdog:
// the first failure reported wins and every later wait fails with its message.
class Health {
 public:
  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load()) {
      message_ = message;
      failed_.store(true);
    }
  }
  bool failed() const { return failed_.load(); }
  std::string message() const {
    std::lock_guard<std::mutex> lock(mu_);
    return message_;
  }
  // Throws DistError("<where>: <message>") once a failure was reported.
  void check(const std::string& where) const {
    if (failed()) throw DistError(where + ": " + message());
  }

 private:
  mutable std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::string message_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the buffers of this communicator live (LocalGroup: the CPU; NCCL: the process's GPU).
  virtual Device device() const = 0;

  // Each rank sends send_bytes[p] bytes to rank p, taken from `send` in rank order (peer segments
  // back to back from byte 0), and receives recv_bytes[p] bytes from rank p into `recv`, in rank
  // order. send_bytes[q] on rank p must equal recv_bytes[p] on rank q (checked where the transport
  // can see both). Tensors: contiguous, any dtype, on device(); the bytes to self are copied too.
  virtual void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_bytes, Tensor& recv,
                            const std::vector<int64_t>& recv_bytes) = 0;
  // x <- ((x_0 + x_1) + x_2) + ... elementwise over the ranks' x (F32 or F64, same shape on every
  // rank): one fixed order whatever the transport, so every rank gets the same bits, and the same
  // bits as summing the ranks' buffers one after the other on one machine.
  virtual void all_reduce_sum(Tensor& x) = 0;
  // all_reduce_sum whose result is guaranteed only after the next wait_pending(): the NCCL
  // communicator runs it on its own stream, overlapping the compute stream's later work, which
  // must neither read nor write x until then. By default it completes at once.
  virtual void all_reduce_sum_start(Tensor& x) { all_reduce_sum(x); }
  virtual void wait_pending() {}
  // Blocks the host until every collective this rank issued has completed, or throws DistError
  // when the group failed meanwhile (before the host reads what a collective wrote to memory it
  // can see). A no-op where collectives complete on the host (LocalGroup).
  virtual void wait_host() {}
  // Every rank's x becomes root's x (same shape and dtype on every rank).
  virtual void broadcast(Tensor& x, int root) = 0;
  virtual void barrier() = 0;
  // A new group of the ranks that pass the same color, ordered by (key, rank); collective.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Ends every pending and future collective of this rank with DistError(why), and tells the
  // peers where the transport can (LocalGroup: all ranks; NCCL: ncclCommAbort plus the
  // rendezvous watchdog, which reaches every process).
  virtual void abort(const std::string& why) = 0;
};

// The all-to-all of one int64 count per peer (host vectors; through device buffers for NCCL):
// returns recv[p] = what rank p passed as send[rank()]. send: size() x per_peer values, peer-major.
std::vector<int64_t> all_to_all_counts(Communicator& comm, const std::vector<int64_t>& send, int64_t per_peer);

}  // namespace fourbit::dist
