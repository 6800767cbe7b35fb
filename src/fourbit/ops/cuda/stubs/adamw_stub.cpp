// TEMPORARY (build scaffolding): compiled only while ops/cuda/adamw.cu does not exist, so CUDA
// builds link while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cuda/cuda_ops.h"
namespace fourbit::ops::cuda {
void adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const AdamW&) { fail("cuda adamw_step: not implemented yet"); }
}  // namespace fourbit::ops::cuda
