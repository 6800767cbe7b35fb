// defines: cuda::quantize, cuda::quantize_segments, cuda::dequantize, cuda::requantize_transposed,
//          cuda::requantize_transposed_segments, cuda::take_nonfinite_flag
// The GPU quantizers. Every value goes through the same numerics/ functions as the CPU loops of
// ops/cpu/quantize.cpp (max_abs_finite, rht_forward/rht_inverse, nvfp4_s_enc/s_dec,
// nvfp4_quantize_block, mxfp8_quantize_block, s2f6_quantize_block and the decoders), or through
// their register-resident equivalents in numerics/fast_quant.h (proven equal to them by
// tests/numerics/fast_quant_test.cpp), with the same arguments (block amax, n, SR counter =
// storage_row * padded_cols + col), so the bytes equal the CPU's by construction. The kernels
// only decide who computes what and how data moves.
//
// Shapes (on stream()):
//  - nvfp4_row_fast_kernel (NVFP4, Row axis, per-row (per-token) outer scale, RNE with or
//    without Four Over Six, no RHT, no 16x16 tiles, rows of at most kFusedMaxCols padded
//    columns, float4-loadable input: the activations; persistent CTAs, the next rows' loads in
//    flight while the current ones are computed) and mxfp8_row_fast_kernel (MXFP8, Row axis, no
//    RHT, RNE or SR, float4-loadable input): register-resident, one pass; a warp loads runs of
//    32 blocks with coalesced 16-byte loads, each lane then owns one block of each run and
//    quantizes it with fast_quant.h (see the section comment).
//  - quantize_tile_kernel (every other spec; 256 threads a CTA): one CTA per storage tile (trows
//    x tcols, tcols a multiple of the block) staged in shared memory. Blocks are stored B+1
//    floats apart, so "one thread owns a block" reads (the numerics read a block in element
//    order) hit 32 different banks.
//    Row axis: rows read with float4. Col axis: the logical [tcols x trows] patch is read along
//    the contiguous dimension and written transposed into the tile (no transposed copy in
//    global memory). Phase A: a thread per block counts its non-finite inputs, rotates it
//    (RHT) in place and takes its amax. Phase A2: 16x16 tile amax, per-row S_enc. Phase B: a
//    thread per block quantizes and stores codes and scale.
//  - NVFP4 per-row scales the fast kernel does not take (SR, RHT, unaligned or wider rows) on
//    the Row axis: tiles are whole rows, the row amax is reduced in shared memory, the input is
//    read once ("fused").
//  - Other NVFP4 outer scales: an amax pre-pass (amax_segments_kernel over contiguous groups,
//    or quantize_tile_kernel in amax mode behind an RHT or for column groups), then
//    outer_scale_kernel, then the tile kernel (two reads of the input are unavoidable).
//  - mxfp8_col_fast_kernel (MXFP8, Col axis, no RHT, up to kColSegsPerLaunch row segments with
//    their own SR keys a launch: quantize and quantize_segments): the Col-axis counterpart of
//    the row kernel; quantize_tile_kernel takes the remaining Col-axis specs.
//  - requantize_transposed_kernel (requantize_segments_kernel: up to kReqSegsPerLaunch slices of
//    one tensor a launch): NVFP4 tile -> exact decode into shared memory, transposed -> MXFP8
//    E4M3 RCEIL + SR blocks along the old rows with fast_quant.h, in one kernel.
//  - dequant_tile_kernel: decode a storage tile into shared memory, undo the RHT, write the
//    logical layout with coalesced (float4) stores.
// Where the time goes. The tile kernels with the generic numerics are instruction-bound (ncu on
// an H200, 8192 x 8192: ~80% of issue slots busy, DRAM at 12-28%): about 90 (NVFP4 RNE, MXFP8
// RNE) to 200 (NVFP4 Four Over Six) instructions per element, most of them in minifloat_encode's
// integer rounding and in Philox. A quantizer at 75% of a device copy's rate on float32 input has
// ~45-55 instructions per element (H200: ~33e12 thread-instructions/s over ~0.6-0.66e12
// elements/s). The fast paths' arithmetic, counted in PTX: NVFP4 per-token RNE ~15 per element,
// Four Over Six ~36 (two candidates' rounding by float adds, 5 float ops each for the error
// sums; in SASS, loads, staging and stores included, see nvfp4_row_fast_kernel: 32.2 for the
// bench's 8192-column rows; was 35.2, 43.9), MXFP8 RNE ~6
// (hardware pair conversion), MXFP8 SR ~35 (Philox ~18 of them: 70 operations a call shared by 4
// elements; ~10.7 in SASS, where each 32x32 -> 64-bit product is one IMAD.WIDE),
// requantize_transposed 32.4 in SASS (was 46.9; decode ~7, SR encode ~6, Philox ~10.7; its bound
// is ~18, see the kernel). Measured on an H200 (2026-11-30, bench/gpu_quant, 16384 x 8192, ratio
// to a device copy; bench/results/h200_gpu_quant.json): Four Over Six 0.53 at 55-57 SASS
// instructions per element (ncu: 82% of issue slots busy), 0.66 at 43.9, 0.75 at 35.2, 0.80 at
// 32.2; NVFP4 per-token RNE 0.98; MXFP8 row RNE 1.01, SR 0.68, Col axis 0.62;
// requantize_transposed 0.18 at 46.9 SASS per element, 0.23 at 32.4.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "fourbit/numerics/fast_quant.h"
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

// The outer scale group (QTensor::outer_index) of a storage row in a known slice.
__device__ __forceinline__ int64_t group_in_slice(OuterScale outer, int64_t storage_row, int64_t slice) {
  switch (outer) {
    case OuterScale::PerRow: return storage_row;
    case OuterScale::PerSlice: return slice;
    default: return 0;
  }
}
// The same from the rows per slice.
__device__ __forceinline__ int64_t group_of(OuterScale outer, int64_t storage_row, int64_t rows_per_slice) {
  return group_in_slice(outer, storage_row, outer == OuterScale::PerSlice ? storage_row / rows_per_slice : 0);
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

// ---- register-resident fast paths: Row axis, no RHT ------------------------------------------------
//
// Shape (both kernels): a warp takes runs of 32 consecutive blocks of one storage row, and lane l
// ends up owning block l of each run in registers, quantizing it alone with the
// numerics/fast_quant.h functions (proven equal to the generic block quantizers). A run is read
// with coalesced 16-byte loads, lane l taking float4s l, l + 32, ... (MXFP8: every load of the
// thread issued before the first is used; NVFP4: cp.async copies of the next row group, issued
// before the current one is computed), and handed over through a per-warp shared buffer (2 KB a
// run for NVFP4, 4 KB for MXFP8) whose chunk order is XOR-swizzled, so that both the coalesced
// stores and the block-owning reads are free of bank conflicts. Codes leave as one 8-byte (NVFP4)
// or two 16-byte (MXFP8) stores per lane: a warp writes a contiguous run. A block holding a NaN or
// an Inf (found by a NaN-propagating max, one instruction per element) takes the generic numerics
// on a local copy, and is counted as the tile kernel counts it. Inputs must be float4-loadable
// (cols % 4 == 0, 16-byte aligned); padding past cols is loaded as zeros, as in the tile kernel.

constexpr int kWarps = kThreads / 32;
constexpr int kFastRunBlocks = 32;      // blocks per warp run: one per lane
constexpr int kNvfp4FastMaxWarps = 16;  // per CTA: one row of up to 16384 columns

struct FastRowParams {
  const float* x;          // storage rows [rows, cols], contiguous
  int64_t rows, cols, padded_cols, nb;
  uint8_t* codes;          // [rows, code_row_bytes]
  uint8_t* scales;         // [rows, nb]
  float* outer;            // NVFP4: S_dec per row (written here)
  int team_warps;          // NVFP4: warps sharing one row (and its amax)
  int64_t runs_per_row;    // MXFP8: warps per row (one run each)
  num::MxScaleRule mx_rule;
  uint64_t seed, stream;
  bool report;
};

// Chunk c (a float4) of block b of a run lives at float B * b + 4 * (c ^ stage_swizzle(b)): a
// quarter-warp's eight 16-byte accesses then fall on eight different 4-bank groups, both when
// consecutive lanes store consecutive chunks and when each lane reads chunk c of its own block.
template <int B>
__device__ __forceinline__ int stage_swizzle(int b) {
  return B == 16 ? (b >> 1) & 3 : b & 7;
}

// Loads the run starting at column col0 of `row`: float4 j of lane l is float4 l + 32 j of the run.
template <int B>
__device__ __forceinline__ void load_run(const float* row, int64_t cols, int64_t col0, bool live,
                                         float4 (&raw)[B / 4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < B / 4; ++j) {
    const int64_t col = col0 + 4 * (lane + 32 * j);
    raw[j] = live && col < cols ? __ldg(reinterpret_cast<const float4*>(row + col))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// The 16 values of block `lane` of a run at shared-window address a (from read_run_address): chunk
// c at a ^ 16 c, as blocks are 64-byte aligned (the caller declares the buffer so) and the swizzle
// XORs bits 4-5 of the address: one LOP3 a chunk, where read_run forms every address anew. offset:
// a multiple of 64 (another run, another half), added after the XOR (the load's immediate).
// Volatile, clobbering memory: the loads stay between the __syncwarp()s around them and are redone
// for every row (the address repeats every other row).
__device__ __forceinline__ uint32_t shared_address(const float* q) {
  uint32_t a = uint32_t(__cvta_generic_to_shared(q));
  asm("mov.b32 %0, %0;" : "+r"(a));  // opaque: kept in a register, not formed anew every row
  return a;
}
__device__ __forceinline__ uint32_t read_run_address(const float* buf) {
  const int lane = threadIdx.x & 31;
  return shared_address(buf + 16 * lane + 4 * stage_swizzle<16>(lane));
}
__device__ __forceinline__ void read_run_at(uint32_t a, uint32_t offset, float (&v)[16]) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[4 * c]), "=f"(v[4 * c + 1]), "=f"(v[4 * c + 2]), "=f"(v[4 * c + 3])
                 : "r"((a ^ (16u * c)) + offset)
                 : "memory");
}

