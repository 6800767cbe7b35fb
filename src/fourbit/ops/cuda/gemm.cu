// defines: cuda::gemm, cuda::gemm_batch, cuda::grouped_gemm, cuda::set_grouped_kernel, cuda::set_fused_dequant, cuda::decode_bf16, matmul_nt, cublas_handle, cublaslt_handle, cublas_workspace
// GEMMs on Hopper. Block-scaled operands (NVFP4, MXFP8, S2F6) are decoded exactly into BF16 —
// E2M1 x E4M3 has at most 6 significant bits and E4M3 x 2^E at most 4, so nothing rounds — and
// multiplied on the BF16 tensor cores with FP32 accumulation (cuBLASLt). NVFP4 outer scales are
// applied to the finished sums, A's per row then B's per column, as on the CPU (NUMERICS
// "GEMMs"). FP32 operands (the fp32 recipe, the router) use cuBLASLt's true FP32 path (no TF32),
// except the router's forward (N = E <= 32 columns) and weight gradient (M = E rows): skinny_gemm.cu.
//
// Where cuBLASLt reports native block-scaled support (Blackwell: VEC16_UE4M3, VEC32_UE8M0 scale
// modes) it would take the packed operands directly; that path cannot run on these H200s and is
// not built yet (docs/cuda.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "fourbit/numerics/bf16.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/s2f6.h"
#include "fourbit/ops/cuda/block_decode.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/matmul.cuh"
#include "fourbit/ops/quant_layout.h"
#include "fourbit/tensor/device_memory.h"

namespace fourbit::ops::cuda {

// ---- handles -----------------------------------------------------------------------------------

cublasHandle_t cublas_handle() {
  static cublasHandle_t h = [] {
    cublasHandle_t x;
    FOURBIT_CUBLAS_CHECK(cublasCreate(&x));
    return x;
  }();
  return h;
}

cublasLtHandle_t cublaslt_handle() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t x;
    FOURBIT_CUBLAS_CHECK(cublasLtCreate(&x));
    return x;
  }();
  return h;
}

// One workspace for the default stream and one per lane, so concurrent GEMMs never share one.
void* cublas_workspace(size_t* bytes) {
  constexpr size_t kBytes = size_t(32) << 20;
  constexpr int kSlots = 9;  // default stream + device_memory's 8 lanes
  static void* ws[kSlots] = {};
  const int slot = current_lane() + 1;
  if (slot < 0 || slot >= kSlots) fail("cublas_workspace: lane {} out of range", slot - 1);
  if (!ws[slot]) {
    // A block allocated while a CUDA graph is being captured belongs to the graph's pool; the
    // workspaces outlive every graph, so one first needed there comes from the driver.
    if (graph_capturing()) FOURBIT_CUDA_CHECK(cudaMalloc(&ws[slot], kBytes));
    else ws[slot] = device_alloc(kBytes);
  }
  *bytes = kBytes;
  return ws[slot];
}

// ---- matmul_nt ---------------------------------------------------------------------------------

namespace {

struct AlgoKey {
  int64_t m;           // 0 (M-free) except for weight-gradient GEMMs (see pick_algo)
  int64_t n, k;        // our N and K (the M-free part of the problem)
  bool a_trans, b_trans;
  int64_t lda_kind, ldb_kind;  // leading dims that do not depend on M (0 when they do)
  int ab_type;
  bool batched;
  auto tie() const { return std::tie(m, n, k, a_trans, b_trans, lda_kind, ldb_kind, ab_type, batched); }
  bool operator<(const AlgoKey& o) const { return tie() < o.tie(); }
};

struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtDescs() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

// cuBLAS is column-major. Our row-major C[M, N] is its column-major C'[N, M] (ld = ldc), and
// C' = op(B') . op(A') where the row-major operands read column-major are:
//   A [M, K] row-major (not trans) -> A' is K x M, op N;  A trans [K, M] -> A' is M x K, op T
//   B [N, K] row-major (not trans) -> B' is K x N, op T;  B trans [K, N] -> B' is N x K, op N
void make_descs(LtDescs& d, const MatmulOperand& a, const MatmulOperand& b, int64_t ldc,
                int64_t c_stride, int64_t M, int64_t N, int64_t K, int batch, cudaDataType_t ab) {
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // FP32 accumulate; no TF32 for FP32 inputs
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, compute, CUDA_R_32F));
  // cuBLAS "A" is our B', cuBLAS "B" is our A'.
  const cublasOperation_t op_b = b.trans ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_a = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
  // stored (column-major) shapes before op
  const uint64_t b_rows = b.trans ? N : K, b_cols = b.trans ? K : N;
  const uint64_t a_rows = a.trans ? M : K, a_cols = a.trans ? K : M;
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, ab, b_rows, b_cols, b.ld));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, ab, a_rows, a_cols, a.ld));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32F, N, M, ldc));
  if (batch > 1) {
    const int32_t count = batch;
    for (auto [layout, stride] : {std::pair{d.b, b.batch_stride}, std::pair{d.a, a.batch_stride},
                                  std::pair{d.c, c_stride}}) {
      FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  }
}

std::mutex g_algo_mu;
std::map<AlgoKey, cublasLtMatmulAlgo_t> g_algos;

// Row GEMMs (fprop, dgrad, attention): the heuristic's first choice for the reference problem
// (M = 8192 rows, 64 batch entries), with split-K turned off, cached per M-free key so every M and
// batch count uses the same kernel and each output row is a function of its input row alone.
// Weight-gradient GEMMs (K = tokens: A transposed and not batched, C[M, N] = A[K, M]^T B, or the
// decoded Col-axis operands of a quantized recipe, C = dY^T X with both stored [rows, tokens])
// reduce over the batch, so batch invariance does not apply to them: they take the heuristic's choice
// for their actual M (a reference M would pick 128x256 tiles for a 16-row router gradient over
// 8192 tokens: 1.3 ms instead of tens of microseconds), split-K allowed: every cuBLASLt reduction
// scheme is sequenced (in place: counters order the partial sums), so results stay deterministic.
cublasLtMatmulAlgo_t pick_algo(const AlgoKey& key, const MatmulOperand& a, const MatmulOperand& b,
                               int64_t N, int64_t K, int batch, cudaDataType_t ab) {
  std::lock_guard<std::mutex> lock(g_algo_mu);
  auto it = g_algos.find(key);
  if (it != g_algos.end()) return it->second;
  const bool per_m = key.m != 0;
  const int64_t ref_m = per_m ? key.m : 8192;
  const int ref_batch = batch > 1 ? 64 : 1;
  MatmulOperand ra = a, rb = b;
  if (a.trans && !per_m) ra.ld = ref_m;  // a [K, M]: its ld grows with M
  LtDescs d;
  make_descs(d, ra, rb, N, N * ref_m, ref_m, N, K, ref_batch, ab);
  cublasLtMatmulPreference_t pref;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws_bytes = 0;
  cublas_workspace(&ws_bytes);
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res[8];
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), d.op, d.b, d.a, d.c, d.c, pref, 8, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0)
    fail("cuBLASLt found no algorithm for a GEMM with N={}, K={} ({})", N, K, cublasGetStatusString(st));
  cublasLtMatmulAlgo_t algo = res[0].algo;
  if (per_m) {
    g_algos.emplace(key, algo);
    return algo;
  }
  const int32_t one = 1;
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one));
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction, sizeof(no_reduction));
  g_algos.emplace(key, algo);
  return algo;
}

