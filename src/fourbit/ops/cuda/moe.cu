// defines: cuda::router_topk, cuda::router_backward, cuda::route_plan, cuda::gather_rows (dense
//          and QTensor), cuda::scatter_rows, cuda::gather_rows_backward, cuda::moe_combine,
//          cuda::moe_combine_backward, cuda::moe_combine_backward_owners, cuda::stable_bucket_sort,
//          cuda::load_balance_term, cuda::load_balance_dprobs, cuda::recorded_index_errors_later,
//          cuda::route_plan_read_backs
// The router and the token <-> expert-slot permutation on the GPU, following ops/cpu/moe.cpp:
//  - router rows run one per warp, arithmetic in double rounded once per output, so a token's
//    probabilities, choices and weights never depend on the other tokens (batch invariance);
//  - route_plan is a stable counting sort on the device (experts ascending, tokens ascending
//    within an expert); its E+1 offsets come to the host in the one copy (the one
//    synchronisation) the design allows per MoE layer; slot_of and token_of_slot stay on the GPU;
//  - gather_rows_backward and moe_combine add a token's k terms in rank order in float, with
//    the CPU's exact operations (acc = 0, then acc += term, never fused), so the two backends
//    agree bit for bit; moe_combine_backward's dot products are per-(token, rank) warp reductions.
// No float atomics anywhere; the integer atomics (slot ownership, the error record) only detect
// bad input. Index checks: index_errors.cuh.
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "fourbit/numerics/hd.h"
#include "fourbit/ops/cuda/bucket_sort.cuh"
#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/reduce.cuh"
#include "fourbit/ops/cuda/vec4.cuh"
#include "fourbit/ops/load_balance_math.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kRowWarps = 8;  // warp-per-row kernels: one row (or assignment) per warp
constexpr int kRowThreads = kRowWarps * 32;
constexpr int kEltThreads = 256;

__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int64_t first_row_of_warp() {
  return blockIdx.x * int64_t(kRowWarps) + threadIdx.x / 32;
}
__device__ __forceinline__ int64_t warp_row_stride() { return int64_t(gridDim.x) * kRowWarps; }
unsigned warp_row_grid(int64_t rows) { return grid_for(rows, kRowWarps); }

// ---- stable bucket sort (bucket_sort.cuh) -----------------------------------------------------
// Four kernels, no atomics. The keys are cut into chunks, one warp per chunk; table[c, b] is
// first the number of keys b in chunk c, then the number of keys b in chunks before c.
//  1. count: the warp stages 1024 keys of its chunk in shared memory and walks them 32 at a time,
//     in order; lanes holding equal keys find each other with __match_any_sync and the lowest of
//     them adds their number to table[chunk, key]. A table row belongs to one warp, and
//     __syncwarp orders one step's update before the next step's.
//  2. chunk prefix: one thread per bucket turns its column of the table into exclusive prefixes
//     over the chunks and writes the bucket's total.
//  3. offsets: one block scans the totals into bucket_start (integers: exact in any order).
//  4. scatter: the same walk as 1; a key goes to bucket_start[key] + table[chunk, key] + the
//     number of equal keys on lower lanes of the same step; the lowest lane advances the entry.
// Positions therefore follow (key, index) order exactly: the sort is stable by construction.

constexpr int kSortWarps = 4;                   // chunks (warps) per block in kernels 1 and 4
constexpr int kSortStage = 1024;                // keys staged per warp at a time (32 steps)
constexpr int64_t kSortMaxChunks = 128;         // at most this many chunks ...
constexpr int64_t kSortTableEntries = 1 << 22;  // ... and a table of at most ~this many counts
constexpr int kPrefixThreads = 256;             // kernel 2: one thread per bucket
constexpr int kPrefixBatch = 8;                 // kernel 2: loads in flight per thread
constexpr int kScanThreads = 1024;              // kernel 3: one block of 32 warps

// Loads keys [base, min(base + kSortStage, end)) of the chunk into this warp's stage. Callers end
// every step with __syncwarp, so a refill never overwrites keys a lane is still reading.
__device__ __forceinline__ void stage_keys(const int32_t* keys, int64_t base, int64_t end,
                                           int32_t* stage, int lane) {
  for (int s = lane; s < kSortStage; s += 32)
    if (base + s < end) stage[s] = keys[base + s];
  __syncwarp();
}

__global__ void __launch_bounds__(kSortWarps * 32)
    bucket_count_kernel(const int32_t* keys, int64_t n, int64_t buckets, int64_t chunk_len,
                        int64_t chunks, int32_t* table, IndexSite site, int64_t key_cols,
                        IndexError* err) {
  __shared__ int32_t stages[kSortWarps][kSortStage];
  const int64_t chunk = blockIdx.x * int64_t(kSortWarps) + threadIdx.x / 32;
  if (chunk >= chunks) return;  // the whole warp leaves (no block barriers below)
  const int lane = lane_id();
  int32_t* stage = stages[threadIdx.x / 32];
  const int64_t begin = chunk * chunk_len;
  const int64_t end = begin + chunk_len < n ? begin + chunk_len : n;
  int32_t* counts = table + chunk * buckets;
  for (int64_t base = begin; base < end; base += kSortStage) {
    stage_keys(keys, base, end, stage, lane);
    for (int s = 0; s < kSortStage && base + s < end; s += 32) {
      const int64_t i = base + s + lane;
      const int32_t key = i < end ? stage[s + lane] : 0;
      const bool valid = i < end && key >= 0 && key < buckets;
      if (i < end && !valid) record_index_error(err, site, i, key, buckets, key_cols);
      const unsigned active = __ballot_sync(kFullMask, valid);
      if (valid) {
        const unsigned peers = __match_any_sync(active, key);
        if (lane == __ffs(peers) - 1) counts[key] += __popc(peers);
      }
      __syncwarp();
    }
  }
}

// Thread b: table[c, b] <- sum of table[c', b] for c' < c; totals[b] <- the column's sum.
// Loads go in batches so that several are in flight (the column is strided by `buckets`).
__global__ void __launch_bounds__(kPrefixThreads)
    bucket_chunk_prefix_kernel(int32_t* table, int64_t buckets, int64_t chunks,
                               int32_t* totals) {
  for (int64_t b = blockIdx.x * int64_t(kPrefixThreads) + threadIdx.x; b < buckets;
       b += int64_t(gridDim.x) * kPrefixThreads) {
    int32_t running = 0;
    for (int64_t c0 = 0; c0 < chunks; c0 += kPrefixBatch) {
      int32_t count[kPrefixBatch];
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u)
        count[u] = c0 + u < chunks ? table[(c0 + u) * buckets + b] : 0;
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u)
        if (c0 + u < chunks) {
          table[(c0 + u) * buckets + b] = running;
          running += count[u];
        }
    }
    totals[b] = running;
  }
}

