// defines: Philox4x32, philox4x32_10, random_bits4, random_bits, RandomBits, kSrPerCall, sr_bits_of, sr_bits, SrBits,
//          mix64, fnv1a64
// Counter-based random numbers (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): Philox-4x32 with 10 rounds. A draw is a pure function of (seed, stream, index), so the
// stochastic rounding of element i is the same on the CPU, on the GPU and under any thread layout
// (NUMERICS "Stochastic rounding").
#pragma once
#include "fourbit/numerics/hd.h"

namespace fourbit::num {

struct Philox4x32 {
  uint32_t v[4];
};

FOURBIT_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * ctr.v[0];
    const uint64_t p1 = uint64_t(kMul1) * ctr.v[2];
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ key0, lo1, hi0 ^ ctr.v[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

// splitmix64's finaliser: how a stream id is folded from several key fields (each xored in, then
// mixed), so that no two fields share bits (SrStreams::key, the sampler's draws, task problems).
FOURBIT_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// FNV-1a (64-bit) of n bytes, from h: how a name or a tensor's bytes become a key field (a site
// name in SrStreams::key, a task's name, a problem's text, the weights a cache was made from).
FOURBIT_HD uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// The four 32-bit words for elements 4*group .. 4*group+3 of (seed, stream). Counter layout:
// (group lo, group hi, stream lo, stream hi); key: (seed lo, seed hi).
FOURBIT_HD Philox4x32 random_bits4(uint64_t seed, uint64_t stream, uint64_t group) {
  return philox4x32_10(Philox4x32{{uint32_t(group), uint32_t(group >> 32), uint32_t(stream),
                                   uint32_t(stream >> 32)}},
                       uint32_t(seed), uint32_t(seed >> 32));
}

// A 32-bit word: word index % 4 of group index / 4 (RHT sign masks, the data generators; SR
// draws sr_bits).
FOURBIT_HD uint32_t random_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return random_bits4(seed, stream, index >> 2).v[index & 3];
}

// Sequential reader of 32-bit words over one (seed, stream) (the data generators' draws): at(i) ==
// random_bits(seed, stream, i), computing each Philox block once for runs of consecutive indices.
struct RandomBits {
  uint64_t seed, stream;
  uint64_t group = ~uint64_t(0);
  Philox4x32 words{{0, 0, 0, 0}};
  FOURBIT_HD RandomBits(uint64_t seed_, uint64_t stream_) : seed(seed_), stream(stream_) {}
  FOURBIT_HD uint32_t at(uint64_t index) {
    if ((index >> 2) != group) {
      group = index >> 2;
      words = random_bits4(seed, stream, group);
    }
    return words.v[index & 3];
  }
};

// NUMERICS "Stochastic rounding": an SR element draws 16 bits, one Philox call serving 8
// elements: element k of a call (k = index % 8) takes half k % 2 (the low half first) of word
// k / 2. kSrPerCall elements per call; sr_bits_of(r, k) is element k's draw from call r.
inline constexpr int kSrPerCall = 8;
FOURBIT_HD uint32_t sr_bits_of(const Philox4x32& r, int k) {
  return (r.v[(k >> 1) & 3] >> (16 * (k & 1))) & 0xFFFFu;
}

// The 16 SR bits of element `index` of (seed, stream): element index % 8 of call index / 8.
FOURBIT_HD uint32_t sr_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return sr_bits_of(random_bits4(seed, stream, index >> 3), int(index & 7));
}

// Sequential reader over one (seed, stream): at(i) == sr_bits(seed, stream, i), computing each
// Philox call once for runs of consecutive indices.
struct SrBits {
  uint64_t seed, stream;
  uint64_t group = ~uint64_t(0);
  Philox4x32 words{{0, 0, 0, 0}};
  FOURBIT_HD SrBits(uint64_t seed_, uint64_t stream_) : seed(seed_), stream(stream_) {}
  FOURBIT_HD uint32_t at(uint64_t index) {
    if ((index >> 3) != group) {
      group = index >> 3;
      words = random_bits4(seed, stream, group);
    }
    return sr_bits_of(words, int(index & 7));
  }
};

}  // namespace fourbit::num
