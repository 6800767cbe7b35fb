// defines: the CudaQuantize tests: ops::quantize / dequantize / requantize_transposed on CUDA
// tensors equal the CPU backend byte for byte (skipped without a GPU). Every QuantSpec that
// ops::quantize accepts (format x axis x rounding x outer scale x Four Over Six x 16x16 tiles x
// Hadamard size, MXFP8 scale rule) on awkward and large shapes and on several kinds of data;
// codes, block scales and outer scales are compared separately, with the first mismatch named.
// Also: QuantReport counts, dequantize bit for bit (with and without undoing the RHT), views and
// unaligned inputs (the scalar paths), the register-resident Row-axis paths on every row width
// class, the non-finite flag, quantize_row_col's one-pass pairs with their BF16 decodes, and
// every dispatch entry's and the requantization's forms (FormOut) with their decodes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fourbit/model/recipe.h"
#include "fourbit/numerics/bf16.h"
#include "fourbit/numerics/hadamard.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/ops/ops.h"
#include "fourbit/ops/quant_layout.h"
#include "fourbit/tensor/device_memory.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;
using num::Rounding;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

// nvfp4-fwd's backward target, as the recipe states it (MXFP8 E4M3, RCEIL, SR).
const QuantSpec kRequantTarget = recipe_by_name("nvfp4-fwd").expert.dgrad.b;

struct Dims {
  int64_t slices, rows, cols;  // logical [slices,] rows x cols
  int64_t numel() const { return slices * rows * cols; }
  Shape shape() const { return slices == 1 ? Shape{rows, cols} : Shape{slices, rows, cols}; }
  std::string str() const {
    return slices == 1 ? "[" + std::to_string(rows) + "," + std::to_string(cols) + "]"
                       : "[" + std::to_string(slices) + "," + std::to_string(rows) + "," +
                             std::to_string(cols) + "]";
  }
};

// ---- data -----------------------------------------------------------------------------------------

enum class Data { Varied, HeavyTailed, Tiny, Huge };

const char* data_name(Data d) {
  switch (d) {
    case Data::Varied: return "varied";
    case Data::HeavyTailed: return "heavy-tailed";
    case Data::Tiny: return "tiny";
    case Data::Huge: return "huge";
  }
  return "?";
}

// Varied: rows of N(0,1) * 2^k with all-zero rows, all-zero 16- and 32-blocks, outliers and
// values on the RCEIL boundaries (max * 2^k for E4M3, E5M2, S2F6). Heavy-tailed: Student-t with 2
// degrees of freedom, a tenth exact zeros. Tiny: magnitudes 2^-140 .. 2^-100 (float32 subnormals
// included). Huge: magnitudes 2^90 .. 2^121 (block and outer scales at their limits; small enough
// that a 32-point RHT cannot overflow to Inf, whose Inf - Inf NaNs differ in sign bit between x86
// and the GPU).
std::vector<float> make_data(const Dims& d, Data kind, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> k(-12, 12);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(d.numel()));
  const int64_t rows = d.slices * d.rows;
  for (int64_t r = 0; r < rows; ++r) {
    const int row_kind = int(gen() % 10);
    const float row_scale = float(std::ldexp(1.0, k(gen)));
    for (int64_t c = 0; c < d.cols; ++c) {
      float v = 0.0f;
      switch (kind) {
        case Data::Varied:
          v = row_kind == 0 ? 0.0f : nd(gen) * row_scale;
          if (row_kind == 1 && (c / 16) % 3 == 1) v = 0.0f;
          if (row_kind == 2 && (c / 32) % 2 == 0) v = 0.0f;
          if (row_kind == 3 && c % 23 == 5) v *= 300.0f;
          if (row_kind >= 4 && row_kind <= 6 && c % 32 == 7) {
            const float max = row_kind == 4 ? 448.0f : row_kind == 5 ? 57344.0f : 127.0f / 64.0f;
            v = (c & 64 ? -max : max) * float(std::ldexp(1.0, k(gen) - 14));
          }
          if (row_kind == 7) v = float(std::ldexp(nd(gen), -24));
          break;
        case Data::HeavyTailed: {
          const float chi2 = -2.0f * std::log(std::max(u(gen), 1e-30f));  // chi-square, 2 dof
          v = u(gen) < 0.1f ? 0.0f : nd(gen) / std::sqrt(chi2 / 2.0f);
          break;
        }
        case Data::Tiny: v = float(std::ldexp(nd(gen), -100 - int(gen() % 40))); break;
        case Data::Huge:
          v = float(std::ldexp(std::clamp(nd(gen), -3.9f, 3.9f) * 0.49, 90 + int(gen() % 31)));
          break;
      }
      x[size_t(r * d.cols + c)] = v;
    }
  }
  return x;
}

// ---- specs ----------------------------------------------------------------------------------------

std::string spec_str(const QuantSpec& s) { return describe(s); }

// Every spec ops::quantize accepts for these dims, from the format registry (per-slice outer
// scales on 3-D inputs only), RHT signs: NVIDIA's mask for 16 points, a fixed word for 32.
std::vector<QuantSpec> all_specs(const Dims& d) {
  std::vector<QuantSpec> out;
  for (Format f : quantized_formats())
    for (QuantSpec s : every_spec(f)) {
      if (s.outer == OuterScale::PerSlice && d.slices == 1) continue;
      s.hadamard_signs = s.hadamard == 16 ? num::kNvidiaRht16Signs : s.hadamard == 32 ? 0x9E3779B9u : 0u;
      out.push_back(s);
    }
  return out;
}

// ---- comparison -----------------------------------------------------------------------------------

template <typename T>
std::vector<T> host_vec(const Tensor& t) {
  if (!t.defined()) return {};
  const Tensor h = t.to(Device::CPU);
  const T* p = h.data<T>();
  return std::vector<T>(p, p + h.numel());
}

// Index of the first differing element (compared as bytes), or -1.
template <typename T>
int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return int64_t(i);
  return -1;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Codes, block scales and outer scales separately; returns false (after one failure message
// naming the first mismatch) when anything differs.
bool same_qtensor(const QTensor& want, const QTensor& got, const std::string& what) {
  if (want.fmt != got.fmt || want.axis != got.axis || want.outer != got.outer ||
      want.slices != got.slices || want.rows != got.rows || want.cols != got.cols ||
      want.tile_2d != got.tile_2d || want.hadamard != got.hadamard ||
      want.hadamard_signs != got.hadamard_signs) {
    ADD_FAILURE() << what << ": QTensor metadata differs";
    return false;
  }
  const int64_t row_bytes = want.code_row_bytes(), nb = want.blocks_per_row();
  const auto wc = host_vec<uint8_t>(want.codes), gc = host_vec<uint8_t>(got.codes);
  if (const int64_t i = first_mismatch(wc, gc); i >= 0) {
    ADD_FAILURE() << what << ": codes differ (sizes " << wc.size() << " / " << gc.size()
                  << "), first at byte " << i << " (storage row " << i / row_bytes << ", byte "
                  << i % row_bytes << "): cpu 0x" << std::hex << int(wc[size_t(i)]) << ", gpu 0x"
                  << int(gc[size_t(i)]);
    return false;
  }
  const auto ws = host_vec<uint8_t>(want.block_scales), gs = host_vec<uint8_t>(got.block_scales);
  if (const int64_t i = first_mismatch(ws, gs); i >= 0) {
    ADD_FAILURE() << what << ": block scales differ, first at " << i << " (storage row " << i / nb
                  << ", block " << i % nb << "): cpu 0x" << std::hex << int(ws[size_t(i)])
                  << ", gpu 0x" << int(gs[size_t(i)]);
    return false;
  }
  if (want.outer_scales.defined() != got.outer_scales.defined()) {
    ADD_FAILURE() << what << ": one side has outer scales, the other not";
    return false;
  }
  const auto wo = host_vec<float>(want.outer_scales), go = host_vec<float>(got.outer_scales);
  if (const int64_t i = first_mismatch(wo, go); i >= 0) {
    ADD_FAILURE() << what << ": outer scales differ, first at " << i << ": cpu " << wo[size_t(i)]
                  << " (0x" << std::hex << bits(wo[size_t(i)]) << "), gpu " << std::dec
                  << go[size_t(i)] << " (0x" << std::hex << bits(go[size_t(i)]) << ")";
    return false;
  }
  return true;
}

bool same_floats(const Tensor& want, const Tensor& got, const std::string& what) {
  if (want.shape() != got.shape()) {
    ADD_FAILURE() << what << ": shape " << shape_str(want.shape()) << " vs " << shape_str(got.shape());
    return false;
  }
  const auto w = host_vec<float>(want), g = host_vec<float>(got);
  if (const int64_t i = first_mismatch(w, g); i >= 0) {
    ADD_FAILURE() << what << ": values differ, first at flat index " << i << ": cpu "
                  << w[size_t(i)] << " (0x" << std::hex << bits(w[size_t(i)]) << "), gpu "
                  << std::dec << g[size_t(i)] << " (0x" << std::hex << bits(g[size_t(i)]) << ")";
    return false;
  }
  return true;
}

bool same_report(const ops::QuantReport& a, const ops::QuantReport& b, const std::string& what) {
  if (a.values == b.values && a.nonfinite == b.nonfinite && a.blocks == b.blocks &&
      a.blocks_chose_four == b.blocks_chose_four)
    return true;
  ADD_FAILURE() << what << ": QuantReport cpu {values " << a.values << ", nonfinite " << a.nonfinite
                << ", blocks " << a.blocks << ", chose_four " << a.blocks_chose_four << "} gpu {values "
                << b.values << ", nonfinite " << b.nonfinite << ", blocks " << b.blocks
                << ", chose_four " << b.blocks_chose_four << "}";
  return false;
}

// Quantizes x (host data) on both backends with every spec and compares everything the CUDA
// quantizer produces: the QTensor and report; dequantize (both undo_hadamard settings) and, for
// NVFP4, requantize_transposed of the CPU's QTensor moved to the GPU. Returns the failing count.
int check_specs(const std::vector<float>& host, const Dims& d, const std::vector<QuantSpec>& specs,
                const std::string& label, bool check_decode = true) {
  const Tensor x_cpu = Tensor::from_host(host.data(), d.shape(), DType::F32);
  const Tensor x_gpu = x_cpu.to(Device::CUDA);
  int failures = 0, index = 0;
  for (const QuantSpec& s : specs) {
    const std::string what = label + " " + d.str() + " " + spec_str(s);
    const ops::RngKey rng{0x5EED0000u + uint64_t(index), uint64_t(index) * 7 + 1};
    ++index;
    ops::QuantReport rc, rg;
    const QTensor qc = ops::quantize(x_cpu, s, rng, &rc);
    const QTensor qg = ops::quantize(x_gpu, s, rng, &rg);
    EXPECT_EQ(qg.device(), Device::CUDA) << what;
    bool ok = same_qtensor(qc, qg, what) && same_report(rc, rg, what);
    if (check_decode) {
      const QTensor qc_on_gpu = qc.to(Device::CUDA);
      for (bool undo : {true, false}) {
        if (!undo && s.hadamard == 0) continue;
        ok = same_floats(ops::dequantize(qc, undo), ops::dequantize(qc_on_gpu, undo),
                         what + " dequantize" + (undo ? "" : "(keep rotation)")) && ok;
      }
      if (s.fmt == Format::NVFP4) {
        const ops::RngKey rq{rng.seed ^ 0xABCDu, rng.stream + 3};
        ok = same_qtensor(ops::requantize_transposed(qc, kRequantTarget, rq), ops::requantize_transposed(qc_on_gpu, kRequantTarget, rq),
                          what + " requantize_transposed") && ok;
      }
    }
    if (!ok && ++failures >= 8) {
      ADD_FAILURE() << label << " " << d.str() << ": stopping after " << failures << " failing specs";
      break;
    }
  }
  return failures;
}

}  // namespace

// ---- tests -------------------------------------------------------------------------------------

TEST(CudaQuantize, AwkwardShapesEverySpecMatchesCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ops::nonfinite_seen(true);
  const std::vector<Dims> shapes = {{1, 1, 1},   {1, 5, 37},  {1, 33, 17}, {1, 129, 300},
                                    {3, 64, 96}, {2, 40, 70}, {1, 16, 4}};
  uint32_t seed = 1;
  for (const Dims& d : shapes)
    for (Data kind : {Data::Varied, Data::HeavyTailed}) {
      const auto host = make_data(d, kind, seed++);
      check_specs(host, d, all_specs(d), data_name(kind));
    }
  EXPECT_FALSE(ops::nonfinite_seen(true)) << "finite inputs raised the non-finite flag";
}

