// defines: read_qwen2_moe, import_hf, config_toml (import.h)
#include "fourbit/hf/import.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include <fmt/format.h>

#include "fourbit/hf/qwen2_moe.h"
#include "fourbit/io/atomic_file.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/model/params.h"
#include "fourbit/model/recipe.h"
#include "fourbit/numerics/bf16.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/checkpoint.h"
#include "fourbit/train/run_dir.h"

namespace fourbit::hf {
namespace fs = std::filesystem;

namespace {

nlohmann::json read_json(const fs::path& path) {
  const std::vector<uint8_t> bytes = io::read_file_bytes(path.string());
  try {
    return nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", path.string(), e.what());
  }
}

// IEEE half -> float (exact).
float half_to_float(uint16_t h) {
  const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(float(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(float(man | 0x400), exp - 25);
  return (h & 0x8000) ? -v : v;
}

struct RawTensor {
  Tensor f32;        // converted, CPU
  std::string file;  // where it came from, for messages
};

// Every tensor of the checkpoint as F32, by name. Sharded checkpoints: the index's weight_map
// names each tensor's file; every file it names is read, and a tensor must be where it says.
std::map<std::string, RawTensor> read_tensors(const fs::path& dir) {
  std::vector<std::string> files;
  std::map<std::string, std::string> expected_file;  // from the index
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const nlohmann::json j = read_json(index);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail("{}: expected an object with a 'weight_map' object (tensor name -> file)", index.string());
    std::set<std::string> seen;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) fail("{}: weight_map['{}'] must be a file name, got {}", index.string(), name, file.dump());
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f == ".." || f.empty())
        fail("{}: weight_map['{}'] = '{}' is not a file in this directory", index.string(), name, f);
      expected_file[name] = f;
      if (seen.insert(f).second) files.push_back(f);
    }
    if (files.empty()) fail("{}: weight_map is empty", index.string());
  } else if (fs::exists(dir / "model.safetensors")) {
    files.push_back("model.safetensors");
  } else {
    fail("{}: no model.safetensors or model.safetensors.index.json (a Hugging Face checkpoint directory has one)",
         dir.string());
  }
  std::map<std::string, RawTensor> out;
  for (const std::string& f : files) {
    const std::string path = (dir / f).string();
    io::SafetensorsFile st = io::read_safetensors(path);
    for (auto& [name, t] : st.tensors) {
      if (out.count(name)) fail("{}: tensor '{}' is also in {}", path, name, out[name].file);
      if (!expected_file.empty()) {
        auto it = expected_file.find(name);
        if (it == expected_file.end() || it->second != f)
          fail("{}: holds tensor '{}', which model.safetensors.index.json {}", path, name,
               it == expected_file.end() ? "does not list" : "places in " + it->second);
      }
      const std::string& dt = st.dtype_names.at(name);
      Tensor f32 = Tensor::empty(t.shape(), DType::F32);
      float* d = f32.data<float>();
      if (dt == "F32") std::memcpy(d, t.raw(), size_t(t.nbytes()));
      else if (dt == "BF16")
        for (int64_t i = 0; i < t.numel(); ++i) d[i] = num::bf16_decode(t.data<uint16_t>()[i]);
      else if (dt == "F16")
        for (int64_t i = 0; i < t.numel(); ++i) d[i] = half_to_float(t.data<uint16_t>()[i]);
      else
        fail("{}: tensor '{}' is {}; fourbit imports BF16, F16 or F32 checkpoints (a quantized checkpoint cannot "
             "be imported)",
             path, name, dt);
      for (int64_t i = 0; i < f32.numel(); ++i)
        if (!std::isfinite(d[i])) fail("{}: tensor '{}' holds a non-finite value ({}) at element {}", path, name, d[i], i);
      out[name] = RawTensor{std::move(f32), path};
    }
  }
  for (const auto& [name, f] : expected_file)
    if (!out.count(name))
      fail("{}: model.safetensors.index.json places tensor '{}' in {}, which does not hold it", dir.string(), name, f);
  return out;
}

bool all_zero(const Tensor& t) {
  const float* d = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (d[i] != 0.0f) return false;
  return true;
}

