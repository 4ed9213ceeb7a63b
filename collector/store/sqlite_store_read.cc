// SqliteStore's read path: jobs, steps, rank rows, rank windows and the downsampled watermark,
// each a prepared statement.
#include <sqlite3.h>

#include <algorithm>
#include <cstdint>
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
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "collector/model/rank_ranges.h"
#include "collector/store/sqlite_statement.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/sqlite_store_statements.h"

namespace rankscope::collector {

using sqlite::Binder;
using sqlite::ColumnBits;
using sqlite::ColumnDouble;
using sqlite::ColumnFloats;
using sqlite::ColumnInt;
using sqlite::ColumnOptionalBits;
using sqlite::ColumnOptionalDouble;
using sqlite::ColumnText;
using sqlite::ColumnTime;
using sqlite::ColumnU32;
using sqlite::IsNull;
using sqlite::kMaxStoredStep;
using sqlite::Quote;
using sqlite::ScopedReset;

namespace {

#define RANKSCOPE_WINDOW_COLUMNS                                                         \
  "first_step, last_step, rank, rows, first_received, last_received, loss_n, loss_sum, " \
  "loss_min, loss_max, grad_norm_n, grad_norm_sum, grad_norm_min, grad_norm_max, "       \
  "grad_cosine_n, grad_cosine_sum, grad_cosine_min, grad_cosine_max, outlier_score_n, "  \
  "outlier_score_sum, outlier_score_min, outlier_score_max, nonfinite, outliers, replica_bad"

#define RANKSCOPE_STEP_COLUMNS                                                                     \
  "step, attempt, ranks, world_size, loss_mean, loss_std, loss_range, grad_norm_mean, "            \
  "grad_norm_std, grad_norm_cv, grad_cosine_mean, missing_ranks, timed_out, completed_at, "        \
  "grad_noise_scale, replica_checked, replica_divergent_ranks, outlier_ranks, duplicate_groups, "  \
  "drifting_ranks, slow_ranks, integrity_error_ratio, integrity_relative_error, integrity_fault, " \
  "integrity_rank, integrity_weight"

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
    "outlier_score, step_time_z, deviating_buckets FROM rank_steps WHERE job = ?1 AND step = ?2 "
    "ORDER BY rank";
constexpr char kCountRankRows[] = "SELECT count(*) FROM rank_steps WHERE job = ?1";
constexpr char kStepRange[] = "SELECT " RANKSCOPE_STEP_COLUMNS
                              " FROM step_stats WHERE job = ?1 AND step >= ?2 AND "
                              "step <= ?3 ORDER BY step LIMIT ?4";
constexpr char kRankRowsInRange[] =
    "SELECT rank, attempt, join_size, loss, grad_norm, grad_cosine, loss_z, grad_norm_z, "
    "reduced_grad_fingerprint, param_fingerprint, step_time_seconds, received_at, replica_ok, "
    "outlier_score, step_time_z, step, nonfinite, deviating_buckets FROM rank_steps WHERE job = ?1 "
    "AND step >= ?2 "
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
       r.received_at, r.replica_ok, r.outlier_score, r.step_time_z, r.step, r.nonfinite,
       r.deviating_buckets, r.bucket_z
FROM s CROSS JOIN rank_steps r ON r.job = ?1 AND r.step = s.step AND r.rank = ?5
ORDER BY r.step LIMIT ?4
)sql";
constexpr char kRankWindowsInRange[] =
    "SELECT " RANKSCOPE_WINDOW_COLUMNS
    " FROM rank_windows WHERE job = ?1 AND first_step <= ?3 AND last_step >= ?2 "
    "ORDER BY first_step, rank LIMIT ?4";
constexpr char kDownsampledBefore[] = "SELECT next_step FROM downsampled WHERE job = ?1";

#undef RANKSCOPE_STEP_COLUMNS
#undef RANKSCOPE_WINDOW_COLUMNS

int64_t ClampStep(uint64_t step) {
  return step > static_cast<uint64_t>(kMaxStoredStep) ? kMaxStoredStep : static_cast<int64_t>(step);
}

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
  row->integrity_error_ratio = ColumnOptionalDouble(stmt, 21);
  row->integrity_relative_error = ColumnOptionalDouble(stmt, 22);
  row->integrity_fault = ColumnText(stmt, 23);
  if (sqlite3_column_type(stmt, 24) != SQLITE_NULL) row->integrity_rank = ColumnU32(stmt, 24);
  row->integrity_weight = ColumnOptionalDouble(stmt, 25);
  RankRanges missing;
  return ParseRankRanges(row->missing_ranks, &missing) &&
         ParseRanks(ColumnText(stmt, 16), &row->replica_divergent_ranks) &&
         ParseRanks(ColumnText(stmt, 17), &row->outlier_ranks) &&
         ParseRanks(ColumnText(stmt, 19), &row->drifting_ranks) &&
         ParseRanks(ColumnText(stmt, 20), &row->slow_ranks);
}

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

