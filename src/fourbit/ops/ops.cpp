// defines: the device dispatch of ops.h, nonfinite_seen, Operand accessors, qtensor views, Lanes,
//          rope_table
#include "fourbit/ops/ops.h"

#include <atomic>
#include <cmath>
#include <exception>
#include <initializer_list>
#include <vector>

#include "fourbit/ops/cpu/cpu_ops.h"
#include "fourbit/ops/host_profile.h"
#include "fourbit/ops/quant_layout.h"
#include "fourbit/ops/tensor_checks.h"
#include "fourbit/tensor/device_memory.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

namespace fourbit::ops {
namespace {
std::atomic<bool> g_nonfinite{false};

// grad_norm_gate's output: F64 [kGateSize] on `dev`.
void expect_gate(const char* op, const Tensor& gate, Device dev) {
  expect_dims_on(dev, op, "gate", gate, DType::F64, {kGateSize}, "[4]");
}

// Every tensor of a list op (sum_squares_each, grad_norm_gate) defined and on the first one's
// device; `one` and `many` name them in the message ("tensor 1 is undefined").
void expect_one_device(const char* op, const std::vector<Tensor>& ts, const char* one, const char* many) {
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].defined()) fail("{}: {} {} is undefined", op, one, i);
    if (ts[i].device() != ts[0].device())
      fail("{}: {} on different devices ({} and {})", op, many, ts[0].str(), ts[i].str());
  }
}
}  // namespace

void raise_nonfinite() { g_nonfinite.store(true, std::memory_order_relaxed); }

bool nonfinite_seen(bool clear) {
  bool seen = clear ? g_nonfinite.exchange(false) : g_nonfinite.load();
#if FOURBIT_HAS_CUDA
  if (cuda_device_count() > 0) seen = cuda::take_nonfinite_flag(clear) || seen;
#endif
  return seen;
}

bool native_block_scaled_gemm(Device device) {
#if FOURBIT_HAS_CUDA
  return device == Device::CUDA && cuda_device_count() > 0 && cuda::native_block_scaled_gemm();
#else
  (void)device;
  return false;
#endif
}

// group_amax: F32 [groups of spec's outer scale over x] on x's device.
void check_group_amax(const Tensor& x, const QuantSpec& spec, const Tensor& a) {
  if (spec.fmt != Format::NVFP4 || spec.outer == OuterScale::None)
    fail("quantize: a group amax was given but {} has no outer scale", describe(spec));
  const QuantShape s = quant_shape(x, spec);
  const int64_t groups = spec.outer == OuterScale::Tensor     ? 1
                         : spec.outer == OuterScale::PerSlice ? s.slices
                                                              : s.slices * (spec.axis == BlockAxis::Row ? s.rows : s.cols);
  if (a.dtype() != DType::F32 || a.dim() != 1 || a.size(0) != groups || a.device() != x.device())
    fail("quantize: group amax must be f32 [{}] on the input's device, got {}", groups, a.str());
}

