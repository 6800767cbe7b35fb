// defines: the CudaDistCodec tests: the payload kernels write the CPU's bytes (skipped without a
// GPU). Every encodable format (S2F6 with and without RHT-32, MXFP8 E4M3/E5M2, BF16, F32) on
// aligned and unaligned widths, through the identity, a gather and a segment map, with NaN/Inf,
// zero, tiny and huge chunks; the decodes bit for bit; NVFP4 and MXFP8 QTensor rows packed and
// unpacked; routing metadata; the fold of the ordered all-reduce; and an ep = 1 dispatch and
// combine of GPU tensors against the same on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fourbit/dist/codec.h"
#include "fourbit/dist/expert_parallel.h"
#include "fourbit/dist/local_group.h"
#include "fourbit/tensor/device_memory.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/dist/codec_cuda.h"
#endif

using namespace fourbit;
using namespace fourbit::dist;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

// Rows of mixed kinds: N(0,1) at scales 2^-12..2^12, zero rows and chunks, outlier channels,
// tiny (subnormal) and huge magnitudes, and a NaN and an Inf in two chunks.
Tensor mixed_rows(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  Tensor t = Tensor::empty({rows, cols}, DType::F32);
  float* x = t.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int kind = int(gen() % 8);
    const float scale = float(std::ldexp(1.0, int(gen() % 25) - 12));
    for (int64_t c = 0; c < cols; ++c) {
      float v = nd(gen) * scale;
      if (kind == 0) v = 0.0f;
      if (kind == 1 && (c / 32) % 2 == 0) v = 0.0f;
      if (kind == 2 && c % 32 == 5) v *= 40.0f;
      if (kind == 3) v = float(std::ldexp(nd(gen), -135));
      if (kind == 4) v = float(std::ldexp(std::clamp(nd(gen), -3.9f, 3.9f) * 0.49, 90 + int(gen() % 30)));
      x[r * cols + c] = v;
    }
  }
  if (rows > 3 && cols > 40) {
    x[2 * cols + 1] = std::numeric_limits<float>::quiet_NaN();
    x[3 * cols + 33] = -std::numeric_limits<float>::infinity();
  }
  return t;
}

Tensor meta_for(int64_t m) {
  Tensor t = Tensor::empty({m, 3}, DType::I32);
  for (int64_t i = 0; i < m; ++i) {
    t.data<int32_t>()[3 * i] = int32_t(7 * i);
    t.data<int32_t>()[3 * i + 1] = int32_t(i % 300);
    t.data<int32_t>()[3 * i + 2] = int32_t(i % 4);
  }
  return t;
}

// The first differing byte of two tensors (on any devices), or -1.
int64_t first_byte_difference(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  if (ha.nbytes() != hb.nbytes()) return 0;
  const auto* pa = static_cast<const uint8_t*>(ha.raw());
  const auto* pb = static_cast<const uint8_t*>(hb.raw());
  for (int64_t i = 0; i < ha.nbytes(); ++i)
    if (pa[i] != pb[i]) return i;
  return -1;
}

// The three maps of `m` payload rows over `rows` other rows, built on `dev`.
struct Maps {
  std::string name;
  RowMap map;
};
std::vector<Maps> maps_for(int64_t m, Device dev) {
  std::vector<int32_t> idx(static_cast<size_t>(m));
  // a permutation: 7 is coprime with every m used here (45, 30)
  for (int64_t i = 0; i < m; ++i) idx[size_t(i)] = int32_t((i * 7 + 3) % m);
  // three segments of the rows, the last one first, the middle one empty
  const int64_t a = m / 3;
  return {{"identity", RowMap()},
          {"gather", RowMap::gather(Tensor::from_host(idx.data(), {m}, DType::I32, dev))},
          {"segments", RowMap::segments({0, m - a, m - a, m}, {a, 0, 0}, dev)}};
}

