// defines: tests of the grouped kernel on packed block-scaled operands (cuda::grouped_gemm_rows
// with NVFP4 / MXFP8 operands, dequantized and scaled inside the kernel; skipped without a GPU):
// bit for bit the decode path it replaces (BF16 copies, the same kernel, the scale epilogue) for
// every format and outer-scale kind the recipes use, with ragged and empty groups, N off the tile,
// accumulate on and off; a row's bits the same between the training tile (M = 8192), the 64 x 128
// tiles that replace it where it would leave SMs idle, and the decode tiles (M = 1, 7, 64, 1000
// rows of one group), also through ops::grouped_gemm with one group (a linear layer's forward:
// BF16, MXFP8 and NVFP4 pairs, N off the 8-column step); with the offsets on the GPU, the host
// offsets' bits; shapes it does not take are declined.
// Both main loops (wgmma on Hopper, mma.sync) are run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#include "ops/cuda_grouped_util.h"
#endif

using namespace fourbit;

#if FOURBIT_HAS_CUDA
namespace {

bool have_gpu() { return cuda_device_count() > 0; }

using optest::bytes;
using optest::DecodeTile;
using optest::kDecodeWidths;
using optest::MainLoop;
using optest::randn_cuda;
using optest::TrainingTile;

QuantSpec spec(Format f, OuterScale outer) {
  QuantSpec s;
  s.fmt = f;
  s.outer = f == Format::NVFP4 ? outer : OuterScale::None;
  return s;
}

struct Case {
  const char* name;
  Format fmt;
  OuterScale a_outer, b_outer;
};
const std::vector<Case> kCases = {
    {"nvfp4 per-row x per-slice (nvfp4-fwd)", Format::NVFP4, OuterScale::PerRow, OuterScale::PerSlice},
    {"nvfp4 per-tensor x per-row", Format::NVFP4, OuterScale::Tensor, OuterScale::PerRow},
    {"nvfp4 no outer scales", Format::NVFP4, OuterScale::None, OuterScale::None},
    {"mxfp8 e4m3", Format::MXFP8_E4M3, OuterScale::None, OuterScale::None},
    {"mxfp8 e5m2", Format::MXFP8_E5M2, OuterScale::None, OuterScale::None},
};

TEST(CudaGroupedFused, EqualsTheDecodePathBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool wgmma : {true, false})       // both main loops
    for (bool decode : {false, true}) {  // training-sized groups, then decode-sized ones (a few rows each)
      const MainLoop loop(wgmma);
      const int64_t M = decode ? 13 : 700, K = 384, N = 200, G = 6;  // N off the 128-column tile, 12 K tiles
      const std::vector<int64_t> offsets =
          decode ? std::vector<int64_t>{0, 1, 1, 9, 10, 10, 13} : std::vector<int64_t>{0, 150, 150, 420, 421, 421, 700};
      const Tensor x = randn_cuda({M, K}, 41, 1.0f), w = randn_cuda({G, N, K}, 42, 0.05f);
      for (const Case& c : kCases) {
        const QTensor xq = ops::quantize(x, spec(c.fmt, c.a_outer)), wq = ops::quantize(w, spec(c.fmt, c.b_outer));
        for (bool acc : {false, true}) {
          const Tensor init = randn_cuda({M, N}, 43, 1.0f);
          Tensor fused = init.clone(), decoded = init.clone();
          ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(xq), ops::cuda::packed_operand(wq),
                                                   offsets, N, xq.padded_cols(), fused.data<float>(), N, acc))
              << c.name;
          if (decode && wgmma)  // every decode configuration gives the same bits (N = 200: a part tile at every width)
            for (int width : kDecodeWidths) {
              const DecodeTile tile(width);
              Tensor other = init.clone();
              ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(xq), ops::cuda::packed_operand(wq),
                                                       offsets, N, xq.padded_cols(), other.data<float>(), N, acc));
              EXPECT_EQ(bytes(other), bytes(fused)) << c.name << " acc=" << acc;
            }
          ops::cuda::set_fused_dequant(false);
          ops::grouped_gemm(ops::Operand(xq), ops::Operand(wq), offsets, decoded, acc);
          ops::cuda::set_fused_dequant(true);
          EXPECT_EQ(bytes(fused), bytes(decoded)) << c.name << " acc=" << acc;
          // and ops::grouped_gemm, which picks one of the two by group size, gives the same bits
          Tensor via_ops = init.clone();
          ops::grouped_gemm(ops::Operand(xq), ops::Operand(wq), offsets, via_ops, acc);
          EXPECT_EQ(bytes(via_ops), bytes(fused)) << c.name << " acc=" << acc;
        }
      }
    }
}

