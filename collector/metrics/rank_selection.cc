#include "collector/metrics/rank_selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace rankscope::collector {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Deviation keys: larger is more deviating; NaN is the most deviating.
double CosineDeviation(const RankStatistics& r) {
  return std::isnan(r.consensus_cosine) ? kInfinity : -r.consensus_cosine;
}
double AbsZ(double z) { return std::isnan(z) ? kInfinity : std::fabs(z); }

// Larger is more deviating; an unknown value (NaN) is the least deviating for these keys, since
// it means "not measured" (a non-finite rank already has a NaN outlier score, which ranks first
// through the cosine and z rankings).
double KnownOrLowest(double v) { return std::isnan(v) ? -kInfinity : v; }

// Indices into `ranks` of the (at most) `limit` most deviating by `key(index)`, most deviating
// first.
template <typename Key>
std::vector<uint32_t> TopByDeviation(absl::Span<const RankStatistics> ranks, size_t limit,
                                     Key key) {
  std::vector<uint32_t> order(ranks.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  const size_t n = std::min(limit, order.size());
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](uint32_t a, uint32_t b) {
    const double ka = key(a);
    const double kb = key(b);
    if (ka != kb) return ka > kb;
    return ranks[a].rank < ranks[b].rank;
  });
  order.resize(n);
  return order;
}

}  // namespace

std::vector<uint32_t> SelectDeviatingRanks(absl::Span<const RankStatistics> ranks,
                                           absl::Span<const RankExtras> extras, size_t limit) {
  const size_t n = std::min(limit, ranks.size());
  if (n == 0) return {};
  const bool has_extras = extras.size() == ranks.size();
  auto outlier = [&](uint32_t i) {
    return has_extras ? KnownOrLowest(extras[i].held_outlier_score) : -kInfinity;
  };
  auto cosine = [&](uint32_t i) { return CosineDeviation(ranks[i]); };
  if (n == ranks.size()) {
    // Everything fits: order by the primary ranking only.
    return has_extras ? TopByDeviation(ranks, n, outlier) : TopByDeviation(ranks, n, cosine);
  }
  std::vector<std::vector<uint32_t>> rankings;
  if (has_extras) rankings.push_back(TopByDeviation(ranks, n, outlier));
  rankings.push_back(TopByDeviation(ranks, n, cosine));
  rankings.push_back(TopByDeviation(ranks, n, [&](uint32_t i) { return AbsZ(ranks[i].loss_z); }));
  rankings.push_back(
      TopByDeviation(ranks, n, [&](uint32_t i) { return AbsZ(ranks[i].grad_norm_z); }));
  if (has_extras) {
    rankings.push_back(
        TopByDeviation(ranks, n, [&](uint32_t i) { return KnownOrLowest(extras[i].step_time_z); }));
    rankings.push_back(
        TopByDeviation(ranks, n, [&](uint32_t i) { return KnownOrLowest(extras[i].drift_score); }));
    rankings.push_back(
        TopByDeviation(ranks, n, [&](uint32_t i) { return KnownOrLowest(extras[i].slow_score); }));
  }
  std::vector<uint32_t> chosen;
  chosen.reserve(n);
  std::vector<bool> taken(ranks.size(), false);
  // Each ranking holds n distinct indices, so this ends with n chosen.
  for (size_t depth = 0; chosen.size() < n; ++depth) {
    for (const auto& ranking : rankings) {
      if (chosen.size() == n) break;
      const uint32_t index = ranking[depth];
      if (!taken[index]) {
        taken[index] = true;
        chosen.push_back(index);
      }
    }
  }
  return chosen;
}

}  // namespace rankscope::collector
