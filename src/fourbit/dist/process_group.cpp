// defines: check_topology, make_topology, dist_timeout, init_process_group (process_group.h)
#include "fourbit/dist/process_group.h"

#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "fourbit/dist/nccl_communicator.h"
#include "fourbit/tensor/device_memory.h"

namespace fourbit::dist {

void check_topology(int64_t ep, int64_t dp, int64_t world, int64_t n_experts) {
  if (ep < 1 || dp < 1) fail("[dist] ep and dp must be at least 1, got ep = {}, dp = {}", ep, dp);
  if (ep * dp != world)
    fail("[dist] ep x dp = {} x {} = {} ranks, but the launcher started {} process(es): they must agree", ep, dp,
         ep * dp, world);
  if (n_experts % ep)
    fail("[dist] ep = {} does not divide model.n_experts = {}: every rank holds the same number of experts", ep,
         n_experts);
}

Topology make_topology(Communicator& world, int ep, int dp, int64_t n_experts) {
  check_topology(ep, dp, world.size(), n_experts);
  Topology t;
  t.ep = ep;
  t.dp = dp;
  t.world = &world;
  t.ep_index = world.rank() % ep;
  t.dp_index = world.rank() / ep;
  t.expert_parallel = world.split(t.dp_index, t.ep_index);
  t.expert_replicas = world.split(t.ep_index, t.dp_index);
  return t;
}

std::chrono::milliseconds dist_timeout() {
  const char* v = std::getenv("FOURBIT_DIST_TIMEOUT_S");
  if (!v || !*v) return std::chrono::seconds(600);
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end || !(s > 0)) fail("FOURBIT_DIST_TIMEOUT_S={} is not a positive number of seconds", v);
  return std::chrono::milliseconds(int64_t(s * 1000));
}

ProcessGroup init_process_group(Device device, std::chrono::milliseconds timeout) {
  ProcessGroup pg;
  pg.info = launch_info_from_environment();
  pg.health = std::make_shared<Health>();
  if (pg.info.world == 1) {
    pg.local = std::make_unique<LocalGroup>(1, timeout);
    pg.world = pg.local->communicator(0);
    return pg;
  }
  if (device != Device::CUDA)
    throw DistError(fmt::format(
        "{} launched {} processes on the CPU, which fourbit runs as one process: multi-process runs need GPUs and "
        "NCCL (on the CPU, expert and data parallelism run as threads: LocalGroup, the tests)",
        pg.info.launcher, pg.info.world));
  if (!nccl_available()) nccl_unique_id();  // throws the message that says how to build with NCCL
  const int gpus = cuda_device_count();
  if (pg.info.local_rank >= gpus)
    throw DistError(fmt::format("rank {}: local rank {} has no GPU ({} visible on this node)", pg.info.rank,
                                pg.info.local_rank, gpus));
  pg.rendezvous = Rendezvous::connect(pg.info, pg.health, timeout);
  const std::vector<std::string> ids = pg.rendezvous->all_gather(pg.info.rank == 0 ? nccl_unique_id() : "");
  pg.rendezvous->start_watchdog();
  pg.world = make_nccl_communicator(pg.info.rank, pg.info.world, ids[0], pg.info.local_rank, pg.health, timeout);
  return pg;
}

}  // namespace fourbit::dist
