// defines: make_add_task, make_sub_task, make_mul_task (tasks.h)
// add, sub and mul: one class, the operator and the operand ranges as data.
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

class ArithmeticTask : public Task {
 public:
  explicit ArithmeticTask(char op) : op_(op) {}
  std::string name() const override { return op_ == '+' ? "add" : op_ == '-' ? "sub" : "mul"; }
  std::string description() const override {
    switch (op_) {
      case '+': return "a+b= for operands 0..999, at least one >= 100";
      case '-': return "a-b= for operands 0..999 with a >= b and a >= 100";
      default: return "a*b= with a two-digit a and a one- or two-digit b";
    }
  }

 protected:
  Problem draw(const std::function<uint32_t()>& rand) const override {
    int64_t a = 0, b = 0;
    if (op_ == '*') {
      a = 10 + draw_below(rand, 90);
      b = draw_below(rand, 2) == 0 ? 1 + draw_below(rand, 9) : 10 + draw_below(rand, 90);
    } else {
      do {
        a = draw_below(rand, 1000);
        b = draw_below(rand, 1000);
        if (op_ == '-' && a < b) std::swap(a, b);
      } while (std::max(a, b) < 100);
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
};

}  // namespace

std::unique_ptr<Task> make_add_task() { return std::make_unique<ArithmeticTask>('+'); }
std::unique_ptr<Task> make_sub_task() { return std::make_unique<ArithmeticTask>('-'); }
std::unique_ptr<Task> make_mul_task() { return std::make_unique<ArithmeticTask>('*'); }

}  // namespace fourbit::rl