TEST(CudaDistCodec, EncodeAndDecodeMatchTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<RowCodec> codecs{{Format::S2F6, 0, 32, 0xA5C3F00Fu}, {Format::S2F6, 0, 0, 0},
                                     {Format::MXFP8_E4M3, 0, 0, 0},     {Format::MXFP8_E5M2, 0, 0, 0},
                                     {Format::BF16, 0, 0, 0},            {Format::F32, 0, 0, 0}};
  for (int64_t cols : {40, 96, 1000, 1024})
    for (RowCodec c : codecs) {
      c.cols = cols;
      const int64_t m = 45;
      const Tensor x = mixed_rows(m, cols, uint32_t(cols));
      const Tensor meta = meta_for(m);
      const std::vector<Maps> cpu_maps = maps_for(m, Device::CPU), gpu_maps = maps_for(m, Device::CUDA);
      for (size_t k = 0; k < cpu_maps.size(); ++k) {
        SCOPED_TRACE(std::string(format_name(c.fmt)) + (c.hadamard ? "+rht" : "") + " cols " + std::to_string(cols) +
                     " map " + cpu_maps[k].name);
        const Tensor pc = encode_rows(x, cpu_maps[k].map, meta, c);
        const Tensor pg = encode_rows(x.to(Device::CUDA), gpu_maps[k].map, meta.to(Device::CUDA), c);
        ASSERT_EQ(first_byte_difference(pc, pg), -1) << "payload bytes (row bytes " << c.row_bytes() << ")";
        Tensor oc = Tensor::zeros({m, cols}, DType::F32), og = Tensor::zeros({m, cols}, DType::F32, Device::CUDA);
        decode_rows(pc, cpu_maps[k].map, c, oc);
        decode_rows(pg, gpu_maps[k].map, c, og);
        ASSERT_EQ(first_byte_difference(oc, og), -1) << "decoded values";
        ASSERT_EQ(first_byte_difference(read_meta(pc, cpu_maps[k].map, m), read_meta(pg, gpu_maps[k].map, m)), -1);
      }
    }
}

TEST(CudaDistCodec, QTensorRowsPackAndUnpackLikeTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (Format f : {Format::NVFP4, Format::MXFP8_E4M3})
    for (int64_t cols : {48, 1024}) {
      SCOPED_TRACE(std::string(format_name(f)) + " cols " + std::to_string(cols));
      QuantSpec spec;
      spec.fmt = f;
      spec.outer = f == Format::NVFP4 ? OuterScale::PerRow : OuterScale::None;
      spec.four_over_six = f == Format::NVFP4;
      const Tensor x = mixed_rows(30, cols, 9);
      Tensor xf = x.clone();  // quantizers report NaN/Inf: keep the finite rows only
      for (int64_t i = 0; i < xf.numel(); ++i)
        if (!std::isfinite(xf.data<float>()[i])) xf.data<float>()[i] = 1.0f;
      const QTensor q = ops::quantize(xf, spec);
      const RowCodec c{f, cols};
      const int64_t m = 30;
      const std::vector<Maps> cpu_maps = maps_for(m, Device::CPU), gpu_maps = maps_for(m, Device::CUDA);
      for (size_t k = 0; k < cpu_maps.size(); ++k) {
        const Tensor pc = pack_rows(q, cpu_maps[k].map, meta_for(m), c);
        const Tensor pg = pack_rows(q.to(Device::CUDA), gpu_maps[k].map, meta_for(m).to(Device::CUDA), c);
        ASSERT_EQ(first_byte_difference(pc, pg), -1) << cpu_maps[k].name;
        const QTensor uc = unpack_rows(pc, cpu_maps[k].map, c, m), ug = unpack_rows(pg, gpu_maps[k].map, c, m);
        EXPECT_EQ(first_byte_difference(uc.codes, ug.codes), -1);
        EXPECT_EQ(first_byte_difference(uc.block_scales, ug.block_scales), -1);
        if (f == Format::NVFP4) {
          EXPECT_EQ(first_byte_difference(uc.outer_scales, ug.outer_scales), -1);
        }
      }
    }
}

