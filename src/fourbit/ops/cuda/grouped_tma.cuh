// defines: hopper::tma_store_block, hopper::init_ring, hopper::release_in_cluster, hopper::tma_produce,
//          hopper::tma_kernel, TmaShape, PpShape, pp_wait_turn, pp_pass_turn, pp_end, hopper::tma_pp_kernel,
//          launch_tma_tile, launch_tma (the training tile fed by TMA), hopper::wgrad_tile_of,
//          hopper::tma_wgrad_produce, hopper::tma_wgrad_kernel, hopper::tma_wgrad_pp_kernel,
//          launch_tma_wgrad_tile, launch_tma_wgrad (the K-grouped form fed by TMA), bf16_map and their
//          launch counters, kMaxKDeviceSets, KDeviceProblemArgs, k_device_problems_kernel (its problems from
//          device offsets)
#pragma once

#include <cuda.h>

#include <atomic>

#include "fourbit/ops/cuda/grouped_hopper.cuh"

namespace fourbit::ops::cuda {
namespace {
namespace hopper {

// ---- the TMA form of the training tile (BF16 operands) -------------------------------------------
//
// The BF16 training tile of wgmma_kernel fed by TMA instead of cp.async from every thread, in
// clusters of two CTAs on neighbouring column tiles that share their A tile: each CTA loads half
// of it and multicasts that half into both, so a pair reads A from L2 once (a third less L2 -> SM
// traffic, what bounds the cp.async loop). One producer thread issues the copies into a ring of
// stages; per stage a "full" mbarrier counts the bytes in (its CTA's B tile and both A halves) and
// an "empty" one the releases of the pair's consumer warpgroups, after which the stage may be
// overwritten in either CTA. The consumers release a stage with a CTA-scope arrival: a cluster-scope
// release costs a MEMBAR.GPU per K tile in every warpgroup, which held the loop at ~0.6 of
// cuBLASLt (h200_gpu_grouped_gemm_cta_release.json has the times without it). Two tiles, 4 stages
// of 48 KB, one CTA an SM (set_grouped_tma_tile): 128 x 256 on two consumer warpgroups of
// m64n256k16 (WGM 2, WN 256; the default), and 256 x 128 on four of m64n128k16 (WGM 4, WN 128).
// The flat tile's warpgroups read a third less shared memory a FLOP (A's 64 rows and B's 256 for
// 64 x 256 outputs, against 64 and 128 for 64 x 128), and its 288 threads leave each 224
// registers for its 128 accumulators, so its epilogue can load the outer scales ahead. On an H100
// at gpu-small's expert shape (h100_gpu_grouped_gemm_tiles_s57.json) the two main loops take the
// same time (0.054-0.056 ms); with the compact epilogue (store_block_full) the flat tile takes
// 0.074 ms, 0.92 of a dense cuBLASLt GEMM of the same FLOPs (68.7 us under Nsight Compute against
// 78.9 for the 256 x 128 tile), and the training step ~1 ms less than on the 256 x 128 tile
// (h100_gpu_train_tma_tile_s57.json). The flat tile measured slower while every K tile's release
// also cost a MEMBAR.GPU (h200_gpu_grouped_gemm_tiles.json, "128x256 tile ms") and before
// store_block_full (its unrolled branchy epilogue ran out of the instruction cache); 128 x 128 on
// two warpgroups, two CTAs an SM, was slower too (h200_gpu_grouped_gemm.json, "TMA 128-row ms")
// and was removed. Every element is the same chain of k16 steps over the same 64-wide K tiles as
// in wgmma_kernel, whatever the instruction's N, so both tiles give wgmma_kernel's bits. BT: B is
// read MN-major as wgmma_kernel's BT form reads it, WN / 64 boxes of 64 N values x 64 K rows of a
// 3-D map [G][K][N] a stage (its K rows past a group's K are zeros, not the next group's). Where K
// is at most 4096 the default is neither tile but the ping-pong form below (tma_pp_kernel), whose
// warpgroups take 128 x 128 tiles in turn.
struct TmaParams {
  CUtensorMap a;  // A [M, K] BF16, boxes of 64 K values x BM / 2 rows, 128-byte swizzle
  CUtensorMap b;  // B [G N, K], boxes of 64 K values x BN rows; BT: [G][K][N], boxes 64 x 64 x 1
  GroupedArgs g;
  int pairs, rows;  // the grid of cluster tiles: pairs of column tiles x row tiles (and slots past them)
  int band_pairs;   // the tile order: column pairs a band (0: a row tile's columns, then the next)
  bool no_store;    // the benchmarks' probe (set_grouped_tma_store_probe): no epilogue, C unwritten
};

// WGM consumer warpgroups of 64 x WN, and the producer warp
template <int WGM>
constexpr int tma_threads() {
  return 128 * WGM + 32;
}

// Cluster tile c (of pairs x rows) in the tile order: clusters in turn walk bands of band_pairs
// column pairs, row tiles fastest inside a band, so that the tiles in flight at once cover a
// near-square block of C and share both operands in L2; walking all the column tiles of a row
// tile first (band_pairs 0) reads the whole of B once per 66 tiles, from HBM where B is larger
// than L2.
__device__ __forceinline__ void tma_tile_of(const TmaParams& tp, int c, int& row_tile, int& pair) {
  row_tile = c / tp.pairs;
  pair = c % tp.pairs;
  if (tp.band_pairs > 0 && tp.band_pairs < tp.pairs) {
    const int band = c / (tp.band_pairs * tp.rows), first = band * tp.band_pairs;
    const int width = min(tp.band_pairs, tp.pairs - first), in_band = c - first * tp.rows;
    row_tile = in_band / width;
    pair = first + in_band % width;
  }
}

// The TMA form's epilogue of warpgroup wm's 64 x WN block at col0. The flat tile's 288 threads
// have the registers for the outer scales in the compact epilogue (store_block_full), loaded
// ahead; the 544 of the 256 x 128 tile (96 registers each) do not, so it takes the compact
// epilogue only where there are no outer scales (ptxas still reports 36 bytes of spills for it
// with that path compiled in, none before; under Nsight Compute the tile went from 84.6 to
// 78.9 us at the expert shape all the same). Elsewhere store_block.
template <int WGM, int WN>
__device__ __forceinline__ void tma_store_block(const GroupedArgs& p, int group, const float (&acc)[WN / 2], int wm,
                                                int col0, long long r0, long long r1) {
  const bool full = block_columns_full<WN>(p, col0);
  if constexpr (WGM <= 2) {
    if (full) return store_block_full<WN, kAhead, true>(p, group, acc, wm, col0, r0, r1);
  } else {
    if (full && !p.a.outer && !p.b.outer) return store_block_full<WN, 2, false, false>(p, group, acc, wm, col0, r0, r1);
  }
  store_block<WN, kAhead, false>(p, group, acc, wm, col0, r0, r1);
}

// Thread 0 sets up a ring of ST stages: each stage's full mbarrier (one arrival, the producer's
// with its bytes) and its empty one (`releases` arrivals, the consumers'), the initialisations made
// visible to the cluster (the caller syncs before any copy or arrival).
template <int ST>
__device__ __forceinline__ void init_ring(uint32_t full0, uint32_t empty0, uint32_t releases) {
  if (threadIdx.x != 0) return;
  for (int st = 0; st < ST; ++st) {
    mbarrier_init(full0 + 8u * st, 1);
    mbarrier_init(empty0 + 8u * st, releases);
  }
  fence_mbarrier_init();
}

// A consumer's release of a stage: one arrival on its empty mbarrier in both CTAs of the pair.
__device__ __forceinline__ void release_in_cluster(uint32_t bar) {
  mbarrier_arrive_cluster(bar, 0);
  mbarrier_arrive_cluster(bar, 1);
}

// The producer warp of the row-grouped TMA forms (tile S, its stages the ring at sbase with their
// full and empty mbarriers): the cluster's tiles in turn, every K tile's copies into the next stage
// once both CTAs have released it; `issuer` (one thread) issues them, the warp finds each tile's
// group (row_tile_of is warp-collective).
template <class S, bool BT>
__device__ __forceinline__ void tma_produce(const TmaParams& tp, uint32_t rank, int cluster, int clusters, int k_tiles,
                                            uint32_t sbase, uint32_t full0, uint32_t empty0, bool issuer) {
  constexpr int BM = S::BM, BN = S::BN, kHalf = BM / 2 * 128;  // bytes of half an A tile
  const GroupedArgs& p = tp.g;
  const int tiles = tp.pairs * tp.rows;
  int it = 0;  // K tiles through the ring so far
  for (int c = cluster; c < tiles; c += clusters) {
    int row_tile, pair;
    tma_tile_of(tp, c, row_tile, pair);
    const RowTile t = row_tile_of(p, BM, row_tile);
    if (t.group < 0) continue;
    const int n0 = (2 * pair + int(rank)) * BN;
    if (issuer) {
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int st = it % S::kStages, round = it / S::kStages;
        if (round > 0) mbarrier_wait(empty0 + 8u * st, uint32_t(round - 1) & 1u);  // released in both CTAs
        const uint32_t stage = sbase + uint32_t(st * S::kStageBytes), bar = full0 + 8u * st;
        mbarrier_arrive_expect_tx(bar, uint32_t(S::kATile + S::kBTile));
        const int k0 = p.k_begin + kt * kBK;
        tma_load_2d_multicast(stage + rank * kHalf, &tp.a, k0, int(t.r0) + int(rank) * (BM / 2), bar, uint16_t(3));
        if constexpr (BT) {
#pragma unroll
          for (int h = 0; h < BN / 64; ++h)
            tma_load_3d(stage + uint32_t(S::kATile + h * kPanel), &tp.b, n0 + 64 * h, k0, t.group, bar);
        } else {
          tma_load_2d(stage + uint32_t(S::kATile), &tp.b, k0, t.group * p.n + n0, bar);
        }
      }
    }
    __syncwarp();
  }
}

// Persistent: cluster i of the grid's n computes cluster tiles i, i + n, i + 2n, ... (both CTAs
// the same row tile, neighbouring column tiles), and the K tiles of all of them run through one
// ring of stages, so the producer loads the next tile's first stages while the consumers store
// the last one's results, and a CTA's setup (barriers, cluster sync) is paid once. Every warp finds
// each tile's group itself (row_tile_of); the slots past the last row tile are skipped by all.
template <bool BT, int WGM, int WN>
__global__ void __launch_bounds__(tma_threads<WGM>(), 1) tma_kernel(const __grid_constant__ TmaParams tp) {
  using S = Shape<Format::BF16, WGM, 1, kStages, WN>;
  constexpr int BM = S::BM, BN = S::BN;
  const GroupedArgs& p = tp.g;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];

