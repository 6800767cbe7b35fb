// defines: FOURBIT_HD, FOURBIT_UNROLL, bits_of, float_of, bits_of64, double_of, is_finite_bits, is_nan_bits,
//          pow2f, abs_bits, mul_rn, add_rn, sub_rn, div_rn, sqrt_rn, dmul_rn, dadd_rn, dsub_rn, ddiv_rn,
//          dfma_rn, max_abs_finite
// The host/device qualifier and the few bit-level helpers every codec needs. Everything in
// numerics/ is header-only and compiled both by the host compiler and by nvcc, so one definition
// of each rounding rule serves the CPU loops and the CUDA kernels (NUMERICS: "one scalar definition").
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FOURBIT_HD __host__ __device__ __forceinline__
#define FOURBIT_UNROLL _Pragma("unroll")
#else
#define FOURBIT_HD inline
#define FOURBIT_UNROLL _Pragma("GCC unroll 32")
#endif

namespace fourbit::num {

FOURBIT_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FOURBIT_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

FOURBIT_HD uint64_t bits_of64(double x) {
#if defined(__CUDA_ARCH__)
  return uint64_t(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FOURBIT_HD double double_of(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double((long long)u);
#else
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// True for every float that is neither Inf nor NaN (exponent field not all ones).
FOURBIT_HD bool is_finite_bits(float x) { return (bits_of(x) & 0x7f800000u) != 0x7f800000u; }
FOURBIT_HD bool is_nan_bits(float x) { return (bits_of(x) & 0x7fffffffu) > 0x7f800000u; }

// 2^k as an exact float32 for k in [-149, 127] (subnormal below -126); 0 below, +Inf above.
FOURBIT_HD float pow2f(int k) {
  if (k > 127) return float_of(0x7f800000u);
  if (k >= -126) return float_of(uint32_t(k + 127) << 23);
  if (k >= -149) return float_of(1u << (k + 149));
  return 0.0f;
}

FOURBIT_HD float abs_bits(float x) { return float_of(bits_of(x) & 0x7fffffffu); }

// Float arithmetic that is never fused into an FMA, whatever the compiler flags: the numerics
// contract fixes every rounding step (NUMERICS: "no fused multiply-add contraction"). Host code is
// compiled with -ffp-contract=off; on the device the _rn intrinsics are never contracted.
FOURBIT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FOURBIT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FOURBIT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

FOURBIT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
FOURBIT_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

// The same for double, and the fused multiply-add where a formula asks for one (one rounding of
// a * b + c, on the host by the FMA instruction or libm's exact emulation): the operations from
// which exp_hd and log_hd (numerics/exp_log.h) build results every backend rounds alike.
FOURBIT_HD double dmul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FOURBIT_HD double dadd_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
FOURBIT_HD double dsub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
FOURBIT_HD double ddiv_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
FOURBIT_HD double dfma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return __builtin_fma(a, b, c);
#endif
}

// max that ignores neither operand's order: a NaN never wins (callers track non-finite inputs
// separately: ops::QuantReport::nonfinite), so the result depends only on the set of finite values.
FOURBIT_HD float max_abs_finite(float acc, float x) {
  float a = abs_bits(x);
  return (is_finite_bits(a) && a > acc) ? a : acc;
}

}  // namespace fourbit::num
