// defines: ExportOptions, ExportSummary, export_run, hf_tensors
// `fourbit export`: a run's checkpoint as a Hugging Face qwen2_moe directory.
//  - format "hf": config.json + model.safetensors holding the effective weights (effective.h) in
//    BF16 (rounded to nearest even) or F32 (exact): what transformers, vLLM or SGLang load as an
//    ordinary unquantized model.
//  - format "modelopt": NVIDIA ModelOpt's unified HF layout with quant_algo MIXED_PRECISION
//    (hf_quant_config.json and config.json's quantization_config). Every linear layer is written
//    in the format its recipe trains it in, codes and block scales copied verbatim from the
//    model's prepared forward weights (no re-quantization): NVFP4 as `weight` (U8, two E2M1 codes
//    a byte, the even column in the low nibble), `weight_scale` (F8_E4M3 [out, in/16]),
//    `weight_scale_2` (F32, S_dec) and `input_scale` (F32, the recorded input amax / (6 * 448));
//    MXFP8 as `weight` (F8_E4M3) and `weight_scale` (U8 E8M0 [out, in/32]); everything else
//    (embedding, norms, router, shared-expert gate, BF16 layers) in BF16. docs/export.md.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fourbit/hf/effective.h"
#include "fourbit/hf/qwen2_moe.h"

namespace fourbit::hf {

struct ExportOptions {
  std::string run_dir;
  std::optional<int64_t> step;   // the latest checkpoint when absent
  std::string format = "hf";     // hf | modelopt
  std::string out_dir;           // created; must be empty if it exists
  std::string dtype = "bf16";    // hf: bf16 | f32
  bool mxfp8_as_bf16 = false;    // modelopt: write MXFP8 layers as their exact BF16 values
};

struct ExportSummary {
  std::string checkpoint_dir;
  int64_t tensors = 0;
  int64_t bytes = 0;
  int64_t nvfp4_modules = 0, mxfp8_modules = 0;
  ModelConfig config;  // as written (tie_embeddings may differ from the run's: effective.h)
};

ExportSummary export_run(const ExportOptions& o);

// The qwen2_moe tensors of effective weights `w` in dtype F32 or BF16, by hf_tensor_map order;
// `config` receives the config they follow (BF16 ties the LM head back to the embedding when the
// run tied them and both round to the same BF16 values).
std::vector<std::pair<std::string, Tensor>> hf_tensors(const EffectiveWeights& w, DType dtype, ModelConfig* config);

}  // namespace fourbit::hf