  const uint32_t rank = cluster_ctarank();
  const int tid = int(threadIdx.x), cluster = int(blockIdx.x) / 2, clusters = int(gridDim.x) / 2;
  const int tiles = tp.pairs * tp.rows;
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const uint32_t full0 = smem_address(&full[0]), empty0 = smem_address(&empty[0]);
  init_ring<kStages>(full0, empty0, 2 * WGM);
  cluster_sync();  // both CTAs' barriers are initialised before either copies or arrives
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;

  if (tid >= 128 * WGM) {  // the producer warp
    tma_produce<S, BT>(tp, rank, cluster, clusters, k_tiles, sbase, full0, empty0, tid == 128 * WGM);
  } else {
    const int wm = tid >> 7;
    int it = 0;
    for (int c = cluster; c < tiles; c += clusters) {
      int row_tile, pair;
      tma_tile_of(tp, c, row_tile, pair);
      const RowTile t = row_tile_of(p, BM, row_tile);
      if (t.group < 0) continue;
      float acc[WN / 2];
#pragma unroll
      for (int i = 0; i < WN / 2; ++i) acc[i] = 0.0f;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int st = it % kStages;
        mbarrier_wait(full0 + 8u * st, uint32_t(it / kStages) & 1u);
        const uint32_t stage = sbase + uint32_t(st * S::kStageBytes);
        mma_k_tile<false, BT, WN>(acc, stage + uint32_t(wm * 64 * 128), stage + uint32_t(S::kATile), kt == 0);
        wgmma_wait<1>();  // the MMAs of the K tile before are done: release its stage in both CTAs
        pin(acc);
        if (kt > 0 && (tid & 127) == 0) release_in_cluster(empty0 + 8u * uint32_t((it - 1) % kStages));
      }
      wgmma_wait<0>();
      pin(acc);
      // the tile's last stage, before its results are stored
      if (k_tiles > 0 && (tid & 127) == 0) release_in_cluster(empty0 + 8u * uint32_t((it - 1) % kStages));
      if (!tp.no_store) tma_store_block<WGM, WN>(p, t.group, acc, wm, (2 * pair + int(rank)) * BN, t.r0, t.r1);
    }
  }
  cluster_sync();  // neither CTA leaves while the other may still copy into it or arrive on it
}

