// defines: cuda::flash_attention_forward, cuda::flash_attention_step, cuda::attention_step_quant_fused,
//          cuda::flash_attention_backward, cuda::set_flash_wgmma,
//          cuda::set_flash_cta, cuda::set_flash_head_rows
// Causal grouped-query attention fused into three kernels that never write the scores (the
// FlashAttention-2 schedule, Dao 2023): BF16 tensor-core MMAs with FP32 accumulation on tiles of
// 64 queries x 64 keys, with the softmax kept online in registers.
//
//   forward   one CTA per (64-query block, q head, sequence): S = Q K^T, running max and sum,
//             O += P V with P rounded to BF16, O / l and lse = m + log l at the end. A one-token
//             step (decode) takes one CTA per (kv head, sequence) instead, the group's q heads
//             as its rows: the keys and values are read once a group, the same bits.
//   dQ        one CTA per (64-query block, q head, sequence): P again from lse,
//             dS = P (dP - D) * scale with dP = dO V^T and D = rowsum(dO * O) (attention.cu's
//             rowdot), dQ += dS K.
//   dK, dV    one CTA per (64-key block, q head, sequence), looping over the query blocks at or
//             after the keys: dV += P^T dO, dK += dS^T Q, per q head ([B, Hq, S, hd]); attention.cu
//             sums each group's heads.
//
// A warpgroup (4 warps, 16 tile rows each) owns 64 rows, a CTA one or two warpgroups (Cta, below),
// and every product is one of two shapes on [64][hd] BF16 tiles in shared memory:
//   scores      C (64 x 64)  = A tile . B tile^T          S = Q K^T, dP = dO V^T, and the dK/dV
//                                                          kernel's S^T = K Q^T, dP^T = V dO^T
//   accumulate  C (64 x hd) += A (BF16 registers) . B tile  O += P V, dQ += dS K, dV += P^T dO,
//                                                          dK += dS^T Q
// with C in the m16n8 accumulator layout (warp w's rows 16w ..) and the register A in mma_bf16's
// A fragments, the layouts in which wgmma also hands a warpgroup its results and takes A from
// registers. So one kernel body runs on either tile engine:
//   Wgmma    (Hopper, sm_90a code, hd 64 or 128): tiles in 64-column panels in the 128-byte
//            swizzle; warpgroup wgmma m64n64k16 reading both tiles through descriptors (scores) or
//            A from registers and B MN-major (accumulate). Each tile is read once per warpgroup.
//   MmaSync  (elsewhere, and hd 32): tiles with rows padded by 16 bytes; each warp loads its
//            fragments by ldmatrix (.trans where the tile holds B itself) into mma.sync m16n8k16.
// The engines give close but not always equal bits (the tensor cores' internal sums); a device
// always takes the same one for a shape, so training, prefill and decode agree.
//
// Q, K, V and dO are rounded to BF16 (RNE, as the materialized path's to_heads) into copies in the
// model's [B, T, H, hd] layout, which the kernels stream through two or three shared-memory
// buffers with cp.async (the next blocks land while the current one is multiplied); outputs go
// straight back to [B, T, H, hd] FP32. Exponentials are exp2 of scores scaled by scale * log2(e)
// (one FFMA and one MUFU.EX2 a score). Every sum runs in a fixed order (no atomics), so results
// are deterministic, and the work for a query row depends only on that row, its keys and the key
// blocks (64 keys aligned to absolute positions): a sequence gives the same bits alone or in a
// batch, and a KV-cache decode step gives the bits of the full forward's row (fully masked key
// blocks change nothing: their scale factor is exp2(0) = 1 and their P is 0).
//
// Supported: hd 32, 64 or 128 and 16-byte aligned outputs; for anything else the entry points
// return false and attention.cu takes the materialized path.
#include <cuda_bf16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/mma.cuh"
#include "fourbit/ops/quant_layout.h"

namespace fourbit::ops::cuda {
namespace {

constexpr int kFaBlock = 64;     // queries and keys per tile
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

std::atomic<bool> g_flash_wgmma{true}, g_flash_head_rows{true};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 2^x by the MUFU.EX2 instruction alone (flushing subnormal results to 0: a P under 2^-126 of the
// row's largest is 0 here); exp2f adds a rescaling around it for subnormals.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
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

// ---- the tile engines ---------------------------------------------------------------------------
// Each gives: the bytes of a [64][HD] tile and the shared-memory offset of its 16-byte chunk c of
// row r (where cp.async puts it); publish(), run by every thread after its copies landed and
// before the barrier that hands the tiles to the warpgroup; scores / accumulate (above), and
// their two-product forms, which may overlap the two.

struct MmaSync {
  static constexpr int kMinBlocks = 1;
  template <int HD>
  static constexpr int kTileBytes = kFaBlock * (HD + 8) * 2;
  template <int HD>
  __device__ static uint32_t chunk(int r, int c) {
    return uint32_t(r * (HD + 8) * 2 + c * 16);
  }
  __device__ static void publish() {}

  // A fragments from rows 16 w .. (warp w of its warpgroup) of tile a; B from tile b as its
  // transpose (b[n][k]).
  template <int HD>
  __device__ static void scores(float (&c)[8][4], uint32_t a, uint32_t b) {
    const int lane = threadIdx.x & 31, m = lane >> 3, i = lane & 7, r = ((threadIdx.x >> 5) & 3) * 16;
    zero(c);
#pragma unroll
    for (int k = 0; k < HD / 16; ++k) {
      uint32_t af[4];
      ldsm_x4<false>(af, a + chunk<HD>(r + 8 * (m & 1) + i, 2 * k + (m >> 1)));
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        uint32_t bf[4];
        ldsm_x4<false>(bf, b + chunk<HD>(n * 8 + 8 * (m >> 1) + i, 2 * k + (m & 1)));
        mma_bf16(c[n], af, bf[0], bf[1]);
        mma_bf16(c[n + 1], af, bf[2], bf[3]);
      }
    }
  }
  template <int HD>
  __device__ static void scores2(float (&c1)[8][4], uint32_t a1, uint32_t b1, float (&c2)[8][4], uint32_t a2,
                                 uint32_t b2) {
    scores<HD>(c1, a1, b1);
    scores<HD>(c2, a2, b2);
  }
  // B = tile b itself (b[k][n]), read transposed by ldmatrix .trans.
  template <int HD>
  __device__ static void accumulate(float (&c)[HD / 8][4], const uint32_t (&a)[4][4], uint32_t b) {
    const int lane = threadIdx.x & 31, m = lane >> 3, i = lane & 7;
#pragma unroll
    for (int n = 0; n < HD / 8; n += 2)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t bf[4];
        ldsm_x4<true>(bf, b + chunk<HD>(k * 16 + 8 * (m & 1) + i, n + (m >> 1)));
        mma_bf16(c[n], a[k], bf[0], bf[1]);
        mma_bf16(c[n + 1], a[k], bf[2], bf[3]);
      }
  }
  template <int HD>
  __device__ static void accumulate2(float (&c1)[HD / 8][4], const uint32_t (&a1)[4][4], uint32_t b1,
                                     float (&c2)[HD / 8][4], const uint32_t (&a2)[4][4], uint32_t b2) {
    accumulate<HD>(c1, a1, b1);
    accumulate<HD>(c2, a2, b2);
  }
};

struct Wgmma {
  static constexpr int kMinBlocks = 2;
  static constexpr int kPanel = kFaBlock * 128;  // 64 rows of 64 columns: one swizzle panel
  template <int HD>
  static constexpr int kTileBytes = kFaBlock * HD * 2;
  template <int HD>
  __device__ static uint32_t chunk(int r, int c) {
    return uint32_t((c >> 3) * kPanel + r * 128 + (((c & 7) ^ (r & 7)) << 4));
  }
  // cp.async writes through the generic proxy; wgmma reads through the async one.
  __device__ static void publish() { fence_proxy_async(); }

