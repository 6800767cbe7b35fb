// defines: StepGraphs
// A training micro-batch's forward and backward (Model::forward_queued, then Model::backward)
// recorded once as a CUDA graph and replayed for the micro-batches after it. A gpu-small bf16
// micro-batch issues about 1600 ops (kernels, cuBLASLt calls, copies), each a few microseconds of
// host time and a gap on the GPU; a replay is one launch (on an H100 a step took 1.4 ms less,
// bench/results/h100_gpu_train_graph_s61.json).
//
// What the host gives a forward is fixed in the recording: the shapes, the loss weight, whether
// token weights come, and whether the backward stores the gradients (the step's first
// micro-batch, after ParamStore::zero_grad) or adds to them. Micro-batches alike in all of these
// are one kind; the tokens, targets and token weights go into the graph's own buffers before each
// replay. A kind is recorded the second time it comes, right after it ran eagerly (which filled the
// weight cache a recording cannot fill; a kind that never comes back, such as RL's micro-batches
// whose loss weights change every step, is never recorded), and replayed from its third time on.
// At most two kinds are recorded (a step's first micro-batch and the others of gradient
// accumulation); any other runs eagerly. The recorded kinds hold the memory their captures took (a
// micro-batch's activations and temporaries) for the run, one set of blocks between them: the
// second kind's capture takes the first's pool (GraphCapture(share)), as they never run at once.
//
// Only a model whose micro-batch reads nothing back can be recorded
// (Model::training_step_capturable: the bf16 and mxfp8 recipes with the MoE backward on the GPU's
// offsets); its weight operands are views of the weights and of their BF16 copies, which stay
// where they are while the optimizer updates them, and the MXFP8 weights' forms, made again where
// they are before a replay after an update (Model::weights_for_replay), so a graph holds across
// steps. Elsewhere every micro-batch runs eagerly. Either way the same bits as forward_queued and
// backward.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fourbit/model/model.h"
#include "fourbit/tensor/device_memory.h"

namespace fourbit {

class StepGraphs {
 public:
  // enabled false: every micro-batch runs eagerly (train.cuda_graphs = false).
  StepGraphs(Model& model, bool enabled);

  // Queues micro-batch (tokens, targets I32 [B, T]; weights F32 [B, T] or undefined, all on the
  // model's device) forward and backward, as forward_queued(tokens, targets, sr, true, loss_weight,
  // weights) and backward() would, and returns the forward's pending stats. first: the step's
  // first micro-batch, whose backward stores the gradients zero_grad left stale.
  PendingForwardStats run(const Tensor& tokens, const Tensor& targets, const Tensor& weights, float loss_weight,
                          const SrStreams& sr, bool first);

  // Why recording stopped (a capture that failed; the run goes on eagerly, the graphs recorded
  // before it released), once: empty otherwise.
  std::string take_failure();
  int64_t graphs() const { return int64_t(graphs_.size()); }
  int64_t replays() const { return replays_; }

 private:
  struct Kind {
    int64_t B = 0, T = 0;
    bool weighted = false, first = false;
    float loss_weight = 0;
    bool operator==(const Kind& o) const;
  };
  struct Recorded {
    Kind kind;
    Tensor tokens, targets, weights;  // the graph's inputs
    std::unique_ptr<DeviceGraph> graph;
    std::optional<PendingForwardStats> stats;  // the recorded forward's: after_replay() reads a replay's
  };
  void record(const Kind& kind, const SrStreams& sr);
  // Whether every weight operand in the model's cache (where a training forward takes its own) is
  // a view of the weights or of their BF16 copies (buffers the optimizer updates in place), which
  // a graph may read from one step to the next; names the first that is not.
  std::string cache_outside_weights();

  Model& model_;
  bool enabled_;
  std::vector<Kind> seen_;  // kinds that ran eagerly once
  std::vector<Recorded> graphs_;
  int64_t replays_ = 0;
  std::string failure_;
};

}  // namespace fourbit
