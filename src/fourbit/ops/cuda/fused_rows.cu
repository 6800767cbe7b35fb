// defines: cuda::row_quant_fused, cuda::launch_rmsnorm_rows_quantized, cuda::launch_swiglu_rows_quantized
// Producers that quantize the rows they write (ops.h "Quantized outputs"): RMSNorm (with or
// without the residual add) and SwiGLU over a fused gate|up row. A CTA takes a row: it computes it
// with the formulas of layers.cu's kernels (row_math.cuh: the same bits; the norm's sum of squares
// by one warp in the lane order that fixes them, the elementwise part by every thread), writes the
// F32 output as they do, and hands each float4 to a shared-memory stage in the layout of the
// register-resident quantizers' warp runs (cast/fast_common.cuh: lane l of the warp reading a run
// owns block l of it). The CTA's warps then quantize the row's runs from there with those kernels'
// block encoders: mxfp8_fast_block for MXFP8; for per-token NVFP4 the row's amax (a first pass,
// the warps' maxes met in shared memory), S_enc and S_dec, then nvfp4_row_block per block, exactly
// as nvfp4_row_fast_kernel. The bits are quantize()'s, one launch instead of two.
//
// At decode a step's activation quantizers were ~60 kernels of 2-4 us each; the ones whose input is
// an RMSNorm or a SwiGLU output now ride along in the producer's launch. A warp per row (the
// norm's own layout) was tried first and lost: a decode row's 1024 SwiGLU values, each an FP64
// exp, and its NVFP4 blocks in one warp took longer than the two launches they replaced
// (bench/results/cuda-log.md, session 45).
//
// The stage holds one row (runs of 32 blocks: 2 KB of floats a run for NVFP4, 4 KB for MXFP8),
// at most kStageBudget, so rows of up to 16384 values (the per-token quantizer's kFusedMaxCols).
// Columns past the row's end are zeros in the stage (as the quantizers load them); a non-finite
// value raises the quantizers' sticky flag through its address.
#include <cuda_runtime.h>

#include <algorithm>

#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/fused_rows.h"
#include "fourbit/ops/cuda/row_math.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kRowWarps = 8;                // a CTA (one row at a time)
constexpr int kRowThreads = 32 * kRowWarps;
constexpr int kStageBudget = 64 * 1024;     // the row's stage (dynamic shared memory)
constexpr int kRunValues = kFastRunBlocks;  // blocks a run (one per lane); a run holds 32 * block values

// Where a row's quantized form goes: q's storage, row-major.
struct RowQuantArgs {
  uint8_t* codes;
  uint8_t* scales;
  float* outer;      // NVFP4: S_dec per row
  int64_t code_ld;   // code bytes a row
  int64_t nb;        // blocks a row
  int runs;          // warp runs a row
  int stage_floats;  // the row's stage: runs * 32 * block
  num::MxScaleRule mx_rule;
  unsigned* nonfinite_flag;  // the quantizers' sticky flag (nonfinite_flag_address)
};

// Group g (columns 4g .. 4g + 3) of the row into the stage: run g / (8 B), and in it float4
// l + 32 j with l = g % 32 lands where stage_run puts lane l's chunk j (whichever thread made it).
template <int B>
__device__ __forceinline__ void stage_group(float* buf, int64_t g, const float (&v)[4]) {
  constexpr int kRunGroups = kRunValues * B / 4;
  const int k = int(g / kRunGroups), r = int(g % kRunGroups);
  *reinterpret_cast<float4*>(buf + k * kRunValues * B + stage_offset<B>(r % 32, r / 32)) =
      make_float4(v[0], v[1], v[2], v[3]);
}

// Zeros in the stage's groups past the row's cols values (never written by the rows); the CTA's
// threads, before its first row.
template <int B>
__device__ __forceinline__ void zero_stage_tail(float* buf, int64_t cols, int runs) {
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t g = cols / 4 + threadIdx.x; g < int64_t(runs) * kRunValues * B / 4; g += blockDim.x)
    stage_group<B>(buf, g, zero);
}

