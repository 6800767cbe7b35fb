// defines: Model, ForwardStats, AuxTerm, PendingForwardStats, SavedBytes, LinearInfo, RoutingEvent, RoutingObserver, ForwardWeightBytes,
//          forward_weight_bytes, set_moe_routing_waits_deferred, set_fused_forward_gemms, set_producer_quantizers,
//          set_shared_expert_grouped, set_dy_decodes_only, set_weight_forms_batched, set_moe_backward_device_offsets,
//          set_moe_device_offsets_on_cpu, set_moe_pairs_on_device_offsets, set_training_producer_quantizers,
//          set_input_amax_from_quantizers
// The decoder-only MoE transformer, forward and backward written out layer by layer over the
// ops/ interface (llm.c style): embedding; L x [RMSNorm -> causal GQA attention with RoPE ->
// residual -> RMSNorm -> MoE FFN (router softmax top-k, SwiGLU experts, optional shared expert,
// load-balance loss) or dense SwiGLU FFN -> residual]; final RMSNorm; LM head (optionally tied).
// Every linear GEMM takes its operand formats from the Recipe; the model never names a recipe.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/kv_cache.h"
#include "fourbit/model/linear.h"
#include "fourbit/model/params.h"
#include "fourbit/model/recipe.h"
#include "fourbit/tensor/device_memory.h"

namespace fourbit {

struct ForwardStats {
  double loss = 0;      // mean cross-entropy over the target tokens (nats); with per-token
                        // weights, sum(weight * CE) / tokens
  double aux_loss = 0;  // load-balance loss summed over MoE layers (already weighted)
  int64_t tokens = 0;   // target tokens counted (targets != -1)
  Tensor token_losses;  // F32/F64 [B*T] on the model's device: each position's unweighted
                        // cross-entropy, -log p(target) (0 where the target is -1)
};

// One MoE layer's load-balance term of a forward: its value (from the host's counts), or
// (device_slot >= 0) its entry among the terms the GPU computed, read back with the stats.
struct AuxTerm {
  double value = 0;
  int64_t device_slot = -1;
};

// A forward whose loss the host has not read yet (Model::forward_queued). stats() reads the
// per-token losses back and sums them: the forward's GPU work must finish first, so a trainer
// that queues the backward before calling it keeps the GPU busy while the host waits, where
// reading the loss first leaves the GPU idle until the host has queued the backward's first
// kernels. The same numbers as Model::forward's, bit for bit.
class PendingForwardStats {
 public:
  // Reads and sums on the first call (a bad index the GPU recorded in the forward fails here); then
  // the same stats.
  const ForwardStats& stats();
  // A forward queued while a CUDA graph is being captured (GraphCapture) reads nothing back: its
  // stats are those of a replay of the graph, from the buffers the replay writes; these are they,
  // for the capture's `keep` (the per-token losses, the count and load-balance terms, the token
  // weights).
  std::vector<Tensor> captured_tensors() const;
  // Called on a captured forward's stats once a replay is queued: a copy whose reads of those
  // buffers (and of the index-error record) are queued behind the replay, as forward_queued queues
  // them behind an eager forward; its stats() are the replay's. (Without it, stats() reads the
  // buffers at once, waiting for the GPU.)
  PendingForwardStats after_replay() const;

