// defines: hopper::streaming (the streaming decode kernel: stream_kernel, its Shape and warp copies)
#pragma once

#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/ops/cuda/grouped_hopper.cuh"

namespace fourbit::ops::cuda {
namespace {
namespace hopper {

// ---- the streaming decode kernel: expert weights as the MMA's A operand, in registers ------------
//
// At decode a group has a few rows (tokens) and its expert's weights are the data to move. The
// tiles above put the tokens in wgmma's 64-row A operand (63 of 64 rows zero at batch 1) and the
// weights in its shared-memory B operand, so every packed weight tile is decoded by the whole CTA
// into shared memory and the MMAs wait behind a barrier for it: Nsight Compute showed those tiles
// bound by that chain, not by bytes. Here the roles are swapped: C^T = B . A^T, each warp owning 16
// weight rows (16 columns of C; or 8, Shape's R, the fragments' other rows zero) over the whole of
// K. A warp streams its rows' K tiles as stored
// (codes and block scales, or BF16) by its own cp.async pipeline, decodes each thread's share of
// a tile in registers straight into mma.sync's A fragment and multiplies it by the tokens,
// 8 J of them as J n8 blocks of the B fragment, read with ldmatrix from a BF16 copy the CTA
// decoded once into shared memory. No warp waits for another's weights: the only barriers are
// around the tokens' copy (once per chunk of K whose BF16 tokens fill 64 KB: all of gpu-small's K).
//
// The same bits as the tiles above: an element is the chain of k16 MMAs over the same 64-wide K
// tiles in order (the zero padding included), and a k16 mma.sync gives wgmma's sum whichever
// operand is A (measured on the H200; the grouped tests compare every decode configuration with
// the training tile, bit for bit).
namespace streaming {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kTokenBytes = 64 * 1024;  // the tokens' BF16 copy: at most

// R weight rows (C columns) a warp: 16, the MMA's rows, or 8 (rows 8 .. 15 of every A fragment
// zero), which halves each warp's decode and doubles the warps streaming a matrix.
template <Format F, int J, int R>
struct Shape {
  static_assert(R == 16 || R == 8, "rows a warp");
  using T = Tile<F>;
  static constexpr int BN = kWarps * R;  // C columns a CTA
  static constexpr int BM = 8 * J;       // tokens a CTA
  static constexpr int kStages = 8;      // a warp's K tiles of weights in flight, plus the one it works on
  static constexpr int kScaleBytes = T::kPacked ? R * 4 : 0;
  static constexpr int kWStage = R * T::kRowBytes + kScaleBytes;  // a warp's stage (load_tile's layout)
  static constexpr int kTokenTile = BM * 128;                         // a K tile of the tokens, BF16, sw128
  static constexpr int kMaxChunk = kTokenBytes / kTokenTile;          // K tiles of tokens held at once
  static constexpr int kWeightBytes = kWarps * kStages * kWStage;
  static constexpr int smem_bytes(int chunk) { return chunk * kTokenTile + kWeightBytes; }
};

// The tokens' K tiles kt0 .. kt1 - 1 (rows r0 .. r0 + rows - 1 of A) as BF16 in shared memory at
// dst, each tile BM rows of 128 bytes in the 128-byte swizzle (sw128); the CTA's threads share it.
// Block-scaled tokens are decoded 16 values at a time, to dequantize_tile's bits (NVFP4 as the
// weights are, e2m1x2_times; MXFP8 with decode8_bits). K past k_end is zero, in the units
// load_tile copies (8 BF16 values, 32 NVFP4, 16 MXFP8), so the products are the tiles'. Rows past
// `rows` are left as they are (zeroed once by the caller).
template <Format F, int BM>
__device__ __forceinline__ void stage_tokens(const GroupedArgs& p, long long r0, int rows, int kt0, int kt1,
                                             unsigned char* dst) {
  using T = Tile<F>;
  constexpr int kUnits = T::kPacked ? 4 : 8;  // units of a row's K tile: 16 values, or one BF16 chunk
  const int tiles = kt1 - kt0;
  for (int u = int(threadIdx.x); u < rows * tiles * kUnits; u += kThreads) {
    const int q = u % kUnits, tile = (u / kUnits) % tiles, row = u / (kUnits * tiles);
    const int k = p.k_begin + (kt0 + tile) * 64 + q * (T::kPacked ? 16 : 8);
    unsigned char* d = dst + tile * BM * 128;
    const unsigned char* arow = p.a.data + (r0 + row) * p.a.ld;
    if constexpr (!T::kPacked) {
      const uint4 v = k < p.k_end ? *reinterpret_cast<const uint4*>(arow + 2ll * k) : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(d + sw128(row, q)) = v;
    } else {
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      // zero where load_tile's copy holding k (32 NVFP4 values, 16 MXFP8 ones) starts past k_end
      if ((F == Format::NVFP4 ? k - 16 * (q & 1) : k) < p.k_end) {
        if constexpr (F == Format::NVFP4) {  // the weights' decode: the same bits (e2m1x2_times)
          const uint2 w = *reinterpret_cast<const uint2*>(arow + k / 2);
          const uint32_t sc = ue4m3_bf16x2(p.a.scales[(r0 + row) * p.a.scale_ld + k / block_values<F>()]);
          uint32_t* l = reinterpret_cast<uint32_t*>(&lo);
          uint32_t* h = reinterpret_cast<uint32_t*>(&hi);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            l[j] = e2m1x2_times(w.x, j, sc);
            h[j] = e2m1x2_times(w.y, j, sc);
          }
        } else {
          const float sv = decode8_scale<F>(p.a.scales[(r0 + row) * p.a.scale_ld + k / block_values<F>()]);
          const uint4 w = *reinterpret_cast<const uint4*>(arow + k);
          lo = decode8_bits<F>(make_uint2(w.x, w.y), sv, nullptr);
          hi = decode8_bits<F>(make_uint2(w.z, w.w), sv, nullptr);
        }
      }
      *reinterpret_cast<uint4*>(d + sw128(row, 2 * q)) = lo;
      *reinterpret_cast<uint4*>(d + sw128(row, 2 * q + 1)) = hi;
    }
  }
}

// Keeps v, worked out once before the K loop, in a register: nvcc otherwise recomputes such lane-
// and warp-derived addresses from the thread index and the kernel's arguments inside the loop,
// every K tile.
__device__ __forceinline__ void hold(uint32_t& v) { asm volatile("" : "+r"(v)); }
__device__ __forceinline__ void hold(int& v) { asm volatile("" : "+r"(v)); }
template <class V>
__device__ __forceinline__ void hold(const V*& v) { asm volatile("" : "+l"(v)); }

// A warp's copies of its R weight rows' K tiles into its pipeline stages, in load_tile's layout
// (codes then one block-scale word a row; BF16 rows in the 128-byte swizzle), each lane's sources
// and destinations worked out once: tile kt is kRowBytes kt further along every row. Rows past N
// and 16-byte units starting past k_end are zero-filled, as load_tile does; a row past N names row
// 0 (so that a tile inside K needs no test), and only the last tile may reach past k_end.
template <Format F, int kRows>
struct WarpCopy {
  using T = Tile<F>;
  static constexpr int kUnits = kRows * T::kChunks;         // 16-byte copies a K tile
  static constexpr int kCopies = (kUnits + 31) / 32;        // a lane's (lanes past kUnits: none)
  static constexpr int kChunkValues = 128 / T::kBits;
  static_assert(32 % T::kChunks == 0, "a lane copies the same chunk of each of its rows");
  // a lane's copies are 32 / kChunks rows apart; those kRepeat apart are rows a multiple of 8 apart
  // (the same swizzle), so their destinations differ by a constant
  static constexpr int kRowsApart = 32 / T::kChunks, kRepeat = T::kPacked ? 1 : 8 / kRowsApart;
  const unsigned char* src[kCopies];  // tile 0's
  int src_bytes[kCopies];             // 16, or 0: a row past N (src: row 0's)
  const unsigned char* any;            // a readable address for the last tile's copies past k_end (which read nothing)
  uint32_t dst[kCopies];               // shared address in stage 0
  int k_first;  // the value index of the lane's first code in tile 0 (the same chunk of each row)
  const uint8_t* scale_src;            // the lane's row's block scales (a row past N: row 0's)
  int scale_bytes;                     // 4, or 0: a row past N
  uint32_t scale_dst;
  unsigned first_block;                // the block holding tile 0's first value (k_begin >= 0)
  // stages: the warp's first stage's shared address
  __device__ __forceinline__ WarpCopy(const GroupedArgs& p, const unsigned char* bg, const uint8_t* bsg, int n0,
                                      int lane, uint32_t stages)
      : any(bg) {
    const int chunk = lane % T::kChunks;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int idx = lane + 32 * i, row = idx / T::kChunks;
      const bool row_ok = idx < kUnits && n0 + row < p.n;
      src[i] = bg + (long long)(row_ok ? n0 + row : 0) * p.b.ld + (long long)p.k_begin * T::kBits / 8 + chunk * 16;
      src_bytes[i] = row_ok ? 16 : 0;
      hold(src[i]);
      hold(src_bytes[i]);
      if (i < kRepeat) {
        dst[i] = stages + (T::kPacked ? uint32_t(row * T::kRowBytes + chunk * 16) : T::bf16_offset(row, chunk));
        hold(dst[i]);
      } else {
        dst[i] = dst[i - kRepeat] + uint32_t(kRepeat * kRowsApart * T::kRowBytes);
      }
    }
    k_first = p.k_begin + chunk * kChunkValues;
    // every lane copies a row's word, lanes past kRows lane % kRows's again (the same bytes to the
    // same place): no divergent branch around the copy in the K loop
    const int scale_lane = lane % kRows;
    const bool scale_row = T::kPacked && n0 + scale_lane < p.n;
    scale_src = T::kPacked ? bsg + (long long)(scale_row ? n0 + scale_lane : 0) * p.b.scale_ld : nullptr;
    scale_bytes = scale_row ? 4 : 0;
    scale_dst = stages + uint32_t(kRows * T::kRowBytes + 4 * scale_lane);
    first_block = unsigned(p.k_begin) / block_values<F>();
    hold(scale_src);
    hold(scale_bytes);
    hold(scale_dst);
  }
  // Starts the copies of K tile kt (< k_tiles) into the stage `stage` bytes past stage 0. kInside:
  // the tile ends at or before k_end, so no unit of it starts past k_end. A tile's first value is
  // before k_end, and with it its scale word: copied wherever its row is.
  template <bool kInside>
  __device__ __forceinline__ void load(const GroupedArgs& p, int kt, uint32_t stage, int lane) const {
    const unsigned tile_bytes = unsigned(kt) * T::kRowBytes;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const unsigned char* from = src[i] + tile_bytes;
      int bytes = src_bytes[i];
      if constexpr (!kInside) {
        const bool ok = bytes != 0 && k_first + kt * 64 < p.k_end;
        from = ok ? from : any;
        bytes = ok ? 16 : 0;
      }
      // lanes past kUnits have no unit: their copy predicated off, not branched around
      if constexpr (kUnits % 32 == 0) cp_async16(dst[i] + stage, from, bytes);
      else cp_async16_if(lane + 32 * i < kUnits, dst[i] + stage, from, bytes);
    }
    if constexpr (T::kPacked) {
      const unsigned word = (first_block + unsigned(kt) * (64 / block_values<F>())) & ~3u;
      cp_async4(scale_dst + stage, scale_src + word, scale_bytes);
    }
  }
};

// The shared addresses weight_fragments reads in a warp's stage 0: BF16, each ldmatrix's row for
// this lane (16 rows: one a k16 step; 8 rows: one a pair of steps); packed, its row gid's codes
// (row gid + 8's kRowBytes 8 on) and block-scale word.
template <Format F, int kRows>
struct FragmentAddresses {
  using T = Tile<F>;
  static constexpr int kCount = !T::kPacked && kRows == 16 ? 4 : 2;
  uint32_t at[kCount];
  __device__ __forceinline__ FragmentAddresses(int lane, uint32_t stages) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      if constexpr (T::kPacked) at[i] = i == 0 ? (lane >> 2) * T::kRowBytes : kRows * T::kRowBytes + 4 * (lane >> 2);
      else if constexpr (kRows == 16) at[i] = sw128(lane & 15, 2 * i + (lane >> 4));
      else at[i] = sw128(lane & 7, 4 * i + (lane >> 3));  // matrices (rows 0..7) x chunks 4 i .. 4 i + 3
      at[i] += stages;
      hold(at[i]);
    }
  }
};

