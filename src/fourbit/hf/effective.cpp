// defines: checkpoint_dir_for, load_run, prepared_to_f32, effective_weights, model_from_weights
// (effective.h)
#include "fourbit/hf/effective.h"

#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"

namespace fourbit::hf {
namespace fs = std::filesystem;

std::string checkpoint_dir_for(const std::string& run_dir, std::optional<int64_t> step) {
  if (!step) return latest_checkpoint(run_dir);
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const fs::path dir = root / fmt::format("step-{:06d}", *step);
  if (fs::is_directory(dir)) return dir.string();
  std::string have;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0)
      have += (have.empty() ? "" : ", ") + e.path().filename().string();
  fail("{}: no checkpoint for step {} (checkpoints: {})", run_dir, *step, have.empty() ? "none" : have);
}

LoadedRun load_run(const std::string& run_dir, std::optional<int64_t> step, const std::string& recipe,
                   Device device) {
  LoadedRun r;
  r.checkpoint_dir = checkpoint_dir_for(run_dir, step);
  r.state = read_checkpoint_state(r.checkpoint_dir);
  r.model = std::make_unique<Model>(r.state.config.model, recipe_by_name(recipe.empty() ? r.state.recipe : recipe),
                                    device);
  load_checkpoint(r.checkpoint_dir, r.model->params(), nullptr, nullptr);
  if (r.state.extra.contains("input_amax")) r.model->load_input_amax(r.state.extra["input_amax"]);
  return r;
}

Tensor prepared_to_f32(const Prepared& p) {
  if (p.is_quantized()) {
    if (p.q.axis != BlockAxis::Row) fail("prepared_to_f32: a forward weight must be blocked along its rows");
    return ops::dequantize(p.q, true).to(Device::CPU);
  }
  if (p.trans) fail("prepared_to_f32: a forward weight is never stored transposed");
  if (p.dense.dtype() == DType::F32) return p.dense.to(Device::CPU);
  Tensor f = Tensor::empty(p.dense.shape(), DType::F32, p.dense.device());
  ops::convert(p.dense, f);  // BF16 -> F32: exact
  return f.to(Device::CPU);
}

namespace {
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0;
}
}  // namespace

EffectiveWeights effective_weights(Model& m) {
  if (m.dtype() != DType::F32) fail("effective_weights: the model must be f32, got {}", dtype_name(m.dtype()));
  EffectiveWeights w;
  w.config = m.config();
  w.tied_in_run = m.config().tie_embeddings;
  const Tensor flat = m.params().flat().to(Device::CPU);
  for (const ParamInfo& p : m.params().infos()) w.params[p.name] = m.params().view(flat, p).clone();
  for (const LinearInfo& li : m.linears()) {
    Tensor eff = prepared_to_f32(m.forward_weight(li.name));
    if (li.name == "lm_head" && w.tied_in_run) {
      if (same_bits(eff, w.params.at("embed"))) continue;  // the head multiplies by the embedding itself
      w.config.tie_embeddings = false;                      // e.g. a BF16 head over an F32 embedding
    }
    w.params[li.name] = std::move(eff);
  }
  return w;
}

std::unique_ptr<Model> model_from_weights(const EffectiveWeights& w, const std::string& recipe, Device device) {
  auto m = std::make_unique<Model>(w.config, recipe_by_name(recipe), device);
  Tensor host = Tensor::empty({m->params().numel()}, DType::F32, Device::CPU);
  for (const ParamInfo& p : m->params().infos()) {
    auto it = w.params.find(p.name);
    if (it == w.params.end()) fail("model_from_weights: no tensor for parameter '{}'", p.name);
    if (it->second.shape() != p.shape)
      fail("model_from_weights: '{}' is {}, the model expects {}", p.name, shape_str(it->second.shape()),
           shape_str(p.shape));
    Tensor dst = m->params().view(host, p);
    dst.copy_from(it->second);
  }
  m->params().flat().copy_from(host);
  return m;
}

}  // namespace fourbit::hf
