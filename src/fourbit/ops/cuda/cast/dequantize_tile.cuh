// defines: DequantParams, dequant_smem_bytes, dequant_tile_kernel, launch_dequant
// Exact dequantization of every format: a storage tile decoded (the registry's block decoders)
// into shared memory, the RHT undone, written in the logical layout with coalesced stores.
#pragma once
#include "fourbit/ops/cuda/cast/cast_common.cuh"

namespace fourbit::ops::cuda {
namespace {

struct DequantParams {
  DecodeArgs dec;
  TileGeom geom;
  int64_t scols;      // storage cols (unpadded)
  int hadamard;       // 0 when the rotation is kept
  uint32_t hadamard_signs;
  float* out;         // logical [S, R, C]
  bool vec4;          // float4 stores (contiguous output dimension % 4 == 0)
};

size_t dequant_smem_bytes(const TileGeom& g) { return sizeof(float) * size_t(g.trows) * g.rs; }

template <Kind K, bool kCol>
__global__ void __launch_bounds__(kThreads) dequant_tile_kernel(const DequantParams p) {
  constexpr int B = kBlockOf<K>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* tile = reinterpret_cast<float*>(smem);
  const TileGeom& g = p.geom;
  const TileCoords tc = tile_coords(g, p.dec.srows, p.dec.nb, B);
  const int64_t g0 = tc.s * p.dec.srows + tc.r0;

  for (GridWalk w(tc.nblk); w.outer < tc.rows; w.next()) {
    const int rr = w.outer, bb = w.inner;
    float v[B];
    decode_block<K>(p.dec, g0 + rr, tc.c0 / B + bb, v);
    float* xb = tile + rr * g.rs + bb * (B + 1);
#pragma unroll
    for (int i = 0; i < B; ++i) xb[i] = v[i];
    if (p.hadamard) rotate_block<B>(xb, p.hadamard, p.hadamard_signs, true);
  }
  __syncthreads();

  // Write the valid columns [c0, c0 + ncols) of each tile row in the logical layout.
  const int ncols = int(min64(int64_t(tc.nblk) * B, p.scols - tc.c0));
  if constexpr (!kCol) {
    float* base = p.out + g0 * p.scols + tc.c0;
    if (p.vec4) {  // scols % 4 == 0, so ncols % 4 == 0
      const int per_row = ncols / 4;
      for (int i = threadIdx.x; i < tc.rows * per_row; i += kThreads) {
        const int rr = i / per_row, c = 4 * (i % per_row);
        const float* s = tile + tile_pos<B>(rr, c, g.rs);
        *reinterpret_cast<float4*>(base + int64_t(rr) * p.scols + c) = make_float4(s[0], s[1], s[2], s[3]);
      }
    } else {
      for (int i = threadIdx.x; i < tc.rows * ncols; i += kThreads) {
        const int rr = i / ncols, c = i % ncols;
        base[int64_t(rr) * p.scols + c] = tile[tile_pos<B>(rr, c, g.rs)];
      }
    }
  } else {
    // Storage (row j, col i) of slice s is logical (s, i, j): out[(s * scols + i) * srows + j].
    const int64_t srows = p.dec.srows;
    float* base = p.out + (tc.s * p.scols + tc.c0) * srows + tc.r0;
    if (p.vec4) {  // srows % 4 == 0, so tc.rows % 4 == 0
      const int per_i = tc.rows / 4;
      for (int i = threadIdx.x; i < ncols * per_i; i += kThreads) {
        const int ii = i / per_i, jj = 4 * (i % per_i);
        *reinterpret_cast<float4*>(base + int64_t(ii) * srows + jj) =
            make_float4(tile[tile_pos<B>(jj, ii, g.rs)], tile[tile_pos<B>(jj + 1, ii, g.rs)],
                        tile[tile_pos<B>(jj + 2, ii, g.rs)], tile[tile_pos<B>(jj + 3, ii, g.rs)]);
      }
    } else {
      for (int i = threadIdx.x; i < ncols * tc.rows; i += kThreads) {
        const int ii = i / tc.rows, jj = i % tc.rows;
        base[int64_t(ii) * srows + jj] = tile[tile_pos<B>(jj, ii, g.rs)];
      }
    }
  }
}

template <Kind K, bool kCol>
void launch_dequant(const DequantParams& p, int64_t slices) {
  const int64_t ctas = p.geom.tiles(slices);
  if (ctas == 0) return;
  const size_t smem = dequant_smem_bytes(p.geom);
  allow_smem<dequant_tile_kernel<K, kCol>>(smem);
  dequant_tile_kernel<K, kCol><<<grid_of(ctas, "dequantize"), kThreads, smem, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

template <Kind K>
void launch_dequant(const DequantParams& p, int64_t slices, bool col) {
  if (col) launch_dequant<K, true>(p, slices);
  else launch_dequant<K, false>(p, slices);
}

}  // namespace
}  // namespace fourbit::ops::cuda
