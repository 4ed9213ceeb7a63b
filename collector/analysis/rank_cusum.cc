#include "collector/analysis/rank_cusum.h"

#include <algorithm>
#include <array>
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
  return kCusumThreshold + std::log(std::max(static_cast<double>(world_size), 4.0) / 4.0) +
         std::log(static_cast<double>(kCusumDataSignals));
}

double SlowThreshold(uint32_t world_size) {
  return kSlowThreshold + std::log(std::max(static_cast<double>(world_size), 4.0) / 4.0);
}

RankCusum::RankCusum(uint32_t world_size)
    : h_(CusumThreshold(world_size)), h_slow_(SlowThreshold(world_size)) {}

RankDrift RankCusum::Flagged(RankDrift d) const {
  d.drifting = d.data > h_;
  d.is_slow = d.slow > h_slow_;
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

std::vector<bool> RankCusum::LateRanks(absl::Span<const RankDriftSignals> ranks,
                                       absl::Span<const double> times) {
  const size_t n = ranks.size();
  std::vector<bool> late(n, false);
  const double median = FiniteMedian(times);
  // This step's largest and second-largest lateness, over the ranks with a time.
  Lateness step{-std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                0};
  size_t finite = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(times[i])) continue;
    ++finite;
    const double d = times[i] - median;
    if (d > step.first) {
      step.second = step.first;
      step.first = d;
      step.latest = ranks[i].rank;
    } else if (d > step.second) {
      step.second = d;
    }
  }
  if (finite < 2) return late;
  if (window_.size() < kSlowWindowSteps) {
    window_.push_back(step);
  } else {
    window_[window_next_] = step;
    window_next_ = (window_next_ + 1) % kSlowWindowSteps;
  }
  if (window_.size() < kSlowMinWindowSteps) return late;
  // r of a rank on a window step: the largest lateness of the *other* ranks, i.e. the step's
  // largest unless the rank was the latest itself. Ranks that were never the latest in the window
  // share one median (of the steps' largest); the few that were (at most kSlowWindowSteps) get
  // their own.
  std::vector<double> others(window_.size());
  auto median_for = [&](uint32_t rank, bool was_latest) {
    for (size_t j = 0; j < window_.size(); ++j) {
      others[j] = was_latest && window_[j].latest == rank ? window_[j].second : window_[j].first;
    }
    return FiniteMedian(others);
  };
  const double shared = median_for(0, /*was_latest=*/false);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(times[i])) continue;
    const uint32_t rank = ranks[i].rank;
    bool was_latest = false;
    for (const Lateness& l : window_) was_latest = was_latest || l.latest == rank;
    const double r = was_latest ? median_for(rank, true) : shared;
    const double floor = std::max(kSlowFloorSeconds, kSlowMargin * std::max(r, 0.0));
    late[i] = times[i] - median > floor;
  }
  return late;
}

std::vector<RankDrift> RankCusum::Update(absl::Span<const RankDriftSignals> ranks,
                                         bool exchangeable) {
  const size_t n = ranks.size();
  std::vector<double> time(n);
  std::array<std::vector<double>, kCusumDataSignals> signal;
  for (std::vector<double>& v : signal) v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    signal[0][i] = ranks[i].loss;
    signal[1][i] = ranks[i].grad_norm;
    signal[2][i] = -ranks[i].consensus_cosine;
    time[i] = ranks[i].step_time_seconds;
  }
  // Each signal's scores over their exact standard deviation sqrt(m^2 - 1) / m (m: the ranks
  // with a finite value of it): unit variance for exchangeable ranks, nothing estimated.
  std::array<std::vector<double>, kCusumDataSignals> x;
  for (size_t j = 0; j < kCusumDataSignals; ++j) {
    x[j] = UniformRankScores(signal[j]);
    const double m = static_cast<double>(std::count_if(signal[j].begin(), signal[j].end(),
                                                       [](double v) { return std::isfinite(v); }));
    if (m >= 2.0) {
      const double sd = std::sqrt(m * m - 1.0) / m;
      for (double& v : x[j]) v /= sd;
    }
  }
  const std::vector<bool> late = LateRanks(ranks, time);
  std::vector<RankDrift> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto it = state_.find(ranks[i].rank);
    RankDrift d = it == state_.end() ? RankDrift{} : it->second;
    if (exchangeable) {
      d.data = 0.0;
      for (size_t j = 0; j < kCusumDataSignals; ++j) {
        d.by_signal[j] = Step(d.by_signal[j], x[j][i], 2.0 * h_);
        d.data = std::max(d.data, d.by_signal[j]);
      }
    }
    // A rank without a time this step keeps its count.
    if (std::isfinite(time[i])) {
      d.slow = std::min(2.0 * h_slow_, std::max(0.0, d.slow + (late[i] ? 1.0 : -1.0)));
    }
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
