// defines: launch_info, launch_info_from_environment, first_slurm_host (launcher.h)
#include "fourbit/dist/launcher.h"

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

#include "fourbit/dist/communicator.h"

namespace fourbit::dist {
namespace {

constexpr int kDefaultRdzvPort = 29511;  // documented: override with FOURBIT_RDZV_PORT

struct Reader {
  const EnvLookup& env;
  std::string launcher;

  std::optional<std::string> get(const std::string& name) const {
    auto v = env(name);
    if (v && v->empty()) return std::nullopt;
    return v;
  }
  bool has(const std::string& name) const { return get(name).has_value(); }

  // A non-negative integer variable; `fallback` when unset (nullopt: required).
  int64_t integer(const std::string& name, std::optional<int64_t> fallback = std::nullopt) const {
    const auto v = get(name);
    if (!v) {
      if (fallback) return *fallback;
      throw DistError(fmt::format("{} launch: {} is not set", launcher, name));
    }
    int64_t out = 0;
    const auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
    if (ec != std::errc() || p != v->data() + v->size() || out < 0)
      throw DistError(fmt::format("{} launch: {}={} is not a non-negative integer", launcher, name, *v));
    return out;
  }
};

void check(const LaunchInfo& li, const std::string& rank_var, const std::string& world_var,
           const std::string& local_var) {
  if (li.world < 1) throw DistError(fmt::format("{} launch: {}={} must be at least 1", li.launcher, world_var, li.world));
  if (li.rank >= li.world)
    throw DistError(fmt::format("{} launch: {}={} is not below {}={}", li.launcher, rank_var, li.rank, world_var, li.world));
  if (li.local_world < 1 || li.local_rank >= li.local_world || li.local_world > li.world)
    throw DistError(fmt::format("{} launch: {}={} does not fit {} process(es) on this node of a world of {}",
                                li.launcher, local_var, li.local_rank, li.local_world, li.world));
}

// Where rank 0 listens: FOURBIT_MASTER_ADDR / MASTER_ADDR, else the launcher's guess, else this
// host when every rank is local.
void rendezvous_address(LaunchInfo& li, const Reader& rd, const std::string& guess_host, int guess_port) {
  if (auto a = rd.get("FOURBIT_MASTER_ADDR")) li.rdzv_host = *a;
  else if (auto m = rd.get("MASTER_ADDR")) li.rdzv_host = *m;
  else if (!guess_host.empty()) li.rdzv_host = guess_host;
  else if (li.single_node) li.rdzv_host = "127.0.0.1";
  else
    throw DistError(fmt::format(
        "{} launch across nodes: set MASTER_ADDR (or FOURBIT_MASTER_ADDR) to the host of rank 0 for the rendezvous",
        li.launcher));
  int64_t port = guess_port;
  if (rd.has("FOURBIT_RDZV_PORT")) port = rd.integer("FOURBIT_RDZV_PORT");
  else if (rd.has("MASTER_PORT")) port = rd.integer("MASTER_PORT") + 1;  // torchrun's store is on MASTER_PORT
  if (port < 1 || port > 65535)
    throw DistError(fmt::format("{} launch: rendezvous port {} is outside 1..65535 (FOURBIT_RDZV_PORT or MASTER_PORT + 1)",
                                li.launcher, port));
  li.rdzv_port = int(port);
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // the first entry: up to the first comma outside brackets
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    else if (nodelist[i] == ']') --depth;
    else if (nodelist[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  const std::string entry = nodelist.substr(0, end);
  const size_t open = entry.find('[');
  if (open == std::string::npos) return entry;
  const size_t close = entry.find(']', open);
  if (close == std::string::npos) throw DistError(fmt::format("Slurm node list '{}': unbalanced '['", nodelist));
  const std::string inside = entry.substr(open + 1, close - open - 1);
  const size_t stop = inside.find_first_of(",-");
  return entry.substr(0, open) + inside.substr(0, stop) + entry.substr(close + 1);
}

LaunchInfo launch_info(const EnvLookup& env) {
  LaunchInfo li;
  Reader rd{env, ""};
  if (rd.has("RANK") || rd.has("WORLD_SIZE")) {
    li.launcher = rd.has("TORCHELASTIC_RUN_ID") ? "torchrun" : "env";
    rd.launcher = li.launcher;
    li.rank = int(rd.integer("RANK"));
    li.world = int(rd.integer("WORLD_SIZE"));
    li.local_rank = int(rd.integer("LOCAL_RANK", li.world == 1 ? std::optional<int64_t>(0) : std::nullopt));
    li.local_world = int(rd.integer("LOCAL_WORLD_SIZE", li.world));
    li.single_node = li.local_world == li.world;
    check(li, "RANK", "WORLD_SIZE", "LOCAL_RANK");
    li.job_key = rd.get("TORCHELASTIC_RUN_ID").value_or("");
    if (li.world > 1 && !rd.has("MASTER_PORT") && !rd.has("FOURBIT_RDZV_PORT"))
      throw DistError(fmt::format("{} launch: set MASTER_PORT (torchrun does) or FOURBIT_RDZV_PORT", li.launcher));
    rendezvous_address(li, rd, "", kDefaultRdzvPort);
  } else if (rd.has("OMPI_COMM_WORLD_RANK")) {
    li.launcher = rd.launcher = "openmpi";
    li.rank = int(rd.integer("OMPI_COMM_WORLD_RANK"));
    li.world = int(rd.integer("OMPI_COMM_WORLD_SIZE"));
    li.local_rank = int(rd.integer("OMPI_COMM_WORLD_LOCAL_RANK"));
    li.local_world = int(rd.integer("OMPI_COMM_WORLD_LOCAL_SIZE"));
    li.single_node = li.local_world == li.world;
    check(li, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK");
    li.job_key = rd.get("OMPI_MCA_ess_base_jobid").value_or("");
    rendezvous_address(li, rd, "", kDefaultRdzvPort);
  } else if (rd.has("PMI_RANK")) {
    li.launcher = rd.launcher = "pmi";
    li.rank = int(rd.integer("PMI_RANK"));
    li.world = int(rd.integer("PMI_SIZE"));
    li.local_rank = int(rd.integer("MPI_LOCALRANKID", li.world == 1 ? std::optional<int64_t>(0) : std::nullopt));
    li.local_world = int(rd.integer("MPI_LOCALNRANKS", li.world));
    li.single_node = li.local_world == li.world;
    check(li, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID");
    li.job_key = rd.get("PMI_ID").value_or("");
    rendezvous_address(li, rd, "", kDefaultRdzvPort);
  } else if (rd.has("SLURM_PROCID")) {
    li.launcher = rd.launcher = "slurm";
    li.rank = int(rd.integer("SLURM_PROCID"));
    li.world = int(rd.has("SLURM_NTASKS") ? rd.integer("SLURM_NTASKS") : rd.integer("SLURM_NPROCS"));
    li.local_rank = int(rd.integer("SLURM_LOCALID"));
    const int64_t nodes = rd.has("SLURM_STEP_NUM_NODES") ? rd.integer("SLURM_STEP_NUM_NODES") : rd.integer("SLURM_NNODES", 1);
    li.single_node = nodes == 1;
    // processes on this node: all of them on one node; else at least local_rank + 1 (only the GPU choice uses it)
    li.local_world = li.single_node ? li.world : li.local_rank + 1;
    check(li, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID");
    const int64_t job = rd.integer("SLURM_JOB_ID", 0), step = rd.integer("SLURM_STEP_ID", 0);
    li.job_key = fmt::format("{}.{}", job, step);
    std::string host;
    if (auto nl = rd.get("SLURM_STEP_NODELIST")) host = first_slurm_host(*nl);
    else if (auto jl = rd.get("SLURM_JOB_NODELIST")) host = first_slurm_host(*jl);
    // a port of its own per job step, so two steps on one node do not meet
    rendezvous_address(li, rd, li.single_node ? "" : host, int(20000 + (job * 7 + step) % 30000));
  } else {
    li.launcher = "single";
    li.job_key = "";
  }
  return li;
}

LaunchInfo launch_info_from_environment() {
  return launch_info([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace fourbit::dist
