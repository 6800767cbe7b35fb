// defines: QuantParams, quant_smem_bytes, quantize_tile_kernel, amax_segments_kernel,
//          outer_scale_kernel, launch_quantize_tiles, launch_quantize, outer_groups, outer_amax_prepass
// The generic quantizer: every spec of every format, one CTA per storage tile staged in shared
// memory, each block through the numerics/ block quantizer (the CPU's functions, so the bytes are
// the CPU's), and the NVFP4 outer-scale pre-pass (group amaxes, then S_enc / S_dec) for scales
// the tile cannot see whole.
#pragma once
#include "fourbit/ops/cuda/cast/cast_common.cuh"

namespace fourbit::ops::cuda {
namespace {

// ---- the quantize kernel ------------------------------------------------------------------------

struct QuantParams {
  LoadArgs in;
  TileGeom geom;
  int64_t slices, padded_cols, nb, code_row_bytes;
  uint8_t* codes;               // NVFP4: null where the form is its BF16 decode alone (bf16)
  uint8_t* scales;
  __nv_bfloat16* bf16;          // NVFP4: the BF16 decode [rows, padded_cols] (ops::FormOut), or null
  float* outer;                 // S_dec output (fused per-row path writes it)
  float* row_amax;              // NVFP4 per-row scales: each row's amax (QTensor::row_amax), or null
  OuterScale outer_kind;
  const uint32_t* group_amax;   // pre-pass result (bits), or null (fused / None)
  uint32_t* amax_out;           // amax mode: per-group maxima (bits)
  bool fused_row_amax;
  bool tile_2d, four_over_six;
  num::ScaleMetric metric;
  num::Rounding rounding;
  num::MxScaleRule mx_rule;
  num::MiniFloatSpec elem;      // MXFP8 element format (by value: usable in device code)
  int hadamard;
  uint32_t hadamard_signs;
  uint64_t seed, stream;
  bool report;
};

// Tile, block amaxes, per-row S_enc and amax, and (8-bit codes) the per-thread code staging.
size_t quant_smem_bytes(const TileGeom& g, int block, bool stage) {
  const size_t nbt = size_t(g.tcols / block);
  return sizeof(float) * (size_t(g.trows) * g.rs + size_t(g.trows) * nbt + 2 * size_t(g.trows)) +
         (stage ? size_t(kThreads) * kStageBytes : 0);
}

// kAmaxOnly: the pre-pass for outer scales behind an RHT or over column groups: phase A only,
// then the per-group maxima go to p.amax_out (nothing is counted: the quantize pass counts).
// kSR (the spec's rounding) and kFos (Four Over Six) are template parameters so that each kernel
// carries only the numerics branch it runs.
template <Kind K, bool kCol, bool kAmaxOnly, bool kSR, bool kFos>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(const QuantParams p) {
  constexpr int B = kBlockOf<K>;
  constexpr num::Rounding kRounding = kSR ? num::Rounding::SR : num::Rounding::RNE;
  extern __shared__ __align__(16) unsigned char smem[];
  const TileGeom& g = p.geom;
  const int nbt = g.tcols / B;
  float* tile = reinterpret_cast<float*>(smem);
  float* bamax = tile + g.trows * g.rs;
  float* row_senc = bamax + g.trows * nbt;
  uint32_t* row_amax = reinterpret_cast<uint32_t*>(row_senc + g.trows);
  uint8_t* stage = reinterpret_cast<uint8_t*>(row_amax + g.trows) + threadIdx.x * kStageBytes;

  const TileCoords tc = tile_coords(g, p.in.srows, p.nb, B);
  const int64_t g0 = tc.s * p.in.srows + tc.r0;  // global storage row of tile row 0

  load_tile<B, kCol>(p.in, tc, g.rs, tile);
  for (int rr = threadIdx.x; rr < tc.rows; rr += kThreads) row_amax[rr] = 0u;
  __syncthreads();

  // Phase A: count non-finite inputs (before an RHT spreads them over a chunk, as the CPU
  // counts them; padding is zero), rotate, block amax (of the rotated values: what gets quantized).
  unsigned nonfinite = 0;
  const bool want_row_amax = kAmaxOnly || p.fused_row_amax;
  for (GridWalk w(tc.nblk); w.outer < tc.rows; w.next()) {
    const int rr = w.outer, bb = w.inner;
    float* xb = tile + rr * g.rs + bb * (B + 1);
    float a = 0.0f;
    if (p.hadamard) {
      if (!kAmaxOnly) {
#pragma unroll
        for (int i = 0; i < B; ++i) nonfinite += num::is_finite_bits(xb[i]) ? 0u : 1u;
      }
      rotate_block<B>(xb, p.hadamard, p.hadamard_signs, false);
#pragma unroll
      for (int i = 0; i < B; ++i) a = num::max_abs_finite(a, xb[i]);
    } else {  // one pass over the block
#pragma unroll
      for (int i = 0; i < B; ++i) {
        a = num::max_abs_finite(a, xb[i]);
        if (!kAmaxOnly) nonfinite += num::is_finite_bits(xb[i]) ? 0u : 1u;
      }
    }
    if (!kAmaxOnly) bamax[rr * nbt + bb] = a;
    if (want_row_amax) atomic_max_amax(&row_amax[rr], a);
  }
  __syncthreads();

  if constexpr (kAmaxOnly) {
    for (int rr = threadIdx.x; rr < tc.rows; rr += kThreads)
      atomicMax(&p.amax_out[group_of(p.outer_kind, g0 + rr, p.in.srows)], row_amax[rr]);
    return;
  } else {
    // Phase A2. NUMERICS: 16x16 tiles take one scale from the tile amax (tiles start at row 0
    // of each slice; tile rows start at multiples of 16 and never cross a slice).
    if (K == Kind::Nvfp4 && p.tile_2d) {
      const int groups = (tc.rows + 15) / 16;
      for (int k = threadIdx.x; k < groups * tc.nblk; k += kThreads) {
        const int r_begin = (k / tc.nblk) * 16, bb = k % tc.nblk;
        const int r_end = tc.rows < r_begin + 16 ? tc.rows : r_begin + 16;
        float a = 0.0f;
        for (int rr = r_begin; rr < r_end; ++rr) a = fmaxf(a, bamax[rr * nbt + bb]);
        for (int rr = r_begin; rr < r_end; ++rr) bamax[rr * nbt + bb] = a;
      }
    }
    if (K == Kind::Nvfp4) {
      for (int rr = threadIdx.x; rr < tc.rows; rr += kThreads) {
        float se = 1.0f;
        if (p.fused_row_amax) {
          se = num::nvfp4_s_enc(num::float_of(row_amax[rr]), kFos);
          p.outer[g0 + rr] = num::nvfp4_s_dec(se);  // the tile spans the whole row: written once
          if (p.row_amax) p.row_amax[g0 + rr] = num::float_of(row_amax[rr]);
        } else if (p.outer_kind != OuterScale::None) {
          const int64_t grp = group_of(p.outer_kind, g0 + rr, p.in.srows);
          se = num::nvfp4_s_enc(num::float_of(p.group_amax[grp]), kFos);
        }
        row_senc[rr] = se;
      }
    }
    __syncthreads();

    // Phase B: one thread per block, the numerics block quantizer on the shared values.
    unsigned values = 0, blocks = 0, chose_four = 0;
    for (GridWalk w(tc.nblk); w.outer < tc.rows; w.next()) {
      const int rr = w.outer, bb = w.inner;
      const float* xb = tile + rr * g.rs + bb * (B + 1);
      const int64_t row = g0 + rr;
      const int64_t col = tc.c0 + int64_t(bb) * B;
      const int64_t blk = col / B;
      const int valid = int(min64(B, p.in.scols - col));
      // Padding past the last column is zero; behind an RHT the rotated padding is not, so
      // those blocks encode all B values (CPU: n = hadamard ? B : min(B, C - b * B)).
      const int n = p.hadamard ? B : valid;
      const uint64_t index0 = uint64_t(row * p.padded_cols + col);  // padded storage index (SR)
      const float amax = bamax[rr * nbt + bb];
      // Full blocks call the block quantizer with a constant n (its loops can then be unrolled);
      // the result is the same function of (x, n, ...) either way.
      if constexpr (K == Kind::Nvfp4) {
        const float se = row_senc[rr], sd = num::nvfp4_s_dec(se);
        const num::Nvfp4Block out =
            n == B ? num::nvfp4_quantize_block(xb, B, amax, se, sd, kFos, p.metric, kRounding,
                                               p.seed, p.stream, index0)
                   : num::nvfp4_quantize_block(xb, n, amax, se, sd, kFos, p.metric, kRounding,
                                               p.seed, p.stream, index0);
        if (p.codes) {
          *reinterpret_cast<uint64_t*>(p.codes + row * p.code_row_bytes + blk * 8) = out.packed;
          p.scales[row * p.nb + blk] = out.scale;
        }
        if (p.bf16) store_nvfp4_block_bf16(p.bf16 + row * p.padded_cols + col, out.packed, out.scale);
        chose_four += out.chose_four ? 1u : 0u;
      } else {
        uint32_t* w = reinterpret_cast<uint32_t*>(stage);
        if (n < B) {
#pragma unroll
          for (int i = 0; i < B / 4; ++i) w[i] = 0u;  // codes past n stay 0
        }
        uint8_t scale;
        if constexpr (K == Kind::Mx)
          scale = n == B ? num::mxfp8_quantize_block(xb, B, amax, p.elem, p.mx_rule, kRounding,
                                                     p.seed, p.stream, index0, stage)
                         : num::mxfp8_quantize_block(xb, n, amax, p.elem, p.mx_rule, kRounding,
                                                     p.seed, p.stream, index0, stage);
        else if constexpr (K == Kind::Mxfp4)  // 16 packed bytes (writes all of them)
          scale = n == B ? num::mxfp4_quantize_block(xb, B, amax, p.mx_rule, kRounding, p.seed, p.stream, index0, stage)
                         : num::mxfp4_quantize_block(xb, n, amax, p.mx_rule, kRounding, p.seed, p.stream, index0, stage);
        else
          scale = n == B ? num::s2f6_quantize_block(xb, B, amax, reinterpret_cast<int8_t*>(stage))
                         : num::s2f6_quantize_block(xb, n, amax, reinterpret_cast<int8_t*>(stage));
        uint4* dst = reinterpret_cast<uint4*>(p.codes + row * p.code_row_bytes + col * kCodeBits<K> / 8);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        if constexpr (kCodeBits<K> == 8) dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
        p.scales[row * p.nb + blk] = scale;
      }
      values += unsigned(valid);
      blocks += 1u;
    }
    flush_counts(p.report, values, nonfinite, blocks, chose_four);
  }
}

// ---- outer-scale pre-pass -----------------------------------------------------------------------

// amax over contiguous segments of x (a tensor, a slice or a row): one CTA per chunk of a
// segment, atomicMax of the chunk's maximum into out[segment].
__global__ void __launch_bounds__(kThreads)
    amax_segments_kernel(const float* __restrict__ x, int64_t seg_len, int64_t chunks_per_seg,
                         int64_t chunk_len, bool vec4, uint32_t* out) {
  const int64_t seg = blockIdx.x / chunks_per_seg, ch = blockIdx.x % chunks_per_seg;
  const float* base = x + seg * seg_len;
  const int64_t lo = ch * chunk_len, hi = min64(seg_len, lo + chunk_len);
  constexpr int U = 4;
  float a = 0.0f;
  if (vec4) {  // seg_len and chunk_len are multiples of 4, x is 16-byte aligned
    const float4* b4 = reinterpret_cast<const float4*>(base);
    for (int64_t i0 = lo / 4 + threadIdx.x; i0 < hi / 4; i0 += U * kThreads) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = i0 + u * kThreads;
        v[u] = i < hi / 4 ? __ldg(b4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        a = num::max_abs_finite(a, v[u].x);
        a = num::max_abs_finite(a, v[u].y);
        a = num::max_abs_finite(a, v[u].z);
        a = num::max_abs_finite(a, v[u].w);
      }
    }
  } else {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) a = num::max_abs_finite(a, __ldg(base + i));
  }
  __shared__ uint32_t warp_max[kThreads / 32];
  const uint32_t m = __reduce_max_sync(0xffffffffu, num::bits_of(a));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    const uint32_t w = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    const uint32_t all = __reduce_max_sync(0xffffffffu, w);
    if (threadIdx.x == 0 && all) atomicMax(out + seg, all);
  }
}

