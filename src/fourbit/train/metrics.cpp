// defines: JsonlLog, Progress (metrics.h)
#include "fourbit/train/metrics.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "fourbit/io/atomic_file.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

JsonlLog::JsonlLog(const std::string& path, int64_t resume_step) : path_(path) {
  if (resume_step > 0 && std::filesystem::exists(path_)) {
    std::ifstream in(path_);
    std::string kept, line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        if (nlohmann::json::parse(line).value("step", int64_t(0)) <= resume_step) kept += line + "\n";
      } catch (const nlohmann::json::exception&) {
        break;  // a torn last line from a killed run
      }
    }
    io::write_file_atomic(path_, kept);
    f_ = std::fopen(path_.c_str(), "a");
  } else {
    f_ = std::fopen(path_.c_str(), "w");
  }
  if (!f_) fail("{}: cannot open for writing", path_);
}

JsonlLog::~JsonlLog() {
  if (f_) std::fclose(f_);
}

void JsonlLog::write(const nlohmann::json& line) {
  const std::string s = line.dump() + "\n";
  if (std::fwrite(s.data(), 1, s.size(), f_) != s.size() || std::fflush(f_) != 0)
    fail("{}: write failed", path_);
}

Progress::Progress(int64_t start_step, int64_t total_steps, int64_t log_every)
    : start_(start_step), total_(total_steps), log_every_(log_every ? log_every : 10),
      tty_(::isatty(::fileno(stderr)) != 0), t0_(std::chrono::steady_clock::now()) {}

namespace {
std::string hms(double s) {
  const int64_t t = int64_t(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60)
                   : fmt::format("{}m{:02d}s", t / 60, t % 60);
}
}  // namespace

void Progress::step(int64_t step, double loss, double tokens_per_s) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const int64_t done = step - start_;
  const double eta = done > 0 ? elapsed / double(done) * double(total_ - step) : 0.0;
  if (tty_) {
    constexpr int kWidth = 24;
    const int fill = total_ ? int(kWidth * step / total_) : kWidth;
    std::string bar(size_t(fill), '=');
    if (fill < kWidth) bar += '>' + std::string(size_t(kWidth - fill - 1), ' ');
    std::fprintf(stderr, "\r  step %5lld/%lld [%s] loss %.4f | %.0f tok/s | ETA %s   ",
                 (long long)step, (long long)total_, bar.c_str(), loss, tokens_per_s, hms(eta).c_str());
    std::fflush(stderr);
    bar_drawn_ = true;
  } else if (step % log_every_ == 0 || step == total_) {
    std::fprintf(stderr, "  step %lld/%lld loss %.4f %.0f tok/s eta %s\n", (long long)step,
                 (long long)total_, loss, tokens_per_s, hms(eta).c_str());
  }
}

void Progress::message(const std::string& line) {
  if (tty_ && bar_drawn_) std::fprintf(stderr, "\r%*s\r", 100, "");
  std::fprintf(stderr, "%s\n", line.c_str());
}

void Progress::finish() {
  if (tty_ && bar_drawn_) std::fprintf(stderr, "\n");
  bar_drawn_ = false;
}

}  // namespace fourbit