// One switch per op on the device of its first tensor; a CUDA tensor in a CPU-only build fails
// with a message instead of reaching a missing symbol.
// Each is timed on the host with FOURBIT_HOST_PROFILE=1 (host_profile.h).
#if FOURBIT_HAS_CUDA
#define FOURBIT_DISPATCH(dev, op, ...)                                             \
  do {                                                                             \
    const HostOpTimer host_timer_(#op);                                            \
    return (dev) == Device::CUDA ? cuda::op(__VA_ARGS__) : cpu::op(__VA_ARGS__);   \
  } while (0)
#else
#define FOURBIT_DISPATCH(dev, op, ...)                                                         \
  do {                                                                                         \
    const HostOpTimer host_timer_(#op);                                                        \
    if ((dev) == Device::CUDA)                                                                 \
      fail("{}: tensor is on a CUDA device but this fourbit was built without CUDA", #op);     \
    return cpu::op(__VA_ARGS__);                                                               \
  } while (0)
#endif

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report, const Tensor* group_amax,
                 FormOut form) {
  if (group_amax) check_group_amax(x, spec, *group_amax);
  FOURBIT_DISPATCH(x.device(), quantize, x, spec, rng, report, group_amax, form);
}
Tensor outer_amax(const std::vector<Tensor>& xs, const QuantSpec& spec) {
  if (xs.empty()) fail("outer_amax: no tensors");
  for (const Tensor& x : xs) {
    if (x.shape() != xs[0].shape() || x.device() != xs[0].device())
      fail("outer_amax: tensors of one shape and device expected, got {} and {}", xs[0].str(), x.str());
  }
  if (spec.fmt != Format::NVFP4 || spec.outer == OuterScale::None)
    fail("outer_amax: {} has no outer scale", describe(spec));
  FOURBIT_DISPATCH(xs[0].device(), outer_amax, xs, spec);
}
Tensor dequantize(const QTensor& q, bool undo_hadamard) {
  FOURBIT_DISPATCH(q.device(), dequantize, q, undo_hadamard);
}
QTensor requantize_transposed(const QTensor& q, const QuantSpec& target, RngKey rng, FormOut form) {
  FOURBIT_DISPATCH(q.device(), requantize_transposed, q, target, rng, form);
}

int64_t Operand::rows() const {
  if (q_) return q_->total_rows();
  return trans_ ? dense_->size(1) : dense_->size(0);
}
int64_t Operand::k() const {
  if (q_) return q_->cols;
  return trans_ ? dense_->size(0) : dense_->size(1);
}
Device Operand::device() const { return q_ ? q_->device() : dense_->device(); }

Lanes::Lanes(Device device, int n) : active_(device == Device::CUDA && n > 1 && !lanes_open()) {
  if (active_) lanes_begin(n);
}
Lanes::~Lanes() noexcept(false) {
  if (!active_) return;
  if (std::uncaught_exceptions() == 0) {
    lanes_end();
    return;
  }
  try {
    lanes_end();
  } catch (const std::exception&) {
  }
}
void Lanes::use(int64_t i) {
  if (active_) lanes_use(int(i));
}

namespace {
void check_gemm_args(const char* op, const Operand& a, const Operand& b, const Tensor& c) {
  if (a.device() != b.device() || a.device() != c.device()) fail("{}: operands and output must be on one device", op);
  if (a.k() != b.k()) fail("{}: reduction sizes differ: A has K={}, B has K={}", op, a.k(), b.k());
  if (c.dim() != 2 || c.size(0) != a.rows() || c.size(1) != b.rows())
    fail("{}: output {} does not match [{}, {}]", op, c.str(), a.rows(), b.rows());
}
}  // namespace

void gemm(const Operand& a, const Operand& b, Tensor& c, bool accumulate) {
  check_gemm_args("gemm", a, b, c);
  FOURBIT_DISPATCH(c.device(), gemm, a, b, c, accumulate);
}

namespace {
// offsets: G + 1 >= 2 non-decreasing values from 0 to `rows` (of `what`); returns G.
int64_t check_row_offsets(const char* op, const std::vector<int64_t>& offsets, int64_t rows, const char* what) {
  const int64_t G = int64_t(offsets.size()) - 1;
  if (G < 1) fail("{}: offsets must hold at least 2 values, got {}", op, offsets.size());
  for (int64_t g = 0; g < G; ++g)
    if (offsets[size_t(g)] > offsets[size_t(g) + 1])
      fail("{}: offsets must not decrease (offsets[{}] = {} > offsets[{}] = {})", op, g, offsets[size_t(g)], g + 1,
           offsets[size_t(g) + 1]);
  if (offsets.front() != 0 || offsets.back() != rows)
    fail("{}: offsets must run from 0 to {}'s {} rows, got {} .. {}", op, what, rows, offsets.front(),
         offsets.back());
  return G;
}

// f(r0, r1, g) for every non-empty segment g of the checked offsets; empty ones stay QTensor{}.
template <typename F>
std::vector<QTensor> per_segment(const std::vector<int64_t>& offsets, F&& f) {
  std::vector<QTensor> out(offsets.size() - 1);
  for (size_t g = 0; g < out.size(); ++g)
    if (offsets[g] < offsets[g + 1]) out[g] = f(offsets[g], offsets[g + 1], g);
  return out;
}
}  // namespace

std::vector<QTensor> quantize_segments(const Tensor& x, const std::vector<int64_t>& offsets,
                                       const QuantSpec& spec, const std::vector<RngKey>& rngs) {
  const HostOpTimer host_timer("quantize_segments");
  if (x.dim() != 2) fail("quantize_segments: x must be 2-D [rows, cols], got {}", x.str());
  const int64_t G = check_row_offsets("quantize_segments", offsets, x.size(0), "x");
  if (int64_t(rngs.size()) != G) fail("quantize_segments: {} keys for {} segments", rngs.size(), G);
  std::vector<QTensor> out;
#if FOURBIT_HAS_CUDA
  if (x.device() == Device::CUDA && cuda::quantize_segments(x, offsets, spec, rngs, out)) return out;
#endif
  return per_segment(offsets,
                     [&](int64_t r0, int64_t r1, size_t g) { return quantize(x.slice_rows(r0, r1), spec, rngs[g]); });
}

bool row_col_one_pass(const QuantSpec& row_spec, const QuantSpec& col_spec) {
  const bool mx = row_spec.fmt == Format::MXFP8_E4M3 || row_spec.fmt == Format::MXFP8_E5M2;
  return mx && col_spec.fmt == row_spec.fmt && row_spec.hadamard == 0 && col_spec.hadamard == 0;
}

namespace {
void check_row_col_axes(const char* op, const QuantSpec& row_spec, const QuantSpec& col_spec) {
  if (row_spec.axis != BlockAxis::Row || col_spec.axis != BlockAxis::Col)
    fail("{}: the first spec must be Row-axis and the second Col-axis, got {} and {}", op, describe(row_spec),
         describe(col_spec));
}
}  // namespace

RowColQuant quantize_row_col(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                             const std::vector<int64_t>& offsets, const std::vector<RngKey>& col_rngs, FormOut row_out,
                             FormOut col_out) {
  const HostOpTimer host_timer("quantize_row_col");
  if (x.dim() != 2) fail("quantize_row_col: x must be 2-D [rows, cols], got {}", x.str());
  check_row_col_axes("quantize_row_col", row_spec, col_spec);
  const int64_t G = check_row_offsets("quantize_row_col", offsets, x.size(0), "x");
  if (int64_t(col_rngs.size()) != G) fail("quantize_row_col: {} keys for {} segments", col_rngs.size(), G);
  RowColQuant out;
#if FOURBIT_HAS_CUDA
  if (x.device() == Device::CUDA &&
      cuda::quantize_row_col(x, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, col_out, out))
    return out;
#else
  (void)row_out;
  (void)col_out;
#endif
  out.row = quantize(x, row_spec, row_rng);
  out.col = quantize_segments(x, offsets, col_spec, col_rngs);
  return out;
}

namespace {
// token_of_slot as the gathered row_col forms take it: i32[M] on x's device.
void check_token_of_slot(const char* op, const Tensor& token_of_slot, const Tensor& x) {
  if (!token_of_slot.defined() || token_of_slot.dim() != 1 || token_of_slot.dtype() != DType::I32 ||
      token_of_slot.device() != x.device())
    fail("{}: token_of_slot must be i32[M] on x's device, got {}{}", op, str_or_undef(token_of_slot),
         token_of_slot.defined() ? token_of_slot.str() : "");
}
// The specs, offsets and keys of a *_device_offsets form: a Row-axis and a Col-axis spec (as
// quantize_row_col checks them), offsets I32 [G + 1], G >= 1, on `dev`, and G keys in each set.
void check_device_segments(const char* op, const QuantSpec& row_spec, const QuantSpec& col_spec, const Tensor& offsets,
                           Device dev, std::initializer_list<size_t> key_counts) {
  check_row_col_axes(op, row_spec, col_spec);
  if (!offsets.defined() || offsets.dim() != 1 || offsets.dtype() != DType::I32 || offsets.device() != dev ||
      offsets.size(0) < 2)
    fail("{}: offsets must be i32[G + 1] with G >= 1 on {}, got {}{}", op, device_name(dev), str_or_undef(offsets),
         offsets.defined() ? offsets.str() : "");
  const int64_t G = offsets.size(0) - 1;
  for (const size_t n : key_counts)
    if (int64_t(n) != G) fail("{}: {} keys for {} segments", op, n, G);
}
std::vector<int64_t> offsets_on_host(const Tensor& offsets) {
  const Tensor h = offsets.to(Device::CPU);
  return std::vector<int64_t>(h.data<int32_t>(), h.data<int32_t>() + h.numel());
}
// A quantize_row_col result on host offsets in the *_device_offsets form: each segment's Col form
// decoded (exactly: MXFP8 values are BF16 values) into its rows of col_rows.
RowColQuant col_forms_as_rows(RowColQuant q, const std::vector<int64_t>& offsets, int64_t cols, Device dev) {
  q.col_rows = Tensor::empty({offsets.back(), cols}, DType::BF16, dev);
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    if (offsets[g] == offsets[g + 1]) continue;
    Tensor rows = q.col_rows.slice_rows(offsets[g], offsets[g + 1]);
    convert(dequantize(q.col[g]), rows);
  }
  q.col.clear();
  return q;
}
}  // namespace

RowColQuant quantize_row_col_device_offsets(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng,
                                            const QuantSpec& col_spec, const Tensor& offsets,
                                            const std::vector<RngKey>& col_rngs, FormOut row_out) {
  const char* op = "quantize_row_col_device_offsets";
  const HostOpTimer host_timer(op);
  if (x.dim() != 2) fail("{}: x must be 2-D [rows, cols], got {}", op, x.str());
  check_device_segments(op, row_spec, col_spec, offsets, x.device(), {col_rngs.size()});
#if FOURBIT_HAS_CUDA
  RowColQuant out;
  if (x.device() == Device::CUDA &&
      cuda::quantize_row_col_device_offsets(x, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, out))
    return out;
#endif
  const std::vector<int64_t> h = offsets_on_host(offsets);
  return col_forms_as_rows(quantize_row_col(x, row_spec, row_rng, col_spec, h, col_rngs, row_out, FormOut::Codes), h,
                           x.size(1), x.device());
}

RowColQuant gather_quantize_row_col_device_offsets(const Tensor& x, const Tensor& token_of_slot,
                                                   const QuantSpec& row_spec, RngKey row_rng,
                                                   const QuantSpec& col_spec, const Tensor& offsets,
                                                   const std::vector<RngKey>& col_rngs, FormOut row_out) {
  const char* op = "gather_quantize_row_col_device_offsets";
  const HostOpTimer host_timer(op);
  if (x.dim() != 2) fail("{}: x must be 2-D [N, D], got {}", op, x.str());
  check_token_of_slot(op, token_of_slot, x);
  check_device_segments(op, row_spec, col_spec, offsets, x.device(), {col_rngs.size()});
#if FOURBIT_HAS_CUDA
  RowColQuant out;
  if (x.device() == Device::CUDA && cuda::gather_quantize_row_col_device_offsets(x, token_of_slot, row_spec, row_rng,
                                                                                 col_spec, offsets, col_rngs, row_out, out))
    return out;
#endif
  const std::vector<int64_t> h = offsets_on_host(offsets);
  return col_forms_as_rows(
      gather_quantize_row_col(x, token_of_slot, row_spec, row_rng, col_spec, h, col_rngs, row_out, FormOut::Codes), h,
      x.size(1), x.device());
}

RowColQuant gather_quantize_row_col(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec,
                                    RngKey row_rng, const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                    const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out) {
  const HostOpTimer host_timer("gather_quantize_row_col");
  const char* op = "gather_quantize_row_col";
  if (x.dim() != 2) fail("{}: x must be 2-D [N, D], got {}", op, x.str());
  check_token_of_slot(op, token_of_slot, x);
  check_row_col_axes(op, row_spec, col_spec);
  const int64_t G = check_row_offsets(op, offsets, token_of_slot.size(0), "token_of_slot");
  if (int64_t(col_rngs.size()) != G) fail("{}: {} keys for {} segments", op, col_rngs.size(), G);
  RowColQuant out;
#if FOURBIT_HAS_CUDA
  if (x.device() == Device::CUDA && cuda::gather_quantize_row_col(x, token_of_slot, row_spec, row_rng, col_spec,
                                                                  offsets, col_rngs, row_out, col_out, out))
    return out;
#endif
  Tensor x_perm = Tensor::empty({token_of_slot.size(0), x.size(1)}, x.dtype(), x.device());
  gather_rows(x, token_of_slot, x_perm);
  return quantize_row_col(x_perm, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, col_out);
}

RowColQuant moe_combine_backward_row_col(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                                         const Tensor& w, Tensor& dw, const QuantSpec& row_spec, RngKey row_rng,
                                         const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                         const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out) {
  const HostOpTimer host_timer("moe_combine_backward_row_col");
  const char* op = "moe_combine_backward_row_col";
  if (!y_perm.defined() || y_perm.dim() != 2)
    fail("{}: y_perm must be 2-D [M, D], got {}{}", op, str_or_undef(y_perm), y_perm.defined() ? y_perm.str() : "");
  check_row_col_axes(op, row_spec, col_spec);
  const int64_t G = check_row_offsets(op, offsets, y_perm.size(0), "y_perm");
  if (int64_t(col_rngs.size()) != G) fail("{}: {} keys for {} segments", op, col_rngs.size(), G);
  RowColQuant out;
#if FOURBIT_HAS_CUDA
  if (dout.device() == Device::CUDA && cuda::moe_combine_backward_row_col(dout, y_perm, slot_of, w, dw, row_spec,
                                                                         row_rng, col_spec, offsets, col_rngs,
                                                                         row_out, col_out, out))
    return out;
#endif
  Tensor dy_perm = Tensor::empty(y_perm.shape(), dout.dtype(), dout.device());
  moe_combine_backward(dout, y_perm, slot_of, w, dy_perm, dw);
  return quantize_row_col(dy_perm, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, col_out);
}

RowColQuant moe_combine_backward_row_col_device_offsets(const Tensor& dout, const Tensor& y_perm,
                                                        const Tensor& slot_of, const Tensor& w, Tensor& dw,
                                                        const QuantSpec& row_spec, RngKey row_rng,
                                                        const QuantSpec& col_spec, const Tensor& offsets,
                                                        const std::vector<RngKey>& col_rngs, FormOut row_out) {
  const char* op = "moe_combine_backward_row_col_device_offsets";
  const HostOpTimer host_timer(op);
  if (!y_perm.defined() || y_perm.dim() != 2)
    fail("{}: y_perm must be 2-D [M, D], got {}{}", op, str_or_undef(y_perm), y_perm.defined() ? y_perm.str() : "");
  check_device_segments(op, row_spec, col_spec, offsets, y_perm.device(), {col_rngs.size()});
#if FOURBIT_HAS_CUDA
  RowColQuant out;
  if (dout.device() == Device::CUDA &&
      cuda::moe_combine_backward_row_col_device_offsets(dout, y_perm, slot_of, w, dw, row_spec, row_rng, col_spec,
                                                        offsets, col_rngs, row_out, out))
    return out;
#endif
  const std::vector<int64_t> h = offsets_on_host(offsets);
  return col_forms_as_rows(moe_combine_backward_row_col(dout, y_perm, slot_of, w, dw, row_spec, row_rng, col_spec, h,
                                                        col_rngs, row_out, FormOut::Codes),
                           h, y_perm.size(1), y_perm.device());
}

RowColQuant swiglu_forward_row_col(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, RngKey row_rng,
                                   const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                   const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out) {
  const HostOpTimer host_timer("swiglu_forward_row_col");
  const char* op = "swiglu_forward_row_col";
  if (h1.dim() != 2) fail("{}: h1 must be 2-D [rows, F], got {}", op, h1.str());
  if (h3.shape() != h1.shape()) fail("{}: h3 {} must have h1's shape {}", op, h3.str(), h1.str());
  check_row_col_axes(op, row_spec, col_spec);
  if (!offsets.empty()) {
    const int64_t G = check_row_offsets(op, offsets, h1.size(0), "h1");
    if (int64_t(col_rngs.size()) != G) fail("{}: {} keys for {} segments", op, col_rngs.size(), G);
  }
  RowColQuant out;
#if FOURBIT_HAS_CUDA
  if (h1.device() == Device::CUDA &&
      cuda::swiglu_forward_row_col(h1, h3, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, col_out, out))
    return out;
#endif
  Tensor a = Tensor::empty(h1.shape(), h1.dtype(), h1.device());
  swiglu_forward(h1, h3, a);
  if (offsets.empty()) {
    out.row = quantize(a, row_spec, row_rng);
    return out;
  }
  return quantize_row_col(a, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, col_out);
}

RowColQuant swiglu_forward_row_col_device_offsets(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                                                  RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                                  const std::vector<RngKey>& col_rngs, FormOut row_out) {
  const char* op = "swiglu_forward_row_col_device_offsets";
  const HostOpTimer host_timer(op);
  if (h1.dim() != 2) fail("{}: h1 must be 2-D [rows, F], got {}", op, h1.str());
  if (h3.shape() != h1.shape()) fail("{}: h3 {} must have h1's shape {}", op, h3.str(), h1.str());
  check_device_segments(op, row_spec, col_spec, offsets, h1.device(), {col_rngs.size()});
#if FOURBIT_HAS_CUDA
  RowColQuant out;
  if (h1.device() == Device::CUDA &&
      cuda::swiglu_forward_row_col_device_offsets(h1, h3, row_spec, row_rng, col_spec, offsets, col_rngs, row_out, out))
    return out;
#endif
  const std::vector<int64_t> h = offsets_on_host(offsets);
  return col_forms_as_rows(
      swiglu_forward_row_col(h1, h3, row_spec, row_rng, col_spec, h, col_rngs, row_out, FormOut::Codes), h,
      h1.size(1), h1.device());
}

std::array<RowColQuant, 2> swiglu_backward_row_col(const Tensor& da, const Tensor& h1, const Tensor& h3,
                                                   const QuantSpec& row_spec, const std::array<RngKey, 2>& row_rngs,
                                                   const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                                   const std::array<std::vector<RngKey>, 2>& col_rngs,
                                                   FormOut row_out, FormOut col_out) {
  const HostOpTimer host_timer("swiglu_backward_row_col");
  const char* op = "swiglu_backward_row_col";
  if (da.dim() != 2) fail("{}: da must be 2-D [rows, F], got {}", op, da.str());
  if (h1.shape() != da.shape() || h3.shape() != da.shape())
    fail("{}: h1 {} and h3 {} must have da's shape {}", op, h1.str(), h3.str(), da.str());
  check_row_col_axes(op, row_spec, col_spec);
  const int64_t G = check_row_offsets(op, offsets, da.size(0), "da");
  for (const std::vector<RngKey>& keys : col_rngs)
    if (int64_t(keys.size()) != G) fail("{}: {} keys for {} segments", op, keys.size(), G);
  std::array<RowColQuant, 2> out;
#if FOURBIT_HAS_CUDA
  if (da.device() == Device::CUDA &&
      cuda::swiglu_backward_row_col(da, h1, h3, row_spec, row_rngs, col_spec, offsets, col_rngs, row_out, col_out, out))
    return out;
#endif
  Tensor dh1 = Tensor::empty(da.shape(), da.dtype(), da.device()), dh3 = Tensor::empty(da.shape(), da.dtype(), da.device());
  swiglu_backward(da, h1, h3, dh1, dh3);
  out[0] = quantize_row_col(dh1, row_spec, row_rngs[0], col_spec, offsets, col_rngs[0], row_out, col_out);
  out[1] = quantize_row_col(dh3, row_spec, row_rngs[1], col_spec, offsets, col_rngs[1], row_out, col_out);
  return out;
}

std::array<RowColQuant, 2> swiglu_backward_row_col_device_offsets(
    const Tensor& da, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
    const std::array<RngKey, 2>& row_rngs, const QuantSpec& col_spec, const Tensor& offsets,
    const std::array<std::vector<RngKey>, 2>& col_rngs, FormOut row_out) {
  const char* op = "swiglu_backward_row_col_device_offsets";
  const HostOpTimer host_timer(op);
  if (da.dim() != 2) fail("{}: da must be 2-D [rows, F], got {}", op, da.str());
  if (h1.shape() != da.shape() || h3.shape() != da.shape())
    fail("{}: h1 {} and h3 {} must have da's shape {}", op, h1.str(), h3.str(), da.str());
  check_device_segments(op, row_spec, col_spec, offsets, da.device(), {col_rngs[0].size(), col_rngs[1].size()});
  std::array<RowColQuant, 2> out;
#if FOURBIT_HAS_CUDA
  if (da.device() == Device::CUDA && cuda::swiglu_backward_row_col_device_offsets(da, h1, h3, row_spec, row_rngs,
                                                                                  col_spec, offsets, col_rngs, row_out,
                                                                                  out))
    return out;
#endif
  const std::vector<int64_t> h = offsets_on_host(offsets);
  out = swiglu_backward_row_col(da, h1, h3, row_spec, row_rngs, col_spec, h, col_rngs, row_out, FormOut::Codes);
  for (RowColQuant& q : out) q = col_forms_as_rows(std::move(q), h, da.size(1), da.device());
  return out;
}

BothAxes quantize_both(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                       RngKey col_rng, FormOut row_out, FormOut col_out) {
  const HostOpTimer host_timer("quantize_both");
  check_row_col_axes("quantize_both", row_spec, col_spec);
  BothAxes out;
#if FOURBIT_HAS_CUDA
  if (x.device() == Device::CUDA &&
      cuda::quantize_both(x, row_spec, row_rng, col_spec, col_rng, row_out, col_out, out.row, out.col))
    return out;
#else
  (void)row_out;
  (void)col_out;
#endif
  out.row = quantize(x, row_spec, row_rng);
  out.col = quantize(x, col_spec, col_rng);
  return out;
}

std::vector<BothAxes> quantize_both_each(const std::vector<BothJob>& jobs) {
  const HostOpTimer host_timer("quantize_both_each");
  bool all_cuda = !jobs.empty();
  for (const BothJob& j : jobs) {
    check_row_col_axes("quantize_both_each", j.row_spec, j.col_spec);
    all_cuda = all_cuda && j.x.device() == Device::CUDA;
  }
  std::vector<BothAxes> out;
#if FOURBIT_HAS_CUDA
  if (all_cuda && cuda::quantize_both_each(jobs, out)) return out;
#else
  (void)all_cuda;
#endif
  out.clear();
  for (const BothJob& j : jobs)
    out.push_back(quantize_both(j.x, j.row_spec, j.row_rng, j.col_spec, j.col_rng, j.row_out, j.col_out));
  return out;
}

void quantize_both_each_into(const std::vector<BothJob>& jobs, std::vector<BothAxes>& into) {
  const HostOpTimer host_timer("quantize_both_each_into");
  if (into.size() != jobs.size())
    fail("quantize_both_each_into: {} forms to write into for {} jobs", into.size(), jobs.size());
  bool all_cuda = !jobs.empty();
  for (const BothJob& j : jobs) {
    check_row_col_axes("quantize_both_each_into", j.row_spec, j.col_spec);
    all_cuda = all_cuda && j.x.device() == Device::CUDA;
  }
#if FOURBIT_HAS_CUDA
  if (all_cuda && cuda::quantize_both_each(jobs, into, true)) return;
#else
  (void)all_cuda;
#endif
  const std::vector<BothAxes> made = quantize_both_each(jobs);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const QTensor* have[2] = {&made[i].row, &made[i].col};
    QTensor* dst[2] = {&into[i].row, &into[i].col};
    for (int f = 0; f < 2; ++f) {
      const QTensor &m = *have[f];
      QTensor& d = *dst[f];
      if (m.fmt != d.fmt || m.axis != d.axis || m.slices != d.slices || m.rows != d.rows || m.cols != d.cols ||
          m.codes.defined() != d.codes.defined() || m.bf16.defined() != d.bf16.defined() ||
          m.outer_scales.defined() != d.outer_scales.defined())
        fail("quantize_both_each_into: job {}'s {} form does not match the form to write into", i,
             f == 0 ? "Row" : "Col");
      for (const auto& [src, out] : {std::pair{&m.codes, &d.codes}, std::pair{&m.block_scales, &d.block_scales},
                                     std::pair{&m.outer_scales, &d.outer_scales}, std::pair{&m.bf16, &d.bf16}})
        if (src->defined()) out->copy_from(*src);
    }
  }
}

