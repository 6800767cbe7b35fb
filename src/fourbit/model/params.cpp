// defines: build_param_layout, ParamStore, init_params
#include "fourbit/model/params.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "fourbit/numerics/philox.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

std::vector<ParamInfo> build_param_layout(const ModelConfig& c) {
  std::vector<ParamInfo> out;
  int64_t offset = 0;
  auto add = [&](const std::string& name, Shape shape, bool decay = true) {
    ParamInfo p{name, std::move(shape), offset, decay};
    offset += p.numel();
    out.push_back(std::move(p));
  };
  const int64_t D = c.d_model, V = c.vocab_size, hd = c.hd();
  add("embed", {V, D});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm", {D}, false);
    add(p + "attn.wq", {c.n_heads * hd, D});
    add(p + "attn.wk", {c.n_kv_heads * hd, D});
    add(p + "attn.wv", {c.n_kv_heads * hd, D});
    add(p + "attn.wo", {D, c.n_heads * hd});
    add(p + "ffn_norm", {D}, false);
    if (c.is_moe_layer(l)) {
      const int64_t E = c.n_experts, F = c.d_expert;
      add(p + "moe.router", {E, D});
      add(p + "moe.w1", {E, F, D});
      add(p + "moe.w3", {E, F, D});
      add(p + "moe.w2", {E, D, F});
      if (c.n_shared_experts) {
        const int64_t Fs = c.shared_hidden();
        add(p + "moe.shared.w1", {Fs, D});
        add(p + "moe.shared.w3", {Fs, D});
        add(p + "moe.shared.w2", {D, Fs});
      }
    } else {
      const int64_t Fd = c.dense_hidden();
      add(p + "mlp.w1", {Fd, D});
      add(p + "mlp.w3", {Fd, D});
      add(p + "mlp.w2", {D, Fd});
    }
  }
  add("final_norm", {D}, false);
  if (!c.tie_embeddings) add("lm_head", {V, D});
  return out;
}

ParamStore::ParamStore(const ModelConfig& c, DType dtype, Device device)
    : cfg_(c), infos_(build_param_layout(c)) {
  for (size_t i = 0; i < infos_.size(); ++i) {
    numel_ += infos_[i].numel();
    index_.emplace(infos_[i].name, i);
  }
  flat_ = Tensor::zeros({numel_}, dtype, device);
  flat_grad_ = Tensor::zeros({numel_}, dtype, device);
  stale_.assign(infos_.size(), 0);
}

void ParamStore::zero_grad() {
  std::fill(stale_.begin(), stale_.end(), uint8_t(1));
  if (flat_grad_.device() != Device::CPU) return;
  if (flat_grad_.dtype() == DType::F64) std::fill_n(flat_grad_.data<double>(), numel_, std::nan(""));
  else if (flat_grad_.dtype() == DType::F32) std::fill_n(flat_grad_.data<float>(), numel_, std::nanf(""));
  else flat_grad_.zero_();
}

size_t ParamStore::param_of(const Tensor& grad) const {
  const int64_t esize = dtype_size(flat_grad_.dtype());
  const auto* base = static_cast<const char*>(flat_grad_.raw());
  const auto* at = static_cast<const char*>(grad.raw());
  const int64_t begin = (at - base) / esize;
  if (grad.dtype() != flat_grad_.dtype() || grad.device() != flat_grad_.device() || at < base ||
      (at - base) % esize != 0 || begin >= numel_)
    fail("ParamStore: {} is not a view of the gradients {}", grad.str(), flat_grad_.str());
  // the last parameter starting at or before begin
  const auto it = std::upper_bound(infos_.begin(), infos_.end(), begin,
                                   [](int64_t v, const ParamInfo& p) { return v < p.offset; });
  const size_t i = size_t(it - infos_.begin()) - 1;
  if (begin + grad.numel() > infos_[i].offset + infos_[i].numel())
    fail("ParamStore: {} runs past the gradient of {}", grad.str(), infos_[i].name);
  return i;
}

bool ParamStore::grad_accumulate(const Tensor& grad) {
  const size_t i = param_of(grad);
  if (!stale_[i]) return true;
  stale_[i] = 0;
  return false;
}

void ParamStore::zero_if_stale(const Tensor& grad) {
  const size_t i = param_of(grad);
  if (!stale_[i]) return;
  flat_grad_.view(infos_[i].offset, {infos_[i].numel()}).zero_();
  stale_[i] = 0;
}