void ReadStat(sqlite3_stmt* stmt, int col, WindowStat* stat) {
  stat->count = ColumnInt(stmt, col);
  stat->sum = IsNull(stmt, col + 1) ? 0.0 : ColumnDouble(stmt, col + 1);
  stat->min = ColumnOptionalDouble(stmt, col + 2);
  stat->max = ColumnOptionalDouble(stmt, col + 3);
}

}  // namespace

absl::StatusOr<sqlite::ReadStatements> sqlite::ReadStatements::Prepare(sqlite3* db,
                                                                       const std::string& path) {
  ReadStatements statements;
  if (absl::Status s = PreparePersistent(db, path,
                                         {{&statements.list_jobs, kListJobs},
                                          {&statements.recent_steps, kRecentSteps},
                                          {&statements.get_step, kGetStep},
                                          {&statements.rank_rows, kRankRows},
                                          {&statements.count_rank_rows, kCountRankRows},
                                          {&statements.step_range, kStepRange},
                                          {&statements.rank_rows_in_range, kRankRowsInRange},
                                          {&statements.rank_series_in_range, kRankSeriesInRange},
                                          {&statements.rank_windows_in_range, kRankWindowsInRange},
                                          {&statements.downsampled_before, kDownsampledBefore}});
      !s.ok()) {
    return s;
  }
  return statements;
}

absl::StatusOr<std::vector<JobRow>> SqliteStore::ListJobs() {
  sqlite3_stmt* stmt = stmts_->read.list_jobs.get();
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
  sqlite3_stmt* stmt = stmts_->read.recent_steps.get();
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
  if (step > static_cast<uint64_t>(kMaxStoredStep)) return std::optional<StepRow>();
  sqlite3_stmt* stmt = stmts_->read.get_step.get();
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
  if (step > static_cast<uint64_t>(kMaxStoredStep)) return ranks;
  sqlite3_stmt* stmt = stmts_->read.rank_rows.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt).Text(job).Int(static_cast<int64_t>(step)).rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      ReadRankRow(stmt, &ranks.emplace_back());
      ranks.back().deviating_buckets = ColumnText(stmt, 15);
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
  if (first_step > static_cast<uint64_t>(kMaxStoredStep) || first_step > last_step) {
    return absl::OkStatus();  // matches nothing
  }
  last_step = std::min(last_step, static_cast<uint64_t>(kMaxStoredStep));
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
      stmts_->read.step_range.get(), job, first_step, last_step, limit, "StepRange",
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
  absl::Status status =
      QueryStepRange(stmts_->read.rank_rows_in_range.get(), job, first_step, last_step, limit,
                     "RankRowsInRange", [&](sqlite3_stmt* stmt) {
                       StepRankRow& row = rows.emplace_back();
                       ReadRankRow(stmt, &row.row);
                       row.step = static_cast<uint64_t>(ColumnInt(stmt, 15));
                       row.nonfinite = ColumnInt(stmt, 16) != 0;
                       row.row.deviating_buckets = ColumnText(stmt, 17);
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
  if (first_step > last_step || first_step > static_cast<uint64_t>(kMaxStoredStep)) return rows;
  sqlite3_stmt* stmt = stmts_->read.rank_series_in_range.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt)
               .Text(job)
               .Int(ClampStep(first_step))
               .Int(ClampStep(last_step))
               .Int(limit)
               .Int(rank)
               .rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      StepRankRow& row = rows.emplace_back();
      ReadRankRow(stmt, &row.row);
      row.step = static_cast<uint64_t>(ColumnInt(stmt, 15));
      row.nonfinite = ColumnInt(stmt, 16) != 0;
      row.row.deviating_buckets = ColumnText(stmt, 17);
      row.row.bucket_z = ColumnFloats(stmt, 18);
    }
  }
  if (rc != SQLITE_DONE) {
    return SqlError(rc, absl::StrFormat("rank %d of job %s steps %d..%d", rank, Quote(job),
                                        first_step, last_step));
  }
  return rows;
}

