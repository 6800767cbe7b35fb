// defines: ParamInfo, ParamStore, LayerWeights, ModelWeights, build_param_layout, init_params
// Parameters live in one flat buffer with named views (llm.c style), so the optimizer, gradient
// clipping, checkpoints and export walk one list. Gradients and the AdamW moments are flat buffers
// of the same layout.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "fourbit/model/config.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit {

struct ParamInfo {
  std::string name;   // e.g. "layers.3.moe.w1" (HF-like; export maps these)
  Shape shape;
  int64_t offset = 0; // elements into the flat buffer
  bool decay = true;  // AdamW weight decay (off for norm gains)
  int64_t numel() const { return shape_numel(shape); }
};

std::vector<ParamInfo> build_param_layout(const ModelConfig& c);

// Views into one flat tensor following a layout.
struct LayerWeights {
  Tensor attn_norm, wq, wk, wv, wo, ffn_norm;
  Tensor router, w1, w3, w2;      // MoE: router [E, D]; w1, w3 [E, F, D]; w2 [E, D, F]
  Tensor sw1, sw3, sw2;           // shared expert [Fs, D], [Fs, D], [D, Fs] (if any)
  Tensor dw1, dw3, dw2;           // dense FFN [Fd, D], [Fd, D], [D, Fd] (first dense_layers)
};
struct ModelWeights {
  Tensor embed;                   // [V, D]
  std::vector<LayerWeights> layers;
  Tensor final_norm;              // [D]
  Tensor lm_head;                 // [V, D]; the embedding itself when tied
};

// BF16 copies of some parameters, packed in parameter order into one buffer: at[i] is where
// parameter i's copy starts (elements), -1 for one without a copy. Undefined buffer: none.
struct Bf16Copies {
  Tensor buffer;
  std::vector<int64_t> at;
  bool defined() const { return buffer.defined(); }
};

// Each slice's amax of some parameters after an optimizer update (ops::SliceAmax), packed into one
// F32 buffer: parameter i raises entries at[i] .. at[i] + numel / slice[i] - 1 (at[i] = -1: none).
// Two parameters may share entries (an FFN's w1 and w3: their joint amax). Undefined buffer: none.
struct SliceAmaxAhead {
  Tensor buffer;
  std::vector<int64_t> at, slice;
  bool defined() const { return buffer.defined(); }
};

class ParamStore {
 public:
  ParamStore(const ModelConfig& c, DType dtype, Device device);
  const std::vector<ParamInfo>& infos() const { return infos_; }
  int64_t numel() const { return numel_; }
  Tensor& flat() { return flat_; }
  const Tensor& flat_const() const { return flat_; }
  Tensor& flat_grad() { return flat_grad_; }
  Tensor view(const Tensor& flat, const ParamInfo& p) const { return flat.view(p.offset, p.shape); }
  const ParamInfo& info(const std::string& name) const;
  // The views of flat() and flat_grad(), made once (every forward and backward asks for them).
  const ModelWeights& weights() const { return cached_views(flat_, weights_); }
  const ModelWeights& grads() const { return cached_views(flat_grad_, grads_); }
  ModelWeights weights_over(const Tensor& flat) const;
  // The index of the parameter whose values `view` (a view of flat()) lies in.
  size_t param_index(const Tensor& view) const;

  // Gradients are zeroed lazily. zero_grad() marks every parameter's gradient stale instead of
  // writing zeros; a backward asks grad_accumulate(g) before its first write to a gradient, and
  // where it answers false (stale) stores the whole parameter's gradient instead of adding to it;
  // a write that can only add calls zero_if_stale(g) first; settle_grads() zeroes the stale
  // gradients no write reached (Model::backward ends with it, and Optimizer::step calls it), so
  // after a backward the gradients read as if zero_grad had written zeros. A GPU step saves
  // the memset of every gradient and the read of every zero it would have added to. On the CPU
  // zero_grad fills the gradients with NaN, so a write that adds to a stale gradient without
  // asking shows in every test that trains or checks a gradient there.
  void zero_grad();
  bool grad_accumulate(const Tensor& grad);  // grad: a view of flat_grad() within one parameter
  void zero_if_stale(const Tensor& grad);
  void settle_grads();
  // Every gradient as a backward leaves it (none stale): after the replay of a recorded backward
  // (StepGraphs), whose writes the host did not see, the way Model::backward's settle_grads leaves
  // the flags.
  void mark_grads_written();

 private:
  size_t param_of(const Tensor& grad) const;  // the parameter whose gradient grad lies in
  struct CachedViews {
    const void* base = nullptr;  // the flat buffer they view
    ModelWeights w;
  };
  const ModelWeights& cached_views(const Tensor& flat, CachedViews& c) const;
  ModelConfig cfg_;
  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, size_t> index_;  // name -> infos_ position
  int64_t numel_ = 0;
  Tensor flat_, flat_grad_;
  std::vector<uint8_t> stale_;  // per parameter, infos_ order
  mutable CachedViews weights_, grads_;
};

// Normal(0, init_std) weights from Philox counters keyed by (seed, parameter index), so the
// initial model is the same on every machine and thread count. Output projections (wo, w2) are
// scaled by 1/sqrt(2 n_layers); norm gains start at 1.
void init_params(ParamStore& p, const ModelConfig& c, uint64_t seed);

}  // namespace fourbit
