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
// A late report is remembered as part of its closed step, so a resend of it is kDuplicate.
// A report for a step closed so long ago that it was forgotten opens that step again.
//
// Cost: Add is O(1) expected plus O(log open steps) when it opens or closes a step, plus
// O(W log W) when it closes one (sorting the reports); merging a duplicate into an open step scans
// that step's reports (O(W), rare). Expire is O(log n) per step it closes; NextDeadline is O(1).
// Memory per job: at most max_open_steps_per_job open steps, each with its reports and the set of
// their ranks (a world_size-bit bitset up to kMaxDenseWorldSize ranks, else a hash set of the
// ranks present: a large claimed world size costs nothing by itself), and at most
// completed_steps_remembered closed steps, each taking min(4 * ranks present, 4 * ranks missing,
// world_size / 8) bytes for its set of ranks (so a complete step costs a few dozen bytes).
//
// Time is injected: every call takes `now`; nothing here reads a clock.
//
// Thread safety: thread-compatible. The caller (the Collector) serializes all calls under its
// own mutex. No call blocks or performs I/O.
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_STEP_JOINER_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_STEP_JOINER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/model/rank_report.h"

namespace rankscope::collector {

struct JoinerOptions {
  absl::Duration step_timeout = absl::Seconds(30);
  size_t max_open_steps_per_job = 256;  // 0 is treated as 1
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
  // The job's bucket names (Hello.bucket_names) when its agents send per-bucket norms; set by
  // the pipeline before the analysis (the joiner leaves it empty).
  std::shared_ptr<const std::vector<std::string>> bucket_names;
};

enum class AddOutcome {
  kAccepted,
  kDuplicate,
  kLate,
  kStale,
  // The caller broke Add's precondition: the job was never registered (kUnknownJob), or
  // rank >= the job's world_size (kRankOutOfRange). Nothing changed and `report` was not moved
  // from. A programming error in the caller, which validates both before calling Add: answer it
  // as an internal error (kInternal), and neither store nor ack the report.
  kUnknownJob,
  kRankOutOfRange,
};

class StepJoiner {
 public:
  explicit StepJoiner(JoinerOptions options = {});

  // Declares a job's world size, or checks it against the one declared before. Returns
  // FailedPrecondition if it differs ("world_size 16 != 8 for job exp-42"), InvalidArgument if
  // world_size is 0. A job stays registered until ForgetJob.
  absl::Status RegisterJob(absl::string_view job, uint32_t world_size);

  // Forgets a job, so that its name may be registered again with another world size (a new run
  // reusing the name): closes its open steps early (reason kEvicted, appended to *closed, in
  // opened_at order) and drops what it remembered of its closed steps. No-op for an unknown job.
  void ForgetJob(absl::string_view job, std::vector<JoinedStep>* closed);

  // Adds a report of a registered job (rank < world_size is the caller's check; kUnknownJob and
  // kRankOutOfRange say what happens if either is broken). Steps that become complete, or are
  // closed early by the open-step cap or a newer attempt, are appended to *closed. `report` is
  // moved from only when the outcome is kAccepted; for kDuplicate its acks were taken into the held
  // report or must be acked by the caller (see above).
  AddOutcome Add(absl::string_view job, RankReport& report, absl::Time now,
                 std::vector<JoinedStep>* closed);

  // Forgets that `step` of `job` was closed with `attempt` (no-op if it was not, or was closed
  // again by a newer attempt): its store write was dropped, so resends of it must be joined and
  // stored again (kAccepted), not acked as duplicates of something never stored. O(1).
  void ForgetClosedStep(absl::string_view job, uint64_t step, uint32_t attempt);

  // Closes every open step whose deadline (opened_at + step_timeout) is <= now, in deadline
  // order (ties: by job name, then step).
  void Expire(absl::Time now, std::vector<JoinedStep>* closed);

  // The earliest deadline among all open steps, or absl::InfiniteFuture(). O(1).
  absl::Time NextDeadline() const;

  // Open steps of `job` (0 for an unknown job), and of all jobs together.
  size_t open_steps(absl::string_view job) const;
  size_t open_steps_total() const;
  // Closed steps of `job` remembered for recognising resends (<= completed_steps_remembered).
  size_t remembered_steps(absl::string_view job) const;

 private:
  // Jobs up to this world size keep an open step's ranks in a bitset (at most 8 KiB); larger
  // ones in a hash set of the ranks present, so that a claimed world size costs nothing until
  // its ranks report.
  static constexpr uint32_t kMaxDenseWorldSize = 65'536;
  struct OpenStep {
    uint32_t attempt = 0;
    absl::Time opened_at;
    std::vector<RankReport> reports;  // arrival order while open
    std::vector<uint64_t> present;    // bitset over ranks [0, world_size), dense jobs only
    absl::flat_hash_set<uint32_t> present_sparse;  // jobs over kMaxDenseWorldSize only
    bool Contains(uint32_t rank) const;
    void Insert(uint32_t rank);
  };
  // The set of ranks a closed step included, in whichever form is smallest: the sorted ranks
  // present, the sorted ranks missing, or a bitset over world_size ranks.
  struct RankSet {
    enum class Form : uint8_t { kPresent, kMissing, kBitset };
    Form form = Form::kMissing;
    std::vector<uint32_t> ranks;  // sorted; kPresent or kMissing
    std::vector<uint64_t> bits;   // kBitset
    bool Contains(uint32_t rank) const;
    void Insert(uint32_t rank);
  };
  struct ClosedStep {
    uint32_t attempt = 0;
    uint64_t close_seq = 0;  // identifies the closed_order entry that owns this record
    RankSet ranks;
  };
  struct Job {
    uint32_t world_size = 0;
    absl::flat_hash_map<uint64_t, OpenStep> open;  // by step
    // (opened_at, step) of every open step: the open-step cap evicts begin().
    std::set<std::pair<absl::Time, uint64_t>> open_by_age;
    absl::flat_hash_map<uint64_t, ClosedStep> closed;  // by step, bounded
    // (step, close_seq) in closing order, oldest first. A step closed again (a newer attempt)
    // leaves its older entry behind; such stale entries are skipped and periodically dropped.
    std::deque<std::pair<uint64_t, uint64_t>> closed_order;
    uint64_t next_close_seq = 0;
  };
  // (opened_at, job, step) of every open step of every job. Every step has the same timeout, so
  // begin() is the earliest deadline: NextDeadline is O(1) and Expire pops from the front, where a
  // scan of the open steps would cost O(jobs x 256) on every Add.
  using DeadlineKey = std::tuple<absl::Time, std::string, uint64_t>;

  void Open(const std::string& job_name, Job& job, RankReport& report, absl::Time now,
            std::vector<JoinedStep>* closed);
  JoinedStep Close(const std::string& job_name, Job& job, uint64_t step, JoinedStep::Reason reason);
  void Remember(Job& job, uint64_t step, uint32_t attempt, RankSet ranks);

  JoinerOptions options_;
  absl::flat_hash_map<std::string, Job> jobs_;
  std::set<DeadlineKey> deadlines_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_STEP_JOINER_H_
