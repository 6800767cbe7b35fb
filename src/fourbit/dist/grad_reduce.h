// defines: GradientBuckets, GradientReducer
// Data-parallel gradient reduction over the flat gradient buffer (model/params.h keeps every
// gradient in one F32 buffer). The buffer is cut into fixed buckets of contiguous elements, in
// buffer order; each bucket is summed over the group with Communicator::all_reduce_sum, whose
// fixed rank order makes the result the same bits on every rank and the same bits as adding the
// ranks' gradients one after the other. The bucket boundaries and the reduction order never
// depend on timing, so overlapping the reduction with the backward changes no bit.
//
// Overlap: the backward visits layers last to first, so the buffer's tail is final first.
// mark_ready(begin, end) records that those elements hold their final gradient; every bucket
// that becomes fully ready is reduced then (LocalGroup: at once; NCCL: enqueued on the
// communicator's stream, behind the compute stream's work so far), and finish() reduces what is
// left and waits.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "fourbit/dist/communicator.h"

namespace fourbit::dist {

// [begin, end) element ranges of a flat buffer of `numel` elements, `bucket_elems` each (the last
// one shorter), in buffer order.
std::vector<std::pair<int64_t, int64_t>> gradient_buckets(int64_t numel, int64_t bucket_elems);

class GradientReducer {
 public:
  // grads: the flat F32 gradient buffer (on comm's device); bucket_bytes: the size of a bucket
  // (25 MiB by default: large enough for the transport's bandwidth, small enough to overlap).
  GradientReducer(Communicator& comm, Tensor grads, int64_t bucket_bytes = 25 << 20);

  // Elements [begin, end) hold their final gradient for this step.
  void mark_ready(int64_t begin, int64_t end);
  // Reduces every bucket not yet reduced (in buffer order) and resets for the next step.
  void finish();
  int64_t buckets() const { return int64_t(buckets_.size()); }
  int64_t reduced() const { return reduced_count_; }

 private:
  void reduce(size_t b);

  Communicator& comm_;
  Tensor grads_;
  std::vector<std::pair<int64_t, int64_t>> buckets_;
  std::vector<int64_t> ready_elems_;  // per bucket: elements marked ready
  std::map<int64_t, int64_t> marked_;  // this step's marked ranges, begin -> end (disjoint)
  std::vector<char> done_;
  int64_t reduced_count_ = 0;
};

}  // namespace fourbit::dist
