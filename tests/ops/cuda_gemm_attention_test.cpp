// defines: tests of the CUDA GEMM and attention against the CPU backend (skipped without a GPU):
// every operand format pair within a similarity bound, NVFP4 outer scales applied after the sum,
// accumulate mode, batch invariance of GEMM rows (M = 1 .. 4096) with a split-K negative
// control, and attention forward/backward within the BF16-attention tolerance: the fused kernels
// against the CPU and the materialized path, and bitwise the same rows in a batch, alone, and in
// KV-cache decode (a CTA per q head or per kv head group) and chunked prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "ops/op_test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

Tensor randn(const Shape& s, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = nd(g) * scale;
  return Tensor::from_host(v.data(), s, DType::F32);
}

// DeepGEMM-style similarity: 1 - 2<x,y> / (|x|^2 + |y|^2); 0 for identical tensors.
double diff(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  double xy = 0, xx = 0, yy = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double p = x.data<float>()[i], q = y.data<float>()[i];
    xy += p * q;
    xx += p * p;
    yy += q * q;
  }
  return 1.0 - 2.0 * xy / (xx + yy);
}

QuantSpec spec(Format f, OuterScale outer = OuterScale::None, BlockAxis axis = BlockAxis::Row) {
  QuantSpec s;
  s.fmt = f;
  s.outer = outer;
  s.axis = axis;
  return s;
}

}  // namespace

TEST(CudaGemm, QuantizedOperandsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Tensor x = randn({200, 96}, 1), w = randn({72, 96}, 2, 0.05f);
  struct Case {
    QuantSpec a, b;
  };
  const std::vector<Case> cases = {
      {spec(Format::NVFP4, OuterScale::PerRow), spec(Format::NVFP4, OuterScale::Tensor)},
      {spec(Format::NVFP4, OuterScale::Tensor), spec(Format::NVFP4, OuterScale::PerRow)},
      {spec(Format::MXFP8_E4M3), spec(Format::MXFP8_E4M3)},
      {spec(Format::MXFP8_E5M2), spec(Format::MXFP8_E4M3)},
  };
  for (const Case& c : cases) {
    const QTensor qa = ops::quantize(x, c.a), qb = ops::quantize(w, c.b);
    Tensor cpu = Tensor::empty({200, 72}, DType::F32);
    ops::gemm(qa, qb, cpu);
    const QTensor ga = qa.to(Device::CUDA), gb = qb.to(Device::CUDA);
    Tensor gpu = Tensor::empty({200, 72}, DType::F32, Device::CUDA);
    ops::gemm(ga, gb, gpu);
    // the same exact operand values, only the FP32 accumulation order differs
    EXPECT_LT(diff(cpu, gpu), 1e-9) << format_name(c.a.fmt) << " x " << format_name(c.b.fmt);
    // accumulate: C += A.B^T
    ops::gemm(ga, gb, gpu, true);
    Tensor twice = cpu.clone();
    ops::add_(twice, cpu);
    EXPECT_LT(diff(twice, gpu), 1e-9);
  }
}

// The decode into BF16 in front of cuBLASLt must give exactly the dequantized values: a GEMM on
// block-scaled operands equals, bit for bit, the GPU GEMM on BF16 copies of their dequantized
// values (zero-padded to the same K). Covers the vectorised BF16 decode and its zero tail
// (NVFP4 A padded to 112 columns against MXFP8 B padded to 128).
TEST(CudaGemm, DecodeGivesExactlyTheDequantizedValues) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (ops::native_block_scaled_gemm(Device::CUDA)) GTEST_SKIP() << "this GPU multiplies the packed operands natively";
  struct Case {
    QuantSpec a, b;
    int64_t k;
  };
  const std::vector<Case> cases = {
      {spec(Format::NVFP4), spec(Format::NVFP4), 128},
      {spec(Format::MXFP8_E4M3), spec(Format::MXFP8_E4M3), 128},
      {spec(Format::MXFP8_E5M2), spec(Format::MXFP8_E4M3), 96},
      {spec(Format::NVFP4), spec(Format::MXFP8_E4M3), 100},
  };
  for (const Case& c : cases) {
    const Tensor x = randn({192, c.k}, 11, 3.0f), w = randn({72, c.k}, 12, 0.05f);
    const QTensor qa = ops::quantize(x, c.a), qb = ops::quantize(w, c.b);
    const int64_t k_eff = std::max(qa.padded_cols(), qb.padded_cols());
    auto dense_bf16 = [&](const QTensor& q, int64_t rows) {
      const Tensor d = ops::dequantize(q);
      std::vector<float> padded(size_t(rows * k_eff), 0.0f);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < c.k; ++j) padded[size_t(r * k_eff + j)] = d.data<float>()[r * c.k + j];
      Tensor t = Tensor::from_host(padded.data(), {rows, k_eff}, DType::F32), t16 = Tensor::empty({rows, k_eff}, DType::BF16);
      ops::convert(t, t16);
      return t16.to(Device::CUDA);
    };
    Tensor from_q = Tensor::empty({192, 72}, DType::F32, Device::CUDA), from_d = from_q.clone();
    ops::gemm(qa.to(Device::CUDA), qb.to(Device::CUDA), from_q);
    ops::gemm(dense_bf16(qa, 192), dense_bf16(qb, 72), from_d);
    const Tensor hq = from_q.to(Device::CPU), hd = from_d.to(Device::CPU);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < hq.numel(); ++i)
      mismatches += hq.data<float>()[i] == hd.data<float>()[i] ? 0 : 1;
    EXPECT_EQ(mismatches, 0) << format_name(c.a.fmt) << " x " << format_name(c.b.fmt) << " K=" << c.k;
  }
}

