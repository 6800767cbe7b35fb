// defines: cuda::grouped_gemm_rows, cuda::grouped_gemm_bf16, cuda::grouped_gemm_k
// The grouped GEMM of the MoE experts (issue 15's kernel family): C[rows of group g] (+)=
// A[rows of group g] . B[g]^T for every g in one launch, on BF16 operands or on block-scaled ones
// (NVFP4, MXFP8 E4M3/E5M2) read packed as they are stored and dequantized inside the kernel, with
// NVFP4's outer scales applied in its epilogue. Offsets are read on the GPU (grouped_gemm_bf16)
// or passed by value (grouped_gemm_rows): no router count has to come back to the host.
//
// Shape of the work. The grid has one CTA per (BM-row tile of a group, BN-column tile of N); the
// host cannot know the groups' sizes, so it launches ceil(M / BM) + G row tiles (the most a
// grouping of M rows into G groups can need) and each CTA finds its group from the offsets
// (row_tile_of, a warp's prefix sum); the CTAs left over return at once. The TMA form is
// persistent over the same tiles instead (below). Two main loops, each with a tile for training shapes and one
// for groups of few rows (the sampler's decode):
//  - on Hopper (namespace hopper, below): wgmma.m64n128k16 from 128-byte-swizzled shared memory,
//    256 x 128 tiles for training, 64 x 128 or 64 x 32 (m64n32k16) for decode, 64-wide K tiles;
//    for groups of a few rows the streaming kernel (hopper::streaming), whose warps decode their
//    weight rows in registers as mma.sync's A operand, the same 64-wide K tiles and k16 steps;
//  - elsewhere (and set_grouped_wgmma(false)): 8 warps of mma.sync m16n8k16 reading XOR-swizzled
//    shared memory with ldmatrix, 128 (64, 16) x 128 tiles, 32-wide K tiles.
// Both feed BF16 tiles by a 4-stage cp.async pipeline; packed tiles (codes as stored and the word
// of block scales holding the tile's) are copied as they are, then decoded one tile ahead into the
// swizzled BF16 layout with block_decode.cuh, the decode of gemm.cu's decode pass: the values and
// so the sums are those of decoding to BF16 first, without the BF16 copies in global memory and
// the separate epilogue pass.
//
// Batch invariance by construction: within a main loop an output element is the FP32 sum of its K
// products taken in one fixed order (K tiles in order, each a fixed sequence of k16 MMAs of one
// instruction shape), with no split-K and nothing that depends on M, the tile, the other rows of
// its tile or the grouping. A row's bits therefore depend only on its own A row and its group's B
// (tests/ops/cuda_grouped_bf16_test, cuda_grouped_fused_test). The two loops may differ from each
// other; a process runs one of them for the sampler and the trainer alike.
//
// Bad offsets (outside [0, M] or decreasing) never make a CTA read or write outside its tensors:
// each group's rows are clamped into [0, M], and the first bad offset is recorded in the device
// index-error record, reported at the next check_index_errors (index_errors.cuh).
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
struct KGroupedArgs {
  int m, n, count;
  int64_t ldc;  // floats
  bool accumulate;
  KProblemArgs prob[kMaxKProblems];
};

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

// A row tile: its group (-1 for the tiles past the last) and rows [r0, r1).
struct RowTile {
  int group;
  long long r0, r1;
};

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
      if (g == 0 && (lo < 0 || lo > p.m)) record_index_error(p.err, IndexSite::GroupedGemmOffsets, 0, lo, p.m + 1, 1);
      if (hi < 0 || hi > p.m) record_index_error(p.err, IndexSite::GroupedGemmOffsets, g + 1, hi, p.m + 1, 1);
      else if (hi < lo) record_index_error(p.err, IndexSite::GroupedGemmOffsetsDecreasing, g + 1, hi, lo, 1);
      lo = lo < 0 ? 0 : (lo > p.m ? p.m : lo);
      hi = hi < lo ? lo : (hi > p.m ? p.m : hi);
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

