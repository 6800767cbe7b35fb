// defines: cuda::flash_attention_forward, cuda::flash_attention_backward
// Causal grouped-query attention fused into three kernels that never write the scores (the
// FlashAttention-2 schedule, Dao 2023): BF16 tensor-core MMAs (mma.sync m16n8k16, FP32
// accumulation) on tiles of 64 queries x 64 keys, with the softmax kept online in registers.
//
//   forward   one CTA per (64-query block, q head, sequence): S = Q K^T, running max and sum,
//             O += P V with P rounded to BF16, O / l and lse = m + log l at the end.
//   dQ        one CTA per (64-query block, q head, sequence): P again from lse,
//             dS = P (dP - D) * scale with dP = dO V^T and D = rowsum(dO * O) (attention.cu's
//             rowdot), dQ += dS K.
//   dK, dV    one CTA per (64-key block, kv head, sequence), looping over the group's q heads and
//             the query blocks at or after the keys: dV += P^T dO, dK += dS^T Q.
//
// Q, K, V and dO are read in FP32 from the model's [B, T, H, hd] layout and rounded to BF16 as
// the materialized path's to_heads does; outputs go straight back to [B, T, H, hd] FP32. Every
// sum runs in a fixed order (no atomics), so results are deterministic, and the work for a query
// row depends only on that row, its keys and the key blocks (64 keys aligned to absolute
// positions): a sequence gives the same bits alone or in a batch, and a KV-cache decode step
// gives the bits of the full forward's row (fully masked key blocks change nothing: their scale
// factor is exp(0) = 1 and their P is 0).
//
// Supported: hd 32 or 64 (registers: the dK/dV kernel holds K, V and both gradients of 16 keys
// per warp), 16-byte aligned tensors. Anything else returns false and attention.cu takes the
// materialized path.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kFaBlock = 64;           // queries and keys per tile
constexpr int kFaThreads = 128;        // 4 warps, 16 rows each
constexpr int kFaTransLd = kFaBlock + 8;  // BF16 row stride of a transposed tile [hd][64]
template <int HD>
constexpr int kFaLd = HD + 8;          // BF16 row stride of a row-major tile [64][hd]
// (+8 BF16 = 16 bytes: the 32-bit fragment loads of a warp fall in 32 different banks)

// C (16x8, FP32) += A (16x16, BF16, row) * B (16x8, BF16, col): PTX's m16n8k16 fragments, with
// gid = lane / 4 and tig = lane % 4: a = {(gid, 2tig..), (gid+8, 2tig..), (gid, 2tig+8..),
// (gid+8, 2tig+8..)}, b = {(k 2tig.., n gid), (k 2tig+8.., n gid)}, c = {(gid, 2tig), (gid, 2tig+1),
// (gid+8, 2tig), (gid+8, 2tig+1)}. The lower k index of a pair sits in the low 16 bits.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t ld_pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragments of k-step kk for the warp's rows r .. r+15 of a row-major tile (stride ld).
__device__ __forceinline__ void load_a(const __nv_bfloat16* tile, int ld, int r, int kk, uint32_t (&a)[4]) {
  const int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
  const __nv_bfloat16* p = tile + (r + gid) * ld + kk * 16 + 2 * tig;
  a[0] = ld_pair(p);
  a[1] = ld_pair(p + 8 * ld);
  a[2] = ld_pair(p + 8);
  a[3] = ld_pair(p + 8 * ld + 8);
}

// acc[n-tile] (16 x 8N) += A (16 x 16K, the warp's fragments) * Y^T, Y stored [n][k] with stride ld:
// every product of these kernels is "rows times the transpose of a tile".
template <int N, int K>
__device__ __forceinline__ void mma_rows_by_tile(float (&acc)[N][4], const uint32_t (&a)[K][4], const __nv_bfloat16* y,
                                                 int ld) {
  const int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const __nv_bfloat16* p = y + (n * 8 + gid) * ld + 2 * tig;
#pragma unroll
    for (int k = 0; k < K; ++k) mma_bf16(acc[n], a[k], ld_pair(p + k * 16), ld_pair(p + k * 16 + 8));
  }
}

