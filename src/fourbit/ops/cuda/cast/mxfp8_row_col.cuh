// defines: kPairSegsPerLaunch, PairSegment, PairOut, PairParams, PlainSource, GatherSource,
//          CombineGradSource, SwigluSource, SwigluGradSource, source_value, mxfp8_row_col_kernel,
//          PairSegmentOut, PairOutput, raw_or_null, launch_mxfp8_row_col, row_col_tile, PairJob,
//          pair_job_slice_ctas, mxfp8_row_col_jobs_kernel, launch_mxfp8_row_col_jobs
// MXFP8 on both axes of F32 values in one pass: the Row-axis form of every row (a GEMM's X or
// dY) and the Col-axis form of each row segment (the weight gradient's X^T or dY^T: the whole
// tensor, or the experts' token ranges with their own SR keys), each optionally with its exact
// BF16 decode for the GEMM that reads it next, and each form's codes optionally left out where
// only that decode is read. The values come from a source: an F32 tensor read once
// (PlainSource; the two separate kernels, mxfp8_row_fast and mxfp8_col_fast, read it twice), its
// rows gathered (GatherSource: the experts' dispatched tokens, gather_rows' x_perm, which is then
// never written), moe_combine_backward's dy_perm (CombineGradSource: each slot's row of the
// output gradient times its routing weight), swiglu_forward's a computed from h1 and h3 (SwigluSource), or swiglu_backward's dh1 and dh3
// computed from da, h1 and h3 (SwigluGradSource, two outputs): computed values are never written
// in F32 nor read back.
#pragma once
#include <algorithm>
#include <type_traits>
#include <vector>

#include "fourbit/ops/cuda/block_decode.cuh"
#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/row_math.cuh"