// This thread's A fragments (mma_bf16's layout: rows gid and gid + 8 of the warp's 16, k 2 tig ..
// and 2 tig + 8 .. of each k16 step) of the warp's K tile in the stage `stage` bytes on (WarpCopy's
// layout): BF16 by ldmatrix from the 128-byte swizzle; packed ones decoded from the rows' codes,
// each value the product code x block scale rounded once to BF16, as decode8_bits has it: NVFP4 by
// integer moves and two BF16-pair FMAs a code byte (e2m1x2_times, exact), MXFP8 by decode2_bits.
// With 8 rows a warp, rows gid + 8 are zeros.
template <Format F, int kRows>
__device__ __forceinline__ void weight_fragments(const FragmentAddresses<F, kRows>& fa, uint32_t stage, int k0,
                                                 int lane, uint32_t (&a)[4][4]) {
  using T = Tile<F>;
  if constexpr (kRows == 8) {
#pragma unroll
    for (int s = 0; s < 4; ++s) a[s][1] = a[s][3] = 0u;
  }
  if constexpr (!T::kPacked) {
    (void)k0;
    if constexpr (kRows == 16) {
#pragma unroll
      for (int s = 0; s < 4; ++s) ldsm_x4<false>(a[s], fa.at[s] + stage);
    } else {  // k16 steps 2 q, 2 q + 1
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        uint32_t r[4];
        ldsm_x4<false>(r, fa.at[q] + stage);
        a[2 * q][0] = r[0], a[2 * q][2] = r[1], a[2 * q + 1][0] = r[2], a[2 * q + 1][2] = r[3];
      }
    }
  } else {
    const int tig = lane & 3;
    constexpr int kWords = T::kRowBytes / 4;
#pragma unroll
    for (int h = 0; h < kRows / 8; ++h) {  // rows gid, gid + 8
      uint32_t w[kWords];
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        const uint4 v = ld_shared_v4(fa.at[0] + stage + uint32_t(8 * h * T::kRowBytes + 16 * i));
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
      }
      const uint32_t scales = ld_shared_u32(fa.at[1] + stage + uint32_t(32 * h));
      if constexpr (F == Format::NVFP4) {
        // a 64-wide tile starts a scale word (k0 is a multiple of 64 where K is packed)
        uint32_t sc[4];
        ue4m3x4_bf16x2(scales, sc);
#pragma unroll
        for (int s = 0; s < 4; ++s) {  // codes of k 16 s + 2 tig, + 1 (word 2 s) and + 8, + 9 (word 2 s + 1)
          a[s][h] = e2m1x2_times(w[2 * s], tig, sc[s]);
          a[s][2 + h] = e2m1x2_times(w[2 * s + 1], tig, sc[s]);
        }
      } else {
        const int first_block = (unsigned(k0) / block_values<F>()) & 3;  // the tile's first scale in the word (k0 >= 0)
        const float sv[2] = {decode8_scale<F>(uint8_t(scales >> (8 * first_block))),
                             decode8_scale<F>(uint8_t(scales >> (8 * (first_block + 1))))};
        const bool odd = tig >= 2;  // a selection, not an index: w stays in registers
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint32_t lo = ((odd ? w[4 * s + 1] : w[4 * s]) >> (16 * (tig & 1))) & 0xFFFFu;
          const uint32_t hi = ((odd ? w[4 * s + 3] : w[4 * s + 2]) >> (16 * (tig & 1))) & 0xFFFFu;
          a[s][h] = decode2_bits<F>(lo, sv[s >> 1], nullptr);
          a[s][2 + h] = decode2_bits<F>(hi, sv[s >> 1], nullptr);
        }
      }
    }
  }
}

