// defines: cuda::embedding_forward, cuda::embedding_backward, cuda::rmsnorm_forward,
//          cuda::add_rmsnorm_forward, cuda::rmsnorm_backward, cuda::rope_forward, cuda::rope_backward,
//          cuda::rope_qkv_to_cache, cuda::rope_fused_qkv_to_cache,
//          cuda::swiglu_forward, cuda::swiglu_forward_fused, cuda::swiglu_backward, cuda::cross_entropy,
//          cuda::count_targets,
//          cuda::rmsnorm_forward_quantized, cuda::add_rmsnorm_forward_quantized,
//          cuda::swiglu_forward_fused_quantized (the kernels: fused_rows.cu)
// The per-token layers on the GPU, F32 tensors. They follow the CPU reference (ops/cpu/layers.cpp)
// formula for formula: arithmetic in double, each output rounded once to float. Hopper runs FP64
// at half the FP32 rate, which these memory-bound kernels barely feel, and it makes GPU and CPU
// agree to about one float ulp instead of to a tolerance. The exception is cross_entropy, whose
// two exponentials per logit would make it compute-bound in double: its inner loops run in float,
// guarded (see there), and agree with the CPU to a few float ulps.
//
// Determinism and batch invariance (DESIGN "Exactness"):
//  - row ops (rmsnorm, cross_entropy) give one row to one warp or one block; a thread's share of
//    the row and the reduction tree (reduce.cuh) depend only on the row length, never on the
//    number of rows or on where the row sits in the batch;
//  - rmsnorm's dw sums rows in fixed chunks (a function of N only), one thread per 4 columns
//    and chunk, then adds the chunk partials in chunk order; for D <= 2048 one block per chunk
//    also writes the chunk's dx, each row's dot reduced over the block in a tree fixed by D;
//  - embedding_backward sorts token positions by id (a stable counting sort, bucket_sort.cuh),
//    then one thread per (id, 4 columns) adds that id's rows in ascending token order, the CPU's
//    sequence of double additions; ids with many tokens are spread over a block's warps in a fixed
//    interleaving (see embedding_backward_big_kernel).
// No float atomics anywhere. Index checks: index_errors.cuh.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "fourbit/ops/cuda/bucket_sort.cuh"
#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/fused_rows.h"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/reduce.cuh"
#include "fourbit/ops/cuda/row_math.cuh"
#include "fourbit/ops/cuda/vec4.cuh"
#include "fourbit/ops/quant_layout.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kRowWarps = 8;  // warp-per-row kernels: one row per warp, 8 warps per block
constexpr int kRowThreads = kRowWarps * 32;
constexpr int kEltThreads = 256;   // elementwise kernels
constexpr int kColThreads = 128;   // column kernels: one group of 4 columns per thread
constexpr int kXentThreads = 1024;  // cross_entropy: one row per block, at most (see cross_entropy_kernel)
constexpr int64_t kSmallBucket = 32;  // embedding_backward: ids with at most this many tokens ...
constexpr int kBigBucketWarps = 32;   // ... else a block of 32 warps per (id, 128 columns) ...
constexpr int kBigBucketBatch = 8;    // ... each warp with the loads of 8 rows in flight
constexpr int64_t kDwMinRows = 32;   // rmsnorm dw: rows per chunk at least this ...
constexpr int64_t kDwMaxChunks = 256;  // ... and at most this many chunks (bounds the scratch)
constexpr int kFusedNormMaxThreads = 512;  // rmsnorm backward in one pass: D <= 4 * this (2048)
constexpr int kDwFinishThreads = 32;        // rmsnorm dw finish: a warp per 32 columns

__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int64_t first_row_of_warp() {
  return blockIdx.x * int64_t(kRowWarps) + threadIdx.x / 32;
}
__device__ __forceinline__ int64_t warp_row_stride() { return int64_t(gridDim.x) * kRowWarps; }
unsigned warp_row_grid(int64_t rows) { return grid_for(rows, kRowWarps); }

// ---- embedding --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kRowThreads)
    embedding_forward_kernel(const int32_t* tok, const float* table, float* out, int64_t N,
                             int64_t V, int64_t D, bool vec, IndexError* err) {
  dependent_launch_prologue();
  const int lane = lane_id();
  const int64_t groups = (D + 3) / 4;
  for (int64_t n = first_row_of_warp(); n < N; n += warp_row_stride()) {
    const int32_t id = tok[n];
    float* o = out + n * D;
    if (id < 0 || id >= V) {  // recorded, row left as zeros, never read out of bounds
      if (lane == 0) record_index_error(err, IndexSite::EmbeddingForwardTokens, n, id, V, 1);
      const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t g = lane; g < groups; g += 32) store4(o, 4 * g, D, vec, zero);
      continue;
    }
    const float* src = table + int64_t(id) * D;
    for (int64_t g = lane; g < groups; g += 32) {
      float v[4];
      load4(src, 4 * g, D, vec, v);
      store4(o, 4 * g, D, vec, v);
    }
  }
}

// Ids used by at most kSmallBucket tokens (nearly all of them): block (x, y) owns column group
// blockIdx.y * kColThreads + threadIdx.x of the ids blockIdx.x, blockIdx.x + gridDim.x, ...;
// order[start[v] .. start[v+1]) are v's token positions, ascending, and the thread adds those
// rows in that order in double, then dtable[v] += the sum with one rounding: the CPU's sequence.
__global__ void __launch_bounds__(kColThreads)
    embedding_backward_small_kernel(const float* dout, const int32_t* order, const int32_t* start,
                                    float* dtable, int64_t V, int64_t D, bool vec) {
  const int64_t g = blockIdx.y * int64_t(kColThreads) + threadIdx.x;
  if (4 * g >= D) return;
  for (int64_t v = blockIdx.x; v < V; v += gridDim.x) {
    const int32_t begin = start[v], end = start[v + 1];
    // Unused ids are not touched (the CPU skips them too); big ones are the other kernel's.
    if (begin == end || end - begin > kSmallBucket) continue;
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    for (int32_t r = begin; r < end; ++r) {
      float x[4];
      load4(dout + int64_t(order[r]) * D, 4 * g, D, vec, x);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c] += double(x[c]);
    }
    float* dst = dtable + v * D;
    float d[4];
    load4(dst, 4 * g, D, vec, d);
#pragma unroll
    for (int c = 0; c < 4; ++c) d[c] = float(double(d[c]) + acc[c]);
    store4(dst, 4 * g, D, vec, d);
  }
}