TEST(CudaGemm, DenseFormatsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Tensor a = randn({130, 64}, 3), b = randn({40, 64}, 4), at = randn({64, 130}, 5);
  for (bool trans : {false, true}) {
    const Tensor& A = trans ? at : a;
    Tensor cpu = Tensor::empty({130, 40}, DType::F32), gpu = Tensor::empty({130, 40}, DType::F32, Device::CUDA);
    ops::gemm(ops::Operand(A, trans), b, cpu);
    const Tensor ga = A.to(Device::CUDA), gb = b.to(Device::CUDA);
    ops::gemm(ops::Operand(ga, trans), gb, gpu);
    EXPECT_LT(diff(cpu, gpu), 1e-10) << "fp32 trans=" << trans;  // true FP32, no TF32
    // BF16 operands
    Tensor a16 = Tensor::empty(A.shape(), DType::BF16), b16 = Tensor::empty(b.shape(), DType::BF16);
    ops::convert(A, a16);
    ops::convert(b, b16);
    ops::gemm(ops::Operand(a16, trans), b16, cpu);
    const Tensor ga16 = a16.to(Device::CUDA), gb16 = b16.to(Device::CUDA);
    ops::gemm(ops::Operand(ga16, trans), gb16, gpu);
    EXPECT_LT(diff(cpu, gpu), 1e-9) << "bf16 trans=" << trans;
  }
}

TEST(CudaGemm, RowsAreBatchInvariant) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t K = 1024, N = 512;
  const Tensor big = randn({4096, K}, 6).to(Device::CUDA), w = randn({N, K}, 7, 0.03f).to(Device::CUDA);
  Tensor a16 = Tensor::empty(big.shape(), DType::BF16, Device::CUDA), w16 = Tensor::empty(w.shape(), DType::BF16, Device::CUDA);
  ops::convert(big, a16);
  ops::convert(w, w16);
  Tensor full = Tensor::empty({4096, N}, DType::F32, Device::CUDA);
  ops::gemm(a16, w16, full);
  const Tensor full_h = full.to(Device::CPU);
  for (int64_t M : {1, 3, 64, 1000}) {
    Tensor part = Tensor::empty({M, N}, DType::F32, Device::CUDA);
    const Tensor rows = a16.slice_rows(0, M);
    ops::gemm(rows, w16, part);
    const Tensor ph = part.to(Device::CPU);
    EXPECT_EQ(0, std::memcmp(ph.data<float>(), full_h.data<float>(), size_t(M * N) * 4)) << "M=" << M;
  }
  // Negative control: a split-K GEMM (two halves, then added) changes the bits of some rows.
  Tensor lo = Tensor::empty({4096, N}, DType::F32, Device::CUDA), hi = Tensor::empty({4096, N}, DType::F32, Device::CUDA);
  Tensor a_lo = Tensor::empty({4096, K / 2}, DType::BF16, Device::CUDA), a_hi = a_lo.clone();
  Tensor w_lo = Tensor::empty({N, K / 2}, DType::BF16, Device::CUDA), w_hi = w_lo.clone();
  {
    const Tensor bh = a16.to(Device::CPU), wh = w16.to(Device::CPU);
    Tensor al = Tensor::empty({4096, K / 2}, DType::BF16), ah = al.clone(), wl = Tensor::empty({N, K / 2}, DType::BF16),
           whh = wl.clone();
    for (int64_t r = 0; r < 4096; ++r)
      for (int64_t k = 0; k < K / 2; ++k) {
        al.data<uint16_t>()[r * K / 2 + k] = bh.data<uint16_t>()[r * K + k];
        ah.data<uint16_t>()[r * K / 2 + k] = bh.data<uint16_t>()[r * K + K / 2 + k];
      }
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < K / 2; ++k) {
        wl.data<uint16_t>()[r * K / 2 + k] = wh.data<uint16_t>()[r * K + k];
        whh.data<uint16_t>()[r * K / 2 + k] = wh.data<uint16_t>()[r * K + K / 2 + k];
      }
    a_lo = al.to(Device::CUDA);
    a_hi = ah.to(Device::CUDA);
    w_lo = wl.to(Device::CUDA);
    w_hi = whh.to(Device::CUDA);
  }
  ops::gemm(a_lo, w_lo, lo);
  ops::gemm(a_hi, w_hi, hi);
  ops::add_(lo, hi);
  const Tensor split = lo.to(Device::CPU);
  EXPECT_NE(0, std::memcmp(split.data<float>(), full_h.data<float>(), size_t(4096 * N) * 4))
      << "split-K should change some bits: the invariance check would be vacuous";
}