template <Format F, int J, int R>
__global__ void __launch_bounds__(kThreads) stream_kernel(const __grid_constant__ GroupedArgs p, int chunk) {
  dependent_launch_prologue();
  using T = Tile<F>;
  using S = Shape<F, J, R>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_group;
  __shared__ long long s_r0, s_r1;

  if (threadIdx.x < 32) find_row_tile(p, S::BM, s_group, s_r0, s_r1);
  __syncthreads();
  if (s_group < 0) return;
  const long long r0 = s_r0, r1 = s_r1;
  const int group = s_group, rows = int(r1 - r0);
  const int warp = int(threadIdx.x) >> 5;
  int lane = int(threadIdx.x) & 31;
  hold(lane);
  const int n0 = int(blockIdx.x) * S::BN + warp * R;  // the warp's first weight row
  const unsigned char* bg = p.b.data + group * p.b.slice_bytes;
  const uint8_t* bsg = T::kPacked ? p.b.scales + group * p.b.scale_slice : nullptr;
  const int k_tiles = (p.k_end - p.k_begin + 63) / 64;
  const int k_inside = (p.k_end - p.k_begin) / 64;  // tiles ending at or before k_end: all but a partial last
  unsigned char* tokens = smem;
  const uint32_t stages = smem_address(smem + chunk * S::kTokenTile + warp * S::kStages * S::kWStage);

  // the warp's weight pipeline: tile kt into stage kt % kStages (kWStage (kt % kStages) bytes on
  // from the warp's first), its lanes sharing the copies
  const WarpCopy<F, R> copy(p, bg, bsg, n0, lane, stages);
  auto load_weights = [&](int kt, uint32_t stage) {
    if (kt < k_inside) copy.template load<true>(p, kt, stage, lane);
    else if (kt < k_tiles) copy.template load<false>(p, kt, stage, lane);
  };
  const FragmentAddresses<F, R> fragment_addresses(lane, stages);
  // this lane's ldmatrix row of the tokens' k16 steps 2 h, 2 h + 1 in tile 0 of the chunk (n8 block 0)
  uint32_t token_rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    token_rows[h] = smem_address(tokens) + sw128(lane & 7, 4 * h + (lane >> 3));
    hold(token_rows[h]);
  }