  // Keeps the registers where the asynchronous wgmma reads or writes them: written before the
  // fence that precedes the MMAs, read after the wait that completes them.
  template <int N>
  __device__ static void pin(float (&c)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(c[n][e])::"memory");
  }
  __device__ static void pin(const uint32_t (&a)[4][4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" ::"r"(a[k][e]) : "memory");
  }
  template <int HD>
  __device__ static void issue_scores(float (&c)[8][4], uint32_t a, uint32_t b) {
#pragma unroll
    for (int k = 0; k < HD / 16; ++k) {
      const uint32_t off = (k >> 2) * kPanel + (k & 3) * 32;  // 16 columns = 32 bytes; 4 steps a panel
      wgmma_m64n64k16_ss(c, wgmma_desc_sw128(a + off), wgmma_desc_sw128(b + off), k > 0);
    }
  }
  template <int HD>
  __device__ static void issue_accumulate(float (&c)[HD / 8][4], const uint32_t (&a)[4][4], uint32_t b) {
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma_m64nNk16_rs<HD>(c, a[k], wgmma_desc_sw128_mn(b + k * 16 * 128, kPanel));
  }
  // One group of MMAs run to completion: the fence, what `issue` issues, its commit and the wait.
  template <typename Issue>
  __device__ static void complete(Issue issue) {
    wgmma_fence();
    issue();
    wgmma_commit();
    wgmma_wait<0>();
  }
  template <int HD>
  __device__ static void scores(float (&c)[8][4], uint32_t a, uint32_t b) {
    complete([&] { issue_scores<HD>(c, a, b); });
    pin(c);
  }
  template <int HD>
  __device__ static void scores2(float (&c1)[8][4], uint32_t a1, uint32_t b1, float (&c2)[8][4], uint32_t a2,
                                 uint32_t b2) {
    complete([&] {
      issue_scores<HD>(c1, a1, b1);
      issue_scores<HD>(c2, a2, b2);
    });
    pin(c1);
    pin(c2);
  }
  // A's fragments and the accumulators are pinned before the fence too: PTX wants every register
  // write a wgmma reads ordered before the wgmma.fence that precedes it.
  template <int HD>
  __device__ static void accumulate(float (&c)[HD / 8][4], const uint32_t (&a)[4][4], uint32_t b) {
    pin(c);
    pin(a);
    complete([&] { issue_accumulate<HD>(c, a, b); });
    pin(c);
    pin(a);
  }
  template <int HD>
  __device__ static void accumulate2(float (&c1)[HD / 8][4], const uint32_t (&a1)[4][4], uint32_t b1,
                                     float (&c2)[HD / 8][4], const uint32_t (&a2)[4][4], uint32_t b2) {
    pin(c1), pin(c2), pin(a1), pin(a2);
    complete([&] {
      issue_accumulate<HD>(c1, a1, b1);
      issue_accumulate<HD>(c2, a2, b2);
    });
    pin(c1), pin(c2), pin(a1), pin(a2);
  }
};

// The 1024-byte aligned start of the dynamic shared memory (the swizzle atoms wgmma's descriptors
// assume; the launches ask for 1024 bytes of slack).
__device__ __forceinline__ uint32_t tiles_base(const unsigned char* smem) {
  return (smem_address(smem) + 1023u) & ~1023u;
}
__device__ __forceinline__ float* smem_floats(unsigned char* smem, uint32_t addr) {
  return reinterpret_cast<float*>(smem + (addr - smem_address(smem)));
}

// Starts copying rows r0 .. r0+63 of x (BF16, row r at x + r * stride, 16-byte aligned) into the
// engine's tile at shared address tile, kThreads threads sharing the chunks; rows at or past
// `rows` become zeros.
template <class E, int HD, int kThreads>
__device__ __forceinline__ void load_tile_async(const __nv_bfloat16* __restrict__ x, int64_t stride, int r0, int rows,
                                                uint32_t tile) {
  // a thread copies one 16-byte column chunk of every kPass-th row: its source steps by kPass rows
  // and its shared-memory slot by kPass rows too (kPass is a multiple of 8, so the swizzle's
  // row-in-atom, and with it the chunk's position in the row, stays the same)
  constexpr int kChunks = HD / 8, kPass = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kPass % 8 == 0 && kFaBlock % kPass == 0, "load_tile_async: tile shape");
  const int c = int(threadIdx.x) % kChunks, r_first = int(threadIdx.x) / kChunks;
  const __nv_bfloat16* src = x + int64_t(r0 + r_first) * stride + c * 8;
  const uint32_t dst = tile + E::template chunk<HD>(r_first, c);
#pragma unroll
  for (int j = 0; j < kFaBlock / kPass; ++j) {
    const bool valid = r0 + r_first + j * kPass < rows;
    cp_async16(dst + uint32_t(E::template chunk<HD>(j * kPass, 0) - E::template chunk<HD>(0, 0)),
               valid ? src + int64_t(j) * kPass * stride : x, valid ? 16 : 0);
  }
}