// One block: thread t owns the buckets [b0, b1) (contiguous, in order). The block scans the
// threads' sums, then each thread writes its buckets' starts.
__global__ void __launch_bounds__(kScanThreads)
    bucket_offsets_kernel(const int32_t* __restrict__ totals, int64_t buckets,
                          int32_t* __restrict__ bucket_start) {
  __shared__ int32_t warp_totals[kScanThreads / 32];
  const int lane = lane_id(), warp = threadIdx.x / 32;
  const int64_t per = (buckets + kScanThreads - 1) / kScanThreads;
  const int64_t b0 = threadIdx.x * per < buckets ? threadIdx.x * per : buckets;
  const int64_t b1 = b0 + per < buckets ? b0 + per : buckets;
  int32_t own = 0;
  for (int64_t b = b0; b < b1; ++b) own += totals[b];
  int32_t incl = own;  // inclusive scan within the warp
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int32_t up = __shfl_up_sync(kFullMask, incl, offset);
    if (lane >= offset) incl += up;
  }
  if (lane == 31) warp_totals[warp] = incl;
  __syncthreads();
  if (warp == 0) {  // inclusive scan of the 32 warp sums
    int32_t t = warp_totals[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int32_t up = __shfl_up_sync(kFullMask, t, offset);
      if (lane >= offset) t += up;
    }
    warp_totals[lane] = t;
  }
  __syncthreads();
  int32_t running = incl - own + (warp > 0 ? warp_totals[warp - 1] : 0);
  for (int64_t b = b0; b < b1; ++b) {
    bucket_start[b] = running;
    running += totals[b];
  }
  if (threadIdx.x == kScanThreads - 1) bucket_start[buckets] = running;  // its b1 == buckets
}

__global__ void __launch_bounds__(kSortWarps * 32)
    bucket_scatter_kernel(const int32_t* keys, int64_t n, int64_t buckets, int64_t chunk_len,
                          int64_t chunks, int32_t* table, const int32_t* bucket_start,
                          int32_t divisor, int32_t* order_out, int32_t* pos_out) {
  __shared__ int32_t stages[kSortWarps][kSortStage];
  const int64_t chunk = blockIdx.x * int64_t(kSortWarps) + threadIdx.x / 32;
  if (chunk >= chunks) return;
  const int lane = lane_id();
  int32_t* stage = stages[threadIdx.x / 32];
  const int64_t begin = chunk * chunk_len;
  const int64_t end = begin + chunk_len < n ? begin + chunk_len : n;
  int32_t* before = table + chunk * buckets;  // keys b already placed by earlier chunks and steps
  for (int64_t base = begin; base < end; base += kSortStage) {
    stage_keys(keys, base, end, stage, lane);
    for (int s = 0; s < kSortStage && base + s < end; s += 32) {
      const int64_t i = base + s + lane;
      const int32_t key = i < end ? stage[s + lane] : 0;
      const bool valid = i < end && key >= 0 && key < buckets;  // bad keys were recorded in 1
      const unsigned active = __ballot_sync(kFullMask, valid);
      if (valid) {
        const unsigned peers = __match_any_sync(active, key);
        const int leader = __ffs(peers) - 1;
        int32_t first = 0;
        if (lane == leader) {
          first = bucket_start[key] + before[key];
          before[key] += __popc(peers);
        }
        first = __shfl_sync(active, first, leader);
        const int32_t p = first + __popc(peers & ((1u << lane) - 1u));
        order_out[p] = int32_t(i / divisor);
        if (pos_out) pos_out[i] = p;
      }
      __syncwarp();
    }
  }
}

// ---- router -----------------------------------------------------------------------------------

// One warp per row; lane l owns experts l, l + 32, ... Selection works on the stored float
// probabilities, as on the CPU: pick j is the greatest (probability, then lower index) among the
// experts that come after pick j-1 in that order, which is the CPU's "strictly greater wins,
// skip taken" scan without a taken set.
__global__ void __launch_bounds__(kRowThreads)
    router_topk_kernel(const float* logits, int64_t k, float* probs, int32_t* topk_idx,
                       float* topk_w, int64_t N, int64_t E) {
  dependent_launch_prologue();
  const int lane = lane_id();
  for (int64_t n = first_row_of_warp(); n < N; n += warp_row_stride()) {
    const float* x = logits + n * E;
    float* p = probs + n * E;
    float m = -INFINITY;
    for (int64_t e = lane; e < E; e += 32) m = fmaxf(m, x[e]);
    const double mx = double(warp_max(m));
    double l = 0.0;
    for (int64_t e = lane; e < E; e += 32) l += exp(double(x[e]) - mx);
    l = warp_sum(l);
    for (int64_t e = lane; e < E; e += 32) p[e] = float(exp(double(x[e]) - mx) / l);
    int32_t* idx = topk_idx + n * k;
    float* w = topk_w + n * k;
    if (isnan(l)) {
      // A NaN or infinite logit makes every probability NaN; nothing compares greater than a
      // NaN, so the CPU's scan takes experts 0 .. k-1, and their weights are NaN.
      for (int64_t j = lane; j < k; j += 32) {
        idx[j] = int32_t(j);
        w[j] = float(NAN);
      }
      continue;
    }
    float prev_v = INFINITY;  // probabilities are finite: everything comes after this
    int32_t prev_e = -1;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      float best_v = -1.0f;  // below every probability
      int32_t best_e = INT32_MAX;
      for (int32_t e = lane; e < E; e += 32) {
        const float v = p[e];  // this lane's own store above
        const bool after_prev = v < prev_v || (v == prev_v && e > prev_e);
        if (after_prev && v > best_v) best_v = v, best_e = e;  // e ascends: ties keep the lower
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, best_v, offset);
        const int32_t oe = __shfl_xor_sync(kFullMask, best_e, offset);
        if (ov > best_v || (ov == best_v && oe < best_e)) best_v = ov, best_e = oe;
      }
      prev_v = best_v, prev_e = best_e;
      sum += double(best_v);
      if (lane == 0) {
        idx[j] = best_e;
        w[j] = best_v;  // the probability for now; divided by the sum below
      }
    }
    if (lane == 0)
      for (int64_t j = 0; j < k; ++j) w[j] = float(double(w[j]) / sum);
  }
}

