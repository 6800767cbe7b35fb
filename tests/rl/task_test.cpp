// defines: task tests (rl/task.h, rl/tasks.h, rl/countdown.h): generators are deterministic
//          and seed dependent; train and eval never share a problem (nor its split key); every
//          reference answer scores 1 and malformed answers score 0 with the reason; the
//          countdown checker parses, evaluates and enforces "each number at most once"; unknown
//          task names fail listing the known ones; the registry takes new tasks; task options
//          (`sort:len=3-5`) set ranges, round-trip through spec(), keep the split and fail
//          helpfully.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fourbit/rl/countdown.h"
#include "fourbit/rl/rollout.h"
#include "fourbit/rl/task.h"
#include "fourbit/train/tokenizer.h"
#include "rl/rl_test_util.h"

using namespace fourbit;
using namespace fourbit::rltest;

namespace {

const std::vector<std::string> kBuiltin = {"add", "countdown", "mul", "reverse", "sort", "sub"};

std::vector<int32_t> completion(const std::string& text, bool eos = true) {
  std::vector<int32_t> t = data::encode(text);
  if (eos) t.push_back(data::kEos);
  return t;
}

// A task with no options, registered at run time (once per process).
class Echo : public rl::Task {
 public:
  std::string name() const override { return "echo-test"; }
  std::string description() const override { return "x= -> x"; }

 protected:
  rl::Problem draw(const std::function<uint32_t()>& rand) const override {
    const std::string d(1, char('a' + rand() % 26));
    return rl::Problem{d + "=", d, d};
  }
  std::string format_error(std::string_view) const override { return ""; }
};

void register_echo() {
  const std::vector<std::string> names = rl::task_names();
  if (std::find(names.begin(), names.end(), "echo-test") == names.end())
    rl::register_task("echo-test", [] { return std::make_unique<Echo>(); });
}

}  // namespace

TEST(Tasks, RegistryKnowsTheBuiltinsAndRefusesUnknownNames) {
  const std::vector<std::string> names = rl::task_names();
  for (const std::string& n : kBuiltin) EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  expect_error([] { rl::make_task("division"); }, "unknown task 'division' (known: add, countdown, ");  // tests may register more
  expect_error([] { rl::register_task("add", [] { return rl::make_task("sub"); }); }, "a task named 'add' exists");
}

TEST(Tasks, GeneratorsAreDeterministicAndSeeded) {
  for (const std::string& n : kBuiltin) {
    const auto task = rl::make_task(n);
    EXPECT_EQ(task->name(), n);
    for (rl::Split s : {rl::Split::Train, rl::Split::Eval}) {
      const auto a = rl::problems(*task, 3, s, 0, 20), b = rl::problems(*task, 3, s, 0, 20);
      const auto c = rl::problems(*task, 4, s, 0, 20), d = rl::problems(*task, 3, s, 10, 10);
      int differ = 0;
      for (size_t i = 0; i < 20; ++i) {
        EXPECT_EQ(a[i].prompt, b[i].prompt) << n;
        EXPECT_EQ(a[i].answer, b[i].answer) << n;
        differ += a[i].prompt != c[i].prompt;
        if (i >= 10) {
          EXPECT_EQ(a[i].prompt, d[i - 10].prompt) << n << ": problem i does not depend on the first index";
        }
      }
      EXPECT_GE(differ, 15) << n << ": another seed should give other problems";
    }
  }
}

// 3000 training problems and 300 eval problems of every task: no split key (hence no prompt)
// in both, every problem's key in its own split, and eval about a tenth of all keys.
TEST(Tasks, TrainAndEvalAreDisjoint) {
  for (const std::string& n : kBuiltin) {
    const auto task = rl::make_task(n);
    std::set<std::string> train_keys, train_prompts;
    for (const rl::Problem& p : rl::problems(*task, 1, rl::Split::Train, 0, 3000)) {
      EXPECT_EQ(rl::Task::split_of(p.key), rl::Split::Train);
      train_keys.insert(p.key);
      train_prompts.insert(p.prompt);
    }
    for (const rl::Problem& p : rl::problems(*task, 1, rl::Split::Eval, 0, 300)) {
      EXPECT_EQ(rl::Task::split_of(p.key), rl::Split::Eval);
      EXPECT_EQ(train_keys.count(p.key), 0u) << n << ": eval key " << p.key << " drawn for training";
      EXPECT_EQ(train_prompts.count(p.prompt), 0u) << n << ": eval prompt " << p.prompt << " drawn for training";
    }
  }
  int eval = 0;
  for (int i = 0; i < 10000; ++i) eval += rl::Task::split_of(std::to_string(i)) == rl::Split::Eval;
  EXPECT_NEAR(eval / 10000.0, 0.1, 0.01);
}