TEST(CudaQuantize, TinyAndHugeMagnitudesMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<Dims> shapes = {{1, 33, 70}, {2, 48, 64}};
  uint32_t seed = 100;
  for (const Dims& d : shapes)
    for (Data kind : {Data::Tiny, Data::Huge})
      check_specs(make_data(d, kind, seed++), d, all_specs(d), data_name(kind));
}

// Rows wider than the one-pass per-token tile (the amax pre-pass path) and a wide 3-D input.
TEST(CudaQuantize, WideRowsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> specs;
  for (const QuantSpec& s : all_specs({1, 3, 20000}))
    if (s.hadamard != 32 && s.mx_rule == num::MxScaleRule::RCEIL) specs.push_back(s);
  check_specs(make_data({1, 3, 20000}, Data::Varied, 7), {1, 3, 20000}, specs, "varied");
  check_specs(make_data({2, 5, 16400}, Data::HeavyTailed, 8), {2, 5, 16400}, specs, "heavy-tailed");
}

// 4096 x 4096 (many tiles, the fused per-token path, several CTAs per outer-scale group) with a
// representative subset of specs, and a [4, 1024, 512] expert-weight stack.
TEST(CudaQuantize, LargeShapesMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> specs;
  for (BlockAxis axis : {BlockAxis::Row, BlockAxis::Col}) {
    QuantSpec s;
    s.axis = axis;
    s.fmt = Format::NVFP4;
    for (OuterScale o : {OuterScale::Tensor, OuterScale::PerRow}) {
      s.outer = o;
      s.four_over_six = false;
      s.rounding = Rounding::RNE;
      specs.push_back(s);
      s.four_over_six = true;
      specs.push_back(s);
      s.rounding = Rounding::SR;
      specs.push_back(s);
    }
    s.outer = OuterScale::Tensor;
    s.four_over_six = false;
    s.rounding = Rounding::RNE;
    s.tile_2d = true;
    specs.push_back(s);
    s.tile_2d = false;
    s.hadamard = 16;
    s.hadamard_signs = num::kNvidiaRht16Signs;
    specs.push_back(s);
    s.hadamard = 0;
    for (Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2, Format::MXFP4}) {
      s.fmt = f;
      s.rounding = Rounding::RNE;
      specs.push_back(s);
      s.rounding = Rounding::SR;
      specs.push_back(s);
    }
    s.fmt = Format::S2F6;
    s.rounding = Rounding::RNE;
    specs.push_back(s);
    s.hadamard = 32;
    s.hadamard_signs = 0x12345678u;
    specs.push_back(s);
  }
  check_specs(make_data({1, 4096, 4096}, Data::Varied, 11), {1, 4096, 4096}, specs, "varied");
  std::vector<QuantSpec> slice_specs = specs;
  for (QuantSpec& s : slice_specs)
    if (s.fmt == Format::NVFP4 && s.outer == OuterScale::Tensor) s.outer = OuterScale::PerSlice;
  check_specs(make_data({4, 1024, 512}, Data::HeavyTailed, 12), {4, 1024, 512}, slice_specs, "heavy-tailed");
}

// The register-resident Row-axis kernels (NVFP4 per-token RNE with and without Four Over Six,
// MXFP8 RNE and SR) on every row width class they distinguish: one warp per row and several rows
// per CTA, teams of 2 to 16 warps with one or two 32-block runs each, widths that are not a
// multiple of the block (padding), the widest row they take (16384) and the first one they leave
// to the tile kernel (16388); and requantize_transposed of the results (tiles of 256 x 32, partial
// in both directions, 16- and 8-byte code loads).
TEST(CudaQuantize, FastRowPathsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> specs;
  for (const QuantSpec& s : all_specs({1, 4, 64})) {
    if (s.axis != BlockAxis::Row || s.hadamard != 0 || s.fmt == Format::S2F6 || s.fmt == Format::MXFP4) continue;
    if (s.fmt == Format::NVFP4 && (s.outer != OuterScale::PerRow || s.tile_2d)) continue;
    specs.push_back(s);
  }
  const std::vector<Dims> shapes = {{1, 9, 16},     {1, 7, 20},     {1, 17, 36},   {2, 5, 100},
                                    {1, 300, 252},  {1, 3, 512},    {1, 5, 1000},  {1, 520, 1028},
                                    {1, 6, 2048},   {1, 4, 4100},   {1, 3, 5120},  {1, 3, 8192},
                                    {1, 2, 8196},   {1, 3, 12288},  {1, 2, 16380}, {1, 2, 16384},
                                    {1, 2, 16388}};
  uint32_t seed = 300;
  for (const Dims& d : shapes)
    for (Data kind : {Data::Varied, Data::HeavyTailed})
      check_specs(make_data(d, kind, seed++), d, specs, data_name(kind));
  for (const Dims& d : {Dims{1, 33, 96}, Dims{2, 40, 1024}})
    for (Data kind : {Data::Tiny, Data::Huge})
      check_specs(make_data(d, kind, seed++), d, specs, data_name(kind));
}

// ops::quantize_segments on the GPU (the Col-axis MXFP8 kernel over row segments: the experts'
// weight-gradient operands) equals the CPU's quantize of each segment: empty segments, segments
// shorter than a block, not a multiple of it, more segments than one launch takes (40 > 32),
// widths that are not a multiple of the CTA's 256 columns, both elements, both roundings (SR
// counters restart in every segment) and both scale rules.
TEST(CudaQuantize, ColAxisMxfp8SegmentsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> specs;
  for (const QuantSpec& s : all_specs({1, 4, 64}))
    if (s.axis == BlockAxis::Col && s.hadamard == 0 && (s.fmt == Format::MXFP8_E4M3 || s.fmt == Format::MXFP8_E5M2))
      specs.push_back(s);
  ASSERT_EQ(specs.size(), 8u);
  const std::vector<std::vector<int64_t>> lengths = {
      {0, 1, 31, 32, 33, 100, 0, 64},
      {5},
      std::vector<int64_t>(40, 37),
  };
  uint32_t seed = 900;
  for (int64_t cols : {1, 37, 256, 300, 1024})
    for (const auto& len : lengths) {
      std::vector<int64_t> offsets = {0};
      for (int64_t n : len) offsets.push_back(offsets.back() + n);
      const Dims d{1, offsets.back(), cols};
      const auto host = make_data(d, Data::Varied, seed++);
      const Tensor x_cpu = Tensor::from_host(host.data(), d.shape(), DType::F32);
      const Tensor x_gpu = x_cpu.to(Device::CUDA);
      int index = 0;
      for (const QuantSpec& s : specs) {
        std::vector<ops::RngKey> keys;
        for (size_t e = 0; e < len.size(); ++e) keys.push_back({0xC0FFEEu + uint64_t(index), 11 * e + 3});
        ++index;
        const std::vector<QTensor> got = ops::quantize_segments(x_gpu, offsets, s, keys);
        ASSERT_EQ(got.size(), len.size());
        for (size_t e = 0; e < len.size(); ++e) {
          const std::string what = d.str() + " " + spec_str(s) + " segment " + std::to_string(e);
          if (len[e] == 0) {
            EXPECT_FALSE(got[e].codes.defined()) << what;
            continue;
          }
          const QTensor want = ops::quantize(x_cpu.slice_rows(offsets[e], offsets[e + 1]), s, keys[e]);
          if (!same_qtensor(want, got[e], what)) return;
        }
      }
    }
}

// q's exact BF16 decode on the host ([total rows, padded cols], codes x block scale rounded once
// to BF16; NVFP4's outer scales are not in it: the GEMM's epilogue applies them), what
// QTensor::bf16 must hold. MXFP8 and NVFP4.
std::vector<uint16_t> host_bf16_decode(const QTensor& q) {
  const auto codes = host_vec<uint8_t>(q.codes), scales = host_vec<uint8_t>(q.block_scales);
  const int64_t nb = q.blocks_per_row(), pc = q.padded_cols(), rb = q.code_row_bytes(), B = q.block();
  std::vector<uint16_t> out(size_t(q.total_rows() * pc));
  float v[num::kMxBlock];
  for (int64_t r = 0; r < q.total_rows(); ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t sc = scales[size_t(r * nb + b)];
      if (q.fmt == Format::NVFP4) {
        for (int64_t i = 0; i < B; ++i) {
          const uint8_t byte = codes[size_t(r * rb + (b * B + i) / 2)];
          v[i] = num::nvfp4_dequant(i % 2 ? byte >> 4 : byte & 0xFu, sc, 1.0f);
        }
      } else {
        const uint8_t* c = codes.data() + r * rb + b * B;
        if (q.fmt == Format::MXFP8_E4M3) num::mxfp8_decode_block<4>(c, sc, 1.0f, v);
        else num::mxfp8_decode_block<5>(c, sc, 1.0f, v);
      }
      for (int64_t i = 0; i < B; ++i) out[size_t(r * pc + b * B + i)] = num::bf16_encode(v[i]);
    }
  return out;
}

// got.bf16 holds the exact decode of got's codes (checked after same_qtensor, so the codes are
// the CPU's).
bool decodes_its_codes(const QTensor& got, const std::string& what) {
  if (!got.bf16.defined() || got.bf16.dtype() != DType::BF16 || got.bf16.shape() != Shape{got.total_rows(), got.padded_cols()}) {
    ADD_FAILURE() << what << ": no BF16 decode of shape [" << got.total_rows() << ", " << got.padded_cols() << "]";
    return false;
  }
  const auto want = host_bf16_decode(got), have = host_vec<uint16_t>(got.bf16);
  auto nan = [](uint16_t h) { return (h & 0x7F80u) == 0x7F80u && (h & 0x7Fu) != 0; };
  int64_t i = want.size() == have.size() ? -1 : 0;
  for (size_t k = 0; i < 0 && k < want.size(); ++k)
    if (want[k] != have[k] && !(nan(want[k]) && nan(have[k]))) i = int64_t(k);  // any NaN for a NaN code
  if (i >= 0) {
    ADD_FAILURE() << what << ": BF16 decode differs at " << i << " (row " << i / got.padded_cols() << ", col "
                  << i % got.padded_cols() << "): want 0x" << std::hex << want[size_t(i)] << ", got 0x"
                  << have[size_t(i)];
    return false;
  }
  return true;
}

constexpr ops::FormOut kForms[3] = {ops::FormOut::Codes, ops::FormOut::CodesAndBf16, ops::FormOut::Bf16};

// got, a form written as `form` asks, against want, the CPU's quantize of the same values: its
// codes and scales equal (Codes, CodesAndBf16), and its BF16 decode the exact values of want's
// codes (CodesAndBf16, Bf16: then without codes or scales).
bool same_form(const QTensor& want, const QTensor& got, ops::FormOut form, const std::string& what) {
  if (form == ops::FormOut::Bf16) {
    if (got.codes.defined() || got.block_scales.defined()) {
      ADD_FAILURE() << what << ": codes written for a form of its decode alone";
      return false;
    }
    if (first_mismatch(host_vec<float>(want.outer_scales), host_vec<float>(got.outer_scales)) >= 0) {
      ADD_FAILURE() << what << ": the decode's outer scales differ from the CPU's";
      return false;
    }
    QTensor w = want;
    w.bf16 = got.bf16;
    return decodes_its_codes(w, what + " (the CPU's codes)");
  }
  if (!same_qtensor(want, got, what)) return false;
  if (form == ops::FormOut::CodesAndBf16) return decodes_its_codes(got, what);
  if (got.bf16.defined()) {
    ADD_FAILURE() << what << ": a BF16 decode written for a form of codes alone";
    return false;
  }
  return true;
}

