// defines: checkpoint_dir_for, LoadedRun, load_run, EffectiveWeights, effective_weights,
//          model_from_weights, prepared_to_f32
// A run's model as the ecosystem sees it. The "effective weights" are what the forward actually
// multiplies by: each linear layer's fprop weight operand (Model::forward_weight) dequantized
// exactly as the GEMM defines it (NVFP4: fl(fl(E2M1 x E4M3) x S_dec); MXFP8: E4M3 x 2^(E-127);
// BF16: the BF16 copy), everything else (embedding, norms) as stored. `fourbit export --format hf`
// writes them and `fourbit score --recipe fp32` computes with them.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "fourbit/model/model.h"
#include "fourbit/train/checkpoint.h"

namespace fourbit::hf {

// RUN/checkpoints/step-NNNNNN when `step` is given (failing with the steps there are when it is
// missing), else the latest checkpoint.
std::string checkpoint_dir_for(const std::string& run_dir, std::optional<int64_t> step);

struct LoadedRun {
  std::string checkpoint_dir;
  CheckpointState state;
  std::unique_ptr<Model> model;  // the run's recipe (or the one asked for), weights and input amax
};
// recipe: "" for the run's own.
LoadedRun load_run(const std::string& run_dir, std::optional<int64_t> step, const std::string& recipe,
                   Device device);

// Prepared fprop weight -> its exact F32 values in the logical shape, on the CPU.
Tensor prepared_to_f32(const Prepared& p);

struct EffectiveWeights {
  // The model's config, except tie_embeddings = false when the LM head's forward weight is not
  // the embedding itself (a BF16 LM head over an F32 embedding): then "lm_head" is its own tensor.
  ModelConfig config;
  bool tied_in_run = false;              // the run's own tie_embeddings
  std::map<std::string, Tensor> params;  // F32 CPU tensors by fourbit parameter name
};
EffectiveWeights effective_weights(Model& m);

// A model of `recipe` (fp32 for scoring effective weights) holding `w` on `device`.
std::unique_ptr<Model> model_from_weights(const EffectiveWeights& w, const std::string& recipe, Device device);

}  // namespace fourbit::hf
