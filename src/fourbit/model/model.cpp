// defines: Model (model.h) — forward and backward of every block, written out; the linears'
//          forward weights and the recorded input amax
#include "fourbit/model/model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fourbit/ops/host_profile.h"
#include "fourbit/ops/load_balance_math.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

namespace {
std::atomic<bool> g_routing_waits_deferred{true};
std::atomic<bool> g_fused_forward_gemms{true};
std::atomic<bool> g_producer_quantizers{true};
std::atomic<bool> g_shared_expert_grouped{true};
// On by default since an H100 ran them in the GPU suite and the training A/B (docs/model.md).
std::atomic<bool> g_dy_decodes_only{true};
std::atomic<bool> g_training_producer_quantizers{true};
std::atomic<bool> g_input_amax_from_quantizers{true};
std::atomic<bool> g_weight_forms_batched{true};
// On by default: with it a bf16 training micro-batch reads no router count back, so the trainer
// records it as a CUDA graph (StepGraphs; eagerly the step is 0.07-0.09 ms slower, docs/model.md).
std::atomic<bool> g_moe_backward_device_offsets{true};
std::atomic<bool> g_moe_device_offsets_on_cpu{false};
std::atomic<bool> g_moe_pairs_on_device_offsets{false};

// Whether an inference forward's MoE layer (experts' recipe r) runs its experts on the routing's
// offsets where the GPU made them, reading no counts back: every recipe's operands but FP32 ones
// (cuBLASLt per expert) on the GPU, unless set_moe_routing_waits_deferred(false).
bool inference_routing_on_gpu(Device device, const ModelConfig& c, const LayerRecipe& r) {
  return device != Device::CPU && ops::grouped_gemm_reads_device_offsets(device, c.n_experts, c.d_model) &&
         ops::grouped_gemm_reads_device_offsets(device, c.n_experts, c.d_expert) &&
         g_routing_waits_deferred.load(std::memory_order_relaxed) && r.fprop.a.fmt != Format::F32 &&
         r.fprop.b.fmt != Format::F32;
}

// X as a layer's GEMMs consume it: the fprop operand, and the wgrad operand when it has to be
// prepared in the forward pass from the high-precision X (quantized recipes that do not
// re-quantize the saved forward operand).
struct LinearInput {
  Prepared fwd;
  Prepared wgrad;
  int64_t bytes() const {
    // a dense wgrad form that is the fwd tensor transposed shares its storage
    return fwd.bytes() + (wgrad.defined() ? wgrad.bytes() : 0);
  }
  // What the backward pass keeps: the forward operand without its BF16 decode (QTensor::bf16),
  // which only the forward's GEMMs read.
  LinearInput kept() && {
    fwd.q.bf16 = Tensor{};
    return std::move(*this);
  }
};

bool wgrad_reuses_fwd(const LayerRecipe& r) {
  return !r.fprop.a.quantized() && !r.wgrad.b.quantized() && r.fprop.a.fmt == r.wgrad.b.fmt;
}

// Whether the weight gradient's input operand comes from the forward's saved one (requantized,
// or reused as it is) rather than from the raw activations.
bool wgrad_from_saved_fwd(const LayerRecipe& r) { return r.requant_saved_sr || wgrad_reuses_fwd(r); }

int64_t tensor_bytes(const Tensor& t) { return t.defined() ? t.nbytes() : 0; }

// A GEMM operand in BF16 as it is (no block-scaled format).
bool dense_bf16(const QuantSpec& q) { return q.fmt == Format::BF16 && !q.quantized(); }

// The load-balance loss of a forward's MoE layers: their terms summed in layer order, each its host
// value or (device_slot >= 0) device[device_slot], the terms the GPU computed as read back.
double sum_aux_terms(const std::vector<AuxTerm>& terms, const double* device) {
  double total = 0;
  for (const AuxTerm& t : terms) {
    FOURBIT_CHECK(t.device_slot < 0 || device, "sum_aux_terms: a layer's term is on the GPU, not read back");
    total += t.device_slot >= 0 ? device[t.device_slot] : t.value;
  }
  return total;
}

// The bytes of `t` on the host: from `read` where one was queued behind its writer, else a copy
// made now (kept in `hold`).
const void* host_bytes(const std::shared_ptr<PendingRead>& read, const Tensor& t, Tensor& hold) {
  if (read) return read->wait();
  hold = t.to(Device::CPU);
  return hold.raw();
}

}  // namespace

struct Model::Saved {
  struct Ffn {  // dense FFN or shared expert: h1, h3 and a are recomputed in backward unless kept
    LinearInput x;
    Tensor h1, h3, a;  // kept (keep_ffn_activations) or undefined
  };
  struct Layer {
    Tensor x_in, rstd1;  // attention block input (residual stream) and its norm's rstd
    LinearInput attn_x;
    Tensor q, k, v, o, lse;
    LinearInput attn_o;
    Tensor x_mid, rstd2;  // FFN block input and its norm's rstd
    bool moe = false;
    Tensor probs, topk_idx, topk_w;
    ops::RoutePlan plan;  // its host offsets, or (the forward read nothing back) its device ones alone
    Prepared x_perm;                     // expert inputs in fprop form, expert-sorted
    std::vector<Prepared> x_perm_wgrad;  // per expert, when prepared in forward
    Tensor x_perm_wgrad_rows;            // or X^T's decodes in X's rows, made on the device offsets
    Tensor expert_h1, expert_h3, expert_a, expert_y;  // expert-sorted, kept (keep_ffn_activations) or undefined
    std::vector<Prepared> expert_a_wgrad;  // kept with them where the forward made w2's a^T (ExpertInner)
    Ffn shared, dense;
  };
  Tensor positions;
  Tensor tokens;
  int64_t B = 0, T = 0;
  float loss_weight = 1;
  SrStreams sr;
  std::vector<Layer> layers;
  Tensor x_final, rstd_f;
  LinearInput xf;
  Tensor dlogits;
};

// Runs one forward or backward pass; holds what every block needs besides its tensors.
struct ModelRunner {
  Model& m;
  const ModelConfig& c;
  SrStreams sr;
  QuantLog* log;
  int64_t layer = 0;
  bool record_amax = false;  // a training forward: keep the running input amax (Model::input_amax)
  bool training_path = false;  // a forward without a backward run as training runs it (Model::logits)
  // A forward without a backward whose GEMMs that read one input run as one (set_fused_forward_gemms).
  bool fuse = false;
  // A forward a backward follows (weights_ahead): its NVFP4 fprop weights are made with their BF16
  // decodes, which the forward's GEMMs and the backward's recomputation read from the cache (each
  // GEMM decoded its weight itself before: twice a step, where the cache holds 2 bytes a value more
  // until the weights change, as quantize_weights_ahead's MXFP8 forms do).
  bool weight_decodes = false;

  Tensor act(const Shape& s) const { return Tensor::empty(s, m.dtype_, m.device_); }
  // The step's weight operands made at the start of the forward pass: BF16 copies in one launch,
  // and for a forward that a backward follows the MXFP8 weights on both axes (fprop and dgrad
  // operands, with their BF16 decodes) in one pass each.
  void weights_ahead(bool for_backward) {
    const ops::HostOpTimer timer("model forward: weights ahead");
    m.convert_bf16_weights_ahead();
    if (for_backward) m.quantize_weights_ahead(sr);
    weight_decodes = for_backward;
  }
  // p with its BF16 decode (ops::with_decode) where several GEMMs read it next: one decode pass,
  // not one a GEMM.
  static Prepared decoded(Prepared p) {
    if (p.is_quantized()) p.q = ops::with_decode(std::move(p.q));
    return p;
  }
  Tensor zeros(const Shape& s) const { return Tensor::zeros(s, m.dtype_, m.device_); }
  // Activations that only GEMMs read as BF16 operands are written as BF16 by their producer (ops.h
  // "BF16 outputs": the bits the operand's conversion gave, one pass instead of two). A linear
  // input: read by fprop as A and, unless the weight gradient reuses the forward's operand, by wgrad
  // as X^T.
  static bool bf16_input(const LayerRecipe& r) {
    return r.fprop.a.fmt == Format::BF16 && (wgrad_from_saved_fwd(r) || r.wgrad.b.fmt == Format::BF16);
  }
  // A linear's output gradient dY: read by dgrad as A and by wgrad as dY^T.
  static bool bf16_grad(const LayerRecipe& r) {
    return r.dgrad.a.fmt == Format::BF16 && r.wgrad.a.fmt == Format::BF16;
  }
  Tensor act_bf16_if(bool bf16, const Shape& s) const {
    return bf16 && m.dtype_ == DType::F32 ? Tensor::empty(s, DType::BF16, m.device_) : act(s);
  }
  // Whether a training step's MoE backward runs the experts' GEMMs on the routing's offsets where
  // the GPU made them (set_moe_backward_device_offsets), the routed experts' E + 1 that the forward
  // keeps in the saved plan, where the grouped kernel takes the offsets there and no quantizer log
  // is written (its per-expert entries count the experts with tokens): where every expert operand
  // is dense BF16 (the bf16 recipe: dY, X and a read in place, no per-expert operand made), or
  // where they are MXFP8 pairs made on those offsets (moe_pairs_on_device_offsets).
  bool backward_on_device_offsets(const LayerRecipe& r) const {
    if (!g_moe_backward_device_offsets.load(std::memory_order_relaxed) ||
        (log && (log->enabled || log->record_calls)) || !moe_offsets_on_gpu())
      return false;
    return (dense_bf16(r.fprop.a) && dense_bf16(r.dgrad.a) && dense_bf16(r.dgrad.b) && dense_bf16(r.wgrad.a) &&
            dense_bf16(r.wgrad.b) && !r.requant_saved_sr && moe_reads_bf16_x()) ||
           moe_pairs_on_device_offsets(r);
  }
  // Whether the experts' quantized operands pair as the mxfp8 recipe's do, each pair made by its
  // producer in one pass that finds the experts' rows from the device offsets (the
  // *_device_offsets preparers): X and X^T as the tokens are gathered (X rounded to nearest), a and
  // a^T in the backward's SwiGLU, dY and dY^T in the combine's backward, dh1, dh3 and their
  // transposes in the SwiGLU's backward. The Col forms come as their decodes in the rows' layout,
  // which grouped_wgrad_device_offsets reads. Not where the FFN interiors are kept (the forward
  // then makes a^T per expert) nor where the producers' quantizers are off; the weights' forms
  // (no offsets in them) as the host-offset path makes them. With set_moe_pairs_on_device_offsets.
  bool moe_pairs_on_device_offsets(const LayerRecipe& r) const {
    return g_moe_pairs_on_device_offsets.load(std::memory_order_relaxed) && m.dtype_ == DType::F32 &&
           swiglu_a_fused(r, true) && dy_pair_fused(r) &&
           r.fprop.a.rounding == num::Rounding::RNE && r.fprop.b.quantized() && r.dgrad.b.quantized() &&
           !r.requant_saved_sr;
  }
  // Whether the MoE layers' expert GEMMs read the routing's offsets where the GPU made them.
  bool moe_offsets_on_gpu() const {
    if (m.device_ == Device::CPU) return g_moe_device_offsets_on_cpu.load(std::memory_order_relaxed);
    return m.device_ != Device::CPU && ops::grouped_gemm_reads_device_offsets(m.device_, c.n_experts, c.d_model) &&
           ops::grouped_gemm_reads_device_offsets(m.device_, c.n_experts, c.d_expert);
  }
  // A training forward's MoE layer under r queues its dispatch, experts and combine on the GPU's
  // plan, before any wait for the counts: dense BF16 expert operands read in place.
  // Also where the experts' pairs are made on those offsets and the backward reads them there.
  bool moe_training_routed_on_gpu(const LayerRecipe& r) const {
    return moe_offsets_on_gpu() && ((moe_reads_bf16_x() && dense_bf16(r.fprop.b) && wgrad_from_saved_fwd(r)) ||
                                    (moe_pairs_on_device_offsets(r) && backward_on_device_offsets(r)));
  }
  // ... and, its backward on those offsets too and no routing observer to call, reads nothing back.
  bool moe_training_reads_nothing(const LayerRecipe& r) const {
    return moe_training_routed_on_gpu(r) && backward_on_device_offsets(r) && !m.routing_observer_;
  }
  // A MoE layer's experts (and shared expert) read its normed input as BF16, the router as F32:
  // the norm writes both (rmsnorm_forward's y_bf16).
  bool moe_reads_bf16_x() const { return bf16_input(recipe(LayerClass::Expert)) && m.dtype_ == DType::F32; }
  // Whether the residual stream's gradient entering layer l's FFN block (moe: a MoE layer) and its
  // attention block is read as a BF16 dY (the FFN's w2 or the shared expert's, and wo): then the
  // norm's backward that produces it writes that copy too (rmsnorm_backward's dx_bf16).
  bool ffn_dy_bf16(bool moe) const {
    if (m.dtype_ != DType::F32) return false;
    if (moe) return c.n_shared_experts > 0 && bf16_grad(recipe(LayerClass::Expert));
    return bf16_grad(recipe(LayerClass::Dense));
  }
  bool attn_dy_bf16() const { return m.dtype_ == DType::F32 && bf16_grad(recipe(LayerClass::Attention)); }
  // The quantization point `name` and its SR stream (linear.h QuantSite; docs/model.md lists the
  // names): "<weight or input group>/<gemm>/<operand>", an input group naming the GEMMs that share
  // one quantized input ("layers.3.attn.wqkv", "layers.1.moe.w13").
  QuantSite site(const std::string& name) const { return sr.site(name); }
  // site(name + "[e]") for every routed expert e: each expert's token range its own stream.
  std::vector<QuantSite> expert_sites(const std::string& name) const {
    std::vector<QuantSite> sites;
    for (int64_t e = 0; e < c.n_experts; ++e) sites.push_back(site(name + "[" + std::to_string(e) + "]"));
    return sites;
  }
  const LayerRecipe& recipe(LayerClass cls) const { return m.recipe_.layer(cls, layer, c.n_layers); }

  // The MoE layers' load-balance loss terms of a forward asked for one, in layer order
  // (ops/load_balance_math.h): computed on the host from the counts and probability sums that come
  // back with the layer's routing, or (device_slot >= 0) by ops::load_balance_term into
  // aux_terms[device_slot] where the forward reads nothing back.
  std::vector<AuxTerm> pending_aux{};
  // F64 [n_layers] on the GPU where the forward queues its MoE layers without waiting for their
  // counts (Model::forward_queued on the GPU); else undefined.
  Tensor aux_terms{};
  // A forward that keeps nothing for a backward and computes no load-balance loss needs the router
  // counts on the host only to report a bad expert id: its MoE layers run on the offsets where the
  // GPU made them, read nothing back, and the device's index-error record is checked once the
  // forward is queued (finish_deferred_plans), not one wait a layer.
  bool deferred_plans = false;
  void finish_deferred_plans() {
    if (deferred_plans) ops::check_index_errors(m.device_);
    deferred_plans = false;
  }
  // The load-balance loss (Switch) of those layers: their terms summed in layer order, each
  // coef * E * sum_e f_e * P_e with f_e the routed share (no gradient) and P_e the mean router
  // probability (PendingForwardStats::stats sums terms the GPU computed the same way).
  double aux_loss_value() {
    const double total = sum_aux_terms(pending_aux, nullptr);
    pending_aux.clear();
    return total;
  }

  // partner: the weight sharing w's outer scale (an FFN's w1 and w3, NUMERICS "NVFP4").
  Prepared weight(const Tensor& w, const std::string& name, GemmRole role, const QuantSpec& spec,
                  LayerClass cls, const Tensor* partner = nullptr) {
    const bool decodes = weight_decodes && role == GemmRole::Fprop && spec.fmt == Format::NVFP4;
    return m.weight(w, name, role, spec, cls, sr, partner, decodes ? ops::FormOut::CodesAndBf16 : ops::FormOut::Codes);
  }

  // Folds max |x| over each segment of an NVFP4 linear input into Model::input_amax()[key]
  // (segments: the rows of x, or the entries offsets[g] .. offsets[g + 1] of `rows`). With q, x's
  // quantized rows, whose quantizer kept each row's amax (QTensor::row_amax), the max is over
  // those (set_input_amax_from_quantizers): the same values without reading x again.
  void record_input_amax(const std::string& key, const Tensor& x, const LayerRecipe& r, int64_t segments = 1,
                         const Tensor& rows = {}, const std::vector<int64_t>& offsets = {},
                         const QTensor* q = nullptr) {
    if (!record_amax || r.fprop.a.fmt != Format::NVFP4) return;
    Tensor& amax = m.input_amax_[key];
    if (!amax.defined()) amax = Tensor::zeros({segments}, DType::F32, m.device_);
    const int64_t n = rows.defined() ? rows.size(0) : x.size(0);
    const bool kept = g_input_amax_from_quantizers.load(std::memory_order_relaxed) && q && q->row_amax.defined() &&
                      q->slices == 1 && q->axis == BlockAxis::Row && q->rows == x.size(0) &&
                      q->row_amax.numel() == x.size(0);
    ops::running_segment_amax(kept ? q->row_amax.reshape({x.size(0), 1}) : x, rows,
                              offsets.empty() ? std::vector<int64_t>{0, n} : offsets, amax);
  }
  static const QTensor* quantized(const Prepared& p) { return p.is_quantized() ? &p.q : nullptr; }

