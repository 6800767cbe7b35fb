// defines: mxfp8_row_fast_kernel, launch_mxfp8_row_fast
// MXFP8 (E4M3 / E5M2, RCEIL or floor scales, RNE or SR) on the Row axis, no RHT, float4-loadable
// input: one warp per run of 32 blocks.
#pragma once
#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/dependent_launch.cuh"

namespace fourbit::ops::cuda {
namespace {

// MXFP8 (E4M3 or E5M2; RCEIL or floor scales), RNE or SR, on the Row axis: one warp per run of
// 32 blocks, each lane quantizing one block with mxfp8_fast_block (SR counter = padded storage
// index, as the generic block quantizer draws them). Instructions per element: ~6 for RNE (PTX);
// SR 32.3 in SASS (scripts/sass_hot_path.py CUBIN mxfp8_row_sr 4: Philox 5.6 of them, one call
// per 8 elements), against the ~50 a 75%-of-copy rate allows.
template <int kExpBits, bool kSR>
__global__ void __launch_bounds__(kThreads, 3) mxfp8_row_fast_kernel(const FastRowParams p) {
  dependent_launch_prologue();
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

void launch_mxfp8_row_fast(FastRowParams f, bool e5m2, bool sr) {
  f.runs_per_row = (f.nb + kFastRunBlocks - 1) / kFastRunBlocks;
  const unsigned ctas = grid_of((f.rows * f.runs_per_row + kWarps - 1) / kWarps, "quantize");
  with_mxfp8_variant(e5m2, sr, [&](auto exp_bits, auto sr_c) {
    launch_dependent(mxfp8_row_fast_kernel<decltype(exp_bits)::value, decltype(sr_c)::value>, ctas, kThreads, 0, f);
  });
}

}  // namespace
}  // namespace fourbit::ops::cuda