template <Format F, int BM>
__global__ void __launch_bounds__(kThreads) grouped_kernel(const __grid_constant__ GroupedArgs p) {
  using S = Storage<F, kBK>;
  using T = Shape<F, BM>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_group;
  __shared__ long long s_r0, s_r1;
  __shared__ float2 e2m1_pair[F == Format::NVFP4 ? 256 : 1];

  // ---- which group and rows this CTA computes (warp 0 reads the offsets) ----
  if (threadIdx.x < 32) find_row_tile(p, BM, s_group, s_r0, s_r1);
  __syncthreads();
  if (s_group < 0) return;
  fill_e2m1_pairs<F>(e2m1_pair);
  const long long r0 = s_r0, r1 = s_r1;
  const int group = s_group, n0 = int(blockIdx.x) * kBN;
  const unsigned char* bg = p.b.data + group * p.b.slice_bytes;
  const uint8_t* bsg = S::kPacked ? p.b.scales + group * p.b.scale_slice : nullptr;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int wm = warp / T::kWarpsN, wn = warp % T::kWarpsN;  // this warp's kWM x kWN block
  const uint32_t sbase = smem_address(smem);
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;

  // One stage: the A tile (rows r0.., K columns k0..k0+31) and the B tile (columns n0.., same K).
  auto load_stage = [&](int stage, int kt) {
    const uint32_t st = sbase + uint32_t(stage * T::kStageBytes);
    const int k0 = p.k_begin + kt * kBK;
    load_tile<F, kBK, BM, kThreads>(p.a, p.a.data, p.a.scales, r0, r1, k0, p.k_end, st);
    load_tile<F, kBK, kBN, kThreads>(p.b, bg, bsg, n0, p.n, k0, p.k_end, st + T::kATile + T::kAScales);
  };

  float acc[T::kMI][T::kNI][4];
#pragma unroll
  for (int i = 0; i < T::kMI; ++i)
#pragma unroll
    for (int j = 0; j < T::kNI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // The two k16 steps of a K tile, in order, on BF16 tiles at sa (BM rows) and sb (128 rows).
  auto mma_tile = [&](uint32_t sa, uint32_t sb) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t af[T::kMI][4], bf[T::kNI][2];
#pragma unroll
      for (int mi = 0; mi < T::kMI; ++mi)
        ldsm_x4<false>(af[mi], sa + swizzle(wm * T::kWM + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
      for (int nj = 0; nj < T::kNI / 2; ++nj) {
        uint32_t r[4];
        ldsm_x4<false>(r, sb + swizzle(wn * T::kWN + nj * 16 + (lane & 7) + ((lane >> 4) << 3),
                                       kk * 2 + ((lane >> 3) & 1)));
        bf[nj * 2][0] = r[0];
        bf[nj * 2][1] = r[1];
        bf[nj * 2 + 1][0] = r[2];
        bf[nj * 2 + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < T::kNI; ++ni) mma_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  if constexpr (!S::kPacked) {
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();  // tile kt has landed (for this thread's copies) ...
      __syncthreads();               // ... for every thread's, and every warp is done with kt - 1
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next % kStages, next);
      cp_async_commit();
      const uint32_t sa = sbase + uint32_t((kt % kStages) * T::kStageBytes);
      mma_tile(sa, sa + T::kATile);
    }
  } else {
    // Packed stages are dequantized one tile ahead into two BF16 buffers: iteration kt decodes
    // tile kt + 1 while its MMAs read tile kt, with one barrier between iterations.
    unsigned char* decoded = smem + kStages * T::kStageBytes;
    auto dequantize = [&](int kt) {
      const unsigned char* st = smem + (kt % kStages) * T::kStageBytes;
      unsigned char* d = decoded + (kt & 1) * (BM + kBN) * 64;
      const int k0 = p.k_begin + kt * kBK;
      dequantize_tile<F, kBK, BM, kThreads>(st, k0, d, e2m1_pair);
      dequantize_tile<F, kBK, kBN, kThreads>(st + T::kATile + T::kAScales, k0, d + BM * 64, e2m1_pair);
    };
    cp_async_wait<kStages - 2>();  // tile 0 has landed
    __syncthreads();
    if (k_tiles > 0) dequantize(0);
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 3>();  // tile kt + 1 has landed (for this thread's copies) ...
      __syncthreads();  // ... for every thread's; tile kt is decoded; every warp is done with kt - 1
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next % kStages, next);
      cp_async_commit();
      if (kt + 1 < k_tiles) dequantize(kt + 1);
      const uint32_t d = smem_address(decoded + (kt & 1) * (BM + kBN) * 64);
      mma_tile(d, d + BM * 64);
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: rows of this group and columns < N only, in NUMERICS' order: the FP32 sum
  // times A's outer scale, times B's, then added to C when accumulating ----
  const float* sbo = p.b.outer ? p.b.outer + group * p.b.outer_group_stride : nullptr;
#pragma unroll
  for (int mi = 0; mi < T::kMI; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const long long row = r0 + wm * T::kWM + mi * 16 + (lane >> 2) + half * 8;
      if (row >= r1) continue;
      const int col0 = n0 + wn * T::kWN + (lane & 3) * 2;
      const float sa = a_scale(p, row);
      float2 old[T::kNI], sb[T::kNI];
#pragma unroll
      for (int ni = 0; ni < T::kNI; ++ni) {
        old[ni] = c_pair(p, row, col0 + ni * 8);
        sb[ni] = b_scales(p, sbo, col0 + ni * 8);
      }
#pragma unroll
      for (int ni = 0; ni < T::kNI; ++ni)
        store_pair<true>(p, sbo, row, col0 + ni * 8, acc[mi][ni][half * 2], acc[mi][ni][half * 2 + 1], old[ni], sa,
                         sb[ni]);
    }
}

// ---- the Hopper main loop: wgmma on 64-wide K tiles ----------------------------------------------
//
// Warpgroups each computing a 64 x 128 block with wgmma.m64n128k16 (BF16 in, FP32 accumulate) from
// shared memory: a CTA tile of 256 x 128 (training: four warpgroups stacked in M, 512 threads, so a
// K tile's 48 KB feed 4 MFLOP), or for decode one warpgroup's 64 x 128, or 64 x 32 with
// m64n32k16 where 128-wide tiles would leave SMs idle (decode_width); 64 x 256 (two warpgroups
// side by side in N) is kept for comparison. Every output element is the same chain of k16 steps
// over K in order in every shape, so its bits depend neither on the tile nor on M (the
// instruction's N does not change an element's sum: tested at every width). Operands arrive by
// cp.async in a pipeline of 64-wide K tiles (4 stages; 8 for the 64 x 32 tile). BF16 ones land in
// the 128-byte swizzle wgmma reads; the MMAs of a tile are issued before the copies of a later one
// and left in flight across the next barrier (copies ahead, one tile of MMAs behind). A's rows
// past its group's are zeroed once and never copied or decoded. Block-scaled ones arrive packed (codes, and the block-scale word of the tile) and
// are dequantized by the CTA into two swizzled BF16 buffers one tile ahead, while the tensor cores
// work on the tile before.
namespace hopper {

constexpr int kBK = 64, kStages = 4;
constexpr int kPanel = kBK * 128;  // bytes of an MN-major panel: 64 K rows of 64 values

template <Format F>
using Tile = Storage<F, kBK>;

template <Format F, int WGM, int WGN, int ST = kStages, int WN = 128>
struct Shape {
  using T = Tile<F>;
  static constexpr int kStages = ST;
  static constexpr int kWGN = WGN, BM = 64 * WGM, BN = WN * WGN, kThreads = 128 * WGM * WGN;
  static constexpr int kATile = BM * T::kRowBytes, kBTile = BN * T::kRowBytes;
  static constexpr int kAScales = T::kPacked ? BM * 4 : 0, kBScales = T::kPacked ? BN * 4 : 0;
  static constexpr int kStageBytes = (kATile + kBTile + kAScales + kBScales + 1023) / 1024 * 1024;
  static constexpr int kDecodedBytes = T::kPacked ? 2 * (BM + BN) * 128 : 0;  // two BF16 A and B tiles
  static constexpr int kSmemBytes = kStages * kStageBytes + kDecodedBytes + 1024;  // + alignment slack
  static_assert(ST >= 3, "the pipelines keep a tile of copies in flight behind one of MMAs");
};

// The decode configuration's stages for a 64 x WN tile of one warpgroup (Shape<F, 1, 1, ST, WN>):
// a CTA streams a WN-column slice of an expert's weights over the whole of K. The 32-wide tile is
// small enough to keep 6 K tiles of copies in flight with two CTAs an SM (BF16: 8 x 12 KB); the
// 128-wide one keeps the training tile's 4 stages (8 made it slower: one CTA an SM).
constexpr int decode_stages(int wn) { return wn <= 32 ? 8 : kStages; }

// C values an epilogue that adds to C loads at once (c_pair): 4 pairs keep the TMA forms, whose
// 17 warps a CTA allow 96 registers a thread, free of spills.
constexpr int kAhead = 4;

// Keeps the accumulators where the asynchronous wgmma writes them: the compiler may not move or
// reuse these registers across this point.
template <int NA>
__device__ __forceinline__ void pin(float (&acc)[NA]) {
#pragma unroll
  for (int i = 0; i < NA; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The MMAs of one 64-wide K tile, its four k16 steps in order, committed as one group: A's tile at
// shared address a (64 rows), B's at b (WN = 128 rows, or 32 for the decode configuration's
// narrow tile), each K-major (128-byte rows in the 128-byte swizzle) or MN-major where TA / TB
// (kPanel panels of 64 K rows, read with wgmma's transpose; WN = 128 only). A k16 step is 32
// bytes on in a K-major tile, 2048 (16 K rows) in an MN-major one; descriptors count 16-byte
// units. first: the tile starts the sum. Every width issues the same k16 steps in the same order;
// an output element's products and sums do not depend on the instruction's N (the tests compare
// every width's bits with the training tile's).
template <bool TA, bool TB, int WN = 128>
__device__ __forceinline__ void mma_k_tile(float (&acc)[WN / 2], uint32_t a, uint32_t b, bool first) {
  static_assert(WN == 128 || (WN == 32 && !TA && !TB), "the narrow tile is 32 wide and K-major");
  const uint64_t da = TA ? wgmma_desc_sw128_mn(a, kPanel) : wgmma_desc_sw128(a);
  const uint64_t db = TB ? wgmma_desc_sw128_mn(b, kPanel) : wgmma_desc_sw128(b);
  constexpr uint64_t kStepA = TA ? 128 : 2, kStepB = TB ? 128 : 2;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk)
    if constexpr (WN == 128) wgmma_m64n128k16<TA, TB>(acc, da + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
    else wgmma_m64n32k16_ss(acc, da + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
  wgmma_commit();
}

// The epilogue of warpgroup wm's 64 x WN block of a row-grouped tile (wgmma's accumulator layout)
// at rows r0 + 64 wm .., columns col0 ..: the group's rows (< r1) and columns < N only, in
// NUMERICS' order (store_pair), C's values and the outer scales loaded AHEAD pairs at a time ahead
// of the stores (kAhead where registers are tight; a decode tile's one warpgroup loads all of a
// row's at once, so its epilogue waits for two loads' latency, not one per pair). SCALES_AHEAD
// false loads the outer scales at each pair's store instead: the TMA form's 96 registers a thread
// hold C's values ahead but not the scales too (they spilled).
template <int WN = 128, int AHEAD = kAhead, bool SCALES_AHEAD = true>
__device__ __forceinline__ void store_block(const GroupedArgs& p, int group, const float (&acc)[WN / 2], int wm,
                                            int col0, long long r0, long long r1) {
  constexpr int kPairs = WN / 8, kAt = kPairs < AHEAD ? kPairs : AHEAD;
  const float* sbo = p.b.outer ? p.b.outer + group * p.b.outer_group_stride : nullptr;
  const int t = int(threadIdx.x) & 127, lane = int(threadIdx.x) & 31;
  const int row_base = wm * 64 + 16 * (t >> 5) + (lane >> 2), col_base = col0 + 2 * (lane & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const long long row = r0 + row_base + 8 * half;
    if (row >= r1) continue;
    const float sa = SCALES_AHEAD ? a_scale(p, row) : 0.0f;
#pragma unroll
    for (int j0 = 0; j0 < kPairs; j0 += kAt) {
      float2 old[kAt], sb[kAt] = {};
#pragma unroll
      for (int j = 0; j < kAt; ++j) {
        old[j] = c_pair(p, row, col_base + 8 * (j0 + j));
        if constexpr (SCALES_AHEAD) sb[j] = b_scales(p, sbo, col_base + 8 * (j0 + j));
      }
#pragma unroll
      for (int j = 0; j < kAt; ++j) {
        const int q = j0 + j;
        store_pair<SCALES_AHEAD>(p, sbo, row, col_base + 8 * q, acc[4 * q + 2 * half], acc[4 * q + 2 * half + 1],
                                 old[j], sa, sb[j]);
      }
    }
  }
}

// The BF16 pipeline of K tiles 0 .. k_tiles - 1: load_stage(kt) starts the copies of tile kt into
// stage kt % kStages, mma_stage(kt) issues (and commits) its MMAs. Tiles kt + 1, kt + 2 are in
// flight while the MMAs of kt - 1 and kt run: the copies of tile kt + 2 go to the stage of kt - 2,
// whose MMAs every warpgroup has finished (wgmma_wait<1> before the barrier) by the time anyone
// issues them.
template <int ST = kStages, int NA, class Load, class Mma>
__device__ __forceinline__ void bf16_pipeline(int k_tiles, float (&acc)[NA], Load&& load_stage, Mma&& mma_stage) {
  constexpr int kStages = ST;
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 3>();  // tile kt has landed (this thread's copies) ...
    fence_proxy_async();           // ... visible to wgmma's proxy ...
    __syncthreads();               // ... for every thread's; and the MMAs of kt - 2 are done
    mma_stage(kt);
    if (kt + kStages - 2 < k_tiles) load_stage(kt + kStages - 2);
    cp_async_commit();
    wgmma_wait<1>();  // the MMAs of kt - 1 are done (this warpgroup's)
    pin(acc);
  }
  wgmma_wait<0>();
  pin(acc);
}

// Copies the 64-row K tile at k0 of an MN-major operand (K rows ld bytes apart), MN values
// mn0 .. mn0 + R - 1 (those < mn_end; K rows < k_end), into R / 64 panels of 64 K rows x 128 bytes
// (kPanel) at dst; what lies outside is zero-filled.
template <int R, int NT>
__device__ __forceinline__ void load_tile_mn(const unsigned char* base, int64_t ld, int mn0, int mn_end, int k0,
                                             int k_end, uint32_t dst) {
  constexpr int kChunksRow = R / 8;  // 16-byte chunks of a K row
#pragma unroll 4
  for (int idx = int(threadIdx.x); idx < kBK * kChunksRow; idx += NT) {
    const int kr = idx / kChunksRow, c = idx % kChunksRow, mn = mn0 + 8 * c;
    const bool ok = k0 + kr < k_end && mn < mn_end;
    cp_async16(dst + uint32_t((c >> 3) * kPanel) + sw128(kr, c & 7),
               ok ? base + (long long)(k0 + kr) * ld + (long long)mn * 2 : base, ok ? 16 : 0);
  }
}

// BT: B (BF16) is read MN-major, each group stored [K, N] (the forward's weight of a dgrad): its
// tile lands as stored in kPanel panels (load_tile_mn) and the MMAs read it with the instruction's
// transpose, the same products in the same order as from a K-major copy of it.
template <Format F, int WGM, int WGN, bool BT, int ST, int WN>
__global__ void __launch_bounds__(128 * WGM * WGN, 1) wgmma_kernel(const __grid_constant__ GroupedArgs p) {
  using T = Tile<F>;
  using S = Shape<F, WGM, WGN, ST, WN>;
  constexpr int kStages = ST;
  static_assert(!BT || F == Format::BF16, "MN-major B is BF16");
  constexpr int kThreads = S::kThreads;
  constexpr int BM = S::BM, BN = S::BN;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int s_group;
  __shared__ long long s_r0, s_r1;
  __shared__ float2 e2m1_pair[F == Format::NVFP4 ? 256 : 1];

  if (threadIdx.x < 32) find_row_tile(p, BM, s_group, s_r0, s_r1);
  __syncthreads();
  if (s_group < 0) return;
  fill_e2m1_pairs<F>(e2m1_pair);
  const long long r0 = s_r0, r1 = s_r1;
  const int group = s_group, n0 = int(blockIdx.x) * BN;
  const unsigned char* bg = p.b.data + group * p.b.slice_bytes;
  const uint8_t* bsg = T::kPacked ? p.b.scales + group * p.b.scale_slice : nullptr;

  // 1024-byte aligned stages (the swizzle atoms wgmma's descriptors assume)
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (sbase - raw);
  const int tid = int(threadIdx.x), wg = tid >> 7;
  const int wm = wg / S::kWGN, wn = wg % S::kWGN;  // this warpgroup's 64 x WN block
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;
  // A's rows past the group's are zeros: copied only where they are the group's, the others
  // zeroed once (BF16: in every stage, read by the MMAs as they are; packed: in both decoded
  // buffers, never decoded). A decode tile (64 rows, a few of them the group's) is spared nearly
  // all of A's copies and decoding.
  const int a_rows = int(r1 - r0);
  {
    const int pad = (BM - a_rows) * 8;  // 16-byte chunks of the rows past the group's
    const int copies = T::kPacked ? 2 : kStages;
    unsigned char* first = smem + (T::kPacked ? kStages * S::kStageBytes : 0);
    const int step = T::kPacked ? (BM + BN) * 128 : S::kStageBytes;
    for (int i = tid; i < copies * pad; i += kThreads)
      *reinterpret_cast<uint4*>(first + (i / pad) * step + a_rows * 128 + (i % pad) * 16) = make_uint4(0u, 0u, 0u, 0u);
  }

  auto load_stage = [&](int kt) {
    const uint32_t st = sbase + uint32_t((kt % kStages) * S::kStageBytes);
    const int k0 = p.k_begin + kt * kBK;
    load_tile<F, kBK, BM, kThreads>(p.a, p.a.data, p.a.scales, r0, r1, k0, p.k_end, st, a_rows);
    if constexpr (BT) load_tile_mn<BN, kThreads>(bg, p.b.ld, n0, p.n, k0, p.k_end, st + S::kATile);
    else load_tile<F, kBK, BN, kThreads>(p.b, bg, bsg, n0, p.n, k0, p.k_end, st + S::kATile + S::kAScales);
  };
  float acc[WN / 2];
#pragma unroll
  for (int i = 0; i < WN / 2; ++i) acc[i] = 0.0f;
  // A K tile on BF16 tiles at sa (BM rows) and sb (BN rows): this warpgroup's 64 rows of A and WN
  // columns of B (WN K-major rows, or for WN = 128 two MN-major panels: 16 KB on either way).
  auto mma_tile = [&](uint32_t sa, uint32_t sb, bool first) {
    mma_k_tile<false, BT, WN>(acc, sa + uint32_t(wm * 64 * 128), sb + uint32_t(wn * WN * 128), first);
  };

  if constexpr (!T::kPacked) {
    bf16_pipeline<ST>(k_tiles, acc, load_stage, [&](int kt) {
      const uint32_t st = sbase + uint32_t((kt % kStages) * S::kStageBytes);
      mma_tile(st, st + S::kATile, kt == 0);
    });
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s);
      cp_async_commit();
    }
    unsigned char* decoded = smem + kStages * S::kStageBytes;
    auto dequantize = [&](int kt) {
      const unsigned char* st = smem + (kt % kStages) * S::kStageBytes;
      unsigned char* d = decoded + (kt & 1) * (BM + BN) * 128;
      const int k0 = p.k_begin + kt * kBK;
      dequantize_tile<F, kBK, BM, kThreads>(st, k0, d, e2m1_pair, a_rows);
      dequantize_tile<F, kBK, BN, kThreads>(st + S::kATile + S::kAScales, k0, d + BM * 128, e2m1_pair);
    };
    cp_async_wait<kStages - 2>();  // tile 0 has landed
    __syncthreads();
    if (k_tiles > 0) dequantize(0);
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 3>();  // tile kt + 1 has landed (this thread's copies)
      fence_proxy_async();           // tile kt's decoded stores visible to wgmma's proxy
      __syncthreads();  // every thread's; tile kt is decoded; every warpgroup is done with kt - 1
      if (kt + kStages - 1 < k_tiles) load_stage(kt + kStages - 1);
      cp_async_commit();
      const uint32_t d = sbase + uint32_t(kStages * S::kStageBytes + (kt & 1) * (BM + BN) * 128);
      mma_tile(d, d + uint32_t(BM * 128), kt == 0);
      if (kt + 1 < k_tiles) dequantize(kt + 1);  // into the other buffer, while the MMAs run
      wgmma_wait<0>();
      pin(acc);
    }
  }
  cp_async_wait<0>();
  store_block<WN, WGM * WGN == 1 ? WN / 8 : kAhead>(p, group, acc, wm, n0 + wn * WN, r0, r1);
}

// ---- the streaming decode kernel: expert weights as the MMA's A operand, in registers ------------
//
// At decode a group has a few rows (tokens) and its expert's weights are the data to move. The
// tiles above put the tokens in wgmma's 64-row A operand (63 of 64 rows zero at batch 1) and the
// weights in its shared-memory B operand, so every packed weight tile is decoded by the whole CTA
// into shared memory and the MMAs wait behind a barrier for it: Nsight Compute showed those tiles
// bound by that chain, not by bytes. Here the roles are swapped: C^T = B . A^T, each warp owning 16
// weight rows (16 columns of C) over the whole of K. A warp streams its rows' K tiles as stored
// (codes and block scales, or BF16) by its own cp.async pipeline, decodes each thread's share of
// a tile in registers straight into mma.sync's A fragment and multiplies it by the tokens,
// 8 J of them as J n8 blocks of the B fragment, read with ldmatrix from a BF16 copy the CTA
// decoded once into shared memory. No warp waits for another's weights: the only barriers are
// around the tokens' copy (once per chunk of K whose BF16 tokens fill 64 KB: all of gpu-small's K).
//
// The same bits as the tiles above: an element is the chain of k16 MMAs over the same 64-wide K
// tiles in order (the zero padding included), and a k16 mma.sync gives wgmma's sum whichever
// operand is A (measured on the H200; the grouped tests compare every decode configuration with
// the training tile, bit for bit).
namespace streaming {

constexpr int kWarps = 4, kThreads = 32 * kWarps, kRows = 16;  // kRows weight rows (C columns) a warp
constexpr int BN = kWarps * kRows;                              // C columns a CTA
constexpr int kTokenBytes = 64 * 1024;                          // the tokens' BF16 copy: at most

template <Format F, int J>
struct Shape {
  using T = Tile<F>;
  static constexpr int BM = 8 * J;   // tokens a CTA
  static constexpr int kStages = 8;  // a warp's K tiles of weights in flight, plus the one it works on
  static constexpr int kScaleBytes = T::kPacked ? kRows * 4 : 0;
  static constexpr int kWStage = kRows * T::kRowBytes + kScaleBytes;  // a warp's stage (load_tile's layout)
  static constexpr int kTokenTile = BM * 128;                         // a K tile of the tokens, BF16, sw128
  static constexpr int kMaxChunk = kTokenBytes / kTokenTile;          // K tiles of tokens held at once
  static constexpr int kWeightBytes = kWarps * kStages * kWStage;
  static constexpr int smem_bytes(int chunk) { return chunk * kTokenTile + kWeightBytes; }
};

// The tokens' K tiles kt0 .. kt1 - 1 (rows r0 .. r0 + rows - 1 of A) as BF16 in shared memory at
// dst, each tile BM rows of 128 bytes in the 128-byte swizzle (sw128); the CTA's threads share it.
// Block-scaled tokens are decoded 16 values at a time, to dequantize_tile's bits (NVFP4 as the
// weights are, e2m1x2_times; MXFP8 with decode8_bits). K past k_end is zero, in the units
// load_tile copies (8 BF16 values, 32 NVFP4, 16 MXFP8), so the products are the tiles'. Rows past
// `rows` are left as they are (zeroed once by the caller).
template <Format F, int BM>
__device__ __forceinline__ void stage_tokens(const GroupedArgs& p, long long r0, int rows, int kt0, int kt1,
                                             unsigned char* dst, const uint32_t* e2m1_bf16) {
  using T = Tile<F>;
  constexpr int kUnits = T::kPacked ? 4 : 8;  // units of a row's K tile: 16 values, or one BF16 chunk
  const int tiles = kt1 - kt0;
  for (int u = int(threadIdx.x); u < rows * tiles * kUnits; u += kThreads) {
    const int q = u % kUnits, tile = (u / kUnits) % tiles, row = u / (kUnits * tiles);
    const int k = p.k_begin + (kt0 + tile) * 64 + q * (T::kPacked ? 16 : 8);
    unsigned char* d = dst + tile * BM * 128;
    const unsigned char* arow = p.a.data + (r0 + row) * p.a.ld;
    if constexpr (!T::kPacked) {
      const uint4 v = k < p.k_end ? *reinterpret_cast<const uint4*>(arow + 2ll * k) : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(d + sw128(row, q)) = v;
    } else {
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      // zero where load_tile's copy holding k (32 NVFP4 values, 16 MXFP8 ones) starts past k_end
      if ((F == Format::NVFP4 ? k - 16 * (q & 1) : k) < p.k_end) {
        if constexpr (F == Format::NVFP4) {  // the weights' decode: the same bits (e2m1x2_times)
          const uint2 w = *reinterpret_cast<const uint2*>(arow + k / 2);
          const uint32_t sc = ue4m3_bf16x2(p.a.scales[(r0 + row) * p.a.scale_ld + k / block_values<F>()]);
          uint32_t* l = reinterpret_cast<uint32_t*>(&lo);
          uint32_t* h = reinterpret_cast<uint32_t*>(&hi);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            l[j] = e2m1x2_times(e2m1_bf16, w.x, j, sc);
            h[j] = e2m1x2_times(e2m1_bf16, w.y, j, sc);
          }
        } else {
          const float sv = decode8_scale<F>(p.a.scales[(r0 + row) * p.a.scale_ld + k / block_values<F>()]);
          const uint4 w = *reinterpret_cast<const uint4*>(arow + k);
          lo = decode8_bits<F>(make_uint2(w.x, w.y), sv, nullptr);
          hi = decode8_bits<F>(make_uint2(w.z, w.w), sv, nullptr);
        }
      }
      *reinterpret_cast<uint4*>(d + sw128(row, 2 * q)) = lo;
      *reinterpret_cast<uint4*>(d + sw128(row, 2 * q + 1)) = hi;
    }
  }
}

// A warp's copies of its weight rows' K tiles into its pipeline stages, in load_tile's layout
// (codes then one block-scale word a row; BF16 rows in the 128-byte swizzle), each lane's sources
// and destinations worked out once: tile kt is kRowBytes further along every row. Rows past N and
// 16-byte units starting past k_end are zero-filled, as load_tile does.
template <Format F>
struct WarpCopy {
  using T = Tile<F>;
  static constexpr int kCopies = kRows * T::kChunks / 32;  // 16-byte copies a lane, a K tile
  static constexpr int kChunkValues = 128 / T::kBits;
  const unsigned char* src[kCopies];  // null: a row past N
  const unsigned char* any;            // a readable address for the zero-filling copies (which read nothing)
  uint32_t dst[kCopies];
  int k_first[kCopies];  // the value index of a copy's first code in tile 0
  const uint8_t* scale_src;
  bool scale_row;
  __device__ __forceinline__ WarpCopy(const GroupedArgs& p, const unsigned char* bg, const uint8_t* bsg, int n0,
                                      int lane)
      : any(bg) {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int idx = lane + 32 * i, row = idx / T::kChunks, chunk = idx % T::kChunks;
      const bool ok = n0 + row < p.n;
      src[i] = ok ? bg + (long long)(n0 + row) * p.b.ld + (long long)p.k_begin * T::kBits / 8 + chunk * 16 : nullptr;
      dst[i] = T::kPacked ? uint32_t(row * T::kRowBytes + chunk * 16) : T::bf16_offset(row, chunk);
      k_first[i] = p.k_begin + chunk * kChunkValues;
    }
    scale_row = T::kPacked && lane < kRows && n0 + lane < p.n;
    scale_src = scale_row ? bsg + (long long)(n0 + lane) * p.b.scale_ld : nullptr;
  }
  // Starts the copies of K tile kt into the stage at shared address st.
  __device__ __forceinline__ void load(const GroupedArgs& p, int kt, uint32_t st, int lane) const {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const bool ok = src[i] && k_first[i] + kt * 64 < p.k_end;
      cp_async16(st + dst[i], ok ? src[i] + kt * T::kRowBytes : any, ok ? 16 : 0);
    }
    if constexpr (T::kPacked) {
      const int k0 = p.k_begin + kt * 64, word = (k0 / block_values<F>()) & ~3;
      if (lane < kRows)
        cp_async4(st + uint32_t(kRows * T::kRowBytes + 4 * lane), scale_row ? scale_src + word : any,
                  scale_row && k0 < p.k_end ? 4 : 0);
    }
  }
};

