// defines: draw_arithmetic_problem, arithmetic_line, append_arithmetic_document (arithmetic.h)
#include "fourbit/train/arithmetic.h"

#include <utility>

#include <fmt/format.h>

namespace fourbit::data {

ArithmeticProblem draw_arithmetic_problem(SequenceRng& rng) {
  constexpr char kOps[3] = {'+', '-', '*'};
  ArithmeticProblem p;
  p.op = kOps[rng.below(3)];
  p.a = int(rng.below(100));
  p.b = int(rng.below(100));
  if (p.op == '-' && p.a < p.b) std::swap(p.a, p.b);
  return p;
}

std::string arithmetic_line(const ArithmeticProblem& p) {
  return fmt::format("{}{}{}={}", p.a, p.op, p.b, p.result());
}

void append_arithmetic_document(SequenceRng& rng, std::string& out) {
  const uint32_t lines = 2 + rng.below(5);
  for (uint32_t i = 0; i < lines; ++i) {
    out += arithmetic_line(draw_arithmetic_problem(rng));
    out += '\n';
  }
}

}  // namespace fourbit::data
