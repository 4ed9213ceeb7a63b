#include "collector/analysis/rank_diagnostics.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/container/flat_hash_map.h"

namespace rankscope::collector {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kMadToSigma = 1.4826;

double Median(std::vector<double> v) {
  if (v.empty()) return kNaN;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  const double hi = v[mid];
  if (v.size() % 2 == 1) return hi;
  const double lo = *std::max_element(v.begin(), v.begin() + mid);
  return 0.5 * (lo + hi);
}

// Median and floored sigma-equivalent MAD of the finite values.
struct Robust {
  double median = kNaN;
  double sigma = kNaN;
};

Robust RobustStats(absl::Span<const double> values) {
  Robust r;
  r.median = FiniteMedian(values);
  if (std::isnan(r.median)) return r;
  std::vector<double> dev;
  dev.reserve(values.size());
  for (double x : values) {
    if (std::isfinite(x)) dev.push_back(std::abs(x - r.median));
  }
  const double floor = kMadFloorRelative * std::max(std::abs(r.median), kMadFloorAbsolute);
  r.sigma = std::max(kMadToSigma * Median(std::move(dev)), floor);
  return r;
}

double RobustZ(double x, const Robust& r) {
  if (!std::isfinite(x) || !std::isfinite(r.median)) return kNaN;
  return (x - r.median) / r.sigma;
}

}  // namespace

double FiniteMedian(absl::Span<const double> values) {
  std::vector<double> finite;
  finite.reserve(values.size());
  for (double x : values) {
    if (std::isfinite(x)) finite.push_back(x);
  }
  return Median(std::move(finite));
}

ReplicaVerdict CheckReplicas(absl::Span<const RankFingerprint> fingerprints) {
  ReplicaVerdict v;
  if (fingerprints.empty()) return v;
  v.checked = true;
  absl::flat_hash_map<uint64_t, size_t> counts;
  for (const RankFingerprint& f : fingerprints) ++counts[f.fingerprint];
  uint64_t best = 0;
  size_t best_count = 0;
  for (const auto& [value, count] : counts) {
    if (count > best_count) {
      best = value;
      best_count = count;
    }
  }
  if (2 * best_count > fingerprints.size()) {
    v.majority = best;
    for (const RankFingerprint& f : fingerprints) {
      if (f.fingerprint != best) v.divergent_ranks.push_back(f.rank);
    }
  } else {
    v.ambiguous = counts.size() > 1;
    if (v.ambiguous) {
      for (const RankFingerprint& f : fingerprints) v.divergent_ranks.push_back(f.rank);
    } else {
      v.majority = best;  // a single value (one rank): trivially consistent
    }
  }
  std::sort(v.divergent_ranks.begin(), v.divergent_ranks.end());
  return v;
}

std::vector<OutlierScore> ComputeOutlierScores(absl::Span<const RankSignals> ranks,
                                               const SignalScales& scale_floor,
                                               SignalScales* step_scales) {
  std::vector<double> losses, norms, cosines;
  // Echoes are left out only while at least 3 independent ranks remain to measure against (a
  // job mostly on the same data is the duplicate-data alert's, not a reason to flag the rest).
  const size_t independent = static_cast<size_t>(
      std::count_if(ranks.begin(), ranks.end(), [](const RankSignals& r) { return !r.echo; }));
  const bool skip_echoes = independent >= 3;
  for (const RankSignals& r : ranks) {
    if (skip_echoes && r.echo) continue;
    if (!r.loss_absent) losses.push_back(r.loss);
    norms.push_back(r.grad_norm);
    cosines.push_back(r.consensus_cosine);
  }
  Robust loss = RobustStats(losses);
  Robust norm = RobustStats(norms);
  Robust cos = RobustStats(cosines);
  if (step_scales != nullptr) *step_scales = {loss.sigma, norm.sigma, cos.sigma};
  // std::fmax passes over a NaN: no floor, or no scale of this step (then no score either).
  loss.sigma = std::fmax(loss.sigma, scale_floor.loss);
  norm.sigma = std::fmax(norm.sigma, scale_floor.grad_norm);
  cos.sigma = std::fmax(cos.sigma, scale_floor.cosine);
  std::vector<OutlierScore> out;
  out.reserve(ranks.size());
  for (const RankSignals& r : ranks) {
    OutlierScore s;
    s.rank = r.rank;
    s.loss_robust_z = r.loss_absent ? 0.0 : RobustZ(r.loss, loss);
    s.grad_norm_robust_z = RobustZ(r.grad_norm, norm);
    // Only a cosine *below* the others' is suspicious; an unknown cosine (W < 2) contributes 0.
    s.cosine_deficit =
        std::isnan(r.consensus_cosine) ? 0.0 : std::max(0.0, -RobustZ(r.consensus_cosine, cos));
    if ((!r.loss_absent && !std::isfinite(r.loss)) || !std::isfinite(r.grad_norm) ||
        std::isinf(r.consensus_cosine)) {
      s.score = kNaN;
    } else {
      s.score = std::max({std::abs(s.loss_robust_z), std::abs(s.grad_norm_robust_z),
                          std::isnan(s.cosine_deficit) ? 0.0 : s.cosine_deficit});
    }
    // A rank that sends NaN/Inf is flagged: that is a fault in itself.
    s.flagged = std::isnan(s.score) || s.score > kOutlierThreshold;
    out.push_back(s);
  }
  return out;
}

double GradientNoiseScale(absl::Span<const double> local_norms, double reduced_norm,
                          uint32_t local_batch_size) {
  const double w = static_cast<double>(local_norms.size());
  if (local_norms.size() < 2 || !std::isfinite(reduced_norm)) return kNaN;
  double small_sq = 0.0;
  for (double n : local_norms) {
    if (!std::isfinite(n)) return kNaN;
    small_sq += n * n;
  }
  small_sq /= w;
  const double big_sq = reduced_norm * reduced_norm;
  const double b = local_batch_size == 0 ? 1.0 : static_cast<double>(local_batch_size);
  const double big_b = w * b;
  const double g2 = (big_b * big_sq - b * small_sq) / (big_b - b);
  const double trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big_b);
  if (!(g2 > 0.0)) return kNaN;
  return trace / g2;
}

std::vector<double> StepTimeRobustZ(absl::Span<const double> step_times) {
  const Robust r = RobustStats(step_times);
  std::vector<double> out;
  out.reserve(step_times.size());
  for (double t : step_times) out.push_back(RobustZ(t, r));
  return out;
}

}  // namespace rankscope::collector
