// defines: cpu::quantize, cpu::outer_amax, cpu::dequantize, cpu::requantize_transposed
// CPU loops over the format registry's block quantizers and decoders (numerics/formats.h). Rows are independent and handled by OpenMP
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

namespace {

// x's storage rows (the transpose of each slice for the Col axis) and the block and row amaxes
// of the values that get quantized (rotated behind an RHT); counts the non-finite inputs.
struct Scanned {
  std::vector<float> transposed;  // Col axis: x's slices transposed
  const float* base = nullptr;
  std::vector<float> block_amax, row_amax;
  int64_t nonfinite = 0;
};

Scanned scan(const Tensor& x, const QuantSpec& spec, const QuantShape& shape, const QTensor& q) {
  const int64_t R = q.total_rows(), C = q.cols, PC = q.padded_cols(), NB = q.blocks_per_row();
  const int B = q.block();
  Scanned sc;
  sc.base = x.data<float>();
  if (spec.axis == BlockAxis::Col) {
    sc.transposed.resize(size_t(x.numel()));
    transpose_slices(sc.base, sc.transposed.data(), shape.slices, shape.rows, shape.cols);
    sc.base = sc.transposed.data();
  }
  const RowSource src{sc.base, C, PC, spec.hadamard, spec.hadamard_signs};
  sc.block_amax.resize(size_t(R * NB));
  sc.row_amax.resize(size_t(R));
  int64_t nonfinite = 0;
#pragma omp parallel reduction(+ : nonfinite)
  {
    std::vector<float> buf(static_cast<size_t>(PC));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      nonfinite += count_nonfinite(sc.base + r * C, C);
      src.load(r, buf.data());
      sc.row_amax[size_t(r)] = scan_row(buf.data(), PC, B, &sc.block_amax[size_t(r * NB)]);
    }
  }
  sc.nonfinite = nonfinite;
  return sc;
}

// Storage rows per outer-scale group of q (a tensor, a slice, a row).
int64_t rows_per_group(const QTensor& q) {
  return q.outer == OuterScale::Tensor ? q.total_rows() : q.outer == OuterScale::PerSlice ? q.rows : 1;
}

// The amax of each outer-scale group from the row amaxes.
std::vector<float> group_amaxes(const QTensor& q, const std::vector<float>& row_amax) {
  const int64_t per = rows_per_group(q), groups = q.total_rows() / std::max<int64_t>(per, 1);
  std::vector<float> out(size_t(groups), 0.0f);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = g * per; r < (g + 1) * per; ++r) out[size_t(g)] = std::max(out[size_t(g)], row_amax[size_t(r)]);
  return out;
}

}  // namespace

Tensor outer_amax(const std::vector<Tensor>& xs, const QuantSpec& spec) {
  std::vector<float> joint;
  for (const Tensor& x : xs) {
    const QuantShape shape = quant_shape(x, spec);
    const QTensor q = alloc_qtensor(spec, shape, Device::CPU);
    const std::vector<float> a = group_amaxes(q, scan(x, spec, shape, q).row_amax);
    if (joint.empty()) joint = a;
    for (size_t g = 0; g < a.size(); ++g) joint[g] = std::max(joint[g], a[g]);
  }
  return Tensor::from_host(joint.data(), {int64_t(joint.size())}, DType::F32);
}

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report, const Tensor* group_amax,
                 FormOut /*form: the CPU's forms are their codes*/) {
  const QuantShape shape = quant_shape(x, spec);
  QTensor q = alloc_qtensor(spec, shape, Device::CPU);
  const int64_t R = q.total_rows(), C = q.cols, PC = q.padded_cols(), NB = q.blocks_per_row();
  const int B = q.block();
  const FormatInfo& info = format_info(spec.fmt);

  // Pass 1: block and row amax (of the rotated values, which are what gets quantized).
  Scanned sc = scan(x, spec, shape, q);
  const RowSource src{sc.base, C, PC, spec.hadamard, spec.hadamard_signs};
  std::vector<float>& block_amax = sc.block_amax;

  // Outer scales (NVFP4): amax over each group of rows (or the caller's), then S_enc / S_dec.
  std::vector<float> s_enc(1, 1.0f);
  if (q.outer != OuterScale::None) {
    const std::vector<float> gamax =
        group_amax ? std::vector<float>(group_amax->data<float>(), group_amax->data<float>() + group_amax->numel())
                   : group_amaxes(q, sc.row_amax);
    s_enc.resize(gamax.size());
    for (size_t g = 0; g < gamax.size(); ++g) {
      s_enc[g] = num::nvfp4_s_enc(gamax[g], spec.four_over_six);
      q.outer_scales.data<float>()[g] = num::nvfp4_s_dec(s_enc[g]);
    }
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

  // Pass 2: every block through the registry's block quantizer.
  uint8_t* codes = q.codes.data<uint8_t>();
  uint8_t* scales = q.block_scales.data<uint8_t>();
  const int64_t row_bytes = q.code_row_bytes(), block_bytes = int64_t(B) * info.element_bits / 8;
  int64_t chose_four = 0;
#pragma omp parallel reduction(+ : chose_four)
  {
    std::vector<float> buf(static_cast<size_t>(PC));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      src.load(r, buf.data());
      const int64_t g = q.outer_index(r);
      const float se = g < 0 ? 1.0f : s_enc[size_t(g)];
      for (int64_t b = 0; b < NB; ++b) {
        // Padding past C is zero; behind an RHT the rotated padding is not, so those blocks
        // encode all B values (the GEMM's reduction runs over the padded width).
        const int n = spec.hadamard ? B : int(std::min<int64_t>(B, C - b * B));
        const BlockIn in{buf.data() + b * B, n, block_amax[size_t(r * NB + b)], se, rng.seed, rng.stream,
                         uint64_t(r * PC + b * B)};  // padded storage index (SR counter)
        bool four = false;
        scales[r * NB + b] = info.quantize_block(in, spec, codes + r * row_bytes + b * block_bytes, &four);
        chose_four += four ? 1 : 0;
      }
    }
  }
  // per-row scales from the rows' own amax: those amaxes travel with the codes (QTensor::row_amax)
  if (keeps_row_amax(spec, group_amax != nullptr))
    q.row_amax = Tensor::from_host(sc.row_amax.data(), {R}, DType::F32, Device::CPU);
  if (sc.nonfinite) raise_nonfinite();
  if (report) {
    report->values += shape.slices * shape.rows * shape.cols;
    report->nonfinite += sc.nonfinite;
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

QTensor requantize_transposed(const QTensor& q, const QuantSpec& target, RngKey rng, FormOut form) {
  const QuantSpec spec = requantize_transposed_spec(q, target);
  return cpu::quantize(cpu::dequantize(q, true), spec, rng, nullptr, nullptr, form);
}

}  // namespace fourbit::ops::cpu
