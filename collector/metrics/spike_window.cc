#include "collector/metrics/spike_window.h"

#include <cmath>
#include <cstddef>

namespace rankscope::collector {

WindowValues WorstOf(const WindowValues& a, const WindowValues& b) {
  // std::fmax/fmin return the other operand when one is NaN.
  return WindowValues{std::fmax(a.loss_std, b.loss_std), std::fmax(a.loss_range, b.loss_range),
                      std::fmax(a.grad_norm_cv, b.grad_norm_cv),
                      std::fmin(a.grad_cosine_mean, b.grad_cosine_mean),
                      std::fmax(a.replica_divergent, b.replica_divergent)};
}

void SpikeWindow::Add(absl::Time now, absl::Duration window, const WindowValues& values) {
  if (window <= absl::ZeroDuration()) return;  // the window metrics equal the latest step
  const absl::Duration granularity = window / kSpikeWindowBuckets;
  const absl::Time at = absl::UnixEpoch() + absl::Floor(now - absl::UnixEpoch(), granularity);
  if (!buckets_.empty() && buckets_.back().at >= at) {
    // Same bucket (or the clock went back): merge, keeping the deque ordered.
    buckets_.back().worst = WorstOf(buckets_.back().worst, values);
  } else {
    buckets_.push_back({at, values});
  }
  while (!buckets_.empty() && buckets_.front().at + granularity <= now - window) {
    buckets_.pop_front();
  }
  while (buckets_.size() > static_cast<size_t>(kSpikeWindowBuckets) + 2) buckets_.pop_front();
}

WindowValues SpikeWindow::Worst(absl::Time now, absl::Duration window,
                                const WindowValues& latest) const {
  const absl::Duration granularity =
      window > absl::ZeroDuration() ? window / kSpikeWindowBuckets : absl::ZeroDuration();
  WindowValues worst = latest;
  for (const Bucket& bucket : buckets_) {
    if (bucket.at + granularity <= now - window) continue;  // entirely before the window
    worst = WorstOf(worst, bucket.worst);
  }
  return worst;
}

}  // namespace rankscope::collector
