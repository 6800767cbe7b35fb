// defines: cuda::grouped_gemm_rows, cuda::grouped_gemm_bf16, cuda::grouped_gemm_k,
//          cuda::grouped_gemm_k_device_offsets, the family's
//          launchers and selection rules (decode_width, few_training_tiles) and its switches
// The grouped GEMM of the MoE experts (issue 15's kernel family): C[rows of group g] (+)=
// A[rows of group g] . B[g]^T for every g in one launch, on BF16 operands or on block-scaled ones
// (NVFP4, MXFP8 E4M3/E5M2) read packed as they are stored and dequantized inside the kernel, with
// NVFP4's outer scales applied in its epilogue. Offsets are read on the GPU (grouped_gemm_bf16)
// or passed by value (grouped_gemm_rows): no router count has to come back to the host.
//
// Shape of the work. The grid has one CTA per (BM-row tile of a group, BN-column tile of N); the
// host cannot know the groups' sizes, so it launches ceil(M / BM) + G row tiles (the most a
// grouping of M rows into G groups can need) and each CTA finds its group from the offsets
// (row_tile_of, a warp's prefix sum); the CTAs left over return at once. The TMA form is
// persistent over the same tiles instead (below). Two main loops, each with a tile for training shapes and one
// for groups of few rows (the sampler's decode):
//  - on Hopper (namespace hopper): wgmma from 128-byte-swizzled shared memory, for training
//    128 x 256 tiles of m64n256k16 (BF16 operands fed by TMA) or 256 x 128 of m64n128k16, for
//    decode 64 x 128 or 64 x 32 (m64n32k16), 64-wide K tiles;
//    for groups of a few rows the streaming kernel (hopper::streaming), whose warps decode their
//    weight rows in registers as mma.sync's A operand, the same 64-wide K tiles and k16 steps;
//  - elsewhere (and set_grouped_wgmma(false)): 8 warps of mma.sync m16n8k16 reading XOR-swizzled
//    shared memory with ldmatrix, 128 (64, 16) x 128 tiles, 32-wide K tiles.
// Both feed BF16 tiles by a 4-stage cp.async pipeline; packed tiles (codes as stored and the word
// of block scales holding the tile's) are copied as they are, then decoded one tile ahead into the
// swizzled BF16 layout with block_decode.cuh, the decode of gemm.cu's decode pass: the values and
// so the sums are those of decoding to BF16 first, without the BF16 copies in global memory and
// the separate epilogue pass.
//
// Batch invariance by construction: within a main loop an output element is the FP32 sum of its K
// products taken in one fixed order (K tiles in order, each a fixed sequence of k16 MMAs of one
// instruction shape), with no split-K and nothing that depends on M, the tile, the other rows of
// its tile or the grouping. A row's bits therefore depend only on its own A row and its group's B
// (tests/ops/cuda_grouped_bf16_test, cuda_grouped_fused_test). The two loops may differ from each
// other; a process runs one of them for the sampler and the trainer alike.
//
// Bad offsets (outside [0, M] or decreasing) never make a CTA read or write outside its tensors:
// each group's rows are clamped into [0, M], and the first bad offset is recorded in the device
// index-error record, reported at the next check_index_errors (index_errors.cuh).
//
// The kernels, one form a file, all in this one translation unit (the anonymous namespace keeps
// them internal): grouped_common.cuh (the arguments, tile loaders, group lookup and epilogue they
// share), grouped_portable.cuh (the mma.sync loop), grouped_hopper.cuh (the wgmma loop),
// grouped_stream.cuh (the streaming decode kernel), grouped_wgrad.cuh (the K-grouped weight
// gradients) and grouped_tma.cuh (the TMA forms of the training tile and of the weight gradients).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/grouped_common.cuh"
#include "fourbit/ops/cuda/grouped_portable.cuh"
#include "fourbit/ops/cuda/grouped_hopper.cuh"
#include "fourbit/ops/cuda/grouped_stream.cuh"
#include "fourbit/ops/cuda/grouped_wgrad.cuh"
#include "fourbit/ops/cuda/grouped_tma.cuh"

