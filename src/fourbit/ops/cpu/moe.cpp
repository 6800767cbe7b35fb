// defines: cpu::router_topk, cpu::router_backward, cpu::route_plan, cpu::gather_rows (dense and
//          QTensor), cpu::scatter_rows, cpu::gather_rows_backward, cpu::moe_combine,
//          cpu::moe_combine_backward, cpu::load_balance_term, cpu::load_balance_dprobs
// The router and the token <-> expert-slot permutation. Every token row is computed by one
// thread from its own k assignments in rank order, so results are deterministic and a token's
// output never depends on the other tokens of the batch (DESIGN "Exactness": combine by rank,
// never by arrival). Router arithmetic runs in double, rounded once per output. The k-term
// sums of gather_rows_backward and moe_combine run in the tensor's own dtype (acc = 0, then
// acc += term for j = 0 .. k-1) so a GPU kernel reproduces them bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/cpu/cpu_ops.h"
#include "fourbit/ops/load_balance_math.h"

namespace fourbit::ops::cpu {
namespace {

// Index tensors are user data: checked serially before any parallel loop.
void check_range(const char* op, const char* name, const Tensor& idx, int64_t limit,
                 const char* limit_name) {
  const int32_t* p = idx.data<int32_t>();
  const int64_t cols = idx.dim() == 2 ? idx.size(1) : 1;
  for (int64_t i = 0; i < idx.numel(); ++i)
    if (p[i] < 0 || p[i] >= limit) {
      if (idx.dim() == 2)
        fail("{}: {}[{}, {}] = {} is outside [0, {}={})", op, name, i / cols, i % cols, p[i],
             limit_name, limit);
      fail("{}: {}[{}] = {} is outside [0, {}={})", op, name, i, p[i], limit_name, limit);
    }
}

// ---- router -----------------------------------------------------------------------------------

template <typename T>
void router_topk_t(const T* logits, int64_t k, T* probs, int32_t* idx, T* w, int64_t N,
                   int64_t E) {
#pragma omp parallel
  {
    std::vector<char> taken(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const T* x = logits + n * E;
      T* p = probs + n * E;
      double m = double(x[0]);
      for (int64_t e = 1; e < E; ++e) m = std::max(m, double(x[e]));
      double l = 0.0;
      for (int64_t e = 0; e < E; ++e) l += std::exp(double(x[e]) - m);
      for (int64_t e = 0; e < E; ++e) p[e] = T(std::exp(double(x[e]) - m) / l);
      // Selection on the stored probabilities: strictly greater wins, so ties keep the lower
      // expert index; a NaN row still yields k distinct experts.
      std::fill(taken.begin(), taken.end(), 0);
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[size_t(e)] && (best < 0 || p[e] > p[best])) best = e;
        taken[size_t(best)] = 1;
        idx[n * k + j] = int32_t(best);
        sum += double(p[best]);
      }
      for (int64_t j = 0; j < k; ++j) w[n * k + j] = T(double(p[idx[n * k + j]]) / sum);
    }
  }
}

// w_j = p_{i_j} / S with S = sum_j p_{i_j}:  dL/dp_{i_l} = (dw_l - sum_j dw_j w_j) / S.
// Then the softmax Jacobian: dlogit_e = p_e (dp_e - sum_f p_f dp_f).
template <typename T>
void router_backward_t(const T* probs, const int32_t* idx, const T* w, const T* dw, const T* dprobs,
                       int64_t dprobs_stride, T* dlogits, int64_t N, int64_t E, int64_t k) {
#pragma omp parallel
  {
    std::vector<double> dp(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const T* p = probs + n * E;
      for (int64_t e = 0; e < E; ++e) dp[size_t(e)] = dprobs ? double(dprobs[n * dprobs_stride + e]) : 0.0;
      double S = 0.0, gw = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        S += double(p[idx[n * k + j]]);
        gw += double(dw[n * k + j]) * double(w[n * k + j]);
      }
      for (int64_t j = 0; j < k; ++j) dp[size_t(idx[n * k + j])] += (double(dw[n * k + j]) - gw) / S;
      double dot = 0.0;
      for (int64_t e = 0; e < E; ++e) dot += double(p[e]) * dp[size_t(e)];
      for (int64_t e = 0; e < E; ++e) dlogits[n * E + e] = T(double(p[e]) * (dp[size_t(e)] - dot));
    }
  }
}

// ---- permutation ------------------------------------------------------------------------------

template <typename T>
void gather_backward_t(const T* dxp, const int32_t* slot_of, T* dx, int64_t N, int64_t k,
                       int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* o = dx + n * D;
    std::fill_n(o, D, T(0));
    for (int64_t j = 0; j < k; ++j) {
      const T* src = dxp + int64_t(slot_of[n * k + j]) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += src[d];
    }
  }
}

