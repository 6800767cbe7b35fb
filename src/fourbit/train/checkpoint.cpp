// defines: checkpoint_name, save_checkpoint, read_checkpoint_state, load_checkpoint,
//          latest_checkpoint, list_checkpoints, load_first_valid_checkpoint, prune_checkpoints,
//          set_aside_checkpoints_after, remove_stale_temporaries (checkpoint.h)
#include "fourbit/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <vector>

#include <fmt/format.h>

#include "fourbit/io/atomic_file.h"
#include "fourbit/io/checksum.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/stop_signal.h"

namespace fourbit {
namespace fs = std::filesystem;

namespace {

// Version 2 adds the per-tensor checksums, the state checksum, the LR schedule and the source
// state; version 1 checkpoints (no checksums) still load.
constexpr const char* kFormat = "fourbit-checkpoint-2";
constexpr const char* kFormatV1 = "fourbit-checkpoint-1";

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail("{}: cannot open directory to sync it", dir.string());
  ::fsync(fd);
  ::close(fd);
}

std::vector<std::pair<std::string, Tensor>> named_views(const ParamStore& p, const Tensor& flat,
                                                        const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor>> out;
  const Tensor host = flat.to(Device::CPU);
  for (const ParamInfo& info : p.infos()) out.emplace_back(prefix + info.name, p.view(host, info));
  return out;
}

// The first non-finite value of an F32/F64 tensor: its index, or -1.
int64_t first_non_finite(const Tensor& t) {
  const int64_t n = t.numel();
  if (t.dtype() == DType::F32) {
    const float* p = t.data<float>();
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) return i;
  } else if (t.dtype() == DType::F64) {
    const double* p = t.data<double>();
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) return i;
  }
  return -1;
}

double value_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : double(t.data<float>()[i]);
}

void load_views(const io::SafetensorsFile& f, const ParamStore& p, Tensor& flat,
                const std::string& prefix) {
  Tensor host = Tensor::empty({p.numel()}, flat.dtype(), Device::CPU);
  for (const ParamInfo& info : p.infos()) {
    const Tensor& t = f.get(prefix + info.name);
    if (t.shape() != info.shape)
      fail("{}: tensor '{}' has shape {}, the model expects {}", f.path, prefix + info.name,
           shape_str(t.shape()), shape_str(info.shape));
    if (t.dtype() != flat.dtype())
      fail("{}: tensor '{}' is {}, expected {}", f.path, prefix + info.name, dtype_name(t.dtype()),
           dtype_name(flat.dtype()));
    // A NaN or Inf weight makes every forward NaN (generate would print nothing): refuse it here.
    if (const int64_t bad = first_non_finite(t); bad >= 0)
      fail("{}: tensor '{}' holds a non-finite value ({}) at element {}; the checkpoint cannot be used", f.path,
           prefix + info.name, value_at(t, bad), bad);
    Tensor dst = p.view(host, info);
    dst.copy_from(t);
  }
  flat.copy_from(host);
}

io::SafetensorsFile read_checked(const std::string& path) {
  io::SafetensorsFile f = io::read_safetensors(path);
  const auto fmt_it = f.metadata.find("format");
  const std::string format = fmt_it == f.metadata.end() ? "" : fmt_it->second;
  if (format != kFormat && format != kFormatV1)
    fail("{}: not a fourbit checkpoint file (metadata format '{}', expected '{}')", path, format, kFormat);
  io::verify_tensor_checksums(f, /*required=*/format == kFormat);
  return f;
}

// CRC-32C of the state's canonical text without its "checksum" field.
std::string state_checksum(nlohmann::json j) {
  j.erase("checksum");
  const std::string text = j.dump();
  return io::checksum_text(io::crc32c(text.data(), text.size()));
}

// "step-000042" -> 42; -1 for anything else.
int64_t step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  int64_t v = -1;
  const char* b = name.data() + 5;
  const char* e = name.data() + name.size();
  const auto r = std::from_chars(b, e, v);
  return r.ec == std::errc() && r.ptr == e && v >= 0 ? v : -1;
}

std::string utc_stamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// The pid in ".NAME.tmp-PID" or ".NAME.tmp-PID-..."; -1 when the name is not a temporary.
long temp_owner(const std::string& name) {
  if (name.empty() || name[0] != '.') return -1;
  const size_t at = name.rfind(".tmp-");
  if (at == std::string::npos || at == 0) return -1;
  long pid = -1;
  const char* b = name.data() + at + 5;
  const char* e = name.data() + name.size();
  const auto r = std::from_chars(b, e, pid);
  if (r.ec != std::errc() || pid <= 0) return -1;
  if (r.ptr != e && *r.ptr != '-') return -1;
  return pid;
}

}  // namespace

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:06d}", step); }

