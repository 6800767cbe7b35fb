// defines: exp_hd, log_hd
// exp and the natural log of a double built only from operations IEEE 754 rounds one way
// (+, -, *, / and fused multiply-add, each rounded to nearest, in a fixed order), so the host and a
// CUDA kernel return the same bits for every input. Library exp/log do not: glibc's and CUDA's
// differ in the last bit for some inputs. The token draw (numerics/draw.h) uses these so that a
// draw on the GPU picks the CPU's token with the CPU's log-probability.
//
// Both are within one ulp of the exact value over their whole range (largest errors seen against
// long double in tests/numerics/exp_log_test.cpp: exp 0.61 ulp, 0.75 where the result is
// subnormal; log 0.80 ulp), so they are not always the correctly rounded value and may differ from
// std::exp / std::log in the last bit (about 1% and 3% of inputs).
#pragma once
#include <cstdint>

#include "fourbit/numerics/hd.h"

namespace fourbit::num {

namespace exp_log_detail {

// 2^k as a double for k in [-1022, 1023] (a normal number: the exponent field is k + 1023).
FOURBIT_HD double pow2d(int k) { return double_of(uint64_t(k + 1023) << 52); }

}  // namespace exp_log_detail

// e^x. NaN for NaN, +Inf above 710 and on overflow, +0 below -746 (e^-746 is under half the
// least subnormal) and where the result rounds to 0; exactly 1 at 0.
FOURBIT_HD double exp_hd(double x) {
  if (!(x == x)) return x;
  if (x > 710.0) return double_of(0x7ff0000000000000ull);
  if (x < -746.0) return 0.0;
  // x = k ln2 + r with k the nearest integer to x / ln2 (adding and subtracting 1.5 * 2^52 rounds
  // to an integer: |x / ln2| < 1077), |r| <= ln2 / 2, and r carried as r + r_lo: ln2 = head + tail
  // with 32 trailing zero bits in the head, so k head is exact and so is x - k head (the two are
  // within a factor 2 of each other where k != 0); the tail's product is added as a TwoSum.
  const double shift = 0x1.8p52;
  const double kd = dsub_rn(dadd_rn(dmul_rn(x, 0x1.71547652b82fep+0), shift), shift);
  const double r1 = dfma_rn(-kd, 0x1.62e42fee00000p-1, x);
  const double c = dmul_rn(-kd, 0x1.a39ef35793c76p-33);
  const double r = dadd_rn(r1, c);
  const double rv = dsub_rn(r, c);
  const double r_lo = dadd_rn(dsub_rn(r1, rv), dsub_rn(c, dsub_rn(r, rv)));
  // e^r by its Taylor series to r^13 / 13! (the first term left out is below 5e-18 relative):
  // 1 + (r + r^2 q), q = 1/2! + r/3! + ... in Horner form, one FMA a term, so that q's rounding
  // reaches the result scaled by r^2 and the last two roundings are all that is left.
  double q = 0x1.6124613a86d09p-33;  // 1/13!
  q = dfma_rn(q, r, 0x1.1eed8eff8d898p-29);  // 1/12!
  q = dfma_rn(q, r, 0x1.ae64567f544e4p-26);  // 1/11!
  q = dfma_rn(q, r, 0x1.27e4fb7789f5cp-22);  // 1/10!
  q = dfma_rn(q, r, 0x1.71de3a556c734p-19);  // 1/9!
  q = dfma_rn(q, r, 0x1.a01a01a01a01ap-16);  // 1/8!
  q = dfma_rn(q, r, 0x1.a01a01a01a01ap-13);  // 1/7!
  q = dfma_rn(q, r, 0x1.6c16c16c16c17p-10);  // 1/6!
  q = dfma_rn(q, r, 0x1.1111111111111p-7);   // 1/5!
  q = dfma_rn(q, r, 0x1.5555555555555p-5);   // 1/4!
  q = dfma_rn(q, r, 0x1.5555555555555p-3);   // 1/3!
  q = dfma_rn(q, r, 0.5);
  const double hi = dadd_rn(1.0, r);
  const double lo = dadd_rn(dsub_rn(1.0, hi), r);  // 1 + r = hi + lo exactly (|r| < 1)
  // e^(r + r_lo) = e^r + r_lo (1 + r) to far below the last place
  const double er = dadd_rn(hi, dfma_rn(dmul_rn(r, r), q, dfma_rn(r_lo, hi, lo)));
  // times 2^k in two exact halves, k in [-1077, 1025]: the first product is a normal number and
  // exact, the second rounds once (to a subnormal, 0 or Inf where the result is one).
  const int k = int(kd);
  const int k1 = k / 2;
  return dmul_rn(dmul_rn(er, exp_log_detail::pow2d(k1)), exp_log_detail::pow2d(k - k1));
}

// The natural log. NaN for NaN and negative x, -Inf at +-0, +Inf at +Inf; exactly 0 at 1.
FOURBIT_HD double log_hd(double x) {
  if (!(x > 0.0)) return x == 0.0 ? -double_of(0x7ff0000000000000ull) : double_of(0x7ff8000000000000ull);
  if (x == double_of(0x7ff0000000000000ull)) return x;
  // x = 2^e (1 + f), 1 + f in [sqrt(2)/2, sqrt(2)); subnormals scaled into the normal range first.
  int e = 0;
  if (x < 0x1p-1022) {
    x = dmul_rn(x, 0x1p54);
    e = -54;
  }
  const uint64_t b = bits_of64(x);
  e += int((b >> 52) & 0x7ff) - 1023;
  double m = double_of((b & 0x000fffffffffffffull) | 0x3ff0000000000000ull);
  if (m > 0x1.6a09e667f3bcdp+0) {
    m = dmul_rn(m, 0.5);
    e += 1;
  }
  const double f = dsub_rn(m, 1.0);  // exact (Sterbenz)
  // log(1 + f) = 2 atanh(s) with s = f / (2 + f), |s| < 0.172, written as
  // f - (f^2/2 - s (f^2/2 + R)) with R = 2 s^3/3 + 2 s^5/5 + ... divided by s: the exact f carries
  // the result, the rounded terms only a correction about f/2 of its size. R to s^20 (the first term
  // left out is below 1e-18 relative).
  const double s = ddiv_rn(f, dadd_rn(2.0, f));
  const double z = dmul_rn(s, s);
  double p = 0x1.8618618618618p-4;  // 2/21
  p = dfma_rn(p, z, 0x1.af286bca1af28p-4);  // 2/19
  p = dfma_rn(p, z, 0x1.e1e1e1e1e1e1ep-4);  // 2/17
  p = dfma_rn(p, z, 0x1.1111111111111p-3);  // 2/15
  p = dfma_rn(p, z, 0x1.3b13b13b13b14p-3);  // 2/13
  p = dfma_rn(p, z, 0x1.745d1745d1746p-3);  // 2/11
  p = dfma_rn(p, z, 0x1.c71c71c71c71cp-3);  // 2/9
  p = dfma_rn(p, z, 0x1.2492492492492p-2);  // 2/7
  p = dfma_rn(p, z, 0x1.999999999999ap-2);  // 2/5
  p = dfma_rn(p, z, 0x1.5555555555555p-1);  // 2/3
  const double R = dmul_rn(z, p);
  const double hfsq = dmul_rn(dmul_rn(0.5, f), f);
  // e ln2 from a head with 32 trailing zero bits (e times it is exact) and a tail.
  const double ed = double(e);
  const double tail = dfma_rn(s, dadd_rn(hfsq, R), dmul_rn(ed, 0x1.a39ef35793c76p-33));
  return dadd_rn(dmul_rn(ed, 0x1.62e42fee00000p-1), dsub_rn(f, dsub_rn(hfsq, tail)));
}

}  // namespace fourbit::num