// w_j = p_{i_j} / S with S = sum_j p_{i_j}:  dL/dp_{i_l} = (dw_l - sum_j dw_j w_j) / S.
// Then the softmax Jacobian: dlogit_e = p_e (dp_e - sum_f p_f dp_f). One warp per row; dp_e is
// recomputed in the second pass instead of stored (k is small).
__device__ __forceinline__ double router_dp(const int32_t* idx, const float* dw, int64_t k,
                                            const float* dprobs_row, int64_t e, double gw,
                                            double S) {
  double dp = dprobs_row ? double(dprobs_row[e]) : 0.0;
  for (int64_t j = 0; j < k; ++j)
    if (idx[j] == e) dp += (double(dw[j]) - gw) / S;
  return dp;
}

__global__ void __launch_bounds__(kRowThreads)
    router_backward_kernel(const float* probs, const int32_t* topk_idx, const float* topk_w,
                           const float* d_topk_w, const float* d_probs, int64_t d_probs_stride,
                           float* d_logits, int64_t N, int64_t E, int64_t k, IndexError* err) {
  const int lane = lane_id();
  for (int64_t n = first_row_of_warp(); n < N; n += warp_row_stride()) {
    const float* p = probs + n * E;
    const int32_t* idx = topk_idx + n * k;
    const float* w = topk_w + n * k;
    const float* dw = d_topk_w + n * k;
    const float* dpr = d_probs ? d_probs + n * d_probs_stride : nullptr;
    // Every lane reads the same k entries and computes the same S and gw.
    double S = 0.0, gw = 0.0;
    bool ok = true;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[j];
      if (e < 0 || e >= E) {
        if (lane == 0) record_index_error(err, IndexSite::RouterBackwardTopk, n * k + j, e, E, k);
        ok = false;
        break;
      }
      S += double(p[e]);
      gw += double(dw[j]) * double(w[j]);
    }
    if (!ok) continue;  // the same decision on every lane
    double dot = 0.0;
    for (int64_t e = lane; e < E; e += 32)
      dot += double(p[e]) * router_dp(idx, dw, k, dpr, e, gw, S);
    dot = warp_sum(dot);
    for (int64_t e = lane; e < E; e += 32)
      d_logits[n * E + e] = float(double(p[e]) * (router_dp(idx, dw, k, dpr, e, gw, S) - dot));
  }
}

// ---- permutation ------------------------------------------------------------------------------

// A row gather copies up to three parts of each row (a QTensor's codes, block scales and per-row
// outer scale; a dense tensor is one part), each with its own row length and copy unit, so a
// quantized dispatch is one launch rather than one a part (a decode step made 31 gathers of them).
struct RowPart {
  const unsigned char* src = nullptr;
  unsigned char* dst = nullptr;
  int64_t row_bytes = 0;
  int unit = 1;  // 16, 4 or 1 bytes: the widest that row_bytes and both pointers' alignment allow
};
struct RowParts {
  static constexpr int kMax = 3;
  RowPart part[kMax];
  int count = 0;
  void add(const void* src, void* dst, int64_t row_bytes) {
    const auto aligned = [&](uintptr_t a) {
      return row_bytes % a == 0 && reinterpret_cast<uintptr_t>(src) % a == 0 && reinterpret_cast<uintptr_t>(dst) % a == 0;
    };
    if (row_bytes > 0)
      part[count++] = {static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), row_bytes,
                       aligned(16) ? 16 : aligned(4) ? 4 : 1};
  }
};

template <typename U>
__device__ __forceinline__ void copy_row_units(const unsigned char* src, unsigned char* dst, int64_t units, int lane) {
  for (int64_t u = lane; u < units; u += 32)
    reinterpret_cast<U*>(dst)[u] = src ? reinterpret_cast<const U*>(src)[u] : U{};
}
// Row n of the part to row s (a null source: zeros), by the warp.
__device__ __forceinline__ void copy_part_row(const RowPart& q, const unsigned char* src, int64_t s, int lane) {
  unsigned char* dst = q.dst + s * q.row_bytes;
  if (q.unit == 16) copy_row_units<uint4>(src, dst, q.row_bytes / 16, lane);
  else if (q.unit == 4) copy_row_units<uint32_t>(src, dst, q.row_bytes / 4, lane);
  else copy_row_units<uint8_t>(src, dst, q.row_bytes, lane);
}

// out[s] = x[token_of_slot[s]] for every part, one warp per output row.
__global__ void __launch_bounds__(kRowThreads)
    gather_rows_kernel(const __grid_constant__ RowParts parts, const int32_t* token_of_slot, int64_t M, int64_t N,
                       IndexError* err) {
  dependent_launch_prologue();
  const int lane = lane_id();
  for (int64_t s = first_row_of_warp(); s < M; s += warp_row_stride()) {
    const int32_t n = token_of_slot[s];
    const bool ok = n >= 0 && n < N;
    if (!ok && lane == 0)  // recorded; the row is zeroed, never read out of bounds
      record_index_error(err, IndexSite::GatherRowsTokenOfSlot, s, n, N, 1);
    for (int i = 0; i < parts.count; ++i) {
      const RowPart& q = parts.part[i];
      copy_part_row(q, ok ? q.src + int64_t(n) * q.row_bytes : nullptr, s, lane);
    }
  }
}

void gather_row_parts(const RowParts& parts, int64_t N, const int32_t* token_of_slot, int64_t M) {
  if (M == 0 || parts.count == 0) return;
  launch_dependent(gather_rows_kernel, warp_row_grid(M), kRowThreads, 0, parts, token_of_slot, M, N,
                   index_error_record());
}

// out[s, :] = x[token_of_slot[s], :] for rows of row_bytes bytes.
void gather_row_bytes(const void* x, int64_t N, int64_t row_bytes, const int32_t* token_of_slot,
                      int64_t M, void* out) {
  RowParts parts;
  parts.add(x, out, row_bytes);
  gather_row_parts(parts, N, token_of_slot, M);
}

// The inverse copy: row s of x goes to out row dst_rows[s], one warp per input row. Rows are
// distinct by contract (the CPU backend checks it); a repeated one would race.
template <typename U>
__global__ void __launch_bounds__(kRowThreads)
    scatter_rows_kernel(const U* x, const int32_t* dst_rows, U* out, int64_t M, int64_t N, int64_t row_units,
                        IndexError* err) {
  const int lane = lane_id();
  for (int64_t s = first_row_of_warp(); s < M; s += warp_row_stride()) {
    const int32_t n = dst_rows[s];
    if (n < 0 || n >= N) {  // recorded; nothing is written
      if (lane == 0) record_index_error(err, IndexSite::ScatterRowsDstRows, s, n, N, 1);
      continue;
    }
    const U* src = x + s * row_units;
    U* o = out + int64_t(n) * row_units;
    for (int64_t u = lane; u < row_units; u += 32) o[u] = src[u];
  }
}