// The ping-pong form (set_grouped_tma_pingpong): 128 x 128 tiles (the pair's A tile shared as in
// tma_kernel), each taken whole by one of two consumer warpgroups in turn (128 accumulators a
// thread: mma_k_tile_m128), so that one warpgroup's epilogue, whose F32 stores wait on DRAM (at
// gpu-small's expert shape C is 128 MB, as many bytes as A and B together), runs while the other
// warpgroup's MMAs keep the tensor cores busy; in tma_kernel every warpgroup stores at once and
// the tensor cores wait. The K tiles of all the CTA's tiles go through one ring of kPpStages
// stages of 32 KB in the cluster's tile order; tile i of the cluster's is warpgroup i % 2's, which
// skips the other's K tiles in the ring. A warpgroup waits on a stage's full barrier by its parity,
// which only tells the phase it waits for from the one before if that one has completed: so a
// warpgroup starts a tile's waits only once the other has passed every wait of the tile before
// (named barrier 1 + w says warpgroup w may go; the other arrives on it after its K loop). The
// same k16 chains as tma_kernel: the same bits.
constexpr int kPpStages = 6;
// A TMA kernel's tile shape: WGM warpgroups of 64 x WN (the cooperative tiles, kStages stages), or
// the ping-pong form's (PP: WGM 2, WN 128, a warpgroup's 128 x 128 tile, kPpStages stages).
template <int WGM, int WN, bool PP>
using TmaShape = Shape<Format::BF16, WGM, 1, PP ? kPpStages : kStages, WN>;
using PpShape = TmaShape<2, 128, true>;

// The ping-pong warpgroups' turns (named barrier 1 + w: warpgroup w may go): before tile i > 0
// of the CTA's (or cluster's), warpgroup i % 2 waits until the other has passed every wait of tile
// i - 1; after its K loop it passes the turn; the pass after the last tile, for a tile that never
// comes, is taken by the warpgroup that would have run it (pp_end).
__device__ __forceinline__ void pp_wait_turn(int i, int wg) {
  if (i > 0) named_barrier_sync(1 + wg, 256);
}
__device__ __forceinline__ void pp_pass_turn(int wg) { named_barrier_arrive(2 - wg, 256); }
__device__ __forceinline__ void pp_end(int tiles, int wg) {
  if (tiles > 0 && tiles % 2 == wg) named_barrier_sync(1 + wg, 256);
}

template <bool BT>
__global__ void __launch_bounds__(tma_threads<2>(), 1) tma_pp_kernel(const __grid_constant__ TmaParams tp) {
  using S = PpShape;
  constexpr int BM = S::BM, BN = S::BN, kSt = S::kStages;
  const GroupedArgs& p = tp.g;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kSt], empty[kSt];

  const uint32_t rank = cluster_ctarank();
  const int tid = int(threadIdx.x), cluster = int(blockIdx.x) / 2, clusters = int(gridDim.x) / 2;
  const int tiles = tp.pairs * tp.rows;
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const uint32_t full0 = smem_address(&full[0]), empty0 = smem_address(&empty[0]);
  init_ring<kSt>(full0, empty0, 2);  // the tile's warpgroup in each CTA of the pair
  cluster_sync();
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;

  if (tid >= 256) {
    tma_produce<S, BT>(tp, rank, cluster, clusters, k_tiles, sbase, full0, empty0, tid == 256);
  } else {
    const int wg = tid >> 7;
    int n_tiles = 0;  // the cluster's tiles so far, both warpgroups'
    for (int c = cluster; c < tiles; c += clusters) {
      int row_tile, pair;
      tma_tile_of(tp, c, row_tile, pair);
      const RowTile t = row_tile_of(p, BM, row_tile);
      if (t.group < 0) continue;
      const int i = n_tiles++;
      if (i % 2 != wg) continue;
      pp_wait_turn(i, wg);
      float acc0[64], acc1[64];
#pragma unroll
      for (int j = 0; j < 64; ++j) acc0[j] = acc1[j] = 0.0f;
      int it = i * k_tiles;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int st = it % kSt;
        mbarrier_wait(full0 + 8u * st, uint32_t(it / kSt) & 1u);
        const uint32_t stage = sbase + uint32_t(st * S::kStageBytes);
        mma_k_tile_m128<false, BT>(acc0, acc1, stage, stage + uint32_t(S::kATile), kt == 0);
        wgmma_wait<1>();  // the MMAs of the K tile before are done: release its stage in both CTAs
        pin(acc0);
        pin(acc1);
        if (kt > 0 && (tid & 127) == 0) release_in_cluster(empty0 + 8u * uint32_t((it - 1) % kSt));
      }
      pp_pass_turn(wg);  // the other warpgroup's next tile may wait on its stages
      wgmma_wait<0>();
      pin(acc0);
      pin(acc1);
      if (k_tiles > 0 && (tid & 127) == 0) release_in_cluster(empty0 + 8u * uint32_t((it - 1) % kSt));
      if (!tp.no_store) {
        const int col0 = (2 * pair + int(rank)) * BN;
        tma_store_block<2, 128>(p, t.group, acc0, 0, col0, t.r0, t.r1);
        tma_store_block<2, 128>(p, t.group, acc1, 1, col0, t.r0, t.r1);
      }
    }
    pp_end(n_tiles, wg);
  }
  cluster_sync();
}