 private:
  friend class Model;
  ForwardStats st_;  // all but the loss (on the GPU also the tokens and aux loss) until stats()
  Tensor weights_;   // the per-token weights, flat [B*T], where the forward had them
  // On the GPU, reads queued behind the forward: the device's index-error record, the target count
  // and the load-balance terms (F64 [1 + n_layers]), the per-token losses and weights.
  std::function<void()> index_check_;
  std::shared_ptr<PendingRead> scalars_, losses_, weights_read_;
  Tensor scalars_dev_;  // F64 [1 + n_layers] on the GPU (the reads' source)
  std::vector<AuxTerm> aux_;  // the MoE layers' terms in layer order
  bool summed_ = false;
};

// Bytes kept between forward and backward, by what keeps them.
struct SavedBytes {
  std::map<std::string, int64_t> by_category;  // residual, attention, router, expert, expert_wgrad, dense, lm_head
  int64_t total() const {
    int64_t t = 0;
    for (const auto& [k, v] : by_category) t += v;
    return t;
  }
};

// A linear layer's weight as the model uses it: its parameter (the embedding for a tied LM
// head), the recipe class it runs in and its layer (n_layers for the LM head).
struct LinearInfo {
  std::string name;  // "layers.3.moe.w1", "layers.0.attn.wq", "layers.1.mlp.w2", "lm_head", ...
  Tensor weight;
  LayerClass cls;
  int64_t layer;
};

// Whether a forward that keeps nothing for a backward and computes no load-balance loss (the
// sampler's prefill and decode, Model::logits) runs its MoE layers on the GPU's routing offsets
// and waits for the router counts once, after the whole forward is queued (true, the default), or
// waits in every MoE layer as training does (the path before it), process-wide: for benchmarks
// that compare the two in one process. Both give the same bits.
void set_moe_routing_waits_deferred(bool on);

// Whether a forward that keeps nothing for a backward (the sampler's prefill and decode,
// Model::logits but as_trainer) runs the GEMMs that read one input as one GEMM on their weights'
// rows stacked (stack_fprop_weights): wq, wk and wv's (where they stack: not NVIDIA's recipe, whose
// per-tensor scales differ) into RoPE and the cache writes straight from the fused rows
// (ops::rope_fused_qkv_to_cache), and every FFN's w1 and w3 (per expert for the routed ones) into
// the SwiGLU of the fused rows (ops::swiglu_forward_fused): one launch each, on wider tiles, where
// a decode step is bound by launches (true, the default); otherwise one GEMM each, as training
// runs them. With it, a MoE layer's shared expert also reads the routed experts' quantized tokens
// (the same spec, rounded to nearest: the same bits) instead of quantizing them again.
// Process-wide, for benchmarks and tests that compare the two in one process. Every output element
// is the same chain of products over K either way: the same bits. Only where the GEMM's order over
// K does not depend on N: not for F32 operands (the fp32 recipe) nor on the GPU where the forward
// GEMMs run on cuBLASLt (set_forward_gemms_grouped(false)).
void set_fused_forward_gemms(bool on);
// In those forwards (set_fused_forward_gemms on), a block-scaled fprop input rounded to nearest is
// quantized by the RMSNorm or SwiGLU that writes it (ops.h "Quantized outputs": one launch instead
// of two, the same bits) where this is on (the default); off, a quantizer of its own after the
// producer, as before. Process-wide, for benchmarks and tests that compare the two in one process.
void set_producer_quantizers(bool on);
// In those forwards (set_fused_forward_gemms on), a MoE layer's shared expert runs as one more
// group of its routed experts' GEMMs and SwiGLU where it has their shape (its hidden d_expert, one
// shared expert) and the recipe quantizes its tokens per row: its tokens gathered after the
// experts' slots, its weights appended after theirs (cached in place of the routed w1 | w3's
// stacked operand, and one more copy of the routed w2 operand), so a layer runs two expert GEMMs and
// one SwiGLU (with its quantizer) fewer (true, the default); off, the shared expert's own GEMMs. The same bits either way: a grouped GEMM's rows do
// not depend on the other groups. Process-wide, for benchmarks and tests.
void set_shared_expert_grouped(bool on);
// In the backward pass, where dgrad's dY and wgrad's dY^T are MXFP8 made in one pass
// (ops::row_col_one_pass): on the GPU, each form is its BF16 decode alone (ops::FormOut::Bf16),
// since both GEMMs that read the pair run right away and nothing reads its codes after them
// (true, the default: on an H100 it took 0.4-1.6 ms off a gpu-small mxfp8 or nvfp4-fwd step,
// bench/results/h100_train_grad_quant_s50.json); off, its codes as well. The same bits either way.
// Process-wide, for benchmarks and tests; returns the setting before.
bool set_dy_decodes_only(bool on);
// On the GPU, the training forward's MXFP8 weight operands (Model::quantize_weights_ahead: every
// weight's fprop and dgrad forms) in one launch for all the weights (true, the default:
// ops::quantize_both_each) or a launch a weight (ops::quantize_both; most weights are too small to
// fill the GPU alone). The same bits either way. Process-wide, for benchmarks and tests; returns
// the setting before.
bool set_weight_forms_batched(bool on);
// In a training step's MoE backward on the GPU, where every expert operand is dense BF16 (the bf16
// recipe) or, with set_moe_pairs_on_device_offsets, an MXFP8 pair made by its producer, and no
// quantizer log is being written, the experts' dgrad and weight-gradient GEMMs read
// the routing's offsets where the GPU made them (ops::grouped_gemm_device_offsets,
// ops::grouped_wgrad_device_offsets: the forward keeps them in the saved plan), with dY, X and a
// read in place and w1's and w3's weight gradients in one launch (on, the default); off, the
// host's offsets and an operand view per expert. Either way the same bits. On, the training
// forward's MoE layers read no counts back either: their load-balance terms and the backward's
// d/dprobs are made on the GPU (ops::load_balance_term, ops::load_balance_dprobs) and the terms come
// back with the loss (PendingForwardStats::stats), so the host queues a bf16 micro-batch's forward
// and backward without waiting for the GPU once, and the trainer records them as a CUDA graph
// (StepGraphs). Eagerly, on an H200, a gpu-small bf16 step ran 0.07-0.09 ms slower with it
// (bench/results/h200_gpu_train_moe_backward_s61.json); the graph it allows took 1.4 ms off a step
// on an H100. Process-wide, for benchmarks and tests; returns the setting before.
bool set_moe_backward_device_offsets(bool on);
// Whether a model on the CPU runs its training MoE layers as the GPU's device-offset path does
// (set_moe_backward_device_offsets), the plan's offsets also an I32 tensor on the CPU that the ops
// read as device offsets (their fallbacks read them back): off by default, as it gains nothing
// there; on, for tests of that path's plumbing where no GPU runs it (CI). The same bits either
// way. Process-wide; returns the setting before.
bool set_moe_device_offsets_on_cpu(bool on);
// Whether the experts' MXFP8 pairs made by their producers (the mxfp8 recipe and nvfp4-fwd's tail
// layers, FFN interiors recomputed) take the device-offset path of set_moe_backward_device_offsets
// too: each pair made on the GPU's offsets (the *_device_offsets preparers, model/linear.h), the
// weight gradients reading the Col forms' decodes in the rows' layout, so that the micro-batch
// reads nothing back and the trainer records it as a CUDA graph (StepGraphs). Off by default: on
// an H100 a gpu-small mxfp8 step took 56.4 ms eagerly and 55.2 replayed with it, against ~51.4
// with the host's offsets in an earlier call (bench/results/h100_gpu_train_mxfp8_device_pairs_graph_s64.json,
// docs/cuda.md). The same bits either way. Process-wide, for benchmarks and tests; returns the
// setting before.
bool set_moe_pairs_on_device_offsets(bool on);
// In training, the ops that produce a GEMM's MXFP8 operands quantize them where they compute them,
// so that on the GPU these F32 tensors are never written nor read back (true): the
// experts' dispatched tokens where they are gathered, when their X and X^T pair
// (ops::gather_quantize_row_col); and, where the FFN interiors are not kept
// (Model::keep_ffn_activations off), an FFN's SwiGLU output a (its routed experts', shared
// expert's or dense FFN's) where swiglu_forward computes it (ops::swiglu_forward_row_col: in the
// forward its Row form as the BF16 decode the GEMM reads, alone; in the backward's recomputation
// with w2's X^T), and its dh1 and dh3 where swiglu_backward computes them, where they pair
// (ops::swiglu_backward_row_col); and the experts' output gradient dy_perm, w2's dY pair, where
// moe_combine_backward computes it (ops::moe_combine_backward_row_col). True, the default: on an
// H100 a gpu-small mxfp8 step took 1.6 ms less than with the dY decodes alone, nvfp4-fwd 1.0 ms
// (bench/results/h100_train_grad_quant_s50.json). Off, the op writes its F32 output and a
// quantizer pass reads it. The same bits either way. Process-wide, for benchmarks and tests;
// returns the setting before.
bool set_training_producer_quantizers(bool on);

// Whether a training forward's running record of its NVFP4 inputs' amax (Model::input_amax, the
// static activation scales of an export) takes the per-row amaxes the inputs' quantizers computed
// anyway (QTensor::row_amax: a max over one float a row) where they have them (true, the default),
// or reads the F32 inputs again (false). The same values either way. Process-wide, for benchmarks
// and tests; returns the setting before.
bool set_input_amax_from_quantizers(bool on);

// One MoE layer's routing in a forward, for analysis (a benchmark counting the experts a decode
// step reads): the layer, the tokens routed, and the route plan's offsets (E + 1 entries: expert e
// took rows offsets[e] .. offsets[e + 1] of the tokens x top_k slots).
struct RoutingEvent {
  int64_t layer;
  int64_t tokens;
  const std::vector<int64_t>& offsets;
};
using RoutingObserver = std::function<void(const RoutingEvent&)>;

class Model {
 public:
  // dtype F32 normally; F64 (with the fp32 recipe, CPU only) for finite-difference checks.
  Model(const ModelConfig& cfg, const Recipe& recipe, Device device, DType dtype = DType::F32);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const Recipe& recipe() const { return recipe_; }
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }
  ParamStore& params() { return params_; }
  // Positions 0 .. T-1 of each of B sequences, I32 [B * T] on the model's device: made once per
  // (B, T) and kept (read only), not rebuilt and uploaded every forward.
  const Tensor& training_positions(int64_t B, int64_t T);

