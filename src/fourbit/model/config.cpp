// defines: load_config, parse_config, config_to_json, config_from_json, validate_config,
//          RunConfig::where, set_config_field, apply_override, config_field_names
#include "fourbit/model/config.h"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <vector>

#include <toml++/toml.h>

#include "fourbit/tensor/error.h"

namespace fourbit {
namespace {

// One table of fields per section: name -> how to read it from TOML, JSON or command-line text
// and write it back.
struct Field {
  std::function<void(const toml::node&, const std::string& where)> from_toml;
  std::function<void(const nlohmann::json&)> from_json;
  std::function<void(const std::string& text, const std::string& where)> from_text;
  std::function<nlohmann::json()> to_json;
};
using Section = std::map<std::string, Field>;

// Text after `--set section.key=`: the whole text must be the value (no trailing characters).
template <typename T>
T parse_text(const std::string& text, const std::string& where) {
  if constexpr (std::is_same_v<T, bool>) {
    if (text == "true") return true;
    if (text == "false") return false;
    fail("{}: expected true or false, got '{}'", where, text);
  } else if constexpr (std::is_same_v<T, std::string>) {
    // TOML-style quotes are optional: train.x="a b" and train.x=a b mean the same.
    if (text.size() >= 2 && (text.front() == '"' || text.front() == '\'') && text.back() == text.front())
      return text.substr(1, text.size() - 2);
    return text;
  } else if constexpr (std::is_floating_point_v<T>) {
    double v = 0;
    const char* end = text.data() + text.size();
    const auto r = std::from_chars(text.data(), end, v);
    if (text.empty() || r.ec != std::errc() || r.ptr != end || !std::isfinite(v))
      fail("{}: expected a finite number, got '{}'", where, text);
    return T(v);
  } else {
    int64_t v = 0;
    const char* end = text.data() + text.size();
    const auto r = std::from_chars(text.data(), end, v);
    if (text.empty() || r.ec != std::errc() || r.ptr != end)
      fail("{}: expected an integer, got '{}'", where, text);
    if constexpr (std::is_unsigned_v<T>) {
      if (v < 0) fail("{}: expected a non-negative integer, got {}", where, v);
    }
    return T(v);
  }
}

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
  f.from_text = [&ref](const std::string& text, const std::string& where) { ref = parse_text<T>(text, where); };
  f.to_json = [&ref]() { return nlohmann::json(ref); };
  return f;
}

// Fields added after run records were first written: an older config.json or state.json lacks
// them and gets the default.
bool added_later(const std::string& section, const std::string& name) {
  return section == "train" && (name == "keep_last" || name == "keep_ffn_activations" || name == "saved_x_decodes" ||
                                name == "cuda_graphs");
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
        {"keep_last", field(t.keep_last)}, {"log_every", field(t.log_every)}, {"seed", field(t.seed)},
        {"keep_ffn_activations", field(t.keep_ffn_activations)},
        {"saved_x_decodes", field(t.saved_x_decodes)}, {"cuda_graphs", field(t.cuda_graphs)}}},
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

std::string RunConfig::where(const std::string& field) const {
  const auto it = origin.find(field);
  return it != origin.end() ? it->second : path;
}

