// defines: load_config, parse_config, config_to_json, config_from_json, validate_config
#include "fourbit/model/config.h"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <vector>

#include <toml++/toml.h>

#include "fourbit/tensor/error.h"

namespace fourbit {
namespace {

// One table of fields per section: name -> how to read it from TOML / JSON and write it back.
struct Field {
  std::function<void(const toml::node&, const std::string& where)> from_toml;
  std::function<void(const nlohmann::json&)> from_json;
  std::function<nlohmann::json()> to_json;
};
using Section = std::map<std::string, Field>;

template <typename T>
Field field(T& ref) {
  Field f;
  f.from_toml = [&ref](const toml::node& n, const std::string& where) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!n.is_boolean()) fail("{}: expected true or false", where);
      ref = n.as_boolean()->get();
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!n.is_string()) fail("{}: expected a string", where);
      ref = n.as_string()->get();
    } else if constexpr (std::is_floating_point_v<T>) {
      if (n.is_integer()) ref = T(n.as_integer()->get());
      else if (n.is_floating_point()) ref = T(n.as_floating_point()->get());
      else fail("{}: expected a number", where);
    } else {
      if (!n.is_integer()) fail("{}: expected an integer", where);
      const int64_t v = n.as_integer()->get();
      if constexpr (std::is_unsigned_v<T>) {
        if (v < 0) fail("{}: expected a non-negative integer, got {}", where, v);
      }
      ref = T(v);
    }
  };
  f.from_json = [&ref](const nlohmann::json& j) { ref = j.get<T>(); };
  f.to_json = [&ref]() { return nlohmann::json(ref); };
  return f;
}

std::map<std::string, Section> sections(RunConfig& c) {
  ModelConfig& m = c.model;
  TrainConfig& t = c.train;
  DataConfig& d = c.data;
  DistConfig& ds = c.dist;
  return {
      {"model",
       {{"vocab_size", field(m.vocab_size)}, {"d_model", field(m.d_model)},
        {"n_layers", field(m.n_layers)}, {"n_heads", field(m.n_heads)},
        {"n_kv_heads", field(m.n_kv_heads)}, {"head_dim", field(m.head_dim)},
        {"max_seq_len", field(m.max_seq_len)}, {"n_experts", field(m.n_experts)},
        {"top_k", field(m.top_k)}, {"d_expert", field(m.d_expert)},
        {"n_shared_experts", field(m.n_shared_experts)}, {"d_shared", field(m.d_shared)},
        {"dense_layers", field(m.dense_layers)}, {"d_dense", field(m.d_dense)},
        {"rope_theta", field(m.rope_theta)}, {"norm_eps", field(m.norm_eps)},
        {"tie_embeddings", field(m.tie_embeddings)}, {"aux_loss_coef", field(m.aux_loss_coef)},
        {"init_std", field(m.init_std)}}},
      {"train",
       {{"batch_size", field(t.batch_size)}, {"seq_len", field(t.seq_len)},
        {"grad_accum", field(t.grad_accum)}, {"steps", field(t.steps)}, {"lr", field(t.lr)},
        {"min_lr_ratio", field(t.min_lr_ratio)}, {"warmup_steps", field(t.warmup_steps)},
        {"weight_decay", field(t.weight_decay)}, {"beta1", field(t.beta1)},
        {"beta2", field(t.beta2)}, {"adam_eps", field(t.adam_eps)},
        {"grad_clip", field(t.grad_clip)}, {"eval_every", field(t.eval_every)},
        {"eval_batches", field(t.eval_batches)}, {"checkpoint_every", field(t.checkpoint_every)},
        {"log_every", field(t.log_every)}, {"seed", field(t.seed)}}},
      {"data",
       {{"source", field(d.source)}, {"arithmetic_fraction", field(d.arithmetic_fraction)},
        {"eval_fraction", field(d.eval_fraction)}}},
      {"dist", {{"ep", field(ds.ep)}, {"dp", field(ds.dp)}}},
  };
}