// Everything a matmul_nt call needs besides its pointers, built once per full problem shape:
// creating four descriptors and checking the algorithm cost more host time than a small expert
// GEMM takes on the GPU.
struct Plan {
  LtDescs d;
  cublasLtMatmulAlgo_t algo{};
  bool use_algo = true;
};

struct PlanKey {
  int64_t m, n, k, lda, ldb, ldc, a_stride, b_stride, c_stride;
  bool a_trans, b_trans, wgrad;
  int batch, ab_type;
  auto tie() const {
    return std::tie(m, n, k, lda, ldb, ldc, a_stride, b_stride, c_stride, a_trans, b_trans, wgrad, batch, ab_type);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

std::mutex g_plan_mu;
std::map<PlanKey, std::unique_ptr<Plan>> g_plans;

const Plan& plan_for(const MatmulOperand& a, const MatmulOperand& b, int64_t ldc, int64_t c_stride, int64_t M,
                     int64_t N, int64_t K, int batch, cudaDataType_t ab, bool reduce_over_batch) {
  const bool wgrad = (a.trans || reduce_over_batch) && batch == 1;
  const PlanKey pk{M,       N,       K,     a.ld,  b.ld,     ldc, a.batch_stride, b.batch_stride, c_stride,
                   a.trans, b.trans, wgrad, batch, int(ab)};
  {
    std::lock_guard<std::mutex> lock(g_plan_mu);
    auto it = g_plans.find(pk);
    if (it != g_plans.end()) return *it->second;
  }
  const AlgoKey key{wgrad ? M : 0, N, K, a.trans, b.trans, (a.trans && !wgrad) ? 0 : a.ld, b.ld, int(ab), batch > 1};
  auto plan = std::make_unique<Plan>();
  plan->algo = pick_algo(key, a, b, N, K, batch, ab);
  make_descs(plan->d, a, b, ldc, c_stride, M, N, K, batch, ab);
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(cublaslt_handle(), plan->d.op, plan->d.b, plan->d.a, plan->d.c, plan->d.c,
                              &plan->algo, &check) != CUBLAS_STATUS_SUCCESS) {
    // The fixed kernel cannot take this shape (alignment of an unusual M): let the heuristic
    // choose for it. Rows of such a GEMM are then not guaranteed batch invariant.
    plan->use_algo = false;
  }
  std::lock_guard<std::mutex> lock(g_plan_mu);
  return *g_plans.emplace(pk, std::move(plan)).first->second;
}

}  // namespace

void matmul_nt(const MatmulOperand& a, const MatmulOperand& b, void* c, int64_t ldc,
               int64_t c_stride, int64_t M, int64_t N, int64_t K, int batch, cudaDataType_t ab,
               float alpha, float beta, bool reduce_over_batch) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty reduction: C = beta * C
    if (beta == 0) {
      for (int i = 0; i < batch; ++i)
        FOURBIT_CUDA_CHECK(cudaMemset2DAsync(static_cast<float*>(c) + i * c_stride, size_t(ldc) * 4, 0,
                                             size_t(N) * 4, size_t(M), stream()));
    }
    return;
  }
  const Plan& plan = plan_for(a, b, ldc, c_stride, M, N, K, batch, ab, reduce_over_batch);
  size_t ws_bytes = 0;
  void* ws = cublas_workspace(&ws_bytes);
  FOURBIT_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan.d.op, &alpha, b.ptr, plan.d.b, a.ptr, plan.d.a,
                                      &beta, c, plan.d.c, c, plan.d.c, plan.use_algo ? &plan.algo : nullptr, ws,
                                      ws_bytes, stream()));
}

// ---- decode of block-scaled operands -----------------------------------------------------------

namespace {

// One thread per block of the operand: writes its B values through the format registry's block
// decoder (numerics/formats.h; NVFP4 without the outer scale: E2M1 x E4M3) as T, and zeros up to
// k_eff.
template <typename T>
__global__ void decode_blocks_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                     int64_t rows, int64_t blocks_per_row, int64_t code_row_bytes,
                                     int block, int fmt, int64_t k_eff, T* __restrict__ out) {
  const int64_t total = rows * blocks_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / blocks_per_row, b = i % blocks_per_row;
    const uint8_t s = scales[i];
    const uint8_t* rc = codes + r * code_row_bytes;
    T* o = out + r * k_eff + b * block;
    float v[32];
    switch (Format(fmt)) {
      case Format::NVFP4: num::nvfp4_decode_block(rc + b * block / 2, s, 1.0f, v); break;
      case Format::MXFP4: num::mxfp4_decode_block(rc + b * block / 2, s, 1.0f, v); break;
      case Format::S2F6: num::s2f6_decode_block(rc + b * block, s, 1.0f, v); break;
      case Format::MXFP8_E5M2: num::mxfp8_decode_block<5>(rc + b * block, s, 1.0f, v); break;
      default: num::mxfp8_decode_block<4>(rc + b * block, s, 1.0f, v); break;  // MXFP8_E4M3 (checked by the host)
    }
#pragma unroll
    for (int j = 0; j < 32; ++j)  // constant indices: v stays in registers
      if (j < block) o[j] = T(v[j]);
    if (b == blocks_per_row - 1)
      for (int64_t j = (b + 1) * block; j < k_eff; ++j) out[r * k_eff + j] = T(0);
  }
}

// The BF16 fast path for NVFP4 and MXFP8 operands (rows over blockIdx.y, 8-value units of a row
// over the threads): one thread per 8 consecutive values of a row
// (4 NVFP4 code bytes or 8 MXFP8 code bytes in one load, one 16-byte store of 8 BF16), so a warp
// writes 512 contiguous bytes per store, each value decoded by block_decode.cuh's decode8_bits —
// the same float product as decode_blocks_kernel's, so both kernels give the same bits.
// Columns from the last block's end up to k_eff are zeros.
// Values c .. c+7 of row r as 8 BF16 (c < coded: inside the stored blocks).
template <Format F>
__device__ __forceinline__ uint4 decode8(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                         int64_t blocks_per_row, int64_t code_row_bytes, int64_t r, int64_t c,
                                         const float2* e2m1_pair) {
  constexpr int B = F == Format::NVFP4 ? num::kNvfp4Block : num::kMxBlock;
  const float sv = decode8_scale<F>(scales[r * blocks_per_row + c / B]);
  uint2 w;
  if constexpr (F == Format::NVFP4)
    w = make_uint2(*reinterpret_cast<const uint32_t*>(codes + r * code_row_bytes + c / 2), 0u);
  else
    w = *reinterpret_cast<const uint2*>(codes + r * code_row_bytes + c);
  return decode8_bits<F>(w, sv, e2m1_pair);
}

