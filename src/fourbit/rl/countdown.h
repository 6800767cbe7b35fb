// defines: CountdownExpr, parse_countdown, countdown_error
// The countdown task's checker: an answer is an arithmetic expression over non-negative decimal
// numbers with + - * and parentheses (usual precedence, left to right; no unary minus, no
// spaces, no leading zeros), which must use each given number at most once and evaluate to the
// target. Exposed for tests.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::rl {

struct CountdownExpr {
  std::string error;             // "" when the text is a well-formed expression
  int64_t value = 0;
  std::vector<int64_t> numbers;  // the numbers it uses, left to right
};

// Parses and evaluates (64-bit, overflow is an error; at most 64 characters, 16 nested levels).
CountdownExpr parse_countdown(std::string_view text);

// "" when `text` is a well-formed expression that uses each of `given` at most once and equals
// `target`; otherwise the reason, starting with "format:" when the text is not an expression.
std::string countdown_error(std::string_view text, const std::vector<int64_t>& given, int64_t target);

}  // namespace fourbit::rl