// True (and the first bad one recorded) when a slot of token n's k entries is outside [0, M).
__device__ __forceinline__ bool bad_slots(const int32_t* slot_of, int64_t n, int64_t k, int64_t M,
                                          bool record, IndexSite site, IndexError* err) {
  for (int64_t j = 0; j < k; ++j) {
    const int32_t s = slot_of[n * k + j];
    if (s < 0 || s >= M) {
      if (record) record_index_error(err, site, n * k + j, s, M, k);
      return true;
    }
  }
  return false;
}

// One thread per (token n, group of 4 columns): dx[n] = sum over j of dx_perm[slot_of[n, j]],
// acc = 0 then acc += row, in rank order, in float (the CPU's exact sequence).
__global__ void __launch_bounds__(kEltThreads)
    gather_rows_backward_kernel(const float* dx_perm, const int32_t* slot_of, float* dx,
                                int64_t N, int64_t M, int64_t k, int64_t D, bool vec,
                                IndexError* err) {
  const int64_t groups = (D + 3) / 4, items = N * groups;
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = item % groups, n = item / groups;
    if (bad_slots(slot_of, n, k, M, g == 0, IndexSite::GatherRowsBackwardSlotOf, err)) continue;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t j = 0; j < k; ++j) {
      float v[4];
      load4(dx_perm + int64_t(slot_of[n * k + j]) * D, 4 * g, D, vec, v);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c] = num::add_rn(acc[c], v[c]);
    }
    store4(dx + n * D, 4 * g, D, vec, acc);
  }
}

// out[n] = sum over j in rank order of w[n, j] * y_perm[slot_of[n, j]]: acc = 0, then
// acc += w * y with a separate rounding for the product and the sum (never an FMA), as on the CPU.
__global__ void __launch_bounds__(kEltThreads)
    moe_combine_kernel(const float* y_perm, const int32_t* slot_of, const float* w, float* out,
                       int64_t N, int64_t M, int64_t k, int64_t D, bool vec, IndexError* err, const float* plus) {
  dependent_launch_prologue();
  const int64_t groups = (D + 3) / 4, items = N * groups;
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = item % groups, n = item / groups;
    if (bad_slots(slot_of, n, k, M, g == 0, IndexSite::MoeCombineSlotOf, err)) continue;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t j = 0; j < k; ++j) {
      const float wj = w[n * k + j];
      float v[4];
      load4(y_perm + int64_t(slot_of[n * k + j]) * D, 4 * g, D, vec, v);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c] = num::add_rn(acc[c], num::mul_rn(wj, v[c]));
    }
    if (plus) {  // add_'s sum, after the routed one
      float p[4];
      load4(plus + n * D, 4 * g, D, vec, p);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c] = num::add_rn(acc[c], p[c]);
    }
    store4(out + n * D, 4 * g, D, vec, acc);
  }
}

// One warp per assignment a = (n, j) with slot s: dy_perm[s] = w * dout[n] (one float product,
// as on the CPU) and dw[a] = <dout[n], y_perm[s]> in double, reduced by the warp tree.
// owner[s] (-1 before) takes the assignment that claims slot s: a second claimant is recorded
// (the CPU rejects a non-injective slot_of before writing; here the error is raised at the next
// check). dy_perm null: only dw and owner are written, for the one-pass quantizer that computes
// dy_perm's rows from dout, w and owner where it reads them (moe_combine_backward_owners).
// O: float, or uint16_t for a BF16 dy_perm (vec4.cuh's store4 encodes it).
template <typename O>
__global__ void __launch_bounds__(kRowThreads)
    moe_combine_backward_kernel(const float* dout, const float* y_perm, const int32_t* slot_of,
                                const float* w, O* dy_perm, float* dw, int32_t* owner,
                                int64_t N, int64_t M, int64_t k, int64_t D, bool vec,
                                IndexError* err) {
  const int lane = lane_id();
  const int64_t groups = (D + 3) / 4;
  for (int64_t a = first_row_of_warp(); a < N * k; a += warp_row_stride()) {
    const int32_t s = slot_of[a];
    if (s < 0 || s >= M) {
      if (lane == 0) record_index_error(err, IndexSite::MoeCombineBackwardSlotOf, a, s, M, k);
      continue;
    }
    if (lane == 0 && atomicCAS(&owner[s], -1, int32_t(a)) != -1)
      record_index_error(err, IndexSite::MoeCombineBackwardSharedSlot, a, s, M, k);
    const float wj = w[a];
    const float* g = dout + (a / k) * D;
    const float* y = y_perm + int64_t(s) * D;
    double dot = 0.0;
    for (int64_t gi = lane; gi < groups; gi += 32) {
      float gv[4], yv[4], out[4];
      load4(g, 4 * gi, D, vec, gv);
      load4(y, 4 * gi, D, vec, yv);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        out[c] = num::mul_rn(wj, gv[c]);
        dot += double(gv[c]) * double(yv[c]);  // zeros past the end add nothing
      }
      if (dy_perm) store4(dy_perm + int64_t(s) * D, 4 * gi, D, vec, out);
    }
    dot = warp_sum(dot);
    if (lane == 0) dw[a] = float(dot);
  }
}

// ---- host helpers -----------------------------------------------------------------------------

// slot_of must be a CUDA i32[N, k] for the given N; returns k.
int64_t expect_slot_of(const char* op, const Tensor& slot_of, int64_t N) {
  if (!slot_of.defined() || slot_of.dim() != 2 || slot_of.size(0) != N)
    fail("{}: slot_of must be i32[N, k] with N={}, got {}{}", op, N, str_or_undef(slot_of),
         slot_of.defined() ? slot_of.str() : "");
  const int64_t k = slot_of.size(1);
  expect_index(op, "slot_of", slot_of, {N, k}, "[N, k]");
  return k;
}

void expect_token_of_slot(const char* op, const Tensor& token_of_slot) {
  if (!token_of_slot.defined() || token_of_slot.dim() != 1)
    fail("{}: token_of_slot must be i32[M], got {}{}", op, str_or_undef(token_of_slot),
         token_of_slot.defined() ? token_of_slot.str() : "");
  expect_index(op, "token_of_slot", token_of_slot, {token_of_slot.size(0)}, "[M]");
}