// BF16 decodes of one or several operands in one launch (gemm_batch: a MoE layer's weight-gradient
// operands, a few hundred KB each, which one launch apiece would leave latency-bound): CTA c
// decodes kDecodeUnits 8-value units of the last job whose first CTA is at or before c.
constexpr int kDecodeJobsPerLaunch = 32;
constexpr int64_t kDecodeUnits = 1024;  // per CTA: four per thread
struct DecodeJob {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t rows, blocks_per_row, code_row_bytes, k_eff;
  __nv_bfloat16* out;
  int64_t cta0;
};
struct DecodeJobs {
  DecodeJob job[kDecodeJobsPerLaunch];
  int n;
};

template <Format F>
__global__ void __launch_bounds__(256) decode_bf16_x8_jobs_kernel(const __grid_constant__ DecodeJobs p) {
  constexpr int B = F == Format::NVFP4 ? num::kNvfp4Block : num::kMxBlock;
  __shared__ float2 e2m1_pair[256];
  fill_e2m1_pairs<F>(e2m1_pair);
  int ji = 0;
  while (ji + 1 < p.n && p.job[ji + 1].cta0 <= int64_t(blockIdx.x)) ++ji;  // uniform over the CTA
  const DecodeJob& j = p.job[ji];
  const int64_t units_per_row = j.k_eff / 8, coded = j.blocks_per_row * B, total = j.rows * units_per_row;
  const int64_t first = (int64_t(blockIdx.x) - j.cta0) * kDecodeUnits;
  for (int64_t u = first + threadIdx.x; u < min(first + kDecodeUnits, total); u += blockDim.x) {
    const int64_t r = u / units_per_row, c = (u % units_per_row) * 8;
    *reinterpret_cast<uint4*>(j.out + r * j.k_eff + c) =
        c < coded ? decode8<F>(j.codes, j.scales, j.blocks_per_row, j.code_row_bytes, r, c, e2m1_pair)
                  : make_uint4(0, 0, 0, 0);
  }
}

// Launches the decodes of `jobs` (formats NVFP4, MXFP8 E4M3/E5M2, decodes_x8), kDecodeJobsPerLaunch
// a launch.
void launch_decodes_x8(Format fmt, std::vector<DecodeJob> jobs) {
  for (size_t first = 0; first < jobs.size(); first += kDecodeJobsPerLaunch) {
    DecodeJobs p{};
    int64_t ctas = 0;
    for (size_t i = first; i < jobs.size() && p.n < kDecodeJobsPerLaunch; ++i) {
      DecodeJob& j = p.job[p.n++] = jobs[i];
      j.cta0 = ctas;
      ctas += (j.rows * (j.k_eff / 8) + kDecodeUnits - 1) / kDecodeUnits;
    }
    if (ctas == 0) continue;
    if (ctas > INT_MAX) fail("cuda gemm: {} decode blocks is more than one launch takes", ctas);
    const unsigned grid = unsigned(ctas);
    switch (fmt) {
      case Format::NVFP4: decode_bf16_x8_jobs_kernel<Format::NVFP4><<<grid, 256, 0, stream()>>>(p); break;
      case Format::MXFP8_E4M3: decode_bf16_x8_jobs_kernel<Format::MXFP8_E4M3><<<grid, 256, 0, stream()>>>(p); break;
      case Format::MXFP8_E5M2: decode_bf16_x8_jobs_kernel<Format::MXFP8_E5M2><<<grid, 256, 0, stream()>>>(p); break;
      default: fail("cuda gemm: no 8-value decode for {}", format_name(fmt));
    }
    FOURBIT_LAUNCH_CHECK();
  }
}

template <typename T>
__global__ void convert_pad_kernel(const float* __restrict__ in, int64_t rows, int64_t cols, int64_t k_eff,
                                   T* __restrict__ out) {
  const int64_t total = rows * k_eff;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / k_eff, c = i % k_eff;
    out[i] = c < cols ? T(in[r * cols + c]) : T(0);
  }
}

__global__ void bf16_to_f32_pad_kernel(const __nv_bfloat16* __restrict__ in, int64_t rows, int64_t cols,
                                       int64_t k_eff, float* __restrict__ out) {
  const int64_t total = rows * k_eff;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / k_eff, c = i % k_eff;
    out[i] = c < cols ? __bfloat162float(in[r * cols + c]) : 0.0f;
  }
}

// An operand's NVFP4 outer scales as the epilogue reads them: row/column i of group g (slice g
// of a multi-slice B in grouped_gemm) uses ptr[g * group_stride + i * stride].
struct OuterScales {
  const float* ptr = nullptr;  // device, or null: no outer scales
  int stride = 0;              // 1: one per row; 0: one for the whole operand (or slice)
  int64_t group_stride = 0;    // per-row: rows per slice; per-slice: 1; per-tensor: 0
};

OuterScales outer_scales_of(const Operand& op) {
  const QTensor* q = op.q();
  if (!q || q->outer == OuterScale::None) return {};
  const bool per_row = q->outer == OuterScale::PerRow;
  return {q->outer_scales.data<float>(), per_row ? 1 : 0,
          per_row ? q->rows : q->outer == OuterScale::PerSlice ? 1 : 0};
}

// The epilogue reads one scale per slice only through grouped_gemm's groups: elsewhere a
// multi-slice QTensor with per-slice scales must arrive sliced.
void expect_unsliced_scales(const Operand& op) {
  if (op.q() && op.q()->slices != 1 && op.q()->outer == OuterScale::PerSlice)
    fail("gemm: a multi-slice QTensor with per-slice scales must be sliced first (qtensor_slice)");
}

// K of an operand as the GEMM runs it: block-scaled operands are zero-padded to whole blocks.
int64_t padded_k(const Operand& op) { return op.q() ? op.q()->padded_cols() : op.k(); }

// C = (accumulate ? C : 0) + fl(fl(tmp * sa[m]) * sb[n]) — the CPU's order.
// sa/sb: per-row scales (stride 1) or one scale for all rows (stride 0); null = none.
// Grouped GEMMs (grouped_gemm): row m belongs to group g (off[g] <= m < off[g+1]), whose B scales
// start at sb + g * sb_group_stride. Rows over blockIdx.y, columns over threads (four at a time
// when rows are float4-aligned).
constexpr int kMaxEpilogueGroups = 128;
struct EpilogueGroups {
  int count = 0;  // 0: one group
  int64_t sb_group_stride = 0;  // OuterScales::group_stride of B
  int64_t off[kMaxEpilogueGroups + 1] = {};
};

__device__ __forceinline__ float scale_one(float t, float a, const float* sb, int64_t n, int sb_stride,
                                           bool has_a) {
  float r = has_a ? num::mul_rn(t, a) : t;
  return sb ? num::mul_rn(r, sb[n * sb_stride]) : r;
}

