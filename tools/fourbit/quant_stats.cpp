// defines: quant_stats (quant_stats.h)
#include "tools/fourbit/quant_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace fourbit::cli {

QuantStats quant_stats(const Tensor& x, const Tensor& xhat, const QTensor& q,
                       const ops::QuantReport& report, bool four_over_six) {
  FOURBIT_CHECK(x.shape() == xhat.shape() && x.dtype() == DType::F32 && xhat.dtype() == DType::F32,
                "quant_stats: {} vs {}", x.str(), xhat.str());
  const float* a = x.data<float>();
  const float* b = xhat.data<float>();
  const int64_t n = x.numel();
  // Sums in double, in element order: the figures do not depend on the thread count.
  double sum_sq_err = 0, sum_sq = 0, max_err = 0;
  int64_t nonzero = 0, flushed = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = double(a[i]) - double(b[i]);
    sum_sq_err += e * e;
    sum_sq += double(a[i]) * double(a[i]);
    max_err = std::max(max_err, std::abs(e));
    if (a[i] != 0.0f) {
      ++nonzero;
      flushed += b[i] == 0.0f ? 1 : 0;
    }
  }
  constexpr double inf = std::numeric_limits<double>::infinity();
  QuantStats s;
  s.values = n;
  s.mse = n ? sum_sq_err / double(n) : 0.0;
  s.rel_err = sum_sq > 0 ? std::sqrt(sum_sq_err / sum_sq) : (sum_sq_err > 0 ? inf : 0.0);
  s.eff_bits = sum_sq_err == 0 ? inf : sum_sq == 0 ? -inf : -std::log2(sum_sq_err / sum_sq) / 2.0;
  s.max_abs_err = max_err;
  s.flushed_pct = nonzero ? 100.0 * double(flushed) / double(nonzero) : 0.0;
  if (four_over_six)
    s.chose_four_pct =
        report.blocks ? 100.0 * double(report.blocks_chose_four) / double(report.blocks) : 0.0;
  s.bits_per_value = n ? double(q.nbytes()) * 8.0 / double(n) : 0.0;
  return s;
}

}  // namespace fourbit::cli
