// defines: cpu::attention_forward, cpu::attention_backward
// Causal grouped-query attention, the CPU reference. Scores, softmax and weighted sums are
// accumulated in double and rounded once to the tensor's dtype.
//
// Order of the forward (the KV-cache contract): for the query at absolute position p,
//   s_j = (sum_d q_d k_jd, d ascending) * (1/sqrt(hd))       for j = 0 .. p
//   m   = max_j s_j
//   l   = sum_j exp(s_j - m),  acc = sum_j exp(s_j - m) v_j    j ascending, in one pass
//   out = acc / l  ("sum then divide"),  lse = m + log(l)
// Nothing in it depends on T, pos0, S or B: only on the query row and the keys 0..p, so a query
// gets the same bits in training, prefill and one-token decode, alone or in a batch. On this
// backend the whole key range is one chunk; a chunked GPU kernel must keep chunk edges at fixed
// absolute positions for the same guarantee.
//
// Backward (pos0 = 0, S = T) recomputes p_tj = exp(s_tj - lse_t) instead of storing P, in two
// passes so every output element is owned by one thread and reduced in a fixed order:
//   pass A, per (b, h, t):  D_t = dout_t . out_t;  dq_t = scale * sum_{j<=t} ds_tj k_j
//   pass B, per (b, g, j):  dv_j = sum_{h in g} sum_{t>=j} p_tj dout_t
//                           dk_j = scale * sum_{h in g} sum_{t>=j} ds_tj q_t
// with ds_tj = p_tj (dout_t . v_j - D_t); heads of a group in ascending order, then t ascending.
#include <algorithm>
#include <cmath>
#include <vector>

#include "fourbit/ops/cpu/checks.h"
#include "fourbit/ops/cpu/cpu_ops.h"

namespace fourbit::ops::cpu {
namespace {

struct Dims {
  int64_t B, T, S, Hq, Hkv, hd;
  int64_t group() const { return Hq / Hkv; }
  // Offsets of a row of q/out/dout [B, T, Hq, hd], of k/v [B, S, Hkv, hd] and of lse [B, Hq, T].
  int64_t q_row(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hq + h) * hd; }
  int64_t kv_row(int64_t b, int64_t j, int64_t g) const { return ((b * S + j) * Hkv + g) * hd; }
  int64_t lse_at(int64_t b, int64_t h, int64_t t) const { return (b * Hq + h) * T + t; }
};

// Four interleaved partial sums combined as (s0 + s1) + (s2 + s3): a fixed order (the same for
// every row, batch size and thread count) that is not one long chain of dependent adds.
template <typename T>
double dot(const T* a, const T* b, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += double(a[i + j]) * double(b[i + j]);
  for (; i < n; ++i) s[i & 3] += double(a[i]) * double(b[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

template <typename T>
void forward_t(const T* q, const T* k, const T* v, int64_t pos0, T* out, T* lse, const Dims& d) {
  const double scale = 1.0 / std::sqrt(double(d.hd));
  const int64_t rows = d.B * d.Hq * d.T;
#pragma omp parallel
  {
    std::vector<double> s(size_t(pos0 + d.T)), acc(size_t(d.hd));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r % d.T, h = (r / d.T) % d.Hq, b = r / (d.T * d.Hq);
      const int64_t g = h / d.group(), p = pos0 + t;
      const T* qr = q + d.q_row(b, t, h);
      double m = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        s[size_t(j)] = dot(qr, k + d.kv_row(b, j, g), d.hd) * scale;
        m = std::max(m, s[size_t(j)]);
      }
      double l = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j <= p; ++j) {
        const double e = std::exp(s[size_t(j)] - m);
        l += e;
        const T* vr = v + d.kv_row(b, j, g);
        for (int64_t i = 0; i < d.hd; ++i) acc[size_t(i)] += e * double(vr[i]);
      }
      T* o = out + d.q_row(b, t, h);
      for (int64_t i = 0; i < d.hd; ++i) o[i] = T(acc[size_t(i)] / l);
      lse[d.lse_at(b, h, t)] = T(m + std::log(l));
    }
  }
}

template <typename T>
void backward_t(const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse,
                T* dq, T* dk, T* dv, const Dims& d) {
  const double scale = 1.0 / std::sqrt(double(d.hd));
  const int64_t hd = d.hd;
  std::vector<double> Dt(size_t(d.B * d.Hq * d.T));

  // Pass A: D_t and dq, one query row per iteration.
  const int64_t rows = d.B * d.Hq * d.T;
#pragma omp parallel
  {
    std::vector<double> acc(static_cast<size_t>(hd));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r % d.T, h = (r / d.T) % d.Hq, b = r / (d.T * d.Hq);
      const int64_t g = h / d.group();
      const T* qr = q + d.q_row(b, t, h);
      const T* dor = dout + d.q_row(b, t, h);
      const double D = dot(dor, out + d.q_row(b, t, h), hd);
      const double L = double(lse[d.lse_at(b, h, t)]);
      Dt[size_t(d.lse_at(b, h, t))] = D;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j <= t; ++j) {
        const T* kr = k + d.kv_row(b, j, g);
        const double p = std::exp(dot(qr, kr, hd) * scale - L);
        const double ds = p * (dot(dor, v + d.kv_row(b, j, g), hd) - D);
        for (int64_t i = 0; i < hd; ++i) acc[size_t(i)] += ds * double(kr[i]);
      }
      T* o = dq + d.q_row(b, t, h);
      for (int64_t i = 0; i < hd; ++i) o[i] = T(scale * acc[size_t(i)]);
    }
  }

  // Pass B: dk and dv, one key row (of one kv head) per iteration.
  const int64_t keys = d.B * d.Hkv * d.S;