absl::StatusOr<int64_t> SqliteStore::CountRankRows(absl::string_view job) {
  sqlite3_stmt* stmt = stmts_->read.count_rank_rows.get();
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

absl::StatusOr<std::vector<RankWindowRow>> SqliteStore::RankWindowsInRange(absl::string_view job,
                                                                           uint64_t first_step,
                                                                           uint64_t last_step,
                                                                           int limit) {
  if (limit < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("RankWindowsInRange: limit %d < 0", limit));
  }
  std::vector<RankWindowRow> rows;
  if (first_step > last_step || first_step > static_cast<uint64_t>(kMaxStoredStep)) return rows;
  sqlite3_stmt* stmt = stmts_->read.rank_windows_in_range.get();
  ScopedReset reset(stmt);
  int rc =
      Binder(stmt).Text(job).Int(ClampStep(first_step)).Int(ClampStep(last_step)).Int(limit).rc();
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      RankWindowRow& w = rows.emplace_back();
      sqlite3_stmt* s = stmt;
      w.first_step = static_cast<uint64_t>(ColumnInt(s, 0));
      w.last_step = static_cast<uint64_t>(ColumnInt(s, 1));
      w.rank = ColumnU32(s, 2);
      w.rows = ColumnInt(s, 3);
      w.first_received = ColumnTime(s, 4);
      w.last_received = ColumnTime(s, 5);
      ReadStat(s, 6, &w.loss);
      ReadStat(s, 10, &w.grad_norm);
      ReadStat(s, 14, &w.grad_cosine);
      ReadStat(s, 18, &w.outlier_score);
      w.nonfinite = ColumnInt(s, 22);
      w.outliers = ColumnInt(s, 23);
      w.replica_bad = ColumnInt(s, 24);
    }
  }
  if (rc != SQLITE_DONE) {
    return SqlError(rc, absl::StrFormat("rank windows of job %s steps %d..%d", Quote(job),
                                        first_step, last_step));
  }
  return rows;
}

absl::StatusOr<uint64_t> SqliteStore::DownsampledBefore(absl::string_view job) {
  sqlite3_stmt* stmt = stmts_->read.downsampled_before.get();
  ScopedReset reset(stmt);
  int rc = Binder(stmt).Text(job).rc();
  if (rc == SQLITE_OK) rc = sqlite3_step(stmt);
  if (rc == SQLITE_DONE) return uint64_t{0};
  if (rc != SQLITE_ROW) return SqlError(rc, absl::StrCat("downsampled of job ", Quote(job)));
  return static_cast<uint64_t>(ColumnInt(stmt, 0));
}

}  // namespace rankscope::collector
