// defines: cuda::quantize, cuda::dequantize, cuda::requantize_transposed, cuda::take_nonfinite_flag
// The GPU quantizers. Every value goes through the same numerics/ functions as the CPU loops of
// ops/cpu/quantize.cpp (max_abs_finite, rht_forward/rht_inverse, nvfp4_s_enc/s_dec,
// nvfp4_quantize_block, mxfp8_quantize_block, s2f6_quantize_block and the decoders), with the
// same arguments (block amax, n, SR counter = storage_row * padded_cols + col), so the bytes
// equal the CPU's by construction. The kernels only decide who computes what and how data moves.
//
// Shapes (256 threads a CTA, default stream):
//  - quantize_tile_kernel: one CTA per storage tile (trows x tcols, tcols a multiple of the
//    block) staged in shared memory. Blocks are stored B+1 floats apart, so "one thread owns a
//    block" reads (the numerics read a block in element order) hit 32 different banks.
//    Row axis: rows read with float4. Col axis: the logical [tcols x trows] patch is read along
//    the contiguous dimension and written transposed into the tile (no transposed copy in
//    global memory). Phase A: a thread per block counts its non-finite inputs, rotates it
//    (RHT) in place and takes its amax. Phase A2: 16x16 tile amax, per-row S_enc. Phase B: a
//    thread per block quantizes and stores codes and scale.
//  - NVFP4 with per-row (per-token) scales on the Row axis: tiles are whole rows, the row amax
//    is reduced in shared memory, the input is read once ("fused").
//  - Other NVFP4 outer scales: an amax pre-pass (amax_segments_kernel over contiguous groups,
//    or quantize_tile_kernel in amax mode behind an RHT or for column groups), then
//    outer_scale_kernel, then the tile kernel (two reads of the input are unavoidable).
//  - requantize_transposed_kernel: NVFP4 tile -> exact decode into shared memory, transposed ->
//    MXFP8 E4M3 RCEIL + SR blocks along the old rows, in one kernel.
//  - dequant_tile_kernel: decode a storage tile into shared memory, undo the RHT, write the
//    logical layout with coalesced (float4) stores.
// Where the time goes (ncu on an H200, 8192 x 8192): the quantizers are instruction-bound, not
// memory-bound: ~80% of issue slots busy, DRAM at 12-28%, about 90 (NVFP4 RNE, MXFP8 RNE) to
// 200 (NVFP4 Four Over Six) instructions per element, most of them inside the scalar codecs
// (minifloat_encode's integer rounding, Philox for SR). Faster kernels need faster numerics/.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "fourbit/numerics/formats.h"
#include "fourbit/numerics/hadamard.h"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/quant_layout.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kStageBytes = 36;          // per-thread staging of one 32-code block (9 words: odd)
constexpr int64_t kFusedMaxCols = 16384;  // per-token rows up to this many padded cols: one pass

// ---- device-side counters -----------------------------------------------------------------------

struct DeviceCounters {
  unsigned long long values, nonfinite, blocks, chose_four;
};
__device__ DeviceCounters g_counters;
__device__ unsigned int g_nonfinite_flag;

// Called by every thread of the CTA at the end of a kernel: raises the sticky flag when any
// thread saw a non-finite value, and adds the CTA's counts to g_counters when a report is wanted.
__device__ void flush_counts(bool report, unsigned values, unsigned nonfinite, unsigned blocks,
                             unsigned chose_four) {
  if (__syncthreads_or(nonfinite != 0) && threadIdx.x == 0) atomicOr(&g_nonfinite_flag, 1u);
  if (!report) return;
  values = __reduce_add_sync(0xffffffffu, values);
  nonfinite = __reduce_add_sync(0xffffffffu, nonfinite);
  blocks = __reduce_add_sync(0xffffffffu, blocks);
  chose_four = __reduce_add_sync(0xffffffffu, chose_four);
  if ((threadIdx.x & 31) == 0) {
    if (values) atomicAdd(&g_counters.values, (unsigned long long)values);
    if (nonfinite) atomicAdd(&g_counters.nonfinite, (unsigned long long)nonfinite);
    if (blocks) atomicAdd(&g_counters.blocks, (unsigned long long)blocks);
    if (chose_four) atomicAdd(&g_counters.chose_four, (unsigned long long)chose_four);
  }
}

// ---- shared pieces ------------------------------------------------------------------------------

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

enum class Kind : int { Nvfp4, Mx, S2f6 };
template <Kind K>
constexpr int kBlockOf = K == Kind::Nvfp4 ? num::kNvfp4Block : num::kMxBlock;

// The storage row's outer scale group (QTensor::outer_index).
__device__ __forceinline__ int64_t group_of(OuterScale outer, int64_t storage_row, int64_t rows_per_slice) {
  switch (outer) {
    case OuterScale::PerRow: return storage_row;
    case OuterScale::PerSlice: return storage_row / rows_per_slice;
    default: return 0;
  }
}

// Position of column c of tile row rr in the shared tile: blocks are B+1 floats apart.
template <int B>
__device__ __forceinline__ int tile_pos(int rr, int c, int rs) {
  return rr * rs + (c / B) * (B + 1) + (c % B);
}

// Max of non-negative floats by their bits (order-free and exact, like every amax here).
__device__ __forceinline__ void atomic_max_amax(uint32_t* p, float a) {
  atomicMax(p, num::bits_of(a));
}

// RHT of one block in place in shared memory (CPU: rotate_row over the padded row; chunks never
// cross a block). In place on the tile rather than on a register copy: the transform's loops are
// not fully unrolled by nvcc, and a register array indexed at run time would live in local memory.
template <int B>
__device__ __forceinline__ void rotate_block(float* xb, int had, uint32_t signs, bool inverse) {
  if (had == 16) {
#pragma unroll
    for (int c = 0; c < B; c += 16)
      inverse ? num::rht_inverse<16>(xb + c, signs) : num::rht_forward<16>(xb + c, signs);
  } else if constexpr (B >= 32) {
#pragma unroll
    for (int c = 0; c < B; c += 32)
      inverse ? num::rht_inverse<32>(xb + c, signs) : num::rht_forward<32>(xb + c, signs);
  }
}

