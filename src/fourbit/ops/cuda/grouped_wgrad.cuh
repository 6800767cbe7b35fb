// defines: hopper::store_wgrad_block, store_wgrad_tile, hopper::wgrad_kernel,
//          hopper::launch_wgrad (the K-grouped form's cp.async loop)
#pragma once

#include "fourbit/ops/cuda/grouped_hopper.cuh"

namespace fourbit::ops::cuda {
namespace {
namespace hopper {

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

// The epilogue of a K-grouped output tile at (m0, n0): warpgroup wm's 64 x WN block (wgmma's
// accumulator layout) into C (ldc floats a row, 8-byte aligned: the form declines odd n or ldc),
// rows < m and columns < n, added to C's values where accumulate (one rounding each). FULL: every
// column of the block is below n (store_wgrad_tile chooses), so no pair is checked or skipped; the
// addition is a select and C's load a predicated one, so the unrolled epilogue has no branch per
// pair and stays small enough for the instruction cache (as store_block_full).
template <int WN = 128, bool FULL = false>
__device__ __forceinline__ void store_wgrad_block(const float (&acc)[WN / 2], float* c, int64_t ldc, int m, int n,
                                                  int m0, int n0, int wm, bool accumulate) {
  const int t = int(threadIdx.x) & 127, lane = int(threadIdx.x) & 31;
  const int row_base = m0 + wm * 64 + 16 * (t >> 5) + (lane >> 2), col_base = n0 + 2 * (lane & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_base + 8 * half;
    if (row >= m) continue;
    float* crow = c + (long long)row * ldc;
#pragma unroll
    for (int j0 = 0; j0 < WN / 8; j0 += kAhead) {
      float2 old[kAhead];  // C's values, loaded together ahead of the stores
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        const int col = col_base + 8 * (j0 + j);
        old[j] = accumulate && (FULL || col < n) ? *reinterpret_cast<const float2*>(crow + col) : make_float2(0.0f, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        const int q = j0 + j, col = col_base + 8 * q;
        if (!FULL && col >= n) continue;  // n is even: col + 1 < n too
        float x = acc[4 * q + 2 * half], y = acc[4 * q + 2 * half + 1];
        x = accumulate ? num::add_rn(old[j].x, x) : x;
        y = accumulate ? num::add_rn(old[j].y, y) : y;
        *reinterpret_cast<float2*>(crow + col) = make_float2(x, y);
      }
    }
  }
}

// store_wgrad_block in its FULL form where the block's WN columns at n0 all lie below n.
template <int WN = 128>
__device__ __forceinline__ void store_wgrad_tile(const float (&acc)[WN / 2], float* c, int64_t ldc, int m, int n, int m0,
                                                 int n0, int wm, bool accumulate) {
  if (n0 + WN <= n) store_wgrad_block<WN, true>(acc, c, ldc, m, n, m0, n0, wm, accumulate);
  else store_wgrad_block<WN, false>(acc, c, ldc, m, n, m0, n0, wm, accumulate);
}

template <bool MN>
__global__ void __launch_bounds__(512, 1) wgrad_kernel(const __grid_constant__ KGroupedArgs p) {
  using S = Shape<Format::BF16, 4, 1>;  // 256 x 128 tiles, four warpgroups stacked in M
  constexpr int kThreads = S::kThreads, BM = S::BM, BN = S::BN;
  const KProblemArgs q = k_problem(p, int(blockIdx.z));
  const int m0 = int(blockIdx.y) * BM, n0 = int(blockIdx.x) * BN;
  const int wm = int(threadIdx.x) >> 7;
  auto store = [&](const float (&acc)[64]) { store_wgrad_tile(acc, q.c, p.ldc, p.m, p.n, m0, n0, wm, p.accumulate); };
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

}  // namespace hopper
}  // namespace
}  // namespace fourbit::ops::cuda
