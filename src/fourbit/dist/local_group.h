// defines: LocalGroup
// N ranks as threads of one process, exchanging buffers through shared memory: the communicator
// the CPU tests run expert and data parallelism on (ep = 2, 4 in one process), and the ep = 1
// path of a single process (a group of one, whose collectives copy nothing they need not).
// Failure semantics are the distributed ones: a rank that throws aborts the group, a rank whose
// function returns leaves it, and a collective waiting for either fails at once with a message
// naming the rank; one that waits longer than the timeout fails naming the ranks it waited for.
#pragma once
#include <chrono>
#include <functional>
#include <memory>

#include "fourbit/dist/communicator.h"

namespace fourbit::dist {

class LocalGroup {
 public:
  struct State;  // the shared mailbox (local_group.cpp)

  explicit LocalGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(120));
  int size() const;
  // The communicator of `rank`: one per thread; several may not be used by one thread at once.
  std::unique_ptr<Communicator> communicator(int rank);
  // Marks `rank` as gone: collectives that wait for it fail instead of waiting.
  void leave(int rank);

  // Runs fn(comm) for every rank on its own thread (rank 0 on the calling thread). A rank that
  // throws aborts the group with its message; a rank that returns leaves it. After every thread
  // ended, rethrows the first failure that was reported (the cause, not the other ranks' echoes
  // of it) as DistError("rank r: ...").
  static void run(int size, const std::function<void(Communicator&)>& fn,
                  std::chrono::milliseconds timeout = std::chrono::seconds(120));

 private:
  std::shared_ptr<State> state_;
};

}  // namespace fourbit::dist
