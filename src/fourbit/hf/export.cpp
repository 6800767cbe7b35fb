// defines: export_run, hf_tensors (export.h)
// The ModelOpt field names, dtypes and layouts are those ModelOpt's unified HF export writes
// (modelopt/torch/export: quant_utils.py process_layer_quant_config, convert_hf_config.py,
// unified_export_hf.py) and vLLM's ModelOpt loader reads (model_executor/layers/quantization/
// modelopt.py); docs/export.md cites them.
#include "fourbit/hf/export.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fourbit/io/atomic_file.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/numerics/bf16.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"

namespace fourbit::hf {
namespace fs = std::filesystem;

namespace {

constexpr const char* kProducerVersion = "0.1";
constexpr float kNvfp4InputScaleDivisor = 6.0f * 448.0f;  // E2M1 max x E4M3 max, as ModelOpt divides

// The F32 values of one checkpoint tensor: zeros, or factor * the parameter (or one expert of it).
Tensor hf_value(const HfTensor& t, const EffectiveWeights& w) {
  if (t.param.empty()) return Tensor::zeros(t.shape, DType::F32);
  auto it = w.params.find(t.param);
  if (it == w.params.end()) fail("export: no parameter '{}' for tensor '{}'", t.param, t.name);
  const Tensor& p = it->second;
  Tensor v = t.expert < 0 ? p.clone() : p.view(t.expert * shape_numel(t.shape), t.shape).clone();
  if (v.shape() != t.shape)
    fail("export: '{}' is {}, qwen2_moe's '{}' needs {}", t.param, shape_str(v.shape()), t.name, shape_str(t.shape));
  if (t.factor != 1.0f) {
    float* d = v.data<float>();
    for (int64_t i = 0; i < v.numel(); ++i) {
      d[i] *= t.factor;  // a power of two: exact unless it overflows
      if (!std::isfinite(d[i]) && std::isfinite(d[i] / t.factor))
        fail("export: '{}' times {} overflows (value {})", t.param, t.factor, d[i] / t.factor);
    }
  }
  return v;
}

Tensor to_bf16(const Tensor& f32) {
  Tensor b = Tensor::empty(f32.shape(), DType::BF16);
  ops::convert(f32, b);
  return b;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0;
}

void prepare_out_dir(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) fail("--out {}: exists and is not a directory", dir);
    if (!fs::is_empty(dir, ec)) fail("--out {}: directory is not empty (export writes into a new or empty directory)", dir);
  }
  fs::create_directories(dir, ec);
  if (ec) fail("--out {}: cannot create directory: {}", dir, ec.message());
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  io::write_file_atomic(path.string(), j.dump(2) + "\n");
}

std::map<std::string, std::string> safetensors_metadata(const LoadedRun& run, const std::string& format) {
  // transformers requires format "pt"; the rest says where the weights came from.
  return {{"format", "pt"},
          {"fourbit_export", format},
          {"fourbit_recipe", run.state.recipe},
          {"fourbit_step", std::to_string(run.state.step)},
          {"fourbit_checkpoint", run.checkpoint_dir}};
}

// ---- modelopt -----------------------------------------------------------------------------------

struct ModeloptOut {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> dtype_names;  // the F8_E4M3 tensors
  nlohmann::json quantized_layers = nlohmann::json::object();
  std::vector<std::string> excluded;  // linear modules written unquantized
  int64_t nvfp4 = 0, mxfp8 = 0;
};

Tensor f32_scalar(float v) { return Tensor::from_host(&v, {}, DType::F32); }

// The static input scale of an NVFP4 module: the recorded running max of its input over
// training forwards / (6 * 448). An expert that never received a token takes its layer's max.
float input_scale_of(const Model& m, const HfTensor& t) {
  const std::string key = Model::input_amax_key(t.param);
  auto it = m.input_amax().find(key);
  if (it == m.input_amax().end())
    fail("export: no activation statistics for '{}' (input '{}'): the checkpoint recorded none (a run trained before "
         "fourbit recorded input amax, or an imported run not trained since). Train it for a step to record them",
         t.module, key);
  const Tensor h = it->second.to(Device::CPU);
  const float* a = h.data<float>();
  float amax = a[t.expert >= 0 && t.expert < h.numel() ? t.expert : 0];
  if (!(amax > 0))
    for (int64_t i = 0; i < h.numel(); ++i) amax = std::max(amax, a[i]);
  if (!(amax > 0) || !std::isfinite(amax))
    fail("export: the recorded input amax of '{}' is {}: no usable activation statistics for '{}'", key, amax, t.module);
  return amax / kNvfp4InputScaleDivisor;
}

