// defines: test::RefFormat, kRefE2M1, kRefE4M3, kRefE5M2, ref_decode, ref_grid, ref_neighbours,
//          ref_nearest_code
// An oracle for the small float formats that shares no code with numerics/: every value is built
// from the NUMERICS.md table (sign, exponent field, mantissa field, bias, NaN/Inf codes) with
// std::ldexp in double. Tests decode, round and bracket with this, then compare with fourbit.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace fourbit::test {

struct RefFormat {
  const char* name;
  int exp_bits;
  int man_bits;
  int bias;
  bool fn_nan;    // "fn": only the all-ones magnitude code is NaN, no Inf (E4M3)
  bool ieee_inf;  // IEEE-like: exponent all ones is Inf (mantissa 0) or NaN (E5M2)
  bool no_nan;    // every code is a number (E2M1)
  int code_bits() const { return 1 + exp_bits + man_bits; }
  uint32_t sign_bit() const { return 1u << (exp_bits + man_bits); }
};

inline constexpr RefFormat kRefE2M1{"e2m1", 2, 1, 1, false, false, true};
inline constexpr RefFormat kRefE4M3{"e4m3", 4, 3, 7, true, false, false};
inline constexpr RefFormat kRefE5M2{"e5m2", 5, 2, 15, false, true, false};

// The value of `code` from the field layout; NaN codes give a quiet NaN, E5M2 0x7C/0xFC +-Inf.
inline double ref_decode(const RefFormat& f, uint32_t code) {
  const bool neg = (code & f.sign_bit()) != 0;
  const uint32_t mag = code & (f.sign_bit() - 1u);
  const uint32_t e = mag >> f.man_bits;
  const uint32_t m = mag & ((1u << f.man_bits) - 1u);
  const uint32_t e_all = (1u << f.exp_bits) - 1u;
  double v;
  if (f.fn_nan && e == e_all && m == ((1u << f.man_bits) - 1u)) {
    return std::numeric_limits<double>::quiet_NaN();
  } else if (f.ieee_inf && e == e_all) {
    if (m != 0) return std::numeric_limits<double>::quiet_NaN();
    v = std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(double(m), 1 - f.bias - f.man_bits);  // subnormal: 0.m * 2^(1-bias)
  } else {
    v = std::ldexp(double((1u << f.man_bits) + m), int(e) - f.bias - f.man_bits);  // 1.m * 2^(e-bias)
  }
  return neg ? -v : v;
}

struct GridPoint {
  double value;
  uint32_t code;
};

// The finite non-negative values of the format with their (sign-clear) codes, ascending; the
// first entry is 0, the last the largest finite value.
inline std::vector<GridPoint> ref_grid(const RefFormat& f) {
  std::vector<GridPoint> g;
  for (uint32_t c = 0; c < f.sign_bit(); ++c) {
    const double v = ref_decode(f, c);
    if (std::isfinite(v)) g.push_back({v, c});
  }
  std::sort(g.begin(), g.end(), [](const GridPoint& a, const GridPoint& b) { return a.value < b.value; });
  return g;
}

inline double ref_max(const RefFormat& f) { return ref_grid(f).back().value; }

// lo <= |x| <= hi on the magnitude grid (lo == hi when |x| is representable). |x| <= max.
struct Bracket {
  GridPoint lo, hi;
};
inline Bracket ref_neighbours(const std::vector<GridPoint>& grid, double ax) {
  auto it = std::lower_bound(grid.begin(), grid.end(), ax,
                             [](const GridPoint& p, double v) { return p.value < v; });
  if (it == grid.end()) return {grid.back(), grid.back()};  // above max: callers avoid this
  if (it->value == ax) return {*it, *it};
  return {*(it - 1), *it};
}

// Round-to-nearest-even with saturation, computed by search over the grid: the code whose value
// is nearest to x; on a tie the even code. Sign kept (also for zero). Finite x only.
inline uint32_t ref_nearest_code(const RefFormat& f, const std::vector<GridPoint>& grid, double x) {
  const uint32_t sign = std::signbit(x) ? f.sign_bit() : 0u;
  const double ax = std::fabs(x);
  if (ax >= grid.back().value) return sign | grid.back().code;  // satfinite
  const Bracket b = ref_neighbours(grid, ax);
  if (b.lo.code == b.hi.code) return sign | b.lo.code;
  const double dlo = ax - b.lo.value, dhi = b.hi.value - ax;  // exact in double
  if (dlo < dhi) return sign | b.lo.code;
  if (dhi < dlo) return sign | b.hi.code;
  return sign | ((b.lo.code & 1u) == 0 ? b.lo.code : b.hi.code);
}

}  // namespace fourbit::test
