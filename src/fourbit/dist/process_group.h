// defines: check_topology, Topology, make_topology, ProcessGroup, init_process_group, dist_timeout
// A run's processes and their groups. world = ep x dp ranks, laid out rank = d * ep + e: the ep
// ranks of one expert-parallel group are consecutive (on one node when ep <= GPUs per node, so
// the all-to-alls stay on NVLink), and the dp replicas of one expert shard are ep apart.
//  - expert parallel group (size ep): dispatch / combine of the MoE layers;
//  - expert replica group (size dp): all-reduce of the expert weights' gradients (each rank holds
//    n_experts / ep experts, the same ones as every rank with its e);
//  - world (size ep x dp): all-reduce of every other gradient (attention, router, norms,
//    embeddings, shared experts: replicated on every rank, each rank with its own tokens).
#pragma once
#include <chrono>
#include <memory>

#include "fourbit/dist/communicator.h"
#include "fourbit/dist/launcher.h"
#include "fourbit/dist/local_group.h"
#include "fourbit/dist/rendezvous.h"

namespace fourbit::dist {

// Fails unless ep, dp >= 1, ep x dp == world and ep divides n_experts, naming the numbers.
void check_topology(int64_t ep, int64_t dp, int64_t world, int64_t n_experts);

struct Topology {
  int ep = 1, dp = 1;
  int ep_index = 0, dp_index = 0;   // rank = dp_index * ep + ep_index
  Communicator* world = nullptr;
  std::unique_ptr<Communicator> expert_parallel;  // the ep ranks with this dp_index
  std::unique_ptr<Communicator> expert_replicas;  // the dp ranks with this ep_index
};
// Splits world into the two groups (collective over world).
Topology make_topology(Communicator& world, int ep, int dp, int64_t n_experts);

struct ProcessGroup {
  LaunchInfo info;
  std::shared_ptr<Health> health;
  std::unique_ptr<Rendezvous> rendezvous;  // null for a single process
  std::unique_ptr<LocalGroup> local;       // a single process: its group of one
  std::unique_ptr<Communicator> world;
};

// The per-collective timeout: FOURBIT_DIST_TIMEOUT_S seconds, 600 by default (a first NCCL
// connection across nodes can take a minute; a step never should).
std::chrono::milliseconds dist_timeout();

// This process in its run, from the launcher's environment (launcher.h). A single process gets
// a group of one (its collectives move nothing). Several processes meet at the rendezvous and,
// on GPUs (device CUDA), share an NCCL communicator on GPU local_rank (set here, so call this
// before any other GPU work), with the watchdog running. Several processes on the CPU are
// refused: their collectives have no transport (run ranks as threads with LocalGroup instead).
ProcessGroup init_process_group(Device device, std::chrono::milliseconds timeout = dist_timeout());

}  // namespace fourbit::dist
