// defines: Prepared, QuantSite, QuantLog, SrStreams, prepare, producer_quant, producer_quantized,
//          shared_outer_amax, prepare_segments,
//          PreparedRowCol, prepare_row_col, prepare_gathered_row_col, prepare_combine_grad_row_col,
//          prepare_swiglu, prepare_swiglu_grads, prepare_gathered_row_col_device_offsets,
//          prepare_combine_grad_row_col_device_offsets, prepare_swiglu_device_offsets,
//          prepare_swiglu_grads_device_offsets, WeightBoth, prepare_weights_both,
//          requantize_saved, requantize_saved_segments, stack_fprop_weights, append_weight_slices, gemm, forward_gemm,
//          set_forward_gemms_grouped,
//          forward_gemms_grouped, grouped_gemm
// Turning a tensor into the GEMM operand a recipe asks for. A Prepared operand is either a dense
// tensor (F32/F64 as it is, or a BF16 copy) or a QTensor; the block axis comes from the role
// (DESIGN "The recipe"): fprop operands and dY for dgrad run their blocks along the rows' K,
// W for dgrad and both wgrad operands along the token/output axis (stored transposed).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fourbit/model/recipe.h"
#include "fourbit/ops/ops.h"

namespace fourbit {

struct Prepared {
  Tensor dense;        // defined for dense operands
  bool trans = false;  // dense: the matrix is stored [K, R]
  QTensor q;           // defined (q.defined()) for quantized operands
  bool is_quantized() const { return q.defined(); }
  bool defined() const { return dense.defined() || is_quantized(); }
  ops::Operand op() const { return is_quantized() ? ops::Operand(q) : ops::Operand(dense, trans); }
  int64_t bytes() const { return is_quantized() ? q.nbytes() : (dense.defined() ? dense.nbytes() : 0); }
  // Rows [b, e) of a Row-axis operand (token segments of a permuted activation).
  Prepared rows(int64_t b, int64_t e) const;
  // Slice s of a 3-D weight operand (one expert).
  Prepared slice(int64_t s) const;
};

// One quantization point of the model: its stable name and the SR stream derived from it
// (SrStreams::key). Names read "<weight or input group>/<gemm>/<operand>[<expert>]", e.g.
// "layers.3.attn.wq/dgrad/dY", "layers.1.moe.w13/wgrad/X^T[5]", "lm_head/fprop/X"
// (docs/model.md lists them).
struct QuantSite {
  std::string name;
  ops::RngKey key;
};

// Which quantizer ran where, for tests and for `fourbit recipes --explain`: the key is
// "<class>/<role>/<a|b>/<format>[/requant]", the value a count of calls. With record_calls, also
// every quantization call in order: its site, stream and a hash of its input (the stream test).
struct QuantLog {
  struct Call {
    std::string site;
    ops::RngKey key;
    std::string spec;     // describe() of the spec it ran
    uint64_t input_hash;  // FNV-1a of the input's bytes (a tensor's, or a saved QTensor's)
  };
  std::map<std::string, int64_t> counts;
  std::vector<Call> calls;
  bool enabled = false;
  bool record_calls = false;
  void add(LayerClass c, GemmRole r, char operand, const QuantSpec& s, bool requant);
};

// Deterministic stochastic-rounding streams. The stream of a quantization point is a function of
// (step, micro-batch, the point's name): the name's FNV-1a 64-bit hash and the two counters,
// each folded in through the splitmix64 finaliser, so that nearby steps and similar names give
// unrelated Philox streams. The Philox key is the run's seed.
struct SrStreams {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t micro = 0;
  ops::RngKey key(std::string_view site_name) const;
  QuantSite site(std::string name) const {
    const ops::RngKey k = key(name);
    return QuantSite{std::move(name), k};
  }
};

// Prepares t as operand `side` ('a' or 'b') of GEMM `role` under spec. t: F32 (F64 for dense
// specs in gradient checks), 2-D, or 3-D [slices, R, C] for expert weights. group_amax: the outer
// scales' group amax to use (ops::quantize), for weights sharing one scale. converted: t's BF16
// copy made ahead (ops::convert_each) for a BF16 spec, used instead of converting t here (the log
// still records t).
// form: what a block-scaled operand holds (ops::FormOut; ops::quantize).
Prepared prepare(const Tensor& t, const QuantSpec& spec, GemmRole role, char side, const QuantSite& site,
                 LayerClass cls, QuantLog* log, const Tensor* group_amax = nullptr, const Tensor* converted = nullptr,
                 ops::FormOut form = ops::FormOut::Codes);

// prepare(t, spec, role, side, site, ...) of a block-scaled spec whose blocks run along t's rows,
// made by the op that writes t (ops.h "Quantized outputs"): producer_quant is the request to hand
// that op (the spec on role's axis, site's stream; the result lands in *out), and
// producer_quantized(*out, t, ...) the Prepared it gives, logged as prepare logs it. The same
// bits as prepare.
ops::RowQuant producer_quant(const QuantSpec& spec, GemmRole role, char side, const QuantSite& site, QTensor* out);
Prepared producer_quantized(QTensor q, const Tensor& t, const QuantSpec& spec, GemmRole role, char side,
                            const QuantSite& site, LayerClass cls, QuantLog* log);

// ops::outer_amax of the weights that share one outer scale under spec on role's block axis (an
// FFN's w1 and w3), or an undefined tensor where spec has no outer scale.
Tensor shared_outer_amax(const std::vector<Tensor>& ws, const QuantSpec& spec, GemmRole role);

// prepare() of rows offsets[e] .. offsets[e + 1] of a 2-D t for every segment e (an expert's
// tokens), at sites[e]; empty segments give an empty Prepared. Bit for bit the per-segment
// calls, in one pass (ops::quantize_segments; a dense operand is converted once and sliced).
std::vector<Prepared> prepare_segments(const Tensor& t, const std::vector<int64_t>& offsets, const QuantSpec& spec,
                                       GemmRole role, char side, const std::vector<QuantSite>& sites,
                                       LayerClass cls, QuantLog* log);

// One operand on each block axis from one t: the Row-axis operand (row_role, row_side) under
// row_spec at row_site, and the Col-axis operand (col_role, col_side) under col_spec of every row
// segment of offsets ({0, rows}: the whole t) at col_sites — the bits and log entries of
// prepare(t, row_spec, ...) followed by prepare_segments(t, offsets, col_spec, ...), in one
// ops::quantize_row_col (one pass over t on the GPU where both are MXFP8). Both specs must be
// block-scaled (the model calls it where ops::row_col_one_pass holds). row_out / col_out: what
// the GPU writes of each form (ops::FormOut): the BF16 decode for an operand a GEMM reads right
// away (not for one saved for the backward pass: it would keep 2 bytes a value alive), the decode
// alone for one that nothing reads after those GEMMs.
struct PreparedRowCol {
  Prepared row;
  std::vector<Prepared> col;
  // The *_device_offsets preparers' Col forms instead of col: their BF16 decodes in the rows'
  // layout, [rows, cols] (ops::RowColQuant::col_rows).
  Tensor col_rows;
};
PreparedRowCol prepare_row_col(const Tensor& t, const QuantSpec& row_spec, GemmRole row_role, char row_side,
                               const QuantSite& row_site, const QuantSpec& col_spec, GemmRole col_role, char col_side,
                               const std::vector<int64_t>& offsets, const std::vector<QuantSite>& col_sites,
                               LayerClass cls, QuantLog* log, ops::FormOut row_out, ops::FormOut col_out);
// prepare_row_col of gather_rows(x, token_of_slot) (the experts' dispatched tokens), its bits and
// log entries, in one ops::gather_quantize_row_col (on the GPU, where the specs are MXFP8, the
// gathered rows are never written in F32). With the log's record_calls, whose records hash the
// gathered rows, the two steps run apart.
PreparedRowCol prepare_gathered_row_col(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec,
                                        GemmRole row_role, char row_side, const QuantSite& row_site,
                                        const QuantSpec& col_spec, GemmRole col_role, char col_side,
                                        const std::vector<int64_t>& offsets, const std::vector<QuantSite>& col_sites,
                                        LayerClass cls, QuantLog* log, ops::FormOut row_out, ops::FormOut col_out);
// moe_combine_backward (dw written) followed by prepare_row_col of its dy_perm, their bits and log
// entries, in one ops::moe_combine_backward_row_col (on the GPU, where the specs are MXFP8,
// dy_perm is never written in F32). With the log's record_calls, whose records hash dy_perm, the
// two steps run apart.
PreparedRowCol prepare_combine_grad_row_col(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                                            const Tensor& w, Tensor& dw, const QuantSpec& row_spec, GemmRole row_role,
                                            char row_side, const QuantSite& row_site, const QuantSpec& col_spec,
                                            GemmRole col_role, char col_side, const std::vector<int64_t>& offsets,
                                            const std::vector<QuantSite>& col_sites, LayerClass cls, QuantLog* log,
                                            ops::FormOut row_out, ops::FormOut col_out);
// prepare_row_col of swiglu_forward's a from h1 and h3 (F32 [rows, F]; offsets empty: prepare of
// a's Row-axis form alone, at row_site; col_spec still names a Col-axis spec that pairs with
// row_spec): the bits and log entries of ops::swiglu_forward followed by that preparation, in one
// ops::swiglu_forward_row_col (on the GPU, where the specs are MXFP8, a is never written in F32).
// With the log's record_calls, whose records hash a, the two steps run apart.
PreparedRowCol prepare_swiglu(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, GemmRole row_role,
                              char row_side, const QuantSite& row_site, const QuantSpec& col_spec, GemmRole col_role,
                              char col_side, const std::vector<int64_t>& offsets,
                              const std::vector<QuantSite>& col_sites, LayerClass cls, QuantLog* log,
                              ops::FormOut row_out, ops::FormOut col_out);
// prepare_row_col of swiglu_backward's dh1 and dh3 from da, h1 and h3 (F32 [rows, F]), output o
// (dh1, dh3) at row_sites[o] and col_sites[o]: the bits and log entries of ops::swiglu_backward
// followed by prepare_row_col of each, in one ops::swiglu_backward_row_col (on the GPU, where the
// specs are MXFP8, dh1 and dh3 are never written in F32). With the log's record_calls, whose
// records hash dh1 and dh3, the two steps run apart.
std::array<PreparedRowCol, 2> prepare_swiglu_grads(const Tensor& da, const Tensor& h1, const Tensor& h3,
                                                   const QuantSpec& row_spec, GemmRole row_role, char row_side,
                                                   const std::array<QuantSite, 2>& row_sites, const QuantSpec& col_spec,
                                                   GemmRole col_role, char col_side, const std::vector<int64_t>& offsets,
                                                   const std::array<std::vector<QuantSite>, 2>& col_sites,
                                                   LayerClass cls, QuantLog* log, ops::FormOut row_out,
                                                   ops::FormOut col_out);
// The four preparers above with the segments as an I32 [G + 1] tensor on the device (a route
// plan's device_offsets, which the host does not have yet), as ops::*_device_offsets take them: the
// Row form as there, the Col forms as their decodes in the rows' layout (out.col_rows; out.col
// stays empty), the same values; on the GPU, where the one-pass kernel takes the specs, nothing
// comes back to the host (a step that runs them can be captured in a graph). They keep no
// quantizer log: its per-segment entries count the segments with rows, which the host does not
// know (the model calls them where it keeps none).
PreparedRowCol prepare_gathered_row_col_device_offsets(const Tensor& x, const Tensor& token_of_slot,
                                                       const QuantSpec& row_spec, GemmRole row_role, char row_side,
                                                       const QuantSite& row_site, const QuantSpec& col_spec,
                                                       GemmRole col_role, char col_side, const Tensor& offsets,
                                                       const std::vector<QuantSite>& col_sites, LayerClass cls,
                                                       ops::FormOut row_out);
PreparedRowCol prepare_combine_grad_row_col_device_offsets(const Tensor& dout, const Tensor& y_perm,
                                                           const Tensor& slot_of, const Tensor& w, Tensor& dw,
                                                           const QuantSpec& row_spec, GemmRole row_role,
                                                           char row_side, const QuantSite& row_site,
                                                           const QuantSpec& col_spec, GemmRole col_role,
                                                           char col_side, const Tensor& offsets,
                                                           const std::vector<QuantSite>& col_sites, LayerClass cls,
                                                           ops::FormOut row_out);
PreparedRowCol prepare_swiglu_device_offsets(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                                             GemmRole row_role, char row_side, const QuantSite& row_site,
                                             const QuantSpec& col_spec, GemmRole col_role, char col_side,
                                             const Tensor& offsets, const std::vector<QuantSite>& col_sites,
                                             LayerClass cls, ops::FormOut row_out);
std::array<PreparedRowCol, 2> prepare_swiglu_grads_device_offsets(
    const Tensor& da, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, GemmRole row_role,
    char row_side, const std::array<QuantSite, 2>& row_sites, const QuantSpec& col_spec, GemmRole col_role,
    char col_side, const Tensor& offsets, const std::array<std::vector<QuantSite>, 2>& col_sites, LayerClass cls,
    ops::FormOut row_out);
// Weights' fprop and dgrad operands (W on the Row and on the Col axis, specs as the recipe states
// them), each its BF16 decode alone where the GPU makes one (the training step's GEMMs read
// nothing else): the bits prepare() gives each. batched: all of them in one
// ops::quantize_both_each (one launch on the GPU); else an ops::quantize_both each. Recorded at
// their sites (with record_calls) but not counted: the weight cache counts each use
// (Model::weight). into (batched only): the operands an earlier call on the same weights and
// specs returned, rewritten in place and returned again (ops::quantize_both_each_into): a CUDA
// graph that reads them reads the new ones.
struct WeightBoth {
  Tensor w;
  QuantSpec fprop;
  QuantSite fprop_site;
  QuantSpec dgrad;
  QuantSite dgrad_site;
  LayerClass cls;
};
std::vector<std::pair<Prepared, Prepared>> prepare_weights_both(
    const std::vector<WeightBoth>& ws, QuantLog* log, bool batched = true,
    const std::vector<std::pair<Prepared, Prepared>>* into = nullptr);

// A dense (BF16, FP32) operand prepared for one role used again for another, reading the same
// tensor (`input`'s rounding) on role's axis: no second conversion; counted in the log and, with
// record_calls, recorded at `site` like a prepared operand.
Prepared reuse_dense(const Prepared& p, const Tensor& input, const QuantSpec& spec, GemmRole role, char side,
                     const QuantSite& site, LayerClass cls, QuantLog* log);

// The nvfp4-fwd backward operand: the saved NVFP4 operand, exactly dequantized, transposed and
// re-quantized as spec says (the recipe's dgrad.b / wgrad.b: MXFP8 with SR; ops::requantize_transposed).
Prepared requantize_saved(const Prepared& saved, const QuantSpec& spec, GemmRole role, char side,
                          const QuantSite& site, LayerClass cls, QuantLog* log, ops::FormOut form = ops::FormOut::Codes);

// requantize_saved of rows offsets[e] .. offsets[e + 1] of a saved Row-axis NVFP4 operand for
// every segment e, at sites[e] (ops::requantize_transposed_segments: one pass on the GPU).
std::vector<Prepared> requantize_saved_segments(const Prepared& saved, const std::vector<int64_t>& offsets,
                                                const QuantSpec& spec, GemmRole role, char side,
                                                const std::vector<QuantSite>& sites, LayerClass cls, QuantLog* log,
                                                ops::FormOut form = ops::FormOut::Codes);

// The fprop weight operands `parts` (each [rows_p, K], or [slices, rows_p, K] for expert stacks)
// stacked along their output rows, slice by slice: the B of one GEMM whose output columns are the
// parts' outputs side by side (wq | wk | wv; an FFN's w1 | w3, per expert). Every output element is
// then the product of the same operand rows over the same K as in its part's own GEMM. A view where
// dense parts lie back to back in one buffer (the BF16 copies of consecutive parameters), else a
// copy. Undefined where the parts do not stack exactly: different formats, block layouts, a
// transposed or Col-axis operand, or outer scales that differ between them (Tensor and PerSlice
// scales stack only with shared_outer: the parts were quantized with one shared amax).
Prepared stack_fprop_weights(const std::vector<Prepared>& parts, bool shared_outer);

// The fprop weight operands `parts` (each [rows, K] or [slices_p, rows, K]; one shape of rows)
// one after another as the slices of one grouped GEMM's B: slice s of the result is the parts'
// slices in order (a MoE layer's experts, then its shared expert as one more group). Each slice
// keeps its own codes, block scales and outer scale, so a group's GEMM is its part's GEMM bit for
// bit. Always a copy. Undefined where they do not append exactly: different formats, row counts or
// block layouts, a transposed or Col-axis operand, per-tensor outer scales (one scale for all
// slices), or dense parts other than BF16.
Prepared append_weight_slices(const std::vector<Prepared>& parts);

// C (+)= A . B^T for two prepared operands (ops::gemm).
void gemm(const Prepared& a, const Prepared& b, Tensor& c, bool accumulate = false);
// C = A . B^T for a linear layer's forward (A the activations [M, K], B the weight [N, K]): one
// group of ops::grouped_gemm. On the CPU that is gemm's bits; on the GPU the grouped kernel family
// sums it (the training tile at training sizes, the streaming kernel or the decode tiles at
// decode sizes), whose rows are the same bits whatever M. Every forward GEMM of the model but the
// FP32 router's comes here, so the sampler's one-token decode steps and prefill reproduce the
// trainer's forward bit for bit on the fast decode kernels, not only on a GEMM held to the
// training shape's tiles.
void forward_gemm(const Prepared& a, const Prepared& b, Tensor& c);
// Whether forward_gemm takes the grouped kernel family (true, the default) or ops::gemm (cuBLASLt
// on the GPU, the path before it), process-wide: for benchmarks that compare the two in one
// process. They give different bits on the GPU, so a sampler and its trainer share one setting.
void set_forward_gemms_grouped(bool on);
bool forward_gemms_grouped();
// The experts' GEMMs in one call: rows offsets[e] .. offsets[e+1] of A and C use expert e's slice
// of B (ops::grouped_gemm).
void grouped_gemm(const Prepared& a, const Prepared& b, const std::vector<int64_t>& offsets, Tensor& c,
                  bool accumulate = false);

}  // namespace fourbit
