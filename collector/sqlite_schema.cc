#include "collector/sqlite_schema.h"

#include <sqlite3.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/sqlite_statement.h"

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
)sql";

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
    if (v == 1) {
      if (absl::Status s = exec("ALTER TABLE step_stats ADD COLUMN duplicate_groups TEXT NOT NULL "
                                "DEFAULT ''",
                                "migrate schema 1 -> 2");
          !s.ok()) {
        return s;
      }
    }
    if (v >= 1 && v <= 2) {
      if (absl::Status s = exec("ALTER TABLE jobs ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0",
                                "migrate schema 2 -> 3");
          !s.ok()) {
        return s;
      }
    }
    if (v >= 1 && v <= 3) {
      for (const char* column : {"drifting_ranks", "slow_ranks"}) {
        if (absl::Status s = exec(absl::StrCat("ALTER TABLE step_stats ADD COLUMN ", column,
                                               " TEXT NOT NULL DEFAULT ''"),
                                  "migrate schema 3 -> 4");
            !s.ok()) {
          return s;
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
  return status;
}

}  // namespace rankscope::collector::sqlite
