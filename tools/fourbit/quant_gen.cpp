// defines: parse_gen_spec, generate_matrix (quant_gen.h)
#include "tools/fourbit/quant_gen.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numbers>
#include <random>

namespace fourbit::cli {
namespace {

// The draws of kGenHelp, one stream per matrix.
class Draws {
 public:
  explicit Draws(uint64_t seed) : rng_(seed) {}

  double uniform() { return double(rng_() >> 11) * 0x1.0p-53; }  // [0, 1)

  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = uniform(), u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(1.0 - u1));  // 1 - u1 is in (0, 1]
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(angle);
    has_spare_ = true;
    return r * std::cos(angle);
  }

  // Gamma(a, 1) by Marsaglia & Tsang (2000); a < 1 through Gamma(a + 1) * u^(1/a).
  double gamma(double a) {
    if (a < 1.0) {
      const double g = gamma(a + 1.0);
      return g * std::pow(1.0 - uniform(), 1.0 / a);
    }
    const double d = a - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
    while (true) {
      const double z = normal();
      const double t = 1.0 + c * z;
      if (t <= 0.0) continue;
      const double v = t * t * t;
      const double u = 1.0 - uniform();
      if (std::log(u) < 0.5 * z * z + d - d * v + d * std::log(v)) return d * v;
    }
  }

 private:
  std::mt19937_64 rng_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

}  // namespace

std::optional<GenSpec> parse_gen_spec(std::string_view s) {
  GenSpec g;
  g.text = std::string(s);
  if (s == "normal") return g;
  if (s == "outliers") {
    g.kind = GenSpec::Kind::Outliers;
    return g;
  }
  constexpr std::string_view prefix = "student-t:";
  if (s.substr(0, prefix.size()) != prefix) return std::nullopt;
  const std::string_view num = s.substr(prefix.size());
  double nu = 0.0;
  const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), nu);
  if (ec != std::errc() || end != num.data() + num.size() || !std::isfinite(nu) || nu <= 0.0)
    return std::nullopt;
  g.kind = GenSpec::Kind::StudentT;
  g.nu = nu;
  return g;
}

Tensor generate_matrix(const GenSpec& spec, int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::F32);
  float* x = t.data<float>();
  const int64_t n = rows * cols;
  Draws draws(seed);
  switch (spec.kind) {
    case GenSpec::Kind::Normal:
    case GenSpec::Kind::Outliers:
      for (int64_t i = 0; i < n; ++i) x[i] = float(draws.normal());
      break;
    case GenSpec::Kind::StudentT:
      for (int64_t i = 0; i < n; ++i) {
        const double z = draws.normal();
        const double g = draws.gamma(spec.nu / 2.0);
        x[i] = float(z / std::sqrt(2.0 * g / spec.nu));
      }
      break;
  }
  if (spec.kind == GenSpec::Kind::Outliers && n > 0) {
    // Selection sampling (Knuth's Algorithm S): entry i is taken with probability
    // (still needed) / (still left), which picks exactly k entries, all subsets equally likely.
    int64_t need = std::max<int64_t>(1, std::llround(double(n) / 1000.0));
    for (int64_t i = 0; i < n && need > 0; ++i) {
      if (draws.uniform() * double(n - i) < double(need)) {
        x[i] *= 100.0f;
        --need;
      }
    }
  }
  return t;
}

}  // namespace fourbit::cli
