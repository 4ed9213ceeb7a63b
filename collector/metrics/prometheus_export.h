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
// Alerts use the window metrics, so a one-step spike is never missed. Precisely:
//  - The window is kept as at most ~60 time buckets of spike_window/60 each (bounded memory
//    whatever the step rate). A step counts for at least `spike_window` after it completed and
//    at most spike_window + spike_window/60.
//  - The latest step always counts, so a stalled job keeps exporting its last step's value and
//    max_window >= the latest gauge (min_window <= it) holds whenever the latest is not NaN.
//  - NaN is ignored as PromQL's max_over_time ignores it: a window metric is NaN only if every
//    step it covers was NaN. rankscope_steps_nonfinite_total counts steps with a NaN/Inf
//    statistic, so a non-finite step between scrapes is not missed either.
//
// Per-rank series (rankscope_rank_outlier_score, rankscope_rank_grad_cosine, rankscope_rank_loss_z,
// rankscope_rank_grad_norm_z, rankscope_rank_step_time_seconds, rankscope_rank_step_time_z,
// rankscope_rank_drift_score, rankscope_rank_slow_score) are exported for at most
// `per_rank_series_limit` ranks per job, the same ranks in every metric, picked from the latest
// step round-robin from seven rankings: largest outlier score, lowest consensus cosine, largest
// |loss_z|, largest |grad_norm_z|, largest step-time z, largest drift score, largest slow score
// (in that priority), so the worst rank by each criterion is always present. NaN counts as the most
// deviating; ties go to the lower rank number. The outlier score is RankExtras::held_outlier_score,
// the smallest of the rank's last 3 per-step scores: a job that stops stepping (finished, hung)
// holds its latest step, and one noisy step must not become an alert. (Under step_stats.h a
// non-finite input makes that statistic NaN for every rank, and with fewer than two ranks every
// cosine is NaN: the other rankings then decide.) rankscope_rank_missing is exported for at most
// `per_rank_series_limit` missing ranks, the lowest rank numbers; world_size - ranks_reporting
// gives the full count.
//
// Jobs: `last_update` is the time of the job's latest OnStep/OnAgent* call. A job with no
// connected agent and not updated for `job_expiry` is no longer exported, and its state is freed
// at a later update of any job (checked at most once a minute). A job with a connected agent is
// never expired: a hung job keeps exporting its last step, so "step not advancing" alerts hold.
// A job has ended when agents connected and none is connected now (it finished, or lost this
// collector): until one connects again, its most deviating ranks' series (the rankings above,
// and their rankscope_rank_info) are not exported. Its last step would otherwise stay "latest"
// for job_expiry, and one noisy step (at 64 ranks a |loss z| above 3 on about one step in six)
// would hold a per-rank alert for that long. Job-level series, missing and replica-divergent
// ranks stay until expiry.
//
// Series budget (docs/reliability.md "What a hostile client can still do"): one group (a job
// without groups is one) exports at most ~30 job-level series plus, for at most
// per_rank_series_limit ranks each, 8 per-rank gauges and rankscope_rank_info, plus at most
// per_rank_series_limit missing and as many replica-divergent ranks (each with its rank_info):
// about 30 + 13 * per_rank_series_limit = 446 at the default 32 (plus, for a stalled or
// out-of-phase job, at most per_rank_series_limit lagging ranks, each with its rank_info); a job
// exports at most per_job_group_series_limit groups, plus 4 aggregates. A collector exports at most
// `max_series` per-job series per scrape: groups are taken most deviating first (a divergent
// replica or an outlier, then the lowest cosine; ties by name) and a group that would overrun
// the budget is left out whole, so no alert sees half a group. rankscope_export_series and
// rankscope_export_groups_capped say what happened.
//
// Thread safety: thread-safe. OnAgent*/OnStep are called by the collector's threads (the clock
// is called without the lock held); Collect() by the HTTP exposer's threads.
#ifndef RANKSCOPE_COLLECTOR_METRICS_PROMETHEUS_EXPORT_H_
#define RANKSCOPE_COLLECTOR_METRICS_PROMETHEUS_EXPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collector/analysis/aggregation_integrity.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/step_stats.h"
#include "collector/metrics/spike_window.h"
#include "common/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace rankscope::collector {