// Starts copying the 64 row values v[r0 ..] (zeros past `rows`) into shared memory.
template <int kThreads>
__device__ __forceinline__ void load_rows_async(const float* __restrict__ v, int r0, int rows, float* dst) {
  for (int i = threadIdx.x; i < kFaBlock; i += kThreads) cp_async4(dst + i, r0 + i < rows ? v + r0 + i : v, r0 + i < rows ? 4 : 0);
}

// A kernel's CTA: WG warpgroups, each owning 64 rows (queries in the forward and dQ kernels, keys
// in the dK/dV kernel), sharing one stream of the other side's 64-row blocks through ST buffers
// (ST - 1 blocks in flight while one is multiplied). A row's work (its blocks, and every sum, in
// order) is the same whatever WG and ST, so every shape gives the same bits.
template <class E, int HD, int WG, int ST>
struct Cta {
  using Engine = E;
  static constexpr int kHd = HD, kWG = WG, kStages = ST, kThreads = 128 * WG, kRows = kFaBlock * WG;
  static constexpr int kTile = E::template kTileBytes<HD>;
  static constexpr int kMinBlocks = E::kMinBlocks / WG > 1 ? E::kMinBlocks / WG : 1;
  static_assert(!std::is_same_v<E, Wgmma> || HD % 64 == 0, "Wgmma tiles are whole 64-column panels");
};

// The stream of blocks 0 .. blocks-1 through ST buffers, block j in buffer j % ST; load(j, buffer)
// starts block j's copies. prologue() starts blocks 0 .. ST-2, one cp.async group each (the first
// also holding the copies the caller started before it). begin(j) waits for block j, publishes
// it, and after the barrier (every warp is done with block j - 1) starts block j + ST - 1 in the
// buffer block j - 1 leaves.
template <int ST, typename Load>
struct BlockStream {
  int blocks;
  Load load;
  __device__ void prologue() const {
#pragma unroll
    for (int j = 0; j < ST - 1; ++j) {
      if (j < blocks) load(j, j);
      cp_async_commit();
    }
  }
  template <class E>
  __device__ void begin(int j) const {
    cp_async_wait<ST - 2>();
    E::publish();
    __syncthreads();
    if (j + ST - 1 < blocks) load(j + ST - 1, (j + ST - 1) % ST);
    cp_async_commit();
  }
};
template <class C, typename Load>
__device__ BlockStream<C::kStages, Load> block_stream(int blocks, Load load) {
  return BlockStream<C::kStages, Load>{blocks, load};
}

// The thread's two rows of a 16-row warp tile: gid and gid + 8.
__device__ __forceinline__ int frag_row(int half) { return ((threadIdx.x & 31) >> 2) + 8 * half; }
// Column of element e (0..3) of n-tile n in an accumulator: 8n + 2 tig + (e & 1).
__device__ __forceinline__ int frag_col(int n, int e) { return 8 * n + 2 * (threadIdx.x & 3) + (e & 1); }
// The first of the warp's 16 rows in its warpgroup's 64, and the thread's warpgroup.
__device__ __forceinline__ int warp_row() { return ((threadIdx.x >> 5) & 3) * 16; }
__device__ __forceinline__ int warpgroup() { return int(threadIdx.x >> 7); }

// Sum (or max) over the four threads that hold one row (lanes 4 gid .. 4 gid + 3), fixed order.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Row `half` of the thread's two rows (gid, gid + 8) of a 16 x 8N accumulator, times `scale`, into
// row (FP32, 8-byte aligned): two values per n-tile.
template <int N>
__device__ __forceinline__ void store_row(float* row, const float (&acc)[N][4], int half, float scale = 1.0f) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    *reinterpret_cast<float2*>(row + frag_col(n, 0)) =
        make_float2(acc[n][2 * half] * scale, acc[n][2 * half + 1] * scale);
}
// The same values rounded to BF16 (RNE) into a BF16 row (4-byte aligned): two values per n-tile.
template <int N>
__device__ __forceinline__ void store_row(__nv_bfloat16* row, const float (&acc)[N][4], int half, float scale) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    *reinterpret_cast<__nv_bfloat162*>(row + frag_col(n, 0)) =
        __floats2bfloat162_rn(acc[n][2 * half] * scale, acc[n][2 * half + 1] * scale);
}

struct FaDims {
  int B, T, S, Hq, Hkv, pos0;
  float scale;
};

// The forward's output quantized along its rows as well (ops.h "Quantized outputs"): MXFP8, RNE,
// in out's [B, T, Hq * hd] rows, so a 32-value block lies within one head's hd values and the CTA
// that computes a head's row has all of its blocks (flash_step_kernel<..., Quant>). codes null: none.
struct FaQuant {
  uint8_t* codes = nullptr;   // [B * T, Hq * hd]
  uint8_t* scales = nullptr;  // [B * T, Hq * hd / 32]
  int exp_bits = 4;           // E4M3 or E5M2
  num::MxScaleRule rule{};
  unsigned* nonfinite = nullptr;  // the quantizers' sticky flag
};