// Four shapes: the fused kernels in one partial tile (T = 40, hd = 32), over three tiles with
// a partial last one (T = 130, hd = 64) and at hd = 128 (T = 70), and the materialized path's
// scalar fallbacks (hd = 6, T = 37).
TEST(CudaAttention, ForwardBackwardMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const auto& [T, hd] : {std::pair<int64_t, int64_t>{40, 32}, {130, 64}, {70, 128}, {37, 6}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " hd=" + std::to_string(hd));
    const int64_t B = 2, Hq = 4, Hkv = 2;
    const Tensor q = randn({B, T, Hq, hd}, 8), k = randn({B, T, Hkv, hd}, 9), v = randn({B, T, Hkv, hd}, 10);
    Tensor out = Tensor::empty(q.shape(), DType::F32), lse = Tensor::empty({B, Hq, T}, DType::F32);
    ops::attention_forward(q, k, v, 0, out, lse);
    const Tensor gq = q.to(Device::CUDA), gk = k.to(Device::CUDA), gv = v.to(Device::CUDA);
    Tensor gout = Tensor::empty(q.shape(), DType::F32, Device::CUDA), glse = Tensor::empty({B, Hq, T}, DType::F32, Device::CUDA);
    ops::attention_forward(gq, gk, gv, 0, gout, glse);
    EXPECT_LT(diff(out, gout), 1e-4);  // BF16 Q, K, V and P on the GPU
    EXPECT_LT(diff(lse, glse), 1e-4);
    const Tensor dout = randn(q.shape(), 11);
    Tensor dq = Tensor::empty(q.shape(), DType::F32), dk = Tensor::empty(k.shape(), DType::F32), dv = dk.clone();
    ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv);
    const Tensor gdout = dout.to(Device::CUDA);
    Tensor gdq = Tensor::empty(q.shape(), DType::F32, Device::CUDA), gdk = Tensor::empty(k.shape(), DType::F32, Device::CUDA),
           gdv = gdk.clone();
    ops::attention_backward(gdout, gq, gk, gv, gout, glse, gdq, gdk, gdv);
    EXPECT_LT(diff(dq, gdq), 1e-3);
    EXPECT_LT(diff(dk, gdk), 1e-3);
    EXPECT_LT(diff(dv, gdv), 1e-3);
  }
}

TEST(CudaAttention, SequenceAloneEqualsSequenceInBatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 8, T = 64, Hq = 4, Hkv = 4, hd = 64;
  const Tensor q = randn({B, T, Hq, hd}, 12).to(Device::CUDA), k = randn({B, T, Hkv, hd}, 13).to(Device::CUDA),
               v = randn({B, T, Hkv, hd}, 14).to(Device::CUDA);
  Tensor out = Tensor::empty(q.shape(), DType::F32, Device::CUDA), lse = Tensor::empty({B, Hq, T}, DType::F32, Device::CUDA);
  ops::attention_forward(q, k, v, 0, out, lse);
  const Tensor q1 = q.slice_rows(3, 4), k1 = k.slice_rows(3, 4), v1 = v.slice_rows(3, 4);
  Tensor out1 = Tensor::empty(q1.shape(), DType::F32, Device::CUDA), lse1 = Tensor::empty({1, Hq, T}, DType::F32, Device::CUDA);
  ops::attention_forward(q1, k1, v1, 0, out1, lse1);
  const Tensor all = out.to(Device::CPU), one = out1.to(Device::CPU);
  EXPECT_EQ(0, std::memcmp(one.data<float>(), all.data<float>() + 3 * T * Hq * hd, size_t(T * Hq * hd) * 4));
}

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && optest::bitwise_equal(a.to(Device::CPU), b.to(Device::CPU));
}

// lse rows t0 .. t0+n-1 of every (b, h) of a [B, H, T] tensor, as [B, H, n].
Tensor lse_rows(const Tensor& lse, int64_t t0, int64_t n) {
  const Tensor h = lse.to(Device::CPU);
  const int64_t BH = h.size(0) * h.size(1), T = h.size(2);
  Tensor out = Tensor::empty({h.size(0), h.size(1), n}, DType::F32);
  for (int64_t i = 0; i < BH; ++i) out.view(i * n, {n}).copy_from(h.view(i * T + t0, {n}));
  return out;
}

}  // namespace

TEST(CudaAttention, SequenceBackwardAloneEqualsInBatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 4, T = 100, Hq = 4, Hkv = 2, hd = 64;
  const Tensor q = randn({B, T, Hq, hd}, 31), k = randn({B, T, Hkv, hd}, 32), v = randn({B, T, Hkv, hd}, 33),
               dout = randn({B, T, Hq, hd}, 34);
  auto grads = [&](int64_t b0, int64_t n) {
    const Tensor gq = q.slice_rows(b0, b0 + n).to(Device::CUDA), gk = k.slice_rows(b0, b0 + n).to(Device::CUDA),
                 gv = v.slice_rows(b0, b0 + n).to(Device::CUDA), gd = dout.slice_rows(b0, b0 + n).to(Device::CUDA);
    Tensor out = Tensor::empty(gq.shape(), DType::F32, Device::CUDA), lse = Tensor::empty({n, Hq, T}, DType::F32, Device::CUDA);
    ops::attention_forward(gq, gk, gv, 0, out, lse);
    Tensor dq = Tensor::empty(gq.shape(), DType::F32, Device::CUDA), dk = Tensor::empty(gk.shape(), DType::F32, Device::CUDA),
           dv = dk.clone();
    ops::attention_backward(gd, gq, gk, gv, out, lse, dq, dk, dv);
    return std::vector<Tensor>{dq.to(Device::CPU), dk.to(Device::CPU), dv.to(Device::CPU)};
  };
  const std::vector<Tensor> all = grads(0, B), one = grads(2, 1);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(same_bits(one[i], all[i].slice_rows(2, 3))) << "gradient " << i;
  const std::vector<Tensor> again = grads(0, B);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(same_bits(again[i], all[i])) << "rerun, gradient " << i;
}

