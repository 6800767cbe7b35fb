// defines: cuda::stable_bucket_sort
// A stable counting sort of small integer keys on the device, shared by route_plan (assignments
// by expert) and embedding_backward (token positions by vocabulary id). Implemented in moe.cu.
//
// Element i of keys[0, n) goes to position p of the order sorted by (key ascending, i ascending);
// the result is one permutation whatever the launch shape, so it is deterministic by definition.
// For every element with a key in [0, buckets):
//   order_out[p] = i / divisor            (divisor k turns an assignment n*k + j into its token n)
//   pos_out[i]   = p                      (skipped when pos_out is null)
// and bucket_start[b] (device, buckets + 1 entries) = first position of bucket b, with
// bucket_start[buckets] = the number of sorted elements. A key outside [0, buckets) is recorded
// as an index error at `site` (index_errors.cuh; key_cols shapes the [row, col] of the message)
// and left out. extra > 0 appends one more bucket after them that no key names: positions
// bucket_start[buckets] + t hold order_out = t for t in [0, extra), and bucket_start has
// buckets + 2 entries, the last bucket_start[buckets] + extra (route_plan's shared-expert group).
// Everything is queued on the default stream; nothing synchronises.
#pragma once
#include <cstdint>

#include "fourbit/ops/cuda/index_errors.cuh"

namespace fourbit::ops::cuda {

void stable_bucket_sort(const int32_t* keys, int64_t n, int64_t buckets, IndexSite site,
                        int64_t key_cols, int32_t divisor, int32_t* order_out, int32_t* pos_out,
                        int32_t* bucket_start, int32_t extra = 0);

}  // namespace fourbit::ops::cuda
