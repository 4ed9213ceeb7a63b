// The one fixed order in which the kernels fold their 32 double partial sums (of squares) into
// one: each group of 8 by pairs, ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the four
// groups by pairs, (g0 + g1) + (g2 + g3). sketch.h ("Rounding") and fingerprint.h promise it, so
// the result does not depend on the instruction set or on how the sums were reached. Pure.
#ifndef RANKSCOPE_AGENT_SRC_FOLD_PARTIAL_SUMS_H_
#define RANKSCOPE_AGENT_SRC_FOLD_PARTIAL_SUMS_H_

#include <cstddef>

namespace rankscope::internal {

inline constexpr size_t kPartialSums = 32;

inline double FoldPartialSums(const double* s) {
  double group[kPartialSums / 8];
  for (size_t g = 0; g < kPartialSums / 8; ++g) {
    const double* x = s + 8 * g;
    group[g] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
  return (group[0] + group[1]) + (group[2] + group[3]);
}

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_FOLD_PARTIAL_SUMS_H_
