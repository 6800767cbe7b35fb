// defines: Prepared, SrStreams, QuantLog, prepare, producer_quant, producer_quantized,
//          reuse_dense, shared_outer_amax, prepare_segments, requantize_saved,
//          requantize_saved_segments, stack_fprop_weights, append_weight_slices, gemm, forward_gemm,
//          set_forward_gemms_grouped,
//          forward_gemms_grouped, grouped_gemm,
//          prepare_row_col, prepare_gathered_row_col, prepare_combine_grad_row_col, prepare_swiglu,
//          prepare_swiglu_grads, prepare_gathered_row_col_device_offsets,
//          prepare_combine_grad_row_col_device_offsets, prepare_swiglu_device_offsets,
//          prepare_swiglu_grads_device_offsets, prepare_weights_both (linear.h)
#include "fourbit/model/linear.h"

#include <atomic>
#include <numeric>

#include <fmt/format.h>

#include "fourbit/numerics/philox.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

Prepared Prepared::rows(int64_t b, int64_t e) const {
  Prepared p = *this;
  if (is_quantized()) {
    p.q = ops::qtensor_rows(q, b, e);
  } else {
    FOURBIT_CHECK(!trans, "row segment of a transposed dense operand");
    p.dense = dense.slice_rows(b, e);
  }
  return p;
}

Prepared Prepared::slice(int64_t s) const {
  Prepared p = *this;
  if (is_quantized()) {
    p.q = ops::qtensor_slice(q, s);
  } else {
    FOURBIT_CHECK(dense.dim() == 3, "slice of a {} operand", dense.str());
    const int64_t n = dense.size(1) * dense.size(2);
    p.dense = dense.view(s * n, {dense.size(1), dense.size(2)});
  }
  return p;
}

void QuantLog::add(LayerClass c, GemmRole r, char operand, const QuantSpec& s, bool requant) {
  if (!enabled) return;
  counts[fmt::format("{}/{}/{}/{}{}", layer_class_name(c), gemm_role_name(r), operand,
                     format_name(s.fmt), requant ? "/requant" : "")] += 1;
}

namespace {
uint64_t hash_tensor(const Tensor& t, uint64_t h = 0xcbf29ce484222325ull) {
  if (!t.defined()) return h;
  const Tensor c = t.device() == Device::CPU ? t : t.to(Device::CPU);
  return num::fnv1a64(c.raw(), size_t(c.nbytes()), h);
}
uint64_t hash_qtensor(const QTensor& q) {
  return hash_tensor(q.outer_scales, hash_tensor(q.block_scales, hash_tensor(q.codes)));
}
void record(QuantLog* log, const QuantSite& site, const QuantSpec& spec, uint64_t input_hash) {
  if (log && log->record_calls) log->calls.push_back({site.name, site.key, describe(spec), input_hash});
}
// The SR keys of per-segment sites, in their order.
std::vector<ops::RngKey> site_keys(const std::vector<QuantSite>& sites) {
  std::vector<ops::RngKey> keys;
  for (const QuantSite& s : sites) keys.push_back(s.key);
  return keys;
}
}  // namespace

ops::RngKey SrStreams::key(std::string_view site_name) const {
  // Each field is folded in through the splitmix64 finaliser in turn, so no two fields share
  // bits (packing them by shifts lets one field's carry reach another's).
  uint64_t z = num::mix64(step + 0x5EED5EEDull);
  z = num::mix64(z ^ micro);
  z = num::mix64(z ^ num::fnv1a64(site_name.data(), site_name.size()));
  return ops::RngKey{seed, z};
}

namespace {
BlockAxis axis_for(GemmRole role, char side) {
  if (role == GemmRole::Fprop) return BlockAxis::Row;
  if (role == GemmRole::Dgrad) return side == 'a' ? BlockAxis::Row : BlockAxis::Col;
  return BlockAxis::Col;  // wgrad: dY^T and X^T
}

// spec on the role's block axis, for an f32 t.
QuantSpec quantized_spec(const Tensor& t, const QuantSpec& spec, GemmRole role, char side, LayerClass cls) {
  if (t.dtype() != DType::F32)
    fail("{} {} operand {}: quantized formats need f32 activations, got {}", layer_class_name(cls),
         gemm_role_name(role), side, t.str());
  QuantSpec s = spec;
  s.axis = axis_for(role, side);
  return s;
}

void check_saved_nvfp4(const Prepared& saved) {
  FOURBIT_CHECK(saved.is_quantized() && saved.q.fmt == Format::NVFP4, "requantize_saved needs a saved NVFP4 operand");
}
}  // namespace