void validate_config(const RunConfig& c) {
  const ModelConfig& m = c.model;
  const TrainConfig& t = c.train;
  // "ORIGIN: field" for the field at fault; a second field in a cross-field rule is named with
  // its own origin in parentheses when it came from somewhere else.
  auto at = [&](const char* field) { return fmt::format("{}: {}", c.where(field), field); };
  auto also = [&](const char* field) {
    return c.where(field) == c.path ? std::string() : fmt::format(", {}", c.where(field));
  };
  auto positive = [&](const char* name, int64_t v) {
    if (v <= 0) fail("{} must be positive, got {}", at(name), v);
  };
  auto non_negative = [&](const char* name, int64_t v) {
    if (v < 0) fail("{} must be >= 0, got {}", at(name), v);
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
  non_negative("model.head_dim", m.head_dim);
  non_negative("model.d_shared", m.d_shared);
  non_negative("model.d_dense", m.d_dense);
  positive("train.batch_size", t.batch_size);
  positive("train.seq_len", t.seq_len);
  positive("train.grad_accum", t.grad_accum);
  non_negative("train.steps", t.steps);
  if (m.head_dim == 0 && m.d_model % m.n_heads)
    fail("{} ({}) must be a multiple of model.n_heads ({}{}) unless model.head_dim is set", at("model.d_model"),
         m.d_model, m.n_heads, also("model.n_heads"));
  if (m.hd() % 2) fail("{}: the head dimension ({}) must be even for rotary embeddings",
                       c.where(m.head_dim ? "model.head_dim" : "model.d_model"), m.hd());
  if (m.n_heads % m.n_kv_heads)
    fail("{} ({}) must be a multiple of model.n_kv_heads ({}{})", at("model.n_heads"), m.n_heads, m.n_kv_heads,
         also("model.n_kv_heads"));
  if (m.top_k > m.n_experts)
    fail("{} ({}) cannot exceed model.n_experts ({}{})", at("model.top_k"), m.top_k, m.n_experts,
         also("model.n_experts"));
  if (m.n_shared_experts < 0 || m.n_shared_experts > 1)
    fail("{} must be 0 or 1, got {}", at("model.n_shared_experts"), m.n_shared_experts);
  if (m.dense_layers < 0 || m.dense_layers > m.n_layers)
    fail("{} must be in [0, model.n_layers={}], got {}", at("model.dense_layers"), m.n_layers, m.dense_layers);
  if (!(m.rope_theta > 0)) fail("{} must be positive, got {}", at("model.rope_theta"), m.rope_theta);
  if (!(m.norm_eps > 0)) fail("{} must be positive, got {}", at("model.norm_eps"), m.norm_eps);
  if (!(m.aux_loss_coef >= 0)) fail("{} must be >= 0, got {}", at("model.aux_loss_coef"), m.aux_loss_coef);
  if (!(m.init_std > 0)) fail("{} must be positive, got {}", at("model.init_std"), m.init_std);
  if (t.seq_len > m.max_seq_len)
    fail("{} ({}) exceeds model.max_seq_len ({}{})", at("train.seq_len"), t.seq_len, m.max_seq_len,
         also("model.max_seq_len"));
  if (!(t.lr > 0)) fail("{} must be positive, got {}", at("train.lr"), t.lr);
  if (!(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1))
    fail("{} must be in [0, 1], got {}", at("train.min_lr_ratio"), t.min_lr_ratio);
  non_negative("train.warmup_steps", t.warmup_steps);
  if (!(t.weight_decay >= 0)) fail("{} must be >= 0, got {}", at("train.weight_decay"), t.weight_decay);
  if (!(t.beta1 >= 0 && t.beta1 < 1)) fail("{} must be in [0, 1), got {}", at("train.beta1"), t.beta1);
  if (!(t.beta2 >= 0 && t.beta2 < 1)) fail("{} must be in [0, 1), got {}", at("train.beta2"), t.beta2);
  if (!(t.adam_eps > 0)) fail("{} must be positive, got {}", at("train.adam_eps"), t.adam_eps);
  if (!(t.grad_clip >= 0)) fail("{} must be >= 0 (0 = off), got {}", at("train.grad_clip"), t.grad_clip);
  non_negative("train.eval_every", t.eval_every);
  non_negative("train.eval_batches", t.eval_batches);
  non_negative("train.log_every", t.log_every);
  non_negative("train.checkpoint_every", t.checkpoint_every);
  non_negative("train.keep_last", t.keep_last);
  const std::string& src = c.data.source;
  if (src != "synthetic" && src.rfind("text:", 0) != 0 && src.rfind("tokens:", 0) != 0)
    fail("{} must be 'synthetic', 'text:FILE' or 'tokens:FILE', got '{}'", at("data.source"), src);
  if (!(c.data.arithmetic_fraction >= 0 && c.data.arithmetic_fraction <= 1))
    fail("{} must be in [0, 1], got {}", at("data.arithmetic_fraction"), c.data.arithmetic_fraction);
  if (!(c.data.eval_fraction > 0 && c.data.eval_fraction < 1))
    fail("{} must be in (0, 1), got {}", at("data.eval_fraction"), c.data.eval_fraction);
  positive("dist.ep", c.dist.ep);
  positive("dist.dp", c.dist.dp);
  if (m.n_experts % c.dist.ep)
    fail("{} ({}) must divide model.n_experts ({}{}): every rank holds the same number of experts", at("dist.ep"),
         c.dist.ep, m.n_experts, also("model.n_experts"));
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
      c.origin[k + "." + f] = fmt::format("{}:{}", path, src.line);
    }
  }
  validate_config(c);
  return c;
}

RunConfig load_config(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("{}: is a directory, expected a TOML config file", path);
  std::ifstream in(path);
  if (!in) fail("{}: cannot open config file", path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: read error in config file", path);
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
      if (!j[sec].contains(name)) {
        if (added_later(sec, name)) continue;
        fail("{}: config has no field '{}.{}'", path, sec, name);
      }
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

namespace fourbit {

void set_config_field(RunConfig& c, const std::string& field, const std::string& value,
                      const std::string& origin) {
  const size_t dot = field.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == field.size())
    fail("{}: expected section.key=value (e.g. train.lr=0.001), got the name '{}'", origin, field);
  const std::string sec = field.substr(0, dot), name = field.substr(dot + 1);
  auto secs = sections(c);
  const auto it = secs.find(sec);
  if (it == secs.end()) fail("{}: unknown section '{}' (expected model, train or data)", origin, sec);
  const auto fit = it->second.find(name);
  if (fit == it->second.end())
    fail("{}: unknown field {} (known in [{}]: {})", origin, field, sec, known_fields(it->second));
  fit->second.from_text(value, fmt::format("{}: {}", origin, field));
  c.origin[field] = origin;
}

void apply_override(RunConfig& c, const std::string& assignment) {
  const std::string origin = "--set " + assignment;
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos)
    fail("{}: expected section.key=value (e.g. --set train.lr=0.001)", origin);
  std::string field = assignment.substr(0, eq);
  while (!field.empty() && field.back() == ' ') field.pop_back();
  std::string value = assignment.substr(eq + 1);
  while (!value.empty() && value.front() == ' ') value.erase(value.begin());
  set_config_field(c, field, value, origin);
}

std::vector<std::string> config_field_names() {
  RunConfig c;
  std::vector<std::string> out;
  for (auto& [sec, fields] : sections(c))
    for (auto& [name, f] : fields) out.push_back(sec + "." + name);
  return out;
}

}  // namespace fourbit
