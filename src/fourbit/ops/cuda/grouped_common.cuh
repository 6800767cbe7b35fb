// defines: the grouped GEMM family's shared pieces (grouped_mma.cu): Storage, OperandArgs, GroupedArgs,
//          KProblemArgs, KDeviceProblem, KGroupedArgs, k_problem, the tile loaders, clamp_rows, clamp_group_rows,
//          row_tile_of, the epilogue (finish_value, store_pair)
// Included by the family's kernel headers and grouped_mma.cu only (one translation unit: the
// anonymous namespace keeps every kernel and helper internal to it).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "fourbit/ops/cuda/block_decode.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/mma.cuh"
#include "fourbit/numerics/hd.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kBN = 128, kBK = 32, kStages = 4, kThreads = 256;

// Byte offset of 16-byte chunk `chunk` (0..3) of row `row` in a BF16 tile of 32 columns (64 bytes
// a row). The XOR spreads the 8 rows an ldmatrix phase reads over 8 distinct 16-byte bank groups.
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return uint32_t(row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4));
}

// Byte offset of 16-byte chunk c (0..7) of row r in a BF16 tile of 64 columns (128-byte rows) in
// the 128-byte swizzle wgmma's descriptors read.
__device__ __forceinline__ uint32_t sw128(int r, int c) { return uint32_t(r * 128 + ((c ^ (r & 7)) << 4)); }

// How an operand sits in memory and in a pipeline stage for K tiles of TK values (32: the mma.sync
// loop, 64: the wgmma one): BF16 tiles are copied as they are, swizzled (swizzle or sw128);
// block-scaled ones are copied packed — a row's TK codes of the K tile and the aligned 4-byte word
// of block scales holding the tile's — and dequantized into a swizzled BF16 tile before the MMAs.
template <Format F, int TK>
struct Storage {
  static_assert(TK == 32 || TK == 64, "K tile");
  static constexpr bool kPacked = F != Format::BF16;
  static constexpr int kBits = F == Format::BF16 ? 16 : F == Format::NVFP4 ? 4 : 8;
  static constexpr int kRowBytes = TK * kBits / 8;  // one row of a K tile as stored
  static constexpr int kChunks = kRowBytes / 16;
  // Chunk c of row r of the BF16 tile.
  static __device__ __forceinline__ uint32_t bf16_offset(int r, int c) { return TK == 32 ? swizzle(r, c) : sw128(r, c); }
};

// Values per block scale of a block-scaled format.
template <Format F>
constexpr int block_values() {
  return F == Format::NVFP4 ? num::kNvfp4Block : num::kMxBlock;
}

constexpr int kMaxHostGroups = 128;

// One operand of the grouped GEMM: rows ld bytes apart (B: group g at slice_bytes * g), block
// scales (block-scaled formats) scale_ld bytes a row, outer scales (NVFP4) applied in the
// epilogue as NUMERICS "GEMMs" orders them.
struct OperandArgs {
  const unsigned char* data;
  const uint8_t* scales;
  const float* outer;      // null: none
  int64_t ld, slice_bytes;  // bytes
  int64_t scale_ld, scale_slice;
  int outer_stride;             // 1: per row; 0: one value (per slice for B)
  int64_t outer_group_stride;  // B: scales per slice (rows, 1 or 0)
  bool trans;                  // B only, BF16: group g stored [K, N], K rows ld bytes apart
};

struct GroupedArgs {
  OperandArgs a, b;
  const int32_t* offsets;  // [G + 1] on the device, or null: host_offsets below
  float* c;                // [M, ldc]
  int64_t ldc, m;
  int n, k_begin, k_end, groups;  // K range in values
  bool accumulate;
  IndexError* err;
  int32_t host_offsets[kMaxHostGroups + 1];  // offsets known on the host, passed by value
};

// One problem of the K-grouped form (below): C (+)= A . B^T with K = k values.
struct KProblemArgs {
  const unsigned char* a;
  const unsigned char* b;
  float* c;
  int64_t lda, ldb;  // bytes between rows (K rows where MN-major)
  int k;
};
constexpr int kMaxKProblems = 64;  // a launch's; more run in several (kernel parameters < 4 KB)
// A problem whose K range the GPU found in device offsets (grouped_gemm_k_device_offsets): its
// operands' TMA maps (MN-major, K rows 0 .. k of the problem) and its arguments, written by
// k_device_problems_kernel before the launch that reads them.
struct alignas(128) KDeviceProblem {  // tensormap.replace takes 128-byte aligned maps
  CUtensorMap a_map, b_map;
  KProblemArgs prob;
};
struct KGroupedArgs {
  int m, n, count;
  int64_t ldc;  // floats
  bool accumulate;
  KProblemArgs prob[kMaxKProblems];
  const KDeviceProblem* dev;  // non-null: the problems are dev[0 .. count), prob unused
};
// Problem j of a K-grouped launch, from its arguments or, with device offsets, from device memory.
__device__ __forceinline__ KProblemArgs k_problem(const KGroupedArgs& p, int j) {
  return p.dev ? p.dev[j].prob : p.prob[j];
}

