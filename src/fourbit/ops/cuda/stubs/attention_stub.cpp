// TEMPORARY (build scaffolding): compiled only while ops/cuda/attention.cu does not exist, so CUDA
// builds link while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cuda/cuda_ops.h"
namespace fourbit::ops::cuda {
void attention_forward(const Tensor&, const Tensor&, const Tensor&, int64_t, Tensor&, Tensor&) { fail("cuda attention_forward: not implemented yet"); }
void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&) { fail("cuda attention_backward: not implemented yet"); }
}  // namespace fourbit::ops::cuda
