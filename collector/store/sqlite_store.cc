#include "collector/store/sqlite_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/model/rank_ranges.h"
#include "collector/store/sqlite_schema.h"
#include "collector/store/sqlite_statement.h"

namespace rankscope::collector {

using sqlite::Binder;
using sqlite::CodeFor;
using sqlite::ColumnBits;
using sqlite::ColumnDouble;
using sqlite::ColumnInt;
using sqlite::ColumnOptionalBits;
using sqlite::ColumnOptionalDouble;
using sqlite::ColumnText;
using sqlite::ColumnTime;
using sqlite::ColumnU32;
using sqlite::IsNull;
using sqlite::Quote;
using sqlite::ScopedReset;
using sqlite::StepToDone;
using sqlite::Stmt;

namespace {

// Every statement that carries a value is prepared and bound.
constexpr char kUpsertJob[] = R"sql(
INSERT INTO jobs(job, world_size, sketch_dim, sketch_seed, first_seen, last_seen, last_step,
                 attempt)
VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
ON CONFLICT(job) DO UPDATE SET
  attempt = max(jobs.attempt, excluded.attempt),
  world_size = excluded.world_size,
  sketch_dim = excluded.sketch_dim,
  sketch_seed = excluded.sketch_seed,
  first_seen = min(jobs.first_seen, excluded.first_seen),
  last_seen = max(jobs.last_seen, excluded.last_seen),
  last_step = max(jobs.last_step, excluded.last_step)
)sql";

constexpr char kUpsertRankIdentity[] = R"sql(
INSERT INTO rank_identities(job, rank, global_rank, host, instance_id, pid, attempt, first_seen,
                            last_seen)
VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8)
ON CONFLICT(job, rank) DO UPDATE SET
  global_rank = excluded.global_rank,
  host = excluded.host,
  instance_id = excluded.instance_id,
  pid = excluded.pid,
  attempt = excluded.attempt,
  last_seen = excluded.last_seen
)sql";

constexpr char kUpsertRank[] = R"sql(
INSERT INTO rank_steps(job, step, rank, attempt, join_size, loss, grad_norm, grad_cosine,
                       loss_z, grad_norm_z, nonfinite, reduced_grad_fingerprint,
                       param_fingerprint, step_time_seconds, received_at, replica_ok,
                       outlier_score, step_time_z)
VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)
ON CONFLICT(job, step, rank) DO UPDATE SET
  attempt = excluded.attempt,
  join_size = excluded.join_size,
  loss = excluded.loss,
  grad_norm = excluded.grad_norm,
  grad_cosine = excluded.grad_cosine,
  loss_z = excluded.loss_z,
  grad_norm_z = excluded.grad_norm_z,
  nonfinite = excluded.nonfinite,
  reduced_grad_fingerprint = excluded.reduced_grad_fingerprint,
  param_fingerprint = excluded.param_fingerprint,
  step_time_seconds = excluded.step_time_seconds,
  received_at = excluded.received_at,
  replica_ok = excluded.replica_ok,
  outlier_score = excluded.outlier_score,
  step_time_z = excluded.step_time_z
WHERE excluded.attempt > rank_steps.attempt
   OR (excluded.attempt = rank_steps.attempt AND excluded.join_size >= rank_steps.join_size)
)sql";

constexpr char kUpsertStep[] = R"sql(
INSERT INTO step_stats(job, step, attempt, ranks, world_size, loss_mean, loss_std, loss_range,
                       grad_norm_mean, grad_norm_std, grad_norm_cv, grad_cosine_mean,
                       missing_ranks, timed_out, completed_at, grad_noise_scale,
                       replica_checked, replica_divergent_ranks, outlier_ranks,
                       duplicate_groups, drifting_ranks, slow_ranks)
VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20,
       ?21, ?22)
