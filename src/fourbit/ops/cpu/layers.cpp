// defines: cpu::embedding_forward, cpu::embedding_backward, cpu::rmsnorm_forward,
//          cpu::add_rmsnorm_forward, cpu::rmsnorm_backward, cpu::rope_forward, cpu::rope_backward,
//          cpu::swiglu_forward, cpu::swiglu_forward_fused, cpu::swiglu_backward, cpu::cross_entropy,
//          cpu::count_targets
// The CPU reference of the per-token layers, for F32 and F64 tensors. Arithmetic runs in double
// and each output is rounded once to the tensor's dtype; every reduction runs sequentially in
// ascending index order. Rows are independent and spread over OpenMP threads; the reductions
// across rows (dw, dtable) give each output element to one thread, which adds the rows in
// ascending order: results never depend on the thread count or on the other rows of the batch.
#include <algorithm>
#include <cmath>
#include <vector>

#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/cpu/cpu_ops.h"

namespace fourbit::ops::cpu {
namespace {

// Token ids are user data: checked serially before any parallel loop.
void check_ids(const char* op, const char* name, const int32_t* ids, int64_t n, int64_t limit,
               const char* limit_name, bool allow_ignore = false) {
  for (int64_t i = 0; i < n; ++i) {
    if (allow_ignore && ids[i] == -1) continue;
    if (ids[i] < 0 || ids[i] >= limit)
      fail("{}: {}[{}] = {} is outside [0, {}={}){}", op, name, i, ids[i], limit_name, limit,
           allow_ignore ? " and is not -1 (ignored)" : "");
  }
}

// ---- embedding --------------------------------------------------------------------------------

template <typename T>
void embedding_forward_t(const int32_t* tok, const T* table, T* out, int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) std::copy_n(table + int64_t(tok[n]) * D, D, out + n * D);
}

// Rows are bucketed by token (a stable counting sort), then each used vocabulary row is
// owned by one thread, which sums its rows in ascending token position.
template <typename T>
void embedding_backward_t(const T* dout, const int32_t* tok, T* dtable, int64_t N, int64_t V,
                          int64_t D) {
  std::vector<int64_t> start(size_t(V + 1), 0);
  for (int64_t n = 0; n < N; ++n) ++start[size_t(tok[n]) + 1];
  for (int64_t v = 0; v < V; ++v) start[size_t(v + 1)] += start[size_t(v)];
  std::vector<int64_t> rows(static_cast<size_t>(N)), cursor(start.begin(), start.end() - 1);
  for (int64_t n = 0; n < N; ++n) rows[size_t(cursor[size_t(tok[n])]++)] = n;
  std::vector<int64_t> used;
  for (int64_t v = 0; v < V; ++v)
    if (start[size_t(v + 1)] > start[size_t(v)]) used.push_back(v);
  const int64_t U = int64_t(used.size());
#pragma omp parallel
  {
    std::vector<double> acc(static_cast<size_t>(D));
#pragma omp for schedule(dynamic, 4)
    for (int64_t u = 0; u < U; ++u) {
      const int64_t v = used[size_t(u)];
      T* dst = dtable + v * D;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t r = start[size_t(v)]; r < start[size_t(v + 1)]; ++r) {
        const T* src = dout + rows[size_t(r)] * D;
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += double(src[d]);
      }
      // Like rmsnorm's dw: the batch's sum first, then one rounded add to the accumulator.
      for (int64_t d = 0; d < D; ++d) dst[d] = T(double(dst[d]) + acc[size_t(d)]);
    }
  }
}

// ---- rmsnorm ----------------------------------------------------------------------------------

template <typename T>
void rmsnorm_forward_t(const T* x, const T* w, double eps, T* y, T* rstd, int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * D;
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += double(xr[d]) * double(xr[d]);
    // The stored rstd is what backward sees, so y is computed from the rounded value too.
    const T rs = T(1.0 / std::sqrt(ss / double(D) + eps));
    rstd[n] = rs;
    for (int64_t d = 0; d < D; ++d) y[n * D + d] = T(double(xr[d]) * double(rs) * double(w[d]));
  }
}