// The row in the stage quantized by the CTA's warps, warp w taking runs w, w + 8, ...; every
// thread calls it (between barriers: the stage is complete, and nothing rewrites it until all
// have returned). amax: the CTA's kRowWarps words of shared memory.

// MXFP8 (E4M3 / E5M2 by kExpBits), RNE: every block on its own (mxfp8_row_fast_kernel's encoder).
template <int kExpBits>
struct MxRows {
  static constexpr int B = num::kMxBlock;
  __device__ static void quantize(const float* buf, int64_t row, int64_t cols, const RowQuantArgs& q, uint32_t*,
                                  unsigned& nonfinite) {
    const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
    for (int k = warp; k < q.runs; k += kRowWarps) {
      float v[B];
      read_run<B>(buf + k * kRunValues * B, v);
      const int64_t blk = int64_t(k) * kRunValues + lane;
      if (blk >= q.nb) continue;
      const int n = int(min64(B, cols - blk * B));
      uint8_t* codes = q.codes + row * q.code_ld + blk * B;
      q.scales[row * q.nb + blk] = mxfp8_fast_block<kExpBits, false>(v, n, q.mx_rule, 0, 0, 0, codes, nonfinite);
    }
  }
};

// Per-token NVFP4, RNE, with or without Four Over Six: nvfp4_row_fast_kernel's row.
template <bool kFos, num::ScaleMetric kMetric>
struct Nvfp4Rows {
  static constexpr int B = num::kNvfp4Block;
  // The block's finite amax; `finite`: it held no NaN/Inf (else nonfinite counts them, if given).
  __device__ static float block_amax(const float (&v)[B], bool& finite, unsigned* nonfinite) {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < B; ++i) a = num::max_abs_nan(a, v[i]);
    finite = num::is_finite_bits(a);
    if (finite) return a;
    unsigned ignored = 0;
    return finite_amax_counting(v, nonfinite ? *nonfinite : ignored);
  }
  __device__ static void quantize(const float* buf, int64_t row, int64_t cols, const RowQuantArgs& q, uint32_t* amax,
                                  unsigned& nonfinite) {
    const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
    uint32_t bits = 0;  // a max of non-negative floats as bits: order-free
    for (int k = warp; k < q.runs; k += kRowWarps) {
      float v[B];
      read_run<B>(buf + k * kRunValues * B, v);
      bool finite;
      bits = max(bits, num::bits_of(block_amax(v, finite, nullptr)));
    }
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (lane == 0) amax[warp] = bits;
    __syncthreads();
    const uint32_t row_amax = __reduce_max_sync(0xffffffffu, lane < kRowWarps ? amax[lane] : 0u);
    const float s_enc = num::nvfp4_s_enc(num::float_of(row_amax), kFos);
    const float s_dec = num::nvfp4_s_dec(s_enc);
    if (threadIdx.x == 0) q.outer[row] = s_dec;
    num::FosGroup grp{};
    if constexpr (kFos) grp = num::fos_group(s_dec);  // the whole warp: its lookups are shuffles
    const bool generic_row = kFos && !grp.exact;
    unsigned chose_four = 0;
    for (int k = warp; k < q.runs; k += kRowWarps) {
      float v[B];
      read_run<B>(buf + k * kRunValues * B, v);
      bool finite;
      const float a = block_amax(v, finite, &nonfinite);
      num::FosBlockScales scales;
      bool bounded;
      nvfp4_row_block_scales<kFos>(a, s_enc, grp, scales, bounded);  // every lane (a vote)
      const int64_t blk = int64_t(k) * kRunValues + lane;
      if (blk >= q.nb) continue;
      const int n = int(min64(B, cols - blk * B));
      const num::Nvfp4Block out =
          nvfp4_row_block<kFos, kMetric>(v, n, a, s_enc, s_dec, scales, bounded, !finite || generic_row, chose_four);
      *reinterpret_cast<uint64_t*>(q.codes + row * q.code_ld + blk * 8) = out.packed;
      q.scales[row * q.nb + blk] = out.scale;
    }
  }
};