Prepared prepare(const Tensor& t, const QuantSpec& spec, GemmRole role, char side, const QuantSite& site,
                 LayerClass cls, QuantLog* log, const Tensor* group_amax, const Tensor* converted, ops::FormOut form) {
  const BlockAxis axis = axis_for(role, side);
  Prepared p;
  if (log) log->add(cls, role, side, spec, false);
  if (log && log->record_calls) record(log, site, spec, hash_tensor(t));
  switch (spec.fmt) {
    case Format::F32:
      p.dense = t;
      p.trans = axis == BlockAxis::Col;
      return p;
    case Format::BF16: {
      // A producer that already wrote the BF16 operand (ops.h "BF16 outputs") hands it over as it is.
      if (t.dtype() == DType::BF16) {
        p.dense = t;
      } else if (converted) {
        FOURBIT_CHECK(converted->dtype() == DType::BF16 && converted->shape() == t.shape(),
                      "prepare: a BF16 copy {} made ahead for {}", converted->str(), t.str());
        p.dense = *converted;
      } else {
        p.dense = Tensor::empty(t.shape(), DType::BF16, t.device());
        ops::convert(t, p.dense);
      }
      p.trans = axis == BlockAxis::Col;
      return p;
    }
    default:
      p.q = ops::quantize(t, quantized_spec(t, spec, role, side, cls), site.key, nullptr, group_amax, form);
      return p;
  }
}

ops::RowQuant producer_quant(const QuantSpec& spec, GemmRole role, char side, const QuantSite& site, QTensor* out) {
  FOURBIT_CHECK(spec.quantized() && axis_for(role, side) == BlockAxis::Row,
                "producer_quant: {} operand {} of {} is not quantized along its rows", describe(spec), side,
                gemm_role_name(role));
  QuantSpec s = spec;
  s.axis = BlockAxis::Row;
  return ops::RowQuant{s, site.key, out};
}

Prepared producer_quantized(QTensor q, const Tensor& t, const QuantSpec& spec, GemmRole role, char side,
                            const QuantSite& site, LayerClass cls, QuantLog* log) {
  FOURBIT_CHECK(q.fmt == spec.fmt && q.axis == axis_for(role, side) && q.logical_shape() == t.shape(),
                "producer_quantized: {} is not {} of {}", q.codes.str(), describe(spec), t.str());
  if (log) log->add(cls, role, side, spec, false);
  if (log && log->record_calls) record(log, site, spec, hash_tensor(t));
  Prepared p;
  p.q = std::move(q);
  return p;
}

Tensor shared_outer_amax(const std::vector<Tensor>& ws, const QuantSpec& spec, GemmRole role) {
  if (spec.fmt != Format::NVFP4 || spec.outer == OuterScale::None) return Tensor{};
  QuantSpec s = spec;
  s.axis = axis_for(role, 'b');
  return ops::outer_amax(ws, s);
}

Prepared reuse_dense(const Prepared& p, const Tensor& input, const QuantSpec& spec, GemmRole role, char side,
                     const QuantSite& site, LayerClass cls, QuantLog* log) {
  FOURBIT_CHECK(!p.is_quantized() && !spec.quantized(), "reuse_dense of a block-scaled operand");
  if (log) log->add(cls, role, side, spec, false);
  if (log && log->record_calls) record(log, site, spec, hash_tensor(input));
  Prepared r = p;
  r.trans = axis_for(role, side) == BlockAxis::Col;
  return r;
}

std::vector<Prepared> prepare_segments(const Tensor& t, const std::vector<int64_t>& offsets, const QuantSpec& spec,
                                       GemmRole role, char side, const std::vector<QuantSite>& sites,
                                       LayerClass cls, QuantLog* log) {
  std::vector<Prepared> out(offsets.size() - 1);
  const bool dense = spec.fmt == Format::F32 || spec.fmt == Format::BF16;
  std::vector<QTensor> qs;
  Prepared whole;
  if (dense) {
    whole = prepare(t, spec, role, side, QuantSite{}, cls, nullptr);  // F32/BF16 draw no bits
  } else {
    qs = ops::quantize_segments(t, offsets, quantized_spec(t, spec, role, side, cls), site_keys(sites));
  }
  for (size_t e = 0; e < out.size(); ++e) {
    const int64_t b = offsets[e], end = offsets[e + 1];
    if (b == end) continue;
    if (log) log->add(cls, role, side, spec, false);
    if (log && log->record_calls) record(log, sites[e], spec, hash_tensor(t.slice_rows(b, end)));
    if (dense) {
      out[e] = whole;
      out[e].dense = whole.dense.slice_rows(b, end);
    } else {
      out[e].q = std::move(qs[e]);
    }
  }
  return out;
}