// The appended bucket of stable_bucket_sort (bucket_sort.cuh) after a sort of its own launches:
// its extra positions after the sorted ones, read from bucket_start[buckets] on the device.
__global__ void append_bucket_kernel(int32_t* bucket_start, int32_t buckets, int32_t extra, int32_t* order_out) {
  const int32_t sorted = bucket_start[buckets];
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t == 0) bucket_start[buckets + 1] = sorted + extra;
  if (t < extra) order_out[sorted + t] = int32_t(t);
}
void append_bucket(int32_t* bucket_start, int32_t buckets, int32_t extra, int32_t* order_out) {
  append_bucket_kernel<<<grid_for(extra, 256), 256, 0, stream()>>>(bucket_start, buckets, extra, order_out);
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace

// A small sort (a decode step's routing, up to kSmallSortKeys keys into at most kSmallSortBuckets
// buckets) in one launch of one warp: the keys counted in index order, the counts scanned into
// bucket_start, then each key placed after the earlier ones of its bucket (the kernels above with
// a single chunk; the same permutation, as for any launch shape). Four launches and a table's
// memset cost a decode step more host time than the sort takes on the GPU.
constexpr int64_t kSmallSortKeys = 4096, kSmallSortBuckets = 1024;
__global__ void __launch_bounds__(32)
    bucket_sort_small_kernel(const int32_t* keys, int n, int buckets, IndexSite site, int64_t key_cols,
                             IndexError* err, int32_t divisor, int32_t* order_out, int32_t* pos_out,
                             int32_t* bucket_start, int32_t extra) {
  dependent_launch_prologue();
  __shared__ int32_t next[kSmallSortBuckets];  // counts, then each bucket's next position
  const int lane = lane_id();
  for (int b = lane; b < buckets; b += 32) next[b] = 0;
  __syncwarp();
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const int32_t key = i < n ? keys[i] : 0;
    const bool valid = i < n && key >= 0 && key < buckets;
    if (i < n && !valid) record_index_error(err, site, i, key, buckets, key_cols);
    const unsigned active = __ballot_sync(kFullMask, valid);
    if (valid) {
      const unsigned peers = __match_any_sync(active, key);
      if (lane == __ffs(peers) - 1) next[key] += __popc(peers);
    }
    __syncwarp();
  }
  // lane l scans the buckets [b0, b1), in order, after the lanes before it
  const int per = (buckets + 31) / 32, b0 = min(buckets, lane * per), b1 = min(buckets, b0 + per);
  int32_t own = 0;
  for (int b = b0; b < b1; ++b) own += next[b];
  int32_t incl = own;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int32_t up = __shfl_up_sync(kFullMask, incl, offset);
    if (lane >= offset) incl += up;
  }
  int32_t running = incl - own;
  for (int b = b0; b < b1; ++b) {
    const int32_t count = next[b];
    bucket_start[b] = running;
    next[b] = running;
    running += count;
  }
  if (lane == 31) bucket_start[buckets] = incl;  // lane 31's b1 is `buckets`
  if (extra > 0) {  // the appended bucket (bucket_sort.cuh)
    const int32_t sorted = __shfl_sync(kFullMask, incl, 31);
    if (lane == 31) bucket_start[buckets + 1] = sorted + extra;
    for (int32_t t = lane; t < extra; t += 32) order_out[sorted + t] = t;
  }
  __syncwarp();
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const int32_t key = i < n ? keys[i] : 0;
    const bool valid = i < n && key >= 0 && key < buckets;  // bad keys were recorded above
    const unsigned active = __ballot_sync(kFullMask, valid);
    if (valid) {
      const unsigned peers = __match_any_sync(active, key);
      const int leader = __ffs(peers) - 1;
      int32_t first = 0;
      if (lane == leader) {
        first = next[key];
        next[key] += __popc(peers);
      }
      first = __shfl_sync(active, first, leader);
      const int32_t p = first + __popc(peers & ((1u << lane) - 1u));
      order_out[p] = i / divisor;
      if (pos_out) pos_out[i] = p;
    }
    __syncwarp();
  }
}

void stable_bucket_sort(const int32_t* keys, int64_t n, int64_t buckets, IndexSite site,
                        int64_t key_cols, int32_t divisor, int32_t* order_out, int32_t* pos_out,
                        int32_t* bucket_start, int32_t extra) {
  FOURBIT_CHECK(n >= 0 && n < (int64_t(1) << 31) && buckets >= 1 && buckets < (int64_t(1) << 31) && extra >= 0 &&
                    n + extra < (int64_t(1) << 31),
                "stable_bucket_sort: n={} keys into {} buckets, {} extra", n, buckets, extra);
  if (n == 0) {
    FOURBIT_CUDA_CHECK(cudaMemsetAsync(bucket_start, 0, size_t(buckets + 1) * sizeof(int32_t), stream()));
    if (extra > 0) append_bucket(bucket_start, int32_t(buckets), extra, order_out);
    return;
  }
  FOURBIT_CHECK(divisor >= 1, "stable_bucket_sort: divisor {}", divisor);
  if (n <= kSmallSortKeys && buckets <= kSmallSortBuckets) {
    launch_dependent(bucket_sort_small_kernel, 1, 32, 0, keys, int(n), int(buckets), site, key_cols,
                     index_error_record(), divisor, order_out, pos_out, bucket_start, extra);
    return;
  }
  // The chunking changes only the speed: the sorted order is one permutation whatever it is.
  int64_t max_chunks = kSortTableEntries / buckets;
  if (max_chunks > kSortMaxChunks) max_chunks = kSortMaxChunks;
  if (max_chunks < 1) max_chunks = 1;
  int64_t chunk_len = (n + max_chunks - 1) / max_chunks;
  chunk_len = (chunk_len + kSortStage - 1) / kSortStage * kSortStage;
  const int64_t chunks = (n + chunk_len - 1) / chunk_len;
  Tensor table = Tensor::zeros({chunks * buckets + buckets}, DType::I32, Device::CUDA);
  int32_t* t = table.data<int32_t>();
  int32_t* totals = t + chunks * buckets;
  const unsigned grid = unsigned((chunks + kSortWarps - 1) / kSortWarps);
  bucket_count_kernel<<<grid, kSortWarps * 32, 0, stream()>>>(keys, n, buckets, chunk_len, chunks, t, site,
                                                 key_cols, index_error_record());
  FOURBIT_LAUNCH_CHECK();
  bucket_chunk_prefix_kernel<<<grid_for(buckets, kPrefixThreads), kPrefixThreads, 0, stream()>>>(
      t, buckets, chunks, totals);
  FOURBIT_LAUNCH_CHECK();
  bucket_offsets_kernel<<<1, kScanThreads, 0, stream()>>>(totals, buckets, bucket_start);
  FOURBIT_LAUNCH_CHECK();
  bucket_scatter_kernel<<<grid, kSortWarps * 32, 0, stream()>>>(keys, n, buckets, chunk_len, chunks, t,
                                                   bucket_start, divisor, order_out, pos_out);
  FOURBIT_LAUNCH_CHECK();
  if (extra > 0) append_bucket(bucket_start, int32_t(buckets), extra, order_out);
}