std::vector<QTensor> requantize_transposed_segments(const QTensor& q, const std::vector<int64_t>& offsets,
                                                    const QuantSpec& target, const std::vector<RngKey>& rngs,
                                                    FormOut form) {
  const HostOpTimer host_timer("requantize_transposed_segments");
  if (q.slices != 1 || q.axis != BlockAxis::Row)
    fail("requantize_transposed_segments: q must be a single-slice Row-axis QTensor (slices {}, axis {})", q.slices,
         q.axis == BlockAxis::Row ? "row" : "col");
  const int64_t G = check_row_offsets("requantize_transposed_segments", offsets, q.rows, "q");
  if (int64_t(rngs.size()) != G) fail("requantize_transposed_segments: {} keys for {} segments", rngs.size(), G);
  std::vector<QTensor> out;
#if FOURBIT_HAS_CUDA
  if (q.device() == Device::CUDA && cuda::requantize_transposed_segments(q, offsets, target, rngs, form, out))
    return out;
#endif
  return per_segment(offsets, [&](int64_t r0, int64_t r1, size_t g) {
    return requantize_transposed(qtensor_rows(q, r0, r1), target, rngs[g], form);
  });
}

QTensor with_decode(QTensor q) {
  if (q.device() != Device::CUDA || q.bf16.defined() || !q.codes.defined()) return q;
#if FOURBIT_HAS_CUDA
  const HostOpTimer host_timer("with_decode");
  q.bf16 = cuda::decode_bf16(q);
#endif
  return q;
}

