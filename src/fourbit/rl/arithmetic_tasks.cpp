// defines: make_add_task, make_sub_task, make_mul_task (tasks.h)
// add, sub and mul: one class, the operator and the operand ranges as data. Options: add and sub
// digits=LO-HI, the larger operand's digit count (default 3: operands 0..999, at least one >= 100);
// mul digits=LO-HI, the second operand's (default 1-2, half each; the first has two digits).
#include <algorithm>
#include <fmt/format.h>

#include "fourbit/rl/tasks.h"

namespace fourbit::rl {
namespace {

// "" when text is a decimal number without sign or leading zeros, else why not.
std::string number_format_error(std::string_view text) {
  if (text.empty()) return "empty answer";
  for (char ch : text)
    if (ch < '0' || ch > '9') return "not a number";
  if (text.size() > 1 && text[0] == '0') return "a leading zero";
  return "";
}

int64_t pow10(int64_t n) {
  int64_t p = 1;
  while (n-- > 0) p *= 10;
  return p;
}

// lo..hi from one random word; no word for a single value, so the default ranges draw the
// problems they drew before options existed.
int64_t draw_in(const std::function<uint32_t()>& rand, const TaskOption& o) {
  return o.lo == o.hi ? o.lo : o.lo + int64_t(draw_below(rand, uint32_t(o.hi - o.lo + 1)));
}

class ArithmeticTask : public Task {
 public:
  explicit ArithmeticTask(char op)
      : op_(op),
        digits_(op == '*' ? declare_option("digits", "digits of the second operand", 1, 2, 1, 2)
                          : declare_option("digits", "digits of the larger operand", 1, 9, 3, 3)) {}
  std::string name() const override { return op_ == '+' ? "add" : op_ == '-' ? "sub" : "mul"; }
  std::string description() const override {
    const TaskOption& d = option(digits_);
    const std::string digits = d.lo == d.hi ? fmt::to_string(d.lo) : fmt::format("{} to {}", d.lo, d.hi);
    switch (op_) {
      case '+': return fmt::format("a+b= for operands 0..{}, the larger with {} digits", pow10(d.hi) - 1, digits);
      case '-': return fmt::format("a-b= for operands 0..{} with a >= b, a with {} digits", pow10(d.hi) - 1, digits);
      default: return fmt::format("a*b= with a two-digit a and a {}-digit b", d.lo == d.hi ? digits : "one- or two");
    }
  }

 protected:
  Problem draw(const std::function<uint32_t()>& rand) const override {
    int64_t a = 0, b = 0;
    if (op_ == '*') {
      a = 10 + draw_below(rand, 90);
      b = draw_in(rand, option(digits_)) == 1 ? 1 + draw_below(rand, 9) : 10 + draw_below(rand, 90);
    } else {
      // both below 10^digits, the larger with exactly `digits` digits
      const int64_t digits = draw_in(rand, option(digits_));
      const int64_t end = pow10(digits), least = digits == 1 ? 0 : end / 10;
      do {
        a = int64_t(draw_below(rand, uint32_t(end)));
        b = int64_t(draw_below(rand, uint32_t(end)));
        if (op_ == '-' && a < b) std::swap(a, b);
      } while (std::max(a, b) < least);
    }
    const int64_t r = op_ == '+' ? a + b : op_ == '-' ? a - b : a * b;
    Problem p;
    p.prompt = fmt::format("{}{}{}=", a, op_, b);
    p.answer = fmt::to_string(r);
    // commutative operators split on the unordered pair: 12+345 and 345+12 fall together
    const bool unordered = op_ != '-';
    p.key = fmt::format("{}{}{}", unordered ? std::min(a, b) : a, op_, unordered ? std::max(a, b) : b);
    return p;
  }
  std::string format_error(std::string_view text) const override { return number_format_error(text); }

 private:
  char op_;
  size_t digits_;
};

}  // namespace

std::unique_ptr<Task> make_add_task() { return std::make_unique<ArithmeticTask>('+'); }
std::unique_ptr<Task> make_sub_task() { return std::make_unique<ArithmeticTask>('-'); }
std::unique_ptr<Task> make_mul_task() { return std::make_unique<ArithmeticTask>('*'); }

}  // namespace fourbit::rl
