// defines: cuda::IndexSite, cuda::IndexError, cuda::record_index_error, cuda::index_error_record,
//          cuda::raise_index_error, cuda::check_index_errors
// Out-of-range indices (token ids, targets, positions, expert ids, slots) on the GPU.
// The CPU backend checks every index on the host before its loop; on the GPU the indices live in
// device memory and reading them on the host would cost a synchronisation per op. So instead:
//  - a kernel never reads or writes outside its tensors: it tests each index it uses, skips the
//    row it cannot compute, and records the first bad index in one device-side record;
//  - the record is turned into fail(), with the same message the CPU gives, at a host
//    synchronisation: at once in the ops that take user data (embedding tokens, cross_entropy
//    targets: one small copy each) unless an ops::DeferIndexChecks scope is open, and otherwise at
//    the next check (route_plan's offsets copy, which a MoE layer that reads its counts back makes
//    anyway; ops::check_index_errors, which a forward whose route plans read nothing back calls
//    once it is queued; ops::check_index_errors_later, a read queued behind the work, which a
//    training forward on the GPU collects in PendingForwardStats::stats).
// Which bad index is recorded first when several race is unspecified; that a bad one is reported is
// not. Kernels run on the default stream and fourbit uses one GPU per process, so one record serves.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fourbit/ops/cuda/common.cuh"

namespace fourbit::ops {
bool index_checks_deferred();  // ops.h DeferIndexChecks
}  // namespace fourbit::ops

