// defines: Rendezvous
// The processes of a run find each other over TCP (docs/distributed.md "Rendezvous"): rank 0
// listens on LaunchInfo::rdzv_host:rdzv_port, every other rank connects (retrying until the
// timeout) and says who it is; rank 0 checks that the world agrees and that every rank came
// exactly once, and refuses connections from another job (LaunchInfo::job_key). all_gather then
// hands small host data around (the NCCL unique id: rank 0's entry).
//
// The connections stay open as the run's failure channel, watched by a thread on every rank:
//  - a rank that fails says so (abort(), or its Health failing, or its Rendezvous dying with an
//    exception in flight): rank 0 passes the message on to every rank;
//  - a rank that vanishes (killed, crashed, node lost) closes its connection without a goodbye:
//    rank 0 notices and tells the others; if rank 0 vanishes, every rank notices;
//  - either way every rank's Health fails with a message naming the rank, and the communicators
//    (the NCCL monitor) abort their collectives instead of waiting for a peer that is gone.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fourbit/dist/communicator.h"
#include "fourbit/dist/launcher.h"

namespace fourbit::dist {

class Rendezvous {
 public:
  // Connects the world (collective over processes). Fails naming the ranks that never came.
  static std::unique_ptr<Rendezvous> connect(const LaunchInfo& info, std::shared_ptr<Health> health,
                                             std::chrono::milliseconds timeout);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::shared_ptr<Health>& health() const { return health_; }

  // Every rank's bytes, in rank order (collective; before start_watchdog).
  std::vector<std::string> all_gather(const std::string& mine);
  // From now on failures travel (see above).
  void start_watchdog();
  // This rank failed: every rank's Health fails with "rank r: why".
  void abort(const std::string& why);
  // A clean exit: peers stop watching this rank. The destructor says goodbye, or aborts when the
  // process's Health failed or an exception is unwinding.
  void goodbye();

 private:
  Rendezvous(int rank, int world, std::shared_ptr<Health> health, std::chrono::milliseconds timeout);
  void watch();
  void send_to(int fd, uint32_t type, const std::string& payload);
  void announce(const std::string& message);  // ABORT to rank 0, or from rank 0 to everyone
  void stop_watchdog();

  int rank_, world_;
  std::shared_ptr<Health> health_;
  std::chrono::milliseconds timeout_;
  std::vector<int> fds_;           // rank 0: fds_[p] for peers p >= 1; others: fds_[0] = rank 0
  std::vector<char> said_goodbye_;  // per fds_ entry
  int wake_[2] = {-1, -1};         // self-pipe that stops the watchdog
  std::thread watchdog_;
  std::mutex send_mu_;
  std::atomic<bool> announced_{false};
  bool closed_ = false;
};

}  // namespace fourbit::dist
