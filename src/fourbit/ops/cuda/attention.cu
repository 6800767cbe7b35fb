// defines: cuda::attention_forward, cuda::attention_backward, cuda::materialized_attention_forward,
//          cuda::materialized_attention_backward
// Causal grouped-query attention on the GPU. ops::attention_* run the fused kernels of
// flash_attention.cu when they take the shape (hd 32, 64 or 128), else the materialized path here:
// three tensor-core GEMM stages with the scores in memory: S = Q K^T / sqrt(hd) (BF16 operands,
// FP32 scores) -> masked softmax, one block per query row with a fixed reduction tree (P in BF16,
// log-sum-exp in FP32) -> O = P V. Backward recomputes P from the saved log-sum-exp. Every GEMM
// goes through matmul_nt, whose kernel choice does not depend on the batch, and every reduction
// runs inside one row: a sequence's outputs are the same alone or in a batch. Query row t of a
// call with pos0 sees keys 0 .. pos0 + t, so a KV cache decode step (T = 1) computes what the full
// forward computed for that row up to the order of the key reduction within one softmax block.
//
// Cost: O(T*S) memory for the scores (512 MiB for 128 heads x 1024 x 1024), which the fused path
// avoids; this path stays for the head sizes the fused kernels do not take (docs/cuda.md).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/matmul.cuh"
#include "fourbit/ops/cuda/vec4.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kRowThreads = 256;
// The softmax forward: 64 threads a row. Its three passes over a row are short chains of loads
// and block reductions, so the rows in flight set its speed: an SM holds at most 32 CTAs, which is
// 32 rows at 64 threads and 8 at 256 (the version with 256 took 447 us for 128 x 1024 x 1024
// scores on an H200, ~3.5x its memory time).
constexpr int kSoftmaxThreads = 64;

// The layout kernels move U consecutive values of the head dimension per thread (U = 8 or 4 when
// hd and the pointers allow 16-byte accesses, else 1), with the index arithmetic once per unit.
template <int U>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[U]) {
  if constexpr (U % 4 == 0) {
#pragma unroll
    for (int i = 0; i < U; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      v[i] = f.x;
      v[i + 1] = f.y;
      v[i + 2] = f.z;
      v[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < U; ++i) v[i] = p[i];
  }
}
template <int U>
__device__ __forceinline__ void store_f32(float* p, const float (&v)[U]) {
  if constexpr (U % 4 == 0) {
#pragma unroll
    for (int i = 0; i < U; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < U; ++i) p[i] = v[i];
  }
}

// U BF16 values as floats (exact), 16 bytes at a time where U = 8.
template <int U>
__device__ __forceinline__ void load_f32(const __nv_bfloat16* p, float (&v)[U]) {
  if constexpr (U == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* pk = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pk[j]);
      v[2 * j] = f.x;
      v[2 * j + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < U; ++i) v[i] = __bfloat162float(p[i]);
  }
}

// x [B, T, Hx, hd] F32 or BF16 -> out [B, Hq, T, hd] BF16, head h reading x's head h / group.
template <int U, typename In>
__global__ void to_heads_kernel(const In* __restrict__ x, int64_t B, int64_t T, int64_t Hx, int64_t Hq,
                                int64_t hd, __nv_bfloat16* __restrict__ out) {
  const int64_t units = hd / U, total = B * Hq * T * units, group = Hq / Hx;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = (i % units) * U, t = (i / units) % T, h = (i / (units * T)) % Hq, b = i / (units * T * Hq);
    float v[U];
    load_f32<U>(x + ((b * T + t) * Hx + h / group) * hd + d, v);
    __nv_bfloat16* o = out + i * U;
    if constexpr (U == 8) {
      uint4 packed;
      __nv_bfloat162* pk = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) pk[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
      *reinterpret_cast<uint4*>(o) = packed;
    } else {
#pragma unroll
      for (int j = 0; j < U; ++j) o[j] = __float2bfloat16_rn(v[j]);
    }
  }
}

// y [B, Hq, T, hd] F32 -> out [B, T, Hq, hd] F32.
template <int U>
__global__ void from_heads_kernel(const float* __restrict__ y, int64_t B, int64_t T, int64_t Hq, int64_t hd,
                                  float* __restrict__ out) {
  const int64_t units = hd / U, total = B * Hq * T * units;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = (i % units) * U, h = (i / units) % Hq, t = (i / (units * Hq)) % T, b = i / (units * Hq * T);
    float v[U];
    load_f32<U>(y + ((b * Hq + h) * T + t) * hd + d, v);
    store_f32<U>(out + i * U, v);
  }
}