namespace fourbit::ops::cuda {
namespace {
namespace hopper {

template <Format F, int WGM, int WGN, bool BT, int ST = kStages, int WN = 128>
void launch_shape(const GroupedArgs& p) {
  using S = Shape<F, WGM, WGN, ST, WN>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(wgmma_kernel<F, WGM, WGN, BT, ST, WN>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    return true;
  }();
  (void)attr;
  const dim3 grid(unsigned((p.n + S::BN - 1) / S::BN), unsigned(row_tile_bound(p, S::BM)));
  wgmma_kernel<F, WGM, WGN, BT, ST, WN><<<grid, S::kThreads, S::kSmemBytes, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

std::atomic<int> g_decode_width{0};

// set_grouped_decode_width's value for the streaming kernel (each warp 16 weight rows wide).
constexpr int kStreamWidth = 16;

// The streaming kernel, its tokens in n8 blocks: one where groups average at most 4 rows, two up to
// 8, else four (a group of more rows than a CTA's takes several CTAs, each reading its weights
// again, mostly from L2). Any choice gives the same bits. A warp takes 16 weight rows, or 8 where
// the call has at most kStreamRows8 rows in all: there a warp's K loop is what the call waits for
// (one warp a sub-partition, issuing its whole decode), and 8 rows halve each warp's decode (NVFP4:
// 114 instructions a K tile instead of 177; 160 and 241 before the loop's addresses were held in
// registers, when the gain was measured) while twice the warps stream the matrix. Measured in
// the sampler's decode on an H100 (two calls, each A/B in adjacent processes): nvfp4-fwd +5–7%,
// bf16 +3–7% at batch 1 and 4 (8 rows in all); at 32 rows (batch 16) the isolated kernel's single
// runs went both ways (NVFP4 faster, MXFP8 slower), so larger calls keep 16.
// FOURBIT_STREAM_ROWS=16 keeps 16 rows a warp everywhere (an A/B switch, read once).
constexpr int64_t kStreamRows8 = 8;

template <Format F, int J, int R>
void launch_stream_j(const GroupedArgs& p) {
  using S = streaming::Shape<F, J, R>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(streaming::stream_kernel<F, J, R>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, S::smem_bytes(S::kMaxChunk)));
    return true;
  }();
  (void)attr;
  const int k_tiles = (p.k_end - p.k_begin + 63) / 64;
  const int chunk = std::max(1, std::min(k_tiles, S::kMaxChunk));
  const dim3 grid(unsigned((p.n + S::BN - 1) / S::BN), unsigned(row_tile_bound(p, S::BM)));
  launch_dependent(streaming::stream_kernel<F, J, R>, grid, streaming::kThreads, S::smem_bytes(chunk), p, chunk);
}
template <Format F>
void launch_stream(const GroupedArgs& p, int64_t rows_per_group) {
  static const bool rows16 = [] {
    const char* e = std::getenv("FOURBIT_STREAM_ROWS");
    return e && std::string(e) == "16";
  }();
  if (rows_per_group <= 4) {
    if (rows16 || p.m > kStreamRows8) launch_stream_j<F, 1, 16>(p);
    else launch_stream_j<F, 1, 8>(p);
  } else if (rows_per_group <= 8) {
    launch_stream_j<F, 2, 16>(p);
  } else {
    launch_stream_j<F, 4, 16>(p);
  }
}

// The decode configuration: the streaming kernel where groups average at most kStreamRows rows;
// above, the 64 x WN tiles of one warpgroup, 128 columns where that gives at least 7/8 of the SMs a
// CTA (the row tiles with rows times the column tiles), else 32, so that a decode step's few weight
// matrices are streamed by 4x the CTAs. (BF16 experts at batch 256, 16 groups of ~32 rows and 1024
// columns, make 128 CTAs of 64 x 128 for the H200's 132 SMs: the sampler's decode step ran 8%
// faster on them than on the 512 CTAs of 64 x 32.) Measured on the H200 (gpu_grouped_gemm's decode
// table, gpu-small's w1|w3): the streaming kernel takes 0.6 (BF16) and 0.4 (NVFP4) of the best
// tile's time at batch 1, 0.4 (NVFP4) at batch 16 and 64 (BF16 there: 1.0, 1.2), and 3x BF16's at
// 32 rows a group (batch 256), where a group's rows take several CTAs; in the sampler it gains at
// every batch up to 64. At batch 1 the 32-wide tile takes 0.74 (BF16) to 0.56 (NVFP4) of the 64 x
// 256 tile's time; where the 128-wide tile fills the GPU the narrower ones are 2x slower (each
// CTA's fixed cost and its K-long chain of barriers, not the weights' bytes, bound these tiles).
// Packed (block-scaled) operands take the streaming kernel up to 64 rows a group: it decodes each
// weight once per 32 rows where a tile decodes it per 64 x WN block on the warpgroup that issues
// the MMAs; at 32 rows a group (batch 256) NVFP4 took 0.75 of the best tile's time, and a linear
// layer's one group of 64 MXFP8 rows on the 64 x 32 tile made the sampler's decode step 18% slower
// than cuBLASLt on BF16 decodes. Row tiles with rows: counted from host offsets; with device
// offsets at most min(G, M).
constexpr int64_t kStreamRows = 16, kStreamRowsPacked = 64;

// The row tiles of bm rows that groups with rows need, from host offsets.
int64_t host_row_tiles(const GroupedArgs& p, int64_t bm) {
  int64_t tiles = 0;
  for (int g = 0; g < p.groups; ++g) tiles += (int64_t(p.host_offsets[g + 1]) - p.host_offsets[g] + bm - 1) / bm;
  return tiles;
}

int decode_width(const GroupedArgs& p, int64_t rows_per_group, bool packed) {
  const int forced = g_decode_width.load(std::memory_order_relaxed);
  if (forced != 0) return forced;
  if (rows_per_group <= (packed ? kStreamRowsPacked : kStreamRows)) return kStreamWidth;
  const int64_t tiles = p.offsets ? std::min<int64_t>(p.groups, p.m) : host_row_tiles(p, 64);
  return 8 * tiles * ((p.n + 127) / 128) >= 7 * device_sm_count() ? 128 : 32;
}

// Where the 256 x 128 tiles of groups of more than 64 rows would not give every SM one (host
// offsets: a linear layer's one group of a few hundred rows, the sampler's prefill, or 256 and
// 260 columns: gpu-small's K/V projections and LM head), the 64 x 128 tiles of one warpgroup, 4x
// as many: at 256 rows of one group the training tile's 8 CTAs made the sampler's decode step
// 14% slower than cuBLASLt. Up to 1024 rows (decode and prefill): in the training step (8192 rows,
// 256 columns) they took 22 us where cuBLASLt's 256 x 128 tile takes 10. With device offsets (the
// training step's experts) the rows are not known here: the training tile.
constexpr int64_t kNarrowMaxRows = 1024;
std::atomic<bool> g_narrow_tiles{true};
bool few_training_tiles(const GroupedArgs& p) {
  if (p.offsets || p.m > kNarrowMaxRows || !g_narrow_tiles.load(std::memory_order_relaxed)) return false;
  return host_row_tiles(p, 256) * ((p.n + 127) / 128) < device_sm_count();
}

// Training shapes: BF16 groups fed by TMA where `tma` (128 x 256 tiles, or 256 x 128:
// set_grouped_tma_tile), else 256 x 128 tiles fed by cp.async; where the groups average
// at most 64 rows (decode), the streaming kernel or 64 x WN tiles of one warpgroup (decode_width;
// the MN-major B form 128 wide), each CTA streaming a slice of the weights over the whole of K;
// or, forced (set_grouped_decode_width(-1)), the 64 x 256 tiles of two warpgroups. The same k16
// steps in K order in every case: the same bits, and for an MN-major B the bits of its K-major copy.
template <Format F, bool BT>
void launch_format(const GroupedArgs& p, int64_t rows_per_group, bool tma) {
  if (rows_per_group > 64 && few_training_tiles(p)) {
    hopper::launch_shape<F, 1, 1, BT, decode_stages(128), 128>(p);
    return;
  }
  if (rows_per_group > 64) {
    if (!(F == Format::BF16 && tma && launch_tma<BT>(p))) hopper::launch_shape<F, 4, 1, BT>(p);
    return;
  }
  const int w = decode_width(p, rows_per_group, F != Format::BF16);
  if (w == kStreamWidth && !BT && row_tile_bound(p, 8) <= 65535) launch_stream<F>(p, rows_per_group);
  else if (w < 0) hopper::launch_shape<F, 1, 2, BT>(p);
  else if (BT || w >= 128) hopper::launch_shape<F, 1, 1, BT, decode_stages(128), 128>(p);
  else hopper::launch_shape<F, 1, 1, false, decode_stages(32), 32>(p);
}

}  // namespace hopper

template <Format F, int BM>
void launch_shape(const GroupedArgs& p) {
  using T = Shape<F, BM>;
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(
        cudaFuncSetAttribute(grouped_kernel<F, BM>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
    return true;
  }();
  (void)attr;
  const dim3 grid(unsigned((p.n + kBN - 1) / kBN), unsigned(row_tile_bound(p, BM)));
  grouped_kernel<F, BM><<<grid, kThreads, T::kSmemBytes, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

// The row tile: 16 rows where the groups average at most 16 (decode), 64 up to 64, else 128.
// Any choice gives the same bits (Shape).
template <Format F>
void launch_format(const GroupedArgs& p, int64_t rows_per_group) {
  if (rows_per_group <= 16) launch_shape<F, 16>(p);
  else if (rows_per_group <= 64) launch_shape<F, 64>(p);
  else launch_shape<F, 128>(p);
}

std::atomic<bool> g_wgmma{true}, g_tma{true};

// Writes 1 where the code the device runs was compiled with sm_90a's features (wgmma), 0 where it
// was not (a plain sm_90 build, or the portable PTX JIT-compiled): the wgmma wrappers trap there.
__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

// Whether this device runs the wgmma loop: compute capability 9.x, and its code has sm_90a's
// features (probed once, one synchronisation). Not while a CUDA graph is being captured: the probe
// would be recorded rather than run and answer no for the whole process; the throw leaves the
// answer unmade, to be probed at the next call outside the capture.
bool hopper_device() {
  static const bool yes = [] {
    if (graph_capturing())
      fail("the GPU's wgmma probe was first needed inside a CUDA graph capture: run the work once before capturing it");
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major != 9) {
      cudaGetLastError();
      return false;
    }
    int* flag = nullptr;
    int host = 0;
    bool ok = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (ok) {
      wgmma_probe_kernel<<<1, 1, 0, stream()>>>(flag);
      ok = cudaGetLastError() == cudaSuccess &&
           cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream()) == cudaSuccess &&
           cudaStreamSynchronize(stream()) == cudaSuccess;
      cudaFree(flag);
    }
    cudaGetLastError();
    return ok && host == 1;
  }();
  return yes;
}

// An MN-major B (BF16 only, accepted on Hopper only: grouped_gemm_rows) runs the wgmma loop's BT form.
template <Format F>
void launch_any(const GroupedArgs& p, int64_t rows_per_group) {
  const bool tma = g_tma.load(std::memory_order_relaxed);
  if constexpr (F == Format::BF16) {
    if (p.b.trans) return hopper::launch_format<F, true>(p, rows_per_group, tma);
  }
  if (g_wgmma.load(std::memory_order_relaxed) && hopper_device()) hopper::launch_format<F, false>(p, rows_per_group, tma);
  else launch_format<F>(p, rows_per_group);
}

void launch(Format fmt, GroupedArgs& p, int64_t rows_per_group, const char* op) {
  p.err = index_error_record();
  const int64_t row_tiles = row_tile_bound(p, 16);
  if (row_tiles > 65535)
    fail("{}: {} row tiles exceed the grid's 65535 (M = {}, G = {})", op, row_tiles, p.m, p.groups);
  switch (fmt) {
    case Format::BF16: launch_any<Format::BF16>(p, rows_per_group); break;
    case Format::NVFP4: launch_any<Format::NVFP4>(p, rows_per_group); break;
    case Format::MXFP8_E4M3: launch_any<Format::MXFP8_E4M3>(p, rows_per_group); break;
    case Format::MXFP8_E5M2: launch_any<Format::MXFP8_E5M2>(p, rows_per_group); break;
    default: fail("{}: no grouped kernel for {}", op, format_name(fmt));
  }
}

OperandArgs operand_args(const GroupedOperand& o) {
  OperandArgs a{};
  a.data = static_cast<const unsigned char*>(o.data);
  a.scales = o.block_scales;
  a.outer = o.outer;
  a.ld = o.ld_bytes;
  a.slice_bytes = o.slice_bytes;
  a.scale_ld = o.scale_ld;
  a.scale_slice = o.scale_slice;
  a.outer_stride = o.outer_stride;
  a.outer_group_stride = o.outer_group_stride;
  a.trans = o.trans;
  return a;
}

GroupedArgs make_args(const GroupedOperand& a, const GroupedOperand& b, float* c, int64_t ldc, int64_t m, int64_t n,
                      int64_t k_begin, int64_t k_end, int64_t groups, bool accumulate) {
  GroupedArgs p{};
  p.a = operand_args(a);
  p.b = operand_args(b);
  p.c = c;
  p.ldc = ldc;
  p.m = m;
  p.n = int(n);
  p.k_begin = int(k_begin);
  p.k_end = int(k_end);
  p.groups = int(groups);
  p.accumulate = accumulate;
  return p;
}

}  // namespace