  // tokens, targets: I32 [B, T] on the model's device (targets -1 = no loss). With
  // for_backward the activations are kept and the gradient of loss_weight * (CE + aux) is ready
  // for backward(), which accumulates into params().flat_grad(); CE is the mean over the targets.
  // token_weights (optional F32 [B, T] on the model's device) weight each target's
  // cross-entropy: the gradient is then of loss_weight * (sum_i w_i CE_i / tokens + aux), e.g.
  // the advantages of a policy-gradient step. Without them the results are unchanged bits.
  ForwardStats forward(const Tensor& tokens, const Tensor& targets, const SrStreams& sr,
                       bool for_backward, float loss_weight = 1.0f, const Tensor& token_weights = Tensor());
  // forward() with the loss left on the device until the returned stats() reads it (after the
  // backward is queued, in a training step): the same work and bits.
  PendingForwardStats forward_queued(const Tensor& tokens, const Tensor& targets, const SrStreams& sr,
                                     bool for_backward, float loss_weight = 1.0f,
                                     const Tensor& token_weights = Tensor());
  void backward();

  // Logits F32 [B*T, V] for tokens [B, T] (a full causal forward); no activations kept. as_trainer:
  // by the training forward's own path (its MoE layers wait for the router counts and quantize
  // as training does) rather than the inference one (set_moe_routing_waits_deferred); the same
  // bits, but the sampler's checks compare against the trainer's path itself.
  Tensor logits(const Tensor& tokens, const SrStreams& sr, bool as_trainer = false);