// A storage tile: trows x tcols of one slice, tcols a multiple of the block.
struct TileGeom {
  int trows = 0, tcols = 0;
  int rs = 0;                         // shared floats per tile row (odd: column reads are conflict-free)
  int64_t row_tiles = 0, col_tiles = 0;  // per slice
  int64_t tiles(int64_t slices) const { return slices * row_tiles * col_tiles; }
};

TileGeom make_geom(int trows, int tcols, int block, int64_t srows, int64_t padded_cols) {
  TileGeom g;
  g.trows = trows;
  g.tcols = tcols;
  g.rs = (tcols / block) * (block + 1);
  if (g.rs % 2 == 0) ++g.rs;
  g.row_tiles = (srows + trows - 1) / trows;
  g.col_tiles = (padded_cols + tcols - 1) / tcols;
  return g;
}

// Where a CTA's tile lies and how much of it is real.
struct TileCoords {
  int64_t s, r0, c0;  // slice, first storage row in the slice, first storage col
  int rows, nblk;     // valid tile rows, valid blocks per tile row
};

__device__ __forceinline__ TileCoords tile_coords(const TileGeom& g, int64_t srows, int64_t nb, int block) {
  int64_t t = blockIdx.x;
  TileCoords tc;
  const int64_t ct = t % g.col_tiles;
  t /= g.col_tiles;
  const int64_t rt = t % g.row_tiles;
  tc.s = t / g.row_tiles;
  tc.r0 = rt * g.trows;
  tc.c0 = ct * g.tcols;
  tc.rows = int(min64(g.trows, srows - tc.r0));
  tc.nblk = int(min64(g.tcols / block, nb - tc.c0 / block));
  return tc;
}

// ---- loading a storage tile (Row: rows of x; Col: the transposed patch) ---------------------------

struct LoadArgs {
  const float* x;   // input, logical [S, R, C] contiguous
  int64_t srows;    // storage rows per slice
  int64_t scols;    // storage cols (unpadded)
  bool vec4;        // float4 loads allowed (contiguous dimension % 4 == 0, 16-byte base)
};

// Position (outer, inner) of k = threadIdx.x + j * kThreads, j = 0, 1, ..., in a row-major
// n_outer x n_inner grid, advanced without an integer division per step.
struct GridWalk {
  int outer, inner, d_outer, d_inner, n_inner;
  __device__ explicit GridWalk(int n) : n_inner(n) {
    outer = int(threadIdx.x) / n;
    inner = int(threadIdx.x) % n;
    d_outer = kThreads / n;
    d_inner = kThreads % n;
  }
  __device__ void next() {
    outer += d_outer;
    inner += d_inner;
    if (inner >= n_inner) {
      inner -= n_inner;
      ++outer;
    }
  }
};

// Every thread loads its grid points in batches of kLoadBatch (all loads of a batch in flight
// before the first store), then stores them: load(o, i) -> T, store(o, i, T).
constexpr int kLoadBatch = 4;
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void batched_walk(int n_outer, int n_inner, Load load, Store store) {
  GridWalk w(n_inner);
  while (w.outer < n_outer) {
    T v[kLoadBatch];
    GridWalk w_store = w;  // the store pass replays the walk instead of keeping positions
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      v[u] = w.outer < n_outer ? load(w.outer, w.inner) : T{};
      w.next();
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      if (w_store.outer < n_outer) store(w_store.outer, w_store.inner, v[u]);
      w_store.next();
    }
  }
}

// Fills tile rows [0, rows) x cols [0, nblk * B) with storage values (zeros past scols).
template <int B, bool kCol>
__device__ void load_tile(const LoadArgs& a, const TileCoords& tc, int rs, float* tile) {
  const int ncols = tc.nblk * B;
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (!kCol) {
    // Storage row r of slice s is input row s * srows + r: contiguous scols floats.
    const float* base = a.x + (tc.s * a.srows + tc.r0) * a.scols + tc.c0;
    const int valid = int(min64(ncols, a.scols - tc.c0));  // columns that exist in x
    if (a.vec4) {  // scols % 4 == 0: a float4 is entirely inside or entirely past the row
      batched_walk<float4>(
          tc.rows, ncols / 4,
          [&](int rr, int q) {
            return 4 * q < valid ? __ldg(reinterpret_cast<const float4*>(base + int64_t(rr) * a.scols + 4 * q))
                                 : zero4;
          },
          [&](int rr, int q, float4 v) {
            float* d = tile + tile_pos<B>(rr, 4 * q, rs);  // 4 values inside one block
            d[0] = v.x;
            d[1] = v.y;
            d[2] = v.z;
            d[3] = v.w;
          });
    } else {
      batched_walk<float>(
          tc.rows, ncols,
          [&](int rr, int c) { return c < valid ? __ldg(base + int64_t(rr) * a.scols + c) : 0.0f; },
          [&](int rr, int c, float v) { tile[tile_pos<B>(rr, c, rs)] = v; });
    }
  } else {
    // Storage (row j, col i) of slice s is input (s, i, j): x[(s * scols + i) * srows + j].
    // Threads run along j (the contiguous input dimension); each writes down a tile column.
    const float* base = a.x + (tc.s * a.scols + tc.c0) * a.srows + tc.r0;
    const int valid = int(min64(ncols, a.scols - tc.c0));  // logical rows that exist in x
    if (a.vec4) {  // srows % 4 == 0, so tc.rows % 4 == 0
      batched_walk<float4>(
          ncols, tc.rows / 4,
          [&](int ii, int q) {
            return ii < valid ? __ldg(reinterpret_cast<const float4*>(base + int64_t(ii) * a.srows + 4 * q))
                              : zero4;
          },
          [&](int ii, int q, float4 v) {
            tile[tile_pos<B>(4 * q + 0, ii, rs)] = v.x;
            tile[tile_pos<B>(4 * q + 1, ii, rs)] = v.y;
            tile[tile_pos<B>(4 * q + 2, ii, rs)] = v.z;
            tile[tile_pos<B>(4 * q + 3, ii, rs)] = v.w;
          });
    } else {
      batched_walk<float>(
          ncols, tc.rows,
          [&](int ii, int jj) { return ii < valid ? __ldg(base + int64_t(ii) * a.srows + jj) : 0.0f; },
          [&](int ii, int jj, float v) { tile[tile_pos<B>(jj, ii, rs)] = v; });
    }
  }
}