// This thread's A fragments (mma_bf16's layout: rows gid and gid + 8 of the warp's 16, k 2 tig ..
// and 2 tig + 8 .. of each k16 step) of the warp's K tile at `st` (WarpCopy's layout): BF16 by
// ldmatrix from the 128-byte swizzle; packed ones decoded from the rows' codes, each value the
// product code x block scale rounded once to BF16, as decode8_bits has it: NVFP4 by a table of
// E2M1 pairs and one BF16-pair FMA a code byte (e2m1x2_times, exact), MXFP8 by decode2_bits.
template <Format F>
__device__ __forceinline__ void weight_fragments(const unsigned char* st, int k0, int lane, const uint32_t* e2m1_bf16,
                                                 uint32_t (&a)[4][4]) {
  using T = Tile<F>;
  if constexpr (!T::kPacked) {
    (void)k0, (void)e2m1_bf16;
    const uint32_t base = smem_address(st);
#pragma unroll
    for (int s = 0; s < 4; ++s) ldsm_x4<false>(a[s], base + sw128(lane & 15, 2 * s + (lane >> 4)));
  } else {
    const int gid = lane >> 2, tig = lane & 3;
    constexpr int kWords = T::kRowBytes / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows gid, gid + 8
      const int row = gid + 8 * h;
      uint32_t w[kWords];
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(st + row * T::kRowBytes + 16 * i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
      }
      const uint32_t scales = *reinterpret_cast<const uint32_t*>(st + kRows * T::kRowBytes + 4 * row);
      if constexpr (F == Format::NVFP4) {
        // a 64-wide tile starts a scale word (k0 is a multiple of 64 where K is packed)
        uint32_t sc[4];
        ue4m3x4_bf16x2(scales, sc);
#pragma unroll
        for (int s = 0; s < 4; ++s) {  // codes of k 16 s + 2 tig, + 1 (word 2 s) and + 8, + 9 (word 2 s + 1)
          a[s][h] = e2m1x2_times(e2m1_bf16, w[2 * s], tig, sc[s]);
          a[s][2 + h] = e2m1x2_times(e2m1_bf16, w[2 * s + 1], tig, sc[s]);
        }
      } else {
        const int first_block = (k0 / block_values<F>()) & 3;  // the tile's first scale in the word
        const float sv[2] = {decode8_scale<F>(uint8_t(scales >> (8 * first_block))),
                             decode8_scale<F>(uint8_t(scales >> (8 * (first_block + 1))))};
        const bool odd = tig >= 2;  // a selection, not an index: w stays in registers
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint32_t lo = ((odd ? w[4 * s + 1] : w[4 * s]) >> (16 * (tig & 1))) & 0xFFFFu;
          const uint32_t hi = ((odd ? w[4 * s + 3] : w[4 * s + 2]) >> (16 * (tig & 1))) & 0xFFFFu;
          a[s][h] = decode2_bits<F>(lo, sv[s >> 1], nullptr);
          a[s][2 + h] = decode2_bits<F>(hi, sv[s >> 1], nullptr);
        }
      }
    }
  }
}

