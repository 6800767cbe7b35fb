// TEMPORARY (build scaffolding): compiled only while ops/cpu/layers.cpp does not exist, so the
// library links while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cpu/cpu_ops.h"
namespace fourbit::ops::cpu {
void embedding_forward(const Tensor&, const Tensor&, Tensor&) { fail("embedding_forward: not implemented yet"); }
void embedding_backward(const Tensor&, const Tensor&, Tensor&) { fail("embedding_backward: not implemented yet"); }
void rmsnorm_forward(const Tensor&, const Tensor&, float, Tensor&, Tensor&) { fail("rmsnorm_forward: not implemented yet"); }
void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { fail("rmsnorm_backward: not implemented yet"); }
void rope_forward(Tensor&, const Tensor&, const Tensor&) { fail("rope_forward: not implemented yet"); }
void rope_backward(Tensor&, const Tensor&, const Tensor&) { fail("rope_backward: not implemented yet"); }
void swiglu_forward(const Tensor&, const Tensor&, Tensor&) { fail("swiglu_forward: not implemented yet"); }
void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { fail("swiglu_backward: not implemented yet"); }
void cross_entropy(const Tensor&, const Tensor&, Tensor&, Tensor*, float) { fail("cross_entropy: not implemented yet"); }
}  // namespace fourbit::ops::cpu
