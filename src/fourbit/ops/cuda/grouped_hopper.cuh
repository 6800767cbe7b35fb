// defines: hopper::Shape, the wgmma loop's helpers (copies, MMAs: mma_k_tile, mma_k_tile_m128;
//          pipeline, stores: store_block,
//          block_columns_full, store_block_full), hopper::wgmma_kernel
#pragma once

#include "fourbit/ops/cuda/grouped_common.cuh"

namespace fourbit::ops::cuda {
namespace {

// ---- the Hopper main loop: wgmma on 64-wide K tiles ----------------------------------------------
//
// Warpgroups each computing a 64 x 128 block with wgmma.m64n128k16 (BF16 in, FP32 accumulate) from
// shared memory: a CTA tile of 256 x 128 (training: four warpgroups stacked in M, 512 threads, so a
// K tile's 48 KB feed 4 MFLOP), or for decode one warpgroup's 64 x 128, or 64 x 32 with
// m64n32k16 where 128-wide tiles would leave SMs idle (decode_width); 64 x 256 (two warpgroups
// side by side in N) is kept for comparison. Every output element is the same chain of k16 steps
// over K in order in every shape, so its bits depend neither on the tile nor on M (the
// instruction's N does not change an element's sum: tested at every width). Operands arrive by
// cp.async in a pipeline of 64-wide K tiles (4 stages; 8 for the 64 x 32 tile). BF16 ones land in
// the 128-byte swizzle wgmma reads; the MMAs of a tile are issued before the copies of a later one
// and left in flight across the next barrier (copies ahead, one tile of MMAs behind). A's rows
// past its group's are zeroed once and never copied or decoded. Block-scaled ones arrive packed (codes, and the block-scale word of the tile) and
// are dequantized by the CTA into two swizzled BF16 buffers one tile ahead, while the tensor cores
// work on the tile before.
namespace hopper {


constexpr int kBK = 64, kStages = 4;
constexpr int kPanel = kBK * 128;  // bytes of an MN-major panel: 64 K rows of 64 values

template <Format F>
using Tile = Storage<F, kBK>;

template <Format F, int WGM, int WGN, int ST = kStages, int WN = 128>
struct Shape {
  using T = Tile<F>;
  static constexpr int kStages = ST;
  static constexpr int kWGN = WGN, BM = 64 * WGM, BN = WN * WGN, kThreads = 128 * WGM * WGN;
  static constexpr int kATile = BM * T::kRowBytes, kBTile = BN * T::kRowBytes;
  static constexpr int kAScales = T::kPacked ? BM * 4 : 0, kBScales = T::kPacked ? BN * 4 : 0;
  static constexpr int kStageBytes = (kATile + kBTile + kAScales + kBScales + 1023) / 1024 * 1024;
  static constexpr int kDecodedBytes = T::kPacked ? 2 * (BM + BN) * 128 : 0;  // two BF16 A and B tiles
  static constexpr int kSmemBytes = kStages * kStageBytes + kDecodedBytes + 1024;  // + alignment slack
  static_assert(ST >= 3, "the pipelines keep a tile of copies in flight behind one of MMAs");
};

// The decode configuration's stages for a 64 x WN tile of one warpgroup (Shape<F, 1, 1, ST, WN>):
// a CTA streams a WN-column slice of an expert's weights over the whole of K. The 32-wide tile is
// small enough to keep 6 K tiles of copies in flight with two CTAs an SM (BF16: 8 x 12 KB); the
// 128-wide one keeps the training tile's 4 stages (8 made it slower: one CTA an SM).
constexpr int decode_stages(int wn) { return wn <= 32 ? 8 : kStages; }

// C values an epilogue that adds to C loads at once (c_pair): 4 pairs keep the TMA forms, whose
// 17 warps a CTA allow 96 registers a thread, free of spills.
constexpr int kAhead = 4;

// Keeps the accumulators where the asynchronous wgmma writes them: the compiler may not move or
// reuse these registers across this point.
template <int NA>
__device__ __forceinline__ void pin(float (&acc)[NA]) {
#pragma unroll
  for (int i = 0; i < NA; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The MMAs of one 64-wide K tile, its four k16 steps in order, committed as one group: A's tile at
// shared address a (64 rows), B's at b (WN = 128 rows, 256 for the TMA form's flat tile, or 32 for
// the decode configuration's narrow tile), each K-major (128-byte rows in the 128-byte swizzle) or
// MN-major where TA / TB (kPanel panels of 64 K rows, read with wgmma's transpose; not WN = 32).
// A k16 step is 32
// bytes on in a K-major tile, 2048 (16 K rows) in an MN-major one; descriptors count 16-byte
// units. first: the tile starts the sum. Every width issues the same k16 steps in the same order;
// an output element's products and sums do not depend on the instruction's N (the tests compare
// every width's bits with the training tile's).
template <bool TA, bool TB, int WN = 128>
__device__ __forceinline__ void mma_k_tile(float (&acc)[WN / 2], uint32_t a, uint32_t b, bool first) {
  static_assert(WN == 128 || WN == 256 || (WN == 32 && !TA && !TB), "128 or 256 wide, or the narrow tile: 32, K-major");
  const uint64_t da = TA ? wgmma_desc_sw128_mn(a, kPanel) : wgmma_desc_sw128(a);
  const uint64_t db = TB ? wgmma_desc_sw128_mn(b, kPanel) : wgmma_desc_sw128(b);
  constexpr uint64_t kStepA = TA ? 128 : 2, kStepB = TB ? 128 : 2;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk)
    if constexpr (WN == 128)
      wgmma_m64n128k16<TA, TB>(acc, da + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
    else if constexpr (WN == 256)
      wgmma_m64n256k16<TA, TB>(acc, da + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
    else wgmma_m64n32k16_ss(acc, da + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
  wgmma_commit();
}

// The MMAs of one 64-wide K tile for one warpgroup's 128 x 128 block (the ping-pong TMA forms):
// A's 128 rows at a (K-major, rows 64.. 8 KB on; or MN-major where TA, two kPanel panels), B's 128
// at b (K-major, or MN-major where TB); each k16 step on rows 0..63 into acc0, then on rows
// 64..127 into acc1 (two independent chains the tensor cores can overlap), committed as one
// group. Each accumulator gets mma_k_tile's k16 chain: the same bits.
template <bool TA, bool TB>
__device__ __forceinline__ void mma_k_tile_m128(float (&acc0)[64], float (&acc1)[64], uint32_t a, uint32_t b,
                                                bool first) {
  static_assert(kPanel == 64 * 128, "A's second 64 rows are 8 KB on in either layout");
  const uint64_t da0 = TA ? wgmma_desc_sw128_mn(a, kPanel) : wgmma_desc_sw128(a);
  const uint64_t da1 = TA ? wgmma_desc_sw128_mn(a + kPanel, kPanel) : wgmma_desc_sw128(a + kPanel);
  const uint64_t db = TB ? wgmma_desc_sw128_mn(b, kPanel) : wgmma_desc_sw128(b);
  constexpr uint64_t kStepA = TA ? 128 : 2, kStepB = TB ? 128 : 2;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    wgmma_m64n128k16<TA, TB>(acc0, da0 + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
    wgmma_m64n128k16<TA, TB>(acc1, da1 + kStepA * kk, db + kStepB * kk, first && kk == 0 ? 0 : 1);
  }
  wgmma_commit();
}

// The epilogue of warpgroup wm's 64 x WN block of a row-grouped tile (wgmma's accumulator layout)
// at rows r0 + 64 wm .., columns col0 ..: the group's rows (< r1) and columns < N only, in
// NUMERICS' order (store_pair), C's values and the outer scales loaded AHEAD pairs at a time ahead
// of the stores (kAhead where registers are tight; a decode tile's one warpgroup loads all of a
// row's at once, so its epilogue waits for two loads' latency, not one per pair). SCALES_AHEAD
// false loads the outer scales at each pair's store instead: the TMA form's 96 registers a thread
// hold C's values ahead but not the scales too (they spilled).
template <int WN = 128, int AHEAD = kAhead, bool SCALES_AHEAD = true>
__device__ __forceinline__ void store_block(const GroupedArgs& p, int group, const float (&acc)[WN / 2], int wm,
                                            int col0, long long r0, long long r1) {
  constexpr int kPairs = WN / 8, kAt = kPairs < AHEAD ? kPairs : AHEAD;
  const float* sbo = p.b.outer ? p.b.outer + group * p.b.outer_group_stride : nullptr;
  const int t = int(threadIdx.x) & 127, lane = int(threadIdx.x) & 31;
  const int row_base = wm * 64 + 16 * (t >> 5) + (lane >> 2), col_base = col0 + 2 * (lane & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const long long row = r0 + row_base + 8 * half;
    if (row >= r1) continue;
    const float sa = SCALES_AHEAD ? a_scale(p, row) : 0.0f;
#pragma unroll
    for (int j0 = 0; j0 < kPairs; j0 += kAt) {
      float2 old[kAt], sb[kAt] = {};
#pragma unroll
      for (int j = 0; j < kAt; ++j) {
        old[j] = c_pair(p, row, col_base + 8 * (j0 + j));
        if constexpr (SCALES_AHEAD) sb[j] = b_scales(p, sbo, col_base + 8 * (j0 + j));
      }
#pragma unroll
      for (int j = 0; j < kAt; ++j) {
        const int q = j0 + j;
        store_pair<SCALES_AHEAD>(p, sbo, row, col_base + 8 * q, acc[4 * q + 2 * half], acc[4 * q + 2 * half + 1],
                                 old[j], sa, sb[j]);
      }
    }
  }
}

// Whether every column of a WN-wide block at col0 lies below N and C's rows are 8-byte aligned, so
// that each pair of the block is one 8-byte access (store_block_full applies).
template <int WN>
__device__ __forceinline__ bool block_columns_full(const GroupedArgs& p, int col0) {
  return col0 + WN <= p.n && (p.ldc & 1) == 0 && (reinterpret_cast<uintptr_t>(p.c) & 7) == 0;
}

// store_block for a block whose columns are all below N, C's rows 8-byte aligned
// (block_columns_full): the same values (finish_scaled's steps in its order, a step taken only
// where its scale or C is there), with no branch per value. The outer scales and the additions to
// C are chosen per value by selects and predicated loads on flags that are the same for the whole
// launch, so the fully unrolled epilogue stays a few instructions a pair: store_block's branches at
// every pair made the 128 x 256 TMA tile's epilogue ~10 K instructions, which ran out of the
// instruction cache (Nsight Compute: stall_no_inst held most of its samples, the kernel 2.7x its
// main loop alone). SCALES_AHEAD as for store_block; SCALED false: for launches without outer
// scales only (fewer registers: the 256 x 128 TMA tile's 96 spilled with the scales' code).
template <int WN = 128, int AHEAD = kAhead, bool SCALES_AHEAD = true, bool SCALED = true>
__device__ __forceinline__ void store_block_full(const GroupedArgs& p, int group, const float (&acc)[WN / 2], int wm,
                                                 int col0, long long r0, long long r1) {
  constexpr int kPairs = WN / 8, kAt = kPairs < AHEAD ? kPairs : AHEAD;
  const float* sbo = p.b.outer ? p.b.outer + group * p.b.outer_group_stride : nullptr;
  const bool scale_a = SCALED && p.a.outer != nullptr, scale_b = SCALED && sbo != nullptr, add = p.accumulate;
  const int t = int(threadIdx.x) & 127, lane = int(threadIdx.x) & 31;
  const int row_base = wm * 64 + 16 * (t >> 5) + (lane >> 2), col_base = col0 + 2 * (lane & 3);
  const long long bs = p.b.outer_stride;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const long long row = r0 + row_base + 8 * half;
    if (row >= r1) continue;
    float* crow = p.c + row * p.ldc;
    const float sa = scale_a ? p.a.outer[row * p.a.outer_stride] : 1.0f;
#pragma unroll
    for (int j0 = 0; j0 < kPairs; j0 += kAt) {
      float2 old[kAt], sb[kAt];
#pragma unroll
      for (int j = 0; j < kAt; ++j) {
        const int col = col_base + 8 * (j0 + j);
        old[j] = add ? *reinterpret_cast<const float2*>(crow + col) : make_float2(0.0f, 0.0f);
        if constexpr (SCALES_AHEAD)
          sb[j] = scale_b ? make_float2(sbo[col * bs], sbo[(col + 1) * bs]) : make_float2(1.0f, 1.0f);
      }
#pragma unroll
      for (int j = 0; j < kAt; ++j) {
        const int q = j0 + j, col = col_base + 8 * q;
        if constexpr (!SCALES_AHEAD)
          sb[j] = scale_b ? make_float2(sbo[col * bs], sbo[(col + 1) * bs]) : make_float2(1.0f, 1.0f);
        float x = acc[4 * q + 2 * half], y = acc[4 * q + 2 * half + 1];
        x = scale_a ? num::mul_rn(x, sa) : x;
        y = scale_a ? num::mul_rn(y, sa) : y;
        x = scale_b ? num::mul_rn(x, sb[j].x) : x;
        y = scale_b ? num::mul_rn(y, sb[j].y) : y;
        x = add ? num::add_rn(old[j].x, x) : x;
        y = add ? num::add_rn(old[j].y, y) : y;
        *reinterpret_cast<float2*>(crow + col) = make_float2(x, y);
      }
    }
  }
}

// The BF16 pipeline of K tiles 0 .. k_tiles - 1: load_stage(kt) starts the copies of tile kt into
// stage kt % kStages, mma_stage(kt) issues (and commits) its MMAs. Tiles kt + 1, kt + 2 are in
// flight while the MMAs of kt - 1 and kt run: the copies of tile kt + 2 go to the stage of kt - 2,
// whose MMAs every warpgroup has finished (wgmma_wait<1> before the barrier) by the time anyone
// issues them.
template <int ST = kStages, int NA, class Load, class Mma>
__device__ __forceinline__ void bf16_pipeline(int k_tiles, float (&acc)[NA], Load&& load_stage, Mma&& mma_stage) {
  constexpr int kStages = ST;
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 3>();  // tile kt has landed (this thread's copies) ...
    fence_proxy_async();           // ... visible to wgmma's proxy ...
    __syncthreads();               // ... for every thread's; and the MMAs of kt - 2 are done
    mma_stage(kt);
    if (kt + kStages - 2 < k_tiles) load_stage(kt + kStages - 2);
    cp_async_commit();
    wgmma_wait<1>();  // the MMAs of kt - 1 are done (this warpgroup's)
    pin(acc);
  }
  wgmma_wait<0>();
  pin(acc);
}

// Copies the 64-row K tile at k0 of an MN-major operand (K rows ld bytes apart), MN values
// mn0 .. mn0 + R - 1 (those < mn_end; K rows < k_end), into R / 64 panels of 64 K rows x 128 bytes
// (kPanel) at dst; what lies outside is zero-filled.
template <int R, int NT>
__device__ __forceinline__ void load_tile_mn(const unsigned char* base, int64_t ld, int mn0, int mn_end, int k0,
                                             int k_end, uint32_t dst) {
  constexpr int kChunksRow = R / 8;  // 16-byte chunks of a K row
#pragma unroll 4
  for (int idx = int(threadIdx.x); idx < kBK * kChunksRow; idx += NT) {
    const int kr = idx / kChunksRow, c = idx % kChunksRow, mn = mn0 + 8 * c;
    const bool ok = k0 + kr < k_end && mn < mn_end;
    cp_async16(dst + uint32_t((c >> 3) * kPanel) + sw128(kr, c & 7),
               ok ? base + (long long)(k0 + kr) * ld + (long long)mn * 2 : base, ok ? 16 : 0);
  }
}

// BT: B (BF16) is read MN-major, each group stored [K, N] (the forward's weight of a dgrad): its
// tile lands as stored in kPanel panels (load_tile_mn) and the MMAs read it with the instruction's
// transpose, the same products in the same order as from a K-major copy of it.
template <Format F, int WGM, int WGN, bool BT, int ST, int WN>
__global__ void __launch_bounds__(128 * WGM * WGN, 1) wgmma_kernel(const __grid_constant__ GroupedArgs p) {
  using T = Tile<F>;
  using S = Shape<F, WGM, WGN, ST, WN>;
  constexpr int kStages = ST;
  static_assert(!BT || F == Format::BF16, "MN-major B is BF16");
  constexpr int kThreads = S::kThreads;
  constexpr int BM = S::BM, BN = S::BN;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int s_group;
  __shared__ long long s_r0, s_r1;
  __shared__ float2 e2m1_pair[F == Format::NVFP4 ? 256 : 1];

  if (threadIdx.x < 32) find_row_tile(p, BM, s_group, s_r0, s_r1);
  __syncthreads();
  if (s_group < 0) return;
  fill_e2m1_pairs<F>(e2m1_pair);
  const long long r0 = s_r0, r1 = s_r1;
  const int group = s_group, n0 = int(blockIdx.x) * BN;
  const unsigned char* bg = p.b.data + group * p.b.slice_bytes;
  const uint8_t* bsg = T::kPacked ? p.b.scales + group * p.b.scale_slice : nullptr;

  // 1024-byte aligned stages (the swizzle atoms wgmma's descriptors assume)
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (sbase - raw);
  const int tid = int(threadIdx.x), wg = tid >> 7;
  const int wm = wg / S::kWGN, wn = wg % S::kWGN;  // this warpgroup's 64 x WN block
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;
  // A's rows past the group's are zeros: copied only where they are the group's, the others
  // zeroed once (BF16: in every stage, read by the MMAs as they are; packed: in both decoded
  // buffers, never decoded). A decode tile (64 rows, a few of them the group's) is spared nearly
  // all of A's copies and decoding.
  const int a_rows = int(r1 - r0);
  {
    const int pad = (BM - a_rows) * 8;  // 16-byte chunks of the rows past the group's
    const int copies = T::kPacked ? 2 : kStages;
    unsigned char* first = smem + (T::kPacked ? kStages * S::kStageBytes : 0);
    const int step = T::kPacked ? (BM + BN) * 128 : S::kStageBytes;
    for (int i = tid; i < copies * pad; i += kThreads)
      *reinterpret_cast<uint4*>(first + (i / pad) * step + a_rows * 128 + (i % pad) * 16) = make_uint4(0u, 0u, 0u, 0u);
  }

  auto load_stage = [&](int kt) {
    const uint32_t st = sbase + uint32_t((kt % kStages) * S::kStageBytes);
    const int k0 = p.k_begin + kt * kBK;
    load_tile<F, kBK, BM, kThreads>(p.a, p.a.data, p.a.scales, r0, r1, k0, p.k_end, st, a_rows);
    if constexpr (BT) load_tile_mn<BN, kThreads>(bg, p.b.ld, n0, p.n, k0, p.k_end, st + S::kATile);
    else load_tile<F, kBK, BN, kThreads>(p.b, bg, bsg, n0, p.n, k0, p.k_end, st + S::kATile + S::kAScales);
  };
  float acc[WN / 2];
#pragma unroll
  for (int i = 0; i < WN / 2; ++i) acc[i] = 0.0f;
  // A K tile on BF16 tiles at sa (BM rows) and sb (BN rows): this warpgroup's 64 rows of A and WN
  // columns of B (WN K-major rows, or for WN = 128 two MN-major panels: 16 KB on either way).
  auto mma_tile = [&](uint32_t sa, uint32_t sb, bool first) {
    mma_k_tile<false, BT, WN>(acc, sa + uint32_t(wm * 64 * 128), sb + uint32_t(wn * WN * 128), first);
  };

  if constexpr (!T::kPacked) {
    bf16_pipeline<ST>(k_tiles, acc, load_stage, [&](int kt) {
      const uint32_t st = sbase + uint32_t((kt % kStages) * S::kStageBytes);
      mma_tile(st, st + S::kATile, kt == 0);
    });
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s);
      cp_async_commit();
    }
    unsigned char* decoded = smem + kStages * S::kStageBytes;
    auto dequantize = [&](int kt) {
      const unsigned char* st = smem + (kt % kStages) * S::kStageBytes;
      unsigned char* d = decoded + (kt & 1) * (BM + BN) * 128;
      const int k0 = p.k_begin + kt * kBK;
      dequantize_tile<F, kBK, BM, kThreads>(st, k0, d, e2m1_pair, a_rows);
      dequantize_tile<F, kBK, BN, kThreads>(st + S::kATile + S::kAScales, k0, d + BM * 128, e2m1_pair);
    };
    cp_async_wait<kStages - 2>();  // tile 0 has landed
    __syncthreads();
    if (k_tiles > 0) dequantize(0);
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 3>();  // tile kt + 1 has landed (this thread's copies)
      fence_proxy_async();           // tile kt's decoded stores visible to wgmma's proxy
      __syncthreads();  // every thread's; tile kt is decoded; every warpgroup is done with kt - 1
      if (kt + kStages - 1 < k_tiles) load_stage(kt + kStages - 1);
      cp_async_commit();
      const uint32_t d = sbase + uint32_t(kStages * S::kStageBytes + (kt & 1) * (BM + BN) * 128);
      mma_tile(d, d + uint32_t(BM * 128), kt == 0);
      if (kt + 1 < k_tiles) dequantize(kt + 1);  // into the other buffer, while the MMAs run
      wgmma_wait<0>();
      pin(acc);
    }
  }
  cp_async_wait<0>();
  constexpr int kStoreAhead = WGM * WGN == 1 ? WN / 8 : kAhead;
  const int col0 = n0 + wn * WN;
  // The narrow decode tile keeps store_block: with store_block_full, ptxas serialized its BF16
  // form's wgmma chain (C7515: non-wgmma instructions defining accumulator registers), and its
  // decode calls ran ~12% slower on an H100 (session 57); its 8 pairs a thread fit the
  // instruction cache either way.
  if (WN >= 128 && block_columns_full<WN>(p, col0)) store_block_full<WN, kStoreAhead>(p, group, acc, wm, col0, r0, r1);
  else store_block<WN, kStoreAhead>(p, group, acc, wm, col0, r0, r1);
}

}  // namespace hopper
}  // namespace
}  // namespace fourbit::ops::cuda
