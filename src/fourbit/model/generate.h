// defines: greedy_generate
// Greedy decoding through the training forward (Model::logits), so samples come from exactly the
// function being trained. Each new token recomputes the window of the last max_seq_len tokens;
// the KV-cache sampler (rl/) will replace this for long generations.
#pragma once
#include <cstdint>
#include <vector>

#include "fourbit/model/model.h"

namespace fourbit {

std::vector<int32_t> greedy_generate(Model& m, const std::vector<int32_t>& prompt, int64_t max_new,
                                     int32_t stop_token);

}  // namespace fourbit