  // Whether a layer's fprop X and wgrad X^T are made together (prepare_row_col): the weight
  // gradient's X^T comes from the high-precision X and the two specs pair in one pass.
  static bool x_pairs(const LayerRecipe& r) {
    return !wgrad_from_saved_fwd(r) && ops::row_col_one_pass(r.fprop.a, r.wgrad.b);
  }
  // The same for the backward's dY (dgrad) and dY^T (wgrad).
  static bool dy_pairs(const LayerRecipe& r) {
    return !wgrad_dy_reuses_dgrad(r) && ops::row_col_one_pass(r.dgrad.a, r.wgrad.a);
  }
  // What a dY pair's quantizer writes of each form (set_dy_decodes_only): the GEMMs that read the
  // pair run right away, and nothing reads its codes after them.
  static ops::FormOut dy_form() {
    return g_dy_decodes_only.load(std::memory_order_relaxed) ? ops::FormOut::Bf16 : ops::FormOut::CodesAndBf16;
  }
  // What a forward's X^T made in X's pair holds for the backward (Model::set_saved_x_decodes).
  ops::FormOut saved_x_form() const { return m.saved_x_decodes_ ? ops::FormOut::Bf16 : ops::FormOut::Codes; }
  // Whether a dY pair is quantized where the op that computes it does (set_training_producer_quantizers):
  // an FFN's dh1 and dh3 in swiglu_backward, the experts' dy_perm in moe_combine_backward. They pair,
  // and they would be F32 tensors read only by the quantizer.
  static bool dy_pair_fused(const LayerRecipe& r) {
    return g_training_producer_quantizers.load(std::memory_order_relaxed) && dy_pairs(r) && !bf16_grad(r);
  }
  // Whether an FFN's SwiGLU output a is quantized where swiglu_forward computes it
  // (set_training_producer_quantizers), for w2's fprop operand alone (pair false) or with its X^T (pair: the
  // two pair, x_pairs). Never where the FFN interiors are kept: a is kept then.
  bool swiglu_a_fused(const LayerRecipe& r, bool pair) const {
    if (!g_training_producer_quantizers.load(std::memory_order_relaxed) || m.keep_ffn_) return false;
    return pair ? x_pairs(r) : ops::row_col_one_pass(r.fprop.a, r.fprop.a);
  }
  // prepare_swiglu_grads for the FFN (or the experts, offsets their token ranges) whose w1 and w3
  // sites are point1 and point3: dh1 and dh3 as linear_backward / expert_dy prepare them.
  // device_offsets (defined: the experts' on the GPU's offsets): prepare_swiglu_grads_device_offsets.
  std::array<PreparedRowCol, 2> swiglu_grads(const Tensor& da, const Tensor& h1, const Tensor& h3, const LayerRecipe& r,
                                             LayerClass cls, const std::string& point1, const std::string& point3,
                                             const std::vector<int64_t>& offsets, bool experts,
                                             const Tensor& device_offsets = Tensor{}) {
    const auto col_sites = [&](const std::string& point) {
      return experts ? expert_sites(point + "/wgrad/dY^T") : std::vector<QuantSite>{site(point + "/wgrad/dY^T")};
    };
    if (device_offsets.defined())
      return prepare_swiglu_grads_device_offsets(da, h1, h3, r.dgrad.a, GemmRole::Dgrad, 'a',
                                                 {site(point1 + "/dgrad/dY"), site(point3 + "/dgrad/dY")}, r.wgrad.a,
                                                 GemmRole::Wgrad, 'a', device_offsets,
                                                 {col_sites(point1), col_sites(point3)}, cls, dy_form());
    return prepare_swiglu_grads(da, h1, h3, r.dgrad.a, GemmRole::Dgrad, 'a',
                                {site(point1 + "/dgrad/dY"), site(point3 + "/dgrad/dY")}, r.wgrad.a, GemmRole::Wgrad, 'a',
                                offsets, {col_sites(point1), col_sites(point3)}, cls, log, dy_form(), dy_form());
  }

  // X of the GEMMs at `point` (a weight or an input group): point/fprop/X, and point/wgrad/X^T
  // where the weight gradient's X is prepared from the high-precision X — both in one pass where
  // their formats pair (prepare_row_col; fwd_bf16: with the fprop operand's BF16 decode, for
  // the forward GEMMs that read it next).
  // converted: x's BF16 copy written by x's producer, taken for a BF16 fprop operand.
  // wgrad_form: what a wgrad X^T made in the pair holds (its decode alone where the backward
  // makes it for the GEMM that follows; unset, as Model::saved_x_decodes says where the forward
  // keeps it).
  LinearInput prepare_input(const Tensor& x, const LayerRecipe& r, LayerClass cls, const std::string& point,
                            bool fwd_bf16 = false, const Tensor* converted = nullptr,
                            std::optional<ops::FormOut> wgrad_form = std::nullopt) {
    if (!wgrad_form) wgrad_form = saved_x_form();
    LinearInput in;
    if (x_pairs(r) && x.size(0) > 0) {
      PreparedRowCol p = prepare_row_col(x, r.fprop.a, GemmRole::Fprop, 'a', site(point + "/fprop/X"), r.wgrad.b,
                                         GemmRole::Wgrad, 'b', {0, x.size(0)}, {site(point + "/wgrad/X^T")}, cls,
                                         log, fwd_bf16 ? ops::FormOut::CodesAndBf16 : ops::FormOut::Codes,
                                         *wgrad_form);
      in.fwd = std::move(p.row);
      in.wgrad = std::move(p.col[0]);
      return in;
    }
    in.fwd = prepare(x, r.fprop.a, GemmRole::Fprop, 'a', site(point + "/fprop/X"), cls, log, nullptr, converted,
                     fwd_bf16 ? ops::FormOut::CodesAndBf16 : ops::FormOut::Codes);
    if (!wgrad_from_saved_fwd(r))
      in.wgrad = prepare(x, r.wgrad.b, GemmRole::Wgrad, 'b', site(point + "/wgrad/X^T"), cls, log, nullptr, nullptr,
                         *wgrad_form);
    return in;
  }

  // Where the forward keeps nothing (fuse: the sampler's, evaluation's), a block-scaled fprop input
  // rounded to nearest is quantized by the op that writes it (ops.h "Quantized outputs": an
  // RMSNorm, a SwiGLU, a decode step's attention), with prepare's bits and one launch fewer.
  // producer_quant: the request for the input at `point` (an input group, as prepare_input names
  // it) of a class-cls layer, landing in *out, or none; producer_quantized: the fprop operand it
  // made of x.
  std::optional<ops::RowQuant> producer_quant(LayerClass cls, const std::string& point, QTensor* out) const {
    const QuantSpec& a = recipe(cls).fprop.a;
    if (!fuse || !g_producer_quantizers.load(std::memory_order_relaxed) || !a.quantized() ||
        a.rounding != num::Rounding::RNE)
      return std::nullopt;
    return fourbit::producer_quant(a, GemmRole::Fprop, 'a', site(point + "/fprop/X"), out);
  }
  Prepared producer_quantized(QTensor q, const Tensor& x, LayerClass cls, const std::string& point) {
    return fourbit::producer_quantized(std::move(q), x, recipe(cls).fprop.a, GemmRole::Fprop, 'a',
                                       site(point + "/fprop/X"), cls, log);
  }

  // prepare_input's fprop operand alone (the same bits), for a forward that keeps nothing for a
  // backward: no weight-gradient form made for nothing (an MXFP8 input's column pass).
  LinearInput prepare_fprop_input(const Tensor& x, const LayerRecipe& r, LayerClass cls, const std::string& point,
                                  const Tensor* converted = nullptr) {
    Prepared fwd = prepare(x, r.fprop.a, GemmRole::Fprop, 'a', site(point + "/fprop/X"), cls, log, nullptr, converted);
    return LinearInput{std::move(fwd), Prepared{}};
  }

  // X^T for wgrad from a saved input (fwd / wgrad forms, possibly row segments); at_site: where a
  // requantization draws its stream.
  Prepared wgrad_input(const Prepared& fwd, const Prepared& wgrad, const LayerRecipe& r,
                       LayerClass cls, const QuantSite& at_site) {
    // requantized operands are read by the GEMM that follows alone: their decodes, no codes
    if (r.requant_saved_sr)
      return requantize_saved(fwd, r.wgrad.b, GemmRole::Wgrad, 'b', at_site, cls, log, ops::FormOut::Bf16);
    if (wgrad_reuses_fwd(r)) {
      if (log) log->add(cls, GemmRole::Wgrad, 'b', r.wgrad.b, false);
      Prepared p = fwd;
      p.trans = true;
      return p;
    }
    FOURBIT_CHECK(wgrad.defined(), "missing saved wgrad operand");
    return wgrad;
  }

  // wgrad_input for every expert's token range (rows offsets[e] .. offsets[e + 1] of the saved
  // operands; wgrad: the per-expert saved forms, or empty) at point/wgrad/X^T[e]; the requantized
  // form in one pass.
  std::vector<Prepared> wgrad_inputs(const Prepared& fwd, const std::vector<Prepared>& wgrad, const LayerRecipe& r,
                                     LayerClass cls, const std::string& point, const std::vector<int64_t>& offsets) {
    const std::vector<QuantSite> sites = expert_sites(point + "/wgrad/X^T");
    if (r.requant_saved_sr)
      return requantize_saved_segments(fwd, offsets, r.wgrad.b, GemmRole::Wgrad, 'b', sites, cls, log,
                                       ops::FormOut::Bf16);
    std::vector<Prepared> out(offsets.size() - 1);
    for (size_t e = 0; e < out.size(); ++e)
      if (offsets[e] < offsets[e + 1])
        out[e] = wgrad_input(fwd.rows(offsets[e], offsets[e + 1]), wgrad.empty() ? Prepared{} : wgrad[e], r, cls,
                             sites[e]);
    return out;
  }

  // W for dgrad: from the saved forward operand by SR (nvfp4-fwd) or prepared from the weights.
  Prepared dgrad_weight(const Tensor& w, const std::string& name, const LayerRecipe& r,
                        LayerClass cls, const Tensor* partner = nullptr) {
    if (r.requant_saved_sr) {
      const Prepared fwd = weight(w, name, GemmRole::Fprop, r.fprop.b, cls, partner);
      return requantize_saved(fwd, r.dgrad.b, GemmRole::Dgrad, 'b', site(name + "/dgrad/W"), cls, log,
                              ops::FormOut::Bf16);
    }
    return weight(w, name, GemmRole::Dgrad, r.dgrad.b, cls, partner);
  }

  // One linear layer's backward: dx (+)= dy . W and dW += dy^T . X (dW = where the gradient is
  // stale: ParamStore::grad_accumulate), at the sites name/dgrad/dY, name/dgrad/W, name/wgrad/dY^T
  // and name/wgrad/X^T. dy_bf16: dy's BF16 copy written by dy's producer, taken for a BF16 dY.
  // made: dY and dY^T as this call's one-pass branch would prepare them (swiglu_grads), for an
  // undefined dy.
  void linear_backward(const Tensor& dy, const LinearInput& x, const Tensor& w,
                       const std::string& name, Tensor& dw, Tensor* dx, bool dx_accumulate,
                       const LayerRecipe& r, LayerClass cls, const Tensor* partner = nullptr,
                       const Tensor* dy_bf16 = nullptr, const PreparedRowCol* made = nullptr) {
    const bool dw_accumulate = m.params_.grad_accumulate(dw);
    const QuantSite dyt_site = site(name + "/wgrad/dY^T");
    if (made || (dx && dy_pairs(r) && dy.size(0) > 0)) {
      FOURBIT_CHECK(dx, "linear_backward: a prepared dY is for a layer with an input gradient");
      // dY and dY^T in one pass, each its BF16 decode (dy_form): both GEMMs read them right away
      const PreparedRowCol p =
          made ? *made
               : prepare_row_col(dy, r.dgrad.a, GemmRole::Dgrad, 'a', site(name + "/dgrad/dY"), r.wgrad.a,
                                GemmRole::Wgrad, 'a', {0, dy.size(0)}, {dyt_site}, cls, log, dy_form(), dy_form());
      gemm(p.row, dgrad_weight(w, name, r, cls, partner), *dx, dx_accumulate);
      gemm(p.col[0], wgrad_input(x.fwd, x.wgrad, r, cls, site(name + "/wgrad/X^T")), dw, dw_accumulate);
      return;
    }
    Prepared pdy;
    if (dx) {
      pdy = prepare(dy, r.dgrad.a, GemmRole::Dgrad, 'a', site(name + "/dgrad/dY"), cls, log, nullptr, dy_bf16);
      gemm(pdy, dgrad_weight(w, name, r, cls, partner), *dx, dx_accumulate);
    }
    const Prepared pdy_t = dx && wgrad_dy_reuses_dgrad(r)
                               ? reuse_dense(pdy, dy, r.wgrad.a, GemmRole::Wgrad, 'a', dyt_site, cls, log)
                               : prepare(dy, r.wgrad.a, GemmRole::Wgrad, 'a', dyt_site, cls, log);
    gemm(pdy_t, wgrad_input(x.fwd, x.wgrad, r, cls, site(name + "/wgrad/X^T")), dw, dw_accumulate);
  }

  // dY^T of the weight gradient from dgrad's dY where both are one dense format: nothing rounds
  // differently, so the dgrad operand is read transposed.
  static bool wgrad_dy_reuses_dgrad(const LayerRecipe& r) {
    return !r.dgrad.a.quantized() && !r.wgrad.a.quantized() && r.dgrad.a.fmt == r.wgrad.a.fmt;
  }
  // The experts' dY for dgrad (point/dgrad/dY) and every expert's dY^T for wgrad
  // (point/wgrad/dY^T[e]): in one pass where they pair, each with its BF16 decode (the GEMMs read
  // them right away); otherwise dY, then wgrad_dy_segments.
  // with_col false (the backward on device offsets): the row form alone, the weight gradients reading
  // dY in place.
  PreparedRowCol expert_dy(const Tensor& dy, const std::vector<int64_t>& offsets, const LayerRecipe& r,
                           LayerClass cls, const std::string& point, bool with_col = true) {
    if (with_col && dy_pairs(r) && dy.size(0) > 0)
      return prepare_row_col(dy, r.dgrad.a, GemmRole::Dgrad, 'a', site(point + "/dgrad/dY"), r.wgrad.a,
                             GemmRole::Wgrad, 'a', offsets, expert_sites(point + "/wgrad/dY^T"), cls, log, dy_form(),
                             dy_form());
    PreparedRowCol p;
    p.row = prepare(dy, r.dgrad.a, GemmRole::Dgrad, 'a', site(point + "/dgrad/dY"), cls, log);
    if (with_col) p.col = wgrad_dy_segments(dy, p.row, offsets, r, cls, point);
    return p;
  }

  // The same for every expert's token range (otherwise prepare_segments, point/wgrad/dY^T[e]).
  std::vector<Prepared> wgrad_dy_segments(const Tensor& dy, const Prepared& pdy, const std::vector<int64_t>& offsets,
                                          const LayerRecipe& r, LayerClass cls, const std::string& point) {
    const std::vector<QuantSite> sites = expert_sites(point + "/wgrad/dY^T");
    if (!wgrad_dy_reuses_dgrad(r))
      return prepare_segments(dy, offsets, r.wgrad.a, GemmRole::Wgrad, 'a', sites, cls, log);
    std::vector<Prepared> out(offsets.size() - 1);
    for (size_t e = 0; e + 1 < offsets.size(); ++e) {
      const int64_t b = offsets[e], end = offsets[e + 1];
      if (b == end) continue;
      Prepared rows = pdy;
      rows.dense = pdy.dense.slice_rows(b, end);
      out[e] = reuse_dense(rows, dy.slice_rows(b, end), r.wgrad.a, GemmRole::Wgrad, 'a', sites[e], cls, log);
    }
    return out;
  }

  // ---- SwiGLU FFN (dense layers and the shared expert) -------------------------------------
  struct FfnRefs {
    const Tensor &w1, &w3, &w2;
    Tensor &g1, &g3, &g2;
    std::string name;
  };