// got, a row_col op's forms of the values x (on the CPU), against the CPU's quantizers: quantize(x,
// rs, row_key) as its Row form, and quantize of each segment offsets[e] .. offsets[e + 1] under cs
// and keys[e] as its Col form (none for an empty segment; no offsets at all: no Col forms), each
// as its FormOut asks. False (with
// the failure added) at the first difference.
bool same_row_col_forms(const Tensor& x, const ops::RowColQuant& got, const QuantSpec& rs, ops::RngKey row_key,
                        ops::FormOut row_out, const QuantSpec& cs, const std::vector<int64_t>& offsets,
                        const std::vector<ops::RngKey>& keys, ops::FormOut col_out, const std::string& what) {
  if (!same_form(ops::quantize(x, rs, row_key), got.row, row_out, what + " row")) return false;
  const size_t segments = offsets.empty() ? 0 : offsets.size() - 1;  // no offsets: the Row form alone
  if (got.col.size() != segments) {
    ADD_FAILURE() << what << ": " << got.col.size() << " Col forms for " << segments << " segments";
    return false;
  }
  for (size_t e = 0; e < got.col.size(); ++e) {
    const std::string we = what + " segment " + std::to_string(e);
    if (offsets[e] == offsets[e + 1]) {
      EXPECT_FALSE(got.col[e].defined()) << we;
      continue;
    }
    if (!same_form(ops::quantize(x.slice_rows(offsets[e], offsets[e + 1]), cs, keys[e]), got.col[e], col_out, we))
      return false;
  }
  return true;
}

// Every MXFP8 spec without an RHT (both element formats, roundings and scale rules), by axis: the
// specs the one-pass kernels of both axes take.
void mxfp8_axis_specs(std::vector<QuantSpec>& rows_specs, std::vector<QuantSpec>& cols_specs) {
  for (const QuantSpec& s : all_specs({1, 4, 64})) {
    if (s.hadamard != 0 || (s.fmt != Format::MXFP8_E4M3 && s.fmt != Format::MXFP8_E5M2)) continue;
    (s.axis == BlockAxis::Row ? rows_specs : cols_specs).push_back(s);
  }
}

// ops::quantize_row_col on the GPU (one pass of mxfp8_row_col_kernel) equals the CPU's quantize
// on the Row axis and quantize of every segment on the Col axis, for every pair of MXFP8 specs of
// one element format (RNE/SR on each side, both scale rules): widths inside, at and past one
// 256-column tile, segments empty, shorter than a block and longer than several, more segments
// than a launch takes, NaN and Inf in the data; each side written as each FormOut asks (the BF16
// decodes the exact values of the codes, with the codes or without them).
TEST(CudaQuantize, RowColPairMatchesCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> rows_specs, cols_specs;
  mxfp8_axis_specs(rows_specs, cols_specs);
  ASSERT_EQ(rows_specs.size(), 8u);
  ASSERT_EQ(cols_specs.size(), 8u);
  const std::vector<std::vector<int64_t>> lengths = {
      {0, 1, 31, 32, 33, 100, 0, 64},
      {70},
      std::vector<int64_t>(40, 37),
  };
  uint32_t seed = 1700;
  int pair = 0;
  for (int64_t cols : {1, 37, 256, 300, 1024})
    for (const auto& len : lengths) {
      std::vector<int64_t> offsets = {0};
      for (int64_t n : len) offsets.push_back(offsets.back() + n);
      const Dims d{1, offsets.back(), cols};
      auto host = make_data(d, seed % 2 ? Data::Varied : Data::Huge, seed);
      ++seed;
      if (cols == 300 && host.size() > 1000) {  // a NaN and an Inf in different blocks of both axes
        host[7 * size_t(cols) + 45] = std::numeric_limits<float>::quiet_NaN();
        host[40 * size_t(cols) + 299] = -std::numeric_limits<float>::infinity();
      }
      const Tensor x_cpu = Tensor::from_host(host.data(), d.shape(), DType::F32);
      const Tensor x_gpu = x_cpu.to(Device::CUDA);
      for (const QuantSpec& rs : rows_specs)
        for (const QuantSpec& cs : cols_specs) {
          if (rs.fmt != cs.fmt) continue;
          ++pair;
          const ops::RngKey row_key{0xBEEFu + uint64_t(pair), 5};
          std::vector<ops::RngKey> keys;
          for (size_t e = 0; e < len.size(); ++e) keys.push_back({0xC0FFEEu + uint64_t(pair), 11 * e + 3});
          const ops::FormOut row_out = kForms[pair % 3], col_out = kForms[(pair / 3 + pair) % 3];
          const ops::RowColQuant got = ops::quantize_row_col(x_gpu, rs, row_key, cs, offsets, keys, row_out, col_out);
          const std::string what = d.str() + " " + spec_str(rs) + " + " + spec_str(cs) + " forms " +
                                   std::to_string(int(row_out)) + "/" + std::to_string(int(col_out));
          if (!same_row_col_forms(x_cpu, got, rs, row_key, row_out, cs, offsets, keys, col_out, what)) return;
        }
    }
  EXPECT_EQ(pair, 15 * 32);  // 5 widths x 3 segmentations x (4 x 4 rounding/rule pairs) x 2 formats
  EXPECT_TRUE(ops::nonfinite_seen(true));
}

// ops::gather_quantize_row_col on the GPU (rows read through token_of_slot) gives the bytes of
// quantize_row_col of gather_rows' x_perm, for slots that repeat and skip tokens, every FormOut;
// an id outside x is reported as gather_rows reports it.
TEST(CudaQuantize, GatheredRowColMatchesGatherThenRowCol) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec row = recipe_by_name("mxfp8").expert.fprop.a, col = recipe_by_name("mxfp8").expert.wgrad.b;
  row.axis = BlockAxis::Row;
  col.axis = BlockAxis::Col;
  int run = 0;
  for (int64_t D : {40, 256, 300}) {
    const int64_t N = 50;
    const Tensor x = Tensor::from_host(make_data({1, N, D}, Data::Varied, 3400 + uint32_t(D)).data(), {N, D},
                                       DType::F32).to(Device::CUDA);
    std::vector<int32_t> tok;
    for (int32_t s = 0; s < 97; ++s) tok.push_back((s * 7 + 3) % int32_t(N));  // repeats, in no order
    const std::vector<int64_t> offsets = {0, 20, 20, 61, 97};
    const std::vector<ops::RngKey> keys = {{8, 1}, {8, 2}, {8, 3}, {8, 4}};
    const Tensor t = Tensor::from_host(tok.data(), {97}, DType::I32).to(Device::CUDA);
    ++run;
    QuantSpec rs = row, cs = col;
    rs.rounding = run % 2 ? num::Rounding::SR : num::Rounding::RNE;
    const ops::FormOut row_out = kForms[run % 3], col_out = kForms[(run + 1) % 3];
    const ops::RowColQuant got = ops::gather_quantize_row_col(x, t, rs, {8, 9}, cs, offsets, keys, row_out, col_out);
    Tensor x_perm = Tensor::empty({97, D}, DType::F32, Device::CUDA);
    ops::gather_rows(x, t, x_perm);
    const Tensor xp = x_perm.to(Device::CPU);
    const std::string what = "D " + std::to_string(D);
    if (!same_row_col_forms(xp, got, rs, {8, 9}, row_out, cs, offsets, keys, col_out, what)) return;
  }
  // an id outside x: reported at the next check, naming it
  const Tensor x = Tensor::zeros({8, 64}, DType::F32, Device::CUDA);
  const std::vector<int32_t> bad = {0, 1, 8, 2};
  const Tensor t = Tensor::from_host(bad.data(), {4}, DType::I32).to(Device::CUDA);
  (void)ops::gather_quantize_row_col(x, t, row, {1, 1}, col, {0, 4}, {{1, 2}}, ops::FormOut::Bf16, ops::FormOut::Bf16);
  try {
    ops::check_index_errors(Device::CUDA);
    ADD_FAILURE() << "an id outside x went unreported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("gather_quantize_row_col: token_of_slot[2] = 8"), std::string::npos)
        << e.what();
  }
}

// ops::quantize_row_col_device_offsets and its gathered form on the GPU (each segment found from
// the offsets on the GPU): the Row form is the host-offset call's, and col_rows the CPU's (each
// segment's Col form decoded into its rows) bit for bit, for both element formats, RNE and SR on
// each side, segments empty, shorter than a block and longer than several, and more segments than
// a launch takes (two launches); offsets past the rows are clamped, not read past. The call reads
// nothing back: recorded in a CUDA graph, its replays write the same forms for new offsets.
TEST(CudaQuantize, RowColOnDeviceOffsetsMatchesCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> rows_specs, cols_specs;
  mxfp8_axis_specs(rows_specs, cols_specs);
  const std::vector<std::vector<int64_t>> lengths = {
      {0, 1, 31, 32, 33, 100, 0, 64},
      std::vector<int64_t>(40, 37),
  };
  auto bytes_equal = [](const Tensor& a, const Tensor& b) {
    const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
    return ha.shape() == hb.shape() && ha.dtype() == hb.dtype() &&
           std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
  };
  uint32_t seed = 5100;
  int pair = 0;
  for (int64_t cols : {37, 256, 1024})
    for (const auto& len : lengths) {
      std::vector<int64_t> offsets = {0};
      for (int64_t n : len) offsets.push_back(offsets.back() + n);
      std::vector<int32_t> off32(offsets.begin(), offsets.end());
      const int64_t R = offsets.back();
      const Tensor x_cpu = Tensor::from_host(make_data({1, R, cols}, Data::Varied, seed++).data(), {R, cols}, DType::F32);
      const Tensor x_gpu = x_cpu.to(Device::CUDA);
      const Tensor off_cpu = Tensor::from_host(off32.data(), {int64_t(off32.size())}, DType::I32);
      const Tensor off_gpu = off_cpu.to(Device::CUDA);
      for (const QuantSpec& rs : rows_specs)
        for (const QuantSpec& cs : cols_specs) {
          if (rs.fmt != cs.fmt) continue;
          ++pair;
          const ops::RngKey row_key{0xD1CEu + uint64_t(pair), 7};
          std::vector<ops::RngKey> keys;
          for (size_t e = 0; e < len.size(); ++e) keys.push_back({0xFACEu + uint64_t(pair), 5 * e + 1});
          const ops::FormOut row_out = kForms[pair % 3];
          const std::string what = std::to_string(R) + "x" + std::to_string(cols) + " " + spec_str(rs) + " + " +
                                   spec_str(cs);
          const ops::RowColQuant got =
              ops::quantize_row_col_device_offsets(x_gpu, rs, row_key, cs, off_gpu, keys, row_out);
          const ops::RowColQuant want_cpu =
              ops::quantize_row_col_device_offsets(x_cpu, rs, row_key, cs, off_cpu, keys, row_out);
          const ops::RowColQuant want_row =
              ops::quantize_row_col(x_gpu, rs, row_key, cs, offsets, keys, row_out, ops::FormOut::Codes);
          EXPECT_TRUE(got.col.empty()) << what;
          ASSERT_TRUE(bytes_equal(got.col_rows, want_cpu.col_rows)) << what << ": col_rows";
          for (const auto& [a, b] : {std::pair{got.row.codes, want_row.row.codes},
                                     std::pair{got.row.block_scales, want_row.row.block_scales},
                                     std::pair{got.row.bf16, want_row.row.bf16}}) {
            ASSERT_EQ(a.defined(), b.defined()) << what;
            if (a.defined()) {
              ASSERT_TRUE(bytes_equal(a, b)) << what << ": the Row form";
            }
          }
        }
    }
  EXPECT_EQ(pair, 3 * 2 * 32);  // 3 widths x 2 segmentations x (4 x 4 rounding/rule pairs) x 2 formats
  // gathered: x's rows read through token_of_slot, against gather_rows then the plain call (and the CPU)
  QuantSpec row = recipe_by_name("mxfp8").expert.fprop.a, col = recipe_by_name("mxfp8").expert.wgrad.b;
  row.axis = BlockAxis::Row;
  col.axis = BlockAxis::Col;
  const int64_t N = 50, M = 97, D = 300;
  const Tensor x = Tensor::from_host(make_data({1, N, D}, Data::Varied, 5300).data(), {N, D}, DType::F32).to(Device::CUDA);
  std::vector<int32_t> tok;
  for (int32_t s = 0; s < M; ++s) tok.push_back((s * 7 + 3) % int32_t(N));
  const Tensor t = Tensor::from_host(tok.data(), {M}, DType::I32).to(Device::CUDA);
  const std::vector<int32_t> off32 = {0, 20, 20, 61, 97};
  const Tensor off = Tensor::from_host(off32.data(), {5}, DType::I32).to(Device::CUDA);
  const std::vector<ops::RngKey> keys = {{8, 1}, {8, 2}, {8, 3}, {8, 4}};
  const ops::RowColQuant got =
      ops::gather_quantize_row_col_device_offsets(x, t, row, {8, 9}, col, off, keys, ops::FormOut::CodesAndBf16);
  Tensor x_perm = Tensor::empty({M, D}, DType::F32, Device::CUDA);
  ops::gather_rows(x, t, x_perm);
  const ops::RowColQuant want =
      ops::quantize_row_col_device_offsets(x_perm.to(Device::CPU), row, {8, 9}, col, off.to(Device::CPU), keys);
  EXPECT_TRUE(bytes_equal(got.col_rows, want.col_rows)) << "gathered: col_rows";
  EXPECT_TRUE(bytes_equal(got.row.codes, want.row.codes)) << "gathered: the Row form";
  // offsets past the rows: clamped to them (the last segment ends at the rows' end)
  const std::vector<int32_t> past = {0, 20, 20, 61, 500};
  const ops::RowColQuant clamped = ops::gather_quantize_row_col_device_offsets(
      x, t, row, {8, 9}, col, Tensor::from_host(past.data(), {5}, DType::I32).to(Device::CUDA), keys,
      ops::FormOut::Codes);
  EXPECT_TRUE(bytes_equal(clamped.col_rows, got.col_rows)) << "offsets past the rows";
  // in a CUDA graph: nothing comes back, and a replay reads the offsets of its time
  Tensor off_live = Tensor::from_host(off32.data(), {5}, DType::I32).to(Device::CUDA);
  std::unique_ptr<DeviceGraph> graph;
  ops::RowColQuant recorded;
  {
    GraphCapture capture;
    recorded = ops::gather_quantize_row_col_device_offsets(x, t, row, {8, 9}, col, off_live, keys, ops::FormOut::Codes);
    graph = capture.finish({recorded.row.codes, recorded.row.block_scales, recorded.col_rows});
  }
  const std::vector<int32_t> other = {0, 3, 50, 50, 97};
  off_live.copy_from(Tensor::from_host(other.data(), {5}, DType::I32));
  graph->replay();
  const ops::RowColQuant want_other =
      ops::quantize_row_col_device_offsets(x_perm.to(Device::CPU), row, {8, 9}, col,
                                           Tensor::from_host(other.data(), {5}, DType::I32), keys);
  EXPECT_TRUE(bytes_equal(recorded.col_rows, want_other.col_rows)) << "the replay on other offsets";
  EXPECT_TRUE(bytes_equal(recorded.row.codes, want_other.row.codes)) << "the replay's Row form";
}

