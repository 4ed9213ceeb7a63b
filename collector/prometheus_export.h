// Prometheus export of per-job statistics (DESIGN.md "Prometheus metrics").
//
// JobMetrics is a prometheus::Collectable: it keeps a small snapshot per job and builds the
// metric families at scrape time, so a job costs no registered Gauge objects and series of jobs
// that went away simply stop being exported (after `job_expiry` without a step).
//
// Label `train_job` names the training job (Prometheus reserves `job` for the scrape target).
//
// Spikes between scrapes: a scrape every 15 s sees one step in hundreds, so besides the latest
// step's value each dispersion metric is also exported as the worst value over the steps that
// completed in the last `spike_window` (default 60 s, four scrape intervals):
//   rankscope_loss_std_max_window, rankscope_loss_range_max_window,
//   rankscope_grad_norm_cv_max_window, rankscope_grad_cosine_mean_min_window.
// Alerts use the window metrics, so a one-step spike is never missed.
//
// Per-rank series (rankscope_rank_grad_cosine, rankscope_rank_loss_z, rankscope_rank_grad_norm_z)
// are exported for at most `per_rank_series_limit` ranks per job: the ranks of the latest step
// with the lowest consensus cosine, then the largest |z|.
//
// Thread safety: thread-safe. OnJob/OnStep/OnAgentStatus are called by the collector's threads;
// Collect() by the HTTP exposer's threads.
#ifndef RANKSCOPE_COLLECTOR_PROMETHEUS_EXPORT_H_
#define RANKSCOPE_COLLECTOR_PROMETHEUS_EXPORT_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collector/step_stats.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace rankscope::collector {

struct ExportOptions {
  size_t per_rank_series_limit = 32;
  absl::Duration spike_window = absl::Seconds(60);
  absl::Duration job_expiry = absl::Hours(1);
  std::function<absl::Time()> clock = [] { return absl::Now(); };
};

// What the exporter needs to know of one closed step.
struct ExportedStep {
  uint64_t step = 0;
  uint32_t world_size = 0;
  bool timed_out = false;
  const StepStatistics* stats = nullptr;   // per_rank carries each rank's number
  absl::Span<const uint32_t> missing_ranks;
};

class JobMetrics : public prometheus::Collectable {
 public:
  explicit JobMetrics(ExportOptions options = {});

  // A rank of `job` connected (hello accepted) or disconnected.
  void OnAgentConnected(const std::string& job, uint32_t world_size);
  void OnAgentDisconnected(const std::string& job);
  // The agent of (job, rank) reported its cumulative count of dropped reports.
  void OnAgentDropped(const std::string& job, uint32_t rank, uint64_t dropped_total);
  // A step of `job` was joined and its statistics computed.
  void OnStep(const std::string& job, const ExportedStep& step);

  // Families, one per metric name, HELP and TYPE set:
  //   gauges {train_job}: rankscope_step, rankscope_world_size, rankscope_ranks_reporting,
  //     rankscope_loss_mean, rankscope_loss_std, rankscope_loss_range, rankscope_grad_norm_mean,
  //     rankscope_grad_norm_std, rankscope_grad_norm_cv, rankscope_grad_cosine_mean,
  //     rankscope_connected_agents, and the four *_window metrics above;
  //   counters {train_job}: rankscope_steps_total, rankscope_steps_timed_out_total,
  //     rankscope_agent_dropped_reports_total;
  //   gauges {train_job,rank}: rankscope_rank_grad_cosine, rankscope_rank_loss_z,
  //     rankscope_rank_grad_norm_z (capped), rankscope_rank_missing (1 for each rank missing from
  //     the latest step, capped).
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct WindowPoint {
    absl::Time at;
    double loss_std, loss_range, grad_norm_cv, grad_cosine_mean;
  };
  struct RankPoint {
    uint32_t rank;
    double grad_cosine, loss_z, grad_norm_z;
  };
  struct JobState {
    uint32_t world_size = 0;
    uint32_t connected = 0;
    bool has_step = false;
    uint64_t step = 0;
    uint32_t ranks_reporting = 0;
    StepStatistics latest;           // per_rank cleared; see top_ranks
    std::vector<RankPoint> top_ranks;  // already capped and ordered
    std::vector<uint32_t> missing;     // capped
    uint64_t steps_total = 0;
    uint64_t steps_timed_out_total = 0;
    absl::flat_hash_map<uint32_t, uint64_t> dropped_by_rank;
    std::deque<WindowPoint> window;
    absl::Time last_update = absl::UnixEpoch();
  };

  ExportOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, JobState> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PROMETHEUS_EXPORT_H_