namespace {
// prepare_row_col's result from the quantizer's forms, with its log entries (not its call records).
PreparedRowCol row_col_prepared(ops::RowColQuant q, const QuantSpec& row_spec, GemmRole row_role, char row_side,
                                const QuantSpec& col_spec, GemmRole col_role, char col_side,
                                const std::vector<int64_t>& offsets, LayerClass cls, QuantLog* log) {
  PreparedRowCol out;
  if (log) log->add(cls, row_role, row_side, row_spec, false);
  out.row.q = std::move(q.row);
  out.col.resize(offsets.size() - 1);
  for (size_t e = 0; e < out.col.size(); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    if (log) log->add(cls, col_role, col_side, col_spec, false);
    out.col[e].q = std::move(q.col[e]);
  }
  return out;
}
}  // namespace

PreparedRowCol prepare_row_col(const Tensor& t, const QuantSpec& row_spec, GemmRole row_role, char row_side,
                               const QuantSite& row_site, const QuantSpec& col_spec, GemmRole col_role, char col_side,
                               const std::vector<int64_t>& offsets, const std::vector<QuantSite>& col_sites,
                               LayerClass cls, QuantLog* log, ops::FormOut row_out, ops::FormOut col_out) {
  FOURBIT_CHECK(row_spec.quantized() && col_spec.quantized(), "prepare_row_col of a dense spec");
  FOURBIT_CHECK(offsets.size() == col_sites.size() + 1, "prepare_row_col: {} offsets for {} sites", offsets.size(),
                col_sites.size());
  const QuantSpec rs = quantized_spec(t, row_spec, row_role, row_side, cls);
  const QuantSpec cs = quantized_spec(t, col_spec, col_role, col_side, cls);
  const std::vector<ops::RngKey> keys = site_keys(col_sites);
  if (log && log->record_calls) {
    record(log, row_site, row_spec, hash_tensor(t));
    for (size_t e = 0; e < col_sites.size(); ++e)
      if (offsets[e] < offsets[e + 1]) record(log, col_sites[e], col_spec, hash_tensor(t.slice_rows(offsets[e], offsets[e + 1])));
  }
  return row_col_prepared(ops::quantize_row_col(t, rs, row_site.key, cs, offsets, keys, row_out, col_out), row_spec,
                          row_role, row_side, col_spec, col_role, col_side, offsets, cls, log);
}

namespace {
// prepare_row_col of the tensor `make` computes (`like`: one of its inputs, for the quantized
// specs' checks), made by `fused` instead — the op that computes and quantizes it in one pass,
// given the specs on their axes and the segments' keys — unless the log records calls: their
// records hash the tensor, so it is then computed and prepared apart.
using FusedRowCol =
    std::function<ops::RowColQuant(const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys)>;
PreparedRowCol computed_row_col(const std::function<Tensor()>& make, const FusedRowCol& fused, const Tensor& like,
                                const QuantSpec& row_spec, GemmRole row_role, char row_side, const QuantSite& row_site,
                                const QuantSpec& col_spec, GemmRole col_role, char col_side,
                                const std::vector<int64_t>& offsets, const std::vector<QuantSite>& col_sites,
                                LayerClass cls, QuantLog* log, ops::FormOut row_out, ops::FormOut col_out) {
  if (log && log->record_calls)
    return prepare_row_col(make(), row_spec, row_role, row_side, row_site, col_spec, col_role, col_side, offsets,
                           col_sites, cls, log, row_out, col_out);
  FOURBIT_CHECK(row_spec.quantized() && col_spec.quantized(), "prepare_row_col of a dense spec");
  FOURBIT_CHECK(offsets.size() == col_sites.size() + 1, "prepare_row_col: {} offsets for {} sites", offsets.size(),
                col_sites.size());
  const std::vector<ops::RngKey> keys = site_keys(col_sites);
  return row_col_prepared(fused(quantized_spec(like, row_spec, row_role, row_side, cls),
                                quantized_spec(like, col_spec, col_role, col_side, cls), keys),
                          row_spec, row_role, row_side, col_spec, col_role, col_side, offsets, cls, log);
}
}  // namespace

PreparedRowCol prepare_gathered_row_col(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec,
                                        GemmRole row_role, char row_side, const QuantSite& row_site,
                                        const QuantSpec& col_spec, GemmRole col_role, char col_side,
                                        const std::vector<int64_t>& offsets, const std::vector<QuantSite>& col_sites,
                                        LayerClass cls, QuantLog* log, ops::FormOut row_out, ops::FormOut col_out) {
  const auto make = [&] {
    Tensor x_perm = Tensor::empty({token_of_slot.size(0), x.size(1)}, x.dtype(), x.device());
    ops::gather_rows(x, token_of_slot, x_perm);
    return x_perm;
  };
  const auto fused = [&](const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys) {
    return ops::gather_quantize_row_col(x, token_of_slot, rs, row_site.key, cs, offsets, keys, row_out, col_out);
  };
  return computed_row_col(make, fused, x, row_spec, row_role, row_side, row_site, col_spec, col_role, col_side,
                          offsets, col_sites, cls, log, row_out, col_out);
}