// A token's attention output and lse are the same bits in the full forward, in a one-token
// KV-cache decode step and in a prefill chunk that starts mid-block (the fused kernels' key
// blocks sit at absolute positions).
TEST(CudaAttention, DecodeAndPrefillEqualFullForwardRows) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t hd : {64, 128}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    const int64_t B = 2, T = 150, Hq = 4, Hkv = 1;
    const Tensor q = randn({B, T, Hq, hd}, 41), k = randn({B, T, Hkv, hd}, 42), v = randn({B, T, Hkv, hd}, 43);
    auto forward = [&](int64_t t0, int64_t t1, int64_t keys) {
      const Tensor gq = optest::time_slice(q, t0, t1).to(Device::CUDA), gk = optest::time_slice(k, 0, keys).to(Device::CUDA),
                   gv = optest::time_slice(v, 0, keys).to(Device::CUDA);
      Tensor out = Tensor::empty(gq.shape(), DType::F32, Device::CUDA), lse = Tensor::empty({B, Hq, t1 - t0}, DType::F32, Device::CUDA);
      ops::attention_forward(gq, gk, gv, t0, out, lse);
      return std::pair<Tensor, Tensor>{out.to(Device::CPU), lse.to(Device::CPU)};
    };
    const auto [full, full_lse] = forward(0, T, T);
    for (int64_t t : {0, 1, 63, 64, 65, 127, 149}) {
      const auto [o, l] = forward(t, t + 1, t + 1);
      EXPECT_TRUE(same_bits(o, optest::time_slice(full, t, t + 1))) << "decode t=" << t;
      EXPECT_TRUE(same_bits(l, lse_rows(full_lse, t, 1))) << "decode lse t=" << t;
    }
    for (const auto& [t0, t1] : {std::pair<int64_t, int64_t>{37, 101}, {64, 150}}) {
      const auto [o, l] = forward(t0, t1, T);  // keys past t1 exist and are masked
      EXPECT_TRUE(same_bits(o, optest::time_slice(full, t0, t1))) << "prefill " << t0;
      EXPECT_TRUE(same_bits(l, lse_rows(full_lse, t0, t1 - t0))) << "prefill lse " << t0;
    }
  }
}

// BF16 operands (ops.h): q, k, v passed as their BF16 roundings give the bits of passing them as
// F32, forward and backward, on the fused kernels (hd 64, 128) and the materialized path (hd 6);
// out_bf16 is out rounded; dout, out and the gradients must stay F32.
TEST(CudaAttention, Bf16OperandsGiveTheBitsOfF32Operands) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(ops::attention_reads_bf16(Device::CUDA));
  ASSERT_FALSE(ops::attention_reads_bf16(Device::CPU));
  auto bf16 = [](const Tensor& t) {
    Tensor b = Tensor::empty(t.shape(), DType::BF16, Device::CUDA);
    ops::convert(t, b);
    return b;
  };
  for (const auto& [T, hd] : {std::pair<int64_t, int64_t>{130, 64}, {70, 128}, {37, 6}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " hd=" + std::to_string(hd));
    const int64_t B = 2, Hq = 4, Hkv = 2;
    const Tensor q = randn({B, T, Hq, hd}, 61).to(Device::CUDA), k = randn({B, T, Hkv, hd}, 62).to(Device::CUDA),
                 v = randn({B, T, Hkv, hd}, 63).to(Device::CUDA), dout = randn({B, T, Hq, hd}, 64).to(Device::CUDA);
    struct Run {
      Tensor out, lse, out16, dq, dk, dv;
    };
    auto run = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv) {
      Run r{Tensor::empty(q.shape(), DType::F32, Device::CUDA), Tensor::empty({B, Hq, T}, DType::F32, Device::CUDA),
            Tensor::empty(q.shape(), DType::BF16, Device::CUDA), Tensor::empty(q.shape(), DType::F32, Device::CUDA),
            Tensor::empty(k.shape(), DType::F32, Device::CUDA), Tensor::empty(k.shape(), DType::F32, Device::CUDA)};
      ops::attention_forward(qq, kk, vv, 0, r.out, r.lse, &r.out16);
      ops::attention_backward(dout, qq, kk, vv, r.out, r.lse, r.dq, r.dk, r.dv);
      return r;
    };
    const Run f = run(q, k, v), b = run(bf16(q), bf16(k), bf16(v));
    EXPECT_TRUE(same_bits(b.out, f.out));
    EXPECT_TRUE(same_bits(b.lse, f.lse));
    EXPECT_TRUE(same_bits(f.out16, bf16(f.out))) << "out_bf16 is out rounded";
    EXPECT_TRUE(same_bits(b.out16, f.out16));
    EXPECT_TRUE(same_bits(b.dq, f.dq));
    EXPECT_TRUE(same_bits(b.dk, f.dk));
    EXPECT_TRUE(same_bits(b.dv, f.dv));
    Tensor out_plain = Tensor::empty(q.shape(), DType::F32, Device::CUDA), lse_plain = f.lse.clone();
    ops::attention_forward(q, k, v, 0, out_plain, lse_plain);
    EXPECT_TRUE(same_bits(out_plain, f.out)) << "out without out_bf16";
  }
  const int64_t B = 1, T = 8, H = 2, hd = 64;
  const Tensor q = randn({B, T, H, hd}, 65).to(Device::CUDA);
  Tensor out = Tensor::empty(q.shape(), DType::F32, Device::CUDA), lse = Tensor::empty({B, H, T}, DType::F32, Device::CUDA);
  std::string err;
  try {
    ops::attention_forward(bf16(q), q, q, 0, out, lse);
  } catch (const std::exception& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("q, k, v must all be f32, or all bf16"), std::string::npos) << err;
  err.clear();
  Tensor dq = out.clone(), dk = out.clone(), dv = out.clone();
  const Tensor qb = bf16(q);
  try {
    ops::attention_backward(qb, qb, qb, qb, out, lse, dq, dk, dv);
  } catch (const std::exception& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("dout, out, lse, dq, dk and dv must be f32"), std::string::npos) << err;
}