// Ids used by more than kSmallBucket tokens (a frequent token, padding): one sequential sum would
// leave a few threads walking thousands of rows, so a block spreads the rows of such an id over
// its 32 warps for columns [128 blockIdx.y, + 128), lane l owning 4 of them. Warp w adds rows
// w, w + 32, w + 64, ... of the id in ascending order (the loads of kBigBucketBatch rows in
// flight), then warp 0 adds the 32 warp sums in warp order: a fixed order for a given token
// count, so the result is deterministic; it differs from the CPU's sequential sum only by double
// rounding. Blocks find their ids a window of 1024 at a time (one id per thread); the order of
// the window's list (a shared-memory counter) does not matter, as each id is computed alone.
__global__ void __launch_bounds__(kBigBucketWarps * 32)
    embedding_backward_big_kernel(const float* dout, const int32_t* order, const int32_t* start,
                                  float* dtable, int64_t V, int64_t D, bool vec) {
  constexpr int kThreads = kBigBucketWarps * 32;
  __shared__ double partial[kBigBucketWarps][128];
  __shared__ int32_t big_ids[kThreads];
  __shared__ int big_count;
  const int lane = lane_id(), warp = threadIdx.x / 32;
  const int64_t col = blockIdx.y * int64_t(128) + 4 * lane;  // past D: loads give zeros
  for (int64_t window = blockIdx.x * int64_t(kThreads); window < V;
       window += int64_t(gridDim.x) * kThreads) {
    if (threadIdx.x == 0) big_count = 0;
    __syncthreads();
    const int64_t mine = window + threadIdx.x;
    if (mine < V && start[mine + 1] - start[mine] > kSmallBucket)
      big_ids[atomicAdd(&big_count, 1)] = int32_t(mine);
    __syncthreads();
    const int count = big_count;
    for (int i = 0; i < count; ++i) {
      const int64_t v = big_ids[i];
      const int32_t begin = start[v], end = start[v + 1];
      double acc[4] = {0.0, 0.0, 0.0, 0.0};
      for (int64_t r0 = begin + warp; r0 < end;
           r0 += int64_t(kBigBucketWarps) * kBigBucketBatch) {
        float x[kBigBucketBatch][4];
#pragma unroll
        for (int u = 0; u < kBigBucketBatch; ++u) {
          const int64_t r = r0 + int64_t(u) * kBigBucketWarps;
          if (r < end) {
            load4(dout + int64_t(order[r]) * D, col, D, vec, x[u]);
          } else {
#pragma unroll
            for (int c = 0; c < 4; ++c) x[u][c] = 0.0f;  // adds nothing
          }
        }
#pragma unroll
        for (int u = 0; u < kBigBucketBatch; ++u)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[c] += double(x[u][c]);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) partial[warp][4 * lane + c] = acc[c];
      __syncthreads();
      if (warp == 0 && col < D) {
        double total[4] = {0.0, 0.0, 0.0, 0.0};
        for (int w = 0; w < kBigBucketWarps; ++w)
#pragma unroll
          for (int c = 0; c < 4; ++c) total[c] += partial[w][4 * lane + c];
        float* dst = dtable + v * D;
        float d[4];
        load4(dst, col, D, vec, d);
#pragma unroll
        for (int c = 0; c < 4; ++c) d[c] = float(double(d[c]) + total[c]);
        store4(dst, col, D, vec, d);
      }
      __syncthreads();  // partial is rewritten for the next id
    }
    __syncthreads();  // every thread has read big_count and big_ids before the next window
  }
}

// ---- rmsnorm ----------------------------------------------------------------------------------

// With `b` (add_rmsnorm_forward): x + b (add_'s FP32 sum) is normed and written to `sum`
// (rmsnorm_row, row_math.cuh: the lane order that fixes the bits).
template <typename O>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_forward_kernel(const float* x, const float* w, double eps, O* y, float* rstd,
                           int64_t N, int64_t D, bool vec, uint16_t* yb, bool vec_b, const float* b,
                           float* sum) {
  dependent_launch_prologue();
  for (int64_t n = first_row_of_warp(); n < N; n += warp_row_stride()) {
    O* yr = y + n * D;
    rmsnorm_row(x, w, eps, rstd, n, D, vec, b, sum, [&](int64_t g, const float (&out)[4]) {
      store4(yr, 4 * g, D, vec, out);
      if (yb) store4(yb + n * D, 4 * g, D, vec_b, out);
    });
  }
}

// dx = (w*dy - y_hat * mean(w*dy*y_hat)) * rstd with y_hat = x * rstd, per row.
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_backward_dx_kernel(const float* dy, const float* x, const float* w, const float* rstd,
                               float* dx, int64_t N, int64_t D, bool vec, bool dx_accumulate, uint16_t* dxb,
                               bool vec_b) {
  const int lane = lane_id();
  const int64_t groups = (D + 3) / 4;
  for (int64_t n = first_row_of_warp(); n < N; n += warp_row_stride()) {
    const float* xr = x + n * D;
    const float* dyr = dy + n * D;
    const double rs = double(rstd[n]);
    double dot = 0.0;
    for (int64_t g = lane; g < groups; g += 32) {
      float xv[4], dv[4], wv[4];
      load4(xr, 4 * g, D, vec, xv);
      load4(dyr, 4 * g, D, vec, dv);
      load4(w, 4 * g, D, vec, wv);
#pragma unroll
      for (int c = 0; c < 4; ++c) dot += double(wv[c]) * double(dv[c]) * (double(xv[c]) * rs);
    }
    const double mean = warp_sum(dot) / double(D);
    float* dxr = dx + n * D;
    for (int64_t g = lane; g < groups; g += 32) {
      float xv[4], dv[4], wv[4], out[4];
      load4(xr, 4 * g, D, vec, xv);
      load4(dyr, 4 * g, D, vec, dv);
      load4(w, 4 * g, D, vec, wv);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        out[c] = float((double(wv[c]) * double(dv[c]) - double(xv[c]) * rs * mean) * rs);
      if (dx_accumulate) {  // add_'s sum of the rounded value
        float old[4];
        load4(dxr, 4 * g, D, vec, old);
#pragma unroll
        for (int c = 0; c < 4; ++c) out[c] = num::add_rn(old[c], out[c]);
      }
      store4(dxr, 4 * g, D, vec, out);
      if (dxb) store4(dxb + n * D, 4 * g, D, vec_b, out);
    }
  }
}

// Block (x, y): column group blockIdx.x * kColThreads + threadIdx.x, rows of chunk blockIdx.y in
// ascending order; partial[chunk, d] = sum over the chunk of dy * (x * rstd).
__global__ void __launch_bounds__(kColThreads)
    rmsnorm_dw_partials_kernel(const float* dy, const float* x, const float* rstd, int64_t N,
                               int64_t D, int64_t rows_per_chunk, bool vec, double* partial) {
  const int64_t g = blockIdx.x * int64_t(kColThreads) + threadIdx.x;
  if (4 * g >= D) return;
  const int64_t chunk = blockIdx.y;
  const int64_t n0 = chunk * rows_per_chunk;
  const int64_t n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t n = n0; n < n1; ++n) {
    const double rs = double(rstd[n]);
    float dv[4], xv[4];
    load4(dy + n * D, 4 * g, D, vec, dv);
    load4(x + n * D, 4 * g, D, vec, xv);
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] += double(dv[c]) * (double(xv[c]) * rs);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (4 * g + c < D) partial[chunk * D + 4 * g + c] = acc[c];
}

