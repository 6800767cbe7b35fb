// defines: split_name, Task::problem, Task::split_of, Task::score, Task::check, Task::spec,
//          Task::set_option, Task::declare_option, register_task, make_task, task_names,
//          prompt_tokens, answer_tokens (task.h)
#include "fourbit/rl/task.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "fourbit/numerics/philox.h"
#include "fourbit/rl/tasks.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/tokenizer.h"

namespace fourbit::rl {

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, TaskFactory> factories;
  Registry() {
    // The built-in tasks (tasks.h); a new task adds its line here.
    factories["add"] = make_add_task;
    factories["sub"] = make_sub_task;
    factories["mul"] = make_mul_task;
    factories["sort"] = make_sort_task;
    factories["reverse"] = make_reverse_task;
    factories["countdown"] = make_countdown_task;
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

std::string range_text(int64_t lo, int64_t hi) { return lo == hi ? fmt::to_string(lo) : fmt::format("{}-{}", lo, hi); }

// "3" or "3-5" as a non-negative integer range; false when the text is anything else.
bool parse_range(std::string_view text, int64_t& lo, int64_t& hi) {
  auto number = [](std::string_view t, int64_t& v) {
    if (t.empty() || t.size() > 18) return false;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    return ec == std::errc() && end == t.data() + t.size() && t[0] != '-' && t[0] != '+';
  };
  const size_t dash = text.find('-');
  if (dash == std::string_view::npos) return number(text, lo) && (hi = lo, true);
  return number(text.substr(0, dash), lo) && number(text.substr(dash + 1), hi);
}

// "len=LO-HI (digits to sort, 2..20, default 3-8)" for each option, for error messages.
std::string options_help(const Task& t) {
  std::string out;
  for (const TaskOption& o : t.options())
    out += fmt::format("{}{}=LO-HI ({}, {}..{}, default {})", out.empty() ? "" : "; ", o.key, o.what, o.min, o.max,
                       range_text(o.default_lo, o.default_hi));
  return out;
}

}  // namespace

const char* split_name(Split s) { return s == Split::Train ? "train" : "eval"; }

Split Task::split_of(std::string_view key) {
  return num::mix64(num::fnv1a64(key.data(), key.size())) % 10 == 0 ? Split::Eval : Split::Train;
}

Problem Task::problem(uint64_t seed, Split split, uint64_t index) const {
  // One Philox stream per (task, split, index); attempts read on along it.
  const std::string task = name();
  const uint64_t stream =
      num::mix64(num::mix64(num::mix64(num::fnv1a64(task.data(), task.size())) ^ uint64_t(split)) ^ index);
  num::RandomBits bits(seed, stream);
  uint64_t next = 0;
  const std::function<uint32_t()> rand = [&] { return bits.at(next++); };
  // About one candidate in ten lands in eval; 2000 misses in a row would take a broken task.
  for (int attempt = 0; attempt < 2000; ++attempt) {
    Problem p = draw(rand);
    if (split_of(p.key) == split) return p;
  }
  fail("task {}: no {} problem after 2000 candidates (index {}, seed {})", name(), split_name(split), index, seed);
}

Score Task::score(const Problem& p, std::span<const int32_t> completion) const {
  const auto eos = std::find(completion.begin(), completion.end(), data::kEos);
  if (eos == completion.end()) return Score{0, false, "no <eos>"};
  std::string text;
  for (auto it = completion.begin(); it != eos; ++it) {
    if (*it < 0 || *it > 255) return Score{0, false, "a special token before <eos>"};
    text.push_back(char(*it));
  }
  return check(p, text);
}

Score Task::check(const Problem& p, std::string_view text) const {
  const std::string err = format_error(text);
  if (!err.empty()) return Score{0, false, err};
  if (text != p.answer) return Score{0, true, "wrong answer"};
  return Score{1, true, "correct"};
}

size_t Task::declare_option(std::string key, std::string what, int64_t min, int64_t max, int64_t default_lo,
                            int64_t default_hi) {
  FOURBIT_CHECK(min <= default_lo && default_lo <= default_hi && default_hi <= max,
                "task option {}: default {}-{} outside {}..{}", key, default_lo, default_hi, min, max);
  options_.push_back(TaskOption{std::move(key), std::move(what), min, max, default_lo, default_hi, default_lo,
                                default_hi});
  return options_.size() - 1;
}

std::string Task::spec() const {
  std::string s = name();
  for (const TaskOption& o : options_)
    if (o.lo != o.default_lo || o.hi != o.default_hi) s += fmt::format(":{}={}", o.key, range_text(o.lo, o.hi));
  return s;
}

void Task::set_option(const std::string& key, const std::string& value) {
  const auto it = std::find_if(options_.begin(), options_.end(), [&](const TaskOption& o) { return o.key == key; });
  if (it == options_.end()) {
    if (options_.empty()) fail("task {} takes no options, got '{}={}'", name(), key, value);
    fail("task {}: unknown option '{}' (it takes {})", name(), key, options_help(*this));
  }
  int64_t lo = 0, hi = 0;
  if (!parse_range(value, lo, hi) || lo > hi || lo < it->min || hi > it->max)
    fail("task {}: {}={}: expected LO-HI or one number, with {} <= LO <= HI <= {} ({})", name(), key, value, it->min,
         it->max, it->what);
  it->lo = lo;
  it->hi = hi;
}

void register_task(const std::string& name, TaskFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.factories.emplace(name, std::move(factory)).second) fail("register_task: a task named '{}' exists", name);
}

std::unique_ptr<Task> make_task(const std::string& spec) {
  // name[:key=value]...
  std::vector<std::string> parts;
  for (size_t begin = 0;;) {
    const size_t end = spec.find(':', begin);
    parts.push_back(spec.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  const std::string& name = parts[0];
  Registry& r = registry();
  TaskFactory f;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    const auto it = r.factories.find(name);
    if (it != r.factories.end()) f = it->second;
  }
  if (!f) {
    std::string known;
    for (const std::string& n : task_names()) known += (known.empty() ? "" : ", ") + n;
    fail("unknown task '{}' (known: {})", name, known);
  }
  std::unique_ptr<Task> task = f();
  std::set<std::string> given;
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    if (parts[i].empty() || eq == 0)
      fail("task '{}': expected {}:KEY=LO-HI, with options separated by ':'", spec, name);
    const std::string key = parts[i].substr(0, eq);
    if (eq == std::string::npos) fail("task '{}': option '{}' needs a value ({}=LO-HI or {}=N)", spec, key, key, key);
    if (!given.insert(key).second) fail("task '{}': option '{}' is given twice", spec, key);
    task->set_option(key, parts[i].substr(eq + 1));
  }
  return task;
}

std::vector<std::string> task_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [n, f] : r.factories) names.push_back(n);
  return names;
}

std::vector<int32_t> prompt_tokens(const Problem& p) {
  std::vector<int32_t> t = {data::kBos};
  for (int32_t b : data::encode(p.prompt)) t.push_back(b);
  t.push_back(data::kSep);
  return t;
}

std::vector<int32_t> answer_tokens(const Problem& p) {
  std::vector<int32_t> t = data::encode(p.answer);
  t.push_back(data::kEos);
  return t;
}

}  // namespace fourbit::rl
