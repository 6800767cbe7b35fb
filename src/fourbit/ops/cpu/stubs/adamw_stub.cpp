// TEMPORARY (build scaffolding): compiled only while ops/cpu/adamw.cpp does not exist, so the
// library links while that file is being written. Delete this folder once all of them exist.
#include "fourbit/ops/cpu/cpu_ops.h"
namespace fourbit::ops::cpu {
void adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const AdamW&) { fail("adamw_step: not implemented yet"); }
}  // namespace fourbit::ops::cpu