// A 16 x 64 accumulator tile (8 n-tiles) as the BF16 A fragments of four k-steps (RNE).
__device__ __forceinline__ void acc_to_a(const float (&c)[8][4], uint32_t (&a)[4][4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a[k][0] = pack_bf16(c[2 * k][0], c[2 * k][1]);
    a[k][1] = pack_bf16(c[2 * k][2], c[2 * k][3]);
    a[k][2] = pack_bf16(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[k][3] = pack_bf16(c[2 * k + 1][2], c[2 * k + 1][3]);
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Rows r0 .. r0+63 of x (row r at x + r * stride, HD floats, 16-byte aligned) rounded to BF16
// into a row-major tile (stride HD + 8) and/or a transposed one (stride 72); rows at or past
// `rows` are zeros.
template <int HD>
__device__ __forceinline__ void load_tile(const float* __restrict__ x, int64_t stride, int r0, int rows,
                                          __nv_bfloat16* row_major, __nv_bfloat16* transposed) {
  constexpr int kUnits = HD / 4;
  for (int i = threadIdx.x; i < kFaBlock * kUnits; i += kFaThreads) {
    const int r = i / kUnits, c = (i % kUnits) * 4;
    float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r0 + r < rows) f = *reinterpret_cast<const float4*>(x + int64_t(r0 + r) * stride + c);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(f.x, f.y), hi = __floats2bfloat162_rn(f.z, f.w);
    if (row_major) {
      uint2 u;
      u.x = *reinterpret_cast<const uint32_t*>(&lo);
      u.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(row_major + r * kFaLd<HD> + c) = u;
    }
    if (transposed) {
      transposed[(c + 0) * kFaTransLd + r] = lo.x;
      transposed[(c + 1) * kFaTransLd + r] = lo.y;
      transposed[(c + 2) * kFaTransLd + r] = hi.x;
      transposed[(c + 3) * kFaTransLd + r] = hi.y;
    }
  }
}

// The thread's two rows of a 16-row warp tile: gid and gid + 8.
__device__ __forceinline__ int frag_row(int half) { return ((threadIdx.x & 31) >> 2) + 8 * half; }
// Column of element e (0..3) of n-tile n in an accumulator: 8n + 2 tig + (e & 1).
__device__ __forceinline__ int frag_col(int n, int e) { return 8 * n + 2 * (threadIdx.x & 3) + (e & 1); }

// Sum (or max) over the four threads that hold one row (lanes 4 gid .. 4 gid + 3), fixed order.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

struct FaDims {
  int B, T, S, Hq, Hkv, pos0;
  float scale;
};

// ---- forward ----------------------------------------------------------------------------------

template <int HD>
__global__ void __launch_bounds__(kFaThreads) flash_forward_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                                   const float* __restrict__ v, FaDims d,
                                                                   float* __restrict__ out, float* __restrict__ lse) {
  constexpr int KS = HD / 16, ND = HD / 8;
  __shared__ __align__(16) __nv_bfloat16 qs[kFaBlock * kFaLd<HD>];
  __shared__ __align__(16) __nv_bfloat16 ks[kFaBlock * kFaLd<HD>];
  __shared__ __align__(16) __nv_bfloat16 vt[HD * kFaTransLd];
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int t0 = qb * kFaBlock, warp_row = (threadIdx.x >> 5) * 16;
  const int64_t q_stride = int64_t(d.Hq) * HD, kv_stride = int64_t(d.Hkv) * HD;
  const float* qh = q + (int64_t(b) * d.T * d.Hq + h) * HD;
  const float* kh = k + (int64_t(b) * d.S * d.Hkv + hk) * HD;
  const float* vh = v + (int64_t(b) * d.S * d.Hkv + hk) * HD;

  load_tile<HD>(qh, q_stride, t0, d.T, qs, nullptr);
  __syncthreads();
  uint32_t qa[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) load_a(qs, kFaLd<HD>, warp_row, kk, qa[kk]);

  int pos[2];  // absolute positions of the thread's two rows
#pragma unroll
  for (int i = 0; i < 2; ++i) pos[i] = d.pos0 + t0 + warp_row + frag_row(i);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[ND][4];
  zero(o);
  const int last_key = min(d.S - 1, d.pos0 + min(d.T - 1, t0 + kFaBlock - 1));
  for (int kb = 0; kb * kFaBlock <= last_key; ++kb) {
    const int s0 = kb * kFaBlock;
    __syncthreads();  // the previous block's K and V are no longer read
    load_tile<HD>(kh, kv_stride, s0, d.S, ks, nullptr);
    load_tile<HD>(vh, kv_stride, s0, d.S, nullptr, vt);
    __syncthreads();
    float s[8][4];
    zero(s);
    mma_rows_by_tile(s, qa, ks, kFaLd<HD>);
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = e >> 1;
        s[n][e] = s0 + frag_col(n, e) <= pos[row] ? s[n][e] * d.scale : -INFINITY;
        block_max[row] = fmaxf(block_max[row], s[n][e]);
      }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], quad_max(block_max[i]));  // finite: key 0 is never masked
      alpha[i] = expf(m[i] - m_new);
      m[i] = m_new;
      l[i] *= alpha[i];
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = expf(s[n][e] - m[e >> 1]);
        l[e >> 1] += s[n][e];
      }
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
    uint32_t pa[4][4];
    acc_to_a(s, pa);
    mma_rows_by_tile(o, pa, vt, kFaTransLd);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = t0 + warp_row + frag_row(i);
    const float sum = quad_sum(l[i]);
    if (t >= d.T) continue;
    float* orow = out + (int64_t(b) * d.T + t) * q_stride + int64_t(h) * HD;