// cuTensorMapEncodeTiled from the driver (no link against libcuda), or null.
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return EncodeTiled(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A BF16 [rows, cols] operand with rows ld bytes apart as a TMA map of 64 x box_rows boxes in the
// 128-byte swizzle, zeros outside; with slice_bytes > 0, a 3-D map [slices][rows][cols] with
// slices slice_bytes apart and boxes of one slice.
bool bf16_map(CUtensorMap& m, const void* base, uint64_t cols, uint64_t rows, uint64_t ld, uint32_t box_rows,
              uint64_t slices = 1, uint64_t slice_bytes = 0) {
  const EncodeTiled fn = encode_tiled();
  if (!fn || rows == 0 || cols == 0 || slices == 0) return false;
  const uint32_t rank = slice_bytes > 0 ? 3 : 2;
  const cuuint64_t dims[3] = {cols, rows, slices}, strides[2] = {ld, slice_bytes};
  const cuuint32_t box[3] = {uint32_t(kBK), box_rows, 1}, elem[3] = {1, 1, 1};
  return fn(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

std::atomic<int64_t> g_tma_launches{0};
// The TMA form's tile order (TmaParams::band_pairs), in pairs of 128-wide column tiles: 8 pairs,
// 16 column tiles of 128, make the 132 CTAs resident at once ~8 row tiles x 16 column tiles, whose
// A (8 x 256 rows) and B (16 x 128 rows) are about as large. The flat tile's bands are as wide in
// columns (half as many pairs of its 256-wide tiles).
std::atomic<int> g_tile_band{8};
std::atomic<bool> g_tma_persistent{true};
std::atomic<int> g_tma_tile_n{256};  // the TMA form's tile: 128 x 256 (256, the default) or 256 x 128 (128)
std::atomic<bool> g_tma_no_store{false};
// The row-grouped form takes tma_pp_kernel where K is at most this (set_grouped_tma_pingpong; 0:
// never), else the tile above. On an H100 the ping-pong tiles took gpu-small's training step
// 0.6-0.8 ms faster for bf16 and 0.1-0.35 for the quantized recipes (its row-grouped GEMMs have K
// of 1024 to 4096), but 8192^3 10-16% slower, where the epilogue is a small part of the tile's
// time and the 128 x 128 tiles' greater L2 traffic counts (h100_gpu_train_pingpong_s58.json,
// h100_gpu_grouped_gemm_pingpong_s58.json).
std::atomic<int> g_tma_pingpong_max_k{4096};
// Whether an MN-major B (the bf16 recipe's dgrads, the forward's weights read in place) takes the
// ping-pong tiles too (set_grouped_tma_pingpong_mn_major; the default): in gpu_grouped_gemm those
// dgrads ran 0-4% faster on 128 x 256, but the step took the same time either way on an H100
// (h100_gpu_train_pingpong_fwd_s59.json).
std::atomic<bool> g_tma_pingpong_mn_major{true};

// The row-grouped TMA kernel of a tile: tma_kernel's BM = 64 WGM x WN, or the ping-pong form's
// 128 x 128 (PP), and its shape.
template <bool BT, int WGM, int WN, bool PP>
constexpr auto tma_kernel_of() {
  if constexpr (PP) return &tma_pp_kernel<BT>;
  else return &tma_kernel<BT, WGM, WN>;
}

// The TMA form of tile BM = 64 WGM x WN (or the ping-pong form's, PP) for BF16 groups of the
// training tile; false where it does not apply (a K-major B's slices not back to back, a map the
// driver will not encode, no driver entry point), and the caller runs wgmma_kernel.
template <bool BT, int WGM, int WN, bool PP = false>
bool launch_tma_tile(const GroupedArgs& p) {
  static_assert(!PP || (WGM == 2 && WN == 128), "the ping-pong form's tiles: two warpgroups of 128 x 128");
  using S = TmaShape<WGM, WN, PP>;
  constexpr auto kernel = tma_kernel_of<BT, WGM, WN, PP>();
  TmaParams tp{};
  tp.g = p;
  const int band = g_tile_band.load(std::memory_order_relaxed);
  tp.band_pairs = band > 0 ? std::max(1, band * 128 / WN) : 0;
  tp.no_store = g_tma_no_store.load(std::memory_order_relaxed);
  if (!bf16_map(tp.a, p.a.data, uint64_t(p.k_end), uint64_t(p.m), uint64_t(p.a.ld), S::BM / 2)) return false;
  if constexpr (BT) {
    const int64_t slice = p.groups > 1 ? p.b.slice_bytes : int64_t(p.k_end) * p.b.ld;  // one group: any stride
    if (slice <= 0 || !bf16_map(tp.b, p.b.data, uint64_t(p.n), uint64_t(p.k_end), uint64_t(p.b.ld), 64,
                                uint64_t(p.groups), uint64_t(slice)))
      return false;
  } else {
    if (p.b.slice_bytes != int64_t(p.n) * p.b.ld ||
        !bf16_map(tp.b, p.b.data, uint64_t(p.k_end), uint64_t(p.groups) * uint64_t(p.n), uint64_t(p.b.ld), S::BN))
      return false;
  }
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  tp.pairs = int((p.n + 2 * S::BN - 1) / (2 * S::BN));
  tp.rows = int(row_tile_bound(p, S::BM));
  const int tiles = tp.pairs * tp.rows;
  // clusters of two CTAs along the columns, asked for at launch (a __cluster_dims__ attribute
  // would not compile for the portable compute_80 code)
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(tma_threads<WGM>());
  cfg.dynamicSmemBytes = S::kSmemBytes;
  cfg.stream = stream();
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = 2;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  // as many clusters as fit on the device at once (one CTA an SM), or one a tile when not persistent
  static const int resident = [&cfg] {
    cudaLaunchConfig_t probe = cfg;
    probe.gridDim = dim3(2 * 1024);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &probe) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = std::max(1, device_sm_count() / 2);
    }
    return n;
  }();
  const int clusters = g_tma_persistent.load(std::memory_order_relaxed) ? std::min(tiles, resident) : tiles;
  cfg.gridDim = dim3(unsigned(2 * clusters));
  // A cluster launch the device refuses (a configuration error, reported at once) leaves the
  // tile to the cp.async form, from then on: a refusal inside a CUDA graph capture would end the
  // capture, so one seen eagerly is not tried again there.
  static std::atomic<bool> refused{false};
  if (refused.load(std::memory_order_relaxed)) return false;
  if (cudaLaunchKernelEx(&cfg, kernel, tp) != cudaSuccess) {
    cudaGetLastError();
    refused.store(true, std::memory_order_relaxed);
    return false;
  }
  g_tma_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The ping-pong form where K is at most g_tma_pingpong_max_k (for an MN-major B, where
// g_tma_pingpong_mn_major too), else the TMA form in the tile set_grouped_tma_tile chose.
template <bool BT>
bool launch_tma(const GroupedArgs& p) {
  if (p.k_end - p.k_begin <= g_tma_pingpong_max_k.load(std::memory_order_relaxed) &&
      (!BT || g_tma_pingpong_mn_major.load(std::memory_order_relaxed)))
    return launch_tma_tile<BT, 2, 128, true>(p);
  return g_tma_tile_n.load(std::memory_order_relaxed) == 256 ? launch_tma_tile<BT, 2, 256>(p)
                                                             : launch_tma_tile<BT, 4, 128>(p);
}

// ---- the TMA form of the K-grouped weight gradients (BF16 operands, either layout) --------------
//
// wgrad_kernel<MN> fed by TMA from one producer thread, persistent: as many CTAs as there are
// SMs, each looping over (output tile, problem) pairs with one ring of stages, so the next tile's
// first K tiles load while the consumer warpgroups add the last one's sums into C. Every problem
// has its own pair of 2-D maps over its token range only, so TMA zero-fills the K past an
// expert's last token: the bits of the cp.async form, which zero-fills it too, from the same
// m64n128k16 chain (mma_k_tile<MN, MN>) over the same 64-wide K tiles. MN-major (the bf16
// recipe's token-major dY and X): A_j is k_j rows of m values, B_j k_j rows of n values, and a
// stage is A's four 64-value panels and B's two, as load_tile_mn lays them. K-major (the decoded
// Col-axis MXFP8 operands of the quantized recipes, [m, T] and [n, T] with an expert's tokens a
// column range): A_j is m rows of k_j values, B_j n rows, one box of 64 K values x BM (A) or
// BN (B) rows each, 128-byte rows in the 128-byte swizzle, as load_tile lays them. The tiles are
// those of the row-grouped form: 128 x 256 on two warpgroups of m64n256k16 (the default) or 256 x
// 128 on four of m64n128k16 (set_grouped_wgrad_tma_tile), the same bits. At gpu-small's expert
// weight gradients on an H100 the flat tile with the compact epilogue takes 0.103 / 0.194 ms (w2;
// w1 and w3), the 256 x 128 tile with the branchy one took 0.124 / 0.230
// (h100_gpu_grouped_gemm_wgrad_s57.json; h100_gpu_grouped_gemm_tiles_s57_call1.txt); in session
// 58's bench the 256 x 128 tile with the compact epilogue and the ping-pong form below took 0.18
// ms for w2 against 0.095 for the flat tile, though the ping-pong form was within ~0.25 ms of the
// flat tile in the training step (h100_gpu_grouped_gemm_pingpong_wgrad_s58.json; not explained).
constexpr int kMaxTmaKProblems = 32;  // a launch's (the maps travel as kernel parameters: ~8 KB)

struct TmaWgradParams {
  CUtensorMap a[kMaxTmaKProblems];  // A_j: [k_j, m] BF16 (MN-major) or [m, k_j] (K-major), 128-byte swizzle
  CUtensorMap b[kMaxTmaKProblems];  // B_j: [k_j, n] or [n, k_j]
  float* c[kMaxTmaKProblems];
  int k[kMaxTmaKProblems];
  int m, n, count, tiles_m, tiles_n;
  int64_t ldc;  // floats
  bool accumulate;
  const KDeviceProblem* dev;  // non-null: the problems' maps, K and C are dev[0 .. count)'s, the arrays above unused
};

// Problem j's K, C and maps, from the parameters or, with device offsets, from device memory.
__device__ __forceinline__ int wgrad_k(const TmaWgradParams& tp, int j) { return tp.dev ? tp.dev[j].prob.k : tp.k[j]; }
__device__ __forceinline__ float* wgrad_c(const TmaWgradParams& tp, int j) { return tp.dev ? tp.dev[j].prob.c : tp.c[j]; }
__device__ __forceinline__ const CUtensorMap* wgrad_map_a(const TmaWgradParams& tp, int j) {
  return tp.dev ? &tp.dev[j].a_map : &tp.a[j];
}
__device__ __forceinline__ const CUtensorMap* wgrad_map_b(const TmaWgradParams& tp, int j) {
  return tp.dev ? &tp.dev[j].b_map : &tp.b[j];
}

// The CTA's tile of round r of a K-grouped launch, or -1 past the last: tiles are dealt to the
// CTAs in rounds of gridDim.x, alternately forwards and backwards (round 0: CTA b takes tile b;
// round 1: tile 2 gridDim.x - 1 - b; ...). The problems come heaviest first (grouped_gemm_k sorts
// them by K; k_device_problems_kernel writes them in that order), so each round deals tiles of
// falling cost and the back-and-forth evens out what a CTA sums over its rounds. Which CTA computes
// a tile changes nothing in its bits.
__device__ __forceinline__ int wgrad_tile_at(int round, int tiles) {
  const int g = int(gridDim.x), b = int(blockIdx.x);
  const int t = round * g + ((round & 1) ? g - 1 - b : b);
  return t < tiles ? t : -1;
}

// Tile t of a K-grouped launch on BM x BN tiles: problem j = t / (its tiles), then row tiles
// fastest.
template <int BM, int BN>
__device__ __forceinline__ void wgrad_tile_of(const TmaWgradParams& tp, int t, int& j, int& m0, int& n0) {
  const int per_problem = tp.tiles_m * tp.tiles_n;
  j = t / per_problem;
  const int r = t % per_problem;
  m0 = (r % tp.tiles_m) * BM;
  n0 = (r / tp.tiles_m) * BN;
}

// The producer thread of the K-grouped TMA forms (tile S): the CTA's tiles in turn, each problem's
// K tiles into the ring's next stage once its consumers have released it.
template <class S, bool MN>
__device__ __forceinline__ void tma_wgrad_produce(const TmaWgradParams& tp, uint32_t sbase, uint32_t full0,
                                                  uint32_t empty0) {
  constexpr int BM = S::BM, BN = S::BN;
  const int tiles = tp.tiles_m * tp.tiles_n * tp.count;
  if (tp.dev) {
    // Maps written by an earlier kernel: each acquired once, before any copy reads it and before
    // any copy is in flight, rather than before each tile's copies (every tile of a CTA is a new
    // problem).
    for (int r = 0, t; (t = wgrad_tile_at(r, tiles)) >= 0; ++r) {
      int j, m0, n0;
      wgrad_tile_of<BM, BN>(tp, t, j, m0, n0);
      if (wgrad_k(tp, j) == 0) continue;  // no copies read an empty problem's maps
      tensormap_acquire(wgrad_map_a(tp, j));
      tensormap_acquire(wgrad_map_b(tp, j));
    }
  }
  int it = 0;
  for (int r = 0, t; (t = wgrad_tile_at(r, tiles)) >= 0; ++r) {
    int j, m0, n0;
    wgrad_tile_of<BM, BN>(tp, t, j, m0, n0);
    const int k_tiles = (wgrad_k(tp, j) + kBK - 1) / kBK;
    const CUtensorMap *map_a = wgrad_map_a(tp, j), *map_b = wgrad_map_b(tp, j);
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int st = it % S::kStages, round = it / S::kStages;
      if (round > 0) mbarrier_wait(empty0 + 8u * st, uint32_t(round - 1) & 1u);
      const uint32_t stage = sbase + uint32_t(st * S::kStageBytes), bar = full0 + 8u * st;
      mbarrier_arrive_expect_tx(bar, uint32_t(S::kATile + S::kBTile));
      const int k0 = kt * kBK;
      if constexpr (MN) {
#pragma unroll
        for (int i = 0; i < BM / 64; ++i) tma_load_2d(stage + uint32_t(i * kPanel), map_a, m0 + 64 * i, k0, bar);
#pragma unroll
        for (int i = 0; i < BN / 64; ++i) tma_load_2d(stage + uint32_t(S::kATile + i * kPanel), map_b, n0 + 64 * i, k0, bar);
      } else {
        tma_load_2d(stage, map_a, k0, m0, bar);
        tma_load_2d(stage + uint32_t(S::kATile), map_b, k0, n0, bar);
      }
    }
  }
}

template <bool MN, int WGM, int WN>
__global__ void __launch_bounds__(tma_threads<WGM>(), 1) tma_wgrad_kernel(const __grid_constant__ TmaWgradParams tp) {
  using S = Shape<Format::BF16, WGM, 1, kStages, WN>;
  constexpr int BM = S::BM, BN = S::BN;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = int(threadIdx.x);
  const int tiles = tp.tiles_m * tp.tiles_n * tp.count;
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const uint32_t full0 = smem_address(&full[0]), empty0 = smem_address(&empty[0]);
  init_ring<kStages>(full0, empty0, WGM);
  __syncthreads();

  if (tid >= 128 * WGM) {  // the producer: one thread issues every copy
    if (tid == 128 * WGM) tma_wgrad_produce<S, MN>(tp, sbase, full0, empty0);
    return;
  }
  const int wm = tid >> 7, t128 = tid & 127;
  int it = 0;
  for (int r = 0, t; (t = wgrad_tile_at(r, tiles)) >= 0; ++r) {
    int j, m0, n0;
    wgrad_tile_of<BM, BN>(tp, t, j, m0, n0);
    const int k_tiles = (wgrad_k(tp, j) + kBK - 1) / kBK;
    float acc[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) acc[i] = 0.0f;
    if (k_tiles == 0 && tp.accumulate) continue;  // no tokens: C unchanged (or zeroed below)
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int st = it % kStages;
      mbarrier_wait(full0 + 8u * st, uint32_t(it / kStages) & 1u);
      const uint32_t stage = sbase + uint32_t(st * S::kStageBytes);
      // this warpgroup's 64 rows of A: 8 KB on (one MN-major panel, or 64 K-major rows)
      mma_k_tile<MN, MN, WN>(acc, stage + uint32_t(wm * kPanel), stage + uint32_t(S::kATile), kt == 0);
      wgmma_wait<1>();  // the MMAs of the K tile before are done: release its stage
      pin(acc);
      if (kt > 0 && t128 == 0) mbarrier_arrive(empty0 + 8u * uint32_t((it - 1) % kStages));
    }
    wgmma_wait<0>();
    pin(acc);
    if (k_tiles > 0 && t128 == 0) mbarrier_arrive(empty0 + 8u * uint32_t((it - 1) % kStages));
    store_wgrad_tile<WN>(acc, wgrad_c(tp, j), tp.ldc, tp.m, tp.n, m0, n0, wm, tp.accumulate);
  }
}

// The K-grouped ping-pong form (set_grouped_wgrad_tma_pingpong): tma_pp_kernel's scheme without
// clusters. 128 x 128 tiles, each taken whole by one of two consumer warpgroups in turn, one's
// epilogue (C, read and written in FP32) under the other's MMAs; tile i of the CTA's is warpgroup
// i % 2's, whose K tiles it skips in the ring (each problem its own K), and named barrier 1 + w
// says warpgroup w may start waiting on its next tile's stages (tma_pp_kernel says why). The same
// k16 chains as tma_wgrad_kernel: the same bits.
template <bool MN>
__global__ void __launch_bounds__(tma_threads<2>(), 1) tma_wgrad_pp_kernel(const __grid_constant__ TmaWgradParams tp) {
  using S = PpShape;
  constexpr int BM = S::BM, BN = S::BN, kSt = S::kStages;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kSt], empty[kSt];
  const int tid = int(threadIdx.x);
  const int tiles = tp.tiles_m * tp.tiles_n * tp.count;
  const uint32_t raw = smem_address(smem_raw), sbase = (raw + 1023u) & ~1023u;
  const uint32_t full0 = smem_address(&full[0]), empty0 = smem_address(&empty[0]);
  init_ring<kSt>(full0, empty0, 1);  // the tile's warpgroup
  __syncthreads();
  if (tid >= 256) {
    if (tid == 256) tma_wgrad_produce<S, MN>(tp, sbase, full0, empty0);
    return;
  }
  const int wg = tid >> 7, t128 = tid & 127;
  int it = 0, i = 0, t;  // K tiles through the ring and tiles (rounds) so far, both warpgroups'
  for (; (t = wgrad_tile_at(i, tiles)) >= 0; ++i) {
    int j, m0, n0;
    wgrad_tile_of<BM, BN>(tp, t, j, m0, n0);
    const int k_tiles = (wgrad_k(tp, j) + kBK - 1) / kBK;
    if (i % 2 != wg) {
      it += k_tiles;
      continue;
    }
    pp_wait_turn(i, wg);
    float acc0[64], acc1[64];
#pragma unroll
    for (int q = 0; q < 64; ++q) acc0[q] = acc1[q] = 0.0f;
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int st = it % kSt;
      mbarrier_wait(full0 + 8u * st, uint32_t(it / kSt) & 1u);
      const uint32_t stage = sbase + uint32_t(st * S::kStageBytes);
      mma_k_tile_m128<MN, MN>(acc0, acc1, stage, stage + uint32_t(S::kATile), kt == 0);
      wgmma_wait<1>();  // the MMAs of the K tile before are done: release its stage
      pin(acc0);
      pin(acc1);
      if (kt > 0 && t128 == 0) mbarrier_arrive(empty0 + 8u * uint32_t((it - 1) % kSt));
    }
    pp_pass_turn(wg);  // the other warpgroup's next tile may wait on its stages
    wgmma_wait<0>();
    pin(acc0);
    pin(acc1);
    if (k_tiles > 0 && t128 == 0) mbarrier_arrive(empty0 + 8u * uint32_t((it - 1) % kSt));
    if (k_tiles == 0 && tp.accumulate) continue;  // no tokens: C unchanged (or zeroed below)
    float* const c = wgrad_c(tp, j);
    store_wgrad_tile<128>(acc0, c, tp.ldc, tp.m, tp.n, m0, n0, 0, tp.accumulate);
    store_wgrad_tile<128>(acc1, c, tp.ldc, tp.m, tp.n, m0, n0, 1, tp.accumulate);
  }
  pp_end(i, wg);
}