namespace {
// B's group shape (N, K) of a grouped GEMM of G groups, after checking a, b and c (grouped_gemm's
// comment in ops.h).
std::pair<int64_t, int64_t> grouped_shape(const char* op, const Operand& a, const Operand& b, int64_t G,
                                          const Tensor& c) {
  if (a.trans() || (a.dense() && a.dense()->dim() != 2))
    fail("{}: a dense A must be [M, K], not transposed; got {}", op, a.dense()->str());
  // B's groups: a QTensor's slices, or a dense [G, N, K] ([G, K, N] transposed) / [G * N, K].
  const QTensor* qb = b.q();
  const Tensor* db = b.dense();
  if (db && !(db->dim() == 3 || (db->dim() == 2 && !b.trans())))
    fail("{}: a dense B must be [G, N, K], [G, K, N] transposed or [G * N, K]; got {}", op, db->str());
  const int64_t slices = qb ? qb->slices : db->dim() == 3 ? db->size(0) : G;
  if (slices != G) fail("{}: B has {} slices for {} groups", op, slices, G);
  int64_t bn = 0, bk = 0;
  if (qb) {
    bn = qb->rows;
    bk = qb->cols;
  } else if (db->dim() == 3) {
    bn = db->size(b.trans() ? 2 : 1);
    bk = db->size(b.trans() ? 1 : 2);
  } else {
    if (db->size(0) % G != 0) fail("{}: a dense B of {} rows does not split into {} groups", op, db->size(0), G);
    bn = db->size(0) / G;
    bk = db->size(1);
  }
  if (a.k() != bk) fail("{}: reduction sizes differ: A has K={}, B has K={}", op, a.k(), bk);
  if (a.device() != b.device() || a.device() != c.device()) fail("{}: operands and output must be on one device", op);
  if (c.dim() != 2 || c.size(0) != a.rows() || c.size(1) != bn)
    fail("{}: output {} does not match [{}, {}]", op, c.str(), a.rows(), bn);
  return {bn, bk};
}
}  // namespace

void grouped_gemm(const Operand& a, const Operand& b, const std::vector<int64_t>& offsets, Tensor& c,
                  bool accumulate) {
  const HostOpTimer host_timer("grouped_gemm");
  const int64_t G = check_row_offsets("grouped_gemm", offsets, a.rows(), "A");
  const auto [bn, bk] = grouped_shape("grouped_gemm", a, b, G, c);
  const QTensor* qb = b.q();
  const Tensor* db = b.dense();
#if FOURBIT_HAS_CUDA
  if (c.device() == Device::CUDA && cuda::grouped_gemm(a, b, offsets, bn, bk, c, accumulate)) return;
#endif
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[size_t(g)], r1 = offsets[size_t(g) + 1];
    if (r0 == r1) continue;
    QTensor qa_rows, qb_slice;
    Tensor da_rows, db_slice, cg = c.slice_rows(r0, r1);
    if (a.q()) qa_rows = qtensor_rows(*a.q(), r0, r1);
    else da_rows = a.dense()->slice_rows(r0, r1);
    if (qb) qb_slice = qtensor_slice(*qb, g);
    else db_slice = db->view(g * bn * bk, b.trans() ? Shape{bk, bn} : Shape{bn, bk});
    gemm(a.q() ? Operand(qa_rows) : Operand(da_rows), qb ? Operand(qb_slice) : Operand(db_slice, b.trans()), cg,
         accumulate);
  }
}

bool grouped_gemm_reads_device_offsets(Device device, int64_t groups, int64_t k) {
#if FOURBIT_HAS_CUDA
  if (device == Device::CUDA) return cuda::grouped_gemm_reads_device_offsets(groups, k);
#endif
  (void)device, (void)groups, (void)k;
  return false;
}

void grouped_gemm_device_offsets(const Operand& a, const Operand& b, const Tensor& offsets, Tensor& c,
                                 bool accumulate) {
  const char* op = "grouped_gemm_device_offsets";
  // G: B's slices where B says (a QTensor, a dense [G, N, K] or [G, K, N]), else the offsets'
  const int64_t slices = b.q() ? b.q()->slices : b.dense() && b.dense()->dim() == 3 ? b.dense()->size(0) : -1;
  if (!offsets.defined() || offsets.dtype() != DType::I32 || offsets.dim() != 1 ||
      (slices >= 0 ? offsets.size(0) != slices + 1 : offsets.size(0) < 2) || offsets.device() != c.device())
    fail("{}: offsets must be I32 [G + 1] = [{}] on the operands' device, got {}", op,
         slices >= 0 ? std::to_string(slices + 1) : "G + 1 >= 2",
         offsets.defined() ? offsets.str() : "an undefined tensor");
  const auto [bn, bk] = grouped_shape(op, a, b, offsets.size(0) - 1, c);
#if FOURBIT_HAS_CUDA
  if (c.device() == Device::CUDA) {
    const HostOpTimer host_timer("grouped_gemm");
    if (cuda::grouped_gemm_device_offsets(a, b, offsets, bn, bk, c, accumulate)) return;
  }
#else
  (void)bn, (void)bk;
#endif
  const Tensor host = offsets.to(Device::CPU);
  const std::vector<int64_t> off(host.data<int32_t>(), host.data<int32_t>() + host.numel());
  grouped_gemm(a, b, off, c, accumulate);
}

namespace {
std::atomic<int64_t> g_grouped_wgrad_device_offsets_calls{0};
}
int64_t grouped_wgrad_device_offsets_calls() { return g_grouped_wgrad_device_offsets_calls.load(); }