void router_topk(const Tensor& logits, int64_t k, Tensor& probs, Tensor& topk_idx, Tensor& topk_w) {
  const char* op = "router_topk";
  expect_f32(op, "logits", logits, 2, "[N, E]");
  const int64_t N = logits.size(0), E = logits.size(1);
  if (k < 1 || k > E) fail("{}: k must be in [1, E={}], got k={}", op, E, k);
  if (E >= (int64_t(1) << 31)) fail("{}: E={} experts exceed the 32-bit index", op, E);
  expect_dims(op, "probs", probs, DType::F32, {N, E}, "[N, E]");
  expect_index(op, "topk_idx", topk_idx, {N, k}, "[N, k]");
  expect_dims(op, "topk_w", topk_w, DType::F32, {N, k}, "[N, k]");
  if (N == 0) return;
  launch_dependent(router_topk_kernel, warp_row_grid(N), kRowThreads, 0, logits.data<float>(), k, probs.data<float>(),
                   topk_idx.data<int32_t>(), topk_w.data<float>(), N, E);
}

void router_backward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_w,
                     const Tensor& d_topk_w, const Tensor& d_probs, Tensor& d_logits) {
  const char* op = "router_backward";
  expect_f32(op, "probs", probs, 2, "[N, E]");
  const int64_t N = probs.size(0), E = probs.size(1);
  const int64_t k =
      expect_router_backward_args(Device::CUDA, op, DType::F32, N, E, topk_idx, topk_w, d_topk_w, d_probs, d_logits);
  if (N == 0) return;
  router_backward_kernel<<<warp_row_grid(N), kRowThreads, 0, stream()>>>(
      probs.data<float>(), topk_idx.data<int32_t>(), topk_w.data<float>(),
      d_topk_w.data<float>(), d_probs.defined() ? d_probs.data<float>() : nullptr,
      d_probs.defined() && d_probs.size(0) == 1 ? 0 : E, d_logits.data<float>(), N, E, k, index_error_record());
  FOURBIT_LAUNCH_CHECK();
}

// ops.h "prob_sums", one CTA an expert: each thread sums whole chunks of kProbSumChunk tokens in
// token order into partial (E x chunks), then thread 0 adds the chunk sums in order into out (the
// plan's device_prob_sums) and, where the plan is read back, out_read.
__global__ void prob_sums_kernel(const float* __restrict__ p, int64_t N, int64_t E, double* __restrict__ partial,
                                 double* __restrict__ out, double* __restrict__ out_read) {
  const int64_t e = blockIdx.x, chunks = (N + kProbSumChunk - 1) / kProbSumChunk;
  double* mine = partial + e * chunks;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int64_t n0 = c * kProbSumChunk, n1 = min(N, n0 + kProbSumChunk);
    double sum = 0.0;
#pragma unroll 8
    for (int64_t n = n0; n < n1; ++n) sum += double(__ldg(p + n * E + e));
    mine[c] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) total += mine[c];
    out[e] = total;
    if (out_read) out_read[e] = total;
  }
}

// ops.h load_balance_term: one thread, the host's loop (load_balance_math.h).
__global__ void load_balance_term_kernel(const int32_t* __restrict__ offsets, const double* __restrict__ prob_sums,
                                         int64_t E, int64_t tokens, int64_t assignments, double coef,
                                         double* __restrict__ term) {
  *term = load_balance_term_of(offsets, prob_sums, E, tokens, assignments, coef);
}

__global__ void load_balance_dprobs_kernel(const int32_t* __restrict__ offsets, int64_t E, int64_t tokens,
                                           int64_t assignments, float loss_weight, double coef,
                                           float* __restrict__ d_probs) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < E) d_probs[e] = float(load_balance_dprob(offsets, e, E, tokens, assignments, loss_weight, coef));
}

void load_balance_term(const Tensor& offsets, const Tensor& prob_sums, int64_t tokens, int64_t assignments,
                       double coef, Tensor& terms, int64_t slot) {
  load_balance_term_kernel<<<1, 1, 0, stream()>>>(offsets.data<int32_t>(), prob_sums.data<double>(),
                                                  offsets.numel() - 1, tokens, assignments, coef,
                                                  terms.data<double>() + slot);
  FOURBIT_LAUNCH_CHECK();
}

void load_balance_dprobs(const Tensor& offsets, int64_t tokens, int64_t assignments, float loss_weight, double coef,
                         Tensor& d_probs) {
  const int64_t E = offsets.numel() - 1;
  load_balance_dprobs_kernel<<<grid_for(E, 128), 128, 0, stream()>>>(offsets.data<int32_t>(), E, tokens, assignments,
                                                                      loss_weight, coef, d_probs.data<float>());
  FOURBIT_LAUNCH_CHECK();
}

static std::atomic<int64_t> g_route_plan_read_backs{0};
int64_t route_plan_read_backs() { return g_route_plan_read_backs.load(std::memory_order_relaxed); }

