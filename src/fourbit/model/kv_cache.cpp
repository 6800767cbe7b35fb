// defines: KvCache, KvStep (kv_cache.h)
#include "fourbit/model/kv_cache.h"

#include <cstdint>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/error.h"

namespace fourbit {

DType KvCache::default_storage(DType dtype, Device device) {
  return dtype == DType::F32 && ops::attention_reads_bf16(device) ? DType::BF16 : dtype;
}

KvCache::KvCache(const ModelConfig& c, int64_t slots, int64_t capacity, DType dtype, Device device,
                 std::optional<DType> storage)
    : slots_(slots),
      capacity_(capacity),
      kv_row_(c.n_kv_heads * c.hd()),
      dtype_(dtype),
      storage_(storage.value_or(default_storage(dtype, device))),
      device_(device) {
  if (storage_ != dtype_ && storage_ != default_storage(dtype_, device_))
    fail("kv cache: {} storage for a {} model on the {}: a cache stores the model's dtype or {}", dtype_name(storage_),
         dtype_name(dtype_), device_name(device_), dtype_name(default_storage(dtype_, device_)));
  if (slots < 0 || capacity < 1) fail("kv cache: needs slots >= 0 and capacity >= 1, got {} and {}", slots, capacity);
  if (slots * capacity > INT32_MAX)  // (slot, position) rows are indexed by i32
    fail("kv cache: {} slots x {} positions exceed 2^31 rows", slots, capacity);
  if (capacity > c.max_seq_len)
    fail("kv cache: capacity {} exceeds the model's max_seq_len {}", capacity, c.max_seq_len);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    k_.push_back(Tensor::zeros({slots, capacity, c.n_kv_heads, c.hd()}, storage_, device));
    v_.push_back(Tensor::zeros({slots, capacity, c.n_kv_heads, c.hd()}, storage_, device));
  }
}

int64_t KvCache::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].nbytes() + v_[l].nbytes();
  return b;
}

KvCache KvCache::gather_slots(const std::vector<int64_t>& src) const {
  KvCache out = *this;
  out.slots_ = int64_t(src.size());
  // One index per (slot, position) row of Hkv * hd values rather than one per slot: a slot is
  // capacity rows long, and the GPU copies a row per warp.
  std::vector<int32_t> idx;
  idx.reserve(src.size() * size_t(capacity_));
  for (int64_t s : src) {
    if (s < 0 || s >= slots_) fail("kv cache: gather_slots: slot {} is outside [0, {})", s, slots_);
    for (int64_t p = 0; p < capacity_; ++p) idx.push_back(int32_t(s * capacity_ + p));
  }
  const int64_t rows = out.slots_ * capacity_;
  const Tensor index = Tensor::from_host(idx.data(), {rows}, DType::I32, device_);
  for (size_t l = 0; l < k_.size(); ++l)
    for (auto [from, to] : {std::pair{&k_[l], &out.k_[l]}, std::pair{&v_[l], &out.v_[l]}}) {
      *to = Tensor::empty({out.slots_, from->size(1), from->size(2), from->size(3)}, storage_, device_);
      if (rows == 0) continue;
      Tensor dst = to->reshape({rows, kv_row_});
      ops::gather_rows(from->reshape({slots_ * capacity_, kv_row_}), index, dst);
    }
  return out;
}

void KvStep::rows_of(const KvCache& cache, const KvBatch& batch, int64_t max_seq_len, std::vector<int32_t>& pos,
                     std::vector<int32_t>& dst) {
  const int64_t B = batch.rows(), T = batch.T;
  if (T < 1) fail("cached forward: T must be at least 1, got {}", T);
  if (B != cache.slots())
    fail("cached forward: the batch has {} rows but the cache {} slots (row b continues slot b)", B, cache.slots());
  pos.clear();
  dst.clear();
  pos.reserve(size_t(B * T));
  dst.reserve(size_t(B * T));
  int64_t next = 0;
  for (const KvGroup& g : batch.groups) {
    if (g.begin != next || g.end <= g.begin)
      fail("cached forward: groups must cover rows 0..{} in order with none empty; a group spans [{}, {}) after row {}",
           B, g.begin, g.end, next);
    if (g.pos0 < 0 || g.pos0 + T > cache.capacity() || g.pos0 + T > max_seq_len)
      fail("cached forward: positions {}..{} of rows [{}, {}) do not fit the cache capacity {} (max_seq_len {})",
           g.pos0, g.pos0 + T - 1, g.begin, g.end, cache.capacity(), max_seq_len);
    for (int64_t r = g.begin; r < g.end; ++r)
      for (int64_t t = 0; t < T; ++t) {
        pos.push_back(int32_t(g.pos0 + t));
        dst.push_back(int32_t(r * cache.capacity() + g.pos0 + t));
      }
    next = g.end;
  }
}

KvStep::KvStep(KvCache& c, const KvBatch& b, int64_t max_seq_len) : cache(c), batch(b) {
  std::vector<int32_t> pos, dst;
  rows_of(cache, batch, max_seq_len, pos, dst);
  positions = Tensor::from_host(pos.data(), {int64_t(pos.size())}, DType::I32, cache.device());
  dst_rows = Tensor::from_host(dst.data(), {int64_t(dst.size())}, DType::I32, cache.device());
}

