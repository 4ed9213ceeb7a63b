#include "collector/analysis/replica_tolerance.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace rankscope::collector {

double ReductionRounding(absl::Span<const double> local_norms, uint32_t world_size,
                         uint32_t precision) {
  if (local_norms.empty()) return 0.0;
  double squares = 0.0;
  for (double n : local_norms) squares += n * n;
  if (!std::isfinite(squares)) return std::numeric_limits<double>::quiet_NaN();
  const double scale =
      std::max(1.0, static_cast<double>(world_size) / static_cast<double>(local_norms.size()));
  return 2.0 * std::ldexp(1.0, -static_cast<int>(precision)) * std::sqrt(squares * scale);
}

ToleranceVerdict CheckReplicasWithTolerance(absl::Span<const RankReplicaSummary> ranks,
                                            double reduction) {
  ToleranceVerdict out;
  if (ranks.empty()) return out;
  std::vector<RankFingerprint> fingerprints;
  fingerprints.reserve(ranks.size());
  for (const RankReplicaSummary& r : ranks) fingerprints.push_back({r.rank, r.fingerprint});
  const ReplicaVerdict exact = CheckReplicas(fingerprints);
  out.verdict.checked = true;
  out.verdict.majority = exact.majority;
  if (exact.divergent_ranks.empty()) return out;  // every fingerprint agrees: nothing to weigh

  // The reference: the coordinate-wise median of the projections, and the median rounding.
  std::vector<double> column(ranks.size());
  std::array<double, kReplicaProjections> center{};
  for (size_t j = 0; j < kReplicaProjections; ++j) {
    for (size_t i = 0; i < ranks.size(); ++i) column[i] = ranks[i].summary.projections[j];
    center[j] = FiniteMedian(column);
  }
  for (size_t i = 0; i < ranks.size(); ++i) column[i] = ranks[i].summary.rounding;
  out.tolerance = kReplicaToleranceSigmas *
                  (kReplicaToleranceUlps * std::max(0.0, FiniteMedian(column)) + reduction);

  std::vector<uint32_t> beyond, within;
  for (const RankReplicaSummary& r : ranks) {
    if (exact.majority && r.fingerprint == *exact.majority) continue;  // the majority's bits
    double deviation = 0.0;
    for (size_t j = 0; j < kReplicaProjections; ++j) {
      deviation = std::max(deviation, std::abs(r.summary.projections[j] - center[j]));
    }
    const double ratio = out.tolerance > 0.0 ? deviation / out.tolerance
                         : deviation > 0.0   ? std::numeric_limits<double>::infinity()
                                             : 0.0;
    out.worst_ratio = std::max(out.worst_ratio, ratio);
    (ratio > 1.0 ? beyond : within).push_back(r.rank);
  }
  // A strict majority must agree (within the tolerance, or bit for bit) for the median to be
  // theirs; otherwise no value can be trusted and every rank is named.
  if (2 * beyond.size() >= ranks.size() && !beyond.empty()) {
    out.verdict.ambiguous = true;
    out.verdict.majority.reset();
    for (const RankReplicaSummary& r : ranks) out.verdict.divergent_ranks.push_back(r.rank);
    within.clear();
  } else {
    out.verdict.divergent_ranks = std::move(beyond);
  }
  std::sort(out.verdict.divergent_ranks.begin(), out.verdict.divergent_ranks.end());
  std::sort(within.begin(), within.end());
  out.within_tolerance = std::move(within);
  return out;
}

}  // namespace rankscope::collector
