// defines: quant_shape, alloc_qtensor (quant_layout.h)
#include "fourbit/ops/quant_layout.h"

namespace fourbit::ops {

QuantShape quant_shape(const Tensor& x, const QuantSpec& spec) {
  if (!spec.quantized())
    fail("quantize: format '{}' is not a block format (expected nvfp4, mxfp8-e4m3, mxfp8-e5m2 or s2f6)",
         format_name(spec.fmt));
  if (x.dtype() != DType::F32) fail("quantize: input must be f32, got {}", x.str());
  if (x.dim() != 2 && x.dim() != 3) fail("quantize: input must be 2-D or 3-D, got {}", x.str());
  if (spec.hadamard != 0 && spec.hadamard != 16 && spec.hadamard != 32)
    fail("quantize: hadamard size must be 0, 16 or 32, got {}", spec.hadamard);
  if (spec.hadamard > spec.block())
    fail("quantize: a {}-point Hadamard transform does not fit {}'s {}-value blocks", spec.hadamard,
         format_name(spec.fmt), spec.block());
  if (spec.four_over_six && spec.fmt != Format::NVFP4)
    fail("quantize: Four Over Six applies to nvfp4 only, not {}", format_name(spec.fmt));
  if (spec.tile_2d && spec.fmt != Format::NVFP4)
    fail("quantize: 16x16 tiles apply to nvfp4 only, not {}", format_name(spec.fmt));
  if (spec.fmt == Format::S2F6 && spec.rounding == num::Rounding::SR)
    fail("quantize: s2f6 supports round-to-nearest-even only");
  QuantShape s{1, x.size(-2), x.size(-1)};
  if (x.dim() == 3) s.slices = x.size(0);
  return s;
}

QTensor alloc_qtensor(const QuantSpec& spec, const QuantShape& s, Device device) {
  QTensor q;
  q.fmt = spec.fmt;
  q.axis = spec.axis;
  q.outer = spec.fmt == Format::NVFP4 ? spec.outer : OuterScale::None;
  q.slices = s.slices;
  q.rows = spec.axis == BlockAxis::Row ? s.rows : s.cols;
  q.cols = spec.axis == BlockAxis::Row ? s.cols : s.rows;
  q.tile_2d = spec.tile_2d;
  q.hadamard = spec.hadamard;
  q.hadamard_signs = spec.hadamard_signs;
  const int64_t n_rows = q.total_rows();
  q.codes = Tensor::empty({n_rows, q.code_row_bytes()}, DType::U8, device);
  q.block_scales = Tensor::empty({n_rows, q.blocks_per_row()}, DType::U8, device);
  switch (q.outer) {
    case OuterScale::None: break;
    case OuterScale::Tensor: q.outer_scales = Tensor::empty({1}, DType::F32, device); break;
    case OuterScale::PerRow: q.outer_scales = Tensor::empty({n_rows}, DType::F32, device); break;
    case OuterScale::PerSlice: q.outer_scales = Tensor::empty({q.slices}, DType::F32, device); break;
  }
  return q;
}

QuantSpec requantize_transposed_spec(const QTensor& q) {
  if (q.fmt != Format::NVFP4)
    fail("requantize_transposed: input must be nvfp4, got {}", format_name(q.fmt));
  QuantSpec spec;
  spec.fmt = Format::MXFP8_E4M3;
  spec.outer = OuterScale::None;
  spec.axis = q.axis == BlockAxis::Row ? BlockAxis::Col : BlockAxis::Row;
  spec.rounding = num::Rounding::SR;
  spec.mx_rule = num::MxScaleRule::RCEIL;
  return spec;
}

}  // namespace fourbit::ops