struct ExportOptions {
  size_t per_rank_series_limit = 32;
  // Data-parallel groups of one job whose series are exported (the most deviating first); the
  // job-level aggregates (rankscope_job_*) cover every group.
  size_t per_job_group_series_limit = 32;
  absl::Duration spike_window = absl::Seconds(60);
  absl::Duration job_expiry = absl::Hours(1);
  // The collector's series budget (--max_exported_series; 0: no cap): per-job series of one scrape
  // beyond it are left out a whole group at a time, the least deviating groups first (see
  // "Series budget"), and counted in rankscope_export_groups_capped.
  size_t max_series = 100'000;
  std::function<absl::Time()> clock = [] { return absl::Now(); };
};

// What the exporter needs to know of one closed step. `extras` (RankExtras, rank_diagnostics.h)
// are in the same order as stats->per_rank. A view: `stats` and the spans must outlive OnStep.
struct ExportedStep {
  uint64_t step = 0;
  uint32_t world_size = 0;
  bool timed_out = false;
  const StepStatistics* stats = nullptr;  // per_rank carries each rank's number
  absl::Span<const uint32_t> missing_ranks;
  // Optional diagnostics: empty `extras` means none; otherwise extras[i] goes with per_rank[i].
  absl::Span<const RankExtras> extras;
  double grad_noise_scale = std::numeric_limits<double>::quiet_NaN();
  bool replica_checked = false;
  absl::Span<const uint32_t> replica_divergent_ranks;
  // Ranks in a group of identical or near-identical gradients (duplicate_ranks.h).
  uint32_t duplicate_ranks = 0;
  // Ranks named persistent outliers at this step (step_stats.outlier_ranks).
  uint32_t outlier_ranks = 0;
  // A rank of the step had no loss (a pipeline stage): the loss statistics are NaN, not a fault.
  bool loss_absent = false;
  // Ranks named by the sequential statistics (rank_cusum.h) after this step; exported with
  // `extras` only.
  absl::Span<const uint32_t> drifting_ranks;
  absl::Span<const uint32_t> slow_ranks;
  // Where in the model: per rank (same order as per_rank; empty: none), the name and robust z
  // of the bucket that carries most of a flagged rank's deviation (bucket_scores.h).
  absl::Span<const std::pair<std::string, double>> top_bucket;
  // Aggregation integrity (aggregation_integrity.h): nullptr when the step was not checked.
  const AggregationVerdict* integrity = nullptr;
};

// Who an agent is, as its hello stated (rankscope_rank_info).
struct RankIdentity {
  bool known = false;
  uint32_t rank = 0;
  std::optional<uint32_t> global_rank;
  std::string host;
  std::string agent_version;  // Hello.agent_version: mixed versions in one job show
};

class JobMetrics : public prometheus::Collectable {
 public:
  explicit JobMetrics(ExportOptions options = {});

  // A rank of `job` connected (hello accepted) or disconnected.
  void OnAgentConnected(const std::string& job, uint32_t world_size);
  // The same, with the rank's identity (exported as rankscope_rank_info while the rank has
  // per-rank series).
  void OnAgentConnected(const std::string& job, uint32_t world_size, RankIdentity identity);
  void OnAgentDisconnected(const std::string& job);
  // A new agent process holds (job, rank) (not a reconnect): its cumulative dropped count starts
  // from zero, so its first count is counted whole.
  void OnAgentStarted(const std::string& job, uint32_t rank);
  // The agent of (job, rank) reported its cumulative count of dropped reports. The exported
  // rankscope_agent_dropped_reports_total never decreases: a count below the process's previous
  // one adds nothing, one report adds at most kMaxDroppedPerReport, and the total saturates.
  static constexpr uint64_t kMaxDroppedPerReport = 65'536;
  void OnAgentDropped(const std::string& job, uint32_t rank, uint64_t dropped_total);
  // The job's control (rankscope ctl, or the newest one its agent stated in its hello) switched
  // reporting on or off. `job` is a group key, or the name of a job of several groups, which
  // sets every group of it that is known here.
  void OnControl(const std::string& job, bool enabled);
  // A step of `job` was joined and its statistics computed.
  void OnStep(const std::string& job, const ExportedStep& step);

