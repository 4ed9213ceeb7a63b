// The SQLite sink (DESIGN.md "SQLite"): one file, WAL, prepared statements only.
//
// Schema (created on Open, idempotently; extra columns beyond DESIGN.md are rankscope's own):
//   jobs(job TEXT PRIMARY KEY, world_size, sketch_dim, sketch_seed, first_seen, last_seen,
//        last_step)
//   rank_steps(job, step, rank, attempt, join_size, loss, grad_norm, grad_cosine, loss_z,
//        grad_norm_z, nonfinite, reduced_grad_fingerprint, param_fingerprint, step_time_seconds,
//        received_at, PRIMARY KEY(job, step, rank))
//   step_stats(job, step, attempt, ranks, world_size, loss_mean, loss_std, loss_range,
//        grad_norm_mean, grad_norm_std, grad_norm_cv, grad_cosine_mean, missing_ranks,
//        timed_out, completed_at, PRIMARY KEY(job, step))
// Times are Unix seconds as REAL. NaN is stored as NULL (SQLite's own rule) and flagged by
// `nonfinite` (1 when the rank's loss or grad_norm was NaN/Inf). missing_ranks is a
// comma-separated list ("3,7"), empty when none.
//
// Idempotency ("newest report wins", duplicates change nothing): a row replaces the stored row
// with the same key only if its attempt is higher, or the attempt is equal and its join_size
// (rank_steps) / ranks (step_stats) is at least the stored one. So a resend after a crash, which
// may be joined with fewer ranks than the original, never degrades what was stored.
//
// Thread safety: a SqliteStore owns one connection and is thread-compatible: use one per thread
// (the StoreWriter thread owns one; queries open their own). WAL lets readers run beside the
// writer.
#ifndef RANKSCOPE_COLLECTOR_SQLITE_STORE_H_
#define RANKSCOPE_COLLECTOR_SQLITE_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct sqlite3;

namespace rankscope::collector {

struct JobRow {
  std::string job;
  uint32_t world_size = 0;
  uint32_t sketch_dim = 0;
  uint64_t sketch_seed = 0;
  absl::Time first_seen = absl::UnixEpoch();  // on upsert, the earliest is kept
  absl::Time last_seen = absl::UnixEpoch();   // on upsert, the latest is kept
  uint64_t last_step = 0;                     // on upsert, the largest is kept
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
};

struct StepRow {
  uint64_t step = 0;
  uint32_t attempt = 0;
  uint32_t ranks = 0;
  uint32_t world_size = 0;
  double loss_mean = 0.0;
  double loss_std = 0.0;
  double loss_range = 0.0;
  double grad_norm_mean = 0.0;
  double grad_norm_std = 0.0;
  double grad_norm_cv = 0.0;
  double grad_cosine_mean = 0.0;
  std::vector<uint32_t> missing_ranks;
  bool timed_out = false;
  absl::Time completed_at = absl::UnixEpoch();
};

// The rows of one step of one job. `stats` is absent for a late report (rank rows only).
struct StepWrite {
  std::string job;
  uint64_t step = 0;
  std::optional<StepRow> stats;
  std::vector<RankRow> ranks;
};

// Everything written in one transaction.
struct StoreBatch {
  std::vector<JobRow> jobs;
  std::vector<StepWrite> steps;
  bool empty() const { return jobs.empty() && steps.empty(); }
};

class SqliteStore {
 public:
  // Opens (creating if needed) the database at `path`, enables WAL and creates the schema.
  // Errors: Unavailable / PermissionDenied / Internal with the path and SQLite's message.
  static absl::StatusOr<std::unique_ptr<SqliteStore>> Open(const std::string& path);
  ~SqliteStore();
  SqliteStore(const SqliteStore&) = delete;
  SqliteStore& operator=(const SqliteStore&) = delete;

  // Writes the whole batch in one transaction: all of it is stored or none of it.
  // On error (disk full, read-only file) the transaction is rolled back; the caller may retry.
  absl::Status Write(const StoreBatch& batch);

  // Queries (read-only).
  absl::StatusOr<std::vector<JobRow>> ListJobs();
  // The newest `limit` steps of a job, newest first.
  absl::StatusOr<std::vector<StepRow>> RecentSteps(absl::string_view job, int limit);
  absl::StatusOr<std::optional<StepRow>> GetStep(absl::string_view job, uint64_t step);
  // Rank rows of one step, ordered by rank.
  absl::StatusOr<std::vector<RankRow>> RankRows(absl::string_view job, uint64_t step);
  absl::StatusOr<int64_t> CountRankRows(absl::string_view job);

  const std::string& path() const { return path_; }

 private:
  SqliteStore(std::string path, sqlite3* db);
  struct Statements;
  std::string path_;
  sqlite3* db_;
  std::unique_ptr<Statements> stmts_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_SQLITE_STORE_H_