// ---- the quantize kernel ------------------------------------------------------------------------

struct QuantParams {
  LoadArgs in;
  TileGeom geom;
  int64_t slices, padded_cols, nb, code_row_bytes;
  uint8_t* codes;
  uint8_t* scales;
  float* outer;                 // S_dec output (fused per-row path writes it)
  OuterScale outer_kind;
  const uint32_t* group_amax;   // pre-pass result (bits), or null (fused / None)
  uint32_t* amax_out;           // amax mode: per-group maxima (bits)
  bool fused_row_amax;
  bool tile_2d, four_over_six;
  num::ScaleMetric metric;
  num::Rounding rounding;
  num::MxScaleRule mx_rule;
  num::MiniFloatSpec elem;      // MXFP8 element format (by value: usable in device code)
  int hadamard;
  uint32_t hadamard_signs;
  uint64_t seed, stream;
  bool report;
};

// Tile, block amaxes, per-row S_enc and amax, and (8-bit codes) the per-thread code staging.
size_t quant_smem_bytes(const TileGeom& g, int block, bool stage) {
  const size_t nbt = size_t(g.tcols / block);
  return sizeof(float) * (size_t(g.trows) * g.rs + size_t(g.trows) * nbt + 2 * size_t(g.trows)) +
         (stage ? size_t(kThreads) * kStageBytes : 0);
}

// kAmaxOnly: the pre-pass for outer scales behind an RHT or over column groups: phase A only,
// then the per-group maxima go to p.amax_out (nothing is counted: the quantize pass counts).
// kSR (the spec's rounding) and kFos (Four Over Six) are template parameters so that each kernel
// carries only the numerics branch it runs.
template <Kind K, bool kCol, bool kAmaxOnly, bool kSR, bool kFos>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(const QuantParams p) {
  constexpr int B = kBlockOf<K>;
  constexpr num::Rounding kRounding = kSR ? num::Rounding::SR : num::Rounding::RNE;
  extern __shared__ __align__(16) unsigned char smem[];
  const TileGeom& g = p.geom;
  const int nbt = g.tcols / B;
  float* tile = reinterpret_cast<float*>(smem);
  float* bamax = tile + g.trows * g.rs;
  float* row_senc = bamax + g.trows * nbt;
  uint32_t* row_amax = reinterpret_cast<uint32_t*>(row_senc + g.trows);
  uint8_t* stage = reinterpret_cast<uint8_t*>(row_amax + g.trows) + threadIdx.x * kStageBytes;

  const TileCoords tc = tile_coords(g, p.in.srows, p.nb, B);
  const int64_t g0 = tc.s * p.in.srows + tc.r0;  // global storage row of tile row 0

  load_tile<B, kCol>(p.in, tc, g.rs, tile);
  for (int rr = threadIdx.x; rr < tc.rows; rr += kThreads) row_amax[rr] = 0u;
  __syncthreads();

  // Phase A: count non-finite inputs (before an RHT spreads them over a chunk, as the CPU
  // counts them; padding is zero), rotate, block amax (of the rotated values: what gets quantized).
  unsigned nonfinite = 0;
  const bool want_row_amax = kAmaxOnly || p.fused_row_amax;
  for (GridWalk w(tc.nblk); w.outer < tc.rows; w.next()) {
    const int rr = w.outer, bb = w.inner;
    float* xb = tile + rr * g.rs + bb * (B + 1);
    float a = 0.0f;
    if (p.hadamard) {
      if (!kAmaxOnly) {
#pragma unroll
        for (int i = 0; i < B; ++i) nonfinite += num::is_finite_bits(xb[i]) ? 0u : 1u;
      }
      rotate_block<B>(xb, p.hadamard, p.hadamard_signs, false);
#pragma unroll
      for (int i = 0; i < B; ++i) a = num::max_abs_finite(a, xb[i]);
    } else {  // one pass over the block
#pragma unroll
      for (int i = 0; i < B; ++i) {
        a = num::max_abs_finite(a, xb[i]);
        if (!kAmaxOnly) nonfinite += num::is_finite_bits(xb[i]) ? 0u : 1u;
      }
    }
    if (!kAmaxOnly) bamax[rr * nbt + bb] = a;
    if (want_row_amax) atomic_max_amax(&row_amax[rr], a);
  }
  __syncthreads();

  if constexpr (kAmaxOnly) {
    for (int rr = threadIdx.x; rr < tc.rows; rr += kThreads)
      atomicMax(&p.amax_out[group_of(p.outer_kind, g0 + rr, p.in.srows)], row_amax[rr]);
    return;
  } else {
    // Phase A2. NUMERICS: 16x16 tiles take one scale from the tile amax (tiles start at row 0
    // of each slice; tile rows start at multiples of 16 and never cross a slice).
    if (K == Kind::Nvfp4 && p.tile_2d) {
      const int groups = (tc.rows + 15) / 16;
      for (int k = threadIdx.x; k < groups * tc.nblk; k += kThreads) {
        const int r_begin = (k / tc.nblk) * 16, bb = k % tc.nblk;
        const int r_end = tc.rows < r_begin + 16 ? tc.rows : r_begin + 16;
        float a = 0.0f;
        for (int rr = r_begin; rr < r_end; ++rr) a = fmaxf(a, bamax[rr * nbt + bb]);
        for (int rr = r_begin; rr < r_end; ++rr) bamax[rr * nbt + bb] = a;
      }
    }
    if (K == Kind::Nvfp4) {
      for (int rr = threadIdx.x; rr < tc.rows; rr += kThreads) {
        float se = 1.0f;
        if (p.fused_row_amax) {
          se = num::nvfp4_s_enc(num::float_of(row_amax[rr]), kFos);
          p.outer[g0 + rr] = num::nvfp4_s_dec(se);  // the tile spans the whole row: written once
        } else if (p.outer_kind != OuterScale::None) {
          const int64_t grp = group_of(p.outer_kind, g0 + rr, p.in.srows);
          se = num::nvfp4_s_enc(num::float_of(p.group_amax[grp]), kFos);
        }
        row_senc[rr] = se;
      }
    }
    __syncthreads();

    // Phase B: one thread per block, the numerics block quantizer on the shared values.
    unsigned values = 0, blocks = 0, chose_four = 0;
    for (GridWalk w(tc.nblk); w.outer < tc.rows; w.next()) {
      const int rr = w.outer, bb = w.inner;
      const float* xb = tile + rr * g.rs + bb * (B + 1);
      const int64_t row = g0 + rr;
      const int64_t col = tc.c0 + int64_t(bb) * B;
      const int64_t blk = col / B;
      const int valid = int(min64(B, p.in.scols - col));
      // Padding past the last column is zero; behind an RHT the rotated padding is not, so
      // those blocks encode all B values (CPU: n = hadamard ? B : min(B, C - b * B)).
      const int n = p.hadamard ? B : valid;
      const uint64_t index0 = uint64_t(row * p.padded_cols + col);  // padded storage index (SR)
      const float amax = bamax[rr * nbt + bb];
      // Full blocks call the block quantizer with a constant n (its loops can then be unrolled);
      // the result is the same function of (x, n, ...) either way.
      if constexpr (K == Kind::Nvfp4) {
        const float se = row_senc[rr], sd = num::nvfp4_s_dec(se);
        const num::Nvfp4Block out =
            n == B ? num::nvfp4_quantize_block(xb, B, amax, se, sd, kFos, p.metric, kRounding,
                                               p.seed, p.stream, index0)
                   : num::nvfp4_quantize_block(xb, n, amax, se, sd, kFos, p.metric, kRounding,
                                               p.seed, p.stream, index0);
        *reinterpret_cast<uint64_t*>(p.codes + row * p.code_row_bytes + blk * 8) = out.packed;
        p.scales[row * p.nb + blk] = out.scale;
        chose_four += out.chose_four ? 1u : 0u;
      } else {
        uint32_t* w = reinterpret_cast<uint32_t*>(stage);
        if (n < B) {
#pragma unroll
          for (int i = 0; i < B / 4; ++i) w[i] = 0u;  // codes past n stay 0
        }
        uint8_t scale;
        if constexpr (K == Kind::Mx)
          scale = n == B ? num::mxfp8_quantize_block(xb, B, amax, p.elem, p.mx_rule, kRounding,
                                                     p.seed, p.stream, index0, stage)
                         : num::mxfp8_quantize_block(xb, n, amax, p.elem, p.mx_rule, kRounding,
                                                     p.seed, p.stream, index0, stage);
        else
          scale = n == B ? num::s2f6_quantize_block(xb, B, amax, reinterpret_cast<int8_t*>(stage))
                         : num::s2f6_quantize_block(xb, n, amax, reinterpret_cast<int8_t*>(stage));
        uint4* dst = reinterpret_cast<uint4*>(p.codes + row * p.code_row_bytes + col);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
        p.scales[row * p.nb + blk] = scale;
      }
      values += unsigned(valid);
      blocks += 1u;
    }
    flush_counts(p.report, values, nonfinite, blocks, chose_four);
  }
}