int64_t grouped_rows_per_group(const std::vector<int64_t>& offsets) {
  int64_t filled = 0;
  for (size_t g = 1; g < offsets.size(); ++g) filled += offsets[g] > offsets[g - 1];
  const int64_t M = offsets.empty() ? 0 : offsets.back() - offsets.front();
  return filled ? (M + filled - 1) / filled : 0;
}

int64_t device_rows_per_group(int64_t groups, int64_t m) { return groups > 0 ? (m + groups - 1) / groups : 0; }

namespace {
// Whether grouped_gemm_rows takes these operands and sizes (its comment in cuda_ops.h).
bool rows_form_fits(const GroupedOperand& a, const GroupedOperand& b, int64_t G, int64_t M, int64_t n, int64_t k) {
  const auto aligned = [](const void* q, uintptr_t to) { return (reinterpret_cast<uintptr_t>(q) % to) == 0; };
  const auto fits = [&](const GroupedOperand& o) {
    if (o.fmt != a.fmt || o.ld_bytes % 16 != 0 || o.slice_bytes % 16 != 0 || !aligned(o.data, 16)) return false;
    if (o.fmt == Format::BF16) return true;
    return o.scale_ld % 4 == 0 && o.scale_slice % 4 == 0 && aligned(o.block_scales, 4);
  };
  const bool formats = a.fmt == Format::BF16 || a.fmt == Format::NVFP4 || a.fmt == Format::MXFP8_E4M3 ||
                       a.fmt == Format::MXFP8_E5M2;
  if (G < 1 || G > kMaxHostGroups || !formats || !fits(a) || !fits(b) || k % (a.fmt == Format::BF16 ? 8 : 32) != 0 ||
      M > INT32_MAX || n > INT32_MAX || k > INT32_MAX || a.trans)
    return false;
  // An MN-major B: BF16 on the wgmma loop only, whole 16-byte chunks of N
  return !(b.trans && (b.fmt != Format::BF16 || n % 8 != 0 || b.ld_bytes < 2 * n ||
                       !g_wgmma.load(std::memory_order_relaxed) || !hopper_device()));
}
}  // namespace