// The CTA tile is BM x 128 with 8 warps: 2 x 4 warps of 64 (BM = 128) or 32 (BM = 64) x 32, or
// 1 x 8 warps of 16 x 16 (BM = 16, the decode configuration). Whatever BM, an output element is
// the same chain of m16n8k16 MMAs over K in order, so its bits do not depend on the tile.
template <Format F, int BM>
struct Shape {
  using S = Storage<F, kBK>;
  static constexpr int kWarpsM = BM >= 64 ? 2 : 1, kWarpsN = 8 / kWarpsM;
  static constexpr int kWM = BM / kWarpsM, kWN = kBN / kWarpsN, kMI = kWM / 16, kNI = kWN / 8;
  static constexpr int kATile = BM * S::kRowBytes, kBTile = kBN * S::kRowBytes;
  static constexpr int kAScales = S::kPacked ? BM * 4 : 0, kBScales = S::kPacked ? kBN * 4 : 0;
  static constexpr int kStageBytes = kATile + kBTile + kAScales + kBScales;
  static constexpr int kDecoded = S::kPacked ? 2 * (BM + kBN) * 64 : 0;  // two BF16 A and B tiles
  static constexpr int kSmemBytes = kStages * kStageBytes + kDecoded;
  static_assert(kMI >= 1 && kNI % 2 == 0, "warp tile");
};

// Starts copying rows row0.. (R of them, those < rows_end valid) of the TK-wide K tile at k0 of
// operand o into the stage at `dst` (codes, then for block-scaled formats one scale word a row),
// NT threads sharing the copies; rows past the end and K past k_end are zero-filled (a zero
// adds nothing to a sum, so the padding cannot change any element's bits; zero codes with a zero
// scale decode to zeros). Only the first `rows` rows are copied (the caller keeps the others
// zero, or never reads them).
template <Format F, int TK, int R, int NT>
__device__ __forceinline__ void load_tile(const OperandArgs& o, const unsigned char* base, const uint8_t* scales,
                                          long long row0, long long rows_end, int k0, int k_end, uint32_t dst,
                                          int rows = R) {
  using S = Storage<F, TK>;
  constexpr int kChunkValues = 128 / S::kBits;
#pragma unroll 4
  for (int idx = int(threadIdx.x); idx < rows * S::kChunks; idx += NT) {
    const int row = idx / S::kChunks, chunk = idx % S::kChunks, k = k0 + chunk * kChunkValues;
    const bool ok = k < k_end && row0 + row < rows_end;
    const uint32_t d = S::kPacked ? dst + uint32_t(row * S::kRowBytes + chunk * 16) : dst + S::bf16_offset(row, chunk);
    cp_async16(d, ok ? base + (row0 + row) * o.ld + (long long)k * S::kBits / 8 : base, ok ? 16 : 0);
  }
  if constexpr (S::kPacked) {
    const uint32_t sdst = dst + uint32_t(R * S::kRowBytes);
    const int word = (k0 / block_values<F>()) & ~3;
    for (int row = int(threadIdx.x); row < rows; row += NT) {
      const bool ok = k0 < k_end && row0 + row < rows_end;
      cp_async4(sdst + uint32_t(4 * row), ok ? scales + (row0 + row) * o.scale_ld + word : scales, ok ? 4 : 0);
    }
  }
}