#if FOURBIT_HAS_CUDA
// The fused kernels against the materialized path on a training-sized shape (both BF16
// attention; they differ in where P is rounded: unnormalized in the fused kernels).
TEST(CudaAttention, FusedMatchesMaterialized) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t hd : {32, 64, 128}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    const int64_t B = 2, T = 320, Hq = 8, Hkv = 2;
    const Tensor q = randn({B, T, Hq, hd}, 51).to(Device::CUDA), k = randn({B, T, Hkv, hd}, 52).to(Device::CUDA),
                 v = randn({B, T, Hkv, hd}, 53).to(Device::CUDA), dout = randn({B, T, Hq, hd}, 54).to(Device::CUDA);
    Tensor out[2], lse[2], dq[2], dk[2], dv[2];
    for (int i = 0; i < 2; ++i) {
      out[i] = Tensor::empty(q.shape(), DType::F32, Device::CUDA);
      lse[i] = Tensor::empty({B, Hq, T}, DType::F32, Device::CUDA);
      dq[i] = Tensor::empty(q.shape(), DType::F32, Device::CUDA);
      dk[i] = Tensor::empty(k.shape(), DType::F32, Device::CUDA);
      dv[i] = Tensor::empty(k.shape(), DType::F32, Device::CUDA);
    }
    ASSERT_TRUE(ops::cuda::flash_attention_forward(q, k, v, 0, out[0], lse[0]));
    ops::cuda::materialized_attention_forward(q, k, v, 0, out[1], lse[1]);
    EXPECT_LT(diff(out[0], out[1]), 1e-5);
    EXPECT_LT(diff(lse[0], lse[1]), 1e-7);
    ops::attention_backward(dout, q, k, v, out[0], lse[0], dq[0], dk[0], dv[0]);  // fused (hd 32 / 64 / 128)
    ops::cuda::materialized_attention_backward(dout, q, k, v, out[1], lse[1], dq[1], dk[1], dv[1]);
    EXPECT_LT(diff(dq[0], dq[1]), 1e-4);
    EXPECT_LT(diff(dk[0], dk[1]), 1e-4);
    EXPECT_LT(diff(dv[0], dv[1]), 1e-5);
  }
}

// The wgmma engine (Hopper) in each CTA shape against the mma.sync one, on the same kernels: the
// shapes run each row's blocks in the same order, so they give the same bits, also for one-token
// KV-cache decode steps; mma.sync reads the same BF16 operands in the same order, so only the
// tensor cores' internal sums may differ, and a tile-layout or descriptor mistake would be far
// outside that bound. T = 130 leaves the second warpgroup of a two-warpgroup CTA without a valid
// row, T = 200 ends mid-tile. Outputs start as NaN, so an element a shape leaves unwritten fails.
TEST(CudaAttention, EnginesAndCtaShapesAgree) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::wgmma_available()) GTEST_SKIP() << "not a Hopper device with sm_90a code";
  struct Restore {
    ~Restore() {
      ops::cuda::set_flash_wgmma(true);
      ops::cuda::set_flash_cta(1, 2);
    }
  } restore;
  auto nans = [](const Shape& shape) {
    const std::vector<float> v(size_t(shape_numel(shape)), std::numeric_limits<float>::quiet_NaN());
    return Tensor::from_host(v.data(), shape, DType::F32, Device::CUDA);
  };
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  for (const int64_t hd : {64, 128})
    for (const int64_t T : {130, 200}) {
      SCOPED_TRACE("hd=" + std::to_string(hd) + " T=" + std::to_string(T));
      const int64_t B = 2, Hq = 4, Hkv = 2;
      const Tensor hq = randn({B, T, Hq, hd}, 61), hk = randn({B, T, Hkv, hd}, 62), hv = randn({B, T, Hkv, hd}, 63);
      const Tensor q = hq.to(Device::CUDA), k = hk.to(Device::CUDA), v = hv.to(Device::CUDA),
                   dout = randn({B, T, Hq, hd}, 64).to(Device::CUDA);
      auto run = [&] {
        Tensor out = nans(q.shape()), lse = nans({B, Hq, T});
        EXPECT_TRUE(ops::cuda::flash_attention_forward(q, k, v, 0, out, lse));
        Tensor dq = nans(q.shape()), dk = nans(k.shape()), dv = nans(k.shape());
        ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv);
        return std::vector<Tensor>{out, lse, dq, dk, dv};
      };
      // token t alone, attending over the keys up to it (pos0 = t): the full forward's row t
      auto decode_matches = [&](const std::vector<Tensor>& full, int64_t t) {
        const Tensor gq = optest::time_slice(hq, t, t + 1).to(Device::CUDA),
                     gk = optest::time_slice(hk, 0, t + 1).to(Device::CUDA),
                     gv = optest::time_slice(hv, 0, t + 1).to(Device::CUDA);
        Tensor out = nans(gq.shape()), lse = nans({B, Hq, 1});
        EXPECT_TRUE(ops::cuda::flash_attention_forward(gq, gk, gv, t, out, lse));
        return same_bits(out, optest::time_slice(full[0].to(Device::CPU), t, t + 1)) &&
               same_bits(lse, lse_rows(full[1], t, 1));
      };
      ops::cuda::set_flash_cta(1, 2);
      const std::vector<Tensor> ref = run();
      for (const auto& [wg, st] : {std::pair<int, int>{1, 2}, {1, 3}, {2, 2}, {2, 3}}) {
        ops::cuda::set_flash_cta(wg, st);
        const std::vector<Tensor> got = run();
        for (size_t i = 0; i < 5; ++i)
          EXPECT_TRUE(same_bits(got[i], ref[i])) << names[i] << ", " << wg << " warpgroups, " << st << " stages";
        for (const int64_t t : {int64_t(0), int64_t(63), int64_t(64), T - 1})
          EXPECT_TRUE(decode_matches(ref, t)) << "decode t=" << t << ", " << wg << " warpgroups, " << st << " stages";
      }
      ops::cuda::set_flash_cta(1, 2);
      ops::cuda::set_flash_wgmma(false);
      const std::vector<Tensor> sync = run();
      ops::cuda::set_flash_wgmma(true);
      for (size_t i = 0; i < 5; ++i) EXPECT_LT(diff(sync[i], ref[i]), 1e-8) << names[i] << ", mma.sync";
    }
}