  // The sampler's forward (rl/sampler.h): tokens I32 [B, T] continue the sequences of cache slots
  // 0..B-1 at the positions `batch` gives; their K/V are written into `cache`. The same blocks,
  // cached weights and per-token quantization as forward(), so every row's logits are the bits of
  // logits() on the whole sequence for the batch-invariant recipes (tests/rl/sampler_test.cpp).
  // Returns logits F32 [R, V] of rows logit_rows (indices into the B * T rows; empty: all rows).
  Tensor forward_cached(const Tensor& tokens, const KvBatch& batch, KvCache& cache, const SrStreams& sr,
                        const std::vector<int32_t>& logit_rows = {});
  // The same over a step already bound to its cache (KvStep's fixed-buffer forms: a CUDA graph's
  // capture of a decode step, model/decode_graph.h); logits of every row.
  Tensor forward_cached(const Tensor& tokens, const KvStep& step, const SrStreams& sr);
  // Whether a cached forward on the GPU reads nothing back to the host (its MoE layers run on the
  // routing's GPU offsets: not with FP32 experts, nor after set_moe_routing_waits_deferred(false)),
  // so that a CUDA graph can record it; false on the CPU.
  bool forward_cached_stays_on_device() const;

  // The load-balance loss's coefficient in forward() and backward(): the config's
  // model.aux_loss_coef until set here. A training setting, not architecture: a source that wants
  // another weight for it (RL) sets it without touching the [model] its checkpoints record.
  double aux_loss_coef() const { return aux_loss_coef_; }
  void set_aux_loss_coef(double coef);  // fails unless finite and >= 0

  // Whether forward(for_backward) keeps the FFNs' interiors for backward — h1 and h3 of the routed
  // experts, the shared experts and the dense FFNs, and the routed experts' outputs — instead of
  // backward recomputing them from the kept input (the default). The same bits either way:
  // keeping them skips a third of the FFN GEMMs' work at two FP32 [tokens, d_ff] tensors (three
  // for routed experts, over top_k x tokens) more per FFN in memory.
  bool keep_ffn_activations() const { return keep_ffn_; }
  void set_keep_ffn_activations(bool on) { keep_ffn_ = on; }