  // Families, one per metric name, HELP and TYPE set:
  //   gauges {train_job}: rankscope_step, rankscope_world_size, rankscope_ranks_reporting,
  //     rankscope_loss_mean, rankscope_loss_std, rankscope_loss_range, rankscope_grad_norm_mean,
  //     rankscope_grad_norm_std, rankscope_grad_norm_cv, rankscope_grad_cosine_mean,
  //     rankscope_connected_agents, and the four *_window metrics above;
  //   counters {train_job}: rankscope_steps_total, rankscope_steps_timed_out_total,
  //     rankscope_steps_nonfinite_total, rankscope_agent_dropped_reports_total (monotonic: the
  //     sum of each rank's increases; an agent restart that resets its count adds the new count);
  //   gauges {train_job,rank}: rankscope_rank_grad_cosine, rankscope_rank_loss_z,
  //     rankscope_rank_grad_norm_z, rankscope_rank_outlier_score, rankscope_rank_step_time_seconds,
  //     rankscope_rank_step_time_z (capped), rankscope_rank_missing (1 for each rank missing from
  //     the latest step, capped);
  //   replica consistency: rankscope_replica_divergent_ranks{train_job} (gauge: most ranks
  //     divergent in one checked step of the spike window; 0 when checked and consistent; absent
  //     until a step was checked), rankscope_replica_checks_total and
  //     rankscope_replica_divergent_steps_total{train_job} (counters),
  //     rankscope_rank_replica_divergent{train_job,rank} (1 for each rank divergent in a step of
  //     the spike window, capped);
  //   rankscope_grad_noise_scale{train_job}: B_simple of the latest step where it was defined;
  //   duplicate data: rankscope_duplicate_ranks{train_job} (gauge: ranks in a duplicate group at
  //     the latest step) and rankscope_duplicate_steps_total{train_job} (counter: steps with one);
  //   sequential detection (rank_cusum.h), with diagnostics only:
  //     rankscope_rank_drift_score, rankscope_rank_slow_score {train_job,rank} (the CUSUM over
  //     its threshold, capped as above) and rankscope_drifting_ranks, rankscope_slow_ranks
  //     {train_job} (ranks above it at the latest step: the CUSUM keeps a rank named for many
  //     steps, so no spike window is needed);
  //   aggregation integrity (once a step was checked): rankscope_integrity_checks_total,
  //     rankscope_integrity_failed_steps_total {train_job} (counters),
  //     rankscope_integrity_error_ratio{train_job} (latest checked step) and
  //     rankscope_integrity_suspect_rank{train_job,fault} (the rank the latest failed check named);
  //   stalls: rankscope_last_step_timestamp_seconds{train_job} (Unix time, the collector's
  //     clock, at which the latest step was joined; absent before the first step and after a
  //     collector restart until one closes) and rankscope_rank_step_lag{train_job,rank} (the
  //     newest step the rank was joined in minus the lower median over the group's ranks of that
  //     number; exported only for ranks off the median, at most per_rank_series_limit, largest
  //     |lag| first, ties to the lower rank; not for an ended job). A job whose agents stay
  //     connected while no step closes is stalled; the lag says which rank ran ahead or stayed
  //     behind, and is absent when every rank stopped at the same step;
  //     rankscope_reporting_enabled{train_job} (OnControl's latest, once told): a job switched
  //     off stops stepping on purpose;
  //   who: rankscope_rank_info{train_job,rank,global_rank,host,version} 1 for each rank with
  //     per-rank series above (top, missing, replica-divergent, lagging ranks) whose identity is
  //     known.
  //   groups: a key "JOB/GROUP" (common/job_name.h) is exported as {train_job=JOB, group=GROUP};
  //     per train_job, across its groups (a job without groups is one): rankscope_job_groups,
  //     rankscope_job_grad_cosine_mean_min (the least consistent group's latest cosine),
  //     rankscope_job_groups_with_outliers, rankscope_job_groups_replica_divergent.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct RankPoint {
    uint32_t rank;
    double grad_cosine, loss_z, grad_norm_z;
    double outlier_score, step_time_seconds, step_time_z;
    double drift_score, slow_score;
    bool has_extras;         // the step carried RankExtras
    std::string top_bucket;  // ExportedStep::top_bucket, empty when none
    double top_bucket_z;
  };
  struct JobState {
    uint32_t world_size = 0;
    uint32_t connected = 0;
    bool had_agents = false;  // an agent connected at some time (see "ended" above)
    bool has_step = false;
    uint64_t step = 0;
    uint32_t ranks_reporting = 0;
    StepSummary latest;                // the latest step's; its ranks: top_ranks
    std::vector<RankPoint> top_ranks;  // already capped and ordered
    std::vector<uint32_t> missing;     // capped
    uint64_t steps_total = 0;
    uint64_t steps_timed_out_total = 0;
    uint64_t steps_nonfinite_total = 0;
    uint64_t dropped_total = 0;  // monotonic, see above
    double grad_noise_scale = std::numeric_limits<double>::quiet_NaN();
    uint64_t replica_checks_total = 0;
    uint64_t replica_divergent_steps_total = 0;
    uint32_t duplicate_ranks = 0;
    uint64_t duplicate_steps_total = 0;
    uint32_t outlier_ranks_latest = 0;       // persistent outliers at the latest step
    bool replica_divergent_checked = false;  // the latest checked step had a divergent replica
    // By rank: who connected (global rank, host). Bounded by the job's ranks that connected.
    absl::flat_hash_map<uint32_t, RankIdentity> identities;
    bool has_sequential = false;  // the latest step carried RankExtras
    uint32_t drifting_ranks = 0;
    uint32_t slow_ranks = 0;
    uint64_t integrity_checks_total = 0;
    uint64_t integrity_failed_total = 0;
    double integrity_error_ratio = std::numeric_limits<double>::quiet_NaN();
    std::optional<uint32_t> integrity_suspect;  // of the latest failed check
    std::string integrity_fault;                // of the latest failed check
    double replica_divergent_latest = std::numeric_limits<double>::quiet_NaN();
    absl::flat_hash_map<uint32_t, absl::Time> replica_divergent_at;  // rank -> last divergent
    absl::flat_hash_map<uint32_t, uint64_t> dropped_by_rank;  // last cumulative count per rank
    absl::Time last_step_at = absl::InfinitePast();           // when the latest step was joined
    std::optional<bool> reporting_enabled;                    // OnControl's; nullopt: never told
    // By rank: the newest step the rank was joined in. Bounded by the ranks that reported.
    absl::flat_hash_map<uint32_t, uint64_t> newest_step_by_rank;
    SpikeWindow window;
    absl::Time last_update = absl::UnixEpoch();
  };

  using JobEntry = std::pair<const std::string, JobState>;
  using Families = std::vector<prometheus::MetricFamily>;  // indexed by JobFamily (job_families.h)

  // The pieces of Collect(), in the order it runs them. Each appends samples to `families`.
  // The jobs exported at `now` (not expired), ordered by key.
  std::vector<const JobEntry*> LiveJobsLocked(absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // rankscope_job_*{train_job}: aggregates across each job's data-parallel groups.
  static void AddJobAggregates(absl::Span<const JobEntry* const> live, Families& families);
  // The group keys whose series are not exported: a job's groups beyond
  // per_job_group_series_limit, the least deviating ones.
  absl::flat_hash_set<const std::string*> HiddenGroups(
      absl::Span<const JobEntry* const> live) const;
  // Whether a group's state ranks before another's as more deviating (see "Series budget").
  static bool MoreDeviating(const JobEntry* a, const JobEntry* b);
  // The series of one group key (the job-level gauges and counters, the window metrics, then
  // AddRankSeries).
  void AddJobSeries(const std::string& key, const JobState& state, absl::Time now,
                    Families& families) const;
  // The per-rank series of one group key: most deviating, replica-divergent and missing ranks,
  // and rankscope_rank_info for each of them.
  void AddRankSeries(const std::string& key, const JobState& state, absl::Time now,
                     Families& families) const;

  // Returns the state of `job`, created if absent, with last_update = now; may free expired jobs.
  JobState& TouchLocked(const std::string& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Expired(const JobState& state, absl::Time now) const;

  ExportOptions options_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, JobState> jobs_ ABSL_GUARDED_BY(mu_);
  absl::Time next_prune_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_METRICS_PROMETHEUS_EXPORT_H_
