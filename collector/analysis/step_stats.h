// Statistics of one joined step (DESIGN.md "The three metrics"). Pure functions, no state.
//
// Conventions (the brute-force reference in tests/collector/step_stats_test.cc uses the same):
//  - std is the population standard deviation; range is max - min.
//  - grad_norm_cv = std / mean, and 0 when std == 0 (all norms equal, including all zero).
//  - The cosine of a zero vector with anything is 0. grad_cosine_mean is the mean over all
//    W(W-1)/2 unordered pairs, computed in O(W k) as (|sum u_r|^2 - W_nz) / (W (W - 1)) where
//    u_r = v_r / |v_r| for nonzero v_r, u_r = 0 otherwise, and W_nz counts nonzero sketches.
//    It is NaN for W < 2 (no pairs).
//  - consensus_cosine of rank r = cos(v_r, sum_{j != r} v_j); NaN for W < 2.
//  - z-scores are (x - mean) / std, and 0 when std == 0 (computed against the exact mean, whose
//    rounding error the second pass estimates, so |z| <= sqrt(W - 1) holds to rounding).
//  - When all values of a quantity are equal and finite, its mean is exactly that value and its
//    std and range are exactly 0 (so its z-scores and cv are 0, not rounding noise).
//  - Non-finite inputs propagate (NaN in, NaN out for the affected statistics); nothing crashes.
//    A NaN loss makes loss_mean/std/range and every loss_z NaN and touches nothing else (likewise
//    grad_norm). An Inf makes the mean +-Inf and std NaN. A sketch holding NaN or Inf makes
//    grad_cosine_mean and every consensus_cosine NaN (each involves every other rank's sketch).
//  - Sketches of different lengths (a caller bug) make every cosine statistic NaN.
//  - A packed sketch (float16, int8) is read as the exact values it stands for
//    (common/sketch_encoding.h); one whose scale is NaN is a sketch holding NaN.
//  - No samples: ranks = 0, grad_cosine_mean NaN, every other field 0.
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_STEP_STATS_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_STEP_STATS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "collector/model/step_summary.h"
#include "common/sketch_encoding.h"

namespace rankscope::collector {

struct RankSample {
  uint32_t rank = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  // The rank's sketch in its encoding (common/sketch_encoding.h; a float span converts to one).
  // Every sample of a step has the same length; encodings may differ (each is decoded exactly).
  SketchView sketch;
};

struct RankStatistics {
  uint32_t rank = 0;
  double consensus_cosine = 0.0;
  double loss_z = 0.0;
  double grad_norm_z = 0.0;
};

// The step's statistics (collector/model/step_summary.h) and each rank's.
struct StepStatistics : StepSummary {
  std::vector<RankStatistics> per_rank;  // same order as the input samples
};

// Computes every statistic of one step in O(W k). `samples` may be empty (all fields zero/NaN).
// The results are bit-identical on every CPU (whichever vector ISA it runs).
StepStatistics ComputeStepStatistics(absl::Span<const RankSample> samples);

// For tests and benchmarks: the sketch kernels compiled for each instruction set.
namespace step_stats_internal {

enum class KernelIsa { kBaseline, kAvx2, kAvx512 };  // kBaseline: SSE2 on x86-64, or portable

// Whether this CPU can run `isa` (kBaseline always).
bool KernelIsaSupported(KernelIsa isa);

// ComputeStepStatistics with the kernels of `isa`, which must be supported.
StepStatistics ComputeStepStatisticsWithIsa(absl::Span<const RankSample> samples, KernelIsa isa);

}  // namespace step_stats_internal

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_STEP_STATS_H_