  // Where a training forward quantizes a linear's input X on both axes in one pass (its MXFP8 X and
  // X^T: attention's inputs, the dense FFN's, the experts' dispatched tokens), what it keeps for
  // the backward: the BF16 decodes alone of X^T (and of the experts' X, which the backward's
  // recomputation reads), which the weight-gradient GEMMs read as they are (true, the default: on
  // an H100 a gpu-small mxfp8 step took 1.5 ms less, nvfp4-fwd 0.4 ms, at 0.6 and 0.27 GB more of
  // peak memory, bench/results/h100_gpu_train_saved_x_s53.json); or their codes (false), half the
  // bytes held, which the backward decodes before its GEMMs. The same bits either way
  // (train.saved_x_decodes).
  bool saved_x_decodes() const { return saved_x_decodes_; }
  void set_saved_x_decodes(bool on) { saved_x_decodes_ = on; }

  // Quantized weights are cached until the weights change: call after every optimizer step.
  // bf16_copies_current: the optimizer has just written the BF16 copies of the updated weights
  // into bf16_weight_copies() (Optimizer::wrote_bf16_copies) and nothing else changes the weights
  // before the next forward, which then takes them instead of converting the weights again.
  // slice_amax_current: the same for the outer-scale groups' amax in slice_amax_ahead()
  // (Optimizer::wrote_slice_amax), which the NVFP4 weights then take instead of a pass over them.
  void invalidate_weight_cache(bool bf16_copies_current = false, bool slice_amax_current = false) {
    ++weights_version_;
    weight_cache_.clear();
    weight_forms_current_ = false;
    group_amax_cache_.clear();
    fused_cache_.clear();
    bf16_ahead_.clear();
    bf16_copies_current_ = bf16_copies_current && bf16_copies_.defined();
    amax_ahead_current_ = slice_amax_current && amax_ahead_.defined();
  }
  // Fails, naming what was expected, unless tokens and targets are I32 [B, T] and token_weights
  // (where defined) F32 [B, T] on this model's device: forward_queued's checks of its batch.
  void check_training_batch(const Tensor& tokens, const Tensor& targets, const Tensor& token_weights) const;
  // Whether a training micro-batch's forward and backward on this model read nothing back to the
  // host and fix nothing that changes between steps into the work they queue, so that they can be
  // recorded as one CUDA graph and replayed in later steps (StepGraphs): on the GPU, every linear
  // operand in BF16 or MXFP8 rounded to nearest (no SR keys, which change every micro-batch, nor
  // amax records), the MXFP8 weights' forms made in one launch (rewritten in place:
  // weights_for_replay), the routers in F32, every MoE layer's routing and backward on the GPU's
  // offsets (set_moe_backward_device_offsets), and no quantizer log or routing observer, which are
  // called on the host. The bf16 and mxfp8 recipes.
  bool training_step_capturable();
  // Before the replay of a recorded training forward, which reads the weights' operands where the
  // recording found them without the work a forward does after invalidate_weight_cache, unless a
  // forward has since the weights changed: converts the BF16 copies unless the optimizer wrote them
  // with its update (Optimizer::write_bf16_copies), and makes the MXFP8 weights' forms again where
  // the last ones are (quantize_weights_ahead; sr: the micro-batch's streams, which their
  // rounding to nearest does not read).
  void weights_for_replay(const SrStreams& sr);
  // Whether a weight operand stays where it is from one step to the next, rewritten in place
  // (weights_for_replay): a view of the weights or of their BF16 copies, or one of the MXFP8
  // forms made in one launch.
  bool persistent_weight_operand(const Prepared& p) const;
  // Where the recipe has linears with BF16 forward operands over F32 weights (bf16, and the
  // layers other recipes keep in BF16, such as the LM head), the BF16 copies of those weights
  // live packed in one buffer (made on first call), which the forward fills with one conversion
  // after the weights change, or the optimizer in its update (Optimizer::write_bf16_copies);
  // undefined where no linear needs one.
  const Bf16Copies& bf16_weight_copies();
  // Where the recipe quantizes weights to NVFP4 with an outer scale per tensor or per expert
  // (NUMERICS "NVFP4": amax_G over the group, an FFN's w1 and w3 one group), the groups' amax
  // live in one F32 buffer (made on first call) that the optimizer can raise in its update
  // (Optimizer::write_slice_amax), so that the next forward's quantizers skip their pass over the
  // weights; undefined where no weight has such a group.
  const SliceAmaxAhead& slice_amax_ahead();
  // Counts invalidate_weight_cache calls: work recorded against the cached weights (a CUDA graph
  // of a forward, model/decode_graph.h) is stale once it changes.
  uint64_t weights_version() const { return weights_version_; }
  const SavedBytes& saved_bytes() const { return saved_bytes_; }
  QuantLog& quant_log() { return quant_log_; }
  // Called with each MoE layer's routing wherever a forward has the router counts on the host:
  // every forward on the CPU, every training forward, and the GPU's inference forwards with
  // set_moe_routing_waits_deferred(false). A deferred forward reads no counts back and calls
  // nothing, nor does a replayed CUDA graph. Empty (the default): off.
  void set_routing_observer(RoutingObserver observer) { routing_observer_ = std::move(observer); }

