// defines: nccl_available, nccl_unique_id, make_nccl_communicator
// The Communicator of one process per GPU, over NCCL (built when CMake finds NCCL: FOURBIT_HAS_NCCL;
// otherwise these fail with a message saying how to get it). Plain C++: nccl.h stays in the .cpp.
//
// How it behaves (docs/distributed.md "Failures"):
//  - every collective runs on the communicator's own CUDA stream, ordered after the work already
//    issued to the caller's stream and, except all_reduce_sum_start, before the work issued after
//    it; the host blocks only where it reads a result (the exchanged counts);
//  - all_reduce_sum is the fixed-order sum: a reduce-scatter by grouped send/recv, a left fold
//    in rank order on the GPU, an all-gather by send/recv (bits independent of NCCL's algorithm);
//  - the communicator is non-blocking (ncclConfig blocking = 0) and a monitor thread watches it:
//    an NCCL asynchronous error, a collective that does not complete within the timeout, or a
//    failure the rendezvous watchdog reports (a peer that died) aborts it with ncclCommAbort,
//    which ends its kernels, and every later call throws DistError with the first cause.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "fourbit/dist/communicator.h"

namespace fourbit::dist {

bool nccl_available();  // this fourbit was built with NCCL
// ncclGetUniqueId's 128 bytes, made by rank 0 and handed to every rank by the rendezvous.
std::string nccl_unique_id();
// The communicator of `rank` in a group of `world` on CUDA device `gpu` (made current here). health: the
// process's failure state (shared with the rendezvous watchdog); timeout: how long one
// collective may take before the group is declared stuck.
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world, const std::string& unique_id, int gpu,
                                                     std::shared_ptr<Health> health,
                                                     std::chrono::milliseconds timeout);

}  // namespace fourbit::dist
