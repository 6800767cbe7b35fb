// defines: SyntheticSource
// The embedded default corpus: documents from the grammar language (grammar.h) and arithmetic
// (arithmetic.h), each sequence "<bos> doc <eos> <bos> doc <eos> ..." cut at T+1 tokens. Sequence
// s of a split is a pure function of (seed, split, s), drawn from SequenceRng(seed, split, s).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fourbit/train/data.h"

namespace fourbit::data {

class SyntheticSource : public TokenSource {
 public:
  // arithmetic_fraction in [0, 1]: the probability that a document is arithmetic.
  SyntheticSource(Split split, uint64_t seed, double arithmetic_fraction);

  void batch(int64_t index, int64_t B, int64_t T, int32_t* tokens,
             int32_t* targets) const override;
  std::string describe() const override;

  // The first `length` tokens of sequence number `sequence` (batch() rows are these, length T+1).
  std::vector<int32_t> sequence(int64_t sequence, int64_t length) const;

 private:
  Split split_;
  uint64_t seed_;
  double arithmetic_fraction_;
};

}  // namespace fourbit::data