// A row's scales: A's (1 without), and the start of B's for the row's group.
struct RowScales {
  float a;
  const float* sb;
};
__device__ __forceinline__ RowScales row_scales(const float* sa, int sa_stride, const float* sb_all,
                                                const EpilogueGroups& groups, int64_t m) {
  int g = 0;  // the last group starting at or before m (binary search over the offsets)
  for (int lo = 0, hi = groups.count; lo < hi;) {
    const int mid = (lo + hi + 1) / 2;
    if (groups.off[mid] <= m) g = lo = mid; else hi = mid - 1;
  }
  return {sa ? sa[m * sa_stride] : 1.0f, sb_all ? sb_all + g * groups.sb_group_stride : nullptr};
}

// kRows rows a thread at a time (rows m, m + gridDim.y, ...), all their loads issued before the
// first store: one float4 in flight a thread left the kernel at ~2/3 of a copy's bandwidth.
constexpr int kEpilogueRows = 4;

// At most 64 registers (4 CTAs an SM): 4 rows' loads of 1024 threads in flight per SM.
__global__ void __launch_bounds__(256, 4)
    scale_epilogue_kernel(const float* __restrict__ tmp, const float* __restrict__ sa, int sa_stride,
                          const float* __restrict__ sb_all, int sb_stride, const EpilogueGroups groups, int64_t M,
                          int64_t N, bool accumulate, bool vec4, float* __restrict__ c) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x, first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const bool has_a = sa != nullptr;
  const int64_t rstep = gridDim.y;
  if (vec4) {
    for (int64_t m0 = blockIdx.y; m0 < M; m0 += kEpilogueRows * rstep) {
      for (int64_t q = first; q < N / 4; q += step) {
        float4 v[kEpilogueRows], o[kEpilogueRows];
#pragma unroll
        for (int r = 0; r < kEpilogueRows; ++r) {
          const int64_t m = m0 + r * rstep;
          if (m >= M) break;
          v[r] = reinterpret_cast<const float4*>(tmp + m * N)[q];
          if (accumulate) o[r] = reinterpret_cast<const float4*>(c + m * N)[q];
        }
#pragma unroll
        for (int r = 0; r < kEpilogueRows; ++r) {
          const int64_t m = m0 + r * rstep;
          if (m >= M) break;
          const RowScales rs = row_scales(sa, sa_stride, sb_all, groups, m);
          float4 x = make_float4(scale_one(v[r].x, rs.a, rs.sb, 4 * q, sb_stride, has_a),
                                 scale_one(v[r].y, rs.a, rs.sb, 4 * q + 1, sb_stride, has_a),
                                 scale_one(v[r].z, rs.a, rs.sb, 4 * q + 2, sb_stride, has_a),
                                 scale_one(v[r].w, rs.a, rs.sb, 4 * q + 3, sb_stride, has_a));
          if (accumulate)
            x = make_float4(num::add_rn(o[r].x, x.x), num::add_rn(o[r].y, x.y), num::add_rn(o[r].z, x.z),
                            num::add_rn(o[r].w, x.w));
          reinterpret_cast<float4*>(c + m * N)[q] = x;
        }
      }
    }
  } else {
    for (int64_t m = blockIdx.y; m < M; m += rstep) {
      const RowScales rs = row_scales(sa, sa_stride, sb_all, groups, m);
      const float* t = tmp + m * N;
      float* cr = c + m * N;
      for (int64_t n = first; n < N; n += step) {
        const float r = scale_one(t[n], rs.a, rs.sb, n, sb_stride, has_a);
        cr[n] = accumulate ? num::add_rn(cr[n], r) : r;
      }
    }
  }
}

void launch_scale_epilogue(const Tensor& tmp, const OuterScales& sa, const OuterScales& sb, EpilogueGroups groups,
                           int64_t M, int64_t N, bool accumulate, Tensor& c) {
  groups.sb_group_stride = sb.group_stride;
  const bool vec4 = N % 4 == 0 && reinterpret_cast<uintptr_t>(c.raw()) % 16 == 0;
  const int64_t row_groups = vec4 ? (M + kEpilogueRows - 1) / kEpilogueRows : M;
  const dim3 grid(grid_for(vec4 ? N / 4 : N, 256, 8), unsigned(std::min<int64_t>(row_groups, 8192)));
  scale_epilogue_kernel<<<grid, 256, 0, stream()>>>(tmp.data<float>(), sa.ptr, sa.stride, sb.ptr, sb.stride, groups,
                                                    M, N, accumulate, vec4, c.data<float>());
  FOURBIT_LAUNCH_CHECK();
}

// Where a GEMM's FP32 sums go: C itself (beta 1 to accumulate), or, when an operand has outer
// scales, a temporary that launch_scale_epilogue then scales into C in the CPU's order.
struct SumTarget {
  Tensor tmp;
  float* out;
  float beta;
};
SumTarget sum_target(bool scaled, int64_t M, int64_t N, Tensor& c, bool accumulate) {
  SumTarget t;
  if (scaled) t.tmp = Tensor::empty({M, N}, DType::F32, Device::CUDA);
  t.out = scaled ? t.tmp.data<float>() : c.data<float>();
  t.beta = !scaled && accumulate ? 1.0f : 0.0f;
  return t;
}

struct Materialized {
  Tensor owned;            // temp buffer when decoded/converted
  MatmulOperand op;
};

// Whether decode8 can decode q padded to k_eff into BF16: NVFP4 or MXFP8, 8-value units, aligned
// codes (the output buffer must be 16-byte aligned too, which fresh allocations are).
bool decodes_x8(const QTensor& q, int64_t k_eff) {
  const bool fmt = q.fmt == Format::NVFP4 || q.fmt == Format::MXFP8_E4M3 || q.fmt == Format::MXFP8_E5M2;
  return fmt && q.codes.defined() && k_eff % 8 == 0 && q.code_row_bytes() % 8 == 0 &&
         reinterpret_cast<uintptr_t>(q.codes.raw()) % 8 == 0;
}

// Whether q carries its BF16 decode (QTensor::bf16) at width k_eff.
bool has_bf16(const QTensor& q, int64_t k_eff) {
  const Tensor& t = q.bf16;
  return t.defined() && t.dtype() == DType::BF16 && t.device() == Device::CUDA && t.dim() == 2 &&
         t.size(0) == q.total_rows() && t.size(1) == k_eff && k_eff == q.padded_cols();
}

// A block-scaled operand that is its BF16 decode alone (ops::FormOut::Bf16) must be read at that
// decode's width: nothing else can decode it.
void expect_decode_width(const QTensor& q, int64_t k_eff, bool f32) {
  if (!q.codes.defined() && (f32 || !has_bf16(q, k_eff)))
    fail("gemm: a block-scaled operand without codes ({} rows, its BF16 decode {} wide) read {} at width {}",
         q.total_rows(), q.padded_cols(), f32 ? "in FP32" : "in BF16", k_eff);
}

