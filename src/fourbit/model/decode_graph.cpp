// defines: DecodeGraph (decode_graph.h)
#include "fourbit/model/decode_graph.h"

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

DecodeGraph::DecodeGraph(Model& model, KvCache& cache, const SrStreams& sr)
    : model_(model),
      cache_(cache),
      slots_(cache.slots()),
      weights_version_(model.weights_version()),
      k0_(cache.k(0).raw()),
      v0_(cache.v(0).raw()) {
  if (model.device() != Device::CUDA || cache.device() != Device::CUDA)
    fail("decode graph: a CUDA graph records GPU work; the model is on the {} and the cache on the {}",
         device_name(model.device()), device_name(cache.device()));
  if (slots_ < 1) fail("decode graph: the cache has no slots");
  if (!model.forward_cached_stays_on_device())
    fail("decode graph: this model's cached forward reads the MoE routing counts back to the host (FP32 experts, or "
         "set_moe_routing_waits_deferred(false)), which a CUDA graph cannot record");
  tokens_ = Tensor::zeros({slots_, 1}, DType::I32, Device::CUDA);
  positions_ = Tensor::zeros({slots_}, DType::I32, Device::CUDA);
  dst_rows_ = Tensor::zeros({slots_}, DType::I32, Device::CUDA);
  // Every slot in one group: with T = 1 attention reads each slot's position from positions_
  // (ops::attention_step), and RoPE and the cache writes read positions_ and dst_rows_.
  const KvBatch batch{1, {KvGroup{0, slots_, 0}}};
  GraphCapture capture;
  const KvStep step = KvStep::bound(cache, batch, positions_, dst_rows_);
  logits_ = model.forward_cached(tokens_, step, sr);
  graph_ = capture.finish({logits_});
}

const Tensor& DecodeGraph::run(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions) {
  if (model_.weights_version() != weights_version_)
    fail("decode graph: the model's weights changed after the capture (its cached weights are gone): capture again");
  if (cache_.slots() != slots_ || cache_.k(0).raw() != k0_ || cache_.v(0).raw() != v0_)
    fail("decode graph: the KV cache holds other tensors than at the capture (a gathered or new cache): capture "
         "again");
  if (int64_t(tokens.size()) != slots_ || int64_t(positions.size()) != slots_)
    fail("decode graph: {} tokens and {} positions for a graph of {} slots", tokens.size(), positions.size(), slots_);
  // Checked here too, not only by the embedding kernel: the replay would write the slot's K/V into
  // the cache before check_index_errors reports it.
  const int64_t V = model_.config().vocab_size;
  for (int64_t b = 0; b < slots_; ++b)
    if (tokens[size_t(b)] < 0 || tokens[size_t(b)] >= V)
      fail("decode graph: slot {}'s token id {} is outside the vocabulary [0, {})", b, tokens[size_t(b)], V);
  // The batch as forward_cached takes it (runs of equal positions), checked and written into the
  // fixed buffers ahead of the replay; the tokens likewise.
  KvBatch batch{1, {}};
  for (int64_t b = 0; b < slots_; ++b) {
    const int64_t pos = positions[size_t(b)];
    if (!batch.groups.empty() && batch.groups.back().pos0 == pos) batch.groups.back().end = b + 1;
    else batch.groups.push_back(KvGroup{b, b + 1, pos});
  }
  const KvStep step(cache_, batch, model_.config().max_seq_len, positions_, dst_rows_);
  tokens_.copy_from(Tensor::from_host(tokens.data(), {slots_, 1}, DType::I32, Device::CPU));
  graph_->replay();
  // the token ids (user data) and positions the replay's kernels checked
  ops::check_index_errors(Device::CUDA);
  return logits_;
}

}  // namespace fourbit