template <typename T>
void combine_t(const T* y, const int32_t* slot_of, const T* w, T* out, int64_t N, int64_t k,
               int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* o = out + n * D;
    std::fill_n(o, D, T(0));
    for (int64_t j = 0; j < k; ++j) {
      const T wj = w[n * k + j];
      const T* src = y + int64_t(slot_of[n * k + j]) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += wj * src[d];
    }
  }
}

// Slots no token points at (none for a route_plan's slot_of) are left zero in dy_perm.
template <typename T>
void combine_backward_t(const T* dout, const T* y, const int32_t* slot_of, const T* w, T* dy,
                        T* dw, int64_t N, int64_t M, int64_t k, int64_t D) {
  std::fill_n(dy, M * D, T(0));
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = dout + n * D;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = slot_of[n * k + j];
      const T wj = w[n * k + j];
      T* o = dy + s * D;
      const T* yr = y + s * D;
      double acc = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        o[d] = wj * g[d];
        acc += double(g[d]) * double(yr[d]);
      }
      dw[n * k + j] = T(acc);
    }
  }
}

// Distinct tokens own distinct slots only if slot_of is injective; writes of dy_perm rely on it.
void check_injective(const char* op, const Tensor& slot_of, int64_t M) {
  std::vector<int64_t> owner(size_t(M), -1);
  const int32_t* s = slot_of.data<int32_t>();
  const int64_t k = slot_of.size(1);
  for (int64_t i = 0; i < slot_of.numel(); ++i) {
    if (owner[size_t(s[i])] >= 0)
      fail("{}: slot_of[{}, {}] = {} is also slot_of[{}, {}]: each slot belongs to one assignment",
           op, i / k, i % k, s[i], owner[size_t(s[i])] / k, owner[size_t(s[i])] % k);
    owner[size_t(s[i])] = i;
  }
}

}  // namespace

void router_topk(const Tensor& logits, int64_t k, Tensor& probs, Tensor& topk_idx, Tensor& topk_w) {
  const char* op = "router_topk";
  const DType dt = expect_float(op, "logits", logits, 2, "[N, E]");
  const int64_t N = logits.size(0), E = logits.size(1);
  if (k < 1 || k > E) fail("{}: k must be in [1, E={}], got k={}", op, E, k);
  expect_dims(op, "probs", probs, dt, {N, E}, "[N, E]");
  expect_index(op, "topk_idx", topk_idx, {N, k}, "[N, k]");
  expect_dims(op, "topk_w", topk_w, dt, {N, k}, "[N, k]");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    router_topk_t(logits.data<T>(), k, probs.data<T>(), topk_idx.data<int32_t>(),
                  topk_w.data<T>(), N, E);
  });
}

void router_backward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_w,
                     const Tensor& d_topk_w, const Tensor& d_probs, Tensor& d_logits) {
  const char* op = "router_backward";
  const DType dt = expect_float(op, "probs", probs, 2, "[N, E]");
  const int64_t N = probs.size(0), E = probs.size(1);
  const int64_t k = expect_router_backward_args(Device::CPU, op, dt, N, E, topk_idx, topk_w, d_topk_w, d_probs, d_logits);
  check_range(op, "topk_idx", topk_idx, E, "E");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    router_backward_t(probs.data<T>(), topk_idx.data<int32_t>(), topk_w.data<T>(),
                      d_topk_w.data<T>(), d_probs.defined() ? d_probs.data<T>() : nullptr,
                      d_probs.defined() && d_probs.size(0) == 1 ? 0 : E, d_logits.data<T>(), N, E, k);
  });
}

namespace {
// ops.h "prob_sums": per expert, chunks of kProbSumChunk tokens summed in token order, then the
// chunk sums in order.
template <class T>
std::vector<double> prob_sums_t(const T* p, int64_t N, int64_t E) {
  std::vector<double> total(size_t(E), 0.0), chunk(size_t(E), 0.0);
  for (int64_t c0 = 0; c0 < N; c0 += kProbSumChunk) {
    std::fill(chunk.begin(), chunk.end(), 0.0);
    for (int64_t n = c0; n < std::min(N, c0 + kProbSumChunk); ++n)
      for (int64_t e = 0; e < E; ++e) chunk[size_t(e)] += double(p[n * E + e]);
    for (int64_t e = 0; e < E; ++e) total[size_t(e)] += chunk[size_t(e)];
  }
  return total;
}
}  // namespace