// q decoded into out ([total rows, k_eff] BF16) by decode_bf16_x8_jobs_kernel.
DecodeJob decode_job(const QTensor& q, int64_t k_eff, Tensor& out) {
  return {q.codes.data<uint8_t>(), q.block_scales.data<uint8_t>(), q.total_rows(), q.blocks_per_row(),
          q.code_row_bytes(), k_eff, out.data<__nv_bfloat16>(), 0};
}

// op as a dense cuBLASLt operand: dense ones in place or converted/padded, block-scaled ones by the
// generic decode (FP32, or BF16 where decode8 does not apply: BatchDecoder::get takes the rest).
Materialized materialize(const Operand& op, int64_t k_eff, bool as_f32) {
  Materialized m;
  const int64_t R = op.rows();
  const unsigned grid = grid_for(R * k_eff, 256);
  if (const QTensor* q = op.q()) {
    m.owned = Tensor::empty({R, k_eff}, as_f32 ? DType::F32 : DType::BF16, Device::CUDA);
    const unsigned g = grid_for(R * q->blocks_per_row(), 256);
    if (as_f32)
      decode_blocks_kernel<float><<<g, 256, 0, stream()>>>(q->codes.data<uint8_t>(), q->block_scales.data<uint8_t>(), R,
                                              q->blocks_per_row(), q->code_row_bytes(), q->block(), int(q->fmt),
                                              k_eff, m.owned.data<float>());
    else
      decode_blocks_kernel<__nv_bfloat16><<<g, 256, 0, stream()>>>(q->codes.data<uint8_t>(), q->block_scales.data<uint8_t>(), R,
                                                      q->blocks_per_row(), q->code_row_bytes(), q->block(),
                                                      int(q->fmt), k_eff, m.owned.data<__nv_bfloat16>());
    FOURBIT_LAUNCH_CHECK();
    m.op = MatmulOperand{m.owned.raw(), false, k_eff, 0};
    return m;
  }
  const Tensor& t = *op.dense();
  if (t.dim() != 2) fail("gemm: dense operand must be 2-D, got {}", t.str());
  const int64_t K = op.k();
  const bool is_f32 = t.dtype() == DType::F32, is_bf16 = t.dtype() == DType::BF16;
  if (!is_f32 && !is_bf16) fail("gemm: dense GPU operand must be f32 or bf16, got {}", t.str());
  if (K == k_eff && (is_f32 == as_f32)) {  // use in place
    m.op = MatmulOperand{t.raw(), op.trans(), t.size(1), 0};
    return m;
  }
  if (op.trans()) fail("gemm: a transposed dense operand cannot be mixed with block-scaled or padded ones");
  m.owned = Tensor::empty({R, k_eff}, as_f32 ? DType::F32 : DType::BF16, Device::CUDA);
  if (is_f32 && !as_f32)
    convert_pad_kernel<__nv_bfloat16><<<grid, 256, 0, stream()>>>(t.data<float>(), R, K, k_eff, m.owned.data<__nv_bfloat16>());
  else if (is_f32)
    convert_pad_kernel<float><<<grid, 256, 0, stream()>>>(t.data<float>(), R, K, k_eff, m.owned.data<float>());
  else if (as_f32)
    bf16_to_f32_pad_kernel<<<grid, 256, 0, stream()>>>(t.data<__nv_bfloat16>(), R, K, k_eff, m.owned.data<float>());
  else
    fail("gemm: unexpected bf16 padding");
  FOURBIT_LAUNCH_CHECK();
  m.op = MatmulOperand{m.owned.raw(), false, k_eff, 0};
  return m;
}

bool is_dense_f32(const Operand& op) { return op.dense() && op.dense()->dtype() == DType::F32; }

// ---- native block-scaled GEMMs (Blackwell) --------------------------------------------------------
// Where the GPU has FP4/FP8 block-scaled tensor cores (compute capability 10+) and cuBLASLt offers
// an algorithm for the pair, NVFP4 x NVFP4 and MXFP8 x MXFP8 operands go to the GEMM packed: codes
// as they are, block scales copied into cuBLASLt's tiled layout (ops/quant_layout.h), outer
// scales applied afterwards as on the decode path. The products are exact either way and the sum
// is FP32, so only the accumulation order differs from the BF16 path.
// NOT RUN HERE: the H200s this project is tested on (sm_90) have no such tensor cores, so this
// path has never executed; it only compiles. Every condition below falls back to the decode path.

__global__ void swizzle_scales_kernel(const uint8_t* __restrict__ src, int64_t rows, int64_t blocks,
                                      int64_t rows_padded, int64_t col_tiles, uint8_t* __restrict__ dst) {
  const int64_t cols_padded = col_tiles * 4, total = rows_padded * cols_padded;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols_padded, c = i % cols_padded;
    dst[cublaslt_scale_offset(r, c, col_tiles)] = r < rows && c < blocks ? src[r * blocks + c] : uint8_t(0);
  }
}

Tensor swizzled_scales(const QTensor& q) {
  const int64_t rows = q.total_rows(), blocks = q.blocks_per_row();
  const int64_t rows_padded = (rows + 127) / 128 * 128, col_tiles = (blocks + 3) / 4;
  Tensor out = Tensor::empty({rows_padded * col_tiles * 4}, DType::U8, Device::CUDA);
  swizzle_scales_kernel<<<grid_for(out.numel(), 256), 256, 0, stream()>>>(
      q.block_scales.data<uint8_t>(), rows, blocks, rows_padded, col_tiles, out.data<uint8_t>());
  FOURBIT_LAUNCH_CHECK();
  return out;
}

struct NativeType {
  cudaDataType_t type;
  int32_t scale_mode;
};

bool native_type(const QTensor& q, NativeType* t) {
  switch (q.fmt) {
    case Format::NVFP4: *t = {CUDA_R_4F_E2M1, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3}; return true;
    case Format::MXFP8_E4M3: *t = {CUDA_R_8F_E4M3, CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0}; return true;
    case Format::MXFP8_E5M2: *t = {CUDA_R_8F_E5M2, CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0}; return true;
    default: return false;
  }
}

}  // namespace

Tensor decode_bf16(const QTensor& q) {
  const int64_t R = q.total_rows(), k = q.padded_cols();
  FOURBIT_CHECK(q.codes.defined(), "decode_bf16: a form without codes ({} rows)", R);
  Tensor out = Tensor::empty({R, k}, DType::BF16, Device::CUDA);
  if (R * k == 0) return out;
  if (decodes_x8(q, k)) {
    launch_decodes_x8(q.fmt, {decode_job(q, k, out)});
    return out;
  }
  decode_blocks_kernel<__nv_bfloat16><<<grid_for(R * q.blocks_per_row(), 256), 256, 0, stream()>>>(
      q.codes.data<uint8_t>(), q.block_scales.data<uint8_t>(), R, q.blocks_per_row(), q.code_row_bytes(), q.block(),
      int(q.fmt), k, out.data<__nv_bfloat16>());
  FOURBIT_LAUNCH_CHECK();
  return out;
}

bool native_block_scaled_gemm() {
  static const bool yes = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major >= 10;
  }();
  return yes;
}