// Row `half` of the thread's two rows of a 16 x HD output accumulator, times inv (store_row's
// values), quantized as MXFP8 blocks of 32 (mxfp8_fast_block, the row quantizer's encoder) into
// row head_row of q's storage, HD / 32 blocks a row. Every lane of the warp calls it (shuffles):
// lane tig of a row's quad gathers block tig's 32 values from the quad and encodes it where the
// row is one of the CTA's (valid).
template <int HD>
__device__ __forceinline__ void quantize_head_row(const float (&acc)[HD / 8][4], int half, float inv, bool valid,
                                                  int64_t head_row, const FaQuant& q) {
  constexpr int kBlocks = HD / num::kMxBlock;
  const int lane = int(threadIdx.x & 31), tig = lane & 3;
  float v[num::kMxBlock];
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk)
#pragma unroll
    for (int j = 0; j < num::kMxBlock; ++j) {
      const int c = blk * num::kMxBlock + j;  // column c: n-tile c / 8, held by quad lane (c % 8) / 2
      const float t = __shfl_sync(0xffffffffu, acc[c / 8][2 * half + (c & 1)] * inv, (lane & ~3) | ((c % 8) / 2));
      if (tig == blk) v[j] = t;
    }
  if (!valid || tig >= kBlocks) return;
  unsigned nonfinite = 0;
  uint8_t* codes = q.codes + head_row * HD + tig * num::kMxBlock;
  q.scales[head_row * kBlocks + tig] =
      q.exp_bits == 4 ? mxfp8_fast_block<4, false>(v, num::kMxBlock, q.rule, 0, 0, 0, codes, nonfinite)
                      : mxfp8_fast_block<5, false>(v, num::kMxBlock, q.rule, 0, 0, 0, codes, nonfinite);
  if (nonfinite) atomicOr(q.nonfinite, 1u);
}

// ---- forward ----------------------------------------------------------------------------------

// The online softmax of one key block: scores s (unscaled) of keys s0 .. for the thread's rows at
// positions pos, masked (where Masked: the block reaches past a row's position) and scaled to log2
// units; updates the rows' running max m and sum l and leaves P = exp2(s - m) in s and in alpha
// the factor the rows' O takes for the new max.
template <bool Masked>
__device__ __forceinline__ void online_softmax(float (&s)[8][4], int s0, const int (&pos)[2], float scale2,
                                               float (&m)[2], float (&l)[2], float (&alpha)[2]) {
  float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = e >> 1;
      s[n][e] = !Masked || s0 + frag_col(n, e) <= pos[row] ? s[n][e] * scale2 : -INFINITY;
      block_max[row] = fmaxf(block_max[row], s[n][e]);
    }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_new = fmaxf(m[i], quad_max(block_max[i]));  // finite: key 0 is never masked
    alpha[i] = exp2_ftz(m[i] - m_new);
    m[i] = m_new;
    l[i] *= alpha[i];
  }
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2_ftz(s[n][e] - m[e >> 1]);
      l[e >> 1] += s[n][e];
    }
}

// online_softmax of a block, masked only where the block reaches past the warp's first row
// (warp-uniform: the masked form changes nothing on the other blocks, it only costs more).
__device__ __forceinline__ void online_softmax(float (&s)[8][4], int s0, const int (&pos)[2], int warp_first_pos,
                                               float scale2, float (&m)[2], float (&l)[2], float (&alpha)[2]) {
  if (s0 + kFaBlock - 1 > warp_first_pos) online_softmax<true>(s, s0, pos, scale2, m, l, alpha);
  else online_softmax<false>(s, s0, pos, scale2, m, l, alpha);
}

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
}

// A forward CTA's work, the queries of batch entry blockIdx.z at positions pos0 + t. Heads: the
// CTA's rows are the queries t0 .. of q head blockIdx.y; or (a one-token decode step, HeadRows)
// the Hq / Hkv q heads that share kv head blockIdx.y, all at position pos0, so that the group's
// keys and values are read once, not once a q head. A row's work is the same either way (its own
// Q row, the same key blocks and masks; the MMAs' rows are independent), so are its bits.
template <class C, bool HeadRows, bool Quant = false>
__device__ __forceinline__ void flash_forward_cta(const __nv_bfloat16* __restrict__ q,
                                                  const __nv_bfloat16* __restrict__ k,
                                                  const __nv_bfloat16* __restrict__ v, FaDims d, int pos0,
                                                  float* __restrict__ out, float* __restrict__ lse,
                                                  __nv_bfloat16* __restrict__ out_bf16, const FaQuant& oq) {
  using E = typename C::Engine;
  constexpr int HD = C::kHd, ND = HD / 8, kTile = C::kTile, ST = C::kStages;
  // the CTA's Q tiles (one a warpgroup), then the K and V buffers
  extern __shared__ unsigned char fa_smem[];
  const uint32_t q_tiles = tiles_base(fa_smem), ks = q_tiles + C::kWG * kTile, vs = ks + ST * kTile;
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);  // the longest rows first
  const int group = d.Hq / d.Hkv, b = blockIdx.z;
  // h: the q head of row 0 (HeadRows: row r is head h + r); hk its kv head; rows: the valid rows
  const int h = HeadRows ? int(blockIdx.y) * group : int(blockIdx.y), hk = h / group;
  const int rows = HeadRows ? group : d.T;
  const int t0 = qb * C::kRows, wt0 = t0 + kFaBlock * warpgroup();
  const uint32_t qs = q_tiles + warpgroup() * kTile;
  const __nv_bfloat16* kh = k + (int64_t(b) * d.S * d.Hkv + hk) * HD;
  const __nv_bfloat16* vh = v + (int64_t(b) * d.S * d.Hkv + hk) * HD;
  const int64_t kv_stride = int64_t(d.Hkv) * HD;
  // the last key any row of the CTA (of the warpgroup) sees
  const int cta_last = min(d.S - 1, pos0 + (HeadRows ? 0 : min(d.T - 1, t0 + C::kRows - 1)));
  const int wg_last_block = min(d.S - 1, pos0 + (HeadRows ? 0 : min(d.T - 1, wt0 + kFaBlock - 1))) / kFaBlock;

  // a row's Q: HeadRows (T = 1) the group's heads, hd apart; else the head's tokens, Hq * hd apart
  const __nv_bfloat16* q_rows = q + (int64_t(b) * d.T * d.Hq + h) * HD;
  const int64_t q_stride = HeadRows ? HD : int64_t(d.Hq) * HD;