template <Format F, int J>
__global__ void __launch_bounds__(kThreads) stream_kernel(const __grid_constant__ GroupedArgs p, int chunk) {
  using T = Tile<F>;
  using S = Shape<F, J>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_group;
  __shared__ long long s_r0, s_r1;
  __shared__ uint32_t e2m1_bf16[F == Format::NVFP4 ? 256 : 1];

  if (threadIdx.x < 32) find_row_tile(p, S::BM, s_group, s_r0, s_r1);
  __syncthreads();
  if (s_group < 0) return;
  if constexpr (F == Format::NVFP4) fill_e2m1_bf16x2(e2m1_bf16);
  const long long r0 = s_r0, r1 = s_r1;
  const int group = s_group, rows = int(r1 - r0);
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int n0 = int(blockIdx.x) * BN + warp * kRows;  // the warp's first weight row
  const unsigned char* bg = p.b.data + group * p.b.slice_bytes;
  const uint8_t* bsg = T::kPacked ? p.b.scales + group * p.b.scale_slice : nullptr;
  const int k_tiles = (p.k_end - p.k_begin + 63) / 64;
  unsigned char* tokens = smem;
  unsigned char* wst = smem + chunk * S::kTokenTile + warp * S::kStages * S::kWStage;
  const uint32_t wbase = smem_address(wst);

  // the warp's weight pipeline: tile kt into stage kt % kStages, its lanes sharing the copies
  const WarpCopy<F> copy(p, bg, bsg, n0, lane);
  auto load_weights = [&](int kt) { copy.load(p, kt, wbase + uint32_t((kt % S::kStages) * S::kWStage), lane); };
#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    if (s < k_tiles) load_weights(s);
    cp_async_commit();
  }
  // the token rows past the group's are zeros, in every tile of the chunk buffer
  for (int i = int(threadIdx.x); i < (S::BM - rows) * 8 * chunk; i += kThreads) {
    const int tile = i / ((S::BM - rows) * 8), rest = i % ((S::BM - rows) * 8);
    *reinterpret_cast<uint4*>(tokens + tile * S::kTokenTile + sw128(rows + rest / 8, rest % 8)) =
        make_uint4(0u, 0u, 0u, 0u);
  }

  float acc[J][4];
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  for (int c0 = 0; c0 < k_tiles; c0 += chunk) {
    const int c1 = min(k_tiles, c0 + chunk);
    if (c0 > 0) __syncthreads();  // every warp is done with the previous chunk's tokens
    stage_tokens<F, S::BM>(p, r0, rows, c0, c1, tokens, e2m1_bf16);
    __syncthreads();
    for (int kt = c0; kt < c1; ++kt) {
      cp_async_wait<S::kStages - 2>();  // tile kt has landed (this lane's copies) ...
      __syncwarp();                     // ... every lane's; and every lane is done with tile kt - 1
      if (kt + S::kStages - 1 < k_tiles) load_weights(kt + S::kStages - 1);
      cp_async_commit();
      uint32_t a[4][4];
      weight_fragments<F>(wst + (kt % S::kStages) * S::kWStage, p.k_begin + kt * 64, lane, e2m1_bf16, a);
      const uint32_t tok = smem_address(tokens + (kt - c0) * S::kTokenTile);
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k16 steps 2 h, 2 h + 1
          uint32_t b[4];
          ldsm_x4<false>(b, tok + sw128(8 * j + (lane & 7), 4 * h + (lane >> 3)));
          mma_bf16(acc[j], a[2 * h], b[0], b[1]);
          mma_bf16(acc[j], a[2 * h + 1], b[2], b[3]);
        }
    }
  }
  cp_async_wait<0>();

  // C[token, weight row] in NUMERICS' order (finish_value): acc[j] holds weight rows gid, gid + 8
  // and tokens 8 j + 2 tig, + 1 of the warp's block.
  const float* sbo = p.b.outer ? p.b.outer + group * p.b.outer_group_stride : nullptr;
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const long long row = r0 + 8 * j + 2 * tig + (e & 1);
      const int col = n0 + gid + 8 * (e >> 1);
      if (row >= r1 || col >= p.n) continue;
      float* c = p.c + row * p.ldc + col;
      *c = finish_value(p, sbo, acc[j][e], row, col, p.accumulate ? *c : 0.0f);
    }
}

}  // namespace streaming

// ---- the K-grouped form (weight gradients): C_j (+)= A_j . B_j^T, problem j's K its own ----------
//
// A MoE layer's expert weight gradients dW_e = dY_e^T X_e sum over each expert's tokens, so the
// groups run along K and every problem has an output of its own. Up to kMaxKProblems problems of
// one m x n output shape run in one launch, a CTA per (256 x 128 output tile, problem), with the
// BF16 pipeline above. The operands are BF16, both K-major (A_j [m, k_j] and B_j [n, k_j] rows
// lda / ldb bytes apart: block-scaled ones decoded) or both MN-major (A_j stored [k_j, m], B_j
// [k_j, n]: the token-major dY and X as the forward and dgrad left them), which land in shared
// memory as they are stored — 64-value panels of 64 K rows in the 128-byte swizzle — and are read
// with the instruction's transpose. An element is the FP32 sum of its k_j products, K tiles in
// order, each four k16 steps: deterministic, and independent of the other problems and of the tile.

// The epilogue of a K-grouped output tile at (m0, n0): warpgroup wm's 64 x 128 block (wgmma's
// accumulator layout) into C (ldc floats a row), rows < m and columns < n, added to C's values
// where accumulate (one rounding each).
__device__ __forceinline__ void store_wgrad_block(const float (&acc)[64], float* c, int64_t ldc, int m, int n, int m0,
                                                  int n0, int wm, bool accumulate) {
  const int t = int(threadIdx.x) & 127, lane = int(threadIdx.x) & 31;
  const int row_base = m0 + wm * 64 + 16 * (t >> 5) + (lane >> 2), col_base = n0 + 2 * (lane & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_base + 8 * half;
    if (row >= m) continue;
    float* crow = c + (long long)row * ldc;
#pragma unroll
    for (int j0 = 0; j0 < 16; j0 += kAhead) {
      float2 old[kAhead];  // C's values, loaded together ahead of the stores
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        const int col = col_base + 8 * (j0 + j);
        old[j] = accumulate && col < n ? *reinterpret_cast<const float2*>(crow + col) : make_float2(0.0f, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        const int q = j0 + j, col = col_base + 8 * q;
        if (col >= n) continue;  // n is even: col + 1 < n too
        float2 v = make_float2(acc[4 * q + 2 * half], acc[4 * q + 2 * half + 1]);
        if (accumulate) v = make_float2(num::add_rn(old[j].x, v.x), num::add_rn(old[j].y, v.y));
        *reinterpret_cast<float2*>(crow + col) = v;
      }
    }
  }
}

