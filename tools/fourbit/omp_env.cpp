// defines: prepare_openmp_environment (omp_env.h)
#include "tools/fourbit/omp_env.h"

#include <unistd.h>

#include <cstdlib>

namespace fourbit::cli {

void prepare_openmp_environment(int argc, char** argv) {
  (void)argc;
  // The user's choice, or this process was already started with ours.
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);
  // exec failed (no /proc): carry on with the library's default policy.
  ::unsetenv("OMP_WAIT_POLICY");
}

}  // namespace fourbit::cli
