// defines: kColSegsPerLaunch, ColSegment, ColSegments, mxfp8_col_fast_kernel, ColSegmentOut,
//          launch_mxfp8_col_fast, mxfp8_col_fast
// MXFP8 on the Col axis (blocks down the columns, stored transposed), no RHT, RNE or SR, over one
// tensor, the slices of a 3-D one, or row segments with their own SR keys (quantize_segments: the
// experts' weight-gradient operands).
#pragma once
#include "fourbit/ops/cuda/cast/fast_common.cuh"

namespace fourbit::ops::cuda {
namespace {

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
}  // namespace fourbit::ops::cuda