namespace {

// One algorithm per M-free problem (as matmul_nt: chosen for a reference M, split-K off), or none.
struct NativeAlgo {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

void native_descs(LtDescs& d, const NativeType& ta, const NativeType& tb, int64_t M, int64_t N, int64_t K,
                  int64_t lda, int64_t ldb) {
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLAS "A" is our B (op T), cuBLAS "B" is our A (op N): the K-major "TN" form FP4/FP8 need.
  const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &tb.scale_mode, sizeof(int32_t)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &ta.scale_mode, sizeof(int32_t)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, tb.type, K, N, ldb));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, ta.type, K, M, lda));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32F, N, M, N));
}

bool run_native_block_scaled(const QTensor& qa, const QTensor& qb, void* out, int64_t M, int64_t N, float beta) {
  NativeType ta{}, tb{};
  if (!native_block_scaled_gemm() || !qa.codes.defined() || !qb.codes.defined() || !native_type(qa, &ta) || !native_type(qb, &tb)) return false;
  if ((ta.type == CUDA_R_4F_E2M1) != (tb.type == CUDA_R_4F_E2M1)) return false;  // no FP4 x FP8
  if (ta.type == CUDA_R_8F_E5M2 && tb.type == CUDA_R_8F_E5M2) return false;     // no E5M2 x E5M2
  const int64_t K = qa.padded_cols();
  if (qb.padded_cols() != K || K % 32 != 0) return false;
  for (const QTensor* q : {&qa, &qb})
    if (q->code_row_bytes() % 16 != 0 || reinterpret_cast<uintptr_t>(q->codes.raw()) % 16 != 0) return false;
  const int64_t lda = K, ldb = K;  // in elements: rows of packed codes are contiguous

  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int, int>, NativeAlgo> algos;
  NativeAlgo na;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple(N, K, int(ta.type), int(tb.type));
    auto it = algos.find(key);
    if (it == algos.end()) {
      LtDescs d;
      native_descs(d, ta, tb, 8192, N, K, lda, ldb);
      cublasLtMatmulPreference_t pref;
      FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws_bytes = 0;
      cublas_workspace(&ws_bytes);
      FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), d.op, d.b, d.a, d.c, d.c, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      NativeAlgo entry;
      if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
        entry.found = true;
        entry.algo = res.algo;
        const int32_t one = 1;
        cublasLtMatmulAlgoConfigSetAttribute(&entry.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one));
      }
      it = algos.emplace(key, entry).first;
    }
    na = it->second;
  }
  if (!na.found) return false;
  LtDescs d;
  native_descs(d, ta, tb, M, N, K, lda, ldb);
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(cublaslt_handle(), d.op, d.b, d.a, d.c, d.c, &na.algo, &check) != CUBLAS_STATUS_SUCCESS)
    return false;
  const Tensor sa = swizzled_scales(qa), sb = swizzled_scales(qb);
  const void* a_scale = sb.raw();  // cuBLAS A is our B
  const void* b_scale = sa.raw();
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  size_t ws_bytes = 0;
  void* ws = cublas_workspace(&ws_bytes);
  const float alpha = 1.0f;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), d.op, &alpha, qb.codes.raw(), d.b, qa.codes.raw(), d.a, &beta,
                                      out, d.c, out, d.c, &na.algo, ws, ws_bytes, stream()));
  return true;
}

// Streams for the independent GEMMs of gemm_batch and grouped_gemm: a MoE layer's per-expert GEMMs
// (~1000 rows each on gpu-small) fill a fraction of the H200's 132 SMs apiece, so four run at once.
constexpr int kGemmLanes = 4;

// FP32 when a dense FP32 operand is involved (fp32 recipe, router); BF16 tensor cores otherwise.
bool runs_f32(const Operand& a, const Operand& b) { return is_dense_f32(a) || is_dense_f32(b); }

// The BF16 decodes of a GEMM call's operands (gemm: A and B; gemm_batch: every job's): one per
// distinct (codes, rows, k_eff), launched together per format, so most GEMMs start after one
// decode launch rather than two.
class BatchDecoder {
 public:
  // The materialized operand (decoded now or later by run(); dense ones as materialize makes them).
  const Materialized& get(const Operand& op, int64_t k_eff, bool f32) {
    const QTensor* q = op.q();
    if (q) expect_decode_width(*q, k_eff, f32);
    if (!q || f32 || !(decodes_x8(*q, k_eff) || has_bf16(*q, k_eff)))
      return *store_.emplace_back(std::make_unique<Materialized>(materialize(op, k_eff, f32)));
    // an operand is its codes (or, without them, its decode)
    const auto key = std::make_tuple(q->codes.defined() ? q->codes.raw() : q->bf16.raw(), q->total_rows(), k_eff);
    if (const auto it = seen_.find(key); it != seen_.end()) return *it->second;
    auto m = std::make_unique<Materialized>();
    if (has_bf16(*q, k_eff)) {  // decoded by its quantizer: the bits this decode would write
      m->op = MatmulOperand{q->bf16.raw(), false, k_eff, 0};
      seen_[key] = m.get();
      return *store_.emplace_back(std::move(m));
    }
    m->owned = Tensor::empty({q->total_rows(), k_eff}, DType::BF16, Device::CUDA);
    m->op = MatmulOperand{m->owned.raw(), false, k_eff, 0};
    pending_[q->fmt].push_back(decode_job(*q, k_eff, m->owned));
    seen_[key] = m.get();
    return *store_.emplace_back(std::move(m));
  }

  void run() {
    for (auto& [fmt, jobs] : pending_) launch_decodes_x8(fmt, std::move(jobs));
    pending_.clear();
  }

 private:
  std::vector<std::unique_ptr<Materialized>> store_;
  std::map<std::tuple<const void*, int64_t, int64_t>, const Materialized*> seen_;
  std::map<Format, std::vector<DecodeJob>> pending_;
};

// C (+)= A . B^T with the operands materialized (or, when A and B are null, natively packed):
// the sums, then the outer-scale epilogue.
void run_gemm(const Operand& a, const Operand& b, const Materialized* A, const Materialized* B, Tensor& c,
              bool accumulate) {
  if (c.dtype() != DType::F32) fail("gemm: GPU output must be f32, got {}", c.str());
  const int64_t M = a.rows(), N = b.rows();
  expect_unsliced_scales(a);
  expect_unsliced_scales(b);
  const OuterScales sa = outer_scales_of(a), sb = outer_scales_of(b);
  const bool scaled = sa.ptr || sb.ptr;
  const SumTarget t = sum_target(scaled, M, N, c, accumulate);
  if (!(a.q() && b.q() && run_native_block_scaled(*a.q(), *b.q(), t.out, M, N, t.beta))) {
    const int64_t k_eff = std::max(padded_k(a), padded_k(b));
    const bool f32 = runs_f32(a, b);
    BatchDecoder dec;
    if (!A) A = &dec.get(a, k_eff, f32);
    if (!B) B = &dec.get(b, k_eff, f32);
    dec.run();
    // A Col-axis A (blocks along the tokens) is a weight gradient's dY^T: K runs over the batch.
    const bool reduce_over_batch = a.q() && a.q()->axis == BlockAxis::Col;
    // FP32 with at most 32 output columns (the router's forward) or rows over the tokens (its
    // weight gradient): skinny_gemm.cu's kernels
    if (!(f32 && (skinny_f32_gemm(A->op, B->op, t.out, N, M, N, k_eff, t.beta != 0.0f) ||
                  skinny_f32_wgrad(A->op, B->op, t.out, N, M, N, k_eff, t.beta != 0.0f))))
      matmul_nt(A->op, B->op, t.out, N, 0, M, N, k_eff, 1, f32 ? CUDA_R_32F : CUDA_R_16BF, 1.0f, t.beta,
                reduce_over_batch);
  }
  if (scaled) launch_scale_epilogue(t.tmp, sa, sb, EpilogueGroups{}, M, N, accumulate, c);
}

}  // namespace