// ---- outer-scale pre-pass -----------------------------------------------------------------------

// amax over contiguous segments of x (a tensor, a slice or a row): one CTA per chunk of a
// segment, atomicMax of the chunk's maximum into out[segment].
__global__ void __launch_bounds__(kThreads)
    amax_segments_kernel(const float* __restrict__ x, int64_t seg_len, int64_t chunks_per_seg,
                         int64_t chunk_len, bool vec4, uint32_t* out) {
  const int64_t seg = blockIdx.x / chunks_per_seg, ch = blockIdx.x % chunks_per_seg;
  const float* base = x + seg * seg_len;
  const int64_t lo = ch * chunk_len, hi = min64(seg_len, lo + chunk_len);
  constexpr int U = 4;
  float a = 0.0f;
  if (vec4) {  // seg_len and chunk_len are multiples of 4, x is 16-byte aligned
    const float4* b4 = reinterpret_cast<const float4*>(base);
    for (int64_t i0 = lo / 4 + threadIdx.x; i0 < hi / 4; i0 += U * kThreads) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = i0 + u * kThreads;
        v[u] = i < hi / 4 ? __ldg(b4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        a = num::max_abs_finite(a, v[u].x);
        a = num::max_abs_finite(a, v[u].y);
        a = num::max_abs_finite(a, v[u].z);
        a = num::max_abs_finite(a, v[u].w);
      }
    }
  } else {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) a = num::max_abs_finite(a, __ldg(base + i));
  }
  __shared__ uint32_t warp_max[kThreads / 32];
  const uint32_t m = __reduce_max_sync(0xffffffffu, num::bits_of(a));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    const uint32_t w = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    const uint32_t all = __reduce_max_sync(0xffffffffu, w);
    if (threadIdx.x == 0 && all) atomicMax(out + seg, all);
  }
}

// S_dec per group from the group amax: outer[g] = nvfp4_s_dec(nvfp4_s_enc(amax_g)).
__global__ void outer_scale_kernel(const uint32_t* __restrict__ group_amax, int64_t groups,
                                   bool four_over_six, float* outer) {
  for (int64_t gi = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; gi < groups;
       gi += int64_t(gridDim.x) * blockDim.x)
    outer[gi] = num::nvfp4_s_dec(num::nvfp4_s_enc(num::float_of(group_amax[gi]), four_over_six));
}

// ---- decoding ----------------------------------------------------------------------------------

struct DecodeArgs {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* outer;      // null when the QTensor has no outer scales
  OuterScale outer_kind;
  int64_t srows, code_row_bytes, nb;
  num::MiniFloatSpec elem;
  bool vec;                // codes rows are 8-byte (NVFP4) / 16-byte (8-bit codes) aligned
};