// transformers 5 stores a layer's experts fused: experts.gate_up_proj [E, 2F, D] (gate rows
// first) and experts.down_proj [E, D, F]. Split them into the per-expert tensors.
void split_fused_experts(std::map<std::string, RawTensor>& ts, const ModelConfig& c) {
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string m = fmt::format("model.layers.{}.mlp.experts.", l);
    auto gu = ts.find(m + "gate_up_proj"), dn = ts.find(m + "down_proj");
    if (gu == ts.end() && dn == ts.end()) continue;
    if (gu == ts.end() || dn == ts.end())
      fail("{}: has {} but not {}", (gu == ts.end() ? dn : gu)->second.file, (gu == ts.end() ? dn : gu)->first,
           gu == ts.end() ? m + "gate_up_proj" : m + "down_proj");
    const int64_t E = c.n_experts, F = c.d_expert, D = c.d_model;
    if (gu->second.f32.shape() != Shape{E, 2 * F, D})
      fail("{}: tensor '{}' has shape {}, config.json implies {}", gu->second.file, gu->first,
           shape_str(gu->second.f32.shape()), shape_str({E, 2 * F, D}));
    if (dn->second.f32.shape() != Shape{E, D, F})
      fail("{}: tensor '{}' has shape {}, config.json implies {}", dn->second.file, dn->first,
           shape_str(dn->second.f32.shape()), shape_str({E, D, F}));
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = fmt::format("{}{}.", m, e);
      for (const char* n : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"})
        if (ts.count(x + n)) fail("{}: has both fused experts and '{}'", gu->second.file, x + n);
      ts[x + "gate_proj.weight"] = {gu->second.f32.view(e * 2 * F * D, {F, D}).clone(), gu->second.file};
      ts[x + "up_proj.weight"] = {gu->second.f32.view(e * 2 * F * D + F * D, {F, D}).clone(), gu->second.file};
      ts[x + "down_proj.weight"] = {dn->second.f32.view(e * D * F, {D, F}).clone(), dn->second.file};
    }
    ts.erase(m + "gate_up_proj");
    ts.erase(m + "down_proj");
  }
}

bool is_shared_expert_tensor(const std::string& name) { return name.find(".mlp.shared_expert.") != std::string::npos; }

}  // namespace

HfCheckpoint read_qwen2_moe(const std::string& dir_str) {
  const fs::path dir = dir_str;
  if (!fs::is_directory(dir)) fail("{}: not a directory (--hf takes a Hugging Face checkpoint directory)", dir_str);
  HfCheckpoint ck;
  const fs::path cfg_path = dir / "config.json";
  ck.hf_config = read_json(cfg_path);
  ModelConfig c = model_config_from_qwen2_moe(ck.hf_config, cfg_path.string());
  const bool qkv_bias = ck.hf_config.value("qkv_bias", true);

  std::map<std::string, RawTensor> ts = read_tensors(dir);
  split_fused_experts(ts, c);
  std::set<std::string> used;
  auto get = [&](const HfTensor& t) -> const Tensor* {
    auto it = ts.find(t.name);
    if (it == ts.end()) return nullptr;
    used.insert(t.name);
    if (it->second.f32.shape() != t.shape)
      fail("{}: tensor '{}' has shape {}, config.json implies {}", it->second.file, t.name,
           shape_str(it->second.f32.shape()), shape_str(t.shape));
    return &it->second.f32;
  };

  // The shared expert: kept (its gate must be zero: sigmoid(0) = 1/2, folded into down_proj),
  // or dropped when it is all zeros in every layer (it then adds exactly zero).
  const std::vector<HfTensor> map = hf_tensor_map(c);
  bool shared_zero = true;
  for (const HfTensor& t : map)
    if (is_shared_expert_tensor(t.name)) {
      const Tensor* v = get(t);
      if (!v) fail("{}: missing tensor '{}'", dir_str, t.name);
      shared_zero = shared_zero && all_zero(*v);
    }
  if (shared_zero) {
    c.n_shared_experts = 0;
    c.d_shared = 0;
    ck.notes.push_back("the shared expert is all zeros in every layer: imported without one");
  }

  ParamStore store(c, DType::F32, Device::CPU);
  Tensor& flat = store.flat();
  for (const HfTensor& t : map) {
    if (shared_zero && (is_shared_expert_tensor(t.name) || t.name.ends_with(".mlp.shared_expert_gate.weight"))) {
      get(t);  // checked for shape, values irrelevant: the expert adds zero
      continue;
    }
    const Tensor* v = get(t);
    if (t.param.empty()) {
      const bool bias = t.name.ends_with(".bias");
      if (!v) {
        if (bias && !qkv_bias) continue;  // qkv_bias: false checkpoints have none
        fail("{}: missing tensor '{}'", dir_str, t.name);
      }
      if (!all_zero(*v)) {
        if (bias)
          fail("{}: tensor '{}' is not zero: non-zero q/k/v biases are not supported (fourbit's attention has no "
               "biases)",
               ts.at(t.name).file, t.name);
        fail("{}: tensor '{}' is not zero: a non-constant shared-expert gate is not supported (fourbit's shared "
             "expert is always on; a zero gate, sigmoid(0) = 1/2, is folded into its down projection)",
             ts.at(t.name).file, t.name);
      }
      continue;
    }
    if (!v) fail("{}: missing tensor '{}'", dir_str, t.name);
    const ParamInfo& info = store.info(t.param);
    Tensor dst = t.expert < 0 ? store.view(flat, info) : flat.view(info.offset + t.expert * shape_numel(t.shape), t.shape);
    dst.copy_from(*v);
    if (t.factor != 1.0f) {  // the shared down projection: hf = 2 * ours
      float* d = dst.data<float>();
      for (int64_t i = 0; i < dst.numel(); ++i) {
        const float h = d[i] / t.factor;
        if (h * t.factor != d[i])
          fail("{}: tensor '{}' value {} cannot be halved exactly (below float's range)", ts.at(t.name).file, t.name, d[i]);
        d[i] = h;
      }
    }
  }
  for (const auto& [name, raw] : ts) {
    if (used.count(name)) continue;
    if (name.ends_with(".rotary_emb.inv_freq")) continue;  // a buffer older transformers saved; derived from rope_theta
    if (name == "lm_head.weight" && c.tie_embeddings) {
      const Tensor& e = ts.at("model.embed_tokens.weight").f32;
      if (raw.f32.shape() == e.shape() && std::memcmp(raw.f32.raw(), e.raw(), size_t(e.nbytes())) == 0) continue;
      fail("{}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight", raw.file);
    }
    fail("{}: unexpected tensor '{}': fourbit's qwen2_moe mapping has no place for it", raw.file, name);
  }
  ck.config = c;
  for (const ParamInfo& p : store.infos()) ck.params[p.name] = store.view(flat, p);  // views keep the buffer
  return ck;
}