  // x_fwd: xn's fprop operand made already under this spec, rounded to nearest (the same bits as
  // preparing it here), taken where nothing is saved: a MoE layer's routed-expert tokens for its
  // shared expert.
  Tensor ffn_forward(const Tensor& xn, const FfnRefs& w, LayerClass cls, Model::Saved::Ffn* saved,
                     const Prepared* x_fwd = nullptr) {
    const LayerRecipe& r = recipe(cls);
    const int64_t N = xn.size(0), F = w.w1.size(0), D = w.w2.size(0);
    FOURBIT_CHECK(!x_fwd || (!saved && r.fprop.a.rounding == num::Rounding::RNE),
                  "ffn_forward: a prepared input is taken only by a forward that saves nothing, rounded to nearest");
    LinearInput x;
    if (x_fwd) x.fwd = *x_fwd;
    else if (saved) x = prepare_input(xn, r, cls, w.name + ".w13", true);
    else x = prepare_fprop_input(xn, r, cls, w.name + ".w13");
    record_input_amax(w.name + ".x", xn, r, 1, {}, {}, quantized(x.fwd));
    const Prepared w1 = weight(w.w1, w.name + ".w1", GemmRole::Fprop, r.fprop.b, cls, &w.w3);
    const Prepared w3 = weight(w.w3, w.name + ".w3", GemmRole::Fprop, r.fprop.b, cls, &w.w1);
    const Prepared w13 = fuse && !saved ? m.fused_weight(w.name + ".w13", {w1, w3}, true) : Prepared{};
    // a quantized where it is computed (no F32 a): the GEMM's decode
    const bool a_fused = !w13.defined() && swiglu_a_fused(r, false) && N > 0;
    Tensor h1, h3, a = a_fused ? Tensor{} : act_bf16_if(bf16_input(r), {N, F}), y = act({N, D});
    QTensor aq;
    std::optional<ops::RowQuant> aq_req;
    Prepared pa;
    if (w13.defined()) {
      Tensor h13 = act({N, 2 * F});
      forward_gemm(x.fwd, w13, h13);
      aq_req = producer_quant(cls, w.name + ".w2", &aq);
      ops::swiglu_forward_fused(h13, a, aq_req ? &*aq_req : nullptr);
    } else {
      h1 = act({N, F});
      h3 = act({N, F});
      forward_gemm(x.fwd, w1, h1);
      forward_gemm(x.fwd, w3, h3);
      if (a_fused)
        pa = prepare_swiglu(h1, h3, r.fprop.a, GemmRole::Fprop, 'a', site(w.name + ".w2/fprop/X"), r.fprop.a,
                            GemmRole::Wgrad, 'b', {}, {}, cls, log, ops::FormOut::Bf16, ops::FormOut::Codes)
                 .row;
      else
        ops::swiglu_forward(h1, h3, a);
    }
    if (!a_fused) {
      // only the GEMM below reads it: its decode alone
      pa = aq_req ? producer_quantized(std::move(aq), a, cls, w.name + ".w2")
                  : prepare(a, r.fprop.a, GemmRole::Fprop, 'a', site(w.name + ".w2/fprop/X"), cls, log, nullptr,
                            nullptr, ops::FormOut::Bf16);
      record_input_amax(w.name + ".a", a, r, 1, {}, {}, quantized(pa));
    }
    forward_gemm(pa, weight(w.w2, w.name + ".w2", GemmRole::Fprop, r.fprop.b, cls), y);
    if (saved) {
      saved->x = std::move(x).kept();
      if (m.keep_ffn_) {
        saved->h1 = h1;
        saved->h3 = h3;
        saved->a = a;
      }
    }
    return y;
  }

  // dxn (+)= the FFN's input gradient; weight gradients accumulate.
  // dy_bf16: dy's BF16 copy, written by the norm backward that produced dy (ffn_dy_bf16,
  // attn_dy_bf16), or null.
  void ffn_backward(const Tensor& dy, const FfnRefs& w, LayerClass cls, const Model::Saved::Ffn& saved, Tensor& dxn,
                    bool dx_accumulate, const Tensor* dy_bf16 = nullptr) {
    const LayerRecipe& r = recipe(cls);
    const int64_t N = dy.size(0), F = w.w1.size(0);
    Tensor h1 = saved.h1, h3 = saved.h3, a = saved.a;
    if (!h1.defined()) {  // recomputed: the forward's GEMMs on its kept input, the same bits
      h1 = act({N, F});
      h3 = act({N, F});
      const Prepared x = decoded(saved.x.fwd);
      forward_gemm(x, weight(w.w1, w.name + ".w1", GemmRole::Fprop, r.fprop.b, cls, &w.w3), h1);
      forward_gemm(x, weight(w.w3, w.name + ".w3", GemmRole::Fprop, r.fprop.b, cls, &w.w1), h3);
    }
    LinearInput a_in;  // same sites, same bits as the forward's
    if (!a.defined() && swiglu_a_fused(r, true) && N > 0) {  // a quantized where it is computed
      // X^T as its decode alone: w2's weight gradient reads it next
      PreparedRowCol p = prepare_swiglu(h1, h3, r.fprop.a, GemmRole::Fprop, 'a', site(w.name + ".w2/fprop/X"), r.wgrad.b,
                                        GemmRole::Wgrad, 'b', {0, N}, {site(w.name + ".w2/wgrad/X^T")}, cls, log,
                                        ops::FormOut::Codes, ops::FormOut::Bf16);
      a_in.fwd = std::move(p.row);
      a_in.wgrad = std::move(p.col[0]);
    } else {
      if (!a.defined()) {
        a = act_bf16_if(bf16_input(r), {N, F});
        ops::swiglu_forward(h1, h3, a);
      }
      a_in = prepare_input(a, r, cls, w.name + ".w2", false, nullptr, ops::FormOut::Bf16);
    }
    Tensor da = act({N, F});
    linear_backward(dy, a_in, w.w2, w.name + ".w2", w.g2, &da, false, r, cls, nullptr, dy_bf16);
    if (dy_pair_fused(r) && N > 0) {  // dh1 and dh3 quantized where they are computed
      const std::array<PreparedRowCol, 2> pdh =
          swiglu_grads(da, h1, h3, r, cls, w.name + ".w1", w.name + ".w3", {0, N}, false);
      linear_backward(Tensor{}, saved.x, w.w1, w.name + ".w1", w.g1, &dxn, dx_accumulate, r, cls, &w.w3, nullptr, &pdh[0]);
      linear_backward(Tensor{}, saved.x, w.w3, w.name + ".w3", w.g3, &dxn, true, r, cls, &w.w1, nullptr, &pdh[1]);
      return;
    }
    Tensor dh1 = act_bf16_if(bf16_grad(r), {N, F}), dh3 = act_bf16_if(bf16_grad(r), {N, F});
    ops::swiglu_backward(da, h1, h3, dh1, dh3);
    linear_backward(dh1, saved.x, w.w1, w.name + ".w1", w.g1, &dxn, dx_accumulate, r, cls, &w.w3);
    linear_backward(dh3, saved.x, w.w3, w.name + ".w3", w.g3, &dxn, true, r, cls, &w.w1);
  }

  // ---- attention block ----------------------------------------------------------------------
  // With `kv` (the sampler), K/V go into the cache and the queries attend over it; otherwise over
  // this batch's own K/V from position 0 (training).
  // x_fwd: xn's fprop operand made by the norm (producer_quant), where nothing is saved.
  Tensor attention_forward(const Tensor& xn, const LayerWeights& w, const std::string& name,
                           Model::Saved::Layer* s, const Tensor& positions, int64_t B, int64_t T,
                           const KvStep* kv = nullptr, const Prepared* x_fwd = nullptr) {
    const LayerClass cls = LayerClass::Attention;
    const LayerRecipe& r = recipe(cls);
    const int64_t N = xn.size(0), hd = c.hd(), Hq = c.n_heads, Hkv = c.n_kv_heads;
    FOURBIT_CHECK(!x_fwd || !s, "attention_forward: a prepared input is taken only by a forward that saves nothing");
    LinearInput x = x_fwd ? LinearInput{*x_fwd, Prepared{}}
                    : s   ? prepare_input(xn, r, cls, name + "wqkv", true)
                          : prepare_fprop_input(xn, r, cls, name + "wqkv");
    record_input_amax(name + "x", xn, r);
    // Where attention reads BF16 operands (ops.h "BF16 operands"): rope writes q and k rounded to
    // BF16 as well, v is converted once, and attention reads those copies, which the backward
    // keeps and the sampler's cache stores (KvCache::default_storage; an F32 cache takes F32).
    const bool bf16_qkv = m.dtype_ == DType::F32 && (kv ? kv->cache.storage() == DType::BF16
                                                         : ops::attention_reads_bf16(m.device_));
    const Prepared wq = weight(w.wq, name + "wq", GemmRole::Fprop, r.fprop.b, cls);
    const Prepared wk = weight(w.wk, name + "wk", GemmRole::Fprop, r.fprop.b, cls);
    const Prepared wv = weight(w.wv, name + "wv", GemmRole::Fprop, r.fprop.b, cls);
    // The output projection's BF16 operand where it reads one, written by attention's epilogue
    // (training's attention and the sampler's cached one alike).
    Tensor o = act({B, T, Hq, hd}), lse = act({B, Hq, T}), o_bf16;
    if (bf16_qkv && bf16_input(r)) o_bf16 = Tensor::empty(o.shape(), DType::BF16, m.device_);
    Tensor* ob = o_bf16.defined() ? &o_bf16 : nullptr;
    // A decode step's o quantized by the attention step for the output projection (producer_quant).
    QTensor oq;
    const auto oq_req = kv && bf16_qkv && T == 1 ? producer_quant(cls, name + "wo", &oq) : std::nullopt;
    const ops::RowQuant* oqp = oq_req ? &*oq_req : nullptr;
    Tensor q4, k4, v4;  // attention's operands, which the backward keeps
    const Prepared wqkv = fuse && kv && bf16_qkv ? m.fused_weight(name + "wqkv", {wq, wk, wv}, false) : Prepared{};
    if (wqkv.defined()) {
      // the sampler's cached call on the fused projection: one GEMM, then RoPE, the BF16 copies
      // and the cache writes reading q, k and v where it left them (rope_attend's bits)
      Tensor qkv = act({N, (Hq + 2 * Hkv) * hd});
      forward_gemm(x.fwd, wqkv, qkv);
      Tensor qb = Tensor::empty({B, T, Hq, hd}, DType::BF16, m.device_);
      kv->rope_attend_fused(layer, qkv.reshape({N, Hq + 2 * Hkv, hd}), Hq, m.rope_, qb, o, lse, ob, oqp);
    } else {
      Tensor q = act({N, Hq * hd}), k = act({N, Hkv * hd}), v = act({N, Hkv * hd});
      forward_gemm(x.fwd, wq, q);
      forward_gemm(x.fwd, wk, k);
      forward_gemm(x.fwd, wv, v);
      q4 = q.reshape({B, T, Hq, hd});
      k4 = k.reshape({B, T, Hkv, hd});
      v4 = v.reshape({B, T, Hkv, hd});
      Tensor q3 = q.reshape({N, Hq, hd}), k3 = k.reshape({N, Hkv, hd});
      if (kv && bf16_qkv) {
        // the sampler's cached call: RoPE, the BF16 copies and the cache writes in one op, the
        // bits of the path below
        Tensor qb = Tensor::empty(q4.shape(), DType::BF16, m.device_);
        kv->rope_attend(layer, q3, k3, v.reshape({N, Hkv, hd}), m.rope_, qb, o, lse, ob, oqp);
      } else {
        if (bf16_qkv) {
          Tensor qb = Tensor::empty(q4.shape(), DType::BF16, m.device_);
          Tensor kb = Tensor::empty(k4.shape(), DType::BF16, m.device_);
          Tensor vb = Tensor::empty(v4.shape(), DType::BF16, m.device_);
          Tensor qb3 = qb.reshape(q3.shape()), kb3 = kb.reshape(k3.shape());
          // the rotated F32 q and k are never read (attention, the cache and the backward take
          // the copies): rope writes the copies only
          ops::rope_forward(q3, positions, m.rope_, &qb3, true);
          ops::rope_forward(k3, positions, m.rope_, &kb3, true);
          ops::convert(v4, vb);
          q4 = qb;
          k4 = kb;
          v4 = vb;
        } else {
          ops::rope_forward(q3, positions, m.rope_);
          ops::rope_forward(k3, positions, m.rope_);
        }
        // (kv here: an F32 cache, so no BF16 operands and no o_bf16)
        if (kv) kv->attend(layer, q4, k4.reshape(k.shape()), v4.reshape(v.shape()), o, lse);
        else ops::attention_forward(q4, k4, v4, 0, o, lse, ob);
      }
    }
    Tensor o2 = o.reshape({N, Hq * hd}), o2_bf16 = o_bf16.defined() ? o_bf16.reshape({N, Hq * hd}) : Tensor{};
    const Tensor* o2_converted = o2_bf16.defined() ? &o2_bf16 : nullptr;
    LinearInput o_in = oq_req ? LinearInput{producer_quantized(std::move(oq), o2, cls, name + "wo"), Prepared{}}
                       : s    ? prepare_input(o2, r, cls, name + "wo", true, o2_converted)
                              : prepare_fprop_input(o2, r, cls, name + "wo", o2_converted);
    record_input_amax(name + "o", o2, r);
    Tensor y = act({N, c.d_model});
    forward_gemm(o_in.fwd, weight(w.wo, name + "wo", GemmRole::Fprop, r.fprop.b, cls), y);
    if (s) {
      s->attn_x = std::move(x).kept();
      s->q = q4;
      s->k = k4;
      s->v = v4;
      s->o = o;
      s->lse = lse;
      s->attn_o = std::move(o_in).kept();
    }
    return y;
  }

  // dy_bf16: dy's BF16 copy, written by the norm backward that produced dy (ffn_dy_bf16,
  // attn_dy_bf16), or null.
  void attention_backward(const Tensor& dy, const LayerWeights& w, LayerWeights& g,
                          const std::string& name, const Model::Saved::Layer& s,
                          const Tensor& positions, Tensor& dxn, const Tensor* dy_bf16) {
    const LayerClass cls = LayerClass::Attention;
    const LayerRecipe& r = recipe(cls);
    const int64_t N = dy.size(0), hd = c.hd(), Hq = c.n_heads, Hkv = c.n_kv_heads;
    Tensor d_o = act({N, Hq * hd});
    linear_backward(dy, s.attn_o, w.wo, name + "wo", g.wo, &d_o, false, r, cls, nullptr, dy_bf16);
    Tensor dq = act(s.q.shape()), dk = act(s.k.shape()), dv = act(s.v.shape());
    ops::attention_backward(d_o.reshape(s.o.shape()), s.q, s.k, s.v, s.o, s.lse, dq, dk, dv);
    Tensor dq3 = dq.reshape({N, Hq, hd}), dk3 = dk.reshape({N, Hkv, hd});
    // dQ and dK as the projections' BF16 dY, written by rope's backward.
    Tensor dqb, dkb;
    if (bf16_grad(r) && m.dtype_ == DType::F32) {
      dqb = Tensor::empty({N, Hq * hd}, DType::BF16, m.device_);
      dkb = Tensor::empty({N, Hkv * hd}, DType::BF16, m.device_);
      Tensor dqb3 = dqb.reshape(dq3.shape()), dkb3 = dkb.reshape(dk3.shape());
      // the projections' BF16 dY only: the rotated F32 dq and dk would not be read
      ops::rope_backward(dq3, positions, m.rope_, &dqb3, true);
      ops::rope_backward(dk3, positions, m.rope_, &dkb3, true);
    } else {
      ops::rope_backward(dq3, positions, m.rope_);
      ops::rope_backward(dk3, positions, m.rope_);
    }
    Tensor dq2 = dq.reshape({N, Hq * hd}), dk2 = dk.reshape({N, Hkv * hd}), dv2 = dv.reshape({N, Hkv * hd});
    // with the copies, dY is the BF16 dq and dk themselves (prepare takes a BF16 tensor as it is)
    linear_backward(dqb.defined() ? dqb : dq2, s.attn_x, w.wq, name + "wq", g.wq, &dxn, false, r, cls);
    linear_backward(dkb.defined() ? dkb : dk2, s.attn_x, w.wk, name + "wk", g.wk, &dxn, true, r, cls);
    linear_backward(dv2, s.attn_x, w.wv, name + "wv", g.wv, &dxn, true, r, cls);
  }

