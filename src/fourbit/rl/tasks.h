// defines: make_add_task, make_sub_task, make_mul_task, make_sort_task, make_reverse_task,
//          make_countdown_task, draw_below
// The built-in tasks (task.cpp registers them by name). Prompts and answers, with the pretraining
// corpus's `a+b=c` lines in mind (docs/data.md), so that pretraining + SFT make them learnable:
//
//   add        "347+58="        -> "405"     operands 0..999, at least one >= 100 (wider than
//                                            the corpus's 0..99); split on the unordered pair
//   sub        "347-58="        -> "289"     operands 0..999, a >= b, a >= 100; split on (a, b)
//   mul        "47*8=", "47*36=" -> "376", "1692"   2x1 and 2x2 digits (half each), the two-digit
//                                            operand first; split on the unordered pair
//   sort       "sort 52871="    -> "12578"   3..8 digits; split on the multiset of digits
//   reverse    "reverse hello=" -> "olleh"   3..8 lowercase letters; split on the string
//   countdown  "cd 3 7 12 5 to 46=" -> any expression over + - * and parentheses that uses each
//              given number at most once and evaluates to the target (countdown.h); 3 or 4
//              numbers 1..20, targets 1..999 made from 2..all of them; split on the sorted
//              numbers and the target
//
// Answers are plain numbers (no sign, no leading zeros), digit strings or letter strings; the
// format check rejects anything else before the exact match.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "fourbit/rl/task.h"

namespace fourbit::rl {

std::unique_ptr<Task> make_add_task();
std::unique_ptr<Task> make_sub_task();
std::unique_ptr<Task> make_mul_task();
std::unique_ptr<Task> make_sort_task();
std::unique_ptr<Task> make_reverse_task();
std::unique_ptr<Task> make_countdown_task();

// A uniform integer in [0, n) from one 32-bit random word (multiply-shift: bias below n / 2^32,
// nothing a task notices; no rejection loop, so a draw always takes one word).
inline uint32_t draw_below(const std::function<uint32_t()>& rand, uint32_t n) {
  return uint32_t((uint64_t(rand()) * n) >> 32);
}

}  // namespace fourbit::rl
