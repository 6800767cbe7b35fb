// defines: quant_shape, qtensor_layout, alloc_qtensor, requantize_transposed_spec (quant_layout.h)
#include "fourbit/ops/quant_layout.h"

#include <string>

namespace fourbit::ops {

QuantShape quant_shape(const Tensor& x, const QuantSpec& spec) {
  if (const std::string err = validate(spec); !err.empty()) {
    std::string block_formats;
    for (Format f : quantized_formats()) block_formats += (block_formats.empty() ? "" : ", ") + std::string(format_name(f));
    fail("quantize: {} (block formats: {})", err, block_formats);
  }
  if (x.dtype() != DType::F32) fail("quantize: input must be f32, got {}", x.str());
  if (x.dim() != 2 && x.dim() != 3) fail("quantize: input must be 2-D or 3-D, got {}", x.str());
  QuantShape s{1, x.size(-2), x.size(-1)};
  if (x.dim() == 3) s.slices = x.size(0);
  return s;
}

QTensor qtensor_layout(const QuantSpec& spec, const QuantShape& s) {
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
  return q;
}

QTensor alloc_qtensor(const QuantSpec& spec, const QuantShape& s, Device device) {
  QTensor q = qtensor_layout(spec, s);
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

QuantSpec requantize_transposed_spec(const QTensor& q, const QuantSpec& target) {
  if (q.fmt != Format::NVFP4)
    fail("requantize_transposed: input must be nvfp4, got {}", format_name(q.fmt));
  if (target.fmt != Format::MXFP8_E4M3 && target.fmt != Format::MXFP8_E5M2)
    fail("requantize_transposed: the target must be mxfp8-e4m3 or mxfp8-e5m2, got {}", describe(target));
  if (target.mx_rule != num::MxScaleRule::RCEIL)
    fail("requantize_transposed: the target's scales must be RCEIL (no element clips, so SR stays unbiased), got {}",
         describe(target));
  if (target.hadamard != 0) fail("requantize_transposed: the target takes no RHT, got {}", describe(target));
  QuantSpec spec = target;
  spec.outer = OuterScale::None;
  spec.axis = q.axis == BlockAxis::Row ? BlockAxis::Col : BlockAxis::Row;
  if (const std::string err = validate(spec); !err.empty()) fail("requantize_transposed: {}", err);
  return spec;
}

}  // namespace fourbit::ops