TEST(Tasks, ReferenceAnswersScoreOne) {
  for (const std::string& n : kBuiltin) {
    const auto task = rl::make_task(n);
    for (const rl::Problem& p : rl::problems(*task, 2, rl::Split::Train, 0, 200)) {
      const rl::Score s = task->score(p, rl::answer_tokens(p));
      EXPECT_EQ(s.reward, 1.0) << n << " " << p.prompt << " -> " << p.answer << ": " << s.reason;
      EXPECT_TRUE(s.well_formed);
      // the format the model sees
      const std::vector<int32_t> t = rl::prompt_tokens(p);
      EXPECT_EQ(t.front(), data::kBos);
      EXPECT_EQ(t.back(), data::kSep);
      EXPECT_EQ(t.size(), p.prompt.size() + 2);
      EXPECT_EQ(p.prompt.back(), '=');
    }
  }
}

TEST(Tasks, ArithmeticShapes) {
  const auto add = rl::make_task("add"), sub = rl::make_task("sub"), mul = rl::make_task("mul");
  int two_by_one = 0, two_by_two = 0;
  for (uint64_t i = 0; i < 300; ++i) {
    int a = 0, b = 0;
    const rl::Problem pa = add->problem(1, rl::Split::Train, i);
    ASSERT_EQ(std::sscanf(pa.prompt.c_str(), "%d+%d=", &a, &b), 2);
    EXPECT_TRUE(std::max(a, b) >= 100 && a <= 999 && b <= 999) << pa.prompt;  // outside the corpus's 0..99
    EXPECT_EQ(pa.answer, std::to_string(a + b));
    const rl::Problem ps = sub->problem(1, rl::Split::Train, i);
    ASSERT_EQ(std::sscanf(ps.prompt.c_str(), "%d-%d=", &a, &b), 2);
    EXPECT_TRUE(a >= b && a >= 100) << ps.prompt;
    const rl::Problem pm = mul->problem(1, rl::Split::Train, i);
    ASSERT_EQ(std::sscanf(pm.prompt.c_str(), "%d*%d=", &a, &b), 2);
    EXPECT_TRUE(a >= 10 && a <= 99 && b >= 1 && b <= 99) << pm.prompt;
    (b < 10 ? two_by_one : two_by_two) += 1;
    EXPECT_EQ(pm.answer, std::to_string(a * b));
  }
  EXPECT_GT(two_by_one, 100);
  EXPECT_GT(two_by_two, 100);
}

TEST(Tasks, MalformedAnswersScoreZeroWithAReason) {
  const auto add = rl::make_task("add");
  rl::Problem p;
  p.prompt = "123+45=";
  p.answer = "168";
  auto expect = [&](const rl::Task& t, const rl::Problem& pr, const std::vector<int32_t>& c, bool well_formed,
                    const std::string& reason) {
    const rl::Score s = t.score(pr, c);
    EXPECT_EQ(s.reward, 0.0) << reason;
    EXPECT_EQ(s.well_formed, well_formed) << reason;
    EXPECT_EQ(s.reason, reason);
  };
  EXPECT_EQ(add->score(p, completion("168")).reward, 1.0);
  // anything after the first <eos> is not looked at
  std::vector<int32_t> extra = completion("168");
  extra.push_back('9');
  EXPECT_EQ(add->score(p, extra).reward, 1.0);
  expect(*add, p, completion("168", false), false, "no <eos>");
  expect(*add, p, completion("169"), true, "wrong answer");
  expect(*add, p, completion("0168"), false, "a leading zero");
  expect(*add, p, completion("16 8"), false, "not a number");
  expect(*add, p, completion("-168"), false, "not a number");
  expect(*add, p, completion(""), false, "empty answer");
  std::vector<int32_t> sep = {'1', data::kSep, '6', '8', data::kEos};
  expect(*add, p, sep, false, "a special token before <eos>");
  const auto sort = rl::make_task("sort"), rev = rl::make_task("reverse");
  rl::Problem ps{"sort 312=", "123", "sort:123"}, pr{"reverse abc=", "cba", "reverse:abc"};
  expect(*sort, ps, completion("12a"), false, "not a digit string");
  expect(*sort, ps, completion("132"), true, "wrong answer");
  expect(*rev, pr, completion("CBA"), false, "not a lowercase word");
  EXPECT_EQ(rev->score(pr, completion("cba")).reward, 1.0);
}