// The decode configuration (16- and 64-row tiles on the mma.sync loop; on the wgmma loop the
// streaming kernel, the weight-streaming 64 x 32 and 64 x 128 tiles and the 64 x 256 one; few rows
// of one expert) and the training one (every expert) give a row the same bits.
TEST(CudaGroupedFused, RowsAreTheSameAcrossBatchSizesAndTiles) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool wgmma : {true, false}) {  // both main loops
    const MainLoop loop(wgmma);
    const int64_t M = 8192, K = 256, N = 256, G = 16;
    std::vector<int64_t> offsets(size_t(G) + 1);
    for (int64_t g = 0; g <= G; ++g) offsets[size_t(g)] = g * M / G;  // 512 rows an expert
    const Tensor x = randn_cuda({M, K}, 51, 1.0f), w = randn_cuda({G, N, K}, 52, 0.05f);
    for (const Case& c : kCases) {
      const QTensor xq = ops::quantize(x, spec(c.fmt, c.a_outer)), wq = ops::quantize(w, spec(c.fmt, c.b_outer));
      Tensor full = Tensor::zeros({M, N}, DType::F32, Device::CUDA), chosen = full.clone();
      {
        const TrainingTile training;
        ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(xq), ops::cuda::packed_operand(wq), offsets,
                                                 N, xq.padded_cols(), full.data<float>(), N, false));
      }
      const std::vector<uint8_t> want = bytes(full);
      // the default for 8192 rows: the training tile too (the 64 x 128 ones run up to 1024 rows)
      ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(xq), ops::cuda::packed_operand(wq), offsets, N,
                                               xq.padded_cols(), chosen.data<float>(), N, false));
      EXPECT_EQ(bytes(chosen), want) << c.name << ": the default configuration";
      const int64_t g = 5, r0 = offsets[size_t(g)] + 3;  // rows of expert 5
      for (int64_t rows : {1, 7, 64, 1000}) {
        const int64_t end = std::min(r0 + rows, M);
        // rows r0 .. end alone, those past expert 5's end going to expert 6 (a 1000-row tile spans two)
        std::vector<int64_t> only(size_t(G) + 1, 0);
        for (int64_t h = 0; h <= G; ++h) only[size_t(h)] = std::clamp(offsets[size_t(h)], r0, end) - r0;
        const QTensor part = ops::qtensor_rows(xq, r0, end);
        for (int width : kDecodeWidths) {  // every decode tile (the training tile at 1000 rows)
          const DecodeTile tile(width);
          Tensor out = Tensor::zeros({end - r0, N}, DType::F32, Device::CUDA);
          ASSERT_TRUE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(part), ops::cuda::packed_operand(wq), only,
                                                   N, xq.padded_cols(), out.data<float>(), N, false));
          const std::vector<uint8_t> got = bytes(out);
          EXPECT_EQ(0, std::memcmp(got.data(), want.data() + size_t(r0 * N) * 4, got.size()))
              << c.name << " rows=" << rows;
        }
      }
    }
  }
}

// A linear layer's forward (model forward_gemm: ops::grouped_gemm with one group, a [M, K] times a
// [N, K] weight) at the shapes of gpu-small's LM head (N = 260, not a multiple of 8) and K/V
// projections (N = 256): rows 1, 7, 64 and 1000 of a batch get the bits they get in the 4096-row
// training GEMM (on the training tile), under every decode configuration (1000 rows: the 64 x 128
// tiles, as the training tile's 12 or 16 would leave SMs idle), for the dense BF16 pair (bf16
// recipe) and the block-scaled ones (mxfp8's attention, nvidia-nvfp4's per-tensor NVFP4). The sampler's decode
// steps and the trainer's forward rely on it.
TEST(CudaGroupedFused, OneGroupRowsAreTheSameAcrossBatchSizes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 4096, K = 1024;
  const Tensor x = randn_cuda({M, K}, 71, 1.0f);
  for (const int64_t N : {260, 256}) {
    const Tensor w = randn_cuda({N, K}, 72 + uint64_t(N), 0.03f);
    Tensor x16 = Tensor::empty({M, K}, DType::BF16, Device::CUDA);
    Tensor w16 = Tensor::empty({N, K}, DType::BF16, Device::CUDA);
    ops::convert(x, x16);
    ops::convert(w, w16);
    const QTensor xm = ops::quantize(x, spec(Format::MXFP8_E4M3, OuterScale::None)),
                  wm = ops::quantize(w, spec(Format::MXFP8_E4M3, OuterScale::None)),
                  xn = ops::quantize(x, spec(Format::NVFP4, OuterScale::Tensor)),
                  wn = ops::quantize(w, spec(Format::NVFP4, OuterScale::Tensor));
    struct Pair {
      const char* name;
      ops::Operand a, b;
    };
    for (const Pair& p : {Pair{"bf16", ops::Operand(x16), ops::Operand(w16)},
                          Pair{"mxfp8", ops::Operand(xm), ops::Operand(wm)},
                          Pair{"nvfp4 per-tensor", ops::Operand(xn), ops::Operand(wn)}}) {
      SCOPED_TRACE(std::string(p.name) + " N=" + std::to_string(N));
      Tensor full = Tensor::zeros({M, N}, DType::F32, Device::CUDA);
      {
        const TrainingTile training;
        ops::grouped_gemm(p.a, p.b, {0, M}, full);
      }
      const std::vector<uint8_t> want = bytes(full);
      const int64_t r0 = 1500;
      for (const int64_t rows : {1, 7, 64, 1000}) {
        const Tensor part16 = x16.slice_rows(r0, r0 + rows);
        QTensor part_q;
        if (p.a.q()) part_q = ops::qtensor_rows(*p.a.q(), r0, r0 + rows);
        const ops::Operand part = p.a.q() ? ops::Operand(part_q) : ops::Operand(part16);
        for (const int width : kDecodeWidths) {
          const DecodeTile tile(width);
          Tensor out = Tensor::zeros({rows, N}, DType::F32, Device::CUDA);
          ops::grouped_gemm(part, p.b, {0, rows}, out);
          const std::vector<uint8_t> got = bytes(out);
          EXPECT_EQ(0, std::memcmp(got.data(), want.data() + size_t(r0 * N) * 4, got.size())) << "rows=" << rows;
        }
      }
    }
  }
}