  // ---- MoE block ----------------------------------------------------------------------------
  // A MoE layer's routed experts' fprop weights with its shared expert's appended as one more
  // slice (set_shared_expert_grouped): w1 | w3 stacked per expert, and w2.
  struct SharedGroup {
    Prepared w13, w2;
    explicit operator bool() const { return w13.defined() && w2.defined(); }
  };
  // The layer's SharedGroup where a forward that keeps nothing (s, aux: none) may run its shared
  // expert with the routed experts, else none. The same bits as running it apart: each group's rows
  // are its own GEMM's, the tokens are quantized per row (not per tensor) and rounded to nearest
  // (so the routed experts' quantized tokens are the shared expert's, as ffn_forward's x_fwd), and
  // the SwiGLU and its quantizer work row by row.
  SharedGroup shared_group(const LayerWeights& w, const std::string& name, const LayerRecipe& r,
                           const Model::Saved::Layer* s, bool aux) {
    const QuantSpec &xa = r.fprop.a, &wb = r.fprop.b;
    if (!g_shared_expert_grouped.load(std::memory_order_relaxed) || !fuse || s || aux || record_amax ||
        training_path || c.n_shared_experts != 1 || c.shared_hidden() != c.d_expert ||
        (xa.quantized() && (xa.rounding != num::Rounding::RNE || xa.outer == OuterScale::Tensor)) ||
        (!wb.quantized() && wb.fmt != Format::BF16))  // F32 weights run apart (fused_weight)
      return {};
    const LayerClass cls = LayerClass::Expert;
    const int64_t E = c.n_experts, D = c.d_model, F = c.d_expert;
    SharedGroup g;
    g.w13 = m.appended_weight(name + "moe.w13+shared", E + 1, D, [&] {
      const std::string sh = name + "moe.shared";
      return std::vector<Prepared>{
          stack_fprop_weights({weight(w.w1, name + "moe.w1", GemmRole::Fprop, wb, cls, &w.w3),
                               weight(w.w3, name + "moe.w3", GemmRole::Fprop, wb, cls, &w.w1)}, true),
          stack_fprop_weights({weight(w.sw1, sh + ".w1", GemmRole::Fprop, wb, cls, &w.sw3),
                               weight(w.sw3, sh + ".w3", GemmRole::Fprop, wb, cls, &w.sw1)}, true)};
    });
    if (!g.w13.defined()) return {};
    g.w2 = m.appended_weight(name + "moe.w2+shared", E + 1, F, [&] {
      return std::vector<Prepared>{weight(w.w2, name + "moe.w2", GemmRole::Fprop, wb, cls),
                                   weight(w.sw2, name + "moe.shared.w2", GemmRole::Fprop, wb, cls)};
    });
    return g;
  }

