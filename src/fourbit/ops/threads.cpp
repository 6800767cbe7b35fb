// defines: physical_cores, default_threads, set_threads (threads.h)
#include "fourbit/ops/threads.h"

#include <omp.h>
#include <sched.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#include "fourbit/tensor/error.h"

namespace fourbit {

namespace {

bool read_int(const std::string& path, long* out) {
  std::ifstream in(path);
  return static_cast<bool>(in >> *out);
}

}  // namespace

int physical_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return omp_get_num_procs();
  std::set<std::pair<long, long>> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    long package = 0, core = 0;
    if (!read_int(topo + "physical_package_id", &package) || !read_int(topo + "core_id", &core))
      return CPU_COUNT(&set);  // no topology (some containers): count what we may run on
    cores.insert({package, core});
  }
  return cores.empty() ? 1 : int(cores.size());
}

int default_threads() {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && n > 0) return int(n);
  }
  return physical_cores();
}

void set_threads(int n) {
  if (n < 1) fail("--threads: expected a positive number of threads, got {}", n);
  omp_set_num_threads(n);
}

}  // namespace fourbit
