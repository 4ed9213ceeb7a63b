// StepAnalyzer: the diagnosis of one closed step, and the store rows that record it.
//
// Pure core: no threads, no clock, no gRPC or SQLite inside. For each JoinedStep (in the order
// the joiner closed them) it computes the step statistics (step_stats.h) and the per-rank
// diagnostics (rank_diagnostics.h: outlier scores, replica fingerprints, step-time z-scores, the
// gradient noise scale), and tracks per job and rank how many consecutive reported steps a rank
// was flagged an outlier (kOutlierPersistence of them make it a persistent outlier) and its
// scores on its last kOutlierPersistence steps (RankExtras::held_outlier_score), and per job
// and rank the sequential statistics of rank_cusum.h (drifting and slow ranks). Per job it holds
// at most world-size ranks; a job's state is reset when its epoch or world size changes and freed
// by ForgetJob.
//
// Sketches of different lengths are never compared: when a control's sketch re-tune crosses a
// step (some ranks already use the new dimension, common/sketch_dim.h), the step's direction
// consistency and every rank's consensus cosine are NaN.
//
// Thread safety: not thread-safe. StepPipeline owns one, used by its step thread only.
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_STEP_ANALYSIS_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_STEP_ANALYSIS_H_

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collector/analysis/aggregation_integrity.h"
#include "collector/analysis/bucket_scores.h"
#include "collector/analysis/duplicate_ranks.h"
#include "collector/analysis/outlier_scale.h"
#include "collector/analysis/rank_cusum.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/step_stats.h"
#include "collector/model/rank_report.h"
#include "collector/model/rows.h"
#include "collector/pipeline/step_joiner.h"

namespace rankscope::collector {

// Everything rank_diagnostics.h derives from one joined step. Per-report vectors are in the
// order of JoinedStep::reports.
struct StepDiagnostics {
  std::vector<OutlierScore> outliers;
  std::vector<RankExtras> extras;
  std::vector<std::optional<bool>> replica_ok;  // nullopt: the rank sent no fingerprint
  bool replica_checked = false;
  std::vector<uint32_t> replica_divergent;  // sorted
  // The parameters were compared with a tolerance (replica_tolerance.h): the ranks whose
  // fingerprint differed within it (sorted), and the largest deviation over the tolerance.
  bool replica_tolerance = false;
  std::vector<uint32_t> replica_within_tolerance;
  double replica_tolerance_ratio = std::numeric_limits<double>::quiet_NaN();
  std::vector<uint32_t> flagged_ranks;  // score above threshold this step, sorted
  double grad_noise_scale = std::numeric_limits<double>::quiet_NaN();
  // This step's own cross-rank scale of each outlier signal (before any floor): what the job's
  // OutlierScaleWindow keeps.
  SignalScales scales;
};

// One closed step, analysed.
struct AnalyzedStep {
  StepStatistics stats;  // per_rank in the order of JoinedStep::reports
  StepDiagnostics diag;
  // Ranks flagged on this step and on the kOutlierPersistence - 1 steps before it that they
  // reported, in the order of JoinedStep::reports.
  std::vector<uint32_t> outlier_ranks;
  // Groups of ranks whose local gradients are identical or nearly so (duplicate_ranks.h):
  // ranks that train on the same data.
  std::vector<DuplicateGroup> duplicates;
  // Ranks whose data-drift / slow CUSUM (rank_cusum.h) is above its threshold after this step,
  // sorted.
  std::vector<uint32_t> drifting_ranks;
  std::vector<uint32_t> slow_ranks;
  // Robust z of each rank's per-bucket norm (bucket_scores.h), in the order of
  // JoinedStep::reports; empty when the step's reports carry no comparable norms.
  std::vector<std::vector<float>> bucket_z;
  // With bucket_z: per report, the buckets that carry the deviation of a rank flagged for any
  // reason (FormatDeviatingBuckets; empty for a rank not flagged), and whether its per-bucket
  // norms are stored (flagged, or a step that is a multiple of kBucketSampleEvery).
  std::vector<std::string> deviating_buckets;
  std::vector<bool> keep_bucket_norms;
  // The most deviating bucket of each such rank, by name (what Prometheus exports); name empty
  // when none.
  std::vector<std::pair<std::string, double>> top_bucket;
  // Aggregation integrity (aggregation_integrity.h), when a rank sent the reduced sketch.
  AggregationVerdict integrity;
};

// Every rank's per-bucket norms are kept on the steps that are multiples of this (a healthy
// baseline beside the flagged rows); on other steps only flagged ranks keep theirs.
inline constexpr uint64_t kBucketSampleEvery = 100;

// The aggregation check of a joined step: the reduced sketch of its lowest rank that sent one
// against every rank's local sketch (unchecked when none sent one or a rank is missing).
AggregationVerdict CheckStepAggregation(const JoinedStep& step);

// The statistics of a joined step; direction consistency and consensus cosines are NaN when its
// reports' sketches differ in length.
StepStatistics ComputeJoinedStepStatistics(const JoinedStep& step);

// The per-rank diagnostics of a joined step, given its statistics (their consensus cosines) and
// its duplicate groups: each group of ranks with identical gradients counts once in the robust
// statistics the outlier scores are measured against (two of four ranks on the same data would
// otherwise make the median and MAD the pair's, and every other rank an outlier). `scale_floor`:
// the outlier signals' scale floor (rank_diagnostics.h; StepAnalyzer passes its job's
// OutlierScaleWindow::Floor(), the default is none).
StepDiagnostics DiagnoseStep(const JoinedStep& step, const StepStatistics& stats,
                             absl::Span<const DuplicateGroup> duplicates = {},
                             const SignalScales& scale_floor = {});

class StepAnalyzer {
 public:
  // Analyses `step`, the next closed step of its job, and updates its ranks' outlier streaks.
  AnalyzedStep Analyze(const JoinedStep& step);

