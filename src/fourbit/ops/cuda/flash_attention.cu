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
//   dK, dV    one CTA per (64-key block, q head, sequence), looping over the query blocks at or
//             after the keys: dV += P^T dO, dK += dS^T Q, per q head ([B, Hq, S, hd]); attention.cu
//             sums each group's heads.
//
// Q, K, V and dO are rounded to BF16 (RNE, as the materialized path's to_heads) into copies in the
// model's [B, T, H, hd] layout, which the kernels stream through double-buffered shared-memory
// tiles with cp.async (the next block lands while the current one is multiplied); outputs go
// straight back to [B, T, H, hd] FP32. Every
// sum runs in a fixed order (no atomics), so results are deterministic, and the work for a query
// row depends only on that row, its keys and the key blocks (64 keys aligned to absolute
// positions): a sequence gives the same bits alone or in a batch, and a KV-cache decode step
// gives the bits of the full forward's row (fully masked key blocks change nothing: their scale
// factor is exp(0) = 1 and their P is 0).
//
// Fragments come from row-major BF16 tiles in shared memory by ldmatrix (.trans where the tile
// holds B itself rather than its transpose), in dynamic shared memory (87 KB for the forward at
// hd 128). Supported: hd 32, 64 or 128 and 16-byte aligned outputs; for anything else the entry
// points return false and attention.cu takes the materialized path.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/mma.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kFaBlock = 64;           // queries and keys per tile
constexpr int kFaThreads = 128;        // 4 warps, 16 rows each
template <int HD>
constexpr int kFaLd = HD + 8;  // BF16 row stride of a tile [64][hd]: +16 bytes, so the eight rows
                                // an ldmatrix reads sit in different banks

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragments of k-step kk for the warp's rows r .. r+15 of a row-major tile (stride ld):
// matrices (rows +0, k +0), (+8, +0), (+0, +8), (+8, +8).
__device__ __forceinline__ void load_a(const __nv_bfloat16* tile, int ld, int r, int kk, uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
  ldsm_x4<false>(a, tile + (r + 8 * (m & 1) + (lane & 7)) * ld + kk * 16 + 8 * (m >> 1));
}

// acc[n-tile] (16 x 8N) += A (16 x 16K, the warp's fragments) * B, with B (16K x 8N) held in a
// row-major BF16 tile y (stride ld) either as its transpose, y[n][k] (KMajor: S = Q K^T reads K
// stored [key][d]), or as itself, y[k][n] (O = P V reads V stored [key][d]). One ldmatrix gives
// the B fragments of two n-tiles: matrices (n +0, k +0), (n +0, k +8), (n +8, k +0), (n +8, k +8).
template <bool KMajor>
__device__ __forceinline__ void load_b_pair(const __nv_bfloat16* y, int ld, int n, int k, uint32_t (&b)[4]) {
  const int lane = threadIdx.x & 31, m = lane >> 3, i = lane & 7;
  if constexpr (KMajor)
    ldsm_x4<false>(b, y + (n * 8 + 8 * (m >> 1) + i) * ld + k * 16 + 8 * (m & 1));
  else
    ldsm_x4<true>(b, y + (k * 16 + 8 * (m & 1) + i) * ld + n * 8 + 8 * (m >> 1));
}

template <bool KMajor, int N, int K>
__device__ __forceinline__ void mma_tile(float (&acc)[N][4], const uint32_t (&a)[K][4], const __nv_bfloat16* y, int ld) {
  static_assert(N % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int n = 0; n < N; n += 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      uint32_t b[4];
      load_b_pair<KMajor>(y, ld, n, k, b);
      mma_bf16(acc[n], a[k], b[0], b[1]);
      mma_bf16(acc[n + 1], a[k], b[2], b[3]);
    }
  }
}

