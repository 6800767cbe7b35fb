// defines: routed_share, load_balance_term_of, load_balance_dprob
// The Switch load-balance loss of one MoE layer and its gradient on the router's probabilities as
// one definition for the host (the model's terms from host counts, the CPU backend's ops) and the
// GPU's kernels (ops::load_balance_term, ops::load_balance_dprobs), so every path gives the same
// bits: every operation in double, rounded on its own (no FMA), in the order written.
//   f_e = count_e / assignments                                  (the routed share, no gradient)
//   term = coef * E * sum over e ascending of f_e * prob_sum_e / tokens
//   d term / d probs[n, e] = loss_weight * coef * E * f_e / tokens  (every token n alike)
#pragma once
#include <cstdint>

#include "fourbit/numerics/hd.h"

namespace fourbit::ops {

// offsets: E + 1 ascending entries (int32 on the GPU, int64 on the host).
template <class Off>
FOURBIT_HD double routed_share(const Off* offsets, int64_t e, int64_t assignments) {
  return num::ddiv_rn(double(offsets[e + 1] - offsets[e]), double(assignments));
}

template <class Off>
FOURBIT_HD double load_balance_term_of(const Off* offsets, const double* prob_sums, int64_t E, int64_t tokens,
                                       int64_t assignments, double coef) {
  double aux = 0.0;
  for (int64_t e = 0; e < E; ++e)
    aux = num::dadd_rn(aux, num::ddiv_rn(num::dmul_rn(routed_share(offsets, e, assignments), prob_sums[e]),
                                         double(tokens)));
  return num::dmul_rn(num::dmul_rn(coef, double(E)), aux);
}

template <class Off>
FOURBIT_HD double load_balance_dprob(const Off* offsets, int64_t e, int64_t E, int64_t tokens, int64_t assignments,
                                     float loss_weight, double coef) {
  const double scale = num::dmul_rn(num::dmul_rn(double(loss_weight), coef), double(E));
  return num::ddiv_rn(num::dmul_rn(scale, routed_share(offsets, e, assignments)), double(tokens));
}

}  // namespace fourbit::ops