  // Router (high precision) -> softmax top-k -> tokens quantized once, dispatched in expert order
  // -> per-expert SwiGLU GEMMs -> combine in rank order -> + shared expert. xn16: xn's BF16
  // copy written by the norm where moe_reads_bf16_x(), else undefined.
  // x_fwd: the routed experts' quantized tokens made by the norm (producer_quant), where nothing
  // is saved.
  Tensor moe_forward(const Tensor& xn, const LayerWeights& w, LayerWeights& g, const std::string& name,
                     Model::Saved::Layer* s, bool aux, const Tensor& xn16, const Prepared* x_fwd = nullptr) {
    const LayerClass cls = LayerClass::Expert;
    const LayerRecipe& r = recipe(cls);
    const LayerRecipe& rr = recipe(LayerClass::Router);
    const int64_t N = xn.size(0), D = c.d_model, E = c.n_experts, K = c.top_k;

    Tensor logits = act({N, E});
    const Prepared px_router = prepare(xn, rr.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.router/fprop/X"),
                                       LayerClass::Router, log);
    gemm(px_router, weight(w.router, name + "moe.router", GemmRole::Fprop, rr.fprop.b, LayerClass::Router), logits);
    Tensor probs = act({N, E}), topk_idx = Tensor::empty({N, K}, DType::I32, m.device_), topk_w = act({N, K});
    ops::router_topk(logits, K, probs, topk_idx, topk_w);
    // A forward with no backward and no load-balance loss (the sampler's, evaluation's) needs no
    // counts on the host at all where the experts' GEMMs read the plan's offsets on the GPU
    // (every recipe's operands but FP32 ones, which run cuBLASLt per expert): nothing comes back,
    // and a bad expert id is reported once the whole forward is queued (finish_deferred_plans).
    const bool deferred =
        !s && !aux && !record_amax && !training_path && inference_routing_on_gpu(m.device_, c, r);
    // The shared expert as one more group of the routed experts' GEMMs (set_shared_expert_grouped):
    // its tokens are the plan's extra rows, after the slots.
    const SharedGroup group = shared_group(w, name, r, s, aux);
    const bool bf16_x = moe_reads_bf16_x();
    FOURBIT_CHECK(!bf16_x || xn16.defined(), "moe_forward: the norm's BF16 copy of the layer input is missing");
    const bool wgrad_from_fwd = wgrad_from_saved_fwd(r);
    // Where the experts' GEMMs take dense BF16 operands (the bf16 recipe) and the GPU made the
    // plan, a training forward's read them there too: the dispatch, the experts and the combine
    // are queued before the host waits for the counts, which only the load-balance statistics and
    // the backward need, so the GPU does not idle through that wait. Elsewhere the host waits here.
    const bool device_routed = deferred || moe_training_routed_on_gpu(r);
    // A training forward whose backward runs every expert GEMM on the device offsets
    // (backward_on_device_offsets) and whose load-balance terms stay on the GPU too (aux_terms)
    // reads nothing back at all: the index check is the forward's (Model::forward_queued).
    const bool no_read = !deferred && s && N > 0 && aux_terms.defined() && !group && moe_training_reads_nothing(r);
    // Otherwise the routing comes back to the host (the expert GEMMs' shapes); the work that does
    // not depend on it is queued first, so that the GPU runs it while the host waits: the tokens'
    // BF16 copy or quantization, and the shared expert when it runs apart.
    ops::PendingRoutePlan pending_plan =
        ops::route_plan_begin(topk_idx, E, aux ? probs : Tensor(), !deferred && !no_read, group ? N : 0);
    ops::RoutePlan& plan = pending_plan.plan;  // its slot maps (and on the GPU, device_offsets) already
    if (m.device_ == Device::CPU && moe_offsets_on_gpu())  // set_moe_device_offsets_on_cpu
      plan.device_offsets = Tensor::from_host(std::vector<int32_t>(plan.offsets.begin(), plan.offsets.end()).data(),
                                              {int64_t(plan.offsets.size())}, DType::I32, Device::CPU);
    const int64_t rows = plan.token_of_slot.size(0);  // N K, and the shared expert's N where grouped
    // Where a weight gradient follows (s) and the experts' X and X^T pair (MXFP8 both, X rounded
    // to nearest: a token's blocks are then the same wherever it is quantized), both come from the
    // dispatched rows in one pass, X with its BF16 decode for the w1 and w3 GEMMs; otherwise each
    // token is quantized once here (or by the norm: x_fwd) and its packed row dispatched, and a
    // forward that keeps nothing makes no X^T.
    FOURBIT_CHECK(!x_fwd || !s, "moe_forward: prepared tokens are taken only by a forward that saves nothing");
    const bool pair_x = s && x_pairs(r) && r.fprop.a.rounding == num::Rounding::RNE;
    Prepared px;
    if (x_fwd) px = *x_fwd;
    else if (r.fprop.a.quantized() && !pair_x)
      px = prepare(xn, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w13/fprop/X"), cls, log);
    Tensor ys;
    if (c.n_shared_experts && !group) {
      FfnRefs sref{w.sw1, w.sw3, w.sw2, g.sw1, g.sw3, g.sw2, name + "moe.shared"};
      // an inference forward's shared expert reads the routed experts' quantized tokens: the
      // same spec rounded to nearest gives the same bits, one quantizer launch a layer fewer
      const bool reuse_px = fuse && !s && px.is_quantized() && r.fprop.a.rounding == num::Rounding::RNE;
      ys = ffn_forward(bf16_x ? xn16 : xn, sref, cls, s ? &s->shared : nullptr, reuse_px ? &px : nullptr);
    }
    if (!device_routed) ops::route_plan_finish(pending_plan);

    // Dispatch: quantize each token once (per-token scales make this independent of the batch),
    // then gather the packed rows into expert order.
    record_input_amax(name + "moe.x", xn, r, E, plan.token_of_slot, plan.offsets, quantized(px));
    Prepared x_perm;
    std::vector<Prepared> x_perm_wgrad;
    Tensor xn_perm, x_wgrad_rows;
    if (r.fprop.a.quantized() && !pair_x) {
      x_perm.q = ops::gather_rows(px.q, plan.token_of_slot);
      if (s) x_perm = decoded(std::move(x_perm));  // w1's and w3's GEMMs read it (inference: a packed read)
    }
    if (pair_x) {
      PreparedRowCol p;
      if (device_routed) {  // the experts' rows found from the GPU's offsets (moe_pairs_on_device_offsets)
        p = prepare_gathered_row_col_device_offsets(xn, plan.token_of_slot, r.fprop.a, GemmRole::Fprop, 'a',
                                                    site(name + "moe.w13/fprop/X"), r.wgrad.b, GemmRole::Wgrad, 'b',
                                                    plan.device_offsets, expert_sites(name + "moe.w13/wgrad/X^T"),
                                                    cls, ops::FormOut::CodesAndBf16);
      } else if (g_training_producer_quantizers.load(std::memory_order_relaxed)) {  // quantized as gathered
        p = prepare_gathered_row_col(xn, plan.token_of_slot, r.fprop.a, GemmRole::Fprop, 'a',
                                     site(name + "moe.w13/fprop/X"), r.wgrad.b, GemmRole::Wgrad, 'b', plan.offsets,
                                     expert_sites(name + "moe.w13/wgrad/X^T"), cls, log, ops::FormOut::CodesAndBf16,
                                     saved_x_form());
      } else {
        xn_perm = act({N * K, D});
        ops::gather_rows(xn, plan.token_of_slot, xn_perm);
        p = prepare_row_col(xn_perm, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w13/fprop/X"), r.wgrad.b,
                            GemmRole::Wgrad, 'b', plan.offsets, expert_sites(name + "moe.w13/wgrad/X^T"), cls, log,
                            ops::FormOut::CodesAndBf16, saved_x_form());
      }
      x_perm = std::move(p.row);
      x_perm_wgrad = std::move(p.col);
      x_wgrad_rows = std::move(p.col_rows);
    } else if (bf16_x) {
      // BF16 experts (and shared expert): the tokens converted once, then dispatched as BF16 rows.
      xn_perm = Tensor::empty({rows, D}, DType::BF16, m.device_);
      ops::gather_rows(xn16, plan.token_of_slot, xn_perm);
      x_perm = prepare(xn_perm, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w13/fprop/X"), cls, log);
    } else if (!r.fprop.a.quantized() || (s && !wgrad_from_fwd)) {
      xn_perm = act({rows, D});
      ops::gather_rows(xn, plan.token_of_slot, xn_perm);
      if (!r.fprop.a.quantized())
        x_perm = prepare(xn_perm, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w13/fprop/X"), cls, log);
    }
    if (s && !wgrad_from_fwd && !pair_x)
      x_perm_wgrad = prepare_segments(xn_perm, plan.offsets, r.wgrad.b, GemmRole::Wgrad, 'b',
                                      expert_sites(name + "moe.w13/wgrad/X^T"), cls, log);

    ExpertInner inner;
    const bool keep = s && m.keep_ffn_;
    Tensor y_perm = expert_ffn(x_perm, w, name, plan, rows, keep ? &inner : nullptr, group ? &group : nullptr);
    Tensor out = act({N, D});
    if (group) {  // the shared expert's rows follow the slots
      ys = y_perm.slice_rows(N * K, N * K + N);
      ops::moe_combine(y_perm.slice_rows(0, N * K), plan.slot_of, topk_w, out, &ys);
    } else {
      ops::moe_combine(y_perm, plan.slot_of, topk_w, out, c.n_shared_experts ? &ys : nullptr);
    }
    if (deferred) {
      deferred_plans = true;
      return out;
    }
    if (no_read) {
      plan.device_offsets = plan.device_offsets.view(0, {E + 1});
      if (aux) {
        ops::load_balance_term(plan.device_offsets, plan.device_prob_sums, N, N * K, m.aux_loss_coef_, aux_terms,
                               layer);
        pending_aux.push_back({0.0, layer});
      }
    } else {
      ops::route_plan_finish(pending_plan);
      // The backward's expert GEMMs read the routed experts' E + 1 offsets where the GPU made them
      // (backward_on_device_offsets); otherwise the rest reads the host's (and the plan's scratch may go).
      if (s && plan.device_offsets.defined() && backward_on_device_offsets(r))
        plan.device_offsets = plan.device_offsets.view(0, {E + 1});
      else
        plan.device_offsets = Tensor{};
      if (group) plan.offsets.pop_back();  // the experts' E + 1 from here on
      if (m.routing_observer_) m.routing_observer_(RoutingEvent{layer, N, plan.offsets});
      if (aux)
        pending_aux.push_back(
            {ops::load_balance_term_of(plan.offsets.data(), plan.prob_sums.data(), E, N, N * K, m.aux_loss_coef_)});
    }
    plan.device_prob_sums = Tensor{};
    if (s) {
      s->probs = probs;
      s->topk_idx = topk_idx;
      s->topk_w = topk_w;
      s->plan = std::move(plan);
      if (pair_x && m.saved_x_decodes_ && x_perm.q.bf16.defined()) {
        // the backward reads X only as the recomputation's GEMM operand (X^T is its own form)
        x_perm.q.codes = Tensor{};
        x_perm.q.block_scales = Tensor{};
      } else {
        x_perm.q.bf16 = Tensor{};  // only the forward's GEMMs read it
      }
      s->x_perm = std::move(x_perm);
      s->x_perm_wgrad = std::move(x_perm_wgrad);
      s->x_perm_wgrad_rows = std::move(x_wgrad_rows);
      if (keep) {
        s->expert_h1 = inner.h1;
        s->expert_h3 = inner.h3;
        s->expert_a = inner.a;
        s->expert_y = y_perm;
        s->expert_a_wgrad = std::move(inner.a_wgrad);
      }
    }
    return out;
  }

  // The experts' weight gradients: grad[e] += a[e] . b[e]^T for every expert that received tokens
  // (grad: an [E, R, C] gradient; a, b: per-expert operands, empty for experts without tokens),
  // every set's GEMMs in one ops::gemm_batch_grouped (each operand decoded once; on Hopper one
  // launch of the grouped kernel's K-grouped form, elsewhere the GEMMs on GPU lanes: a ~1000-token
  // expert GEMM alone fills a quarter of an H200). A stale gradient (ParamStore::grad_accumulate)
  // is stored instead: the GEMMs' sums, and zeros for the experts without tokens.
  struct ExpertWgrad {
    const std::vector<Prepared>& a;
    const std::vector<Prepared>& b;
    Tensor& grad;
  };
  void experts_wgrad(const ops::RoutePlan& plan, const std::vector<ExpertWgrad>& sets) {
    std::vector<Tensor> outs;
    outs.reserve(sets.size() * plan.offsets.size());  // jobs point at them
    std::vector<ops::GemmJob> jobs;
    std::vector<Tensor> empty_slices;  // stored gradients of experts without tokens: zeros, one launch
    for (const ExpertWgrad& w : sets) {
      const bool accumulate = m.params_.grad_accumulate(w.grad);
      for (size_t e = 0; e + 1 < plan.offsets.size(); ++e) {
        const int64_t R = w.grad.size(1), C = w.grad.size(2);
        Tensor slice = w.grad.view(int64_t(e) * R * C, {R, C});
        if (plan.offsets[e] == plan.offsets[e + 1]) {
          if (!accumulate) empty_slices.push_back(slice);
          continue;
        }
        outs.push_back(slice);
        jobs.push_back(ops::GemmJob{w.a[e].op(), w.b[e].op(), &outs.back(), accumulate});
      }
    }
    ops::zero_each(empty_slices);
    ops::gemm_batch_grouped(jobs);
  }

  // A grouped GEMM over the plan's experts: with the offsets on the GPU while the host does not
  // have them yet (moe_forward's device-routed path), else with the host's.
  static void expert_gemm(const Prepared& a, const Prepared& b, const ops::RoutePlan& plan, Tensor& c) {
    if (plan.offsets.empty()) ops::grouped_gemm_device_offsets(a.op(), b.op(), plan.device_offsets, c);
    else grouped_gemm(a, b, plan.offsets, c);
  }

  // The routed experts over expert-sorted rows: y = (silu(x W1^T) * (x W3^T)) W2^T per expert.
  // With `inner`, also returns h1, h3 and a (for backward's recompute).
  struct ExpertInner {
    Tensor h1, h3, a;
    Prepared pa;
    std::vector<Prepared> a_wgrad;  // a^T per expert for w2's weight gradient, where made with pa
    Tensor a_wgrad_rows;            // or a^T's decodes in a's rows, made on the device offsets
  };
  // group: the shared expert's rows follow the experts' (moe_forward), its weights appended to theirs.
  // a_wgrad_form: what inner's a^T forms hold (ops::FormOut): their codes where the backward keeps them,
  // their decodes alone in the backward's recomputation, whose weight-gradient GEMMs read them next.
  Tensor expert_ffn(const Prepared& x_perm, const LayerWeights& w, const std::string& name,
                    const ops::RoutePlan& plan, int64_t rows, ExpertInner* inner, const SharedGroup* group = nullptr,
                    ops::FormOut a_wgrad_form = ops::FormOut::Codes) {
    const LayerClass cls = LayerClass::Expert;
    const LayerRecipe& r = recipe(cls);
    const int64_t F = c.d_expert, D = c.d_model;
    const Prepared w1 = weight(w.w1, name + "moe.w1", GemmRole::Fprop, r.fprop.b, cls, &w.w3);
    const Prepared w3 = weight(w.w3, name + "moe.w3", GemmRole::Fprop, r.fprop.b, cls, &w.w1);
    const Prepared w2 = group ? group->w2 : weight(w.w2, name + "moe.w2", GemmRole::Fprop, r.fprop.b, cls);
    const Prepared w13 = group                ? group->w13
                         : fuse && !inner ? m.fused_weight(name + "moe.w13", {w1, w3}, true)
                                          : Prepared{};
    // a quantized where it is computed (no F32 a; below)
    const bool a_fused = !w13.defined() && swiglu_a_fused(r, inner != nullptr) && rows > 0;
    Tensor h1, h3, a = a_fused ? Tensor{} : act_bf16_if(bf16_input(r), {rows, F}), y = act({rows, D});
    QTensor aq;
    std::optional<ops::RowQuant> aq_req;
    if (w13.defined()) {  // each expert's w1 and w3 rows stacked: one GEMM, its SwiGLU on the halves
      Tensor h13 = act({rows, 2 * F});
      expert_gemm(x_perm, w13, plan, h13);
      aq_req = producer_quant(cls, name + "moe.w2", &aq);
      ops::swiglu_forward_fused(h13, a, aq_req ? &*aq_req : nullptr);
    } else {
      h1 = act({rows, F});
      h3 = act({rows, F});
      expert_gemm(x_perm, w1, plan, h1);
      expert_gemm(x_perm, w3, plan, h3);
      if (!a_fused) ops::swiglu_forward(h1, h3, a);
    }
    // Per-token scales: quantizing all expert rows at once equals quantizing each expert's. For
    // the backward pass (`inner`), w2's weight-gradient operand a^T comes in the same pass where
    // the two pair (prepare_row_col), and a with its BF16 decode for the GEMM below; where a is
    // not computed above, the SwiGLU quantizes it where it computes it (prepare_swiglu), the GEMM's
    // operand as its decode alone: nothing reads it after the GEMM.
    Prepared pa;
    std::vector<Prepared> a_wgrad;
    Tensor a_wgrad_rows;
    // the backward's recomputation where its experts' GEMMs read the GPU's offsets: a^T made on
    // them (moe_pairs_on_device_offsets)
    const bool a_on_device = a_fused && inner && plan.device_offsets.defined() && backward_on_device_offsets(r);
    if (a_on_device) {
      PreparedRowCol p = prepare_swiglu_device_offsets(h1, h3, r.fprop.a, GemmRole::Fprop, 'a',
                                                       site(name + "moe.w2/fprop/X"), r.wgrad.b, GemmRole::Wgrad, 'b',
                                                       plan.device_offsets, expert_sites(name + "moe.w2/wgrad/X^T"),
                                                       cls, ops::FormOut::Bf16);
      pa = std::move(p.row);
      a_wgrad_rows = std::move(p.col_rows);
    } else if (a_fused) {
      PreparedRowCol p =
          inner ? prepare_swiglu(h1, h3, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w2/fprop/X"), r.wgrad.b,
                                 GemmRole::Wgrad, 'b', plan.offsets, expert_sites(name + "moe.w2/wgrad/X^T"), cls, log,
                                 ops::FormOut::Bf16, a_wgrad_form)
                : prepare_swiglu(h1, h3, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w2/fprop/X"), r.fprop.a,
                                 GemmRole::Wgrad, 'b', {}, {}, cls, log, ops::FormOut::Bf16, ops::FormOut::Codes);
      pa = std::move(p.row);
      a_wgrad = std::move(p.col);
    } else {
      if (inner && x_pairs(r) && rows > 0) {
        PreparedRowCol p = prepare_row_col(a, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w2/fprop/X"), r.wgrad.b,
                                           GemmRole::Wgrad, 'b', plan.offsets, expert_sites(name + "moe.w2/wgrad/X^T"),
                                           cls, log, ops::FormOut::CodesAndBf16, a_wgrad_form);
        pa = std::move(p.row);
        a_wgrad = std::move(p.col);
      } else if (aq_req) {
        pa = producer_quantized(std::move(aq), a, cls, name + "moe.w2");
      } else {  // with its decode for the GEMM below; the codes where the backward keeps them
        pa = prepare(a, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w2/fprop/X"), cls, log, nullptr, nullptr,
                     inner ? ops::FormOut::CodesAndBf16 : ops::FormOut::Bf16);
      }
      record_input_amax(name + "moe.a", a, r, c.n_experts, {}, plan.offsets, quantized(pa));
    }
    expert_gemm(pa, w2, plan, y);
    if (inner) {
      pa.q.bf16 = Tensor{};  // only the GEMM above reads it
      *inner = ExpertInner{h1, h3, a, std::move(pa), std::move(a_wgrad), std::move(a_wgrad_rows)};
    }
    return y;
  }

  // dy_bf16: dy's BF16 copy, written by the norm backward that produced dy (ffn_dy_bf16,
  // attn_dy_bf16), or null.
  // The MoE layer's input is the FFN norm's output of s.x_mid (ffn_norm, s.rstd2): the router's
  // weight gradient reads it in F32, which the forward did not keep (ops::rmsnorm_input_wgrad).
  void moe_backward(const Tensor& dy, const LayerWeights& w, LayerWeights& g, const std::string& name,
                    const Model::Saved::Layer& s, float loss_weight, Tensor& dxn, const Tensor* dy_bf16) {
    const LayerClass cls = LayerClass::Expert;
    const LayerRecipe& r = recipe(cls);
    const LayerRecipe& rr = recipe(LayerClass::Router);
    const int64_t N = dy.size(0), D = c.d_model, E = c.n_experts, K = c.top_k, F = c.d_expert;
    const ops::RoutePlan& plan = s.plan;

    ExpertInner in;
    Tensor y_perm;
    if (s.expert_y.defined()) {  // kept: w2's fprop input is prepared again (the same bits) where
                                 // the weight gradient's X^T comes from it
      y_perm = s.expert_y;
      in.h1 = s.expert_h1;
      in.h3 = s.expert_h3;
      in.a = s.expert_a;
      in.a_wgrad = s.expert_a_wgrad;
      if (wgrad_from_saved_fwd(r))
        in.pa = prepare(in.a, r.fprop.a, GemmRole::Fprop, 'a', site(name + "moe.w2/fprop/X"), cls, log);
    } else {
      y_perm = expert_ffn(decoded(s.x_perm), w, name, plan, N * K, &in, nullptr, ops::FormOut::Bf16);
    }
    // The experts' GEMMs on the offsets where the GPU made them (backward_on_device_offsets): dY, X
    // and a read in place (the bf16 recipe), or their pairs made on those offsets, the weight
    // gradients reading the Col forms' decodes in the rows' layout (moe_pairs_on_device_offsets);
    // no per-expert operands. Otherwise on the host's.
    const bool on_gpu = plan.device_offsets.defined() && backward_on_device_offsets(r) && N * K > 0;
    const auto expert_dgrad = [&](const Prepared& a, const Prepared& b, Tensor& out, bool accumulate) {
      if (on_gpu) ops::grouped_gemm_device_offsets(a.op(), b.op(), plan.device_offsets, out, accumulate);
      else grouped_gemm(a, b, plan.offsets, out, accumulate);
    };
    const auto dense_bf16 = [](const Prepared& p, const char* what) -> const Tensor& {
      FOURBIT_CHECK(!p.is_quantized() && p.dense.defined() && p.dense.dtype() == DType::BF16,
                    "moe_backward: the experts' {} is not a dense BF16 operand", what);
      return p.dense;
    };
    // A weight gradient's operand on the device offsets: a pair's Col decodes in the rows' layout,
    // else the dense BF16 rows.
    const auto wgrad_rows = [&](const Tensor& col_rows, const Prepared& p, const char* what) -> const Tensor& {
      return col_rows.defined() ? col_rows : dense_bf16(p, what);
    };
    Tensor d_topk_w = act({N, K});
    PreparedRowCol pdy;
    if (dy_pair_fused(r) && N * K > 0) {
      // dy_perm quantized where its rows are computed (w2's dY pair, as expert_dy makes it)
      pdy = on_gpu ? prepare_combine_grad_row_col_device_offsets(
                         dy, y_perm, plan.slot_of, s.topk_w, d_topk_w, r.dgrad.a, GemmRole::Dgrad, 'a',
                         site(name + "moe.w2/dgrad/dY"), r.wgrad.a, GemmRole::Wgrad, 'a', plan.device_offsets,
                         expert_sites(name + "moe.w2/wgrad/dY^T"), cls, dy_form())
                   : prepare_combine_grad_row_col(
                         dy, y_perm, plan.slot_of, s.topk_w, d_topk_w, r.dgrad.a, GemmRole::Dgrad, 'a',
                         site(name + "moe.w2/dgrad/dY"), r.wgrad.a, GemmRole::Wgrad, 'a', plan.offsets,
                         expert_sites(name + "moe.w2/wgrad/dY^T"), cls, log, dy_form(), dy_form());
    } else {
      Tensor dy_perm = act_bf16_if(bf16_grad(r), {N * K, D});
      ops::moe_combine_backward(dy, y_perm, plan.slot_of, s.topk_w, dy_perm, d_topk_w);
      pdy = expert_dy(dy_perm, plan.offsets, r, cls, name + "moe.w2", !on_gpu);
    }

    // w2: da = dy_e . W2_e, dW2_e += dy_e^T . a_e
    const Prepared w2_dgrad = dgrad_weight(w.w2, name + "moe.w2", r, cls);
    const Prepared w1_dgrad = dgrad_weight(w.w1, name + "moe.w1", r, cls, &w.w3);
    const Prepared w3_dgrad = dgrad_weight(w.w3, name + "moe.w3", r, cls, &w.w1);
    Tensor da = act({N * K, F});
    expert_dgrad(pdy.row, w2_dgrad, da, false);
    if (on_gpu) {  // dW2_e (+)= dy_e^T . a_e, every expert's rows in one launch
      ops::grouped_wgrad_device_offsets(wgrad_rows(pdy.col_rows, pdy.row, "dY"),
                                        wgrad_rows(in.a_wgrad_rows, in.pa, "a"), plan.device_offsets, g.w2,
                                        m.params_.grad_accumulate(g.w2));
    } else {
      // The weight-gradient operands along the tokens: every expert's in one pass (per-expert keys).
      const std::vector<Prepared> dyt = std::move(pdy.col);
      const std::vector<Prepared> a_wgrad =
          wgrad_from_saved_fwd(r)   ? wgrad_inputs(in.pa, {}, r, cls, name + "moe.w2", plan.offsets)
          : !in.a_wgrad.empty() ? std::move(in.a_wgrad)
                                : prepare_segments(in.a, plan.offsets, r.wgrad.b, GemmRole::Wgrad, 'b',
                                                   expert_sites(name + "moe.w2/wgrad/X^T"), cls, log);
      experts_wgrad(plan, {{dyt, a_wgrad, g.w2}});
    }
    // w1, w3: dx_perm = dh1_e . W1_e + dh3_e . W3_e; dW1_e += dh1_e^T . x_e (and W3)
    PreparedRowCol pdh1, pdh3;
    if (dy_pair_fused(r) && N * K > 0) {  // dh1 and dh3 quantized where they are computed
      std::array<PreparedRowCol, 2> pdh =
          swiglu_grads(da, in.h1, in.h3, r, cls, name + "moe.w1", name + "moe.w3", plan.offsets, true,
                       on_gpu ? plan.device_offsets : Tensor{});
      pdh1 = std::move(pdh[0]);
      pdh3 = std::move(pdh[1]);
    } else {
      Tensor dh1 = act_bf16_if(bf16_grad(r), {N * K, F}), dh3 = act_bf16_if(bf16_grad(r), {N * K, F});
      ops::swiglu_backward(da, in.h1, in.h3, dh1, dh3);
      pdh1 = expert_dy(dh1, plan.offsets, r, cls, name + "moe.w1", !on_gpu);
      pdh3 = expert_dy(dh3, plan.offsets, r, cls, name + "moe.w3", !on_gpu);
    }
    Tensor dx_perm = act({N * K, D});
    expert_dgrad(pdh1.row, w1_dgrad, dx_perm, false);
    expert_dgrad(pdh3.row, w3_dgrad, dx_perm, true);
    if (on_gpu) {  // dW1_e and dW3_e (+)= dh_e^T . x_e: both weights' experts in one launch
      const bool accumulate = m.params_.grad_accumulate(g.w1);
      FOURBIT_CHECK(accumulate == m.params_.grad_accumulate(g.w3), "moe_backward: w1's and w3's gradients differ in "
                    "staleness");
      // the routed slots (not a shared group's)
      const Tensor x16 = s.x_perm_wgrad_rows.defined() ? s.x_perm_wgrad_rows
                                                       : dense_bf16(s.x_perm, "X").slice_rows(0, N * K);
      ops::grouped_wgrad_device_offsets({{&wgrad_rows(pdh1.col_rows, pdh1.row, "dh1"), &x16, &g.w1},
                                         {&wgrad_rows(pdh3.col_rows, pdh3.row, "dh3"), &x16, &g.w3}},
                                        plan.device_offsets, accumulate);
    } else {
      const std::vector<Prepared> dh1t = std::move(pdh1.col), dh3t = std::move(pdh3.col);
      const std::vector<Prepared> x_wgrad =
          wgrad_inputs(s.x_perm, s.x_perm_wgrad, r, cls, name + "moe.w13", plan.offsets);
      experts_wgrad(plan, {{dh1t, x_wgrad, g.w1}, {dh3t, x_wgrad, g.w3}});
    }
    ops::gather_rows_backward(dx_perm, plan.slot_of, dxn);

    // Router: through the top-k weights and the load-balance loss's d/dprobs, one row every token
    // shares: from the host's counts (E values to upload), or made where the device offsets are.
    Tensor d_probs;
    if (plan.offsets.empty()) {
      d_probs = act({1, E});
      ops::load_balance_dprobs(plan.device_offsets, N, N * K, loss_weight, m.aux_loss_coef_, d_probs);
    } else {
      Tensor d_probs_host = Tensor::empty({1, E}, m.dtype_, Device::CPU);
      for (int64_t e = 0; e < E; ++e) {
        const double d = ops::load_balance_dprob(plan.offsets.data(), e, E, N, N * K, loss_weight, m.aux_loss_coef_);
        if (m.dtype_ == DType::F64) d_probs_host.data<double>()[e] = d;
        else d_probs_host.data<float>()[e] = float(d);
      }
      d_probs = d_probs_host.to(m.device_);
    }
    Tensor d_logits = act({N, E});
    ops::router_backward(s.probs, s.topk_idx, s.topk_w, d_topk_w, d_probs, d_logits);
    // The router's GEMMs run on F32 operands in every recipe (high precision): dX = dlogits . W,
    // and dW = dlogits^T . X with X the norm's output made where the GEMM reads it.
    FOURBIT_CHECK(!rr.dgrad.a.quantized() && rr.wgrad.a.fmt == Format::F32 && rr.wgrad.b.fmt == Format::F32,
                  "moe_backward: the router's gradients take F32 operands");
    const std::string router = name + "moe.router";
    const Prepared pdl = prepare(d_logits, rr.dgrad.a, GemmRole::Dgrad, 'a', site(router + "/dgrad/dY"),
                                 LayerClass::Router, log);
    gemm(pdl, dgrad_weight(w.router, router, rr, LayerClass::Router), dxn, true);
    if (log) {  // the weight gradient's two F32 operands, as prepare() would log them
      log->add(LayerClass::Router, GemmRole::Wgrad, 'a', rr.wgrad.a, false);
      log->add(LayerClass::Router, GemmRole::Wgrad, 'b', rr.wgrad.b, false);
    }
    ops::rmsnorm_input_wgrad(d_logits, s.x_mid, w.ffn_norm, float(c.norm_eps), s.rstd2, g.router,
                             m.params_.grad_accumulate(g.router));

    if (c.n_shared_experts) {
      FfnRefs sref{w.sw1, w.sw3, w.sw2, g.sw1, g.sw3, g.sw2, name + "moe.shared"};
      ffn_backward(dy, sref, cls, s.shared, dxn, true, dy_bf16);
    }
  }
};

// ------------------------------------------------------------------------------------------------

Model::Model(const ModelConfig& cfg, const Recipe& recipe, Device device, DType dtype)
    : cfg_(cfg),
      recipe_(recipe),
      device_(device),
      dtype_(dtype),
      params_(cfg, dtype, device),
      aux_loss_coef_(cfg.aux_loss_coef) {
  if (dtype != DType::F32 && dtype != DType::F64) fail("model dtype must be f32 or f64");
  rope_ = ops::rope_table(cfg.max_seq_len, cfg.hd(), cfg.rope_theta, device);
  if (dtype == DType::F64) {
    Tensor t = Tensor::empty(rope_.shape(), DType::F64, device);
    ops::convert(rope_, t);
    rope_ = t;
  }
}

Model::~Model() = default;

void Model::set_aux_loss_coef(double coef) {
  if (!(coef >= 0 && std::isfinite(coef))) fail("load-balance loss coefficient: expected a finite value >= 0, got {}", coef);
  aux_loss_coef_ = coef;
}

Prepared Model::weight(const Tensor& w, const std::string& name, GemmRole role, const QuantSpec& spec,
                       LayerClass cls, const SrStreams& sr, const Tensor* partner, ops::FormOut form) {
  // Weight operands are functions of the weights (RNE in every recipe): cached until the weights
  // change, at the site name/role/W of the step that first prepares them.
  const std::string key = name + "/" + gemm_role_name(role);
  auto it = weight_cache_.find(key);
  if (it != weight_cache_.end()) {
    quant_log_.add(cls, role, 'b', spec, false);
    return it->second;
  }
  // A dense (BF16, FP32) dgrad weight is the forward's operand read transposed: the same rounding
  // of the same weights, so it is not converted a second time (nor cached: a view, no GPU work).
  if (role == GemmRole::Dgrad && !spec.quantized()) {
    auto fwd = weight_cache_.find(name + "/" + gemm_role_name(GemmRole::Fprop));
    if (fwd != weight_cache_.end() && !fwd->second.is_quantized() &&
        fwd->second.dense.dtype() == (spec.fmt == Format::BF16 ? DType::BF16 : DType::F32))
      return reuse_dense(fwd->second, w, spec, role, 'b', sr.site(key + "/W"), cls, &quant_log_);
  }
  // A capture only records work: an operand prepared inside one would sit in the cache unmade.
  if (graph_capturing())
    fail("model: the weight operand {} is not cached, and a CUDA graph being captured cannot make it (run the "
         "forward once before capturing it)", key);
  // NUMERICS "NVFP4": an FFN's w1 and w3 form one outer-scale group (per expert for the routed
  // experts' [E, F, D] stacks; the whole matrix for the shared expert and a dense FFN, whose
  // gate and up projections serving engines fuse the same way).
  Tensor gamax = amax_ahead(w, spec, partner);  // the optimizer's, where it raised them
  if (!gamax.defined() && partner) {  // one pass over the pair for both (a max is the same in any order)
    const void *a0 = w.raw(), *a1 = partner->raw();
    const std::string pair =
        fmt::format("{}:{}/{}/{}", std::min(a0, a1), std::max(a0, a1), gemm_role_name(role), describe(spec));
    auto a = group_amax_cache_.find(pair);
    if (a == group_amax_cache_.end()) a = group_amax_cache_.emplace(pair, shared_outer_amax({w, *partner}, spec, role)).first;
    gamax = a->second;
  }
  const auto ahead = bf16_ahead_.find(key);
  const Tensor* converted = ahead != bf16_ahead_.end() && spec.fmt == Format::BF16 && ahead->second.source == w.raw() &&
                                    ahead->second.copy.shape() == w.shape()
                                ? &ahead->second.copy
                                : nullptr;
  Prepared p = prepare(w, spec, role, 'b', sr.site(key + "/W"), cls, &quant_log_, gamax.defined() ? &gamax : nullptr,
                       converted, form);
  if (ahead != bf16_ahead_.end()) bf16_ahead_.erase(ahead);
  weight_cache_.emplace(key, p);
  return p;
}

Prepared Model::fused_weight(const std::string& name, const std::vector<Prepared>& parts, bool shared_outer) {
  // Only where a GEMM's element is the same chain over K whatever its N: the CPU's GEMM, and on
  // the GPU the grouped kernel family, which takes BF16 and block-scaled operands (forward_gemm's
  // default). F32 operands (the fp32 recipe: views of the weights themselves) and a GPU GEMM on
  // cuBLASLt, whose algorithm is chosen per N, run their parts apart.
  const Prepared& p0 = parts.at(0);
  if (!p0.is_quantized() && (!p0.dense.defined() || p0.dense.dtype() != DType::BF16)) return {};
  const int64_t slices = p0.is_quantized() ? p0.q.slices : p0.dense.dim() == 3 ? p0.dense.size(0) : 1;
  const int64_t K = p0.is_quantized() ? p0.q.cols : p0.dense.size(-1);
  if (!grouped_forward_gemms(slices, K)) return {};
  return cached_fused(name, [&] { return stack_fprop_weights(parts, shared_outer); });
}

bool Model::grouped_forward_gemms(int64_t slices, int64_t K) const {
  return device_ == Device::CPU ||
         (forward_gemms_grouped() && ops::grouped_gemm_reads_device_offsets(device_, slices, K));
}

Prepared Model::cached_fused(const std::string& name, const std::function<Prepared()>& make) {
  const std::string key = name + "/" + gemm_role_name(GemmRole::Fprop);
  auto it = fused_cache_.find(key);
  if (it != fused_cache_.end()) return it->second;
  // as weight(): a capture would leave the stacked copy unmade in the cache
  if (graph_capturing())
    fail("model: the fused weight operand {} is not cached, and a CUDA graph being captured cannot make it (run the "
         "forward once before capturing it)", key);
  return fused_cache_.emplace(key, make()).first->second;
}

Prepared Model::appended_weight(const std::string& name, int64_t slices, int64_t K,
                                const std::function<std::vector<Prepared>()>& parts) {
  // only where the grouped kernel family runs the groups (as fused_weight): its rows do not depend
  // on the other groups
  if (!grouped_forward_gemms(slices, K)) return {};
  return cached_fused(name, [&] { return append_weight_slices(parts()); });
}

// On the GPU, every weight whose fprop and dgrad operands are MXFP8 of one format, both rounded
// to nearest and made from the weights (not the nvfp4-fwd requantization), goes into the cache as
// both operands at once, each its BF16 decode alone: one pass over the weight instead of two
// quantizations and a decode before every GEMM, and one launch for all of them
// (set_weight_forms_batched). Nothing in the step reads their codes
// (forward_weight makes them again for its readers); the cache holds 2 bytes a value per operand
// until the weights change. Once a change: forms an inference forward cached since (one role's,
// with codes) are replaced, so that the cache holds the forms made in one launch, which stay where
// they are from one update to the next (weight_forms_).
void Model::quantize_weights_ahead(const SrStreams& sr) {
  if (device_ != Device::CUDA || dtype_ != DType::F32 || weight_forms_current_) return;
  std::vector<WeightBoth> ws;
  std::vector<std::pair<std::string, std::string>> keys;
  for (const LinearInfo& li : linears()) {
    const LayerRecipe& r = recipe_.layer(li.cls, li.layer, cfg_.n_layers);
    const QuantSpec &f = r.fprop.b, &d = r.dgrad.b;
    if (r.requant_saved_sr || !ops::row_col_one_pass(f, d) || f.rounding != num::Rounding::RNE ||
        d.rounding != num::Rounding::RNE || li.weight.dtype() != DType::F32)
      continue;
    const std::string kf = li.name + "/" + gemm_role_name(GemmRole::Fprop);
    const std::string kd = li.name + "/" + gemm_role_name(GemmRole::Dgrad);
    ws.push_back({li.weight, f, sr.site(kf + "/W"), d, sr.site(kd + "/W"), li.cls});
    keys.emplace_back(kf, kd);
  }
  if (ws.empty()) return;
  // The same weights' forms made in one launch again (after an update): rewritten where the last
  // ones are, which a recorded micro-batch reads (StepGraphs).
  const bool batched = g_weight_forms_batched.load(std::memory_order_relaxed);
  const bool again = batched && keys == weight_forms_keys_;
  std::vector<std::pair<Prepared, Prepared>> forms =
      prepare_weights_both(ws, &quant_log_, batched, again ? &weight_forms_ : nullptr);
  weight_forms_ = batched ? forms : std::vector<std::pair<Prepared, Prepared>>{};
  weight_forms_keys_ = batched ? keys : std::vector<std::pair<std::string, std::string>>{};
  weight_forms_current_ = true;
  for (size_t i = 0; i < ws.size(); ++i) {
    weight_cache_.insert_or_assign(keys[i].first, std::move(forms[i].first));
    weight_cache_.insert_or_assign(keys[i].second, std::move(forms[i].second));
  }
}

const Tensor& Model::training_positions(int64_t B, int64_t T) {
  if (!positions_.defined() || positions_B_ != B || positions_T_ != T) {
    std::vector<int32_t> pos(size_t(B * T));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) pos[size_t(b * T + t)] = int32_t(t);
    positions_ = Tensor::from_host(pos.data(), {B * T}, DType::I32, device_);
    positions_B_ = B;
    positions_T_ = T;
  }
  return positions_;
}

const Bf16Copies& Model::bf16_weight_copies() {
  if (bf16_copies_made_) return bf16_copies_;
  bf16_copies_made_ = true;
  if (dtype_ != DType::F32) return bf16_copies_;
  const std::vector<ParamInfo>& infos = params_.infos();
  std::vector<uint8_t> wanted(infos.size(), 0);
  for (const LinearInfo& li : linears())
    if (recipe_.layer(li.cls, li.layer, cfg_.n_layers).fprop.b.fmt == Format::BF16)
      wanted[params_.param_index(li.weight)] = 1;
  bf16_copies_.at.assign(infos.size(), -1);
  int64_t n = 0;
  for (size_t i = 0; i < infos.size(); ++i)
    if (wanted[i]) {
      bf16_copies_.at[i] = n;
      n += infos[i].numel();
    }
  if (n > 0) bf16_copies_.buffer = Tensor::empty({n}, DType::BF16, device_);
  return bf16_copies_;
}

namespace {
// The outer-scale groups of an NVFP4 weight operand whose amax is a max over contiguous elements
// of the weight (no Hadamard rotation): one for a per-tensor scale, one a slice for per-slice
// scales; 0 for any other spec.
int64_t weight_amax_groups(const Tensor& w, const QuantSpec& spec) {
  if (spec.fmt != Format::NVFP4 || spec.hadamard != 0) return 0;
  if (spec.outer == OuterScale::Tensor) return 1;
  if (spec.outer == OuterScale::PerSlice) return w.dim() == 3 ? w.size(0) : 1;
  return 0;
}
}  // namespace

const SliceAmaxAhead& Model::slice_amax_ahead() {
  if (amax_ahead_made_) return amax_ahead_;
  amax_ahead_made_ = true;
  if (dtype_ != DType::F32) return amax_ahead_;
  const std::vector<ParamInfo>& infos = params_.infos();
  amax_ahead_.at.assign(infos.size(), -1);
  amax_ahead_.slice.assign(infos.size(), 0);
  // Each linear whose forward (else dgrad) weight operand has such groups and is a whole
  // parameter gets entries; an FFN's w3 shares its w1's (linears() lists w1 first), as weight()
  // pairs them.
  std::map<std::string, size_t> by_name;
  std::vector<std::pair<size_t, size_t>> pairs;  // (w3, w1) parameter indices sharing entries
  int64_t n = 0;
  for (const LinearInfo& li : linears()) {
    const LayerRecipe& r = recipe_.layer(li.cls, li.layer, cfg_.n_layers);
    int64_t groups = weight_amax_groups(li.weight, r.fprop.b);
    if (groups == 0) groups = weight_amax_groups(li.weight, r.dgrad.b);
    if (groups == 0 || li.weight.dtype() != DType::F32) continue;
    const size_t i = params_.param_index(li.weight);
    if (li.weight.raw() != params_.view(params_.flat_const(), infos[i]).raw() || li.weight.numel() != infos[i].numel())
      continue;
    by_name[li.name] = i;
    amax_ahead_.slice[i] = li.weight.numel() / groups;
    const auto w1 = li.name.ends_with(".w3") ? by_name.find(li.name.substr(0, li.name.size() - 1) + "1") : by_name.end();
    if (w1 != by_name.end() && infos[w1->second].numel() == li.weight.numel() &&
        amax_ahead_.slice[w1->second] == amax_ahead_.slice[i]) {
      amax_ahead_.at[i] = amax_ahead_.at[w1->second];
      pairs.emplace_back(i, w1->second);
      continue;
    }
    amax_ahead_.at[i] = n;
    n += groups;
  }
  if (n == 0) return amax_ahead_ = SliceAmaxAhead{};
  amax_ahead_.buffer = Tensor::zeros({n}, DType::F32, device_);
  const auto raw_of = [&](size_t i) { return params_.view(params_.flat_const(), infos[i]).raw(); };
  for (const auto& [name, i] : by_name)
    amax_ahead_at_[raw_of(i)] = AmaxAhead{amax_ahead_.buffer.view(amax_ahead_.at[i], {infos[i].numel() / amax_ahead_.slice[i]}),
                                          nullptr, infos[i].numel()};
  for (const auto& [w3, w1] : pairs) {  // two weights on one set of entries
    amax_ahead_at_[raw_of(w3)].partner = raw_of(w1);
    amax_ahead_at_[raw_of(w1)].partner = raw_of(w3);
  }
  return amax_ahead_;
}

Tensor Model::amax_ahead(const Tensor& w, const QuantSpec& spec, const Tensor* partner) const {
  if (!amax_ahead_current_) return {};
  const auto it = amax_ahead_at_.find(w.raw());
  if (it == amax_ahead_at_.end()) return {};
  const AmaxAhead& e = it->second;
  const int64_t groups = weight_amax_groups(w, spec);
  // the same groups of the same weights (and of the same pair), else the pass over the weights
  if (groups == 0 || e.amax.numel() != groups || e.partner != (partner ? partner->raw() : nullptr) ||
      w.numel() != e.numel)
    return {};
  return e.amax;
}

void Model::convert_bf16_weights_ahead() {
  if (!weight_cache_.empty() || !bf16_ahead_.empty() || dtype_ != DType::F32) return;
  if (graph_capturing())
    fail("model: the weight cache is empty, and a CUDA graph being captured cannot fill it (run the forward once "
         "before capturing it)");
  const Bf16Copies& copies = bf16_weight_copies();
  if (!copies.defined()) return;
  std::vector<Tensor> src, dst;
  for (const LinearInfo& li : linears()) {
    const LayerRecipe& r = recipe_.layer(li.cls, li.layer, cfg_.n_layers);
    if (r.fprop.b.fmt != Format::BF16 || li.weight.dtype() != DType::F32) continue;
    const size_t i = params_.param_index(li.weight);
    const int64_t within = (static_cast<const char*>(li.weight.raw()) -
                            static_cast<const char*>(params_.flat_const().raw())) / int64_t(sizeof(float)) -
                           params_.infos()[i].offset;
    Tensor copy = copies.buffer.view(copies.at[i] + within, li.weight.shape());
    src.push_back(li.weight);
    dst.push_back(copy);
    bf16_ahead_.emplace(li.name + "/" + gemm_role_name(GemmRole::Fprop), Bf16Ahead{li.weight.raw(), copy});
  }
  // the optimizer wrote them with the update (the same bits: convert of the updated weights)
  if (!bf16_copies_current_) ops::convert_each(src, dst);
}

bool Model::training_step_capturable() {
  if (device_ == Device::CPU || dtype_ != DType::F32 || quant_log_.enabled || quant_log_.record_calls) return false;
  // Every operand dense BF16, or MXFP8 rounded to nearest (no SR keys, which change every
  // micro-batch, and no amax record) with the weights' two forms made in one launch (their
  // buffers rewritten in place before a replay: quantize_weights_ahead).
  const bool batched = g_weight_forms_batched.load(std::memory_order_relaxed);
  const auto mx_rne = [](const QuantSpec& q) {
    return (q.fmt == Format::MXFP8_E4M3 || q.fmt == Format::MXFP8_E5M2) && q.rounding == num::Rounding::RNE &&
           q.hadamard == 0;
  };
  const auto replayable = [&](const LayerRecipe& r) {
    for (const GemmRecipe* g : {&r.fprop, &r.dgrad, &r.wgrad})
      for (const QuantSpec* q : {&g->a, &g->b})
        if (!dense_bf16(*q) && !mx_rne(*q)) return false;
    if (r.fprop.b.quantized() != r.dgrad.b.quantized()) return false;
    if (r.fprop.b.quantized() && !(batched && ops::row_col_one_pass(r.fprop.b, r.dgrad.b))) return false;
    return !r.requant_saved_sr;
  };
  ModelRunner run{*this, cfg_, SrStreams{}, &quant_log_};
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    run.layer = l;
    const bool moe = cfg_.is_moe_layer(l);
    if (!replayable(run.recipe(LayerClass::Attention)) ||
        !replayable(run.recipe(moe ? LayerClass::Expert : LayerClass::Dense)))
      return false;
    if (moe && !run.moe_training_reads_nothing(run.recipe(LayerClass::Expert))) return false;
    const LayerRecipe& router = run.recipe(LayerClass::Router);
    for (const GemmRecipe* g : {&router.fprop, &router.dgrad, &router.wgrad})
      if (g->a.quantized() || g->b.quantized()) return false;
  }
  return replayable(recipe_.layer(LayerClass::LmHead, cfg_.n_layers, cfg_.n_layers));
}

void Model::weights_for_replay(const SrStreams& sr) {
  // the BF16 copies, unless a forward since the update converted them
  if (!bf16_copies_current_ && weight_cache_.empty() && bf16_ahead_.empty()) {
    convert_bf16_weights_ahead();
    bf16_copies_current_ = bf16_copies_.defined();
  }
  quantize_weights_ahead(sr);  // (nothing where a training forward since the update made them)
}

bool Model::persistent_weight_operand(const Prepared& p) const {
  if (!p.is_quantized())
    return p.dense.defined() && (p.dense.shares_storage(params_.flat_const()) ||
                                 (bf16_copies_.defined() && p.dense.shares_storage(bf16_copies_.buffer)));
  const auto same = [](const QTensor& a, const QTensor& b) {
    for (const auto& [x, y] : {std::pair{&a.codes, &b.codes}, std::pair{&a.bf16, &b.bf16}})
      if (x->defined() && !(y->defined() && x->raw() == y->raw())) return false;
    return a.codes.defined() || a.bf16.defined();
  };
  for (const auto& [f, d] : weight_forms_)
    if (same(p.q, f.q) || same(p.q, d.q)) return true;
  return false;
}

namespace {

// The layer stack and LM head; with `s`, keeps what backward needs; with `aux`, leaves the MoE
// layers' load-balance terms in run (ModelRunner::aux_loss_value). With `kv` (the sampler's cached
// forward) attention goes through the cache and only the rows `logit_rows` (I32 indices into the
// B * T rows; undefined: all) reach the LM head.
Tensor forward_logits(Model& m, ModelRunner& run, const Tensor& tokens, Model::Saved* s, bool aux,
                      const KvStep* kv = nullptr, const Tensor& logit_rows = Tensor()) {
  const ModelConfig& cfg = m.config();
  const int64_t B = tokens.size(0), T = tokens.size(1), D = cfg.d_model, V = cfg.vocab_size;
  int64_t N = B * T;
  const ModelWeights& w = m.params().weights();
  ModelWeights g = m.params().grads();
  const Tensor positions = kv ? kv->positions : m.training_positions(B, T);
  run.weights_ahead(s != nullptr);
  Tensor x = run.act({N, D});
  ops::embedding_forward(tokens.reshape({N}), w.embed, x);
  // The residual stream's x + f of the block before, where one is pending: added by the next
  // norm (add_rmsnorm_forward: the bits of the add, then the norm).
  Tensor pending;
  // yq: y's fprop operand made by the norm (ModelRunner::producer_quant), or none.
  auto norm = [&](const Tensor& w_norm, Tensor& y, Tensor& rstd, Tensor* y_bf16,
                  const std::optional<ops::RowQuant>& yq = std::nullopt) {
    const ops::RowQuant* q = yq ? &*yq : nullptr;
    if (!pending.defined()) return ops::rmsnorm_forward(x, w_norm, float(cfg.norm_eps), y, rstd, y_bf16, q);
    Tensor sum = run.act({N, D});
    ops::add_rmsnorm_forward(x, pending, sum, w_norm, float(cfg.norm_eps), y, rstd, y_bf16, q);
    x = sum;
    pending = Tensor{};
  };
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    run.layer = l;
    Model::Saved::Layer* sl = s ? &s->layers[size_t(l)] : nullptr;
    const LayerWeights& lw = w.layers[size_t(l)];
    LayerWeights& lg = g.layers[size_t(l)];
    const std::string name = "layers." + std::to_string(l) + ".";
    // attention block
    // The attention's normed input is only read by its QKV GEMMs; the FFN's also by the router
    // (F32) in a MoE layer.
    Tensor xn = run.act_bf16_if(ModelRunner::bf16_input(run.recipe(LayerClass::Attention)), {N, D});
    Tensor rstd1 = run.act({N});
    QTensor xq;
    const auto xq_req = run.producer_quant(LayerClass::Attention, name + "attn.wqkv", &xq);
    norm(lw.attn_norm, xn, rstd1, nullptr, xq_req);
    const Prepared x_fwd =
        xq_req ? run.producer_quantized(std::move(xq), xn, LayerClass::Attention, name + "attn.wqkv") : Prepared{};
    const Tensor x_in = x;
    pending = run.attention_forward(xn, lw, name + "attn.", sl, positions, B, T, kv, xq_req ? &x_fwd : nullptr);
    // FFN block
    const bool moe = cfg.is_moe_layer(l);
    Tensor xn2 = run.act_bf16_if(!moe && ModelRunner::bf16_input(run.recipe(LayerClass::Dense)), {N, D});
    Tensor rstd2 = run.act({N});
    Tensor xn2_16;
    if (moe && run.moe_reads_bf16_x()) xn2_16 = Tensor::empty({N, D}, DType::BF16, m.device());
    const LayerClass ffn_cls = moe ? LayerClass::Expert : LayerClass::Dense;
    const std::string ffn_point = name + (moe ? "moe.w13" : "mlp.w13");
    QTensor xq2;
    const auto xq2_req = run.producer_quant(ffn_cls, ffn_point, &xq2);
    norm(lw.ffn_norm, xn2, rstd2, xn2_16.defined() ? &xn2_16 : nullptr, xq2_req);
    const Prepared x2_fwd = xq2_req ? run.producer_quantized(std::move(xq2), xn2, ffn_cls, ffn_point) : Prepared{};
    const Prepared* x2_in = xq2_req ? &x2_fwd : nullptr;
    const Tensor x_mid = x;
    Tensor f;
    if (moe) {
      f = run.moe_forward(xn2, lw, lg, name, sl, aux, xn2_16, x2_in);
    } else {
      ModelRunner::FfnRefs dref{lw.dw1, lw.dw3, lw.dw2, lg.dw1, lg.dw3, lg.dw2, name + "mlp"};
      f = run.ffn_forward(xn2, dref, LayerClass::Dense, sl ? &sl->dense : nullptr, x2_in);
    }
    pending = f;
    if (sl) {
      sl->x_in = x_in;
      sl->rstd1 = rstd1;
      sl->x_mid = x_mid;
      sl->rstd2 = rstd2;
      sl->moe = moe;
    }
  }
  if (logit_rows.defined()) {  // every op after the layer stack is per token: a subset of rows
    if (pending.defined()) {
      Tensor x_out = run.act({N, D});
      ops::add(x, pending, x_out);
      x = x_out;
      pending = Tensor{};
    }
    N = logit_rows.size(0);
    Tensor picked = run.act({N, D});
    ops::gather_rows(x, logit_rows, picked);
    x = picked;
  }
  run.layer = cfg.n_layers;
  const LayerRecipe& rh = m.recipe().lm_head;
  Tensor xf = run.act_bf16_if(ModelRunner::bf16_input(rh), {N, D}), rstd_f = run.act({N});
  norm(w.final_norm, xf, rstd_f, nullptr);
  run.record_input_amax("lm_head.x", xf, rh);
  LinearInput xf_in = s ? run.prepare_input(xf, rh, LayerClass::LmHead, "lm_head", true)
                        : run.prepare_fprop_input(xf, rh, LayerClass::LmHead, "lm_head");
  Tensor logits = Tensor::empty({N, V}, m.dtype(), m.device());
  forward_gemm(xf_in.fwd, run.weight(w.lm_head, "lm_head", GemmRole::Fprop, rh.fprop.b, LayerClass::LmHead), logits);
  if (s) {
    s->x_final = x;
    s->rstd_f = rstd_f;
    s->xf = std::move(xf_in).kept();
    s->positions = positions;
  }
  run.finish_deferred_plans();
  return logits;
}

}  // namespace