// A one-token step of grouped-query attention (the sampler's decode) runs a CTA per kv head with
// its group's q heads as rows (set_flash_head_rows): out, its BF16 copy and lse are the bits of a
// CTA per q head, for every head size, group size (2, 4, 8), position (the first key block, its
// last key, the next block's first, mid-block, the cache's end), both engines and every CTA shape.
// Outputs start as NaN, so a row the packed form leaves unwritten fails.
TEST(CudaAttention, OneTokenHeadRowsGiveTheBitsOfHeadCtas) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  struct Restore {
    ~Restore() {
      ops::cuda::set_flash_head_rows(true);
      ops::cuda::set_flash_wgmma(true);
      ops::cuda::set_flash_cta(1, 2);
    }
  } restore;
  auto nans = [](const Shape& shape, DType dt) {
    const std::vector<float> v(size_t(shape_numel(shape)), std::numeric_limits<float>::quiet_NaN());
    Tensor f = Tensor::from_host(v.data(), shape, DType::F32, Device::CUDA);
    if (dt == DType::F32) return f;
    Tensor b = Tensor::empty(shape, dt, Device::CUDA);
    ops::convert(f, b);
    return b;
  };
  const int64_t B = 3, S = 200, Hkv = 2;
  for (const int64_t hd : {32, 64, 128})
    for (const int64_t group : {2, 4, 8}) {
      const int64_t Hq = Hkv * group;
      const Tensor q = randn({B, 1, Hq, hd}, 71).to(Device::CUDA), k = randn({B, S, Hkv, hd}, 72).to(Device::CUDA),
                   v = randn({B, S, Hkv, hd}, 73).to(Device::CUDA);
      for (const int64_t pos0 : {0, 63, 64, 130, 199})
        for (const bool wgmma : {true, false})
          for (const auto& [wg, st] : {std::pair<int, int>{1, 2}, {2, 3}}) {
            if (!wgmma && (wg != 1 || st != 2)) continue;  // mma.sync has one CTA shape
            SCOPED_TRACE("hd=" + std::to_string(hd) + " group=" + std::to_string(group) + " pos0=" +
                         std::to_string(pos0) + (wgmma ? " wgmma " : " mma.sync ") + std::to_string(wg) + "x" +
                         std::to_string(st));
            ops::cuda::set_flash_wgmma(wgmma);
            ops::cuda::set_flash_cta(wg, st);
            std::vector<std::vector<float>> results;
            for (const bool head_rows : {false, true}) {
              ops::cuda::set_flash_head_rows(head_rows);
              Tensor out = nans(q.shape(), DType::F32), lse = nans({B, Hq, 1}, DType::F32),
                     out16 = nans(q.shape(), DType::BF16);
              ASSERT_TRUE(ops::cuda::flash_attention_forward(q, k, v, pos0, out, lse, &out16));
              Tensor out16_f = Tensor::empty(q.shape(), DType::F32, Device::CUDA);
              ops::convert(out16, out16_f);
              std::vector<float> all;
              for (const Tensor* t : {&out, &lse, &out16_f}) {
                const Tensor h = t->to(Device::CPU);
                all.insert(all.end(), h.data<float>(), h.data<float>() + h.numel());
              }
              for (float x : all) ASSERT_FALSE(std::isnan(x)) << "an output left unwritten, head_rows " << head_rows;
              results.push_back(std::move(all));
            }
            EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)));
          }
    }
}
#endif