void ParamStore::settle_grads() {
  // runs of neighbouring stale parameters in one zeroing each
  for (size_t i = 0; i < infos_.size();) {
    if (!stale_[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < infos_.size() && stale_[j]) stale_[j++] = 0;
    const int64_t at = infos_[i].offset, n = infos_[j - 1].offset + infos_[j - 1].numel() - at;
    flat_grad_.view(at, {n}).zero_();
    i = j;
  }
}

void ParamStore::mark_grads_written() { std::fill(stale_.begin(), stale_.end(), uint8_t(0)); }

size_t ParamStore::param_index(const Tensor& view) const {
  const auto* base = static_cast<const char*>(flat_.raw());
  const auto* p = static_cast<const char*>(view.raw());
  const int64_t at = (p - base) / int64_t(dtype_size(flat_.dtype()));
  for (size_t i = 0; i < infos_.size(); ++i)
    if (at >= infos_[i].offset && at + view.numel() <= infos_[i].offset + infos_[i].numel()) return i;
  fail("ParamStore: {} is not within one parameter", view.str());
}

const ParamInfo& ParamStore::info(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) fail("no parameter named '{}'", name);
  return infos_[it->second];
}

const ModelWeights& ParamStore::cached_views(const Tensor& flat, CachedViews& c) const {
  if (c.base != flat.raw()) {
    c.w = weights_over(flat);
    c.base = flat.raw();
  }
  return c.w;
}

ModelWeights ParamStore::weights_over(const Tensor& flat) const {
  ModelWeights w;
  auto get = [&](const std::string& n) { return view(flat, info(n)); };
  w.embed = get("embed");
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.attn_norm = get(p + "attn_norm");
    lw.wq = get(p + "attn.wq");
    lw.wk = get(p + "attn.wk");
    lw.wv = get(p + "attn.wv");
    lw.wo = get(p + "attn.wo");
    lw.ffn_norm = get(p + "ffn_norm");
    if (cfg_.is_moe_layer(l)) {
      lw.router = get(p + "moe.router");
      lw.w1 = get(p + "moe.w1");
      lw.w3 = get(p + "moe.w3");
      lw.w2 = get(p + "moe.w2");
      if (cfg_.n_shared_experts) {
        lw.sw1 = get(p + "moe.shared.w1");
        lw.sw3 = get(p + "moe.shared.w3");
        lw.sw2 = get(p + "moe.shared.w2");
      }
    } else {
      lw.dw1 = get(p + "mlp.w1");
      lw.dw3 = get(p + "mlp.w3");
      lw.dw2 = get(p + "mlp.w2");
    }
    w.layers.push_back(lw);
  }
  w.final_norm = get("final_norm");
  w.lm_head = cfg_.tie_embeddings ? w.embed : get("lm_head");
  return w;
}

void init_params(ParamStore& store, const ModelConfig& c, uint64_t seed) {
  std::vector<double> host(size_t(store.numel()));
  const double out_scale = 1.0 / std::sqrt(2.0 * double(c.n_layers));
  for (size_t pi = 0; pi < store.infos().size(); ++pi) {
    const ParamInfo& p = store.infos()[pi];
    const bool is_norm = !p.decay;
    const bool is_out = p.name.ends_with(".wo") || p.name.ends_with(".w2");
    const double std = c.init_std * (is_out ? out_scale : 1.0);
    // Each element is a function of its counter alone, so threads cannot change the values.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < p.numel(); ++i) {
      double v = 1.0;
      if (!is_norm) {
        // Box-Muller on two 32-bit uniforms from the counter (seed, parameter, element).
        const num::Philox4x32 r = num::random_bits4(seed, 0x1A17000 + pi, uint64_t(i));
        const double u1 = (double(r.v[0]) + 1.0) / 4294967296.0;
        const double u2 = double(r.v[1]) / 4294967296.0;
        v = std * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
      }
      host[size_t(p.offset + i)] = v;
    }
  }
  Tensor& flat = store.flat();
  if (flat.dtype() == DType::F64) {
    flat.copy_from(Tensor::from_host(host.data(), {store.numel()}, DType::F64));
  } else {
    std::vector<float> f(host.begin(), host.end());
    flat.copy_from(Tensor::from_host(f.data(), {store.numel()}, DType::F32));
  }
}

}  // namespace fourbit
