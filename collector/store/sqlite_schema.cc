#include "collector/store/sqlite_schema.h"

#include <sqlite3.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/store/sqlite_statement.h"

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
      // (a VACUUM after the transaction, see ConfigureConnection).
      {5, {}},
  };
  return *kMigrations;
}

}  // namespace

// Sets the connection's pragmas and creates (or checks) the schema. Errors name `path`; the
// caller closes `db` on failure.
absl::Status ConfigureConnection(const std::string& path, const StoreOptions& options,
                                 sqlite3* db) {
  const auto fail = [&](int rc, absl::string_view what) { return SqlStatus(rc, path, what, db); };
  const auto exec = [&](const std::string& sql, absl::string_view what = {}) -> absl::Status {
    int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) return fail(rc, what.empty() ? absl::string_view(sql) : what);
    return absl::OkStatus();
  };
  // Runs a statement that returns one row and returns its first column as text.
  const auto query = [&](const char* sql, std::string* result) -> absl::Status {
    sqlite3_stmt* raw = nullptr;
    int rc = sqlite3_prepare_v2(db, sql, -1, &raw, nullptr);
    Stmt stmt(raw);
    if (rc != SQLITE_OK) return fail(rc, sql);
    rc = sqlite3_step(stmt.get());
    if (rc != SQLITE_ROW) return fail(rc, sql);
    *result = ColumnText(stmt.get(), 0);
    return absl::OkStatus();
  };

  sqlite3_extended_result_codes(db, 1);
  const int64_t busy_ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(options.busy_timeout), 0,
                                              std::numeric_limits<int>::max());
  sqlite3_busy_timeout(db, static_cast<int>(busy_ms));  // 0: fail at once with SQLITE_BUSY

  if (options.read_only) {
    std::string version;
    if (absl::Status s = query("PRAGMA user_version", &version); !s.ok()) return s;
    if (version == "0") {
      return absl::FailedPreconditionError(absl::StrFormat(
          "sqlite_store %s: no rankscope schema (open it read-write once first)", path));
    }
    int v = 0;
    if (!absl::SimpleAtoi(version, &v) || v > SqliteStore::kSchemaVersion) {
      return absl::FailedPreconditionError(
          absl::StrFormat("sqlite_store %s: schema_version %s is newer than this build's %d", path,
                          version, SqliteStore::kSchemaVersion));
    }
    if (v < SqliteStore::kSchemaVersion) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "sqlite_store %s: schema_version %s is older than this build's %d (start this build's "
          "collector on it once to migrate it)",
          path, version, SqliteStore::kSchemaVersion));
    }
    return absl::OkStatus();
  }

  // journal_mode=WAL is persistent in the file; readers do not block the writer.
  std::string mode;
  if (absl::Status s = query("PRAGMA journal_mode=WAL", &mode); !s.ok()) return s;
  if (mode != "wal" && mode != "memory") {
    return absl::FailedPreconditionError(absl::StrFormat(
        "sqlite_store %s: could not enable WAL (journal_mode is '%s')", path, mode));
  }
  // NORMAL in WAL mode: a commit survives a process crash; only power loss or an OS crash can
  // lose the newest commits (never corrupting the file). FULL fsyncs every commit.
  if (absl::Status s =
          exec(options.synchronous_full ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
      !s.ok()) {
    return s;
  }
  if (options.max_size_bytes > 0) {
    std::string page_size;
    if (absl::Status s = query("PRAGMA page_size", &page_size); !s.ok()) return s;
    int64_t bytes_per_page = 4096;
    if (!absl::SimpleAtoi(page_size, &bytes_per_page) || bytes_per_page <= 0) {
      bytes_per_page = 4096;
    }
    const int64_t pages = std::max<int64_t>(1, options.max_size_bytes / bytes_per_page);
    if (absl::Status s = exec(absl::StrCat("PRAGMA max_page_count=", pages)); !s.ok()) return s;
  }

  // Freed pages go back to the file system in steps (SqliteStore::IncrementalVacuum, run by the
  // retention pass), so pruning shrinks the file. On a new, empty file this takes effect at once;
  // a file created before schema 5 needs one VACUUM, below.
  if (absl::Status s = exec("PRAGMA auto_vacuum=INCREMENTAL"); !s.ok()) return s;
  // The WAL is truncated back to this after a checkpoint that found it larger, so a burst of
  // pruning does not leave a large -wal file behind.
  if (absl::Status s = exec("PRAGMA journal_size_limit=67108864"); !s.ok()) return s;

  // Schema creation and the version check in one write transaction, so two processes opening a
  // new file at once do not race.
  if (absl::Status s = exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  absl::Status status = [&]() -> absl::Status {
    std::string version;
    if (absl::Status s = query("PRAGMA user_version", &version); !s.ok()) return s;
    int v = 0;
    if (!absl::SimpleAtoi(version, &v) || v > SqliteStore::kSchemaVersion) {
      return absl::FailedPreconditionError(
          absl::StrFormat("sqlite_store %s: schema_version %s is newer than this build's %d", path,
                          version, SqliteStore::kSchemaVersion));
    }
    // Migrations from older versions, one step at a time (v == 0: a new file, created whole).
    if (v >= 1) {
      for (const Migration& m : Migrations()) {
        if (v >= m.to_version) continue;
        for (const char* sql : m.statements) {
          if (absl::Status s = exec(sql, absl::StrFormat("migrate schema %d -> %d: %s",
                                                         m.to_version - 1, m.to_version, sql));
              !s.ok()) {
            return s;
          }
        }
      }
    }
    if (absl::Status s = exec(kCreateSchema, "create schema"); !s.ok()) return s;
    if (v < SqliteStore::kSchemaVersion) {
      if (absl::Status s = exec(absl::StrCat("PRAGMA user_version=", SqliteStore::kSchemaVersion));
          !s.ok()) {
        return s;
      }
    }
    return exec("COMMIT");
  }();
  if (!status.ok() && sqlite3_get_autocommit(db) == 0) {
    sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  if (!status.ok()) return status;
  // A file written before schema 5 has auto_vacuum=NONE, which only a VACUUM can change: it
  // rewrites the whole file once (seconds per GB, the writer waits; readers keep reading), needs
  // as much free disk as the file, and never runs again on this file. If it fails (e.g. the disk
  // is too full), the store still works; the file just does not shrink when pruned.
  std::string auto_vacuum;
  if (absl::Status s = query("PRAGMA auto_vacuum", &auto_vacuum); !s.ok()) return s;
  if (auto_vacuum != "2") {
    if (absl::Status s = exec("VACUUM", "VACUUM (enable auto_vacuum=INCREMENTAL, once)"); !s.ok()) {
      std::fprintf(stderr, "rankscope-collector: %s (the file will not shrink when pruned)\n",
                   s.ToString().c_str());
    }
  }
  return absl::OkStatus();
}

}  // namespace rankscope::collector::sqlite
