// defines: GenSpec, parse_gen_spec, generate_matrix, kGenHelp
// Seeded test matrices for `fourbit quant --gen`. The generators are written out here (not
// std::normal_distribution & co., whose algorithms differ between standard libraries) so a seed
// means the same matrix wherever fourbit is built; only std::mt19937_64's raw output is used.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fourbit/tensor/tensor.h"

namespace fourbit::cli {

struct GenSpec {
  enum class Kind { Normal, StudentT, Outliers } kind = Kind::Normal;
  double nu = 0.0;   // Student-t degrees of freedom
  std::string text;  // as given on the command line
};

// "normal", "student-t:NU" (NU any positive finite number) or "outliers"; nullopt otherwise.
std::optional<GenSpec> parse_gen_spec(std::string_view s);

// An F32 [rows, cols] CPU tensor drawn as kGenHelp describes.
Tensor generate_matrix(const GenSpec& spec, int64_t rows, int64_t cols, uint64_t seed);

inline constexpr const char* kGenHelp =
    "Generators (--gen), all driven by std::mt19937_64(--seed), values drawn in row-major order:\n"
    "  uniform u = (next() >> 11) * 2^-53; normals by Box-Muller in pairs,\n"
    "  z0 = sqrt(-2 ln(1 - u1)) cos(2 pi u2), z1 = ... sin(2 pi u2), computed in double.\n"
    "  normal        N(0, 1).\n"
    "  student-t:NU  Student-t with NU > 0 degrees of freedom: t = z / sqrt(2 g / NU), z ~ "
    "N(0,1),\n"
    "                g ~ Gamma(NU/2) by Marsaglia-Tsang (for NU/2 < 1: Gamma(NU/2 + 1) * "
    "u^(2/NU)).\n"
    "                student-t:3 has heavy tails (variance 3).\n"
    "  outliers      N(0, 1), then k = max(1, round(n / 1000)) of the n entries (0.1%), chosen\n"
    "                uniformly without replacement by selection sampling, multiplied by 100.\n"
    "  Values are rounded once from double to float32.";

}  // namespace fourbit::cli