// dkv_h [B, Hq, S, hd] -> dkv [B, S, Hkv, hd]: the heads of a group summed in head order.
template <int U>
__global__ void reduce_groups_kernel(const float* __restrict__ per_head, int64_t B, int64_t S, int64_t Hq,
                                     int64_t Hkv, int64_t hd, float* __restrict__ out) {
  const int64_t units = hd / U, total = B * S * Hkv * units, group = Hq / Hkv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = (i % units) * U, kh = (i / units) % Hkv, s = (i / (units * Hkv)) % S, b = i / (units * Hkv * S);
    float acc[U];
#pragma unroll
    for (int j = 0; j < U; ++j) acc[j] = 0.0f;
    for (int64_t g = 0; g < group; ++g) {
      float v[U];
      load_f32<U>(per_head + ((b * Hq + kh * group + g) * S + s) * hd + d, v);
#pragma unroll
      for (int j = 0; j < U; ++j) acc[j] += v[j];
    }
    store_f32<U>(out + i * U, acc);
  }
}

// u (8 or 4) when hd is a multiple of it and every pointer is 16-byte aligned, else 1.
int unit_for(int64_t hd, std::initializer_list<const void*> ptrs, int u) {
  bool ok = hd % u == 0;
  for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return ok ? u : 1;
}

void launch_from_heads(const Tensor& y, int64_t B, int64_t T, int64_t Hq, int64_t hd, Tensor& out) {
  const int u = unit_for(hd, {y.raw(), out.raw()}, 4);
  const unsigned grid = grid_for(y.numel() / u, 256);
  if (u == 4) from_heads_kernel<4><<<grid, 256, 0, stream()>>>(y.data<float>(), B, T, Hq, hd, out.data<float>());
  else from_heads_kernel<1><<<grid, 256, 0, stream()>>>(y.data<float>(), B, T, Hq, hd, out.data<float>());
  FOURBIT_LAUNCH_CHECK();
}

void launch_reduce_groups(const Tensor& per_head, int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t hd,
                          Tensor& out) {
  const int u = unit_for(hd, {per_head.raw(), out.raw()}, 4);
  const unsigned grid = grid_for(out.numel() / u, 256);
  if (u == 4) reduce_groups_kernel<4><<<grid, 256, 0, stream()>>>(per_head.data<float>(), B, S, Hq, Hkv, hd, out.data<float>());
  else reduce_groups_kernel<1><<<grid, 256, 0, stream()>>>(per_head.data<float>(), B, S, Hq, Hkv, hd, out.data<float>());
  FOURBIT_LAUNCH_CHECK();
}

__device__ float block_reduce(float v, float* shared, bool is_max) {
  // fixed tree: warp shuffles, then warp 0 over the per-warp results
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x >> 5) ? shared[lane] : (is_max ? -INFINITY : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
      const float w = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, w) : v + w;
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float r = shared[0];
  __syncthreads();
  return r;
}

// One block per score row (b*Hq + h, t): P = softmax over keys 0 .. pos0+t (masked keys 0). The
// row is read three times (max, sum, write), from L1/L2 after the first: holding it in registers
// instead (8 values a thread) was slower on an H200 (510 vs 447 us a call at 128 x 1024 x 1024):
// twice the registers halve the CTAs in flight, and this kernel waits on memory.
__global__ void softmax_rows_kernel(const float* __restrict__ scores, int64_t T, int64_t S, int64_t pos0,
                                    __nv_bfloat16* __restrict__ p, float* __restrict__ lse) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x, t = row % T;
  const int64_t valid = min(S, pos0 + t + 1);
  const float* s = scores + row * S;
  float m = -INFINITY;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, s[j]);
  m = block_reduce(m, shared, true);
  float l = 0.0f;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) l += expf(s[j] - m);
  l = block_reduce(l, shared, false);
  const float inv = 1.0f / l;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x)
    p[row * S + j] = __float2bfloat16_rn(j < valid ? expf(s[j] - m) * inv : 0.0f);
  if (threadIdx.x == 0) lse[row] = m + logf(l);
}