bool grouped_gemm_rows(const GroupedOperand& a, const GroupedOperand& b, const std::vector<int64_t>& offsets,
                       int64_t n, int64_t k, float* c, int64_t ldc, bool accumulate) {
  const int64_t G = int64_t(offsets.size()) - 1, M = offsets.empty() ? 0 : offsets.back();
  if (!rows_form_fits(a, b, G, M, n, k) || offsets.front() != 0) return false;
  if (M == 0 || n == 0) return true;
  GroupedArgs p = make_args(a, b, c, ldc, M, n, 0, k, G, accumulate);
  for (int64_t g = 0; g <= G; ++g) p.host_offsets[g] = int32_t(offsets[size_t(g)]);
  launch(a.fmt, p, grouped_rows_per_group(offsets), "grouped_gemm");
  return true;
}

bool grouped_gemm_rows(const GroupedOperand& a, const GroupedOperand& b, const int32_t* device_offsets,
                       int64_t groups, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc, bool accumulate) {
  if (!device_offsets || !rows_form_fits(a, b, groups, m, n, k)) return false;
  if (m == 0 || n == 0) return true;
  GroupedArgs p = make_args(a, b, c, ldc, m, n, 0, k, groups, accumulate);
  p.offsets = device_offsets;
  launch(a.fmt, p, device_rows_per_group(groups, m), "grouped_gemm");
  return true;
}

