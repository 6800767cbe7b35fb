// defines: ArithmeticProblem, draw_arithmetic_problem, arithmetic_line, append_arithmetic_document
// The arithmetic half of the synthetic corpus, and the checkable tasks SFT/RL will reuse:
// "12+35=47", "90-13=77", "7*8=56", operands 0..99, results always correct, differences never
// negative.
#pragma once
#include <string>

#include "fourbit/train/sequence_rng.h"

namespace fourbit::data {

struct ArithmeticProblem {
  int a = 0;
  char op = '+';  // '+', '-' or '*'
  int b = 0;
  int result() const { return op == '+' ? a + b : op == '-' ? a - b : a * b; }
};

// Operator uniform over + - *, operands uniform over 0..99; for '-' the larger operand comes first.
ArithmeticProblem draw_arithmetic_problem(SequenceRng& rng);
// "a<op>b=result", no newline.
std::string arithmetic_line(const ArithmeticProblem& p);
// Two to six problems, each line ending in '\n'.
void append_arithmetic_document(SequenceRng& rng, std::string& out);

}  // namespace fourbit::data