PendingRoutePlan route_plan_begin(const Tensor& topk_idx, int64_t n_experts, const Tensor& probs, bool /*read_back*/,
                                  int64_t extra_rows) {
  const char* op = "route_plan";
  if (!topk_idx.defined() || topk_idx.dim() != 2 || topk_idx.dtype() != DType::I32 ||
      topk_idx.device() != Device::CPU)
    fail("{}: topk_idx must be an i32[N, k] cpu tensor, got {}{}", op, str_or_undef(topk_idx),
         topk_idx.defined() ? topk_idx.str() : "");
  if (n_experts < 1) fail("{}: n_experts must be positive, got {}", op, n_experts);
  check_range(op, "topk_idx", topk_idx, n_experts, "n_experts");
  const int64_t N = topk_idx.size(0), k = topk_idx.size(1);
  const int32_t* idx = topk_idx.data<int32_t>();
  RoutePlan plan;
  plan.offsets.assign(size_t(n_experts + 1), 0);
  for (int64_t i = 0; i < N * k; ++i) ++plan.offsets[size_t(idx[i]) + 1];
  for (int64_t e = 0; e < n_experts; ++e) plan.offsets[size_t(e + 1)] += plan.offsets[size_t(e)];
  plan.slot_of = Tensor::empty({N, k}, DType::I32);
  plan.token_of_slot = Tensor::empty({N * k + extra_rows}, DType::I32);
  int32_t* slot_of = plan.slot_of.data<int32_t>();
  int32_t* token_of = plan.token_of_slot.data<int32_t>();
  // Tokens visited in ascending order fill each expert's range in ascending order (stable).
  std::vector<int64_t> cursor(plan.offsets.begin(), plan.offsets.end() - 1);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = cursor[size_t(idx[n * k + j])]++;
      slot_of[n * k + j] = int32_t(s);
      token_of[s] = int32_t(n);
    }
  if (extra_rows > 0) {  // the extra group (ops.h): tokens 0 .. extra_rows - 1 after the slots
    for (int64_t t = 0; t < extra_rows; ++t) token_of[N * k + t] = int32_t(t);
    plan.offsets.push_back(N * k + extra_rows);
  }
  if (probs.defined())
    with_float(probs.dtype(), [&](auto tag) {
      using T = decltype(tag);
      plan.prob_sums = prob_sums_t(probs.data<T>(), N, n_experts);
    });
  return PendingRoutePlan{std::move(plan), {}};
}

void load_balance_term(const Tensor& offsets, const Tensor& prob_sums, int64_t tokens, int64_t assignments,
                       double coef, Tensor& terms, int64_t slot) {
  terms.data<double>()[slot] = load_balance_term_of(offsets.data<int32_t>(), prob_sums.data<double>(),
                                                    offsets.numel() - 1, tokens, assignments, coef);
}

void load_balance_dprobs(const Tensor& offsets, int64_t tokens, int64_t assignments, float loss_weight, double coef,
                         Tensor& d_probs) {
  const int64_t E = offsets.numel() - 1;
  for (int64_t e = 0; e < E; ++e) {
    const double d = load_balance_dprob(offsets.data<int32_t>(), e, E, tokens, assignments, loss_weight, coef);
    if (d_probs.dtype() == DType::F64) d_probs.data<double>()[e] = d;
    else d_probs.data<float>()[e] = float(d);
  }
}

void gather_rows(const Tensor& x, const Tensor& token_of_slot, Tensor& x_perm) {
  const char* op = "gather_rows";
  const auto [N, D, M] = expect_gather_args(Device::CPU, op, x, token_of_slot, x_perm);
  check_range(op, "token_of_slot", token_of_slot, N, "N");
  // A row copy is exact for every dtype, so this one loop serves them all.
  const int64_t row_bytes = D * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(x_perm.raw());
  const int32_t* tok = token_of_slot.data<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < M; ++s)
    std::memcpy(dst + s * row_bytes, src + int64_t(tok[s]) * row_bytes, size_t(row_bytes));
}

void scatter_rows(const Tensor& x, const Tensor& dst_rows, Tensor& out) {
  const char* op = "scatter_rows";
  const auto [N, D, M] = expect_scatter_args(Device::CPU, op, x, dst_rows, out);
  check_range(op, "dst_rows", dst_rows, N, "N");
  const int32_t* dst_idx = dst_rows.data<int32_t>();
  // Two rows written to one place would make the result depend on the write order.
  std::vector<bool> taken(size_t(N), false);
  for (int64_t s = 0; s < M; ++s) {
    if (taken[size_t(dst_idx[s])])
      fail("{}: dst_rows[{}] = {} repeats an earlier entry: each output row takes one input row", op, s,
           dst_idx[s]);
    taken[size_t(dst_idx[s])] = true;
  }
  const int64_t row_bytes = D * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < M; ++s)
    std::memcpy(dst + int64_t(dst_idx[s]) * row_bytes, src + s * row_bytes, size_t(row_bytes));
}

