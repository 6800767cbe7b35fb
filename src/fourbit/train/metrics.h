// defines: JsonlLog, Progress
// metrics.jsonl holds only what is a pure function of the seed (losses, learning rate, gradient
// norm), so two runs of one seed write identical files; timings go to the terminal and to
// summary.json. A training source's side outputs (samples.jsonl) are JSON-lines files of the same
// kind. Progress draws a one-line bar on a terminal and plain lines otherwise.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace fourbit {

// A JSON-lines file of a run, one object per line, each with the 1-based "step" that wrote it.
class JsonlLog {
 public:
  // Opens `path`; when resuming at `resume_step`, keeps only the lines of steps up to it (and
  // drops a torn last line), so the file ends as an uninterrupted run's would.
  JsonlLog(const std::string& path, int64_t resume_step);
  ~JsonlLog();
  JsonlLog(const JsonlLog&) = delete;
  JsonlLog& operator=(const JsonlLog&) = delete;
  void write(const nlohmann::json& line);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

class Progress {
 public:
  Progress(int64_t start_step, int64_t total_steps, int64_t log_every);
  ~Progress() { finish(); }  // ends a drawn bar's line, also when an error unwinds past it
  void step(int64_t step, double loss, double tokens_per_s);  // step: completed steps
  void message(const std::string& line);                      // a full line above the bar
  void finish();
  bool tty() const { return tty_; }

 private:
  int64_t start_, total_, log_every_;
  bool tty_;
  bool bar_drawn_ = false;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace fourbit
