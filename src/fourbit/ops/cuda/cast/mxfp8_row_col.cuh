// defines: kPairSegsPerLaunch, PairSegment, PairParams, mxfp8_row_col_kernel, PairSegmentOut,
//          launch_mxfp8_row_col
// MXFP8 on both axes of one F32 input in one pass: the Row-axis form of every row (a GEMM's X or
// dY) and the Col-axis form of each row segment (the weight gradient's X^T or dY^T: the whole
// tensor, or the experts' token ranges with their own SR keys), each optionally with its exact
// BF16 decode for the GEMM that reads it next. The two separate kernels (mxfp8_row_fast,
// mxfp8_col_fast) read the input twice; this one reads it once.
#pragma once
#include <algorithm>

#include "fourbit/ops/cuda/block_decode.cuh"
#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/dependent_launch.cuh"

namespace fourbit::ops::cuda {
namespace {

// A CTA takes one block row (32 logical rows) of one segment and kThreads columns. Thread t loads
// its column's 32 values with scalar loads that a warp makes into 128-byte rows, quantizes them
// as the Col-axis block (mxfp8_col_fast's counters and layout), and leaves them in a shared tile;
// then each thread takes one (row, 32-column block) of the tile and quantizes it as the Row-axis
// block (mxfp8_row_fast's counters and layout). Both go through mxfp8_fast_words, so the codes
// and scales are those of the separate kernels, and the BF16 decodes are block_decode.cuh's.
// The codes and decodes then go through shared memory (the tile's bytes again) so that the
// global stores are whole 32-byte sectors: 16 consecutive threads write a row's 256 codes, 32
// its 512 decode bytes; 2 (4) write a column's 32 codes (decodes).
//
// The tile holds row i's column c at float i * kPairLd + 32 b + 4 ((q + b) & 7) + e for c = 32 b +
// 4 q + e: a warp's column stores of one row permute the 32 words of one block (no conflict), and
// the eight threads of a quarter-warp, which read the same logical chunk q of blocks 0..7 of one
// row as float4s, land on eight different 4-bank groups ((i + q + b) mod 8, kPairLd / 4 odd). The
// staging rows are padded by 16 bytes, and a thread stores its 16-byte chunks in an order rotated
// by its block, so that the eight threads of a quarter-warp hit eight different 4-bank groups.
constexpr int kPairCols = kThreads;                     // columns per CTA
constexpr int kPairBlocks = kPairCols / num::kMxBlock;  // Row-axis blocks per tile row
constexpr int kPairLd = kPairCols + 4;
constexpr int kPairSegsPerLaunch = 32;
static_assert(kPairBlocks == 8 && num::kMxBlock * kPairBlocks == kThreads,
              "one (row, block) of the 32 x kThreads tile per thread, eight blocks a row");
static_assert((kPairLd / 4) % 8 == 1, "rows of the tile start one 16-byte chunk apart modulo eight");
// Output staging, in bytes: a column's 32 codes, a row's 256 codes, a column's 32 BF16, a row's
// 256 BF16 (each + 16 bytes of padding), one after the other.
constexpr int kColCodeLd = num::kMxBlock + 16, kRowCodeLd = kPairCols + 16;
constexpr int kColBf16Ld = 2 * num::kMxBlock + 16, kRowBf16Ld = 2 * kPairCols + 16;
constexpr int kStageRowCodes = kPairCols * kColCodeLd;
constexpr int kStageColBf16 = kStageRowCodes + num::kMxBlock * kRowCodeLd;
constexpr int kStageRowBf16 = kStageColBf16 + kPairCols * kColBf16Ld;
constexpr int kPairSmem = std::max(int(num::kMxBlock * kPairLd * sizeof(float)), kStageRowBf16 + num::kMxBlock * kRowBf16Ld);

struct PairSegment {
  int64_t x_row0, rows;    // the segment's rows of x
  uint8_t* codes;          // Col form: storage [cols, padded rows]
  uint8_t* scales;         // [cols, padded rows / 32]
  __nv_bfloat16* bf16;     // [cols, padded rows], or null
  int64_t counter_row0;    // SR counters: storage row counter_row0 + j for column j (slice s of a
                           // 3-D input: s * cols, as the 3-D tensor's Col-axis quantizer counts)
  uint64_t seed, stream;
  int64_t cta0;            // the segment's first CTA
};
struct PairParams {
  const float* x;  // [rows, cols], row-major
  int64_t cols, col_chunks, row_padded_cols, row_nb;
  uint8_t* row_codes;         // Row form: [rows, row_padded_cols]
  uint8_t* row_scales;        // [rows, row_nb]
  __nv_bfloat16* row_bf16;    // [rows, row_padded_cols], or null
  uint64_t row_seed, row_stream;
  num::MxScaleRule row_rule, col_rule;
  PairSegment seg[kPairSegsPerLaunch];
  int n;
};

// Words 2u and 2u + 1 of a block's eight code words (u = 0..3, known only at run time).
__device__ __forceinline__ uint2 code_pair(const uint32_t (&w)[num::kMxBlock / 4], int u) {
  return u == 0 ? make_uint2(w[0], w[1]) : u == 1 ? make_uint2(w[2], w[3]) : u == 2 ? make_uint2(w[4], w[5])
                                                                                    : make_uint2(w[6], w[7]);
}

template <int kExpBits, bool kRowSR, bool kColSR>
__global__ void __launch_bounds__(kThreads) mxfp8_row_col_kernel(const __grid_constant__ PairParams p) {
  dependent_launch_prologue();
  constexpr int B = num::kMxBlock;
  constexpr Format F = kExpBits == 4 ? Format::MXFP8_E4M3 : Format::MXFP8_E5M2;
  extern __shared__ __align__(16) unsigned char pair_smem[];
  float* tile = reinterpret_cast<float*>(pair_smem);
  const int64_t cta = blockIdx.x;
  int si = 0;
  while (si + 1 < p.n && p.seg[si + 1].cta0 <= cta) ++si;  // uniform over the CTA
  const PairSegment& sg = p.seg[si];
  const int64_t local = cta - sg.cta0, rb = local / p.col_chunks, r0 = rb * B;
  const int64_t c0 = (local % p.col_chunks) * kPairCols;
  const int t = int(threadIdx.x);
  const int64_t j = c0 + t;  // the thread's logical column
  const int n_rows = int(min64(B, sg.rows - r0));
  const int64_t padded_rows = ((sg.rows + B - 1) / B) * B;
  unsigned nonfinite = 0;

  float v[B];
  if (j < p.cols) {
    const float* src = p.x + (sg.x_row0 + r0) * p.cols + j;
    if (n_rows == B) {
#pragma unroll
      for (int i = 0; i < B; ++i) v[i] = __ldg(src + int64_t(i) * p.cols);
    } else {
#pragma unroll
      for (int i = 0; i < B; ++i) v[i] = i < n_rows ? __ldg(src + int64_t(i) * p.cols) : 0.0f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < B; ++i) v[i] = 0.0f;
  }
  {
    const int b = t / B, q = (t % B) / 4, e = t % 4;
    float* col = tile + B * b + 4 * ((q + b) & 7) + e;
#pragma unroll
    for (int i = 0; i < B; ++i) col[i * kPairLd] = v[i];
  }
  const bool col_live = j < p.cols;
  uint32_t wc[B / 4];
  uint8_t col_scale = 0;
  if (col_live) {  // the Col-axis block: logical rows r0 .. r0 + 31 of column j
    col_scale = mxfp8_fast_words<kExpBits, kColSR>(v, n_rows, p.col_rule, sg.seed, sg.stream,
                                                   uint64_t((sg.counter_row0 + j) * padded_rows + r0), wc, nonfinite);
    sg.scales[j * (padded_rows / B) + rb] = col_scale;
  }
  __syncthreads();
  const int i = t / kPairBlocks, b = t % kPairBlocks;
  const int64_t blk = c0 / B + b, row = sg.x_row0 + r0 + i;
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
    row_scale = mxfp8_fast_words<kExpBits, kRowSR>(v, int(min64(B, p.cols - col)), p.row_rule, p.row_seed,
                                                   p.row_stream, uint64_t(row * p.row_padded_cols + col), wr, nonfinite);
    p.row_scales[row * p.row_nb + blk] = row_scale;
  }
  __syncthreads();  // the tile is read: its bytes stage the outputs now