ON CONFLICT(job, step) DO UPDATE SET
  attempt = excluded.attempt,
  ranks = excluded.ranks,
  world_size = excluded.world_size,
  loss_mean = excluded.loss_mean,
  loss_std = excluded.loss_std,
  loss_range = excluded.loss_range,
  grad_norm_mean = excluded.grad_norm_mean,
  grad_norm_std = excluded.grad_norm_std,
  grad_norm_cv = excluded.grad_norm_cv,
  grad_cosine_mean = excluded.grad_cosine_mean,
  missing_ranks = excluded.missing_ranks,
  timed_out = excluded.timed_out,
  completed_at = excluded.completed_at,
  grad_noise_scale = excluded.grad_noise_scale,
  replica_checked = excluded.replica_checked,
  replica_divergent_ranks = excluded.replica_divergent_ranks,
  outlier_ranks = excluded.outlier_ranks,
  duplicate_groups = excluded.duplicate_groups,
  drifting_ranks = excluded.drifting_ranks,
  slow_ranks = excluded.slow_ranks
WHERE excluded.attempt > step_stats.attempt
   OR (excluded.attempt = step_stats.attempt AND excluded.ranks >= step_stats.ranks)
)sql";

#define RANKSCOPE_STEP_COLUMNS                                                                    \
  "step, attempt, ranks, world_size, loss_mean, loss_std, loss_range, grad_norm_mean, "           \
  "grad_norm_std, grad_norm_cv, grad_cosine_mean, missing_ranks, timed_out, completed_at, "       \
  "grad_noise_scale, replica_checked, replica_divergent_ranks, outlier_ranks, duplicate_groups, " \
  "drifting_ranks, slow_ranks"

constexpr char kListJobs[] =
    "SELECT job, world_size, sketch_dim, sketch_seed, first_seen, last_seen, last_step, attempt "
    "FROM jobs ORDER BY job";
constexpr char kRecentSteps[] =
    "SELECT " RANKSCOPE_STEP_COLUMNS " FROM step_stats WHERE job = ?1 ORDER BY step DESC LIMIT ?2";
constexpr char kGetStep[] =
    "SELECT " RANKSCOPE_STEP_COLUMNS " FROM step_stats WHERE job = ?1 AND step = ?2";
constexpr char kRankRows[] =
    "SELECT rank, attempt, join_size, loss, grad_norm, grad_cosine, loss_z, grad_norm_z, "
    "reduced_grad_fingerprint, param_fingerprint, step_time_seconds, received_at, replica_ok, "
    "outlier_score, step_time_z FROM rank_steps WHERE job = ?1 AND step = ?2 ORDER BY rank";
constexpr char kCountRankRows[] = "SELECT count(*) FROM rank_steps WHERE job = ?1";
constexpr char kStepRange[] = "SELECT " RANKSCOPE_STEP_COLUMNS
                              " FROM step_stats WHERE job = ?1 AND step >= ?2 AND "
                              "step <= ?3 ORDER BY step LIMIT ?4";
constexpr char kRankRowsInRange[] =
    "SELECT rank, attempt, join_size, loss, grad_norm, grad_cosine, loss_z, grad_norm_z, "
    "reduced_grad_fingerprint, param_fingerprint, step_time_seconds, received_at, replica_ok, "
    "outlier_score, step_time_z, step, nonfinite FROM rank_steps WHERE job = ?1 AND step >= ?2 "
    "AND step <= ?3 ORDER BY step, rank LIMIT ?4";
// One rank's rows: a loose index scan over the steps of the range (one seek per stored step in
// the (job, step, rank) key, then one seek for the rank), so it reads that rank's rows only,
// not every rank's rows of the range. CROSS JOIN keeps s the outer loop (SQLite otherwise scans
// every row of the job). 4,096 ranks x 120 steps: 0.2 ms, against 34 ms for a rank filter on the
// range and 290 ms for the whole range (docs/PERFORMANCE.md "Web view at 512 and 4,096 ranks").
constexpr char kRankSeriesInRange[] = R"sql(
WITH RECURSIVE s(step) AS (
  SELECT (SELECT step FROM rank_steps WHERE job = ?1 AND step >= ?2 AND step <= ?3
          ORDER BY step LIMIT 1)
  UNION ALL
  SELECT (SELECT step FROM rank_steps WHERE job = ?1 AND step > s.step AND step <= ?3
          ORDER BY step LIMIT 1)
  FROM s WHERE s.step IS NOT NULL
)
SELECT r.rank, r.attempt, r.join_size, r.loss, r.grad_norm, r.grad_cosine, r.loss_z,
       r.grad_norm_z, r.reduced_grad_fingerprint, r.param_fingerprint, r.step_time_seconds,
       r.received_at, r.replica_ok, r.outlier_score, r.step_time_z, r.step, r.nonfinite