TEST(CudaDistCodec, SlotMetaMatchesTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 gen(3);
  std::vector<int32_t> idx(2000 * 4);
  for (auto& v : idx) v = int32_t(gen() % 64);
  for (size_t n = 0; n < 2000; ++n)  // distinct experts per token
    for (int j = 1; j < 4; ++j)
      while (std::find(idx.begin() + long(n * 4), idx.begin() + long(n * 4 + size_t(j)), idx[n * 4 + size_t(j)]) !=
             idx.begin() + long(n * 4 + size_t(j)))
        idx[n * 4 + size_t(j)] = (idx[n * 4 + size_t(j)] + 1) % 64;
  const Tensor topk = Tensor::from_host(idx.data(), {2000, 4}, DType::I32);
  const Tensor gtopk = topk.to(Device::CUDA);
  const Tensor mc = slot_meta(ops::route_plan(topk, 64), topk);
  const Tensor mg = slot_meta(ops::route_plan(gtopk, 64), gtopk);
  EXPECT_EQ(first_byte_difference(mc, mg), -1);
}

TEST(CudaDistCodec, FoldIsTheCpuLeftFold) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
#if FOURBIT_HAS_CUDA
  const int ranks = 5;
  const int64_t n = 3001, stride = 3100;
  std::mt19937 gen(4);
  std::normal_distribution<float> nd;
  std::vector<float> chunks(size_t(ranks * stride));
  for (auto& v : chunks) v = std::ldexp(nd(gen), int(gen() % 41) - 20);
  std::vector<float> want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float acc = chunks[size_t(i)];
    for (int r = 1; r < ranks; ++r) acc = acc + chunks[size_t(r * stride + i)];
    want[size_t(i)] = acc;
  }
  const Tensor g = Tensor::from_host(chunks.data(), {int64_t(chunks.size())}, DType::F32, Device::CUDA);
  Tensor out = Tensor::empty({n}, DType::F32, Device::CUDA);
  cuda::fold_rank_chunks(g.raw(), ranks, n, stride, DType::F32, out.raw(), current_stream());
  device_synchronize();
  EXPECT_EQ(first_byte_difference(out, Tensor::from_host(want.data(), {n}, DType::F32)), -1);
#endif
}

TEST(CudaDistCodec, EpOneDispatchAndCombineMatchTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // nvfp4-fwd's payloads for one rank's 300 tokens over 16 experts, top-2, d_model 256
  const int64_t N = 300, E = 16, K = 2, D = 256;
  std::mt19937 gen(5);
  std::vector<int32_t> idx(size_t(N * K));
  for (int64_t n = 0; n < N; ++n) {
    idx[size_t(n * K)] = int32_t(gen() % E);
    idx[size_t(n * K + 1)] = int32_t((idx[size_t(n * K)] + 1 + gen() % (E - 1)) % E);
  }
  const Tensor topk = Tensor::from_host(idx.data(), {N, K}, DType::I32);
  Tensor x = mixed_rows(N, D, 6);
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(x.data<float>()[i])) x.data<float>()[i] = 0.5f;
  const Tensor y = mixed_rows(N * K, D, 7);
  QuantSpec spec;
  spec.fmt = Format::NVFP4;
  spec.outer = OuterScale::PerRow;
  spec.four_over_six = true;
  const MoeCodecs codecs =
      moe_codecs(spec, QuantSpec{Format::MXFP8_E4M3, BlockAxis::Row, OuterScale::None}, Format::S2F6, D, 0x1234u, 0x9876u);
  auto run = [&](Device dev) {
    LocalGroup one(1);
    auto comm = one.communicator(0);
    ExpertParallel ep(*comm, E, true);
    const Tensor t = topk.to(dev);
    const ops::RoutePlan route = ops::route_plan(t, E);
    ExchangePlan plan = ep.plan(route, t);
    const ExpertRows rows = ep.dispatch(plan, ops::quantize(x.to(dev), spec), codecs.dispatch);
    const Tensor back = ep.combine(plan, y.to(dev), codecs.combine);
    const Tensor dy = ep.dispatch_grad(plan, y.to(dev), codecs.grad_dispatch);
    return std::vector<Tensor>{rows.q.codes, rows.q.block_scales, rows.q.outer_scales, back, dy};
  };
  const std::vector<Tensor> c = run(Device::CPU), g = run(Device::CUDA);
  const char* names[] = {"dispatched codes", "dispatched scales", "dispatched outer scales", "combined rows",
                         "dispatched dY rows"};
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(first_byte_difference(c[i], g[i]), -1) << names[i];
}

}  // namespace