// The B values of block `lane` of a run in the warp's shared buffer.
template <int B>
__device__ __forceinline__ void read_run(const float* buf, float (&v)[B]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < B / 4; ++c) {
    const float4 f = *reinterpret_cast<const float4*>(buf + B * lane + 4 * (c ^ stage_swizzle<B>(lane)));
    v[4 * c] = f.x;
    v[4 * c + 1] = f.y;
    v[4 * c + 2] = f.z;
    v[4 * c + 3] = f.w;
  }
}

// Passes a loaded run through the warp's shared buffer: v = the B values of block `lane`.
template <int B>
__device__ __forceinline__ void stage_run(float* buf, const float4 (&raw)[B / 4], float (&v)[B]) {
  constexpr int kChunks = B / 4;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int b = lane / kChunks + j * (32 / kChunks), c = lane % kChunks;
    *reinterpret_cast<float4*>(buf + B * b + 4 * (c ^ stage_swizzle<B>(b))) = raw[j];
  }
  __syncwarp();
  read_run<B>(buf, v);
  __syncwarp();  // the buffer is reused by the next run
}

// max_abs_finite over a block, with its non-finite values counted (the rare path).
template <int B>
__device__ __forceinline__ float finite_amax_counting(const float (&v)[B], unsigned& nonfinite) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < B; ++i) {
    a = num::max_abs_finite(a, v[i]);
    nonfinite += num::is_finite_bits(v[i]) ? 0u : 1u;
  }
  return a;
}

// The fast MXFP8 paths' fallback for a block holding a non-finite value: the generic block
// quantizer on a copy of v (n values, codes past n stay 0), its 32 codes packed four to a word.
// Inlined on purpose: a call would take v's and w's addresses, which moves the hot path's block
// out of registers into local memory (368 bytes of stack; MXFP8 row RNE fell from 1.00 to 0.54
// of a copy's rate when this was __noinline__).
__device__ __forceinline__ uint8_t mxfp8_generic_block(const float (&v)[num::kMxBlock], int n, float amax,
                                                    num::MiniFloatSpec elem, num::MxScaleRule rule,
                                                    num::Rounding rounding, uint64_t seed, uint64_t stream,
                                                    uint64_t index0, uint32_t (&w)[num::kMxBlock / 4]) {
  constexpr int B = num::kMxBlock;
  float copy[B];
  uint8_t c[B];
#pragma unroll
  for (int i = 0; i < B; ++i) {
    copy[i] = v[i];
    c[i] = 0;
  }
  const uint8_t scale = num::mxfp8_quantize_block(copy, n, amax, elem, rule, rounding, seed, stream, index0, c);
#pragma unroll
  for (int g = 0; g < B / 4; ++g)
    w[g] = uint32_t(c[4 * g]) | uint32_t(c[4 * g + 1]) << 8 | uint32_t(c[4 * g + 2]) << 16 | uint32_t(c[4 * g + 3]) << 24;
  return scale;
}

// 32 MXFP8 codes (eight words) to dst with two 16-byte stores (dst is 16-byte aligned).
__device__ __forceinline__ void store_mx_codes(uint8_t* dst, const uint32_t (&w)[num::kMxBlock / 4]) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(w[0], w[1], w[2], w[3]);
  d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// Four codes of an MXFP8 block under SR as one word: y[i] = bits of x[i] * x_scale (exact where
// it matters, see Mxfp8Sr; x's sign kept, so the block's inputs need not stay live), r the Philox
// words of counters 4g .. 4g + 3.
template <int kExpBits, bool kWide>
__device__ __forceinline__ uint32_t mxfp8_sr_word(const uint32_t (&y)[32], int g,
                                                  const num::Philox4x32& r) {
  using Sr = num::Mxfp8Sr<kExpBits>;
  uint32_t word = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t u = y[4 * g + e] & 0x7fffffffu;
    const uint32_t code = kWide ? Sr::code_wide(u, r.v[e]) : Sr::code_normal(u, r.v[e]);
    word |= (code | ((y[4 * g + e] >> 24) & 0x80u)) << (8 * e);
  }
  return word;
}

// The 32 codes of an MXFP8 block under SR, as 8 words, one Philox call per 4 codes (fast_quant.h:
// the words and codes of random_bits4 and mxfp8_encode with SR). The common form serves values
// that are zero or normal in the target; a group of four holding a value below (rare: about one
// Gaussian value in 10^4) takes the general form, in a branch that costs nothing otherwise.
template <int kExpBits>
__device__ __forceinline__ void mxfp8_sr_block(const float (&v)[32], float x_scale,
                                               const num::PhiloxKeys& keys, uint64_t stream,
                                               uint64_t index0, uint32_t (&w)[8]) {
  uint32_t y[32], wide = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    y[i] = num::bits_of(num::mul_rn(v[i], x_scale));
    wide |= uint32_t(num::Mxfp8Sr<kExpBits>::needs_wide(y[i] & 0x7fffffffu)) << i;
  }
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const num::Philox4x32 r = num::random_bits4_fast(keys, stream, index0 / 4 + uint64_t(g));
    if (__builtin_expect(((wide >> (4 * g)) & 0xfu) != 0, 0))
      w[g] = mxfp8_sr_word<kExpBits, true>(y, g, r);
    else
      w[g] = mxfp8_sr_word<kExpBits, false>(y, g, r);
  }
}

