// defines: HfCheckpoint, read_qwen2_moe, ImportOptions, ImportSummary, import_hf, config_toml
// `fourbit import`: a Hugging Face qwen2_moe checkpoint (config.json + model.safetensors, or
// shards listed by model.safetensors.index.json; BF16, F16 or F32 tensors; per-expert tensor
// names or transformers 5's fused experts.gate_up_proj / experts.down_proj) into a fourbit run
// directory at step 0, which `generate`, `score`, `export` and `pretrain --resume` accept.
// Everything fourbit cannot compute exactly fails with one error naming it: another
// architecture, sliding windows, RoPE scaling, non-zero q/k/v biases, a shared expert whose gate
// is not constant (a zero gate is sigmoid(0) = 1/2, folded into the down projection), tensors
// the mapping has no place for, missing tensors and shapes that disagree with config.json.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fourbit/model/config.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::hf {

struct HfCheckpoint {
  ModelConfig config;
  std::map<std::string, Tensor> params;  // F32 CPU tensors by fourbit parameter name (views of one buffer)
  nlohmann::json hf_config;              // config.json as read
  std::vector<std::string> notes;        // what was folded or dropped, for the user
};
HfCheckpoint read_qwen2_moe(const std::string& dir);

struct ImportOptions {
  std::string hf_dir;
  std::string out_dir;                // the new run directory
  std::string recipe = "nvfp4-fwd";   // the recipe the run trains (and generates) with
  uint64_t seed = 1234;
};

struct ImportSummary {
  std::string checkpoint_dir;
  ModelConfig config;
  int64_t params = 0;
  std::vector<std::string> notes;
};
ImportSummary import_hf(const ImportOptions& o);

// A run config as TOML that load_config reads back to the same values (an imported run's
// config.toml, to edit into the config of a run that starts from it with --init).
std::string config_toml(const RunConfig& c);

}  // namespace fourbit::hf