#pragma omp parallel
  {
    std::vector<double> ak(static_cast<size_t>(hd)), av(static_cast<size_t>(hd));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < keys; ++r) {
      const int64_t j = r % d.S, g = (r / d.S) % d.Hkv, b = r / (d.S * d.Hkv);
      const T* kr = k + d.kv_row(b, j, g);
      const T* vr = v + d.kv_row(b, j, g);
      std::fill(ak.begin(), ak.end(), 0.0);
      std::fill(av.begin(), av.end(), 0.0);
      for (int64_t h = g * d.group(); h < (g + 1) * d.group(); ++h)
        for (int64_t t = j; t < d.T; ++t) {
          const T* qr = q + d.q_row(b, t, h);
          const T* dor = dout + d.q_row(b, t, h);
          const double p = std::exp(dot(qr, kr, hd) * scale - double(lse[d.lse_at(b, h, t)]));
          const double ds = p * (dot(dor, vr, hd) - Dt[size_t(d.lse_at(b, h, t))]);
          for (int64_t i = 0; i < hd; ++i) {
            av[size_t(i)] += p * double(dor[i]);
            ak[size_t(i)] += ds * double(qr[i]);
          }
        }
      T* ok = dk + d.kv_row(b, j, g);
      T* ov = dv + d.kv_row(b, j, g);
      for (int64_t i = 0; i < hd; ++i) {
        ok[i] = T(scale * ak[size_t(i)]);
        ov[i] = T(av[size_t(i)]);
      }
    }
  }
}

// Validates q, k, v and returns the problem's dimensions.
Dims check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, DType& dt) {
  dt = expect_float(op, "q", q, 4, "[B, T, Hq, hd]");
  expect_float(op, "k", k, 4, "[B, S, Hkv, hd]");
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  if (k.dtype() != dt || k.size(0) != d.B || k.size(3) != d.hd)
    fail("{}: k must be {}[B, S, Hkv, hd] with B={}, hd={} (from q {}), got {}", op,
         dtype_name(dt), d.B, d.hd, q.str(), k.str());
  if (d.Hkv < 1 || d.Hq % d.Hkv != 0)
    fail("{}: q heads Hq={} must be a multiple of kv heads Hkv={} (q {}, k {})", op, d.Hq, d.Hkv,
         q.str(), k.str());
  if (d.hd < 1) fail("{}: head_dim must be positive, got q {}", op, q.str());
  expect_like(op, "v", v, "k", k);
  return d;
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0,
                       Tensor& out, Tensor& lse, Tensor* out_bf16) {
  const char* op = "attention_forward";
  DType dt;
  const Dims d = check_qkv(op, q, k, v, dt);
  if (pos0 < 0 || d.S < pos0 + d.T)
    fail("{}: k/v hold S={} positions but queries at pos0={} with T={} need S >= {}", op, d.S,
         pos0, d.T, pos0 + d.T);
  expect_like(op, "out", out, "q", q);
  expect_dims(op, "lse", lse, dt, {d.B, d.Hq, d.T}, "[B, Hq, T]");
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    forward_t(q.data<T>(), k.data<T>(), v.data<T>(), pos0, out.data<T>(), lse.data<T>(), d);
  });
  if (out_bf16) convert(out, *out_bf16);
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv) {
  const char* op = "attention_backward";
  DType dt;
  const Dims d = check_qkv(op, q, k, v, dt);
  if (d.S != d.T)
    fail("{}: training backward needs k/v of the same length as q (S == T), got S={}, T={}", op,
         d.S, d.T);
  expect_like(op, "dout", dout, "q", q);
  expect_like(op, "out", out, "q", q);
  expect_dims(op, "lse", lse, dt, {d.B, d.Hq, d.T}, "[B, Hq, T]");
  expect_like(op, "dq", dq, "q", q);
  expect_like(op, "dk", dk, "k", k);
  expect_like(op, "dv", dv, "v", v);
  with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    backward_t(dout.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(), out.data<T>(),
               lse.data<T>(), dq.data<T>(), dk.data<T>(), dv.data<T>(), d);
  });
}

}  // namespace fourbit::ops::cpu