#pragma unroll
    for (int n = 0; n < ND; ++n)
      *reinterpret_cast<float2*>(orow + frag_col(n, 0)) = make_float2(o[n][2 * i] / sum, o[n][2 * i + 1] / sum);
    if ((threadIdx.x & 3) == 0) lse[(int64_t(b) * d.Hq + h) * d.T + t] = m[i] + logf(sum);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// dS = P (dP - D) * scale for an accumulator tile s (scores, unscaled) and dp, in place in s:
// P = exp(s * scale - lse) where `visible`, else 0. lse_of / D_of give a fragment element's row
// values (queries are rows in the dQ kernel, columns in the dK/dV kernel). p receives P.
template <typename Visible, typename LseOf, typename DOf>
__device__ __forceinline__ void softmax_grad(float (&s)[8][4], const float (&dp)[8][4], float (&p)[8][4], float scale,
                                             Visible visible, LseOf lse_of, DOf d_of) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pv = visible(n, e) ? expf(s[n][e] * scale - lse_of(n, e)) : 0.0f;
      p[n][e] = pv;
      s[n][e] = pv * (dp[n][e] - d_of(n, e)) * scale;
    }
}

template <int HD>
__global__ void __launch_bounds__(kFaThreads) flash_dq_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                              const float* __restrict__ v, const float* __restrict__ dout,
                                                              const float* __restrict__ lse, const float* __restrict__ D,
                                                              FaDims d, float* __restrict__ dq) {
  constexpr int KS = HD / 16, ND = HD / 8;
  __shared__ __align__(16) __nv_bfloat16 ks[kFaBlock * kFaLd<HD>];
  __shared__ __align__(16) __nv_bfloat16 kt[HD * kFaTransLd];
  __shared__ __align__(16) __nv_bfloat16 vs[kFaBlock * kFaLd<HD>];
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int t0 = qb * kFaBlock, warp_row = (threadIdx.x >> 5) * 16;
  const int64_t q_stride = int64_t(d.Hq) * HD, kv_stride = int64_t(d.Hkv) * HD;
  const float* kh = k + (int64_t(b) * d.S * d.Hkv + hk) * HD;
  const float* vh = v + (int64_t(b) * d.S * d.Hkv + hk) * HD;

  // Q and dO fragments, staged through the K and V tiles' memory
  uint32_t qa[KS][4], da[KS][4];
  load_tile<HD>(q + (int64_t(b) * d.T * d.Hq + h) * HD, q_stride, t0, d.T, ks, nullptr);
  load_tile<HD>(dout + (int64_t(b) * d.T * d.Hq + h) * HD, q_stride, t0, d.T, vs, nullptr);
  __syncthreads();
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    load_a(ks, kFaLd<HD>, warp_row, kk, qa[kk]);
    load_a(vs, kFaLd<HD>, warp_row, kk, da[kk]);
  }
  int t[2];
  float row_lse[2], row_d[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    t[i] = t0 + warp_row + frag_row(i);
    const int64_t r = (int64_t(b) * d.Hq + h) * d.T + min(t[i], d.T - 1);
    row_lse[i] = lse[r];
    row_d[i] = D[r];
  }
  float acc[ND][4];
  zero(acc);
  const int last_key = min(d.T - 1, t0 + kFaBlock - 1);
  for (int kb = 0; kb * kFaBlock <= last_key; ++kb) {
    const int s0 = kb * kFaBlock;
    __syncthreads();
    load_tile<HD>(kh, kv_stride, s0, d.S, ks, kt);
    load_tile<HD>(vh, kv_stride, s0, d.S, vs, nullptr);
    __syncthreads();
    float s[8][4], dp[8][4], p[8][4];
    zero(s);
    zero(dp);
    mma_rows_by_tile(s, qa, ks, kFaLd<HD>);
    mma_rows_by_tile(dp, da, vs, kFaLd<HD>);
    softmax_grad(
        s, dp, p, d.scale, [&](int n, int e) { return s0 + frag_col(n, e) <= t[e >> 1]; },
        [&](int, int e) { return row_lse[e >> 1]; }, [&](int, int e) { return row_d[e >> 1]; });
    uint32_t dsa[4][4];
    acc_to_a(s, dsa);
    mma_rows_by_tile(acc, dsa, kt, kFaTransLd);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (t[i] >= d.T) continue;
    float* row = dq + (int64_t(b) * d.T + t[i]) * q_stride + int64_t(h) * HD;
#pragma unroll
    for (int n = 0; n < ND; ++n) *reinterpret_cast<float2*>(row + frag_col(n, 0)) = make_float2(acc[n][2 * i], acc[n][2 * i + 1]);
  }
}

