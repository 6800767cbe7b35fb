// defines: QTensor
// A block-quantized tensor of any quantized format of the registry (numerics/formats.h): packed
// codes, one scale byte per block, FP32 outer scales (NVFP4), and what is needed to decode them.
// Byte layout (see docs/numerics.md): storage is `slices` matrices of rows x cols with blocks
// running along cols.
// A Col-axis QTensor stores each slice transposed, so its blocks are contiguous too.
#pragma once
#include <cstdint>

#include "fourbit/numerics/formats.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit {

struct QTensor {
  Format fmt = Format::NVFP4;
  BlockAxis axis = BlockAxis::Row;
  OuterScale outer = OuterScale::None;
  int64_t slices = 1;   // leading batch (e.g. experts); outer PerSlice has one scale per slice
  int64_t rows = 0;     // storage rows per slice
  int64_t cols = 0;     // storage cols: the blocked, contiguous dimension (unpadded)
  bool tile_2d = false;
  int hadamard = 0;     // RHT size applied before quantizing (S2F6 payload), 0 = none
  uint32_t hadamard_signs = 0;

  Tensor codes;         // U8 [slices*rows, code_row_bytes()]
  Tensor block_scales;  // U8 [slices*rows, blocks_per_row()]
  Tensor outer_scales;  // F32 S_dec values: [1], [slices*rows] or [slices]; undefined for None
  // Optional, CUDA only: the codes' exact BF16 values (block scale applied, outer scale not),
  // BF16 [slices*rows, padded_cols()], written by the quantizer alongside the codes for the GEMM
  // that reads this operand next (ops::quantize_row_col), which then needs no decode pass. A
  // cache of the codes, not more data: views keep the matching rows, and every op that makes new
  // codes from these leaves it undefined. A form that only the GEMMs running next read may be
  // its decode alone (ops::FormOut::Bf16): codes and block_scales undefined, bf16 defined.
  Tensor bf16;
  // Optional: each storage row's amax, max |x| over the row's finite values of the quantized
  // input (F32 [slices*rows]), written by the NVFP4 quantizers of per-row outer scales without a
  // rotation (the amax each row's S_enc comes from): what a running record of the input's amax
  // (Model::input_amax) folds instead of reading the input again. Views keep the matching rows;
  // an op that gathers or stacks rows leaves it undefined.
  Tensor row_amax;

  int block() const { return format_info(fmt).block; }
  int element_bits() const { return format_info(fmt).element_bits; }
  int64_t blocks_per_row() const { return (cols + block() - 1) / block(); }
  int64_t padded_cols() const { return blocks_per_row() * block(); }
  int64_t code_row_bytes() const { return padded_cols() * element_bits() / 8; }
  int64_t total_rows() const { return slices * rows; }
  // Whether it holds a tensor: its codes, or (a form without codes) its decode.
  bool defined() const { return codes.defined() || bf16.defined(); }
  Device device() const { return codes.defined() || !bf16.defined() ? codes.device() : bf16.device(); }

  // The logical shape of the tensor that was quantized ([slices,] R, C).
  Shape logical_shape() const {
    const int64_t r = axis == BlockAxis::Row ? rows : cols;
    const int64_t c = axis == BlockAxis::Row ? cols : rows;
    return slices == 1 ? Shape{r, c} : Shape{slices, r, c};
  }
  int64_t outer_index(int64_t storage_row) const {
    switch (outer) {
      case OuterScale::None: return -1;
      case OuterScale::Tensor: return 0;
      case OuterScale::PerRow: return storage_row;
      case OuterScale::PerSlice: return storage_row / rows;
    }
    return -1;
  }
  // Bytes actually stored (codes + block scales + outer scales): the packed-activation size; a
  // form without codes, its decode's.
  int64_t nbytes() const {
    const int64_t packed = codes.defined() ? codes.nbytes() + block_scales.nbytes() : bf16.defined() ? bf16.nbytes() : 0;
    return packed + (outer_scales.defined() ? outer_scales.nbytes() : 0);
  }
  QTensor to(Device d) const {
    QTensor q = *this;
    q.bf16 = Tensor{};
    q.codes = codes.to(d);
    q.block_scales = block_scales.to(d);
    if (outer_scales.defined()) q.outer_scales = outer_scales.to(d);
    if (row_amax.defined()) q.row_amax = row_amax.to(d);
    return q;
  }
};

}  // namespace fourbit