FROM s CROSS JOIN rank_steps r ON r.job = ?1 AND r.step = s.step AND r.rank = ?5
ORDER BY r.step LIMIT ?4
)sql";

#undef RANKSCOPE_STEP_COLUMNS

constexpr int64_t kMaxStep = std::numeric_limits<int64_t>::max();

std::string JoinRanks(const std::vector<uint32_t>& ranks) { return absl::StrJoin(ranks, ","); }

bool ParseRanks(absl::string_view text, std::vector<uint32_t>* ranks) {
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    uint32_t rank = 0;
    if (!absl::SimpleAtoi(part, &rank)) return false;
    ranks->push_back(rank);
  }
  return true;
}

// Columns as in RANKSCOPE_STEP_COLUMNS.
bool ReadStepRow(sqlite3_stmt* stmt, StepRow* row) {
  row->step = static_cast<uint64_t>(ColumnInt(stmt, 0));
  row->attempt = ColumnU32(stmt, 1);
  row->ranks = ColumnU32(stmt, 2);
  row->world_size = ColumnU32(stmt, 3);
  row->loss_mean = ColumnDouble(stmt, 4);
  row->loss_std = ColumnDouble(stmt, 5);
  row->loss_range = ColumnDouble(stmt, 6);
  row->grad_norm_mean = ColumnDouble(stmt, 7);
  row->grad_norm_std = ColumnDouble(stmt, 8);
  row->grad_norm_cv = ColumnDouble(stmt, 9);
  row->grad_cosine_mean = ColumnDouble(stmt, 10);
  row->timed_out = ColumnInt(stmt, 12) != 0;
  row->completed_at = ColumnTime(stmt, 13);
  row->grad_noise_scale = ColumnDouble(stmt, 14);
  row->replica_checked = ColumnInt(stmt, 15) != 0;
  row->duplicate_groups = ColumnText(stmt, 18);
  row->missing_ranks = ColumnText(stmt, 11);
  RankRanges missing;
  return ParseRankRanges(row->missing_ranks, &missing) &&
         ParseRanks(ColumnText(stmt, 16), &row->replica_divergent_ranks) &&
         ParseRanks(ColumnText(stmt, 17), &row->outlier_ranks) &&
         ParseRanks(ColumnText(stmt, 19), &row->drifting_ranks) &&
         ParseRanks(ColumnText(stmt, 20), &row->slow_ranks);
}

}  // namespace

struct SqliteStore::Statements {
  Stmt begin;
  Stmt commit;
  Stmt rollback;
  Stmt upsert_job;
  Stmt upsert_rank_identity;
  Stmt upsert_rank;
  Stmt upsert_step;
  Stmt list_jobs;
  Stmt recent_steps;
  Stmt get_step;
  Stmt rank_rows;
  Stmt count_rank_rows;
  Stmt step_range;
  Stmt rank_rows_in_range;
  Stmt rank_series_in_range;
};

absl::StatusOr<std::unique_ptr<SqliteStore>> SqliteStore::Open(const std::string& path) {
  return Open(path, StoreOptions());
}