const ForwardStats& PendingForwardStats::stats() {
  if (summed_) return st_;
  if (index_check_) {  // a bad token id, target or expert id fails here, before any update
    const std::function<void()> check = std::move(index_check_);
    index_check_ = nullptr;
    check();
  }
  Tensor hold_s, hold_l, hold_w;  // host copies where no read was queued
  if (scalars_dev_.defined()) {  // the GPU's forward: its count and load-balance terms (forward_queued;
                                 // captured: the replay's, read now)
    const double* sc = static_cast<const double*>(host_bytes(scalars_, scalars_dev_, hold_s));
    st_.tokens = int64_t(sc[0]);
    st_.aux_loss = sum_aux_terms(aux_, sc + 1);
  }
  const int64_t n = st_.token_losses.numel(), n_valid = st_.tokens;
  const bool f64 = st_.token_losses.dtype() == DType::F64;
  const void* lraw = host_bytes(losses_, st_.token_losses, hold_l);
  const float* w = weights_.defined() ? static_cast<const float*>(host_bytes(weights_read_, weights_, hold_w)) : nullptr;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double l = f64 ? static_cast<const double*>(lraw)[i] : double(static_cast<const float*>(lraw)[i]);
    sum += w ? double(w[i]) * l : l;
  }
  st_.loss = n_valid ? sum / double(n_valid) : 0.0;
  summed_ = true;
  weights_ = scalars_dev_ = Tensor{};
  scalars_ = losses_ = weights_read_ = nullptr;
  return st_;
}