  // The rank's current streak of consecutive flagged steps in `job` (0 when not flagged).
  uint32_t OutlierStreak(const std::string& job, uint32_t rank) const;

  // The rank's sequential statistics in `job` (zero when none).
  RankDrift Drift(const std::string& job, uint32_t rank) const;

  // Frees everything kept for `job` (the pipeline forgot it).
  void ForgetJob(const std::string& job);

  // Jobs with sequential state (for tests of the memory bound).
  size_t drift_jobs() const { return drift_.size(); }

 private:
  struct JobDrift {
    uint32_t attempt;
    uint32_t world_size;
    RankCusum cusum;
    OutlierScaleWindow outlier_scales;  // the outlier score's scale floor (outlier_scale.h)
  };

  // A rank's recent outlier scores, of the steps it reported.
  struct RankOutlierHistory {
    uint32_t streak = 0;  // consecutive steps whose score was flagged
    uint32_t kept = 0;    // valid entries of `previous`
    // The scores of its last kOutlierPersistence - 1 steps, the latest first.
    std::array<double, kOutlierPersistence - 1> previous{};
  };
  // Per job, per rank that reported in it (at most its largest world size).
  absl::flat_hash_map<std::string, absl::flat_hash_map<uint32_t, RankOutlierHistory>>
      outlier_history_;
  // Per job: the CUSUM statistics of its current epoch.
  absl::flat_hash_map<std::string, JobDrift> drift_;
};

// A rank's row from its report alone: what a late report (join_size 1) stores; StepRows adds
// the join's statistics and diagnostics.
RankRow ToRankRow(const RankReport& report, uint32_t join_size);

// The rows that record an analysed step: its step_stats row (completed at `completed_at`) and
// one rank_steps row per report, in report order. Does not touch the reports' acks.
StepWrite StepRows(const JoinedStep& step, AnalyzedStep analyzed, absl::Time completed_at);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_STEP_ANALYSIS_H_