template <int HD>
__global__ void __launch_bounds__(kFaThreads) flash_dkv_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                               const float* __restrict__ v, const float* __restrict__ dout,
                                                               const float* __restrict__ lse, const float* __restrict__ D,
                                                               FaDims d, float* __restrict__ dk, float* __restrict__ dv) {
  constexpr int KS = HD / 16, ND = HD / 8;
  __shared__ __align__(16) __nv_bfloat16 qs[kFaBlock * kFaLd<HD>];
  __shared__ __align__(16) __nv_bfloat16 qt[HD * kFaTransLd];
  __shared__ __align__(16) __nv_bfloat16 dos[kFaBlock * kFaLd<HD>];
  __shared__ __align__(16) __nv_bfloat16 dot[HD * kFaTransLd];
  __shared__ float q_lse[kFaBlock], q_d[kFaBlock];
  const int kb = blockIdx.x;  // the most work first: key block 0 sees every query block
  const int hk = blockIdx.y, b = blockIdx.z, group = d.Hq / d.Hkv;
  const int s0 = kb * kFaBlock, warp_row = (threadIdx.x >> 5) * 16;
  const int64_t q_stride = int64_t(d.Hq) * HD, kv_stride = int64_t(d.Hkv) * HD;

  // K and V fragments of the warp's 16 keys, staged through the Q and dO tiles' memory
  uint32_t ka[KS][4], va[KS][4];
  load_tile<HD>(k + (int64_t(b) * d.S * d.Hkv + hk) * HD, kv_stride, s0, d.S, qs, nullptr);
  load_tile<HD>(v + (int64_t(b) * d.S * d.Hkv + hk) * HD, kv_stride, s0, d.S, dos, nullptr);
  __syncthreads();
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    load_a(qs, kFaLd<HD>, warp_row, kk, ka[kk]);
    load_a(dos, kFaLd<HD>, warp_row, kk, va[kk]);
  }
  int key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) key[i] = s0 + warp_row + frag_row(i);
  float gk[ND][4], gv[ND][4];
  zero(gk);
  zero(gv);
  const int q_blocks = (d.T + kFaBlock - 1) / kFaBlock;
  for (int g = 0; g < group; ++g) {
    const int h = hk * group + g;
    const float* qh = q + (int64_t(b) * d.T * d.Hq + h) * HD;
    const float* doh = dout + (int64_t(b) * d.T * d.Hq + h) * HD;
    const int64_t row0 = (int64_t(b) * d.Hq + h) * d.T;
    for (int qb = kb; qb < q_blocks; ++qb) {  // causal: queries at or after the block's first key
      const int t0 = qb * kFaBlock;
      __syncthreads();
      load_tile<HD>(qh, q_stride, t0, d.T, qs, qt);
      load_tile<HD>(doh, q_stride, t0, d.T, dos, dot);
      for (int i = threadIdx.x; i < kFaBlock; i += kFaThreads) {
        q_lse[i] = t0 + i < d.T ? lse[row0 + t0 + i] : 0.0f;
        q_d[i] = t0 + i < d.T ? D[row0 + t0 + i] : 0.0f;
      }
      __syncthreads();
      float s[8][4], dp[8][4], p[8][4];  // transposed: keys are rows, queries columns
      zero(s);
      zero(dp);
      mma_rows_by_tile(s, ka, qs, kFaLd<HD>);
      mma_rows_by_tile(dp, va, dos, kFaLd<HD>);
      softmax_grad(
          s, dp, p, d.scale,
          [&](int n, int e) {
            const int tq = t0 + frag_col(n, e);
            return tq < d.T && key[e >> 1] <= tq;
          },
          [&](int n, int e) { return q_lse[frag_col(n, e)]; }, [&](int n, int e) { return q_d[frag_col(n, e)]; });
      uint32_t pa[4][4], dsa[4][4];
      acc_to_a(p, pa);
      acc_to_a(s, dsa);
      mma_rows_by_tile(gv, pa, dot, kFaTransLd);
      mma_rows_by_tile(gk, dsa, qt, kFaTransLd);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key[i] >= d.S) continue;
    const int64_t off = (int64_t(b) * d.S + key[i]) * kv_stride + int64_t(hk) * HD;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      *reinterpret_cast<float2*>(dk + off + frag_col(n, 0)) = make_float2(gk[n][2 * i], gk[n][2 * i + 1]);
      *reinterpret_cast<float2*>(dv + off + frag_col(n, 0)) = make_float2(gv[n][2 * i], gv[n][2 * i + 1]);
    }
  }
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0; }