void emit_nvfp4(ModeloptOut& out, const Model& m, const HfTensor& t, const QTensor& q) {
  if (q.cols % 16 != 0)
    fail("export: '{}' has {} input features, not a multiple of 16: NVFP4 checkpoints store whole 1x16 blocks",
         t.module, q.cols);
  float s_dec = 1.0f;  // OuterScale::None: S_enc = S_dec = 1
  // One scale for the module: per tensor, or the one slice of a 2-D weight (the shared expert's).
  if (q.outer == OuterScale::Tensor || (q.outer == OuterScale::PerSlice && q.slices == 1))
    s_dec = q.outer_scales.to(Device::CPU).data<float>()[0];
  else if (q.outer != OuterScale::None)
    fail("export: '{}' has per-row weight scales, which ModelOpt's NVFP4 layout cannot hold", t.module);
  const float s2 = s_dec * t.factor;  // the shared expert's doubling goes into the outer scale: exact
  if (!std::isfinite(s2)) fail("export: weight_scale_2 of '{}' overflows", t.module);
  out.tensors.emplace_back(t.module + ".weight", q.codes.to(Device::CPU).clone());
  out.tensors.emplace_back(t.module + ".weight_scale", q.block_scales.to(Device::CPU).clone());
  out.dtype_names[t.module + ".weight_scale"] = "F8_E4M3";  // UE4M3 bytes are E4M3 bytes with sign 0
  out.tensors.emplace_back(t.module + ".weight_scale_2", f32_scalar(s2));
  out.tensors.emplace_back(t.module + ".input_scale", f32_scalar(input_scale_of(m, t)));
  out.quantized_layers[t.module] = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
  ++out.nvfp4;
}

void emit_mxfp8(ModeloptOut& out, const HfTensor& t, const QTensor& q) {
  if (q.cols % 32 != 0)
    fail("export: '{}' has {} input features, not a multiple of 32: MXFP8 checkpoints store whole 1x32 blocks",
         t.module, q.cols);
  Tensor scales = q.block_scales.to(Device::CPU).clone();
  if (t.factor != 1.0f) {  // x2 is one more in the E8M0 exponent
    if (t.factor != 2.0f) fail("export: '{}': only a factor of 2 fits an E8M0 scale", t.module);
    uint8_t* s = scales.data<uint8_t>();
    for (int64_t i = 0; i < scales.numel(); ++i) {
      if (s[i] >= 254) fail("export: '{}': doubling the E8M0 scale {} leaves the format", t.module, int(s[i]));
      ++s[i];
    }
  }
  out.tensors.emplace_back(t.module + ".weight", q.codes.to(Device::CPU).clone());
  out.dtype_names[t.module + ".weight"] = "F8_E4M3";
  out.tensors.emplace_back(t.module + ".weight_scale", scales);  // U8: E8M0 codes
  out.quantized_layers[t.module] = {{"quant_algo", "MXFP8"}, {"group_size", 32}};
  ++out.mxfp8;
}

nlohmann::json config_groups(const nlohmann::json& quantized_layers) {
  // ModelOpt's convert_hf_quant_config_format: one group per distinct layer config.
  std::map<std::string, std::vector<std::string>> by_algo;
  for (const auto& [module, cfg] : quantized_layers.items()) by_algo[cfg["quant_algo"].get<std::string>()].push_back(module);
  nlohmann::json groups = nlohmann::json::object();
  int i = 0;
  for (const auto& [algo, modules] : by_algo) {
    const bool fp4 = algo == "NVFP4";
    const nlohmann::json side = {{"dynamic", false}, {"num_bits", fp4 ? 4 : 8}, {"type", "float"},
                                 {"group_size", fp4 ? 16 : 32}};
    groups[fmt::format("group_{}", i++)] = {{"input_activations", side}, {"weights", side}, {"targets", modules}};
  }
  return groups;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> hf_tensors(const EffectiveWeights& w, DType dtype, ModelConfig* config) {
  if (dtype != DType::F32 && dtype != DType::BF16) fail("export: dtype must be f32 or bf16");
  ModelConfig cfg = w.config;
  check_qwen2_moe_mappable(cfg);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const HfTensor& t : hf_tensor_map(cfg)) {
    Tensor v = hf_value(t, w);
    out.emplace_back(t.name, dtype == DType::F32 ? v : to_bf16(v));
  }
  if (dtype == DType::BF16 && w.tied_in_run && !cfg.tie_embeddings) {
    // Untied only because the head ran in BF16 over an F32 embedding: in BF16 they may be one.
    const Tensor* embed = nullptr;
    const Tensor* head = nullptr;
    for (const auto& [name, t] : out) {
      if (name == "model.embed_tokens.weight") embed = &t;
      if (name == "lm_head.weight") head = &t;
    }
    if (embed && head && same_bits(*embed, *head)) {
      cfg.tie_embeddings = true;
      std::erase_if(out, [](const auto& kv) { return kv.first == "lm_head.weight"; });
    }
  }
  if (config) *config = cfg;
  return out;
}