bool grouped_gemm_k(bool mn_major, const std::vector<KGroupedProblem>& problems, int64_t m, int64_t n, int64_t ldc,
                    bool accumulate) {
  if (!g_wgmma.load(std::memory_order_relaxed) || !hopper_device()) return false;
  const auto aligned = [](const void* q, uintptr_t to) { return (reinterpret_cast<uintptr_t>(q) % to) == 0; };
  if (m < 1 || n < 1 || m > INT32_MAX || n > INT32_MAX || n % 2 != 0 || ldc % 2 != 0 || ldc < n) return false;
  if (mn_major && (m % 8 != 0 || n % 8 != 0)) return false;
  for (const KGroupedProblem& q : problems)
    if (q.k < 0 || q.k > INT32_MAX || !aligned(q.a, 16) || !aligned(q.b, 16) || !aligned(q.c, 8) || q.lda % 8 != 0 ||
        q.ldb % 8 != 0 || (!mn_major && q.k % 8 != 0))
      return false;
  // Heaviest first (most K), ties in the callers' order: the kernels deal tiles in rounds that
  // then fall in cost (hopper::wgrad_tile_at), and a launch's problems are alike in weight.
  std::vector<size_t> order(problems.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return problems[x].k > problems[y].k; });
  // the TMA form takes up to kMaxTmaKProblems a launch (its maps are kernel parameters)
  const bool tma = hopper::g_wgrad_tma.load(std::memory_order_relaxed);
  const size_t per_launch = size_t(tma ? hopper::kMaxTmaKProblems : kMaxKProblems);
  for (size_t first = 0; first < problems.size(); first += per_launch) {
    KGroupedArgs p{};
    p.m = int(m);
    p.n = int(n);
    p.ldc = ldc;
    p.accumulate = accumulate;
    p.count = int(std::min(problems.size() - first, per_launch));
    for (int j = 0; j < p.count; ++j) {
      const KGroupedProblem& q = problems[order[first + size_t(j)]];
      p.prob[j] = KProblemArgs{static_cast<const unsigned char*>(q.a), static_cast<const unsigned char*>(q.b), q.c,
                               2 * q.lda, 2 * q.ldb, int(q.k)};
    }
    if (mn_major) {
      if (!tma || !hopper::launch_tma_wgrad<true>(p)) hopper::launch_wgrad<true>(p);
    } else if (!tma || !hopper::launch_tma_wgrad<false>(p)) {
      hopper::launch_wgrad<false>(p);
    }
  }
  return true;
}