// D[b, h, t] = sum_d dout . out (original [B, T, Hq, hd] layout), one warp per row; and dout
// rounded to BF16 (RNE) in that layout, the backward GEMMs' operand, from the same read.
__global__ void rowdot_kernel(const float* __restrict__ dout, const float* __restrict__ out, int64_t B,
                              int64_t T, int64_t Hq, int64_t hd, float* __restrict__ D,
                              __nv_bfloat16* __restrict__ dout_bf16) {
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int lane = threadIdx.x & 31;
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; w < B * Hq * T; w += warps) {
    const int64_t t = w % T, h = (w / T) % Hq, b = w / (T * Hq);
    const int64_t base = ((b * T + t) * Hq + h) * hd;
    float acc = 0.0f;
    for (int64_t d = lane; d < hd; d += 32) {
      const float g = dout[base + d];
      acc += g * out[base + d];
      dout_bf16[base + d] = __float2bfloat16_rn(g);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) D[w] = acc;
  }
}

// rowdot_kernel for hd = 4 L (L = 16 or 32: hd 64 or 128) with 16-byte aligned rows: each thread
// one float4 of a row (its four products added in order, FMAs), the row's L lanes then added by
// the butterfly; rows in memory order ([B, T, Hq]), so a warp reads 512 contiguous bytes of each
// input. One pass per element, no grid-stride loop: the one-warp-a-row kernel above spends its
// time on index arithmetic and two loads in flight a lane.
template <int L>
__global__ void __launch_bounds__(256)
    rowdot_vec_kernel(const float4* __restrict__ dout, const float4* __restrict__ out, int64_t rows, int64_t T,
                      int64_t Hq, float* __restrict__ D, uint16_t* __restrict__ dout_bf16) {
  static_assert(L == 16 || L == 32, "a row is a power-of-two group of lanes within one warp");
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, r = i / L;
  float acc = 0.0f;
  if (r < rows) {
    const float4 g = dout[i], o = out[i];
    acc = g.x * o.x;
    acc = fmaf(g.y, o.y, acc);
    acc = fmaf(g.z, o.z, acc);
    acc = fmaf(g.w, o.w, acc);
    const float gv[4] = {g.x, g.y, g.z, g.w};
    store4(dout_bf16, 4 * i, 4 * i + 4, true, gv);  // one 8-byte store (a fresh, aligned copy)
  }
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (r < rows && i % L == 0) {
    const int64_t h = r % Hq, t = (r / Hq) % T, b = r / (Hq * T);
    D[(b * Hq + h) * T + t] = acc;
  }
}

// From recomputed scores: P = exp(S - lse) (BF16, for dV) and dS = P (dP - D) * scale (BF16).
// One block per score row; U = 4 keys a thread (16-byte loads, 8-byte stores) when S allows;
// masked keys (j > t) write zeros without reading their scores.
template <int U>
__global__ void softmax_backward_kernel(const float* __restrict__ scores, const float* __restrict__ lse,
                                        const float* __restrict__ dp, const float* __restrict__ D, int64_t T,
                                        int64_t S, float scale, __nv_bfloat16* __restrict__ p,
                                        __nv_bfloat16* __restrict__ ds) {
  const int64_t row = blockIdx.x, t = row % T;
  const float l = lse[row], dr = D[row];
  for (int64_t j0 = int64_t(threadIdx.x) * U; j0 < S; j0 += int64_t(blockDim.x) * U) {
    const int64_t i = row * S + j0;
    float sv[U], dv[U], pv[U], dsv[U];
    if (j0 <= t) {
      load_f32<U>(scores + i, sv);
      load_f32<U>(dp + i, dv);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      pv[k] = 0.0f;
      dsv[k] = 0.0f;
      if (j0 + k <= t) {
        pv[k] = expf(sv[k] - l);
        dsv[k] = pv[k] * (dv[k] - dr) * scale;
      }
    }
    if constexpr (U == 4) {
      __nv_bfloat162 pp[2] = {__floats2bfloat162_rn(pv[0], pv[1]), __floats2bfloat162_rn(pv[2], pv[3])};
      __nv_bfloat162 dd[2] = {__floats2bfloat162_rn(dsv[0], dsv[1]), __floats2bfloat162_rn(dsv[2], dsv[3])};
      *reinterpret_cast<uint2*>(p + i) = *reinterpret_cast<const uint2*>(pp);
      *reinterpret_cast<uint2*>(ds + i) = *reinterpret_cast<const uint2*>(dd);
    } else {
#pragma unroll
      for (int k = 0; k < U; ++k) {
        p[i + k] = __float2bfloat16_rn(pv[k]);
        ds[i + k] = __float2bfloat16_rn(dsv[k]);
      }
    }
  }
}

