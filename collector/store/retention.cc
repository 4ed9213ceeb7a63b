#include "collector/store/retention.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rankscope::collector {

absl::StatusOr<absl::Duration> ParseRetentionAge(absl::string_view text) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "retention age '", text, "' is not a number with a unit d, h, m or s (e.g. 7d), or 0"));
  };
  if (text == "0") return absl::ZeroDuration();
  if (text.size() < 2) return bad();
  double value = 0;
  if (!absl::SimpleAtod(text.substr(0, text.size() - 1), &value) || !(value >= 0)) return bad();
  absl::Duration unit;
  switch (text.back()) {
    case 'd':
      unit = absl::Hours(24);
      break;
    case 'h':
      unit = absl::Hours(1);
      break;
    case 'm':
      unit = absl::Minutes(1);
      break;
    case 's':
      unit = absl::Seconds(1);
      break;
    default:
      return bad();
  }
  return value * unit;
}

int64_t StepsPerBatch(const RetentionOptions& options, uint32_t world_size) {
  return std::max<int64_t>(1, options.max_rows_per_batch / std::max<int64_t>(world_size, 1));
}

namespace {

// The action of `kind` on job `j` (one batch of its rows).
PruneAction JobAction(PruneAction::Kind kind, PruneReason reason, const JobExtent& j,
                      absl::Time cutoff, uint64_t max_step, const RetentionOptions& options) {
  PruneAction action;
  action.kind = kind;
  action.reason = reason;
  action.job = j.job;
  action.cutoff = cutoff;
  action.max_step = max_step;
  action.max_steps = StepsPerBatch(options, j.world_size);
  return action;
}

// The job whose oldest (rank) step, older than its newest step, is the oldest in time; null if
// none has one.
const JobExtent* OldestBefore(const std::vector<JobExtent>& jobs,
                              std::optional<uint64_t> JobExtent::*step,
                              absl::Time JobExtent::*time) {
  const JobExtent* oldest = nullptr;
  for (const JobExtent& j : jobs) {
    if ((j.*step) && *(j.*step) < j.newest_step && (oldest == nullptr || j.*time < oldest->*time)) {
      oldest = &j;
    }
  }
  return oldest;
}

}  // namespace

PruneAction NextPruneAction(const RetentionOptions& options, absl::Time now,
                            const StoreUsage& usage, const std::vector<JobExtent>& jobs) {
  constexpr uint64_t kAnyStep = std::numeric_limits<uint64_t>::max();
  PruneAction action;
  // Rule 1: per-rank rows past their age.
  if (options.rank_steps > absl::ZeroDuration()) {
    const absl::Time cutoff = now - options.rank_steps;
    for (const JobExtent& j : jobs) {
      if (j.oldest_rank_step && j.oldest_rank_time < cutoff) {
        return JobAction(PruneAction::Kind::kDownsample, PruneReason::kAge, j, cutoff, kAnyStep,
                         options);
      }
    }
  }
  // Rule 2: steps past their age.
  if (options.steps > absl::ZeroDuration()) {
    const absl::Time cutoff = now - options.steps;
    for (const JobExtent& j : jobs) {
      const bool old_steps = j.oldest_step && j.oldest_step_time < cutoff;
      const bool forgotten = !j.oldest_step && j.last_seen < cutoff;
      if (old_steps || forgotten) {
        return JobAction(PruneAction::Kind::kDropSteps, PruneReason::kAge, j, cutoff, kAnyStep,
                         options);
      }
    }
  }
  // Rule 3: the size cap, oldest first, never a job's newest step.
  if (options.max_db_bytes > 0 && usage.live_bytes() > options.max_db_bytes) {
    if (const JobExtent* oldest =
            OldestBefore(jobs, &JobExtent::oldest_rank_step, &JobExtent::oldest_rank_time)) {
      return JobAction(PruneAction::Kind::kDownsample, PruneReason::kSize, *oldest,
                       absl::InfiniteFuture(), oldest->newest_step - 1, options);
    }
    if (const JobExtent* oldest =
            OldestBefore(jobs, &JobExtent::oldest_step, &JobExtent::oldest_step_time)) {
      return JobAction(PruneAction::Kind::kDropSteps, PruneReason::kSize, *oldest,
                       absl::InfiniteFuture(), oldest->newest_step - 1, options);
    }
    action.over_cap = true;
  }
  // Rule 4: give free pages back.
  if (usage.freelist_count > 0) {
    action.kind = PruneAction::Kind::kVacuum;
    action.vacuum_pages =
        std::min(usage.freelist_count, std::max<int64_t>(options.vacuum_pages, 1));
  }
  return action;
}

}  // namespace rankscope::collector