std::string save_checkpoint(const std::string& run_dir, const ParamStore& params,
                            const Tensor& adam_m, const Tensor& adam_v, const CheckpointState& st,
                            int64_t keep_last) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const std::string name = checkpoint_name(st.step);
  const fs::path final_dir = root / name;
  const fs::path tmp_dir = root / fmt::format(".{}.tmp-{}", name, ::getpid());
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail("{}: cannot create checkpoint directory: {}", root.string(), ec.message());
  fs::remove_all(tmp_dir, ec);
  fs::create_directory(tmp_dir, ec);
  if (ec) fail("{}: cannot create directory: {}", tmp_dir.string(), ec.message());
  try {
    nlohmann::json state = {
        {"format", kFormat},
        {"step", st.step},
        {"seed", st.seed},
        {"recipe", st.recipe},
        {"tokens_seen", st.tokens_seen},
        {"config", config_to_json(st.config)},
        {"schedule", st.schedule},
        {"source", st.source},
        {"extra", st.extra},
    };
    state["checksum"] = state_checksum(state);
    std::map<std::string, std::string> meta = {{"format", kFormat},
                                               {"step", std::to_string(st.step)},
                                               {"recipe", st.recipe}};
    const auto model_tensors = named_views(params, params.flat_const(), "");
    std::map<std::string, std::string> model_meta = meta;
    io::add_tensor_checksums(model_meta, model_tensors);
    io::write_safetensors((tmp_dir / "model.safetensors").string(), model_tensors, model_meta);
    test_signal_point("checkpoint", st.step);  // FOURBIT_TEST_RAISE: a signal mid-write
    std::vector<std::pair<std::string, Tensor>> optim = named_views(params, adam_m, "m.");
    for (auto& kv : named_views(params, adam_v, "v.")) optim.push_back(std::move(kv));
    io::add_tensor_checksums(meta, optim);
    io::write_safetensors((tmp_dir / "optim.safetensors").string(), optim, meta);
    io::write_file_atomic((tmp_dir / "state.json").string(), state.dump(2) + "\n");
    fsync_dir(tmp_dir);
    if (fs::exists(final_dir)) fs::remove_all(final_dir);  // re-saving the same step (resume)
    fs::rename(tmp_dir, final_dir);
    fsync_dir(root);
    io::write_file_atomic((root / "latest").string(), name + "\n");
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  prune_checkpoints(run_dir, keep_last);
  return final_dir.string();
}

CheckpointState read_checkpoint_state(const std::string& dir) {
  const std::string path = (fs::path(dir) / "state.json").string();
  const std::vector<uint8_t> bytes = io::read_file_bytes(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", path, e.what());
  }
  CheckpointState st;
  try {
    if (!j.is_object()) fail("{}: expected a JSON object", path);
    const std::string format = j.value("format", "");
    if (format != kFormat && format != kFormatV1)
      fail("{}: not a fourbit checkpoint (format '{}', expected '{}')", path, format, kFormat);
    if (format == kFormat) {
      if (!j.contains("checksum")) fail("{}: has no checksum (the file was altered)", path);
      const std::string want = j.at("checksum").get<std::string>(), have = state_checksum(j);
      if (want != have) fail("{}: fails its checksum (stored {}, the content gives {}): the file is corrupt", path, want, have);
    }
    st.step = j.at("step").get<int64_t>();
    st.seed = j.at("seed").get<uint64_t>();
    st.recipe = j.at("recipe").get<std::string>();
    st.tokens_seen = j.value("tokens_seen", int64_t(0));
    st.schedule = j.value("schedule", nlohmann::json());
    st.source = j.value("source", nlohmann::json());
    st.extra = j.value("extra", nlohmann::json::object());
    st.config = config_from_json(j.at("config"), path);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: missing or malformed field: {}", path, e.what());
  }
  return st;
}

void load_checkpoint(const std::string& dir, ParamStore& params, Tensor* adam_m, Tensor* adam_v) {
  const io::SafetensorsFile model = read_checked((fs::path(dir) / "model.safetensors").string());
  load_views(model, params, params.flat(), "");
  if (adam_m || adam_v) {
    const io::SafetensorsFile optim = read_checked((fs::path(dir) / "optim.safetensors").string());
    if (adam_m) load_views(optim, params, *adam_m, "m.");
    if (adam_v) load_views(optim, params, *adam_v, "v.");
  }
}