PreparedRowCol prepare_combine_grad_row_col(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                                            const Tensor& w, Tensor& dw, const QuantSpec& row_spec, GemmRole row_role,
                                            char row_side, const QuantSite& row_site, const QuantSpec& col_spec,
                                            GemmRole col_role, char col_side, const std::vector<int64_t>& offsets,
                                            const std::vector<QuantSite>& col_sites, LayerClass cls, QuantLog* log,
                                            ops::FormOut row_out, ops::FormOut col_out) {
  const auto make = [&] {
    Tensor dy_perm = Tensor::empty(y_perm.shape(), dout.dtype(), dout.device());
    ops::moe_combine_backward(dout, y_perm, slot_of, w, dy_perm, dw);
    return dy_perm;
  };
  const auto fused = [&](const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys) {
    return ops::moe_combine_backward_row_col(dout, y_perm, slot_of, w, dw, rs, row_site.key, cs, offsets, keys,
                                             row_out, col_out);
  };
  return computed_row_col(make, fused, dout, row_spec, row_role, row_side, row_site, col_spec, col_role, col_side,
                          offsets, col_sites, cls, log, row_out, col_out);
}

PreparedRowCol prepare_swiglu(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, GemmRole row_role,
                              char row_side, const QuantSite& row_site, const QuantSpec& col_spec, GemmRole col_role,
                              char col_side, const std::vector<int64_t>& offsets,
                              const std::vector<QuantSite>& col_sites, LayerClass cls, QuantLog* log,
                              ops::FormOut row_out, ops::FormOut col_out) {
  const auto make = [&] {
    Tensor a = Tensor::empty(h1.shape(), h1.dtype(), h1.device());
    ops::swiglu_forward(h1, h3, a);
    return a;
  };
  const auto fused = [&](const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys) {
    return ops::swiglu_forward_row_col(h1, h3, rs, row_site.key, cs, offsets, keys, row_out, col_out);
  };
  if (!offsets.empty())
    return computed_row_col(make, fused, h1, row_spec, row_role, row_side, row_site, col_spec, col_role, col_side,
                            offsets, col_sites, cls, log, row_out, col_out);
  // the Row form alone: prepare's bits and log entry
  PreparedRowCol out;
  if (log && log->record_calls) {  // the records hash a: written, then prepared
    out.row = prepare(make(), row_spec, row_role, row_side, row_site, cls, log);
    return out;
  }
  FOURBIT_CHECK(row_spec.quantized() && col_spec.quantized(), "prepare_swiglu of a dense spec");
  if (log) log->add(cls, row_role, row_side, row_spec, false);
  out.row.q = fused(quantized_spec(h1, row_spec, row_role, row_side, cls),
                    quantized_spec(h1, col_spec, col_role, col_side, cls), {})
                  .row;
  return out;
}

std::array<PreparedRowCol, 2> prepare_swiglu_grads(const Tensor& da, const Tensor& h1, const Tensor& h3,
                                                   const QuantSpec& row_spec, GemmRole row_role, char row_side,
                                                   const std::array<QuantSite, 2>& row_sites, const QuantSpec& col_spec,
                                                   GemmRole col_role, char col_side, const std::vector<int64_t>& offsets,
                                                   const std::array<std::vector<QuantSite>, 2>& col_sites,
                                                   LayerClass cls, QuantLog* log, ops::FormOut row_out,
                                                   ops::FormOut col_out) {
  std::array<PreparedRowCol, 2> out;
  if (log && log->record_calls) {  // the records hash dh1 and dh3: written, then prepared
    Tensor dh1 = Tensor::empty(da.shape(), da.dtype(), da.device()), dh3 = Tensor::empty(da.shape(), da.dtype(), da.device());
    ops::swiglu_backward(da, h1, h3, dh1, dh3);
    const Tensor* dh[2] = {&dh1, &dh3};
    for (size_t o = 0; o < 2; ++o)
      out[o] = prepare_row_col(*dh[o], row_spec, row_role, row_side, row_sites[o], col_spec, col_role, col_side, offsets,
                               col_sites[o], cls, log, row_out, col_out);
    return out;
  }
  FOURBIT_CHECK(row_spec.quantized() && col_spec.quantized(), "prepare_swiglu_grads of a dense spec");
  const QuantSpec rs = quantized_spec(da, row_spec, row_role, row_side, cls);
  const QuantSpec cs = quantized_spec(da, col_spec, col_role, col_side, cls);
  std::array<std::vector<ops::RngKey>, 2> keys;
  for (size_t o = 0; o < 2; ++o) {
    FOURBIT_CHECK(offsets.size() == col_sites[o].size() + 1, "prepare_swiglu_grads: {} offsets for {} sites",
                  offsets.size(), col_sites[o].size());
    keys[o] = site_keys(col_sites[o]);
  }
  std::array<ops::RowColQuant, 2> q = ops::swiglu_backward_row_col(
      da, h1, h3, rs, {row_sites[0].key, row_sites[1].key}, cs, offsets, keys, row_out, col_out);
  for (size_t o = 0; o < 2; ++o)
    out[o] = row_col_prepared(std::move(q[o]), row_spec, row_role, row_side, col_spec, col_role, col_side, offsets, cls,
                              log);
  return out;
}

