// defines: QuantStats, quant_stats
// The error measures `fourbit quant` prints for one quantizer on one tensor.
#pragma once
#include <cstdint>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/qtensor.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::cli {

struct QuantStats {
  int64_t values = 0;
  double mse = 0;              // mean (x - xhat)^2
  double rel_err = 0;          // ||x - xhat|| / ||x||
  double eff_bits = 0;         // -log2(mean (x - xhat)^2 / mean x^2) / 2; +inf when exact
  double max_abs_err = 0;      // max |x - xhat|
  double flushed_pct = 0;      // % of the nonzero x whose xhat is 0
  double chose_four_pct = -1;  // % of blocks where Four Over Six kept the 1.5x scale; -1: 4/6 off
  double bits_per_value = 0;   // (codes + block scales + outer scales) bytes * 8 / values
};

// x and xhat: F32 CPU tensors of the same shape; q: the QTensor xhat was decoded from (any
// device: only its byte count is read).
QuantStats quant_stats(const Tensor& x, const Tensor& xhat, const QTensor& q,
                       const ops::QuantReport& report, bool four_over_six);

}  // namespace fourbit::cli