// Asynchronous 16-byte copies global -> shared (sm_80+), which keep the next row's loads in flight
// while the current row is computed, without holding registers. src_bytes 0 fills zeros.
__device__ __forceinline__ void cp_async16(uint32_t d, const float* src, int src_bytes) {  // d: shared window
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async16(float* dst, const float* src, int src_bytes) {
  cp_async16(uint32_t(__cvta_generic_to_shared(dst)), src, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all_but_newest() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// load_run + the stores of stage_run in one: the loads go straight into the swizzled shared buffer
// (same layout and lane assignment, columns past cols zero-filled); read_run (read_run_at for the
// NVFP4 kernel) then takes them out.
// Columns are 32-bit (rows of at most kFusedMaxCols) and the row pointer is formed once, opaque to
// the compiler (which would otherwise redo the row's 64-bit offset arithmetic for every chunk): a
// source address is then one wide multiply-add. A column past the row reads nothing (zero fill)
// from the row's start.
__device__ __forceinline__ const float* opaque_ptr(const float* q) {
  asm("mov.b64 %0, %0;" : "+l"(q));
  return q;
}
template <int B>
__device__ __forceinline__ void prefetch_run(float* buf, const float* row, int cols, int col0, bool live) {
  constexpr int kChunks = B / 4;
  const int lane = threadIdx.x & 31;
  row = opaque_ptr(row);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int b = lane / kChunks + j * (32 / kChunks), c = lane % kChunks;
    const int col = col0 + 4 * (lane + 32 * j);
    const bool in = live && col < cols;
    cp_async16(buf + B * b + 4 * (c ^ stage_swizzle<B>(b)), row + uint32_t(col < cols ? col : 0),
               in ? 16 : 0);
  }
}

// NVFP4, per-row (per-token) outer scale, RNE, with or without Four Over Six: one pass over the
// input. A team of team_warps warps holds one row (kRuns runs of 32 blocks per warp, so up to
// 16 x 2 x 32 blocks = 16384 columns); the row amax is a warp max plus, for teams of several
// warps, a shared-memory max. A CTA holds one row or several (a row group; at most 512 threads)
// and is persistent: it loops over row groups g = blockIdx.x, + gridDim.x, ..., and while it
// quantizes group g the cp.async copies of group g + gridDim.x are in flight into the other half
// of a double-buffered shared stage (the team max's __syncthreads keeps a CTA's warps in step,
// so without this a CTA would alternate between waiting on memory and computing).
// Instructions per element, SASS of the sm_90a build (nvdisasm -gi; one thread's hot path
// through one loop iteration, warps inside the row, every block finite, divided by the kRuns * 16
// elements it quantizes; counted by scripts/sass_hot_path.py): kRuns 2 (Four Over Six rows of an
// even run count, as 8192 columns, see launch_nvfp4_row_fast): Four Over Six MSE 32.2 (was 35.2, 40.0, 49.1), MAE 30.2 (was 33.2), RNE 19.6 (was 20.3);
// kRuns 1: Four Over Six MSE 36.6 (was 40.3, 43.9, 57.4), MAE 34.6 (was 38.3), RNE 23.4 (was
// 24.8, 26.0). kRuns 2, 4/6 MSE, 1031 instructions per iteration, per element: the block
// quantizer 23.4 (11 per element and candidate, no saturation clamp where the run's fos_bounded
// vote holds; signs 7/8, the choice and packing ~0.6), its scales and the vote 1.9
// (fos_block_scales: no division), block amax 1.0; the rest 6.0: prefetch (a running source
// pointer, immediate offsets), staging reads (one lane address kept), team max, S_enc, S_dec and
// the encode-scale table, stores (running row pointers) and counters (values and blocks once,
// after the loop). ~38 is what a 75%-of-copy rate allows (the tile kernel's generic numerics:
// 90-200). kRuns 2 holds 16 warps per SM (128 registers), kRuns 1 32 (64 registers),
// both with 64 KiB of copies in flight per SM.
template <int kRuns, bool kFos, num::ScaleMetric kMetric>
__global__ void __launch_bounds__(32 * kNvfp4FastMaxWarps, kRuns == 1 ? 2 : 1)
    nvfp4_row_fast_kernel(const FastRowParams p) {
  constexpr int B = num::kNvfp4Block;
  constexpr int kWarpFloats = kRuns * kFastRunBlocks * B;  // one warp's runs
  // [2][warps][kWarpFloats]; blocks 64-byte aligned in the shared window (read_run_at XORs bits 4-5)
  extern __shared__ __align__(128) float stage[];
  __shared__ uint32_t team_amax[2][kNvfp4FastMaxWarps];
  const int warps = int(blockDim.x) / 32;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int tw = p.team_warps, wt = warp % tw;  // team size, warp within the team
  const int rows_per_cta = warps / tw;
  const int64_t groups = (p.rows + rows_per_cta - 1) / rows_per_cta;
  const int blk0 = wt * kRuns * kFastRunBlocks;  // first block of the warp's runs
  const int cols = int(p.cols);                  // at most kFusedMaxCols
  // The warp's row in group g is g * rows_per_cta + warp / tw: kept as a running value (row of
  // the group being quantized) so the loop does no division and no 64-bit multiply for it.
  const int64_t row_step = int64_t(gridDim.x) * rows_per_cta;
  int64_t row = int64_t(blockIdx.x) * rows_per_cta + warp / tw;
  // This warp's part of stage half it & 1; prefetch(r, h) starts the copies of row r into half h.
  auto half = [&](int it) { return stage + ((it & 1) * warps + warp) * kWarpFloats; };
  // A warp whose runs lie inside the row (every warp of rows that are a multiple of its span, as
  // 8192 columns) copies from one address per row: chunk j of run k is at src + 128 j + 512 k and
  // lands at dst + 128 j + 512 k (the swizzle of block b = lane / 4 + 8 j does not depend on j),
  // so the copies take immediate offsets and no per-chunk bounds checks.
  const bool whole = (blk0 + kRuns * kFastRunBlocks) * B <= cols;  // uniform over the warp
  const uint32_t src0 = uint32_t(blk0 * B + 4 * lane);
  const int dst0 = B * (lane / 4) + 4 * ((lane % 4) ^ ((lane / 8) & 3));
  static_assert(B == 16, "read_run_at reads 16-value blocks");
  const uint32_t read0 = read_run_address(half(0)), half_bytes = uint32_t(4 * warps * kWarpFloats);
  // The calls go down the rows in order (row0, + row_step, ...): the whole-run copies take their
  // source from a running pointer (two adds a row, where forming it took a 64-bit multiply) and
  // their destination from one shared-window address kept in a register.
  const float* next_src = p.x + row * p.cols + src0;
  int64_t src_step = row_step * p.cols;
  asm("mov.b64 %0, %0;" : "+l"(src_step));  // opaque: formed once
  const uint32_t write0 = shared_address(half(0) + dst0);
  auto prefetch = [&](int64_t r, int h) {  // h: the stage half
    const bool live = r < p.rows;
    if (whole) {
      const float* src = live ? next_src : p.x + src0;
      const uint32_t dst = write0 + uint32_t(h) * half_bytes;
#pragma unroll
      for (int k = 0; k < kRuns; ++k)
#pragma unroll
        for (int j = 0; j < B / 4; ++j)
          cp_async16(dst + uint32_t(4 * (k * kFastRunBlocks * B + 8 * B * j)),
                     src + k * kFastRunBlocks * B + 128 * j, live ? 16 : 0);
      next_src += src_step;
    } else {
      const float* xrow = p.x + (live ? r : 0) * p.cols;
#pragma unroll
      for (int k = 0; k < kRuns; ++k)
        prefetch_run<B>(half(h) + k * kFastRunBlocks * B, xrow, cols, (blk0 + k * kFastRunBlocks) * B, live);
    }
  };

  unsigned nonfinite = 0, chose_four = 0;
  int64_t g = blockIdx.x;
  if (g < groups) prefetch(row, 0);
  cp_async_commit();
  const int64_t row0 = row;
  unsigned lane_runs = 0;  // bit k: the lane's block of run k lies in the row
#pragma unroll
  for (int k = 0; k < kRuns; ++k) lane_runs |= unsigned(blk0 + k * kFastRunBlocks + lane < p.nb) << k;
  int it = 0;
  // kRuns 2: the row's codes and scales through running pointers (the lane's first block; steps
  // formed once), where every row took two 64-bit multiplies; kRuns 1 (64 registers) has no room.
  uint8_t* codes_row = nullptr;
  uint8_t* scales_row = nullptr;
  int64_t codes_step = 0, scales_step = 0;
  if constexpr (kRuns > 1) {
    codes_row = p.codes + row * (p.padded_cols / 2) + (blk0 + lane) * 8;
    scales_row = p.scales + row * p.nb + blk0 + lane;
    codes_step = row_step * (p.padded_cols / 2);
    scales_step = row_step * p.nb;
    asm("mov.b64 %0, %0;" : "+l"(codes_step));
    asm("mov.b64 %0, %0;" : "+l"(scales_step));
  }
  for (; g < groups;  // uniform over the CTA
       ++it, g += gridDim.x, row += row_step, codes_row += codes_step, scales_row += scales_step) {
    __syncwarp();  // every lane has read the half the next prefetch overwrites
    if (g + gridDim.x < groups) prefetch(row + row_step, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait_all_but_newest();
    __syncwarp();  // the whole warp's copies of group g have landed
    float v[kRuns][B];
#pragma unroll
    for (int k = 0; k < kRuns; ++k)
      read_run_at(read0 + (it & 1) * half_bytes, 4 * k * kFastRunBlocks * B, v[k]);
    const bool live = row < p.rows;

    // Block amaxes (max_abs_finite), non-finite counts, the row amax (bits: order-free, exact).
    float amax[kRuns];
    unsigned nonfinite_blocks = 0;
    uint32_t row_amax = 0;
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      float a = 0.0f;
#pragma unroll
      for (int i = 0; i < B; ++i) a = num::max_abs_nan(a, v[k][i]);
      if (!num::is_finite_bits(a)) {
        a = finite_amax_counting(v[k], nonfinite);
        nonfinite_blocks |= 1u << k;
      }
      amax[k] = a;
      row_amax = max(row_amax, num::bits_of(a));
    }
    row_amax = __reduce_max_sync(0xffffffffu, row_amax);
    if (tw > 1) {  // uniform over the CTA; the two halves alternate so no warp overwrites a max
      if (lane == 0) team_amax[it & 1][warp] = row_amax;  // another warp still has to read
      __syncthreads();
      // lane l < tw reads team warp l's max: one read and one warp max whatever the team size
      row_amax = __reduce_max_sync(0xffffffffu, lane < tw ? team_amax[it & 1][warp - wt + lane] : 0u);
    }
    const float s_enc = num::nvfp4_s_enc(num::float_of(row_amax), kFos);
    const float s_dec = num::nvfp4_s_dec(s_enc);
    if (live && wt == 0 && lane == 0) p.outer[row] = s_dec;
    // Four Over Six: the row's table of encode scales (lookups are shuffles: the whole warp builds
    // and reads it, before the per-block branches); rows outside its exact range go generic.
    num::FosGroup grp{};
    if constexpr (kFos) grp = num::fos_group(s_dec);
    // runs the fast quantizers do not take: a non-finite value, or a group outside FosGroup::exact
    const unsigned generic_runs = nonfinite_blocks | (!kFos || grp.exact ? 0u : ~0u);

#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int blk = blk0 + k * kFastRunBlocks + lane;
      num::FosBlockScales scales{};
      bool bounded = false;  // every block of the warp's run: the unclamped quantizer (fos_bounded)
      if constexpr (kFos) {
        scales = num::fos_block_scales(amax[k], s_enc, grp);
        bounded = __all_sync(0xffffffffu, num::fos_bounded(amax[k], scales));
      }
      if (!live || !((lane_runs >> k) & 1u)) continue;
      const int n = min(B, cols - blk * B);
      num::Nvfp4Block out;
      if (!((generic_runs >> k) & 1u)) {
        if constexpr (kFos) {  // (chose_four counted in each branch: one add where the choice is made)
          if (bounded) {
            out = num::fos_quantize_block<kMetric, true>(v[k], scales);
            chose_four += unsigned(out.chose_four);
          } else {
            out = num::fos_quantize_block<kMetric, false>(v[k], scales);  // a run with a subnormal s_b
            chose_four += unsigned(out.chose_four);
          }
        } else {
          out = num::nvfp4_quantize_block_fast<false>(v[k], amax[k], s_enc, s_dec);
        }
      } else {
        float copy[B];
#pragma unroll
        for (int i = 0; i < B; ++i) copy[i] = v[k][i];
        out = num::nvfp4_quantize_block(copy, n, amax[k], s_enc, s_dec, kFos, kMetric,
                                        num::Rounding::RNE, 0, 0, 0);
        chose_four += unsigned(out.chose_four);
      }
      if constexpr (kRuns > 1) {
        *reinterpret_cast<uint64_t*>(codes_row + k * kFastRunBlocks * 8) = out.packed;
        scales_row[k * kFastRunBlocks] = out.scale;
      } else {
        *reinterpret_cast<uint64_t*>(p.codes + row * (p.padded_cols / 2) + blk * 8) = out.packed;
        p.scales[row * p.nb + blk] = out.scale;
      }
    }
  }
  // values and blocks follow from the live iterations (rows grow with it: the first ones), as a
  // lane's blocks and their sizes are the same in every row
  const unsigned live_its =
      row0 < p.rows ? unsigned(min64(int64_t(it), (p.rows - row0 + row_step - 1) / row_step)) : 0u;
  unsigned values = 0, blocks = 0;
#pragma unroll
  for (int k = 0; k < kRuns; ++k) {
    if ((lane_runs >> k) & 1u) {
      values += live_its * unsigned(min(B, cols - (blk0 + k * kFastRunBlocks + lane) * B));
      blocks += live_its;
    }
  }
  flush_counts(p.report, values, nonfinite, blocks, chose_four);
}

// One MXFP8 block of the fast paths: v holds the block's values (zeros past n), index0 its
// first SR counter; the 32 codes go to dst (16-byte aligned) and the scale byte is returned. RNE
// converts pairs in hardware (cvt.rn.satfinite.e4m3x2 / e5m2x2, as mxfp8_encode does); SR spends
// one Philox-4x32-10 call on four consecutive counters. A block holding NaN/Inf takes the generic
// quantizer and counts its non-finite values into `nonfinite`.
template <int kExpBits, bool kSR>
__device__ __forceinline__ uint8_t mxfp8_fast_block(const float (&v)[num::kMxBlock], int n, num::MxScaleRule rule,
                                                    uint64_t seed, uint64_t stream, uint64_t index0, uint8_t* dst,
                                                    unsigned& nonfinite) {
  constexpr int B = num::kMxBlock;
  const num::MiniFloatSpec elem = kExpBits == 4 ? num::e4m3_spec() : num::e5m2_spec();
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < B; ++i) a = num::max_abs_nan(a, v[i]);
  uint32_t w[B / 4];  // the 32 code bytes
  uint8_t scale;
  if (num::is_finite_bits(a)) {
    scale = num::mxfp8_scale(a, elem, rule);
    const float x_scale = num::pow2f(127 - int(scale));
    if constexpr (kSR) {
      mxfp8_sr_block<kExpBits>(v, x_scale, num::philox_keys(seed), stream, index0, w);
    } else {
#pragma unroll
      for (int g = 0; g < B / 4; ++g)
        w[g] = num::mxfp8_encode_rne_x2<kExpBits>(v[4 * g], v[4 * g + 1], scale, x_scale) |
               (num::mxfp8_encode_rne_x2<kExpBits>(v[4 * g + 2], v[4 * g + 3], scale, x_scale) << 16);
    }
  } else {  // a NaN or Inf in the block: the generic quantizer on a copy
    a = finite_amax_counting(v, nonfinite);
    scale = mxfp8_generic_block(v, n, a, elem, rule, kSR ? num::Rounding::SR : num::Rounding::RNE, seed, stream,
                                index0, w);
  }
  store_mx_codes(dst, w);
  return scale;
}