// Decodes block `blk` of storage row `row` into v[0..B), exactly as cpu::QRowDecoder::row with
// with_outer = true: NVFP4 fl(fl(E2M1 * E4M3) * S_dec) (S_dec = 1 without outer scales), MXFP8
// elem * 2^(E-127), S2F6 q * 2^(E-133).
template <Kind K>
__device__ __forceinline__ void decode_block(const DecodeArgs& d, int64_t row, int64_t blk, float* v) {
  constexpr int B = kBlockOf<K>;
  const uint8_t sb = d.scales[row * d.nb + blk];
  if constexpr (K == Kind::Nvfp4) {
    const uint8_t* src = d.codes + row * d.code_row_bytes + blk * 8;
    uint64_t packed = 0;
    if (d.vec) {
      packed = *reinterpret_cast<const uint64_t*>(src);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) packed |= uint64_t(src[k]) << (8 * k);
    }
    const float s_dec = d.outer ? d.outer[group_of(d.outer_kind, row, d.srows)] : 1.0f;
#pragma unroll
    for (int i = 0; i < B; ++i) v[i] = num::nvfp4_dequant(uint32_t(packed >> (4 * i)) & 0xFu, sb, s_dec);
  } else {
    const uint8_t* src = d.codes + row * d.code_row_bytes + blk * B;
    uint32_t w[B / 4];
    if (d.vec) {
      const uint4 lo = reinterpret_cast<const uint4*>(src)[0];
      const uint4 hi = reinterpret_cast<const uint4*>(src)[1];
      w[0] = lo.x; w[1] = lo.y; w[2] = lo.z; w[3] = lo.w;
      w[4] = hi.x; w[5] = hi.y; w[6] = hi.z; w[7] = hi.w;
    } else {
#pragma unroll
      for (int k = 0; k < B / 4; ++k)
        w[k] = uint32_t(src[4 * k]) | uint32_t(src[4 * k + 1]) << 8 | uint32_t(src[4 * k + 2]) << 16 |
               uint32_t(src[4 * k + 3]) << 24;
    }
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const uint8_t c = uint8_t(w[i / 4] >> (8 * (i % 4)));
      if constexpr (K == Kind::Mx) v[i] = num::mxfp8_decode(c, sb, d.elem);
      else v[i] = num::s2f6_decode_scaled(int8_t(c), sb);
    }
  }
}

struct DequantParams {
  DecodeArgs dec;
  TileGeom geom;
  int64_t scols;      // storage cols (unpadded)
  int hadamard;       // 0 when the rotation is kept
  uint32_t hadamard_signs;
  float* out;         // logical [S, R, C]
  bool vec4;          // float4 stores (contiguous output dimension % 4 == 0)
};

size_t dequant_smem_bytes(const TileGeom& g) { return sizeof(float) * size_t(g.trows) * g.rs; }

template <Kind K, bool kCol>
__global__ void __launch_bounds__(kThreads) dequant_tile_kernel(const DequantParams p) {
  constexpr int B = kBlockOf<K>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* tile = reinterpret_cast<float*>(smem);
  const TileGeom& g = p.geom;
  const TileCoords tc = tile_coords(g, p.dec.srows, p.dec.nb, B);
  const int64_t g0 = tc.s * p.dec.srows + tc.r0;

  for (GridWalk w(tc.nblk); w.outer < tc.rows; w.next()) {
    const int rr = w.outer, bb = w.inner;
    float v[B];
    decode_block<K>(p.dec, g0 + rr, tc.c0 / B + bb, v);
    float* xb = tile + rr * g.rs + bb * (B + 1);
#pragma unroll
    for (int i = 0; i < B; ++i) xb[i] = v[i];
    if (p.hadamard) rotate_block<B>(xb, p.hadamard, p.hadamard_signs, true);
  }
  __syncthreads();

  // Write the valid columns [c0, c0 + ncols) of each tile row in the logical layout.
  const int ncols = int(min64(int64_t(tc.nblk) * B, p.scols - tc.c0));
  if constexpr (!kCol) {
    float* base = p.out + g0 * p.scols + tc.c0;
    if (p.vec4) {  // scols % 4 == 0, so ncols % 4 == 0
      const int per_row = ncols / 4;
      for (int i = threadIdx.x; i < tc.rows * per_row; i += kThreads) {
        const int rr = i / per_row, c = 4 * (i % per_row);
        const float* s = tile + tile_pos<B>(rr, c, g.rs);
        *reinterpret_cast<float4*>(base + int64_t(rr) * p.scols + c) = make_float4(s[0], s[1], s[2], s[3]);
      }
    } else {
      for (int i = threadIdx.x; i < tc.rows * ncols; i += kThreads) {
        const int rr = i / ncols, c = i % ncols;
        base[int64_t(rr) * p.scols + c] = tile[tile_pos<B>(rr, c, g.rs)];
      }
    }
  } else {
    // Storage (row j, col i) of slice s is logical (s, i, j): out[(s * scols + i) * srows + j].
    const int64_t srows = p.dec.srows;
    float* base = p.out + (tc.s * p.scols + tc.c0) * srows + tc.r0;
    if (p.vec4) {  // srows % 4 == 0, so tc.rows % 4 == 0
      const int per_i = tc.rows / 4;
      for (int i = threadIdx.x; i < ncols * per_i; i += kThreads) {
        const int ii = i / per_i, jj = 4 * (i % per_i);
        *reinterpret_cast<float4*>(base + int64_t(ii) * srows + jj) =
            make_float4(tile[tile_pos<B>(jj, ii, g.rs)], tile[tile_pos<B>(jj + 1, ii, g.rs)],
                        tile[tile_pos<B>(jj + 2, ii, g.rs)], tile[tile_pos<B>(jj + 3, ii, g.rs)]);
      }
    } else {
      for (int i = threadIdx.x; i < ncols * tc.rows; i += kThreads) {
        const int ii = i / tc.rows, jj = i % tc.rows;
        base[int64_t(ii) * srows + jj] = tile[tile_pos<B>(jj, ii, g.rs)];
      }
    }
  }
}

// ---- NVFP4 -> MXFP8 E4M3 (transposed), one kernel -----------------------------------------------

// A tile is kReqRows input storage rows (old rows: 4 output blocks of 32) x kReqCols input
// storage cols (4 NVFP4 blocks: 64 output storage rows).
constexpr int kReqRows = 128;
constexpr int kReqCols = 64;
constexpr int kReqRs = (kReqRows / num::kMxBlock) * (num::kMxBlock + 1) + 1;  // 133: odd

struct RequantParams {
  DecodeArgs dec;           // the NVFP4 input (storage [S * rows, cols])
  int64_t in_cols;          // input storage cols (unpadded) = output storage rows per slice
  int64_t row_tiles, col_tiles;
  uint8_t* codes;           // output storage [S * in_cols, out_padded_cols]
  uint8_t* scales;
  int64_t out_padded_cols, out_nb;
  uint64_t seed, stream;
};

