// defines: parse_countdown, countdown_error (countdown.h), make_countdown_task (tasks.h)
#include "fourbit/rl/countdown.h"

#include <algorithm>
#include <charconv>
#include <map>

#include <fmt/format.h>

#include "fourbit/rl/tasks.h"
#include "fourbit/tensor/error.h"

namespace fourbit::rl {
namespace {

constexpr size_t kMaxChars = 64;
constexpr int kMaxDepth = 16;

// Recursive descent: expr := term {('+' | '-') term}; term := factor {'*' factor};
// factor := number | '(' expr ')'.
class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}
  CountdownExpr run() {
    CountdownExpr r;
    if (s_.empty()) r.error = "empty answer";
    else if (s_.size() > kMaxChars) r.error = fmt::format("longer than {} characters", kMaxChars);
    else {
      for (char ch : s_)
        if (!((ch >= '0' && ch <= '9') || ch == '+' || ch == '-' || ch == '*' || ch == '(' || ch == ')')) {
          r.error = fmt::format("unexpected character '{}'", ch);
          return r;
        }
      int64_t v = 0;
      if (expr(v, 0) && pos_ != s_.size()) err_ = fmt::format("unexpected '{}' at {}", s_[pos_], pos_);
      r.error = err_;
      r.value = v;
      r.numbers = numbers_;
    }
    return r;
  }

 private:
  bool failed(std::string msg) {
    if (err_.empty()) err_ = std::move(msg);
    return false;
  }
  bool expr(int64_t& v, int depth) {
    if (!term(v, depth)) return false;
    while (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) {
      const char op = s_[pos_++];
      int64_t w = 0;
      if (!term(w, depth)) return false;
      if (op == '+' ? __builtin_add_overflow(v, w, &v) : __builtin_sub_overflow(v, w, &v)) return failed("overflow");
    }
    return true;
  }
  bool term(int64_t& v, int depth) {
    if (!factor(v, depth)) return false;
    while (pos_ < s_.size() && s_[pos_] == '*') {
      ++pos_;
      int64_t w = 0;
      if (!factor(w, depth)) return false;
      if (__builtin_mul_overflow(v, w, &v)) return failed("overflow");
    }
    return true;
  }
  bool factor(int64_t& v, int depth) {
    if (pos_ >= s_.size()) return failed("ends where a number or '(' should be");
    if (s_[pos_] == '(') {
      if (depth + 1 > kMaxDepth) return failed("nested too deeply");
      ++pos_;
      if (!expr(v, depth + 1)) return false;
      if (pos_ >= s_.size() || s_[pos_] != ')') return failed("a '(' without its ')'");
      ++pos_;
      return true;
    }
    const size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    if (pos_ == start) return failed(fmt::format("unexpected '{}' at {}", s_[start], start));
    if (pos_ - start > 1 && s_[start] == '0') return failed("a number with a leading zero");
    if (pos_ - start > 9) return failed("a number longer than 9 digits");
    std::from_chars(s_.data() + start, s_.data() + pos_, v);
    numbers_.push_back(v);
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
  std::string err_;
  std::vector<int64_t> numbers_;
};

// The numbers and target of a prompt "cd N N N [N] to T=" (this file writes them).
void parse_prompt(const std::string& prompt, std::vector<int64_t>& numbers, int64_t& target) {
  std::string_view s(prompt);
  FOURBIT_CHECK(s.starts_with("cd ") && s.ends_with("="), "not a countdown prompt: '{}'", prompt);
  s = s.substr(3, s.size() - 4);
  const size_t to = s.find(" to ");
  FOURBIT_CHECK(to != std::string_view::npos, "not a countdown prompt: '{}'", prompt);
  std::string_view list = s.substr(0, to);
  while (!list.empty()) {
    const size_t sp = list.find(' ');
    const std::string_view tok = list.substr(0, sp);
    int64_t v = 0;
    std::from_chars(tok.data(), tok.data() + tok.size(), v);
    numbers.push_back(v);
    list = sp == std::string_view::npos ? std::string_view() : list.substr(sp + 1);
  }
  const std::string_view t = s.substr(to + 4);
  std::from_chars(t.data(), t.data() + t.size(), target);
}

class CountdownTask : public Task {
 public:
  CountdownTask() : numbers_(declare_option("numbers", "numbers given", 2, 6, 3, 4)) {}
  std::string name() const override { return "countdown"; }
  std::string description() const override {
    return fmt::format("cd N ... to T= with {}..{} numbers 1..20 -> an expression with + - * ( ) using each number "
                       "at most once, equal to T", option(numbers_).lo, option(numbers_).hi);
  }

 protected:
  Problem draw(const std::function<uint32_t()>& rand) const override {
    const TaskOption& numbers = option(numbers_);
    while (true) {
      const uint32_t n = uint32_t(numbers.lo) + draw_below(rand, uint32_t(numbers.hi - numbers.lo + 1));
      std::vector<int64_t> nums;
      for (uint32_t i = 0; i < n; ++i) nums.push_back(1 + draw_below(rand, 20));
      // the answer: m of them (2..n) in a random order with random operators
      const uint32_t m = 2 + draw_below(rand, n - 1);
      std::vector<int64_t> pool = nums;
      std::string expr;
      for (uint32_t i = 0; i < m; ++i) {
        const uint32_t j = draw_below(rand, uint32_t(pool.size()));
        if (i > 0) expr.push_back("+-*"[draw_below(rand, 3)]);
        expr += fmt::to_string(pool[j]);
        pool.erase(pool.begin() + j);
      }
      const CountdownExpr e = parse_countdown(expr);
      if (e.value < 1 || e.value > 999) continue;
      if (std::find(nums.begin(), nums.end(), e.value) != nums.end()) continue;  // no one-number answers
      Problem p;
      p.prompt = "cd";
      for (int64_t v : nums) p.prompt += fmt::format(" {}", v);
      p.prompt += fmt::format(" to {}=", e.value);
      p.answer = expr;
      std::sort(nums.begin(), nums.end());
      p.key = "countdown:";
      for (int64_t v : nums) p.key += fmt::format("{},", v);
      p.key += fmt::format(">{}", e.value);
      return p;
    }
  }
  Score check(const Problem& p, std::string_view text) const override {
    std::vector<int64_t> given;
    int64_t target = 0;
    parse_prompt(p.prompt, given, target);
    const std::string err = countdown_error(text, given, target);
    if (err.empty()) return Score{1, true, "correct"};
    if (err.starts_with("format: ")) return Score{0, false, err.substr(8)};
    return Score{0, true, err};
  }
  std::string format_error(std::string_view text) const override { return parse_countdown(text).error; }

 private:
  size_t numbers_;
};

}  // namespace

CountdownExpr parse_countdown(std::string_view text) { return Parser(text).run(); }

std::string countdown_error(std::string_view text, const std::vector<int64_t>& given, int64_t target) {
  const CountdownExpr e = parse_countdown(text);
  if (!e.error.empty()) return "format: " + e.error;
  std::map<int64_t, int64_t> left;
  for (int64_t v : given) left[v] += 1;
  for (int64_t v : e.numbers)
    if (left[v]-- <= 0) return fmt::format("uses {} more often than given", v);
  if (e.value != target) return fmt::format("evaluates to {}, not {}", e.value, target);
  return "";
}

std::unique_ptr<Task> make_countdown_task() { return std::make_unique<CountdownTask>(); }

}  // namespace fourbit::rl
