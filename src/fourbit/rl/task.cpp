// defines: split_name, Task::problem, Task::split_of, Task::score, Task::check, register_task,
//          make_task, task_names, prompt_tokens, answer_tokens (task.h)
#include "fourbit/rl/task.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "fourbit/numerics/philox.h"
#include "fourbit/rl/tasks.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/tokenizer.h"

namespace fourbit::rl {

namespace {

uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

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

}  // namespace

const char* split_name(Split s) { return s == Split::Train ? "train" : "eval"; }

Split Task::split_of(std::string_view key) {
  return mix64(fnv1a(key)) % 10 == 0 ? Split::Eval : Split::Train;
}

Problem Task::problem(uint64_t seed, Split split, uint64_t index) const {
  // One Philox stream per (task, split, index); attempts read on along it.
  const uint64_t stream = mix64(mix64(mix64(fnv1a(name())) ^ uint64_t(split)) ^ index);
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

void register_task(const std::string& name, TaskFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.factories.emplace(name, std::move(factory)).second) fail("register_task: a task named '{}' exists", name);
}

std::unique_ptr<Task> make_task(const std::string& name) {
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
  return f();
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