void gemm(const Operand& a, const Operand& b, Tensor& c, bool accumulate) {
  run_gemm(a, b, nullptr, nullptr, c, accumulate);
}

namespace {
std::atomic<bool> g_grouped_kernel{true}, g_fused_dequant{true}, g_grouped_transposed_b{true};

// gemm_batch_grouped's one launch: every job a BF16 GEMM without outer scales into a whole F32
// [m, n] output of one shape, its operands (as materialized) all read along K or all transposed.
bool run_k_grouped(const std::vector<GemmJob>& jobs,
                   const std::vector<std::pair<const Materialized*, const Materialized*>>& ops) {
  if (!g_grouped_kernel.load(std::memory_order_relaxed)) return false;
  const Tensor& c0 = *jobs[0].c;
  if (c0.dim() != 2) return false;
  const int64_t m = c0.size(0), n = c0.size(1);
  const bool mn = ops[0].first->op.trans;
  std::vector<KGroupedProblem> problems;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const GemmJob& j = jobs[i];
    const MatmulOperand &A = ops[i].first->op, &B = ops[i].second->op;
    if (runs_f32(j.a, j.b) || outer_scales_of(j.a).ptr || outer_scales_of(j.b).ptr || j.c->dtype() != DType::F32 ||
        j.c->dim() != 2 || j.c->size(0) != m || j.c->size(1) != n || A.trans != mn || B.trans != mn ||
        j.accumulate != jobs[0].accumulate)
      return false;
    problems.push_back(KGroupedProblem{A.ptr, B.ptr, j.c->data<float>(), A.ld, B.ld,
                                       std::max(padded_k(j.a), padded_k(j.b))});
  }
  return grouped_gemm_k(mn, problems, m, n, n, jobs[0].accumulate);
}
}  // namespace

bool gemm_batch(const std::vector<GemmJob>& jobs, bool grouped) {
  if (native_block_scaled_gemm()) return false;
  BatchDecoder dec;
  std::vector<std::pair<const Materialized*, const Materialized*>> ops;
  for (const GemmJob& j : jobs) {
    const int64_t k_eff = std::max(padded_k(j.a), padded_k(j.b));
    const bool f32 = runs_f32(j.a, j.b);
    const Materialized& A = dec.get(j.a, k_eff, f32);
    ops.emplace_back(&A, &dec.get(j.b, k_eff, f32));
  }
  dec.run();
  if (grouped && run_k_grouped(jobs, ops)) return true;
  Lanes lanes(Device::CUDA, kGemmLanes);
  for (size_t i = 0; i < jobs.size(); ++i) {
    lanes.use(int64_t(i));
    run_gemm(jobs[i].a, jobs[i].b, ops[i].first, ops[i].second, *jobs[i].c, jobs[i].accumulate);
  }
  return true;
}

namespace {
// o with the outer scales s, applied in the grouped kernel's epilogue.
GroupedOperand with_outer(GroupedOperand o, const OuterScales& s) {
  o.outer = s.ptr;
  o.outer_stride = s.stride;
  o.outer_group_stride = s.group_stride;
  return o;
}
}  // namespace

GroupedOperand packed_operand(const QTensor& q) {
  GroupedOperand o;
  o.fmt = q.fmt;
  o.data = q.codes.raw();
  o.ld_bytes = q.code_row_bytes();
  o.slice_bytes = q.rows * q.code_row_bytes();
  o.block_scales = q.block_scales.data<uint8_t>();
  o.scale_ld = q.blocks_per_row();
  o.scale_slice = q.rows * q.blocks_per_row();
  return with_outer(o, outer_scales_of(Operand(q)));
}

void set_grouped_kernel(bool on) { g_grouped_kernel.store(on, std::memory_order_relaxed); }

void set_grouped_transposed_b(bool on) { g_grouped_transposed_b.store(on, std::memory_order_relaxed); }
void set_fused_dequant(bool on) { g_fused_dequant.store(on, std::memory_order_relaxed); }

bool grouped_gemm_reads_device_offsets(int64_t groups, int64_t k) {
  // where grouped_gemm runs dense BF16 groups through the grouped kernel (grouped_gemm_rows' limits)
  return g_grouped_kernel.load(std::memory_order_relaxed) && !native_block_scaled_gemm() && groups >= 1 &&
         groups <= kMaxEpilogueGroups && k % 8 == 0;
}

