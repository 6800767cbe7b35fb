// defines: Format, FormatTraits, format_traits, format_name, parse_format, BlockAxis, OuterScale,
//          QuantSpec
// The catalogue of tensor formats and the description of how one GEMM operand is quantized.
// One row per format in kFormatTable (name, element bits, block size, scale kind); the quantizers
// dispatch on Format in one switch whose default fails loudly.
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/s2f6.h"

namespace fourbit {

enum class Format : uint8_t { F32, BF16, E4M3, E5M2, NVFP4, MXFP8_E4M3, MXFP8_E5M2, S2F6 };

enum class ScaleKind : uint8_t { None, UE4M3, UE8M0 };

struct FormatTraits {
  Format format;
  std::string_view name;      // as spelled in configs, recipes and on the command line
  int element_bits;           // bits per stored value
  int block;                  // values per block scale; 0 = not block-scaled
  ScaleKind scale;
  bool quantized;             // true for the QTensor formats
};

inline constexpr FormatTraits kFormatTable[] = {
    {Format::F32, "fp32", 32, 0, ScaleKind::None, false},
    {Format::BF16, "bf16", 16, 0, ScaleKind::None, false},
    {Format::E4M3, "e4m3", 8, 0, ScaleKind::None, false},
    {Format::E5M2, "e5m2", 8, 0, ScaleKind::None, false},
    {Format::NVFP4, "nvfp4", 4, num::kNvfp4Block, ScaleKind::UE4M3, true},
    {Format::MXFP8_E4M3, "mxfp8-e4m3", 8, num::kMxBlock, ScaleKind::UE8M0, true},
    {Format::MXFP8_E5M2, "mxfp8-e5m2", 8, num::kMxBlock, ScaleKind::UE8M0, true},
    {Format::S2F6, "s2f6", 8, num::kS2f6Block, ScaleKind::UE8M0, true},
};

constexpr const FormatTraits& format_traits(Format f) { return kFormatTable[static_cast<int>(f)]; }
constexpr std::string_view format_name(Format f) { return format_traits(f).name; }

inline std::optional<Format> parse_format(std::string_view s) {
  for (const auto& t : kFormatTable)
    if (t.name == s) return t.format;
  return std::nullopt;
}

// Which way the blocks run. Row: along each row (the last logical dimension). Col: down each
// column; such a QTensor is stored as the transpose, so storage always has contiguous blocks.
enum class BlockAxis : uint8_t { Row, Col };

// Which values share one FP32 outer scale (NVFP4 only).
enum class OuterScale : uint8_t { None, Tensor, PerRow, PerSlice };

// How one operand is quantized (DESIGN "Key types"). Formats without blocks ignore the rest.
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

  int block() const { return format_traits(fmt).block; }
  bool quantized() const { return format_traits(fmt).quantized; }
};

}  // namespace fourbit
