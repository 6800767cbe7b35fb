// defines: the FormatRegistry tests (numerics/formats.h): every row is complete and consistent,
//          validate() refuses what a row does not take and names it, describe() gives the recipe
//          tables' words, every_spec() lists exactly the specs validate() accepts.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <tuple>

#include "fourbit/numerics/formats.h"

using namespace fourbit;

TEST(FormatRegistry, RowsAreCompleteAndFollowTheEnum) {
  for (size_t i = 0; i < sizeof kFormats / sizeof kFormats[0]; ++i) {
    const FormatInfo& f = kFormats[i];
    EXPECT_EQ(size_t(f.format), i);
    EXPECT_EQ(parse_format(f.name), f.format) << f.name;
    EXPECT_FALSE(f.summary.empty()) << f.name;
    if (!f.quantized) continue;
    EXPECT_NE(f.quantize_block, nullptr) << f.name;
    EXPECT_NE(f.decode_block, nullptr) << f.name;
    EXPECT_FALSE(f.codes_layout.empty()) << f.name;
    EXPECT_FALSE(f.scales_layout.empty()) << f.name;
    EXPECT_EQ(f.outer_layout.empty(), !(f.fields & kFieldOuter)) << f.name;
    EXPECT_LE(f.block, 32) << f.name << ": the block decoders' callers hold 32 values";
  }
  EXPECT_FALSE(parse_format("nvfp5").has_value());
  EXPECT_EQ(quantized_formats().size(), 5u);
}

TEST(FormatRegistry, ValidateRefusesWhatARowDoesNotTake) {
  QuantSpec s;
  s.fmt = Format::MXFP4;
  EXPECT_EQ(validate(s), "");
  s.four_over_six = true;
  EXPECT_NE(validate(s).find("Four Over Six"), std::string::npos);
  s.four_over_six = false;
  s.tile_2d = true;
  EXPECT_NE(validate(s).find("16x16"), std::string::npos);
  s.tile_2d = false;
  s.hadamard = 8;
  EXPECT_NE(validate(s).find("0, 16 or 32"), std::string::npos);
  s.fmt = Format::NVFP4;
  s.hadamard = 32;
  EXPECT_NE(validate(s).find("16-value blocks"), std::string::npos);
  s.hadamard = 0;
  s.mx_rule = num::MxScaleRule::FLOOR;
  EXPECT_NE(validate(s).find("scale rule"), std::string::npos);
  s.fmt = Format::S2F6;
  s.mx_rule = num::MxScaleRule::RCEIL;
  s.rounding = num::Rounding::SR;
  EXPECT_NE(validate(s).find("round-to-nearest-even only"), std::string::npos);
  s.fmt = Format::BF16;
  EXPECT_NE(validate(s).find("not a block format"), std::string::npos);
  s.fmt = Format::MXFP8_E5M2;
  s.rounding = num::Rounding::RNE;
  s.outer = OuterScale::PerRow;  // formats without an outer scale ignore the field
  EXPECT_EQ(validate(s), "");
}

TEST(FormatRegistry, DescribeGivesTheTablesWords) {
  QuantSpec s;
  s.fmt = Format::NVFP4;
  s.outer = OuterScale::PerRow;
  s.four_over_six = true;
  EXPECT_EQ(describe(s), "nvfp4 1x16, fp32 scale per token, 4/6 mse");
  s.outer = OuterScale::PerSlice;
  s.four_over_six = false;
  s.tile_2d = true;
  s.rounding = num::Rounding::SR;
  s.hadamard = 16;
  EXPECT_EQ(describe(s), "nvfp4 1x16 (16x16 tiles), fp32 scale per expert, SR, RHT-16");
  QuantSpec m;
  m.fmt = Format::MXFP4;
  m.mx_rule = num::MxScaleRule::FLOOR;
  m.axis = BlockAxis::Col;
  EXPECT_EQ(describe(m), "mxfp4 1x32 floor, col axis");
  m.fmt = Format::F32;
  EXPECT_EQ(describe(m), "fp32");
}

// every_spec lists each valid combination once, and nothing validate() refuses.
TEST(FormatRegistry, EverySpecIsExactlyTheValidOnes) {
  size_t total = 0;
  for (Format f : quantized_formats()) {
    std::set<std::tuple<int, int, int, int, int, int, int, int>> seen;
    for (const QuantSpec& s : every_spec(f)) {
      EXPECT_EQ(validate(s), "") << describe(s);
      EXPECT_TRUE(seen.insert({int(s.axis), int(s.rounding), s.hadamard, int(s.outer), int(s.four_over_six),
                               int(s.metric), int(s.tile_2d), int(s.mx_rule)})
                      .second)
          << describe(s) << " twice";
    }
    total += seen.size();
  }
  // nvfp4: 2 axes x 2 roundings x 2 RHT (0, 16) x 4 outer x 3 (4/6) x 2 tiles = 192; mxfp8 x2:
  // 2 x 2 x 3 x 2 rules = 24 each; mxfp4 24; s2f6: 2 axes x RNE x 3 = 6.
  EXPECT_EQ(total, 192u + 24u + 24u + 24u + 6u);
}