namespace fourbit::ops::cuda {

// Where an index was read: names the op, the index tensor and its bound in the message.
enum class IndexSite : int32_t {
  EmbeddingForwardTokens = 1,
  EmbeddingBackwardTokens,
  RopeForwardPositions,
  RopeBackwardPositions,
  CrossEntropyTargets,
  RouterBackwardTopk,
  RoutePlanTopk,
  GatherRowsTokenOfSlot,
  GatherRowsBackwardSlotOf,
  MoeCombineSlotOf,
  MoeCombineBackwardSlotOf,
  MoeCombineBackwardSharedSlot,  // two assignments write one slot (slot_of is not injective)
  SegmentAmaxRows,
  ScatterRowsDstRows,
  GroupedGemmOffsets,            // outside [0, M]
  GroupedGemmOffsetsDecreasing,  // below the one before it
  AttentionStepPositions,
  GatherQuantizeTokenOfSlot,
};

struct IndexError {
  int32_t set;    // 0 until the first bad index is recorded
  int32_t site;   // IndexSite
  int64_t pos;    // flat position in the index tensor
  int64_t value;  // the index found there
  int64_t limit;  // the exclusive upper bound it broke
  int64_t cols;   // columns of a 2-D index tensor (the message gives [row, col]); 1 for 1-D
};

// First writer wins (an integer CAS); its fields are complete once the kernel has finished.
__device__ __forceinline__ void record_index_error(IndexError* rec, IndexSite site, int64_t pos,
                                                   int64_t value, int64_t limit, int64_t cols) {
  if (atomicCAS(&rec->set, 0, 1) == 0) {
    rec->site = int32_t(site);
    rec->pos = pos;
    rec->value = value;
    rec->limit = limit;
    rec->cols = cols;
  }
}

// The process-wide device record (allocated and zeroed on first use, never freed).
inline IndexError* index_error_record() {
  static IndexError* rec = [] {
    void* p = nullptr;
    FOURBIT_CUDA_CHECK(cudaMalloc(&p, sizeof(IndexError)));
    FOURBIT_CUDA_CHECK(cudaMemset(p, 0, sizeof(IndexError)));
    return static_cast<IndexError*>(p);
  }();
  return rec;
}

// Clears the device record and fails with the CPU backend's message for `e` (e.set != 0).
[[noreturn]] inline void raise_index_error(const IndexError& e) {
  FOURBIT_CUDA_CHECK(cudaMemsetAsync(index_error_record(), 0, sizeof(IndexError), stream()));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  const char* op = "?";
  const char* tensor = "?";
  const char* bound = "?";
  switch (IndexSite(e.site)) {
    case IndexSite::EmbeddingForwardTokens: op = "embedding_forward", tensor = "tokens", bound = "V"; break;
    case IndexSite::EmbeddingBackwardTokens: op = "embedding_backward", tensor = "tokens", bound = "V"; break;
    case IndexSite::RopeForwardPositions: op = "rope_forward", tensor = "positions", bound = "max_pos"; break;
    case IndexSite::RopeBackwardPositions: op = "rope_backward", tensor = "positions", bound = "max_pos"; break;
    case IndexSite::CrossEntropyTargets: op = "cross_entropy", tensor = "targets", bound = "V"; break;
    case IndexSite::RouterBackwardTopk: op = "router_backward", tensor = "topk_idx", bound = "E"; break;
    case IndexSite::RoutePlanTopk: op = "route_plan", tensor = "topk_idx", bound = "n_experts"; break;
    case IndexSite::GatherRowsTokenOfSlot: op = "gather_rows", tensor = "token_of_slot", bound = "N"; break;
    case IndexSite::GatherQuantizeTokenOfSlot:
      op = "gather_quantize_row_col", tensor = "token_of_slot", bound = "N";
      break;
    case IndexSite::ScatterRowsDstRows: op = "scatter_rows", tensor = "dst_rows", bound = "N"; break;
    case IndexSite::GatherRowsBackwardSlotOf: op = "gather_rows_backward", tensor = "slot_of", bound = "M"; break;
    case IndexSite::MoeCombineSlotOf: op = "moe_combine", tensor = "slot_of", bound = "M"; break;
    case IndexSite::MoeCombineBackwardSlotOf:
    case IndexSite::MoeCombineBackwardSharedSlot: op = "moe_combine_backward", tensor = "slot_of", bound = "M"; break;
    case IndexSite::SegmentAmaxRows: op = "running_segment_amax", tensor = "rows", bound = "R"; break;
    case IndexSite::AttentionStepPositions: op = "attention_step", tensor = "positions", bound = "S"; break;
    case IndexSite::GroupedGemmOffsets:
    case IndexSite::GroupedGemmOffsetsDecreasing: op = "grouped_gemm_bf16", tensor = "offsets", bound = "M + 1"; break;
  }
  const std::string at = e.cols > 1 ? fmt::format("[{}, {}]", e.pos / e.cols, e.pos % e.cols)
                                    : fmt::format("[{}]", e.pos);
  if (IndexSite(e.site) == IndexSite::MoeCombineBackwardSharedSlot)
    fail("{}: {}{} = {} is also the slot of another assignment: each slot belongs to one "
         "assignment",
         op, tensor, at, e.value);
  if (IndexSite(e.site) == IndexSite::GroupedGemmOffsetsDecreasing)
    fail("{}: {}{} = {} is below {}{} = {}: group offsets must not decrease", op, tensor, at, e.value, tensor,
         fmt::format("[{}]", e.pos - 1), e.limit);
  fail("{}: {}{} = {} is outside [0, {}={}){} (found on the GPU)", op, tensor, at, e.value, bound,
       e.limit,
       IndexSite(e.site) == IndexSite::CrossEntropyTargets ? " and is not -1 (ignored)" : "");
}

// Synchronises (one small device-to-host copy) and fails if any kernel recorded a bad index.
// While a CUDA graph is being captured nothing can be read back: the record keeps what the
// graph's kernels find, and whoever replays the graph checks after each replay. Within an
// ops::DeferIndexChecks scope the ops' own checks (not `even_deferred`, an explicit
// ops::check_index_errors) leave the record to a later check the same way.
inline void check_index_errors(bool even_deferred = false) {
  if (graph_capturing() || (!even_deferred && ops::index_checks_deferred())) return;
  IndexError e{};
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&e, index_error_record(), sizeof e, cudaMemcpyDeviceToHost, stream()));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  if (e.set) raise_index_error(e);
}

}  // namespace fourbit::ops::cuda
