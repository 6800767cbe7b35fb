// defines: cpu::quantize, cpu::dequantize, cpu::requantize_transposed
// CPU loops over the numerics/ block quantizers. Rows are independent and handled by OpenMP
// threads; every output byte is a pure function of the input, the spec and the RNG key, so the
// thread count never changes a result.
#include <algorithm>
#include <vector>

#include "fourbit/numerics/hadamard.h"
#include "fourbit/ops/cpu/cpu_ops.h"
#include "fourbit/ops/cpu/qdecode.h"
#include "fourbit/ops/quant_layout.h"

namespace fourbit::ops {
void raise_nonfinite();  // ops.cpp
}

namespace fourbit::ops::cpu {
namespace {

// Transposes each slice of src [S, R, C] into dst [S, C, R], in cache-sized tiles: writes run
// along dst rows (contiguous), reads stride through a 32 x 32 tile that stays in L1.
void transpose_slices(const float* src, float* dst, int64_t S, int64_t R, int64_t C) {
  constexpr int64_t T = 32;
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t s = 0; s < S; ++s)
    for (int64_t c0 = 0; c0 < C; c0 += T)
      for (int64_t r0 = 0; r0 < R; r0 += T) {
        const float* a = src + s * R * C;
        float* b = dst + s * R * C;
        const int64_t r_end = std::min(R, r0 + T), c_end = std::min(C, c0 + T);
        for (int64_t c = c0; c < c_end; ++c)
          for (int64_t r = r0; r < r_end; ++r) b[c * R + r] = a[r * C + c];
      }
}

void rotate_row(float* row, int64_t padded_cols, int n, uint32_t signs, bool inverse) {
  for (int64_t c = 0; c < padded_cols; c += n) {
    if (n == 16) inverse ? num::rht_inverse<16>(row + c, signs) : num::rht_forward<16>(row + c, signs);
    else inverse ? num::rht_inverse<32>(row + c, signs) : num::rht_forward<32>(row + c, signs);
  }
}

struct RowSource {
  const float* base;  // storage-order rows [total_rows, cols]
  int64_t cols, padded_cols;
  int hadamard;
  uint32_t signs;
  // Copies row r into buf (padded with zeros) and applies the RHT when the spec asks for it.
  void load(int64_t r, float* buf) const {
    std::copy_n(base + r * cols, cols, buf);
    std::fill(buf + cols, buf + padded_cols, 0.0f);
    if (hadamard) rotate_row(buf, padded_cols, hadamard, signs, false);
  }
};

// Block amaxes of one loaded (padded, possibly rotated) row; returns the row amax.
float scan_row(const float* row, int64_t n, int block, float* block_amax) {
  float row_amax = 0.0f;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    float a = 0.0f;
    for (int64_t i = b0; i < b0 + block; ++i) a = num::max_abs_finite(a, row[i]);
    block_amax[b0 / block] = a;
    row_amax = std::max(row_amax, a);
  }
  return row_amax;
}

// NaN/Inf among the input values of storage row r (counted before any rotation spreads them).
int64_t count_nonfinite(const float* row, int64_t n) {
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) k += num::is_finite_bits(row[i]) ? 0 : 1;
  return k;
}

}  // namespace

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report) {
  const QuantShape shape = quant_shape(x, spec);
  QTensor q = alloc_qtensor(spec, shape, Device::CPU);
  const int64_t R = q.total_rows(), C = q.cols, PC = q.padded_cols(), NB = q.blocks_per_row();
  const int B = q.block();

  std::vector<float> transposed;
  const float* base = x.data<float>();
  if (spec.axis == BlockAxis::Col) {
    transposed.resize(size_t(x.numel()));
    transpose_slices(base, transposed.data(), shape.slices, shape.rows, shape.cols);
    base = transposed.data();
  }
  const RowSource src{base, C, PC, spec.hadamard, spec.hadamard_signs};

  // Pass 1: block and row amax (of the rotated values, which are what gets quantized).
  std::vector<float> block_amax(static_cast<size_t>(R * NB)), row_amax(static_cast<size_t>(R));
  int64_t nonfinite = 0;
#pragma omp parallel reduction(+ : nonfinite)
  {
    std::vector<float> buf(static_cast<size_t>(PC));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      nonfinite += count_nonfinite(base + r * C, C);
      src.load(r, buf.data());
      row_amax[size_t(r)] = scan_row(buf.data(), PC, B, &block_amax[size_t(r * NB)]);
    }
  }

  // Outer scales (NVFP4): amax over each group of rows, then S_enc / S_dec.
  const bool nvfp4 = spec.fmt == Format::NVFP4;
  std::vector<float> s_enc;
  if (nvfp4) {
    const int64_t rows_per_group = q.outer == OuterScale::Tensor   ? R
                                   : q.outer == OuterScale::PerSlice ? q.rows
                                                                     : 1;
    const int64_t groups = R / rows_per_group;
    s_enc.resize(size_t(groups));
    for (int64_t g = 0; g < groups; ++g) {
      float a = 0.0f;
      for (int64_t r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r)
        a = std::max(a, row_amax[size_t(r)]);
      s_enc[size_t(g)] = q.outer == OuterScale::None ? 1.0f : num::nvfp4_s_enc(a, spec.four_over_six);
      if (q.outer != OuterScale::None) q.outer_scales.data<float>()[g] = num::nvfp4_s_dec(s_enc[size_t(g)]);
    }
    // NUMERICS: 16x16 tiles take one scale from the tile amax, replicated to each 1x16 slot.
    if (spec.tile_2d) {
      for (int64_t s = 0; s < q.slices; ++s)
        for (int64_t r0 = 0; r0 < q.rows; r0 += 16)
          for (int64_t b = 0; b < NB; ++b) {
            const int64_t r_end = std::min(q.rows, r0 + 16);
            float a = 0.0f;
            for (int64_t r = r0; r < r_end; ++r) a = std::max(a, block_amax[size_t((s * q.rows + r) * NB + b)]);
            for (int64_t r = r0; r < r_end; ++r) block_amax[size_t((s * q.rows + r) * NB + b)] = a;
          }
    }
  }

  // Pass 2: quantize every block.
  uint8_t* codes = q.codes.data<uint8_t>();
  uint8_t* scales = q.block_scales.data<uint8_t>();
  const int64_t row_bytes = q.code_row_bytes();
  const num::MiniFloatSpec elem = spec.fmt == Format::MXFP8_E5M2 ? num::kE5M2 : num::kE4M3;
  int64_t chose_four = 0;