// MXFP8 (E4M3 or E5M2; RCEIL or floor scales), RNE or SR, on the Row axis: one warp per run of
// 32 blocks, each lane quantizing one block with mxfp8_fast_block (SR counter = padded storage
// index, as the generic block quantizer draws them). Instructions per element: ~6 for RNE (PTX),
// ~35 for SR (PTX; Philox ~10.7 of them in SASS), against the ~50 a 75%-of-copy rate allows.
template <int kExpBits, bool kSR>
__global__ void __launch_bounds__(kThreads, 3) mxfp8_row_fast_kernel(const FastRowParams p) {
  constexpr int B = num::kMxBlock;
  __shared__ __align__(16) float stage[kWarps][kFastRunBlocks * B];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t gw = int64_t(blockIdx.x) * kWarps + warp;
  const int64_t row = gw / p.runs_per_row, run = gw % p.runs_per_row;
  const bool live = row < p.rows;
  const float* xrow = p.x + (live ? row : 0) * p.cols;

  float4 raw[B / 4];
  load_run<B>(xrow, p.cols, run * kFastRunBlocks * B, live, raw);
  float v[B];
  stage_run<B>(stage[warp], raw, v);

  const int64_t blk = run * kFastRunBlocks + lane;
  unsigned values = 0, nonfinite = 0, blocks = 0;
  if (live && blk < p.nb) {
    const int64_t col = blk * B;
    const int n = int(min64(B, p.cols - col));
    p.scales[row * p.nb + blk] = mxfp8_fast_block<kExpBits, kSR>(
        v, n, p.mx_rule, p.seed, p.stream, uint64_t(row * p.padded_cols + col), p.codes + row * p.padded_cols + col,
        nonfinite);
    values = unsigned(n);
    blocks = 1u;
  }
  flush_counts(p.report, values, nonfinite, blocks, 0u);
}

