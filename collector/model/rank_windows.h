// Downsampled per-rank data (DESIGN.md "Storage lifecycle"): the `rank_windows` table.
//
// When the retention pass prunes a job's full per-rank rows (rank_steps), it first folds them
// into one row per (job, window of steps, rank): the window of step s is
// [WindowFirstStep(s, w), WindowFirstStep(s, w) + w - 1] for the window length w
// (RetentionOptions::window_steps, default 100). Per metric (loss, gradient norm, consensus cosine,
// outlier score) the row keeps the count of non-NULL values, their sum, min and max, so that rows
// of one window pruned in several batches merge exactly (the mean is sum / count); plus counts of
// the rows that were flagged (non-finite, outlier score at or above the threshold, replica
// mismatch) and the wall time of the first and last row.
//
// The window length is stored in each row (first_step, last_step): changing it later starts new
// windows, old rows keep theirs. Pure types and arithmetic; the SQL lives in sqlite_store.
#ifndef RANKSCOPE_COLLECTOR_MODEL_RANK_WINDOWS_H_
#define RANKSCOPE_COLLECTOR_MODEL_RANK_WINDOWS_H_

#include <cstdint>
#include <limits>
#include <optional>

#include "absl/time/time.h"

namespace rankscope::collector {

// min / mean / max of one metric over a window's rows; `count` counts the non-NULL values (a NaN
// is stored NULL and not counted). All unset when count == 0.
struct WindowStat {
  int64_t count = 0;
  double sum = 0.0;
  std::optional<double> min;
  std::optional<double> max;
  // sum / count; NaN when count == 0.
  double mean() const {
    return count > 0 ? sum / static_cast<double>(count) : std::numeric_limits<double>::quiet_NaN();
  }
};

struct RankWindowRow {
  uint64_t first_step = 0;
  uint64_t last_step = 0;
  uint32_t rank = 0;
  int64_t rows = 0;  // rank_steps rows folded in
  absl::Time first_received = absl::UnixEpoch();
  absl::Time last_received = absl::UnixEpoch();
  WindowStat loss;
  WindowStat grad_norm;
  WindowStat grad_cosine;  // consensus cosine
  WindowStat outlier_score;
  int64_t nonfinite = 0;    // rows whose loss, gradient norm or sketch was NaN/Inf
  int64_t outliers = 0;     // rows with outlier_score >= the threshold at pruning time
  int64_t replica_bad = 0;  // rows whose replica fingerprints differed from the majority
};

// The first step of the window holding `step`; window_steps 0 is taken as 1.
inline uint64_t WindowFirstStep(uint64_t step, uint32_t window_steps) {
  const uint64_t w = window_steps == 0 ? 1 : window_steps;
  return step - step % w;
}

// The last step of the window holding `step` (saturating at UINT64_MAX).
inline uint64_t WindowLastStep(uint64_t step, uint32_t window_steps) {
  const uint64_t w = window_steps == 0 ? 1 : window_steps;
  const uint64_t first = WindowFirstStep(step, window_steps);
  return first > std::numeric_limits<uint64_t>::max() - (w - 1)
             ? std::numeric_limits<uint64_t>::max()
             : first + (w - 1);
}

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_RANK_WINDOWS_H_