template <typename T>
void rmsnorm_backward_t(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw,
                        int64_t N, int64_t D, bool dx_accumulate, bool dw_accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * D;
    const T* dyr = dy + n * D;
    const double rs = double(rstd[n]);
    double dot = 0.0;  // sum of w*dy*y_hat
    for (int64_t d = 0; d < D; ++d) dot += double(w[d]) * double(dyr[d]) * (double(xr[d]) * rs);
    const double mean = dot / double(D);
    for (int64_t d = 0; d < D; ++d) {
      const T v = T((double(w[d]) * double(dyr[d]) - double(xr[d]) * rs * mean) * rs);
      dx[n * D + d] = dx_accumulate ? T(dx[n * D + d] + v) : v;  // add_'s sum of the rounded value
    }
  }
  // dw: columns are split over threads in fixed blocks; each column sums rows in order.
  constexpr int64_t kCols = 64;
  const int64_t blocks = (D + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t d0 = b * kCols, d1 = std::min(D, d0 + kCols);
    double acc[kCols];
    for (int64_t d = d0; d < d1; ++d) acc[d - d0] = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const double rs = double(rstd[n]);
      for (int64_t d = d0; d < d1; ++d)
        acc[d - d0] += double(dy[n * D + d]) * (double(x[n * D + d]) * rs);
    }
    for (int64_t d = d0; d < d1; ++d) dw[d] = dw_accumulate ? T(double(dw[d]) + acc[d - d0]) : T(acc[d - d0]);
  }
}

// ---- rope -------------------------------------------------------------------------------------

// Rotates pairs (i, i + hd/2) of every head by +angle (sign = 1) or -angle (sign = -1):
//   a' = a cos - s b sin,  b' = b cos + s a sin.
template <typename T, typename C>
void rope_t(T* x, const int32_t* pos, const C* table, int64_t N, int64_t H, int64_t hd,
            double sign) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const C* cs = table + int64_t(pos[n]) * hd;
    for (int64_t h = 0; h < H; ++h) {
      T* row = x + (n * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const double c = double(cs[i]), s = sign * double(cs[half + i]);
        const double a = double(row[i]), b = double(row[half + i]);
        row[i] = T(a * c - b * s);
        row[half + i] = T(b * c + a * s);
      }
    }
  }
}

void rope(const char* op, Tensor& x, const Tensor& positions, const Tensor& table, double sign) {
  const DType dt = expect_float(op, "x", x, 3, "[N, H, hd]");
  const int64_t N = x.size(0), H = x.size(1), hd = x.size(2);
  if (hd % 2 != 0) fail("{}: head_dim must be even, got x {}", op, x.str());
  expect_index(op, "positions", positions, {N}, "[N]");
  const DType tt = expect_float(op, "table", table, 2, "[max_pos, hd]");
  if (table.size(1) != hd)
    fail("{}: table must be [max_pos, hd] with hd={}, got {}", op, hd, table.str());
  check_ids(op, "positions", positions.data<int32_t>(), N, table.size(0), "max_pos");
  with_float(dt, [&](auto tx) {
    using T = decltype(tx);
    with_float(tt, [&](auto tc) {
      using C = decltype(tc);
      rope_t(x.data<T>(), positions.data<int32_t>(), table.data<C>(), N, H, hd, sign);
    });
  });
}

// ---- swiglu -----------------------------------------------------------------------------------

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

template <typename T>
void swiglu_forward_t(const T* h1, const T* h3, T* a, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double z = double(h1[i]);
    a[i] = T(z * sigmoid(z) * double(h3[i]));
  }
}

// The same over rows of the fused gate|up output: row r's gate values at h13[r * 2F, r * 2F + F),
// its up values right after them.
template <typename T>
void swiglu_forward_fused_t(const T* h13, T* a, int64_t rows, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < F; ++i) {
      const double z = double(h13[r * 2 * F + i]);
      a[r * F + i] = T(z * sigmoid(z) * double(h13[r * 2 * F + F + i]));
    }
}

// d silu(z)/dz = s (1 + z (1 - s)) with s = sigmoid(z).
template <typename T>
void swiglu_backward_t(const T* da, const T* h1, const T* h3, T* dh1, T* dh3, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double z = double(h1[i]), s = sigmoid(z), g = double(da[i]);
    const double dsilu = s * (1.0 + z * (1.0 - s));
    dh1[i] = T(g * double(h3[i]) * dsilu);
    dh3[i] = T(g * z * s);
  }
}

// ---- cross entropy ----------------------------------------------------------------------------

