// defines: cuda::gemm, matmul_nt, cublas_handle, cublaslt_handle, cublas_workspace
// GEMMs on Hopper. Block-scaled operands (NVFP4, MXFP8, S2F6) are decoded exactly into BF16 —
// E2M1 x E4M3 has at most 6 significant bits and E4M3 x 2^E at most 4, so nothing rounds — and
// multiplied on the BF16 tensor cores with FP32 accumulation (cuBLASLt). NVFP4 outer scales are
// applied to the finished sums, A's per row then B's per column, as on the CPU (NUMERICS
// "GEMMs"). FP32 operands (the fp32 recipe, the router) use cuBLASLt's true FP32 path (no TF32).
//
// Where cuBLASLt reports native block-scaled support (Blackwell: VEC16_UE4M3, VEC32_UE8M0 scale
// modes) it would take the packed operands directly; that path cannot run on these H200s and is
// not built yet (docs/cuda.md).
#include <cuda_bf16.h>

#include <map>
#include <mutex>
#include <tuple>

#include "fourbit/numerics/bf16.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/s2f6.h"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/matmul.cuh"
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

void* cublas_workspace(size_t* bytes) {
  constexpr size_t kBytes = size_t(64) << 20;
  static void* ws = device_alloc(kBytes);
  *bytes = kBytes;
  return ws;
}

// ---- matmul_nt ---------------------------------------------------------------------------------

namespace {

struct AlgoKey {
  int64_t n, k;        // our N and K (the M-free part of the problem)
  bool a_trans, b_trans;
  int64_t lda_kind, ldb_kind;  // leading dims that do not depend on M (0 when they do)
  int ab_type;
  bool batched;
  auto tie() const { return std::tie(n, k, a_trans, b_trans, lda_kind, ldb_kind, ab_type, batched); }
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

// The heuristic's first choice for the reference problem (M = 8192 rows, 64 batch entries), with
// split-K turned off. Cached per M-free key so every M and batch count uses the same kernel.
cublasLtMatmulAlgo_t pick_algo(const AlgoKey& key, const MatmulOperand& a, const MatmulOperand& b,
                               int64_t N, int64_t K, int batch, cudaDataType_t ab) {
  std::lock_guard<std::mutex> lock(g_algo_mu);
  auto it = g_algos.find(key);
  if (it != g_algos.end()) return it->second;
  constexpr int64_t kRefM = 8192;
  const int ref_batch = batch > 1 ? 64 : 1;
  MatmulOperand ra = a, rb = b;
  if (a.trans) ra.ld = kRefM;  // a [K, M]: its ld grows with M
  LtDescs d;
  make_descs(d, ra, rb, N, N * kRefM, kRefM, N, K, ref_batch, ab);
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
  const int32_t one = 1;
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one));
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction, sizeof(no_reduction));
  g_algos.emplace(key, algo);
  return algo;
}

}  // namespace

void matmul_nt(const MatmulOperand& a, const MatmulOperand& b, void* c, int64_t ldc,
               int64_t c_stride, int64_t M, int64_t N, int64_t K, int batch, cudaDataType_t ab,
               float alpha, float beta) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty reduction: C = beta * C
    if (beta == 0) {
      for (int i = 0; i < batch; ++i)
        FOURBIT_CUDA_CHECK(cudaMemset2DAsync(static_cast<float*>(c) + i * c_stride, size_t(ldc) * 4, 0,
                                             size_t(N) * 4, size_t(M), 0));
    }
    return;
  }
  const AlgoKey key{N, K, a.trans, b.trans, a.trans ? 0 : a.ld, b.ld, int(ab), batch > 1};
  cublasLtMatmulAlgo_t algo = pick_algo(key, a, b, N, K, batch, ab);
  LtDescs d;
  make_descs(d, a, b, ldc, c_stride, M, N, K, batch, ab);
  size_t ws_bytes = 0;
  void* ws = cublas_workspace(&ws_bytes);
  cublasLtMatmulHeuristicResult_t check{};
  const cublasLtMatmulAlgo_t* use = &algo;
  if (cublasLtMatmulAlgoCheck(cublaslt_handle(), d.op, d.b, d.a, d.c, d.c, &algo, &check) !=
      CUBLAS_STATUS_SUCCESS) {
    // The fixed kernel cannot take this shape (alignment of an unusual M): let the heuristic
    // choose for it. Rows of such a GEMM are then not guaranteed batch invariant.
    use = nullptr;
  }
  FOURBIT_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), d.op, &alpha, b.ptr, d.b, a.ptr, d.a, &beta, c,
                                      d.c, c, d.c, use, ws, ws_bytes, 0));
}

// ---- decode of block-scaled operands -----------------------------------------------------------

