// defines: the CUDA backend's entry points (same signatures and semantics as ops.h, CUDA tensors),
//          take_nonfinite_flag, native_block_scaled_gemm, grouped_gemm, gemm_batch, quantize_segments,
//          requantize_transposed_segments, flash_attention_forward, flash_attention_backward,
//          materialized_attention_forward, materialized_attention_backward
// Plain C++ (no CUDA syntax): ops.cpp, compiled by the host compiler, includes it. Kernels run on
// cuda::stream() (the default stream, or the current GPU lane's); results that the host reads
// (losses, counts) synchronise.
#pragma once
#include "fourbit/ops/ops.h"

namespace fourbit::ops::cuda {

#include "fourbit/ops/backend_ops.inc"  // NOLINT(bugprone-suspicious-include)

// The device-side sticky flag the quantize kernels raise on NaN/Inf input (synchronises).
bool take_nonfinite_flag(bool clear);

// ops::grouped_gemm on CUDA operands (checked by the caller; B's groups are n x k); false when it
// does not apply (more than 128 groups, native block-scaled GEMMs, a transposed B that would need
// a conversion), and the caller runs one gemm per group.
bool grouped_gemm(const Operand& a, const Operand& b, const std::vector<int64_t>& offsets, int64_t n, int64_t k,
                  Tensor& c, bool accumulate);

// ops::gemm_batch on CUDA operands (checked by the caller); false when it does not apply
// (native block-scaled GEMMs), and the caller runs one gemm per job.
bool gemm_batch(const std::vector<GemmJob>& jobs);

// ops::quantize_segments on a CUDA tensor (checked by the caller) into out; false when the spec
// has no batched kernel, and the caller quantizes segment by segment.
bool quantize_segments(const Tensor& x, const std::vector<int64_t>& offsets, const QuantSpec& spec,
                       const std::vector<RngKey>& rngs, std::vector<QTensor>& out);

// ops::requantize_transposed_segments on a CUDA QTensor (checked by the caller) into out; false
// behind an RHT (the caller requantizes segment by segment).
bool requantize_transposed_segments(const QTensor& q, const std::vector<int64_t>& offsets,
                                    const std::vector<RngKey>& rngs, std::vector<QTensor>& out);

// The two GPU attention paths behind ops::attention_forward/backward (same arguments; the fused
// backward takes D = rowsum(dout * out) [B, Hq, T] and writes per-q-head gradients dk_heads,
// dv_heads [B, Hq, S, hd], which the caller sums over each group). The fused one (flash_attention.cu)
// returns false for shapes it does not take (hd other than 32, 64 or 128; unaligned outputs) and the
// materialized one (attention.cu: scores in memory, cuBLASLt GEMMs) runs instead. Both are here
// for the tests and bench/gpu_attention, which compare them.
bool flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out, Tensor& lse);
bool flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                              const Tensor& D, Tensor& dq, Tensor& dk_heads, Tensor& dv_heads);
void materialized_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out,
                                    Tensor& lse);
void materialized_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv);

// Whether this GPU multiplies NVFP4/MXFP8 operands natively (block-scaled tensor cores, sm_100+).
bool native_block_scaled_gemm();

}  // namespace fourbit::ops::cuda