size_t requant_smem_bytes() {
  return sizeof(float) * size_t(kReqCols) * kReqRs + size_t(kThreads) * kStageBytes;
}

__global__ void __launch_bounds__(kThreads) requantize_transposed_kernel(const RequantParams p) {
  constexpr int B = num::kMxBlock;
  extern __shared__ __align__(16) unsigned char smem[];
  float* tile = reinterpret_cast<float*>(smem);  // [kReqCols][kReqRs]: output-row major
  uint8_t* stage = smem + sizeof(float) * kReqCols * kReqRs + threadIdx.x * kStageBytes;

  int64_t t = blockIdx.x;
  const int64_t ct = t % p.col_tiles;
  t /= p.col_tiles;
  const int64_t rt = t % p.row_tiles, s = t / p.row_tiles;
  const int64_t i0 = rt * kReqRows;  // first input storage row (in the slice)
  const int64_t j0 = ct * kReqCols;  // first input storage col
  const int64_t in_rows = p.dec.srows;

  // Phase 1: decode. Four consecutive threads take the four 16-blocks of one input row (32
  // contiguous code bytes) and write them down tile columns. Rows past the input are zeros
  // (the output's padding); input blocks past the row are not output rows and are skipped.
  for (int k = threadIdx.x; k < kReqRows * (kReqCols / 16); k += kThreads) {
    const int jb = k % (kReqCols / 16), ii = k / (kReqCols / 16);
    const int64_t blk = j0 / 16 + jb;
    if (blk >= p.dec.nb) continue;
    float v[16];
    if (i0 + ii < in_rows) {
      decode_block<Kind::Nvfp4>(p.dec, s * in_rows + i0 + ii, blk, v);
    } else {
#pragma unroll
      for (int e = 0; e < 16; ++e) v[e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) tile[tile_pos<B>(jb * 16 + e, ii, kReqRs)] = v[e];
  }
  __syncthreads();

  // Phase 2: one thread per output block (output storage row j, 32 old rows).
  unsigned values = 0, nonfinite = 0, blocks = 0;
  for (int k = threadIdx.x; k < kReqCols * (kReqRows / B); k += kThreads) {
    const int ob = k % (kReqRows / B), jj = k / (kReqRows / B);
    const int64_t j = j0 + jj;
    const int64_t col = i0 + int64_t(ob) * B;  // output storage col
    if (j >= p.in_cols || col >= in_rows) continue;
    const float* xb = tile + jj * kReqRs + ob * (B + 1);
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < B; ++e) {
      a = num::max_abs_finite(a, xb[e]);
      nonfinite += num::is_finite_bits(xb[e]) ? 0u : 1u;
    }
    const int n = int(min64(B, in_rows - col));
    const int64_t row = s * p.in_cols + j;  // output storage row
    uint32_t* w = reinterpret_cast<uint32_t*>(stage);
    if (n < B) {
#pragma unroll
      for (int e = 0; e < B / 4; ++e) w[e] = 0u;
    }
    const uint64_t index0 = uint64_t(row * p.out_padded_cols + col);
    const uint8_t scale =
        n == B ? num::mxfp8_quantize_block(xb, B, a, num::e4m3_spec(), num::MxScaleRule::RCEIL,
                                           num::Rounding::SR, p.seed, p.stream, index0, stage)
               : num::mxfp8_quantize_block(xb, n, a, num::e4m3_spec(), num::MxScaleRule::RCEIL,
                                           num::Rounding::SR, p.seed, p.stream, index0, stage);
    uint4* dst = reinterpret_cast<uint4*>(p.codes + row * p.out_padded_cols + col);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    p.scales[row * p.out_nb + col / B] = scale;
    values += unsigned(n);
    blocks += 1u;
  }
  flush_counts(false, values, nonfinite, blocks, 0u);
}

// ---- host side -----------------------------------------------------------------------------------

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

unsigned grid_of(int64_t ctas, const char* what) {
  if (ctas > INT_MAX) fail("cuda {}: {} thread blocks is more than one launch takes", what, ctas);
  return unsigned(ctas);
}

// Opts a kernel into more than 48 KB of dynamic shared memory (once per size it grows to).
template <auto kernel>
void allow_smem(size_t bytes) {
  static size_t allowed = 48 * 1024;
  if (bytes > allowed) {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    allowed = bytes;
  }
}

DeviceCounters* counters_ptr() {
  static DeviceCounters* p = [] {
    void* a = nullptr;
    FOURBIT_CUDA_CHECK(cudaGetSymbolAddress(&a, g_counters));
    return static_cast<DeviceCounters*>(a);
  }();
  return p;
}

void reset_counters() { FOURBIT_CUDA_CHECK(cudaMemsetAsync(counters_ptr(), 0, sizeof(DeviceCounters), 0)); }

void add_counters(QuantReport* report) {
  DeviceCounters c{};
  FOURBIT_CUDA_CHECK(cudaMemcpy(&c, counters_ptr(), sizeof c, cudaMemcpyDeviceToHost));  // syncs
  report->values += int64_t(c.values);
  report->nonfinite += int64_t(c.nonfinite);
  report->blocks += int64_t(c.blocks);
  report->blocks_chose_four += int64_t(c.chose_four);
}

// Tile shapes. Row axis: 16 rows (the 16x16 tiles need whole row groups) x up to 512 cols, more
// rows for narrow tensors; about 8K floats (35 KB of shared memory) a CTA. Col axis: 64 storage
// rows (logical cols, 256 contiguous input bytes) x 128 storage cols (logical rows).
TileGeom row_geom(int block, int64_t srows, int64_t padded_cols) {
  const int tcols = int(std::min<int64_t>(padded_cols, 512));
  const int trows = 16 * std::max(1, 512 / std::max(tcols, 1));
  return make_geom(trows, tcols, block, srows, padded_cols);
}
TileGeom col_geom(int block, int64_t srows, int64_t padded_cols) {
  return make_geom(64, int(std::min<int64_t>(padded_cols, 128)), block, srows, padded_cols);
}
// Whole rows (the per-token fused path): about 4K floats or one row a CTA.
TileGeom fused_geom(int block, int64_t srows, int64_t padded_cols) {
  const int trows = int(std::max<int64_t>(1, 4096 / padded_cols));
  return make_geom(trows, int(padded_cols), block, srows, padded_cols);
}