absl::StatusOr<std::unique_ptr<SqliteStore>> SqliteStore::Open(const std::string& path,
                                                               const StoreOptions& options) {
  sqlite3* db = nullptr;
  // NOMUTEX: a SqliteStore is thread-compatible, its owner serializes calls.
  const int flags =
      (options.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
      SQLITE_OPEN_NOMUTEX;
  int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status status(CodeFor(rc),
                        absl::StrFormat("sqlite_store %s: open: %s [sqlite code %d]", path,
                                        db ? sqlite3_errmsg(db) : sqlite3_errstr(rc), rc));
    sqlite3_close(db);
    return status;
  }
  if (absl::Status s = sqlite::ConfigureConnection(path, options, db); !s.ok()) {
    sqlite3_close(db);
    return s;
  }
  // From here the store owns `db` and closes it on every path.
  std::unique_ptr<SqliteStore> store(new SqliteStore(path, db));
  const struct {
    Stmt* stmt;
    const char* sql;
  } kStatements[] = {
      {&store->stmts_->begin, "BEGIN IMMEDIATE"},
      {&store->stmts_->commit, "COMMIT"},
      {&store->stmts_->rollback, "ROLLBACK"},
      {&store->stmts_->upsert_job, kUpsertJob},
      {&store->stmts_->upsert_rank_identity, kUpsertRankIdentity},
      {&store->stmts_->upsert_rank, kUpsertRank},
      {&store->stmts_->upsert_step, kUpsertStep},
      {&store->stmts_->list_jobs, kListJobs},
      {&store->stmts_->recent_steps, kRecentSteps},
      {&store->stmts_->get_step, kGetStep},
      {&store->stmts_->rank_rows, kRankRows},
      {&store->stmts_->count_rank_rows, kCountRankRows},
      {&store->stmts_->step_range, kStepRange},
      {&store->stmts_->rank_rows_in_range, kRankRowsInRange},
      {&store->stmts_->rank_series_in_range, kRankSeriesInRange},
  };
  for (const auto& s : kStatements) {
    sqlite3_stmt* raw = nullptr;
    rc = sqlite3_prepare_v3(db, s.sql, -1, SQLITE_PREPARE_PERSISTENT, &raw, nullptr);
    s.stmt->reset(raw);
    if (rc != SQLITE_OK) return store->SqlError(rc, absl::StrCat("prepare ", s.sql));
  }
  return store;
}

SqliteStore::SqliteStore(std::string path, sqlite3* db)
    : path_(std::move(path)), db_(db), stmts_(std::make_unique<Statements>()) {}

SqliteStore::~SqliteStore() {
  stmts_.reset();  // statements are finalized before their connection is closed
  sqlite3_close(db_);
}

absl::Status SqliteStore::SqlError(int rc, absl::string_view what) const {
  return sqlite::SqlStatus(rc, path_, what, db_);
}

