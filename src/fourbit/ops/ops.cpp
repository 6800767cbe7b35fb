// defines: the device dispatch of ops.h, nonfinite_seen
#include "fourbit/ops/ops.h"

#include <atomic>

#include "fourbit/ops/cpu/cpu_ops.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

namespace fourbit::ops {
namespace {
std::atomic<bool> g_nonfinite{false};

[[noreturn]] void no_cuda(const char* op) {
  fail("{}: tensor is on a CUDA device but this fourbit was built without CUDA", op);
}
}  // namespace

void raise_nonfinite() { g_nonfinite.store(true, std::memory_order_relaxed); }

bool nonfinite_seen(bool clear) {
  return clear ? g_nonfinite.exchange(false) : g_nonfinite.load();
}

#if FOURBIT_HAS_CUDA
#define FOURBIT_DISPATCH(dev, op, ...) \
  return (dev) == Device::CUDA ? cuda::op(__VA_ARGS__) : cpu::op(__VA_ARGS__)
#else
#define FOURBIT_DISPATCH(dev, op, ...) \
  do {                                 \
    if ((dev) == Device::CUDA) no_cuda(#op); \
    return cpu::op(__VA_ARGS__);       \
  } while (0)
#endif

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report) {
  FOURBIT_DISPATCH(x.device(), quantize, x, spec, rng, report);
}
Tensor dequantize(const QTensor& q, bool undo_hadamard) {
  FOURBIT_DISPATCH(q.device(), dequantize, q, undo_hadamard);
}
QTensor requantize_transposed(const QTensor& q, RngKey rng) {
  FOURBIT_DISPATCH(q.device(), requantize_transposed, q, rng);
}

}  // namespace fourbit::ops
