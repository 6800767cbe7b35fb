// defines: save_checkpoint, read_checkpoint_state, load_checkpoint, latest_checkpoint
#include "fourbit/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include <fmt/format.h>

#include "fourbit/io/atomic_file.h"
#include "fourbit/io/safetensors.h"
#include "fourbit/tensor/error.h"

namespace fourbit {
namespace fs = std::filesystem;

namespace {

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
    Tensor dst = p.view(host, info);
    dst.copy_from(t);
  }
  flat.copy_from(host);
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, const ParamStore& params,
                            const Tensor& adam_m, const Tensor& adam_v, const CheckpointState& st) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const std::string name = fmt::format("step-{:06d}", st.step);
  const fs::path final_dir = root / name;
  const fs::path tmp_dir = root / fmt::format(".{}.tmp-{}", name, ::getpid());
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail("{}: cannot create checkpoint directory: {}", root.string(), ec.message());
  fs::remove_all(tmp_dir, ec);
  fs::create_directory(tmp_dir, ec);
  if (ec) fail("{}: cannot create directory: {}", tmp_dir.string(), ec.message());
  try {
    const nlohmann::json state = {
        {"format", "fourbit-checkpoint-1"},
        {"step", st.step},
        {"seed", st.seed},
        {"recipe", st.recipe},
        {"tokens_seen", st.tokens_seen},
        {"config", config_to_json(st.config)},
        {"extra", st.extra},
    };
    std::map<std::string, std::string> meta = {{"format", "fourbit-checkpoint-1"},
                                               {"step", std::to_string(st.step)},
                                               {"recipe", st.recipe}};
    io::write_safetensors((tmp_dir / "model.safetensors").string(),
                          named_views(params, params.flat_const(), ""), meta);
    std::vector<std::pair<std::string, Tensor>> optim = named_views(params, adam_m, "m.");
    for (auto& kv : named_views(params, adam_v, "v.")) optim.push_back(std::move(kv));
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
    if (j.value("format", "") != "fourbit-checkpoint-1")
      fail("{}: not a fourbit checkpoint (format '{}')", path, j.value("format", ""));
    st.step = j.at("step").get<int64_t>();
    st.seed = j.at("seed").get<uint64_t>();
    st.recipe = j.at("recipe").get<std::string>();
    st.tokens_seen = j.value("tokens_seen", int64_t(0));
    st.extra = j.value("extra", nlohmann::json::object());
    st.config = config_from_json(j.at("config"), path);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: missing or malformed field: {}", path, e.what());
  }
  return st;
}

void load_checkpoint(const std::string& dir, ParamStore& params, Tensor* adam_m, Tensor* adam_v) {
  const io::SafetensorsFile model = io::read_safetensors((fs::path(dir) / "model.safetensors").string());
  load_views(model, params, params.flat(), "");
  if (adam_m || adam_v) {
    const io::SafetensorsFile optim = io::read_safetensors((fs::path(dir) / "optim.safetensors").string());
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

}  // namespace fourbit
