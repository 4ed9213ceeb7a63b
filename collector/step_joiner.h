// Joins the reports of the ranks of a job into steps (DESIGN.md "Delivery and failure semantics").
//
// A step is complete when all world_size ranks reported it, or timed out `step_timeout` after its
// first report arrived (the missing ranks are named). Memory per job is bounded: at most
// `max_open_steps_per_job` steps are open; adding one more closes the oldest open step early
// (reason kEvicted). The joiner remembers the last `completed_steps_remembered` closed steps of
// each job so that resends are recognised:
//  - a report for an open step from a rank already in it, same attempt: kDuplicate (its acks are
//    merged into the held report, so the live stream is acked when the step is stored);
//  - a report for a closed step that included the rank, same attempt: kDuplicate (ack it after
//    the next commit; nothing changes);
//  - a report for a closed step that did not include the rank, same attempt: kLate (store the
//    rank's row alone; the step's statistics stay as they were);
//  - a report with a higher attempt than the step's (the job restarted from a checkpoint): the
//    newest attempt wins. An open step of the older attempt is closed as kSuperseded and a new
//    one opened; a closed step is joined again from scratch;
//  - a report with a lower attempt than the step's: kStale (ack, drop).
//
// Time is injected: every call takes `now`; nothing here reads a clock.
//
// Thread safety: thread-compatible. The caller (the Collector) serializes all calls under its
// own mutex. No call blocks or performs I/O.
#ifndef RANKSCOPE_COLLECTOR_STEP_JOINER_H_
#define RANKSCOPE_COLLECTOR_STEP_JOINER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/rank_report.h"

namespace rankscope::collector {

struct JoinerOptions {
  absl::Duration step_timeout = absl::Seconds(30);
  size_t max_open_steps_per_job = 256;
  size_t completed_steps_remembered = 4096;
};

struct JoinedStep {
  enum class Reason { kComplete, kTimedOut, kEvicted, kSuperseded };
  std::string job;
  uint64_t step = 0;
  uint32_t attempt = 0;
  uint32_t world_size = 0;
  Reason reason = Reason::kComplete;
  absl::Time opened_at = absl::UnixEpoch();  // first report's arrival
  std::vector<RankReport> reports;           // sorted by rank, one per rank
  std::vector<uint32_t> missing_ranks;       // sorted
};

enum class AddOutcome { kAccepted, kDuplicate, kLate, kStale };

class StepJoiner {
 public:
  explicit StepJoiner(JoinerOptions options = {});

  // Declares a job's world size, or checks it against the one declared before. Returns
  // FailedPrecondition if it differs ("world_size 16 != 8 for job exp-42").
  absl::Status RegisterJob(absl::string_view job, uint32_t world_size);

  // Adds a report of a registered job (rank < world_size is the caller's check). Steps that
  // become complete, or are closed early by the open-step cap or a newer attempt, are appended
  // to *closed. `report` is moved from only when the outcome is kAccepted; for kDuplicate its
  // acks were taken into the held report or must be acked by the caller (see above).
  AddOutcome Add(absl::string_view job, RankReport& report, absl::Time now,
                 std::vector<JoinedStep>* closed);

  // Closes every open step whose deadline (opened_at + step_timeout) is <= now.
  void Expire(absl::Time now, std::vector<JoinedStep>* closed);

  // The earliest deadline among all open steps, or absl::InfiniteFuture().
  absl::Time NextDeadline() const;

  size_t open_steps(absl::string_view job) const;
  size_t open_steps_total() const;

 private:
  struct OpenStep {
    uint32_t attempt = 0;
    absl::Time opened_at;
    std::vector<RankReport> reports;  // unsorted while open
  };
  struct ClosedStep {
    uint32_t attempt = 0;
    std::vector<uint32_t> ranks;  // sorted
  };
  struct Job {
    uint32_t world_size = 0;
    absl::flat_hash_map<uint64_t, OpenStep> open;       // by step
    absl::flat_hash_map<uint64_t, ClosedStep> closed;   // by step, bounded
    std::vector<uint64_t> closed_order;                 // FIFO of closed steps for eviction
    size_t closed_order_head = 0;
  };

  JoinedStep Close(const std::string& job_name, Job& job, uint64_t step,
                   JoinedStep::Reason reason);

  JoinerOptions options_;
  absl::flat_hash_map<std::string, Job> jobs_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_STEP_JOINER_H_