TEST(Countdown, ParserEvaluatesWithPrecedenceAndRejectsMalformedText) {
  struct Case {
    const char* text;
    int64_t value;
    std::vector<int64_t> numbers;
  };
  for (const Case& c : {Case{"3+4*5", 23, {3, 4, 5}}, Case{"(3+4)*5", 35, {3, 4, 5}}, Case{"20-3-4", 13, {20, 3, 4}},
                        Case{"2*(3-(4+5))", -12, {2, 3, 4, 5}}, Case{"7", 7, {7}}, Case{"0*9", 0, {0, 9}}}) {
    const rl::CountdownExpr e = rl::parse_countdown(c.text);
    EXPECT_EQ(e.error, "") << c.text;
    EXPECT_EQ(e.value, c.value) << c.text;
    EXPECT_EQ(e.numbers, c.numbers) << c.text;
  }
  const std::map<std::string, std::string> bad = {
      {"", "empty answer"},
      {"3 + 4", "unexpected character ' '"},
      {"3/4", "unexpected character '/'"},
      {"-3+4", "unexpected '-' at 0"},
      {"3**4", "unexpected '*' at 2"},
      {"3+", "ends where a number or '(' should be"},
      {"(3+4", "a '(' without its ')'"},
      {"3+4)", "unexpected ')' at 3"},
      {"()", "unexpected ')' at 1"},
      {"03+4", "a number with a leading zero"},
      {"1234567890+1", "a number longer than 9 digits"},
      {"999999999*999999999*999999999", "overflow"},
      {fmt::format("{}1{}", std::string(17, '('), std::string(17, ')')), "nested too deeply"},
      {std::string(70, '1'), "longer than 64 characters"},
  };
  for (const auto& [text, err] : bad) EXPECT_EQ(rl::parse_countdown(text).error, err) << "'" << text << "'";
}

TEST(Countdown, CheckerEnforcesNumbersAndTarget) {
  EXPECT_EQ(rl::countdown_error("12*3+7", {3, 7, 12, 5}, 43), "");
  EXPECT_EQ(rl::countdown_error("(5+7)*3", {3, 7, 12, 5}, 36), "");  // not every number needed
  EXPECT_EQ(rl::countdown_error("3*3", {3, 7}, 9), "uses 3 more often than given");
  EXPECT_EQ(rl::countdown_error("3*3", {3, 3, 7}, 9), "");  // given twice, usable twice
  EXPECT_EQ(rl::countdown_error("4+5", {3, 7}, 9), "uses 4 more often than given");
  EXPECT_EQ(rl::countdown_error("3+7", {3, 7}, 11), "evaluates to 10, not 11");
  EXPECT_EQ(rl::countdown_error("3+x", {3, 7}, 10), "format: unexpected character 'x'");
  // Through the task: prompt "cd ... to T=", the reference answer and a different valid one.
  const auto task = rl::make_task("countdown");
  for (const rl::Problem& p : rl::problems(*task, 5, rl::Split::Eval, 0, 50)) {
    EXPECT_EQ(p.prompt.rfind("cd ", 0), 0u) << p.prompt;
    EXPECT_EQ(task->score(p, rl::answer_tokens(p)).reward, 1.0) << p.prompt << " " << p.answer;
    // the answer in parentheses is the same value
    EXPECT_EQ(task->score(p, completion("(" + p.answer + ")")).reward, 1.0) << p.answer;
    EXPECT_EQ(task->score(p, completion(p.answer + "+1")).reward, 0.0) << p.answer;
  }
  rl::Problem p{"cd 3 7 12 5 to 43=", "12*3+7", "x"};
  EXPECT_EQ(task->score(p, completion("7+3*12")).reward, 1.0);
  const rl::Score reuse = task->score(p, completion("12*3+7*1"));
  EXPECT_EQ(reuse.reward, 0.0);
  EXPECT_TRUE(reuse.well_formed);
  EXPECT_EQ(reuse.reason, "uses 1 more often than given");
  const rl::Score malformed = task->score(p, completion("12*3+7="));
  EXPECT_FALSE(malformed.well_formed);
  EXPECT_EQ(malformed.reason, "unexpected character '='");
}

// A task from outside the built-in list: registered at run time, made by name.
TEST(Tasks, RegistryTakesNewTasks) {
  register_echo();
  const auto t = rl::make_task("echo-test");
  const rl::Problem p = t->problem(1, rl::Split::Train, 0);
  EXPECT_EQ(t->score(p, rl::answer_tokens(p)).reward, 1.0);
}