// The computed sources on device offsets (moe_combine_backward_row_col_device_offsets,
// swiglu_forward_row_col_device_offsets, swiglu_backward_row_col_device_offsets) on the GPU give
// the CPU's forms bit for bit (the CPU: the host-offset op, each segment's Col form decoded into
// its rows), over a route plan's slots with an expert of no tokens, widths inside and past a tile.
TEST(CudaQuantize, ComputedSourcesOnDeviceOffsetsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec row = recipe_by_name("mxfp8").expert.dgrad.a, col = recipe_by_name("mxfp8").expert.wgrad.a;
  row.axis = BlockAxis::Row;
  col.axis = BlockAxis::Col;
  auto bytes_equal = [](const Tensor& a, const Tensor& b) {
    const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
    return ha.shape() == hb.shape() && std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
  };
  auto same = [&](const ops::RowColQuant& got, const ops::RowColQuant& want, const std::string& what) {
    EXPECT_TRUE(bytes_equal(got.col_rows, want.col_rows)) << what << ": col_rows";
    EXPECT_TRUE(bytes_equal(got.row.codes, want.row.codes)) << what << ": Row codes";
    EXPECT_TRUE(bytes_equal(got.row.block_scales, want.row.block_scales)) << what << ": Row scales";
  };
  uint32_t seed = 5400;
  for (int64_t D : {40, 256, 300}) {
    const int64_t N = 45, k = 2, E = 5;  // expert 4 gets no token
    std::vector<int32_t> idx(size_t(N * k));
    for (int64_t n = 0; n < N; ++n) {
      idx[size_t(n * k)] = int32_t((n * 3) % 4);
      idx[size_t(n * k + 1)] = int32_t((n * 3 + 1 + n % 3) % 4);
      if (idx[size_t(n * k + 1)] == idx[size_t(n * k)]) idx[size_t(n * k + 1)] = (idx[size_t(n * k)] + 1) % 4;
    }
    const Tensor idx_cpu = Tensor::from_host(idx.data(), {N, k}, DType::I32);
    const ops::RoutePlan plan_cpu = ops::route_plan(idx_cpu, E), plan_gpu = ops::route_plan(idx_cpu.to(Device::CUDA), E);
    const std::vector<int32_t> off32(plan_cpu.offsets.begin(), plan_cpu.offsets.end());
    const Tensor off_cpu = Tensor::from_host(off32.data(), {E + 1}, DType::I32), off_gpu = off_cpu.to(Device::CUDA);
    std::vector<ops::RngKey> keys0, keys1;
    for (int64_t e = 0; e < E; ++e) {
      keys0.push_back({21, uint64_t(e)});
      keys1.push_back({22, uint64_t(e)});
    }
    auto data = [&](int64_t r, int64_t c) {
      return Tensor::from_host(make_data({1, r, c}, Data::Varied, seed++).data(), {r, c}, DType::F32);
    };
    const std::string what = "D " + std::to_string(D);
    {  // the combine gradient
      const Tensor dout = data(N, D), y_perm = data(N * k, D), w = data(N, k);
      Tensor dw_gpu = Tensor::empty({N, k}, DType::F32, Device::CUDA), dw_cpu = Tensor::empty({N, k}, DType::F32);
      const ops::RowColQuant got = ops::moe_combine_backward_row_col_device_offsets(
          dout.to(Device::CUDA), y_perm.to(Device::CUDA), plan_gpu.slot_of, w.to(Device::CUDA), dw_gpu, row, {21, 9},
          col, off_gpu, keys0, ops::FormOut::CodesAndBf16);
      const ops::RowColQuant want = ops::moe_combine_backward_row_col_device_offsets(
          dout, y_perm, plan_cpu.slot_of, w, dw_cpu, row, {21, 9}, col, off_cpu, keys0);
      same(got, want, what + " combine");
      EXPECT_TRUE(bytes_equal(dw_gpu, dw_cpu)) << what << " combine: dw";
    }
    const Tensor h1 = data(N * k, D), h3 = data(N * k, D), da = data(N * k, D);
    same(ops::swiglu_forward_row_col_device_offsets(h1.to(Device::CUDA), h3.to(Device::CUDA), row, {23, 9}, col, off_gpu,
                                                    keys0),
         ops::swiglu_forward_row_col_device_offsets(h1, h3, row, {23, 9}, col, off_cpu, keys0), what + " swiglu");
    const std::array<ops::RowColQuant, 2> got =
        ops::swiglu_backward_row_col_device_offsets(da.to(Device::CUDA), h1.to(Device::CUDA), h3.to(Device::CUDA), row,
                                                    {ops::RngKey{24, 1}, {24, 2}}, col, off_gpu, {keys0, keys1});
    const std::array<ops::RowColQuant, 2> want = ops::swiglu_backward_row_col_device_offsets(
        da, h1, h3, row, {ops::RngKey{24, 1}, {24, 2}}, col, off_cpu, {keys0, keys1});
    same(got[0], want[0], what + " swiglu backward dh1");
    same(got[1], want[1], what + " swiglu backward dh3");
  }
}

// ops::moe_combine_backward_row_col on the GPU (dy_perm's rows computed where the quantizer reads
// them) gives moe_combine_backward's dw and the bytes of quantize_row_col of its dy_perm, every
// FormOut, a route plan's slots; two assignments of one slot are reported as moe_combine_backward
// reports them.
TEST(CudaQuantize, CombineGradRowColMatchesCombineBackwardThenRowCol) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec row = recipe_by_name("mxfp8").expert.dgrad.a, col = recipe_by_name("mxfp8").expert.wgrad.a;
  row.axis = BlockAxis::Row;
  col.axis = BlockAxis::Col;
  int run = 0;
  for (int64_t D : {40, 256, 300}) {
    const int64_t N = 37, k = 2, E = 4;
    std::vector<int32_t> idx(size_t(N * k));
    for (int64_t a = 0; a < N * k; ++a) idx[size_t(a)] = int32_t((a * 5 + a / k) % E);
    for (int64_t n = 0; n < N; ++n)  // top-k picks distinct experts
      if (idx[size_t(n * k)] == idx[size_t(n * k + 1)]) idx[size_t(n * k + 1)] = (idx[size_t(n * k)] + 1) % int32_t(E);
    const ops::RoutePlan plan =
        ops::route_plan(Tensor::from_host(idx.data(), {N, k}, DType::I32).to(Device::CUDA), E);
    const Tensor dout = Tensor::from_host(make_data({1, N, D}, Data::Varied, 3500 + uint32_t(D)).data(), {N, D},
                                          DType::F32).to(Device::CUDA);
    const Tensor y_perm = Tensor::from_host(make_data({1, N * k, D}, Data::Varied, 3600 + uint32_t(D)).data(),
                                            {N * k, D}, DType::F32).to(Device::CUDA);
    const Tensor w = Tensor::from_host(make_data({1, N, k}, Data::Varied, 3700 + uint32_t(D)).data(), {N, k},
                                       DType::F32).to(Device::CUDA);
    std::vector<ops::RngKey> keys;
    for (int64_t e = 0; e < E; ++e) keys.push_back({9, uint64_t(e)});
    ++run;
    QuantSpec rs = row;
    rs.rounding = run % 2 ? num::Rounding::SR : num::Rounding::RNE;
    const ops::FormOut row_out = kForms[run % 3], col_out = kForms[(run + 2) % 3];
    Tensor dw = Tensor::empty({N, k}, DType::F32, Device::CUDA), dw_want = dw.clone();
    const ops::RowColQuant got = ops::moe_combine_backward_row_col(dout, y_perm, plan.slot_of, w, dw, rs, {9, 99}, col,
                                                                  plan.offsets, keys, row_out, col_out);
    Tensor dy_perm = Tensor::empty({N * k, D}, DType::F32, Device::CUDA);
    ops::moe_combine_backward(dout, y_perm, plan.slot_of, w, dy_perm, dw_want);
    ops::check_index_errors(Device::CUDA);
    EXPECT_EQ(first_mismatch(host_vec<float>(dw), host_vec<float>(dw_want)), -1) << "dw, D " << D;
    const Tensor dp = dy_perm.to(Device::CPU);
    const std::string what = "D " + std::to_string(D);
    if (!same_row_col_forms(dp, got, rs, {9, 99}, row_out, col, plan.offsets, keys, col_out, what)) return;
  }
  // two assignments of one slot: reported at the next check
  const std::vector<int32_t> shared = {0, 1, 1, 2};
  const Tensor slot_of = Tensor::from_host(shared.data(), {2, 2}, DType::I32).to(Device::CUDA);
  const Tensor dout = Tensor::zeros({2, 32}, DType::F32, Device::CUDA), y = Tensor::zeros({4, 32}, DType::F32, Device::CUDA);
  const Tensor w = Tensor::zeros({2, 2}, DType::F32, Device::CUDA);
  Tensor dw = Tensor::empty({2, 2}, DType::F32, Device::CUDA);
  (void)ops::moe_combine_backward_row_col(dout, y, slot_of, w, dw, row, {1, 1}, col, {0, 4}, {{1, 2}}, ops::FormOut::Bf16,
                                          ops::FormOut::Bf16);
  try {
    ops::check_index_errors(Device::CUDA);
    ADD_FAILURE() << "a shared slot went unreported";
  } catch (const std::exception& e) {
    // either of the two assignments may be the one that finds the slot taken
    EXPECT_NE(std::string(e.what()).find("= 1 is also the slot of another assignment"), std::string::npos) << e.what();
  }
}