void grouped_wgrad_device_offsets(const std::vector<WgradSet>& sets, const Tensor& offsets, bool accumulate) {
  const char* op = "grouped_wgrad_device_offsets";
  if (sets.empty()) return;
  g_grouped_wgrad_device_offsets_calls.fetch_add(1, std::memory_order_relaxed);
  const auto name = [](const Tensor* t) { return t && t->defined() ? t->str() : std::string("an undefined tensor"); };
  const Tensor* a0 = sets[0].a;
  for (size_t s = 0; s < sets.size(); ++s) {
    const Tensor *a = sets[s].a, *b = sets[s].b;
    if (!a || !b || !a->defined() || !b->defined() || a->dim() != 2 || b->dim() != 2 || a->dtype() != b->dtype() ||
        a->size(0) != b->size(0) || a->device() != b->device())
      fail("{}: set {}: a and b must be [M, R] and [M, C] tensors of one dtype on one device, got {} and {}", op, s,
           name(a), name(b));
    if (a->dtype() != DType::BF16 && a->dtype() != DType::F32 && a->dtype() != DType::F64)
      fail("{}: set {}: a and b must be BF16, F32 or F64, got {}", op, s, a->str());
    if (s > 0 && (a->dtype() != a0->dtype() || a->shape() != a0->shape() || b->shape() != sets[0].b->shape() ||
                  a->device() != a0->device()))
      fail("{}: set {} ({} and {}) differs from set 0 ({} and {}) in dtype, shape or device", op, s, a->str(),
           b->str(), a0->str(), sets[0].b->str());
  }
  const DType out = a0->dtype() == DType::F64 ? DType::F64 : DType::F32;
  if (!offsets.defined() || offsets.dtype() != DType::I32 || offsets.dim() != 1 || offsets.size(0) < 2 ||
      offsets.device() != a0->device())
    fail("{}: offsets must be I32 [G + 1] (G >= 1) on the operands' device, got {}", op, name(&offsets));
  const int64_t M = a0->size(0), R = a0->size(1), C = sets[0].b->size(1), G = offsets.size(0) - 1;
  for (size_t s = 0; s < sets.size(); ++s) {
    const Tensor* c = sets[s].c;
    if (!c || !c->defined() || c->dtype() != out || c->dim() != 3 || c->size(0) != G || c->size(1) != R ||
        c->size(2) != C || c->device() != a0->device())
      fail("{}: set {}: c must be {} [{}, {}, {}] on the operands' device, got {}", op, s, dtype_name(out), G, R, C,
           name(c));
  }
  const HostOpTimer host_timer(op);
#if FOURBIT_HAS_CUDA
  if (a0->device() == Device::CUDA && a0->dtype() == DType::BF16) {
    std::vector<cuda::KDeviceSet> ks;
    for (const WgradSet& s : sets) ks.push_back({s.a->raw(), s.b->raw(), s.c->data<float>()});
    if (cuda::grouped_gemm_k_device_offsets(ks, R, C, M, offsets.data<int32_t>(), G, R, C, accumulate)) return;
  }
#endif
  const Tensor host = offsets.to(Device::CPU);
  const int32_t* off = host.data<int32_t>();
  for (int64_t g = 0; g <= G; ++g) {
    const int64_t lo = g == 0 ? 0 : off[g - 1];
    if (off[g] < lo || off[g] > M)
      fail("{}: offsets[{}] = {} must lie in [{}, {}] (offsets never decrease and stay within the {} rows of a "
           "and b)", op, g, off[g], lo, M, M);
  }
  const size_t n = sets.size() * size_t(G);
  std::vector<Tensor> as, bs, outs, empty;
  as.reserve(n);  // the jobs point at them
  bs.reserve(n);
  outs.reserve(n);
  std::vector<GemmJob> jobs;
  for (const WgradSet& s : sets)
    for (int64_t g = 0; g < G; ++g) {
      Tensor slice = s.c->view(g * R * C, {R, C});
      if (off[g] == off[g + 1]) {
        if (!accumulate) empty.push_back(slice);
        continue;
      }
      as.push_back(s.a->slice_rows(off[g], off[g + 1]));
      bs.push_back(s.b->slice_rows(off[g], off[g + 1]));
      outs.push_back(slice);
      jobs.push_back(GemmJob{Operand(as.back(), true), Operand(bs.back(), true), &outs.back(), accumulate});
    }
  zero_each(empty);
  gemm_batch_grouped(jobs);
}

void grouped_wgrad_device_offsets(const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& c,
                                  bool accumulate) {
  grouped_wgrad_device_offsets({WgradSet{&a, &b, &c}}, offsets, accumulate);
}

namespace {
void run_gemm_batch(const char* op, const std::vector<GemmJob>& jobs, bool grouped) {
  const HostOpTimer host_timer(op);
  if (jobs.empty()) return;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!jobs[j].c) fail("{}: job {} has no output", op, j);
    check_gemm_args(op, jobs[j].a, jobs[j].b, *jobs[j].c);
    if (jobs[j].c->device() != jobs[0].c->device()) fail("{}: jobs 0 and {} are on different devices", op, j);
  }
#if FOURBIT_HAS_CUDA
  if (jobs[0].c->device() == Device::CUDA && cuda::gemm_batch(jobs, grouped)) return;
#else
  (void)grouped;
#endif
  for (const GemmJob& j : jobs) gemm(j.a, j.b, *j.c, j.accumulate);
}
}  // namespace

void gemm_batch(const std::vector<GemmJob>& jobs) { run_gemm_batch("gemm_batch", jobs, false); }
void gemm_batch_grouped(const std::vector<GemmJob>& jobs) { run_gemm_batch("gemm_batch_grouped", jobs, true); }

QTensor qtensor_rows(const QTensor& q, int64_t begin, int64_t end) {
  FOURBIT_CHECK(q.slices == 1 && 0 <= begin && begin <= end && end <= q.rows,
                "qtensor_rows({}, {}) of a QTensor with {} slices of {} rows", begin, end, q.slices,
                q.rows);
  QTensor out = q;
  out.rows = end - begin;
  if (q.codes.defined()) {  // a form of its decode alone has none (FormOut::Bf16)
    out.codes = q.codes.slice_rows(begin, end);
    out.block_scales = q.block_scales.slice_rows(begin, end);
  }
  if (q.outer == OuterScale::PerRow) out.outer_scales = q.outer_scales.slice_rows(begin, end);
  if (q.bf16.defined()) out.bf16 = q.bf16.slice_rows(begin, end);
  if (q.row_amax.defined()) out.row_amax = q.row_amax.slice_rows(begin, end);
  return out;
}

QTensor qtensor_slice(const QTensor& q, int64_t s) {
  FOURBIT_CHECK(0 <= s && s < q.slices, "qtensor_slice({}) of {} slices", s, q.slices);
  QTensor out = q;
  out.slices = 1;
  if (q.codes.defined()) {
    out.codes = q.codes.slice_rows(s * q.rows, (s + 1) * q.rows);
    out.block_scales = q.block_scales.slice_rows(s * q.rows, (s + 1) * q.rows);
  }
  if (q.bf16.defined()) out.bf16 = q.bf16.slice_rows(s * q.rows, (s + 1) * q.rows);
  if (q.row_amax.defined()) out.row_amax = q.row_amax.slice_rows(s * q.rows, (s + 1) * q.rows);
  switch (q.outer) {
    case OuterScale::None:
    case OuterScale::Tensor: break;
    case OuterScale::PerRow: out.outer_scales = q.outer_scales.slice_rows(s * q.rows, (s + 1) * q.rows); break;
    case OuterScale::PerSlice:
      out.outer_scales = q.outer_scales.slice_rows(s, s + 1);
      out.outer = OuterScale::Tensor;
      break;
  }
  return out;
}

void convert(const Tensor& src, Tensor& dst) { FOURBIT_DISPATCH(src.device(), convert, src, dst); }
void convert_each(const std::vector<Tensor>& src, std::vector<Tensor>& dst) {
  const HostOpTimer host_timer("convert_each");
  if (src.size() != dst.size()) fail("convert_each: {} sources for {} destinations", src.size(), dst.size());
  if (src.empty()) return;
  bool all_gpu = true;
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].numel() != dst[i].numel() || src[i].device() != dst[i].device())
      fail("convert_each: pair {}: src {} and dst {} must have one element count and device", i, src[i].str(),
           dst[i].str());
    all_gpu = all_gpu && src[i].device() == Device::CUDA;
  }
#if FOURBIT_HAS_CUDA
  if (all_gpu && cuda::convert_each(src, dst)) return;
#else
  (void)all_gpu;
#endif
  for (size_t i = 0; i < src.size(); ++i) convert(src[i], dst[i]);
}
void zero_each(std::vector<Tensor>& ts) {
  bool all_gpu = true;
  for (const Tensor& t : ts) all_gpu = all_gpu && t.device() == Device::CUDA;
#if FOURBIT_HAS_CUDA
  if (!ts.empty() && all_gpu && cuda::zero_each(ts)) return;
#else
  (void)all_gpu;
#endif
  for (Tensor& t : ts) t.zero_();
}
void add_(Tensor& dst, const Tensor& src) { FOURBIT_DISPATCH(dst.device(), add_, dst, src); }
void add(const Tensor& a, const Tensor& b, Tensor& out) { FOURBIT_DISPATCH(out.device(), add, a, b, out); }
void scale_(Tensor& t, double s) { FOURBIT_DISPATCH(t.device(), scale_, t, s); }
double sum_squares(const Tensor& t) { FOURBIT_DISPATCH(t.device(), sum_squares, t); }
std::vector<double> sum_squares_each(const std::vector<Tensor>& ts) {
  if (ts.empty()) return {};
  expect_one_device("sum_squares_each", ts, "tensor", "tensors");
  FOURBIT_DISPATCH(ts[0].device(), sum_squares_each, ts);
}
void fill_(Tensor& t, double v) { FOURBIT_DISPATCH(t.device(), fill_, t, v); }
void running_segment_amax(const Tensor& x, const Tensor& rows, const std::vector<int64_t>& offsets, Tensor& amax) {
  FOURBIT_DISPATCH(x.device(), running_segment_amax, x, rows, offsets, amax);
}

