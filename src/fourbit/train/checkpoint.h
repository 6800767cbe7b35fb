// defines: CheckpointState, checkpoint_name, save_checkpoint, read_checkpoint_state,
//          load_checkpoint, latest_checkpoint, list_checkpoints, load_first_valid_checkpoint,
//          prune_checkpoints, set_aside_checkpoints_after, remove_stale_temporaries
// A checkpoint is a directory RUN/checkpoints/step-NNNNNN/ with model.safetensors (parameters
// by name, F32), optim.safetensors (AdamW moments m.NAME, v.NAME) and state.json (config, recipe,
// step, seed, LR schedule, data position). Every tensor carries a CRC-32C in the safetensors
// metadata and state.json carries one of its own content; loading checks them and refuses
// non-finite values, naming the tensor. A checkpoint is written into a temporary directory
// (.step-NNNNNN.tmp-PID), every file fsynced, then renamed into place, so a crash or a failed
// write never leaves a partial checkpoint and never touches an earlier one.
// RUN/checkpoints/latest names the newest (written atomically) for people and tools; loading
// does not trust it: it takes the newest step-N directory that loads, falling back past corrupt
// ones with a warning.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/params.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

struct CheckpointState {
  RunConfig config;           // train.steps: the run's current total (after any extension)
  std::string recipe;
  int64_t step = 0;           // optimizer steps completed
  uint64_t seed = 0;          // run seed (SR streams and data derive from it and the step)
  int64_t tokens_seen = 0;
  nlohmann::json schedule;    // LrSchedule::to_json (null: the plain schedule of config.train)
  nlohmann::json source;      // the TrainingSource's own state (null for stateless sources)
  nlohmann::json extra;       // free-form (last losses, versions)
};

// "step-000042"
std::string checkpoint_name(int64_t step);

// Writes a checkpoint for `state.step` under run_dir, points `latest` at it and, with keep_last
// > 0, removes all but the newest keep_last step directories. Returns its directory.
std::string save_checkpoint(const std::string& run_dir, const ParamStore& params,
                            const Tensor& adam_m, const Tensor& adam_v, const CheckpointState& state,
                            int64_t keep_last = 0);

// Reads and checks state.json of the checkpoint directory `dir`.
CheckpointState read_checkpoint_state(const std::string& dir);
// Reads the checkpoint directory `dir` into params/m/v. Shapes must match the layout; every
// tensor's checksum is verified and every value must be finite. Errors name the file and tensor.
void load_checkpoint(const std::string& dir, ParamStore& params, Tensor* adam_m, Tensor* adam_v);

// The directory `checkpoints/latest` names; fails clearly if none.
std::string latest_checkpoint(const std::string& run_dir);

// Thrown by a load callback for a checkpoint that is intact but does not fit (another [model]):
// load_first_valid_checkpoint passes it on instead of falling back to an older checkpoint.
struct CheckpointMismatch : Error {
  using Error::Error;
};

// (step, directory) of every checkpoints/step-N directory of a run, by ascending step.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir);

// Calls `load(dir)` on checkpoints of `run` newest first until one succeeds, and returns its
// directory. `run` is a run directory, or a checkpoint directory (then only that one is tried).
// `which` ("step-N" or "N"; empty: the newest) asks for one checkpoint: then it alone is tried.
// A checkpoint whose load throws an Error is skipped with a line in `warnings` saying why and
// which one is used instead; when none loads, the error lists each failure. A
// CheckpointMismatch is not skipped: it ends the search.
std::string load_first_valid_checkpoint(const std::string& run, const std::string& which,
                                        const std::function<void(const std::string& dir)>& load,
                                        std::vector<std::string>* warnings);

// Removes all but the newest keep_last step directories (keep_last 0: none removed).
void prune_checkpoints(const std::string& run_dir, int64_t keep_last);

// Moves the step directories after `step` (a resume from an earlier checkpoint leaves them
// behind: another future of the run) into checkpoints/superseded-<UTC time>/; returns that
// directory, or "" when there were none.
std::string set_aside_checkpoints_after(const std::string& run_dir, int64_t step);

// Removes what killed writers left in the run directory and checkpoints/: temporary checkpoint
// directories (.step-N.tmp-PID) and temp files (.NAME.tmp-PID-...) of any process but this one.
// Call only while holding the run (RunLock), so no other process can be writing them. Returns
// how many were removed.
int remove_stale_temporaries(const std::string& run_dir);

}  // namespace fourbit