// The whole backward for D <= 4 * kFusedNormMaxThreads in one pass over dy and x: block b takes
// the rows of dw chunk b in ascending order, two at a time, thread t the column group t (4
// columns). Per row the block reduces the dot of rmsnorm_backward_dx_kernel (each thread's 4
// products in column order, the warp butterfly, then the warps' totals with the same butterfly: a
// tree fixed by D, so a row's dx never depends on N or on the row's place), writes dx, and adds
// the row's dy * y_hat to the thread's dw partial: rmsnorm_dw_partials_kernel's sums, the same
// bits. The next two rows' dy and x are loaded while these two rows' dots are reduced.
__global__ void __launch_bounds__(kFusedNormMaxThreads)
    rmsnorm_backward_fused_kernel(const float* dy, const float* x, const float* w, const float* rstd,
                                  float* dx, int64_t N, int64_t D, int64_t rows_per_chunk, bool vec,
                                  bool dx_accumulate, double* partial, uint16_t* dxb, bool vec_b) {
  __shared__ double warp_dots[2][2][32];  // [pair parity][row of the pair][warp]: one barrier a pair
  const int lane = lane_id(), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t g = threadIdx.x;
  const bool active = 4 * g < D;
  const int64_t chunk = blockIdx.x, n0 = chunk * rows_per_chunk;
  const int64_t n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
  float wv[4] = {0, 0, 0, 0}, dv[2][4], xv[2][4];
  const auto load_pair = [&](int64_t n, float d[2][4], float xx[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (active && n + j < n1) {
        load4(dy + (n + j) * D, 4 * g, D, vec, d[j]);
        load4(x + (n + j) * D, 4 * g, D, vec, xx[j]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) d[j][c] = xx[j][c] = 0.0f;
      }
    }
  };
  if (active) load4(w, 4 * g, D, vec, wv);
  load_pair(n0, dv, xv);
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t n = n0; n < n1; n += 2) {
    float dn[2][4], xn[2][4];
    load_pair(n + 2, dn, xn);
    const int parity = int((n - n0) / 2) & 1;
    double rs[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      rs[j] = n + j < n1 ? double(rstd[n + j]) : 0.0;
      double dot = 0.0;
#pragma unroll
      for (int c = 0; c < 4; ++c) dot += double(wv[c]) * double(dv[j][c]) * (double(xv[j][c]) * rs[j]);
      dot = warp_sum(dot);
      if (lane == 0) warp_dots[parity][j][warp] = dot;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const double mean = warp_sum(lane < warps ? warp_dots[parity][j][lane] : 0.0) / double(D);
      if (!active || n + j >= n1) continue;
      float out[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        out[c] = float((double(wv[c]) * double(dv[j][c]) - double(xv[j][c]) * rs[j] * mean) * rs[j]);
        acc[c] += double(dv[j][c]) * (double(xv[j][c]) * rs[j]);
      }
      float* dxr = dx + (n + j) * D;
      if (dx_accumulate) {  // add_'s sum of the rounded value
        float old[4];
        load4(dxr, 4 * g, D, vec, old);
#pragma unroll
        for (int c = 0; c < 4; ++c) out[c] = num::add_rn(old[c], out[c]);
      }
      store4(dxr, 4 * g, D, vec, out);
      if (dxb) store4(dxb + (n + j) * D, 4 * g, D, vec_b, out);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) dv[j][c] = dn[j][c], xv[j][c] = xn[j][c];
  }
  if (active)
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (4 * g + c < D) partial[chunk * D + 4 * g + c] = acc[c];
}

// dw[d] (+)= the chunk partials of column d added in chunk order (one rounding, as on the CPU);
// dw_accumulate false stores the sum (the bits of adding it to zeros: the sum is never -0).
// A warp per 32 columns with the loads unrolled ahead of the (ordered) adds: the chain of
// chunks dependent loads was the kernel's time.
__global__ void __launch_bounds__(kDwFinishThreads)
    rmsnorm_dw_finish_kernel(const double* partial, int64_t chunks, int64_t D, float* dw,
                             bool dw_accumulate) {
  const int64_t d = blockIdx.x * int64_t(kDwFinishThreads) + threadIdx.x;
  if (d >= D) return;
  double total = 0.0;
#pragma unroll 16
  for (int64_t c = 0; c < chunks; ++c) total += partial[c * D + d];
  dw[d] = dw_accumulate ? float(double(dw[d]) + total) : float(total);
}

// ---- rope -------------------------------------------------------------------------------------

// One thread per (row n, head h, group of 4 pairs): pairs (i, i + hd/2) rotate by +angle
// (sign = 1) or -angle (sign = -1):  a' = a cos - s b sin,  b' = b cos + s a sin. xb (or null):
// the rotated values' BF16 encodings too, in x's layout (vec_b: 8-byte stores); store_x: the
// rotated values also back into x (false: the BF16 copy only).
__global__ void __launch_bounds__(kEltThreads)
    rope_kernel(float* x, uint16_t* xb, const int32_t* pos, const float* table, int64_t N, int64_t H,
                int64_t hd, int64_t max_pos, double sign, bool vec, bool vec_b, bool store_x, IndexSite site,
                IndexError* err) {
  const int64_t half = hd / 2, groups = (half + 3) / 4, items = N * H * groups;
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = item % groups, nh = item / groups, n = nh / H;
    const int32_t p = pos[n];
    if (p < 0 || p >= max_pos) {  // recorded once per row, x left unrotated
      if (g == 0 && nh % H == 0) record_index_error(err, site, n, p, max_pos, 1);
      continue;
    }
    float* row = x + nh * hd;
    const float* cs = table + int64_t(p) * hd;
    float a[4], b[4], c[4], s[4];
    load4(row, 4 * g, half, vec, a);
    load4(row + half, 4 * g, half, vec, b);
    load4(cs, 4 * g, half, vec, c);
    load4(cs + half, 4 * g, half, vec, s);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const double cc = double(c[k]), ss = sign * double(s[k]);
      const double aa = double(a[k]), bb = double(b[k]);
      a[k] = float(aa * cc - bb * ss);
      b[k] = float(bb * cc + aa * ss);
    }
    if (store_x) {
      store4(row, 4 * g, half, vec, a);
      store4(row + half, 4 * g, half, vec, b);
    }
    if (xb) {
      store4(xb + nh * hd, 4 * g, half, vec_b, a);
      store4(xb + nh * hd + half, 4 * g, half, vec_b, b);
    }
  }
}

