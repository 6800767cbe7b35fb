// defines: DecodeGraph
// A decode step of Model::forward_cached (one token for every slot of a KV cache) recorded once as
// a CUDA graph and replayed each step. At small batches the step waits on the host: it issues
// about a thousand ops (kernels, cuBLASLt calls, copies) a step at a few microseconds each, while
// the GPU's share is a fraction of that; a replay is one launch. The inputs that change from step
// to step (the tokens, each slot's position and cache row) live in fixed buffers written before
// each replay; everything the forward reads from the host at capture (shapes, pointers, job tables)
// is fixed for the graph's life, which is why a graph belongs to one cache of one batch.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "fourbit/model/kv_cache.h"
#include "fourbit/model/model.h"
#include "fourbit/tensor/device_memory.h"

namespace fourbit {

class DecodeGraph {
 public:
  // Records the decode step over every slot of `cache` (nothing runs yet). model, cache and sr
  // must outlive the graph, and the cache keep its tensors (KvCache::gather_slots makes a new
  // cache: capture a new graph for it). The model's cached weights must be made already (a
  // forward since the weights last changed, such as the prefill): a capture may not leave buffers
  // behind. Fails, saying why, where no capture can be made (no GPU, a CPU model, an op that
  // reads back to the host); the caller then runs forward_cached itself.
  DecodeGraph(Model& model, KvCache& cache, const SrStreams& sr);

  // Slot b's next token tokens[b] at position positions[b] (checked as forward_cached checks a
  // batch): its K/V go into the cache and the logits F32 [slots, V] come back, the graph's own
  // output tensor, which the next run() overwrites (work queued before then may read it). Fails,
  // before the replay, once the model's weights have changed since the capture, when `cache`
  // holds other tensors than at the capture, and on a token id outside the vocabulary.
  const Tensor& run(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions);

  int64_t slots() const { return slots_; }

 private:
  Model& model_;
  KvCache& cache_;
  int64_t slots_;
  uint64_t weights_version_;
  const void *k0_, *v0_;  // the cache's first K and V tensors at the capture
  Tensor tokens_, positions_, dst_rows_;  // the fixed inputs, I32 [slots, 1], [slots], [slots]
  Tensor logits_;                         // the fixed output
  std::unique_ptr<DeviceGraph> graph_;
};

}  // namespace fourbit
