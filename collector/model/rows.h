// The rows the collector stores and reads back: one struct per table row (jobs, rank_identities,
// rank_steps, step_stats) and the batch written in one transaction. Plain values, shared by the
// pure core (the step analysis builds them, the job registry restores from them, the web API and
// the Query conversions read them) and the SQLite store (collector/store/sqlite_store.h), which
// documents the schema, how each field is stored and the upsert rules.
#ifndef RANKSCOPE_COLLECTOR_MODEL_ROWS_H_
#define RANKSCOPE_COLLECTOR_MODEL_ROWS_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "collector/model/step_summary.h"

namespace rankscope::collector {

struct JobRow {
  std::string job;
  uint32_t world_size = 0;
  uint32_t sketch_dim = 0;
  uint64_t sketch_seed = 0;
  absl::Time first_seen = absl::UnixEpoch();  // on upsert, the earliest is kept
  absl::Time last_seen = absl::UnixEpoch();   // on upsert, the latest is kept
  uint64_t last_step = 0;                     // on upsert, the largest is kept
  uint32_t attempt = 0;  // the job's current epoch (JobRegistry); on upsert, the largest is kept
};

struct RankRow {
  uint32_t rank = 0;
  uint32_t attempt = 0;
  uint32_t join_size = 0;  // ranks in the join this row was computed in (1 for a late report)
  double loss = 0.0;
  double grad_norm = 0.0;
  std::optional<double> grad_cosine;  // consensus cosine; nullopt for a late report
  std::optional<double> loss_z;
  std::optional<double> grad_norm_z;
  std::optional<uint64_t> reduced_grad_fingerprint;
  std::optional<uint64_t> param_fingerprint;
  std::optional<double> step_time_seconds;
  absl::Time received_at = absl::UnixEpoch();
  std::optional<bool> replica_ok;       // nullopt: no fingerprint of this rank was checked
  std::optional<double> outlier_score;  // see rank_diagnostics.h
  std::optional<double> step_time_z;    // robust z of the rank's step time
  // A value of the rank's sketch was NaN or +/-Inf (the sketch itself is not stored). The stored
  // `nonfinite` column is 1 when this is set or loss or grad_norm is not finite.
  bool sketch_nonfinite = false;
  // The rank had no loss (a pipeline stage): `loss` is stored NULL and is not counted as
  // non-finite. Not stored itself (a NULL loss with nonfinite 0 says it).
  bool loss_absent = false;
  // Where in the model (collector/analysis/bucket_scores.h): the buckets that carry a flagged
  // rank's deviation, "layers.20-23.mlp z=45.1; ..." (rank_steps.deviating_buckets; empty when
  // the rank was not flagged or no bucket deviates). Schema version 9 (sqlite_schema.cc).
  std::string deviating_buckets;
  // The rank's per-bucket norms and their robust z, kept (rank_bucket_norms) only for a flagged
  // rank and on sampled steps (kBucketSampleEvery); empty otherwise.
  std::vector<float> bucket_norms;
  std::vector<float> bucket_z;
};

// A step_stats row: the step's statistics (StepSummary: ranks and the dispersion of their
// losses, gradient norms and sketches) and what the analysis found.
struct StepRow : StepSummary {
  uint64_t step = 0;
  uint32_t attempt = 0;
  uint32_t world_size = 0;
  std::string missing_ranks;  // compact (rank_ranges.h): "0-5,9", "+N" beyond 64 runs
  bool timed_out = false;
  absl::Time completed_at = absl::UnixEpoch();
  double grad_noise_scale = std::numeric_limits<double>::quiet_NaN();  // NaN: not computable
  bool replica_checked = false;                   // some rank sent a fingerprint
  std::vector<uint32_t> replica_divergent_ranks;  // ranks whose fingerprint differs
  std::vector<uint32_t> outlier_ranks;            // ranks above the outlier threshold on their last
                                                  // kOutlierPersistence steps (rank_diagnostics.h)
  std::string duplicate_groups;  // ranks with identical gradients, "0,2;1,3" (duplicate_ranks.h)
  // Ranks whose sequential statistic is above its threshold (rank_cusum.h): data drift (loss,
  // gradient norm, consensus cosine) and slow (step time). Schema version 4.
  std::vector<uint32_t> drifting_ranks;
  std::vector<uint32_t> slow_ranks;
  // Aggregation integrity (collector/analysis/aggregation_integrity.h), present when a rank sent
  // the reduced gradient's sketch: ||s - m|| / tolerance (> 1: flagged), ||s - m|| / ||s||, the
  // fault ("" clean, "sum", "missing", "doubled", "scaled", "corrupted"), the rank named and its
  // W * weight. Schema version 6.
  std::optional<double> integrity_error_ratio;
  std::optional<double> integrity_relative_error;
  std::string integrity_fault;
  std::optional<uint32_t> integrity_rank;
  std::optional<double> integrity_weight;
};

// A rank row with its step (range queries).
struct StepRankRow {
  uint64_t step = 0;
  RankRow row;
  // The stored `nonfinite` column (RankRowsInRange, RankSeriesInRange): the rank's loss, gradient
  // norm or sketch was NaN/Inf when it reported. The verdict, not a re-judgement of the values
  // read back (a pipeline stage's absent loss reads back as NaN and is not non-finite).
  bool nonfinite = false;
};

// The rows of one step of one job. `stats` is absent for a late report (rank rows only).
struct StepWrite {
  std::string job;
  uint64_t step = 0;
  std::optional<StepRow> stats;
  std::vector<RankRow> ranks;
};

// Who reports (or last reported) a rank of a job's group: its newest accepted hello.
struct RankIdentityRow {
  std::string job;  // the group key
  uint32_t rank = 0;
  std::optional<uint32_t> global_rank;
  std::string host;
  std::string instance_id;
  uint32_t pid = 0;
  uint32_t attempt = 0;                 // the epoch its reports join under
  absl::Time seen = absl::UnixEpoch();  // first_seen on insert, last_seen always
};

// Everything written in one transaction.
struct StoreBatch {
  std::vector<JobRow> jobs;
  std::vector<RankIdentityRow> rank_identities;
  std::vector<StepWrite> steps;
  bool empty() const { return jobs.empty() && rank_identities.empty() && steps.empty(); }
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_ROWS_H_