// S_dec per group from the group amax: outer[g] = nvfp4_s_dec(nvfp4_s_enc(amax_g)).
__global__ void outer_scale_kernel(const uint32_t* __restrict__ group_amax, int64_t groups,
                                   bool four_over_six, float* outer) {
  for (int64_t gi = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; gi < groups;
       gi += int64_t(gridDim.x) * blockDim.x)
    outer[gi] = num::nvfp4_s_dec(num::nvfp4_s_enc(num::float_of(group_amax[gi]), four_over_six));
}

template <Kind K, bool kCol, bool kAmaxOnly, bool kSR, bool kFos>
void launch_quantize_tiles(const QuantParams& p) {
  const int64_t ctas = p.geom.tiles(p.slices);
  if (ctas == 0) return;
  const size_t smem = quant_smem_bytes(p.geom, kBlockOf<K>, K != Kind::Nvfp4 && !kAmaxOnly);
  allow_smem<quantize_tile_kernel<K, kCol, kAmaxOnly, kSR, kFos>>(smem);
  quantize_tile_kernel<K, kCol, kAmaxOnly, kSR, kFos><<<grid_of(ctas, "quantize"), kThreads, smem, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

template <Kind K, bool kCol>
void launch_quantize(const QuantParams& p, bool sr, bool fos) {
  if constexpr (K == Kind::Nvfp4) {
    if (sr) fos ? launch_quantize_tiles<K, kCol, false, true, true>(p)
                : launch_quantize_tiles<K, kCol, false, true, false>(p);
    else fos ? launch_quantize_tiles<K, kCol, false, false, true>(p)
             : launch_quantize_tiles<K, kCol, false, false, false>(p);
  } else if constexpr (K == Kind::Mx || K == Kind::Mxfp4) {
    sr ? launch_quantize_tiles<K, kCol, false, true, false>(p)
       : launch_quantize_tiles<K, kCol, false, false, false>(p);
  } else {
    launch_quantize_tiles<K, kCol, false, false, false>(p);  // S2F6 is RNE only (quant_shape)
  }
}

template <Kind K>
void launch_quantize(const QuantParams& p, bool col) {
  const bool sr = p.rounding == num::Rounding::SR;
  if (col) launch_quantize<K, true>(p, sr, p.four_over_six);
  else launch_quantize<K, false>(p, sr, p.four_over_six);
}

// The outer-scale groups of q: 1, one per slice, or one per storage row.
int64_t outer_groups(const QTensor& q) {
  return q.outer == OuterScale::Tensor ? 1 : q.outer == OuterScale::PerSlice ? q.slices : q.total_rows();
}

// Raises gamax's groups to the amax of each outer-scale group of p's input (zeroed first when
// `zero`: several inputs into one gamax give their joint amax).
void outer_amax_prepass(const QuantParams& p, bool col, int64_t groups, uint32_t* gamax, int64_t R,
                        int64_t C, bool zero) {
  if (zero) FOURBIT_CUDA_CHECK(cudaMemsetAsync(gamax, 0, size_t(groups) * sizeof(uint32_t), stream()));
  const int64_t numel = p.slices * R * C;
  if (numel == 0) return;
  if (p.hadamard == 0 && !(col && p.outer_kind == OuterScale::PerRow)) {
    // Contiguous groups: the tensor, a slice, or (Row axis) a storage row.
    const int64_t seg_len = numel / groups;
    const bool vec4 = seg_len % 4 == 0 && aligned(p.in.x, 16);
    const int64_t chunk = std::min<int64_t>(seg_len, 32768);
    const int64_t chunks = (seg_len + chunk - 1) / chunk;
    amax_segments_kernel<<<grid_of(groups * chunks, "quantize"), kThreads, 0, stream()>>>(p.in.x, seg_len, chunks,
                                                                              chunk, vec4, gamax);
    FOURBIT_LAUNCH_CHECK();
  } else {
    QuantParams a = p;
    a.amax_out = gamax;
    if (col) launch_quantize_tiles<Kind::Nvfp4, true, true, false, false>(a);
    else launch_quantize_tiles<Kind::Nvfp4, false, true, false, false>(a);
  }
}

}  // namespace
}  // namespace fourbit::ops::cuda