struct Dims {
  int64_t B, T, S, Hq, Hkv, hd;
};

Dims check_dims(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  check_cuda_tensor(q, op, "q");
  check_cuda_tensor(k, op, "k");
  check_cuda_tensor(v, op, "v");
  const DType dt = q.dtype();
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || (dt != DType::F32 && dt != DType::BF16) || k.dtype() != dt ||
      v.dtype() != dt)
    fail("{}: q, k, v must all be f32, or all bf16, [B, T, H, hd], got {}, {}, {}", op, q.str(), k.str(), v.str());
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  if (k.shape() != v.shape() || k.size(0) != d.B || k.size(3) != d.hd || d.Hq % d.Hkv)
    fail("{}: k {} / v {} do not fit q {}", op, k.str(), v.str(), q.str());
  return d;
}

Tensor heads_bf16(const Tensor& x, const Dims& d, int64_t len, int64_t hx) {
  Tensor out = Tensor::empty({d.B, d.Hq, len, d.hd}, DType::BF16, Device::CUDA);
  const int u = unit_for(d.hd, {x.raw(), out.raw()}, 8);  // 8 BF16 = one 16-byte store
  const unsigned grid = grid_for(out.numel() / u, 256);
  auto launch = [&](auto in) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
    if (u == 8) to_heads_kernel<8, In><<<grid, 256, 0, stream()>>>(in, d.B, len, hx, d.Hq, d.hd, out.data<__nv_bfloat16>());
    else to_heads_kernel<1, In><<<grid, 256, 0, stream()>>>(in, d.B, len, hx, d.Hq, d.hd, out.data<__nv_bfloat16>());
  };
  if (x.dtype() == DType::BF16) launch(x.data<__nv_bfloat16>());
  else launch(x.data<float>());
  FOURBIT_LAUNCH_CHECK();
  return out;
}

// Batched S[bh] = scale * Q[bh] K[bh]^T, [T, S] per head.
Tensor scores(const Tensor& qh, const Tensor& kh, const Dims& d) {
  Tensor s = Tensor::empty({d.B * d.Hq, d.T, d.S}, DType::F32, Device::CUDA);
  matmul_nt(MatmulOperand{qh.raw(), false, d.hd, d.T * d.hd}, MatmulOperand{kh.raw(), false, d.hd, d.S * d.hd},
            s.raw(), d.S, d.T * d.S, d.T, d.S, d.hd, int(d.B * d.Hq), CUDA_R_16BF,
            float(1.0 / std::sqrt(double(d.hd))), 0.0f);
  return s;
}

// D = rowsum(dout * out) [B, Hq, T], the softmax backward's per-row term (both paths), and
// dout_bf16: dout rounded to BF16, which both paths' GEMMs read.
Tensor rowdot(const Tensor& dout, const Tensor& out, const Dims& d, Tensor& dout_bf16) {
  Tensor D = Tensor::empty({d.B * d.Hq * d.T}, DType::F32, Device::CUDA);
  dout_bf16 = Tensor::empty(dout.shape(), DType::BF16, Device::CUDA);
  const int64_t rows = d.B * d.T * d.Hq;
  const bool vec = (d.hd == 64 || d.hd == 128) && aligned16(dout.raw()) && aligned16(out.raw());
  if (vec && rows > 0) {
    const int64_t threads = rows * (d.hd / 4);
    const unsigned grid = unsigned((threads + 255) / 256);
    const float4* g = static_cast<const float4*>(dout.raw());
    const float4* o = static_cast<const float4*>(out.raw());
    uint16_t* gb = dout_bf16.data<uint16_t>();
    if (d.hd == 64) rowdot_vec_kernel<16><<<grid, 256, 0, stream()>>>(g, o, rows, d.T, d.Hq, D.data<float>(), gb);
    else rowdot_vec_kernel<32><<<grid, 256, 0, stream()>>>(g, o, rows, d.T, d.Hq, D.data<float>(), gb);
  } else {
    rowdot_kernel<<<grid_for(d.B * d.Hq * d.T * 32, 256), 256, 0, stream()>>>(
        dout.data<float>(), out.data<float>(), d.B, d.T, d.Hq, d.hd, D.data<float>(), dout_bf16.data<__nv_bfloat16>());
  }
  FOURBIT_LAUNCH_CHECK();
  return D;
}

