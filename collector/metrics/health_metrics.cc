#include "collector/metrics/health_metrics.h"

#include <string>
#include <vector>

#include "prometheus/family.h"

namespace rankscope::collector {
namespace {

prometheus::Counter* NewCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Gauge* NewGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help) {
  return &prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Histogram* NewHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help) {
  return &prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add(
      {}, HealthMetrics::LatencyBuckets());
}

}  // namespace

const std::vector<double>& HealthMetrics::LatencyBuckets() {
  static const std::vector<double>* const kBuckets =
      new std::vector<double>{100e-6, 250e-6, 500e-6, 1e-3,   2.5e-3, 5e-3, 10e-3, 25e-3,
                              50e-3,  100e-3, 250e-3, 500e-3, 1.0,    2.5,  5.0,   10.0};
  return *kBuckets;
}

// The names below are constants that prometheus-cpp accepts, so nothing here throws.
HealthMetrics::HealthMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& r = *registry_;
  reports_received_ = NewCounter(r, "rankscope_reports_received_total",
                                 "Rank reports received from agents, before validation.");
  auto& rejected = prometheus::BuildCounter()
                       .Name("rankscope_reports_rejected_total")
                       .Help("Reports, hellos and streams rejected, by reason.")
                       .Register(r);
  for (size_t i = 0; i < kRejectReasons.size(); ++i) {
    rejected_[i] = &rejected.Add({{"reason", std::string(ReasonLabel(kRejectReasons[i]))}});
  }
  reports_late_ = NewCounter(r, "rankscope_reports_late_total",
                             "Reports received for a step that was already closed.");
  reports_duplicate_ = NewCounter(r, "rankscope_reports_duplicate_total",
                                  "Reports received again for a (job, rank, step) already held.");
  steps_evicted_ = NewCounter(r, "rankscope_steps_evicted_total",
                              "Open steps evicted by the per-job cap before they completed.");
  ingest_latency_ =
      NewHistogram(r, "rankscope_ingest_latency_seconds",
                   "Time from a step's last report received to its statistics exported.");
  store_commit_ = NewHistogram(r, "rankscope_store_commit_seconds",
                               "Duration of one SQLite commit of a batch.");
  store_errors_ = NewCounter(r, "rankscope_store_errors_total", "Failed SQLite operations.");
  store_dropped_ = NewCounter(r, "rankscope_store_dropped_items_total",
                              "Store items dropped unstored (queue overflow or a permanent SQLite "
                              "error); their agents are made to reconnect and resend.");
  store_healthy_ = NewGauge(r, "rankscope_store_healthy",
                            "1 while the last SQLite commit succeeded, 0 while commits fail "
                            "(disk full, file unwritable); nothing is acked while 0.");
  store_healthy_->Set(1);
  store_queue_depth_ =
      NewGauge(r, "rankscope_store_queue_depth", "Items waiting for the SQLite writer thread.");
  streams_open_ = NewGauge(r, "rankscope_streams_open", "Agent streams currently open.");
  attempt_takeovers_ =
      NewCounter(r, "rankscope_attempt_takeovers_total",
                 "Hellos of a higher attempt accepted while streams of the job's previous attempt "
                 "were still connected (a restart, or a client announcing one).");
  streams_hello_timeout_ =
      NewCounter(r, "rankscope_streams_hello_timeout_total",
                 "Agent streams ended because no Hello came within --hello_timeout.");
  streams_overflowed_ =
      NewCounter(r, "rankscope_streams_overflowed_total",
                 "Agent streams ended with RESOURCE_EXHAUSTED because the agent did not read the "
                 "acks and rejections queued for it.");
  auto& pruned = prometheus::BuildCounter()
                     .Name("rankscope_store_pruned_rows_total")
                     .Help(
                         "Rows deleted by the storage retention pass, by table and reason (age: "
                         "--retention_rank_steps / --retention_steps; size: --max_db_bytes).")
                     .Register(r);
  const char* const kReasons[] = {"age", "size"};
  const char* const kTables[] = {"rank_steps", "step_stats", "rank_windows", "jobs"};
  for (size_t i = 0; i < 2; ++i) {
    for (size_t t = 0; t < 4; ++t) {
      pruned_rows_[i][t] = &pruned.Add({{"reason", kReasons[i]}, {"table", kTables[t]}});
    }
  }
  downsampled_rows_ = NewCounter(r, "rankscope_store_downsampled_rows_total",
                                 "rank_steps rows folded into rank_windows before being pruned.");
  vacuumed_bytes_ = NewCounter(r, "rankscope_store_vacuumed_bytes_total",
                               "Bytes of free pages returned to the file system (incremental "
                               "vacuum).");
  prune_errors_ =
      NewCounter(r, "rankscope_store_prune_errors_total", "Failed storage retention passes.");
  prune_seconds_ = NewHistogram(r, "rankscope_store_prune_seconds",
                                "Duration of one storage retention transaction.");
  db_bytes_ = NewGauge(r, "rankscope_store_db_bytes",
                       "Size of the SQLite database file (pages x page size, without the WAL).");
  db_free_bytes_ = NewGauge(r, "rankscope_store_db_free_bytes",
                            "Free pages of the database file not yet returned by the vacuum.");
  over_cap_ = NewGauge(r, "rankscope_store_over_cap",
                       "1 while the database exceeds --max_db_bytes with only each job's newest "
                       "step left to prune.");
}

