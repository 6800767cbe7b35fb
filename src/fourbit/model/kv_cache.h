// defines: KvGroup, KvBatch, KvCache, KvStep
// The sampler's per-layer key/value cache and the layout of one cached forward call
// (Model::forward_cached). A cache holds K and V of every layer for `slots` sequences of up to
// `capacity` positions, as [slots, capacity, Hkv, hd] tensors: exactly the k/v layout
// ops::attention_forward reads, so a run of slots is a view and the attention over a cache is the
// training attention's own op (same key order, same 64-key blocks on the GPU): a cached token's
// output row is the bits of the full forward's row for that position.
#pragma once
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "fourbit/model/config.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops {
struct RowQuant;  // ops/ops.h
}

namespace fourbit {

// Rows [begin, end) of a cached call's tokens [B, T] continue the sequences in cache slots
// [begin, end), all at positions pos0 .. pos0 + T - 1 (ops::attention_forward takes one pos0 per
// call, so sequences at different positions are different groups).
struct KvGroup {
  int64_t begin = 0, end = 0, pos0 = 0;
};

// One cached call: tokens [B, T] whose groups cover rows 0 .. B-1 in order. A prefill is one group
// at pos0 0 (prompts right-padded to T: padding rows only write K/V at positions after the prompt,
// which later tokens overwrite before any query can see them); a decode step has T = 1 and one
// group per run of equal positions.
struct KvBatch {
  int64_t T = 1;
  std::vector<KvGroup> groups;
  int64_t rows() const { return groups.empty() ? 0 : groups.back().end; }
};

class KvCache {
 public:
  KvCache() = default;
  // Zero-filled: the GPU kernels read whole 64-key tiles and mask the keys after a query, and
  // a masked key must still be finite (0 * NaN would poison the sum). dtype: the model's (what
  // the cache is for). K and V are stored as default_storage(dtype, device) unless `storage`
  // says otherwise (F32 where BF16 would be the default: benchmarks comparing the two).
  KvCache(const ModelConfig& c, int64_t slots, int64_t capacity, DType dtype, Device device,
          std::optional<DType> storage = std::nullopt);
  // BF16 where the device's attention reads BF16 operands (ops::attention_reads_bf16) and the
  // model computes in F32: the values attention reads either way, in half the bytes and with no
  // conversion of the cache at each call (the model writes K and V rounded by RoPE's BF16 copy);
  // otherwise the model's dtype.
  static DType default_storage(DType dtype, Device device);

  int64_t slots() const { return slots_; }
  int64_t capacity() const { return capacity_; }
  int64_t layers() const { return int64_t(k_.size()); }
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }
  DType storage() const { return storage_; }
  int64_t bytes() const;
  const Tensor& k(int64_t layer) const { return k_.at(size_t(layer)); }
  const Tensor& v(int64_t layer) const { return v_.at(size_t(layer)); }

  // A new cache whose slot i holds slot src[i] of this one (every layer, every position): a
  // prefilled prompt copied to its G samples, or finished sequences dropped.
  KvCache gather_slots(const std::vector<int64_t>& src) const;

 private:
  friend struct KvStep;
  int64_t slots_ = 0, capacity_ = 0, kv_row_ = 0;  // kv_row_: Hkv * hd values per position
  DType dtype_ = DType::F32, storage_ = DType::F32;
  Device device_ = Device::CPU;
  std::vector<Tensor> k_, v_;
};

// A checked KvBatch bound to a cache for one forward call: each row's position (for RoPE) and the
// cache row its K/V go to, on the cache's device.
struct KvStep {
  KvStep(KvCache& cache, const KvBatch& batch, int64_t max_seq_len);
  // The same batch's positions and cache rows written into `positions` and `dst_rows` (I32 [B * T]
  // on the cache's device, made beforehand): inputs a CUDA graph reads from fixed buffers.
  KvStep(KvCache& cache, const KvBatch& batch, int64_t max_seq_len, Tensor positions, Tensor dst_rows);
  // Bound to positions and dst_rows as they are, without writing them: a capture of the call
  // whose replays find the values written there since (by the constructor above). batch gives
  // the rows and T only.
  static KvStep bound(KvCache& cache, const KvBatch& batch, Tensor positions, Tensor dst_rows);
  KvCache& cache;
  KvBatch batch;
  Tensor positions;  // I32 [B * T]
  Tensor dst_rows;   // I32 [B * T]: slot * capacity + position, rows of a layer's cache as [slots * capacity, Hkv * hd]

  // Writes this call's k, v rows ([B * T, Hkv * hd], after RoPE) into layer `layer` of the cache,
  // then attention of q [B, T, Hq, hd] over the cache, one ops::attention_forward per group:
  // o [B, T, Hq, hd], lse [B, Hq, T]. q, k and v are in the cache's storage dtype.
  void attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor& lse) const;
  // The same from the projections' F32 q [B * T, Hq, hd], k and v [B * T, Hkv, hd] before RoPE,
  // for a BF16 cache: RoPE, the BF16 roundings and the cache writes in one op
  // (ops::rope_qkv_to_cache at this call's positions, `table` the model's RoPE table), then the
  // attention of q's BF16 copy (q_bf16 [B, T, Hq, hd], written here) over the cache: attend's bits.
  // o_bf16 (optional, o's shape, BF16): o rounded to BF16 as well, written by attention's epilogue
  // (ops::attention_forward's out_bf16: the output projection's BF16 operand without a convert).
  // oq (optional): o's [B * T, Hq * hd] rows quantized as well (ops.h "Quantized outputs": in the
  // attention step's epilogue where T = 1 and the backend takes the spec; otherwise after it).
  void rope_attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& table,
                   Tensor& q_bf16, Tensor& o, Tensor& lse, Tensor* o_bf16 = nullptr,
                   const ops::RowQuant* oq = nullptr) const;
  // The same from the fused projection's qkv [B * T, Hq + 2 Hkv, hd] (ops::rope_fused_qkv_to_cache,
  // Hq = n_heads): rope_attend's bits on its three parts.
  void rope_attend_fused(int64_t layer, const Tensor& qkv, int64_t n_heads, const Tensor& table, Tensor& q_bf16,
                         Tensor& o, Tensor& lse, Tensor* o_bf16 = nullptr, const ops::RowQuant* oq = nullptr) const;

 private:
  void attend_cached(int64_t layer, const Tensor& q, Tensor& o, Tensor& lse, Tensor* o_bf16 = nullptr,
                     const ops::RowQuant* oq = nullptr) const;
  struct Unchecked {};
  KvStep(Unchecked, KvCache& cache, const KvBatch& batch) : cache(cache), batch(batch) {}
  // batch's positions and cache rows, after checking them against the cache
  static void rows_of(const KvCache& cache, const KvBatch& batch, int64_t max_seq_len, std::vector<int32_t>& pos,
                      std::vector<int32_t>& dst);
  // Layer `layer`'s K and V caches as [slots * capacity, hkv, hd] views; fails unless they store BF16.
  std::pair<Tensor, Tensor> bf16_cache_rows(int64_t layer, int64_t hkv, int64_t hd) const;
};

}  // namespace fourbit