// The materialized backward: scores, dP, P and dS in memory, five batched GEMMs; dq, and dK, dV
// per q head (dkh, dvh [B, Hq, S, hd]), as flash_attention_backward gives them.
void materialized_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                           const Tensor& D, Tensor& dq, Tensor& dkh, Tensor& dvh) {
  const Dims d = check_dims(q, k, v, "attention_backward");
  const int64_t BH = d.B * d.Hq;
  const float scale = float(1.0 / std::sqrt(double(d.hd)));
  const Tensor qh = heads_bf16(q, d, d.T, d.Hq), kh = heads_bf16(k, d, d.S, d.Hkv), vh = heads_bf16(v, d, d.S, d.Hkv);
  const Tensor doh = heads_bf16(dout, d, d.T, d.Hq);
  const Tensor s = scores(qh, kh, d);
  // dP[bh] = dO[bh] V[bh]^T  [T, S]
  Tensor dp = Tensor::empty({BH, d.T, d.S}, DType::F32, Device::CUDA);
  matmul_nt(MatmulOperand{doh.raw(), false, d.hd, d.T * d.hd}, MatmulOperand{vh.raw(), false, d.hd, d.S * d.hd},
            dp.raw(), d.S, d.T * d.S, d.T, d.S, d.hd, int(BH), CUDA_R_16BF, 1.0f, 0.0f);
  Tensor p = Tensor::empty({BH, d.T, d.S}, DType::BF16, Device::CUDA);
  Tensor ds = Tensor::empty({BH, d.T, d.S}, DType::BF16, Device::CUDA);
  // S % 4 == 0 keeps every row's 4-key units 16-byte aligned (fresh buffers are).
  if (d.S % 4 == 0)
    softmax_backward_kernel<4><<<unsigned(BH * d.T), kRowThreads, 0, stream()>>>(
        s.data<float>(), lse.data<float>(), dp.data<float>(), D.data<float>(), d.T, d.S, scale,
        p.data<__nv_bfloat16>(), ds.data<__nv_bfloat16>());
  else
    softmax_backward_kernel<1><<<unsigned(BH * d.T), kRowThreads, 0, stream()>>>(
        s.data<float>(), lse.data<float>(), dp.data<float>(), D.data<float>(), d.T, d.S, scale,
        p.data<__nv_bfloat16>(), ds.data<__nv_bfloat16>());
  FOURBIT_LAUNCH_CHECK();
  // dV_h[bh] = P^T dO: C[s, d] = sum_t P[t, s] dO[t, d]  (A = P stored [K=T, M=S], B = dO stored [K=T, N=hd])
  matmul_nt(MatmulOperand{p.raw(), true, d.S, d.T * d.S}, MatmulOperand{doh.raw(), true, d.hd, d.T * d.hd},
            dvh.raw(), d.hd, d.S * d.hd, d.S, d.hd, d.T, int(BH), CUDA_R_16BF, 1.0f, 0.0f);
  // dQ_h = dS K: C[t, d] = sum_s dS[t, s] K[s, d]  (B = K stored [K=S, N=hd])
  Tensor dqh = Tensor::empty({d.B, d.Hq, d.T, d.hd}, DType::F32, Device::CUDA);
  matmul_nt(MatmulOperand{ds.raw(), false, d.S, d.T * d.S}, MatmulOperand{kh.raw(), true, d.hd, d.S * d.hd},
            dqh.raw(), d.hd, d.T * d.hd, d.T, d.hd, d.S, int(BH), CUDA_R_16BF, 1.0f, 0.0f);
  // dK_h = dS^T Q: C[s, d] = sum_t dS[t, s] Q[t, d]
  matmul_nt(MatmulOperand{ds.raw(), true, d.S, d.T * d.S}, MatmulOperand{qh.raw(), true, d.hd, d.T * d.hd},
            dkh.raw(), d.hd, d.S * d.hd, d.S, d.hd, d.T, int(BH), CUDA_R_16BF, 1.0f, 0.0f);
  launch_from_heads(dqh, d.B, d.T, d.Hq, d.hd, dq);
}