// ops::swiglu_forward_row_col on the GPU (a computed and quantized in one pass) gives the bits of
// swiglu_forward followed by the CPU's quantizers of that a: with Col forms per segment (widths
// inside, at and past one 256-column tile, segments empty, short and long; RNE and SR, every
// FormOut) and without them (the Row form alone, as prepare of w2's input makes it).
TEST(CudaQuantize, SwigluRowColMatchesSwigluThenQuantize) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec row = recipe_by_name("mxfp8").expert.fprop.a, col = recipe_by_name("mxfp8").expert.wgrad.b;
  row.axis = BlockAxis::Row;
  col.axis = BlockAxis::Col;
  ASSERT_TRUE(ops::row_col_one_pass(row, col));
  const std::vector<std::vector<int64_t>> lengths = {{0, 1, 31, 32, 33, 100, 0, 64}, {70}, {}};
  uint32_t seed = 3300;
  int run = 0;
  for (int64_t F : {1, 37, 256, 300, 1024})
    for (const auto& len : lengths) {
      std::vector<int64_t> offsets;
      int64_t rows = 45;  // no segments: the Row form alone
      if (!len.empty()) {
        offsets = {0};
        for (int64_t n : len) offsets.push_back(offsets.back() + n);
        rows = offsets.back();
      }
      const Dims d{1, rows, F};
      const Tensor h1 = Tensor::from_host(make_data(d, Data::Varied, seed++).data(), d.shape(), DType::F32).to(Device::CUDA);
      const Tensor h3 = Tensor::from_host(make_data(d, Data::Huge, seed++).data(), d.shape(), DType::F32).to(Device::CUDA);
      ++run;
      QuantSpec rs = row, cs = col;
      rs.rounding = run % 2 ? num::Rounding::SR : num::Rounding::RNE;
      cs.rounding = run % 3 ? num::Rounding::RNE : num::Rounding::SR;
      const ops::FormOut row_out = kForms[run % 3], col_out = kForms[(run / 3 + run + 2) % 3];
      const ops::RngKey row_key{0x71u + uint64_t(run), 1};
      std::vector<ops::RngKey> keys;
      for (size_t e = 0; e < len.size(); ++e) keys.push_back({0x72u + uint64_t(run), 5 * e + 1});
      const ops::RowColQuant got = ops::swiglu_forward_row_col(h1, h3, rs, row_key, cs, offsets, keys, row_out, col_out);
      Tensor a = Tensor::empty(d.shape(), DType::F32, Device::CUDA);
      ops::swiglu_forward(h1, h3, a);
      const Tensor a_cpu = a.to(Device::CPU);
      const std::string what = d.str() + " run " + std::to_string(run);
      if (!same_row_col_forms(a_cpu, got, rs, row_key, row_out, cs, offsets, keys, col_out, what)) return;
    }
  EXPECT_EQ(run, 15);
}

// ops::swiglu_backward_row_col on the GPU (dh1 and dh3 computed and quantized in one pass) gives
// the bits of swiglu_backward followed by quantize_row_col of each, on the GPU and on the CPU:
// widths inside, at and past one 128-column half tile, segments empty, shorter than a block and
// longer than several, more than a launch takes; RNE and SR on each side, every FormOut, its own
// keys per output; a NaN in da flags the quantizers as the separate passes do.
TEST(CudaQuantize, SwigluGradsRowColMatchSwigluThenRowCol) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec row = recipe_by_name("mxfp8").expert.dgrad.a, col = recipe_by_name("mxfp8").expert.wgrad.a;
  row.axis = BlockAxis::Row;
  col.axis = BlockAxis::Col;
  ASSERT_TRUE(ops::row_col_one_pass(row, col));
  const std::vector<std::vector<int64_t>> lengths = {{0, 1, 31, 32, 33, 100, 0, 64}, {70}, std::vector<int64_t>(36, 9)};
  uint32_t seed = 3100;
  int run = 0;
  for (int64_t F : {1, 37, 128, 200, 1024})
    for (const auto& len : lengths) {
      std::vector<int64_t> offsets = {0};
      for (int64_t n : len) offsets.push_back(offsets.back() + n);
      const Dims d{1, offsets.back(), F};
      std::vector<Tensor> in;
      for (int k = 0; k < 3; ++k)
        in.push_back(Tensor::from_host(make_data(d, k == 2 ? Data::Huge : Data::Varied, seed++).data(), d.shape(),
                                       DType::F32));
      const bool nan = F == 200 && len.size() == 1;
      if (nan) {  // a NaN in da reaches dh1 and dh3 of one element
        std::vector<float> h = host_vec<float>(in[0]);
        h[5 * size_t(F) + 150] = std::numeric_limits<float>::quiet_NaN();
        in[0] = Tensor::from_host(h.data(), d.shape(), DType::F32);
      }
      const Tensor da = in[0].to(Device::CUDA), h1 = in[1].to(Device::CUDA), h3 = in[2].to(Device::CUDA);
      ++run;
      QuantSpec rs = row, cs = col;
      rs.rounding = run % 2 ? num::Rounding::SR : num::Rounding::RNE;
      cs.rounding = run % 3 ? num::Rounding::RNE : num::Rounding::SR;
      const ops::FormOut row_out = kForms[run % 3], col_out = kForms[(run / 3 + run + 1) % 3];
      const std::array<ops::RngKey, 2> row_keys = {ops::RngKey{0x51u + uint64_t(run), 1}, {0x52u + uint64_t(run), 2}};
      std::array<std::vector<ops::RngKey>, 2> keys;
      for (size_t e = 0; e < len.size(); ++e) {
        keys[0].push_back({0x61u + uint64_t(run), 7 * e + 1});
        keys[1].push_back({0x62u + uint64_t(run), 7 * e + 2});
      }
      (void)ops::nonfinite_seen(true);
      const std::array<ops::RowColQuant, 2> got =
          ops::swiglu_backward_row_col(da, h1, h3, rs, row_keys, cs, offsets, keys, row_out, col_out);
      const bool fused_flag = ops::nonfinite_seen(true);
      Tensor dh[2] = {Tensor::empty(d.shape(), DType::F32, Device::CUDA), Tensor::empty(d.shape(), DType::F32, Device::CUDA)};
      ops::swiglu_backward(da, h1, h3, dh[0], dh[1]);
      const std::string what = d.str() + " run " + std::to_string(run);
      // the separate passes on the GPU; they flag what the fused pass flags (the NaN, and any
      // product of da and the huge h3 past FLT_MAX)
      std::array<ops::RowColQuant, 2> aparts;
      for (int o = 0; o < 2; ++o)
        aparts[size_t(o)] = ops::quantize_row_col(dh[o], rs, row_keys[size_t(o)], cs, offsets, keys[size_t(o)],
                                                  ops::FormOut::CodesAndBf16, ops::FormOut::CodesAndBf16);
      EXPECT_EQ(fused_flag, ops::nonfinite_seen(true)) << what;
      if (nan) {
        EXPECT_TRUE(fused_flag) << what;
      }
      for (int o = 0; o < 2; ++o) {
        const std::string wo = what + (o ? " dh3" : " dh1");
        const ops::RowColQuant& apart = aparts[size_t(o)];
        // and the CPU's quantizers of the GPU's dh
        const Tensor dh_cpu = dh[o].to(Device::CPU);
        if (!same_row_col_forms(dh_cpu, got[size_t(o)], rs, row_keys[size_t(o)], row_out, cs, offsets,
                                keys[size_t(o)], col_out, wo))
          return;
        if (!same_form(apart.row, got[size_t(o)].row, row_out, wo + " row against the passes")) return;
      }
    }
  EXPECT_EQ(run, 15);
  // a host tensor among the inputs is refused, naming it
  const Tensor dev = Tensor::zeros({64, 32}, DType::F32, Device::CUDA), host_t = Tensor::zeros({64, 32}, DType::F32);
  const std::array<std::vector<ops::RngKey>, 2> one = {std::vector<ops::RngKey>{{1, 1}}, std::vector<ops::RngKey>{{1, 2}}};
  try {
    (void)ops::swiglu_backward_row_col(dev, host_t, dev, row, {ops::RngKey{1, 3}, ops::RngKey{1, 4}}, col, {0, 64}, one,
                                       ops::FormOut::Bf16, ops::FormOut::Bf16);
    ADD_FAILURE() << "a host h1 was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("h1"), std::string::npos) << e.what();
  }
}

// ops::quantize_both on the GPU (quantize_row_col's kernel, a segment per slice) equals the CPU's
// quantize on each axis for 2-D and 3-D inputs (the 3-D Col-axis counters run on over the
// slices, so SR draws differ per slice), each axis written as each FormOut asks.
TEST(CudaQuantize, BothAxesMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> rows_specs, cols_specs;
  mxfp8_axis_specs(rows_specs, cols_specs);
  uint32_t seed = 2100;
  int pair = 0;
  for (const Dims& d : {Dims{1, 70, 300}, Dims{3, 45, 64}, Dims{4, 64, 257}}) {
    const Tensor x_cpu = Tensor::from_host(make_data(d, Data::Varied, seed++).data(), d.shape(), DType::F32);
    const Tensor x_gpu = x_cpu.to(Device::CUDA);
    for (const QuantSpec& rs : rows_specs)
      for (const QuantSpec& cs : cols_specs) {
        if (rs.fmt != cs.fmt) continue;
        ++pair;
        const ops::RngKey rk{0xABCu + uint64_t(pair), 1}, ck{0xDEFu + uint64_t(pair), 2};
        const ops::FormOut row_out = kForms[(pair + 1) % 3], col_out = kForms[(pair / 3 + pair) % 3];
        const ops::BothAxes got = ops::quantize_both(x_gpu, rs, rk, cs, ck, row_out, col_out);
        const std::string what = d.str() + " " + spec_str(rs) + " + " + spec_str(cs) + " forms " +
                                 std::to_string(int(row_out)) + "/" + std::to_string(int(col_out));
        if (!same_form(ops::quantize(x_cpu, rs, rk), got.row, row_out, what + " row")) return;
        if (!same_form(ops::quantize(x_cpu, cs, ck), got.col, col_out, what + " col")) return;
      }
  }
  EXPECT_EQ(pair, 3 * 32);
}

// ops::quantize_both_each on the GPU (one launch of the jobs kernel per MXFP8 variant) equals
// ops::quantize_both on each tensor, byte for byte and form for form: 2-D and 3-D tensors of
// widths that are and are not a multiple of the CTA's 256 columns and of the block, rows not a
// multiple of 32, an empty tensor among them, every element format, rounding pair and scale rule
// (jobs of different variants interleaved, so the launches take them out of order), more CTAs than
// fit the GPU at once.
TEST(CudaQuantize, BothAxesEachMatchesBothAxes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<QuantSpec> rows_specs, cols_specs;
  mxfp8_axis_specs(rows_specs, cols_specs);
  const std::vector<Dims> dims = {{1, 70, 300}, {3, 45, 64}, {4, 64, 257}, {1, 1024, 1024}, {16, 96, 512},
                                  {1, 0, 64},   {1, 5, 36},  {2, 33, 1000}};
  std::vector<Tensor> xs;
  uint32_t seed = 2300;
  for (const Dims& d : dims)
    xs.push_back(Tensor::from_host(make_data(d, Data::Varied, seed++).data(), d.shape(), DType::F32, Device::CUDA));
  std::vector<ops::BothJob> jobs;
  std::vector<std::string> names;
  int pair = 0;
  for (const QuantSpec& rs : rows_specs)
    for (const QuantSpec& cs : cols_specs) {
      if (rs.fmt != cs.fmt) continue;
      const size_t i = size_t(pair) % xs.size();
      ++pair;
      jobs.push_back({xs[i], rs, {0x51u + uint64_t(pair), 1}, cs, {0x77u + uint64_t(pair), 2},
                      kForms[size_t(pair + 1) % 3], kForms[size_t(pair / 3 + pair) % 3]});
      names.push_back(dims[i].str() + " " + spec_str(rs) + " + " + spec_str(cs));
    }
  const std::vector<ops::BothAxes> got = ops::quantize_both_each(jobs);
  ASSERT_EQ(got.size(), jobs.size());
  for (size_t k = 0; k < jobs.size(); ++k) {
    const ops::BothJob& j = jobs[k];
    const ops::BothAxes want = ops::quantize_both(j.x, j.row_spec, j.row_rng, j.col_spec, j.col_rng, j.row_out,
                                                  j.col_out);
    for (const auto& [a, b, axis] : {std::tuple{&want.row, &got[k].row, "row"}, std::tuple{&want.col, &got[k].col, "col"}}) {
      const std::string what = names[k] + " " + axis;
      EXPECT_EQ(a->codes.defined(), b->codes.defined()) << what;
      EXPECT_EQ(a->bf16.defined(), b->bf16.defined()) << what;
      if (a->codes.defined() && !same_qtensor(*a, *b, what)) return;
      if (a->bf16.defined()) {
        EXPECT_EQ(host_vec<uint16_t>(a->bf16), host_vec<uint16_t>(b->bf16)) << what << ": BF16 decodes differ";
      }
    }
  }
  EXPECT_EQ(pair, 32);
  // quantize_both_each_into: other tensors of the same shapes written into those forms in place
  // (a step's weights after an update), the bits of quantize_both_each on them
  std::vector<ops::BothJob> again = jobs;
  std::map<const void*, Tensor> next;
  for (ops::BothJob& j : again) {
    Tensor& x = next[j.x.raw()];
    if (!x.defined()) {
      const auto same = [&](const Tensor& t) { return t.raw() == j.x.raw(); };
      const Dims d = dims[size_t(std::find_if(xs.begin(), xs.end(), same) - xs.begin())];
      x = Tensor::from_host(make_data(d, Data::Varied, seed++).data(), d.shape(), DType::F32, Device::CUDA);
    }
    j.x = x;
  }
  std::vector<ops::BothAxes> into = got;
  ops::quantize_both_each_into(again, into);
  const std::vector<ops::BothAxes> fresh = ops::quantize_both_each(again);
  for (size_t k = 0; k < jobs.size(); ++k)
    for (const auto& [a, b, was, axis] : {std::tuple{&fresh[k].row, &into[k].row, &got[k].row, "row"},
                                          std::tuple{&fresh[k].col, &into[k].col, &got[k].col, "col"}}) {
      const std::string what = names[k] + " " + axis + " (written into)";
      EXPECT_EQ(b->codes.defined() ? b->codes.raw() : nullptr, was->codes.defined() ? was->codes.raw() : nullptr)
          << what;
      EXPECT_EQ(b->bf16.defined() ? b->bf16.raw() : nullptr, was->bf16.defined() ? was->bf16.raw() : nullptr) << what;
      if (a->codes.defined() && !same_qtensor(*a, *b, what)) return;
      if (a->bf16.defined()) {
        EXPECT_EQ(host_vec<uint16_t>(a->bf16), host_vec<uint16_t>(b->bf16)) << what << ": BF16 decodes differ";
      }
    }
  std::vector<ops::BothAxes> short_forms(into.begin(), into.begin() + 1);
  EXPECT_THROW(ops::quantize_both_each_into({again[1]}, short_forms), std::exception) << "another tensor's forms";
}