std::atomic<bool> g_wgrad_tma{true};
std::atomic<int64_t> g_wgrad_tma_launches{0};
std::atomic<int> g_wgrad_tma_tile_n{256};  // as g_tma_tile_n, for the K-grouped form
std::atomic<bool> g_wgrad_tma_pingpong{false};  // tma_wgrad_pp_kernel instead of that tile

// The K-grouped TMA kernel of a tile: tma_wgrad_kernel's 64 WGM x WN, or the ping-pong form's
// 128 x 128 (PP).
template <bool MN, int WGM, int WN, bool PP>
constexpr auto tma_wgrad_kernel_of() {
  if constexpr (PP) return &tma_wgrad_pp_kernel<MN>;
  else return &tma_wgrad_kernel<MN, WGM, WN>;
}

// The TMA form of up to kMaxTmaKProblems problems on tiles of 64 WGM x WN (or the ping-pong
// form's, PP); false where it does not apply (a map the driver will not encode, strides off TMA's
// 16-byte grain, a launch refused), and the caller runs wgrad_kernel<MN>.
template <bool MN, int WGM, int WN, bool PP = false>
bool launch_tma_wgrad_tile(const KGroupedArgs& p) {
  static_assert(!PP || (WGM == 2 && WN == 128), "the ping-pong form's tiles: two warpgroups of 128 x 128");
  using S = TmaShape<WGM, WN, PP>;
  constexpr auto kernel = tma_wgrad_kernel_of<MN, WGM, WN, PP>();
  if (p.dev ? !MN : p.count > kMaxTmaKProblems) return false;  // device-made maps: MN-major
  // ~8 KB of kernel parameters: kept off the stack
  static thread_local TmaWgradParams tp;
  tp = TmaWgradParams{};
  tp.m = p.m;
  tp.n = p.n;
  tp.count = p.count;
  tp.ldc = p.ldc;
  tp.accumulate = p.accumulate;
  tp.tiles_m = (p.m + S::BM - 1) / S::BM;
  tp.tiles_n = (p.n + S::BN - 1) / S::BN;
  tp.dev = p.dev;  // its maps made on the GPU (MN-major, boxes of 64 K rows: any tile's)
  for (int j = 0; j < (p.dev ? 0 : p.count); ++j) {
    const KProblemArgs& q = p.prob[j];
    tp.c[j] = q.c;
    tp.k[j] = q.k;
    if (q.k == 0) continue;  // no copies: its tiles only store zeros, or nothing
    if (q.lda % 16 != 0 || q.ldb % 16 != 0) return false;
    const bool mapped =
        MN ? bf16_map(tp.a[j], q.a, uint64_t(p.m), uint64_t(q.k), uint64_t(q.lda), 64) &&
                 bf16_map(tp.b[j], q.b, uint64_t(p.n), uint64_t(q.k), uint64_t(q.ldb), 64)
           : bf16_map(tp.a[j], q.a, uint64_t(q.k), uint64_t(p.m), uint64_t(q.lda), S::BM) &&
                 bf16_map(tp.b[j], q.b, uint64_t(q.k), uint64_t(p.n), uint64_t(q.ldb), S::BN);
    if (!mapped) return false;
  }
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  const int tiles = tp.tiles_m * tp.tiles_n * tp.count;
  const int ctas = std::min(tiles, device_sm_count());
  if (ctas <= 0) return true;
  kernel<<<unsigned(ctas), tma_threads<WGM>(), S::kSmemBytes, stream()>>>(tp);
  if (cudaGetLastError() != cudaSuccess) return false;  // e.g. parameters over the device's limit
  g_wgrad_tma_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The K-grouped TMA form in the tile set_grouped_wgrad_tma_tile chose, or the ping-pong form
// (set_grouped_wgrad_tma_pingpong).
template <bool MN>
bool launch_tma_wgrad(const KGroupedArgs& p) {
  if (g_wgrad_tma_pingpong.load(std::memory_order_relaxed)) return launch_tma_wgrad_tile<MN, 2, 128, true>(p);
  return g_wgrad_tma_tile_n.load(std::memory_order_relaxed) == 256 ? launch_tma_wgrad_tile<MN, 2, 256>(p)
                                                                   : launch_tma_wgrad_tile<MN, 4, 128>(p);
}

// ---- the K-grouped form with device offsets (grouped_gemm_k_device_offsets) ----------------------
//
// Problem s * groups + g is K rows offsets[g] .. offsets[g + 1] of set s's token-major (MN-major)
// A_s [rows, m] and B_s [rows, n]. k_device_problems_kernel, one thread a problem, writes each
// problem's arguments and, for the TMA form, its maps: copies of the host's maps of set s's whole
// operands with the address moved to the problem's first row and the K extent cut to its rows, so
// that a problem's last K tile is zero-filled past its rows as the host-made maps of
// launch_tma_wgrad_tile fill it (the same operands in shared memory: the same bits). Offsets outside
// [0, rows] or decreasing are recorded as grouped_gemm's index errors and clamped, as row_tile_of
// does. The problems are written heaviest first, as grouped_gemm_k orders the host's (wgrad_tile_at
// says why): problem (s, g) goes to slot sets x (the groups with more rows, or as many and a lower
// index) + s, so an expert's problems of every set lie side by side (w1's and w3's read one X).
// Past kMaxRankedGroups groups (each thread reads every group's offsets) they keep their order.
constexpr int kMaxKDeviceSets = 4;  // a launch's sets of operands sharing the offsets (an FFN's w1 and w3: 2)
constexpr int kMaxRankedGroups = 1024;
struct KDeviceProblemArgs {
  CUtensorMap a_map[kMaxKDeviceSets], b_map[kMaxKDeviceSets];  // the whole of each A and B, K rows 0 .. rows
  const unsigned char* a[kMaxKDeviceSets];
  const unsigned char* b[kMaxKDeviceSets];
  float* c[kMaxKDeviceSets];
  int64_t lda, ldb;  // bytes between K rows
  int64_t c_stride;  // floats between a set's problems' outputs
  const int32_t* offsets;
  int64_t rows;
  int sets, groups;
  bool maps;  // false: the cp.async form runs, no maps made
  IndexError* err;
  KDeviceProblem* out;
};

__global__ void k_device_problems_kernel(const __grid_constant__ KDeviceProblemArgs q) {
  const int j = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= q.sets * q.groups) return;
  const int s = j / q.groups, g = j % q.groups;
  long long lo = q.offsets[g], hi = q.offsets[g + 1];
  clamp_group_rows(lo, hi, g, q.rows, q.err);
  int slot = j;
  if (q.groups <= kMaxRankedGroups) {
    int ahead = 0;  // groups before g in the order: more rows, or as many and a lower index
    for (int h = 0; h < q.groups; ++h) {
      long long lo_h = q.offsets[h], hi_h = q.offsets[h + 1];
      clamp_rows(lo_h, hi_h, q.rows);
      ahead += (hi_h - lo_h > hi - lo || (hi_h - lo_h == hi - lo && h < g)) ? 1 : 0;
    }
    slot = ahead * q.sets + s;
  }
  KDeviceProblem& d = q.out[slot];
  d.prob = KProblemArgs{q.a[s] + lo * q.lda, q.b[s] + lo * q.ldb, q.c[s] + g * q.c_stride, q.lda, q.ldb, int(hi - lo)};
  if (!q.maps || hi == lo) return;  // no copies read an empty problem's maps
  d.a_map = q.a_map[s];
  d.b_map = q.b_map[s];
  tensormap_set_address(&d.a_map, d.prob.a);
  tensormap_set_dim<1>(&d.a_map, uint32_t(hi - lo));
  tensormap_set_address(&d.b_map, d.prob.b);
  tensormap_set_dim<1>(&d.b_map, uint32_t(hi - lo));
  tensormap_release();
}

}  // namespace hopper
}  // namespace
}  // namespace fourbit::ops::cuda