namespace {
// The Col forms' keys of a device-offset preparer, one a segment of offsets (I32 [G + 1]).
std::vector<ops::RngKey> device_segment_keys(const char* op, const Tensor& offsets,
                                             const std::vector<QuantSite>& col_sites) {
  FOURBIT_CHECK(offsets.defined() && offsets.dim() == 1 && offsets.size(0) == int64_t(col_sites.size()) + 1,
                "{}: offsets {} for {} sites", op, offsets.defined() ? offsets.str() : "undefined", col_sites.size());
  return site_keys(col_sites);
}
// A device-offset preparer's result: `fused` given the specs on their axes and the segments' keys.
PreparedRowCol device_row_col(const char* op, const FusedRowCol& fused, const Tensor& like, const QuantSpec& row_spec,
                              GemmRole row_role, char row_side, const QuantSpec& col_spec, GemmRole col_role,
                              char col_side, const Tensor& offsets, const std::vector<QuantSite>& col_sites,
                              LayerClass cls) {
  FOURBIT_CHECK(row_spec.quantized() && col_spec.quantized(), "{} of a dense spec", op);
  ops::RowColQuant q = fused(quantized_spec(like, row_spec, row_role, row_side, cls),
                             quantized_spec(like, col_spec, col_role, col_side, cls),
                             device_segment_keys(op, offsets, col_sites));
  PreparedRowCol out;
  out.row.q = std::move(q.row);
  out.col_rows = std::move(q.col_rows);
  return out;
}
}  // namespace

PreparedRowCol prepare_gathered_row_col_device_offsets(const Tensor& x, const Tensor& token_of_slot,
                                                       const QuantSpec& row_spec, GemmRole row_role, char row_side,
                                                       const QuantSite& row_site, const QuantSpec& col_spec,
                                                       GemmRole col_role, char col_side, const Tensor& offsets,
                                                       const std::vector<QuantSite>& col_sites, LayerClass cls,
                                                       ops::FormOut row_out) {
  const auto fused = [&](const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys) {
    return ops::gather_quantize_row_col_device_offsets(x, token_of_slot, rs, row_site.key, cs, offsets, keys, row_out);
  };
  return device_row_col("prepare_gathered_row_col_device_offsets", fused, x, row_spec, row_role, row_side, col_spec,
                        col_role, col_side, offsets, col_sites, cls);
}

PreparedRowCol prepare_combine_grad_row_col_device_offsets(const Tensor& dout, const Tensor& y_perm,
                                                           const Tensor& slot_of, const Tensor& w, Tensor& dw,
                                                           const QuantSpec& row_spec, GemmRole row_role,
                                                           char row_side, const QuantSite& row_site,
                                                           const QuantSpec& col_spec, GemmRole col_role,
                                                           char col_side, const Tensor& offsets,
                                                           const std::vector<QuantSite>& col_sites, LayerClass cls,
                                                           ops::FormOut row_out) {
  const auto fused = [&](const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys) {
    return ops::moe_combine_backward_row_col_device_offsets(dout, y_perm, slot_of, w, dw, rs, row_site.key, cs, offsets,
                                                            keys, row_out);
  };
  return device_row_col("prepare_combine_grad_row_col_device_offsets", fused, dout, row_spec, row_role, row_side,
                        col_spec, col_role, col_side, offsets, col_sites, cls);
}

PreparedRowCol prepare_swiglu_device_offsets(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                                             GemmRole row_role, char row_side, const QuantSite& row_site,
                                             const QuantSpec& col_spec, GemmRole col_role, char col_side,
                                             const Tensor& offsets, const std::vector<QuantSite>& col_sites,
                                             LayerClass cls, ops::FormOut row_out) {
  const auto fused = [&](const QuantSpec& rs, const QuantSpec& cs, const std::vector<ops::RngKey>& keys) {
    return ops::swiglu_forward_row_col_device_offsets(h1, h3, rs, row_site.key, cs, offsets, keys, row_out);
  };
  return device_row_col("prepare_swiglu_device_offsets", fused, h1, row_spec, row_role, row_side, col_spec, col_role,
                        col_side, offsets, col_sites, cls);
}