void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out) {
  FOURBIT_DISPATCH(table.device(), embedding_forward, tokens, table, out);
}
void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable, bool tokens_checked) {
  FOURBIT_DISPATCH(dout.device(), embedding_backward, dout, tokens, dtable, tokens_checked);
}
namespace {
// A BF16 copy an op writes next to its F32 output `of` (named `what`): of's shape and device.
void expect_bf16_copy(const char* op, const char* what, const Tensor* copy, const Tensor& of) {
  if (!copy) return;
  if (!copy->defined() || copy->dtype() != DType::BF16 || copy->shape() != of.shape() || copy->device() != of.device() ||
      of.dtype() != DType::F32)
    fail("{}: {} must be a BF16 tensor of the f32 output's shape {} on its device, got {} for {}", op, what,
         shape_str(of.shape()), copy->defined() ? copy->str() : "undefined", of.str());
}

// A quantized output's request (ops.h "Quantized outputs"): somewhere to put it, a block-scaled
// Row-axis spec, and a 2-D F32 output to quantize.
void expect_row_quant(const char* op, const char* what, const RowQuant* rq, const Tensor& of) {
  if (!rq) return;
  if (!rq->out) fail("{}: the quantized {} has nowhere to go (RowQuant::out is null)", op, what);
  if (!rq->spec.quantized() || rq->spec.axis != BlockAxis::Row)
    fail("{}: the quantized {} needs a block-scaled Row-axis spec, got {}", op, what, describe(rq->spec));
  if (!of.defined() || of.dtype() != DType::F32 || of.dim() != 2)
    fail("{}: a quantized {} needs an f32 [rows, cols] {}, got {}", op, what, what,
         of.defined() ? of.str() : "undefined");
}
}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd, Tensor* y_bf16,
                     const RowQuant* yq) {
  expect_bf16_copy("rmsnorm_forward", "y_bf16", y_bf16, y);
  expect_row_quant("rmsnorm_forward", "y", yq, y);
#if FOURBIT_HAS_CUDA
  if (yq && x.device() == Device::CUDA) {
    const HostOpTimer host_timer("rmsnorm_forward_quantized");
    if (cuda::rmsnorm_forward_quantized(x, w, eps, y, rstd, y_bf16, *yq)) return;
  }
#endif
  [&] { FOURBIT_DISPATCH(x.device(), rmsnorm_forward, x, w, eps, y, rstd, y_bf16); }();
  if (yq) *yq->out = quantize(y, yq->spec, yq->rng);
}
void add_rmsnorm_forward(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& y,
                         Tensor& rstd, Tensor* y_bf16, const RowQuant* yq) {
  expect_bf16_copy("add_rmsnorm_forward", "y_bf16", y_bf16, y);
  expect_row_quant("add_rmsnorm_forward", "y", yq, y);
#if FOURBIT_HAS_CUDA
  if (yq && a.device() == Device::CUDA) {
    const HostOpTimer host_timer("add_rmsnorm_forward_quantized");
    if (cuda::add_rmsnorm_forward_quantized(a, b, sum, w, eps, y, rstd, y_bf16, *yq)) return;
  }
#endif
  [&] { FOURBIT_DISPATCH(a.device(), add_rmsnorm_forward, a, b, sum, w, eps, y, rstd, y_bf16); }();
  if (yq) *yq->out = quantize(y, yq->spec, yq->rng);
}
void rmsnorm_input_wgrad(const Tensor& dy, const Tensor& x, const Tensor& w, float eps, const Tensor& rstd, Tensor& dw,
                         bool accumulate) {
  const char* op = "rmsnorm_input_wgrad";
  if (dy.dim() != 2 || x.dim() != 2 || dy.size(0) != x.size(0))
    fail("{}: dy [N, M] and x [N, D] must share N, got {} and {}", op, dy.str(), x.str());
  const int64_t N = x.size(0), D = x.size(1), M = dy.size(1);
  if (w.dim() != 1 || w.size(0) != D) fail("{}: w must be [{}] like x's rows, got {}", op, D, w.str());
  if (rstd.dim() != 1 || rstd.size(0) != N) fail("{}: rstd must be [{}], one a row of x, got {}", op, N, rstd.str());
  if (dw.dim() != 2 || dw.size(0) != M || dw.size(1) != D)
    fail("{}: dw must be [{}, {}], got {}", op, M, D, dw.str());
  for (const Tensor* t : {&dy, &x, &w, &rstd, static_cast<const Tensor*>(&dw)})
    if (t->dtype() != x.dtype() || t->device() != x.device())
      fail("{}: every tensor must be {} on the {} like x, got {}", op, dtype_name(x.dtype()), device_name(x.device()),
           t->str());
#if FOURBIT_HAS_CUDA
  if (x.device() == Device::CUDA && cuda::rmsnorm_input_wgrad(dy, x, w, rstd, dw, accumulate)) return;
#endif
  // the definition: the norm's output, then the GEMM
  Tensor y = Tensor::empty({N, D}, x.dtype(), x.device()), rstd_again = Tensor::empty({N}, x.dtype(), x.device());
  rmsnorm_forward(x, w, eps, y, rstd_again);
  gemm(Operand(dy, true), Operand(y, true), dw, accumulate);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool dx_accumulate, bool dw_accumulate, Tensor* dx_bf16) {
  expect_bf16_copy("rmsnorm_backward", "dx_bf16", dx_bf16, dx);
  FOURBIT_DISPATCH(dy.device(), rmsnorm_backward, dy, x, w, rstd, dx, dw, dx_accumulate, dw_accumulate, dx_bf16);
}

Tensor rope_table(int64_t max_pos, int64_t head_dim, double theta, Device device) {
  FOURBIT_CHECK(head_dim % 2 == 0, "rope: head_dim {} must be even", head_dim);
  const int64_t half = head_dim / 2;
  std::vector<float> t(size_t(max_pos * head_dim));
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta, -double(2 * i) / double(head_dim));
      const double angle = double(p) * inv_freq;
      t[size_t(p * head_dim + i)] = float(std::cos(angle));
      t[size_t(p * head_dim + half + i)] = float(std::sin(angle));
    }
  return Tensor::from_host(t.data(), {max_pos, head_dim}, DType::F32, device);
}

void rope_forward(Tensor& x, const Tensor& positions, const Tensor& table, Tensor* x_bf16, bool bf16_only) {
  expect_bf16_copy("rope_forward", "x_bf16", x_bf16, x);
  if (bf16_only && !x_bf16) fail("rope_forward: bf16_only writes only x_bf16, and none was given");
  FOURBIT_DISPATCH(x.device(), rope_forward, x, positions, table, x_bf16, bf16_only);
}
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& table, Tensor* dx_bf16, bool bf16_only) {
  expect_bf16_copy("rope_backward", "dx_bf16", dx_bf16, dx);
  if (bf16_only && !dx_bf16) fail("rope_backward: bf16_only writes only dx_bf16, and none was given");
  FOURBIT_DISPATCH(dx.device(), rope_backward, dx, positions, table, dx_bf16, bf16_only);
}
namespace {
// rope_qkv_to_cache's destinations for queries of q_shape [N, Hq, hd] and Hkv key/value heads.
void check_qkv_destinations(const char* op, const Shape& q_shape, int64_t Hkv, Device device, const Tensor& q_bf16,
                            const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t hd = q_shape[2];
  if (!q_bf16.defined() || q_bf16.dtype() != DType::BF16 || q_bf16.shape() != q_shape || q_bf16.device() != device)
    fail("{}: q_bf16 must be a bf16 tensor {} on q's device, got {}", op, shape_str(q_shape),
         q_bf16.defined() ? q_bf16.str() : "undefined");
  for (const auto& [name, c] : {std::pair<const char*, const Tensor*>{"k_cache", &k_cache}, {"v_cache", &v_cache}})
    if (!c->defined() || c->dtype() != DType::BF16 || c->dim() != 3 || c->size(1) != Hkv || c->size(2) != hd ||
        c->device() != device)
      fail("{}: {} must be a bf16 [rows, Hkv={}, hd={}] tensor on q's device, got {}", op, name, Hkv, hd,
           c->defined() ? c->str() : "undefined");
  if (k_cache.shape() != v_cache.shape())
    fail("{}: k_cache {} and v_cache {} differ", op, k_cache.str(), v_cache.str());
}
}  // namespace

