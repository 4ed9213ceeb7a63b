// StepChangeLog: which steps of each job had rows committed to the store after a cursor, so that
// a reader holding a window of steps re-reads exactly the ones that changed (the web view's
// `?changes=`, docs/DESIGN.md "Web view"): a late report for a step closed long ago, a step that
// closed after newer ones (a timeout), a step joined again under a newer attempt.
//
// Each Record (called by the store writer's thread after a successful commit) takes the next
// sequence number and remembers (seq, step) for every step of the batch. A cursor is
// (instance, seq): `instance` tells this log from a restarted collector's, so a cursor the log
// never issued is answered "incomplete" rather than wrongly. A reader takes Now() before it reads
// the store; every commit after that has a higher sequence, so no change is missed (one committed
// between Now() and the read is read twice, which is harmless).
//
// Memory is bounded: at most max_entries_per_job (seq, step) pairs per job, at most max_jobs jobs
// (the job recorded least recently is forgotten first). A query whose cursor is older than what
// the log still holds for that job answers complete = false: the caller re-reads its whole window.
//
// Cost: Record O(steps in the batch) (plus O(jobs) when a job is forgotten); StepsChangedSince
// O(log n + changes after the cursor).
//
// Thread safety: thread-safe (one internal mutex, held only for the bookkeeping above).
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_STEP_CHANGE_LOG_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_STEP_CHANGE_LOG_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "collector/model/rows.h"
#include "common/mutex.h"

namespace rankscope::collector {

struct ChangeCursor {
  uint64_t instance = 0;
  uint64_t seq = 0;
  bool operator==(const ChangeCursor& o) const { return instance == o.instance && seq == o.seq; }
};

// "INSTANCE.SEQ" in lower-case hex and decimal ("9f3a0c1d2e4b5a67.1234").
std::string FormatChangeCursor(const ChangeCursor& cursor);
// The inverse of FormatChangeCursor; nullopt for anything else (at most 16 hex digits, a dot,
// at most 20 decimal digits, no sign, no spaces).
std::optional<ChangeCursor> ParseChangeCursor(absl::string_view text);

class StepChangeLog {
 public:
  // `instance`: this log's identity, different for every collector process (the pipeline passes
  // a random number).
  explicit StepChangeLog(uint64_t instance, size_t max_entries_per_job = 4096,
                         size_t max_jobs = 4096);

  // The steps of `batch` were committed: one new sequence number for all of them.
  void Record(const StoreBatch& batch);
  // Records `steps` of `job` under one new sequence number (Record's unit, for tests).
  void RecordSteps(absl::string_view job, const std::vector<uint64_t>& steps);

  // The cursor now: every later Record has a higher sequence.
  ChangeCursor Now() const;

  struct Changes {
    // False when the log cannot say: the cursor is another instance's or newer than any it
    // issued, or entries after it were forgotten (memory bound).
    bool complete = false;
    std::vector<uint64_t> steps;  // ascending, each once; empty when !complete
  };
  // The steps of `job` in [first, last] recorded after `cursor`.
  Changes StepsChangedSince(absl::string_view job, const ChangeCursor& cursor, uint64_t first,
                            uint64_t last) const;

 private:
  struct JobLog {
    std::deque<std::pair<uint64_t, uint64_t>> entries;  // (seq, step), seq ascending
    uint64_t forgotten_through = 0;  // entries with seq <= this may have been dropped
    uint64_t last_seq = 0;
  };
  void AddLocked(absl::string_view job, uint64_t seq, const std::vector<uint64_t>& steps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t instance_;
  const size_t max_entries_per_job_;
  const size_t max_jobs_;
  mutable Mutex mu_;
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  // The highest sequence of any job forgotten whole (a job without a log was not changed after
  // a cursor at or past it).
  uint64_t jobs_forgotten_through_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, JobLog> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_STEP_CHANGE_LOG_H_