// MXFP8 on the Col axis (blocks of 32 logical rows down each column; storage transposed), no
// RHT, RNE or SR, for one or several row segments of one [R, C] input, each its own storage
// matrix [C, padded rows] (a tensor, the slices of a 3-D tensor, or the experts' token ranges of
// the weight-gradient operands, which would otherwise be as many small launches). A CTA takes one
// block row (32 logical rows) of one segment and kThreads columns; thread t loads its column's 32
// values with 32 scalar loads that a warp makes into 128-byte rows (coalesced, no shared
// memory), quantizes them with mxfp8_fast_block and writes the block's 32 codes as two 16-byte
// stores. Counter for SR: storage row (logical column) * padded rows + first logical row.
constexpr int kColSegsPerLaunch = 32;
struct ColSegment {
  const float* x;   // logical rows [rows, cols] of the input, row-major
  uint8_t* codes;   // storage [cols, padded_rows]
  uint8_t* scales;  // storage [cols, padded_rows / 32]
  int64_t rows;     // logical rows (the blocked dimension)
  int64_t row0;     // storage row of the segment's first row in the SR counter (slice s: s * cols)
  uint64_t seed, stream;
  int64_t cta0;     // the segment's first CTA
};
struct ColSegments {
  ColSegment seg[kColSegsPerLaunch];
  int n;
  int64_t cols, col_chunks;  // logical cols, ceil(cols / kThreads)
  num::MxScaleRule mx_rule;
  bool report;
};

template <int kExpBits, bool kSR>
__global__ void __launch_bounds__(kThreads) mxfp8_col_fast_kernel(const __grid_constant__ ColSegments p) {
  constexpr int B = num::kMxBlock;
  const int64_t cta = blockIdx.x;
  int si = 0;
  while (si + 1 < p.n && p.seg[si + 1].cta0 <= cta) ++si;  // uniform over the CTA
  const ColSegment& sg = p.seg[si];
  const int64_t local = cta - sg.cta0, rb = local / p.col_chunks;
  const int64_t j = (local % p.col_chunks) * kThreads + threadIdx.x;  // logical column
  unsigned values = 0, nonfinite = 0, blocks = 0;
  if (j < p.cols) {
    const int64_t r0 = rb * B;
    const int n = int(min64(B, sg.rows - r0));
    const float* src = sg.x + r0 * p.cols + j;
    float v[B];
    if (n == B) {
#pragma unroll
      for (int i = 0; i < B; ++i) v[i] = __ldg(src + int64_t(i) * p.cols);
    } else {
#pragma unroll
      for (int i = 0; i < B; ++i) v[i] = i < n ? __ldg(src + int64_t(i) * p.cols) : 0.0f;
    }
    const int64_t padded_rows = ((sg.rows + B - 1) / B) * B;
    sg.scales[j * (padded_rows / B) + rb] = mxfp8_fast_block<kExpBits, kSR>(
        v, n, p.mx_rule, sg.seed, sg.stream, uint64_t((sg.row0 + j) * padded_rows + r0),
        sg.codes + j * padded_rows + r0, nonfinite);
    values = unsigned(n);
    blocks = 1u;
  }
  flush_counts(p.report, values, nonfinite, blocks, 0u);
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
//
// Shape: a CTA takes a tile of kReqRows input storage rows (old rows: 8 output blocks of 32) x
// kReqCols input storage cols (2 NVFP4 blocks; 32 output storage rows). Phase 1: thread t decodes
// old row t's two blocks (16 code bytes, one load, four registers) exactly (fl(fl(E2M1 * E4M3) *
// S_dec), as nvfp4_dequant, by Nvfp4DecodeWord) and writes the 32 values down a tile column: the
// 32 lanes of a warp write 32 consecutive old rows, one bank each. Phase 2: thread t owns output
// block t % 8 of output row t / 8, reads its 32 values with eight 16-byte shared loads (blocks
// kReqBlockStride floats apart: conflict-free), and quantizes them with RCEIL scales and
// elementwise SR (E4m3SrWords; Mxfp8Sr for a block holding a value below E4M3's normals), one
// Philox-4x32-10 call per four consecutive counters. A warp writes four output rows of 256
// contiguous code bytes.
//
// Instructions (SASS, sm_90a, nvdisasm; scripts/sass_hot_path.py CUBIN requantize_transposed
// [--by-function | --by-line]: one thread's path from entry to EXIT for a whole tile of finite
// values, divided by its 32 elements): 32.4 per element (1037 a thread), was 46.9 (1501):
//   Philox          10.7  (was 14.7) 64-bit products: one IMAD.WIDE each, not IMAD.HI + IMAD;
//                         keys from the constant bank, not rematerialized per call
//   exact decode    ~7    (was ~10)  4 bit moves + 2 FMUL + 1 STS (no multiply by 2^126; the
//                         codes were a runtime-indexed array in local memory)
//   SR encode       ~6    (was ~11.5) FMUL, VIADDMNMX (the wide-path test), SHF + LEA, 7/4 PRMT
//                         and LOP3 to pack codes and signs, the signs' shared reload
//   amax, scale     ~1.5
//   the rest        ~6    tile coordinates (32-bit now, was 64-bit divisions), addresses,
//                         loads, shared loads, stores
// What bounds it: the kernel moves only ~1.6 bytes per element (0.56 in, 1.03 out), so 75% of an
// H200 copy (~2.9 TB/s) is ~1.8e12 elements/s, which at ~33e12 thread-instructions/s leaves ~18
// instructions per element; Philox alone is ~10 of them under the SR contract (10 rounds of two
// 32x32 -> 64-bit products and two 3-way XORs per 4 elements), decode and encode ~13, so the
// ceiling stays well below 0.75. It ran at 0.18 at 46.9 instructions (it was ~0.08 with the
// generic numerics, ~200 instructions per element) and runs at 0.23 at 32.4 (H200, measured; less
// than the count's ~0.26; not profiled: IMAD.WIDE's issue rate is the first suspect).
constexpr int kReqRows = 256;
constexpr int kReqCols = 32;
constexpr int kReqBlockStride = 36;  // floats between the output blocks of a tile row
constexpr int kReqRs = (kReqRows / num::kMxBlock) * kReqBlockStride;  // 288 floats per output row

struct RequantParams {
  DecodeArgs dec;           // the NVFP4 input (storage [S * rows, cols])
  bool vec16;               // two blocks (16 code bytes) of a tile row load as one uint4
  int64_t in_cols;          // input storage cols (unpadded) = output storage rows per slice
  uint32_t row_tiles, col_tiles;  // per slice (a launch's CTAs are < 2^31: so are these)
  uint8_t* codes;           // output storage [S * in_cols, out_padded_cols]
  uint8_t* scales;
  int64_t out_padded_cols, out_nb;
  uint64_t seed, stream;
};

// A 16-byte shared-memory load the compiler must issue again (volatile): reading a value back
// instead of holding it in a register from an earlier load.
__device__ __forceinline__ float4 lds_reload(const float4* p) {
  float4 f;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(f.x), "=f"(f.y), "=f"(f.z), "=f"(f.w)
               : "r"(uint32_t(__cvta_generic_to_shared(p))));
  return f;
}