std::atomic<int64_t> g_wgrad_device_calls{0};

bool grouped_gemm_k_device_offsets(const std::vector<KDeviceSet>& sets, int64_t lda, int64_t ldb, int64_t rows,
                                   const int32_t* offsets, int64_t groups, int64_t m, int64_t n, bool accumulate) {
  if (!g_wgmma.load(std::memory_order_relaxed) || !hopper_device()) return false;
  const auto aligned = [](const void* q, uintptr_t to) { return (reinterpret_cast<uintptr_t>(q) % to) == 0; };
  const int64_t count = int64_t(sets.size()) * groups;
  if (m < 8 || n < 8 || m > INT32_MAX || n > INT32_MAX || m % 8 != 0 || n % 8 != 0 || lda < m || ldb < n ||
      lda % 8 != 0 || ldb % 8 != 0 || rows < 0 || rows > INT32_MAX || groups < 1 || count > 65535 ||
      sets.size() > size_t(hopper::kMaxKDeviceSets) || sets.empty() || !offsets)
    return false;
  for (const KDeviceSet& s : sets)
    if (!aligned(s.a, 16) || !aligned(s.b, 16) || !aligned(s.c, 8)) return false;
  Tensor problems = Tensor::empty({count * int64_t(sizeof(KDeviceProblem))}, DType::U8, Device::CUDA);
  hopper::KDeviceProblemArgs q{};
  q.sets = int(sets.size());
  q.lda = 2 * lda;
  q.ldb = 2 * ldb;
  q.c_stride = m * n;
  q.offsets = offsets;
  q.rows = rows;
  q.groups = int(groups);
  q.err = index_error_record();
  q.out = static_cast<KDeviceProblem*>(problems.raw());
  // the TMA form's maps (none for 0 rows: then the cp.async form stores every empty problem's zeros,
  // or nothing)
  q.maps = hopper::g_wgrad_tma.load(std::memory_order_relaxed);
  for (size_t s = 0; s < sets.size(); ++s) {
    q.a[s] = static_cast<const unsigned char*>(sets[s].a);
    q.b[s] = static_cast<const unsigned char*>(sets[s].b);
    q.c[s] = sets[s].c;
    q.maps = q.maps && hopper::bf16_map(q.a_map[s], sets[s].a, uint64_t(m), uint64_t(rows), uint64_t(q.lda), 64) &&
             hopper::bf16_map(q.b_map[s], sets[s].b, uint64_t(n), uint64_t(rows), uint64_t(q.ldb), 64);
  }
  hopper::k_device_problems_kernel<<<unsigned((count + 127) / 128), 128, 0, stream()>>>(q);
  FOURBIT_LAUNCH_CHECK();
  static thread_local KGroupedArgs p;  // ~3.5 KB: kept off the stack
  p = KGroupedArgs{};
  p.m = int(m);
  p.n = int(n);
  p.ldc = n;
  p.accumulate = accumulate;
  p.count = int(count);
  p.dev = q.out;
  if (!q.maps || !hopper::launch_tma_wgrad<true>(p)) hopper::launch_wgrad<true>(p);
  g_wgrad_device_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void grouped_gemm_bf16(const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& c, bool accumulate,
                       int64_t k_begin, int64_t k_end) {
  const char* op = "grouped_gemm_bf16";
  check_cuda_tensor(a, op, "a");
  check_cuda_tensor(b, op, "b");
  check_cuda_tensor(offsets, op, "offsets");
  check_cuda_tensor(c, op, "c");
  if (a.dtype() != DType::BF16 || a.dim() != 2) fail("{}: a must be a BF16 [M, K] tensor, got {}", op, a.str());
  if (b.dtype() != DType::BF16 || b.dim() != 3) fail("{}: b must be a BF16 [G, N, K] tensor, got {}", op, b.str());
  if (offsets.dtype() != DType::I32 || offsets.dim() != 1 || offsets.size(0) != b.size(0) + 1)
    fail("{}: offsets must be an I32 [G + 1] = [{}] tensor, got {}", op, b.size(0) + 1, offsets.str());
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(1);
  if (b.size(2) != K) fail("{}: b is {} but a has K = {}", op, b.str(), K);
  if (c.dtype() != DType::F32 || c.dim() != 2 || c.size(0) != M || c.size(1) != N)
    fail("{}: c must be an F32 [{}, {}] tensor, got {}", op, M, N, c.str());
  if (k_end < 0) k_end = K;
  if (K % 8 != 0) fail("{}: K = {} must be a multiple of 8 (16-byte rows of BF16)", op, K);
  if (k_begin < 0 || k_begin > k_end || k_end > K || k_begin % 8 != 0 || k_end % 8 != 0)
    fail("{}: K range [{}, {}) must lie in [0, {}] with multiples of 8 as bounds", op, k_begin, k_end, K);
  if (N > INT32_MAX || K > INT32_MAX || G > INT32_MAX / 2) fail("{}: N = {}, K = {} or G = {} too large", op, N, K, G);
  if (M == 0 || N == 0 || G == 0) return;
  if (M > INT32_MAX) fail("{}: M = {} rows exceed the I32 offsets' range", op, M);
  GroupedArgs p = make_args(GroupedOperand::bf16(a.raw(), K, 0), GroupedOperand::bf16(b.raw(), K, N * K),
                            static_cast<float*>(c.raw()), N, M, N, k_begin, k_end, G, accumulate);
  p.offsets = static_cast<const int32_t*>(offsets.raw());
  launch(Format::BF16, p, device_rows_per_group(G, M), op);
}

void set_grouped_wgmma(bool on) { g_wgmma.store(on, std::memory_order_relaxed); }

void set_grouped_tma(bool on) { g_tma.store(on, std::memory_order_relaxed); }

void set_grouped_decode_width(int width) {
  if (width != 0 && width != -1 && width != hopper::kStreamWidth && width != 32 && width != 128)
    fail("set_grouped_decode_width: {} is not 0 (chosen per call), -1 (the 64 x 256 tile), {} (the streaming "
         "kernel), 32 or 128", width, hopper::kStreamWidth);
  hopper::g_decode_width.store(width, std::memory_order_relaxed);
}

void set_grouped_narrow_tiles(bool on) { hopper::g_narrow_tiles.store(on, std::memory_order_relaxed); }

void set_grouped_tma_persistent(bool on) { hopper::g_tma_persistent.store(on, std::memory_order_relaxed); }

void set_grouped_wgrad_tma(bool on) { hopper::g_wgrad_tma.store(on, std::memory_order_relaxed); }

int64_t grouped_wgrad_tma_launches() { return hopper::g_wgrad_tma_launches.load(std::memory_order_relaxed); }
int64_t grouped_wgrad_device_calls() { return g_wgrad_device_calls.load(std::memory_order_relaxed); }

void set_grouped_tile_band(int pairs) { hopper::g_tile_band.store(std::max(0, pairs), std::memory_order_relaxed); }

int set_grouped_tma_tile(int n) {
  if (n != 128 && n != 256)
    fail("set_grouped_tma_tile: the TMA form's tile is 128 (256 x 128) or 256 (128 x 256) columns wide, got {}", n);
  return hopper::g_tma_tile_n.exchange(n, std::memory_order_relaxed);
}

int set_grouped_tma_pingpong(int max_k) {
  return hopper::g_tma_pingpong_max_k.exchange(std::max(0, max_k), std::memory_order_relaxed);
}

bool set_grouped_tma_pingpong_mn_major(bool on) {
  return hopper::g_tma_pingpong_mn_major.exchange(on, std::memory_order_relaxed);
}

bool set_grouped_wgrad_tma_pingpong(bool on) {
  return hopper::g_wgrad_tma_pingpong.exchange(on, std::memory_order_relaxed);
}

void set_grouped_tma_store_probe(bool no_store) { hopper::g_tma_no_store.store(no_store, std::memory_order_relaxed); }

int set_grouped_wgrad_tma_tile(int n) {
  if (n != 128 && n != 256)
    fail("set_grouped_wgrad_tma_tile: the K-grouped TMA form's tile is 128 (256 x 128) or 256 (128 x 256) columns "
         "wide, got {}", n);
  return hopper::g_wgrad_tma_tile_n.exchange(n, std::memory_order_relaxed);
}

int64_t grouped_tma_launches() { return hopper::g_tma_launches.load(std::memory_order_relaxed); }

bool wgmma_available() { return hopper_device(); }

void check_recorded_index_errors() { check_index_errors(true); }

}  // namespace fourbit::ops::cuda
