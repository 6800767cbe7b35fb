// defines: QRowDecoder
// Decodes storage rows of a QTensor to float with per-format lookup tables: one table lookup and
// one multiply per value, the scale decoded once per block. The values are bit-identical to the
// numerics/ decoders (the tables are filled from them, and the products are the same products).
#pragma once
#include <algorithm>
#include <array>

#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/nvfp4.h"
#include "fourbit/numerics/s2f6.h"
#include "fourbit/tensor/qtensor.h"

namespace fourbit::ops::cpu {

class QRowDecoder {
 public:
  explicit QRowDecoder(const QTensor& q) : q_(q) {
    for (uint32_t c = 0; c < 16; ++c) e2m1_[c] = num::e2m1_decode(c);
    const num::MiniFloatSpec elem = q.fmt == Format::MXFP8_E5M2 ? num::kE5M2 : num::kE4M3;
    for (uint32_t c = 0; c < 256; ++c) fp8_[c] = num::minifloat_decode(elem, c);
    codes_ = q.codes.data<uint8_t>();
    scales_ = q.block_scales.data<uint8_t>();
    outer_ = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  }

  // Writes padded_cols() values of storage row r. with_outer: NVFP4 values times S_dec (the full
  // dequantization); without: E2M1 x E4M3 only (the GEMM applies S_dec after the sum).
  template <typename T>
  void row(int64_t r, T* out, bool with_outer) const {
    const int64_t NB = q_.blocks_per_row(), B = q_.block();
    const uint8_t* rc = codes_ + r * q_.code_row_bytes();
    const uint8_t* sc = scales_ + r * NB;
    switch (q_.fmt) {
      case Format::NVFP4: {
        const float s_dec = outer_ ? outer_[q_.outer_index(r)] : 1.0f;
        for (int64_t b = 0; b < NB; ++b) {
          const float s = num::ue4m3_decode(sc[b]);
          for (int64_t i = 0; i < B; i += 2) {
            const uint8_t byte = rc[(b * B + i) / 2];
            float lo = e2m1_[byte & 0xF] * s, hi = e2m1_[byte >> 4] * s;
            if (with_outer) {
              lo = num::mul_rn(lo, s_dec);
              hi = num::mul_rn(hi, s_dec);
            }
            out[b * B + i] = T(lo);
            out[b * B + i + 1] = T(hi);
          }
        }
        break;
      }
      case Format::MXFP8_E4M3:
      case Format::MXFP8_E5M2:
        for (int64_t b = 0; b < NB; ++b) {
          const float s = num::ue8m0_decode(sc[b]);
          for (int64_t i = 0; i < B; ++i) out[b * B + i] = T(fp8_[rc[b * B + i]] * s);
        }
        break;
      case Format::S2F6:
        for (int64_t b = 0; b < NB; ++b) {
          const float s = num::pow2f(int(sc[b]) - 127 - 6);
          for (int64_t i = 0; i < B; ++i) out[b * B + i] = T(float(int8_t(rc[b * B + i])) * s);
        }
        break;
      default: fail("decode: unsupported format {}", format_name(q_.fmt));
    }
  }

 private:
  const QTensor& q_;
  std::array<float, 16> e2m1_{};
  std::array<float, 256> fp8_{};
  const uint8_t* codes_ = nullptr;
  const uint8_t* scales_ = nullptr;
  const float* outer_ = nullptr;
};

}  // namespace fourbit::ops::cpu