template <typename T>
void cross_entropy_t(const T* logits, const int32_t* tgt, T* losses, T* dlogits, double grad_scale,
                     const float* weights, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    // Without weights gs is grad_scale itself, so the unweighted path keeps its bits.
    const double gs = weights ? grad_scale * double(weights[n]) : grad_scale;
    const T* x = logits + n * V;
    T* g = dlogits ? dlogits + n * V : nullptr;
    const int32_t t = tgt[n];
    if (t < 0) {  // ignored (-1; other values were rejected before the loop)
      losses[n] = T(0);
      if (g) std::fill_n(g, V, T(0));
      continue;
    }
    double m = double(x[0]);
    for (int64_t v = 1; v < V; ++v) m = std::max(m, double(x[v]));
    double l = 0.0;
    for (int64_t v = 0; v < V; ++v) l += std::exp(double(x[v]) - m);
    const double lse = m + std::log(l);
    losses[n] = T(lse - double(x[t]));
    if (g)
      for (int64_t v = 0; v < V; ++v)
        g[v] = T((std::exp(double(x[v]) - lse) - (v == t ? 1.0 : 0.0)) * gs);
  }
}

}  // namespace

void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out) {
  const char* op = "embedding_forward";
  const DType dt = expect_float(op, "table", table, 2, "[V, D]");
  if (!tokens.defined() || tokens.dim() != 1)
    fail("{}: tokens must be i32[N], got {}", op, tokens.defined() ? tokens.str() : "undefined");
  const int64_t N = tokens.size(0), V = table.size(0), D = table.size(1);
  expect_index(op, "tokens", tokens, {N}, "[N]");
  expect_dims(op, "out", out, dt, {N, D}, "[N, D]");
  check_ids(op, "tokens", tokens.data<int32_t>(), N, V, "V");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_t(tokens.data<int32_t>(), table.data<T>(), out.data<T>(), N, D);
  });
}

void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable, bool tokens_checked) {
  (void)tokens_checked;  // the CPU checks the ids as it reads them: nothing to save
  const char* op = "embedding_backward";
  const DType dt = expect_float(op, "dtable", dtable, 2, "[V, D]");
  const int64_t V = dtable.size(0), D = dtable.size(1);
  if (!tokens.defined() || tokens.dim() != 1)
    fail("{}: tokens must be i32[N], got {}", op, tokens.defined() ? tokens.str() : "undefined");
  const int64_t N = tokens.size(0);
  expect_index(op, "tokens", tokens, {N}, "[N]");
  expect_dims(op, "dout", dout, dt, {N, D}, "[N, D]");
  check_ids(op, "tokens", tokens.data<int32_t>(), N, V, "V");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    embedding_backward_t(dout.data<T>(), tokens.data<int32_t>(), dtable.data<T>(), N, V, D);
  });
}

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd, Tensor* y_bf16) {
  const char* op = "rmsnorm_forward";
  const DType dt = expect_float(op, "x", x, 2, "[N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  expect_dims(op, "w", w, dt, {D}, "[D]");
  expect_out(op, "y", y, dt, {N, D}, "[N, D]");
  expect_dims(op, "rstd", rstd, dt, {N}, "[N]");
  if (!(eps >= 0.0f)) fail("{}: eps must be >= 0, got {}", op, eps);
  Tensor out = f32_stand_in(y);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward_t(x.data<T>(), w.data<T>(), double(eps), out.data<T>(), rstd.data<T>(), N, D);
  });
  if (out.raw() != y.raw()) convert(out, y);
  if (y_bf16) convert(y, *y_bf16);
}

void add_rmsnorm_forward(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& y,
                         Tensor& rstd, Tensor* y_bf16) {
  add(a, b, sum);
  rmsnorm_forward(sum, w, eps, y, rstd, y_bf16);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool dx_accumulate, bool dw_accumulate, Tensor* dx_bf16) {
  const char* op = "rmsnorm_backward";
  const DType dt = expect_float(op, "x", x, 2, "[N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  expect_dims(op, "dy", dy, dt, {N, D}, "[N, D]");
  expect_dims(op, "w", w, dt, {D}, "[D]");
  expect_dims(op, "rstd", rstd, dt, {N}, "[N]");
  expect_dims(op, "dx", dx, dt, {N, D}, "[N, D]");
  expect_dims(op, "dw", dw, dt, {D}, "[D]");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_backward_t(dy.data<T>(), x.data<T>(), w.data<T>(), rstd.data<T>(), dx.data<T>(),
                       dw.data<T>(), N, D, dx_accumulate, dw_accumulate);
  });
  if (dx_bf16) convert(dx, *dx_bf16);
}