std::array<PreparedRowCol, 2> prepare_swiglu_grads_device_offsets(
    const Tensor& da, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, GemmRole row_role,
    char row_side, const std::array<QuantSite, 2>& row_sites, const QuantSpec& col_spec, GemmRole col_role,
    char col_side, const Tensor& offsets, const std::array<std::vector<QuantSite>, 2>& col_sites, LayerClass cls,
    ops::FormOut row_out) {
  const char* op = "prepare_swiglu_grads_device_offsets";
  FOURBIT_CHECK(row_spec.quantized() && col_spec.quantized(), "{} of a dense spec", op);
  std::array<ops::RowColQuant, 2> q = ops::swiglu_backward_row_col_device_offsets(
      da, h1, h3, quantized_spec(da, row_spec, row_role, row_side, cls), {row_sites[0].key, row_sites[1].key},
      quantized_spec(da, col_spec, col_role, col_side, cls),
      offsets, {device_segment_keys(op, offsets, col_sites[0]), device_segment_keys(op, offsets, col_sites[1])},
      row_out);
  std::array<PreparedRowCol, 2> out;
  for (size_t o = 0; o < 2; ++o) {
    out[o].row.q = std::move(q[o].row);
    out[o].col_rows = std::move(q[o].col_rows);
  }
  return out;
}

std::vector<std::pair<Prepared, Prepared>> prepare_weights_both(
    const std::vector<WeightBoth>& ws, QuantLog* log, bool batched,
    const std::vector<std::pair<Prepared, Prepared>>* into) {
  std::vector<ops::BothJob> jobs;
  for (const WeightBoth& b : ws) {
    FOURBIT_CHECK(b.fprop.quantized() && b.dgrad.quantized(), "prepare_weights_both of a dense spec");
    jobs.push_back({b.w, quantized_spec(b.w, b.fprop, GemmRole::Fprop, 'b', b.cls), b.fprop_site.key,
                    quantized_spec(b.w, b.dgrad, GemmRole::Dgrad, 'b', b.cls), b.dgrad_site.key, ops::FormOut::Bf16,
                    ops::FormOut::Bf16});
  }
  std::vector<ops::BothAxes> q;
  FOURBIT_CHECK(!into || (batched && into->size() == ws.size()), "prepare_weights_both: {} operand pairs to write "
                "into for {} weights{}", into ? into->size() : 0, ws.size(), batched ? "" : ", one call a weight");
  if (into) {
    for (const auto& [f, d] : *into) q.push_back({f.q, d.q});
    ops::quantize_both_each_into(jobs, q);
  } else if (batched) {
    q = ops::quantize_both_each(jobs);
  } else {
    for (const ops::BothJob& j : jobs)
      q.push_back(ops::quantize_both(j.x, j.row_spec, j.row_rng, j.col_spec, j.col_rng, j.row_out, j.col_out));
  }
  std::vector<std::pair<Prepared, Prepared>> out(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    if (log && log->record_calls) {
      const uint64_t h = hash_tensor(ws[i].w);
      record(log, ws[i].fprop_site, ws[i].fprop, h);
      record(log, ws[i].dgrad_site, ws[i].dgrad, h);
    }
    out[i].first.q = std::move(q[i].row);
    out[i].second.q = std::move(q[i].col);
  }
  return out;
}

Prepared requantize_saved(const Prepared& saved, const QuantSpec& spec, GemmRole role, char side,
                          const QuantSite& site, LayerClass cls, QuantLog* log, ops::FormOut form) {
  check_saved_nvfp4(saved);
  if (log) log->add(cls, role, side, spec, true);
  if (log && log->record_calls) record(log, site, spec, hash_qtensor(saved.q));
  Prepared p;
  p.q = ops::requantize_transposed(saved.q, spec, site.key, form);
  return p;
}

std::vector<Prepared> requantize_saved_segments(const Prepared& saved, const std::vector<int64_t>& offsets,
                                                const QuantSpec& spec, GemmRole role, char side,
                                                const std::vector<QuantSite>& sites, LayerClass cls, QuantLog* log,
                                                ops::FormOut form) {
  check_saved_nvfp4(saved);
  std::vector<QTensor> qs = ops::requantize_transposed_segments(saved.q, offsets, spec, site_keys(sites), form);
  std::vector<Prepared> out(qs.size());
  for (size_t e = 0; e < qs.size(); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    if (log) log->add(cls, role, side, spec, true);
    if (log && log->record_calls)
      record(log, sites[e], spec, hash_qtensor(ops::qtensor_rows(saved.q, offsets[e], offsets[e + 1])));
    out[e].q = std::move(qs[e]);
  }
  return out;
}

