#include "collector/store/sqlite_schema.h"

#include <sqlite3.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/store/sqlite_statement.h"
#include "collector/store/sqlite_transaction.h"
#include "common/crash_point.h"

namespace rankscope::collector::sqlite {
namespace {

// Constant DDL, run once in Open. Every statement that carries a value is prepared and bound.
constexpr char kCreateSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS jobs(
  job TEXT NOT NULL PRIMARY KEY,
  world_size INTEGER NOT NULL,
  sketch_dim INTEGER NOT NULL,
  sketch_seed INTEGER NOT NULL,  -- uint64 bit pattern
  first_seen REAL NOT NULL,
  last_seen REAL NOT NULL,
  last_step INTEGER NOT NULL DEFAULT 0,
  attempt INTEGER NOT NULL DEFAULT 0);  -- the job's current epoch: rows of older ones lose
CREATE TABLE IF NOT EXISTS rank_identities(
  job TEXT NOT NULL,
  rank INTEGER NOT NULL,
  global_rank INTEGER,  -- NULL when the agent did not state it
  host TEXT NOT NULL,
  instance_id TEXT NOT NULL,
  pid INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  first_seen REAL NOT NULL,
  last_seen REAL NOT NULL,
  PRIMARY KEY(job, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_steps(
  job TEXT NOT NULL,
  step INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  join_size INTEGER NOT NULL,
  loss REAL,
  grad_norm REAL,
  grad_cosine REAL,
  loss_z REAL,
  grad_norm_z REAL,
  nonfinite INTEGER NOT NULL DEFAULT 0,
  reduced_grad_fingerprint INTEGER,  -- uint64 bit pattern
  param_fingerprint INTEGER,         -- uint64 bit pattern
  step_time_seconds REAL,
  received_at REAL NOT NULL,
  replica_ok INTEGER,                -- 1, 0, or NULL when no fingerprint was checked
  outlier_score REAL,
  step_time_z REAL,
  -- Where in the model (schema 6): "layers.20-23.mlp z=45.1; ..." for a flagged rank, and its
  -- per-bucket norms and their robust z as float32 BLOBs (flagged rows and every 100th step).
  deviating_buckets TEXT NOT NULL DEFAULT '',
  bucket_norms BLOB,
  bucket_z BLOB,
  PRIMARY KEY(job, step, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS step_stats(
  job TEXT NOT NULL,
  step INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  ranks INTEGER NOT NULL,
  world_size INTEGER NOT NULL,
  loss_mean REAL,
  loss_std REAL,
  loss_range REAL,
  grad_norm_mean REAL,
  grad_norm_std REAL,
  grad_norm_cv REAL,
  grad_cosine_mean REAL,
  missing_ranks TEXT NOT NULL DEFAULT '',
  timed_out INTEGER NOT NULL DEFAULT 0,
  completed_at REAL NOT NULL,
  grad_noise_scale REAL,
  replica_checked INTEGER NOT NULL DEFAULT 0,
  replica_divergent_ranks TEXT NOT NULL DEFAULT '',
  outlier_ranks TEXT NOT NULL DEFAULT '',
  duplicate_groups TEXT NOT NULL DEFAULT '',  -- "0,2;1,3": ranks with identical gradients
  drifting_ranks TEXT NOT NULL DEFAULT '',    -- "1,5": data-drift CUSUM above h (rank_cusum.h)
  slow_ranks TEXT NOT NULL DEFAULT '',        -- "3": step-time CUSUM above h
  integrity_error_ratio REAL,     -- ||s - m|| / tolerance (aggregation_integrity.h); NULL: unchecked
  integrity_relative_error REAL,  -- ||s - m|| / ||s||
  integrity_fault TEXT NOT NULL DEFAULT '',  -- "", "sum", "missing", "doubled", "scaled", ...
  integrity_rank INTEGER,         -- the rank named, NULL: none
  integrity_weight REAL,          -- its W * weight in the reduction (1 expected)
  PRIMARY KEY(job, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_windows(
  job TEXT NOT NULL,
  first_step INTEGER NOT NULL,  -- the window: first_step .. last_step (retention.h)
  rank INTEGER NOT NULL,
  last_step INTEGER NOT NULL,
  rows INTEGER NOT NULL,        -- rank_steps rows aggregated so far
  first_received REAL NOT NULL,
  last_received REAL NOT NULL,
  loss_n INTEGER NOT NULL, loss_sum REAL, loss_min REAL, loss_max REAL,
  grad_norm_n INTEGER NOT NULL, grad_norm_sum REAL, grad_norm_min REAL, grad_norm_max REAL,
  grad_cosine_n INTEGER NOT NULL, grad_cosine_sum REAL, grad_cosine_min REAL,
  grad_cosine_max REAL,
  outlier_score_n INTEGER NOT NULL, outlier_score_sum REAL, outlier_score_min REAL,
  outlier_score_max REAL,
  nonfinite INTEGER NOT NULL,    -- rows with a non-finite loss, norm or sketch
  outliers INTEGER NOT NULL,     -- rows with outlier_score >= the outlier threshold
  replica_bad INTEGER NOT NULL,  -- rows with replica_ok = 0
  PRIMARY KEY(job, first_step, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS downsampled(
  job TEXT NOT NULL PRIMARY KEY,
  next_step INTEGER NOT NULL);  -- rank_steps rows below it were aggregated into rank_windows
)sql";

// One schema version's migration from the version before it: statements run in the open's
// write transaction, in order. kCreateSchema runs after all of them (creating new tables), so a
// migration only alters what already exists. To add version N + 1: append its entry here, bump
// SqliteStore::kSchemaVersion, extend kCreateSchema, and add a fixture of a version-N file to
// tests/collector/testdata with a test that opens it.
struct Migration {
  int to_version;
  std::vector<const char*> statements;
};

const std::vector<Migration>& Migrations() {
  static const std::vector<Migration>* const kMigrations = new std::vector<Migration>{
      {2, {"ALTER TABLE step_stats ADD COLUMN duplicate_groups TEXT NOT NULL DEFAULT ''"}},
      {3, {"ALTER TABLE jobs ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0"}},
      {4,
       {"ALTER TABLE step_stats ADD COLUMN drifting_ranks TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE step_stats ADD COLUMN slow_ranks TEXT NOT NULL DEFAULT ''"}},
      // 5: rank_windows and downsampled (created by kCreateSchema), and auto_vacuum=INCREMENTAL
      // (a VACUUM after the transaction, see EnableIncrementalVacuum).
      {5, {}},
      // 6: where in the model (rank_steps.deviating_buckets, bucket_norms, bucket_z).
      {6,
       {"ALTER TABLE rank_steps ADD COLUMN deviating_buckets TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE rank_steps ADD COLUMN bucket_norms BLOB",
        "ALTER TABLE rank_steps ADD COLUMN bucket_z BLOB"}},
      // 7: aggregation integrity (collector/analysis/aggregation_integrity.h).
      {7,
       {"ALTER TABLE step_stats ADD COLUMN integrity_error_ratio REAL",
        "ALTER TABLE step_stats ADD COLUMN integrity_relative_error REAL",
        "ALTER TABLE step_stats ADD COLUMN integrity_fault TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE step_stats ADD COLUMN integrity_rank INTEGER",
        "ALTER TABLE step_stats ADD COLUMN integrity_weight REAL"}},
  };
  return *kMigrations;
}

// `db` with its file's path, for errors that name it.
class Connection {
 public:
  Connection(const std::string& path, sqlite3* db) : path_(path), db_(db) {}

  absl::Status Fail(int rc, absl::string_view what) const {
    return SqlStatus(rc, path_, what, db_);
  }

  // Runs constant SQL (DDL, pragmas); an error names `what`, or the SQL itself.
  absl::Status Exec(const std::string& sql, absl::string_view what = {}) const {
    const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) return Fail(rc, what.empty() ? absl::string_view(sql) : what);
    return absl::OkStatus();
  }

  // Runs a statement that returns one row and returns its first column as text.
  absl::StatusOr<std::string> QueryText(const char* sql) const {
    sqlite3_stmt* raw = nullptr;
    int rc = sqlite3_prepare_v2(db_, sql, -1, &raw, nullptr);
    Stmt stmt(raw);
    if (rc != SQLITE_OK) return Fail(rc, sql);
    rc = sqlite3_step(stmt.get());
    if (rc != SQLITE_ROW) return Fail(rc, sql);
    return ColumnText(stmt.get(), 0);
  }

  // PRAGMA user_version, the file's schema version (0: a new file). Newer than this build's:
  // kFailedPrecondition.
  absl::StatusOr<int> SchemaVersion() const {
    absl::StatusOr<std::string> version = QueryText("PRAGMA user_version");
    if (!version.ok()) return version.status();
    int v = 0;
    if (!absl::SimpleAtoi(*version, &v) || v > SqliteStore::kSchemaVersion) {
      return absl::FailedPreconditionError(
          absl::StrFormat("sqlite_store %s: schema_version %s is newer than this build's %d", path_,
                          *version, SqliteStore::kSchemaVersion));
    }
    return v;
  }

  const std::string& path() const { return path_; }
  sqlite3* db() const { return db_; }

 private:
  const std::string& path_;
  sqlite3* const db_;
};

// Runs the migrations from version `from` (>= 1) to kSchemaVersion, one step at a time.
absl::Status Migrate(const Connection& connection, int from) {
  for (const Migration& m : Migrations()) {
    if (from >= m.to_version) continue;
    for (const char* sql : m.statements) {
      if (absl::Status s = connection.Exec(
              sql,
              absl::StrFormat("migrate schema %d -> %d: %s", m.to_version - 1, m.to_version, sql));
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

void SetBusyTimeout(const StoreOptions& options, sqlite3* db) {
  sqlite3_extended_result_codes(db, 1);
  const int64_t busy_ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(options.busy_timeout), 0,
                                              std::numeric_limits<int>::max());
  sqlite3_busy_timeout(db, static_cast<int>(busy_ms));  // 0: fail at once with SQLITE_BUSY
}

absl::Status CheckSchemaVersion(const std::string& path, sqlite3* db) {
  absl::StatusOr<int> version = Connection(path, db).SchemaVersion();
  if (!version.ok()) return version.status();
  if (*version == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "sqlite_store %s: no rankscope schema (open it read-write once first)", path));
  }
  if (*version < SqliteStore::kSchemaVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "sqlite_store %s: schema_version %d is older than this build's %d (start this build's "
        "collector on it once to migrate it)",
        path, *version, SqliteStore::kSchemaVersion));
  }
  return absl::OkStatus();
}

absl::Status SetWritePragmas(const std::string& path, const StoreOptions& options, sqlite3* db) {
  const Connection connection(path, db);
  // journal_mode=WAL is persistent in the file; readers do not block the writer.
  absl::StatusOr<std::string> mode = connection.QueryText("PRAGMA journal_mode=WAL");
  if (!mode.ok()) return mode.status();
  if (*mode != "wal" && *mode != "memory") {
    return absl::FailedPreconditionError(absl::StrFormat(
        "sqlite_store %s: could not enable WAL (journal_mode is '%s')", path, *mode));
  }
  // NORMAL in WAL mode: a commit survives a process crash; only power loss or an OS crash can
  // lose the newest commits (never corrupting the file). FULL fsyncs every commit.
  if (absl::Status s = connection.Exec(options.synchronous_full ? "PRAGMA synchronous=FULL"
                                                                : "PRAGMA synchronous=NORMAL");
      !s.ok()) {
    return s;
  }
  if (options.max_size_bytes > 0) {
    absl::StatusOr<std::string> page_size = connection.QueryText("PRAGMA page_size");
    if (!page_size.ok()) return page_size.status();
    int64_t bytes_per_page = 4096;
    if (!absl::SimpleAtoi(*page_size, &bytes_per_page) || bytes_per_page <= 0) {
      bytes_per_page = 4096;
    }
    const int64_t pages = std::max<int64_t>(1, options.max_size_bytes / bytes_per_page);
    if (absl::Status s = connection.Exec(absl::StrCat("PRAGMA max_page_count=", pages)); !s.ok()) {
      return s;
    }
  }
  // Freed pages go back to the file system in steps (SqliteStore::IncrementalVacuum, run by the
  // retention pass), so pruning shrinks the file. On a new, empty file this takes effect at once;
  // a file created before schema 5 needs one VACUUM (EnableIncrementalVacuum).
  if (absl::Status s = connection.Exec("PRAGMA auto_vacuum=INCREMENTAL"); !s.ok()) return s;
  // The WAL is truncated back to this after a checkpoint that found it larger, so a burst of
  // pruning does not leave a large -wal file behind.
  return connection.Exec("PRAGMA journal_size_limit=67108864");
}

absl::Status CreateOrMigrateSchema(const std::string& path, sqlite3* db) {
  const Connection connection(path, db);
  absl::StatusOr<TransactionStatements> statements = TransactionStatements::Prepare(db, path);
  if (!statements.ok()) return statements.status();
  // The version check, migrations and creation in one write transaction, so two processes
  // opening a new file at once do not race.
  return InWriteTransaction(db, path, *statements, [&]() -> absl::Status {
    absl::StatusOr<int> version = connection.SchemaVersion();
    if (!version.ok()) return version.status();
    // v == 0: a new file, created whole by kCreateSchema.
    if (*version >= 1) {
      if (absl::Status s = Migrate(connection, *version); !s.ok()) return s;
      // Migrated, user_version not yet set, nothing committed (testing only).
      if (*version < SqliteStore::kSchemaVersion) CrashPointForTesting("store_schema_migration");
    }
    if (absl::Status s = connection.Exec(kCreateSchema, "create schema"); !s.ok()) return s;
    if (*version < SqliteStore::kSchemaVersion) {
      return connection.Exec(absl::StrCat("PRAGMA user_version=", SqliteStore::kSchemaVersion));
    }
    return absl::OkStatus();
  });
}

absl::Status EnableIncrementalVacuum(const std::string& path, sqlite3* db) {
  const Connection connection(path, db);
  absl::StatusOr<std::string> auto_vacuum = connection.QueryText("PRAGMA auto_vacuum");
  if (!auto_vacuum.ok()) return auto_vacuum.status();
  if (*auto_vacuum == "2") return absl::OkStatus();  // INCREMENTAL already
  if (absl::Status s = connection.Exec("VACUUM", "VACUUM (enable auto_vacuum=INCREMENTAL, once)");
      !s.ok()) {
    std::fprintf(stderr, "rankscope-collector: %s (the file will not shrink when pruned)\n",
                 s.ToString().c_str());
  }
  return absl::OkStatus();
}

}  // namespace rankscope::collector::sqlite
