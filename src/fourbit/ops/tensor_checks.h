// defines: str_or_undef, expect_dims_on, expect_like_on, expect_out_on, expect_add_args,
//          expect_add_inplace_args, CombineShape, expect_combine_args, GatherShape, expect_gather_args,
//          expect_scatter_args, expect_router_backward_args, expect_segment_amax_args, check_draw_spec,
//          expect_draw_args
// Argument checks shared by both backends' layer ops, so a shape error reads the same on either
// ("rmsnorm_forward: w must be f32[D]=[64] cpu, got f32[32] cpu"). Each backend's checks header
// binds the device (cpu/checks.h, cuda/checks.cuh).
#pragma once
#include <cmath>
#include <string>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops {

// "undefined " for an undefined tensor, "" otherwise: messages print it before t.str().
inline const char* str_or_undef(const Tensor& t) { return t.defined() ? "" : "undefined "; }

// Exactly dtype `dt` and shape `shape` on `dev`; `sym` is the symbolic shape ("[D]").
inline void expect_dims_on(Device dev, const char* op, const char* name, const Tensor& t, DType dt,
                           const Shape& shape, const char* sym) {
  if (!t.defined())
    fail("{}: {} must be {}{}={} {}, got an undefined tensor", op, name, dtype_name(dt), sym,
         shape_str(shape), device_name(dev));
  if (t.device() != dev || t.dtype() != dt || t.shape() != shape)
    fail("{}: {} must be {}{}={} {}, got {}", op, name, dtype_name(dt), sym, shape_str(shape),
         device_name(dev), t.str());
}

// Same dtype and shape as `ref` (named `ref_name`).
inline void expect_like_on(Device dev, const char* op, const char* name, const Tensor& t,
                           const char* ref_name, const Tensor& ref) {
  const std::string sym = std::string("[like ") + ref_name + "]";
  expect_dims_on(dev, op, name, t, ref.dtype(), ref.shape(), sym.c_str());
}

// An output of shape `shape` whose dtype is the inputs' `dt`, or BF16 where `dt` is F32 (the ops
// that may hand the next GEMM its BF16 operand directly, ops.h "BF16 outputs"). Returns its dtype.
inline DType expect_out_on(Device dev, const char* op, const char* name, const Tensor& t, DType dt,
                           const Shape& shape, const char* sym) {
  if (t.defined() && dt == DType::F32 && t.dtype() == DType::BF16 && t.device() == dev && t.shape() == shape)
    return DType::BF16;
  if (dt == DType::F32 && t.defined() && t.dtype() != DType::F32)
    fail("{}: {} must be f32 or bf16{}={} {}, got {}", op, name, sym, shape_str(shape), device_name(dev), t.str());
  expect_dims_on(dev, op, name, t, dt, shape, sym);
  return dt;
}

// add(a, b, out): three value tensors (the backend's check `value`), b and out of a's dtype and
// shape; add_(dst, src): src of dst's (both already checked to be value tensors).
inline void expect_add_args(const Tensor& a, const Tensor& b, const Tensor& out,
                            void (*value)(const char* op, const char* name, const Tensor& t)) {
  value("add", "a", a);
  value("add", "b", b);
  value("add", "out", out);
  if (b.dtype() != a.dtype() || b.shape() != a.shape() || out.dtype() != a.dtype() || out.shape() != a.shape())
    fail("add: b and out must match a {}, got {} and {}", a.str(), b.str(), out.str());
}
inline void expect_add_inplace_args(const Tensor& dst, const Tensor& src) {
  if (src.dtype() != dst.dtype() || src.shape() != dst.shape())
    fail("add_: src must match dst {}, got {}", dst.str(), src.str());
}

