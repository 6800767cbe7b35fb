// defines: cuda::grouped_gemm_bf16, cuda::grouped_gemm_bf16_rows
// The grouped BF16 GEMM of the MoE experts with device-side group offsets (issue 15's first
// kernel): C[rows of group g] (+)= A[rows of group g] . B[g]^T for every g in one launch, with the
// offsets read on the GPU, so no router count comes back to the host before the expert GEMMs.
//
// Shape of the work. The grid has one CTA per (128-row tile of a group, 128-column tile of N);
// the host cannot know the groups' sizes, so it launches ceil(M / 128) + G row tiles (the most a
// grouping of M rows into G groups can need) and each CTA finds its group by walking the offsets;
// the CTAs left over return at once. A CTA is 8 warps (2 x 4), each computing a 64 x 32 block
// with mma.sync m16n8k16 (BF16 in, FP32 accumulate), fed by a 4-stage cp.async pipeline of
// 128 x 32 tiles in XOR-swizzled shared memory read with ldmatrix.
//
// Batch invariance by construction: an output element is the FP32 sum of its K products taken in
// one fixed order (32-wide K tiles in order, each a fixed sequence of two k16 MMAs), with no
// split-K and nothing that depends on M, on the other rows of its tile or on the grouping. A row's
// bits therefore depend only on its own A row and its group's B (tests/ops/cuda_grouped_bf16_test).
//
// Bad offsets (outside [0, M] or decreasing) never make a CTA read or write outside its tensors:
// each group's rows are clamped into [0, M], and the first bad offset is recorded in the device
// index-error record, reported at the next check_index_errors (index_errors.cuh).
#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/mma.cuh"

namespace fourbit::ops::cuda {

namespace {

constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 4, kThreads = 256;
constexpr int kTileBytes = 128 * kBK * 2;          // one 128 x 32 BF16 tile
constexpr int kStageBytes = 2 * kTileBytes;        // A and B
constexpr int kSmemBytes = kStages * kStageBytes;  // 64 KiB

// Byte offset of 16-byte chunk `chunk` (0..3) of row `row` in a 128 x 32 BF16 tile (64 bytes a
// row). The XOR spreads the 8 rows an ldmatrix phase reads over 8 distinct 16-byte bank groups.
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return uint32_t(row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4));
}

constexpr int kMaxHostGroups = 128;

struct GroupedArgs {
  const __nv_bfloat16* a;  // [M, lda], columns k_begin .. k_end used
  const __nv_bfloat16* b;  // G slices of [N, ldb], b_stride elements apart
  const int32_t* offsets;  // [G + 1] on the device, or null: host_offsets below
  float* c;                // [M, ldc]
  int64_t lda, ldb, b_stride, ldc, m;
  int n, k_begin, k_end, groups;
  bool accumulate;
  IndexError* err;
  int32_t host_offsets[kMaxHostGroups + 1];  // offsets known on the host, passed by value
};