void gemm(const Prepared& a, const Prepared& b, Tensor& c, bool accumulate) {
  ops::gemm(a.op(), b.op(), c, accumulate);
}

namespace {
std::atomic<bool> g_forward_grouped{true};
}  // namespace

namespace {

// ts[p] holds `slices` blocks of rows[p] rows of C values each (as [slices * rows[p], C] or any
// shape of that size): a new [slices * sum(rows), C] tensor whose slice s is the parts' blocks s
// one after another (one strided copy a part).
Tensor stack_slices(const std::vector<Tensor>& ts, const std::vector<int64_t>& rows, int64_t slices, int64_t C) {
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t(0));
  Tensor out = Tensor::empty({slices * total, C}, ts[0].dtype(), ts[0].device());
  const size_t es = size_t(dtype_size(out.dtype()));
  int64_t at = 0;
  for (size_t p = 0; p < ts.size(); ++p) {
    copy_bytes_2d(static_cast<char*>(out.raw()) + size_t(at * C) * es, size_t(total * C) * es, ts[p].raw(),
                  size_t(rows[p] * C) * es, size_t(rows[p] * C) * es, size_t(slices), out.device());
    at += rows[p];
  }
  return out;
}

Prepared stack_quantized(const std::vector<Prepared>& parts, bool shared_outer) {
  const QTensor& q0 = parts[0].q;
  if (q0.axis != BlockAxis::Row) return {};
  if ((q0.outer == OuterScale::Tensor || q0.outer == OuterScale::PerSlice) && !shared_outer) return {};
  std::vector<int64_t> rows;
  bool all_bf16 = true;
  for (const Prepared& p : parts) {
    const QTensor& q = p.q;
    if (!p.is_quantized() || q.fmt != q0.fmt || q.axis != q0.axis || q.outer != q0.outer || q.slices != q0.slices ||
        q.cols != q0.cols || q.tile_2d != q0.tile_2d || q.hadamard != q0.hadamard ||
        q.hadamard_signs != q0.hadamard_signs || q.device() != q0.device())
      return {};
    if (q.tile_2d && q.rows % 16 != 0) return {};  // keep every 16-row tile within one part
    if (!q.codes.defined()) return {};             // a decode alone (prepare_weights_both): run apart
    rows.push_back(q.rows);
    all_bf16 = all_bf16 && q.bf16.defined();
  }
  const auto field = [&](Tensor QTensor::*member) {
    std::vector<Tensor> ts;
    for (const Prepared& p : parts) ts.push_back(p.q.*member);
    return ts;
  };
  QTensor out = q0;
  out.row_amax = Tensor{};  // the parts' rows, stacked: not recorded
  out.rows = std::accumulate(rows.begin(), rows.end(), int64_t(0));
  out.codes = stack_slices(field(&QTensor::codes), rows, q0.slices, q0.code_row_bytes());
  out.block_scales = stack_slices(field(&QTensor::block_scales), rows, q0.slices, q0.blocks_per_row());
  // per row: the parts' own rows' scales; per tensor or slice: one amax was shared, so part 0's
  // scales are every part's
  if (q0.outer == OuterScale::PerRow)
    out.outer_scales = stack_slices(field(&QTensor::outer_scales), rows, q0.slices, 1).reshape({q0.slices * out.rows});
  out.bf16 = all_bf16 ? stack_slices(field(&QTensor::bf16), rows, q0.slices, q0.padded_cols()) : Tensor{};
  Prepared p;
  p.q = std::move(out);
  return p;
}

Prepared stack_dense(const std::vector<Prepared>& parts) {
  const Tensor& d0 = parts[0].dense;
  const bool stacked = d0.dim() == 3;
  if (d0.dim() != 2 && !stacked) return {};
  const int64_t slices = stacked ? d0.size(0) : 1, K = d0.size(-1);
  std::vector<int64_t> rows;
  std::vector<Tensor> ts;
  bool adjacent = !stacked;  // one buffer, each part right after the one before
  for (size_t i = 0; i < parts.size(); ++i) {
    const Tensor& d = parts[i].dense;
    if (parts[i].is_quantized() || !d.defined() || parts[i].trans || d.dtype() != d0.dtype() || d.dim() != d0.dim() ||
        d.size(-1) != K || (stacked && d.size(0) != slices) || d.device() != d0.device())
      return {};
    rows.push_back(d.size(-2));
    ts.push_back(d);
    if (i > 0)
      adjacent = adjacent && d.shares_storage(d0) &&
                 static_cast<const char*>(d.raw()) ==
                     static_cast<const char*>(parts[i - 1].dense.raw()) + parts[i - 1].dense.nbytes();
  }
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t(0));
  Prepared p;
  if (adjacent) p.dense = d0.view(0, {total, K});
  else p.dense = stack_slices(ts, rows, slices, K).reshape(stacked ? Shape{slices, total, K} : Shape{total, K});
  return p;
}

