// The SQLite sink (DESIGN.md "SQLite"): one file, WAL, prepared statements only.
//
// Schema (created on Open, idempotently; extra columns beyond DESIGN.md are rankscope's own):
//   jobs(job TEXT PRIMARY KEY, world_size, sketch_dim, sketch_seed, first_seen, last_seen,
//        last_step, attempt)
//   rank_identities(job, rank, global_rank, host, instance_id, pid, attempt, first_seen,
//        last_seen, PRIMARY KEY(job, rank)): who holds each rank (its newest accepted hello)
// `job` is the group key (common/job_name.h GroupKey): the job's name, or "JOB/GROUP" for a
// data-parallel group of a job with several. `attempt` is the epoch (JobRegistry "Epochs"): in
// jobs the job's current one, in rank_steps and step_stats the one the row was joined under
// (a row is replaced only by one of a higher epoch, or of the same epoch and a larger join).
//   rank_steps(job, step, rank, attempt, join_size, loss, grad_norm, grad_cosine, loss_z,
//        grad_norm_z, nonfinite, reduced_grad_fingerprint, param_fingerprint, step_time_seconds,
//        received_at, replica_ok, outlier_score, step_time_z, PRIMARY KEY(job, step, rank))
//   step_stats(job, step, attempt, ranks, world_size, loss_mean, loss_std, loss_range,
//        grad_norm_mean, grad_norm_std, grad_norm_cv, grad_cosine_mean, missing_ranks,
//        timed_out, completed_at, grad_noise_scale, replica_checked, replica_divergent_ranks,
//        outlier_ranks, duplicate_groups, drifting_ranks, slow_ranks, PRIMARY KEY(job, step))
//   rank_windows(job, first_step, rank, last_step, rows, first_received, last_received, and per
//        metric (loss, grad_norm, grad_cosine, outlier_score) _n, _sum, _min, _max; nonfinite,
//        outliers, replica_bad; PRIMARY KEY(job, first_step, rank)): downsampled rank rows
//        (rank_windows.h), written by the retention pass (retention.h) before it deletes them
//   downsampled(job PRIMARY KEY, next_step): rank_steps rows of lower steps were downsampled
// Times are Unix seconds as REAL, with microsecond precision (InfiniteFuture/InfinitePast are
// stored as +/-Inf). NaN is stored as NULL (SQLite's own rule) and flagged by `nonfinite` (1 when
// the rank's loss or grad_norm was NaN/Inf); +/-Inf is stored as REAL +/-Inf. On reads a NULL
// required double comes back as NaN and a NULL optional one as nullopt (so an optional that held
// NaN reads back as nullopt). uint64 values (sketch_seed, the fingerprints) are stored as the
// INTEGER with the same 64-bit pattern (static_cast<int64_t>): a value with the high bit set reads
// as negative in the sqlite3 shell; cast back to uint64 to compare. Steps are INTEGER and must be
// <= INT64_MAX (Write rejects larger ones). missing_ranks is the compact text of rank_ranges.h
// ("0-5,9", at most 64 runs then "+N" for the rest; "3,7" as older versions wrote it), empty when
// none; world_size - ranks is the full count. rank_steps and step_stats are WITHOUT ROWID tables
// clustered on their primary keys, which also serve RecentSteps and RankRows; no other index is
// needed. The schema version is PRAGMA user_version (kSchemaVersion); Open refuses a file written
// by a newer schema and migrates an older one (sqlite_schema.cc; to 5: one VACUUM to switch the
// file to auto_vacuum=INCREMENTAL, so that pruning shrinks it).
//
// Durability: WAL with synchronous=NORMAL by default. A commit survives a crash or SIGKILL of the
// process (it is in the WAL, which the OS holds), so "ack after commit" holds against collector
// crashes. A power loss or OS crash may lose the last transactions committed since the last WAL
// sync (the file stays consistent, never half a batch); set StoreOptions::synchronous_full for
// an fsync on every commit if acks must survive power loss too.
//
// Idempotency ("newest report wins", duplicates change nothing): a row replaces the stored row
// with the same key only if its attempt is higher, or the attempt is equal and its join_size
// (rank_steps) / ranks (step_stats) is at least the stored one. So a resend after a crash, which
// may be joined with fewer ranks than the original, never degrades what was stored.
//
// Thread safety: a SqliteStore owns one connection and is thread-compatible: use one per thread
// (the StoreWriter thread owns one; queries open their own, e.g. with StoreOptions::read_only).
// WAL lets readers run beside the writer; several processes may open the same file.
#ifndef RANKSCOPE_COLLECTOR_STORE_SQLITE_STORE_H_
#define RANKSCOPE_COLLECTOR_STORE_SQLITE_STORE_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/model/rank_windows.h"
#include "collector/model/rows.h"
#include "collector/store/retention.h"

