// defines: cuda::set_dependent_launches (cuda_ops.h; the switch lives in dependent_launch.cuh)
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"

namespace fourbit::ops::cuda {

void set_dependent_launches(bool on) { g_dependent_launches.store(on, std::memory_order_relaxed); }

}  // namespace fourbit::ops::cuda