template <Kind K, bool kCol, bool kAmaxOnly, bool kSR, bool kFos>
void launch_quantize_tiles(const QuantParams& p) {
  const int64_t ctas = p.geom.tiles(p.slices);
  if (ctas == 0) return;
  const size_t smem = quant_smem_bytes(p.geom, kBlockOf<K>, K != Kind::Nvfp4 && !kAmaxOnly);
  allow_smem<quantize_tile_kernel<K, kCol, kAmaxOnly, kSR, kFos>>(smem);
  quantize_tile_kernel<K, kCol, kAmaxOnly, kSR, kFos><<<grid_of(ctas, "quantize"), kThreads, smem>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

template <Kind K, bool kCol>
void launch_quantize(const QuantParams& p, bool sr, bool fos) {
  if constexpr (K == Kind::Nvfp4) {
    if (sr) fos ? launch_quantize_tiles<K, kCol, false, true, true>(p)
                : launch_quantize_tiles<K, kCol, false, true, false>(p);
    else fos ? launch_quantize_tiles<K, kCol, false, false, true>(p)
             : launch_quantize_tiles<K, kCol, false, false, false>(p);
  } else if constexpr (K == Kind::Mx) {
    sr ? launch_quantize_tiles<K, kCol, false, true, false>(p)
       : launch_quantize_tiles<K, kCol, false, false, false>(p);
  } else {
    launch_quantize_tiles<K, kCol, false, false, false>(p);  // S2F6 is RNE only (quant_shape)
  }
}

template <Kind K>
void launch_quantize(const QuantParams& p, bool col) {
  const bool sr = p.rounding == num::Rounding::SR;
  if (col) launch_quantize<K, true>(p, sr, p.four_over_six);
  else launch_quantize<K, false>(p, sr, p.four_over_six);
}

// Fills p.group_amax's groups (zeroed first) with the amax of each outer-scale group.
void outer_amax_prepass(const QuantParams& p, bool col, int64_t groups, uint32_t* gamax, int64_t R,
                        int64_t C) {
  FOURBIT_CUDA_CHECK(cudaMemsetAsync(gamax, 0, size_t(groups) * sizeof(uint32_t), 0));
  const int64_t numel = p.slices * R * C;
  if (numel == 0) return;
  if (p.hadamard == 0 && !(col && p.outer_kind == OuterScale::PerRow)) {
    // Contiguous groups: the tensor, a slice, or (Row axis) a storage row.
    const int64_t seg_len = numel / groups;
    const bool vec4 = seg_len % 4 == 0 && aligned(p.in.x, 16);
    const int64_t chunk = std::min<int64_t>(seg_len, 32768);
    const int64_t chunks = (seg_len + chunk - 1) / chunk;
    amax_segments_kernel<<<grid_of(groups * chunks, "quantize"), kThreads>>>(p.in.x, seg_len, chunks,
                                                                              chunk, vec4, gamax);
    FOURBIT_LAUNCH_CHECK();
  } else {
    QuantParams a = p;
    a.amax_out = gamax;
    if (col) launch_quantize_tiles<Kind::Nvfp4, true, true, false, false>(a);
    else launch_quantize_tiles<Kind::Nvfp4, false, true, false, false>(a);
  }
}

}  // namespace

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report) {
  check_cuda_tensor(x, "quantize", "x");
  const QuantShape shape = quant_shape(x, spec);
  QTensor q = alloc_qtensor(spec, shape, Device::CUDA);
  const bool col = spec.axis == BlockAxis::Col;
  const int B = q.block();

  QuantParams p{};
  p.in.x = x.data<float>();
  p.in.srows = q.rows;
  p.in.scols = q.cols;
  // float4 loads run along the input's contiguous dimension: logical C (= scols on the Row
  // axis, srows on the Col axis); every row then starts 16-byte aligned.
  p.in.vec4 = shape.cols % 4 == 0 && aligned(p.in.x, 16);
  p.slices = q.slices;
  p.padded_cols = q.padded_cols();
  p.nb = q.blocks_per_row();
  p.code_row_bytes = q.code_row_bytes();
  p.codes = q.codes.data<uint8_t>();
  p.scales = q.block_scales.data<uint8_t>();
  p.outer = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  p.outer_kind = q.outer;
  p.tile_2d = spec.tile_2d;
  p.four_over_six = spec.four_over_six;
  p.metric = spec.metric;
  p.rounding = spec.rounding;
  p.mx_rule = spec.mx_rule;
  p.elem = spec.fmt == Format::MXFP8_E5M2 ? num::kE5M2 : num::kE4M3;
  p.hadamard = spec.hadamard;
  p.hadamard_signs = spec.hadamard_signs;
  p.seed = rng.seed;
  p.stream = rng.stream;
  p.report = report != nullptr;
  if (report) reset_counters();

  const int64_t srows_total = q.total_rows();
  switch (spec.fmt) {
    case Format::NVFP4: {
      const bool fused = !col && q.outer == OuterScale::PerRow && !spec.tile_2d &&
                         p.padded_cols > 0 && p.padded_cols <= kFusedMaxCols;
      Tensor gamax;
      if (q.outer != OuterScale::None && !fused) {
        p.geom = col ? col_geom(B, q.rows, p.padded_cols) : row_geom(B, q.rows, p.padded_cols);
        const int64_t groups = q.outer == OuterScale::Tensor     ? 1
                               : q.outer == OuterScale::PerSlice ? q.slices
                                                                 : srows_total;
        gamax = Tensor::empty({groups}, DType::U32, Device::CUDA);
        outer_amax_prepass(p, col, groups, gamax.data<uint32_t>(), shape.rows, shape.cols);
        outer_scale_kernel<<<grid_for(groups, kThreads), kThreads>>>(gamax.data<uint32_t>(), groups,
                                                                     spec.four_over_six, p.outer);
        FOURBIT_LAUNCH_CHECK();
        p.group_amax = gamax.data<uint32_t>();
      }
      if (fused) {
        p.geom = fused_geom(B, q.rows, p.padded_cols);
        p.fused_row_amax = true;
      } else {
        p.geom = col ? col_geom(B, q.rows, p.padded_cols) : row_geom(B, q.rows, p.padded_cols);
      }
      if (p.padded_cols > 0) launch_quantize<Kind::Nvfp4>(p, col);
      break;  // gamax is freed after the launches are queued: the allocator reuses in stream order
    }
    case Format::MXFP8_E4M3:
    case Format::MXFP8_E5M2:
      p.geom = col ? col_geom(B, q.rows, p.padded_cols) : row_geom(B, q.rows, p.padded_cols);
      if (p.padded_cols > 0) launch_quantize<Kind::Mx>(p, col);
      break;
    case Format::S2F6:
      p.geom = col ? col_geom(B, q.rows, p.padded_cols) : row_geom(B, q.rows, p.padded_cols);
      if (p.padded_cols > 0) launch_quantize<Kind::S2f6>(p, col);
      break;
    default: fail("cuda quantize: unsupported format {}", format_name(spec.fmt));
  }
  if (report) add_counters(report);
  return q;
}