struct sqlite3;
struct sqlite3_stmt;

namespace rankscope::collector {

// The rows (JobRow ... StoreBatch) are in collector/model/rows.h.

struct StoreOptions {
  // Opens an existing database read-only (a query connection beside the writer): no schema is
  // created and Write fails with PermissionDenied. Open fails with FailedPrecondition when the
  // file has no rankscope schema yet.
  bool read_only = false;
  // synchronous=FULL instead of NORMAL: every commit is fsynced, so it also survives power loss.
  bool synchronous_full = false;
  // How long a statement waits for another connection's lock before failing with Unavailable.
  absl::Duration busy_timeout = absl::Seconds(5);
  // A cap on the database's size (PRAGMA max_page_count, rounded down to whole pages); 0 means
  // none. A Write that would grow the file beyond it fails with ResourceExhausted, like a full
  // disk.
  int64_t max_size_bytes = 0;
};

class SqliteStore {
 public:
  // The schema this build writes (PRAGMA user_version).
  // 1: the first release. 2: step_stats.duplicate_groups. 3: jobs.attempt.
  // 4: step_stats.drifting_ranks, slow_ranks. 5: rank_windows, downsampled, auto_vacuum.
  // 6: rank_steps.deviating_buckets, bucket_norms, bucket_z (where in the model).
  // 7: step_stats.integrity_error_ratio, integrity_relative_error, integrity_fault,
  // integrity_rank, integrity_weight (aggregation integrity).
  static constexpr int kSchemaVersion = 7;

  // Opens (creating if needed) the database at `path`, enables WAL and creates the schema.
  // Errors carry the path and SQLite's message:
  //   Unavailable: the file could not be opened (missing directory, out of file descriptors) or
  //     is locked; transient, retry with backoff.
  //   PermissionDenied: the file or its directory is not writable; needs an operator.
  //   DataLoss: the file is not a SQLite database or is corrupt; do not retry.
  //   FailedPrecondition: written by a newer schema, or (read_only) no schema yet.
  //   Internal: anything else (a bug).
  static absl::StatusOr<std::unique_ptr<SqliteStore>> Open(const std::string& path);
  static absl::StatusOr<std::unique_ptr<SqliteStore>> Open(const std::string& path,
                                                           const StoreOptions& options);
  ~SqliteStore();
  SqliteStore(const SqliteStore&) = delete;
  SqliteStore& operator=(const SqliteStore&) = delete;

  // Writes the whole batch in one transaction (BEGIN IMMEDIATE ... COMMIT): all of it is stored
  // or none of it. An empty batch is a no-op. The key of step_stats is StepWrite::step;
  // StepRow::step must equal it. On error the transaction is rolled back and nothing of the
  // batch is stored; the message names the path and SQLite's error. What the caller should do:
  //   ResourceExhausted: the disk (or max_size_bytes) is full. Retry with backoff; it succeeds
  //     once space is freed. Keep the batch un-acked.
  //   Unavailable: transient (a lock held past busy_timeout, an I/O error). Retry with backoff.
  //   PermissionDenied: the file, its directory or the connection is read-only. Retrying does
  //     not help until an operator fixes it (a slow retry is harmless).
  //   InvalidArgument: the batch itself is bad (a step > INT64_MAX, StepRow::step != the
  //     StepWrite's step). Never retry it: the same batch fails again.
  //   DataLoss: the file is corrupt. Do not retry. Internal: a bug. Do not retry.
  absl::Status Write(const StoreBatch& batch);