// Tile t of p (slices x row tiles x col tiles), by the CTA.
// keys = philox_keys(p.seed).
__device__ __forceinline__ void requantize_tile(const RequantParams& p, int64_t t, const num::PhiloxKeys& keys) {
  constexpr int B = num::kMxBlock;
  static_assert(kReqRows == kThreads && kReqCols == 32 && kReqCols * (kReqRows / B) == kThreads);
  __shared__ __align__(16) float tile[kReqCols * kReqRs];  // output-row major, 36 KB

  // t < 2^31 (one launch's CTAs): 32-bit divisions
  const uint32_t t32 = uint32_t(t), ct = t32 % p.col_tiles, t_rs = t32 / p.col_tiles;
  const int64_t rt = t_rs % p.row_tiles, s = t_rs / p.row_tiles;
  const int64_t i0 = rt * kReqRows;  // first input storage row (in the slice)
  const int64_t j0 = ct * kReqCols;  // first input storage col
  const int64_t in_rows = p.dec.srows;

  // Phase 1: decode old row i0 + t. Rows past the input are zeros (the output's padding); an
  // input block past the row holds no output rows and is skipped.
  {
    const int ii = int(threadIdx.x);
    float* dst = tile + (ii / B) * kReqBlockStride + ii % B;  // + jj * kReqRs
    const int64_t blk0 = j0 / 16;
    const int nblk = int(min64(2, p.dec.nb - blk0));
    if (i0 + ii < in_rows) {
      const int64_t row = s * in_rows + i0 + ii;
      const uint8_t* src = p.dec.codes + row * p.dec.code_row_bytes + blk0 * 8;
      uint32_t words[4] = {0, 0, 0, 0};  // element k in nibble k % 8 of words[k / 8]
      if (p.vec16 && nblk == 2) {
        const uint4 c = *reinterpret_cast<const uint4*>(src);
        words[0] = c.x, words[1] = c.y, words[2] = c.z, words[3] = c.w;
      } else {
#pragma unroll
        for (int b = 0; b < 2; ++b) {  // unrolled: words stays in registers
          if (b >= nblk) break;
          uint64_t packed = 0;
          if (p.dec.vec) {
            packed = reinterpret_cast<const uint64_t*>(src)[b];
          } else {
            for (int k = 0; k < 8; ++k) packed |= uint64_t(src[8 * b + k]) << (8 * k);
          }
          words[2 * b] = uint32_t(packed), words[2 * b + 1] = uint32_t(packed >> 32);
        }
      }
      const float s_dec = p.dec.outer ? p.dec.outer[group_in_slice(p.dec.outer_kind, row, s)] : 1.0f;
      if (__builtin_expect(num::Nvfp4DecodeWord::exact_for(s_dec), 1)) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          if (b >= nblk) break;
          const num::Nvfp4DecodeWord d(num::ue4m3_decode_fast(p.dec.scales[row * p.dec.nb + blk0 + b]), s_dec);
#pragma unroll
          for (int e = 0; e < 16; ++e) dst[(16 * b + e) * kReqRs] = d.at(words[2 * b + e / 8], e % 8);
        }
      } else {  // |S_dec| >= 2^120: nvfp4_dequant itself (a rolled loop: the selects keep words in registers)
        for (int b = 0; b < nblk; ++b) {
          const uint8_t sb = p.dec.scales[row * p.dec.nb + blk0 + b];
          for (int e = 0; e < 16; ++e) {
            const uint32_t code = (b == 0 ? (e < 8 ? words[0] : words[1]) : (e < 8 ? words[2] : words[3])) >> (4 * (e % 8));
            dst[(16 * b + e) * kReqRs] = num::nvfp4_dequant(code & 0xFu, sb, s_dec);
          }
        }
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < kReqCols; ++jj) dst[jj * kReqRs] = 0.0f;
    }
  }
  __syncthreads();

  // Phase 2: output block ob of output storage row j0 + jj (old rows i0 + 32 ob ...).
  unsigned nonfinite = 0;
  const int jj = int(threadIdx.x) / (kReqRows / B), ob = int(threadIdx.x) % (kReqRows / B);
  const int64_t j = j0 + jj;
  const int64_t col = i0 + int64_t(ob) * B;  // output storage col
  if (j < p.in_cols && col < in_rows) {
    float v[B];
    const float* src = tile + jj * kReqRs + ob * kReqBlockStride;
#pragma unroll
    for (int c = 0; c < B / 4; ++c) {
      const float4 f = reinterpret_cast<const float4*>(src)[c];
      v[4 * c] = f.x;
      v[4 * c + 1] = f.y;
      v[4 * c + 2] = f.z;
      v[4 * c + 3] = f.w;
    }
    const int64_t row = s * p.in_cols + j;  // output storage row
    const uint64_t index0 = uint64_t(row * p.out_padded_cols + col);
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < B; ++e) a = num::max_abs_nan(a, v[e]);
    uint32_t w[B / 4];
    uint8_t scale;
    if (num::is_finite_bits(a)) {
      scale = num::ue8m0_scale_for_max(a, num::kE4M3Max);  // mxfp8_scale(a, E4M3, RCEIL)
      // RCEIL: every |v| * 2^(127 - scale) <= 448, as E4m3SrWords needs
      using Sr = num::E4m3SrWords;
      const float xs8 = Sr::x_scale8(scale);
      uint32_t y8[B], low = ~0u;  // low: the least nonzero y8, less 1 (zeros wrap to ~0)
#pragma unroll
      for (int e = 0; e < B; ++e) {
        y8[e] = Sr::scaled(v[e], xs8);
        low = min(low, y8[e] - 1u);
      }
      // v is not kept past here (registers: 32 more spilled): the signs and the rare path read
      // the tile again
      const float4* src4 = reinterpret_cast<const float4*>(src);
      if (__builtin_expect(!Sr::needs_wide(low + 1u), 1)) {
        // index0 is a multiple of 32 (padded cols and col are), so the group index0 / 4 + g
        // is (index0 / 4) | g: the same counter without a 64-bit add
#pragma unroll
        for (int g = 0; g < B / 4; ++g) {
          const num::Philox4x32 r = num::random_bits4_fast(keys, p.stream, (index0 >> 2) | uint64_t(g));
          const float4 x = lds_reload(src4 + g);
          w[g] = Sr::pack(Sr::code_at_24(y8[4 * g], r.v[0]), Sr::code_at_24(y8[4 * g + 1], r.v[1]),
                          Sr::code_at_24(y8[4 * g + 2], r.v[2]), Sr::code_at_24(y8[4 * g + 3], r.v[3]),
                          num::bits_of(x.x), num::bits_of(x.y), num::bits_of(x.z), num::bits_of(x.w));
        }
      } else {  // a value below E4M3's smallest normal (rare): Mxfp8Sr's general form
        float x[B];
#pragma unroll
        for (int c = 0; c < B / 4; ++c) {
          const float4 f = lds_reload(src4 + c);
          x[4 * c] = f.x, x[4 * c + 1] = f.y, x[4 * c + 2] = f.z, x[4 * c + 3] = f.w;
        }
        mxfp8_sr_block<4>(x, num::pow2f(127 - int(scale)), keys, p.stream, index0, w);
      }
    } else {  // a non-finite decoded value (a NaN scale byte, or an overflowing S_dec)
      a = finite_amax_counting(v, nonfinite);
      scale = mxfp8_generic_block(v, int(min64(B, in_rows - col)), a, num::e4m3_spec(), num::MxScaleRule::RCEIL,
                                  num::Rounding::SR, p.seed, p.stream, index0, w);
    }
    store_mx_codes(p.codes + row * p.out_padded_cols + col, w);
    p.scales[row * p.out_nb + col / B] = scale;
  }
  flush_counts(false, 0u, nonfinite, 0u, 0u);
}

// keys: philox_keys(p.seed), made on the host, so that the rounds read them from the constant
// bank (made in the kernel they were rematerialized, one add per key and Philox call, for want of
// registers: 38.4 instructions per element instead of 32.4).
__global__ void __launch_bounds__(kThreads, 3) requantize_transposed_kernel(const RequantParams p,
                                                                            const num::PhiloxKeys keys) {
  requantize_tile(p, blockIdx.x, keys);
}

// Several single-slice inputs (the experts' token ranges of one saved operand) in one launch: CTA
// c runs tile c - cta0[i] of segment i, the last segment whose first CTA is at or before c.
constexpr int kReqSegsPerLaunch = 16;
struct RequantSegments {
  RequantParams seg[kReqSegsPerLaunch];
  int64_t cta0[kReqSegsPerLaunch];
  int n;
};