#pragma unroll
  for (int w = 0; w < C::kWG; ++w)
    load_tile_async<E, HD, C::kThreads>(q_rows, q_stride, t0 + kFaBlock * w, rows, q_tiles + w * kTile);
  const auto keys = block_stream<C>(cta_last / kFaBlock + 1, [&](int j, int buf) {
    load_tile_async<E, HD, C::kThreads>(kh, kv_stride, j * kFaBlock, d.S, ks + buf * kTile);
    load_tile_async<E, HD, C::kThreads>(vh, kv_stride, j * kFaBlock, d.S, vs + buf * kTile);
  });
  keys.prologue();

  const float scale2 = d.scale * kLog2e;  // scores in log2 units
  int pos[2];  // absolute positions of the thread's two rows, and of the warp's first
#pragma unroll
  for (int i = 0; i < 2; ++i) pos[i] = pos0 + (HeadRows ? 0 : wt0 + warp_row() + frag_row(i));
  const int pos_first = pos0 + (HeadRows ? 0 : wt0 + warp_row());
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[ND][4];
  zero(o);
  for (int kb = 0; kb < keys.blocks; ++kb) {
    keys.template begin<E>(kb);
    if (kb > wg_last_block) continue;  // past every key of the warpgroup's rows
    const int s0 = kb * kFaBlock, buf = kb % ST;
    float s[8][4], alpha[2];
    E::template scores<HD>(s, qs, ks + buf * kTile);
    online_softmax(s, s0, pos, pos_first, scale2, m, l, alpha);
    rescale(o, alpha);
    uint32_t pa[4][4];
    acc_to_a(s, pa);
    E::template accumulate<HD>(o, pa, vs + buf * kTile);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = wt0 + warp_row() + frag_row(i);
    const float sum = quad_sum(l[i]);
    // HeadRows: token 0 of head h + r; else token r of head h
    const int64_t head_row = HeadRows ? int64_t(b) * d.Hq + h + r : (int64_t(b) * d.T + r) * d.Hq + h;
    if constexpr (Quant) quantize_head_row<HD>(o, i, 1.0f / sum, r < rows, head_row, oq);
    if (r >= rows) continue;
    store_row(out + head_row * HD, o, i, 1.0f / sum);  // O / l
    if (out_bf16) store_row(out_bf16 + head_row * HD, o, i, 1.0f / sum);  // the same values, rounded
    if ((threadIdx.x & 3) == 0)
      lse[HeadRows ? head_row : (int64_t(b) * d.Hq + h) * d.T + r] = m[i] * kLn2 + logf(sum);
  }
}

// The forward over queries at pos0 + t (training, prefill, and a decode step's group of sequences
// at one position).
template <class C, bool HeadRows>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    flash_forward_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                         const __nv_bfloat16* __restrict__ v, FaDims d, float* __restrict__ out,
                         float* __restrict__ lse, __nv_bfloat16* __restrict__ out_bf16) {
  flash_forward_cta<C, HeadRows>(q, k, v, d, d.pos0, out, lse, out_bf16, FaQuant{});
}

// attention_step (T = 1): sequence b's query at position pos_of_row[b], read here, so that a CUDA
// graph's replay of the launch takes the positions written since; one outside [0, S) is recorded
// in `errors` and its rows are left unwritten.
template <class C, bool HeadRows, bool Quant>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    flash_step_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                      const __nv_bfloat16* __restrict__ v, FaDims d, const int32_t* __restrict__ pos_of_row,
                      IndexError* errors, float* __restrict__ out, float* __restrict__ lse,
                      __nv_bfloat16* __restrict__ out_bf16, const FaQuant oq) {
  dependent_launch_prologue();
  const int b = blockIdx.z, pos0 = pos_of_row[b];
  if (pos0 < 0 || pos0 >= d.S) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0)
      record_index_error(errors, IndexSite::AttentionStepPositions, b, pos0, d.S, 1);
    return;
  }
  flash_forward_cta<C, HeadRows, Quant>(q, k, v, d, pos0, out, lse, out_bf16, oq);
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