template <bool MN>
__global__ void __launch_bounds__(512, 1) wgrad_kernel(const __grid_constant__ KGroupedArgs p) {
  using S = Shape<Format::BF16, 4, 1>;  // 256 x 128 tiles, four warpgroups stacked in M
  constexpr int kThreads = S::kThreads, BM = S::BM, BN = S::BN;
  const KProblemArgs& q = p.prob[blockIdx.z];
  const int m0 = int(blockIdx.y) * BM, n0 = int(blockIdx.x) * BN;
  const int wm = int(threadIdx.x) >> 7;
  auto store = [&](const float (&acc)[64]) { store_wgrad_block(acc, q.c, p.ldc, p.m, p.n, m0, n0, wm, p.accumulate); };
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  if (q.k == 0) {  // no tokens: C = 0, or C unchanged
    if (!p.accumulate) store(acc);
    return;
  }
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const int k_tiles = (q.k + kBK - 1) / kBK;
  auto load_stage = [&](int kt) {
    const uint32_t st = sbase + uint32_t((kt % kStages) * S::kStageBytes);
    const int k0 = kt * kBK;
    if constexpr (MN) {
      load_tile_mn<BM, kThreads>(q.a, q.lda, m0, p.m, k0, q.k, st);
      load_tile_mn<BN, kThreads>(q.b, q.ldb, n0, p.n, k0, q.k, st + S::kATile);
    } else {
      OperandArgs oa{}, ob{};
      oa.ld = q.lda;
      ob.ld = q.ldb;
      load_tile<Format::BF16, kBK, BM, kThreads>(oa, q.a, nullptr, m0, p.m, k0, q.k, st);
      load_tile<Format::BF16, kBK, BN, kThreads>(ob, q.b, nullptr, n0, p.n, k0, q.k, st + S::kATile);
    }
  };
  bf16_pipeline(k_tiles, acc, load_stage, [&](int kt) {
    const uint32_t st = sbase + uint32_t((kt % kStages) * S::kStageBytes);
    // this warpgroup's 64 rows of A: 8 KB on (64 K-major rows, or one MN-major panel)
    mma_k_tile<MN, MN>(acc, st + uint32_t(wm * 64 * 128), st + uint32_t(S::kATile), kt == 0);
  });
  cp_async_wait<0>();
  store(acc);
}

template <bool MN>
void launch_wgrad(const KGroupedArgs& p) {
  using S = Shape<Format::BF16, 4, 1>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(
        cudaFuncSetAttribute(wgrad_kernel<MN>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  const dim3 grid(unsigned((p.n + S::BN - 1) / S::BN), unsigned((p.m + S::BM - 1) / S::BM), unsigned(p.count));
  wgrad_kernel<MN><<<grid, S::kThreads, S::kSmemBytes, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

// ---- the TMA form of the training tile (BF16 operands) -------------------------------------------
//
// The BF16 training tile of wgmma_kernel fed by TMA instead of cp.async from every thread, in
// clusters of two CTAs on neighbouring column tiles that share their A tile: each CTA loads half
// of it and multicasts that half into both, so a pair reads A from L2 once (a third less L2 -> SM
// traffic, what bounds the cp.async loop). One producer thread issues the copies into a ring of
// stages; per stage a "full" mbarrier counts the bytes in (its CTA's B tile and both A halves) and
// an "empty" one the releases of the pair's consumer warpgroups, after which the stage may be
// overwritten in either CTA. The consumers release a stage with a CTA-scope arrival: a cluster-scope
// release costs a MEMBAR.GPU per K tile in every warpgroup, which held the loop at ~0.6 of
// cuBLASLt (h200_gpu_grouped_gemm_cta_release.json has the times without it). The tile is
// 256 x 128 on four consumer warpgroups with 4 stages, one CTA an SM. Two others measured slower
// at every shape (while the arrivals still had that barrier) and were removed: 128 x 128 on two,
// two CTAs an SM so that one's prologue and epilogue run under the other's MMAs
// (bench/results/h200_gpu_grouped_gemm.json, "TMA 128-row ms"), and 128 x 256 on two warpgroups of
// m64n256k16, which gives the same bits (h200_gpu_grouped_gemm_tiles.json, "128x256 tile ms").
// The consumer warpgroups run the same m64n128k16 chain over the same 64-wide K tiles as
// wgmma_kernel, so every element gets wgmma_kernel's bits. BT: B is
// read MN-major as wgmma_kernel's BT form reads it, two boxes of 64 N values x 64 K rows of a
// 3-D map [G][K][N] a stage (its K rows past a group's K are zeros, not the next group's).
struct TmaParams {
  CUtensorMap a;  // A [M, K] BF16, boxes of 64 K values x 128 rows, 128-byte swizzle
  CUtensorMap b;  // B [G N, K], boxes of 64 K values x 128 rows; BT: [G][K][N], boxes 64 x 64 x 1
  GroupedArgs g;
  int pairs, rows;  // the grid of cluster tiles: pairs of column tiles x row tiles (and slots past them)
  int band_pairs;   // the tile order: column pairs a band (0: a row tile's columns, then the next)
};

constexpr int kTmaConsumers = 4, kTmaThreads = 128 * kTmaConsumers + 32;  // + the producer warp

// Cluster tile c (of pairs x rows) in the tile order: clusters in turn walk bands of band_pairs
// column pairs, row tiles fastest inside a band, so that the tiles in flight at once cover a
// near-square block of C and share both operands in L2; walking all the column tiles of a row
// tile first (band_pairs 0) reads the whole of B once per 66 tiles, from HBM where B is larger
// than L2.
__device__ __forceinline__ void tma_tile_of(const TmaParams& tp, int c, int& row_tile, int& pair) {
  row_tile = c / tp.pairs;
  pair = c % tp.pairs;
  if (tp.band_pairs > 0 && tp.band_pairs < tp.pairs) {
    const int band = c / (tp.band_pairs * tp.rows), first = band * tp.band_pairs;
    const int width = min(tp.band_pairs, tp.pairs - first), in_band = c - first * tp.rows;
    row_tile = in_band / width;
    pair = first + in_band % width;
  }
}

// Persistent: cluster i of the grid's n computes cluster tiles i, i + n, i + 2n, ... (both CTAs
// the same row tile, neighbouring column tiles), and the K tiles of all of them run through one
// ring of stages, so the producer loads the next tile's first stages while the consumers store
// the last one's results, and a CTA's setup (barriers, cluster sync) is paid once. Every warp finds
// each tile's group itself (row_tile_of); the slots past the last row tile are skipped by all.
template <bool BT>
__global__ void __launch_bounds__(kTmaThreads, 1) tma_kernel(const __grid_constant__ TmaParams tp) {
  using S = Shape<Format::BF16, kTmaConsumers, 1>;
  constexpr int BM = S::BM, BN = S::BN, kHalf = BM / 2 * 128;  // bytes of half an A tile
  const GroupedArgs& p = tp.g;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];

  const uint32_t rank = cluster_ctarank();
  const int tid = int(threadIdx.x), cluster = int(blockIdx.x) / 2, clusters = int(gridDim.x) / 2;
  const int tiles = tp.pairs * tp.rows;
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const uint32_t full0 = smem_address(&full[0]), empty0 = smem_address(&empty[0]);
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbarrier_init(full0 + 8u * st, 1);
      mbarrier_init(empty0 + 8u * st, 2 * kTmaConsumers);
    }
    fence_mbarrier_init();
  }
  cluster_sync();  // both CTAs' barriers are initialised before either copies or arrives
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;

  if (tid >= 128 * kTmaConsumers) {  // the producer warp: one thread issues every copy
    int it = 0;                      // K tiles through the ring so far
    for (int c = cluster; c < tiles; c += clusters) {
      int row_tile, pair;
      tma_tile_of(tp, c, row_tile, pair);
      const RowTile t = row_tile_of(p, BM, row_tile);
      if (t.group < 0) continue;
      const int n0 = (2 * pair + int(rank)) * BN;
      if (tid == 128 * kTmaConsumers) {
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int st = it % kStages, round = it / kStages;
          if (round > 0) mbarrier_wait(empty0 + 8u * st, uint32_t(round - 1) & 1u);  // released in both CTAs
          const uint32_t stage = sbase + uint32_t(st * S::kStageBytes), bar = full0 + 8u * st;
          mbarrier_arrive_expect_tx(bar, uint32_t(S::kATile + S::kBTile));
          const int k0 = p.k_begin + kt * kBK;
          tma_load_2d_multicast(stage + rank * kHalf, &tp.a, k0, int(t.r0) + int(rank) * (BM / 2), bar,
                                uint16_t(3));
          if constexpr (BT) {
            tma_load_3d(stage + uint32_t(S::kATile), &tp.b, n0, k0, t.group, bar);
            tma_load_3d(stage + uint32_t(S::kATile + kPanel), &tp.b, n0 + 64, k0, t.group, bar);
          } else {
            tma_load_2d(stage + uint32_t(S::kATile), &tp.b, k0, t.group * p.n + n0, bar);
          }
        }
      }
      __syncwarp();
    }
  } else {
    const int wm = tid >> 7;
    int it = 0;
    for (int c = cluster; c < tiles; c += clusters) {
      int row_tile, pair;
      tma_tile_of(tp, c, row_tile, pair);
      const RowTile t = row_tile_of(p, BM, row_tile);
      if (t.group < 0) continue;
      float acc[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int st = it % kStages;
        mbarrier_wait(full0 + 8u * st, uint32_t(it / kStages) & 1u);
        const uint32_t stage = sbase + uint32_t(st * S::kStageBytes);
        mma_k_tile<false, BT>(acc, stage + uint32_t(wm * 64 * 128), stage + uint32_t(S::kATile), kt == 0);
        wgmma_wait<1>();  // the MMAs of the K tile before are done: release its stage in both CTAs
        pin(acc);
        if (kt > 0 && (tid & 127) == 0) {
          const uint32_t bar = empty0 + 8u * uint32_t((it - 1) % kStages);
          mbarrier_arrive_cluster(bar, 0);
          mbarrier_arrive_cluster(bar, 1);
        }
      }
      wgmma_wait<0>();
      pin(acc);
      if (k_tiles > 0 && (tid & 127) == 0) {  // the tile's last stage, before its results are stored
        const uint32_t bar = empty0 + 8u * uint32_t((it - 1) % kStages);
        mbarrier_arrive_cluster(bar, 0);
        mbarrier_arrive_cluster(bar, 1);
      }
      store_block<128, kAhead, false>(p, t.group, acc, wm, (2 * pair + int(rank)) * BN, t.r0, t.r1);
    }
  }
  cluster_sync();  // neither CTA leaves while the other may still copy into it or arrive on it
}

