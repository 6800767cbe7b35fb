// defines: make_sort_task, make_reverse_task (tasks.h)
// sort (the digits of a string in ascending order) and reverse (a lowercase word backwards); the
// option len=LO-HI sets the length (default 3-8).
#include <algorithm>
#include <fmt/format.h>

#include "fourbit/rl/tasks.h"

namespace fourbit::rl {
namespace {

bool all_in(std::string_view text, char lo, char hi) {
  return std::all_of(text.begin(), text.end(), [&](char ch) { return ch >= lo && ch <= hi; });
}

// A length in [lo, hi] from one random word.
uint32_t draw_length(const std::function<uint32_t()>& rand, const TaskOption& len) {
  return uint32_t(len.lo) + draw_below(rand, uint32_t(len.hi - len.lo + 1));
}

class SortTask : public Task {
 public:
  SortTask() : len_(declare_option("len", "digits to sort", 2, 20, 3, 8)) {}
  std::string name() const override { return "sort"; }
  std::string description() const override {
    return fmt::format("sort DIGITS= for {}..{} digits -> the digits ascending", option(len_).lo, option(len_).hi);
  }

 protected:
  Problem draw(const std::function<uint32_t()>& rand) const override {
    const uint32_t n = draw_length(rand, option(len_));
    std::string digits;
    for (uint32_t i = 0; i < n; ++i) digits.push_back(char('0' + draw_below(rand, 10)));
    Problem p;
    p.prompt = fmt::format("sort {}=", digits);
    std::sort(digits.begin(), digits.end());
    p.answer = digits;
    p.key = "sort:" + digits;  // the multiset: every order of the same digits falls together
    return p;
  }
  std::string format_error(std::string_view text) const override {
    if (text.empty()) return "empty answer";
    return all_in(text, '0', '9') ? "" : "not a digit string";
  }

 private:
  size_t len_;
};

class ReverseTask : public Task {
 public:
  ReverseTask() : len_(declare_option("len", "letters of the word", 2, 20, 3, 8)) {}
  std::string name() const override { return "reverse"; }
  std::string description() const override {
    return fmt::format("reverse WORD= for {}..{} lowercase letters -> the word backwards", option(len_).lo,
                       option(len_).hi);
  }

 protected:
  Problem draw(const std::function<uint32_t()>& rand) const override {
    const uint32_t n = draw_length(rand, option(len_));
    std::string word;
    for (uint32_t i = 0; i < n; ++i) word.push_back(char('a' + draw_below(rand, 26)));
    Problem p;
    p.prompt = fmt::format("reverse {}=", word);
    p.key = "reverse:" + word;
    std::reverse(word.begin(), word.end());
    p.answer = word;
    return p;
  }
  std::string format_error(std::string_view text) const override {
    if (text.empty()) return "empty answer";
    return all_in(text, 'a', 'z') ? "" : "not a lowercase word";
  }

 private:
  size_t len_;
};

}  // namespace

std::unique_ptr<Task> make_sort_task() { return std::make_unique<SortTask>(); }
std::unique_ptr<Task> make_reverse_task() { return std::make_unique<ReverseTask>(); }

}  // namespace fourbit::rl