// Both paths' backward: D, then the fused kernels (when `fused` and they take the shape) or the
// materialized path, then each group's per-head dK, dV summed in head order.
void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool fused) {
  const Dims d = check_dims(q, k, v, "attention_backward");
  Tensor dout_bf16;
  const Tensor D = rowdot(dout, out, d, dout_bf16);
  Tensor dkh = Tensor::empty({d.B, d.Hq, d.S, d.hd}, DType::F32, Device::CUDA),
         dvh = Tensor::empty({d.B, d.Hq, d.S, d.hd}, DType::F32, Device::CUDA);
  if (!(fused && flash_attention_backward(dout_bf16, q, k, v, lse, D, dq, dkh, dvh)))
    materialized_backward(dout_bf16, q, k, v, lse, D, dq, dkh, dvh);
  launch_reduce_groups(dkh, d.B, d.S, d.Hq, d.Hkv, d.hd, dk);
  launch_reduce_groups(dvh, d.B, d.S, d.Hq, d.Hkv, d.hd, dv);
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out, Tensor& lse,
                       Tensor* out_bf16) {
  const Dims d = check_dims(q, k, v, "attention_forward");
  if (pos0 < 0 || pos0 + d.T > d.S) fail("attention_forward: pos0 {} + T {} exceeds the {} keys", pos0, d.T, d.S);
  if (out.shape() != q.shape() || lse.shape() != Shape{d.B, d.Hq, d.T} || out.dtype() != DType::F32 ||
      lse.dtype() != DType::F32)
    fail("attention_forward: out must be f32{} and lse f32[{}, {}, {}], got {} and {}", shape_str(q.shape()), d.B,
         d.Hq, d.T, out.str(), lse.str());
  if (!flash_attention_forward(q, k, v, pos0, out, lse, out_bf16))
    materialized_attention_forward(q, k, v, pos0, out, lse, out_bf16);
}

void materialized_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out,
                                    Tensor& lse, Tensor* out_bf16) {
  const Dims d = check_dims(q, k, v, "attention_forward");
  const Tensor qh = heads_bf16(q, d, d.T, d.Hq), kh = heads_bf16(k, d, d.S, d.Hkv), vh = heads_bf16(v, d, d.S, d.Hkv);
  const Tensor s = scores(qh, kh, d);
  Tensor p = Tensor::empty({d.B * d.Hq, d.T, d.S}, DType::BF16, Device::CUDA);
  softmax_rows_kernel<<<unsigned(d.B * d.Hq * d.T), kSoftmaxThreads, 0, stream()>>>(s.data<float>(), d.T, d.S, pos0,
                                                                  p.data<__nv_bfloat16>(), lse.data<float>());
  FOURBIT_LAUNCH_CHECK();
  // O[bh] = P[bh] V[bh]: V is stored [S, hd] = [K, N], a transposed B operand.
  Tensor oh = Tensor::empty({d.B, d.Hq, d.T, d.hd}, DType::F32, Device::CUDA);
  matmul_nt(MatmulOperand{p.raw(), false, d.S, d.T * d.S}, MatmulOperand{vh.raw(), true, d.hd, d.S * d.hd},
            oh.raw(), d.hd, d.T * d.hd, d.T, d.hd, d.S, int(d.B * d.Hq), CUDA_R_16BF, 1.0f, 0.0f);
  launch_from_heads(oh, d.B, d.T, d.Hq, d.hd, out);
  if (out_bf16) convert(out, *out_bf16);
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv) {
  const Dims d = check_dims(q, k, v, "attention_backward");
  if (d.S != d.T) fail("attention_backward: training attention needs S == T, got S={} T={}", d.S, d.T);
  if (dout.shape() != q.shape() || out.shape() != q.shape() || dq.shape() != q.shape() || dk.shape() != k.shape() ||
      dv.shape() != v.shape())
    fail("attention_backward: gradient shapes do not match q {} / k {}", q.str(), k.str());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &out, &lse, &dq, &dk, &dv})
    if (t->dtype() != DType::F32)
      fail("attention_backward: dout, out, lse, dq, dk and dv must be f32 (q, k, v may be bf16), got {}", t->str());
  backward(dout, q, k, v, out, lse, dq, dk, dv, true);
}

void materialized_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv) {
  backward(dout, q, k, v, out, lse, dq, dk, dv, false);
}

}  // namespace fourbit::ops::cuda
