// defines: WeightCodes, nvfp4_weight_codes, fraction_changed
// The NVFP4 codes of a model's weights as the forward uses them (Model::forward_weight), to
// measure how many 4-bit codes an optimizer step changes: RL's small updates may move few codes
// across a rounding boundary, and a step that changes none leaves the policy exactly as it was.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fourbit/model/model.h"

namespace fourbit::rl {

struct WeightCodes {
  std::map<std::string, std::vector<uint8_t>> packed;  // linear name -> packed codes (host)
  int64_t codes = 0;                                   // logical 4-bit codes over all of them
  bool empty() const { return packed.empty(); }
};

// The packed NVFP4 codes of every linear whose forward weight operand is NVFP4 (none for recipes
// without NVFP4 weights). Prepares the weights the forward would, into its cache.
WeightCodes nvfp4_weight_codes(Model& model);

// The fraction of 4-bit codes that differ between two snapshots of the same model (0 when empty).
double fraction_changed(const WeightCodes& before, const WeightCodes& after);

}  // namespace fourbit::rl