// Work spread over GPU lanes gives the bits of the same work issued in order: 16 "experts" of
// different row counts, each quantizing its rows (MXFP8 with SR along the tokens, NVFP4 per
// token) and running two GEMMs into its own rows, with temporaries freed inside the lanes.
TEST(CudaLanes, ExpertLoopEqualsSequentialLoop) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t D = 256, F = 192, E = 16;
  std::vector<int64_t> offsets{0};
  for (int64_t e = 0; e < E; ++e) offsets.push_back(offsets.back() + 8 + 37 * ((e * 7) % 11));
  const int64_t rows = offsets.back();
  const Tensor x = randn({rows, D}, 21).to(Device::CUDA), w = randn({E, F, D}, 22, 0.05f).to(Device::CUDA);
  QuantSpec tok = spec(Format::NVFP4, OuterScale::PerRow), wq = spec(Format::NVFP4, OuterScale::PerSlice);
  QuantSpec col = spec(Format::MXFP8_E4M3, OuterScale::None, BlockAxis::Col);
  col.rounding = num::Rounding::SR;
  const QTensor qw = ops::quantize(w, wq);
  auto run = [&](int lanes_n) {
    Tensor h = Tensor::empty({rows, F}, DType::F32, Device::CUDA);
    Tensor g = Tensor::empty({E, F, F}, DType::F32, Device::CUDA);
    ops::fill_(g, 0.0);
    ops::Lanes lanes(Device::CUDA, lanes_n);
    for (int64_t e = 0; e < E; ++e) {
      lanes.use(e);
      const Tensor xe = x.slice_rows(offsets[e], offsets[e + 1]);
      Tensor he = h.slice_rows(offsets[e], offsets[e + 1]);
      ops::gemm(ops::quantize(xe, tok), ops::qtensor_slice(qw, e), he);
      const QTensor ht = ops::quantize(he, col, ops::RngKey{7, uint64_t(e)});
      Tensor ge = g.view(e * F * F, {F, F});
      ops::gemm(ht, ht, ge, true);
    }
    return std::make_pair(h, g);
  };
  const auto [h1, g1] = run(1);
  const auto [h4, g4] = run(4);
  device_synchronize();
  for (const auto& [a, b] : {std::make_pair(h1, h4), std::make_pair(g1, g4)}) {
    const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
    EXPECT_EQ(0, std::memcmp(ha.data<float>(), hb.data<float>(), size_t(ha.nbytes())));
  }
}

// A grouped GEMM (one decode per operand, one launch of the grouped kernel for BF16 and decoded
// block-scaled operands or the groups' cuBLASLt GEMMs on lanes for FP32 and a transposed B, one
// epilogue) gives each group the bits it gets when that group is the only one with rows (the
// sampler's decode sees few rows of few experts, the trainer many of all), for every operand kind
// the model hands it, with empty groups; and each group is within the GEMM tolerance of one
// cuBLASLt gemm of that group.
TEST(CudaGroupedGemm, EachGroupAsIfAlone) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t K = 96, N = 40, G = 6;
  const std::vector<int64_t> offsets{0, 37, 37, 140, 141, 141, 200};
  const Tensor x = randn({200, K}, 31).to(Device::CUDA), w = randn({G, N, K}, 32, 0.05f).to(Device::CUDA);
  const Tensor wt = randn({G, K, N}, 33, 0.05f).to(Device::CUDA);  // a transposed dense B
  Tensor x16 = Tensor::empty(x.shape(), DType::BF16, Device::CUDA), w16 = Tensor::empty(w.shape(), DType::BF16, Device::CUDA),
         wt16 = Tensor::empty(wt.shape(), DType::BF16, Device::CUDA);
  ops::convert(x, x16);
  ops::convert(w, w16);
  ops::convert(wt, wt16);
  const QTensor xq = ops::quantize(x, spec(Format::NVFP4, OuterScale::PerRow));
  const QTensor wq = ops::quantize(w, spec(Format::NVFP4, OuterScale::PerSlice));
  const QTensor xm = ops::quantize(x, spec(Format::MXFP8_E4M3)), wm = ops::quantize(w, spec(Format::MXFP8_E4M3));
  struct Case {
    const char* name;
    ops::Operand a, b;
    bool b_trans3d;
  };
  const std::vector<Case> cases = {
      {"nvfp4", ops::Operand(xq), ops::Operand(wq), false},
      {"mxfp8", ops::Operand(xm), ops::Operand(wm), false},
      {"bf16", ops::Operand(x16), ops::Operand(w16), false},
      {"bf16 transposed B", ops::Operand(x16), ops::Operand(wt16, true), true},
      {"fp32", ops::Operand(x), ops::Operand(w), false},
  };
  for (const Case& c : cases) {
    for (bool acc : {false, true}) {
      const Tensor init = randn({200, N}, 34).to(Device::CUDA);
      Tensor grouped = init.clone(), alone = init.clone(), looped = init.clone();
      ops::grouped_gemm(c.a, c.b, offsets, grouped, acc);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r0 = offsets[size_t(g)], r1 = offsets[size_t(g) + 1];
        if (r0 == r1) continue;
        QTensor qa, qb;
        Tensor da, db;
        if (c.a.q()) qa = ops::qtensor_rows(*c.a.q(), r0, r1);
        else da = c.a.dense()->slice_rows(r0, r1);
        const ops::Operand ag = c.a.q() ? ops::Operand(qa) : ops::Operand(da);
        // group g alone: its rows only, every other group empty
        std::vector<int64_t> only(size_t(G) + 1, 0);
        for (int64_t h = g + 1; h <= G; ++h) only[size_t(h)] = r1 - r0;
        Tensor cg = alone.slice_rows(r0, r1);
        ops::grouped_gemm(ag, c.b, only, cg, acc);
        if (c.b.q()) qb = ops::qtensor_slice(*c.b.q(), g);
        else db = c.b.dense()->view(g * N * K, c.b_trans3d ? Shape{K, N} : Shape{N, K});
        Tensor lg = looped.slice_rows(r0, r1);
        ops::gemm(ag, c.b.q() ? ops::Operand(qb) : ops::Operand(db, c.b_trans3d), lg, acc);
      }
      const Tensor hg = grouped.to(Device::CPU), ha = alone.to(Device::CPU);
      EXPECT_EQ(0, std::memcmp(hg.data<float>(), ha.data<float>(), size_t(hg.nbytes()))) << c.name << " acc=" << acc;
      EXPECT_LT(diff(grouped, looped), 1e-6) << c.name << " acc=" << acc;
    }
  }
}