// The same product with A read from shared memory (rows warp_row .., stride lda) one k-step at a
// time, for the kernel whose accumulators leave no registers for A's fragments.
template <bool KMajor, int N, int K>
__device__ __forceinline__ void mma_tile_smem_a(float (&acc)[N][4], const __nv_bfloat16* a_tile, int lda, int warp_row,
                                                const __nv_bfloat16* y, int ld) {
  static_assert(N % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int k = 0; k < K; ++k) {
    uint32_t a[4];
    load_a(a_tile, lda, warp_row, k, a);
#pragma unroll
    for (int n = 0; n < N; n += 2) {
      uint32_t b[4];
      load_b_pair<KMajor>(y, ld, n, k, b);
      mma_bf16(acc[n], a, b[0], b[1]);
      mma_bf16(acc[n + 1], a, b[2], b[3]);
    }
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

// Starts copying rows r0 .. r0+63 of x (BF16, row r at x + r * stride, 16-byte aligned) into a
// row-major tile (stride HD + 8); rows at or past `rows` become zeros.
template <int HD>
__device__ __forceinline__ void load_tile_async(const __nv_bfloat16* __restrict__ x, int64_t stride, int r0, int rows,
                                                __nv_bfloat16* tile) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kFaBlock * kChunks; i += kFaThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool valid = r0 + r < rows;
    cp_async16(tile + r * kFaLd<HD> + c, valid ? x + int64_t(r0 + r) * stride + c : x, valid ? 16 : 0);
  }
}

// Starts copying the 64 row values v[r0 ..] (zeros past `rows`) into shared memory.
__device__ __forceinline__ void load_rows_async(const float* __restrict__ v, int r0, int rows, float* dst) {
  for (int i = threadIdx.x; i < kFaBlock; i += kFaThreads) cp_async4(dst + i, r0 + i < rows ? v + r0 + i : v, r0 + i < rows ? 4 : 0);
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

// Row `half` of the thread's two rows (gid, gid + 8) of a 16 x 8N accumulator, divided by div,
// into row (FP32, 8-byte aligned): two values per n-tile.
template <int N>
__device__ __forceinline__ void store_row(float* row, const float (&acc)[N][4], int half, float div = 1.0f) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    *reinterpret_cast<float2*>(row + frag_col(n, 0)) = make_float2(acc[n][2 * half] / div, acc[n][2 * half + 1] / div);
}

struct FaDims {
  int B, T, S, Hq, Hkv, pos0;
  float scale;
};

// The K and V rows of one (sequence, kv head) as a stream of double-buffered 64-key tiles: key
// block kb lives in buffer kb % 2, and next(kb) starts copying block kb + 1 into the other one
// while block kb is multiplied (the forward and the dQ kernel walk the keys this way).
template <int HD>
struct KvTiles {
  static constexpr int kTile = kFaBlock * kFaLd<HD>;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int64_t stride;
  int S, blocks;
  __nv_bfloat16 (*ks)[kTile];
  __nv_bfloat16 (*vs)[kTile];

  __device__ KvTiles(const __nv_bfloat16* k_all, const __nv_bfloat16* v_all, const FaDims& d, int b, int hk,
                     int last_key, __nv_bfloat16 (*ks_)[kTile], __nv_bfloat16 (*vs_)[kTile])
      : k(k_all + (int64_t(b) * d.S * d.Hkv + hk) * HD),
        v(v_all + (int64_t(b) * d.S * d.Hkv + hk) * HD),
        stride(int64_t(d.Hkv) * HD),
        S(d.S),
        blocks(last_key / kFaBlock + 1),
        ks(ks_),
        vs(vs_) {}
  __device__ void load(int kb) const {
    load_tile_async<HD>(k, stride, kb * kFaBlock, S, ks[kb & 1]);
    load_tile_async<HD>(v, stride, kb * kFaBlock, S, vs[kb & 1]);
  }
  __device__ void next(int kb) const {
    if (kb + 1 < blocks) load(kb + 1);
    cp_async_commit();
  }
};

// ---- forward ----------------------------------------------------------------------------------

