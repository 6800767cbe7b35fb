// defines: RunRecord, read_run_record, write_run_record, check_new_run_dir, claim_new_run_dir,
//          RunLock, ConfigChange, config_changes, kResumeChangeable, utc_time
// A run directory belongs to one run. Its config.json (the run record) is written once when the
// run starts: the resolved config, recipe, device, where the config came from, the --set
// overrides, the command line, the source's own record and, for --init, the weights it started
// from. Every resume appends an entry to its "resumes" list (step, time, what the command line
// changed) and changes nothing else. A new run refuses a directory that holds anything unless
// asked to replace it (--force), and then moves the old one aside (DIR.old-<UTC time>) instead of
// deleting it. While a run trains, it holds an exclusive lock on DIR/.lock, so two processes
// never write one run.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"

namespace fourbit {

struct RunRecord {
  std::string dir;        // the run directory
  std::string path;       // DIR/config.json
  nlohmann::json json;    // the whole record
  RunConfig config;       // "config", as the run started (train.steps: its first length)
  std::string recipe;
  std::string command;    // the command that started it ("pretrain", "sft", "rl")
  std::string device;     // the device of the latest start or resume
  nlohmann::json source;  // the TrainingSource's record (null in records before it existed)
};

// Reads DIR/config.json. Errors name the directory when it is not a fourbit run.
RunRecord read_run_record(const std::string& dir);
// Writes DIR/config.json atomically (the new record, or the old one with a resume appended).
void write_run_record(const std::string& dir, const nlohmann::json& record);

// Fails unless `dir` can hold a new run: it is missing or empty, or `force` is given (then it
// must not be in use). The message says what the directory holds and how to continue it
// (`resume_hint`, e.g. "fourbit pretrain --resume DIR") or replace it (--force).
void check_new_run_dir(const std::string& dir, bool force, const std::string& resume_hint);
// Creates `dir` for a new run; with `force`, first renames an existing non-empty one to
// DIR.old-<UTC time> (returned; "" when nothing was moved).
std::string claim_new_run_dir(const std::string& dir, bool force);

// An exclusive flock on DIR/.lock for as long as the object lives; fails, naming the directory
// and the holder's pid, when another process holds it. The pid is written into the file by
// record_holder(), once the run really starts, so a command that fails before that leaves the
// directory byte for byte as it was.
class RunLock {
 public:
  explicit RunLock(const std::string& dir);
  ~RunLock();
  void record_holder();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

// Config fields a resume may change (they change no number the run computes): the logging and
// checkpoint cadence, what the forward keeps for the backward (memory against time) and whether
// the GPU replays the step as a CUDA graph. train.steps changes through the LR schedule
// (LrSchedule); the device may change too. Every other difference is an error.
inline const std::vector<std::string> kResumeChangeable = {"train.log_every", "train.checkpoint_every",
                                                           "train.keep_last", "train.keep_ffn_activations",
                                                           "train.saved_x_decodes", "train.cuda_graphs"};

struct ConfigChange {
  std::string field;  // "train.lr"
  nlohmann::json old_value, new_value;
  std::string origin;  // where the new value came from ("new.toml:12", "--set train.lr=0.1")
};
// Every field (config_field_names order) whose value differs, train.steps excepted.
std::vector<ConfigChange> config_changes(const RunConfig& recorded, const RunConfig& requested);

// "2026-12-01T15:50:00Z"
std::string utc_time();

}  // namespace fourbit