PendingForwardStats PendingForwardStats::after_replay() const {
  if (!scalars_dev_.defined() || scalars_ || summed_)
    fail("PendingForwardStats::after_replay: these are not the stats of a forward queued while a CUDA graph was captured");
  PendingForwardStats p = *this;
  const Tensor& losses = st_.token_losses;
  p.index_check_ = ops::check_index_errors_later(scalars_dev_.device());
  p.scalars_ = read_later(scalars_dev_.raw(), size_t(scalars_dev_.nbytes()));
  p.losses_ = read_later(losses.raw(), size_t(losses.nbytes()));
  if (weights_.defined()) p.weights_read_ = read_later(weights_.raw(), size_t(weights_.nbytes()));
  return p;
}

std::vector<Tensor> PendingForwardStats::captured_tensors() const {
  std::vector<Tensor> out;
  for (const Tensor& t : {st_.token_losses, scalars_dev_, weights_})
    if (t.defined()) out.push_back(t);
  return out;
}

ForwardStats Model::forward(const Tensor& tokens, const Tensor& targets, const SrStreams& sr,
                            bool for_backward, float loss_weight, const Tensor& token_weights) {
  return forward_queued(tokens, targets, sr, for_backward, loss_weight, token_weights).stats();
}

void Model::check_training_batch(const Tensor& tokens, const Tensor& targets, const Tensor& token_weights) const {
  if (tokens.dim() != 2 || tokens.dtype() != DType::I32)
    fail("model forward: tokens must be i32 [B, T], got {}", tokens.str());
  if (targets.shape() != tokens.shape() || targets.dtype() != DType::I32)
    fail("model forward: targets must be i32 {} like tokens, got {}", shape_str(tokens.shape()), targets.str());
  if (token_weights.defined() && (token_weights.shape() != tokens.shape() || token_weights.dtype() != DType::F32 ||
                                  token_weights.device() != device_))
    fail("model forward: token weights must be f32 {} on {} like tokens, got {}", shape_str(tokens.shape()),
         device_name(device_), token_weights.str());
}

PendingForwardStats Model::forward_queued(const Tensor& tokens, const Tensor& targets, const SrStreams& sr,
                                          bool for_backward, float loss_weight, const Tensor& token_weights) {
  check_training_batch(tokens, targets, token_weights);
  const bool weighted = token_weights.defined();
  const int64_t B = tokens.size(0), T = tokens.size(1), N = B * T, V = cfg_.vocab_size;
  if (T > cfg_.max_seq_len) fail("model forward: sequence length {} exceeds max_seq_len {}", T, cfg_.max_seq_len);

  ModelRunner run{*this, cfg_, sr, &quant_log_};
  run.record_amax = for_backward;
  std::unique_ptr<Saved> s;
  if (for_backward) {
    s = std::make_unique<Saved>();
    s->B = B;
    s->T = T;
    s->loss_weight = loss_weight;
    s->sr = sr;
    s->tokens = tokens;
    s->layers.resize(size_t(cfg_.n_layers));
  }
  // On the GPU the host queues the whole forward without waiting for it: the ops' index checks are
  // deferred (one read of the device's record once the forward is queued), the target count and the
  // cross-entropy's gradient scale are made there (ops::count_targets), and the MoE layers either
  // read their counts back as they go or, where the backward runs on the device offsets, leave
  // their load-balance terms there too (ModelRunner::aux_terms). What the stats need comes back in
  // reads queued behind the forward, which stats() waits for.
  const bool on_gpu = device_ != Device::CPU;
  std::optional<ops::DeferIndexChecks> defer_checks;
  Tensor scalars;  // F64 [1 + n_layers] on the GPU: the target count, then the MoE layers' terms
  if (on_gpu) {
    defer_checks.emplace();
    scalars = Tensor::zeros({1 + cfg_.n_layers}, DType::F64, device_);
    run.aux_terms = scalars.view(1, {cfg_.n_layers});
  }
  const Tensor logits = forward_logits(*this, run, tokens, s.get(), true);
  const Tensor targets_flat = targets.reshape({N});
  int64_t n_valid = 0;
  Tensor scale;  // the GPU's gradient scale (count_targets)
  if (on_gpu) {
    scale = Tensor::empty({1}, DType::F32, device_);
    Tensor count = scalars.view(0, {1});
    ops::count_targets(targets_flat, loss_weight, count, scale);
  } else {
    const int32_t* th = targets.data<int32_t>();
    for (int64_t i = 0; i < N; ++i) n_valid += th[i] >= 0 ? 1 : 0;
  }

  // Cross-entropy; its gradient (of loss_weight * mean CE) is computed here, fused.
  Tensor losses = run.act({N});
  Tensor dlogits;
  if (for_backward) dlogits = Tensor::empty({N, V}, dtype_, device_);
  const double grad_scale = n_valid ? double(loss_weight) / double(n_valid) : 0.0;
  const Tensor weights_flat = weighted ? token_weights.reshape({N}) : Tensor();
  ops::cross_entropy(logits, targets_flat, losses, for_backward ? &dlogits : nullptr, grad_scale,
                     weighted ? &weights_flat : nullptr, on_gpu ? &scale : nullptr);

  PendingForwardStats pending;
  ForwardStats& st = pending.st_;
  st.token_losses = losses;
  pending.weights_ = weights_flat;  // undefined without token weights
  if (on_gpu) {
    pending.scalars_dev_ = scalars;
    if (!graph_capturing()) {  // a capture records: stats() reads the replay's buffers (captured_tensors)
      pending.index_check_ = ops::check_index_errors_later(device_);
      pending.scalars_ = read_later(scalars.raw(), size_t(scalars.nbytes()));
      pending.losses_ = read_later(losses.raw(), size_t(losses.nbytes()));
      if (weighted) pending.weights_read_ = read_later(weights_flat.raw(), size_t(weights_flat.nbytes()));
    }
    pending.aux_ = std::move(run.pending_aux);
    run.pending_aux.clear();
  } else {
    st.tokens = n_valid;
    st.aux_loss = run.aux_loss_value();
  }

  if (s) {
    saved_bytes_ = SavedBytes{};
    s->dlogits = dlogits;
    auto& by = saved_bytes_.by_category;
    for (const Saved::Layer& sl : s->layers) {
      by["residual"] += tensor_bytes(sl.x_in) + tensor_bytes(sl.rstd1) + tensor_bytes(sl.x_mid) + tensor_bytes(sl.rstd2);
      by["attention"] += sl.attn_x.bytes() + tensor_bytes(sl.q) + tensor_bytes(sl.k) + tensor_bytes(sl.v) +
                         tensor_bytes(sl.o) + tensor_bytes(sl.lse) + sl.attn_o.bytes();
      if (sl.moe) {
        by["router"] += tensor_bytes(sl.probs) + tensor_bytes(sl.topk_idx) + tensor_bytes(sl.topk_w) +
                        tensor_bytes(sl.plan.slot_of) + tensor_bytes(sl.plan.token_of_slot);
        int64_t ex = sl.x_perm.bytes() + sl.shared.x.bytes() + tensor_bytes(sl.expert_h1) + tensor_bytes(sl.expert_h3) +
                     tensor_bytes(sl.expert_a) + tensor_bytes(sl.expert_y) + tensor_bytes(sl.shared.h1) +
                     tensor_bytes(sl.shared.h3) + tensor_bytes(sl.shared.a);
        for (const Prepared& p : sl.x_perm_wgrad) ex += p.bytes();
        ex += tensor_bytes(sl.x_perm_wgrad_rows);
        by["expert"] += ex;
        int64_t a_wgrad = 0;  // w2's a^T, made with a in the forward (kept FFN interiors)
        for (const Prepared& p : sl.expert_a_wgrad) a_wgrad += p.bytes();
        if (a_wgrad) by["expert_wgrad"] += a_wgrad;
      } else {
        by["dense"] += sl.dense.x.bytes() + tensor_bytes(sl.dense.h1) + tensor_bytes(sl.dense.h3) +
                       tensor_bytes(sl.dense.a);
      }
    }
    by["residual"] += tensor_bytes(s->x_final) + tensor_bytes(s->rstd_f);
    by["lm_head"] += s->xf.bytes() + tensor_bytes(s->dlogits);
    saved_ = std::move(s);
  }
  return pending;
}

