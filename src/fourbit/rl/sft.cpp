// defines: SftSource, evaluate_tasks (sft.h)
#include "fourbit/rl/sft.h"

#include <fmt/format.h>

#include "fourbit/rl/rollout.h"
#include "fourbit/rl/task_batch.h"
#include "fourbit/tensor/error.h"

namespace fourbit::rl {

SftSource::SftSource(SftOptions opt) : opt_(std::move(opt)) {
  if (opt_.tasks.empty()) fail("sft: give at least one task (--task)");
  if (opt_.eval_problems < 1) fail("--eval-problems: expected at least 1, got {}", opt_.eval_problems);
  if (opt_.eval_max_new < 1) fail("--max-new: expected at least 1 token, got {}", opt_.eval_max_new);
  for (const std::string& t : opt_.tasks) tasks_.push_back(make_task(t));
}

std::string SftSource::describe() const {
  std::string names;
  for (const auto& t : tasks_) names += (names.empty() ? "" : "; ") + t->spec() + ": " + t->description();
  return fmt::format("sft on {} (train split; {} held-out problems per task)", names, opt_.eval_problems);
}

nlohmann::json SftSource::record() const {
  std::vector<std::string> specs;
  for (const auto& t : tasks_) specs.push_back(t->spec());
  return {{"kind", "sft"},
          {"tasks", specs},
          {"eval_problems", opt_.eval_problems},
          {"eval_max_new", opt_.eval_max_new},
          {"eval_seed", kEvalSeed}};
}

void SftSource::start(Model& model, const RunConfig& config) {
  (void)model;
  cfg_ = config;
  for (const auto& t : tasks_)
    check_fits_context(*t, cfg_.model, cfg_.train.seed, kEvalSeed, std::max<int64_t>(opt_.eval_problems, 256), true);
}

MicroBatch SftSource::micro_batch(const StepContext& ctx, int64_t micro) {
  const int64_t B = cfg_.train.batch_size, n_tasks = int64_t(tasks_.size());
  std::vector<TaskRow> rows;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = (ctx.step * cfg_.train.grad_accum + micro) * B + b;  // the run's g-th problem
    const Task& task = *tasks_[size_t(g % n_tasks)];
    rows.push_back(task_row(task.problem(ctx.seed, Split::Train, uint64_t(g / n_tasks))));
  }
  return task_micro_batch(rows);
}

void SftSource::evaluate(const StepContext& ctx, Model& model, nlohmann::json& line) {
  (void)ctx;
  std::vector<const Task*> tasks;
  for (const auto& t : tasks_) tasks.push_back(t.get());
  evaluate_tasks(model, tasks, opt_.eval_problems, opt_.eval_max_new, line);
}

void evaluate_tasks(Model& model, const std::vector<const Task*>& tasks, int64_t problems, int64_t max_new,
                    nlohmann::json& line) {
  Sampler sampler(model, kEvalStreams);
  double accuracy_sum = 0, loss_sum = 0;
  int64_t loss_tokens = 0;
  for (const Task* task : tasks) {
    const EvalResult r = evaluate_greedy(sampler, *task, kEvalSeed, problems, max_new);
    line["eval_accuracy_" + task->spec()] = r.accuracy();
    accuracy_sum += r.accuracy();
    // The reference answers' cross-entropy, in batches of 64 problems.
    const std::vector<Problem> ps = rl::problems(*task, kEvalSeed, Split::Eval, 0, problems);
    for (size_t first = 0; first < ps.size(); first += 64) {
      std::vector<TaskRow> rows;
      for (size_t i = first; i < std::min(ps.size(), first + 64); ++i) rows.push_back(task_row(ps[i]));
      const MicroBatch b = task_micro_batch(rows);
      const ForwardStats st =
          model.forward(b.tokens.to(model.device()), b.targets.to(model.device()), kEvalStreams, false);
      loss_sum += st.loss * double(st.tokens);
      loss_tokens += st.tokens;
    }
  }
  line["eval_accuracy"] = accuracy_sum / double(tasks.size());
  line["eval_loss"] = loss_sum / double(loss_tokens);
}

}  // namespace fourbit::rl