namespace {

// One thread per block of the operand: writes its B values (E2M1 x E4M3 for NVFP4, without the
// outer scale; elem x 2^E for MXFP8; q x 2^(E-127-6) for S2F6) as T, and zeros up to k_eff.
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
    if (fmt == int(Format::NVFP4)) {
      const float sv = num::ue4m3_decode(s);
      for (int j = 0; j < block; j += 2) {
        const uint8_t byte = rc[(b * block + j) / 2];
        o[j] = T(num::e2m1_decode(byte & 0xF) * sv);
        o[j + 1] = T(num::e2m1_decode(byte >> 4) * sv);
      }
    } else if (fmt == int(Format::S2F6)) {
      for (int j = 0; j < block; ++j) o[j] = T(num::s2f6_decode_scaled(int8_t(rc[b * block + j]), s));
    } else {
      const num::MiniFloatSpec elem = fmt == int(Format::MXFP8_E5M2) ? num::e5m2_spec() : num::e4m3_spec();
      for (int j = 0; j < block; ++j) o[j] = T(num::mxfp8_decode(rc[b * block + j], s, elem));
    }
    if (b == blocks_per_row - 1)
      for (int64_t j = (b + 1) * block; j < k_eff; ++j) out[r * k_eff + j] = T(0);
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

// C = (accumulate ? C : 0) + fl(fl(tmp * sa[m]) * sb[n]) — the CPU's order.
// sa/sb: per-row scales (stride 1) or one scale for all rows (stride 0); null = none.
__global__ void scale_epilogue_kernel(const float* __restrict__ tmp, const float* __restrict__ sa,
                                      int sa_stride, const float* __restrict__ sb, int sb_stride,
                                      int64_t M, int64_t N, bool accumulate, float* __restrict__ c) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / N, n = i % N;
    float r = tmp[i];
    if (sa) r = num::mul_rn(r, sa[m * sa_stride]);
    if (sb) r = num::mul_rn(r, sb[n * sb_stride]);
    c[i] = accumulate ? num::add_rn(c[i], r) : r;
  }
}

struct Materialized {
  Tensor owned;            // temp buffer when decoded/converted
  MatmulOperand op;
  const float* scale = nullptr;  // NVFP4 outer scales (device), or null
  int scale_stride = 0;          // 1: one per row; 0: one for the whole operand
};

Materialized materialize(const Operand& op, int64_t k_eff, bool as_f32) {
  Materialized m;
  const int64_t R = op.rows();
  const unsigned grid = grid_for(R * k_eff, 256);
  if (const QTensor* q = op.q()) {
    if (q->slices != 1 && q->outer == OuterScale::PerSlice)
      fail("gemm: a multi-slice QTensor with per-slice scales must be sliced first (qtensor_slice)");
    m.owned = Tensor::empty({R, k_eff}, as_f32 ? DType::F32 : DType::BF16, Device::CUDA);
    const unsigned g = grid_for(R * q->blocks_per_row(), 256);
    if (as_f32)
      decode_blocks_kernel<float><<<g, 256>>>(q->codes.data<uint8_t>(), q->block_scales.data<uint8_t>(), R,
                                              q->blocks_per_row(), q->code_row_bytes(), q->block(), int(q->fmt),
                                              k_eff, m.owned.data<float>());
    else
      decode_blocks_kernel<__nv_bfloat16><<<g, 256>>>(q->codes.data<uint8_t>(), q->block_scales.data<uint8_t>(), R,
                                                      q->blocks_per_row(), q->code_row_bytes(), q->block(),
                                                      int(q->fmt), k_eff, m.owned.data<__nv_bfloat16>());
    FOURBIT_LAUNCH_CHECK();
    m.op = MatmulOperand{m.owned.raw(), false, k_eff, 0};
    if (q->outer != OuterScale::None) {  // per-slice with one slice is one scale, like per-tensor
      m.scale = q->outer_scales.data<float>();
      m.scale_stride = q->outer == OuterScale::PerRow ? 1 : 0;
    }
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
    convert_pad_kernel<__nv_bfloat16><<<grid, 256>>>(t.data<float>(), R, K, k_eff, m.owned.data<__nv_bfloat16>());
  else if (is_f32)
    convert_pad_kernel<float><<<grid, 256>>>(t.data<float>(), R, K, k_eff, m.owned.data<float>());
  else if (as_f32)
    bf16_to_f32_pad_kernel<<<grid, 256>>>(t.data<__nv_bfloat16>(), R, K, k_eff, m.owned.data<float>());
  else
    fail("gemm: unexpected bf16 padding");
  FOURBIT_LAUNCH_CHECK();
  m.op = MatmulOperand{m.owned.raw(), false, k_eff, 0};
  return m;
}

bool is_dense_f32(const Operand& op) { return op.dense() && op.dense()->dtype() == DType::F32; }

}  // namespace

void gemm(const Operand& a, const Operand& b, Tensor& c, bool accumulate) {
  if (c.dtype() != DType::F32) fail("gemm: GPU output must be f32, got {}", c.str());
  auto padded = [](const Operand& op) { return op.q() ? op.q()->padded_cols() : op.k(); };
  const int64_t k_eff = std::max(padded(a), padded(b));
  // FP32 when a dense FP32 operand is involved (fp32 recipe, router); BF16 tensor cores otherwise.
  const bool f32 = is_dense_f32(a) || is_dense_f32(b);
  const Materialized A = materialize(a, k_eff, f32);
  const Materialized B = materialize(b, k_eff, f32);
  const int64_t M = a.rows(), N = b.rows();
  const cudaDataType_t type = f32 ? CUDA_R_32F : CUDA_R_16BF;
  if (!A.scale && !B.scale) {
    matmul_nt(A.op, B.op, c.raw(), N, 0, M, N, k_eff, 1, type, 1.0f, accumulate ? 1.0f : 0.0f);
    return;
  }
  Tensor tmp = Tensor::empty({M, N}, DType::F32, Device::CUDA);
  matmul_nt(A.op, B.op, tmp.raw(), N, 0, M, N, k_eff, 1, type, 1.0f, 0.0f);
  scale_epilogue_kernel<<<grid_for(M * N, 256), 256>>>(tmp.data<float>(), A.scale, A.scale_stride, B.scale,
                                                       B.scale_stride, M, N, accumulate, c.data<float>());
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace fourbit::ops::cuda
