// defines: Split, split_name, Problem, Score, TaskOption, Task, TaskFactory, register_task,
//          make_task, task_names, prompt_tokens, answer_tokens
// Tasks with verifiable rewards for SFT and RL. A task is a seeded generator of problems with a
// train/eval split, and a checker: reward 1 for an exactly right answer, 0 otherwise (after a
// format check that says why). Problems are text: the model sees `<bos> prompt <sep>` and should
// answer `answer <eos>`.
//
// The split is by operands: a problem belongs to eval when a hash of its canonical operand tuple
// (split_key: e.g. the unordered pair of an addition's operands) falls in the eval tenth, so no
// eval problem, nor a trivial variant of one, is ever drawn for training. Problem `index` of a
// split is a pure function of (task, seed, split, index): candidates come from Philox keyed by
// (seed, index, attempt) and the first whose key lands in the split is taken.
//
// Options: a task may declare integer ranges that set its difficulty, written after its name,
// `sort:len=3-5` or `add:digits=2`, several joined by ':' (`name:key=lo-hi:key=n`). make_task
// parses them once and each task validates its own (unknown key, bad or out-of-bounds range). The
// split does not depend on options (the key is the operands), so no eval problem of any variant
// of a task is ever a training problem of another.
//
// Adding a task: a class deriving from Task in its own file and one line in task.cpp's list of
// built-in tasks (or register_task at run time); no trainer code changes.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::rl {

enum class Split : uint8_t { Train, Eval };
const char* split_name(Split s);

struct Problem {
  std::string prompt;  // the text before <sep>, e.g. "1234+567="
  std::string answer;  // a reference answer (no <eos>); for countdown one of possibly many
  std::string key;     // the canonical operand tuple the split hashes
};

struct Score {
  double reward = 0;         // 1 or 0
  bool well_formed = false;  // ended with <eos> and passed the task's format check
  std::string reason;        // "correct", or what was wrong ("no <eos>", "not a number", ...)
};

// An integer range a task takes as an option (`key=lo-hi`, or `key=n` for lo = hi), within
// [min, max]; lo and hi start at the task's defaults.
struct TaskOption {
  std::string key;   // "len"
  std::string what;  // "digits to sort"
  int64_t min = 0, max = 0;
  int64_t default_lo = 0, default_hi = 0;
  int64_t lo = 0, hi = 0;
};

// A task's problems and checker; stateless once made (make_task sets its options), so one
// instance serves every thread and step.
class Task {
 public:
  virtual ~Task() = default;
  // The registered name ("sort"), without options; problem streams are keyed by it.
  virtual std::string name() const = 0;
  virtual std::string description() const = 0;

  // The options it takes, with their values.
  const std::vector<TaskOption>& options() const { return options_; }
  // The name and each option that is not at its default, e.g. "sort:len=3-5": what make_task
  // takes to make this task again (runs record it, metrics name per-task fields by it).
  std::string spec() const;
  // Sets option `key` from "lo-hi" or "n"; fails naming the task, the key and what it accepts.
  void set_option(const std::string& key, const std::string& value);

  // Problem `index` of `split` (pure function of seed, split and index).
  Problem problem(uint64_t seed, Split split, uint64_t index) const;
  // Which split a problem's key belongs to (about one in ten to eval).
  static Split split_of(std::string_view key);

  // Scores a completion: the sampled tokens after <sep>, normally ending with <eos> (258).
  // Anything after the first <eos> is ignored; no <eos> at all scores 0 ("no <eos>").
  Score score(const Problem& p, std::span<const int32_t> completion) const;

 protected:
  // One candidate problem from 32-bit random words (rand() gives the next one).
  virtual Problem draw(const std::function<uint32_t()>& rand) const = 0;
  // The answer text (before <eos>, bytes only) checked against p: reward 1 or 0 with a reason.
  // The default: format_error(), then exact match with p.answer.
  virtual Score check(const Problem& p, std::string_view text) const;
  // The format check of the default check(): "" when fine, else the reason.
  virtual std::string format_error(std::string_view text) const = 0;
  // Declares an option (from the constructor) at its default range; returns its index.
  size_t declare_option(std::string key, std::string what, int64_t min, int64_t max, int64_t default_lo,
                        int64_t default_hi);
  const TaskOption& option(size_t index) const { return options_.at(index); }

 private:
  std::vector<TaskOption> options_;
};

using TaskFactory = std::function<std::unique_ptr<Task>()>;
// Adds a task under `name` (fails if the name is taken).
void register_task(const std::string& name, TaskFactory factory);
// The task `spec` names: a registered name, optionally with options ("sort:len=3-5"); fails
// listing the known names, or naming the option that is wrong.
std::unique_ptr<Task> make_task(const std::string& spec);
// Every registered name, sorted.
std::vector<std::string> task_names();

// <bos> prompt <sep>, and answer <eos>, as token ids.
std::vector<int32_t> prompt_tokens(const Problem& p);
std::vector<int32_t> answer_tokens(const Problem& p);

}  // namespace fourbit::rl