void rope_forward(Tensor& x, const Tensor& positions, const Tensor& table, Tensor* x_bf16, bool bf16_only) {
  Tensor r = bf16_only ? x.clone() : x;  // bf16_only: rotate a copy, x keeps its values
  rope("rope_forward", r, positions, table, 1.0);
  if (x_bf16) convert(r, *x_bf16);
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& table, Tensor* dx_bf16, bool bf16_only) {
  Tensor r = bf16_only ? dx.clone() : dx;
  rope("rope_backward", r, positions, table, -1.0);
  if (dx_bf16) convert(r, *dx_bf16);
}

void swiglu_forward(const Tensor& h1, const Tensor& h3, Tensor& a) {
  const char* op = "swiglu_forward";
  const DType dt = expect_float(op, "h1", h1, h1.defined() ? h1.dim() : 0, "[..., F]");
  expect_like(op, "h3", h3, "h1", h1);
  expect_out(op, "a", a, dt, h1.shape(), "[like h1]");
  Tensor out = f32_stand_in(a);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_t(h1.data<T>(), h3.data<T>(), out.data<T>(), h1.numel());
  });
  if (out.raw() != a.raw()) convert(out, a);
}

void swiglu_forward_fused(const Tensor& h13, Tensor& a) {
  const char* op = "swiglu_forward_fused";
  const DType dt = expect_float(op, "h13", h13, h13.defined() ? h13.dim() : 0, "[..., 2F]");
  const int64_t F = h13.size(h13.dim() - 1) / 2, rows = F > 0 ? h13.numel() / (2 * F) : 0;
  Shape a_shape = h13.shape();
  a_shape.back() = F;
  expect_out(op, "a", a, dt, a_shape, "[..., F]");
  Tensor out = f32_stand_in(a);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_fused_t(h13.data<T>(), out.data<T>(), rows, F);
  });
  if (out.raw() != a.raw()) convert(out, a);
}

void swiglu_backward(const Tensor& da, const Tensor& h1, const Tensor& h3, Tensor& dh1,
                     Tensor& dh3) {
  const char* op = "swiglu_backward";
  const DType dt = expect_float(op, "h1", h1, h1.defined() ? h1.dim() : 0, "[..., F]");
  expect_like(op, "da", da, "h1", h1);
  expect_like(op, "h3", h3, "h1", h1);
  const DType out_dt = expect_out(op, "dh1", dh1, dt, h1.shape(), "[like h1]");
  expect_dims(op, "dh3", dh3, out_dt, h1.shape(), "[like dh1]");
  Tensor o1 = f32_stand_in(dh1), o3 = f32_stand_in(dh3);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_t(da.data<T>(), h1.data<T>(), h3.data<T>(), o1.data<T>(), o3.data<T>(),
                      h1.numel());
  });
  if (o1.raw() != dh1.raw()) {
    convert(o1, dh1);
    convert(o3, dh3);
  }
}

void cross_entropy(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor* dlogits,
                   double grad_scale, const Tensor* weights, const Tensor* scale) {
  if (scale) grad_scale = double(scale->data<float>()[0]);
  const char* op = "cross_entropy";
  const DType dt = expect_float(op, "logits", logits, 2, "[N, V]");
  const int64_t N = logits.size(0), V = logits.size(1);
  if (V < 1) fail("{}: logits must have at least one column, got {}", op, logits.str());
  expect_index(op, "targets", targets, {N}, "[N]");
  expect_dims(op, "losses", losses, dt, {N}, "[N]");
  const bool want_grad = dlogits && dlogits->defined();
  if (want_grad) expect_dims(op, "dlogits", *dlogits, dt, {N, V}, "[N, V]");
  const bool weighted = weights && weights->defined();
  if (weighted) expect_dims(op, "weights", *weights, DType::F32, {N}, "[N]");
  check_ids(op, "targets", targets.data<int32_t>(), N, V, "V", /*allow_ignore=*/true);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_t(logits.data<T>(), targets.data<int32_t>(), losses.data<T>(),
                    want_grad ? dlogits->data<T>() : nullptr, double(grad_scale),
                    weighted ? weights->data<float>() : nullptr, N, V);
  });
}

void count_targets(const Tensor& targets, float loss_weight, Tensor& count, Tensor& scale) {
  const int32_t* t = targets.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) n += t[i] >= 0 ? 1 : 0;
  count.data<double>()[0] = double(n);
  scale.data<float>()[0] = n ? float(double(loss_weight) / double(n)) : 0.0f;
}

}  // namespace fourbit::ops::cpu
