// The spike window of one job's Prometheus export (prometheus_export.h "Spikes between
// scrapes"): the worst values of the steps completed in the last `window`, kept as at most
// kSpikeWindowBuckets + 2 time buckets of window / kSpikeWindowBuckets each, so memory is bounded
// whatever the step rate.
//
// Pure; not thread-safe (JobMetrics holds it under its lock).
#ifndef RANKSCOPE_COLLECTOR_METRICS_SPIKE_WINDOW_H_
#define RANKSCOPE_COLLECTOR_METRICS_SPIKE_WINDOW_H_

#include <cstdint>
#include <deque>

#include "absl/time/time.h"

namespace rankscope::collector {

inline constexpr int64_t kSpikeWindowBuckets = 60;

// The statistics the window keeps, each with its direction: the largest dispersion, the smallest
// cosine, the most divergent replicas.
struct WindowValues {
  double loss_std, loss_range, grad_norm_cv;
  double grad_cosine_mean;
  double replica_divergent;  // ranks divergent in a checked step (NaN: no check)
};

// The worse of `a` and `b` field by field: max of loss_std, loss_range, grad_norm_cv and
// replica_divergent, min of grad_cosine_mean. NaN is ignored unless both are NaN (PromQL's
// max_over_time semantics).
WindowValues WorstOf(const WindowValues& a, const WindowValues& b);

class SpikeWindow {
 public:
  // Records the values of a step completed at `now`. A `window` <= 0 keeps nothing.
  void Add(absl::Time now, absl::Duration window, const WindowValues& values);

  // The worst of `latest` and of every bucket that overlaps [now - window, now]: a step counts
  // for at least `window` after it completed and at most window + window / kSpikeWindowBuckets.
  WindowValues Worst(absl::Time now, absl::Duration window, const WindowValues& latest) const;

 private:
  // The worst values of the steps completed in [at, at + window / kSpikeWindowBuckets).
  struct Bucket {
    absl::Time at;
    WindowValues worst;
  };
  std::deque<Bucket> buckets_;  // ordered by `at`
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_METRICS_SPIKE_WINDOW_H_
