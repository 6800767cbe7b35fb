// defines: Rounding, SigExp, split_float, clz32, split_normalized, shift_round_rne, shift_round_sr,
//          shift_round
// The one place where fourbit drops low-order bits. Every encoder (E2M1, E4M3, E5M2, S2F6, UE8M0
// scale choice) reduces a float32 to an integer significand and a shift, then rounds here.
// Integer arithmetic only, so host and device agree bit for bit by construction.
#pragma once
#include "fourbit/numerics/hd.h"

namespace fourbit::num {

enum class Rounding : uint8_t { RNE = 0, SR = 1 };

// |x| = sig * 2^(exp2 - 23), with sig < 2^24 (the implicit bit included for normal floats).
struct SigExp {
  uint32_t sig;
  int exp2;  // unbiased exponent of the leading bit position 23
};

FOURBIT_HD SigExp split_float(float x) {
  const uint32_t u = bits_of(x) & 0x7fffffffu;
  const int biased = int(u >> 23);
  const uint32_t frac = u & 0x7fffffu;
  if (biased == 0) return {frac, -126};  // subnormal: no implicit bit
  return {frac | 0x800000u, biased - 127};
}

// Leading-zero count of a nonzero 32-bit word.
FOURBIT_HD int clz32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(int(v));
#else
  return __builtin_clz(v);
#endif
}

// |x| = sig * 2^(exp2 - 23) with bit 23 of sig set: float32 subnormals are normalised (exactly,
// by shifting). x must be finite and nonzero.
FOURBIT_HD SigExp split_normalized(float x) {
  SigExp se = split_float(x);
  const int lz = clz32(se.sig) - 8;  // 0 for normal floats
  return {se.sig << lz, se.exp2 - lz};
}

// round(sig / 2^shift) to nearest, ties to even; shift >= 0. Branch-free: adding half - 1 plus
// the kept LSB carries into the kept bits exactly when the remainder is above half, or equal to
// half with an odd kept value (sig < 2^24 and shift <= 25, so nothing overflows 32 bits).
FOURBIT_HD uint32_t shift_round_rne(uint32_t sig, int shift) {
  if (shift <= 0) return sig;       // callers never pass a negative shift with a nonzero sig
  if (shift > 25) return 0;          // sig < 2^24 <= half a quantum
  const uint32_t half_minus_one = (1u << (shift - 1)) - 1u;
  return (sig + half_minus_one + ((sig >> shift) & 1u)) >> shift;
}

// Stochastic rounding of sig / 2^shift with 16 random bits (NUMERICS "Stochastic rounding": add
// a uniform random integer below the kept least-significant bit, truncate). rnd16: the element's
// 16 bits (sr_bits, philox.h; higher bits are ignored). The remainder's top 16 bits,
// floor(sig * 2^(16 - shift)) mod 2^16, plus rnd16 carries into the kept bits with probability
// remainder / 2^16: for shift <= 16 that floor is exact, so P(round up) = rem / 2^shift exactly;
// for shift > 16 the remainder is truncated to its top 16 bits first (a bias below 2^-16 of one
// quantum, toward zero). One formula for both: floor((floor(sig * 2^(16 - shift)) + rnd16) / 2^16)
// = floor(sig / 2^shift) + carry (sig an integer, so flooring sig * 2^(16 - shift) first changes
// no carry when shift <= 16).
FOURBIT_HD uint32_t shift_round_sr(uint32_t sig, int shift, uint32_t rnd16) {
  if (shift <= 0) return sig;
  if (shift >= 16 + 24) return 0;  // sig < 2^24: the top 16 remainder bits are 0, never rounds up
  const uint64_t scaled = (uint64_t(sig) << 16) >> shift;
  return uint32_t((scaled + (rnd16 & 0xFFFFu)) >> 16);
}

FOURBIT_HD uint32_t shift_round(uint32_t sig, int shift, Rounding mode, uint32_t rnd) {
  return mode == Rounding::SR ? shift_round_sr(sig, shift, rnd) : shift_round_rne(sig, shift);
}

}  // namespace fourbit::num
