// TEMPORARY (build scaffolding): compiled only while ops/cpu/attention.cpp does not exist, so the
// library links while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cpu/cpu_ops.h"
namespace fourbit::ops::cpu {
void attention_forward(const Tensor&, const Tensor&, const Tensor&, int64_t, Tensor&, Tensor&) { fail("attention_forward: not implemented yet"); }
void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&) { fail("attention_backward: not implemented yet"); }
}  // namespace fourbit::ops::cpu
