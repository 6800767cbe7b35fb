// defines: read_run_record, write_run_record, check_new_run_dir, claim_new_run_dir, RunLock,
//          config_changes, utc_time (run_dir.h)
#include "fourbit/train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "fourbit/io/atomic_file.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/checkpoint.h"

namespace fourbit {
namespace fs = std::filesystem;

namespace {

std::string stamp(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[40];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

// One line on what a non-empty directory holds, for the refusal message.
std::string what_it_holds(const std::string& dir) {
  const fs::path rec = fs::path(dir) / "config.json";
  if (!fs::exists(rec)) {
    int n = 0;
    std::error_code ec;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) ++n;
    return fmt::format("holds {} entr{} and no fourbit run", n, n == 1 ? "y" : "ies");
  }
  std::string desc = "holds a fourbit run";
  try {
    const RunRecord r = read_run_record(dir);
    const auto cps = list_checkpoints(dir);
    desc += fmt::format(" ({} {}, {})", r.command, r.recipe,
                        cps.empty() ? std::string("no checkpoints")
                                    : fmt::format("newest checkpoint {}", fs::path(cps.back().second).filename().string()));
  } catch (const Error&) {
    desc += " (its config.json cannot be read)";
  }
  return desc;
}

bool is_empty_dir(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::is_empty(dir, ec);
}

// Whether a live process holds DIR/.lock (tested with a non-blocking shared lock).
bool in_use(const std::string& dir, long* holder) {
  const std::string path = (fs::path(dir) / ".lock").string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool busy = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  if (busy && holder) {
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    *holder = n > 0 ? std::strtol(buf, nullptr, 10) : 0;
  }
  ::close(fd);
  return busy;
}

}  // namespace

std::string utc_time() { return stamp("%Y-%m-%dT%H:%M:%SZ"); }

RunRecord read_run_record(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) fail("{}: no such run directory", dir);
  if (!fs::is_directory(dir, ec)) fail("{}: is not a directory (expected a run directory)", dir);
  RunRecord r;
  r.dir = dir;
  r.path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(r.path)) fail("{}: not a fourbit run directory (it has no config.json)", dir);
  const std::vector<uint8_t> bytes = io::read_file_bytes(r.path);
  try {
    r.json = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", r.path, e.what());
  }
  try {
    if (!r.json.is_object() || !r.json.contains("config"))
      fail("{}: not a fourbit run record (no \"config\")", r.path);
    r.config = config_from_json(r.json.at("config"), r.path);
    r.recipe = r.json.at("recipe").get<std::string>();
    r.command = r.json.value("command", std::string("pretrain"));
    r.device = r.json.value("device", std::string("cpu"));
    if (r.json.contains("resumes") && !r.json["resumes"].empty())
      r.device = r.json["resumes"].back().value("device", r.device);
    r.source = r.json.value("source", nlohmann::json());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: missing or malformed field: {}", r.path, e.what());
  }
  return r;
}

void write_run_record(const std::string& dir, const nlohmann::json& record) {
  io::write_file_atomic((fs::path(dir) / "config.json").string(), record.dump(2) + "\n");
}

void check_new_run_dir(const std::string& dir, bool force, const std::string& resume_hint) {
  std::error_code ec;
  if (!fs::exists(dir, ec) || is_empty_dir(dir)) return;
  if (!fs::is_directory(dir, ec))
    fail("{}: exists and is not a directory; give --out a directory for the run", dir);
  if (!force)
    fail("{}: {}; continue it with `{}`, or replace it with --force (the old directory is moved to {}.old-<time>, "
         "not deleted)",
         dir, what_it_holds(dir), resume_hint, dir);
  long holder = 0;
  if (in_use(dir, &holder))
    fail("{}: is being trained by another fourbit process (pid {}); it cannot be replaced now", dir, holder);
}

std::string claim_new_run_dir(const std::string& dir, bool force) {
  std::error_code ec;
  std::string moved;
  if (fs::exists(dir, ec) && !is_empty_dir(dir)) {
    if (!force) fail("{}: is not empty (internal: claim without check_new_run_dir)", dir);
    std::string base = dir;
    while (base.size() > 1 && base.back() == '/') base.pop_back();
    moved = base + ".old-" + stamp("%Y%m%dT%H%M%SZ");
    for (int i = 1; fs::exists(moved, ec); ++i) moved = fmt::format("{}.old-{}-{}", base, stamp("%Y%m%dT%H%M%SZ"), i);
    fs::rename(base, moved, ec);  // one atomic rename: the old run is whole, just elsewhere
    if (ec) fail("{}: cannot move it aside to {}: {}", dir, moved, ec.message());
  }
  fs::create_directories(dir, ec);
  if (ec) fail("{}: cannot create run directory: {}", dir, ec.message());
  return moved;
}

RunLock::RunLock(const std::string& dir) {
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot open the run's lock file: {}", path, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    ::close(fd_);
    fd_ = -1;
    fail("{}: is being trained by another fourbit process (pid {}); wait for it or stop it first", dir,
         n > 0 ? std::strtol(buf, nullptr, 10) : 0L);
  }
}

void RunLock::record_holder() {
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size())) {
    // The lock holds without the pid; only the message a second process prints loses it.
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::vector<ConfigChange> config_changes(const RunConfig& recorded, const RunConfig& requested) {
  const nlohmann::json a = config_to_json(recorded), b = config_to_json(requested);
  std::vector<ConfigChange> out;
  for (const std::string& field : config_field_names()) {
    if (field == "train.steps") continue;
    const size_t dot = field.find('.');
    const std::string sec = field.substr(0, dot), key = field.substr(dot + 1);
    const nlohmann::json& va = a[sec][key];
    const nlohmann::json& vb = b[sec][key];
    if (va != vb) out.push_back({field, va, vb, requested.where(field)});
  }
  return out;
}

}  // namespace fourbit