// From the scores s (unscaled) and dp of an accumulator tile: P = exp(s * scale - lse) where
// `visible` (everywhere unless Masked), else 0, into dp, and dS = P (dP - D) * scale into s.
// lse_of / D_of give a fragment element's row values (queries are rows in the dQ kernel, columns
// in the dK/dV kernel), lse in log2 units (lse * log2(e)).
template <bool Masked, typename Visible, typename LseOf, typename DOf>
__device__ __forceinline__ void softmax_grad(float (&s)[8][4], float (&dp)[8][4], float scale, Visible visible,
                                             LseOf lse2_of, DOf d_of) {
  const float scale2 = scale * kLog2e;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pv = !Masked || visible(n, e) ? exp2_ftz(fmaf(s[n][e], scale2, -lse2_of(n, e))) : 0.0f;
      s[n][e] = pv * (dp[n][e] - d_of(n, e)) * scale;
      dp[n][e] = pv;
    }
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) flash_dq_kernel(const FaBackward a) {
  using E = typename C::Engine;
  const __nv_bfloat16 *q = a.q, *k = a.k, *v = a.v, *dout = a.dout;
  const float *lse = a.lse, *D = a.D;
  const FaDims d = a.d;
  float* dq = a.dq;
  constexpr int HD = C::kHd, ND = HD / 8, kTile = C::kTile, ST = C::kStages;
  // the CTA's Q tiles, its dO tiles (one each a warpgroup), then the K and V buffers
  extern __shared__ unsigned char fa_smem[];
  const uint32_t q_tiles = tiles_base(fa_smem), do_tiles = q_tiles + C::kWG * kTile,
                 ks = q_tiles + 2 * C::kWG * kTile, vs = ks + ST * kTile;
  const int qb = int(gridDim.x) - 1 - int(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int t0 = qb * C::kRows, wt0 = t0 + kFaBlock * warpgroup();
  const uint32_t qs = q_tiles + warpgroup() * kTile, dos = do_tiles + warpgroup() * kTile;
  const int64_t q_stride = int64_t(d.Hq) * HD, kv_stride = int64_t(d.Hkv) * HD;
  const __nv_bfloat16* kh = k + (int64_t(b) * d.S * d.Hkv + hk) * HD;
  const __nv_bfloat16* vh = v + (int64_t(b) * d.S * d.Hkv + hk) * HD;
  const int wg_last_block = min(d.T - 1, wt0 + kFaBlock - 1) / kFaBlock;

#pragma unroll
  for (int w = 0; w < C::kWG; ++w) {
    load_tile_async<E, HD, C::kThreads>(q + (int64_t(b) * d.T * d.Hq + h) * HD, q_stride, t0 + kFaBlock * w, d.T,
                                        q_tiles + w * kTile);
    load_tile_async<E, HD, C::kThreads>(dout + (int64_t(b) * d.T * d.Hq + h) * HD, q_stride, t0 + kFaBlock * w, d.T,
                                        do_tiles + w * kTile);
  }
  const auto keys = block_stream<C>(min(d.T - 1, t0 + C::kRows - 1) / kFaBlock + 1, [&](int j, int buf) {
    load_tile_async<E, HD, C::kThreads>(kh, kv_stride, j * kFaBlock, d.S, ks + buf * kTile);
    load_tile_async<E, HD, C::kThreads>(vh, kv_stride, j * kFaBlock, d.S, vs + buf * kTile);
  });
  keys.prologue();
  int t[2];
  float row_lse2[2], row_d[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    t[i] = wt0 + warp_row() + frag_row(i);
    const int64_t r = (int64_t(b) * d.Hq + h) * d.T + min(t[i], d.T - 1);
    row_lse2[i] = lse[r] * kLog2e;
    row_d[i] = D[r];
  }
  float acc[ND][4];
  zero(acc);
  for (int kb = 0; kb < keys.blocks; ++kb) {
    keys.template begin<E>(kb);
    if (kb > wg_last_block) continue;
    const int s0 = kb * kFaBlock, buf = kb % ST;
    float s[8][4], dp[8][4];
    E::template scores2<HD>(s, qs, ks + buf * kTile, dp, dos, vs + buf * kTile);
    const auto visible = [&](int n, int e) { return s0 + frag_col(n, e) <= t[e >> 1]; };
    const auto lse2_of = [&](int, int e) { return row_lse2[e >> 1]; };
    const auto d_of = [&](int, int e) { return row_d[e >> 1]; };
    // masked where the block reaches past the warp's first query
    if (s0 + kFaBlock - 1 > wt0 + warp_row()) softmax_grad<true>(s, dp, d.scale, visible, lse2_of, d_of);
    else softmax_grad<false>(s, dp, d.scale, visible, lse2_of, d_of);
    uint32_t dsa[4][4];
    acc_to_a(s, dsa);
    E::template accumulate<HD>(acc, dsa, ks + buf * kTile);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (t[i] >= d.T) continue;
    store_row(dq + (int64_t(b) * d.T + t[i]) * q_stride + int64_t(h) * HD, acc, i);
  }
}

// dK, dV of one q head's view of its kv head ([B, Hq, S, hd]; attention.cu sums each group's
// heads in head order, as on the materialized path).
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) flash_dkv_kernel(const FaBackward a) {
  using E = typename C::Engine;
  const __nv_bfloat16 *q = a.q, *k = a.k, *v = a.v, *dout = a.dout;
  const float *lse = a.lse, *D = a.D;
  const FaDims d = a.d;
  float *dk_heads = a.dk_heads, *dv_heads = a.dv_heads;
  constexpr int HD = C::kHd, ND = HD / 8, kTile = C::kTile, ST = C::kStages;
  // the CTA's K tiles, its V tiles (one each a warpgroup), then the Q and dO buffers, then the
  // buffered query blocks' lse and D
  extern __shared__ unsigned char fa_smem[];
  const uint32_t k_tiles = tiles_base(fa_smem), v_tiles = k_tiles + C::kWG * kTile,
                 qs = k_tiles + 2 * C::kWG * kTile, dos = qs + ST * kTile;
  float* q_lse = smem_floats(fa_smem, dos + ST * kTile);  // [ST][64], then D's [ST][64]
  float* q_d = q_lse + ST * kFaBlock;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (d.Hq / d.Hkv);
  const int s0 = blockIdx.x * C::kRows, ws0 = s0 + kFaBlock * warpgroup();  // key block 0 first: the most work
  const uint32_t kt = k_tiles + warpgroup() * kTile, vt = v_tiles + warpgroup() * kTile;
  const int64_t q_stride = int64_t(d.Hq) * HD, kv_stride = int64_t(d.Hkv) * HD;
  const __nv_bfloat16* qh = q + (int64_t(b) * d.T * d.Hq + h) * HD;
  const __nv_bfloat16* doh = dout + (int64_t(b) * d.T * d.Hq + h) * HD;
  const float* lse_h = lse + (int64_t(b) * d.Hq + h) * d.T;
  const float* d_h = D + (int64_t(b) * d.Hq + h) * d.T;
  // causal: the query blocks at or after the CTA's (the warpgroup's) first key
  const int first_qb = s0 / kFaBlock, wg_first_qb = ws0 / kFaBlock;

#pragma unroll
  for (int w = 0; w < C::kWG; ++w) {
    load_tile_async<E, HD, C::kThreads>(k + (int64_t(b) * d.S * d.Hkv + hk) * HD, kv_stride, s0 + kFaBlock * w, d.S,
                                        k_tiles + w * kTile);
    load_tile_async<E, HD, C::kThreads>(v + (int64_t(b) * d.S * d.Hkv + hk) * HD, kv_stride, s0 + kFaBlock * w, d.S,
                                        v_tiles + w * kTile);
  }
  const auto queries = block_stream<C>((d.T + kFaBlock - 1) / kFaBlock - first_qb, [&](int j, int buf) {
    const int r0 = (first_qb + j) * kFaBlock;
    load_tile_async<E, HD, C::kThreads>(qh, q_stride, r0, d.T, qs + buf * kTile);
    load_tile_async<E, HD, C::kThreads>(doh, q_stride, r0, d.T, dos + buf * kTile);
    load_rows_async<C::kThreads>(lse_h, r0, d.T, q_lse + buf * kFaBlock);
    load_rows_async<C::kThreads>(d_h, r0, d.T, q_d + buf * kFaBlock);
  });
  queries.prologue();
  int key[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) key[i] = ws0 + warp_row() + frag_row(i);
  float gk[ND][4], gv[ND][4];
  zero(gk);
  zero(gv);
  for (int j = 0; j < queries.blocks; ++j) {
    queries.template begin<E>(j);
    const int qb = first_qb + j, t0 = qb * kFaBlock, buf = j % ST;
    if (qb < wg_first_qb) continue;  // before every key of the warpgroup
    float s[8][4], dp[8][4];  // transposed: keys are rows, queries columns
    E::template scores2<HD>(s, kt, qs + buf * kTile, dp, vt, dos + buf * kTile);
    const float* bl = q_lse + buf * kFaBlock;
    const float* bd = q_d + buf * kFaBlock;
    const auto visible = [&](int n, int e) {
      const int tq = t0 + frag_col(n, e);
      return tq < d.T && key[e >> 1] <= tq;
    };
    const auto lse2_of = [&](int n, int e) { return bl[frag_col(n, e)] * kLog2e; };
    const auto d_of = [&](int n, int e) { return bd[frag_col(n, e)]; };
    // masked where a query of the block precedes one of the warp's keys, or is past the end
    if (t0 < ws0 + warp_row() + 15 || t0 + kFaBlock > d.T) softmax_grad<true>(s, dp, d.scale, visible, lse2_of, d_of);
    else softmax_grad<false>(s, dp, d.scale, visible, lse2_of, d_of);
    uint32_t pa[4][4], dsa[4][4];
    acc_to_a(dp, pa);
    acc_to_a(s, dsa);
    E::template accumulate2<HD>(gv, pa, dos + buf * kTile, gk, dsa, qs + buf * kTile);
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

// x rounded to BF16 (RNE) in the same [B, T, H, hd] layout: the kernels' operands, copied into
// shared memory with cp.async. A BF16 x is that already (its producer wrote it).
Tensor bf16_operand(const Tensor& x) {
  if (x.dtype() == DType::BF16) return x;
  Tensor y = Tensor::empty(x.shape(), DType::BF16, Device::CUDA);
  convert(x, y);
  return y;
}

const __nv_bfloat16* bf16_data(const Tensor& t) { return t.data<__nv_bfloat16>(); }

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

unsigned blocks_of(int64_t n, int rows) { return unsigned((n + rows - 1) / rows); }

// Bytes of n of the CTA's tiles, plus `extra`, plus the slack tiles_base aligns in.
template <class C>
constexpr size_t tiles_bytes(int n, size_t extra = 0) {
  return size_t(n) * size_t(C::kTile) + extra + 1024;
}

// The wgmma engine's CTA shape (warpgroups, stages): set_flash_cta.
std::atomic<int> g_flash_wg{1}, g_flash_stages{2};

// fn(Cta<...>{}) for the head size: the wgmma engine where the device runs sm_90a code and hd is
// 64 or 128 (set_flash_wgmma(false) forces mma.sync, for tests and benchmarks) in the CTA shape
// set_flash_cta chose, else mma.sync with one warpgroup and two buffers.
template <typename Fn>
void with_cta(int hd, Fn&& fn) {
  const bool wgmma = g_flash_wgmma.load(std::memory_order_relaxed) && wgmma_available();
  const int wg = g_flash_wg.load(std::memory_order_relaxed), st = g_flash_stages.load(std::memory_order_relaxed);
  auto shaped = [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    if (wg == 1) {
      if (st == 2) fn(Cta<Wgmma, HD, 1, 2>{});
      else fn(Cta<Wgmma, HD, 1, 3>{});
    } else {
      if (st == 2) fn(Cta<Wgmma, HD, 2, 2>{});
      else fn(Cta<Wgmma, HD, 2, 3>{});
    }
  };
  switch (hd) {
    case 32: fn(Cta<MmaSync, 32, 1, 2>{}); break;
    case 64:
      if (wgmma) shaped(std::integral_constant<int, 64>{});
      else fn(Cta<MmaSync, 64, 1, 2>{});
      break;
    case 128:
      if (wgmma) shaped(std::integral_constant<int, 128>{});
      else fn(Cta<MmaSync, 128, 1, 2>{});
      break;
    default: fail("flash attention: no kernels for hd {}", hd);
  }
}

}  // namespace

void set_flash_wgmma(bool on) { g_flash_wgmma.store(on, std::memory_order_relaxed); }

void set_flash_head_rows(bool on) { g_flash_head_rows.store(on, std::memory_order_relaxed); }

void set_flash_cta(int warpgroups, int stages) {
  if ((warpgroups != 1 && warpgroups != 2) || (stages != 2 && stages != 3))
    fail("set_flash_cta: warpgroups must be 1 or 2 and stages 2 or 3, not {} and {}", warpgroups, stages);
  g_flash_wg.store(warpgroups, std::memory_order_relaxed);
  g_flash_stages.store(stages, std::memory_order_relaxed);
}

namespace {

// The forward kernels' launch for d (fa_dims' shape, pos0 or pos_of_row set).
// pos_of_row: attention_step's positions (flash_step_kernel), or null (flash_forward_kernel at d.pos0).
void launch_flash_forward(const FaDims& d, int hd, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                          Tensor& lse, Tensor* out_bf16, const int32_t* pos_of_row = nullptr,
                          const FaQuant& oq = FaQuant{}) {
  const Tensor qb = bf16_operand(q), kb = bf16_operand(k), vb = bf16_operand(v);
  __nv_bfloat16* ob = out_bf16 ? out_bf16->data<__nv_bfloat16>() : nullptr;
  // a one-token step of grouped-query attention (the sampler's decode): a CTA per kv head, its
  // group's q heads as rows
  const int group = d.Hq / d.Hkv;
  const bool head_rows =
      d.T == 1 && group > 1 && group <= kFaBlock && g_flash_head_rows.load(std::memory_order_relaxed);
  with_cta(hd, [&](auto cta) {
    using C = decltype(cta);
    const size_t smem_bytes = tiles_bytes<C>(C::kWG + 2 * C::kStages);
    auto launch = [&](auto head_rows_c, dim3 grid) {
      constexpr bool HR = decltype(head_rows_c)::value;
      if (pos_of_row) {
        auto step = [&](auto quant_c) {
          constexpr bool Q = decltype(quant_c)::value;
          const size_t smem = launchable<flash_step_kernel<C, HR, Q>>(smem_bytes);
          launch_dependent(flash_step_kernel<C, HR, Q>, grid, C::kThreads, smem, bf16_data(qb), bf16_data(kb),
                           bf16_data(vb), d, pos_of_row, index_error_record(), out.data<float>(), lse.data<float>(),
                           ob, oq);
        };
        if (oq.codes) step(std::true_type{});
        else step(std::false_type{});
      } else {
        const size_t smem = launchable<flash_forward_kernel<C, HR>>(smem_bytes);
        flash_forward_kernel<C, HR><<<grid, C::kThreads, smem, stream()>>>(
            bf16_data(qb), bf16_data(kb), bf16_data(vb), d, out.data<float>(), lse.data<float>(), ob);
      }
    };
    if (head_rows) launch(std::true_type{}, dim3(1, unsigned(d.Hkv), unsigned(d.B)));
    else launch(std::false_type{}, dim3(blocks_of(d.T, C::kRows), unsigned(d.Hq), unsigned(d.B)));
  });
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace

bool flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out,
                             Tensor& lse, Tensor* out_bf16) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, pos0, {&out}, d, hd)) return false;
  if (out_bf16 && reinterpret_cast<uintptr_t>(out_bf16->raw()) % 16 != 0) return false;
  if (d.T == 0 || d.B == 0) return true;
  launch_flash_forward(d, hd, q, k, v, out, lse, out_bf16);
  return true;
}