// The packed TK-wide K tile at k0 of R rows at `src` into the swizzled BF16 tile at `dst`: a thread
// decodes 16 values of a row at a time (one NVFP4 block, half an MXFP8 one) with decode8_bits.
// Only the first `rows` rows are written (the caller keeps the others zero).
template <Format F, int TK, int R, int NT>
__device__ __forceinline__ void dequantize_tile(const unsigned char* src, int k0, unsigned char* dst,
                                                const float2* e2m1_pair, int rows = R) {
  using S = Storage<F, TK>;
  constexpr int kUnitShift = TK == 32 ? 1 : 2;               // 16-value units a row: 2 or 4
  constexpr int kUnitBytes = S::kRowBytes >> kUnitShift;      // 8 NVFP4 code bytes, 16 MXFP8
  const int first_block = (k0 / block_values<F>()) & 3;  // the tile's first scale in its row's word
#pragma unroll 2
  for (int u = int(threadIdx.x); u < (rows << kUnitShift); u += NT) {
    const int row = u >> kUnitShift, q = u & ((1 << kUnitShift) - 1);  // values 16 q .. 16 q + 15
    const unsigned char* codes = src + row * S::kRowBytes + q * kUnitBytes;
    const uint8_t scale = src[R * S::kRowBytes + 4 * row + first_block + (F == Format::NVFP4 ? q : q >> 1)];
    const float sv = decode8_scale<F>(scale);
    uint4 lo, hi;
    if constexpr (F == Format::NVFP4) {
      const uint2 w = *reinterpret_cast<const uint2*>(codes);
      lo = decode8_bits<F>(make_uint2(w.x, 0u), sv, e2m1_pair);
      hi = decode8_bits<F>(make_uint2(w.y, 0u), sv, e2m1_pair);
    } else {
      const uint4 w = *reinterpret_cast<const uint4*>(codes);
      lo = decode8_bits<F>(make_uint2(w.x, w.y), sv, e2m1_pair);
      hi = decode8_bits<F>(make_uint2(w.z, w.w), sv, e2m1_pair);
    }
    *reinterpret_cast<uint4*>(dst + S::bf16_offset(row, 2 * q)) = lo;
    *reinterpret_cast<uint4*>(dst + S::bf16_offset(row, 2 * q + 1)) = hi;
  }
}

// The grid's row tiles of bm rows: enough for every group's, whatever the offsets. Groups without
// rows need none, and the others at most one more than their rows / bm, so ceil(M / bm) + min(G, M)
// (at decode, a few rows among many experts: 3 at batch 1 of top-2 where M / bm + G gave 17, so
// far fewer CTAs that only find no tile and exit). Offsets that break the bound (decreasing ones,
// groups past M) are recorded as index errors by row_tile_of.
inline int64_t row_tile_bound(const GroupedArgs& p, int64_t bm) {
  return std::max<int64_t>(1, (p.m + bm - 1) / bm + std::min<int64_t>(p.groups, p.m));
}

// A row tile: its group (-1 for the tiles past the last) and rows [r0, r1).
struct RowTile {
  int group;
  long long r0, r1;
};

// A group's row range [lo, hi) clamped to 0 <= lo <= hi <= m rows.
__device__ __forceinline__ void clamp_rows(long long& lo, long long& hi, long long m) {
  lo = lo < 0 ? 0 : (lo > m ? m : lo);
  hi = hi < lo ? lo : (hi > m ? m : hi);
}

// Group g's row range [lo, hi) from its offsets, checked against m rows: an offset outside [0, m]
// or below the one before it is recorded as grouped_gemm's index error (lo, offsets[0], only for
// g 0: for the others it is the group before's hi), then clamped (clamp_rows).
__device__ __forceinline__ void clamp_group_rows(long long& lo, long long& hi, int g, long long m, IndexError* err) {
  if (g == 0 && (lo < 0 || lo > m)) record_index_error(err, IndexSite::GroupedGemmOffsets, 0, lo, m + 1, 1);
  if (hi < 0 || hi > m) record_index_error(err, IndexSite::GroupedGemmOffsets, g + 1, hi, m + 1, 1);
  else if (hi < lo) record_index_error(err, IndexSite::GroupedGemmOffsetsDecreasing, g + 1, hi, lo, 1);
  clamp_rows(lo, hi, m);
}

// Row tile `tile` (tiles of bm rows, each group's in turn); bad offsets are clamped and recorded.
// Warp-collective, the same answer in every lane: the lanes read 32 groups' offsets at once and a
// prefix sum of their tile counts finds the group, where one thread walking the offsets would
// wait on one dependent load after another (up to G of them).
__device__ __forceinline__ RowTile row_tile_of(const GroupedArgs& p, int bm, int tile) {
  const int lane = int(threadIdx.x) & 31;
  for (int base = 0; base < p.groups; base += 32) {
    const int g = base + lane;
    long long lo = 0, hi = 0;
    int tiles = 0;
    if (g < p.groups) {
      lo = p.offsets ? p.offsets[g] : p.host_offsets[g];
      hi = p.offsets ? p.offsets[g + 1] : p.host_offsets[g + 1];
      clamp_group_rows(lo, hi, g, p.m, p.err);
      tiles = int((hi - lo + bm - 1) / bm);
    }
    int upto = tiles;  // tiles of groups base .. g
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, upto, d);
      if (lane >= d) upto += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, g < p.groups && tile < upto);
    if (hit) {  // the first group whose tiles reach past `tile` holds it
      const int src = __ffs(hit) - 1;
      const long long r0 = lo + (long long)(tile - (upto - tiles)) * bm;
      RowTile t;
      t.group = base + src;
      t.r0 = __shfl_sync(0xffffffffu, r0, src);
      t.r1 = __shfl_sync(0xffffffffu, hi < r0 + bm ? hi : r0 + bm, src);
      return t;
    }
    tile -= __shfl_sync(0xffffffffu, upto, 31);
  }
  return RowTile{-1, 0, 0};
}