// Called by every thread of the CTA after its rows: raises the sticky flag for a NaN/Inf seen.
__device__ __forceinline__ void raise_nonfinite(unsigned* flag, unsigned nonfinite) {
  if (__syncthreads_or(nonfinite != 0) && threadIdx.x == 0) atomicOr(flag, 1u);
}

// One row a CTA: warp 0 takes the sum of squares (rmsnorm_row_rstd: the plain kernel's pass, lane
// for lane), then every thread computes groups tid, tid + 256, ... of y from the row as that pass
// left it (x, or the sum it wrote: visible to the CTA after the barrier).
template <class Q>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_rows_quantized_kernel(const float* x, const float* w, double eps, float* y, float* rstd, int64_t N,
                                  int64_t D, uint16_t* yb, bool vec_b, const float* b, float* sum, RowQuantArgs q) {
  dependent_launch_prologue();
  extern __shared__ __align__(16) float stage[];
  __shared__ uint32_t amax[kRowWarps];
  __shared__ float row_rs;
  zero_stage_tail<Q::B>(stage, D, q.runs);
  const int64_t groups = D / 4;
  unsigned nonfinite = 0;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    if (threadIdx.x < 32) {
      const float rs = rmsnorm_row_rstd(x, eps, rstd, n, D, true, b, sum);
      if (threadIdx.x == 0) row_rs = rs;
    }
    __syncthreads();
    const float rs = row_rs;
    const float* xr = b ? sum + n * D : x + n * D;
    for (int64_t g = threadIdx.x; g < groups; g += kRowThreads) {
      float xv[4], wv[4], out[4];
      load4(xr, 4 * g, D, true, xv);
      load4(w, 4 * g, D, true, wv);
#pragma unroll
      for (int c = 0; c < 4; ++c) out[c] = rmsnorm_value(xv[c], rs, wv[c]);
      store4(y + n * D, 4 * g, D, true, out);
      if (yb) store4(yb + n * D, 4 * g, D, vec_b, out);
      stage_group<Q::B>(stage, g, out);
    }
    __syncthreads();
    Q::quantize(stage, n, D, q, amax, nonfinite);
    __syncthreads();  // the stage, row_rs and amax are the next row's
  }
  raise_nonfinite(q.nonfinite_flag, nonfinite);
}

// swiglu_forward_kernel's elements, a row a CTA, every thread taking groups tid, tid + 256, ...
template <class Q>
__global__ void __launch_bounds__(kRowThreads)
    swiglu_rows_quantized_kernel(const float* h13, float* a, int64_t rows, int64_t F, RowQuantArgs q) {
  dependent_launch_prologue();
  extern __shared__ __align__(16) float stage[];
  __shared__ uint32_t amax[kRowWarps];
  zero_stage_tail<Q::B>(stage, F, q.runs);
  const int64_t groups = F / 4;
  unsigned nonfinite = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* h1 = h13 + r * 2 * F;
    const float* h3 = h1 + F;
    for (int64_t g = threadIdx.x; g < groups; g += kRowThreads) {
      float z[4], u[4], out[4];
      load4(h1, 4 * g, F, true, z);
      load4(h3, 4 * g, F, true, u);
#pragma unroll
      for (int c = 0; c < 4; ++c) out[c] = swiglu_value(z[c], u[c]);
      store4(a + r * F, 4 * g, F, true, out);
      stage_group<Q::B>(stage, g, out);
    }
    __syncthreads();
    Q::quantize(stage, r, F, q, amax, nonfinite);
    __syncthreads();
  }
  raise_nonfinite(q.nonfinite_flag, nonfinite);
}

int stage_floats(const QuantSpec& spec, int64_t cols) {
  const int64_t run = int64_t(kRunValues) * spec.block();
  return int((cols + run - 1) / run * run);
}