__global__ void __launch_bounds__(kThreads, 2) grouped_bf16_kernel(const __grid_constant__ GroupedArgs p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_group;
  __shared__ long long s_r0, s_r1;

  // ---- which group and rows this CTA computes (thread 0 walks the offsets) ----
  if (threadIdx.x == 0) {
    int tile = int(blockIdx.y), group = -1;
    long long r0 = 0, r1 = 0;
    for (int g = 0; g < p.groups && group < 0; ++g) {
      long long lo = p.offsets ? p.offsets[g] : p.host_offsets[g];
      long long hi = p.offsets ? p.offsets[g + 1] : p.host_offsets[g + 1];
      if (g == 0 && (lo < 0 || lo > p.m)) record_index_error(p.err, IndexSite::GroupedGemmOffsets, 0, lo, p.m + 1, 1);
      if (hi < 0 || hi > p.m) record_index_error(p.err, IndexSite::GroupedGemmOffsets, g + 1, hi, p.m + 1, 1);
      else if (hi < lo) record_index_error(p.err, IndexSite::GroupedGemmOffsetsDecreasing, g + 1, hi, lo, 1);
      lo = lo < 0 ? 0 : (lo > p.m ? p.m : lo);
      hi = hi < lo ? lo : (hi > p.m ? p.m : hi);
      const long long tiles = (hi - lo + kBM - 1) / kBM;
      if (tile < tiles) {
        group = g;
        r0 = lo + (long long)tile * kBM;
        r1 = hi;
      } else {
        tile -= int(tiles);
      }
    }
    s_group = group;
    s_r0 = r0;
    s_r1 = r1 < r0 + kBM ? r1 : r0 + kBM;
  }
  __syncthreads();
  if (s_group < 0) return;
  const long long r0 = s_r0, r1 = s_r1;
  const int n0 = int(blockIdx.x) * kBN;
  const __nv_bfloat16* bg = p.b + (long long)s_group * p.b_stride;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 2, wn = warp & 3;  // this warp's 64 x 32 block: rows wm*64, columns wn*32
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem));
  const int k_tiles = (p.k_end - p.k_begin + kBK - 1) / kBK;

  // One stage: the A tile (rows r0.., K columns k0..k0+31) and the B tile (columns n0.., same K),
  // 512 16-byte chunks each, 2 per thread; chunks outside the rows, N or K are zero-filled (a
  // zero adds nothing to a sum, so the padding cannot change any element's bits).
  auto load_stage = [&](int stage, int kt) {
    const uint32_t sa = sbase + uint32_t(stage * kStageBytes), sb = sa + kTileBytes;
    const int k0 = p.k_begin + kt * kBK;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = tid + i * kThreads, row = idx >> 2, chunk = idx & 3, k = k0 + chunk * 8;
      const bool k_ok = k < p.k_end;
      const long long ar = r0 + row;
      const bool a_ok = k_ok && ar < r1;
      cp_async16(sa + swizzle(row, chunk), a_ok ? p.a + ar * p.lda + k : p.a, a_ok ? 16 : 0);
      const int bn = n0 + row;
      const bool b_ok = k_ok && bn < p.n;
      cp_async16(sb + swizzle(row, chunk), b_ok ? bg + (long long)bn * p.ldb + k : p.b, b_ok ? 16 : 0);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed (for this thread's copies) ...
    __syncthreads();               // ... for every thread's, and every warp is done with kt - 1
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();

    const uint32_t sa = sbase + uint32_t((kt % kStages) * kStageBytes), sb = sa + kTileBytes;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {  // the two k16 steps of the tile, in order
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
        ldsm_x4<false>(af[mi], sa + swizzle(wm * 64 + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        uint32_t r[4];
        ldsm_x4<false>(r, sb + swizzle(wn * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        bf[nj * 2][0] = r[0];
        bf[nj * 2][1] = r[1];
        bf[nj * 2 + 1][0] = r[2];
        bf[nj * 2 + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: FP32 out (or added to C), rows of this group and columns < N only ----
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const long long row = r0 + wm * 64 + mi * 16 + (lane >> 2) + half * 8;
      if (row >= r1) continue;
      float* crow = p.c + row * p.ldc;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
        float v0 = acc[mi][ni][half * 2], v1 = acc[mi][ni][half * 2 + 1];
        if (col + 1 < p.n) {
          float* q = crow + col;
          if ((reinterpret_cast<uintptr_t>(q) & 7) == 0) {
            float2 o = p.accumulate ? *reinterpret_cast<float2*>(q) : make_float2(0.0f, 0.0f);
            o.x = p.accumulate ? o.x + v0 : v0;
            o.y = p.accumulate ? o.y + v1 : v1;
            *reinterpret_cast<float2*>(q) = o;
          } else {
            q[0] = p.accumulate ? q[0] + v0 : v0;
            q[1] = p.accumulate ? q[1] + v1 : v1;
          }
        } else if (col < p.n) {
          crow[col] = p.accumulate ? crow[col] + v0 : v0;
        }
      }
    }
  }
}

GroupedArgs make_args(const void* a, int64_t lda, const void* b, int64_t ldb, int64_t b_stride, float* c, int64_t ldc,
                      int64_t m, int64_t n, int64_t k_begin, int64_t k_end, int64_t groups, bool accumulate) {
  GroupedArgs p{};
  p.a = static_cast<const __nv_bfloat16*>(a);
  p.b = static_cast<const __nv_bfloat16*>(b);
  p.c = c;
  p.lda = lda;
  p.ldb = ldb;
  p.b_stride = b_stride;
  p.ldc = ldc;
  p.m = m;
  p.n = int(n);
  p.k_begin = int(k_begin);
  p.k_end = int(k_end);
  p.groups = int(groups);
  p.accumulate = accumulate;
  return p;
}

void launch(GroupedArgs& p, const char* op) {
  static const bool attr = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(grouped_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)attr;
  p.err = index_error_record();
  const int64_t row_tiles = (p.m + kBM - 1) / kBM + p.groups;
  if (row_tiles > 65535) fail("{}: {} row tiles exceed the grid's 65535 (M = {}, G = {})", op, row_tiles, p.m, p.groups);
  const dim3 grid(unsigned((p.n + kBN - 1) / kBN), unsigned(row_tiles));
  grouped_bf16_kernel<<<grid, kThreads, kSmemBytes, stream()>>>(p);
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace

bool grouped_gemm_bf16_rows(const void* a, int64_t lda, const void* b, int64_t ldb, int64_t b_stride,
                            const std::vector<int64_t>& offsets, int64_t n, int64_t k, float* c, int64_t ldc,
                            bool accumulate) {
  const int64_t G = int64_t(offsets.size()) - 1, M = offsets.empty() ? 0 : offsets.back();
  const auto aligned16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  if (G < 1 || G > kMaxHostGroups || k % 8 != 0 || lda % 8 != 0 || ldb % 8 != 0 || b_stride % 8 != 0 ||
      !aligned16(a) || !aligned16(b) || M > INT32_MAX || n > INT32_MAX || k > INT32_MAX || offsets.front() != 0)
    return false;
  if (M == 0 || n == 0) return true;
  GroupedArgs p = make_args(a, lda, b, ldb, b_stride, c, ldc, M, n, 0, k, G, accumulate);
  for (int64_t g = 0; g <= G; ++g) p.host_offsets[g] = int32_t(offsets[size_t(g)]);
  launch(p, "grouped_gemm");
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
  GroupedArgs p = make_args(a.raw(), K, b.raw(), K, N * K, static_cast<float*>(c.raw()), N, M, N, k_begin, k_end, G,
                            accumulate);
  p.offsets = static_cast<const int32_t*>(offsets.raw());
  launch(p, op);
}

void check_recorded_index_errors() { check_index_errors(); }

}  // namespace fourbit::ops::cuda