namespace {

absl::Status ValidateBatch(const StoreBatch& batch) {
  for (const JobRow& job : batch.jobs) {
    if (job.last_step > static_cast<uint64_t>(kMaxStep)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "job %s: last_step %d > INT64_MAX cannot be stored", Quote(job.job), job.last_step));
    }
  }
  for (const StepWrite& write : batch.steps) {
    if (write.step > static_cast<uint64_t>(kMaxStep)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "job %s: step %d > INT64_MAX cannot be stored", Quote(write.job), write.step));
    }
    if (write.stats.has_value() && write.stats->step != write.step) {
      return absl::InvalidArgumentError(
          absl::StrFormat("job %s: StepRow::step %d != StepWrite::step %d", Quote(write.job),
                          write.stats->step, write.step));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SqliteStore::Write(const StoreBatch& batch) {
  if (batch.empty()) return absl::OkStatus();
  if (absl::Status s = ValidateBatch(batch); !s.ok()) return s;

  {
    ScopedReset reset(stmts_->begin.get());
    int rc = StepToDone(stmts_->begin.get());
    if (rc != SQLITE_DONE) return SqlError(rc, "BEGIN IMMEDIATE");
  }
  absl::Status status = WriteRows(batch);
  if (status.ok()) {
    ScopedReset reset(stmts_->commit.get());
    int rc = StepToDone(stmts_->commit.get());
    if (rc != SQLITE_DONE) status = SqlError(rc, "COMMIT");
  }
  // SQLite may already have rolled the transaction back itself (e.g. on SQLITE_FULL).
  if (!status.ok() && sqlite3_get_autocommit(db_) == 0) {
    ScopedReset reset(stmts_->rollback.get());
    StepToDone(stmts_->rollback.get());
  }
  return status;
}

absl::Status SqliteStore::WriteRows(const StoreBatch& batch) {
  for (const JobRow& job : batch.jobs) {
    sqlite3_stmt* stmt = stmts_->upsert_job.get();
    ScopedReset reset(stmt);
    int rc = Binder(stmt)
                 .Text(job.job)
                 .Int(job.world_size)
                 .Int(job.sketch_dim)
                 .Bits(job.sketch_seed)
                 .Time(job.first_seen)
                 .Time(job.last_seen)
                 .Int(static_cast<int64_t>(job.last_step))
                 .Int(job.attempt)
                 .rc();
    if (rc == SQLITE_OK) rc = StepToDone(stmt);
    if (rc != SQLITE_DONE) return SqlError(rc, absl::StrCat("upsert jobs ", Quote(job.job)));
  }
  for (const RankIdentityRow& who : batch.rank_identities) {
    sqlite3_stmt* stmt = stmts_->upsert_rank_identity.get();
    ScopedReset reset(stmt);
    Binder b(stmt);
    b.Text(who.job).Int(who.rank);
    if (who.global_rank) {
      b.Int(*who.global_rank);
    } else {
      b.Null();
    }
    int rc =
        b.Text(who.host).Text(who.instance_id).Int(who.pid).Int(who.attempt).Time(who.seen).rc();
    if (rc == SQLITE_OK) rc = StepToDone(stmt);
    if (rc != SQLITE_DONE) {
      return SqlError(rc, absl::StrCat("upsert rank_identities ", Quote(who.job)));
    }
  }
  for (const StepWrite& write : batch.steps) {
    const auto step = static_cast<int64_t>(write.step);
    if (write.stats.has_value()) {
      const StepRow& row = *write.stats;
      sqlite3_stmt* stmt = stmts_->upsert_step.get();
      ScopedReset reset(stmt);
      const std::string divergent = JoinRanks(row.replica_divergent_ranks);
      const std::string outliers = JoinRanks(row.outlier_ranks);
      const std::string drifting = JoinRanks(row.drifting_ranks);
      const std::string slow = JoinRanks(row.slow_ranks);
      int rc = Binder(stmt)
                   .Text(write.job)
                   .Int(step)
                   .Int(row.attempt)
                   .Int(row.ranks)
                   .Int(row.world_size)
                   .Double(row.loss_mean)
                   .Double(row.loss_std)
                   .Double(row.loss_range)
                   .Double(row.grad_norm_mean)
                   .Double(row.grad_norm_std)
                   .Double(row.grad_norm_cv)
                   .Double(row.grad_cosine_mean)
                   .Text(row.missing_ranks)
                   .Int(row.timed_out ? 1 : 0)
                   .Time(row.completed_at)
                   .Double(row.grad_noise_scale)
                   .Int(row.replica_checked ? 1 : 0)
                   .Text(divergent)
                   .Text(outliers)
                   .Text(row.duplicate_groups)
                   .Text(drifting)
                   .Text(slow)
                   .rc();
      if (rc == SQLITE_OK) rc = StepToDone(stmt);
      if (rc != SQLITE_DONE) {
        return SqlError(
            rc, absl::StrFormat("upsert step_stats job %s step %d", Quote(write.job), write.step));
      }
    }
    for (const RankRow& row : write.ranks) {
      sqlite3_stmt* stmt = stmts_->upsert_rank.get();
      ScopedReset reset(stmt);
      const bool nonfinite = row.sketch_nonfinite ||
                             (!row.loss_absent && !std::isfinite(row.loss)) ||
                             !std::isfinite(row.grad_norm);
      int rc = Binder(stmt)
                   .Text(write.job)
                   .Int(step)
                   .Int(row.rank)
                   .Int(row.attempt)
                   .Int(row.join_size)
                   .Double(row.loss)
                   .Double(row.grad_norm)
                   .Double(row.grad_cosine)
                   .Double(row.loss_z)
                   .Double(row.grad_norm_z)
                   .Int(nonfinite ? 1 : 0)
                   .Bits(row.reduced_grad_fingerprint)
                   .Bits(row.param_fingerprint)
                   .Double(row.step_time_seconds)
                   .Time(row.received_at)
                   .OptionalBool(row.replica_ok)
                   .Double(row.outlier_score)
                   .Double(row.step_time_z)
                   .rc();
      if (rc == SQLITE_OK) rc = StepToDone(stmt);
      if (rc != SQLITE_DONE) {
        return SqlError(rc, absl::StrFormat("upsert rank_steps job %s step %d rank %d",
                                            Quote(write.job), write.step, row.rank));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// Reads columns 0..14 of a rank_steps row in kRankRows' order.
void ReadRankRow(sqlite3_stmt* stmt, RankRow* row) {
  row->rank = ColumnU32(stmt, 0);
  row->attempt = ColumnU32(stmt, 1);
  row->join_size = ColumnU32(stmt, 2);
  row->loss = ColumnDouble(stmt, 3);
  row->grad_norm = ColumnDouble(stmt, 4);
  row->grad_cosine = ColumnOptionalDouble(stmt, 5);
  row->loss_z = ColumnOptionalDouble(stmt, 6);
  row->grad_norm_z = ColumnOptionalDouble(stmt, 7);
  row->reduced_grad_fingerprint = ColumnOptionalBits(stmt, 8);
  row->param_fingerprint = ColumnOptionalBits(stmt, 9);
  row->step_time_seconds = ColumnOptionalDouble(stmt, 10);
  row->received_at = ColumnTime(stmt, 11);
  if (!IsNull(stmt, 12)) row->replica_ok = ColumnInt(stmt, 12) != 0;
  row->outlier_score = ColumnOptionalDouble(stmt, 13);
  row->step_time_z = ColumnOptionalDouble(stmt, 14);
}

}  // namespace

absl::StatusOr<std::vector<JobRow>> SqliteStore::ListJobs() {
  sqlite3_stmt* stmt = stmts_->list_jobs.get();
  ScopedReset reset(stmt);
  std::vector<JobRow> jobs;
  int rc;
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    JobRow& row = jobs.emplace_back();
    row.job = ColumnText(stmt, 0);
    row.world_size = ColumnU32(stmt, 1);
    row.sketch_dim = ColumnU32(stmt, 2);
    row.sketch_seed = ColumnBits(stmt, 3);
    row.first_seen = ColumnTime(stmt, 4);
    row.last_seen = ColumnTime(stmt, 5);
    row.last_step = static_cast<uint64_t>(ColumnInt(stmt, 6));
    row.attempt = ColumnU32(stmt, 7);
  }
  if (rc != SQLITE_DONE) return SqlError(rc, "list jobs");
  return jobs;
}

absl::StatusOr<std::vector<StepRow>> SqliteStore::RecentSteps(absl::string_view job, int limit) {
  if (limit < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("RecentSteps: limit %d < 0", limit));
  }
  sqlite3_stmt* stmt = stmts_->recent_steps.get();
  ScopedReset reset(stmt);
  std::vector<StepRow> steps;
  int rc = Binder(stmt).Text(job).Int(limit).rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      StepRow& row = steps.emplace_back();
      if (!ReadStepRow(stmt, &row)) return BadMissingRanks(job, row.step);
    }
  }
  if (rc != SQLITE_DONE) return SqlError(rc, absl::StrCat("recent steps of job ", Quote(job)));
  return steps;
}