// ops::grouped_gemm_device_offsets on block-scaled operands (the sampler's MoE layers, queued
// before the router's counts reach the host) gives ops::grouped_gemm's bits with the same offsets
// on the host, for every format and outer-scale kind: decode-sized groups (the packed operands in
// the kernel on both sides), training-sized ones (decoded to BF16 first on both sides), and one
// group of 130 rows among six, where the host's average over the filled groups (130) takes the
// decode path and the device's over all six (22) the packed kernel; accumulating too.
TEST(CudaGroupedFused, DeviceOffsetsGiveTheHostOffsetsBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t K = 384, N = 200, G = 6;
  for (const std::vector<int32_t>& off : {std::vector<int32_t>{0, 1, 1, 9, 10, 10, 13},
                                          std::vector<int32_t>{0, 150, 150, 420, 421, 421, 700},
                                          std::vector<int32_t>{0, 0, 0, 0, 0, 130, 130}}) {
    const int64_t M = off.back();
    const std::vector<int64_t> host(off.begin(), off.end());
    const Tensor dev_off = Tensor::from_host(off.data(), {G + 1}, DType::I32, Device::CUDA);
    const Tensor x = randn_cuda({M, K}, 81, 1.0f), w = randn_cuda({G, N, K}, 82, 0.05f);
    for (const Case& c : kCases) {
      SCOPED_TRACE(std::string(c.name) + " M=" + std::to_string(M));
      const QTensor xq = ops::quantize(x, spec(c.fmt, c.a_outer)), wq = ops::quantize(w, spec(c.fmt, c.b_outer));
      EXPECT_TRUE(ops::grouped_gemm_reads_device_offsets(Device::CUDA, G, xq.padded_cols()));
      for (bool acc : {false, true}) {
        const Tensor init = randn_cuda({M, N}, 83, 1.0f);
        Tensor want = init.clone(), got = init.clone();
        ops::grouped_gemm(ops::Operand(xq), ops::Operand(wq), host, want, acc);
        ops::grouped_gemm_device_offsets(ops::Operand(xq), ops::Operand(wq), dev_off, got, acc);
        EXPECT_EQ(bytes(got), bytes(want)) << "acc=" << acc;
      }
    }
  }
}

TEST(CudaGroupedFused, DeclinesWhatItDoesNotTake) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Tensor x = randn_cuda({8, 96}, 61, 1.0f), w = randn_cuda({2, 16, 96}, 62, 1.0f);
  Tensor c = Tensor::zeros({8, 16}, DType::F32, Device::CUDA);
  const QTensor xq = ops::quantize(x, spec(Format::NVFP4, OuterScale::None));
  const QTensor wq = ops::quantize(w, spec(Format::NVFP4, OuterScale::None));
  const QTensor wm = ops::quantize(w, spec(Format::MXFP8_E4M3, OuterScale::None));
  // K = 96 is not a multiple of 32 (and 6 NVFP4 scales a row are not whole words)
  EXPECT_FALSE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(xq), ops::cuda::packed_operand(wq), {0, 4, 8}, 16,
                                            96, c.data<float>(), 16, false));
  // two formats
  EXPECT_FALSE(ops::cuda::grouped_gemm_rows(ops::cuda::packed_operand(xq), ops::cuda::packed_operand(wm), {0, 4, 8}, 16,
                                            96, c.data<float>(), 16, false));
}

}  // namespace
#endif