namespace fourbit::ops::cuda {
namespace {

// A CTA takes one block row (32 logical rows) of one segment and kThreads tile columns: all of
// one output's (one output), or 128 of each of two outputs' (the tile's first and last 128
// columns: dh1's and dh3's at the same columns). Thread t holds tile column t's 32 values: loaded
// (or computed from loads) with scalar loads that a warp makes into 128-byte rows (PlainSource,
// GatherSource, CombineGradSource, SwigluSource), or read back from the shared tile where SwigluGradSource computed them (each
// thread one column's 16 rows of both outputs, one sigmoid a pair, as swiglu_backward). It quantizes them as the Col-axis block
// (mxfp8_col_fast's counters and layout) and leaves them in a shared tile; then each thread
// takes one (row, 32-column block) of the tile and quantizes it as the Row-axis block
// (mxfp8_row_fast's counters and layout). Both go through mxfp8_fast_words, so the codes and
// scales are those of the separate kernels, and the BF16 decodes are block_decode.cuh's.
// The codes and then the decodes go through shared memory (the tile's bytes again) so that the
// global stores are whole 32-byte sectors: 16 consecutive threads write a row's 256 codes, 32
// its 512 decode bytes; 2 (4) write a column's 32 codes (decodes).
//
// The tile holds row i's column c at float i * kPairLd + 32 b + 4 ((q + b) & 7) + e for c = 32 b +
// 4 q + e: a warp's column stores of one row permute the 32 words of one block (no conflict), and
// the eight threads of a quarter-warp, which read the same logical chunk q of blocks 0..7 of one
// row as float4s, land on eight different 4-bank groups ((i + q + b) mod 8, kPairLd / 4 odd). The
// staging rows are padded by 16 bytes, and a thread stores its 16-byte chunks in an order rotated
// by its block, so that the eight threads of a quarter-warp hit eight different 4-bank groups.
constexpr int kPairCols = kThreads;                     // tile columns per CTA
constexpr int kPairBlocks = kPairCols / num::kMxBlock;  // Row-axis blocks per tile row
constexpr int kPairLd = kPairCols + 4;
constexpr int kPairSegsPerLaunch = 32;
constexpr int kComputeRows = 4;  // a computed source's rows a group (its loads, then its arithmetic)
static_assert(kPairBlocks == 8 && num::kMxBlock * kPairBlocks == kThreads,
              "one (row, block) of the 32 x kThreads tile per thread, eight blocks a row");
static_assert((kPairLd / 4) % 8 == 1, "rows of the tile start one 16-byte chunk apart modulo eight");
// Output staging, in bytes, in two rounds (the codes, then the BF16 decodes), each holding the
// columns' parts and then the rows': a column's 32 codes (BF16) and a row's 256 codes (BF16),
// each + 16 bytes of padding. Two rounds rather than all four at once keep the CTA's shared
// memory at 36.5 KB instead of 57 KB: four CTAs an SM rather than three, so that one CTA's loads
// (or a computed source's arithmetic) overlap another's.
constexpr int kColCodeLd = num::kMxBlock + 16, kRowCodeLd = kPairCols + 16;
constexpr int kColBf16Ld = 2 * num::kMxBlock + 16, kRowBf16Ld = 2 * kPairCols + 16;
constexpr int kStageRows = kPairCols * kColBf16Ld;  // where a round's row parts start
constexpr int kPairSmem = std::max(int(num::kMxBlock * kPairLd * sizeof(float)), kStageRows + num::kMxBlock * kRowBf16Ld);
static_assert(kPairCols * kColCodeLd <= kStageRows && kPairSmem <= 37 * 1024, "the staging rounds' layout");

// Tile column c's float in row i of the tile.
__device__ __forceinline__ int pair_tile_index(int i, int c) {
  const int b = c / num::kMxBlock, q = (c % num::kMxBlock) / 4, e = c % 4;
  return i * kPairLd + num::kMxBlock * b + 4 * ((q + b) & 7) + e;
}

struct PairSegment {
  int64_t x_row0, rows;    // the segment's rows of the source
  int64_t at;              // padded rows of the segments before it: its Col forms start at cols * at
  int64_t counter_row0;    // SR counters: storage row counter_row0 + j for column j (slice s of a
                           // 3-D input: s * cols, as the 3-D tensor's Col-axis quantizer counts)
  uint64_t seed[2], stream[2];  // per output
  int64_t cta0;            // the segment's first CTA
};
// One output's forms (each pointer null where that part is not written).
struct PairOut {
  uint8_t* row_codes;       // Row form: [rows, row_padded_cols]
  uint8_t* row_scales;      // [rows, row_nb]
  __nv_bfloat16* row_bf16;  // [rows, row_padded_cols]
  uint64_t row_seed, row_stream;
  uint8_t* col_codes;       // Col forms: a segment's storage [cols, its padded rows] at cols * at
  uint8_t* col_scales;      // [cols, padded rows / 32] at cols * at / 32
  __nv_bfloat16* col_bf16;  // [cols, padded rows] at cols * at
  __nv_bfloat16* col_bf16_rows;  // the Col forms' decodes in the rows' layout: [rows, cols], row r at r
};
// The values' source: an F32 tensor of `ld` floats a row, or swiglu_backward's gradients.
struct PlainSource {
  const float* x;
  int64_t ld;
};
struct GatherSource {  // row s of x_perm = x[rows[s]] (gather_rows)
  const float* x;        // [n, ld]
  const int32_t* rows;
  int64_t ld, n;
  IndexError* err;
};
struct CombineGradSource {  // moe_combine_backward's dy_perm: row s = w[a] dout[a / k], a the assignment of slot s
  const float* dout;  // [N, ld]
  const int32_t* owner;  // [M]: the assignment of each slot, -1 for none
  const float* w;        // [N k]
  int64_t ld, k;
};
struct SwigluSource {  // swiglu_forward's a
  const float *h1, *h3;  // [rows, ld] each
  int64_t ld;
};
struct SwigluGradSource {
  const float *da, *h1, *h3;  // [rows, ld] each
  int64_t ld;
};
// The rows of a CTA's block row that a source reads through an index (GatherSource,
// CombineGradSource): where row i of the block row starts in the source tensor (-1: a zero row)
// and its routing weight, looked up once a row by the block row's first warp rather than once an
// element (for the combine, that also divides each assignment by k once a row).
struct PairRowTable {
  int64_t base[num::kMxBlock];
  float w[num::kMxBlock];
};
template <class Src>
constexpr bool reads_through_index() {
  return std::is_same_v<Src, GatherSource> || std::is_same_v<Src, CombineGradSource>;
}
// Entry i of the block row's table: source row `row`.
__device__ __forceinline__ void fill_row(const GatherSource& src, int64_t row, PairRowTable& tab, int i) {
  const int32_t n = __ldg(src.rows + row);
  tab.base[i] = n >= 0 && n < src.n ? n * src.ld : -1;  // an id outside x: a zero row
}
__device__ __forceinline__ void fill_row(const CombineGradSource& src, int64_t row, PairRowTable& tab, int i) {
  const int32_t a = __ldg(src.owner + row);
  tab.base[i] = a >= 0 ? int64_t(a / int32_t(src.k)) * src.ld : -1;
  tab.w[i] = a >= 0 ? __ldg(src.w + a) : 0.0f;
}
// Element (row, col) of a source read as loaded (the SwiGLU sources are computed in the kernel,
// their loads grouped ahead of their arithmetic); i: the row's index in its block row (the table's).
template <class Tab>
__device__ __forceinline__ float source_value(const PlainSource& s, const Tab&, int64_t row, int, int64_t col) {
  return __ldg(s.x + row * s.ld + col);
}
__device__ __forceinline__ float source_value(const GatherSource& s, const PairRowTable& tab, int64_t, int i,
                                              int64_t col) {
  const int64_t base = tab.base[i];
  return base >= 0 ? __ldg(s.x + base + col) : 0.0f;
}
__device__ __forceinline__ float source_value(const CombineGradSource& s, const PairRowTable& tab, int64_t, int i,
                                              int64_t col) {
  const int64_t base = tab.base[i];
  return base >= 0 ? num::mul_rn(tab.w[i], __ldg(s.dout + base + col)) : 0.0f;  // as the op's
}
template <class Src>
constexpr int pair_outputs() {
  return std::is_same_v<Src, SwigluGradSource> ? 2 : 1;
}
// The segments are seg[0 .. n), or, with dev_offsets (I32 [groups + 1] on the GPU, the router's
// offsets where it made them), groups first .. first + n of those offsets, whose rows the host
// does not know: seg[i] then holds only group first + i's keys, and a CTA finds its group from the
// offsets (pair_device_segment). rows: the source's rows (an offset past them is clamped).
template <class Src>
struct PairParams {
  Src src;
  int64_t cols, col_chunks, row_padded_cols, row_nb;  // cols: each output's
  num::MxScaleRule row_rule, col_rule;
  PairOut out[2];
  PairSegment seg[kPairSegsPerLaunch];
  int n;
  const int32_t* dev_offsets;
  int first;
  int64_t rows;
};

// Segment `first + i` of the device offsets that CTA `cta` falls in, set out as the host would
// have (its rows, its first CTA, its keys), or false for a CTA past the groups' block rows (the
// launch covers the most they can take: ceil(rows / 32) + n block rows). Read by one thread.
template <class Src>
__device__ inline bool pair_device_segment(const PairParams<Src>& p, int64_t cta, PairSegment& sg) {
  auto at = [&](int g) { return min64(p.rows, int64_t(max(0, __ldg(p.dev_offsets + g)))); };
  int64_t cta0 = 0, r0 = at(p.first);
  for (int i = 0; i < p.n; ++i) {
    const int64_t end = at(p.first + i + 1), r1 = end > r0 ? end : r0;  // a decreasing offset: an empty group
    const int64_t ctas = (r1 - r0 + num::kMxBlock - 1) / num::kMxBlock * p.col_chunks;
    if (cta < cta0 + ctas) {
      sg = p.seg[i];
      sg.x_row0 = r0;
      sg.rows = r1 - r0;
      sg.at = 0;
      sg.counter_row0 = 0;
      sg.cta0 = cta0;
      return true;
    }
    cta0 += ctas;
    r0 = r1;
  }
  return false;
}

// Words 2u and 2u + 1 of a block's eight code words (u = 0..3, known only at run time).
__device__ __forceinline__ uint2 code_pair(const uint32_t (&w)[num::kMxBlock / 4], int u) {
  return u == 0 ? make_uint2(w[0], w[1]) : u == 1 ? make_uint2(w[2], w[3]) : u == 2 ? make_uint2(w[4], w[5])
                                                                                    : make_uint2(w[6], w[7]);
}

// CTA `cta` of a launch over p, in segment sg: its block row there, both forms (the kernels below).
template <int kExpBits, bool kRowSR, bool kColSR, class Src>
__device__ __forceinline__ void row_col_tile(const PairParams<Src>& p, const PairSegment& sg, int64_t cta) {
  constexpr int B = num::kMxBlock;
  constexpr int kOuts = pair_outputs<Src>(), kOutCols = kPairCols / kOuts;  // tile columns an output
  constexpr Format F = kExpBits == 4 ? Format::MXFP8_E4M3 : Format::MXFP8_E5M2;
  extern __shared__ __align__(16) unsigned char pair_smem[];
  float* tile = reinterpret_cast<float*>(pair_smem);
  const int64_t local = cta - sg.cta0, rb = local / p.col_chunks, r0 = rb * B;
  const int64_t c0 = (local % p.col_chunks) * kOutCols;  // each output's first column
  const int t = int(threadIdx.x);
  const int o = t / kOutCols;        // the output of the thread's tile column
  const int64_t j = c0 + t % kOutCols;  // its column there
  const int n_rows = int(min64(B, sg.rows - r0));
  const int64_t padded_rows = ((sg.rows + B - 1) / B) * B;
  const PairOut& out = p.out[o];
  unsigned nonfinite = 0;

  struct NoTable {};
  __shared__ std::conditional_t<reads_through_index<Src>(), PairRowTable, NoTable> tab;
  if constexpr (reads_through_index<Src>()) {
    if (t < n_rows) {
      const int64_t s = sg.x_row0 + r0 + t;
      fill_row(p.src, s, tab, t);
      if constexpr (std::is_same_v<Src, GatherSource>) {  // as gather_rows does: recorded, the row read as zeros
        const int32_t n = p.src.rows[s];
        if (c0 == 0 && (n < 0 || n >= p.src.n))
          record_index_error(p.src.err, IndexSite::GatherQuantizeTokenOfSlot, s, n, p.src.n, 1);
      }
    }
    __syncthreads();
  }
  float v[B];
  if constexpr (std::is_same_v<Src, SwigluSource>) {
    // computed values go to the tile kComputeRows rows at a time, the next rows' loads issued
    // before this group's double arithmetic (so that the two overlap within the thread, where the
    // CTAs of an SM, starting together, would otherwise all load and then all compute), and are
    // read back as the column's block; rows past the source's are zeros (swiglu_value(0, 0) = +0)
    float* col = tile + pair_tile_index(0, t);
    const int64_t row0 = sg.x_row0 + r0;
    float z[2][kComputeRows], u[2][kComputeRows];
    const auto load = [&](int g, float (&zz)[kComputeRows], float (&uu)[kComputeRows]) {
#pragma unroll
      for (int k = 0; k < kComputeRows; ++k) {
        const int i = g * kComputeRows + k;
        const bool live = j < p.cols && i < n_rows;
        const int64_t at = (row0 + i) * p.src.ld + j;
        zz[k] = live ? __ldg(p.src.h1 + at) : 0.0f;
        uu[k] = live ? __ldg(p.src.h3 + at) : 0.0f;
      }
    };
    load(0, z[0], u[0]);
#pragma unroll
    for (int g = 0; g < B / kComputeRows; ++g) {
      if (g + 1 < B / kComputeRows) load(g + 1, z[(g + 1) & 1], u[(g + 1) & 1]);
#pragma unroll
      for (int k = 0; k < kComputeRows; ++k)
        col[(g * kComputeRows + k) * kPairLd] = swiglu_value(z[g & 1][k], u[g & 1][k]);
    }
#pragma unroll
    for (int i = 0; i < B; ++i) v[i] = col[i * kPairLd];
  } else if constexpr (kOuts == 1) {
    if (j < p.cols) {
      const int64_t row0 = sg.x_row0 + r0;
      if (n_rows == B) {
#pragma unroll
        for (int i = 0; i < B; ++i) v[i] = source_value(p.src, tab, row0 + i, i, j);
      } else {
#pragma unroll
        for (int i = 0; i < B; ++i) v[i] = i < n_rows ? source_value(p.src, tab, row0 + i, i, j) : 0.0f;
      }
    } else {
#pragma unroll
      for (int i = 0; i < B; ++i) v[i] = 0.0f;
    }
    float* col = tile + pair_tile_index(0, t);
#pragma unroll
    for (int i = 0; i < B; ++i) col[i * kPairLd] = v[i];
  } else {
    // thread t: column c0 + t % 128 of both outputs, rows 16 (t / 128) .. + 15 of the block row
    // (the next kComputeRows rows' loads in flight during this group's arithmetic, as above)
    const int lc = t % kOutCols, i0 = (t / kOutCols) * (B / 2);
    const int64_t jj = c0 + lc;
    float g[2][kComputeRows], z[2][kComputeRows], u[2][kComputeRows];
    const auto load = [&](int q, float (&gg)[kComputeRows], float (&zz)[kComputeRows], float (&uu)[kComputeRows]) {
#pragma unroll
      for (int k = 0; k < kComputeRows; ++k) {
        const int i = i0 + q * kComputeRows + k;
        const bool live = jj < p.cols && i < n_rows;
        const int64_t at = (sg.x_row0 + r0 + i) * p.src.ld + jj;
        gg[k] = live ? __ldg(p.src.da + at) : 0.0f;
        zz[k] = live ? __ldg(p.src.h1 + at) : 0.0f;
        uu[k] = live ? __ldg(p.src.h3 + at) : 0.0f;
      }
    };
    load(0, g[0], z[0], u[0]);
#pragma unroll
    for (int q = 0; q < B / 2 / kComputeRows; ++q) {
      if (q + 1 < B / 2 / kComputeRows) load(q + 1, g[(q + 1) & 1], z[(q + 1) & 1], u[(q + 1) & 1]);
#pragma unroll
      for (int k = 0; k < kComputeRows; ++k) {
        const int i = i0 + q * kComputeRows + k;
        float d1, d3;  // rows past the source's: swiglu_grads(0, 0, 0) = (+0, +0)
        swiglu_grads(g[q & 1][k], z[q & 1][k], u[q & 1][k], d1, d3);
        tile[pair_tile_index(i, lc)] = d1;
        tile[pair_tile_index(i, kOutCols + lc)] = d3;
      }
    }
    __syncthreads();
    const float* col = tile + pair_tile_index(0, t);
#pragma unroll
    for (int i = 0; i < B; ++i) v[i] = col[i * kPairLd];
  }
  const bool col_live = j < p.cols;
  uint32_t wc[B / 4];
  uint8_t col_scale = 0;
  if (col_live) {  // the Col-axis block: logical rows r0 .. r0 + 31 of column j
    col_scale = mxfp8_fast_words<kExpBits, kColSR>(v, n_rows, p.col_rule, sg.seed[o], sg.stream[o],
                                                   uint64_t((sg.counter_row0 + j) * padded_rows + r0), wc, nonfinite);
    if (out.col_scales) out.col_scales[p.cols * sg.at / B + j * (padded_rows / B) + rb] = col_scale;
  }
  __syncthreads();
  const int i = t / kPairBlocks, b = t % kPairBlocks;
  const int ob = b / (kPairBlocks / kOuts);  // the output of the thread's Row-axis block
  const PairOut& rout = p.out[ob];
  const int64_t blk = c0 / B + b % (kPairBlocks / kOuts), row = sg.x_row0 + r0 + i;
  const bool row_live = i < n_rows && blk < p.row_nb;
  uint32_t wr[B / 4];
  uint8_t row_scale = 0;
  if (row_live) {  // the Row-axis block: columns 32 blk .. + 31 of row r0 + i
    const float* tr = tile + i * kPairLd + B * b;
#pragma unroll
    for (int q = 0; q < B / 4; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(tr + 4 * ((q + b) & 7));
      v[4 * q] = f.x;
      v[4 * q + 1] = f.y;
      v[4 * q + 2] = f.z;
      v[4 * q + 3] = f.w;
    }
    const int64_t col = blk * B;
    row_scale = mxfp8_fast_words<kExpBits, kRowSR>(v, int(min64(B, p.cols - col)), p.row_rule, rout.row_seed,
                                                   rout.row_stream, uint64_t(row * p.row_padded_cols + col), wr,
                                                   nonfinite);
    if (rout.row_scales) rout.row_scales[row * p.row_nb + blk] = row_scale;
  }
  __syncthreads();  // the tile is read: its bytes stage the outputs now

  // Whether a round has anything to write is uniform over the CTA (the launch's pointers).
  bool any_codes = false, any_bf16 = false;
#pragma unroll
  for (int q = 0; q < kOuts; ++q) {
    any_codes |= p.out[q].row_codes || p.out[q].col_codes;
    any_bf16 |= p.out[q].row_bf16 || p.out[q].col_bf16 || p.out[q].col_bf16_rows;
  }
  unsigned char* col_stage = pair_smem;
  unsigned char* row_stage = pair_smem + kStageRows;
  // The global stores: tile column c is column c0 + c % kOutCols of output c / kOutCols.
  if (any_codes) {
    if (col_live && out.col_codes) {
      uint4* d = reinterpret_cast<uint4*>(col_stage + t * kColCodeLd);
      d[0] = make_uint4(wc[0], wc[1], wc[2], wc[3]);
      d[1] = make_uint4(wc[4], wc[5], wc[6], wc[7]);
    }
    if (row_live && rout.row_codes) {
#pragma unroll
      for (int h0 = 0; h0 < 2; ++h0) {
        const int h = (h0 + (b >> 2)) & 1;
        *reinterpret_cast<uint4*>(row_stage + i * kRowCodeLd + B * b + 16 * h) =
            h ? make_uint4(wr[4], wr[5], wr[6], wr[7]) : make_uint4(wr[0], wr[1], wr[2], wr[3]);
      }
    }
    __syncthreads();
    for (int k = t; k < 2 * kPairCols; k += kThreads) {  // column c0 + k / 2: two halves of its 32 codes
      const int c = k >> 1, h = k & 1;
      const PairOut& w = p.out[c / kOutCols];
      const int64_t jc = c0 + c % kOutCols;
      if (w.col_codes && jc < p.cols)
        *reinterpret_cast<uint4*>(w.col_codes + p.cols * sg.at + jc * padded_rows + r0 + 16 * h) =
            *reinterpret_cast<const uint4*>(col_stage + c * kColCodeLd + 16 * h);
    }
    for (int k = t; k < B * (kPairCols / 16); k += kThreads) {  // row k / 16: sixteen chunks of 16 codes
      const int r = k / (kPairCols / 16), part = k % (kPairCols / 16);
      const PairOut& w = p.out[16 * part / kOutCols];
      const int64_t cc = c0 + (16 * part) % kOutCols;
      if (w.row_codes && r < n_rows && cc < p.row_padded_cols)
        *reinterpret_cast<uint4*>(w.row_codes + (sg.x_row0 + r0 + r) * p.row_padded_cols + cc) =
            *reinterpret_cast<const uint4*>(row_stage + r * kRowCodeLd + 16 * part);
    }
    if (any_bf16) __syncthreads();  // the codes are read: the decodes take their bytes
  }
  if (any_bf16) {
    if (col_live && (out.col_bf16 || out.col_bf16_rows)) {
      const float sv = decode8_scale<F>(col_scale);
      uint4* e = reinterpret_cast<uint4*>(col_stage + t * kColBf16Ld);
#pragma unroll
      for (int u = 0; u < 4; ++u) e[u] = decode8_bits<F>(make_uint2(wc[2 * u], wc[2 * u + 1]), sv, nullptr);
    }
    if (row_live && rout.row_bf16) {
      const float sv = decode8_scale<F>(row_scale);
#pragma unroll
      for (int u0 = 0; u0 < 4; ++u0) {
        const int u = (u0 + (b >> 1)) & 3;
        *reinterpret_cast<uint4*>(row_stage + i * kRowBf16Ld + 2 * B * b + 16 * u) =
            decode8_bits<F>(code_pair(wr, u), sv, nullptr);
      }
    }
    __syncthreads();
    for (int k = t; k < 4 * kPairCols; k += kThreads) {  // column c0 + k / 4: four chunks of 8 BF16
      const int c = k >> 2, part = k & 3;
      const PairOut& w = p.out[c / kOutCols];
      const int64_t jc = c0 + c % kOutCols;
      if (w.col_bf16 && jc < p.cols)
        *reinterpret_cast<uint4*>(w.col_bf16 + p.cols * sg.at + jc * padded_rows + r0 + 8 * part) =
            *reinterpret_cast<const uint4*>(col_stage + c * kColBf16Ld + 16 * part);
    }
    // The Col decodes in the rows' layout: row r0 + r's eight columns from the eight columns'
    // staged blocks (whole 16-byte stores where the row's columns allow them). A warp's lanes take
    // consecutive rows of one chunk of eight columns: each of the eight staged reads is then a
    // run of consecutive BF16 of one column (no bank conflict), where lanes along the columns
    // would each read a column kColBf16Ld * 8 bytes (a multiple of 128) from the next, all in one
    // bank.
    for (int k = t; k < n_rows * (kPairCols / 8); k += kThreads) {
      const int r = k % n_rows, c8 = 8 * (k / n_rows);
      const PairOut& w = p.out[c8 / kOutCols];
      const int64_t jc = c0 + c8 % kOutCols;
      if (!w.col_bf16_rows || jc >= p.cols) continue;
      __nv_bfloat16* dst = w.col_bf16_rows + (sg.x_row0 + r0 + r) * p.cols + jc;
      const auto staged = [&](int e) {
        return *reinterpret_cast<const __nv_bfloat16*>(col_stage + (c8 + e) * kColBf16Ld + 2 * r);
      };
      if (p.cols % 8 == 0) {
        __align__(16) __nv_bfloat16 v8[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v8[e] = staged(e);
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v8);
      } else {
        for (int e = 0; e < 8 && jc + e < p.cols; ++e) dst[e] = staged(e);
      }
    }
    for (int k = t; k < B * (kPairCols / 8); k += kThreads) {  // row k / 32: 32 chunks of 8 BF16
      const int r = k / (kPairCols / 8), part = k % (kPairCols / 8);
      const PairOut& w = p.out[8 * part / kOutCols];
      const int64_t cc = c0 + (8 * part) % kOutCols;
      if (w.row_bf16 && r < n_rows && cc < p.row_padded_cols)
        *reinterpret_cast<uint4*>(w.row_bf16 + (sg.x_row0 + r0 + r) * p.row_padded_cols + cc) =
            *reinterpret_cast<const uint4*>(row_stage + r * kRowBf16Ld + 16 * part);
    }
  }
  flush_counts(false, 0u, nonfinite, 0u, 0u);
}

template <int kExpBits, bool kRowSR, bool kColSR, class Src>
__global__ void __launch_bounds__(kThreads, kRowSR || kColSR ? 2 : 4) mxfp8_row_col_kernel(const __grid_constant__ PairParams<Src> p) {
  dependent_launch_prologue();
  const int64_t cta = blockIdx.x;
  if (p.dev_offsets) {
    __shared__ PairSegment sg;
    __shared__ bool live;
    if (threadIdx.x == 0) live = pair_device_segment(p, cta, sg);
    __syncthreads();
    if (!live) return;  // uniform: past the groups' block rows
    row_col_tile<kExpBits, kRowSR, kColSR>(p, sg, cta);
    return;
  }
  int si = 0;
  while (si + 1 < p.n && p.seg[si + 1].cta0 <= cta) ++si;  // uniform over the CTA
  row_col_tile<kExpBits, kRowSR, kColSR>(p, p.seg[si], cta);
}

// One F32 tensor ([S, R, C]: S slices of R rows) of mxfp8_row_col_jobs_kernel, as quantize_both
// takes it: its Row form, and a Col segment per slice (at s * col_padded_rows in its Col storage,
// SR counters from s * C, one key); its CTAs from cta0 on, ceil(R / 32) block rows of col chunks a
// slice.
struct PairJob {
  const float* x;
  int64_t R, C, S;
  int64_t row_padded_cols, row_nb, col_padded_rows;
  num::MxScaleRule row_rule, col_rule;
  PairOut out;
  uint64_t col_seed, col_stream;
  int64_t cta0;
};
__host__ __device__ inline int64_t pair_job_slice_ctas(int64_t R, int64_t C) {
  return ((R + num::kMxBlock - 1) / num::kMxBlock) * ((C + kPairCols - 1) / kPairCols);
}

// Many tensors' forms in one launch (a step's weights: ~120 tensors, most of them too small to
// fill the GPU alone, each a launch and a ramp of its own before): a CTA finds its job (binary
// search over the jobs' first CTAs) and its slice, sets out the one-segment PairParams that
// quantize_both would have launched in shared memory, and runs the same tile. The same bits as
// quantize_both on each tensor, by construction.
template <int kExpBits, bool kRowSR, bool kColSR>
__global__ void __launch_bounds__(kThreads, kRowSR || kColSR ? 2 : 4)
    mxfp8_row_col_jobs_kernel(const PairJob* __restrict__ jobs, int count) {
  dependent_launch_prologue();
  __shared__ PairParams<PlainSource> sp;
  const int64_t cta = blockIdx.x;
  if (threadIdx.x == 0) {
    int lo = 0, hi = count - 1;  // the last job whose first CTA is at or before this one
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (jobs[mid].cta0 <= cta) lo = mid;
      else hi = mid - 1;
    }
    const PairJob& jb = jobs[lo];
    const int64_t per_slice = pair_job_slice_ctas(jb.R, jb.C), sl = (cta - jb.cta0) / per_slice;
    sp.src = PlainSource{jb.x, jb.C};
    sp.cols = jb.C;
    sp.col_chunks = (jb.C + kPairCols - 1) / kPairCols;
    sp.row_padded_cols = jb.row_padded_cols;
    sp.row_nb = jb.row_nb;
    sp.row_rule = jb.row_rule;
    sp.col_rule = jb.col_rule;
    sp.out[0] = jb.out;
    sp.n = 1;
    PairSegment& sg = sp.seg[0];
    sg.x_row0 = sl * jb.R;
    sg.rows = jb.R;
    sg.at = sl * jb.col_padded_rows;
    sg.counter_row0 = sl * jb.C;
    sg.seed[0] = jb.col_seed;
    sg.stream[0] = jb.col_stream;
    sg.cta0 = jb.cta0 + sl * per_slice;
  }
  __syncthreads();
  row_col_tile<kExpBits, kRowSR, kColSR>(sp, sp.seg[0], cta);
}

// One Col-axis segment of launch_mxfp8_row_col: rows x_row0 .. x_row0 + rows of the source, its
// Col forms at cols * at in each output's storage, SR counters from counter_row0, one key an
// output.
struct PairSegmentOut {
  int64_t x_row0, rows, at, counter_row0;
  RngKey rng[2];
};
// One output of launch_mxfp8_row_col: its Row form (row: codes, scales and bf16 as allocated;
// an undefined tensor is not written) under row_rng, and the bases of its Col forms (null: not
// written): per segment, or their decodes in the rows' layout (col_bf16_rows, [rows, cols]).
struct PairOutput {
  QTensor* row;
  RngKey row_rng;
  uint8_t* col_codes;
  uint8_t* col_scales;
  __nv_bfloat16* col_bf16;
  __nv_bfloat16* col_bf16_rows = nullptr;
};

// t's storage, or null for a form part not written (an undefined tensor).
inline void* raw_or_null(const Tensor& t) { return t.defined() ? t.raw() : nullptr; }

// The source's values ([rows, cols] per output) into the outputs' Row forms (every row under
// row_spec) and the segments' Col forms under col_spec (rounding and scale rule; both MXFP8 of
// one element format). Segments must cover the source's rows (each row's Row-axis block is
// quantized by the CTA of its segment). With dev_offsets (I32 [segs.size() + 1] on the GPU, over
// the source's `rows` rows) the segments are those offsets' groups, segs giving only their keys:
// every launch covers the most block rows its groups can take, and the CTAs past theirs return.
template <class Src>
void launch_mxfp8_row_col(const Src& src, int64_t cols, const std::vector<PairOutput>& outs,
                          const QuantSpec& row_spec, const QuantSpec& col_spec,
                          const std::vector<PairSegmentOut>& segs, const Tensor* dev_offsets = nullptr,
                          int64_t rows = 0) {
  constexpr int kOuts = pair_outputs<Src>();
  FOURBIT_CHECK(int(outs.size()) == kOuts, "launch_mxfp8_row_col: {} outputs for a source of {}", outs.size(), kOuts);
  const bool row_sr = row_spec.rounding == num::Rounding::SR, col_sr = col_spec.rounding == num::Rounding::SR;
  const QTensor& row0 = *outs[0].row;
  const bool e5m2 = row0.fmt == Format::MXFP8_E5M2;
  for (size_t first = 0; first < segs.size(); first += kPairSegsPerLaunch) {
    PairParams<Src> p{};
    p.src = src;
    p.cols = cols;
    p.col_chunks = (cols + kPairCols / kOuts - 1) / (kPairCols / kOuts);
    p.row_padded_cols = row0.padded_cols();
    p.row_nb = row0.blocks_per_row();
    p.row_rule = row_spec.mx_rule;
    p.col_rule = col_spec.mx_rule;
    for (int o = 0; o < kOuts; ++o) {
      const PairOutput& w = outs[size_t(o)];
      PairOut& d = p.out[o];
      d.row_codes = static_cast<uint8_t*>(raw_or_null(w.row->codes));
      d.row_scales = static_cast<uint8_t*>(raw_or_null(w.row->block_scales));
      d.row_bf16 = static_cast<__nv_bfloat16*>(raw_or_null(w.row->bf16));
      d.row_seed = w.row_rng.seed;
      d.row_stream = w.row_rng.stream;
      d.col_codes = w.col_codes;
      d.col_scales = w.col_scales;
      d.col_bf16 = w.col_bf16;
      d.col_bf16_rows = w.col_bf16_rows;
    }
    int64_t ctas = 0;
    if (dev_offsets) {
      p.dev_offsets = dev_offsets->data<int32_t>();
      p.first = int(first);
      p.rows = rows;
      for (size_t i = first; i < segs.size() && p.n < kPairSegsPerLaunch; ++i) {
        PairSegment& sg = p.seg[p.n++];
        for (int o = 0; o < kOuts; ++o) {
          sg.seed[o] = segs[i].rng[o].seed;
          sg.stream[o] = segs[i].rng[o].stream;
        }
      }
      ctas = ((rows + num::kMxBlock - 1) / num::kMxBlock + p.n) * p.col_chunks;
    }
    for (size_t i = first; !dev_offsets && i < segs.size() && p.n < kPairSegsPerLaunch; ++i) {
      const PairSegmentOut& so = segs[i];
      PairSegment& sg = p.seg[p.n++];
      sg.x_row0 = so.x_row0;
      sg.rows = so.rows;
      sg.at = so.at;
      sg.counter_row0 = so.counter_row0;
      for (int o = 0; o < kOuts; ++o) {
        sg.seed[o] = so.rng[o].seed;
        sg.stream[o] = so.rng[o].stream;
      }
      sg.cta0 = ctas;
      ctas += ((so.rows + num::kMxBlock - 1) / num::kMxBlock) * p.col_chunks;
    }
    if (ctas == 0) continue;
    const unsigned grid = grid_of(ctas, "quantize_row_col");
    auto go = [&](auto exp_bits, auto row_sr_c, auto col_sr_c) {
      constexpr auto kernel = mxfp8_row_col_kernel<decltype(exp_bits)::value, decltype(row_sr_c)::value,
                                                   decltype(col_sr_c)::value, Src>;
      allow_smem<kernel>(kPairSmem);
      launch_dependent(kernel, grid, kThreads, kPairSmem, p);
    };
    using T = std::true_type;
    using F = std::false_type;
    with_mxfp8_variant(e5m2, row_sr, [&](auto exp_bits, auto row_sr_c) {
      col_sr ? go(exp_bits, row_sr_c, T{}) : go(exp_bits, row_sr_c, F{});
    });
  }
}

// The jobs (their cta0 left to this) in one launch of mxfp8_row_col_jobs_kernel: every job one
// MXFP8 element format and rounding pair (e5m2, row_sr, col_sr); the table goes up through a
// staged copy (no wait).
void launch_mxfp8_row_col_jobs(std::vector<PairJob>& jobs, bool e5m2, bool row_sr, bool col_sr) {
  int64_t ctas = 0;
  std::vector<PairJob> live;
  for (PairJob& j : jobs) {
    if (j.R == 0 || j.C == 0 || j.S == 0) continue;
    j.cta0 = ctas;
    ctas += j.S * pair_job_slice_ctas(j.R, j.C);
    live.push_back(j);
  }
  if (live.empty()) return;
  const Tensor table =
      Tensor::from_host(live.data(), {int64_t(live.size() * sizeof(PairJob))}, DType::U8, Device::CUDA);
  const unsigned grid = grid_of(ctas, "quantize_both_each");
  auto go = [&](auto exp_bits, auto row_sr_c, auto col_sr_c) {
    constexpr auto kernel = mxfp8_row_col_jobs_kernel<decltype(exp_bits)::value, decltype(row_sr_c)::value,
                                                      decltype(col_sr_c)::value>;
    allow_smem<kernel>(kPairSmem);
    launch_dependent(kernel, grid, kThreads, kPairSmem, static_cast<const PairJob*>(table.raw()), int(live.size()));
  };
  using T = std::true_type;
  using F = std::false_type;
  with_mxfp8_variant(e5m2, row_sr, [&](auto exp_bits, auto row_sr_c) {
    col_sr ? go(exp_bits, row_sr_c, T{}) : go(exp_bits, row_sr_c, F{});
  });
}  // table is freed after the launch is queued: the allocator reuses in stream order

}  // namespace
}  // namespace fourbit::ops::cuda