PendingRoutePlan route_plan_begin(const Tensor& topk_idx, int64_t n_experts, const Tensor& probs, bool read_back,
                                  int64_t extra_rows) {
  const char* op = "route_plan";
  if (!topk_idx.defined() || topk_idx.dim() != 2 || topk_idx.dtype() != DType::I32 ||
      topk_idx.device() != Device::CUDA)
    fail("{}: topk_idx must be an i32[N, k] cuda tensor, got {}{}", op, str_or_undef(topk_idx),
         topk_idx.defined() ? topk_idx.str() : "");
  if (n_experts < 1 || n_experts >= (int64_t(1) << 31))
    fail("{}: n_experts must be in [1, 2^31), got {}", op, n_experts);
  const int64_t N = topk_idx.size(0), k = topk_idx.size(1), A = N * k;
  if (A >= (int64_t(1) << 31))
    fail("{}: N*k = {} assignments exceed the 32-bit slot index", op, A);
  if (probs.defined() && probs.dtype() != DType::F32)
    fail("{}: probs must be f32 on the GPU, got {}", op, probs.str());
  PendingRoutePlan pending;
  RoutePlan& plan = pending.plan;
  plan.slot_of = Tensor::empty({N, k}, DType::I32, Device::CUDA);
  plan.token_of_slot = Tensor::empty({A + extra_rows}, DType::I32, Device::CUDA);
  // Scratch: bucket_start (G + 1 int32: the E experts' groups and an extra one, ops.h), a copy of
  // the index-error record and, with probs, the E probability sums, so that one read-back (the
  // layer's one wait for the GPU) brings back the offsets, any error and the sums; then the sums'
  // chunk partials (not read back).
  const int64_t groups = n_experts + (extra_rows > 0 ? 1 : 0);
  const auto round8 = [](size_t b) { return (b + 7) / 8 * 8; };
  const size_t start_bytes = round8(size_t(groups + 1) * sizeof(int32_t));
  const size_t sums_at = round8(start_bytes + sizeof(IndexError));
  const size_t sums_bytes = probs.defined() && read_back ? size_t(n_experts) * sizeof(double) : 0;
  const size_t read_bytes = sums_at + sums_bytes;
  // I32 elements (every part's size is a multiple of 8 bytes), so that its first E + 1 are the
  // plan's device_offsets
  Tensor scratch = Tensor::empty({int64_t(read_bytes) / 4}, DType::I32, Device::CUDA);
  char* dev = static_cast<char*>(scratch.raw());
  plan.device_offsets = scratch.view(0, {groups + 1});
  stable_bucket_sort(topk_idx.data<int32_t>(), A, n_experts, IndexSite::RoutePlanTopk, k,
                     int32_t(k > 0 ? k : 1), plan.token_of_slot.data<int32_t>(),
                     plan.slot_of.data<int32_t>(), reinterpret_cast<int32_t*>(dev), int32_t(extra_rows));
  if (probs.defined()) {
    // the sums (the plan's device_prob_sums), then their chunk partials
    const int64_t chunks = (N + kProbSumChunk - 1) / kProbSumChunk;
    Tensor sums = Tensor::empty({n_experts + n_experts * chunks}, DType::F64, Device::CUDA);
    plan.device_prob_sums = sums.view(0, {n_experts});
    double* read_sums = sums_bytes ? reinterpret_cast<double*>(dev + sums_at) : nullptr;
    if (N > 0) {
      prob_sums_kernel<<<unsigned(n_experts), 128, 0, stream()>>>(probs.data<float>(), N, n_experts,
                                                                 sums.data<double>() + n_experts, sums.data<double>(),
                                                                 read_sums);
      FOURBIT_LAUNCH_CHECK();
    } else {
      FOURBIT_CUDA_CHECK(cudaMemsetAsync(sums.raw(), 0, size_t(n_experts) * sizeof(double), stream()));
      if (read_sums) FOURBIT_CUDA_CHECK(cudaMemsetAsync(read_sums, 0, sums_bytes, stream()));
    }
  }
  if (!read_back) return pending;  // the record keeps any bad id for check_index_errors
  g_route_plan_read_backs.fetch_add(1, std::memory_order_relaxed);
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(dev + start_bytes, index_error_record(), sizeof(IndexError),
                                     cudaMemcpyDeviceToDevice, stream()));
  // The scratch lives as long as the plan's device_offsets; its reuse once freed is queued behind
  // the read-back on this stream.
  std::shared_ptr<PendingRead> read = read_later(dev, read_bytes);
  pending.finish = [read, n_experts, groups, start_bytes, sums_at, sums_bytes](RoutePlan& p) {
    const char* host = static_cast<const char*>(read->wait());
    IndexError err;
    std::memcpy(&err, host + start_bytes, sizeof err);
    if (err.set) raise_index_error(err);  // this op's expert ids, or an earlier op's indices
    p.offsets.resize(size_t(groups + 1));
    for (int64_t e = 0; e <= groups; ++e) {
      int32_t v;
      std::memcpy(&v, host + e * sizeof(int32_t), sizeof v);
      p.offsets[size_t(e)] = v;
    }
    if (sums_bytes) {
      p.prob_sums.resize(size_t(n_experts));
      std::memcpy(p.prob_sums.data(), host + sums_at, sums_bytes);
    }
  };
  return pending;
}

std::function<void()> recorded_index_errors_later() {
  if (graph_capturing()) return {};  // nothing comes back while capturing: the replayer checks
  std::shared_ptr<PendingRead> read = read_later(index_error_record(), sizeof(IndexError));
  return [read] {
    IndexError e;
    std::memcpy(&e, read->wait(), sizeof e);
    if (e.set) raise_index_error(e);
  };
}

void gather_rows(const Tensor& x, const Tensor& token_of_slot, Tensor& x_perm) {
  const char* op = "gather_rows";
  const auto [N, D, M] = expect_gather_args(Device::CUDA, op, x, token_of_slot, x_perm);
  // A row copy is exact for every dtype, so this one kernel serves them all.
  gather_row_bytes(x.raw(), N, D * dtype_size(x.dtype()), token_of_slot.data<int32_t>(), M,
                   x_perm.raw());
}

void scatter_rows(const Tensor& x, const Tensor& dst_rows, Tensor& out) {
  const char* op = "scatter_rows";
  const auto [N, D, M] = expect_scatter_args(Device::CUDA, op, x, dst_rows, out);
  const int64_t row_bytes = D * dtype_size(x.dtype());
  if (M == 0 || row_bytes == 0) return;
  const unsigned grid = warp_row_grid(M);
  IndexError* err = index_error_record();
  const int32_t* idx = dst_rows.data<int32_t>();
  if (row_bytes % 16 == 0 && aligned16(x.raw()) && aligned16(out.raw()))
    scatter_rows_kernel<uint4><<<grid, kRowThreads, 0, stream()>>>(x.data<uint4>(), idx, out.data<uint4>(), M, N,
                                                                    row_bytes / 16, err);
  else if (row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(x.raw()) % 4 == 0 &&
           reinterpret_cast<uintptr_t>(out.raw()) % 4 == 0)
    scatter_rows_kernel<uint32_t><<<grid, kRowThreads, 0, stream()>>>(x.data<uint32_t>(), idx, out.data<uint32_t>(),
                                                                       M, N, row_bytes / 4, err);
  else
    scatter_rows_kernel<uint8_t><<<grid, kRowThreads, 0, stream()>>>(x.data<uint8_t>(), idx, out.data<uint8_t>(), M,
                                                                      N, row_bytes, err);
  FOURBIT_LAUNCH_CHECK();
}