__global__ void __launch_bounds__(kThreads, 3) requantize_segments_kernel(const __grid_constant__ RequantSegments p) {
  const int64_t cta = blockIdx.x;
  int si = 0;
  while (si + 1 < p.n && p.cta0[si + 1] <= cta) ++si;  // uniform over the CTA
  // the keys made here: 16 segments' keys would take the parameters past 4 KB
  requantize_tile(p.seg[si], cta - p.cta0[si], num::philox_keys(p.seg[si].seed));
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

void reset_counters() { FOURBIT_CUDA_CHECK(cudaMemsetAsync(counters_ptr(), 0, sizeof(DeviceCounters), stream())); }

void add_counters(QuantReport* report) {
  DeviceCounters c{};
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&c, counters_ptr(), sizeof c, cudaMemcpyDeviceToHost, stream()));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream()));
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
  quantize_tile_kernel<K, kCol, kAmaxOnly, kSR, kFos><<<grid_of(ctas, "quantize"), kThreads, smem, stream()>>>(p);
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
  FOURBIT_CUDA_CHECK(cudaMemsetAsync(gamax, 0, size_t(groups) * sizeof(uint32_t), stream()));
  const int64_t numel = p.slices * R * C;
  if (numel == 0) return;
  if (p.hadamard == 0 && !(col && p.outer_kind == OuterScale::PerRow)) {
    // Contiguous groups: the tensor, a slice, or (Row axis) a storage row.
    const int64_t seg_len = numel / groups;
    const bool vec4 = seg_len % 4 == 0 && aligned(p.in.x, 16);
    const int64_t chunk = std::min<int64_t>(seg_len, 32768);
    const int64_t chunks = (seg_len + chunk - 1) / chunk;
    amax_segments_kernel<<<grid_of(groups * chunks, "quantize"), kThreads, 0, stream()>>>(p.in.x, seg_len, chunks,
                                                                              chunk, vec4, gamax);
    FOURBIT_LAUNCH_CHECK();
  } else {
    QuantParams a = p;
    a.amax_out = gamax;
    if (col) launch_quantize_tiles<Kind::Nvfp4, true, true, false, false>(a);
    else launch_quantize_tiles<Kind::Nvfp4, false, true, false, false>(a);
  }
}

// ---- launching the register-resident fast paths ------------------------------------------------------

// Row-axis inputs without an RHT that float4 loads can read.
bool fast_row_input(const QuantSpec& spec, const QuantParams& p, int64_t rows) {
  return spec.axis == BlockAxis::Row && spec.hadamard == 0 && p.in.vec4 && p.padded_cols > 0 && rows > 0;
}

FastRowParams fast_row_params(const QuantParams& p, int64_t rows) {
  FastRowParams f{};
  f.x = p.in.x;
  f.rows = rows;
  f.cols = p.in.scols;
  f.padded_cols = p.padded_cols;
  f.nb = p.nb;
  f.codes = p.codes;
  f.scales = p.scales;
  f.outer = p.outer;
  f.mx_rule = p.mx_rule;
  f.seed = p.seed;
  f.stream = p.stream;
  f.report = p.report;
  return f;
}

// Streaming multiprocessors of the current device (cached per device).
int sm_count() {
  static std::atomic<int> cached[64];
  int dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  std::atomic<int>& c = cached[dev & 63];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    FOURBIT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    c.store(n, std::memory_order_relaxed);
  }
  return n;
}

// The persistent NVFP4 kernel: as many CTAs as fit on the device at once (no more than there are
// row groups), each with its double-buffered stage in dynamic shared memory.
template <auto kernel>
void launch_persistent(const FastRowParams& f, int64_t groups, int threads, size_t smem) {
  allow_smem<kernel>(smem);
  static std::atomic<int> cached_per_sm[kNvfp4FastMaxWarps + 1];  // by warps (smem follows)
  std::atomic<int>& c = cached_per_sm[threads / 32];
  int per_sm = c.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    FOURBIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    per_sm = std::max(per_sm, 1);
    c.store(per_sm, std::memory_order_relaxed);
  }
  const int64_t ctas = std::min<int64_t>(groups, int64_t(per_sm) * sm_count());
  kernel<<<grid_of(ctas, "quantize"), threads, smem, stream()>>>(f);
  FOURBIT_LAUNCH_CHECK();
}

template <int kRuns>
void launch_nvfp4_row_fast(const FastRowParams& f, int64_t groups, int threads, bool fos,
                           num::ScaleMetric metric) {
  using num::ScaleMetric;
  const size_t smem =  // two halves of kRuns runs per warp
      2 * sizeof(float) * size_t(threads / 32) * kRuns * kFastRunBlocks * num::kNvfp4Block;
  if (!fos)
    launch_persistent<nvfp4_row_fast_kernel<kRuns, false, ScaleMetric::MSE>>(f, groups, threads, smem);
  else if (metric == ScaleMetric::MSE)
    launch_persistent<nvfp4_row_fast_kernel<kRuns, true, ScaleMetric::MSE>>(f, groups, threads, smem);
  else
    launch_persistent<nvfp4_row_fast_kernel<kRuns, true, ScaleMetric::MAE>>(f, groups, threads, smem);
}

// A row of nb blocks takes ceil(nb / 32) warp runs (at most 32 for kFusedMaxCols): two runs per
// warp above 16 runs (8192 columns), and under Four Over Six for every even count (8192 columns:
// 8 warps of 2 runs), else one; as many warps as that needs (a team of up to 16: one CTA); rows
// of up to 4 warps share a CTA (of at most 256 threads). Two runs spread the row's fixed work
// (prefetch, staging, team max, S_enc, S_dec, the encode-scale table) over twice the elements:
// Four Over Six, 8192 columns, 32.2 SASS instructions per element against 36.6 with one run (see
// nvfp4_row_fast_kernel), for 16 resident warps per SM instead of 32 (128 registers; the same
// 64 KiB of copies in flight per SM). The RNE path, memory-bound already, keeps one run.
void launch_nvfp4_row_fast(FastRowParams f, bool fos, num::ScaleMetric metric) {
  const int64_t runs_needed = (f.nb + kFastRunBlocks - 1) / kFastRunBlocks;
  const int runs = runs_needed > kNvfp4FastMaxWarps || (fos && runs_needed % 2 == 0) ? 2 : 1;
  f.team_warps = int((runs_needed + runs - 1) / runs);
  if (f.team_warps > kNvfp4FastMaxWarps)
    fail("cuda quantize: {} blocks per row is too wide for the per-token kernel", f.nb);
  const int rows_per_cta = std::max(1, kWarps / f.team_warps);
  const int64_t groups = (f.rows + rows_per_cta - 1) / rows_per_cta;
  const int threads = 32 * f.team_warps * rows_per_cta;
  if (runs == 1) launch_nvfp4_row_fast<1>(f, groups, threads, fos, metric);
  else launch_nvfp4_row_fast<2>(f, groups, threads, fos, metric);
}

// launch(exp_bits, sr) with the element's exponent bits (4: E4M3, 5: E5M2) and the rounding as
// compile-time constants, for the fast MXFP8 kernels' template arguments.
template <typename Launch>
void with_mxfp8_variant(bool e5m2, bool sr, Launch&& launch) {
  using E4 = std::integral_constant<int, 4>;
  using E5 = std::integral_constant<int, 5>;
  if (e5m2) sr ? launch(E5{}, std::true_type{}) : launch(E5{}, std::false_type{});
  else sr ? launch(E4{}, std::true_type{}) : launch(E4{}, std::false_type{});
  FOURBIT_LAUNCH_CHECK();
}

void launch_mxfp8_row_fast(FastRowParams f, bool e5m2, bool sr) {
  f.runs_per_row = (f.nb + kFastRunBlocks - 1) / kFastRunBlocks;
  const unsigned ctas = grid_of((f.rows * f.runs_per_row + kWarps - 1) / kWarps, "quantize");
  with_mxfp8_variant(e5m2, sr, [&](auto exp_bits, auto sr_c) {
    mxfp8_row_fast_kernel<decltype(exp_bits)::value, decltype(sr_c)::value><<<ctas, kThreads, 0, stream()>>>(f);
  });
}