absl::StatusOr<std::optional<StepRow>> SqliteStore::GetStep(absl::string_view job, uint64_t step) {
  if (step > static_cast<uint64_t>(kMaxStep)) return std::optional<StepRow>();
  sqlite3_stmt* stmt = stmts_->get_step.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt).Text(job).Int(static_cast<int64_t>(step)).rc();
  if (rc == SQLITE_OK) rc = sqlite3_step(stmt);
  if (rc == SQLITE_DONE) return std::optional<StepRow>();
  if (rc != SQLITE_ROW) {
    return SqlError(rc, absl::StrFormat("get step %d of job %s", step, Quote(job)));
  }
  StepRow row;
  if (!ReadStepRow(stmt, &row)) return BadMissingRanks(job, step);
  return std::optional<StepRow>(std::move(row));
}

absl::StatusOr<std::vector<RankRow>> SqliteStore::RankRows(absl::string_view job, uint64_t step) {
  std::vector<RankRow> ranks;
  if (step > static_cast<uint64_t>(kMaxStep)) return ranks;
  sqlite3_stmt* stmt = stmts_->rank_rows.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt).Text(job).Int(static_cast<int64_t>(step)).rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      ReadRankRow(stmt, &ranks.emplace_back());
    }
  }
  if (rc != SQLITE_DONE) {
    return SqlError(rc, absl::StrFormat("rank rows of job %s step %d", Quote(job), step));
  }
  return ranks;
}

