// StoreWriter: the thread that owns the SQLite store's write connection.
//
// Items (rows plus the acks they release) are queued by any thread; the writer takes everything
// queued (up to max_batch_items), writes it in one transaction, and only after the commit
// succeeded sends the acks. So an ack always means "stored".
//
// Failures. A failed commit that may succeed later (disk full, file unwritable, I/O error, lock
// held: ResourceExhausted, PermissionDenied, Unavailable) is reported through on_error, nothing
// is acked, and the same items are retried every retry_backoff while new items keep queueing; the
// streams stay open, so once a retry commits, the acks flow as if nothing happened. Any other
// failure (the batch itself cannot be stored) drops the batch unacked so that it cannot block the
// queue; past max_pending_items the oldest items are dropped unacked. A dropped item is never
// silently forgotten: on_drop receives its rows (the pipeline lets the joiner forget those steps,
// so that resends are joined and stored again instead of being taken for duplicates) and every
// AckSink among its acks is Abandon()ed with UNAVAILABLE, which ends that agent's stream: the
// agent reconnects and resends all it has not had acked, dropped items included.
//
// Acks of the same item order are sent in commit order. An item with an empty batch carries acks
// only (a duplicate of something already stored): it is acked after the next commit, which is
// after the commit of what it duplicates.
//
// Retention (StoreWriterOptions::retention, DESIGN.md "Storage lifecycle"): the same thread
// prunes the store in small transactions (retention.h picks each action, SqliteStore::Prune runs
// it): one after each commit while the previous one pruned something, else one check every
// RetentionOptions::check_interval (by the writer's clock). A pruning transaction touches at most
// RetentionOptions::max_rows_per_batch rank rows, so commits of new rows wait at most one such
// transaction. Pruning failures are reported through on_prune_error and retried at the next
// check; they never hold acks back.
//
// Thread safety: Enqueue, Flush, WaitRetentionIdle and Stop are thread-safe. Hooks are called on
// the writer thread.
#ifndef RANKSCOPE_COLLECTOR_STORE_STORE_WRITER_H_
#define RANKSCOPE_COLLECTOR_STORE_STORE_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/model/ack.h"
#include "collector/store/retention.h"
#include "collector/store/sqlite_store.h"
#include "common/mutex.h"

namespace rankscope::collector {

struct WriteItem {
  StoreBatch batch;
  std::vector<AckHandle> acks;
};

struct StoreWriterHooks {
  std::function<void(absl::Duration commit_time, size_t items)> on_commit;
  // The rows of a commit that succeeded, before its acks are sent (the pipeline's StepChangeLog).
  std::function<void(const StoreBatch& stored)> on_stored;
  std::function<void(const absl::Status& error)> on_error;
  std::function<void(size_t pending)> on_queue_depth;
  // `items` items holding `rows` were dropped unacked for `why`. Called on the writer thread, or
  // for a queue overflow on the thread calling Enqueue (never under the writer's lock).
  std::function<void(const StoreBatch& rows, size_t items, const absl::Status& why)> on_drop;
  // Retention: one pruning transaction done (`took` by the writer's clock).
  std::function<void(const PruneAction& action, const SqliteStore::PruneResult& result,
                     absl::Duration took)>
      on_prune;
  // Retention: the store's size at each check; over_cap when max_db_bytes is exceeded and only
  // each job's newest step is left to prune.
  std::function<void(const StoreUsage& usage, bool over_cap)> on_usage;
  std::function<void(const absl::Status& error)> on_prune_error;
};

struct StoreWriterOptions {
  size_t max_batch_items = 1024;
  size_t max_pending_items = 200'000;
  absl::Duration retry_backoff = absl::Seconds(1);
  // The writer's only source of time: the group-commit interval, the commit time reported to
  // on_commit, and Stop's deadline. Waits between those instants are real (absl::Mutex waits), so
  // a test clock decides when the writer thinks an instant has come, not how long it sleeps.
  // Called on the writer thread and the thread calling Stop; must be thread-safe.
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  // The storage lifecycle; nullopt: the writer never prunes (the store grows forever).
  std::optional<RetentionOptions> retention;
  // The time retention ages are measured against: the clock that stamped the rows (the
  // pipeline's). Null: `clock`. check_interval is measured with `clock`.
  std::function<absl::Time()> retention_clock;
};

class StoreWriter {
 public:
  StoreWriter(std::unique_ptr<SqliteStore> store, StoreWriterOptions options,
              StoreWriterHooks hooks);
  ~StoreWriter();  // Stop(absl::Seconds(5)) if not stopped.

  void Enqueue(WriteItem item);

  // Waits until every item enqueued before the call was committed (true), or the timeout passed.
  bool Flush(absl::Duration timeout);

  // Commits what is queued (trying for at most `timeout`), then stops the thread. Idempotent.
  // Returns the last commit error if items were left uncommitted.
  absl::Status Stop(absl::Duration timeout);

  // The most recent commit error, OK once a later commit succeeded.
  absl::Status health() const;

  // Waits until a retention check that started after this call found nothing to prune (true),
  // or the timeout passed (tests and the soak benchmark). False at once without retention.
  bool WaitRetentionIdle(absl::Duration timeout);

 private:
  // The writer thread's loop, in the pieces below (all writer thread only): prune while idle and
  // retention is due, take a batch, commit it.
  void Run();
  // One retention check and at most one pruning transaction; returns whether it pruned.
  bool RetentionPass();
  // A retention pass is due: the last one pruned (a backlog), or check_interval has passed.
  bool RetentionDue() const;
  // RetentionPass, and when the next is due.
  void Prune();
  // Nothing pending and not stopping.
  bool Idle() const ABSL_LOCKS_EXCLUDED(mu_);
  enum class Take { kBatch, kAgain, kStopped };
  // Waits for pending items (or a retention check: kAgain), then up to kCommitInterval after the
  // last commit for a full batch, and moves at most max_batch_items into `items` (kBatch).
  // kStopped: nothing left, or stopping past the deadline.
  Take TakeBatch(std::vector<WriteItem>& items) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes `items` in one transaction and settles them: acked when stored; dropped unacked
  // (their agents resend) on a permanent error; put back in front to retry after retry_backoff
  // on a transient one. Returns false when the writer stopped while waiting to retry.
  bool CommitBatch(std::vector<WriteItem>& items) ABSL_LOCKS_EXCLUDED(mu_);

  const StoreWriterOptions options_;
  const StoreWriterHooks hooks_;
  std::unique_ptr<SqliteStore> store_;  // writer thread only
  // Writer thread only: the last group commit, and the retention schedule (RetentionDue).
  absl::Time last_commit_ = absl::InfinitePast();
  bool retention_backlog_ = false;
  absl::Time next_retention_check_ = absl::InfinitePast();

  mutable Mutex mu_;
  std::deque<WriteItem> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;  // items ever enqueued
  uint64_t finished_ ABSL_GUARDED_BY(mu_) = 0;  // items committed or dropped
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time stop_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  // Retention checks started, and the last one of them that found nothing to prune.
  uint64_t retention_checks_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t retention_idle_check_ ABSL_GUARDED_BY(mu_) = 0;
  bool retention_wanted_ ABSL_GUARDED_BY(mu_) = false;  // WaitRetentionIdle asks for a check
  std::thread thread_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_STORE_STORE_WRITER_H_