// The Col-axis MXFP8 kernel over row segments of x [*, cols] (segs[i].x_row0 = the segment's first
// row), kColSegsPerLaunch segments a launch; segs[i].q is segment i's (allocated) QTensor.
struct ColSegmentOut {
  int64_t x_row0, rows;  // the segment's rows of x
  const QTensor* q;      // its storage (one QTensor, or one slice's view)
  int64_t counter_row0;  // ColSegment::row0
  RngKey rng;
};
void launch_mxfp8_col_fast(const float* x, int64_t cols, const std::vector<ColSegmentOut>& segs, bool e5m2,
                           bool sr, num::MxScaleRule rule, bool report) {
  for (size_t first = 0; first < segs.size(); first += kColSegsPerLaunch) {
    ColSegments p{};
    p.cols = cols;
    p.col_chunks = (cols + kThreads - 1) / kThreads;
    p.mx_rule = rule;
    p.report = report;
    int64_t ctas = 0;
    for (size_t i = first; i < segs.size() && p.n < kColSegsPerLaunch; ++i) {
      const ColSegmentOut& o = segs[i];
      ColSegment& sg = p.seg[p.n++];
      sg.x = x + o.x_row0 * cols;
      sg.row0 = o.counter_row0;
      sg.codes = o.q->codes.data<uint8_t>();
      sg.scales = o.q->block_scales.data<uint8_t>();
      sg.rows = o.rows;
      sg.seed = o.rng.seed;
      sg.stream = o.rng.stream;
      sg.cta0 = ctas;
      ctas += ((o.rows + num::kMxBlock - 1) / num::kMxBlock) * p.col_chunks;
    }
    if (ctas == 0) continue;
    const unsigned grid = grid_of(ctas, "quantize");
    with_mxfp8_variant(e5m2, sr, [&](auto exp_bits, auto sr_c) {
      mxfp8_col_fast_kernel<decltype(exp_bits)::value, decltype(sr_c)::value><<<grid, kThreads, 0, stream()>>>(p);
    });
  }
}

// Specs the Col-axis MXFP8 kernel takes.
bool mxfp8_col_fast(const QuantSpec& spec) {
  return (spec.fmt == Format::MXFP8_E4M3 || spec.fmt == Format::MXFP8_E5M2) && spec.axis == BlockAxis::Col &&
         spec.hadamard == 0;
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
      // Per-token RNE (activations): the register-resident one-pass kernel.
      if (fast_row_input(spec, p, srows_total) && q.outer == OuterScale::PerRow && !spec.tile_2d &&
          spec.rounding == num::Rounding::RNE && p.padded_cols <= kFusedMaxCols) {
        launch_nvfp4_row_fast(fast_row_params(p, srows_total), spec.four_over_six, spec.metric);
        break;
      }
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
        outer_scale_kernel<<<grid_for(groups, kThreads), kThreads, 0, stream()>>>(gamax.data<uint32_t>(), groups,
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
      if (mxfp8_col_fast(spec)) {  // one segment per slice; SR counters run on over the slices
        std::vector<QTensor> views;
        std::vector<ColSegmentOut> segs;
        for (int64_t sl = 0; sl < q.slices; ++sl) views.push_back(qtensor_slice(q, sl));
        for (int64_t sl = 0; sl < q.slices; ++sl)
          segs.push_back({sl * q.cols, q.cols, &views[size_t(sl)], sl * q.rows, rng});
        launch_mxfp8_col_fast(p.in.x, q.rows, segs, spec.fmt == Format::MXFP8_E5M2,
                              spec.rounding == num::Rounding::SR, spec.mx_rule, p.report);
        break;
      }
      if (fast_row_input(spec, p, srows_total)) {
        launch_mxfp8_row_fast(fast_row_params(p, srows_total), spec.fmt == Format::MXFP8_E5M2,
                              spec.rounding == num::Rounding::SR);
        break;
      }
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

bool quantize_segments(const Tensor& x, const std::vector<int64_t>& offsets, const QuantSpec& spec,
                       const std::vector<RngKey>& rngs, std::vector<QTensor>& out) {
  if (!mxfp8_col_fast(spec)) return false;
  check_cuda_tensor(x, "quantize_segments", "x");
  if (x.dtype() != DType::F32) fail("cuda quantize_segments: x must be f32, got {}", x.str());
  const size_t G = rngs.size();
  out.assign(G, QTensor{});
  std::vector<ColSegmentOut> segs;
  for (size_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    if (r0 == r1) continue;
    out[g] = alloc_qtensor(spec, quant_shape(x.slice_rows(r0, r1), spec), Device::CUDA);
    segs.push_back({r0, r1 - r0, &out[g], 0, rngs[g]});
  }
  launch_mxfp8_col_fast(x.data<float>(), x.size(1), segs, spec.fmt == Format::MXFP8_E5M2,
                        spec.rounding == num::Rounding::SR, spec.mx_rule, false);
  return true;
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
  dequant_tile_kernel<K, kCol><<<grid_of(ctas, "dequantize"), kThreads, smem, stream()>>>(p);
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

namespace {
// requantize_transposed_kernel's arguments for q (no RHT) into a freshly allocated *out; returns
// the number of CTAs.
int64_t requant_params(const QTensor& q, RngKey rng, QTensor* out, RequantParams& p) {
  p = RequantParams{};
  p.dec = decode_args(q, "requantize_transposed");
  // Either axis: the output's storage is the per-slice transpose of the input's storage.
  const QuantShape logical = q.axis == BlockAxis::Row ? QuantShape{q.slices, q.rows, q.cols}
                                                      : QuantShape{q.slices, q.cols, q.rows};
  *out = alloc_qtensor(requantize_transposed_spec(q), logical, Device::CUDA);
  // Two blocks of a tile row are 16 bytes at a multiple of 16 past the row start.
  p.vec16 = aligned(p.dec.codes, 16) && p.dec.code_row_bytes % 16 == 0;
  p.in_cols = q.cols;
  const int64_t row_tiles = (q.rows + kReqRows - 1) / kReqRows, col_tiles = (q.cols + kReqCols - 1) / kReqCols;
  p.row_tiles = uint32_t(row_tiles);  // exact whenever the CTA count passes grid_of (< 2^31)
  p.col_tiles = uint32_t(col_tiles);
  p.codes = out->codes.data<uint8_t>();
  p.scales = out->block_scales.data<uint8_t>();
  p.out_padded_cols = out->padded_cols();
  p.out_nb = out->blocks_per_row();
  p.seed = rng.seed;
  p.stream = rng.stream;
  return q.slices * row_tiles * col_tiles;
}
}  // namespace

QTensor requantize_transposed(const QTensor& q, RngKey rng) {
  // Behind an RHT the exact values need the inverse rotation of whole chunks first: the plain
  // composition (cpu::requantize_transposed's definition) on the GPU.
  if (q.hadamard != 0) return cuda::quantize(cuda::dequantize(q, true), requantize_transposed_spec(q), rng, nullptr);
  RequantParams p;
  QTensor out;
  const int64_t ctas = requant_params(q, rng, &out, p);
  if (ctas > 0) {
    requantize_transposed_kernel<<<grid_of(ctas, "requantize_transposed"), kThreads, 0, stream()>>>(
        p, num::philox_keys(rng.seed));
    FOURBIT_LAUNCH_CHECK();
  }
  return out;
}

bool requantize_transposed_segments(const QTensor& q, const std::vector<int64_t>& offsets,
                                    const std::vector<RngKey>& rngs, std::vector<QTensor>& out) {
  if (q.hadamard != 0) return false;
  out.assign(rngs.size(), QTensor{});
  RequantSegments p{};
  int64_t ctas = 0;
  auto flush = [&] {
    if (ctas > 0) {
      requantize_segments_kernel<<<grid_of(ctas, "requantize_transposed"), kThreads, 0, stream()>>>(p);
      FOURBIT_LAUNCH_CHECK();
    }
    p.n = 0;
    ctas = 0;
  };
  for (size_t g = 0; g < rngs.size(); ++g) {
    if (offsets[g] == offsets[g + 1]) continue;
    p.cta0[p.n] = ctas;
    ctas += requant_params(qtensor_rows(q, offsets[g], offsets[g + 1]), rngs[g], &out[g], p.seg[p.n]);
    if (++p.n == kReqSegsPerLaunch) flush();
  }
  flush();
  return true;
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