#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    load_weights(s, uint32_t(s * S::kWStage));
    cp_async_commit();
  }
  // the token rows past the group's are zeros, in every tile of the chunk buffer
  for (int i = int(threadIdx.x); i < (S::BM - rows) * 8 * chunk; i += kThreads) {
    const int tile = i / ((S::BM - rows) * 8), rest = i % ((S::BM - rows) * 8);
    *reinterpret_cast<uint4*>(tokens + tile * S::kTokenTile + sw128(rows + rest / 8, rest % 8)) =
        make_uint4(0u, 0u, 0u, 0u);
  }

  float acc[J][4];
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  // tile kt's stage and tile kt - 1's, which takes tile kt + kStages - 1: stepped, not worked out
  // from kt (nvcc would multiply at every address)
  constexpr uint32_t kLastStage = (S::kStages - 1) * S::kWStage;
  uint32_t stage = 0, previous_stage = kLastStage;
  for (int c0 = 0; c0 < k_tiles; c0 += chunk) {
    const int c1 = min(k_tiles, c0 + chunk);
    if (c0 > 0) __syncthreads();  // every warp is done with the previous chunk's tokens
    stage_tokens<F, S::BM>(p, r0, rows, c0, c1, tokens);
    __syncthreads();
    uint32_t token_tile = 0;  // tile kt's in the chunk's tokens
    for (int kt = c0; kt < c1; ++kt) {
      cp_async_wait<S::kStages - 2>();  // tile kt has landed (this lane's copies) ...
      __syncwarp();                     // ... every lane's; and every lane is done with tile kt - 1
      load_weights(kt + S::kStages - 1, previous_stage);
      cp_async_commit();
      uint32_t a[4][4];
      weight_fragments<F, R>(fragment_addresses, stage, p.k_begin + kt * 64, lane, a);
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k16 steps 2 h, 2 h + 1
          uint32_t b[4];
          ldsm_x4<false>(b, token_rows[h] + token_tile + uint32_t(8 * j * 128));  // rows 8 j .. of block j
          mma_bf16(acc[j], a[2 * h], b[0], b[1]);
          mma_bf16(acc[j], a[2 * h + 1], b[2], b[3]);
        }
      previous_stage = stage;
      stage = stage == kLastStage ? 0 : stage + S::kWStage;
      token_tile += S::kTokenTile;
    }
  }
  cp_async_wait<0>();

  // C[token, weight row] in NUMERICS' order (finish_value): acc[j] holds weight rows gid, gid + 8
  // and tokens 8 j + 2 tig, + 1 of the warp's block.
  const float* sbo = p.b.outer ? p.b.outer + group * p.b.outer_group_stride : nullptr;
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const long long row = r0 + 8 * j + 2 * tig + (e & 1);
      const int col = n0 + gid + 8 * (e >> 1);
      if ((R == 8 && e >= 2) || row >= r1 || col >= p.n) continue;
      float* c = p.c + row * p.ldc + col;
      *c = finish_value(p, sbo, acc[j][e], row, col, p.accumulate ? *c : 0.0f);
    }
}

}  // namespace streaming

}  // namespace hopper
}  // namespace
}  // namespace fourbit::ops::cuda