// moe_combine and its backward: y_perm [M, D] and w [N, k] of dtype `dt` (that of out/dout,
// [N, D]), slot_of i32 [N, k]. Returns M and k.
struct CombineShape {
  int64_t M, k;
};
inline CombineShape expect_combine_args(Device dev, const char* op, DType dt, int64_t N, int64_t D,
                                        const Tensor& y_perm, const Tensor& slot_of, const Tensor& w) {
  if (!y_perm.defined() || y_perm.dim() != 2)
    fail("{}: y_perm must be a 2-D {} tensor [M, D], got {}", op, device_name(dev),
         y_perm.defined() ? y_perm.str() : "an undefined tensor");
  const int64_t M = y_perm.size(0);
  expect_dims_on(dev, op, "y_perm", y_perm, dt, {M, D}, "[M, D]");
  if (!slot_of.defined() || slot_of.dim() != 2 || slot_of.size(0) != N)
    fail("{}: slot_of must be i32[N, k] with N={}, got {}", op, N,
         slot_of.defined() ? slot_of.str() : "an undefined tensor");
  const int64_t k = slot_of.size(1);
  expect_dims_on(dev, op, "slot_of", slot_of, DType::I32, {N, k}, "[N, k]");
  expect_dims_on(dev, op, "w", w, dt, {N, k}, "[N, k]");
  return {M, k};
}

// router_backward: probs [N, E] of dtype `dt` (checked by the caller), topk_idx i32 [N, k],
// topk_w, d_topk_w [N, k], d_probs [N, E] or undefined (no extra gradient), d_logits [N, E].
// Returns k.
inline int64_t expect_router_backward_args(Device dev, const char* op, DType dt, int64_t N, int64_t E,
                                           const Tensor& topk_idx, const Tensor& topk_w,
                                           const Tensor& d_topk_w, const Tensor& d_probs,
                                           const Tensor& d_logits) {
  if (!topk_idx.defined() || topk_idx.dim() != 2)
    fail("{}: topk_idx must be i32[N, k], got {}{}", op, str_or_undef(topk_idx), topk_idx.defined() ? topk_idx.str() : "");
  const int64_t k = topk_idx.size(1);
  expect_dims_on(dev, op, "topk_idx", topk_idx, DType::I32, {N, k}, "[N, k]");
  expect_dims_on(dev, op, "topk_w", topk_w, dt, {N, k}, "[N, k]");
  expect_dims_on(dev, op, "d_topk_w", d_topk_w, dt, {N, k}, "[N, k]");
  // d_probs: one row per token, or one row for every token (the load-balance loss's gradient)
  if (d_probs.defined()) {
    const bool one_row = d_probs.dim() == 2 && d_probs.size(0) == 1 && d_probs.size(1) == E;
    expect_dims_on(dev, op, "d_probs", d_probs, dt, one_row ? Shape{1, E} : Shape{N, E}, "[N, E] or [1, E]");
  }
  expect_dims_on(dev, op, "d_logits", d_logits, dt, {N, E}, "[N, E]");
  return k;
}

// gather_rows over dense rows: x [N, D] (any dtype), token_of_slot i32 [M], x_perm [M, D] like x.
struct GatherShape {
  int64_t N, D, M;
};
inline GatherShape expect_gather_args(Device dev, const char* op, const Tensor& x,
                                      const Tensor& token_of_slot, const Tensor& x_perm) {
  if (!x.defined() || x.dim() != 2 || x.device() != dev)
    fail("{}: x must be a 2-D {} tensor [N, D], got {}", op, device_name(dev),
         x.defined() ? x.str() : "an undefined tensor");
  if (!token_of_slot.defined() || token_of_slot.dim() != 1)
    fail("{}: token_of_slot must be i32[M], got {}", op,
         token_of_slot.defined() ? token_of_slot.str() : "an undefined tensor");
  const GatherShape g{x.size(0), x.size(1), token_of_slot.size(0)};
  expect_dims_on(dev, op, "token_of_slot", token_of_slot, DType::I32, {g.M}, "[M]");
  expect_dims_on(dev, op, "x_perm", x_perm, x.dtype(), {g.M, g.D}, "[M, D]");
  return g;
}

