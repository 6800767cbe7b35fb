// defines: Format, BlockAxis, OuterScale, QuantSpec, ScaleKind, SpecField, BlockIn, FormatInfo,
//          kFormats, format_info, format_name, parse_format, quantized_formats, quantize_block,
//          decode_block, validate, describe, every_spec
// The format registry: one row per format (name, element bits, block size, scale kind, which
// QuantSpec fields apply, the roundings and RHT sizes it takes, its scalar block quantizer and
// decoder, its byte layout). validate() and describe() are written once from the rows; the CPU
// quantizer and decoder, the CLI, the recipe tables, the tests' spec lists and the benches read
// them. Adding a format is one row plus its scalar functions (numerics/<format>.h).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fourbit/numerics/fast_quant.h"
#include "fourbit/numerics/mxfp4.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/s2f6.h"

namespace fourbit {

// Serialized by value in configs and checkpoints' metadata: new formats go at the end.
enum class Format : uint8_t { F32, BF16, E4M3, E5M2, NVFP4, MXFP8_E4M3, MXFP8_E5M2, S2F6, MXFP4 };

// Which way the blocks run. Row: along each row (the last logical dimension). Col: down each
// column; such a QTensor is stored as the transpose, so storage always has contiguous blocks.
enum class BlockAxis : uint8_t { Row, Col };

// Which values share one FP32 outer scale (NVFP4 only).
enum class OuterScale : uint8_t { None, Tensor, PerRow, PerSlice };

// How one operand is quantized (DESIGN "Key types"). Fields a format does not take are rejected
// by validate() when set (outer excepted: formats without an outer scale ignore it).
struct QuantSpec {
  Format fmt = Format::F32;
  BlockAxis axis = BlockAxis::Row;
  OuterScale outer = OuterScale::Tensor;
  num::Rounding rounding = num::Rounding::RNE;
  bool four_over_six = false;
  num::ScaleMetric metric = num::ScaleMetric::MSE;
  num::MxScaleRule mx_rule = num::MxScaleRule::RCEIL;
  int hadamard = 0;           // 0, 16 or 32: RHT applied to each chunk before quantizing
  uint32_t hadamard_signs = 0;
  bool tile_2d = false;       // NVFP4 16x16 scale tiles (NVIDIA's weight recipe)