// A GEMM that reads quantize_row_col's BF16 decodes gives the bits of the same GEMM decoding the
// codes itself (the decode pass), for the Row-axis operand of fprop/dgrad and the Col-axis
// operands of a weight gradient (whole and per expert segment, through gemm_batch_grouped), and
// the views of a decoded operand (qtensor_rows) keep their rows of it.
TEST(CudaQuantize, RowColDecodesFeedTheGemmsAsTheDecodePass) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec row = recipe_by_name("mxfp8").expert.fprop.a;
  row.axis = BlockAxis::Row;
  QuantSpec col = row;
  col.axis = BlockAxis::Col;
  const int64_t R = 300, C = 200, Cy = 96, N = 72;
  const std::vector<int64_t> offsets = {0, 64, 64, 250, 300};
  const std::vector<ops::RngKey> keys = {{1, 2}, {1, 3}, {1, 4}, {1, 5}};
  const Tensor x = Tensor::from_host(make_data({1, R, C}, Data::Varied, 11).data(), {R, C}, DType::F32).to(Device::CUDA);
  const Tensor y = Tensor::from_host(make_data({1, R, Cy}, Data::Varied, 12).data(), {R, Cy}, DType::F32).to(Device::CUDA);
  const Tensor w = Tensor::from_host(make_data({1, N, C}, Data::Varied, 13).data(), {N, C}, DType::F32).to(Device::CUDA);
  const QTensor qw = ops::quantize(w, row, {7, 7});
  const ops::RowColQuant px = ops::quantize_row_col(x, row, {3, 1}, col, offsets, keys, ops::FormOut::CodesAndBf16,
                                                    ops::FormOut::CodesAndBf16);
  const ops::RowColQuant py = ops::quantize_row_col(y, row, {3, 2}, col, offsets, keys, ops::FormOut::CodesAndBf16,
                                                    ops::FormOut::CodesAndBf16);
  // the same forms as their decodes alone (ops::FormOut::Bf16): no codes to decode or to key on
  const ops::RowColQuant dx = ops::quantize_row_col(x, row, {3, 1}, col, offsets, keys, ops::FormOut::Bf16,
                                                    ops::FormOut::Bf16);
  const ops::RowColQuant dy = ops::quantize_row_col(y, row, {3, 2}, col, offsets, keys, ops::FormOut::Bf16,
                                                    ops::FormOut::Bf16);
  ASSERT_FALSE(dx.row.codes.defined());
  auto plain = [](QTensor q) {
    q.bf16 = Tensor{};
    return q;
  };
  auto same = [](const Tensor& a, const Tensor& b, const std::string& what) {
    const auto ha = host_vec<float>(a), hb = host_vec<float>(b);
    EXPECT_EQ(first_mismatch(ha, hb), -1) << what;
  };
  {  // fprop: X . W^T, and rows 64 .. 250 of X through a view
    Tensor c1 = Tensor::empty({R, N}, DType::F32, Device::CUDA), c2 = c1.clone();
    ops::gemm(ops::Operand(px.row), ops::Operand(qw), c1);
    ops::gemm(ops::Operand(plain(px.row)), ops::Operand(qw), c2);
    same(c1, c2, "fprop");
    Tensor c3 = c1.clone();
    ops::gemm(ops::Operand(dx.row), ops::Operand(qw), c3);
    same(c3, c2, "fprop, the decode alone");
    const QTensor v = ops::qtensor_rows(px.row, 64, 250);
    ASSERT_TRUE(v.bf16.defined());
    Tensor d1 = Tensor::empty({186, N}, DType::F32, Device::CUDA), d2 = d1.clone();
    ops::gemm(ops::Operand(v), ops::Operand(qw), d1);
    ops::gemm(ops::Operand(plain(v)), ops::Operand(qw), d2);
    same(d1, d2, "fprop of a row view");
    Tensor d3 = d1.clone();
    ops::gemm(ops::Operand(ops::qtensor_rows(dx.row, 64, 250)), ops::Operand(qw), d3);
    same(d3, d2, "fprop of a row view, the decode alone");
  }
  {  // experts: X . W_e^T with W_e's decodes from quantize_both, and dgrad's dY . W_e with W's Col form
    const int64_t E = 4, F = 48;
    const Tensor we = Tensor::from_host(make_data({E, F, C}, Data::Varied, 14).data(), {E, F, C}, DType::F32)
                          .to(Device::CUDA);
    const ops::BothAxes qe = ops::quantize_both(we, row, {8, 1}, col, {8, 2}, ops::FormOut::CodesAndBf16,
                                                ops::FormOut::CodesAndBf16);
    ASSERT_TRUE(qe.row.bf16.defined() && qe.col.bf16.defined());
    Tensor c1 = Tensor::empty({R, F}, DType::F32, Device::CUDA), c2 = c1.clone();
    ops::grouped_gemm(ops::Operand(px.row), ops::Operand(qe.row), offsets, c1);
    ops::grouped_gemm(ops::Operand(plain(px.row)), ops::Operand(plain(qe.row)), offsets, c2);
    same(c1, c2, "expert fprop");
    Tensor c3 = c1.clone();
    ops::grouped_gemm(ops::Operand(dx.row), ops::Operand(qe.row), offsets, c3);
    same(c3, c2, "expert fprop, the decode alone");
    const Tensor dyf = Tensor::from_host(make_data({1, R, F}, Data::Varied, 15).data(), {R, F}, DType::F32)
                           .to(Device::CUDA);
    const QTensor qdy = ops::quantize(dyf, row, {9, 9});
    Tensor d1 = Tensor::empty({R, C}, DType::F32, Device::CUDA), d2 = d1.clone();
    ops::grouped_gemm(ops::Operand(qdy), ops::Operand(qe.col), offsets, d1);
    ops::grouped_gemm(ops::Operand(qdy), ops::Operand(plain(qe.col)), offsets, d2);
    same(d1, d2, "expert dgrad");
    // dY as its decode alone, against dY's codes (dgrad's A of a training step)
    const ops::RowColQuant pdy = ops::quantize_row_col(dyf, row, {9, 9}, col, {0, R}, {{9, 10}}, ops::FormOut::Bf16,
                                                       ops::FormOut::Bf16);
    Tensor d3 = d1.clone();
    ops::grouped_gemm(ops::Operand(pdy.row), ops::Operand(qe.col), offsets, d3);
    same(d3, d2, "expert dgrad, dY the decode alone");
  }
  {  // wgrad of every segment: dY^T[e] . X^T[e], in one batch
    std::vector<Tensor> with(offsets.size() - 1), without(offsets.size() - 1);
    std::vector<ops::GemmJob> jw, jn;
    for (size_t e = 0; e + 1 < offsets.size(); ++e) {
      if (offsets[e] == offsets[e + 1]) continue;
      with[e] = Tensor::zeros({Cy, C}, DType::F32, Device::CUDA);
      without[e] = with[e].clone();
    }
    std::vector<QTensor> plain_y, plain_x;
    for (size_t e = 0; e < with.size(); ++e) {
      plain_y.push_back(py.col[e].codes.defined() ? plain(py.col[e]) : QTensor{});
      plain_x.push_back(px.col[e].codes.defined() ? plain(px.col[e]) : QTensor{});
    }
    for (size_t e = 0; e < with.size(); ++e) {
      if (!with[e].defined()) continue;
      jw.push_back({ops::Operand(py.col[e]), ops::Operand(px.col[e]), &with[e], true});
      jn.push_back({ops::Operand(plain_y[e]), ops::Operand(plain_x[e]), &without[e], true});
    }
    ops::gemm_batch_grouped(jw);
    ops::gemm_batch_grouped(jn);
    for (size_t e = 0; e < with.size(); ++e)
      if (with[e].defined()) same(with[e], without[e], "wgrad segment " + std::to_string(e));
    // both operands their decodes alone, in one batch (no codes to tell the operands apart by)
    std::vector<Tensor> alone(with.size());
    std::vector<ops::GemmJob> ja;
    for (size_t e = 0; e < with.size(); ++e) {
      if (!with[e].defined()) continue;
      alone[e] = Tensor::zeros({Cy, C}, DType::F32, Device::CUDA);
      ja.push_back({ops::Operand(dy.col[e]), ops::Operand(dx.col[e]), &alone[e], true});
    }
    ops::gemm_batch_grouped(ja);
    for (size_t e = 0; e < with.size(); ++e)
      if (with[e].defined()) same(alone[e], without[e], "wgrad segment, the decodes alone " + std::to_string(e));
  }
}

// ops::requantize_transposed_segments on the GPU (one launch for up to 16 of an NVFP4 activation's
// row segments) equals the CPU's requantize_transposed of each segment's rows: empty segments,
// segments shorter than a block and longer than a 256-row tile, more segments than one launch
// takes, widths that end inside a 32-column tile, per-token and per-tensor outer scales.
TEST(CudaQuantize, RequantizeSegmentsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::vector<int64_t>> lengths = {{0, 1, 31, 300, 0, 64, 33}, std::vector<int64_t>(20, 45)};
  uint32_t seed = 950;
  for (int64_t cols : {16, 48, 1024})
    for (const auto& len : lengths)
      for (OuterScale outer : {OuterScale::PerRow, OuterScale::Tensor}) {
        std::vector<int64_t> offsets = {0};
        for (int64_t n : len) offsets.push_back(offsets.back() + n);
        const Dims d{1, offsets.back(), cols};
        const auto host = make_data(d, Data::Varied, seed++);
        QuantSpec spec;
        spec.fmt = Format::NVFP4;
        spec.outer = outer;
        spec.four_over_six = true;
        const QTensor q_cpu = ops::quantize(Tensor::from_host(host.data(), d.shape(), DType::F32), spec);
        const QTensor q_gpu = q_cpu.to(Device::CUDA);
        std::vector<ops::RngKey> keys;
        for (size_t e = 0; e < len.size(); ++e) keys.push_back({0xBEEFu + seed, 5 * e + 1});
        const std::vector<QTensor> got = ops::requantize_transposed_segments(q_gpu, offsets, kRequantTarget, keys);
        ASSERT_EQ(got.size(), len.size());
        for (size_t e = 0; e < len.size(); ++e) {
          const std::string what = d.str() + " segment " + std::to_string(e);
          if (len[e] == 0) {
            EXPECT_FALSE(got[e].codes.defined()) << what;
            continue;
          }
          const QTensor want = ops::requantize_transposed(ops::qtensor_rows(q_cpu, offsets[e], offsets[e + 1]), kRequantTarget, keys[e]);
          if (!same_qtensor(want, got[e], what)) return;
        }
      }
}