namespace {
// A grouped GEMM's row offsets (G + 1 values from 0 to M): on the host, or (host null) an I32 array
// on the GPU that the grouped kernel reads.
struct RowOffsets {
  const std::vector<int64_t>* host = nullptr;
  const int32_t* device = nullptr;
  int64_t groups = 0, rows = 0;
  int64_t rows_per_group() const {
    return host ? grouped_rows_per_group(*host) : device_rows_per_group(groups, rows);
  }
};
bool grouped_rows(const GroupedOperand& a, const GroupedOperand& b, const RowOffsets& off, int64_t n, int64_t k,
                  float* c, bool accumulate) {
  return off.host ? grouped_gemm_rows(a, b, *off.host, n, k, c, n, accumulate)
                  : grouped_gemm_rows(a, b, off.device, off.groups, off.rows, n, k, c, n, accumulate);
}

// grouped_gemm's grouped-kernel paths: the packed operands in small groups, else the BF16 operands
// (dense, or block-scaled ones decoded once) in one launch. false where the kernel does not take
// them; with host offsets grouped_gemm then runs cuBLASLt group by group.
bool grouped_kernel_gemm(const Operand& a, const Operand& b, const RowOffsets& off, int64_t N, int64_t K, Tensor& c,
                         bool accumulate) {
  const int64_t G = off.groups;
  if (G > kMaxEpilogueGroups || native_block_scaled_gemm() || !g_grouped_kernel.load(std::memory_order_relaxed))
    return false;
  expect_unsliced_scales(a);
  const QTensor* qb = b.q();
  // Block-scaled A and B of one format where the groups are small (the sampler's decode): read
  // packed by the grouped kernel, dequantized and scaled inside it, the bits of the decode path
  // below. Measured on the H200 (bench/gpu_grouped_gemm): 1.2-1.4x the decode path at decode sizes,
  // 0.6x at training sizes, where the in-kernel decode outweighs the BF16 copies it saves.
  if (a.q() && qb && a.q()->codes.defined() && qb->codes.defined() && off.rows_per_group() <= 64 &&
      g_fused_dequant.load(std::memory_order_relaxed) &&
      a.q()->padded_cols() == qb->padded_cols() && qb->rows == N &&
      grouped_rows(packed_operand(*a.q()), packed_operand(*qb), off, N, qb->padded_cols(), c.data<float>(),
                   accumulate))
    return true;
  const int64_t k_eff = std::max(padded_k(a), qb ? qb->padded_cols() : K);
  const bool f32 = is_dense_f32(a) || (!qb && b.dense()->dtype() == DType::F32);
  if (f32 || a.trans()) return false;
  // B as one operand of G stacked groups: slice g starts b_slice elements after slice 0.
  Tensor b2;
  BatchDecoder dec;  // A and B decoded in one launch where their formats agree
  MatmulOperand B;
  int64_t b_slice = 0;
  if (qb) {
    B = dec.get(Operand(*qb), k_eff, false).op;
    b_slice = N * B.ld;
  } else if (!b.trans()) {
    b2 = b.dense()->reshape({G * N, K});
    B = dec.get(Operand(b2), k_eff, false).op;
    b_slice = N * B.ld;
  } else {  // [G, K, N]: used in place, so it must not need padding
    if (K != k_eff || !g_grouped_transposed_b.load(std::memory_order_relaxed)) return false;
    B = MatmulOperand{b.dense()->raw(), true, N, 0};
    b_slice = K * N;
  }
  const MatmulOperand A = dec.get(a, k_eff, false).op;
  dec.run();
  // BF16 operands (dense, or block-scaled ones decoded exactly): every group in one launch of the
  // grouped kernel (grouped_mma.cu), whose rows are batch invariant by construction; the sampler's
  // decode and the trainer's forward both come here, so their expert GEMMs stay the same sums.
  // NVFP4 outer scales are applied in the kernel's epilogue (finish_value: the products, then
  // the accumulation, in the scale epilogue's order), so C is written once, with no temporary
  // and no epilogue pass. A transposed dense B ([G, K, N], the forward's weight of a dgrad) is
  // read MN-major in place where the kernel can (Hopper).
  GroupedOperand gb = with_outer(GroupedOperand::bf16(B.ptr, B.ld, b_slice), outer_scales_of(b));
  gb.trans = B.trans;
  return !A.trans && grouped_rows(with_outer(GroupedOperand::bf16(A.ptr, A.ld, 0), outer_scales_of(a)), gb, off, N,
                                  k_eff, c.data<float>(), accumulate);
}
}  // namespace

bool grouped_gemm_device_offsets(const Operand& a, const Operand& b, const Tensor& offsets, int64_t n, int64_t k,
                                 Tensor& c, bool accumulate) {
  const int64_t G = offsets.numel() - 1, M = a.rows();
  if (!grouped_gemm_reads_device_offsets(G, k)) return false;
  const Tensor *da = a.dense(), *db = b.dense();
  if (da && db && da->dtype() == DType::BF16 && db->dtype() == DType::BF16 && !b.trans() && db->dim() == 3) {
    const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    if (!aligned(da->raw()) || !aligned(db->raw())) return false;
    grouped_gemm_bf16(*da, *db, offsets, c, accumulate);
    return true;
  }
  return grouped_kernel_gemm(a, b, RowOffsets{nullptr, offsets.data<int32_t>(), G, M}, n, k, c, accumulate);
}

// Packed block-scaled operands in small groups straight into the grouped kernel; otherwise one
// decode of A and of every slice of B (one launch when they share a format), then every group in
// one launch of the grouped kernel, outer scales in its epilogue; where the kernel does not take
// the operands, one cuBLASLt call per non-empty group (spread over the GPU lanes) and one scale
// epilogue for all rows.
bool grouped_gemm(const Operand& a, const Operand& b, const std::vector<int64_t>& offsets, int64_t N, int64_t K,
                  Tensor& c, bool accumulate) {
  const int64_t G = int64_t(offsets.size()) - 1, M = a.rows();
  if (G > kMaxEpilogueGroups || native_block_scaled_gemm()) return false;  // the caller loops
  if (grouped_kernel_gemm(a, b, RowOffsets{&offsets, nullptr, G, M}, N, K, c, accumulate)) return true;
  // cuBLASLt group by group on the lanes (FP32 operands, a transposed dense B off Hopper, or the
  // grouped kernel switched off), the outer scales in one epilogue pass
  expect_unsliced_scales(a);
  const QTensor* qb = b.q();
  const int64_t k_eff = std::max(padded_k(a), qb ? qb->padded_cols() : K);
  const bool f32 = is_dense_f32(a) || (!qb && b.dense()->dtype() == DType::F32);
  Tensor b2;
  BatchDecoder dec;
  MatmulOperand B;
  int64_t b_slice = 0;
  if (qb) {
    B = dec.get(Operand(*qb), k_eff, f32).op;
    b_slice = N * B.ld;
  } else if (!b.trans()) {
    b2 = b.dense()->reshape({G * N, K});
    B = dec.get(Operand(b2), k_eff, f32).op;
    b_slice = N * B.ld;
  } else {  // [G, K, N]: used in place, so it must not need padding or a type conversion
    if (K != k_eff || (b.dense()->dtype() == DType::F32) != f32) return false;
    B = MatmulOperand{b.dense()->raw(), true, N, 0};
    b_slice = K * N;
  }
  const OuterScales sa = outer_scales_of(a), sb = outer_scales_of(b);
  const MatmulOperand A = dec.get(a, k_eff, f32).op;
  dec.run();
  const size_t elem = f32 ? 4 : 2;
  EpilogueGroups groups;
  groups.count = int(G);
  for (int64_t g = 0; g <= G; ++g) groups.off[g] = offsets[size_t(g)];
  const bool scaled = sa.ptr || sb.ptr;
  const SumTarget t = sum_target(scaled, M, N, c, accumulate);
  {  // the lanes join at the end of this block, before the epilogue reads their sums
    Lanes lanes(Device::CUDA, kGemmLanes);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r0 = offsets[size_t(g)], rows = offsets[size_t(g) + 1] - r0;
      if (rows == 0) continue;
      lanes.use(g);
      MatmulOperand ag = A, bg = B;
      ag.ptr = static_cast<const char*>(A.ptr) + size_t(r0 * A.ld) * elem;
      bg.ptr = static_cast<const char*>(B.ptr) + size_t(g * b_slice) * elem;
      matmul_nt(ag, bg, t.out + r0 * N, N, 0, rows, N, k_eff, 1, f32 ? CUDA_R_32F : CUDA_R_16BF, 1.0f, t.beta);
    }
  }
  if (scaled) launch_scale_epilogue(t.tmp, sa, sb, groups, M, N, accumulate, c);
  return true;
}

}  // namespace fourbit::ops::cuda