QTensor gather_rows(const QTensor& x, const Tensor& token_of_slot) {
  const char* op = "gather_rows";
  if (x.axis != BlockAxis::Row || x.slices != 1)
    fail("{}: a QTensor must be Row-axis with one slice (rows = tokens), got {}-axis with {} "
         "slices",
         op, x.axis == BlockAxis::Row ? "Row" : "Col", x.slices);
  expect_dims(op, "QTensor codes", x.codes, DType::U8, {x.rows, x.code_row_bytes()},
              "[rows, code_row_bytes]");
  expect_dims(op, "QTensor block_scales", x.block_scales, DType::U8,
              {x.rows, x.blocks_per_row()}, "[rows, blocks_per_row]");
  const bool per_row = x.outer == OuterScale::PerRow;
  if (per_row)
    expect_dims(op, "QTensor outer_scales", x.outer_scales, DType::F32, {x.rows}, "[rows]");
  expect_token_of_slot(op, token_of_slot);
  const int64_t M = token_of_slot.size(0);
  const int32_t* tok = token_of_slot.data<int32_t>();
  QTensor out = x;
  out.rows = M;
  out.bf16 = out.row_amax = Tensor{};  // new codes: the input's decode and row amaxes do not describe them
  out.codes = Tensor::empty({M, x.code_row_bytes()}, DType::U8, Device::CUDA);
  out.block_scales = Tensor::empty({M, x.blocks_per_row()}, DType::U8, Device::CUDA);
  RowParts parts;  // one launch for all of a row's parts
  parts.add(x.codes.raw(), out.codes.raw(), x.code_row_bytes());
  parts.add(x.block_scales.raw(), out.block_scales.raw(), x.blocks_per_row());
  // Per-row (per-token) scales travel with their rows; Tensor/None (and the single PerSlice
  // scale of a one-slice tensor) apply to every row and are copied as they are.
  if (per_row) {
    out.outer_scales = Tensor::empty({M}, DType::F32, Device::CUDA);
    parts.add(x.outer_scales.raw(), out.outer_scales.raw(), sizeof(float));
  } else if (x.outer_scales.defined()) {
    out.outer_scales = x.outer_scales.clone();
  }
  gather_row_parts(parts, x.rows, tok, M);
  return out;
}

void gather_rows_backward(const Tensor& dx_perm, const Tensor& slot_of, Tensor& dx) {
  const char* op = "gather_rows_backward";
  expect_f32(op, "dx", dx, 2, "[N, D]");
  const int64_t N = dx.size(0), D = dx.size(1);
  expect_f32(op, "dx_perm", dx_perm, 2, "[M, D]");
  const int64_t M = dx_perm.size(0);
  expect_dims(op, "dx_perm", dx_perm, DType::F32, {M, D}, "[M, D]");
  const int64_t k = expect_slot_of(op, slot_of, N);
  const int64_t items = N * ((D + 3) / 4);
  if (items == 0) return;
  const bool vec = D % 4 == 0 && aligned16(dx_perm.raw()) && aligned16(dx.raw());
  gather_rows_backward_kernel<<<grid_for(items, kEltThreads), kEltThreads, 0, stream()>>>(
      dx_perm.data<float>(), slot_of.data<int32_t>(), dx.data<float>(), N, M, k, D, vec,
      index_error_record());
  FOURBIT_LAUNCH_CHECK();
}

void moe_combine(const Tensor& y_perm, const Tensor& slot_of, const Tensor& w, Tensor& out, const Tensor* plus) {
  const char* op = "moe_combine";
  expect_f32(op, "out", out, 2, "[N, D]");
  const int64_t N = out.size(0), D = out.size(1);
  const auto [M, k] = expect_combine_args(Device::CUDA, op, DType::F32, N, D, y_perm, slot_of, w);
  const int64_t items = N * ((D + 3) / 4);
  if (items == 0) return;
  const bool vec = D % 4 == 0 && aligned16(y_perm.raw()) && aligned16(out.raw()) && (!plus || aligned16(plus->raw()));
  launch_dependent(moe_combine_kernel, grid_for(items, kEltThreads), kEltThreads, 0, y_perm.data<float>(),
                   slot_of.data<int32_t>(), w.data<float>(), out.data<float>(), N, M, k, D, vec, index_error_record(),
                   plus ? plus->data<float>() : nullptr);
}

namespace {
// moe_combine_backward's checks and kernel, dy_perm optional (null: dw and each slot's owning
// assignment alone, for the quantizer that computes dy_perm's rows itself); returns the owners,
// I32 [M], -1 where no assignment claims the slot.
Tensor combine_backward(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of, const Tensor& w,
                        Tensor* dy_perm, Tensor& dw) {
  const char* op = "moe_combine_backward";
  expect_f32(op, "dout", dout, 2, "[N, D]");
  const int64_t N = dout.size(0), D = dout.size(1);
  const auto [M, k] = expect_combine_args(Device::CUDA, op, DType::F32, N, D, y_perm, slot_of, w);
  const DType out_dt = dy_perm ? expect_out(op, "dy_perm", *dy_perm, {M, D}, "[M, D]") : DType::F32;
  expect_dims(op, "dw", dw, DType::F32, {N, k}, "[N, k]");
  // Slots no assignment points at stay zero. With M = N k (a route_plan's slot_of) every slot is
  // written unless two assignments share one or one is out of range, which the kernel records as
  // an index error, so only M > N k needs the zeros.
  if (dy_perm && M > N * k) dy_perm->zero_();
  Tensor owner = Tensor::empty({M}, DType::I32, Device::CUDA);
  if (M > 0) FOURBIT_CUDA_CHECK(cudaMemsetAsync(owner.raw(), 0xFF, size_t(M) * sizeof(int32_t), stream()));
  if (N * k == 0) return owner;
  const bool vec =
      D % 4 == 0 && aligned16(dout.raw()) && aligned16(y_perm.raw()) && (!dy_perm || out_aligned(*dy_perm));
  const int64_t slots = M, ranks = k;  // a lambda may not capture structured bindings (C++17)
  with_out_type(out_dt, [&](auto tag) {
    using O = decltype(tag);
    moe_combine_backward_kernel<<<warp_row_grid(N * ranks), kRowThreads, 0, stream()>>>(
        dout.data<float>(), y_perm.data<float>(), slot_of.data<int32_t>(), w.data<float>(),
        dy_perm ? dy_perm->data<O>() : nullptr, dw.data<float>(), owner.data<int32_t>(), N, slots, ranks, D, vec,
        index_error_record());
  });
  FOURBIT_LAUNCH_CHECK();
  return owner;
}
}  // namespace

void moe_combine_backward(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                          const Tensor& w, Tensor& dy_perm, Tensor& dw) {
  (void)combine_backward(dout, y_perm, slot_of, w, &dy_perm, dw);
}

Tensor moe_combine_backward_owners(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of, const Tensor& w,
                                   Tensor& dw) {
  return combine_backward(dout, y_perm, slot_of, w, nullptr, dw);
}

}  // namespace fourbit::ops::cuda