// Inputs that are not 16-byte aligned or whose rows are not a multiple of 4 floats take the
// scalar load paths; QTensor views (rows of a token batch, one expert of a stack) take the
// unaligned code paths of dequantize and requantize_transposed.
TEST(CudaQuantize, UnalignedInputsAndViewsMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Dims d{1, 70, 96};
  const auto host = make_data(d, Data::Varied, 21);
  std::vector<float> padded(host.size() + 1, 0.0f);
  std::copy(host.begin(), host.end(), padded.begin() + 1);
  const Tensor big = Tensor::from_host(padded.data(), {int64_t(padded.size())}, DType::F32, Device::CUDA);
  const Tensor x_gpu = big.view(1, d.shape());  // 4 bytes past a 256-byte boundary
  const Tensor x_cpu = Tensor::from_host(host.data(), d.shape(), DType::F32);
  int index = 0;
  for (const QuantSpec& s : all_specs(d)) {
    const ops::RngKey rng{77, uint64_t(index++)};
    const std::string what = "unaligned " + spec_str(s);
    if (!same_qtensor(ops::quantize(x_cpu, s, rng), ops::quantize(x_gpu, s, rng), what)) break;
  }
  const Dims d3{2, 48, 40};
  const Tensor x3 = Tensor::from_host(make_data(d3, Data::Varied, 22).data(), d3.shape(), DType::F32);
  for (const QuantSpec& base : all_specs(d3)) {
    if (base.axis != BlockAxis::Row || base.hadamard != 0 || base.rounding != Rounding::RNE) continue;
    const QTensor qc = ops::quantize(x3, base);
    const QTensor qg = qc.to(Device::CUDA);
    const std::string what = "views " + spec_str(base);
    const QTensor sc = ops::qtensor_slice(qc, 1), sg = ops::qtensor_slice(qg, 1);
    same_floats(ops::dequantize(sc), ops::dequantize(sg), what + " slice dequantize");
    if (base.outer != OuterScale::PerSlice) {
      const QTensor rc = ops::qtensor_rows(ops::qtensor_slice(qc, 0), 3, 41);
      const QTensor rg = ops::qtensor_rows(ops::qtensor_slice(qg, 0), 3, 41);
      same_floats(ops::dequantize(rc), ops::dequantize(rg), what + " rows dequantize");
      if (base.fmt == Format::NVFP4)
        same_qtensor(ops::requantize_transposed(rc, kRequantTarget, {5, 6}), ops::requantize_transposed(rg, kRequantTarget, {5, 6}),
                     what + " rows requantize_transposed");
    }
  }
}

// NaN and Inf inputs raise the sticky flag (ops::nonfinite_seen reads the device flag) and are
// counted like the CPU counts them (input values, before an RHT spreads them over a chunk).
// Rows of 50 floats take the tile kernels; rows of 64 (float4-loadable) the register-resident
// Row-axis kernels, whose non-finite blocks leave the fast numerics for the generic ones.
TEST(CudaQuantize, NonfiniteInputIsCountedAndFlagged) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const Dims d : {Dims{1, 19, 50}, Dims{2, 19, 64}}) {
    auto host = make_data(d, Data::Varied, 31);
    host[5 * d.cols + 7] = std::numeric_limits<float>::quiet_NaN();
    host[11 * d.cols + 33] = -std::numeric_limits<float>::infinity();
    host[18 * d.cols + 49] = std::numeric_limits<float>::infinity();
    const Tensor x_cpu = Tensor::from_host(host.data(), d.shape(), DType::F32);
    const Tensor x_gpu = x_cpu.to(Device::CUDA);
    for (const QuantSpec& s : all_specs(d)) {
      const std::string what = "non-finite " + d.str() + " " + spec_str(s);
      ops::nonfinite_seen(true);
      ops::QuantReport rg;
      const QTensor qg = ops::quantize(x_gpu, s, {3, 4}, &rg);
      EXPECT_TRUE(ops::nonfinite_seen(false)) << what << ": flag not raised";
      EXPECT_TRUE(ops::nonfinite_seen(true)) << what << ": flag cleared by a non-clearing read";
      EXPECT_FALSE(ops::nonfinite_seen(true)) << what << ": flag not cleared";
      ops::QuantReport rc;
      const QTensor qc = ops::quantize(x_cpu, s, {3, 4}, &rc);
      ops::nonfinite_seen(true);
      EXPECT_EQ(rg.nonfinite, 3) << what;
      same_report(rc, rg, what);
      // The bytes are still a function of the input. Except behind an RHT in MXFP8: there an Inf
      // or NaN spreads over its chunk as NaNs whose sign bit (kept in the E4M3/E5M2 NaN code)
      // differs between x86 and the GPU.
      const bool mx = s.fmt == Format::MXFP8_E4M3 || s.fmt == Format::MXFP8_E5M2;
      if (!(mx && s.hadamard)) same_qtensor(qc, qg, what);
    }
  }
  // A finite input leaves the flag down.
  const Dims d{1, 19, 50};
  const Tensor clean = Tensor::from_host(make_data(d, Data::Varied, 32).data(), d.shape(), DType::F32, Device::CUDA);
  QuantSpec s;
  s.fmt = Format::NVFP4;
  (void)ops::quantize(clean, s);
  EXPECT_FALSE(ops::nonfinite_seen(true));
}

#if FOURBIT_HAS_CUDA
TEST(CudaQuantize, RejectsHostTensors) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Tensor x = Tensor::zeros({4, 16}, DType::F32);
  QuantSpec s;
  s.fmt = Format::NVFP4;
  EXPECT_THROW((void)ops::cuda::quantize(x, s, {}, nullptr, nullptr, ops::FormOut::Codes), Error);
  const QTensor q = ops::quantize(x, s);
  EXPECT_THROW((void)ops::cuda::dequantize(q, true), Error);
  EXPECT_THROW((void)ops::cuda::requantize_transposed(q, kRequantTarget, {}, ops::FormOut::Codes), Error);
  const Tensor xi = Tensor::zeros({4, 16}, DType::I32, Device::CUDA);
  EXPECT_THROW((void)ops::quantize(xi, s), Error);
}
#endif

// ---- the dispatch lists ----------------------------------------------------------------------------

#if FOURBIT_HAS_CUDA
namespace {

QuantSpec make_spec(Format f, BlockAxis axis, OuterScale outer, Rounding rnd, bool fos = false, int had = 0) {
  QuantSpec s;
  s.fmt = f;
  s.axis = axis;
  s.outer = format_info(f).fields & kFieldOuter ? outer : OuterScale::None;
  s.rounding = rnd;
  s.four_over_six = fos;
  s.hadamard = had;
  s.hadamard_signs = had == 16 ? num::kNvidiaRht16Signs : 0x2468ACE1u;
  return s;
}

// One case per entry of every format's quantize list (quantize.cu), the entry it must take, and
// whether the caller gives the group amax (the FFN's shared w1/w3 outer scale).
// A saved activation as nvfp4-fwd keeps it (NVFP4, per-token scales, Four Over Six) on the CPU:
// what requantize_transposed reads.
QTensor saved_tokens(const Dims& d, uint32_t seed) {
  QuantSpec nv;
  nv.fmt = Format::NVFP4;
  nv.outer = OuterScale::PerRow;
  nv.four_over_six = true;
  return ops::quantize(Tensor::from_host(make_data(d, Data::Varied, seed).data(), d.shape(), DType::F32), nv);
}

struct DispatchCase {
  Dims d;
  QuantSpec spec;
  bool group_amax;
  const char* entry;
};

std::vector<DispatchCase> dispatch_cases() {
  using F = Format;
  const auto R = BlockAxis::Row, C = BlockAxis::Col;
  return {
      {{1, 64, 256}, make_spec(F::NVFP4, R, OuterScale::PerRow, Rounding::RNE, true), false, "nvfp4_row_fast_kernel"},
      {{1, 33, 50}, make_spec(F::NVFP4, R, OuterScale::PerRow, Rounding::RNE), false, "nvfp4_tile_row_amax"},
      {{1, 40, 96}, make_spec(F::NVFP4, R, OuterScale::PerRow, Rounding::SR, true), false, "nvfp4_tile_row_amax"},
      {{1, 64, 256}, make_spec(F::NVFP4, R, OuterScale::Tensor, Rounding::RNE), false, "quantize_tile_kernel"},
      {{3, 32, 64}, make_spec(F::NVFP4, C, OuterScale::PerSlice, Rounding::SR), true, "quantize_tile_kernel"},
      {{1, 48, 64}, make_spec(F::NVFP4, R, OuterScale::PerRow, Rounding::RNE, true), true, "quantize_tile_kernel"},
      {{2, 64, 96}, make_spec(F::MXFP8_E4M3, C, OuterScale::None, Rounding::SR), false, "mxfp8_col_fast_kernel"},
      {{1, 64, 96}, make_spec(F::MXFP8_E5M2, R, OuterScale::None, Rounding::SR), false, "mxfp8_row_fast_kernel"},
      {{1, 64, 96}, make_spec(F::MXFP8_E4M3, R, OuterScale::None, Rounding::SR, false, 32), false,
       "quantize_tile_kernel"},
      {{1, 40, 70}, make_spec(F::S2F6, R, OuterScale::None, Rounding::RNE, false, 32), false, "quantize_tile_kernel"},
      {{1, 40, 96}, make_spec(F::MXFP4, R, OuterScale::None, Rounding::SR), false, "quantize_tile_kernel"},
      {{2, 40, 70}, make_spec(F::MXFP4, C, OuterScale::None, Rounding::RNE, false, 16), false, "quantize_tile_kernel"},
  };
}

}  // namespace

// Host code only (no GPU needed): the cases take the entries they name, and together they reach
// every entry of every format's list.
TEST(CudaQuantize, DispatchCasesReachEveryEntry) {
  std::set<std::pair<Format, std::string>> reached;
  for (const DispatchCase& c : dispatch_cases()) {
    const bool vec4 = c.d.cols % 4 == 0;  // fresh device allocations are 16-byte aligned
    EXPECT_STREQ(ops::cuda::quantize_kernel_for(c.spec, c.d.slices, c.d.rows, c.d.cols, vec4, c.group_amax), c.entry)
        << spec_str(c.spec) << " " << c.d.str();
    reached.insert({c.spec.fmt == Format::MXFP8_E5M2 ? Format::MXFP8_E4M3 : c.spec.fmt, c.entry});
  }
  for (Format f : quantized_formats()) {
    const Format list = f == Format::MXFP8_E5M2 ? Format::MXFP8_E4M3 : f;  // one list for both MXFP8 elements
    const std::vector<std::string> names = ops::cuda::quantize_kernel_names(f);
    ASSERT_FALSE(names.empty()) << format_name(f);
    EXPECT_EQ(names.back(), "quantize_tile_kernel") << format_name(f) << ": the generic kernel goes last";
    for (const std::string& n : names) EXPECT_TRUE(reached.count({list, n})) << format_name(f) << ": " << n << " is not reached";
  }
  QTensor q;
  q.fmt = Format::NVFP4;
  EXPECT_STREQ(ops::cuda::requantize_kernel_for(q, ops::requantize_transposed_spec(q, kRequantTarget)),
               "requantize_transposed_kernel");
  QuantSpec e5 = kRequantTarget;
  e5.fmt = Format::MXFP8_E5M2;
  EXPECT_STREQ(ops::cuda::requantize_kernel_for(q, ops::requantize_transposed_spec(q, e5)), "dequantize_then_quantize");
}

