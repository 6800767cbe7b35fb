// defines: CheckpointState, save_checkpoint, load_checkpoint, latest_checkpoint
// A checkpoint is a directory RUN/checkpoints/step-NNNNNN/ with model.safetensors (parameters
// by name, F32), optim.safetensors (AdamW moments m.NAME, v.NAME) and state.json (config, recipe,
// step, seed, data position). It is written into a temporary directory, every file fsynced,
// then renamed into place, so a crash or a failed write never leaves a partial checkpoint and
// never touches an earlier one. RUN/checkpoints/latest names the newest (written atomically).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/model/params.h"

namespace fourbit {

struct CheckpointState {
  RunConfig config;
  std::string recipe;
  int64_t step = 0;           // optimizer steps completed
  uint64_t seed = 0;          // run seed (SR streams and data derive from it and the step)
  int64_t tokens_seen = 0;
  nlohmann::json extra;       // free-form (last losses, versions)
};

// Writes a checkpoint for `state.step` under run_dir; returns its directory.
std::string save_checkpoint(const std::string& run_dir, const ParamStore& params,
                            const Tensor& adam_m, const Tensor& adam_v, const CheckpointState& state);

// Reads the checkpoint directory `dir` into params/m/v (shapes must match the layout of the
// config saved in it; every mismatch is an error naming the file and tensor).
CheckpointState read_checkpoint_state(const std::string& dir);
void load_checkpoint(const std::string& dir, ParamStore& params, Tensor* adam_m, Tensor* adam_v);

// The newest checkpoint directory of a run (from checkpoints/latest); fails clearly if none.
std::string latest_checkpoint(const std::string& run_dir);

}  // namespace fourbit
