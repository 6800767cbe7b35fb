// defines: kThreads, kStageBytes, kFusedMaxCols, DeviceCounters, g_counters, g_nonfinite_flag,
//          flush_counts, Kind, kBlockOf, kCodeBits, group_in_slice, group_of, tile_pos,
//          atomic_max_amax, rotate_block, TileGeom, make_geom, TileCoords, tile_coords, LoadArgs,
//          GridWalk, batched_walk, load_tile, writes_codes, writes_bf16, store_nvfp4_block_bf16, DecodeArgs, decode_block, decode_args, aligned,
//          grid_of, allow_smem, counters_ptr, reset_counters, add_counters, row_geom, col_geom,
//          fused_geom, sm_count
// What the quantize kernels share: the device counters and the sticky non-finite flag, the block
// kinds, storage tiles staged in shared memory (geometry, coordinates, coalesced loads), the
// exact block decoder (the registry's block decoders, numerics/formats.h), and the host helpers
// (alignment, launch limits, shared-memory opt-in, the device's SM count, tile shapes).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fourbit/numerics/fast_quant.h"
#include "fourbit/numerics/formats.h"
#include "fourbit/numerics/hadamard.h"
#include "fourbit/ops/cuda/block_decode.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/quant_layout.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kStageBytes = 36;          // per-thread staging of one 32-code block (9 words: odd)
constexpr int64_t kFusedMaxCols = 16384;  // per-token rows up to this many padded cols: one pass
static_assert(kThreads % 32 == 0, "whole warps: the counters reduce per warp");
static_assert(kStageBytes >= 32 && kStageBytes % 4 == 0 && (kStageBytes / 4) % 2 == 1,
              "a 32-byte block staged in an odd number of words (bank-conflict-free)");

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

enum class Kind : int { Nvfp4, Mx, S2f6, Mxfp4 };
template <Kind K>
constexpr int kBlockOf = K == Kind::Nvfp4 ? num::kNvfp4Block : K == Kind::Mxfp4 ? num::kMxfp4Block : num::kMxBlock;
template <Kind K>
constexpr int kCodeBits = K == Kind::Nvfp4 || K == Kind::Mxfp4 ? 4 : 8;  // bits per stored code
static_assert(num::kMxfp4Block == num::kMxBlock && num::kS2f6Block == num::kMxBlock, "32-value blocks");

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

// What a form (ops::FormOut) holds: its codes, its BF16 decode, or both (host code).
inline bool writes_codes(FormOut f) { return f != FormOut::Bf16; }
inline bool writes_bf16(FormOut f) { return f != FormOut::Codes; }

// ---- decoding ----------------------------------------------------------------------------------

// The 16 values of an NVFP4 block (its packed codes, low nibble first, and its UE4M3 scale) as
// 16 BF16 at dst (32-byte aligned): code x block scale, the bits of the decode pass
// (decode8_bits; e2m1x2_times forms the same exact products), the outer scale left to the GEMM's
// epilogue as there. A quantizer writing its form's BF16 decode (ops::FormOut) calls it where it
// writes the codes.
__device__ __forceinline__ void store_nvfp4_block_bf16(__nv_bfloat16* dst, uint64_t packed, uint8_t scale) {
  const uint32_t sc = ue4m3_bf16x2(scale), lo = uint32_t(packed), hi = uint32_t(packed >> 32);
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(e2m1x2_times(lo, 0, sc), e2m1x2_times(lo, 1, sc), e2m1x2_times(lo, 2, sc), e2m1x2_times(lo, 3, sc));
  d[1] = make_uint4(e2m1x2_times(hi, 0, sc), e2m1x2_times(hi, 1, sc), e2m1x2_times(hi, 2, sc), e2m1x2_times(hi, 3, sc));
}

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
    uint8_t bytes[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) bytes[k] = uint8_t(packed >> (8 * k));
    num::nvfp4_decode_block(bytes, sb, s_dec, v);
  } else if constexpr (K == Kind::Mxfp4) {
    const uint8_t* src = d.codes + row * d.code_row_bytes + blk * (B / 2);
    uint8_t bytes[B / 2];
    if (d.vec) {
      const uint4 c = *reinterpret_cast<const uint4*>(src);
      const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
      for (int k = 0; k < B / 2; ++k) bytes[k] = uint8_t(w[k / 4] >> (8 * (k % 4)));
    } else {
#pragma unroll
      for (int k = 0; k < B / 2; ++k) bytes[k] = src[k];
    }
    num::mxfp4_decode_block(bytes, sb, 1.0f, v);
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

// ---- host side -----------------------------------------------------------------------------------

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

unsigned grid_of(int64_t ctas, const char* what) {
  if (ctas > INT_MAX) fail("cuda {}: {} thread blocks is more than one launch takes", what, ctas);
  return unsigned(ctas);
}

// The device's opt-in limit of dynamic shared memory per block.
size_t max_smem_optin() { return size_t(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>()); }

// Opts a kernel into more than 48 KB of dynamic shared memory (once per size it grows to).
template <auto kernel>
void allow_smem(size_t bytes) {
  static size_t allowed = 48 * 1024;  // what every kernel may use without opting in (CUDA)
  if (bytes > max_smem_optin())
    fail("cuda quantize: a kernel needs {} bytes of shared memory, the device allows {}", bytes, max_smem_optin());
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

// Streaming multiprocessors of the current device (queried, cached per device).
int sm_count() { return device_sm_count(); }

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
  d.vec = aligned(d.codes, q.fmt == Format::NVFP4 ? 8 : 16);  // MXFP4: 16 bytes a block
  return d;
}

}  // namespace
}  // namespace fourbit::ops::cuda