KvStep::KvStep(KvCache& c, const KvBatch& b, int64_t max_seq_len, Tensor pos_buf, Tensor dst_buf)
    : cache(c), batch(b) {
  std::vector<int32_t> pos, dst;
  rows_of(cache, batch, max_seq_len, pos, dst);
  const Shape shape{int64_t(pos.size())};
  for (const Tensor* t : {&pos_buf, &dst_buf})
    if (t->dtype() != DType::I32 || t->shape() != shape || t->device() != cache.device())
      fail("cached forward: a step's positions and cache rows go into i32 [{}] tensors on the {}, got {}", shape[0],
           device_name(cache.device()), t->str());
  pos_buf.copy_from(Tensor::from_host(pos.data(), shape, DType::I32, Device::CPU));
  dst_buf.copy_from(Tensor::from_host(dst.data(), shape, DType::I32, Device::CPU));
  positions = std::move(pos_buf);
  dst_rows = std::move(dst_buf);
}

KvStep KvStep::bound(KvCache& cache, const KvBatch& batch, Tensor positions, Tensor dst_rows) {
  KvStep step(Unchecked{}, cache, batch);
  step.positions = std::move(positions);
  step.dst_rows = std::move(dst_rows);
  return step;
}

void KvStep::attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor& lse) const {
  for (const Tensor* t : {&q, &k, &v})
    if (t->dtype() != cache.storage())
      fail("cached forward: q, k and v must be {} like the cache's storage, got {}", dtype_name(cache.storage()),
           t->str());
  const int64_t rows = cache.slots() * cache.capacity();
  Tensor kc = cache.k_.at(size_t(layer)), vc = cache.v_.at(size_t(layer));
  Tensor kc2 = kc.reshape({rows, cache.kv_row_}), vc2 = vc.reshape({rows, cache.kv_row_});
  // The cache first, then attention reads this call's keys from it like every earlier one's.
  ops::scatter_rows(k.reshape({k.numel() / cache.kv_row_, cache.kv_row_}), dst_rows, kc2);
  ops::scatter_rows(v.reshape({v.numel() / cache.kv_row_, cache.kv_row_}), dst_rows, vc2);
  attend_cached(layer, q, o, lse);
}

std::pair<Tensor, Tensor> KvStep::bf16_cache_rows(int64_t layer, int64_t hkv, int64_t hd) const {
  if (cache.storage() != DType::BF16)
    fail("cached forward: rope_attend writes a BF16 cache, this one stores {}", dtype_name(cache.storage()));
  const int64_t rows = cache.slots() * cache.capacity();
  return {cache.k_.at(size_t(layer)).reshape({rows, hkv, hd}), cache.v_.at(size_t(layer)).reshape({rows, hkv, hd})};
}

void KvStep::rope_attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& table,
                         Tensor& q_bf16, Tensor& o, Tensor& lse, Tensor* o_bf16, const ops::RowQuant* oq) const {
  auto [kc, vc] = bf16_cache_rows(layer, k.size(1), k.size(2));
  Tensor q3 = q_bf16.reshape(q.shape());
  ops::rope_qkv_to_cache(q, k, v, positions, table, dst_rows, q3, kc, vc);
  attend_cached(layer, q_bf16, o, lse, o_bf16, oq);
}

void KvStep::rope_attend_fused(int64_t layer, const Tensor& qkv, int64_t n_heads, const Tensor& table,
                               Tensor& q_bf16, Tensor& o, Tensor& lse, Tensor* o_bf16,
                               const ops::RowQuant* oq) const {
  auto [kc, vc] = bf16_cache_rows(layer, (qkv.size(1) - n_heads) / 2, qkv.size(2));
  Tensor q3 = q_bf16.reshape({qkv.size(0), n_heads, qkv.size(2)});
  ops::rope_fused_qkv_to_cache(qkv, n_heads, positions, table, dst_rows, q3, kc, vc);
  attend_cached(layer, q_bf16, o, lse, o_bf16, oq);
}

void KvStep::attend_cached(int64_t layer, const Tensor& q, Tensor& o, Tensor& lse, Tensor* o_bf16,
                           const ops::RowQuant* oq) const {
  const Tensor kc = cache.k_.at(size_t(layer)), vc = cache.v_.at(size_t(layer));
  if (batch.T == 1) {  // a decode step: every sequence at its own position, one op
    ops::attention_step(q, kc, vc, positions, o, lse, o_bf16, oq);
    return;
  }
  for (const KvGroup& g : batch.groups) {
    const Tensor qg = q.slice_rows(g.begin, g.end);
    Tensor og = o.slice_rows(g.begin, g.end), lg = lse.slice_rows(g.begin, g.end);
    Tensor obg = o_bf16 ? o_bf16->slice_rows(g.begin, g.end) : Tensor{};
    // Keys pos0 + T .. S - 1 of these slots are never reached by a query of this call (causal).
    ops::attention_forward(qg, kc.slice_rows(g.begin, g.end), vc.slice_rows(g.begin, g.end), g.pos0, og, lg,
                           o_bf16 ? &obg : nullptr);
  }
  if (oq) *oq->out = ops::quantize(o.reshape({o.size(0) * o.size(1), o.size(2) * o.size(3)}), oq->spec, oq->rng);
}

}  // namespace fourbit
