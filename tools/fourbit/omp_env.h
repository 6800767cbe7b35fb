// defines: prepare_openmp_environment
// How OpenMP threads wait between parallel regions. A training step of the CPU backend is many
// short parallel loops; by default libgomp lets a thread that has finished its share spin for a
// while before it sleeps. On an idle machine that is the fastest way to start the next loop, but
// when another process holds one of the cores the spinning thread burns the time slice the
// thread it waits for needs, and a two-thread run becomes 30-60x slower than a one-thread run
// (docs/benchmarks.md). libgomp reads its policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT) once, when
// the library is loaded, so `fourbit` sets it for itself before that: if the user has set
// neither variable, main() sets them and re-executes the binary once.
#pragma once

namespace fourbit::cli {

// Call first in main(). Returns only when the environment is as wanted (or cannot be changed);
// otherwise the process image is replaced by the same command with it set.
void prepare_openmp_environment(int argc, char** argv);

}  // namespace fourbit::cli