  // Queries (read-only).
  absl::StatusOr<std::vector<JobRow>> ListJobs();
  // The newest `limit` steps of a job (step_stats rows), newest first. InvalidArgument when
  // limit < 0.
  absl::StatusOr<std::vector<StepRow>> RecentSteps(absl::string_view job, int limit);
  absl::StatusOr<std::optional<StepRow>> GetStep(absl::string_view job, uint64_t step);
  // Rank rows of one step, ordered by rank.
  absl::StatusOr<std::vector<RankRow>> RankRows(absl::string_view job, uint64_t step);
  absl::StatusOr<int64_t> CountRankRows(absl::string_view job);
  // step_stats rows with first_step <= step <= last_step, oldest first, at most `limit`.
  // InvalidArgument when limit < 0; empty when first_step > last_step.
  absl::StatusOr<std::vector<StepRow>> StepRange(absl::string_view job, uint64_t first_step,
                                                 uint64_t last_step, int limit);
  // rank_steps rows with first_step <= step <= last_step, ordered by (step, rank), at most
  // `limit`. InvalidArgument when limit < 0; empty when first_step > last_step.
  absl::StatusOr<std::vector<StepRankRow>> RankRowsInRange(absl::string_view job,
                                                           uint64_t first_step, uint64_t last_step,
                                                           int limit);
  // The rank_steps rows of one rank with first_step <= step <= last_step, ordered by step, at
  // most `limit`; reads that rank's rows only (one index seek per stored step), with their
  // bucket_z where kept (RankRow::bucket_z; RankRowsInRange leaves it empty). InvalidArgument
  // when limit < 0; empty when first_step > last_step.
  absl::StatusOr<std::vector<StepRankRow>> RankSeriesInRange(absl::string_view job, uint32_t rank,
                                                             uint64_t first_step,
                                                             uint64_t last_step, int limit);

  // rank_windows rows of a job overlapping [first_step, last_step], ordered by (first_step,
  // rank), at most `limit` (rank_windows.h). InvalidArgument when limit < 0.
  absl::StatusOr<std::vector<RankWindowRow>> RankWindowsInRange(absl::string_view job,
                                                                uint64_t first_step,
                                                                uint64_t last_step, int limit);
  // The job's rank_steps rows below this step were downsampled into rank_windows and deleted,
  // except flagged rows (retention.h rule 1; 0: none were).
  absl::StatusOr<uint64_t> DownsampledBefore(absl::string_view job);

  // --- Retention (sqlite_retention.cc; DESIGN.md "Storage lifecycle", retention.h) ----------
  // Each call is its own short transaction on the writer's connection. Errors as on Write.
  absl::StatusOr<StoreUsage> Usage();
  absl::StatusOr<std::vector<JobExtent>> JobExtents();
  struct PruneResult {
    int64_t rank_rows = 0;        // rank_steps rows deleted
    int64_t rank_rows_kept = 0;   // flagged rank_steps rows kept (kDownsample)
    int64_t step_rows = 0;        // step_stats rows deleted
    int64_t window_rows = 0;      // rank_windows rows deleted
    int64_t windows_written = 0;  // rank_windows rows inserted or merged into
    int64_t job_rows = 0;         // jobs rows deleted (forgotten jobs)
    int64_t steps = 0;            // steps the action covered (0: nothing was old enough)
    int64_t pages_vacuumed = 0;   // kVacuum
  };
  // Executes one PruneAction (retention.h). `window_steps` and `outlier_threshold` as in
  // RetentionOptions.
  absl::StatusOr<PruneResult> Prune(const PruneAction& action, uint32_t window_steps,
                                    double outlier_threshold);

  const std::string& path() const { return path_; }

 private:
  SqliteStore(std::string path, sqlite3* db);
  struct Statements;
  // A Status for SQLite result code `rc` (mapped as documented on Write) naming path_, `what`
  // and SQLite's message.
  absl::Status SqlError(int rc, absl::string_view what) const;
  absl::Status WriteRows(const StoreBatch& batch);
  absl::Status BadMissingRanks(absl::string_view job, uint64_t step) const;
  // Runs a prepared (job, first_step, last_step, limit) query, calling read_row on each row;
  // InvalidArgument when limit < 0, nothing read when the range is empty.
  absl::Status QueryStepRange(sqlite3_stmt* stmt, absl::string_view job, uint64_t first_step,
                              uint64_t last_step, int limit, absl::string_view what,
                              absl::FunctionRef<absl::Status(sqlite3_stmt*)> read_row);
  absl::StatusOr<PruneResult> Downsample(const PruneAction& action, uint32_t window_steps,
                                         double outlier_threshold);
  absl::StatusOr<PruneResult> DropSteps(const PruneAction& action);
  absl::StatusOr<PruneResult> IncrementalVacuum(int64_t pages);
  // Runs `body` in a write transaction (sqlite_transaction.h): BEGIN IMMEDIATE, COMMIT if it
  // returns OK, else ROLLBACK and its error.
  absl::Status InTransaction(absl::FunctionRef<absl::Status()> body);
  std::string path_;
  sqlite3* db_;
  std::unique_ptr<Statements> stmts_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_STORE_SQLITE_STORE_H_