// Options after the name: each task declares its own ranges; make_task parses and validates
// them once; spec() gives the canonical text back (defaults left out) and description() the
// values; the defaults draw exactly the problems of the plain name.
TEST(TaskOptions, RangesSetTheDifficultyAndSpecRoundTrips) {
  const auto sort = rl::make_task("sort:len=3-5");
  EXPECT_EQ(sort->name(), "sort");
  EXPECT_EQ(sort->spec(), "sort:len=3-5");
  EXPECT_NE(sort->description().find("3..5 digits"), std::string::npos) << sort->description();
  std::set<size_t> lengths;
  for (const rl::Problem& p : rl::problems(*sort, 1, rl::Split::Train, 0, 300)) lengths.insert(p.answer.size());
  EXPECT_EQ(lengths, (std::set<size_t>{3, 4, 5}));
  EXPECT_EQ(rl::make_task("reverse:len=4")->problem(1, rl::Split::Eval, 7).answer.size(), 4u);
  EXPECT_EQ(rl::make_task(sort->spec())->spec(), "sort:len=3-5");
  EXPECT_EQ(rl::make_task("sort:len=3-8")->spec(), "sort");  // the default is the plain name
  for (const std::string& n : kBuiltin) {
    const auto plain = rl::make_task(n);
    const auto& o = plain->options().at(0);
    const auto same = rl::make_task(fmt::format("{}:{}={}-{}", n, o.key, o.default_lo, o.default_hi));
    const auto a = rl::problems(*plain, 2, rl::Split::Train, 0, 50), b = rl::problems(*same, 2, rl::Split::Train, 0, 50);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].prompt, b[i].prompt) << n;
  }
  for (uint64_t i = 0; i < 200; ++i) {
    int a = 0, b = 0;
    const rl::Problem p = rl::make_task("add:digits=2")->problem(1, rl::Split::Train, i);
    ASSERT_EQ(std::sscanf(p.prompt.c_str(), "%d+%d=", &a, &b), 2);
    EXPECT_TRUE(std::max(a, b) >= 10 && std::max(a, b) <= 99) << p.prompt;
    const rl::Problem m = rl::make_task("mul:digits=1")->problem(1, rl::Split::Train, i);
    ASSERT_EQ(std::sscanf(m.prompt.c_str(), "%d*%d=", &a, &b), 2);
    EXPECT_TRUE(b >= 1 && b <= 9) << m.prompt;
  }
}

// An easier variant shares the split: no eval problem of sort:len=3-5 is a training problem of
// sort, nor the other way round (the key is the operands, not the options).
TEST(TaskOptions, VariantsKeepTheSplit) {
  const auto easy = rl::make_task("sort:len=3-5"), full = rl::make_task("sort");
  std::set<std::string> train;
  for (const auto* t : {easy.get(), full.get()})
    for (const rl::Problem& p : rl::problems(*t, 1, rl::Split::Train, 0, 2000)) train.insert(p.key);
  for (const auto* t : {easy.get(), full.get()})
    for (const rl::Problem& p : rl::problems(*t, 0, rl::Split::Eval, 0, 200))
      EXPECT_EQ(train.count(p.key), 0u) << p.prompt;
}

TEST(TaskOptions, BadOptionsFailNamingWhatIsWrong) {
  expect_error([] { rl::make_task("sort:length=3-5"); },
               "task sort: unknown option 'length' (it takes len=LO-HI (digits to sort, 2..20, default 3-8))");
  expect_error([] { rl::make_task("sort:len=5-3"); },
               "task sort: len=5-3: expected LO-HI or one number, with 2 <= LO <= HI <= 20 (digits to sort)");
  for (const char* bad : {"sort:len=1-4", "sort:len=3-21", "sort:len=x", "sort:len=3-", "sort:len=-3", "sort:len="})
    expect_error([&] { rl::make_task(bad); }, "expected LO-HI or one number");
  expect_error([] { rl::make_task("sort:len"); }, "task 'sort:len': option 'len' needs a value");
  expect_error([] { rl::make_task("sort:len=3:len=4"); }, "option 'len' is given twice");
  expect_error([] { rl::make_task("sort:"); }, "task 'sort:': expected sort:KEY=LO-HI");
  expect_error([] { rl::make_task("division:len=3"); }, "unknown task 'division'");
  expect_error([] { rl::make_task("add:digits=10"); }, "1 <= LO <= HI <= 9");
  register_echo();
  expect_error([] { rl::make_task("echo-test:len=3"); }, "task echo-test takes no options, got 'len=3'");
}