template <int HD>
__global__ void __launch_bounds__(kFaThreads, 1) flash_forward_kernel(const __nv_bfloat16* __restrict__ q,
                                                                      const __nv_bfloat16* __restrict__ k,
                                                                      const __nv_bfloat16* __restrict__ v, FaDims d,
                                                                      float* __restrict__ out, float* __restrict__ lse) {
  constexpr int KS = HD / 16, ND = HD / 8, kTile = kFaBlock * kFaLd<HD>;
  // Q, then K and V double-buffered: block kb + 1 loads while block kb is multiplied
  extern __shared__ __align__(16) unsigned char fa_smem[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(fa_smem);
  auto ks = reinterpret_cast<__nv_bfloat16(*)[kTile]>(qs + kTile);
  auto vs = reinterpret_cast<__nv_bfloat16(*)[kTile]>(qs + 3 * kTile);
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int t0 = qb * kFaBlock, warp_row = (threadIdx.x >> 5) * 16;
  const KvTiles<HD> kv(k, v, d, b, hk, min(d.S - 1, d.pos0 + min(d.T - 1, t0 + kFaBlock - 1)), ks, vs);

  load_tile_async<HD>(q + (int64_t(b) * d.T * d.Hq + h) * HD, int64_t(d.Hq) * HD, t0, d.T, qs);
  kv.load(0);
  cp_async_commit();
  cp_async_wait<0>();
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
  for (int kb = 0; kb < kv.blocks; ++kb) {
    const int s0 = kb * kFaBlock, buf = kb & 1;
    kv.next(kb);
    float s[8][4];
    zero(s);
    mma_tile<true>(s, qa, ks[buf], kFaLd<HD>);
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
    mma_tile<false>(o, pa, vs[buf], kFaLd<HD>);
    cp_async_wait<0>();  // block kb + 1 has landed, and (the barrier) nobody reads block kb now
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = t0 + warp_row + frag_row(i);
    const float sum = quad_sum(l[i]);
    if (t >= d.T) continue;
    store_row(out + ((int64_t(b) * d.T + t) * d.Hq + h) * HD, o, i, sum);
    if ((threadIdx.x & 3) == 0) lse[(int64_t(b) * d.Hq + h) * d.T + t] = m[i] + logf(sum);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// The backward kernels' arguments: BF16 copies of Q, K, V, dO; the forward's lse and D =
// rowsum(dO * O), both [B, Hq, T]; FP32 outputs dq [B, T, Hq, hd] and dk_heads, dv_heads
// [B, Hq, S, hd].
struct FaBackward {
  const __nv_bfloat16 *q, *k, *v, *dout;
  const float *lse, *D;
  FaDims d;
  float *dq, *dk_heads, *dv_heads;
};

// The dQ kernel holds Q and dO of its 16 rows per warp in registers: once the copies in flight
// have landed, the A fragments of tiles x and y (staged in a buffer the loop reuses: the closing
// barrier frees it).
template <int HD>
__device__ __forceinline__ void staged_fragments(const __nv_bfloat16* x, const __nv_bfloat16* y, int warp_row,
                                                 uint32_t (&xa)[HD / 16][4], uint32_t (&ya)[HD / 16][4]) {
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    load_a(x, kFaLd<HD>, warp_row, kk, xa[kk]);
    load_a(y, kFaLd<HD>, warp_row, kk, ya[kk]);
  }
  __syncthreads();
}

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
__global__ void __launch_bounds__(kFaThreads, 1) flash_dq_kernel(const FaBackward a) {
  const __nv_bfloat16 *q = a.q, *k = a.k, *v = a.v, *dout = a.dout;
  const float *lse = a.lse, *D = a.D;
  const FaDims d = a.d;
  float* dq = a.dq;
  constexpr int KS = HD / 16, ND = HD / 8, kTile = kFaBlock * kFaLd<HD>;
  extern __shared__ __align__(16) unsigned char fa_smem[];
  auto ks = reinterpret_cast<__nv_bfloat16(*)[kTile]>(fa_smem);
  auto vs = reinterpret_cast<__nv_bfloat16(*)[kTile]>(fa_smem + 2 * kTile * sizeof(__nv_bfloat16));
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int t0 = qb * kFaBlock, warp_row = (threadIdx.x >> 5) * 16;
  const int64_t q_stride = int64_t(d.Hq) * HD;
  const KvTiles<HD> kv(k, v, d, b, hk, min(d.T - 1, t0 + kFaBlock - 1), ks, vs);

  // Q and dO fragments, staged through buffer 1, while key block 0 lands in buffer 0
  load_tile_async<HD>(q + (int64_t(b) * d.T * d.Hq + h) * HD, q_stride, t0, d.T, ks[1]);
  load_tile_async<HD>(dout + (int64_t(b) * d.T * d.Hq + h) * HD, q_stride, t0, d.T, vs[1]);
  kv.load(0);
  cp_async_commit();
  uint32_t qa[KS][4], da[KS][4];
  staged_fragments<HD>(ks[1], vs[1], warp_row, qa, da);
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
  for (int kb = 0; kb < kv.blocks; ++kb) {
    const int s0 = kb * kFaBlock, buf = kb & 1;
    kv.next(kb);
    float s[8][4], dp[8][4], p[8][4];
    zero(s);
    zero(dp);
    mma_tile<true>(s, qa, ks[buf], kFaLd<HD>);
    mma_tile<true>(dp, da, vs[buf], kFaLd<HD>);
    softmax_grad(
        s, dp, p, d.scale, [&](int n, int e) { return s0 + frag_col(n, e) <= t[e >> 1]; },
        [&](int, int e) { return row_lse[e >> 1]; }, [&](int, int e) { return row_d[e >> 1]; });
    uint32_t dsa[4][4];
    acc_to_a(s, dsa);
    mma_tile<false>(acc, dsa, ks[buf], kFaLd<HD>);
    cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (t[i] >= d.T) continue;
    store_row(dq + (int64_t(b) * d.T + t[i]) * q_stride + int64_t(h) * HD, acc, i);
  }
}

// dK, dV of one q head's view of its kv head ([B, Hq, S, hd]; attention.cu sums each group's
// heads in head order, as on the materialized path).
template <int HD>
__global__ void __launch_bounds__(kFaThreads, 1) flash_dkv_kernel(const FaBackward a) {
  const __nv_bfloat16 *q = a.q, *k = a.k, *v = a.v, *dout = a.dout;
  const float *lse = a.lse, *D = a.D;
  const FaDims d = a.d;
  float *dk_heads = a.dk_heads, *dv_heads = a.dv_heads;
  constexpr int KS = HD / 16, ND = HD / 8, kTile = kFaBlock * kFaLd<HD>;
  // K and V of the CTA's keys (read a k-step at a time: the two gradients fill the registers),
  // then Q and dO double-buffered, then the query blocks' lse and D
  extern __shared__ __align__(16) unsigned char fa_smem[];
  __nv_bfloat16* kt = reinterpret_cast<__nv_bfloat16*>(fa_smem);
  __nv_bfloat16* vt = kt + kTile;
  auto qs = reinterpret_cast<__nv_bfloat16(*)[kTile]>(kt + 2 * kTile);
  auto dos = reinterpret_cast<__nv_bfloat16(*)[kTile]>(kt + 4 * kTile);
  auto q_lse = reinterpret_cast<float(*)[kFaBlock]>(kt + 6 * kTile);
  auto q_d = q_lse + 2;
  const int kb = blockIdx.x;  // the most work first: key block 0 sees every query block
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int s0 = kb * kFaBlock, warp_row = (threadIdx.x >> 5) * 16;
  const int64_t q_stride = int64_t(d.Hq) * HD, kv_stride = int64_t(d.Hkv) * HD;
  const __nv_bfloat16* qh = q + (int64_t(b) * d.T * d.Hq + h) * HD;
  const __nv_bfloat16* doh = dout + (int64_t(b) * d.T * d.Hq + h) * HD;
  const float* lse_h = lse + (int64_t(b) * d.Hq + h) * d.T;
  const float* d_h = D + (int64_t(b) * d.Hq + h) * d.T;
  const int q_blocks = (d.T + kFaBlock - 1) / kFaBlock;
  auto load_queries = [&](int qb, int buf) {
    load_tile_async<HD>(qh, q_stride, qb * kFaBlock, d.T, qs[buf]);
    load_tile_async<HD>(doh, q_stride, qb * kFaBlock, d.T, dos[buf]);
    load_rows_async(lse_h, qb * kFaBlock, d.T, q_lse[buf]);
    load_rows_async(d_h, qb * kFaBlock, d.T, q_d[buf]);
  };

  load_tile_async<HD>(k + (int64_t(b) * d.S * d.Hkv + hk) * HD, kv_stride, s0, d.S, kt);
  load_tile_async<HD>(v + (int64_t(b) * d.S * d.Hkv + hk) * HD, kv_stride, s0, d.S, vt);
  load_queries(kb, 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  int key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) key[i] = s0 + warp_row + frag_row(i);
  float gk[ND][4], gv[ND][4];
  zero(gk);
  zero(gv);
  for (int qb = kb; qb < q_blocks; ++qb) {  // causal: queries at or after the block's first key
    const int t0 = qb * kFaBlock, buf = (qb - kb) & 1;
    if (qb + 1 < q_blocks) load_queries(qb + 1, buf ^ 1);
    cp_async_commit();
    float s[8][4], dp[8][4], p[8][4];  // transposed: keys are rows, queries columns
    zero(s);
    zero(dp);
    mma_tile_smem_a<true, 8, KS>(s, kt, kFaLd<HD>, warp_row, qs[buf], kFaLd<HD>);
    mma_tile_smem_a<true, 8, KS>(dp, vt, kFaLd<HD>, warp_row, dos[buf], kFaLd<HD>);
    const float* bl = q_lse[buf];
    const float* bd = q_d[buf];
    softmax_grad(
        s, dp, p, d.scale,
        [&](int n, int e) {
          const int tq = t0 + frag_col(n, e);
          return tq < d.T && key[e >> 1] <= tq;
        },
        [&](int n, int e) { return bl[frag_col(n, e)]; }, [&](int n, int e) { return bd[frag_col(n, e)]; });
    uint32_t pa[4][4], dsa[4][4];
    acc_to_a(p, pa);
    acc_to_a(s, dsa);
    mma_tile<false>(gv, pa, dos[buf], kFaLd<HD>);
    mma_tile<false>(gk, dsa, qs[buf], kFaLd<HD>);
    cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key[i] >= d.S) continue;
    const int64_t off = ((int64_t(b) * d.Hq + h) * d.S + key[i]) * HD;
    store_row(dk_heads + off, gk, i);
    store_row(dv_heads + off, gv, i);
  }
}

// The launch shape shared by the three kernels, or false when the fused path does not apply
// (outputs are written in 8-byte pairs: fresh tensors, and the views the model passes, are
// 16-byte aligned).
bool fa_dims(const Tensor& q, const Tensor& k, int64_t pos0, std::initializer_list<const Tensor*> outputs, FaDims& d,
             int& hd) {
  hd = int(q.size(3));
  if (hd != 32 && hd != 64 && hd != 128) return false;
  for (const Tensor* t : outputs)
    if (reinterpret_cast<uintptr_t>(t->raw()) % 16 != 0) return false;
  const int64_t B = q.size(0), T = q.size(1), S = k.size(1), Hq = q.size(2), Hkv = k.size(2);
  if (B > 65535 || Hq > 65535 || T > INT32_MAX / 2 || S > INT32_MAX / 2 || pos0 > INT32_MAX / 4) return false;
  d = FaDims{int(B), int(T), int(S), int(Hq), int(Hkv), int(pos0), float(1.0 / std::sqrt(double(hd)))};
  return true;
}

unsigned blocks_of(int64_t n) { return unsigned((n + kFaBlock - 1) / kFaBlock); }

// x rounded to BF16 (RNE) in the same [B, T, H, hd] layout: the kernels' operands, copied into
// shared memory with cp.async.
Tensor bf16_copy(const Tensor& x) {
  Tensor y = Tensor::empty(x.shape(), DType::BF16, Device::CUDA);
  convert(x, y);
  return y;
}

const __nv_bfloat16* bf16_data(const Tensor& t) { return t.data<__nv_bfloat16>(); }

size_t tile_bytes(int hd) { return size_t(kFaBlock) * size_t(hd + 8) * sizeof(__nv_bfloat16); }

// `bytes` of dynamic shared memory for Kernel (the opt-in above 48 KB, once per kernel: the
// static lives in each instantiation, i.e. each kernel).
template <auto Kernel>
size_t launchable(size_t bytes) {
  static const bool allowed = [&] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    return true;
  }();
  (void)allowed;
  return bytes;
}