std::string known_fields(const Section& s) {
  std::string out;
  for (const auto& [name, f] : s) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

void validate_config(const RunConfig& c) {
  const ModelConfig& m = c.model;
  const TrainConfig& t = c.train;
  const std::string& p = c.path;
  auto positive = [&](const char* name, int64_t v) {
    if (v <= 0) fail("{}: {} must be positive, got {}", p, name, v);
  };
  positive("model.vocab_size", m.vocab_size);
  positive("model.d_model", m.d_model);
  positive("model.n_layers", m.n_layers);
  positive("model.n_heads", m.n_heads);
  positive("model.n_kv_heads", m.n_kv_heads);
  positive("model.max_seq_len", m.max_seq_len);
  positive("model.n_experts", m.n_experts);
  positive("model.top_k", m.top_k);
  positive("model.d_expert", m.d_expert);
  positive("train.batch_size", t.batch_size);
  positive("train.seq_len", t.seq_len);
  positive("train.grad_accum", t.grad_accum);
  if (t.steps < 0) fail("{}: train.steps must be >= 0, got {}", p, t.steps);
  if (m.head_dim == 0 && m.d_model % m.n_heads)
    fail("{}: model.d_model ({}) must be a multiple of model.n_heads ({}) unless model.head_dim is set",
         p, m.d_model, m.n_heads);
  if (m.hd() % 2) fail("{}: the head dimension ({}) must be even for rotary embeddings", p, m.hd());
  if (m.n_heads % m.n_kv_heads)
    fail("{}: model.n_heads ({}) must be a multiple of model.n_kv_heads ({})", p, m.n_heads, m.n_kv_heads);
  if (m.top_k > m.n_experts)
    fail("{}: model.top_k ({}) cannot exceed model.n_experts ({})", p, m.top_k, m.n_experts);
  if (m.n_shared_experts < 0 || m.n_shared_experts > 1)
    fail("{}: model.n_shared_experts must be 0 or 1, got {}", p, m.n_shared_experts);
  if (m.dense_layers < 0 || m.dense_layers > m.n_layers)
    fail("{}: model.dense_layers must be in [0, n_layers={}], got {}", p, m.n_layers, m.dense_layers);
  if (t.seq_len > m.max_seq_len)
    fail("{}: train.seq_len ({}) exceeds model.max_seq_len ({})", p, t.seq_len, m.max_seq_len);
  if (!(t.lr > 0)) fail("{}: train.lr must be positive, got {}", p, t.lr);
  if (t.warmup_steps < 0) fail("{}: train.warmup_steps must be >= 0", p);
  if (!(t.beta1 >= 0 && t.beta1 < 1) || !(t.beta2 >= 0 && t.beta2 < 1))
    fail("{}: train.beta1 and train.beta2 must be in [0, 1)", p);
  if (t.eval_every < 0 || t.eval_batches < 0 || t.log_every < 0 || t.checkpoint_every < 0)
    fail("{}: train.eval_every, eval_batches, log_every and checkpoint_every must be >= 0", p);
  const std::string& src = c.data.source;
  if (src != "synthetic" && src.rfind("text:", 0) != 0 && src.rfind("tokens:", 0) != 0)
    fail("{}: data.source must be 'synthetic', 'text:FILE' or 'tokens:FILE', got '{}'", p, src);
  if (!(c.data.arithmetic_fraction >= 0 && c.data.arithmetic_fraction <= 1))
    fail("{}: data.arithmetic_fraction must be in [0, 1]", p);
  if (!(c.data.eval_fraction > 0 && c.data.eval_fraction < 1))
    fail("{}: data.eval_fraction must be in (0, 1)", p);
  positive("dist.ep", c.dist.ep);
  positive("dist.dp", c.dist.dp);
  if (m.n_experts % c.dist.ep)
    fail("{}: dist.ep ({}) must divide model.n_experts ({}): every rank holds the same number of experts", p,
         c.dist.ep, m.n_experts);
}

RunConfig parse_config(const std::string& text, const std::string& path) {
  RunConfig c;
  c.path = path;
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    fail("{}:{}:{}: malformed TOML: {}", path, b.line, b.column, e.description());
  }
  auto secs = sections(c);
  for (const auto& [key, node] : root) {
    const std::string k(key.str());
    auto it = secs.find(k);
    if (it == secs.end()) fail("{}: unknown section [{}] (expected [model], [train], [data] or [dist])", path, k);
    if (!node.is_table()) fail("{}: '{}' must be a table ([{}])", path, k, k);
    for (const auto& [fkey, fnode] : *node.as_table()) {
      const std::string f(fkey.str());
      auto fit = it->second.find(f);
      const auto& src = fnode.source().begin;
      const std::string where = fmt::format("{}:{}: {}.{}", path, src.line, k, f);
      if (fit == it->second.end())
        fail("{}: unknown field (known in [{}]: {})", where, k, known_fields(it->second));
      fit->second.from_toml(fnode, where);
    }
  }
  validate_config(c);
  return c;
}

RunConfig load_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("{}: cannot open config file", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path);
}

nlohmann::json config_to_json(const RunConfig& c) {
  RunConfig copy = c;
  nlohmann::json j;
  for (auto& [sec, fields] : sections(copy))
    for (auto& [name, f] : fields) j[sec][name] = f.to_json();
  return j;
}

RunConfig config_from_json(const nlohmann::json& j, const std::string& path) {
  RunConfig c;
  c.path = path;
  auto secs = sections(c);
  for (auto& [sec, fields] : secs) {
    // [dist] came later: run directories written before it have none and ran as one process
    if (!j.contains(sec) && sec == "dist") continue;
    if (!j.contains(sec)) fail("{}: config has no '{}' section", path, sec);
    for (auto& [name, f] : fields) {
      if (!j[sec].contains(name)) fail("{}: config has no field '{}.{}'", path, sec, name);
      try {
        f.from_json(j[sec][name]);
      } catch (const nlohmann::json::exception& e) {
        fail("{}: config field '{}.{}': {}", path, sec, name, e.what());
      }
    }
  }
  validate_config(c);
  return c;
}

}  // namespace fourbit
