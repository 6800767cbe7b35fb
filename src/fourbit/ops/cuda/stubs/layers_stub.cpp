// TEMPORARY (build scaffolding): compiled only while ops/cuda/layers.cu does not exist, so CUDA
// builds link while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cuda/cuda_ops.h"
namespace fourbit::ops::cuda {
void embedding_forward(const Tensor&, const Tensor&, Tensor&) { fail("cuda embedding_forward: not implemented yet"); }
void embedding_backward(const Tensor&, const Tensor&, Tensor&) { fail("cuda embedding_backward: not implemented yet"); }
void rmsnorm_forward(const Tensor&, const Tensor&, float, Tensor&, Tensor&) { fail("cuda rmsnorm_forward: not implemented yet"); }
void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { fail("cuda rmsnorm_backward: not implemented yet"); }
void rope_forward(Tensor&, const Tensor&, const Tensor&) { fail("cuda rope_forward: not implemented yet"); }
void rope_backward(Tensor&, const Tensor&, const Tensor&) { fail("cuda rope_backward: not implemented yet"); }
void swiglu_forward(const Tensor&, const Tensor&, Tensor&) { fail("cuda swiglu_forward: not implemented yet"); }
void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { fail("cuda swiglu_backward: not implemented yet"); }
void cross_entropy(const Tensor&, const Tensor&, Tensor&, Tensor*, double) { fail("cuda cross_entropy: not implemented yet"); }
}  // namespace fourbit::ops::cuda