ExportSummary export_run(const ExportOptions& o) {
  if (o.format != "hf" && o.format != "modelopt") fail("--format: expected hf or modelopt, got '{}'", o.format);
  if (o.format == "hf" && o.dtype != "bf16" && o.dtype != "f32") fail("--dtype: expected bf16 or f32, got '{}'", o.dtype);
  if (o.format == "modelopt" && o.dtype != "bf16")
    fail("--dtype {}: a modelopt export keeps its unquantized tensors in bf16 (drop --dtype)", o.dtype);
  if (o.out_dir.empty()) fail("export: an output directory is required (--out DIR)");
  LoadedRun run = load_run(o.run_dir, o.step, "", Device::CPU);
  Model& m = *run.model;
  const EffectiveWeights eff = effective_weights(m);
  check_qwen2_moe_mappable(eff.config);

  // Everything is built in memory first, so a refusal leaves no partial directory behind.
  ExportSummary sum;
  sum.checkpoint_dir = run.checkpoint_dir;
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> dtype_names;
  nlohmann::json config, hf_quant_config;
  if (o.format == "hf") {
    const DType dt = o.dtype == "f32" ? DType::F32 : DType::BF16;
    tensors = hf_tensors(eff, dt, &sum.config);
    config = qwen2_moe_config(sum.config, dt == DType::F32 ? "float32" : "bfloat16");
  } else {
    bool any_quantized = false;
    for (const LinearInfo& li : m.linears()) any_quantized = any_quantized || m.forward_weight(li.name).is_quantized();
    if (!any_quantized)
      fail("export: run '{}' (recipe {}) has no NVFP4 or MXFP8 linear layer; a modelopt export needs a quantized "
           "recipe (use --format hf)",
           o.run_dir, run.state.recipe);
    std::map<std::string, Tensor> bf16;
    for (auto& [name, t] : hf_tensors(eff, DType::BF16, &sum.config)) bf16[name] = std::move(t);
    ModeloptOut mo;
    for (const HfTensor& t : hf_tensor_map(sum.config)) {
      if (!t.module.empty() && !t.param.empty()) {
        const Prepared p = m.forward_weight(t.param);
        if (p.is_quantized() && !(p.q.fmt == Format::MXFP8_E4M3 && o.mxfp8_as_bf16)) {
          if (p.q.axis != BlockAxis::Row || p.q.hadamard)
            fail("export: '{}' is not a row-blocked forward weight without RHT", t.param);
          const QTensor q = t.expert >= 0 ? ops::qtensor_slice(p.q, t.expert) : p.q;
          if (q.fmt == Format::NVFP4) emit_nvfp4(mo, m, t, q);
          else if (q.fmt == Format::MXFP8_E4M3) emit_mxfp8(mo, t, q);
          else fail("export: '{}' runs in {}, which has no ModelOpt form", t.param, format_name(q.fmt));
          continue;
        }
        if (p.is_quantized()) {  // MXFP8 as BF16: E4M3 x 2^k has 4 significant bits, BF16 keeps 8
          const Tensor exact = hf_value(t, eff);
          Tensor back = Tensor::empty(exact.shape(), DType::F32);
          ops::convert(bf16.at(t.name), back);
          if (!same_bits(exact, back))
            fail("export: '{}' has MXFP8 values outside BF16's range, so --mxfp8 bf16 would change them", t.module);
        }
      }
      if (!t.module.empty()) mo.excluded.push_back(t.module);
      mo.tensors.emplace_back(t.name, bf16.at(t.name));
    }
    // The LM head is never quantized; say so even when it is tied to the embedding (ModelOpt
    // excludes it the same way).
    if (std::find(mo.excluded.begin(), mo.excluded.end(), "lm_head") == mo.excluded.end()) mo.excluded.push_back("lm_head");
    sum.nvfp4_modules = mo.nvfp4;
    sum.mxfp8_modules = mo.mxfp8;
    tensors = std::move(mo.tensors);
    dtype_names = std::move(mo.dtype_names);
    const nlohmann::json producer = {{"name", "fourbit"}, {"version", kProducerVersion}};
    const nlohmann::json quant = {{"quant_algo", "MIXED_PRECISION"},
                                  {"kv_cache_quant_algo", nullptr},
                                  {"quantized_layers", mo.quantized_layers},
                                  {"exclude_modules", mo.excluded}};
    hf_quant_config = {{"producer", producer}, {"quantization", quant}};
    config = qwen2_moe_config(sum.config, "bfloat16");
    config["quantization_config"] = {{"quant_method", "modelopt"},
                                     {"quant_algo", "MIXED_PRECISION"},
                                     {"producer", producer},
                                     {"config_groups", config_groups(mo.quantized_layers)},
                                     {"quantized_layers", mo.quantized_layers},
                                     {"ignore", mo.excluded}};
  }
  for (const auto& [name, t] : tensors) sum.bytes += t.nbytes();
  sum.tensors = int64_t(tensors.size());

  prepare_out_dir(o.out_dir);
  const fs::path out = o.out_dir;
  io::write_safetensors((out / "model.safetensors").string(), tensors, safetensors_metadata(run, o.format), dtype_names);
  if (!hf_quant_config.is_null()) write_json(out / "hf_quant_config.json", hf_quant_config);
  write_json(out / "config.json", config);
  return sum;
}

}  // namespace fourbit::hf