// A batch of independent GEMMs (each distinct quantized operand decoded once, all decodes in one
// launch per format, the GEMMs on lanes) gives the bits of one gemm per job: the MoE weight-
// gradient shapes (Col-axis MXFP8 operands of several token counts, one B shared by two jobs),
// NVFP4 with per-row and per-tensor outer scales (the epilogue), E5M2, BF16 and FP32 dense
// operands, operands whose K is not a multiple of 8 (the generic decode), with and without
// accumulation, more decodes than one launch takes.
TEST(CudaGemmBatch, EqualsOneGemmPerJob) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t N = 48, M = 40;
  std::vector<Tensor> dense;  // keeps every operand alive
  std::vector<QTensor> quant;
  dense.reserve(256);
  quant.reserve(256);
  std::vector<ops::GemmJob> jobs;
  std::vector<Tensor> outs, want;
  outs.reserve(256);
  want.reserve(256);
  uint64_t seed = 100;
  auto add_job = [&](ops::Operand a, ops::Operand b, bool acc) {
    outs.push_back(randn({a.rows(), b.rows()}, seed++).to(Device::CUDA));
    want.push_back(outs.back().clone());
    jobs.push_back({a, b, &outs.back(), acc});
  };
  // The experts' weight gradients: K = tokens of the expert, Col-axis MXFP8 (E4M3 and E5M2).
  for (int64_t tokens : {1, 31, 64, 100, 250}) {
    for (Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2}) {
      dense.push_back(randn({tokens, M}, seed++).to(Device::CUDA));
      quant.push_back(ops::quantize(dense.back(), spec(f, OuterScale::None, BlockAxis::Col)));
      const QTensor& dy = quant.back();
      dense.push_back(randn({tokens, N}, seed++).to(Device::CUDA));
      quant.push_back(ops::quantize(dense.back(), spec(f, OuterScale::None, BlockAxis::Col)));
      const QTensor& x = quant.back();
      add_job(ops::Operand(dy), ops::Operand(x), true);
      add_job(ops::Operand(dy), ops::Operand(x), false);  // the same operands again
    }
  }
  for (OuterScale o : {OuterScale::PerRow, OuterScale::Tensor}) {
    dense.push_back(randn({M, 96}, seed++).to(Device::CUDA));
    quant.push_back(ops::quantize(dense.back(), spec(Format::NVFP4, o)));
    const QTensor& a = quant.back();
    dense.push_back(randn({N, 96}, seed++).to(Device::CUDA));
    quant.push_back(ops::quantize(dense.back(), spec(Format::NVFP4, o)));
    add_job(ops::Operand(a), ops::Operand(quant.back()), true);
  }
  dense.push_back(randn({M, 72}, seed++).to(Device::CUDA));
  const Tensor& a32 = dense.back();
  dense.push_back(randn({N, 72}, seed++).to(Device::CUDA));
  const Tensor& b32 = dense.back();
  add_job(ops::Operand(a32), ops::Operand(b32), true);  // FP32
  dense.push_back(Tensor::empty(a32.shape(), DType::BF16, Device::CUDA));
  ops::convert(a32, dense.back());
  const Tensor& a16 = dense.back();
  dense.push_back(Tensor::empty(b32.shape(), DType::BF16, Device::CUDA));
  ops::convert(b32, dense.back());
  add_job(ops::Operand(a16), ops::Operand(dense.back()), false);  // BF16
  // S2F6 and an MXFP8 operand with K = 20 (padded to 32): decoded one by one, as gemm does.
  dense.push_back(randn({M, 20}, seed++).to(Device::CUDA));
  quant.push_back(ops::quantize(dense.back(), spec(Format::MXFP8_E4M3)));
  const QTensor& odd = quant.back();
  dense.push_back(randn({N, 20}, seed++).to(Device::CUDA));
  quant.push_back(ops::quantize(dense.back(), spec(Format::S2F6)));
  add_job(ops::Operand(odd), ops::Operand(quant.back()), true);
  // More than 32 distinct decodes of one format: two launches.
  for (int i = 0; i < 20; ++i) {
    dense.push_back(randn({33, M}, seed++).to(Device::CUDA));
    quant.push_back(ops::quantize(dense.back(), spec(Format::MXFP8_E4M3, OuterScale::None, BlockAxis::Col)));
    const QTensor& a = quant.back();
    dense.push_back(randn({33, N}, seed++).to(Device::CUDA));
    quant.push_back(ops::quantize(dense.back(), spec(Format::MXFP8_E4M3, OuterScale::None, BlockAxis::Col)));
    add_job(ops::Operand(a), ops::Operand(quant.back()), true);
  }
  ASSERT_LE(outs.size(), 256u);
  ops::gemm_batch(jobs);
  for (size_t j = 0; j < jobs.size(); ++j) {
    ops::gemm(jobs[j].a, jobs[j].b, want[j], jobs[j].accumulate);
    const Tensor hg = outs[j].to(Device::CPU), hw = want[j].to(Device::CPU);
    EXPECT_EQ(0, std::memcmp(hg.data<float>(), hw.data<float>(), size_t(hg.nbytes()))) << "job " << j;
  }
}
