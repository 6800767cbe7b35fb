// defines: dependent_launch_prologue, launch_dependent, dependent_launches_on
// Programmatic dependent launch (compute capability 9.0+). A kernel launched with launch_dependent
// may be scheduled while the kernel before it on the stream still runs: its CTAs become resident
// and wait in dependent_launch_prologue until that kernel has completed and its memory writes are
// visible, then let the kernel after them be scheduled in turn. What it saves is each kernel's
// launch and ramp between dependent kernels, which at decode sizes (a few rows; kernels of 2-6 µs)
// is a large share of a step; in a CUDA graph the launches become programmatic edges.
//
// The rules for a kernel launched this way:
//  - dependent_launch_prologue() is its first statement, run by every thread, before any global
//    memory access and before any return. The wait makes the kernel's completion come after its
//    predecessor's, which is what the next kernel's wait relies on for the kernels before that;
//    a CTA that returned first could let the grid finish early.
//  - Nothing else changes: the prologue is a no-op where the launch had no such dependency (a
//    plain launch, an older device, the switch off), so the kernel may also be launched with <<<>>>.
// At most two kernels of a stream are resident at once: the running one and the next one, waiting
// (the trigger comes after the wait, so the one after that is not launched until this one runs).
#pragma once
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "fourbit/ops/cuda/common.cuh"

namespace fourbit::ops::cuda {

__device__ __forceinline__ void dependent_launch_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The process-wide switch (set_dependent_launches in cuda_ops.h): on unless the environment sets
// FOURBIT_DEPENDENT_LAUNCHES=0 (to run a whole program, the test suite say, with plain launches).
inline std::atomic<bool> g_dependent_launches{[] {
  const char* env = std::getenv("FOURBIT_DEPENDENT_LAUNCHES");
  return env == nullptr || std::string_view(env) != "0";
}()};

// Whether launch_dependent asks for the overlap: the switch is on and the device has compute
// capability 9.0 or more.
inline bool dependent_launches_on() {
  return g_dependent_launches.load(std::memory_order_relaxed) &&
         device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9;
}

// kernel<<<grid, block, smem, stream()>>>(args...), as a programmatic dependent launch where
// dependent_launches_on(), the launch checked (no FOURBIT_LAUNCH_CHECK needed after it). The kernel
// must follow the rules above.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream();
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launches_on() ? 1 : 0;
  FOURBIT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace fourbit::ops::cuda
