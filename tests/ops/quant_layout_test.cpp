// defines: tests of ops/quant_layout.h's cuBLASLt block-scale layout (the Blackwell native GEMM
// path's scale copy, which cannot run on the project's H200s: this is what can be checked here).
#include <gtest/gtest.h>

#include <vector>

#include "fourbit/ops/quant_layout.h"

using fourbit::ops::cublaslt_scale_offset;

// The documented anchors: a tile is 32 rows x 16 bytes, the four 32-row groups of a 128-row tile
// interleave by 4 bytes, tiles follow along the block columns first.
TEST(QuantLayout, CublasltScaleOffsetAnchors) {
  EXPECT_EQ(cublaslt_scale_offset(0, 0, 3), 0);
  EXPECT_EQ(cublaslt_scale_offset(0, 3, 3), 3);
  EXPECT_EQ(cublaslt_scale_offset(1, 0, 3), 16);
  EXPECT_EQ(cublaslt_scale_offset(31, 0, 3), 31 * 16);
  EXPECT_EQ(cublaslt_scale_offset(32, 0, 3), 4);
  EXPECT_EQ(cublaslt_scale_offset(96, 2, 3), 14);
  EXPECT_EQ(cublaslt_scale_offset(0, 4, 3), 512);          // next tile along the columns
  EXPECT_EQ(cublaslt_scale_offset(128, 0, 3), 3 * 512);    // next tile row
  EXPECT_EQ(cublaslt_scale_offset(127, 11, 3), 2 * 512 + 31 * 16 + 3 * 4 + 3);
}

// Over a padded scale matrix every byte of the output is written exactly once.
TEST(QuantLayout, CublasltScaleOffsetIsAPermutation) {
  for (int64_t col_tiles : {1, 2, 5}) {
    const int64_t rows = 384, cols = col_tiles * 4;
    std::vector<int> hits(size_t(rows * cols), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t o = cublaslt_scale_offset(r, c, col_tiles);
        ASSERT_GE(o, 0);
        ASSERT_LT(o, rows * cols);
        ++hits[size_t(o)];
      }
    for (int h : hits) ASSERT_EQ(h, 1);
  }
}