// ops::rope_qkv_to_cache: one thread per (row n, head h, group g of 4 pairs), the heads being q's
// Hq, then k's Hkv, then v's Hkv. q and k rotate by rope_kernel's arithmetic (sign 1) into their
// BF16 copies (q_bf16; k's cache row dst[n]); v's values are rounded to BF16 into its cache row
// (store4's bf16_encode: convert's bits). A bad position is recorded as rope_forward records it and
// leaves the row's q and k unwritten; a bad cache row as scatter_rows records it, nothing written.
// ldq, ldkv: floats from one row n of q (of k and v) to the next: Hq * hd and Hkv * hd for three
// tensors, (Hq + 2 Hkv) * hd for the fused projection's rows (ops::rope_fused_qkv_to_cache).
__global__ void __launch_bounds__(kEltThreads)
    rope_qkv_cache_kernel(const float* q, const float* k, const float* v, int64_t ldq, int64_t ldkv,
                          const int32_t* pos, const float* table, const int32_t* dst, int64_t N, int64_t Hq,
                          int64_t Hkv, int64_t hd, int64_t max_pos, int64_t cache_rows, uint16_t* qb, uint16_t* kc,
                          uint16_t* vc, bool vec, bool vec_b, IndexError* err) {
  dependent_launch_prologue();
  const int64_t half = hd / 2, groups = (half + 3) / 4, H = Hq + 2 * Hkv, items = N * H * groups;
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = item % groups, nh = item / groups, n = nh / H, h = nh % H;
    const float* src;
    uint16_t* out;
    if (h < Hq) {
      src = q + n * ldq + h * hd;
      out = qb + (n * Hq + h) * hd;
    } else {
      const int32_t d = dst[n];
      if (d < 0 || d >= cache_rows) {  // recorded once per row; nothing written
        if (g == 0 && h == Hq) record_index_error(err, IndexSite::ScatterRowsDstRows, n, d, cache_rows, 1);
        continue;
      }
      const bool is_k = h < Hq + Hkv;
      const int64_t hk = h - Hq - (is_k ? 0 : Hkv);
      src = (is_k ? k : v) + n * ldkv + hk * hd;
      out = (is_k ? kc : vc) + (int64_t(d) * Hkv + hk) * hd;
    }
    float a[4], b[4];
    load4(src, 4 * g, half, vec, a);
    load4(src + half, 4 * g, half, vec, b);
    if (h < Hq + Hkv) {
      const int32_t p = pos[n];
      if (p < 0 || p >= max_pos) {  // recorded once per row, q and k left unwritten
        if (g == 0 && h == 0) record_index_error(err, IndexSite::RopeForwardPositions, n, p, max_pos, 1);
        continue;
      }
      const float* cs = table + int64_t(p) * hd;
      float c[4], s[4];
      load4(cs, 4 * g, half, vec, c);
      load4(cs + half, 4 * g, half, vec, s);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const double cc = double(c[e]), ss = double(s[e]);
        const double aa = double(a[e]), bb = double(b[e]);
        a[e] = float(aa * cc - bb * ss);
        b[e] = float(bb * cc + aa * ss);
      }
    }
    store4(out, 4 * g, half, vec_b, a);
    store4(out + half, 4 * g, half, vec_b, b);
  }
}

// ---- swiglu -----------------------------------------------------------------------------------

// O: float, or uint16_t for a BF16 output (vec4.cuh's store4 encodes it). rows of F values: h1's
// and h3's row r start ld floats after row r - 1's, a's F values after it (one row of n values for
// two tensors; rows of the fused gate|up output, h3 = h1 + F, ld = 2F, for swiglu_forward_fused).
template <typename O>
__global__ void __launch_bounds__(kEltThreads)
    swiglu_forward_kernel(const float* h1, const float* h3, O* a, int64_t rows, int64_t F, int64_t ld, bool vec) {
  dependent_launch_prologue();
  const int64_t row_groups = (F + 3) / 4, groups = rows * row_groups;
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < groups;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = item / row_groups, g = item % row_groups;
    float z[4], u[4], out[4];
    load4(h1 + r * ld, 4 * g, F, vec, z);
    load4(h3 + r * ld, 4 * g, F, vec, u);
#pragma unroll
    for (int c = 0; c < 4; ++c) out[c] = swiglu_value(z[c], u[c]);
    store4(a + r * F, 4 * g, F, vec, out);
  }
}

// dh1 and dh3 from da, h1 and h3 (swiglu_grads).
template <typename O>
__global__ void __launch_bounds__(kEltThreads)
    swiglu_backward_kernel(const float* da, const float* h1, const float* h3, O* dh1,
                           O* dh3, int64_t n, bool vec) {
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    float gv[4], z[4], u[4], o1[4], o3[4];
    load4(da, 4 * g, n, vec, gv);
    load4(h1, 4 * g, n, vec, z);
    load4(h3, 4 * g, n, vec, u);
#pragma unroll
    for (int c = 0; c < 4; ++c) swiglu_grads(gv[c], z[c], u[c], o1[c], o3[c]);
    store4(dh1, 4 * g, n, vec, o1);
    store4(dh3, 4 * g, n, vec, o3);
  }
}