void Model::backward() {
  if (!saved_) fail("model backward: no forward pass with for_backward=true to go back through");
  std::unique_ptr<Saved> s = std::move(saved_);
  const int64_t N = s->B * s->T, D = cfg_.d_model;
  ModelRunner run{*this, cfg_, s->sr, &quant_log_};
  const ModelWeights& w = params_.weights();
  ModelWeights g = params_.grads();

  // LM head and final norm
  run.layer = cfg_.n_layers;
  Tensor dxf = run.act({N, D});
  run.linear_backward(s->dlogits, s->xf, w.lm_head, "lm_head", g.lm_head, &dxf, false,
                      recipe_.lm_head, LayerClass::LmHead);
  Tensor dx = run.act({N, D});
  // dx's BF16 copy where the next linear reads it as a BF16 dY, written by the norm's backward
  // that produced dx (one buffer: each copy is read before the next norm overwrites it)
  Tensor dx16;
  auto dx16_if = [&](bool wanted) -> Tensor* {
    if (!wanted) return nullptr;
    if (!dx16.defined()) dx16 = Tensor::empty({N, D}, DType::BF16, device_);
    return &dx16;
  };
  const auto ffn_dy16 = [&](int64_t l) { return run.ffn_dy_bf16(cfg_.is_moe_layer(l)); };
  // the norms' backward stores a stale gradient (ParamStore::grad_accumulate), else adds to it
  Tensor* dy16 = dx16_if(ffn_dy16(cfg_.n_layers - 1));  // dx's copy, or null
  ops::rmsnorm_backward(dxf, s->x_final, w.final_norm, s->rstd_f, dx, g.final_norm, false,
                        params_.grad_accumulate(g.final_norm), dy16);

  for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) {
    run.layer = l;
    const Saved::Layer& sl = s->layers[size_t(l)];
    const LayerWeights& lw = w.layers[size_t(l)];
    LayerWeights& lg = g.layers[size_t(l)];
    const std::string name = "layers." + std::to_string(l) + ".";
    // FFN block: dx flows through the residual and through the FFN
    Tensor dxn2 = run.act({N, D});
    if (sl.moe) {
      run.moe_backward(dx, lw, lg, name, sl, s->loss_weight, dxn2, dy16);
    } else {
      ModelRunner::FfnRefs dref{lw.dw1, lw.dw3, lw.dw2, lg.dw1, lg.dw3, lg.dw2, name + "mlp"};
      run.ffn_backward(dx, dref, LayerClass::Dense, sl.dense, dxn2, false, dy16);
    }
    // the residual's gradient plus the normed branch's, added by the norm's backward
    dy16 = dx16_if(run.attn_dy_bf16());
    ops::rmsnorm_backward(dxn2, sl.x_mid, lw.ffn_norm, sl.rstd2, dx, lg.ffn_norm, true,
                          params_.grad_accumulate(lg.ffn_norm), dy16);
    // attention block
    Tensor dxn = run.act({N, D});
    run.attention_backward(dx, lw, lg, name + "attn.", sl, s->positions, dxn, dy16);
    dy16 = dx16_if(l > 0 && ffn_dy16(l - 1));
    ops::rmsnorm_backward(dxn, sl.x_in, lw.attn_norm, sl.rstd1, dx, lg.attn_norm, true,
                          params_.grad_accumulate(lg.attn_norm), dy16);
  }
  params_.zero_if_stale(g.embed);  // the embedding's backward adds to its gradient
  // the forward's embedding_forward checked these tokens: no host round trip here
  ops::embedding_backward(dx, s->tokens.reshape({N}), g.embed, true);
  params_.settle_grads();
}

void set_moe_routing_waits_deferred(bool on) { g_routing_waits_deferred.store(on, std::memory_order_relaxed); }
void set_fused_forward_gemms(bool on) { g_fused_forward_gemms.store(on, std::memory_order_relaxed); }
void set_producer_quantizers(bool on) { g_producer_quantizers.store(on, std::memory_order_relaxed); }
bool set_moe_pairs_on_device_offsets(bool on) {
  return g_moe_pairs_on_device_offsets.exchange(on, std::memory_order_relaxed);
}

bool set_moe_device_offsets_on_cpu(bool on) {
  return g_moe_device_offsets_on_cpu.exchange(on, std::memory_order_relaxed);
}

bool set_moe_backward_device_offsets(bool on) {
  return g_moe_backward_device_offsets.exchange(on, std::memory_order_relaxed);
}
void set_shared_expert_grouped(bool on) { g_shared_expert_grouped.store(on, std::memory_order_relaxed); }
bool set_weight_forms_batched(bool on) { return g_weight_forms_batched.exchange(on, std::memory_order_relaxed); }
bool set_dy_decodes_only(bool on) { return g_dy_decodes_only.exchange(on, std::memory_order_relaxed); }
bool set_training_producer_quantizers(bool on) {
  return g_training_producer_quantizers.exchange(on, std::memory_order_relaxed);
}
bool set_input_amax_from_quantizers(bool on) {
  return g_input_amax_from_quantizers.exchange(on, std::memory_order_relaxed);
}

Tensor Model::forward_cached(const Tensor& tokens, const KvBatch& batch, KvCache& cache, const SrStreams& sr,
                             const std::vector<int32_t>& logit_rows) {
  if (tokens.dtype() != DType::I32 || tokens.dim() != 2 || tokens.device() != device_)
    fail("cached forward: tokens must be i32 [B, T] on the {}, got {}", device_name(device_), tokens.str());
  if (tokens.size(1) != batch.T) fail("cached forward: tokens {} but the batch says T = {}", tokens.str(), batch.T);
  if (cache.layers() != cfg_.n_layers || cache.device() != device_ || cache.dtype() != dtype_)
    fail("cached forward: the cache ({} layers, {} {}) was not made for this model ({} layers, {} {})",
         cache.layers(), dtype_name(cache.dtype()), device_name(cache.device()), cfg_.n_layers, dtype_name(dtype_),
         device_name(device_));
  const KvStep kv(cache, batch, cfg_.max_seq_len);
  if (tokens.size(0) != batch.rows())
    fail("cached forward: tokens {} but the batch has {} rows", tokens.str(), batch.rows());
  Tensor rows;
  if (!logit_rows.empty()) {
    for (int32_t r : logit_rows)
      if (r < 0 || r >= tokens.numel()) fail("cached forward: logit row {} is outside [0, {})", r, tokens.numel());
    rows = Tensor::from_host(logit_rows.data(), {int64_t(logit_rows.size())}, DType::I32, device_);
  }
  ModelRunner run{*this, cfg_, sr, nullptr};
  run.fuse = g_fused_forward_gemms.load(std::memory_order_relaxed);
  return forward_logits(*this, run, tokens, nullptr, false, &kv, rows);
}

Tensor Model::forward_cached(const Tensor& tokens, const KvStep& kv, const SrStreams& sr) {
  if (tokens.dtype() != DType::I32 || tokens.dim() != 2 || tokens.device() != device_ ||
      tokens.size(0) != kv.batch.rows() || tokens.size(1) != kv.batch.T)
    fail("cached forward: tokens must be i32 [{}, {}] on the {} (the step's rows and T), got {}", kv.batch.rows(),
         kv.batch.T, device_name(device_), tokens.str());
  if (kv.cache.layers() != cfg_.n_layers || kv.cache.device() != device_ || kv.cache.dtype() != dtype_)
    fail("cached forward: the cache ({} layers, {} {}) was not made for this model ({} layers, {} {})",
         kv.cache.layers(), dtype_name(kv.cache.dtype()), device_name(kv.cache.device()), cfg_.n_layers,
         dtype_name(dtype_), device_name(device_));
  ModelRunner run{*this, cfg_, sr, nullptr};
  run.fuse = g_fused_forward_gemms.load(std::memory_order_relaxed);
  return forward_logits(*this, run, tokens, nullptr, false, &kv, Tensor());
}

bool Model::forward_cached_stays_on_device() const {
  if (device_ == Device::CPU) return false;
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    if (cfg_.is_moe_layer(l) &&
        !inference_routing_on_gpu(device_, cfg_, recipe_.layer(LayerClass::Expert, l, cfg_.n_layers)))
      return false;
  return true;
}

Tensor Model::logits(const Tensor& tokens, const SrStreams& sr, bool as_trainer) {
  if (tokens.dtype() != DType::I32 || tokens.dim() != 2) fail("logits: tokens must be i32 [B, T], got {}", tokens.str());
  if (tokens.size(1) > cfg_.max_seq_len)
    fail("logits: sequence length {} exceeds max_seq_len {}", tokens.size(1), cfg_.max_seq_len);
  ModelRunner run{*this, cfg_, sr, nullptr};
  run.training_path = as_trainer;
  run.fuse = !as_trainer && g_fused_forward_gemms.load(std::memory_order_relaxed);
  return forward_logits(*this, run, tokens, nullptr, false);
}

// ---- the linears' forward weights and the recorded input amax ---------------------------------

std::vector<LinearInfo> Model::linears() const {
  const ModelWeights& w = params_.weights();
  std::vector<LinearInfo> out;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const LayerWeights& lw = w.layers[size_t(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    auto add = [&](const std::string& name, const Tensor& t, LayerClass cls) { out.push_back({p + name, t, cls, l}); };
    add("attn.wq", lw.wq, LayerClass::Attention);
    add("attn.wk", lw.wk, LayerClass::Attention);
    add("attn.wv", lw.wv, LayerClass::Attention);
    add("attn.wo", lw.wo, LayerClass::Attention);
    if (cfg_.is_moe_layer(l)) {
      add("moe.router", lw.router, LayerClass::Router);
      add("moe.w1", lw.w1, LayerClass::Expert);
      add("moe.w3", lw.w3, LayerClass::Expert);
      add("moe.w2", lw.w2, LayerClass::Expert);
      if (cfg_.n_shared_experts) {  // the shared expert runs in the experts' recipe class
        add("moe.shared.w1", lw.sw1, LayerClass::Expert);
        add("moe.shared.w3", lw.sw3, LayerClass::Expert);
        add("moe.shared.w2", lw.sw2, LayerClass::Expert);
      }
    } else {
      add("mlp.w1", lw.dw1, LayerClass::Dense);
      add("mlp.w3", lw.dw3, LayerClass::Dense);
      add("mlp.w2", lw.dw2, LayerClass::Dense);
    }
  }
  out.push_back({"lm_head", w.lm_head, LayerClass::LmHead, cfg_.n_layers});
  return out;
}

LinearInfo Model::linear(const std::string& name) const {
  for (LinearInfo& li : linears())
    if (li.name == name) return li;
  fail("model: no linear layer named '{}'", name);
}

Prepared Model::forward_weight(const std::string& linear_name) {
  // The same call (name, role, spec, class) as the forward's, so the same cache entry.
  const LinearInfo li = linear(linear_name);
  const LayerRecipe& r = recipe_.layer(li.cls, li.layer, cfg_.n_layers);
  // An FFN's w1 and w3 share one outer scale (NUMERICS "NVFP4"): the forward prepares each with
  // the other as its partner, and so does this, in case the forward has not run since the weights
  // last changed.
  const bool gate = linear_name.ends_with(".w1"), up = linear_name.ends_with(".w3");
  const std::string stem = linear_name.substr(0, linear_name.size() - 1);
  const Tensor partner = gate ? linear(stem + "3").weight : up ? linear(stem + "1").weight : Tensor{};
  Prepared p = weight(li.weight, li.name, GemmRole::Fprop, r.fprop.b, li.cls, SrStreams{},
                      partner.defined() ? &partner : nullptr);
  // The training forward caches its MXFP8 weights as their decodes alone (quantize_weights_ahead);
  // readers of this (export, the RL weight-code snapshots) get the codes: made again, the same
  // bits (weights round to nearest, and MXFP8 has no outer scale to share).
  if (p.is_quantized() && !p.q.codes.defined())
    p = prepare(li.weight, r.fprop.b, GemmRole::Fprop, 'b', QuantSite{}, li.cls, nullptr);
  return p;
}

int64_t ForwardWeightBytes::experts_total() const {
  int64_t total = 0;
  for (const auto& [layer, bytes] : expert_by_layer) total += bytes;
  return total;
}

ForwardWeightBytes forward_weight_bytes(Model& model) {
  ForwardWeightBytes out;
  const int64_t E = model.config().n_experts;
  for (const LinearInfo& li : model.linears()) {
    const int64_t bytes = model.forward_weight(li.name).bytes();
    // routed experts' weights are [E, R, C]; a shared expert's and every other linear's are 2-D
    if (li.cls == LayerClass::Expert && li.weight.dim() == 3) {
      if (bytes % E != 0) fail("forward_weight_bytes: {} holds {} bytes, not a whole number per each of {} experts",
                               li.name, bytes, E);
      out.expert_by_layer[li.layer] += bytes / E;
    } else {
      out.other += bytes;
    }
  }
  return out;
}

std::string Model::input_amax_key(const std::string& linear_name) {
  if (linear_name == "lm_head") return "lm_head.x";
  const size_t dot = linear_name.rfind('.');
  if (dot == std::string::npos) return "";
  const std::string block = linear_name.substr(0, dot), w = linear_name.substr(dot + 1);
  if (w == "router") return "";
  if (w == "wq" || w == "wk" || w == "wv") return block + ".x";
  if (w == "wo") return block + ".o";
  if (w == "w1" || w == "w3") return block + ".x";
  if (w == "w2") return block + ".a";
  return "";
}

nlohmann::json Model::input_amax_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, t] : input_amax_) {
    const Tensor h = t.to(Device::CPU);
    std::vector<float> v(h.data<float>(), h.data<float>() + h.numel());
    j[key] = v;  // floats print in round-trip precision, so a checkpoint restores the same bits
  }
  return j;
}

void Model::load_input_amax(const nlohmann::json& j) {
  if (!j.is_object()) fail("input_amax: expected an object of arrays, got {}", j.type_name());
  std::map<std::string, Tensor> loaded;
  for (const auto& [key, v] : j.items()) {
    const int64_t expect = key.ends_with("moe.x") || key.ends_with("moe.a") ? cfg_.n_experts : 1;
    if (!v.is_array() || int64_t(v.size()) != expect)
      fail("input_amax: '{}' must hold {} number{}, got {}", key, expect, expect == 1 ? "" : "s", v.dump());
    std::vector<float> vals;
    for (const auto& x : v) {
      if (!x.is_number() || !(x.get<double>() >= 0)) fail("input_amax: '{}' holds {}, not an amax >= 0", key, x.dump());
      vals.push_back(x.get<float>());
    }
    loaded[key] = Tensor::from_host(vals.data(), {expect}, DType::F32, device_);
  }
  input_amax_ = std::move(loaded);
}

}  // namespace fourbit