// running_segment_amax: x f32 [R, C], rows i32 [M] or undefined (then M = R), offsets G + 1
// non-decreasing from 0 to M, amax f32 [G]. Row indices themselves are checked by the backend.
// Returns M.
inline int64_t expect_segment_amax_args(Device dev, const char* op, const Tensor& x, const Tensor& rows,
                                        const std::vector<int64_t>& offsets, const Tensor& amax) {
  if (!x.defined() || x.dim() != 2 || x.dtype() != DType::F32 || x.device() != dev)
    fail("{}: x must be a 2-D f32 {} tensor [R, C], got {}{}", op, device_name(dev), str_or_undef(x),
         x.defined() ? x.str() : "");
  int64_t M = x.size(0);
  if (rows.defined()) {
    if (rows.dim() != 1) fail("{}: rows must be i32[M], got {}", op, rows.str());
    M = rows.size(0);
    expect_dims_on(dev, op, "rows", rows, DType::I32, {M}, "[M]");
  }
  if (offsets.size() < 2 || offsets.front() != 0 || offsets.back() != M)
    fail("{}: offsets must run from 0 to M={} ({} given)", op, M, offsets.size());
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    if (offsets[g] > offsets[g + 1]) fail("{}: offsets decrease at segment {}", op, g);
  expect_dims_on(dev, op, "amax", amax, DType::F32, {int64_t(offsets.size()) - 1}, "[G]");
  return M;
}

// scatter_rows: x [M, D] (any dtype), dst_rows i32 [M], out [N, D] like x; the same shapes as a
// gather with the roles of x and out swapped.
inline GatherShape expect_scatter_args(Device dev, const char* op, const Tensor& x, const Tensor& dst_rows,
                                       const Tensor& out) {
  if (!out.defined() || out.dim() != 2 || out.device() != dev)
    fail("{}: out must be a 2-D {} tensor [N, D], got {}", op, device_name(dev),
         out.defined() ? out.str() : "an undefined tensor");
  if (!dst_rows.defined() || dst_rows.dim() != 1)
    fail("{}: dst_rows must be i32[M], got {}", op, dst_rows.defined() ? dst_rows.str() : "an undefined tensor");
  const GatherShape g{out.size(0), out.size(1), dst_rows.size(0)};
  expect_dims_on(dev, op, "dst_rows", dst_rows, DType::I32, {g.M}, "[M]");
  expect_dims_on(dev, op, "x", x, out.dtype(), {g.M, g.D}, "[M, D]");
  return g;
}

// A draw spec's ranges, the message starting with `who` (draw_tokens, and rl's sampling options).
inline void check_draw_spec(const char* who, const DrawSpec& spec) {
  if (!(spec.temperature >= 0) || !std::isfinite(spec.temperature))
    fail("{}: temperature must be a finite value >= 0 (0 = greedy), got {}", who, spec.temperature);
  if (spec.top_k < 0) fail("{}: top_k must be >= 0 (0 = all tokens), got {}", who, spec.top_k);
  if (!(spec.top_p > 0 && spec.top_p <= 1))
    fail("{}: top_p must be in (0, 1] (1 = all tokens), got {}", who, spec.top_p);
}

// draw_tokens: logits f32 [A, V] (V >= 1), keys i64 [A, 2], tokens i32 [A], logprobs f64 [A],
// status i32 [A], all on dev; the spec's ranges (check_draw_spec).
// Returns V.
inline int64_t expect_draw_args(Device dev, const char* op, const Tensor& logits, const DrawSpec& spec,
                                const Tensor& keys, const Tensor& tokens, const Tensor& logprobs,
                                const Tensor& status) {
  if (!logits.defined() || logits.dim() != 2 || logits.dtype() != DType::F32 || logits.device() != dev ||
      logits.size(1) < 1)
    fail("{}: logits must be f32[A, V] {} with V >= 1, got {}", op, device_name(dev),
         logits.defined() ? logits.str() : "an undefined tensor");
  const int64_t A = logits.size(0);
  expect_dims_on(dev, op, "keys", keys, DType::I64, {A, 2}, "[A, 2]");
  expect_dims_on(dev, op, "tokens", tokens, DType::I32, {A}, "[A]");
  expect_dims_on(dev, op, "logprobs", logprobs, DType::F64, {A}, "[A]");
  expect_dims_on(dev, op, "status", status, DType::I32, {A}, "[A]");
  check_draw_spec(op, spec);
  return logits.size(1);
}

}  // namespace fourbit::ops
