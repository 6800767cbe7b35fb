// defines: QRowDecoder
// Decodes storage rows of a QTensor to float through the format registry's block decoder
// (numerics/formats.h: the one decoder of each format), the block scale decoded once per block.
#pragma once
#include <algorithm>
#include <array>

#include "fourbit/numerics/formats.h"
#include "fourbit/tensor/error.h"
#include "fourbit/tensor/qtensor.h"

namespace fourbit::ops::cpu {

class QRowDecoder {
 public:
  explicit QRowDecoder(const QTensor& q) : q_(q), info_(format_info(q.fmt)) {
    if (!info_.quantized) fail("decode: {} is not a block format", format_name(q.fmt));
    codes_ = q.codes.data<uint8_t>();
    scales_ = q.block_scales.data<uint8_t>();
    outer_ = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  }

  // Writes padded_cols() values of storage row r. with_outer: NVFP4 values times S_dec (the full
  // dequantization); without: E2M1 x E4M3 only (the GEMM applies S_dec after the sum).
  template <typename T>
  void row(int64_t r, T* out, bool with_outer) const {
    const int64_t NB = q_.blocks_per_row(), B = q_.block(), block_bytes = B * q_.element_bits() / 8;
    const uint8_t* rc = codes_ + r * q_.code_row_bytes();
    const uint8_t* sc = scales_ + r * NB;
    const float s_dec = with_outer && outer_ ? outer_[q_.outer_index(r)] : 1.0f;
    std::array<float, 64> v{};
    for (int64_t b = 0; b < NB; ++b) {
      info_.decode_block(rc + b * block_bytes, sc[b], s_dec, v.data());
      std::copy_n(v.data(), B, out + b * B);  // to T: exact for F32 and F64 (and BF16's own rounding)
    }
  }

 private:
  const QTensor& q_;
  const FormatInfo& info_;
  const uint8_t* codes_ = nullptr;
  const uint8_t* scales_ = nullptr;
  const float* outer_ = nullptr;
};

}  // namespace fourbit::ops::cpu