// fn(std::integral_constant<int, hd>) for the head sizes the kernels are built for.
template <typename Fn>
void with_head_dim(int hd, Fn&& fn) {
  switch (hd) {
    case 32: fn(std::integral_constant<int, 32>{}); break;
    case 64: fn(std::integral_constant<int, 64>{}); break;
    case 128: fn(std::integral_constant<int, 128>{}); break;
    default: fail("flash attention: no kernels for hd {}", hd);
  }
}

}  // namespace

bool flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out,
                             Tensor& lse) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, pos0, {&out}, d, hd)) return false;
  if (d.T == 0 || d.B == 0) return true;
  const Tensor qb = bf16_copy(q), kb = bf16_copy(k), vb = bf16_copy(v);
  const dim3 grid(blocks_of(d.T), unsigned(d.Hq), unsigned(d.B));
  with_head_dim(hd, [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    const size_t smem = launchable<flash_forward_kernel<HD>>(5 * tile_bytes(HD));
    flash_forward_kernel<HD><<<grid, kFaThreads, smem, stream()>>>(bf16_data(qb), bf16_data(kb), bf16_data(vb), d,
                                                                    out.data<float>(), lse.data<float>());
  });
  FOURBIT_LAUNCH_CHECK();
  return true;
}

bool flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                              const Tensor& D, Tensor& dq, Tensor& dk_heads, Tensor& dv_heads) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, 0, {&dq, &dk_heads, &dv_heads}, d, hd)) return false;
  if (d.T == 0 || d.B == 0) return true;
  const Tensor qb = bf16_copy(q), kb = bf16_copy(k), vb = bf16_copy(v), dob = bf16_copy(dout);
  const dim3 q_grid(blocks_of(d.T), unsigned(d.Hq), unsigned(d.B)), kv_grid(blocks_of(d.S), unsigned(d.Hq), unsigned(d.B));
  const FaBackward args{bf16_data(qb),      bf16_data(kb),   bf16_data(vb),  bf16_data(dob),
                        lse.data<float>(),  D.data<float>(), d,              dq.data<float>(),
                        dk_heads.data<float>(), dv_heads.data<float>()};
  with_head_dim(hd, [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    const size_t dq_smem = launchable<flash_dq_kernel<HD>>(4 * tile_bytes(HD));
    flash_dq_kernel<HD><<<q_grid, kFaThreads, dq_smem, stream()>>>(args);
    FOURBIT_LAUNCH_CHECK();
    const size_t dkv_smem = launchable<flash_dkv_kernel<HD>>(6 * tile_bytes(HD) + 4 * kFaBlock * sizeof(float));
    flash_dkv_kernel<HD><<<kv_grid, kFaThreads, dkv_smem, stream()>>>(args);
  });
  FOURBIT_LAUNCH_CHECK();
  return true;
}

}  // namespace fourbit::ops::cuda
