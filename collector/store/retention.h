// The storage lifecycle policy (DESIGN.md "Storage lifecycle"): what the store writer's retention
// pass prunes next. Pure: no SQLite, no clock, no threads; the store (sqlite_store.h, "Retention")
// executes the action it picks, one small transaction at a time.
//
// Ages are measured against the stored wall time of a step: step_stats.completed_at (set from the
// pipeline's clock when the step closed) and, for rank rows, rank_steps.received_at. A job's steps
// are taken in step order: the pass stops at the first step that is not old enough, so a step
// completed earlier than a lower step waits for it (steps of a job complete in order, except
// after a restart from a checkpoint).
//
// Rules, in this order (the first that applies is the next action):
//  1. Age, per-rank rows (retention_rank_steps > 0): the oldest steps of a job whose rank_steps
//     rows are older than now - retention_rank_steps are downsampled into rank_windows
//     (rank_windows.h), then their rows are deleted, except flagged rows (a rank that was an
//     outlier, diverged, was non-finite, drifting or slow at that step), which stay until rule 2.
//     The other rows of a flagged step go: keeping whole steps would keep every row of a job
//     with one chronic straggler (a 1,024-rank loadgen job with one slow rank kept 96% of its
//     rows that way). Missing ranks have no rows; step_stats names them.
//  2. Age, steps (retention_steps > 0): step_stats rows completed before now - retention_steps
//     are deleted with every rank_steps row (flagged or not) and rank_windows row of those steps.
//     A job with nothing left that was last seen before the cutoff is forgotten (jobs,
//     rank_identities).
//  3. Size (max_db_bytes > 0 and the live bytes, pages in use, exceed it): the oldest data goes
//     first, never a job's newest step: rule 1 on the job whose oldest not yet downsampled rank
//     row is the oldest of all jobs, whatever its age; when none is left, rule 2 on the job whose
//     oldest step is the oldest. When only each job's newest step is left, nothing is pruned
//     (the store keeps working above the cap and says so: rankscope_store_over_cap).
//  4. Vacuum: free pages are returned to the file system, vacuum_pages at a time
//     (PRAGMA incremental_vacuum), so the file shrinks.
// Each action touches at most max_rows_per_batch rank rows (the batch's steps are
// max(1, max_rows_per_batch / world_size)), so a pruning transaction is short and ingest commits
// run between two of them.
#ifndef RANKSCOPE_COLLECTOR_STORE_RETENTION_H_
#define RANKSCOPE_COLLECTOR_STORE_RETENTION_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rankscope::collector {

struct RetentionOptions {
  // Full per-rank rows are kept this long (0: forever). --retention_rank_steps.
  absl::Duration rank_steps = absl::Hours(7 * 24);
  // step_stats (and rank_windows, and flagged rank rows) are kept this long
  // (0: forever). --retention_steps.
  absl::Duration steps = absl::Hours(90 * 24);
  // Live database bytes above which the oldest data is pruned (0: no cap). --max_db_bytes.
  int64_t max_db_bytes = 0;
  // Steps per rank_windows row (--downsample_window_steps).
  uint32_t window_steps = 100;
  // At most this many rank rows per pruning transaction.
  int64_t max_rows_per_batch = 2048;
  // At most this many pages per incremental_vacuum.
  int64_t vacuum_pages = 2048;
  // How often an idle writer looks for something to prune (it goes on at once, between
  // commits, while the last pass pruned something).
  absl::Duration check_interval = absl::Seconds(10);
  // A rank row with outlier_score >= this is flagged (rank_diagnostics.h's threshold).
  double outlier_threshold = 6.0;

  bool enabled() const {
    return rank_steps > absl::ZeroDuration() || steps > absl::ZeroDuration() || max_db_bytes > 0;
  }
};

// Parses a retention age: a number with a unit d (days), h, m or s ("7d", "36h", "90d"), or "0"
// (keep forever). InvalidArgument names the text.
absl::StatusOr<absl::Duration> ParseRetentionAge(absl::string_view text);

// What the store says about one job, for the policy.
struct JobExtent {
  std::string job;
  uint32_t world_size = 0;
  uint64_t newest_step = 0;  // jobs.last_step: never pruned for size
  absl::Time last_seen = absl::UnixEpoch();
  // The oldest rank_steps row not yet downsampled (step >= downsampled.next_step).
  std::optional<uint64_t> oldest_rank_step;
  absl::Time oldest_rank_time = absl::InfiniteFuture();
  // The oldest step_stats row.
  std::optional<uint64_t> oldest_step;
  absl::Time oldest_step_time = absl::InfiniteFuture();
};

struct StoreUsage {
  int64_t page_size = 0;
  int64_t page_count = 0;
  int64_t freelist_count = 0;
  int64_t file_bytes() const { return page_size * page_count; }
  int64_t live_bytes() const { return page_size * (page_count - freelist_count); }
};

enum class PruneReason { kAge, kSize };

struct PruneAction {
  enum class Kind { kNone, kDownsample, kDropSteps, kVacuum };
  Kind kind = Kind::kNone;
  PruneReason reason = PruneReason::kAge;
  std::string job;
  // Rows of steps that completed (rank rows: were received) at or after this are not touched.
  absl::Time cutoff = absl::InfinitePast();
  // Steps above this are not touched.
  uint64_t max_step = 0;
  // Steps per transaction.
  int64_t max_steps = 1;
  // kVacuum: pages to return.
  int64_t vacuum_pages = 0;
  // Rule 3 applies but only each job's newest step is left.
  bool over_cap = false;
};

// The next action under `options` at `now` (see the rules above).
PruneAction NextPruneAction(const RetentionOptions& options, absl::Time now,
                            const StoreUsage& usage, const std::vector<JobExtent>& jobs);

// Steps per transaction for a job of `world_size` ranks: max(1, max_rows_per_batch / world_size).
int64_t StepsPerBatch(const RetentionOptions& options, uint32_t world_size);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_STORE_RETENTION_H_