// The row tile of blockIdx.y into shared memory, for the kernels whose CTA computes one tile: warp
// 0's work, before a barrier.
__device__ __forceinline__ void find_row_tile(const GroupedArgs& p, int bm, int& s_group, long long& s_r0,
                                              long long& s_r1) {
  const RowTile t = row_tile_of(p, bm, int(blockIdx.y));
  if ((threadIdx.x & 31) == 0) {
    s_group = t.group;
    s_r0 = t.r0;
    s_r1 = t.r1;
  }
}

// The epilogue of one output element in NUMERICS' order: the FP32 sum times A's outer scale sa
// (where A has outer scales), times B's sb (where B has: scaled_b), then added to C when
// accumulating. Epilogues with registers to spare load the scales ahead (a_scale, b_scales), with
// C's values, so that no load waits behind the stores before it; finish_value loads them itself.
__device__ __forceinline__ float finish_scaled(const GroupedArgs& p, bool scaled_b, float v, float sa, float sb,
                                               float c) {
  if (p.a.outer) v = num::mul_rn(v, sa);
  if (scaled_b) v = num::mul_rn(v, sb);
  return p.accumulate ? num::add_rn(c, v) : v;
}
__device__ __forceinline__ float finish_value(const GroupedArgs& p, const float* sbo, float v, long long row, int col,
                                              float c) {
  if (p.a.outer) v = num::mul_rn(v, p.a.outer[row * p.a.outer_stride]);
  if (sbo) v = num::mul_rn(v, sbo[(long long)col * p.b.outer_stride]);
  return p.accumulate ? num::add_rn(c, v) : v;
}

// A's outer scale for a row of C (0 where A has none: unread).
__device__ __forceinline__ float a_scale(const GroupedArgs& p, long long row) {
  return p.a.outer ? p.a.outer[row * p.a.outer_stride] : 0.0f;
}

// B's outer scales for columns col, col + 1 (sbo: the group's; 0 where there are none or past N).
__device__ __forceinline__ float2 b_scales(const GroupedArgs& p, const float* sbo, int col) {
  if (!sbo) return make_float2(0.0f, 0.0f);
  return make_float2(col < p.n ? sbo[(long long)col * p.b.outer_stride] : 0.0f,
                     col + 1 < p.n ? sbo[(long long)(col + 1) * p.b.outer_stride] : 0.0f);
}

// Whether columns col, col + 1 of a C row take one 8-byte access.
__device__ __forceinline__ bool pair_fits(const GroupedArgs& p, const float* crow, int col) {
  return col + 1 < p.n && (reinterpret_cast<uintptr_t>(crow + col) & 7) == 0;
}

// C's two values at columns col, col + 1 of a row where they take one 8-byte access and the
// epilogue adds to C (else zeros, unread): the epilogues load these for several pairs before
// storing any, so that the loads are in flight together instead of one latency a pair.
__device__ __forceinline__ float2 c_pair(const GroupedArgs& p, long long row, int col) {
  const float* crow = p.c + row * p.ldc;
  return p.accumulate && pair_fits(p, crow, col) ? *reinterpret_cast<const float2*>(crow + col) : make_float2(0.0f, 0.0f);
}

// Two values of a row at columns col, col + 1 (those < N), 8-byte stores where aligned; old: C's
// values there (c_pair); sbo: B's outer scales (the group's); sa, sb: the outer scales loaded
// ahead (a_scale, b_scales) where SCALES_AHEAD, else loaded here.
template <bool SCALES_AHEAD>
__device__ __forceinline__ void store_pair(const GroupedArgs& p, const float* sbo, long long row, int col, float v0,
                                           float v1, float2 old, float sa, float2 sb) {
  float* crow = p.c + row * p.ldc;
  const auto finish = [&](float v, int at, float b, float c) {
    if constexpr (SCALES_AHEAD) return finish_scaled(p, sbo != nullptr, v, sa, b, c);
    else return finish_value(p, sbo, v, row, at, c);
  };
  if (pair_fits(p, crow, col)) {
    float2 o = old;
    o.x = finish(v0, col, sb.x, o.x);
    o.y = finish(v1, col + 1, sb.y, o.y);
    *reinterpret_cast<float2*>(crow + col) = o;
  } else {
    if (col < p.n) crow[col] = finish(v0, col, sb.x, p.accumulate ? crow[col] : 0.0f);
    if (col + 1 < p.n) crow[col + 1] = finish(v1, col + 1, sb.y, p.accumulate ? crow[col + 1] : 0.0f);
  }
}

}  // namespace
}  // namespace fourbit::ops::cuda