// cuTensorMapEncodeTiled from the driver (no link against libcuda), or null.
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return EncodeTiled(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A BF16 [rows, cols] operand with rows ld bytes apart as a TMA map of 64 x box_rows boxes in the
// 128-byte swizzle, zeros outside; with slice_bytes > 0, a 3-D map [slices][rows][cols] with
// slices slice_bytes apart and boxes of one slice.
bool bf16_map(CUtensorMap& m, const void* base, uint64_t cols, uint64_t rows, uint64_t ld, uint32_t box_rows,
              uint64_t slices = 1, uint64_t slice_bytes = 0) {
  const EncodeTiled fn = encode_tiled();
  if (!fn || rows == 0 || cols == 0 || slices == 0) return false;
  const uint32_t rank = slice_bytes > 0 ? 3 : 2;
  const cuuint64_t dims[3] = {cols, rows, slices}, strides[2] = {ld, slice_bytes};
  const cuuint32_t box[3] = {uint32_t(kBK), box_rows, 1}, elem[3] = {1, 1, 1};
  return fn(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

std::atomic<int64_t> g_tma_launches{0};
// The TMA form's tile order (TmaParams::band_pairs): 8 pairs, 16 column tiles of 128, make the 132
// CTAs resident at once ~8 row tiles x 16 column tiles, whose A (8 x 256 rows) and B (16 x 128
// rows) are about as large.
std::atomic<int> g_tile_band{8};
std::atomic<bool> g_tma_persistent{true};

// The TMA form for BF16 groups of the training tile; false where it does not apply (a K-major B's
// slices not back to back, a map the driver will not encode, no driver entry point), and the
// caller runs wgmma_kernel.
template <bool BT>
bool launch_tma(const GroupedArgs& p) {
  using S = Shape<Format::BF16, kTmaConsumers, 1>;
  TmaParams tp{};
  tp.g = p;
  tp.band_pairs = g_tile_band.load(std::memory_order_relaxed);
  if (!bf16_map(tp.a, p.a.data, uint64_t(p.k_end), uint64_t(p.m), uint64_t(p.a.ld), S::BM / 2)) return false;
  if constexpr (BT) {
    const int64_t slice = p.groups > 1 ? p.b.slice_bytes : int64_t(p.k_end) * p.b.ld;  // one group: any stride
    if (slice <= 0 || !bf16_map(tp.b, p.b.data, uint64_t(p.n), uint64_t(p.k_end), uint64_t(p.b.ld), 64,
                                uint64_t(p.groups), uint64_t(slice)))
      return false;
  } else {
    if (p.b.slice_bytes != int64_t(p.n) * p.b.ld ||
        !bf16_map(tp.b, p.b.data, uint64_t(p.k_end), uint64_t(p.groups) * uint64_t(p.n), uint64_t(p.b.ld), S::BN))
      return false;
  }
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(
        cudaFuncSetAttribute(tma_kernel<BT>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  tp.pairs = int((p.n + 2 * S::BN - 1) / (2 * S::BN));
  tp.rows = int((p.m + S::BM - 1) / S::BM + p.groups);
  const int tiles = tp.pairs * tp.rows;
  // clusters of two CTAs along the columns, asked for at launch (a __cluster_dims__ attribute
  // would not compile for the portable compute_80 code)
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(kTmaThreads);
  cfg.dynamicSmemBytes = S::kSmemBytes;
  cfg.stream = stream();
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = 2;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  // as many clusters as fit on the device at once (one CTA an SM), or one a tile when not persistent
  static const int resident = [&cfg] {
    cudaLaunchConfig_t probe = cfg;
    probe.gridDim = dim3(2 * 1024);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, tma_kernel<BT>, &probe) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = std::max(1, device_sm_count() / 2);
    }
    return n;
  }();
  const int clusters = g_tma_persistent.load(std::memory_order_relaxed) ? std::min(tiles, resident) : tiles;
  cfg.gridDim = dim3(unsigned(2 * clusters));
  // A cluster launch the device refuses (a configuration error, reported at once) leaves the
  // tile to the cp.async form.
  if (cudaLaunchKernelEx(&cfg, tma_kernel<BT>, tp) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  g_tma_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// ---- the TMA form of the K-grouped weight gradients (BF16 operands, either layout) --------------
//
// wgrad_kernel<MN> fed by TMA from one producer thread, persistent: as many CTAs as there are
// SMs, each looping over (output tile, problem) pairs with one ring of stages, so the next tile's
// first K tiles load while the consumer warpgroups add the last one's sums into C. Every problem
// has its own pair of 2-D maps over its token range only, so TMA zero-fills the K past an
// expert's last token: the bits of the cp.async form, which zero-fills it too, from the same
// m64n128k16 chain (mma_k_tile<MN, MN>) over the same 64-wide K tiles. MN-major (the bf16
// recipe's token-major dY and X): A_j is k_j rows of m values, B_j k_j rows of n values, and a
// stage is A's four 64-value panels and B's two, as load_tile_mn lays them. K-major (the decoded
// Col-axis MXFP8 operands of the quantized recipes, [m, T] and [n, T] with an expert's tokens a
// column range): A_j is m rows of k_j values, B_j n rows, one box of 64 K values x 256 (A) or
// 128 (B) rows each, 128-byte rows in the 128-byte swizzle, as load_tile lays them.
constexpr int kMaxTmaKProblems = 32;  // a launch's (the maps travel as kernel parameters: ~8 KB)

struct TmaWgradParams {
  CUtensorMap a[kMaxTmaKProblems];  // A_j: [k_j, m] BF16 (MN-major) or [m, k_j] (K-major), 128-byte swizzle
  CUtensorMap b[kMaxTmaKProblems];  // B_j: [k_j, n] or [n, k_j]
  float* c[kMaxTmaKProblems];
  int k[kMaxTmaKProblems];
  int m, n, count, tiles_m, tiles_n;
  int64_t ldc;  // floats
  bool accumulate;
};

constexpr int kWgradConsumers = 4, kWgradThreads = 128 * kWgradConsumers + 32;  // + the producer warp

template <bool MN>
__global__ void __launch_bounds__(kWgradThreads, 1) tma_wgrad_kernel(const __grid_constant__ TmaWgradParams tp) {
  using S = Shape<Format::BF16, kWgradConsumers, 1>;  // 256 x 128 tiles
  constexpr int BM = S::BM, BN = S::BN;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = int(threadIdx.x);
  const int per_problem = tp.tiles_m * tp.tiles_n, tiles = per_problem * tp.count;
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const uint32_t full0 = smem_address(&full[0]), empty0 = smem_address(&empty[0]);
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbarrier_init(full0 + 8u * st, 1);
      mbarrier_init(empty0 + 8u * st, kWgradConsumers);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  // tile t: problem t / per_problem, then row tiles fastest
  auto tile_of = [&](int t, int& j, int& m0, int& n0) {
    j = t / per_problem;
    const int r = t % per_problem;
    m0 = (r % tp.tiles_m) * BM;
    n0 = (r / tp.tiles_m) * BN;
  };

  if (tid >= 128 * kWgradConsumers) {  // the producer: one thread issues every copy
    if (tid != 128 * kWgradConsumers) return;
    int it = 0;
    for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
      int j, m0, n0;
      tile_of(t, j, m0, n0);
      const int k_tiles = (tp.k[j] + kBK - 1) / kBK;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int st = it % kStages, round = it / kStages;
        if (round > 0) mbarrier_wait(empty0 + 8u * st, uint32_t(round - 1) & 1u);
        const uint32_t stage = sbase + uint32_t(st * S::kStageBytes), bar = full0 + 8u * st;
        mbarrier_arrive_expect_tx(bar, uint32_t(S::kATile + S::kBTile));
        const int k0 = kt * kBK;
        if constexpr (MN) {
#pragma unroll
          for (int i = 0; i < BM / 64; ++i) tma_load_2d(stage + uint32_t(i * kPanel), &tp.a[j], m0 + 64 * i, k0, bar);
#pragma unroll
          for (int i = 0; i < BN / 64; ++i)
            tma_load_2d(stage + uint32_t(S::kATile + i * kPanel), &tp.b[j], n0 + 64 * i, k0, bar);
        } else {
          tma_load_2d(stage, &tp.a[j], k0, m0, bar);
          tma_load_2d(stage + uint32_t(S::kATile), &tp.b[j], k0, n0, bar);
        }
      }
    }
    return;
  }
  const int wm = tid >> 7, t128 = tid & 127;
  int it = 0;
  for (int t = int(blockIdx.x); t < tiles; t += int(gridDim.x)) {
    int j, m0, n0;
    tile_of(t, j, m0, n0);
    const int k_tiles = (tp.k[j] + kBK - 1) / kBK;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    if (k_tiles == 0 && tp.accumulate) continue;  // no tokens: C unchanged (or zeroed below)
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int st = it % kStages;
      mbarrier_wait(full0 + 8u * st, uint32_t(it / kStages) & 1u);
      const uint32_t stage = sbase + uint32_t(st * S::kStageBytes);
      // this warpgroup's 64 rows of A: 8 KB on (one MN-major panel, or 64 K-major rows)
      mma_k_tile<MN, MN>(acc, stage + uint32_t(wm * kPanel), stage + uint32_t(S::kATile), kt == 0);
      wgmma_wait<1>();  // the MMAs of the K tile before are done: release its stage
      pin(acc);
      if (kt > 0 && t128 == 0) mbarrier_arrive(empty0 + 8u * uint32_t((it - 1) % kStages));
    }
    wgmma_wait<0>();
    pin(acc);
    if (k_tiles > 0 && t128 == 0) mbarrier_arrive(empty0 + 8u * uint32_t((it - 1) % kStages));
    store_wgrad_block(acc, tp.c[j], tp.ldc, tp.m, tp.n, m0, n0, wm, tp.accumulate);
  }
}

std::atomic<bool> g_wgrad_tma{true};
std::atomic<int64_t> g_wgrad_tma_launches{0};

// The TMA form of up to kMaxTmaKProblems problems; false where it does not apply (a map the
// driver will not encode, strides off TMA's 16-byte grain, a launch refused), and the caller runs
// wgrad_kernel<MN>.
template <bool MN>
bool launch_tma_wgrad(const KGroupedArgs& p) {
  using S = Shape<Format::BF16, kWgradConsumers, 1>;
  if (p.count > kMaxTmaKProblems) return false;
  // ~8 KB of kernel parameters: kept off the stack
  static thread_local TmaWgradParams tp;
  tp = TmaWgradParams{};
  tp.m = p.m;
  tp.n = p.n;
  tp.count = p.count;
  tp.ldc = p.ldc;
  tp.accumulate = p.accumulate;
  tp.tiles_m = (p.m + S::BM - 1) / S::BM;
  tp.tiles_n = (p.n + S::BN - 1) / S::BN;
  for (int j = 0; j < p.count; ++j) {
    const KProblemArgs& q = p.prob[j];
    tp.c[j] = q.c;
    tp.k[j] = q.k;
    if (q.k == 0) continue;  // no copies: its tiles only store zeros, or nothing
    if (q.lda % 16 != 0 || q.ldb % 16 != 0) return false;
    const bool mapped =
        MN ? bf16_map(tp.a[j], q.a, uint64_t(p.m), uint64_t(q.k), uint64_t(q.lda), 64) &&
                 bf16_map(tp.b[j], q.b, uint64_t(p.n), uint64_t(q.k), uint64_t(q.ldb), 64)
           : bf16_map(tp.a[j], q.a, uint64_t(q.k), uint64_t(p.m), uint64_t(q.lda), S::BM) &&
                 bf16_map(tp.b[j], q.b, uint64_t(q.k), uint64_t(p.n), uint64_t(q.ldb), S::BN);
    if (!mapped) return false;
  }
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(
        cudaFuncSetAttribute(tma_wgrad_kernel<MN>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  const int tiles = tp.tiles_m * tp.tiles_n * tp.count;
  const int ctas = std::min(tiles, device_sm_count());
  if (ctas <= 0) return true;
  tma_wgrad_kernel<MN><<<unsigned(ctas), kWgradThreads, S::kSmemBytes, stream()>>>(tp);
  if (cudaGetLastError() != cudaSuccess) return false;  // e.g. parameters over the device's limit
  g_wgrad_tma_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

template <Format F, int WGM, int WGN, bool BT, int ST = kStages, int WN = 128>
void launch_shape(const GroupedArgs& p) {
  using S = Shape<F, WGM, WGN, ST, WN>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(wgmma_kernel<F, WGM, WGN, BT, ST, WN>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  const dim3 grid(unsigned((p.n + S::BN - 1) / S::BN), unsigned((p.m + S::BM - 1) / S::BM + p.groups));
  wgmma_kernel<F, WGM, WGN, BT, ST, WN><<<grid, S::kThreads, S::kSmemBytes, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

std::atomic<int> g_decode_width{0};

// set_grouped_decode_width's value for the streaming kernel (each warp 16 weight rows wide).
constexpr int kStreamWidth = 16;

// The streaming kernel, its tokens in n8 blocks: one where groups average at most 4 rows, two up to
// 8, else four (a group of more rows than a CTA's takes several CTAs, each reading its weights
// again, mostly from L2). Any choice gives the same bits.
template <Format F, int J>
void launch_stream_j(const GroupedArgs& p) {
  using S = streaming::Shape<F, J>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(streaming::stream_kernel<F, J>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            S::smem_bytes(S::kMaxChunk)));
    return true;
  }();
  (void)attr;
  const int k_tiles = (p.k_end - p.k_begin + 63) / 64;
  const int chunk = std::max(1, std::min(k_tiles, S::kMaxChunk));
  const dim3 grid(unsigned((p.n + streaming::BN - 1) / streaming::BN), unsigned((p.m + S::BM - 1) / S::BM + p.groups));
  streaming::stream_kernel<F, J><<<grid, streaming::kThreads, S::smem_bytes(chunk), stream()>>>(p, chunk);
  FOURBIT_LAUNCH_CHECK();
}
template <Format F>
void launch_stream(const GroupedArgs& p, int64_t rows_per_group) {
  if (rows_per_group <= 4) launch_stream_j<F, 1>(p);
  else if (rows_per_group <= 8) launch_stream_j<F, 2>(p);
  else launch_stream_j<F, 4>(p);
}

// The decode configuration: the streaming kernel where groups average at most kStreamRows rows;
// above, the 64 x WN tiles of one warpgroup, 128 columns where that gives every SM a CTA (the row
// tiles with rows times the column tiles), else 32, so that a decode step's few weight matrices
// are streamed by 4x the CTAs. Measured on the H200 (gpu_grouped_gemm's decode table, gpu-small's
// w1|w3): the streaming kernel takes 0.6 (BF16) and 0.4 (NVFP4) of the best tile's time at batch
// 1, 0.4 (NVFP4) at batch 16 and 64 (BF16 there: 1.0, 1.2), and 3x BF16's at 32 rows a group
// (batch 256), where a group's rows take several CTAs; in the sampler it gains at every batch up
// to 64. At batch 1 the 32-wide tile takes 0.74 (BF16) to 0.56 (NVFP4) of the 64 x 256 tile's
// time; where the 128-wide tile fills the GPU the narrower ones are 2x slower (each CTA's fixed
// cost and its K-long chain of barriers, not the weights' bytes, bound these tiles). Packed
// (block-scaled) operands take the streaming kernel up to 64 rows a group: it decodes each weight
// once per 32 rows where a tile decodes it per 64 x WN block on the warpgroup that issues the
// MMAs; at 32 rows a group (batch 256) NVFP4 took 0.75 of the best tile's time, and a linear
// layer's one group of 64 MXFP8 rows on the 64 x 32 tile made the sampler's decode step 18%
// slower than cuBLASLt on BF16 decodes. Row tiles with rows: counted from host offsets; with
// device offsets at most min(G, M).
constexpr int64_t kStreamRows = 16, kStreamRowsPacked = 64;
int decode_width(const GroupedArgs& p, int64_t rows_per_group, bool packed) {
  const int forced = g_decode_width.load(std::memory_order_relaxed);
  if (forced != 0) return forced;
  if (rows_per_group <= (packed ? kStreamRowsPacked : kStreamRows)) return kStreamWidth;
  int64_t tiles = 0;
  if (p.offsets) tiles = std::min<int64_t>(p.groups, p.m);
  else
    for (int g = 0; g < p.groups; ++g) tiles += (int64_t(p.host_offsets[g + 1]) - p.host_offsets[g] + 63) / 64;
  return tiles * ((p.n + 127) / 128) >= device_sm_count() ? 128 : 32;
}

// Where the 256 x 128 tiles of groups of more than 64 rows would not give every SM one (host
// offsets: a linear layer's one group of a few hundred rows, the sampler's prefill, or 256 and
// 260 columns: gpu-small's K/V projections and LM head), the 64 x 128 tiles of one warpgroup, 4x
// as many: at 256 rows of one group the training tile's 8 CTAs made the sampler's decode step
// 14% slower than cuBLASLt. Up to 1024 rows (decode and prefill): in the training step (8192 rows,
// 256 columns) they took 22 us where cuBLASLt's 256 x 128 tile takes 10. With device offsets (the
// training step's experts) the rows are not known here: the training tile.
constexpr int64_t kNarrowMaxRows = 1024;
std::atomic<bool> g_narrow_tiles{true};
bool few_training_tiles(const GroupedArgs& p) {
  if (p.offsets || p.m > kNarrowMaxRows || !g_narrow_tiles.load(std::memory_order_relaxed)) return false;
  int64_t tiles = 0;
  for (int g = 0; g < p.groups; ++g) tiles += (int64_t(p.host_offsets[g + 1]) - p.host_offsets[g] + 255) / 256;
  return tiles * ((p.n + 127) / 128) < device_sm_count();
}

// 256 x 128 tiles for training shapes (BF16 ones fed by TMA where `tma`); where the groups average
// at most 64 rows (decode), the streaming kernel or 64 x WN tiles of one warpgroup (decode_width;
// the MN-major B form 128 wide), each CTA streaming a slice of the weights over the whole of K;
// or, forced (set_grouped_decode_width(-1)), the 64 x 256 tiles of two warpgroups. The same k16
// steps in K order in every case: the same bits, and for an MN-major B the bits of its K-major copy.
template <Format F, bool BT>
void launch_format(const GroupedArgs& p, int64_t rows_per_group, bool tma) {
  if (rows_per_group > 64 && few_training_tiles(p)) {
    hopper::launch_shape<F, 1, 1, BT, decode_stages(128), 128>(p);
    return;
  }
  if (rows_per_group > 64) {
    if (!(F == Format::BF16 && tma && launch_tma<BT>(p))) hopper::launch_shape<F, 4, 1, BT>(p);
    return;
  }
  const int w = decode_width(p, rows_per_group, F != Format::BF16);
  if (w == kStreamWidth && !BT && (p.m + 7) / 8 + p.groups <= 65535) launch_stream<F>(p, rows_per_group);
  else if (w < 0) hopper::launch_shape<F, 1, 2, BT>(p);
  else if (BT || w >= 128) hopper::launch_shape<F, 1, 1, BT, decode_stages(128), 128>(p);
  else hopper::launch_shape<F, 1, 1, false, decode_stages(32), 32>(p);
}

}  // namespace hopper

template <Format F, int BM>
void launch_shape(const GroupedArgs& p) {
  using T = Shape<F, BM>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(
        cudaFuncSetAttribute(grouped_kernel<F, BM>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
    return true;
  }();
  (void)attr;
  const dim3 grid(unsigned((p.n + kBN - 1) / kBN), unsigned((p.m + BM - 1) / BM + p.groups));
  grouped_kernel<F, BM><<<grid, kThreads, T::kSmemBytes, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

// The row tile: 16 rows where the groups average at most 16 (decode), 64 up to 64, else 128.
// Any choice gives the same bits (Shape).
template <Format F>
void launch_format(const GroupedArgs& p, int64_t rows_per_group) {
  if (rows_per_group <= 16) launch_shape<F, 16>(p);
  else if (rows_per_group <= 64) launch_shape<F, 64>(p);
  else launch_shape<F, 128>(p);
}

std::atomic<bool> g_wgmma{true}, g_tma{true};

// Writes 1 where the code the device runs was compiled with sm_90a's features (wgmma), 0 where it
// was not (a plain sm_90 build, or the portable PTX JIT-compiled): the wgmma wrappers trap there.
__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

// Whether this device runs the wgmma loop: compute capability 9.x, and its code has sm_90a's
// features (probed once, one synchronisation).
bool hopper_device() {
  static const bool yes = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major != 9) {
      cudaGetLastError();
      return false;
    }
    int* flag = nullptr;
    int host = 0;
    bool ok = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (ok) {
      wgmma_probe_kernel<<<1, 1, 0, stream()>>>(flag);
      ok = cudaGetLastError() == cudaSuccess &&
           cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream()) == cudaSuccess &&
           cudaStreamSynchronize(stream()) == cudaSuccess;
      cudaFree(flag);
    }
    cudaGetLastError();
    return ok && host == 1;
  }();
  return yes;
}

// An MN-major B (BF16 only, accepted on Hopper only: grouped_gemm_rows) runs the wgmma loop's BT form.
template <Format F>
void launch_any(const GroupedArgs& p, int64_t rows_per_group) {
  const bool tma = g_tma.load(std::memory_order_relaxed);
  if constexpr (F == Format::BF16) {
    if (p.b.trans) return hopper::launch_format<F, true>(p, rows_per_group, tma);
  }
  if (g_wgmma.load(std::memory_order_relaxed) && hopper_device()) hopper::launch_format<F, false>(p, rows_per_group, tma);
  else launch_format<F>(p, rows_per_group);
}

void launch(Format fmt, GroupedArgs& p, int64_t rows_per_group, const char* op) {
  p.err = index_error_record();
  const int64_t row_tiles = (p.m + 15) / 16 + p.groups;
  if (row_tiles > 65535)
    fail("{}: {} row tiles exceed the grid's 65535 (M = {}, G = {})", op, row_tiles, p.m, p.groups);
  switch (fmt) {
    case Format::BF16: launch_any<Format::BF16>(p, rows_per_group); break;
    case Format::NVFP4: launch_any<Format::NVFP4>(p, rows_per_group); break;
    case Format::MXFP8_E4M3: launch_any<Format::MXFP8_E4M3>(p, rows_per_group); break;
    case Format::MXFP8_E5M2: launch_any<Format::MXFP8_E5M2>(p, rows_per_group); break;
    default: fail("{}: no grouped kernel for {}", op, format_name(fmt));
  }
}

OperandArgs operand_args(const GroupedOperand& o) {
  OperandArgs a{};
  a.data = static_cast<const unsigned char*>(o.data);
  a.scales = o.block_scales;
  a.outer = o.outer;
  a.ld = o.ld_bytes;
  a.slice_bytes = o.slice_bytes;
  a.scale_ld = o.scale_ld;
  a.scale_slice = o.scale_slice;
  a.outer_stride = o.outer_stride;
  a.outer_group_stride = o.outer_group_stride;
  a.trans = o.trans;
  return a;
}

GroupedArgs make_args(const GroupedOperand& a, const GroupedOperand& b, float* c, int64_t ldc, int64_t m, int64_t n,
                      int64_t k_begin, int64_t k_end, int64_t groups, bool accumulate) {
  GroupedArgs p{};
  p.a = operand_args(a);
  p.b = operand_args(b);
  p.c = c;
  p.ldc = ldc;
  p.m = m;
  p.n = int(n);
  p.k_begin = int(k_begin);
  p.k_end = int(k_end);
  p.groups = int(groups);
  p.accumulate = accumulate;
  return p;
}

}  // namespace

int64_t grouped_rows_per_group(const std::vector<int64_t>& offsets) {
  int64_t filled = 0;
  for (size_t g = 1; g < offsets.size(); ++g) filled += offsets[g] > offsets[g - 1];
  const int64_t M = offsets.empty() ? 0 : offsets.back() - offsets.front();
  return filled ? (M + filled - 1) / filled : 0;
}

bool grouped_gemm_rows(const GroupedOperand& a, const GroupedOperand& b, const std::vector<int64_t>& offsets,
                       int64_t n, int64_t k, float* c, int64_t ldc, bool accumulate) {
  const int64_t G = int64_t(offsets.size()) - 1, M = offsets.empty() ? 0 : offsets.back();
  const auto aligned = [](const void* q, uintptr_t to) { return (reinterpret_cast<uintptr_t>(q) % to) == 0; };
  const auto fits = [&](const GroupedOperand& o) {
    if (o.fmt != a.fmt || o.ld_bytes % 16 != 0 || o.slice_bytes % 16 != 0 || !aligned(o.data, 16)) return false;
    if (o.fmt == Format::BF16) return true;
    return o.scale_ld % 4 == 0 && o.scale_slice % 4 == 0 && aligned(o.block_scales, 4);
  };
  const bool formats = a.fmt == Format::BF16 || a.fmt == Format::NVFP4 || a.fmt == Format::MXFP8_E4M3 ||
                       a.fmt == Format::MXFP8_E5M2;
  if (G < 1 || G > kMaxHostGroups || !formats || !fits(a) || !fits(b) || k % (a.fmt == Format::BF16 ? 8 : 32) != 0 ||
      M > INT32_MAX || n > INT32_MAX || k > INT32_MAX || offsets.front() != 0 || a.trans)
    return false;
  // An MN-major B: BF16 on the wgmma loop only, whole 16-byte chunks of N
  if (b.trans && (b.fmt != Format::BF16 || n % 8 != 0 || b.ld_bytes < 2 * n || !g_wgmma.load(std::memory_order_relaxed) ||
                  !hopper_device()))
    return false;
  if (M == 0 || n == 0) return true;
  GroupedArgs p = make_args(a, b, c, ldc, M, n, 0, k, G, accumulate);
  for (int64_t g = 0; g <= G; ++g) p.host_offsets[g] = int32_t(offsets[size_t(g)]);
  launch(a.fmt, p, grouped_rows_per_group(offsets), "grouped_gemm");
  return true;
}

bool grouped_gemm_k(bool mn_major, const std::vector<KGroupedProblem>& problems, int64_t m, int64_t n, int64_t ldc,
                    bool accumulate) {
  if (!g_wgmma.load(std::memory_order_relaxed) || !hopper_device()) return false;
  const auto aligned = [](const void* q, uintptr_t to) { return (reinterpret_cast<uintptr_t>(q) % to) == 0; };
  if (m < 1 || n < 1 || m > INT32_MAX || n > INT32_MAX || n % 2 != 0 || ldc % 2 != 0 || ldc < n) return false;
  if (mn_major && (m % 8 != 0 || n % 8 != 0)) return false;
  for (const KGroupedProblem& q : problems)
    if (q.k < 0 || q.k > INT32_MAX || !aligned(q.a, 16) || !aligned(q.b, 16) || !aligned(q.c, 8) || q.lda % 8 != 0 ||
        q.ldb % 8 != 0 || (!mn_major && q.k % 8 != 0))
      return false;
  // the TMA form takes up to kMaxTmaKProblems a launch (its maps are kernel parameters)
  const bool tma = hopper::g_wgrad_tma.load(std::memory_order_relaxed);
  const size_t per_launch = size_t(tma ? hopper::kMaxTmaKProblems : kMaxKProblems);
  for (size_t first = 0; first < problems.size(); first += per_launch) {
    KGroupedArgs p{};
    p.m = int(m);
    p.n = int(n);
    p.ldc = ldc;
    p.accumulate = accumulate;
    p.count = int(std::min(problems.size() - first, per_launch));
    for (int j = 0; j < p.count; ++j) {
      const KGroupedProblem& q = problems[first + size_t(j)];
      p.prob[j] = KProblemArgs{static_cast<const unsigned char*>(q.a), static_cast<const unsigned char*>(q.b), q.c,
                               2 * q.lda, 2 * q.ldb, int(q.k)};
    }
    if (mn_major) {
      if (!tma || !hopper::launch_tma_wgrad<true>(p)) hopper::launch_wgrad<true>(p);
    } else if (!tma || !hopper::launch_tma_wgrad<false>(p)) {
      hopper::launch_wgrad<false>(p);
    }
  }
  return true;
}

void grouped_gemm_bf16(const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& c, bool accumulate,
                       int64_t k_begin, int64_t k_end) {
  const char* op = "grouped_gemm_bf16";
  check_cuda_tensor(a, op, "a");
  check_cuda_tensor(b, op, "b");
  check_cuda_tensor(offsets, op, "offsets");
  check_cuda_tensor(c, op, "c");
  if (a.dtype() != DType::BF16 || a.dim() != 2) fail("{}: a must be a BF16 [M, K] tensor, got {}", op, a.str());
  if (b.dtype() != DType::BF16 || b.dim() != 3) fail("{}: b must be a BF16 [G, N, K] tensor, got {}", op, b.str());
  if (offsets.dtype() != DType::I32 || offsets.dim() != 1 || offsets.size(0) != b.size(0) + 1)
    fail("{}: offsets must be an I32 [G + 1] = [{}] tensor, got {}", op, b.size(0) + 1, offsets.str());
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(1);
  if (b.size(2) != K) fail("{}: b is {} but a has K = {}", op, b.str(), K);
  if (c.dtype() != DType::F32 || c.dim() != 2 || c.size(0) != M || c.size(1) != N)
    fail("{}: c must be an F32 [{}, {}] tensor, got {}", op, M, N, c.str());
  if (k_end < 0) k_end = K;
  if (K % 8 != 0) fail("{}: K = {} must be a multiple of 8 (16-byte rows of BF16)", op, K);
  if (k_begin < 0 || k_begin > k_end || k_end > K || k_begin % 8 != 0 || k_end % 8 != 0)
    fail("{}: K range [{}, {}) must lie in [0, {}] with multiples of 8 as bounds", op, k_begin, k_end, K);
  if (N > INT32_MAX || K > INT32_MAX || G > INT32_MAX / 2) fail("{}: N = {}, K = {} or G = {} too large", op, N, K, G);
  if (M == 0 || N == 0 || G == 0) return;
  if (M > INT32_MAX) fail("{}: M = {} rows exceed the I32 offsets' range", op, M);
  GroupedArgs p = make_args(GroupedOperand::bf16(a.raw(), K, 0), GroupedOperand::bf16(b.raw(), K, N * K),
                            static_cast<float*>(c.raw()), N, M, N, k_begin, k_end, G, accumulate);
  p.offsets = static_cast<const int32_t*>(offsets.raw());
  launch(Format::BF16, p, (M + G - 1) / G, op);
}

void set_grouped_wgmma(bool on) { g_wgmma.store(on, std::memory_order_relaxed); }

void set_grouped_tma(bool on) { g_tma.store(on, std::memory_order_relaxed); }

void set_grouped_decode_width(int width) {
  if (width != 0 && width != -1 && width != hopper::kStreamWidth && width != 32 && width != 128)
    fail("set_grouped_decode_width: {} is not 0 (chosen per call), -1 (the 64 x 256 tile), {} (the streaming "
         "kernel), 32 or 128", width, hopper::kStreamWidth);
  hopper::g_decode_width.store(width, std::memory_order_relaxed);
}

void set_grouped_narrow_tiles(bool on) { hopper::g_narrow_tiles.store(on, std::memory_order_relaxed); }

void set_grouped_tma_persistent(bool on) { hopper::g_tma_persistent.store(on, std::memory_order_relaxed); }

void set_grouped_wgrad_tma(bool on) { hopper::g_wgrad_tma.store(on, std::memory_order_relaxed); }

int64_t grouped_wgrad_tma_launches() { return hopper::g_wgrad_tma_launches.load(std::memory_order_relaxed); }

void set_grouped_tile_band(int pairs) { hopper::g_tile_band.store(std::max(0, pairs), std::memory_order_relaxed); }

int64_t grouped_tma_launches() { return hopper::g_tma_launches.load(std::memory_order_relaxed); }

bool wgmma_available() { return hopper_device(); }

void check_recorded_index_errors() { check_index_errors(); }

}  // namespace fourbit::ops::cuda