std::string config_toml(const RunConfig& c) {
  const nlohmann::json j = config_to_json(c);
  std::string out;
  for (const char* sec : {"model", "train", "data"}) {
    out += fmt::format("[{}]\n", sec);
    for (const auto& [k, v] : j.at(sec).items()) {
      if (v.is_boolean()) out += fmt::format("{} = {}\n", k, v.get<bool>() ? "true" : "false");
      else if (v.is_string()) out += fmt::format("{} = {}\n", k, v.dump());
      else if (v.is_number_float()) out += fmt::format("{} = {}\n", k, v.get<double>());  // shortest round trip
      else out += fmt::format("{} = {}\n", k, v.dump());
    }
    out += "\n";
  }
  return out;
}

ImportSummary import_hf(const ImportOptions& o) {
  if (o.out_dir.empty()) fail("import: a run directory is required (--out RUN)");
  recipe_by_name(o.recipe);  // an unknown recipe fails before any work
  if (fs::exists(fs::path(o.out_dir) / "checkpoints"))
    fail("--out {}: already holds a run (checkpoints/); import into a new directory", o.out_dir);
  HfCheckpoint ck = read_qwen2_moe(o.hf_dir);

  RunConfig rc;
  rc.model = ck.config;
  rc.train.seed = o.seed;
  rc.train.seq_len = std::min(rc.train.seq_len, rc.model.max_seq_len);
  rc.path = (fs::path(o.out_dir) / "config.toml").string();
  validate_config(rc);

  ParamStore store(rc.model, DType::F32, Device::CPU);
  Tensor& flat = store.flat();
  for (const ParamInfo& p : store.infos()) {
    Tensor dst = store.view(flat, p);
    dst.copy_from(ck.params.at(p.name));
  }
  const Tensor zeros = Tensor::zeros({store.numel()}, DType::F32);
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) fail("--out {}: cannot create directory: {}", o.out_dir, ec.message());
  const std::string source = fs::absolute(o.hf_dir).lexically_normal().string();
  CheckpointState st;
  st.config = rc;
  st.recipe = o.recipe;
  st.seed = o.seed;
  st.extra = {{"imported_from", source}, {"hf_config", ck.hf_config}};
  ImportSummary sum;
  sum.checkpoint_dir = save_checkpoint(o.out_dir, store, zeros, zeros, st);
  // The run record as the training loop writes it: a pretraining run at step 0 that
  // `pretrain --resume RUN` continues (on any data: it has no source record yet) and `--init RUN`
  // starts from; the config again as TOML, to edit into a new run's config.
  io::write_file_atomic(rc.path, config_toml(rc));
  const nlohmann::json run = {{"format", "fourbit-run-1"}, {"command", "pretrain"},
                              {"config", config_to_json(rc)}, {"recipe", o.recipe},
                              {"config_path", rc.path}, {"device", "cpu"},
                              {"created", utc_time()}, {"imported_from", source},
                              {"source", nullptr}, {"resumes", nlohmann::json::array()}};
  write_run_record(o.out_dir, run);
  sum.config = rc.model;
  sum.params = store.numel();
  sum.notes = ck.notes;
  return sum;
}

}  // namespace fourbit::hf
