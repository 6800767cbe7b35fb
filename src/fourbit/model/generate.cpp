// defines: greedy_generate
#include "fourbit/model/generate.h"

#include <algorithm>

#include "fourbit/tensor/error.h"

namespace fourbit {

std::vector<int32_t> greedy_generate(Model& m, const std::vector<int32_t>& prompt, int64_t max_new,
                                     int32_t stop_token) {
  if (prompt.empty()) fail("generate: the prompt is empty");
  std::vector<int32_t> seq = prompt;
  const int64_t window = m.config().max_seq_len, V = m.config().vocab_size;
  for (int64_t i = 0; i < max_new; ++i) {
    const int64_t start = std::max<int64_t>(0, int64_t(seq.size()) - window);
    const int64_t T = int64_t(seq.size()) - start;
    const Tensor tokens = Tensor::from_host(seq.data() + start, {1, T}, DType::I32, m.device());
    const Tensor logits = m.logits(tokens, SrStreams{}).to(Device::CPU);
    const float* last = logits.data<float>() + (T - 1) * V;
    const int32_t next = int32_t(std::max_element(last, last + V) - last);  // ties: lowest id
    seq.push_back(next);
    if (next == stop_token) break;
  }
  return std::vector<int32_t>(seq.begin() + int64_t(prompt.size()), seq.end());
}

}  // namespace fourbit
