// The collector's own health metrics (DESIGN.md "Prometheus metrics"), registered in a
// prometheus::Registry that the HTTP exposer serves beside JobMetrics.
//
// Every metric is created in the constructor from constant names, so no method throws and none
// allocates a new series at runtime: rankscope_reports_rejected_total has one series per reason
// in kRejectReasons (reject_reason.h), labelled ReasonLabel(reason), each exported from 0.
//
// Exported:
//   counters: rankscope_reports_received_total, rankscope_reports_rejected_total{reason},
//     rankscope_reports_late_total, rankscope_reports_duplicate_total,
//     rankscope_steps_evicted_total, rankscope_store_errors_total (failed commits, each retry
//     counted), rankscope_store_dropped_items_total (store items given up unstored; their agents
//     are made to resend), rankscope_streams_hello_timeout_total (streams ended because their
//     first message did not come within --hello_timeout), rankscope_streams_overflowed_total
//     (streams ended because their agent did not read what it was sent),
//     rankscope_attempt_takeovers_total (hellos of a higher attempt accepted while streams of the
//     job's previous attempt were still connected: a restart, or a client announcing one);
//   histograms (seconds, buckets 100 µs .. 10 s): rankscope_ingest_latency_seconds,
//     rankscope_store_commit_seconds;
//   gauges: rankscope_store_queue_depth, rankscope_streams_open, rankscope_store_healthy (1 while
//     the last SQLite commit succeeded, 0 from a failed one until a commit succeeds again).
//   storage lifecycle (retention.h): rankscope_store_pruned_rows_total{table,reason} (rows
//     deleted by the retention pass; table rank_steps|step_stats|rank_windows|jobs, reason
//     age|size), rankscope_store_downsampled_rows_total (rank_steps rows folded into
//     rank_windows), rankscope_store_vacuumed_bytes_total, rankscope_store_prune_errors_total,
//     histogram rankscope_store_prune_seconds (one pruning transaction), gauges
//     rankscope_store_db_bytes (the database file: pages x page size),
//     rankscope_store_db_free_bytes (free pages not yet returned), rankscope_store_over_cap (1
//     while --max_db_bytes is exceeded and only each job's newest step is left to prune).
//
// Thread safety: thread-safe; every method may be called from any thread.
#ifndef RANKSCOPE_COLLECTOR_METRICS_HEALTH_METRICS_H_
#define RANKSCOPE_COLLECTOR_METRICS_HEALTH_METRICS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/model/reject_reason.h"
#include "collector/store/retention.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace rankscope::collector {

class HealthMetrics {
 public:
  HealthMetrics();
  HealthMetrics(const HealthMetrics&) = delete;
  HealthMetrics& operator=(const HealthMetrics&) = delete;

  // The registry holding these metrics; register it with the exposer.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // `count` reports were received (before validation).
  void ReportsReceived(uint64_t count = 1);
  // A report, hello or stream was rejected for `reason` (kNone is counted as kInvalidReport).
  void Rejected(RejectReason reason);
  // The same by label value: a label not in kRejectReasons is counted as invalid_report (the
  // label set stays fixed).
  void Rejected(absl::string_view label);
  // A report arrived for a step already closed (late) or already received (duplicate).
  void ReportLate();
  void ReportDuplicate();
  // An open step was evicted by the joiner's per-job cap before it completed.
  void StepEvicted();

  // From a step's last report received to its statistics exported.
  void ObserveIngestLatency(absl::Duration latency);
  // One SQLite commit (a batch), and a failed store operation.
  void ObserveStoreCommit(absl::Duration duration);
  void StoreError();
  // Whether the last SQLite commit succeeded (rankscope_store_healthy).
  void SetStoreHealthy(bool healthy);
  // `items` store items were dropped unstored (queue overflow or a permanent store error).
  void StoreDropped(size_t items);
  // Reports (or batches) waiting for the SQLite writer thread.
  void SetStoreQueueDepth(size_t depth);

  // Storage lifecycle: one pruning transaction and what it deleted; the store's size.
  void ObservePrune(PruneReason reason, int64_t rank_rows, int64_t step_rows, int64_t window_rows,
                    int64_t job_rows, int64_t downsampled_rows, int64_t vacuumed_bytes,
                    absl::Duration took);
  void PruneError();
  void SetStoreUsage(int64_t file_bytes, int64_t free_bytes, bool over_cap);

  // Agent streams currently open.
  void StreamOpened();
  void StreamClosed();
  // A stream was ended because no hello came within --hello_timeout.
  void HelloTimedOut();
  // A higher attempt took a job over while its previous attempt's streams were connected.
  void AttemptTakeover();
  // A stream was ended because its outbound queue was full (the agent does not read).
  void StreamOverflowed();

  // The histograms' bucket upper bounds, in seconds: 100 µs .. 10 s, 1-2.5-5 per decade.
  static const std::vector<double>& LatencyBuckets();

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* reports_received_;
  std::array<prometheus::Counter*, kRejectReasons.size()> rejected_;
  prometheus::Counter* reports_late_;
  prometheus::Counter* reports_duplicate_;
  prometheus::Counter* steps_evicted_;
  prometheus::Histogram* ingest_latency_;
  prometheus::Histogram* store_commit_;
  prometheus::Counter* store_errors_;
  prometheus::Counter* store_dropped_;
  prometheus::Gauge* store_healthy_;
  prometheus::Gauge* store_queue_depth_;
  prometheus::Gauge* streams_open_;
  prometheus::Counter* streams_hello_timeout_;
  prometheus::Counter* attempt_takeovers_;
  prometheus::Counter* streams_overflowed_;
  // [reason][table]: age, size x rank_steps, step_stats, rank_windows, jobs.
  std::array<std::array<prometheus::Counter*, 4>, 2> pruned_rows_;
  prometheus::Counter* downsampled_rows_;
  prometheus::Counter* vacuumed_bytes_;
  prometheus::Counter* prune_errors_;
  prometheus::Histogram* prune_seconds_;
  prometheus::Gauge* db_bytes_;
  prometheus::Gauge* db_free_bytes_;
  prometheus::Gauge* over_cap_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_METRICS_HEALTH_METRICS_H_