std::string latest_checkpoint(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const fs::path latest = root / "latest";
  if (!fs::exists(latest)) fail("{}: no checkpoint to resume from (missing {})", run_dir, latest.string());
  const std::vector<uint8_t> b = io::read_file_bytes(latest.string());
  std::string name(b.begin(), b.end());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  const fs::path dir = root / name;
  if (name.empty() || !fs::is_directory(dir))
    fail("{}: names checkpoint '{}', which does not exist", latest.string(), name);
  return dir.string();
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory(ec)) out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string load_first_valid_checkpoint(const std::string& run, const std::string& which,
                                        const std::function<void(const std::string& dir)>& load,
                                        std::vector<std::string>* warnings) {
  std::error_code ec;
  if (!fs::exists(run, ec)) fail("{}: no such run or checkpoint directory", run);
  if (!fs::is_directory(run, ec)) fail("{}: is not a directory (expected a run or checkpoint directory)", run);
  if (fs::exists(fs::path(run) / "state.json")) {  // a checkpoint directory itself
    if (!which.empty()) fail("{} is a checkpoint directory; it cannot also pick checkpoint '{}'", run, which);
    load(run);
    return run;
  }
  const auto all = list_checkpoints(run);
  if (!which.empty()) {
    const int64_t want = step_of(which.rfind("step-", 0) == 0 ? which : "step-" + which);
    if (want < 0) fail("checkpoint '{}': expected step-N or N", which);
    for (const auto& [step, dir] : all)
      if (step == want) {
        load(dir);  // asked for by name: no fallback
        return dir;
      }
    std::string have;
    for (const auto& [step, dir] : all) have += (have.empty() ? "" : ", ") + fs::path(dir).filename().string();
    fail("{}: has no checkpoint {} (it has: {})", run, checkpoint_name(want), have.empty() ? "none" : have);
  }
  if (all.empty())
    fail("{}: has no checkpoints (no {}/checkpoints/step-N directory)", run, run);
  std::vector<std::string> failures;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      load(it->second);
      if (warnings)
        for (const std::string& f : failures)
          warnings->push_back(fmt::format("warning: skipping a corrupt checkpoint: {}; using {}", f,
                                          fs::path(it->second).filename().string()));
      return it->second;
    } catch (const CheckpointMismatch&) {
      throw;  // intact but not for this model: an older one would not fit either
    } catch (const Error& e) {
      failures.push_back(e.what());
    }
  }
  std::string why;
  for (const std::string& f : failures) why += (why.empty() ? "" : "; ") + f;
  fail("{}: no checkpoint can be loaded: {}", run, why);
}

void prune_checkpoints(const std::string& run_dir, int64_t keep_last) {
  if (keep_last <= 0) return;
  const auto all = list_checkpoints(run_dir);
  for (size_t i = 0; i + size_t(keep_last) < all.size(); ++i) {
    std::error_code ec;
    fs::remove_all(all[i].second, ec);
    if (ec) fail("{}: cannot remove this old checkpoint (train.keep_last = {}): {}", all[i].second, keep_last,
                 ec.message());
  }
}

std::string set_aside_checkpoints_after(const std::string& run_dir, int64_t step) {
  std::vector<std::string> later;
  for (const auto& [s, dir] : list_checkpoints(run_dir))
    if (s > step) later.push_back(dir);
  if (later.empty()) return "";
  const fs::path root = fs::path(run_dir) / "checkpoints";
  fs::path aside = root / ("superseded-" + utc_stamp());
  for (int i = 1; fs::exists(aside); ++i) aside = root / fmt::format("superseded-{}-{}", utc_stamp(), i);
  std::error_code ec;
  fs::create_directory(aside, ec);
  if (ec) fail("{}: cannot create directory: {}", aside.string(), ec.message());
  for (const std::string& dir : later) {
    fs::rename(dir, aside / fs::path(dir).filename(), ec);
    if (ec) fail("{}: cannot move it into {}: {}", dir, aside.string(), ec.message());
  }
  fsync_dir(root);
  return aside.string();
}

int remove_stale_temporaries(const std::string& run_dir) {
  int removed = 0;
  const long self = long(::getpid());
  for (const fs::path& dir : {fs::path(run_dir), fs::path(run_dir) / "checkpoints"}) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> stale;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const long pid = temp_owner(e.path().filename().string());
      if (pid > 0 && pid != self) stale.push_back(e.path());
    }
    for (const fs::path& p : stale) {
      fs::remove_all(p, ec);
      if (!ec) ++removed;
    }
  }
  return removed;
}

}  // namespace fourbit