absl::Status SqliteStore::QueryStepRange(sqlite3_stmt* stmt, absl::string_view job,
                                         uint64_t first_step, uint64_t last_step, int limit,
                                         absl::string_view what,
                                         absl::FunctionRef<absl::Status(sqlite3_stmt*)> read_row) {
  if (limit < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: limit %d < 0", what, limit));
  }
  if (first_step > static_cast<uint64_t>(kMaxStep) || first_step > last_step) {
    return absl::OkStatus();  // matches nothing
  }
  last_step = std::min(last_step, static_cast<uint64_t>(kMaxStep));
  ScopedReset reset(stmt);
  int rc = Binder(stmt)
               .Text(job)
               .Int(static_cast<int64_t>(first_step))
               .Int(static_cast<int64_t>(last_step))
               .Int(limit)
               .rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      absl::Status row = read_row(stmt);
      if (!row.ok()) return row;
    }
  }
  if (rc != SQLITE_DONE) {
    return SqlError(
        rc, absl::StrFormat("%s of job %s steps %d..%d", what, Quote(job), first_step, last_step));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepRow>> SqliteStore::StepRange(absl::string_view job,
                                                            uint64_t first_step, uint64_t last_step,
                                                            int limit) {
  std::vector<StepRow> steps;
  absl::Status status = QueryStepRange(
      stmts_->step_range.get(), job, first_step, last_step, limit, "StepRange",
      [&](sqlite3_stmt* stmt) {
        StepRow& row = steps.emplace_back();
        return ReadStepRow(stmt, &row) ? absl::OkStatus() : BadMissingRanks(job, row.step);
      });
  if (!status.ok()) return status;
  return steps;
}

absl::StatusOr<std::vector<StepRankRow>> SqliteStore::RankRowsInRange(absl::string_view job,
                                                                      uint64_t first_step,
                                                                      uint64_t last_step,
                                                                      int limit) {
  std::vector<StepRankRow> rows;
  absl::Status status = QueryStepRange(stmts_->rank_rows_in_range.get(), job, first_step, last_step,
                                       limit, "RankRowsInRange", [&](sqlite3_stmt* stmt) {
                                         StepRankRow& row = rows.emplace_back();
                                         ReadRankRow(stmt, &row.row);
                                         row.step = static_cast<uint64_t>(ColumnInt(stmt, 15));
                                         row.nonfinite = ColumnInt(stmt, 16) != 0;
                                         return absl::OkStatus();
                                       });
  if (!status.ok()) return status;
  return rows;
}

absl::StatusOr<std::vector<StepRankRow>> SqliteStore::RankSeriesInRange(
    absl::string_view job, uint32_t rank, uint64_t first_step, uint64_t last_step, int limit) {
  if (limit < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("RankSeriesInRange: limit %d < 0", limit));
  }
  std::vector<StepRankRow> rows;
  if (first_step > static_cast<uint64_t>(kMaxStep) || first_step > last_step) return rows;
  last_step = std::min(last_step, static_cast<uint64_t>(kMaxStep));
  sqlite3_stmt* stmt = stmts_->rank_series_in_range.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt)
               .Text(job)
               .Int(static_cast<int64_t>(first_step))
               .Int(static_cast<int64_t>(last_step))
               .Int(limit)
               .Int(rank)
               .rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      StepRankRow& row = rows.emplace_back();
      ReadRankRow(stmt, &row.row);
      row.step = static_cast<uint64_t>(ColumnInt(stmt, 15));
      row.nonfinite = ColumnInt(stmt, 16) != 0;
    }
  }
  if (rc != SQLITE_DONE) {
    return SqlError(rc, absl::StrFormat("rank %d of job %s steps %d..%d", rank, Quote(job),
                                        first_step, last_step));
  }
  return rows;
}

absl::StatusOr<int64_t> SqliteStore::CountRankRows(absl::string_view job) {
  sqlite3_stmt* stmt = stmts_->count_rank_rows.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt).Text(job).rc();
  if (rc == SQLITE_OK) rc = sqlite3_step(stmt);
  if (rc != SQLITE_ROW) return SqlError(rc, absl::StrCat("count rank rows of job ", Quote(job)));
  return ColumnInt(stmt, 0);
}

absl::Status SqliteStore::BadMissingRanks(absl::string_view job, uint64_t step) const {
  return absl::DataLossError(
      absl::StrFormat("sqlite_store %s: job %s step %d: missing_ranks is not a list of ranks",
                      path_, Quote(job), step));
}

}  // namespace rankscope::collector