// ---- cross entropy ----------------------------------------------------------------------------
// The one layer whose inner loops run in float: two exponentials per logit in double, with the
// float <-> double conversions around them (a quarter of the FP64 rate on Hopper), made it
// compute-bound at a third of the memory bandwidth. Float arithmetic with three guards keeps each
// output within a few float ulps of the CPU's double result:
//  - x - m (m the row max, exact) rounds by at most half an ulp of |x - m|: a relative error of
//    |x - m| 2^-24 in exp(x - m), small exactly where the term is large; the max contributes
//    exp(0) = 1 exactly;
//  - each thread adds its terms with Kahan compensation and hands the block tree (in double) the
//    compensated value, so l = 1 + (the rest) keeps the rest's digits, and a confident token's
//    loss log(l) stays accurate relative to itself;
//  - the gradient subtracts lse as float hi + lo, and the target's p_t - 1, which cancels as
//    p_t -> 1, is expm1f of a small and accurate argument.
//
// One block of T threads per row (grid-stride; the branch on the target is uniform over the block,
// so every thread reaches the same block reductions). Thread t owns groups t, t + T, ...
// The row is read three times (max, sum, gradient); with 1024 threads a block, at most two rows
// per SM are in flight (~34 MB for V = 32000 on an H200), so the second and third reads hit L2.
// T is the smallest of 128, 256, 512 that has a thread for every group of 4 logits, else 1024
// (cross_entropy_threads): where T >= the groups, each thread owns one group whatever T is, and the
// warps past the row add exact zeros to the block tree (reduce.cuh), so every T gives the same
// bits; a small vocabulary (V = 260: 65 groups) then runs 128 threads a row instead of 1024, of
// which 959 waited at every block reduction.
template <int T>
__global__ void __launch_bounds__(T)
    cross_entropy_kernel(const float* logits, const int32_t* tgt, const float* weights, float* losses,
                         float* dlogits, float grad_scale, const float* scale_dev, int64_t N, int64_t V, bool vec,
                         IndexError* err) {
  dependent_launch_prologue();
  if (scale_dev) grad_scale = *scale_dev;  // count_targets' (after the prologue: its writer may still run)
  static_assert(T % 32 == 0 && T <= kXentThreads, "whole warps, at most kXentThreads");
  __shared__ float max_scratch[T / 32];
  __shared__ double sum_scratch[T / 32];
  const int64_t groups = (V + 3) / 4;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    float* grad = dlogits ? dlogits + n * V : nullptr;
    const int32_t t = tgt[n];
    if (t < 0 || t >= V) {  // -1: ignored (loss 0, zero gradient row); anything else: recorded
      if (threadIdx.x == 0) {
        losses[n] = 0.0f;
        if (t != -1) record_index_error(err, IndexSite::CrossEntropyTargets, n, t, V, 1);
      }
      if (grad) {
        const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t g = threadIdx.x; g < groups; g += T) store4(grad, 4 * g, V, vec, zero);
      }
      continue;
    }
    float m = -INFINITY;
    for (int64_t g = threadIdx.x; g < groups; g += T) {
      float v[4];
      load4(x, 4 * g, V, vec, v);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (4 * g + c < V) m = fmaxf(m, v[c]);
    }
    // The max of floats is exact in any order. (A NaN logit is skipped here but makes l NaN.)
    m = block_max<T>(m, max_scratch);
    float sum = 0.0f, lost = 0.0f;  // Kahan: the running sum and the low part it dropped
    for (int64_t g = threadIdx.x; g < groups; g += T) {
      float v[4];
      load4(x, 4 * g, V, vec, v);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (4 * g + c < V) {
          const float y = expf(v[c] - m) - lost;
          const float next = sum + y;
          lost = (next - sum) - y;
          sum = next;
        }
    }
    const double l = block_sum<T>(double(sum) - double(lost), sum_scratch);
    const double lse = double(m) + log(l);
    if (threadIdx.x == 0) losses[n] = float(lse - double(x[t]));
    if (grad) {
      // The row's weight folds into the scale (one float product); none: grad_scale, same bits.
      const float scale = weights ? grad_scale * weights[n] : grad_scale;
      const float lse_hi = float(lse), lse_lo = float(lse - double(lse_hi));
      for (int64_t g = threadIdx.x; g < groups; g += T) {
        float v[4], out[4];
        load4(x, 4 * g, V, vec, v);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float d = (v[c] - lse_hi) - lse_lo;
          out[c] = (4 * g + c == t ? expm1f(d) : expf(d)) * scale;
        }
        store4(grad, 4 * g, V, vec, out);
      }
    }
  }
}

// ---- shared host helpers ----------------------------------------------------------------------

void expect_tokens_1d(const char* op, const Tensor& tokens) {
  if (!tokens.defined() || tokens.dim() != 1)
    fail("{}: tokens must be i32[N], got {}", op, tokens.defined() ? tokens.str() : "undefined");
}

// The BF16 copy's pointer, or null, and whether its groups of 4 (of a row of D values) take
// 8-byte stores.
uint16_t* bf16_copy_ptr(Tensor* t, int64_t D, bool& vec) {
  uint16_t* p = t ? static_cast<uint16_t*>(t->raw()) : nullptr;
  vec = p && D % 4 == 0 && reinterpret_cast<uintptr_t>(p) % 8 == 0;
  return p;
}

void rope(const char* op, IndexSite site, Tensor& x, const Tensor& positions, const Tensor& table,
          double sign, Tensor* x_bf16, bool bf16_only) {
  expect_f32(op, "x", x, 3, "[N, H, hd]");
  const int64_t N = x.size(0), H = x.size(1), hd = x.size(2);
  if (hd % 2 != 0) fail("{}: head_dim must be even, got x {}", op, x.str());
  expect_index(op, "positions", positions, {N}, "[N]");
  expect_f32(op, "table", table, 2, "[max_pos, hd]");
  if (table.size(1) != hd)
    fail("{}: table must be [max_pos, hd] with hd={}, got {}", op, hd, table.str());
  const int64_t half = hd / 2, items = N * H * ((half + 3) / 4);
  if (items == 0) return;
  const bool vec = half % 4 == 0 && aligned16(x.raw()) && aligned16(table.raw());
  bool vec_b;  // rope's groups of 4 are within a half row
  uint16_t* xb = bf16_copy_ptr(x_bf16, half, vec_b);
  rope_kernel<<<grid_for(items, kEltThreads), kEltThreads, 0, stream()>>>(
      x.data<float>(), xb, positions.data<int32_t>(), table.data<float>(), N, H, hd, table.size(0),
      sign, vec, vec_b, !bf16_only, site, index_error_record());
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace

void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out) {
  const char* op = "embedding_forward";
  expect_f32(op, "table", table, 2, "[V, D]");
  expect_tokens_1d(op, tokens);
  const int64_t N = tokens.size(0), V = table.size(0), D = table.size(1);
  expect_index(op, "tokens", tokens, {N}, "[N]");
  expect_dims(op, "out", out, DType::F32, {N, D}, "[N, D]");
  if (N == 0) return;
  const bool vec = D % 4 == 0 && aligned16(table.raw()) && aligned16(out.raw());
  launch_dependent(embedding_forward_kernel, warp_row_grid(N), kRowThreads, 0, tokens.data<int32_t>(),
                   table.data<float>(), out.data<float>(), N, V, D, vec, index_error_record());
  // token ids are user data: a bad one fails here, as on the CPU (in a DeferIndexChecks scope, at the
  // caller's later check)
  check_index_errors();
}

void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable, bool tokens_checked) {
  const char* op = "embedding_backward";
  expect_f32(op, "dtable", dtable, 2, "[V, D]");
  const int64_t V = dtable.size(0), D = dtable.size(1);
  expect_tokens_1d(op, tokens);
  const int64_t N = tokens.size(0);
  expect_index(op, "tokens", tokens, {N}, "[N]");
  expect_dims(op, "dout", dout, DType::F32, {N, D}, "[N, D]");
  if (N >= (int64_t(1) << 31)) fail("{}: N={} tokens exceed the 32-bit sort", op, N);
  if (N == 0) return;
  Tensor order = Tensor::empty({N}, DType::I32, Device::CUDA);
  Tensor start = Tensor::empty({V + 1}, DType::I32, Device::CUDA);
  stable_bucket_sort(tokens.data<int32_t>(), N, V, IndexSite::EmbeddingBackwardTokens, 1, 1,
                     order.data<int32_t>(), nullptr, start.data<int32_t>());
  const int64_t groups = (D + 3) / 4;
  if (groups > 0) {
    const bool vec = D % 4 == 0 && aligned16(dout.raw()) && aligned16(dtable.raw());
    const dim3 small_grid(grid_for(V, 1, 2048), unsigned((groups + kColThreads - 1) / kColThreads));
    embedding_backward_small_kernel<<<small_grid, kColThreads, 0, stream()>>>(
        dout.data<float>(), order.data<int32_t>(), start.data<int32_t>(), dtable.data<float>(), V,
        D, vec);
    FOURBIT_LAUNCH_CHECK();
    const dim3 big_grid(grid_for(V, kBigBucketWarps * 32, 64), unsigned((D + 127) / 128));
    embedding_backward_big_kernel<<<big_grid, kBigBucketWarps * 32, 0, stream()>>>(
        dout.data<float>(), order.data<int32_t>(), start.data<int32_t>(), dtable.data<float>(), V,
        D, vec);
    FOURBIT_LAUNCH_CHECK();
  }
  // token ids are user data (bad ones were left out of the sort); checked ones need no second read
  if (!tokens_checked) check_index_errors();
}