// launch(Q{}) with the row quantizer of spec (row_quant_fused's specs).
template <typename Launch>
void with_row_quantizer(const QuantSpec& spec, Launch&& launch) {
  switch (spec.fmt) {
    case Format::MXFP8_E4M3: return launch(MxRows<4>{});
    case Format::MXFP8_E5M2: return launch(MxRows<5>{});
    default:
      if (!spec.four_over_six) return launch(Nvfp4Rows<false, num::ScaleMetric::MSE>{});
      if (spec.metric == num::ScaleMetric::MSE) return launch(Nvfp4Rows<true, num::ScaleMetric::MSE>{});
      return launch(Nvfp4Rows<true, num::ScaleMetric::MAE>{});
  }
}

RowQuantArgs row_quant_args(const QuantSpec& spec, int64_t cols, QTensor& q) {
  RowQuantArgs a{};
  a.codes = q.codes.data<uint8_t>();
  a.scales = q.block_scales.data<uint8_t>();
  a.outer = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  a.code_ld = q.code_row_bytes();
  a.nb = q.blocks_per_row();
  a.stage_floats = stage_floats(spec, cols);
  a.runs = int(a.stage_floats / (int64_t(kRunValues) * spec.block()));
  a.mx_rule = spec.mx_rule;
  a.nonfinite_flag = nonfinite_flag_address();
  return a;
}

// A CTA a row (grid_for caps the grid; the kernels stride over the rest), with the row's stage
// in dynamic shared memory, opted in where it and the kernel's own few static words pass 48 KB
// (without an opt-in the two together must fit: a 48 KB stage alone does not).
template <auto kernel, typename... Args>
void launch_rows(int64_t rows, const RowQuantArgs& q, Args... args) {
  static const size_t static_smem = [] {
    cudaFuncAttributes a{};
    FOURBIT_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
    return a.sharedSizeBytes;
  }();
  const size_t smem = size_t(q.stage_floats) * sizeof(float);
  allow_smem<kernel>(smem + static_smem);
  launch_dependent(kernel, grid_for(rows, 1), kRowThreads, smem, args..., q);
}

}  // namespace

bool row_quant_fused(const QuantSpec& spec, int64_t cols) {
  const bool mx = (spec.fmt == Format::MXFP8_E4M3 || spec.fmt == Format::MXFP8_E5M2);
  const bool nvfp4 = spec.fmt == Format::NVFP4 && spec.outer == OuterScale::PerRow;
  return (mx || nvfp4) && spec.axis == BlockAxis::Row && spec.rounding == num::Rounding::RNE && spec.hadamard == 0 &&
         !spec.tile_2d && cols > 0 && cols % 4 == 0 &&
         int64_t(stage_floats(spec, cols)) * int64_t(sizeof(float)) <= kStageBudget;
}

void launch_rmsnorm_rows_quantized(const float* x, const float* w, double eps, float* y, float* rstd, int64_t N,
                                   int64_t D, uint16_t* yb, bool vec_b, const float* b, float* sum,
                                   const QuantSpec& spec, QTensor& q) {
  const RowQuantArgs args = row_quant_args(spec, D, q);
  with_row_quantizer(spec, [&](auto quantizer) {
    launch_rows<rmsnorm_rows_quantized_kernel<decltype(quantizer)>>(N, args, x, w, eps, y, rstd, N, D, yb, vec_b, b,
                                                                     sum);
  });
}

void launch_swiglu_rows_quantized(const float* h13, float* a, int64_t rows, int64_t F, const QuantSpec& spec,
                                  QTensor& q) {
  const RowQuantArgs args = row_quant_args(spec, F, q);
  with_row_quantizer(spec, [&](auto quantizer) {
    launch_rows<swiglu_rows_quantized_kernel<decltype(quantizer)>>(rows, args, h13, a, rows, F);
  });
}

}  // namespace fourbit::ops::cuda