  // Every linear layer (attention, routed and shared experts, dense FFN, router, LM head) in
  // layout order, and one of them by name.
  std::vector<LinearInfo> linears() const;
  LinearInfo linear(const std::string& name) const;
  // The fprop weight operand of a linear exactly as forward() prepares it (the cached one once
  // forward has run): what the model computes with, for export and scoring.
  Prepared forward_weight(const std::string& linear_name);
  // The prepared weights forward() has cached since the last invalidate_weight_cache(), by
  // "<linear>/<gemm role>" (tests check forward_weight against them).
  const std::map<std::string, Prepared>& weight_cache() const { return weight_cache_; }
  // The stacked operands of the fused forward GEMMs (set_fused_forward_gemms) made since then, by
  // "<fused name>/fprop" ("layers.3.attn.wqkv", "layers.3.moe.w13"): undefined where the parts
  // did not stack and ran apart.
  const std::map<std::string, Prepared>& fused_weights() const { return fused_cache_; }

  // Running max of |x| over the inputs of each NVFP4-quantized linear seen by training forwards
  // (for_backward), per input: "layers.3.moe.x" (w1 and w3, one value per expert, over the
  // tokens routed to it), "layers.3.moe.a" (w2, per expert), "layers.3.moe.shared.x"/".a",
  // "layers.0.mlp.x"/".a", "layers.0.attn.x" (wq, wk, wv), "layers.0.attn.o" (wo),
  // "lm_head.x" (F32 [1] unless per expert). The calibration-free input_scale of an NVFP4
  // export; checkpoints carry it so a resumed run continues the max.
  const std::map<std::string, Tensor>& input_amax() const { return input_amax_; }
  nlohmann::json input_amax_json() const;  // {"layers.3.moe.x": [amax per expert], ...}
  void load_input_amax(const nlohmann::json& j);  // fails naming a key whose size is wrong
  // The input_amax key of a linear ("layers.3.moe.w3" -> "layers.3.moe.x"); "" for the router.
  static std::string input_amax_key(const std::string& linear_name);

  struct Saved;  // activations kept for backward (model.cpp)