bool attention_step_quant_fused(const QuantSpec& spec, int64_t hd) {
  return (spec.fmt == Format::MXFP8_E4M3 || spec.fmt == Format::MXFP8_E5M2) && spec.axis == BlockAxis::Row &&
         spec.rounding == num::Rounding::RNE && spec.hadamard == 0 && !spec.tile_2d && hd % num::kMxBlock == 0;
}

bool flash_attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, Tensor& out,
                          Tensor& lse, Tensor* out_bf16, const RowQuant* oq) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, 0, {&out}, d, hd)) return false;
  if (out_bf16 && reinterpret_cast<uintptr_t>(out_bf16->raw()) % 16 != 0) return false;
  FaQuant fq;
  if (oq) {
    FOURBIT_CHECK(attention_step_quant_fused(oq->spec, hd), "flash_attention_step: a quantized output it cannot make");
    *oq->out = alloc_qtensor(oq->spec, quant_shape(out.reshape({d.B, int64_t(d.Hq) * hd}), oq->spec), Device::CUDA);
    fq.codes = oq->out->codes.data<uint8_t>();
    fq.scales = oq->out->block_scales.data<uint8_t>();
    fq.exp_bits = oq->spec.fmt == Format::MXFP8_E4M3 ? 4 : 5;
    fq.rule = oq->spec.mx_rule;
    fq.nonfinite = nonfinite_flag_address();
  }
  if (d.B == 0) return true;
  launch_flash_forward(d, hd, q, k, v, out, lse, out_bf16, positions.data<int32_t>(), fq);
  return true;
}