Prepared append_quantized(const std::vector<Prepared>& parts) {
  const QTensor& q0 = parts[0].q;
  if (q0.axis != BlockAxis::Row || q0.outer == OuterScale::Tensor) return {};
  std::vector<Tensor> codes, scales, outers, bf16;
  std::vector<int64_t> rows;  // each part's storage rows, all slices
  int64_t slices = 0;
  bool all_bf16 = true;
  for (const Prepared& p : parts) {
    const QTensor& q = p.q;
    if (!p.is_quantized() || p.trans || q.fmt != q0.fmt || q.axis != q0.axis || q.outer != q0.outer ||
        q.rows != q0.rows || q.cols != q0.cols || q.tile_2d != q0.tile_2d || q.hadamard != q0.hadamard ||
        q.hadamard_signs != q0.hadamard_signs || q.device() != q0.device())
      return {};
    slices += q.slices;
    rows.push_back(q.total_rows());
    codes.push_back(q.codes);
    scales.push_back(q.block_scales);
    if (q.outer != OuterScale::None) outers.push_back(q.outer_scales.reshape({q.outer_scales.numel(), 1}));
    bf16.push_back(q.bf16);
    all_bf16 = all_bf16 && q.bf16.defined();
  }
  QTensor out = q0;
  out.row_amax = Tensor{};  // the parts' rows, stacked: not recorded
  out.slices = slices;
  out.codes = stack_slices(codes, rows, 1, q0.code_row_bytes());
  out.block_scales = stack_slices(scales, rows, 1, q0.blocks_per_row());
  if (q0.outer != OuterScale::None) {  // PerRow: a scale a storage row; PerSlice: one a slice
    std::vector<int64_t> n;
    for (const Tensor& t : outers) n.push_back(t.size(0));
    const Tensor all = stack_slices(outers, n, 1, 1);
    out.outer_scales = all.reshape({all.size(0)});
  }
  out.bf16 = all_bf16 ? stack_slices(bf16, rows, 1, q0.padded_cols()) : Tensor{};
  Prepared p;
  p.q = std::move(out);
  return p;
}

Prepared append_dense(const std::vector<Prepared>& parts) {
  const Tensor& d0 = parts[0].dense;
  if (!d0.defined() || d0.dtype() != DType::BF16 || (d0.dim() != 2 && d0.dim() != 3)) return {};
  const int64_t R = d0.size(-2), K = d0.size(-1);
  std::vector<Tensor> ts;
  std::vector<int64_t> rows;
  int64_t slices = 0;
  for (const Prepared& p : parts) {
    const Tensor& d = p.dense;
    if (p.is_quantized() || p.trans || !d.defined() || d.dtype() != d0.dtype() || (d.dim() != 2 && d.dim() != 3) ||
        d.size(-2) != R || d.size(-1) != K || d.device() != d0.device())
      return {};
    const int64_t s = d.dim() == 3 ? d.size(0) : 1;
    slices += s;
    rows.push_back(s * R);
    ts.push_back(d);
  }
  Prepared p;
  p.dense = stack_slices(ts, rows, 1, K).reshape({slices, R, K});
  return p;
}

}  // namespace

Prepared append_weight_slices(const std::vector<Prepared>& parts) {
  FOURBIT_CHECK(parts.size() >= 2, "append_weight_slices: appending needs two parts or more");
  return parts[0].is_quantized() ? append_quantized(parts) : append_dense(parts);
}

Prepared stack_fprop_weights(const std::vector<Prepared>& parts, bool shared_outer) {
  FOURBIT_CHECK(parts.size() >= 2, "stack_fprop_weights: stacking needs two parts or more");
  return parts[0].is_quantized() ? stack_quantized(parts, shared_outer) : stack_dense(parts);
}

void forward_gemm(const Prepared& a, const Prepared& b, Tensor& c) {
  if (g_forward_grouped.load(std::memory_order_relaxed)) ops::grouped_gemm(a.op(), b.op(), {0, a.op().rows()}, c);
  else ops::gemm(a.op(), b.op(), c);
}

void set_forward_gemms_grouped(bool on) { g_forward_grouped.store(on, std::memory_order_relaxed); }
bool forward_gemms_grouped() { return g_forward_grouped.load(std::memory_order_relaxed); }

void grouped_gemm(const Prepared& a, const Prepared& b, const std::vector<int64_t>& offsets, Tensor& c,
                  bool accumulate) {
  ops::grouped_gemm(a.op(), b.op(), offsets, c, accumulate);
}

}  // namespace fourbit
