// defines: check_batch_args
// The argument checks every TokenSource::batch() makes before it writes anything.
#pragma once
#include <cstdint>
#include <string_view>

namespace fourbit::data {

// `what` names the source in the message ("corpus.txt", "synthetic data").
void check_batch_args(std::string_view what, int64_t index, int64_t B, int64_t T,
                      const int32_t* tokens, const int32_t* targets);

}  // namespace fourbit::data
