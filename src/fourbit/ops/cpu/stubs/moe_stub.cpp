// TEMPORARY (build scaffolding): compiled only while ops/cpu/moe.cpp does not exist, so the
// library links while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cpu/cpu_ops.h"
namespace fourbit::ops::cpu {
void router_topk(const Tensor&, int64_t, Tensor&, Tensor&, Tensor&) { fail("router_topk: not implemented yet"); }
void router_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&) { fail("router_backward: not implemented yet"); }
RoutePlan route_plan(const Tensor&, int64_t) { fail("route_plan: not implemented yet"); }
void gather_rows(const Tensor&, const Tensor&, Tensor&) { fail("gather_rows: not implemented yet"); }
QTensor gather_rows(const QTensor&, const Tensor&) { fail("gather_rows: not implemented yet"); }
void gather_rows_backward(const Tensor&, const Tensor&, Tensor&) { fail("gather_rows_backward: not implemented yet"); }
void moe_combine(const Tensor&, const Tensor&, const Tensor&, Tensor&) { fail("moe_combine: not implemented yet"); }
void moe_combine_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { fail("moe_combine_backward: not implemented yet"); }
}  // namespace fourbit::ops::cpu
