// defines: TaskRow, task_row, task_micro_batch, task_list, check_fits_context
// Prompt/answer sequences as the training loop's micro-batches (SFT's problems, RL's rollouts):
// one sequence per row, right-padded with <pad> to the longest row, targets only on the answer
// (or completion) tokens. The target of answer token j sits at position answer_start - 1 + j,
// the row Model::logits and rl::forward_logprobs read it from.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fourbit/model/config.h"
#include "fourbit/rl/task.h"
#include "fourbit/train/loop.h"

namespace fourbit::rl {

struct TaskRow {
  std::vector<int32_t> sequence;  // <bos> prompt <sep> answer ... (the model reads all but the last)
  int64_t answer_start = 0;       // index of the first token that is a target (>= 1)
  std::vector<float> weights;     // one per target token; empty = no weights (all 1)
};

// <bos> prompt <sep> answer <eos>, answer_start at the first answer token.
TaskRow task_row(const Problem& p);

// The rows as one micro-batch [rows, longest - 1] on the host. With weights (every row must
// then carry them), also the per-token weights; padding and prompt positions get target -1.
MicroBatch task_micro_batch(const std::vector<TaskRow>& rows);

// "add,sort:len=3-5" -> {"add", "sort:len=3-5"}, each in its canonical form (Task::spec: options
// at their defaults left out); fails on an empty or repeated task, an unknown one (listing the
// known ones) and a bad option, before any work.
std::vector<std::string> task_list(const std::string& comma_separated, const std::string& flag);

// Fails, naming the task and the longest case, when a problem among the first `count` of each
// split (train with `seed`, eval with `eval_seed`) does not fit the model's context: its prompt
// (RL samples after it), or with_answer its whole training row (SFT).
void check_fits_context(const Task& task, const ModelConfig& model, uint64_t seed, uint64_t eval_seed, int64_t count,
                        bool with_answer);

}  // namespace fourbit::rl