  unsigned char* col_codes = pair_smem;
  unsigned char* row_codes = pair_smem + kStageRowCodes;
  unsigned char* col_bf16 = pair_smem + kStageColBf16;
  unsigned char* row_bf16 = pair_smem + kStageRowBf16;
  if (col_live) {
    uint4* d = reinterpret_cast<uint4*>(col_codes + t * kColCodeLd);
    d[0] = make_uint4(wc[0], wc[1], wc[2], wc[3]);
    d[1] = make_uint4(wc[4], wc[5], wc[6], wc[7]);
    if (sg.bf16) {
      const float sv = decode8_scale<F>(col_scale);
      uint4* e = reinterpret_cast<uint4*>(col_bf16 + t * kColBf16Ld);
#pragma unroll
      for (int u = 0; u < 4; ++u) e[u] = decode8_bits<F>(make_uint2(wc[2 * u], wc[2 * u + 1]), sv, nullptr);
    }
  }
  if (row_live) {
#pragma unroll
    for (int h0 = 0; h0 < 2; ++h0) {
      const int h = (h0 + (b >> 2)) & 1;
      *reinterpret_cast<uint4*>(row_codes + i * kRowCodeLd + B * b + 16 * h) =
          h ? make_uint4(wr[4], wr[5], wr[6], wr[7]) : make_uint4(wr[0], wr[1], wr[2], wr[3]);
    }
    if (p.row_bf16) {
      const float sv = decode8_scale<F>(row_scale);
#pragma unroll
      for (int u0 = 0; u0 < 4; ++u0) {
        const int u = (u0 + (b >> 1)) & 3;
        *reinterpret_cast<uint4*>(row_bf16 + i * kRowBf16Ld + 2 * B * b + 16 * u) =
            decode8_bits<F>(code_pair(wr, u), sv, nullptr);
      }
    }
  }
  __syncthreads();
  for (int k = t; k < 2 * kPairCols; k += kThreads) {  // column c0 + k / 2: two halves of its 32 codes
    const int c = k >> 1, h = k & 1;
    if (c0 + c < p.cols)
      *reinterpret_cast<uint4*>(sg.codes + (c0 + c) * padded_rows + r0 + 16 * h) =
          *reinterpret_cast<const uint4*>(col_codes + c * kColCodeLd + 16 * h);
  }
  for (int k = t; k < B * (kPairCols / 16); k += kThreads) {  // row k / 16: sixteen chunks of 16 codes
    const int r = k / (kPairCols / 16), part = k % (kPairCols / 16);
    if (r < n_rows && c0 + 16 * part < p.row_padded_cols)
      *reinterpret_cast<uint4*>(p.row_codes + (sg.x_row0 + r0 + r) * p.row_padded_cols + c0 + 16 * part) =
          *reinterpret_cast<const uint4*>(row_codes + r * kRowCodeLd + 16 * part);
  }
  if (sg.bf16)
    for (int k = t; k < 4 * kPairCols; k += kThreads) {  // column c0 + k / 4: four chunks of 8 BF16
      const int c = k >> 2, part = k & 3;
      if (c0 + c < p.cols)
        *reinterpret_cast<uint4*>(sg.bf16 + (c0 + c) * padded_rows + r0 + 8 * part) =
            *reinterpret_cast<const uint4*>(col_bf16 + c * kColBf16Ld + 16 * part);
    }
  if (p.row_bf16)
    for (int k = t; k < B * (kPairCols / 8); k += kThreads) {  // row k / 32: 32 chunks of 8 BF16
      const int r = k / (kPairCols / 8), part = k % (kPairCols / 8);
      if (r < n_rows && c0 + 8 * part < p.row_padded_cols)
        *reinterpret_cast<uint4*>(p.row_bf16 + (sg.x_row0 + r0 + r) * p.row_padded_cols + c0 + 8 * part) =
            *reinterpret_cast<const uint4*>(row_bf16 + r * kRowBf16Ld + 16 * part);
    }
  flush_counts(false, 0u, nonfinite, 0u, 0u);
}

// One Col-axis segment of launch_mxfp8_row_col: rows x_row0 .. x_row0 + rows of x, into the
// storage at codes / scales / bf16 (null: no decode) under rng, counters from counter_row0.
struct PairSegmentOut {
  int64_t x_row0, rows;
  uint8_t* codes;
  uint8_t* scales;
  __nv_bfloat16* bf16;
  int64_t counter_row0;
  RngKey rng;
};

// x [rows, cols] (F32, contiguous) into `row` (the Row-axis form of every row under row_spec and
// row_rng) and the segments' Col-axis forms under col_spec (rounding and scale rule; both MXFP8
// of one element format). Segments must cover x's rows (each row's Row-axis block is quantized by
// the CTA of its segment).
void launch_mxfp8_row_col(const float* x, int64_t cols, QTensor& row, RngKey row_rng, const QuantSpec& row_spec,
                          const QuantSpec& col_spec, const std::vector<PairSegmentOut>& segs) {
  const bool row_sr = row_spec.rounding == num::Rounding::SR, col_sr = col_spec.rounding == num::Rounding::SR;
  const bool e5m2 = row.fmt == Format::MXFP8_E5M2;
  for (size_t first = 0; first < segs.size(); first += kPairSegsPerLaunch) {
    PairParams p{};
    p.x = x;
    p.cols = cols;
    p.col_chunks = (cols + kPairCols - 1) / kPairCols;
    p.row_padded_cols = row.padded_cols();
    p.row_nb = row.blocks_per_row();
    p.row_codes = row.codes.data<uint8_t>();
    p.row_scales = row.block_scales.data<uint8_t>();
    p.row_bf16 = row.bf16.defined() ? row.bf16.data<__nv_bfloat16>() : nullptr;
    p.row_seed = row_rng.seed;
    p.row_stream = row_rng.stream;
    p.row_rule = row_spec.mx_rule;
    p.col_rule = col_spec.mx_rule;
    int64_t ctas = 0;
    for (size_t i = first; i < segs.size() && p.n < kPairSegsPerLaunch; ++i) {
      const PairSegmentOut& o = segs[i];
      PairSegment& sg = p.seg[p.n++];
      sg.x_row0 = o.x_row0;
      sg.rows = o.rows;
      sg.codes = o.codes;
      sg.scales = o.scales;
      sg.bf16 = o.bf16;
      sg.counter_row0 = o.counter_row0;
      sg.seed = o.rng.seed;
      sg.stream = o.rng.stream;
      sg.cta0 = ctas;
      ctas += ((o.rows + num::kMxBlock - 1) / num::kMxBlock) * p.col_chunks;
    }
    if (ctas == 0) continue;
    const unsigned grid = grid_of(ctas, "quantize_row_col");
    auto go = [&](auto exp_bits, auto row_sr_c, auto col_sr_c) {
      constexpr auto kernel =
          mxfp8_row_col_kernel<decltype(exp_bits)::value, decltype(row_sr_c)::value, decltype(col_sr_c)::value>;
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

}  // namespace
}  // namespace fourbit::ops::cuda
