// defines: SyntheticSource (synthetic_source.h)
#include "fourbit/train/synthetic_source.h"

#include "fourbit/tensor/error.h"
#include "fourbit/train/arithmetic.h"
#include "fourbit/train/batch_checks.h"
#include "fourbit/train/grammar.h"

namespace fourbit::data {

SyntheticSource::SyntheticSource(Split split, uint64_t seed, double arithmetic_fraction)
    : split_(split), seed_(seed), arithmetic_fraction_(arithmetic_fraction) {
  if (!(arithmetic_fraction >= 0 && arithmetic_fraction <= 1))
    fail("synthetic data: data.arithmetic_fraction must be in [0, 1], got {}",
         arithmetic_fraction);
}

std::vector<int32_t> SyntheticSource::sequence(int64_t sequence, int64_t length) const {
  if (sequence < 0 || length < 0)
    fail("synthetic data: sequence number and length must be >= 0, got {} and {}", sequence,
         length);
  SequenceRng rng(seed_, split_, sequence);
  std::vector<int32_t> out;
  out.reserve(size_t(length) + 256);
  std::string doc;
  while (int64_t(out.size()) < length) {
    doc.clear();
    if (rng.chance(arithmetic_fraction_))
      append_arithmetic_document(rng, doc);
    else
      append_grammar_document(rng, doc);
    out.push_back(kBos);
    for (char c : doc) out.push_back(int32_t(static_cast<unsigned char>(c)));
    out.push_back(kEos);
  }
  out.resize(size_t(length));
  return out;
}

void SyntheticSource::batch(int64_t index, int64_t B, int64_t T, int32_t* tokens,
                            int32_t* targets) const {
  check_batch_args("synthetic data", index, B, T, tokens, targets);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t> w = sequence(sequence_number(index, B, b), T + 1);
    for (int64_t t = 0; t < T; ++t) {
      tokens[b * T + t] = w[size_t(t)];
      targets[b * T + t] = w[size_t(t) + 1];
    }
  }
}

std::string SyntheticSource::describe() const {
  return fmt::format("synthetic (grammar + arithmetic, arithmetic_fraction {:.2f}, seed {}, {} split)",
                     arithmetic_fraction_, seed_, split_name(split_));
}

}  // namespace fourbit::data