#pragma omp parallel reduction(+ : chose_four)
  {
    std::vector<float> buf(static_cast<size_t>(PC));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      src.load(r, buf.data());
      uint8_t* row_codes = codes + r * row_bytes;
      for (int64_t b = 0; b < NB; ++b) {
        const float* xb = buf.data() + b * B;
        // Padding past C is zero; behind an RHT the rotated padding is not, so those blocks
        // encode all B values (the GEMM's reduction runs over the padded width).
        const int n = spec.hadamard ? B : int(std::min<int64_t>(B, C - b * B));
        const float amax = block_amax[size_t(r * NB + b)];
        const uint64_t index0 = uint64_t(r * PC + b * B);  // padded storage index (SR counter)
        switch (spec.fmt) {
          case Format::NVFP4: {
            const int64_t g = q.outer_index(r) < 0 ? 0 : q.outer_index(r);
            const float se = s_enc[size_t(g)];
            const num::Nvfp4Block blk = num::nvfp4_quantize_block(
                xb, n, amax, se, num::nvfp4_s_dec(se), spec.four_over_six, spec.metric,
                spec.rounding, rng.seed, rng.stream, index0);
            for (int k = 0; k < 8; ++k) row_codes[b * 8 + k] = uint8_t(blk.packed >> (8 * k));
            scales[r * NB + b] = blk.scale;
            chose_four += blk.chose_four ? 1 : 0;
            break;
          }
          case Format::MXFP8_E4M3:
          case Format::MXFP8_E5M2: {
            uint8_t* out = row_codes + b * B;
            scales[r * NB + b] = num::mxfp8_quantize_block(xb, n, amax, elem, spec.mx_rule,
                                                           spec.rounding, rng.seed, rng.stream,
                                                           index0, out);
            std::fill(out + n, out + B, uint8_t(0));
            break;
          }
          case Format::S2F6: {
            int8_t* out = reinterpret_cast<int8_t*>(row_codes + b * B);
            scales[r * NB + b] = num::s2f6_quantize_block(xb, n, amax, out);
            std::fill(out + n, out + B, int8_t(0));
            break;
          }
          default: fail("quantize: unsupported format {}", format_name(spec.fmt));
        }
      }
    }
  }
  if (nonfinite) raise_nonfinite();
  if (report) {
    report->values += shape.slices * shape.rows * shape.cols;
    report->nonfinite += nonfinite;
    report->blocks += R * NB;
    report->blocks_chose_four += chose_four;
  }
  return q;
}

Tensor dequantize(const QTensor& q, bool undo_hadamard) {
  const int64_t R = q.total_rows(), C = q.cols, PC = q.padded_cols();
  const QRowDecoder dec(q);
  std::vector<float> storage(static_cast<size_t>(R * C));
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(PC));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      dec.row(r, buf.data(), true);
      if (undo_hadamard && q.hadamard) rotate_row(buf.data(), PC, q.hadamard, q.hadamard_signs, true);
      std::copy_n(buf.data(), C, storage.data() + r * C);
    }
  }
  Tensor out = Tensor::empty(q.logical_shape(), DType::F32);
  if (q.axis == BlockAxis::Row) std::copy(storage.begin(), storage.end(), out.data<float>());
  else transpose_slices(storage.data(), out.data<float>(), q.slices, q.rows, q.cols);
  return out;
}

QTensor requantize_transposed(const QTensor& q, RngKey rng) {
  const QuantSpec spec = requantize_transposed_spec(q);
  return cpu::quantize(cpu::dequantize(q, true), spec, rng, nullptr);
}

}  // namespace fourbit::ops::cpu