namespace {

DecodeArgs decode_args(const QTensor& q, const char* op) {
  check_cuda_tensor(q.codes, op, "q.codes");
  check_cuda_tensor(q.block_scales, op, "q.block_scales");
  if (q.outer != OuterScale::None) check_cuda_tensor(q.outer_scales, op, "q.outer_scales");
  DecodeArgs d{};
  d.codes = q.codes.data<uint8_t>();
  d.scales = q.block_scales.data<uint8_t>();
  d.outer = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  d.outer_kind = q.outer;
  d.srows = q.rows;
  d.code_row_bytes = q.code_row_bytes();
  d.nb = q.blocks_per_row();
  d.elem = q.fmt == Format::MXFP8_E5M2 ? num::kE5M2 : num::kE4M3;
  // Rows are code_row_bytes apart (a multiple of 8 for NVFP4, of 32 otherwise): the base decides.
  d.vec = aligned(d.codes, q.fmt == Format::NVFP4 ? 8 : 16);
  return d;
}

template <Kind K, bool kCol>
void launch_dequant(const DequantParams& p, int64_t slices) {
  const int64_t ctas = p.geom.tiles(slices);
  if (ctas == 0) return;
  const size_t smem = dequant_smem_bytes(p.geom);
  allow_smem<dequant_tile_kernel<K, kCol>>(smem);
  dequant_tile_kernel<K, kCol><<<grid_of(ctas, "dequantize"), kThreads, smem>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

template <Kind K>
void launch_dequant(const DequantParams& p, int64_t slices, bool col) {
  if (col) launch_dequant<K, true>(p, slices);
  else launch_dequant<K, false>(p, slices);
}

}  // namespace

Tensor dequantize(const QTensor& q, bool undo_hadamard) {
  DequantParams p{};
  p.dec = decode_args(q, "dequantize");
  Tensor out = Tensor::empty(q.logical_shape(), DType::F32, Device::CUDA);
  if (out.numel() == 0) return out;
  const bool col = q.axis == BlockAxis::Col;
  const int B = q.block();
  p.geom = col ? col_geom(B, q.rows, q.padded_cols()) : row_geom(B, q.rows, q.padded_cols());
  p.scols = q.cols;
  p.hadamard = undo_hadamard ? q.hadamard : 0;
  p.hadamard_signs = q.hadamard_signs;
  p.out = out.data<float>();
  p.vec4 = (col ? q.rows : q.cols) % 4 == 0;  // out is a fresh (256-byte aligned) allocation
  switch (q.fmt) {
    case Format::NVFP4: launch_dequant<Kind::Nvfp4>(p, q.slices, col); break;
    case Format::MXFP8_E4M3:
    case Format::MXFP8_E5M2: launch_dequant<Kind::Mx>(p, q.slices, col); break;
    case Format::S2F6: launch_dequant<Kind::S2f6>(p, q.slices, col); break;
    default: fail("cuda dequantize: unsupported format {}", format_name(q.fmt));
  }
  return out;
}

QTensor requantize_transposed(const QTensor& q, RngKey rng) {
  const QuantSpec spec = requantize_transposed_spec(q);
  // Behind an RHT the exact values need the inverse rotation of whole chunks first: the plain
  // composition (cpu::requantize_transposed's definition) on the GPU.
  if (q.hadamard != 0) return cuda::quantize(cuda::dequantize(q, true), spec, rng, nullptr);

  RequantParams p{};
  p.dec = decode_args(q, "requantize_transposed");
  // Either axis: the output's storage is the per-slice transpose of the input's storage.
  const QuantShape logical = q.axis == BlockAxis::Row ? QuantShape{q.slices, q.rows, q.cols}
                                                      : QuantShape{q.slices, q.cols, q.rows};
  QTensor out = alloc_qtensor(spec, logical, Device::CUDA);
  p.in_cols = q.cols;
  p.row_tiles = (q.rows + kReqRows - 1) / kReqRows;
  p.col_tiles = (q.cols + kReqCols - 1) / kReqCols;
  p.codes = out.codes.data<uint8_t>();
  p.scales = out.block_scales.data<uint8_t>();
  p.out_padded_cols = out.padded_cols();
  p.out_nb = out.blocks_per_row();
  p.seed = rng.seed;
  p.stream = rng.stream;
  const int64_t ctas = q.slices * p.row_tiles * p.col_tiles;
  if (ctas > 0) {
    const size_t smem = requant_smem_bytes();
    allow_smem<requantize_transposed_kernel>(smem);
    requantize_transposed_kernel<<<grid_of(ctas, "requantize_transposed"), kThreads, smem>>>(p);
    FOURBIT_LAUNCH_CHECK();
  }
  return out;
}

bool take_nonfinite_flag(bool clear) {
  unsigned int v = 0;
  // cudaMemcpyFromSymbol waits for the kernels queued on the default stream.
  FOURBIT_CUDA_CHECK(cudaMemcpyFromSymbol(&v, g_nonfinite_flag, sizeof v));
  if (clear && v) {
    const unsigned int zero = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpyToSymbol(g_nonfinite_flag, &zero, sizeof zero));
  }
  return v != 0;
}

}  // namespace fourbit::ops::cuda
