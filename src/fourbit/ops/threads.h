// defines: physical_cores, default_threads, set_threads
// How many CPU threads the ops use. The default is one per physical core this process may run
// on: the CPU kernels are compute-bound loops that gain nothing from a core's second hardware
// thread, and on a small shared machine every extra thread is one more to wait for at each of
// the many short parallel regions of a step. OMP_NUM_THREADS, when set, still decides.
#pragma once

namespace fourbit {

// Distinct (package, core) pairs among the CPUs in this process's affinity mask (Linux sysfs);
// the number of CPUs it may use when the topology cannot be read.
int physical_cores();
// OMP_NUM_THREADS when it is set to a positive number, else physical_cores().
int default_threads();
// Threads for the parallel loops from now on (n >= 1; an Error otherwise).
void set_threads(int n);

}  // namespace fourbit