void HealthMetrics::ObservePrune(PruneReason reason, int64_t rank_rows, int64_t step_rows,
                                 int64_t window_rows, int64_t job_rows, int64_t downsampled_rows,
                                 int64_t vacuumed_bytes, absl::Duration took) {
  auto& by_table = pruned_rows_[reason == PruneReason::kAge ? 0 : 1];
  by_table[0]->Increment(static_cast<double>(rank_rows));
  by_table[1]->Increment(static_cast<double>(step_rows));
  by_table[2]->Increment(static_cast<double>(window_rows));
  by_table[3]->Increment(static_cast<double>(job_rows));
  downsampled_rows_->Increment(static_cast<double>(downsampled_rows));
  vacuumed_bytes_->Increment(static_cast<double>(vacuumed_bytes));
  prune_seconds_->Observe(absl::ToDoubleSeconds(took));
}

void HealthMetrics::PruneError() { prune_errors_->Increment(); }

void HealthMetrics::SetStoreUsage(int64_t file_bytes, int64_t free_bytes, bool over_cap) {
  db_bytes_->Set(static_cast<double>(file_bytes));
  db_free_bytes_->Set(static_cast<double>(free_bytes));
  over_cap_->Set(over_cap ? 1 : 0);
}

void HealthMetrics::ReportsReceived(uint64_t count) {
  reports_received_->Increment(static_cast<double>(count));
}

void HealthMetrics::Rejected(RejectReason reason) {
  if (reason == RejectReason::kNone) reason = RejectReason::kInvalidReport;
  rejected_[ReasonIndex(reason)]->Increment();
}

void HealthMetrics::Rejected(absl::string_view label) {
  Rejected(ReasonFromLabel(std::string_view(label.data(), label.size()))
               .value_or(RejectReason::kInvalidReport));
}

void HealthMetrics::ReportLate() { reports_late_->Increment(); }
void HealthMetrics::ReportDuplicate() { reports_duplicate_->Increment(); }
void HealthMetrics::StepEvicted() { steps_evicted_->Increment(); }

void HealthMetrics::ObserveIngestLatency(absl::Duration latency) {
  ingest_latency_->Observe(absl::ToDoubleSeconds(latency));
}

void HealthMetrics::ObserveStoreCommit(absl::Duration duration) {
  store_commit_->Observe(absl::ToDoubleSeconds(duration));
}

void HealthMetrics::StoreError() { store_errors_->Increment(); }

void HealthMetrics::SetStoreHealthy(bool healthy) { store_healthy_->Set(healthy ? 1 : 0); }

void HealthMetrics::StoreDropped(size_t items) {
  store_dropped_->Increment(static_cast<double>(items));
}

void HealthMetrics::SetStoreQueueDepth(size_t depth) {
  store_queue_depth_->Set(static_cast<double>(depth));
}

void HealthMetrics::StreamOpened() { streams_open_->Increment(); }
void HealthMetrics::StreamClosed() { streams_open_->Decrement(); }
void HealthMetrics::HelloTimedOut() { streams_hello_timeout_->Increment(); }
void HealthMetrics::AttemptTakeover() { attempt_takeovers_->Increment(); }
void HealthMetrics::StreamOverflowed() { streams_overflowed_->Increment(); }

}  // namespace rankscope::collector
