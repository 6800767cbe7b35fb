// defines: gradient_buckets, GradientReducer (grad_reduce.h)
#include "fourbit/dist/grad_reduce.h"

#include <algorithm>
#include <iterator>

namespace fourbit::dist {

std::vector<std::pair<int64_t, int64_t>> gradient_buckets(int64_t numel, int64_t bucket_elems) {
  if (numel < 0 || bucket_elems < 1) fail("gradient_buckets: {} elements in buckets of {}", numel, bucket_elems);
  std::vector<std::pair<int64_t, int64_t>> b;
  for (int64_t s = 0; s < numel; s += bucket_elems) b.emplace_back(s, std::min(numel, s + bucket_elems));
  return b;
}

GradientReducer::GradientReducer(Communicator& comm, Tensor grads, int64_t bucket_bytes)
    : comm_(comm), grads_(std::move(grads)) {
  if (!grads_.defined() || grads_.dtype() != DType::F32 || grads_.dim() != 1)
    fail("GradientReducer: the gradients must be one flat f32 buffer, got {}", grads_.defined() ? grads_.str() : "undefined");
  if (bucket_bytes < 4) fail("GradientReducer: a bucket of {} bytes holds no gradient", bucket_bytes);
  buckets_ = gradient_buckets(grads_.numel(), bucket_bytes / 4);
  ready_elems_.assign(buckets_.size(), 0);
  done_.assign(buckets_.size(), 0);
}

void GradientReducer::reduce(size_t b) {
  Tensor view = grads_.view(buckets_[b].first, {buckets_[b].second - buckets_[b].first});
  comm_.all_reduce_sum_start(view);
  done_[b] = 1;
  ++reduced_count_;
}

void GradientReducer::mark_ready(int64_t begin, int64_t end) {
  if (begin < 0 || end > grads_.numel() || begin > end)
    fail("GradientReducer::mark_ready: [{}, {}) is outside the {} gradients", begin, end, grads_.numel());
  if (begin == end) return;
  // A range marked twice would complete a bucket early, before all its gradients are final.
  auto next = marked_.lower_bound(end);
  if (next != marked_.begin() && std::prev(next)->second > begin)
    fail("GradientReducer::mark_ready: [{}, {}) overlaps [{}, {}), marked before in this step", begin, end,
         std::prev(next)->first, std::prev(next)->second);
  marked_[begin] = end;
  // Buckets overlapping [begin, end), each reduced once all its elements were marked. Every rank
  // marks the same ranges in the same order, so every rank reduces the same buckets in the same
  // order (a collective's order must match across ranks).
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t lo = std::max(begin, buckets_[b].first), hi = std::min(end, buckets_[b].second);
    if (lo >= hi) continue;
    ready_elems_[b] += hi - lo;
    if (!done_[b] && ready_elems_[b] == buckets_[b].second - buckets_[b].first) reduce(b);
  }
}

void GradientReducer::finish() {
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (!done_[b]) reduce(b);
  comm_.wait_pending();
  std::fill(ready_elems_.begin(), ready_elems_.end(), 0);
  std::fill(done_.begin(), done_.end(), 0);
  marked_.clear();
  reduced_count_ = 0;
}

}  // namespace fourbit::dist