bool flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                              const Tensor& D, Tensor& dq, Tensor& dk_heads, Tensor& dv_heads) {
  FaDims d;
  int hd;
  if (!fa_dims(q, k, 0, {&dq, &dk_heads, &dv_heads}, d, hd)) return false;
  if (d.T == 0 || d.B == 0) return true;
  const Tensor qb = bf16_operand(q), kb = bf16_operand(k), vb = bf16_operand(v), dob = bf16_operand(dout);
  const FaBackward args{bf16_data(qb),      bf16_data(kb),   bf16_data(vb),  bf16_data(dob),
                        lse.data<float>(),  D.data<float>(), d,              dq.data<float>(),
                        dk_heads.data<float>(), dv_heads.data<float>()};
  with_cta(hd, [&](auto cta) {
    using C = decltype(cta);
    const dim3 q_grid(blocks_of(d.T, C::kRows), unsigned(d.Hq), unsigned(d.B)),
        kv_grid(blocks_of(d.S, C::kRows), unsigned(d.Hq), unsigned(d.B));
    const size_t dq_smem = launchable<flash_dq_kernel<C>>(tiles_bytes<C>(2 * C::kWG + 2 * C::kStages));
    flash_dq_kernel<C><<<q_grid, C::kThreads, dq_smem, stream()>>>(args);
    FOURBIT_LAUNCH_CHECK();
    const size_t dkv_smem = launchable<flash_dkv_kernel<C>>(
        tiles_bytes<C>(2 * C::kWG + 2 * C::kStages, 2 * C::kStages * kFaBlock * sizeof(float)));
    flash_dkv_kernel<C><<<kv_grid, C::kThreads, dkv_smem, stream()>>>(args);
  });
  FOURBIT_LAUNCH_CHECK();
  return true;
}

}  // namespace fourbit::ops::cuda