namespace {
// rmsnorm_forward's and add_rmsnorm_forward's arguments, checked (b and sum: the add's, or null;
// x is the add's a), and what their kernels take.
struct NormArgs {
  int64_t N, D;
  DType out_dt;
  bool vec;  // float4 loads and stores: D % 4 == 0, every row 16-byte aligned
  uint16_t* yb;
  bool vec_b;
};
NormArgs norm_args(const char* op, const Tensor& x, const Tensor* b, const Tensor* sum, const Tensor& w, float eps,
                   const Tensor& y, const Tensor& rstd, Tensor* y_bf16) {
  expect_f32(op, b ? "a" : "x", x, 2, "[N, D]");
  NormArgs n{};
  n.N = x.size(0);
  n.D = x.size(1);
  if (b) {
    expect_dims(op, "b", *b, DType::F32, {n.N, n.D}, "[N, D]");
    expect_dims(op, "sum", *sum, DType::F32, {n.N, n.D}, "[N, D]");
  }
  expect_dims(op, "w", w, DType::F32, {n.D}, "[D]");
  n.out_dt = expect_out(op, "y", y, {n.N, n.D}, "[N, D]");
  expect_dims(op, "rstd", rstd, DType::F32, {n.N}, "[N]");
  if (!(eps >= 0.0f)) fail("{}: eps must be >= 0, got {}", op, eps);
  n.vec = n.D % 4 == 0 && aligned16(x.raw()) && aligned16(w.raw()) && out_aligned(y) &&
          (!b || (aligned16(b->raw()) && aligned16(sum->raw())));
  n.yb = bf16_copy_ptr(y_bf16, n.D, n.vec_b);
  return n;
}

void norm_forward(const NormArgs& n, const Tensor& x, const Tensor* b, Tensor* sum, const Tensor& w, float eps,
                  Tensor& y, Tensor& rstd) {
  if (n.N == 0) return;
  with_out_type(n.out_dt, [&](auto tag) {
    using O = decltype(tag);
    launch_dependent(rmsnorm_forward_kernel<O>, warp_row_grid(n.N), kRowThreads, 0, x.data<float>(), w.data<float>(),
                     double(eps), y.data<O>(), rstd.data<float>(), n.N, n.D, n.vec, n.yb, n.vec_b,
                     b ? b->data<float>() : nullptr, sum ? sum->data<float>() : nullptr);
  });
}

// The norm with y quantized in the same kernel (fused_rows.cu), where it takes the spec and y's
// layout; false (nothing done) otherwise.
bool norm_forward_quantized(const NormArgs& n, const Tensor& x, const Tensor* b, Tensor* sum, const Tensor& w,
                            float eps, Tensor& y, Tensor& rstd, const RowQuant& yq) {
  if (n.N == 0 || n.out_dt != DType::F32 || !n.vec || !row_quant_fused(yq.spec, n.D)) return false;
  *yq.out = alloc_qtensor(yq.spec, quant_shape(y, yq.spec), Device::CUDA);
  launch_rmsnorm_rows_quantized(x.data<float>(), w.data<float>(), double(eps), y.data<float>(), rstd.data<float>(),
                                n.N, n.D, n.yb, n.vec_b, b ? b->data<float>() : nullptr,
                                sum ? sum->data<float>() : nullptr, yq.spec, *yq.out);
  return true;
}
}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd, Tensor* y_bf16) {
  const NormArgs n = norm_args("rmsnorm_forward", x, nullptr, nullptr, w, eps, y, rstd, y_bf16);
  norm_forward(n, x, nullptr, nullptr, w, eps, y, rstd);
}

void add_rmsnorm_forward(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& y,
                         Tensor& rstd, Tensor* y_bf16) {
  const NormArgs n = norm_args("add_rmsnorm_forward", a, &b, &sum, w, eps, y, rstd, y_bf16);
  norm_forward(n, a, &b, &sum, w, eps, y, rstd);
}

bool rmsnorm_forward_quantized(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd, Tensor* y_bf16,
                               const RowQuant& yq) {
  const NormArgs n = norm_args("rmsnorm_forward", x, nullptr, nullptr, w, eps, y, rstd, y_bf16);
  return norm_forward_quantized(n, x, nullptr, nullptr, w, eps, y, rstd, yq);
}

