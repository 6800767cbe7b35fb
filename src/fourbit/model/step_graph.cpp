// defines: StepGraphs (step_graph.h)
#include "fourbit/model/step_graph.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "fourbit/tensor/error.h"

namespace fourbit {

bool StepGraphs::Kind::operator==(const Kind& o) const {
  // the loss weight by its bits: the recorded kernels take exactly this float
  return B == o.B && T == o.T && weighted == o.weighted && first == o.first &&
         std::memcmp(&loss_weight, &o.loss_weight, sizeof(float)) == 0;
}

StepGraphs::StepGraphs(Model& model, bool enabled) : model_(model), enabled_(enabled) {}

std::string StepGraphs::take_failure() {
  std::string f;
  f.swap(failure_);
  return f;
}

std::string StepGraphs::cache_outside_weights() {
  // (Model::persistent_weight_operand. The fused operands an inference forward stacks,
  // Model::fused_weights, are copies, but no training forward reads them.)
  for (const auto& [key, p] : model_.weight_cache())
    if (!model_.persistent_weight_operand(p)) return key;
  return "";
}

void StepGraphs::record(const Kind& kind, const SrStreams& sr) {
  // The eager micro-batch before this left every gradient written. A first micro-batch's graph
  // stores them, as after zero_grad; nothing runs while recording, so they stay as they are.
  ParamStore& params = model_.params();
  Recorded rec;
  rec.kind = kind;
  const Device dev = model_.device();
  rec.tokens = Tensor::zeros({kind.B, kind.T}, DType::I32, dev);
  rec.targets = Tensor::zeros({kind.B, kind.T}, DType::I32, dev);
  if (kind.weighted) rec.weights = Tensor::zeros({kind.B, kind.T}, DType::F32, dev);
  // The positions the forward reads are the model's (Model::training_positions), replaced when
  // another (B, T) comes: the graph keeps the ones it recorded.
  std::vector<Tensor> keep{model_.training_positions(kind.B, kind.T), rec.tokens, rec.targets};
  if (kind.weighted) keep.push_back(rec.weights);
  std::string error;
  try {
    const std::string outside = cache_outside_weights();
    if (!outside.empty())
      fail("the weight operand {} is not a view of the weights or of their BF16 copies nor an MXFP8 form rewritten "
           "in place, so a replay after an update would read a freed copy",
           outside);
    if (kind.first) params.zero_grad();
    // The kinds replay one at a time, and after_replay queues the reads of a replay's stats
    // behind it: they can share one pool of blocks (device_memory.h).
    GraphCapture capture(graphs_.empty() ? nullptr : graphs_.front().graph.get());
    rec.stats.emplace(model_.forward_queued(rec.tokens, rec.targets, sr, true, kind.loss_weight, rec.weights));
    model_.backward();
    for (const Tensor& t : rec.stats->captured_tensors()) keep.push_back(t);
    rec.graph = capture.finish(keep);
  } catch (const Error& e) {
    error = e.what();
  }
  params.mark_grads_written();
  if (!error.empty()) {
    failure_ = fmt::format("a training micro-batch could not be recorded as a CUDA graph ({}); the run goes on "
                           "without one",
                           error);
    enabled_ = false;
    graphs_.clear();  // their blocks back for the eager micro-batches from here on
    return;
  }
  graphs_.push_back(std::move(rec));
}

PendingForwardStats StepGraphs::run(const Tensor& tokens, const Tensor& targets, const Tensor& weights,
                                    float loss_weight, const SrStreams& sr, bool first) {
  model_.check_training_batch(tokens, targets, weights);
  const Kind kind{tokens.size(0), tokens.size(1), weights.defined(), first, loss_weight};
  const bool capturable = enabled_ && model_.training_step_capturable();
  if (capturable) {
    const auto it = std::find_if(graphs_.begin(), graphs_.end(), [&](const Recorded& r) { return r.kind == kind; });
    if (it != graphs_.end()) {  // (the token and target ids are checked by the replay's kernels: stats())
      it->tokens.copy_from(tokens);
      it->targets.copy_from(targets);
      if (kind.weighted) it->weights.copy_from(weights);
      model_.weights_for_replay(sr);
      it->graph->replay();
      model_.params().mark_grads_written();
      ++replays_;
      return it->stats->after_replay();
    }
  }
  PendingForwardStats pending = model_.forward_queued(tokens, targets, sr, true, loss_weight, weights);
  model_.backward();
  if (capturable && graphs_.size() < 2) {
    if (std::find(seen_.begin(), seen_.end(), kind) != seen_.end()) record(kind, sr);
    else seen_.push_back(kind);
  }
  return pending;
}

}  // namespace fourbit
