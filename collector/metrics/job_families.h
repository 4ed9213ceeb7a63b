// The metric families JobMetrics exports (prometheus_export.h), as data: one row per family,
// in output order, with its name, HELP and TYPE. A family's JobFamily value is its row's index,
// checked at compile time below.
//
// Internal to collector/metrics/ (included by prometheus_export.cc and its tests only).
#ifndef RANKSCOPE_COLLECTOR_METRICS_JOB_FAMILIES_H_
#define RANKSCOPE_COLLECTOR_METRICS_JOB_FAMILIES_H_

#include <cstddef>

#include "prometheus/metric_type.h"

namespace rankscope::collector {

enum JobFamily : size_t {
  kStep,
  kWorldSize,
  kRanksReporting,
  kConnectedAgents,
  kLossMean,
  kLossStd,
  kLossRange,
  kGradNormMean,
  kGradNormStd,
  kGradNormCv,
  kGradCosineMean,
  kLossStdMaxWindow,
  kLossRangeMaxWindow,
  kGradNormCvMaxWindow,
  kGradCosineMeanMinWindow,
  kStepsTotal,
  kStepsTimedOutTotal,
  kStepsNonfiniteTotal,
  kAgentDroppedReportsTotal,
  kRankGradCosine,
  kRankLossZ,
  kRankGradNormZ,
  kRankMissing,
  kRankOutlierScore,
  kRankStepTimeSeconds,
  kRankStepTimeZ,
  kGradNoiseScale,
  kReplicaDivergentRanks,
  kReplicaChecksTotal,
  kReplicaDivergentStepsTotal,
  kRankReplicaDivergent,
  kDuplicateRanks,
  kDuplicateStepsTotal,
  kRankInfo,
  kJobGroups,
  kJobGradCosineMeanMin,
  kJobGroupsWithOutliers,
  kJobGroupsReplicaDivergent,
  kRankDriftScore,
  kRankSlowScore,
  kDriftingRanks,
  kSlowRanks,
  kRankDeviatingBucket,
  kIntegrityChecksTotal,
  kIntegrityFailedStepsTotal,
  kIntegrityErrorRatio,
  kIntegritySuspectRank,
  kLastStepTimestamp,
  kRankStepLag,
  kReportingEnabled,
  kExportSeries,
  kExportGroupsCapped,
  kJobFamilyCount,
};

struct JobFamilySpec {
  JobFamily family;
  const char* name;
  const char* help;
  prometheus::MetricType type;
};

inline constexpr JobFamilySpec kJobFamilies[kJobFamilyCount] = {
    {kStep, "rankscope_step", "Step number of the training job's latest joined step.",
     prometheus::MetricType::Gauge},
    {kWorldSize, "rankscope_world_size", "Number of ranks of the training job.",
     prometheus::MetricType::Gauge},
    {kRanksReporting, "rankscope_ranks_reporting", "Ranks that reported the latest joined step.",
     prometheus::MetricType::Gauge},
    {kConnectedAgents, "rankscope_connected_agents",
     "Agents of the training job with an open stream.", prometheus::MetricType::Gauge},
    {kLossMean, "rankscope_loss_mean", "Mean of the ranks' local losses at the latest step.",
     prometheus::MetricType::Gauge},
    {kLossStd, "rankscope_loss_std",
     "Population standard deviation of the ranks' local losses at the "
     "latest step.",
     prometheus::MetricType::Gauge},
    {kLossRange, "rankscope_loss_range",
     "Max minus min of the ranks' local losses at the latest step.", prometheus::MetricType::Gauge},
    {kGradNormMean, "rankscope_grad_norm_mean",
     "Mean of the ranks' local gradient L2 norms at the latest step.",
     prometheus::MetricType::Gauge},
    {kGradNormStd, "rankscope_grad_norm_std",
     "Population standard deviation of the ranks' local gradient L2 "
     "norms at the latest step.",
     prometheus::MetricType::Gauge},
    {kGradNormCv, "rankscope_grad_norm_cv",
     "Coefficient of variation (std/mean) of the ranks' local gradient "
     "L2 norms at the latest step.",
     prometheus::MetricType::Gauge},
    {kGradCosineMean, "rankscope_grad_cosine_mean",
     "Mean pairwise cosine of the ranks' gradient sketches at the "
     "latest step (NaN with fewer than two ranks).",
     prometheus::MetricType::Gauge},
    {kLossStdMaxWindow, "rankscope_loss_std_max_window",
     "Max of rankscope_loss_std over the latest step and the "
     "steps completed in the spike window.",
     prometheus::MetricType::Gauge},
    {kLossRangeMaxWindow, "rankscope_loss_range_max_window",
     "Max of rankscope_loss_range over the latest step and the "
     "steps completed in the spike window.",
     prometheus::MetricType::Gauge},
    {kGradNormCvMaxWindow, "rankscope_grad_norm_cv_max_window",
     "Max of rankscope_grad_norm_cv over the latest step and "
     "the steps completed in the spike window.",
     prometheus::MetricType::Gauge},
    {kGradCosineMeanMinWindow, "rankscope_grad_cosine_mean_min_window",
     "Min of rankscope_grad_cosine_mean over the latest "
     "step and the steps completed in the spike window.",
     prometheus::MetricType::Gauge},
    {kStepsTotal, "rankscope_steps_total", "Steps of the training job joined and exported.",
     prometheus::MetricType::Counter},
    {kStepsTimedOutTotal, "rankscope_steps_timed_out_total",
     "Steps closed by the join timeout with ranks missing.", prometheus::MetricType::Counter},
    {kStepsNonfiniteTotal, "rankscope_steps_nonfinite_total",
     "Steps with a NaN or Inf loss, gradient-norm or cosine "
     "statistic.",
     prometheus::MetricType::Counter},
    {kAgentDroppedReportsTotal, "rankscope_agent_dropped_reports_total",
     "Reports dropped by the training job's agents "
     "because their queue was full.",
     prometheus::MetricType::Counter},
    {kRankGradCosine, "rankscope_rank_grad_cosine",
     "Consensus cosine of the rank's gradient sketch with the sum "
     "of the other ranks' at the latest step (most deviating ranks only).",
     prometheus::MetricType::Gauge},
    {kRankLossZ, "rankscope_rank_loss_z",
     "Z-score of the rank's local loss at the latest step (most "
     "deviating ranks only).",
     prometheus::MetricType::Gauge},
    {kRankGradNormZ, "rankscope_rank_grad_norm_z",
     "Z-score of the rank's local gradient L2 norm at the latest "
     "step (most deviating ranks only).",
     prometheus::MetricType::Gauge},
    {kRankMissing, "rankscope_rank_missing",
     "1 for each rank missing from the latest step (capped; "
     "world_size - ranks_reporting is the full count).",
     prometheus::MetricType::Gauge},
    {kRankOutlierScore, "rankscope_rank_outlier_score",
     "Robust outlier score of the rank held over its last 3 reported steps (the smallest of "
     "them): per step the largest of the median/MAD z-scores of its loss and gradient norm and "
     "the deficit of its consensus cosine (most deviating ranks only; above 6: a persistent "
     "outlier).",
     prometheus::MetricType::Gauge},
    {kRankStepTimeSeconds, "rankscope_rank_step_time_seconds",
     "The rank's own compute time of the latest step, up to its gradient hook (most deviating "
     "ranks only).",
     prometheus::MetricType::Gauge},
    {kRankStepTimeZ, "rankscope_rank_step_time_z",
     "Robust z-score of the rank's step time at the latest step; a straggler is large and "
     "positive (most deviating ranks only).",
     prometheus::MetricType::Gauge},
    {kGradNoiseScale, "rankscope_grad_noise_scale",
     "Gradient noise scale B_simple (McCandlish et al. 2018) of the latest step where it was "
     "defined, in samples.",
     prometheus::MetricType::Gauge},
    {kReplicaDivergentRanks, "rankscope_replica_divergent_ranks",
     "Most ranks whose replica fingerprint differed from the majority (beyond the tolerance, "
     "for ranks whose replica check is tolerance) in one checked step of the spike window.",
     prometheus::MetricType::Gauge},
    {kReplicaChecksTotal, "rankscope_replica_checks_total",
     "Steps whose replica fingerprints were compared.", prometheus::MetricType::Counter},
    {kReplicaDivergentStepsTotal, "rankscope_replica_divergent_steps_total",
     "Checked steps in which some rank's replica fingerprint differed (beyond the tolerance, "
     "for ranks whose replica check is tolerance).",
     prometheus::MetricType::Counter},
    {kRankReplicaDivergent, "rankscope_rank_replica_divergent",
     "1 for each rank whose replica fingerprint differed (beyond the tolerance, for ranks whose "
     "replica check is tolerance) in a step of the spike window (capped).",
     prometheus::MetricType::Gauge},
    {kDuplicateRanks, "rankscope_duplicate_ranks",
     "Ranks whose local gradient was identical or nearly so (sketch cosine >= 0.999) to another "
     "rank's at the latest step: ranks that train on the same data.",
     prometheus::MetricType::Gauge},
    {kDuplicateStepsTotal, "rankscope_duplicate_steps_total",
     "Steps in which two or more ranks had identical or near-identical local gradients.",
     prometheus::MetricType::Counter},
    {kRankInfo, "rankscope_rank_info",
     "1 for each rank with per-rank series (most deviating, missing, replica-divergent, lagging "
     "ranks): its global rank, host and agent version, as its agent stated them.",
     prometheus::MetricType::Gauge},
    {kJobGroups, "rankscope_job_groups", "Data-parallel groups of the training job exported.",
     prometheus::MetricType::Gauge},
    {kJobGradCosineMeanMin, "rankscope_job_grad_cosine_mean_min",
     "The least consistent data-parallel group's mean pairwise cosine at its latest step.",
     prometheus::MetricType::Gauge},
    {kJobGroupsWithOutliers, "rankscope_job_groups_with_outliers",
     "Data-parallel groups of the job with a persistent outlier rank at their latest step.",
     prometheus::MetricType::Gauge},
    {kJobGroupsReplicaDivergent, "rankscope_job_groups_replica_divergent",
     "Data-parallel groups of the job whose latest checked step had a divergent replica.",
     prometheus::MetricType::Gauge},
    {kRankDriftScore, "rankscope_rank_drift_score",
     "The rank's data-drift CUSUM (loss, gradient norm and consensus cosine rank scores) over "
     "its threshold at the latest step; above 1 the rank is named drifting (most deviating "
     "ranks only).",
     prometheus::MetricType::Gauge},
    {kRankSlowScore, "rankscope_rank_slow_score",
     "The rank's step-time CUSUM over its threshold at the latest step; above 1 the rank is "
     "named slow (most deviating ranks only).",
     prometheus::MetricType::Gauge},
    {kDriftingRanks, "rankscope_drifting_ranks",
     "Ranks whose data-drift CUSUM was above its threshold at the latest step "
     "(step_stats.drifting_ranks).",
     prometheus::MetricType::Gauge},
    {kSlowRanks, "rankscope_slow_ranks",
     "Ranks whose step-time CUSUM was above its threshold at the latest step "
     "(step_stats.slow_ranks): stragglers.",
     prometheus::MetricType::Gauge},
    {kRankDeviatingBucket, "rankscope_rank_deviating_bucket_z",
     "Where in the model: for a flagged rank with per-rank series, the robust z of its local "
     "gradient norm in the parameter group (label bucket, e.g. layers.20-23.mlp) that deviates "
     "most from the other ranks' (one series per rank; NaN for a non-finite norm).",
     prometheus::MetricType::Gauge},
    {kIntegrityChecksTotal, "rankscope_integrity_checks_total",
     "Steps whose reduced-gradient sketch was compared with the mean of the ranks' local "
     "sketches (aggregation integrity).",
     prometheus::MetricType::Counter},
    {kIntegrityFailedStepsTotal, "rankscope_integrity_failed_steps_total",
     "Checked steps whose reduced gradient differed from the mean of the local gradients beyond "
     "the arithmetic's tolerance: a wrong all-reduce (step_stats.integrity_fault).",
     prometheus::MetricType::Counter},
    {kIntegrityErrorRatio, "rankscope_integrity_error_ratio",
     "||reduced sketch - mean of local sketches|| over its tolerance at the latest checked step; "
     "above 1 the step is flagged.",
     prometheus::MetricType::Gauge},
    {kIntegritySuspectRank, "rankscope_integrity_suspect_rank",
     "The rank whose contribution the latest failed check found missing, doubled or corrupted "
     "(labelled with the fault); absent when no rank was named.",
     prometheus::MetricType::Gauge},
    {kLastStepTimestamp, "rankscope_last_step_timestamp_seconds",
     "Unix time (the collector's clock) at which the job's latest step was joined: "
     "time() minus it is how long no step completed (RankscopeJobStalled).",
     prometheus::MetricType::Gauge},
    {kRankStepLag, "rankscope_rank_step_lag",
     "The newest step a rank reported minus the median of its group's ranks' newest steps "
     "(positive: ahead, negative: behind); exported only for ranks off the median, capped.",
     prometheus::MetricType::Gauge},
    {kReportingEnabled, "rankscope_reporting_enabled",
     "1 while the job's reporting is switched on, 0 while `rankscope ctl disable` switched it "
     "off (its steps then stop on purpose); absent until a control is known.",
     prometheus::MetricType::Gauge},
    {kExportSeries, "rankscope_export_series",
     "Per-job series in this scrape (these two included), at most --max_exported_series.",
     prometheus::MetricType::Gauge},
    {kExportGroupsCapped, "rankscope_export_groups_capped",
     "Jobs (data-parallel groups) whose series this scrape left out because the collector's "
     "--max_exported_series budget was spent on more deviating ones.",
     prometheus::MetricType::Gauge},
};

// True iff every row of kJobFamilies sits at the index of its JobFamily.
constexpr bool JobFamiliesInOrder() {
  for (size_t i = 0; i < kJobFamilyCount; ++i) {
    if (kJobFamilies[i].family != i) return false;
  }
  return true;
}
static_assert(JobFamiliesInOrder(), "kJobFamilies must list every JobFamily in enum order");

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_METRICS_JOB_FAMILIES_H_