void rope_qkv_to_cache(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& table,
                       const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache) {
  const HostOpTimer host_timer("rope_qkv_to_cache");
  const char* op = "rope_qkv_to_cache";
  const auto f32_3d = [&](const char* name, const Tensor& t) {
    if (!t.defined() || t.dtype() != DType::F32 || t.dim() != 3)
      fail("{}: {} must be an f32 [N, H, hd] tensor, got {}", op, name, t.defined() ? t.str() : "undefined");
  };
  f32_3d("q", q);
  f32_3d("k", k);
  f32_3d("v", v);
  const int64_t N = q.size(0), hd = q.size(2), Hkv = k.size(1);
  if (k.size(0) != N || k.size(2) != hd || v.shape() != k.shape())
    fail("{}: k and v must be [N={}, Hkv, hd={}] alike, got k {} and v {}", op, N, hd, k.str(), v.str());
  if (k.device() != q.device() || v.device() != q.device())
    fail("{}: q, k and v must be on one device", op);
  check_qkv_destinations(op, q.shape(), Hkv, q.device(), q_bf16, k_cache, v_cache);
#if FOURBIT_HAS_CUDA
  if (q.device() == Device::CUDA &&
      cuda::rope_qkv_to_cache(q, k, v, positions, table, dst_rows, q_bf16, k_cache, v_cache))
    return;
#endif
  Tensor qq = q, kk = k, kb = Tensor::empty(k.shape(), DType::BF16, k.device()),
         vb = Tensor::empty(v.shape(), DType::BF16, v.device());
  rope_forward(qq, positions, table, &q_bf16, true);
  rope_forward(kk, positions, table, &kb, true);
  convert(v, vb);
  const int64_t row = Hkv * hd;
  Tensor kc = k_cache.reshape({k_cache.size(0), row}), vc = v_cache.reshape({v_cache.size(0), row});
  scatter_rows(kb.reshape({N, row}), dst_rows, kc);
  scatter_rows(vb.reshape({N, row}), dst_rows, vc);
}
void rope_fused_qkv_to_cache(const Tensor& qkv, int64_t n_heads, const Tensor& positions, const Tensor& table,
                             const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache) {
  const HostOpTimer host_timer("rope_fused_qkv_to_cache");
  const char* op = "rope_fused_qkv_to_cache";
  if (!qkv.defined() || qkv.dtype() != DType::F32 || qkv.dim() != 3)
    fail("{}: qkv must be an f32 [N, Hq + 2 Hkv, hd] tensor, got {}", op, qkv.defined() ? qkv.str() : "undefined");
  const int64_t N = qkv.size(0), H = qkv.size(1), hd = qkv.size(2);
  const int64_t Hkv = k_cache.defined() && k_cache.dim() == 3 ? k_cache.size(1) : -1;
  if (n_heads < 1 || Hkv < 1 || H != n_heads + 2 * Hkv)
    fail("{}: qkv {} must hold Hq={} query heads and then the caches' Hkv={} key and Hkv value heads a row", op,
         qkv.str(), n_heads, Hkv);
  check_qkv_destinations(op, {N, n_heads, hd}, Hkv, qkv.device(), q_bf16, k_cache, v_cache);
#if FOURBIT_HAS_CUDA
  if (qkv.device() == Device::CUDA &&
      cuda::rope_fused_qkv_to_cache(qkv, n_heads, positions, table, dst_rows, q_bf16, k_cache, v_cache))
    return;
#endif
  // Elsewhere the three heads' ranges are taken apart (a copy: the same values), then the
  // three-tensor form runs.
  std::vector<int32_t> rows_q, rows_k, rows_v;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      (h < n_heads ? rows_q : h < n_heads + Hkv ? rows_k : rows_v).push_back(int32_t(n * H + h));
  const Tensor heads = qkv.reshape({N * H, hd});
  const auto take = [&](const std::vector<int32_t>& rows, int64_t count) {
    Tensor out = Tensor::empty({N * count, hd}, DType::F32, qkv.device());
    gather_rows(heads, Tensor::from_host(rows.data(), {int64_t(rows.size())}, DType::I32, qkv.device()), out);
    return out.reshape({N, count, hd});
  };
  rope_qkv_to_cache(take(rows_q, n_heads), take(rows_k, Hkv), take(rows_v, Hkv), positions, table, dst_rows, q_bf16,
                    k_cache, v_cache);
}
bool attention_reads_bf16(Device device) { return device == Device::CUDA; }
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0,
                       Tensor& out, Tensor& lse, Tensor* out_bf16) {
  expect_bf16_copy("attention_forward", "out_bf16", out_bf16, out);
  FOURBIT_DISPATCH(q.device(), attention_forward, q, k, v, pos0, out, lse, out_bf16);
}
void attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, Tensor& out,
                    Tensor& lse, Tensor* out_bf16, const RowQuant* oq) {
  const HostOpTimer host_timer("attention_step");
  if (q.dim() != 4 || q.size(1) != 1 || k.dim() != 4 || k.size(0) != q.size(0))
    fail("attention_step: q must be [B, 1, Hq, hd] and k [B, S, Hkv, hd] of the same B, got q {} and k {}", q.str(),
         k.str());
  if (v.shape() != k.shape() || k.size(3) != q.size(3) || k.size(2) < 1 || q.size(2) % k.size(2) != 0)
    fail("attention_step: k and v must be [B, S, Hkv, hd] with q's hd and Hkv dividing Hq, got q {}, k {}, v {}",
         q.str(), k.str(), v.str());
  const int64_t B = q.size(0), S = k.size(1);
  if (positions.dtype() != DType::I32 || positions.shape() != Shape{B} || positions.device() != q.device())
    fail("attention_step: positions must be i32 [{}] on q's device ({}), got {}", B, device_name(q.device()),
         positions.str());
  if (out.shape() != q.shape() || lse.shape() != Shape{B, q.size(2), 1})
    fail("attention_step: out must be {} and lse [{}, {}, 1], got {} and {}", shape_str(q.shape()), B, q.size(2),
         out.str(), lse.str());
  expect_bf16_copy("attention_step", "out_bf16", out_bf16, out);
  const Tensor out_rows = oq ? out.reshape({B, q.size(2) * q.size(3)}) : Tensor{};
  expect_row_quant("attention_step", "out", oq, out_rows);
  // the op, then its quantized output where the kernel did not make it
  const auto quantize_out = [&] {
    if (oq) *oq->out = quantize(out_rows, oq->spec, oq->rng);
  };
#if FOURBIT_HAS_CUDA
  if (q.device() == Device::CUDA && out.dtype() == DType::F32 && lse.dtype() == DType::F32) {
    const bool fused_q = oq && cuda::attention_step_quant_fused(oq->spec, q.size(3));
    if (cuda::flash_attention_step(q, k, v, positions, out, lse, out_bf16, fused_q ? oq : nullptr)) {
      if (!fused_q) quantize_out();
      return;
    }
  }
#endif
  const Tensor pos = positions.to(Device::CPU);
  const int32_t* p = pos.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    if (p[b] < 0 || p[b] >= S) fail("attention_step: positions[{}] = {} is outside [0, S={})", b, p[b], S);
  for (int64_t b0 = 0, b1; b0 < B; b0 = b1) {  // runs of equal positions, one attention_forward each
    for (b1 = b0 + 1; b1 < B && p[b1] == p[b0];) ++b1;
    Tensor o = out.slice_rows(b0, b1), l = lse.slice_rows(b0, b1), o16;
    if (out_bf16) o16 = out_bf16->slice_rows(b0, b1);
    attention_forward(q.slice_rows(b0, b1), k.slice_rows(b0, b1), v.slice_rows(b0, b1), p[b0], o, l,
                      out_bf16 ? &o16 : nullptr);
  }
  quantize_out();
}
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv) {
  FOURBIT_DISPATCH(q.device(), attention_backward, dout, q, k, v, out, lse, dq, dk, dv);
}
void swiglu_forward(const Tensor& h1, const Tensor& h3, Tensor& a) {
  FOURBIT_DISPATCH(h1.device(), swiglu_forward, h1, h3, a);
}
void swiglu_forward_fused(const Tensor& h13, Tensor& a, const RowQuant* aq) {
  if (h13.defined() && (h13.dim() < 1 || h13.size(h13.dim() - 1) % 2 != 0))
    fail("swiglu_forward_fused: h13 must be [..., 2F] (gate then up), an even last dimension, got {}", h13.str());
  expect_row_quant("swiglu_forward_fused", "a", aq, a);
#if FOURBIT_HAS_CUDA
  if (aq && h13.device() == Device::CUDA) {
    const HostOpTimer host_timer("swiglu_forward_fused_quantized");
    if (cuda::swiglu_forward_fused_quantized(h13, a, *aq)) return;
  }
#endif
  [&] { FOURBIT_DISPATCH(h13.device(), swiglu_forward_fused, h13, a); }();
  if (aq) *aq->out = quantize(a, aq->spec, aq->rng);
}
void swiglu_backward(const Tensor& da, const Tensor& h1, const Tensor& h3, Tensor& dh1,
                     Tensor& dh3) {
  FOURBIT_DISPATCH(h1.device(), swiglu_backward, da, h1, h3, dh1, dh3);
}
void cross_entropy(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor* dlogits,
                   double grad_scale, const Tensor* weights, const Tensor* scale) {
  if (scale && (!scale->defined() || scale->dtype() != DType::F32 || scale->numel() != 1 ||
                scale->device() != logits.device()))
    fail("cross_entropy: scale must be one f32 on the logits' device ({}), got {}", device_name(logits.device()),
         scale->defined() ? scale->str() : "an undefined tensor");
  FOURBIT_DISPATCH(logits.device(), cross_entropy, logits, targets, losses, dlogits, grad_scale, weights, scale);
}
void count_targets(const Tensor& targets, float loss_weight, Tensor& count, Tensor& scale) {
  const char* op = "count_targets";
  if (!targets.defined() || targets.dim() != 1 || targets.dtype() != DType::I32)
    fail("{}: targets must be i32 [N], got {}", op, targets.defined() ? targets.str() : "an undefined tensor");
  const Device dev = targets.device();
  if (!count.defined() || count.dtype() != DType::F64 || count.numel() != 1 || count.device() != dev)
    fail("{}: count must be one f64 on {}, got {}", op, device_name(dev), count.defined() ? count.str() : "an undefined tensor");
  if (!scale.defined() || scale.dtype() != DType::F32 || scale.numel() != 1 || scale.device() != dev)
    fail("{}: scale must be one f32 on {}, got {}", op, device_name(dev), scale.defined() ? scale.str() : "an undefined tensor");
  FOURBIT_DISPATCH(dev, count_targets, targets, loss_weight, count, scale);
}
void draw_tokens(const Tensor& logits, const DrawSpec& spec, const Tensor& keys, Tensor& tokens, Tensor& logprobs,
                 Tensor& status) {
  FOURBIT_DISPATCH(logits.device(), draw_tokens, logits, spec, keys, tokens, logprobs, status);
}
void router_topk(const Tensor& logits, int64_t k, Tensor& probs, Tensor& topk_idx,
                 Tensor& topk_w) {
  FOURBIT_DISPATCH(logits.device(), router_topk, logits, k, probs, topk_idx, topk_w);
}
void router_backward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_w,
                     const Tensor& d_topk_w, const Tensor& d_probs, Tensor& d_logits) {
  FOURBIT_DISPATCH(probs.device(), router_backward, probs, topk_idx, topk_w, d_topk_w, d_probs,
                   d_logits);
}
PendingRoutePlan route_plan_begin(const Tensor& topk_idx, int64_t n_experts, const Tensor& probs, bool read_back,
                                  int64_t extra_rows) {
  if (topk_idx.defined() && topk_idx.dim() == 2 && (extra_rows < 0 || extra_rows > topk_idx.size(0)))
    fail("route_plan: extra_rows must be in [0, N={}] (rows of the tokens), got {}", topk_idx.size(0), extra_rows);
  if (probs.defined() && topk_idx.defined()) {  // (an undefined topk_idx: the backend says so)
    const int64_t N = topk_idx.dim() == 2 ? topk_idx.size(0) : -1;
    if (probs.dim() != 2 || probs.size(0) != N || probs.size(1) != n_experts ||
        (probs.dtype() != DType::F32 && probs.dtype() != DType::F64) || probs.device() != topk_idx.device())
      fail("route_plan: probs must be a float [N={}, E={}] tensor on topk_idx's device, got {}", N, n_experts,
           probs.str());
  }
  FOURBIT_DISPATCH(topk_idx.device(), route_plan_begin, topk_idx, n_experts, probs, read_back, extra_rows);
}
void check_index_errors(Device device) {
#if FOURBIT_HAS_CUDA
  if (device == Device::CUDA) cuda::check_recorded_index_errors();
#endif
  (void)device;
}
namespace {
std::atomic<int> g_index_checks_deferred{0};
}
DeferIndexChecks::DeferIndexChecks() { g_index_checks_deferred.fetch_add(1, std::memory_order_relaxed); }
DeferIndexChecks::~DeferIndexChecks() { g_index_checks_deferred.fetch_sub(1, std::memory_order_relaxed); }
bool index_checks_deferred() { return g_index_checks_deferred.load(std::memory_order_relaxed) > 0; }
std::function<void()> check_index_errors_later(Device device) {
#if FOURBIT_HAS_CUDA
  if (device == Device::CUDA) return cuda::recorded_index_errors_later();
#endif
  (void)device;
  return {};
}
namespace {
// load_balance_term's and load_balance_dprobs' shared arguments: offsets I32 [E + 1] on `dev`.
int64_t expect_load_balance_offsets(const char* op, const Tensor& offsets, Device dev, int64_t tokens,
                                    int64_t assignments) {
  if (!offsets.defined() || offsets.dim() != 1 || offsets.dtype() != DType::I32 || offsets.numel() < 2 ||
      offsets.device() != dev)
    fail("{}: offsets must be i32 [E + 1] (E >= 1) on {}, got {}", op, device_name(dev),
         offsets.defined() ? offsets.str() : "an undefined tensor");
  if (tokens < 1 || assignments < 1)
    fail("{}: tokens and assignments must be positive, got {} and {}", op, tokens, assignments);
  return offsets.numel() - 1;
}
}  // namespace
void load_balance_term(const Tensor& offsets, const Tensor& prob_sums, int64_t tokens, int64_t assignments,
                       double coef, Tensor& terms, int64_t slot) {
  const char* op = "load_balance_term";
  if (!terms.defined()) fail("{}: terms is undefined", op);
  const Device dev = terms.device();
  const int64_t E = expect_load_balance_offsets(op, offsets, dev, tokens, assignments);
  if (!prob_sums.defined() || prob_sums.dtype() != DType::F64 || prob_sums.numel() != E || prob_sums.device() != dev)
    fail("{}: prob_sums must be f64 [E={}] on {}, got {}", op, E, device_name(dev),
         prob_sums.defined() ? prob_sums.str() : "an undefined tensor");
  if (terms.dtype() != DType::F64 || slot < 0 || slot >= terms.numel())
    fail("{}: terms must be f64 with an entry {}, got {}", op, slot, terms.str());
  FOURBIT_DISPATCH(dev, load_balance_term, offsets, prob_sums, tokens, assignments, coef, terms, slot);
}
void load_balance_dprobs(const Tensor& offsets, int64_t tokens, int64_t assignments, float loss_weight, double coef,
                         Tensor& d_probs) {
  const char* op = "load_balance_dprobs";
  if (!d_probs.defined()) fail("{}: d_probs is undefined", op);
  const Device dev = d_probs.device();
  const int64_t E = expect_load_balance_offsets(op, offsets, dev, tokens, assignments);
  const bool float_ok = d_probs.dtype() == DType::F32 || (dev == Device::CPU && d_probs.dtype() == DType::F64);
  if (!float_ok || d_probs.dim() != 2 || d_probs.size(0) != 1 || d_probs.size(1) != E)
    fail("{}: d_probs must be [1, E={}] f32 (or f64 on the CPU) on {}, got {}", op, E, device_name(dev), d_probs.str());
  FOURBIT_DISPATCH(dev, load_balance_dprobs, offsets, tokens, assignments, loss_weight, coef, d_probs);
}
void route_plan_finish(PendingRoutePlan& pending) {
  const HostOpTimer host_timer("route_plan_end (the wait for the counts)");
  if (pending.finish) pending.finish(pending.plan);
  pending.finish = nullptr;
}
RoutePlan route_plan_end(PendingRoutePlan pending) {
  route_plan_finish(pending);
  return std::move(pending.plan);
}
RoutePlan route_plan(const Tensor& topk_idx, int64_t n_experts, const Tensor& probs) {
  return route_plan_end(route_plan_begin(topk_idx, n_experts, probs));
}
void gather_rows(const Tensor& x, const Tensor& token_of_slot, Tensor& x_perm) {
  FOURBIT_DISPATCH(x.device(), gather_rows, x, token_of_slot, x_perm);
}
QTensor gather_rows(const QTensor& x, const Tensor& token_of_slot) {
  FOURBIT_DISPATCH(x.device(), gather_rows, x, token_of_slot);
}
void scatter_rows(const Tensor& x, const Tensor& dst_rows, Tensor& out) {
  FOURBIT_DISPATCH(out.device(), scatter_rows, x, dst_rows, out);
}
void gather_rows_backward(const Tensor& dx_perm, const Tensor& slot_of, Tensor& dx) {
  FOURBIT_DISPATCH(dx.device(), gather_rows_backward, dx_perm, slot_of, dx);
}
void moe_combine(const Tensor& y_perm, const Tensor& slot_of, const Tensor& w, Tensor& out, const Tensor* plus) {
  if (plus && (!plus->defined() || plus->dtype() != out.dtype() || plus->shape() != out.shape() ||
               plus->device() != out.device()))
    fail("moe_combine: plus must match out {}, got {}", out.str(), plus->defined() ? plus->str() : "undefined");
  FOURBIT_DISPATCH(out.device(), moe_combine, y_perm, slot_of, w, out, plus);
}
void moe_combine_backward(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                          const Tensor& w, Tensor& dy_perm, Tensor& dw) {
  FOURBIT_DISPATCH(dout.device(), moe_combine_backward, dout, y_perm, slot_of, w, dy_perm, dw);
}
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h, Tensor* param_bf16,
                const Tensor* gate, const SliceAmax& slice_amax) {
  if (gate) {
    expect_gate("adamw_step", *gate, param.defined() ? param.device() : Device::CPU);
    if (h.grad_scale != 1.0f)
      fail("adamw_step: with a gate the clip factor comes from it; grad_scale must be 1, got {}", h.grad_scale);
  }
  if (slice_amax.amax) {
    const Tensor& a = *slice_amax.amax;
    const int64_t n = param.defined() ? param.numel() : 0, sl = slice_amax.slice;
    if (sl < 1 || n % sl != 0)
      fail("adamw_step: the amax slice must divide param's {} elements, got {}", n, sl);
    if (!a.defined() || a.dtype() != DType::F32 || a.numel() != n / sl || !param.defined() ||
        a.device() != param.device())
      fail("adamw_step: slice_amax must be an f32 tensor of {} elements (one a slice of {}) on param's device, got {}",
           n / sl, sl, a.defined() ? a.str() : "an undefined tensor");
  }
  FOURBIT_DISPATCH(param.device(), adamw_step, param, grad, m, v, h, param_bf16, gate, slice_amax);
}
void grad_norm_gate(const std::vector<Tensor>& grads, double max_norm, Tensor& gate) {
  if (grads.empty()) fail("grad_norm_gate: no gradients");
  expect_one_device("grad_norm_gate", grads, "gradient", "gradients");
  expect_gate("grad_norm_gate", gate, grads[0].device());
  if (!(max_norm >= 0.0)) fail("grad_norm_gate: max_norm must be >= 0 (0: no clipping), got {}", max_norm);
  const bool host_seen = g_nonfinite.exchange(false);
  FOURBIT_DISPATCH(grads[0].device(), grad_norm_gate, grads, max_norm, host_seen, gate);
}

}  // namespace fourbit::ops
