// defines: split_stream, SequenceRng
// The random draws behind one sequence of one split. Philox is keyed by the seed and the counter
// stream is (sequence number, split), so sequences are independent of each other, of the order
// they are asked for, and of any global state.
#pragma once
#include <cstdint>

#include "fourbit/numerics/philox.h"
#include "fourbit/train/data.h"

namespace fourbit::data {

// Low bit: the split; the rest: the sequence number (< 2^63, checked by sequence_number()).
constexpr uint64_t split_stream(Split split, int64_t sequence) {
  return (uint64_t(sequence) << 1) | (split == Split::Eval ? 1u : 0u);
}

class SequenceRng {
 public:
  SequenceRng(uint64_t seed, Split split, int64_t sequence)
      : bits_(seed, split_stream(split, sequence)) {}

  uint32_t next_u32() { return bits_.at(next_++); }
  uint64_t next_u64() {
    const uint64_t hi = next_u32();
    return (hi << 32) | next_u32();
  }
  // Uniform in [0, n) for n >= 1. Multiply-shift: the bias is below n / 2^32, far under anything a
  // corpus statistic could see, and every call costs exactly one draw.
  uint32_t below(uint32_t n) { return uint32_t((uint64_t(next_u32()) * n) >> 32); }
  // True with probability p: exactly never for p <= 0, always for p >= 1.
  bool chance(double p) { return double(next_u32()) * 0x1p-32 < p; }

 private:
  num::RandomBits bits_;
  uint64_t next_ = 0;
};

}  // namespace fourbit::data
