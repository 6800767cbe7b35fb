// defines: nvfp4_row_fast_kernel, launch_persistent, launch_nvfp4_row_fast
// NVFP4 with a per-row (per-token) outer scale, RNE with or without Four Over Six, Row axis, no
// RHT, no 16x16 tiles, rows of at most kFusedMaxCols padded columns, float4-loadable input: the
// activations of nvfp4-fwd. One pass, persistent CTAs.
#pragma once
#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/dependent_launch.cuh"

namespace fourbit::ops::cuda {
namespace {

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
// even run count, as 8192 columns, see launch_nvfp4_row_fast): Four Over Six MSE 32.4, MAE 30.4,
// RNE 19.7; kRuns 1: Four Over Six MSE 36.9, MAE 34.9, RNE 23.8. kRuns 2, 4/6 MSE, 1036
// instructions per iteration, per element: the block quantizer 23.4 (11 per element and
// candidate, no saturation clamp where the run's fos_bounded vote holds; signs 7/8, the choice
// and packing ~0.6), its scales and the vote 1.9
// (fos_block_scales: no division), block amax 1.0; the rest 6.0: prefetch (a running source
// pointer, immediate offsets), staging reads (one lane address kept), team max, S_enc, S_dec and
// the encode-scale table, stores (running row pointers) and counters (values and blocks once,
// after the loop). ~38 is what a 75%-of-copy rate allows (the tile kernel's generic numerics:
// 90-200). kRuns 2 holds 16 warps per SM (128 registers), kRuns 1 32 (64 registers),
// both with 64 KiB of copies in flight per SM.
template <int kRuns, bool kFos, num::ScaleMetric kMetric>
__global__ void __launch_bounds__(32 * kNvfp4FastMaxWarps, kRuns == 1 ? 2 : 1)
    nvfp4_row_fast_kernel(const FastRowParams p) {
  dependent_launch_prologue();
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
    cp_async_wait<1>();
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
    if (live && wt == 0 && lane == 0) {
      p.outer[row] = s_dec;
      if (p.row_amax) p.row_amax[row] = num::float_of(row_amax);
    }
    // Four Over Six: the row's table of encode scales (lookups are shuffles: the whole warp builds
    // and reads it, before the per-block branches); rows outside its exact range go generic.
    num::FosGroup grp{};
    if constexpr (kFos) grp = num::fos_group(s_dec);
    // runs the fast quantizers do not take: a non-finite value, or a group outside FosGroup::exact
    const unsigned generic_runs = nonfinite_blocks | (!kFos || grp.exact ? 0u : ~0u);

#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int blk = blk0 + k * kFastRunBlocks + lane;
      num::FosBlockScales scales;
      bool bounded;  // every block of the warp's run: the unclamped quantizer (fos_bounded)
      nvfp4_row_block_scales<kFos>(amax[k], s_enc, grp, scales, bounded);
      if (!live || !((lane_runs >> k) & 1u)) continue;
      const int n = min(B, cols - blk * B);
      const num::Nvfp4Block out = nvfp4_row_block<kFos, kMetric>(v[k], n, amax[k], s_enc, s_dec, scales, bounded,
                                                                 (generic_runs >> k) & 1u, chose_four);
      if (p.codes) {
        if constexpr (kRuns > 1) {
          *reinterpret_cast<uint64_t*>(codes_row + k * kFastRunBlocks * 8) = out.packed;
          scales_row[k * kFastRunBlocks] = out.scale;
        } else {
          *reinterpret_cast<uint64_t*>(p.codes + row * (p.padded_cols / 2) + blk * 8) = out.packed;
          p.scales[row * p.nb + blk] = out.scale;
        }
      }
      if (p.bf16) store_nvfp4_block_bf16(p.bf16 + row * p.padded_cols + blk * B, out.packed, out.scale);
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
  launch_dependent(kernel, grid_of(ctas, "quantize"), threads, smem, f);
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

}  // namespace
}  // namespace fourbit::ops::cuda
