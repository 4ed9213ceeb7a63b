#include "collector/analysis/rank_cusum.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "collector/analysis/rank_diagnostics.h"

namespace rankscope::collector {
namespace {

constexpr double kSqrt3 = 1.7320508075688772;

double Step(double s, double x, double cap) {
  return std::min(cap, std::max(0.0, s + x - kCusumDrift));
}

}  // namespace

double CusumThreshold(uint32_t world_size) {
  return kCusumThreshold + std::log(std::max(static_cast<double>(world_size), 4.0) / 4.0);
}

RankCusum::RankCusum(uint32_t world_size) : h_(CusumThreshold(world_size)) {}

RankDrift RankCusum::Flagged(RankDrift d) const {
  d.drifting = d.data > h_;
  d.is_slow = d.slow > h_;
  return d;
}

std::vector<double> UniformRankScores(absl::Span<const double> values) {
  std::vector<double> out(values.size(), 0.0);
  std::vector<size_t> order;
  order.reserve(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i])) order.push_back(i);
  }
  const size_t n = order.size();
  if (n < 2) return out;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return values[a] < values[b] || (values[a] == values[b] && a < b);
  });
  for (size_t lo = 0; lo < n;) {
    size_t hi = lo + 1;
    while (hi < n && values[order[hi]] == values[order[lo]]) ++hi;
    const double position = 0.5 * static_cast<double>(lo + hi - 1);  // ties: mean position
    const double u = kSqrt3 * ((2.0 * position + 1.0) / static_cast<double>(n) - 1.0);
    for (size_t j = lo; j < hi; ++j) out[order[j]] = u;
    lo = hi;
  }
  return out;
}

double RankCusum::data_sigma() const { return std::sqrt(y2_sum_ / y2_count_); }

std::vector<RankDrift> RankCusum::Update(absl::Span<const RankDriftSignals> ranks,
                                         bool exchangeable) {
  const size_t n = ranks.size();
  std::vector<double> loss(n), norm(n), neg_cos(n), time(n);
  for (size_t i = 0; i < n; ++i) {
    loss[i] = ranks[i].loss;
    norm[i] = ranks[i].grad_norm;
    neg_cos[i] = -ranks[i].consensus_cosine;
    time[i] = ranks[i].step_time_seconds;
  }
  const std::vector<double> u_loss = UniformRankScores(loss);
  const std::vector<double> u_norm = UniformRankScores(norm);
  const std::vector<double> u_cos = UniformRankScores(neg_cos);
  std::vector<double> u_time = UniformRankScores(time);
  // Slowdown floor: a rank no later than it is not late (see the header).
  const double median_time = FiniteMedian(time);
  const double floor = std::max(kSlowFloorSeconds, kSlowFloorFraction * median_time);
  for (size_t i = 0; i < n; ++i) {
    if (!(time[i] - median_time > floor)) u_time[i] = std::min(u_time[i], 0.0);
  }
  std::vector<double> y(n);
  for (size_t i = 0; i < n; ++i) y[i] = u_loss[i] + u_norm[i] + u_cos[i];
  if (exchangeable) {
    for (double v : y) y2_sum_ += v * v;
    y2_count_ += static_cast<double>(n);
  }
  const double sigma = data_sigma();
  std::vector<RankDrift> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto it = state_.find(ranks[i].rank);
    RankDrift d = it == state_.end() ? RankDrift{} : it->second;
    if (exchangeable) d.data = Step(d.data, y[i] / sigma, 2.0 * h_);
    d.slow = Step(d.slow, u_time[i], 2.0 * h_);
    d = Flagged(d);
    if (d.data == 0.0 && d.slow == 0.0) {
      if (it != state_.end()) state_.erase(it);
    } else if (it != state_.end()) {
      it->second = d;
    } else {
      state_.emplace(ranks[i].rank, d);
    }
    out.push_back(d);
  }
  return out;
}

RankDrift RankCusum::Get(uint32_t rank) const {
  auto it = state_.find(rank);
  return it == state_.end() ? RankDrift{} : Flagged(it->second);
}

}  // namespace rankscope::collector
