// defines: split_name, TokenSource, sequence_number, make_token_source, unigram_entropy_nats
//          (data.h), check_batch_args (batch_checks.h)
#include "fourbit/train/data.h"

#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "fourbit/tensor/error.h"
#include "fourbit/train/batch_checks.h"
#include "fourbit/train/synthetic_source.h"
#include "fourbit/train/text_source.h"
#include "fourbit/train/token_shard_source.h"

namespace fourbit::data {

const char* split_name(Split split) {
  switch (split) {
    case Split::Train: return "train";
    case Split::Eval: return "eval";
  }
  fail("data: unknown Split value {}", int(split));
}

TokenSource::~TokenSource() = default;

int64_t sequence_number(int64_t index, int64_t B, int64_t b) {
  if (index < 0 || B < 1 || b < 0 || b >= B)
    fail("data: batch index {} row {} of batch size {}: expected index >= 0 and 0 <= row < "
         "batch size",
         index, b, B);
  // Kept below 2^62 so split_stream() can shift it left by one without losing a bit.
  constexpr int64_t kLimit = int64_t(1) << 62;
  if (index > (kLimit - b) / B)
    fail("data: batch index {} with batch size {} is beyond the 2^62 sequences of a split", index,
         B);
  return index * B + b;
}

void check_batch_args(std::string_view what, int64_t index, int64_t B, int64_t T,
                      const int32_t* tokens, const int32_t* targets) {
  if (index < 0) fail("{}: batch index must be >= 0, got {}", what, index);
  if (B < 1 || T < 1)
    fail("{}: batch shape must be positive, got batch_size {} and seq_len {}", what, B, T);
  if (!tokens || !targets) fail("{}: batch() needs token and target buffers, got null", what);
}

std::unique_ptr<TokenSource> make_token_source(const DataConfig& d, Split split, uint64_t seed,
                                               int64_t vocab_size) {
  const std::string_view src = d.source;
  const auto file_after = [&](std::string_view prefix) {
    std::string path(src.substr(prefix.size()));
    if (path.empty()) fail("data.source '{}' names no file (expected '{}FILE')", src, prefix);
    return path;
  };
  if (src == "synthetic") {
    check_vocab_size(vocab_size);
    return std::make_unique<SyntheticSource>(split, seed, d.arithmetic_fraction);
  }
  if (src.starts_with("text:")) {
    check_vocab_size(vocab_size);
    return std::make_unique<TextFileSource>(file_after("text:"), split, seed, d.eval_fraction);
  }
  if (src.starts_with("tokens:"))
    return std::make_unique<TokenShardSource>(file_after("tokens:"), split, seed,
                                              d.eval_fraction, vocab_size);
  fail("data.source must be 'synthetic', 'text:FILE' or 'tokens:FILE', got '{}'", src);
}

double unigram_entropy_nats(const TokenSource& src, int64_t batches, int64_t B, int64_t T) {
  if (batches < 1 || B < 1 || T < 1)
    fail("unigram_entropy_nats: batches, batch size and seq_len must be >= 1, got {}, {}, {}",
         batches, B, T);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  std::vector<int64_t> counts;
  for (int64_t i = 0; i < batches; ++i) {
    src.batch(i, B, T, tokens.data(), targets.data());
    for (int32_t t : targets) {
      if (t < 0) fail("unigram_entropy_nats: {} produced a negative token id {}", src.describe(), t);
      if (size_t(t) >= counts.size()) counts.resize(size_t(t) + 1, 0);
      ++counts[size_t(t)];
    }
  }
  const double total = double(batches * B * T);
  double h = 0;
  for (int64_t c : counts)
    if (c) h -= double(c) / total * std::log(double(c) / total);
  return h;
}

}  // namespace fourbit::data
