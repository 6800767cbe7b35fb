// TEMPORARY (build scaffolding): compiled only while ops/cuda/moe.cu does not exist, so CUDA
// builds link while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cuda/cuda_ops.h"
namespace fourbit::ops::cuda {
void router_topk(const Tensor&, int64_t, Tensor&, Tensor&, Tensor&) { fail("cuda router_topk: not implemented yet"); }
void router_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&) { fail("cuda router_backward: not implemented yet"); }
RoutePlan route_plan(const Tensor&, int64_t) { fail("cuda route_plan: not implemented yet"); }
void gather_rows(const Tensor&, const Tensor&, Tensor&) { fail("cuda gather_rows: not implemented yet"); }
QTensor gather_rows(const QTensor&, const Tensor&) { fail("cuda gather_rows: not implemented yet"); }
void gather_rows_backward(const Tensor&, const Tensor&, Tensor&) { fail("cuda gather_rows_backward: not implemented yet"); }
void moe_combine(const Tensor&, const Tensor&, const Tensor&, Tensor&) { fail("cuda moe_combine: not implemented yet"); }
void moe_combine_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { fail("cuda moe_combine_backward: not implemented yet"); }
}  // namespace fourbit::ops::cuda