 private:
  friend struct ModelRunner;
  // The weight operand for role under spec, cached until invalidate_weight_cache(); partner: the
  // weight that shares its outer scale (an FFN's w1 and w3).
  // form: what a block-scaled operand made here holds (ops::FormOut; a cached one as it was made).
  Prepared weight(const Tensor& w, const std::string& name, GemmRole role, const QuantSpec& spec,
                  LayerClass cls, const SrStreams& sr, const Tensor* partner,
                  ops::FormOut form = ops::FormOut::Codes);
  // At a forward's start with nothing cached: the BF16 copies of every weight whose forward
  // operand is BF16, made in one ops::convert_each (one launch on the GPU, instead of one per
  // weight as each layer first asks for it); weight() then takes them as prepare's conversion.
  void convert_bf16_weights_ahead();
  // The operand of the fused GEMM `name` ("layers.3.attn.wqkv", "layers.3.moe.w13") stacked from
  // its parts' cached operands (stack_fprop_weights), cached with them until the weights change;
  // undefined (also cached) where they do not stack, and (not cached) where a fused GEMM would not
  // give its parts' bits (set_fused_forward_gemms).
  Prepared fused_weight(const std::string& name, const std::vector<Prepared>& parts, bool shared_outer);
  // The B of a MoE layer's routed experts with its shared expert appended as one more slice
  // (append_weight_slices of the operands `parts` makes on a cache miss; `slices` of K columns in
  // all): `name` ("layers.3.moe.w13+shared", "layers.3.moe.w2+shared") cached with the fused
  // operands; undefined where they do not append or a grouped GEMM of them would not give the
  // parts' bits.
  Prepared appended_weight(const std::string& name, int64_t slices, int64_t K,
                           const std::function<std::vector<Prepared>()>& parts);
  // fused_cache_'s entry `name`, made by `make` on a miss (not while a CUDA graph is captured).
  Prepared cached_fused(const std::string& name, const std::function<Prepared()>& make);
  // Whether this device's forward GEMMs of `slices` groups over K run on the grouped kernel family
  // (or the CPU's GEMM), whose output element is one chain over K whatever N and the other groups:
  // where fused_weight's and appended_weight's operands give their parts' bits.
  bool grouped_forward_gemms(int64_t slices, int64_t K) const;
  void quantize_weights_ahead(const SrStreams& sr);
  struct Bf16Ahead {
    const void* source;  // the weight's storage: a copy is only used for the weight it was made of
    Tensor copy;
  };
  ModelConfig cfg_;
  const Recipe& recipe_;
  Device device_;
  DType dtype_;
  ParamStore params_;
  Tensor rope_;
  Tensor positions_;  // training_positions' for (positions_B_, positions_T_)
  int64_t positions_B_ = 0, positions_T_ = 0;
  std::map<std::string, Prepared> weight_cache_;
  // quantize_weights_ahead's last forms made in one launch, by their cache keys: kept through
  // invalidate_weight_cache and rewritten in place while the keys stay the same.
  std::vector<std::pair<Prepared, Prepared>> weight_forms_;
  std::vector<std::pair<std::string, std::string>> weight_forms_keys_;
  bool weight_forms_current_ = false;  // made since the weights last changed
  // The outer-scale group amax of a weight pair (an FFN's w1 and w3), made for the first of the two
  // and taken by the second, until the weights change.
  std::map<std::string, Tensor> group_amax_cache_;
  std::map<std::string, Prepared> fused_cache_;  // fused_weight's, by "<name>/fprop"
  std::map<std::string, Bf16Ahead> bf16_ahead_;  // by weight_cache_ key, until weight() takes it
  Bf16Copies bf16_copies_;            // bf16_weight_copies()
  bool bf16_copies_made_ = false;
  bool bf16_copies_current_ = false;  // they hold the weights' BF16 rounding (invalidate_weight_cache)
  // slice_amax_ahead()'s entries by weight: its groups' amax (a view of the buffer), the weight
  // whose groups share them (an FFN's w1 for its w3 and back; null: none), and the weight's size.
  struct AmaxAhead {
    Tensor amax;
    const void* partner = nullptr;
    int64_t numel = 0;
  };
  Tensor amax_ahead(const Tensor& w, const QuantSpec& spec, const Tensor* partner) const;
  SliceAmaxAhead amax_ahead_;
  std::map<const void*, AmaxAhead> amax_ahead_at_;
  bool amax_ahead_made_ = false;
  bool amax_ahead_current_ = false;  // the buffer holds the weights' amax (invalidate_weight_cache)
  std::map<std::string, Tensor> input_amax_;
  std::unique_ptr<Saved> saved_;
  SavedBytes saved_bytes_;
  QuantLog quant_log_;
  double aux_loss_coef_;
  bool keep_ffn_ = false;
  bool saved_x_decodes_ = true;
  uint64_t weights_version_ = 0;
  RoutingObserver routing_observer_;
};

// The bytes of every linear's forward weight operand as the model stores it for its GEMMs
// (Model::forward_weight: codes, block and outer scales of a quantized one; the BF16 or F32
// matrix of a dense one), the least a forward that uses them all must read: the routed experts
// apart, per expert, since a decode step reads only those that received a token.
struct ForwardWeightBytes {
  int64_t other = 0;                           // attention, dense and shared FFNs, routers, LM head
  std::map<int64_t, int64_t> expert_by_layer;  // MoE layer -> one routed expert's w1 + w3 + w2
  int64_t experts_total() const;               // one expert of each MoE layer, summed
};
ForwardWeightBytes forward_weight_bytes(Model& model);

}  // namespace fourbit