bool add_rmsnorm_forward_quantized(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& y,
                                   Tensor& rstd, Tensor* y_bf16, const RowQuant& yq) {
  const NormArgs n = norm_args("add_rmsnorm_forward", a, &b, &sum, w, eps, y, rstd, y_bf16);
  return norm_forward_quantized(n, a, &b, &sum, w, eps, y, rstd, yq);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool dx_accumulate, bool dw_accumulate, Tensor* dx_bf16) {
  const char* op = "rmsnorm_backward";
  expect_f32(op, "x", x, 2, "[N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  expect_dims(op, "dy", dy, DType::F32, {N, D}, "[N, D]");
  expect_dims(op, "w", w, DType::F32, {D}, "[D]");
  expect_dims(op, "rstd", rstd, DType::F32, {N}, "[N]");
  expect_dims(op, "dx", dx, DType::F32, {N, D}, "[N, D]");
  expect_dims(op, "dw", dw, DType::F32, {D}, "[D]");
  if (D == 0) return;
  if (N == 0) {  // dw += an empty sum; a stored one is zeros
    if (!dw_accumulate) dw.zero_();
    return;
  }
  const bool vec = D % 4 == 0 && aligned16(dy.raw()) && aligned16(x.raw()) &&
                   aligned16(w.raw()) && aligned16(dx.raw());
  // dw: the chunking is a function of N alone, so a given batch always sums in the same order.
  int64_t rows_per_chunk = (N + kDwMaxChunks - 1) / kDwMaxChunks;
  if (rows_per_chunk < kDwMinRows) rows_per_chunk = kDwMinRows;
  const int64_t chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = Tensor::empty({chunks, D}, DType::F64, Device::CUDA);
  const int64_t groups = (D + 3) / 4;
  bool vec_b;
  uint16_t* dxb = bf16_copy_ptr(dx_bf16, D, vec_b);
  if (groups <= kFusedNormMaxThreads) {
    const unsigned threads = unsigned((groups + 31) / 32 * 32);
    rmsnorm_backward_fused_kernel<<<unsigned(chunks), threads, 0, stream()>>>(
        dy.data<float>(), x.data<float>(), w.data<float>(), rstd.data<float>(), dx.data<float>(), N, D,
        rows_per_chunk, vec, dx_accumulate, partial.data<double>(), dxb, vec_b);
    FOURBIT_LAUNCH_CHECK();
  } else {
    rmsnorm_backward_dx_kernel<<<warp_row_grid(N), kRowThreads, 0, stream()>>>(
        dy.data<float>(), x.data<float>(), w.data<float>(), rstd.data<float>(), dx.data<float>(), N,
        D, vec, dx_accumulate, dxb, vec_b);
    FOURBIT_LAUNCH_CHECK();
    const dim3 grid(unsigned((groups + kColThreads - 1) / kColThreads), unsigned(chunks));
    const bool vec_dw = D % 4 == 0 && aligned16(dy.raw()) && aligned16(x.raw());
    rmsnorm_dw_partials_kernel<<<grid, kColThreads, 0, stream()>>>(dy.data<float>(), x.data<float>(),
                                                      rstd.data<float>(), N, D, rows_per_chunk,
                                                      vec_dw, partial.data<double>());
    FOURBIT_LAUNCH_CHECK();
  }
  rmsnorm_dw_finish_kernel<<<unsigned((D + kDwFinishThreads - 1) / kDwFinishThreads), kDwFinishThreads, 0, stream()>>>(
      partial.data<double>(), chunks, D, dw.data<float>(), dw_accumulate);
  FOURBIT_LAUNCH_CHECK();
}

void rope_forward(Tensor& x, const Tensor& positions, const Tensor& table, Tensor* x_bf16, bool bf16_only) {
  rope("rope_forward", IndexSite::RopeForwardPositions, x, positions, table, 1.0, x_bf16, bf16_only);
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& table, Tensor* dx_bf16, bool bf16_only) {
  rope("rope_backward", IndexSite::RopeBackwardPositions, dx, positions, table, -1.0, dx_bf16, bf16_only);
}

namespace {

// The kernel over q, k and v given as row pointers and strides (floats): the three tensors, or
// three column ranges of the fused projection.
bool rope_qkv_rows_to_cache(const char* op, const float* q, const float* k, const float* v, int64_t ldq, int64_t ldkv,
                            int64_t N, int64_t Hq, int64_t Hkv, int64_t hd, const Tensor& positions,
                            const Tensor& table, const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache,
                            Tensor& v_cache) {
  if (hd % 2 != 0) return false;
  expect_index(op, "positions", positions, {N}, "[N]");
  expect_index(op, "dst_rows", dst_rows, {N}, "[N]");
  expect_f32(op, "table", table, 2, "[max_pos, hd]");
  if (table.size(1) != hd) fail("{}: table must be [max_pos, hd] with hd={}, got {}", op, hd, table.str());
  const int64_t half = hd / 2, items = N * (Hq + 2 * Hkv) * ((half + 3) / 4);
  if (items == 0) return true;
  const bool vec = half % 4 == 0 && ldq % 4 == 0 && ldkv % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(v) &&
                   aligned16(table.raw());
  const bool vec_b = half % 4 == 0 && aligned8(q_bf16.raw()) && aligned8(k_cache.raw()) && aligned8(v_cache.raw());
  launch_dependent(rope_qkv_cache_kernel, grid_for(items, kEltThreads), kEltThreads, 0, q, k, v, ldq, ldkv,
                   positions.data<int32_t>(), table.data<float>(), dst_rows.data<int32_t>(), N, Hq, Hkv, hd,
                   table.size(0), k_cache.size(0), static_cast<uint16_t*>(q_bf16.raw()),
                   static_cast<uint16_t*>(k_cache.raw()), static_cast<uint16_t*>(v_cache.raw()), vec, vec_b,
                   index_error_record());
  FOURBIT_LAUNCH_CHECK();
  return true;
}

}  // namespace

bool rope_qkv_to_cache(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& table,
                       const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache) {
  const int64_t N = q.size(0), Hq = q.size(1), hd = q.size(2), Hkv = k.size(1);
  return rope_qkv_rows_to_cache("rope_qkv_to_cache", q.data<float>(), k.data<float>(), v.data<float>(), Hq * hd,
                                Hkv * hd, N, Hq, Hkv, hd, positions, table, dst_rows, q_bf16, k_cache, v_cache);
}

bool rope_fused_qkv_to_cache(const Tensor& qkv, int64_t Hq, const Tensor& positions, const Tensor& table,
                             const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache) {
  const int64_t N = qkv.size(0), H = qkv.size(1), hd = qkv.size(2), Hkv = (H - Hq) / 2;
  const float* q = qkv.data<float>();
  return rope_qkv_rows_to_cache("rope_fused_qkv_to_cache", q, q + Hq * hd, q + (Hq + Hkv) * hd, H * hd, H * hd, N,
                                Hq, Hkv, hd, positions, table, dst_rows, q_bf16, k_cache, v_cache);
}

void swiglu_forward(const Tensor& h1, const Tensor& h3, Tensor& a) {
  const char* op = "swiglu_forward";
  expect_f32(op, "h1", h1, h1.defined() ? h1.dim() : 0, "[..., F]");
  expect_like(op, "h3", h3, "h1", h1);
  const DType out_dt = expect_out(op, "a", a, h1.shape(), "[like h1]");
  const int64_t n = h1.numel();
  if (n == 0) return;
  const bool vec = aligned16(h1.raw()) && aligned16(h3.raw()) && out_aligned(a);
  const unsigned grid = grid_for((n + 3) / 4, kEltThreads);
  with_out_type(out_dt, [&](auto tag) {
    using O = decltype(tag);
    launch_dependent(swiglu_forward_kernel<O>, grid, kEltThreads, 0, h1.data<float>(), h3.data<float>(),
                     a.data<O>(), 1, n, n, vec);
  });
}

namespace {
// swiglu_forward_fused's arguments, checked: F, the rows of h13 [..., 2F] and a's type.
struct SwigluArgs {
  int64_t F, rows;
  DType out_dt;
};
SwigluArgs swiglu_fused_args(const Tensor& h13, const Tensor& a) {
  const char* op = "swiglu_forward_fused";
  expect_f32(op, "h13", h13, h13.defined() ? h13.dim() : 0, "[..., 2F]");
  SwigluArgs s{};
  s.F = h13.size(h13.dim() - 1) / 2;
  s.rows = s.F > 0 ? h13.numel() / (2 * s.F) : 0;
  Shape a_shape = h13.shape();
  a_shape.back() = s.F;
  s.out_dt = expect_out(op, "a", a, a_shape, "[..., F]");
  return s;
}
}  // namespace

void swiglu_forward_fused(const Tensor& h13, Tensor& a) {
  const SwigluArgs s = swiglu_fused_args(h13, a);
  const int64_t F = s.F, rows = s.rows;
  if (rows == 0 || F == 0) return;
  const float* h1 = h13.data<float>();
  // the groups of four of a row stay within it: vectorised where every row's start is aligned
  const bool vec = F % 4 == 0 && aligned16(h1) && out_aligned(a);
  const unsigned grid = grid_for(rows * ((F + 3) / 4), kEltThreads);
  with_out_type(s.out_dt, [&](auto tag) {
    using O = decltype(tag);
    launch_dependent(swiglu_forward_kernel<O>, grid, kEltThreads, 0, h1, h1 + F, a.data<O>(), rows, F, 2 * F, vec);
  });
}

bool swiglu_forward_fused_quantized(const Tensor& h13, Tensor& a, const RowQuant& aq) {
  const SwigluArgs s = swiglu_fused_args(h13, a);
  if (s.rows == 0 || s.out_dt != DType::F32 || !aligned16(h13.raw()) || !aligned16(a.raw()) ||
      !row_quant_fused(aq.spec, s.F))
    return false;
  *aq.out = alloc_qtensor(aq.spec, quant_shape(a, aq.spec), Device::CUDA);
  launch_swiglu_rows_quantized(h13.data<float>(), a.data<float>(), s.rows, s.F, aq.spec, *aq.out);
  return true;
}

void swiglu_backward(const Tensor& da, const Tensor& h1, const Tensor& h3, Tensor& dh1,
                     Tensor& dh3) {
  const char* op = "swiglu_backward";
  expect_f32(op, "h1", h1, h1.defined() ? h1.dim() : 0, "[..., F]");
  expect_like(op, "da", da, "h1", h1);
  expect_like(op, "h3", h3, "h1", h1);
  const DType out_dt = expect_out(op, "dh1", dh1, h1.shape(), "[like h1]");
  expect_dims(op, "dh3", dh3, out_dt, h1.shape(), "[like dh1]");
  const int64_t n = h1.numel();
  if (n == 0) return;
  const bool vec = aligned16(da.raw()) && aligned16(h1.raw()) && aligned16(h3.raw()) && out_aligned(dh1) &&
                   out_aligned(dh3);
  const unsigned grid = grid_for((n + 3) / 4, kEltThreads);
  with_out_type(out_dt, [&](auto tag) {
    using O = decltype(tag);
    swiglu_backward_kernel<<<grid, kEltThreads, 0, stream()>>>(da.data<float>(), h1.data<float>(), h3.data<float>(),
                                                                dh1.data<O>(), dh3.data<O>(), n, vec);
  });
  FOURBIT_LAUNCH_CHECK();
}

namespace {
std::atomic<int> g_xent_threads{0};
}  // namespace

void set_cross_entropy_threads(int threads) {
  if (threads != 0 && threads != 128 && threads != 256 && threads != 512 && threads != kXentThreads)
    fail("set_cross_entropy_threads: 0 (by V), 128, 256, 512 or {}, got {}", kXentThreads, threads);
  g_xent_threads.store(threads, std::memory_order_relaxed);
}

int cross_entropy_threads(int64_t V) {
  const int forced = g_xent_threads.load(std::memory_order_relaxed);
  const int64_t groups = (V + 3) / 4;
  if (forced) return forced >= groups ? forced : kXentThreads;  // fewer: other per-thread sums
  for (const int t : {128, 256, 512})
    if (groups <= t) return t;
  return kXentThreads;
}

void cross_entropy(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor* dlogits,
                   double grad_scale, const Tensor* weights, const Tensor* scale) {
  const char* op = "cross_entropy";
  expect_f32(op, "logits", logits, 2, "[N, V]");
  const int64_t N = logits.size(0), V = logits.size(1);
  if (V < 1) fail("{}: logits must have at least one column, got {}", op, logits.str());
  expect_index(op, "targets", targets, {N}, "[N]");
  expect_dims(op, "losses", losses, DType::F32, {N}, "[N]");
  const bool want_grad = dlogits && dlogits->defined();
  if (want_grad) expect_dims(op, "dlogits", *dlogits, DType::F32, {N, V}, "[N, V]");
  const bool weighted = weights && weights->defined();
  if (weighted) expect_dims(op, "weights", *weights, DType::F32, {N}, "[N]");
  if (N == 0) return;
  const bool vec = V % 4 == 0 && aligned16(logits.raw()) &&
                   (!want_grad || aligned16(dlogits->raw()));
  const int threads = cross_entropy_threads(V);
  auto launch = [&](auto kernel, int t) {
    launch_dependent(kernel, grid_for(N, 1, int64_t(device_sm_count()) * (2048 / t)), t, 0, logits.data<float>(),
                     targets.data<int32_t>(), weighted ? weights->data<float>() : nullptr, losses.data<float>(),
                     want_grad ? dlogits->data<float>() : nullptr, float(grad_scale),
                     scale ? scale->data<float>() : nullptr, N, V, vec, index_error_record());
  };
  switch (threads) {
    case 128: launch(cross_entropy_kernel<128>, 128); break;
    case 256: launch(cross_entropy_kernel<256>, 256); break;
    case 512: launch(cross_entropy_kernel<512>, 512); break;
    default: launch(cross_entropy_kernel<kXentThreads>, kXentThreads); break;
  }
  check_index_errors();  // targets are user data: as embedding_forward's tokens
}

// ops.h count_targets: one block; each thread counts a strided share, block_sum adds the counts
// (whole numbers below 2^53: exact in double in any order).
constexpr int kCountThreads = 1024;
__global__ void __launch_bounds__(kCountThreads)
    count_targets_kernel(const int32_t* __restrict__ tgt, int64_t N, float loss_weight, double* __restrict__ count,
                         float* __restrict__ scale) {
  dependent_launch_prologue();
  __shared__ double scratch[kCountThreads / 32];
  double n = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += kCountThreads) n += tgt[i] >= 0 ? 1.0 : 0.0;
  const double total = block_sum<kCountThreads>(n, scratch);
  if (threadIdx.x == 0) {
    *count = total;
    *scale = total > 0.0 ? float(__ddiv_rn(double(loss_weight), total)) : 0.0f;
  }
}

void count_targets(const Tensor& targets, float loss_weight, Tensor& count, Tensor& scale) {
  launch_dependent(count_targets_kernel, 1, kCountThreads, 0, targets.data<int32_t>(), targets.numel(), loss_weight,
                   count.data<double>(), scale.data<float>());
}

}  // namespace fourbit::ops::cuda
