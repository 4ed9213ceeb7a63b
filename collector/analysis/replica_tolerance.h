// Replicas compared with a tolerance (issue 36, item 5; docs/DESIGN.md "Replica check: exact or
// tolerance"). Pure functions.
//
// Where a framework or mode does not promise bit-identical replicas (a reduction whose order
// differs between ranks, ranks on different GPU models, a non-deterministic optimizer step),
// the ranks' parameter fingerprints may all differ by rounding, and the exact check
// (CheckReplicas, rank_diagnostics.h) would name every rank. Such ranks send a float summary
// beside the fingerprint (ReplicaSummary: kReplicaProjections signed sums P_j = sum_i s_j(g_i)
// x_i with fixed pseudo-random signs, and R, the size of a one-ulp difference in every value plus
// the summary's own float64 rounding), and CheckReplicasWithTolerance compares those.
//
// The reduced gradient (reduced_grad_summary) is compared the same way, with a tolerance that
// also covers a reduction summed in another order on each rank (ReductionRounding).
//
// The arithmetic. Two replicas x and x + d give P_j(x + d) - P_j(x) = sum_i s_j(g_i) d_i: over
// the signs (independent of d), a sum with mean 0, variance ||d||^2 and sub-Gaussian tails
// (Hoeffding: P(|.| > t ||d||) <= 2 exp(-t^2 / 2)). Replicas that differ by at most
// kReplicaToleranceUlps ulps in every value have ||d|| <= k R. So with
//     tau = lambda k R_med,   lambda = kReplicaToleranceSigmas = 8,   k = 4,
// (R_med the ranks' median R), such a rank exceeds tau on one projection with probability at
// most 2 exp(-32) ~ 2.5e-14. The reference is the coordinate-wise median M of the ranks'
// projections: when a strict majority agree within tau pairwise, M lies inside their range on
// every coordinate, so each of them is within tau of M; a rank is divergent when
// max_j |P_j - M_j| > tau and its fingerprint is not the exact majority's. A divergence d is
// missed only when all four projections fall under tau: probability about (0.8 tau / ||d||)^4
// once ||d|| is a few tau (4e-5 at ||d|| = 10 tau, 5e-3 at 3 tau). For float32 parameters
// R ~ 2^-23 ||x||, so tau ~ 3.8e-6 ||x||: a divergence is seen once its norm is a few 1e-5 of
// the parameters' norm, wherever it lies (bfloat16 parameters: R ~ 2^-7 ||x||, so only
// divergences of about the parameters' own size; their ulp is 0.8 %).
// With no strict majority within tau (e.g. two ranks that disagree) every rank is named and
// `ambiguous` is set, as in the exact check.
//
// Ranks whose fingerprint equals the exact majority's hold the majority's bits: never named.
// Ranks whose fingerprint differs but whose summary is within tau are `within_tolerance`:
// rounding-level differences the exact check would have named.
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_REPLICA_TOLERANCE_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_REPLICA_TOLERANCE_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/model/rank_report.h"

namespace rankscope::collector {

inline constexpr double kReplicaToleranceUlps = 4.0;    // k: ulps per value, RMS
inline constexpr double kReplicaToleranceSigmas = 8.0;  // lambda

struct RankReplicaSummary {
  uint32_t rank = 0;
  uint64_t fingerprint = 0;
  ReplicaSummary summary;
};

struct ToleranceVerdict {
  ReplicaVerdict verdict;  // divergent_ranks: beyond the tolerance; majority: the exact one
  // Ranks whose fingerprint differs from the exact majority (or that have none) but whose
  // summary is within the tolerance, sorted.
  std::vector<uint32_t> within_tolerance;
  double tolerance = 0.0;  // tau
  // The largest max_j |P_j - M_j| / tau over the ranks (0 when every fingerprint agrees; +inf
  // when tau is 0 and a summary differs).
  double worst_ratio = 0.0;
};

// The tolerance check of one step's replicas (every rank that sent a fingerprint sent a
// summary): tau = lambda (k R_med + reduction), where `reduction` bounds the RMS difference two
// reductions summed in different orders may leave (the reduced gradient's:
// ReductionRounding; 0 for the parameters). Unchecked (verdict.checked false) for an empty input.
ToleranceVerdict CheckReplicasWithTolerance(absl::Span<const RankReplicaSummary> ranks,
                                            double reduction = 0.0);

// The reduced gradient's `reduction` term: 2 * 2^-p * sqrt(sum_r ||g_r||^2) * sqrt(world_size /
// ranks) over the step's reported local gradient norms (the missing ranks' taken as their mean),
// with p the smallest precision the ranks' summaries state. A reduction's rounding error e, with
// the errors of its W - 1 additions and of the division by W modelled as independent and zero
// mean, has E||e||^2 <= 2^-2p sum_r ||g_r||^2 (docs/DESIGN.md "Aggregation integrity", the same
// model); two orders differ by at most twice that RMS. NaN when a norm is not finite (the exact
// check is used then).
double ReductionRounding(absl::Span<const double> local_norms, uint32_t world_size,
                         uint32_t precision);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_REPLICA_TOLERANCE_H_