  int block() const;
  bool quantized() const;
};

enum class ScaleKind : uint8_t { None, UE4M3, UE8M0 };

// QuantSpec fields beyond the format, rounding and axis, as bits of FormatInfo::fields.
enum SpecField : uint8_t {
  kFieldOuter = 1,        // outer: an FP32 scale per tensor / row / slice
  kFieldFourOverSix = 2,  // four_over_six and metric
  kFieldTile2d = 4,       // tile_2d
  kFieldMxRule = 8,       // mx_rule: RCEIL or the OCP floor rule
};

// One block as the block quantizers take it: x[0..n) (n <= block; past n the block holds zeros),
// the block amax (of a 16x16 tile for NVFP4 tiles), the group's S_enc (NVFP4; 1 without an outer
// scale and for other formats), and the SR key: element i draws sr_bits(seed, stream, index0 + i).
struct BlockIn {
  const float* x;
  int n;
  float amax, s_enc;
  uint64_t seed, stream, index0;
};

// Writes the block's block * element_bits / 8 code bytes (codes past n are 0) and returns its
// scale byte; *chose_four: Four Over Six took the 1.5x scale.
using QuantizeBlockFn = uint8_t (*)(const BlockIn& in, const QuantSpec& spec, uint8_t* codes, bool* chose_four);
// The block's values x_hat (NUMERICS' decode), s_dec the group's NVFP4 S_dec (1 gives the values
// before the outer scale, what a GEMM multiplies; other formats ignore it).
using DecodeBlockFn = void (*)(const uint8_t* codes, uint8_t scale, float s_dec, float* out);

struct FormatInfo {
  Format format;
  std::string_view name;      // as spelled in configs, recipes and on the command line
  std::string_view summary;   // one line for `fourbit quant --help` and `fourbit recipes`
  int element_bits;           // bits per stored value
  int block;                  // values per block scale; 0 = not block-scaled
  ScaleKind scale;
  bool quantized;             // a QTensor format (block scales, quantize/dequantize)
  uint8_t fields;             // SpecField bits
  bool sr;                    // takes stochastic rounding (RNE always)
  uint8_t hadamard_sizes;     // RHT sizes it takes: bit 0 for 16, bit 1 for 32
  QuantizeBlockFn quantize_block;
  DecodeBlockFn decode_block;
  std::string_view codes_layout, scales_layout, outer_layout;  // the byte layout, in words
};

namespace num {

// The rows' block functions: the numerics/<format>.h quantizers and decoders behind one
// signature. Device code calls the same scalar functions directly.
inline uint8_t nvfp4_block_bytes(const BlockIn& in, const QuantSpec& s, uint8_t* codes, bool* chose_four) {
  const Nvfp4Block b = nvfp4_quantize_block(in.x, in.n, in.amax, in.s_enc, nvfp4_s_dec(in.s_enc), s.four_over_six,
                                            s.metric, s.rounding, in.seed, in.stream, in.index0);
  for (int k = 0; k < kNvfp4Block / 2; ++k) codes[k] = uint8_t(b.packed >> (8 * k));
  *chose_four = b.chose_four;
  return b.scale;
}
FOURBIT_HD void nvfp4_decode_block(const uint8_t* codes, uint8_t scale, float s_dec, float* out) {
  const float sc = ue4m3_decode(scale);  // decoded once: nvfp4_dequant's products
  for (int i = 0; i < kNvfp4Block; ++i)
    out[i] = mul_rn(e2m1_decode((codes[i / 2] >> (4 * (i % 2))) & 0xFu) * sc, s_dec);
}

// The CPU's MXFP8 block: mxfp8_quantize_block's codes through fast_quant.h's integer forms
// (Mxfp8Rne, Mxfp8Sr), which equal the generic encoder (Mxfp8Sr for every input but NaN: a NaN
// element under SR, or a block whose scale is the NaN code, takes the generic encoder).
template <int kExpBits>
uint8_t mxfp8_block_bytes_fast(const BlockIn& in, const QuantSpec& s, uint8_t* codes) {
  const MiniFloatSpec elem = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  const uint8_t scale = mxfp8_scale(in.amax, elem, s.mx_rule);
  if (scale == kUe8m0Nan)
    return mxfp8_quantize_block(in.x, in.n, in.amax, elem, s.mx_rule, s.rounding, in.seed, in.stream, in.index0,
                                codes);
  const float x_scale = pow2f(127 - int(scale));
  if (s.rounding == Rounding::SR) {
    SrBits rnd(in.seed, in.stream);
    for (int i = 0; i < in.n; ++i) {
      const uint32_t r = rnd.at(in.index0 + uint64_t(i));
      codes[i] = is_nan_bits(in.x[i]) ? mxfp8_encode(in.x[i], scale, elem, Rounding::SR, r)
                                      : Mxfp8Sr<kExpBits>::encode(in.x[i], x_scale, r);
    }
  } else {
    for (int i = 0; i < in.n; ++i) codes[i] = Mxfp8Rne<kExpBits>::encode(in.x[i], x_scale);
  }
  return scale;
}
inline uint8_t mxfp8_block_bytes(const BlockIn& in, const QuantSpec& s, uint8_t* codes, bool* chose_four) {
  *chose_four = false;
  for (int i = in.n; i < kMxBlock; ++i) codes[i] = 0;
  return s.fmt == Format::MXFP8_E5M2 ? mxfp8_block_bytes_fast<5>(in, s, codes) : mxfp8_block_bytes_fast<4>(in, s, codes);
}
#if !defined(__CUDA_ARCH__)
// The 256 values of the E4M3 (kExpBits 4) or E5M2 codes, minifloat_decode's floats computed once:
// on the CPU a block decode is then a load and mxfp8_decode's multiply per element.
template <int kExpBits>
const float* minifloat_values() {
  static const std::vector<float> values = [] {
    std::vector<float> v(256);
    for (uint32_t c = 0; c < 256; ++c) v[c] = minifloat_decode(kExpBits == 4 ? e4m3_spec() : e5m2_spec(), c);
    return v;
  }();
  return values.data();
}
#endif
template <int kExpBits>
FOURBIT_HD void mxfp8_decode_block(const uint8_t* codes, uint8_t scale, float /*s_dec*/, float* out) {
#if defined(__CUDA_ARCH__)
  const MiniFloatSpec elem = kExpBits == 4 ? e4m3_spec() : e5m2_spec();
  for (int i = 0; i < kMxBlock; ++i) out[i] = mxfp8_decode(codes[i], scale, elem);
#else
  const float* values = minifloat_values<kExpBits>();
  const float sc = ue8m0_decode(scale);
  for (int i = 0; i < kMxBlock; ++i) out[i] = values[codes[i]] * sc;  // = mxfp8_decode(codes[i], scale, elem)
#endif
}

inline uint8_t mxfp4_block_bytes(const BlockIn& in, const QuantSpec& s, uint8_t* codes, bool* chose_four) {
  *chose_four = false;
  return mxfp4_quantize_block(in.x, in.n, in.amax, s.mx_rule, s.rounding, in.seed, in.stream, in.index0, codes);
}
FOURBIT_HD void mxfp4_decode_block(const uint8_t* codes, uint8_t scale, float /*s_dec*/, float* out) {
  for (int i = 0; i < kMxfp4Block; ++i) out[i] = mxfp4_decode(codes[i / 2] >> (4 * (i % 2)), scale);
}

inline uint8_t s2f6_block_bytes(const BlockIn& in, const QuantSpec&, uint8_t* codes, bool* chose_four) {
  *chose_four = false;
  for (int i = in.n; i < kS2f6Block; ++i) codes[i] = 0;
  return s2f6_quantize_block(in.x, in.n, in.amax, reinterpret_cast<int8_t*>(codes));
}
FOURBIT_HD void s2f6_decode_block(const uint8_t* codes, uint8_t scale, float /*s_dec*/, float* out) {
  for (int i = 0; i < kS2f6Block; ++i) out[i] = s2f6_decode_scaled(int8_t(codes[i]), scale);
}

}  // namespace num

// RHT sizes: bit 0 = 16, bit 1 = 32.
inline constexpr uint8_t kRht16 = 1, kRht32 = 2;

inline constexpr FormatInfo kFormats[] = {
    {Format::F32, "fp32", "float32, not quantized", 32, 0, ScaleKind::None, false, 0, false, 0, nullptr, nullptr,
     "", "", ""},
    {Format::BF16, "bf16", "bfloat16 (an IEEE cast, RNE), not quantized", 16, 0, ScaleKind::None, false, 0, false, 0,
     nullptr, nullptr, "", "", ""},
    {Format::E4M3, "e4m3", "OFP8 E4M3 scalar codec", 8, 0, ScaleKind::None, false, 0, false, 0, nullptr, nullptr, "",
     "", ""},
    {Format::E5M2, "e5m2", "OFP8 E5M2 scalar codec", 8, 0, ScaleKind::None, false, 0, false, 0, nullptr, nullptr, "",
     "", ""},
    {Format::NVFP4, "nvfp4", "E2M1 values, 1x16 blocks, UE4M3 block scales, FP32 outer scale", 4, num::kNvfp4Block,
     ScaleKind::UE4M3, true, kFieldOuter | kFieldFourOverSix | kFieldTile2d, true, kRht16, num::nvfp4_block_bytes,
     num::nvfp4_decode_block, "uint8 [rows, cols/2]: E2M1 codes, element 2k in the low nibble of byte k",
     "UE4M3 (E4M3 without sign), one per 16 values",
     "float32 S_dec (x = E2M1(code) * E4M3(block_scale) * S_dec): one, one per row, or one per slice"},
    {Format::MXFP8_E4M3, "mxfp8-e4m3", "E4M3 values, 1x32 blocks, UE8M0 scales (OCP MX)", 8, num::kMxBlock,
     ScaleKind::UE8M0, true, kFieldMxRule, true, kRht16 | kRht32, num::mxfp8_block_bytes, num::mxfp8_decode_block<4>,
     "uint8 [rows, cols]: one E4M3 code per value", "UE8M0, one per 32 values; x = E4M3(code) * 2^(scale - 127)",
     ""},
    {Format::MXFP8_E5M2, "mxfp8-e5m2", "E5M2 values, 1x32 blocks, UE8M0 scales (OCP MX)", 8, num::kMxBlock,
     ScaleKind::UE8M0, true, kFieldMxRule, true, kRht16 | kRht32, num::mxfp8_block_bytes, num::mxfp8_decode_block<5>,
     "uint8 [rows, cols]: one E5M2 code per value", "UE8M0, one per 32 values; x = E5M2(code) * 2^(scale - 127)",
     ""},
    {Format::S2F6, "s2f6", "int8 fixed point s/64, 1x32 blocks, UE8M0 scales (expert-combine payload)", 8,
     num::kS2f6Block, ScaleKind::UE8M0, true, 0, false, kRht16 | kRht32, num::s2f6_block_bytes,
     num::s2f6_decode_block, "int8 [rows, cols]: one S2F6 code per value",
     "UE8M0, one per 32 values; x = code / 64 * 2^(scale - 127)", ""},
    {Format::MXFP4, "mxfp4", "E2M1 values, 1x32 blocks, UE8M0 scales (OCP MX)", 4, num::kMxfp4Block,
     ScaleKind::UE8M0, true, kFieldMxRule, true, kRht16 | kRht32, num::mxfp4_block_bytes, num::mxfp4_decode_block,
     "uint8 [rows, cols/2]: E2M1 codes, element 2k in the low nibble of byte k",
     "UE8M0, one per 32 values; x = E2M1(code) * 2^(scale - 127)", ""},
};

constexpr const FormatInfo& format_info(Format f) { return kFormats[static_cast<int>(f)]; }
constexpr std::string_view format_name(Format f) { return format_info(f).name; }
static_assert([] {
  for (int i = 0; i < int(sizeof kFormats / sizeof kFormats[0]); ++i)
    if (int(kFormats[i].format) != i) return false;
  return true;
}(), "kFormats rows follow the Format enum");
static_assert([] {
  for (const FormatInfo& f : kFormats)
    if (f.quantized != (f.block > 0) || (f.block > 0 && f.block * f.element_bits % 8 != 0)) return false;
  return true;
}(), "every quantized row has a block of whole code bytes (its block functions: formats_test)");

inline int QuantSpec::block() const { return format_info(fmt).block; }
inline bool QuantSpec::quantized() const { return format_info(fmt).quantized; }

inline std::optional<Format> parse_format(std::string_view s) {
  for (const auto& t : kFormats)
    if (t.name == s) return t.format;
  return std::nullopt;
}

// The QTensor formats, in registry order.
inline std::vector<Format> quantized_formats() {
  std::vector<Format> out;
  for (const auto& t : kFormats)
    if (t.quantized) out.push_back(t.format);
  return out;
}

// What is wrong with spec for its format ("" when nothing): a format that is not quantized, a
// field the format does not take, a rounding or an RHT size it does not take.
inline std::string validate(const QuantSpec& s) {
  const FormatInfo& f = format_info(s.fmt);
  const std::string name(f.name);
  if (!f.quantized) return "format '" + name + "' is not a block format";
  if (s.rounding == num::Rounding::SR && !f.sr) return name + " supports round-to-nearest-even only";
  if (s.four_over_six && !(f.fields & kFieldFourOverSix)) return "Four Over Six does not apply to " + name;
  if (s.tile_2d && !(f.fields & kFieldTile2d)) return "16x16 scale tiles do not apply to " + name;
  if (s.mx_rule != num::MxScaleRule::RCEIL && !(f.fields & kFieldMxRule))
    return "a UE8M0 scale rule does not apply to " + name;
  if (s.hadamard != 0) {
    const uint8_t bit = s.hadamard == 16 ? kRht16 : s.hadamard == 32 ? kRht32 : 0;
    if (!bit) return "hadamard size must be 0, 16 or 32, got " + std::to_string(s.hadamard);
    if (!(f.hadamard_sizes & bit))
      return "a " + std::to_string(s.hadamard) + "-point Hadamard transform does not fit " + name + "'s " +
             std::to_string(f.block) + "-value blocks";
  }
  return "";
}

// "nvfp4 1x16, fp32 scale per token, 4/6 mse", "mxfp8-e4m3 1x32 rceil, SR", "bf16".
inline std::string describe(const QuantSpec& s) {
  const FormatInfo& f = format_info(s.fmt);
  std::string out(f.name);
  if (!f.quantized) return out;
  out += " 1x" + std::to_string(f.block);
  if (f.fields & kFieldTile2d && s.tile_2d) out += " (16x16 tiles)";
  if (f.fields & kFieldMxRule) out += s.mx_rule == num::MxScaleRule::RCEIL ? " rceil" : " floor";
  if (f.fields & kFieldOuter) {
    switch (s.outer) {
      case OuterScale::None: break;
      case OuterScale::Tensor: out += ", fp32 scale per tensor"; break;
      case OuterScale::PerRow: out += ", fp32 scale per token"; break;
      case OuterScale::PerSlice: out += ", fp32 scale per expert"; break;
    }
  }
  if (f.fields & kFieldFourOverSix && s.four_over_six)
    out += s.metric == num::ScaleMetric::MSE ? ", 4/6 mse" : ", 4/6 mae";
  if (s.rounding == num::Rounding::SR) out += ", SR";
  if (s.hadamard) out += ", RHT-" + std::to_string(s.hadamard);
  if (s.axis == BlockAxis::Col) out += ", col axis";
  return out;
}

// Every valid spec of a quantized format: both axes, each rounding, no RHT and each RHT size it
// takes (signs 0: callers pick them), and every value of the fields it takes (outer scales, Four
// Over Six off / mse / mae, 16x16 tiles, RCEIL / floor). The tests' and benches' spec lists.
inline std::vector<QuantSpec> every_spec(Format fmt) {
  const FormatInfo& f = format_info(fmt);
  std::vector<QuantSpec> out;
  if (!f.quantized) return out;
  for (BlockAxis axis : {BlockAxis::Row, BlockAxis::Col})
    for (num::Rounding rnd : {num::Rounding::RNE, num::Rounding::SR}) {
      if (rnd == num::Rounding::SR && !f.sr) continue;
      for (int had : {0, 16, 32}) {
        if (had && !(f.hadamard_sizes & (had == 16 ? kRht16 : kRht32))) continue;
        QuantSpec s;
        s.fmt = fmt;
        s.axis = axis;
        s.rounding = rnd;
        s.hadamard = had;
        s.outer = (f.fields & kFieldOuter) ? OuterScale::Tensor : OuterScale::None;
        std::vector<QuantSpec> stage = {s}, next;
        auto expand = [&](bool applies, auto&& variants) {
          if (!applies) return;
          next.clear();
          for (const QuantSpec& b : stage) variants(b);
          stage.swap(next);
        };
        expand(f.fields & kFieldOuter, [&](const QuantSpec& b) {
          for (OuterScale o : {OuterScale::None, OuterScale::Tensor, OuterScale::PerRow, OuterScale::PerSlice}) {
            QuantSpec v = b;
            v.outer = o;
            next.push_back(v);
          }
        });
        expand(f.fields & kFieldFourOverSix, [&](const QuantSpec& b) {
          for (int fos = 0; fos < 3; ++fos) {
            QuantSpec v = b;
            v.four_over_six = fos != 0;
            v.metric = fos == 2 ? num::ScaleMetric::MAE : num::ScaleMetric::MSE;
            next.push_back(v);
          }
        });
        expand(f.fields & kFieldTile2d, [&](const QuantSpec& b) {
          for (bool tile : {false, true}) {
            QuantSpec v = b;
            v.tile_2d = tile;
            next.push_back(v);
          }
        });
        expand(f.fields & kFieldMxRule, [&](const QuantSpec& b) {
          for (auto rule : {num::MxScaleRule::RCEIL, num::MxScaleRule::FLOOR}) {
            QuantSpec v = b;
            v.mx_rule = rule;
            next.push_back(v);
          }
        });
        out.insert(out.end(), stage.begin(), stage.end());
      }
    }
  return out;
}

}  // namespace fourbit
