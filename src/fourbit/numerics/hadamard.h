// defines: kNvidiaRht16Signs, hadamard_norm, hadamard_transform, rht_forward, rht_inverse, rht_signs
// Random Hadamard transform on chunks of n = 16 or 32 values (NUMERICS "Random Hadamard
// transform"): RHT(x) = (x . s) H_n / sqrt(n), inverse (y H_n / sqrt(n)) . s, with H_n the
// Sylvester matrix H[i][j] = (-1)^popcount(i & j) (symmetric, H H = n I).
#pragma once
#include "fourbit/numerics/philox.h"

namespace fourbit::num {

// NVIDIA's fixed 16-point sign mask: bit i set means s_i = -1.
inline constexpr uint32_t kNvidiaRht16Signs = 0xD7E8u;

// 1/sqrt(n) rounded to float32; for n = 16 it is exactly 0.25.
FOURBIT_HD float hadamard_norm(int n) { return n == 16 ? 0.25f : 0.17677669529663688f; }

// In place x <- H_n x / sqrt(n) by the iterative butterfly. The butterfly order is part of the
// contract: CPU and GPU run this same loop, so the float32 sums round identically.
template <int N>
FOURBIT_HD void hadamard_transform(float* x) {
  static_assert(N == 16 || N == 32, "Hadamard size is 16 or 32");
FOURBIT_UNROLL
  for (int h = 1; h < N; h *= 2) {
FOURBIT_UNROLL
    for (int i = 0; i < N; i += 2 * h) {
FOURBIT_UNROLL
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float norm = hadamard_norm(N);
FOURBIT_UNROLL
  for (int i = 0; i < N; ++i) x[i] *= norm;
}

template <int N>
FOURBIT_HD void rht_forward(float* x, uint32_t signs) {
FOURBIT_UNROLL
  for (int i = 0; i < N; ++i)
    if ((signs >> i) & 1u) x[i] = -x[i];
  hadamard_transform<N>(x);
}

template <int N>
FOURBIT_HD void rht_inverse(float* y, uint32_t signs) {
  hadamard_transform<N>(y);
FOURBIT_UNROLL
  for (int i = 0; i < N; ++i)
    if ((signs >> i) & 1u) y[i] = -y[i];
}

// A seeded sign vector for one (run, layer): the low n bits of a Philox draw. Recorded in
// checkpoints through its (seed, stream) pair.
FOURBIT_HD uint32_t rht_signs(uint64_t seed, uint64_t stream, int n) {
  const uint32_t r = random_bits(seed, stream, 0);
  return n >= 32 ? r : (r & ((1u << n) - 1u));
}

}  // namespace fourbit::num
