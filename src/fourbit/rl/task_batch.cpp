// defines: task_row, task_micro_batch, task_list, check_fits_context (task_batch.h)
#include "fourbit/rl/task_batch.h"

#include <algorithm>
#include <set>

#include "fourbit/tensor/error.h"
#include "fourbit/train/tokenizer.h"

namespace fourbit::rl {

TaskRow task_row(const Problem& p) {
  TaskRow r;
  r.sequence = prompt_tokens(p);
  r.answer_start = int64_t(r.sequence.size());
  const std::vector<int32_t> a = answer_tokens(p);
  r.sequence.insert(r.sequence.end(), a.begin(), a.end());
  return r;
}

MicroBatch task_micro_batch(const std::vector<TaskRow>& rows) {
  if (rows.empty()) fail("task batch: no rows");
  const bool weighted = !rows[0].weights.empty();
  int64_t T = 1;
  for (const TaskRow& r : rows) {
    const int64_t n = int64_t(r.sequence.size()), answer = n - r.answer_start;
    if (r.answer_start < 1 || answer < 1)
      fail("task batch: a row needs a prompt and at least one answer token (length {}, answer from {})", n,
           r.answer_start);
    if (weighted != !r.weights.empty() || (weighted && int64_t(r.weights.size()) != answer))
      fail("task batch: every row needs one weight per answer token or none ({} weights for {} tokens)",
           r.weights.size(), answer);
    T = std::max(T, n - 1);
  }
  const int64_t B = int64_t(rows.size());
  std::vector<int32_t> tokens(size_t(B * T), data::kPad), targets(size_t(B * T), -1);
  std::vector<float> weights(weighted ? size_t(B * T) : 0, 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    const TaskRow& r = rows[size_t(b)];
    const int64_t n = int64_t(r.sequence.size());
    for (int64_t t = 0; t + 1 < n; ++t) tokens[size_t(b * T + t)] = r.sequence[size_t(t)];
    for (int64_t j = r.answer_start; j < n; ++j) {  // answer token j is predicted at position j - 1
      targets[size_t(b * T + j - 1)] = r.sequence[size_t(j)];
      if (weighted) weights[size_t(b * T + j - 1)] = r.weights[size_t(j - r.answer_start)];
    }
  }
  MicroBatch mb;
  mb.tokens = Tensor::from_host(tokens.data(), {B, T}, DType::I32);
  mb.targets = Tensor::from_host(targets.data(), {B, T}, DType::I32);
  if (weighted) mb.weights = Tensor::from_host(weights.data(), {B, T}, DType::F32);
  return mb;
}

std::vector<std::string> task_list(const std::string& comma_separated, const std::string& flag) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  size_t begin = 0;
  while (true) {
    const size_t end = comma_separated.find(',', begin);
    const std::string given = comma_separated.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    if (given.empty()) fail("{}: expected task names separated by commas, got '{}'", flag, comma_separated);
    std::string spec;
    try {
      spec = make_task(given)->spec();
    } catch (const Error& e) {
      fail("{}: {}", flag, e.what());
    }
    if (!seen.insert(spec).second) fail("{}: task '{}' is named twice", flag, spec);
    out.push_back(spec);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

void check_fits_context(const Task& task, const ModelConfig& model, uint64_t seed, uint64_t eval_seed, int64_t count,
                        bool with_answer) {
  int64_t longest = 0;
  std::string example;
  for (const Split split : {Split::Train, Split::Eval})
    for (int64_t i = 0; i < count; ++i) {
      const Problem p = task.problem(split == Split::Train ? seed : eval_seed, split, uint64_t(i));
      const TaskRow r = task_row(p);
      // SFT reads the whole row but its last token; RL's sampler reads the prompt.
      const int64_t n = with_answer ? int64_t(r.sequence.size()) - 1 : r.answer_start;
      if (n > longest) {
        longest = n;
        example = p.prompt + (with_answer ? p.answer : "");
      }
    }
  if (longest > model.max_seq_len)
    fail("task {}: {} '{}' takes {} tokens, longer than the model's context (model.max_seq_len {})", task.name(),
         with_answer ? "the training row of" : "the prompt", example, longest, model.max_seq_len);
}

}  // namespace fourbit::rl