// The launch shape shared by the three kernels, or false when the fused path does not apply.
bool fa_dims(const Tensor& q, const Tensor& k, int64_t pos0, std::initializer_list<const Tensor*> all, FaDims& d,
             int& hd) {
  hd = int(q.size(3));
  if (hd != 32 && hd != 64) return false;
  for (const Tensor* t : all)
    if (!aligned16(*t)) return false;
  const int64_t B = q.size(0), T = q.size(1), S = k.size(1), Hq = q.size(2), Hkv = k.size(2);
  if (B > 65535 || Hq > 65535 || T > INT32_MAX / 2 || S > INT32_MAX / 2 || pos0 > INT32_MAX / 4) return false;
  d = FaDims{int(B), int(T), int(S), int(Hq), int(Hkv), int(pos0), float(1.0 / std::sqrt(double(hd)))};
  return true;
}

unsigned blocks_of(int64_t n) { return unsigned((n + kFaBlock - 1) / kFaBlock); }

}  // namespace

bool flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out,
                             Tensor& lse) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, pos0, {&q, &k, &v, &out}, d, hd)) return false;
  if (d.T == 0 || d.B == 0) return true;
  const dim3 grid(blocks_of(d.T), unsigned(d.Hq), unsigned(d.B));
  if (hd == 32)
    flash_forward_kernel<32><<<grid, kFaThreads, 0, stream()>>>(q.data<float>(), k.data<float>(), v.data<float>(), d,
                                                                 out.data<float>(), lse.data<float>());
  else
    flash_forward_kernel<64><<<grid, kFaThreads, 0, stream()>>>(q.data<float>(), k.data<float>(), v.data<float>(), d,
                                                                 out.data<float>(), lse.data<float>());
  FOURBIT_LAUNCH_CHECK();
  return true;
}

bool flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                              const Tensor& D, Tensor& dq, Tensor& dk, Tensor& dv) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, 0, {&dout, &q, &k, &v, &dq, &dk, &dv}, d, hd)) return false;
  if (d.T == 0 || d.B == 0) return true;
  const dim3 q_grid(blocks_of(d.T), unsigned(d.Hq), unsigned(d.B)), kv_grid(blocks_of(d.S), unsigned(d.Hkv), unsigned(d.B));
  if (hd == 32) {
    flash_dq_kernel<32><<<q_grid, kFaThreads, 0, stream()>>>(q.data<float>(), k.data<float>(), v.data<float>(),
                                                             dout.data<float>(), lse.data<float>(), D.data<float>(), d,
                                                             dq.data<float>());
    flash_dkv_kernel<32><<<kv_grid, kFaThreads, 0, stream()>>>(q.data<float>(), k.data<float>(), v.data<float>(),
                                                               dout.data<float>(), lse.data<float>(), D.data<float>(), d,
                                                               dk.data<float>(), dv.data<float>());
  } else {
    flash_dq_kernel<64><<<q_grid, kFaThreads, 0, stream()>>>(q.data<float>(), k.data<float>(), v.data<float>(),
                                                             dout.data<float>(), lse.data<float>(), D.data<float>(), d,
                                                             dq.data<float>());
    flash_dkv_kernel<64><<<kv_grid, kFaThreads, 0, stream()>>>(q.data<float>(), k.data<float>(), v.data<float>(),
                                                               dout.data<float>(), lse.data<float>(), D.data<float>(), d,
                                                               dk.data<float>(), dv.data<float>());
  }
  FOURBIT_LAUNCH_CHECK();
  return true;
}

}  // namespace fourbit::ops::cuda
