// defines: the CUDA backend's entry points (same signatures and semantics as ops.h, CUDA tensors),
//          take_nonfinite_flag
// Plain C++ (no CUDA syntax): ops.cpp, compiled by the host compiler, includes it. Kernels run on
// the default stream; results that the host reads (losses, counts) synchronise.
#pragma once
#include "fourbit/ops/ops.h"

namespace fourbit::ops::cuda {

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report);
Tensor dequantize(const QTensor& q, bool undo_hadamard);
QTensor requantize_transposed(const QTensor& q, RngKey rng);

void gemm(const Operand& a, const Operand& b, Tensor& c, bool accumulate);

void convert(const Tensor& src, Tensor& dst);
void add_(Tensor& dst, const Tensor& src);
void scale_(Tensor& t, double s);
double sum_squares(const Tensor& t);
void fill_(Tensor& t, double v);

void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable);
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw);
void rope_forward(Tensor& x, const Tensor& positions, const Tensor& table);
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& table);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0,
                       Tensor& out, Tensor& lse);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv);
void swiglu_forward(const Tensor& h1, const Tensor& h3, Tensor& a);
void swiglu_backward(const Tensor& da, const Tensor& h1, const Tensor& h3, Tensor& dh1, Tensor& dh3);
void cross_entropy(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor* dlogits,
                   double grad_scale);
void router_topk(const Tensor& logits, int64_t k, Tensor& probs, Tensor& topk_idx, Tensor& topk_w);
void router_backward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_w,
                     const Tensor& d_topk_w, const Tensor& d_probs, Tensor& d_logits);

RoutePlan route_plan(const Tensor& topk_idx, int64_t n_experts);
void gather_rows(const Tensor& x, const Tensor& token_of_slot, Tensor& x_perm);
QTensor gather_rows(const QTensor& x, const Tensor& token_of_slot);
void gather_rows_backward(const Tensor& dx_perm, const Tensor& slot_of, Tensor& dx);
void moe_combine(const Tensor& y_perm, const Tensor& slot_of, const Tensor& w, Tensor& out);
void moe_combine_backward(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                          const Tensor& w, Tensor& dy_perm, Tensor& dw);

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h);

// The device-side sticky flag the quantize kernels raise on NaN/Inf input (synchronises).
bool take_nonfinite_flag(bool clear);

}  // namespace fourbit::ops::cuda