QTensor gather_rows(const QTensor& x, const Tensor& token_of_slot) {
  const char* op = "gather_rows";
  if (x.axis != BlockAxis::Row || x.slices != 1)
    fail("{}: a QTensor must be Row-axis with one slice (rows = tokens), got {}-axis with {} "
         "slices",
         op, x.axis == BlockAxis::Row ? "Row" : "Col", x.slices);
  if (x.device() != Device::CPU) fail("{}: QTensor codes must be on the cpu", op);
  if (!token_of_slot.defined() || token_of_slot.dim() != 1)
    fail("{}: token_of_slot must be i32[M], got {}{}", op, str_or_undef(token_of_slot),
         token_of_slot.defined() ? token_of_slot.str() : "");
  const int64_t M = token_of_slot.size(0);
  expect_index(op, "token_of_slot", token_of_slot, {M}, "[M]");
  check_range(op, "token_of_slot", token_of_slot, x.rows, "rows");
  QTensor out = x;
  out.rows = M;
  out.bf16 = out.row_amax = Tensor{};  // new codes: the input's decode and row amaxes do not describe them
  out.codes = Tensor::empty({M, x.code_row_bytes()}, DType::U8);
  out.block_scales = Tensor::empty({M, x.blocks_per_row()}, DType::U8);
  const bool per_row = x.outer == OuterScale::PerRow;
  // Tensor/None (and the single PerSlice scale of a one-slice tensor) apply to every row.
  if (x.outer_scales.defined())
    out.outer_scales = per_row ? Tensor::empty({M}, DType::F32) : x.outer_scales.clone();
  gather_rows(x.codes, token_of_slot, out.codes);
  gather_rows(x.block_scales, token_of_slot, out.block_scales);
  if (per_row) {
    const float* src = x.outer_scales.data<float>();
    float* dst = out.outer_scales.data<float>();
    const int32_t* tok = token_of_slot.data<int32_t>();
    for (int64_t s = 0; s < M; ++s) dst[s] = src[tok[s]];
  }
  return out;
}

void gather_rows_backward(const Tensor& dx_perm, const Tensor& slot_of, Tensor& dx) {
  const char* op = "gather_rows_backward";
  const DType dt = expect_float(op, "dx", dx, 2, "[N, D]");
  const int64_t N = dx.size(0), D = dx.size(1);
  expect_float(op, "dx_perm", dx_perm, 2, "[M, D]");
  const int64_t M = dx_perm.size(0);
  expect_dims(op, "dx_perm", dx_perm, dt, {M, D}, "[M, D]");
  if (!slot_of.defined() || slot_of.dim() != 2 || slot_of.size(0) != N)
    fail("{}: slot_of must be i32[N, k] with N={}, got {}{}", op, N, str_or_undef(slot_of),
         slot_of.defined() ? slot_of.str() : "");
  const int64_t k = slot_of.size(1);
  expect_index(op, "slot_of", slot_of, {N, k}, "[N, k]");
  check_range(op, "slot_of", slot_of, M, "M");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    gather_backward_t(dx_perm.data<T>(), slot_of.data<int32_t>(), dx.data<T>(), N, k, D);
  });
}

void moe_combine(const Tensor& y_perm, const Tensor& slot_of, const Tensor& w, Tensor& out, const Tensor* plus) {
  const char* op = "moe_combine";
  const DType dt = expect_float(op, "out", out, 2, "[N, D]");
  const int64_t N = out.size(0), D = out.size(1);
  const auto [M, k] = expect_combine_args(Device::CPU, op, dt, N, D, y_perm, slot_of, w);
  check_range(op, "slot_of", slot_of, M, "M");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    combine_t(y_perm.data<T>(), slot_of.data<int32_t>(), w.data<T>(), out.data<T>(), N, k, D);
  });
  if (plus) add_(out, *plus);
}

void moe_combine_backward(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                          const Tensor& w, Tensor& dy_perm, Tensor& dw) {
  const char* op = "moe_combine_backward";
  const DType dt = expect_float(op, "dout", dout, 2, "[N, D]");
  const int64_t N = dout.size(0), D = dout.size(1);
  const auto [M, k] = expect_combine_args(Device::CPU, op, dt, N, D, y_perm, slot_of, w);
  expect_out(op, "dy_perm", dy_perm, dt, {M, D}, "[M, D]");
  expect_dims(op, "dw", dw, dt, {N, k}, "[N, k]");
  check_range(op, "slot_of", slot_of, M, "M");
  check_injective(op, slot_of, M);
  Tensor out = f32_stand_in(dy_perm);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    combine_backward_t(dout.data<T>(), y_perm.data<T>(), slot_of.data<int32_t>(), w.data<T>(),
                       out.data<T>(), dw.data<T>(), N, M, k, D);
  });
  if (out.raw() != dy_perm.raw()) convert(out, dy_perm);
}

}  // namespace fourbit::ops::cpu