// The cases above on the GPU against the CPU, byte for byte: quantize (with the caller's group
// amax where the case says so: the joint amax of two tensors, as an FFN's w1 and w3 share it, and
// outer_amax itself), dequantize, and requantize_transposed to each target kind (the fused kernel
// for E4M3 with SR, the dequantize-then-quantize composition for E5M2 and for RNE).
TEST(CudaQuantize, DispatchEntriesMatchCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1200;
  for (const DispatchCase& c : dispatch_cases()) {
    const std::string what = std::string(c.entry) + " " + spec_str(c.spec) + " " + c.d.str();
    const auto host = make_data(c.d, Data::Varied, seed++);
    if (!c.group_amax) {
      check_specs(host, c.d, {c.spec}, "dispatch");
      continue;
    }
    const auto other = make_data(c.d, Data::HeavyTailed, seed++);
    const Tensor x_cpu = Tensor::from_host(host.data(), c.d.shape(), DType::F32);
    const Tensor y_cpu = Tensor::from_host(other.data(), c.d.shape(), DType::F32);
    const Tensor x_gpu = x_cpu.to(Device::CUDA), y_gpu = y_cpu.to(Device::CUDA);
    const Tensor a_cpu = ops::outer_amax({x_cpu, y_cpu}, c.spec), a_gpu = ops::outer_amax({x_gpu, y_gpu}, c.spec);
    if (!same_floats(a_cpu, a_gpu, what + " outer_amax")) continue;
    const ops::RngKey rng{41, 43};
    same_qtensor(ops::quantize(x_cpu, c.spec, rng, nullptr, &a_cpu), ops::quantize(x_gpu, c.spec, rng, nullptr, &a_gpu),
                 what + " with a group amax");
  }
  // requantize_transposed to targets other than E4M3 with SR: the composition, on the GPU.
  const QTensor qc = saved_tokens({1, 70, 96}, seed++), qg = qc.to(Device::CUDA);
  for (Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2})
    for (Rounding rnd : {Rounding::RNE, Rounding::SR}) {
      QuantSpec t = kRequantTarget;
      t.fmt = f;
      t.rounding = rnd;
      const std::string what = "requantize_transposed to " + describe(t);
      same_qtensor(ops::requantize_transposed(qc, t, {7, 8}), ops::requantize_transposed(qg, t, {7, 8}), what);
      const std::vector<int64_t> offsets = {0, 31, 31, 70};
      const std::vector<ops::RngKey> keys = {{1, 2}, {1, 3}, {1, 4}};
      const auto got = ops::requantize_transposed_segments(qg, offsets, t, keys);
      for (size_t e = 0; e < keys.size(); ++e)
        if (offsets[e] < offsets[e + 1])
          same_qtensor(ops::requantize_transposed(ops::qtensor_rows(qc, offsets[e], offsets[e + 1]), t, keys[e]), got[e],
                       what + " segment " + std::to_string(e));
    }
}

// quantize and requantize_transposed written as each FormOut asks, on the GPU, against the CPU's
// codes: every dispatch entry (NVFP4's kernels write the decode beside the codes, or alone; the
// others take the decode pass after their codes), with and without a caller's group amax;
// requantize_transposed's kernel (E4M3 with SR) and its composition (E5M2), whole and by segments.
// A decode alone keeps the outer scales the GEMM applies to it.
TEST(CudaQuantize, FormsOfEveryEntryAreItsCodesDecoded) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1300;
  for (const DispatchCase& c : dispatch_cases()) {
    if (c.spec.fmt != Format::NVFP4 && c.spec.fmt != Format::MXFP8_E4M3 && c.spec.fmt != Format::MXFP8_E5M2)
      continue;  // the formats the recipes' GEMMs read (host_bf16_decode)
    const auto host = make_data(c.d, Data::Varied, seed++), other = make_data(c.d, Data::HeavyTailed, seed++);
    const Tensor x_cpu = Tensor::from_host(host.data(), c.d.shape(), DType::F32);
    const Tensor y_cpu = Tensor::from_host(other.data(), c.d.shape(), DType::F32);
    const Tensor x_gpu = x_cpu.to(Device::CUDA), y_gpu = y_cpu.to(Device::CUDA);
    const Tensor a_cpu = c.group_amax ? ops::outer_amax({x_cpu, y_cpu}, c.spec) : Tensor{};
    const Tensor a_gpu = c.group_amax ? ops::outer_amax({x_gpu, y_gpu}, c.spec) : Tensor{};
    const ops::RngKey rng{51, 53};
    const QTensor want = ops::quantize(x_cpu, c.spec, rng, nullptr, c.group_amax ? &a_cpu : nullptr);
    for (ops::FormOut form : {ops::FormOut::CodesAndBf16, ops::FormOut::Bf16}) {
      const std::string what = std::string(c.entry) + " " + spec_str(c.spec) + " " + c.d.str() +
                               (form == ops::FormOut::Bf16 ? " decode alone" : " codes and decode");
      const QTensor got = ops::quantize(x_gpu, c.spec, rng, nullptr, c.group_amax ? &a_gpu : nullptr, form);
      if (!same_form(want, got, form, what)) return;
    }
  }
  const QTensor qc = saved_tokens({1, 300, 96}, seed++), qg = qc.to(Device::CUDA);
  const std::vector<int64_t> offsets = {0, 31, 31, 290, 300};
  const std::vector<ops::RngKey> keys = {{1, 2}, {1, 3}, {1, 4}, {1, 5}};
  for (Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2}) {
    QuantSpec t = kRequantTarget;
    t.fmt = f;
    for (ops::FormOut form : {ops::FormOut::CodesAndBf16, ops::FormOut::Bf16}) {
      const std::string what = "requantize_transposed to " + describe(t) +
                               (form == ops::FormOut::Bf16 ? ", decode alone" : ", codes and decode");
      if (!same_form(ops::requantize_transposed(qc, t, {7, 8}), ops::requantize_transposed(qg, t, {7, 8}, form), form,
                     what))
        return;
      const auto got = ops::requantize_transposed_segments(qg, offsets, t, keys, form);
      ASSERT_EQ(got.size(), keys.size());
      for (size_t e = 0; e < keys.size(); ++e) {
        const std::string we = what + " segment " + std::to_string(e);
        if (offsets[e] == offsets[e + 1]) {
          EXPECT_FALSE(got[e].defined()) << we;
          continue;
        }
        if (!same_form(ops::requantize_transposed(ops::qtensor_rows(qc, offsets[e], offsets[e + 1]), t, keys[e]),
                       got[e], form, we))
          return;
      }
    }
  }
}

// QTensor::row_amax on the GPU: each NVFP4 entry of per-row scales (the register-resident kernel,
// whole-row tiles, and the tile kernel after its amax pass for rows past the fused width) keeps
// the CPU's row amaxes, in either form, with a NaN among the values; views keep theirs, a gather
// drops them, and other specs and a caller's amax leave them undefined.
TEST(CudaQuantize, Nvfp4PerRowKeepsTheCpusRowAmax) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  QuantSpec fos;
  fos.fmt = Format::NVFP4;
  fos.outer = OuterScale::PerRow;
  fos.four_over_six = true;
  QuantSpec sr = fos;
  sr.four_over_six = false;
  sr.rounding = num::Rounding::SR;
  struct Case {
    QuantSpec spec;
    Dims d;
    const char* entry;
  };
  const std::vector<Case> cases = {{fos, {1, 256, 1024}, "nvfp4_row_fast_kernel"},
                                   {fos, {3, 40, 96}, "nvfp4_row_fast_kernel"},
                                   {fos, {1, 100, 1001}, "nvfp4_tile_row_amax"},
                                   {sr, {1, 64, 512}, "nvfp4_tile_row_amax"},
                                   {fos, {1, 5, 20000}, "quantize_tile_kernel"}};
  uint32_t seed = 1500;
  for (const Case& c : cases) {
    std::vector<float> host = make_data(c.d, Data::HeavyTailed, seed++);
    host[size_t(c.d.cols + 3)] = std::nanf("");
    const Tensor x_cpu = Tensor::from_host(host.data(), c.d.shape(), DType::F32), x_gpu = x_cpu.to(Device::CUDA);
    EXPECT_STREQ(ops::cuda::quantize_kernel_for(c.spec, c.d.slices, c.d.rows, c.d.cols, c.d.cols % 4 == 0, false),
                 c.entry);
    const QTensor want = ops::quantize(x_cpu, c.spec, {5, 6});
    ASSERT_TRUE(want.row_amax.defined());
    for (ops::FormOut form : {ops::FormOut::Codes, ops::FormOut::Bf16}) {
      const std::string what = std::string(c.entry) + " " + spec_str(c.spec) + " " + c.d.str();
      const QTensor got = ops::quantize(x_gpu, c.spec, {5, 6}, nullptr, nullptr, form);
      ASSERT_TRUE(got.row_amax.defined()) << what;
      EXPECT_EQ(host_vec<float>(got.row_amax), host_vec<float>(want.row_amax)) << what;
      EXPECT_EQ(host_vec<float>(got.outer_scales), host_vec<float>(want.outer_scales)) << what;
    }
  }
  const Dims d{1, 64, 256};
  const std::vector<float> host = make_data(d, Data::Varied, seed++);
  const Tensor x = Tensor::from_host(host.data(), d.shape(), DType::F32).to(Device::CUDA);
  const QTensor q = ops::quantize(x, fos);
  const QTensor v = ops::qtensor_rows(q, 10, 20);
  ASSERT_TRUE(v.row_amax.defined());
  EXPECT_EQ(host_vec<float>(v.row_amax), host_vec<float>(q.row_amax.slice_rows(10, 20)));
  const int32_t toks[4] = {3, 3, 0, 63};
  EXPECT_FALSE(ops::gather_rows(q, Tensor::from_host(toks, {4}, DType::I32).to(Device::CUDA)).row_amax.defined());
  QuantSpec per_tensor = fos, rotated = fos;
  per_tensor.outer = OuterScale::Tensor;
  rotated.four_over_six = false;
  rotated.hadamard = 16;
  rotated.hadamard_signs = num::kNvidiaRht16Signs;
  for (const QuantSpec& s : {per_tensor, rotated}) EXPECT_FALSE(ops::quantize(x, s).row_amax.defined()) << spec_str(s);
  const Tensor amax = q.row_amax.clone();
  EXPECT_FALSE(ops::quantize(x, fos, {}, nullptr, &amax).row_amax.defined());
}

// An NVFP4 operand written with its decode (beside the codes or alone) gives a GEMM the bits of
// its codes: the decode is code x block scale, and the outer scales (per token on A, per tensor
// on B) are applied in the epilogue as they are for the codes. ops::with_decode the same.
TEST(CudaQuantize, Nvfp4DecodesFeedTheGemmAsTheCodes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const QuantSpec xs = recipe_by_name("nvfp4-fwd").expert.fprop.a;  // per-token, Four Over Six
  QuantSpec ws = xs;
  ws.outer = OuterScale::Tensor;
  ws.four_over_six = false;
  const int64_t M = 130, N = 72, K = 200;
  const Tensor x = Tensor::from_host(make_data({1, M, K}, Data::Varied, 21).data(), {M, K}, DType::F32).to(Device::CUDA);
  const Tensor w = Tensor::from_host(make_data({1, N, K}, Data::Varied, 22).data(), {N, K}, DType::F32).to(Device::CUDA);
  auto run = [&](const QTensor& a, const QTensor& b) {
    Tensor c = Tensor::empty({M, N}, DType::F32, Device::CUDA);
    ops::gemm(ops::Operand(a), ops::Operand(b), c, false);
    return host_vec<float>(c);
  };
  const auto want = run(ops::quantize(x, xs, {1, 1}), ops::quantize(w, ws, {2, 2}));
  for (ops::FormOut form : {ops::FormOut::CodesAndBf16, ops::FormOut::Bf16}) {
    const QTensor a = ops::quantize(x, xs, {1, 1}, nullptr, nullptr, form), b = ops::quantize(w, ws, {2, 2}, nullptr, nullptr, form);
    EXPECT_EQ(form == ops::FormOut::Bf16, !a.codes.defined());
    EXPECT_EQ(first_mismatch(want, run(a, b)), -1) << (form == ops::FormOut::Bf16 ? "decodes alone" : "codes and decodes");
  }
  const QTensor a = ops::with_decode(ops::quantize(x, xs, {1, 1})), b = ops::with_decode(ops::quantize(w, ws, {2, 2}));
  ASSERT_TRUE(a.bf16.defined() && b.bf16.defined());
  EXPECT_EQ(first_mismatch(want, run(a, b)), -1) << "with_decode";
}
#endif
