// defines: grouped_kernel, the portable main loop of the grouped GEMM (mma.sync m16n8k16; grouped_mma.cu)
// Runs where the Hopper loop does not (other GPUs, a plain sm_90 or PTX-JIT build) and under
// set_grouped_wgmma(false).
#pragma once

#include "fourbit/ops/cuda/grouped_common.cuh"

namespace fourbit::ops::cuda {
namespace {

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

}  // namespace
}  // namespace fourbit::ops::cuda
