// SqliteStore's storage lifecycle: usage, job extents, downsampling into rank_windows, dropping
// old steps and incremental vacuum. The policy is retention.h; this file only executes its
// actions, each in one short transaction. (The reads of rank_windows are in sqlite_store_read.cc
// with the other reads; Usage and JobExtents, the policy's inputs, stay here.)
#include <sqlite3.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/store/sqlite_statement.h"
#include "collector/store/sqlite_store.h"
#include "common/crash_point.h"

namespace rankscope::collector {

using sqlite::Binder;
using sqlite::ColumnDouble;
using sqlite::ColumnInt;
using sqlite::ColumnOptionalDouble;
using sqlite::ColumnText;
using sqlite::ColumnTime;
using sqlite::ColumnU32;
using sqlite::IsNull;
using sqlite::Quote;
using sqlite::StepToDone;
using sqlite::Stmt;

namespace {

constexpr int64_t kMaxStep = std::numeric_limits<int64_t>::max();

int64_t ClampStep(uint64_t step) {
  return step > static_cast<uint64_t>(kMaxStep) ? kMaxStep : static_cast<int64_t>(step);
}

// Flagged rank rows outlive the per-rank retention (DESIGN.md "Storage lifecycle"): the row of a
// rank that was non-finite, scored as an outlier or failed its replica check at that step, or
// that its step's step_stats names as a (persistent) outlier, divergent, drifting or slow rank, or
// as the rank the aggregation check named. The other rows of a flagged step are downsampled like
// any (the step's statistics stay in step_stats): keeping whole steps would keep every row of a job
// with one chronic straggler. Missing ranks have no row to keep; step_stats.missing_ranks names
// them. ?1 job, ?4 outlier threshold; evaluated on a rank_steps row.
constexpr char kRowIsFlagged[] = R"sql(
  (rank_steps.nonfinite <> 0 OR coalesce(rank_steps.outlier_score >= ?4, 0) OR
   coalesce(rank_steps.replica_ok = 0, 0) OR
   EXISTS (SELECT 1 FROM step_stats s WHERE s.job = ?1 AND s.step = rank_steps.step AND
     instr(',' || s.outlier_ranks || ',' || s.replica_divergent_ranks || ',' ||
           s.drifting_ranks || ',' || s.slow_ranks || ',' || coalesce(s.integrity_rank, '') ||
           ',', ',' || rank_steps.rank || ',') > 0))
)sql";

// The rank_steps columns a window summarises as count, sum, min and max (rank_windows.h).
constexpr const char* kWindowMetrics[] = {"loss", "grad_norm", "grad_cosine", "outlier_score"};

// Folds rank_steps rows of steps ?2..?3 into their windows of ?4 steps (rank_windows.h); a
// window row already there (an earlier batch of the same window) is merged exactly: counts and
// sums add, minima and maxima combine, a NULL (no finite value yet) yields to the other side.
const std::string& FoldIntoWindowsSql() {
  static const std::string* const sql = [] {
    std::string columns, aggregates, merges;
    for (const char* m : kWindowMetrics) {
      absl::StrAppend(&columns, ", ", m, "_n, ", m, "_sum, ", m, "_min, ", m, "_max");
      absl::StrAppend(&aggregates, ", count(", m, "), sum(", m, "), min(", m, "), max(", m, ")");
      absl::StrAppend(&merges, "  ", m, "_n = ", m, "_n + excluded.", m, "_n,\n");
      absl::StrAppend(&merges, "  ", m, "_sum = coalesce(", m, "_sum + excluded.", m, "_sum, ", m,
                      "_sum, excluded.", m, "_sum),\n");
      for (const char* op : {"min", "max"}) {
        absl::StrAppend(&merges, "  ", m, "_", op, " = coalesce(", op, "(", m, "_", op,
                        ", excluded.", m, "_", op, "), ", m, "_", op, ", excluded.", m, "_", op,
                        "),\n");
      }
    }
    return new std::string(absl::StrCat(
        "INSERT INTO rank_windows(job, first_step, rank, last_step, rows, first_received, "
        "last_received",
        columns, ", nonfinite, outliers, replica_bad)\n",
        "SELECT ?1, (step / ?4) * ?4, rank, (step / ?4) * ?4 + ?4 - 1, count(*), "
        "min(received_at), max(received_at)",
        aggregates,
        ", sum(nonfinite <> 0), sum(coalesce(outlier_score >= ?5, 0)), "
        "sum(coalesce(replica_ok = 0, 0))\n"
        "FROM rank_steps WHERE job = ?1 AND step >= ?2 AND step <= ?3\n"
        "GROUP BY step / ?4, rank\n"
        "ON CONFLICT(job, first_step, rank) DO UPDATE SET\n"
        "  rows = rows + excluded.rows,\n"
        "  first_received = min(first_received, excluded.first_received),\n"
        "  last_received = max(last_received, excluded.last_received),\n",
        merges,
        "  nonfinite = nonfinite + excluded.nonfinite,\n"
        "  outliers = outliers + excluded.outliers,\n"
        "  replica_bad = replica_bad + excluded.replica_bad\n"));
  }();
  return *sql;
}

}  // namespace

namespace {

// A statement prepared for one use (retention runs a few per transaction; preparing costs
// microseconds beside the rows it touches).
struct OneShot {
  Stmt stmt;
  int rc = SQLITE_OK;
  OneShot(sqlite3* db, const char* sql) {
    sqlite3_stmt* raw = nullptr;
    rc = sqlite3_prepare_v2(db, sql, -1, &raw, nullptr);
    stmt.reset(raw);
  }
  sqlite3_stmt* get() const { return stmt.get(); }
};

}  // namespace

absl::StatusOr<StoreUsage> SqliteStore::Usage() {
  StoreUsage usage;
  const struct {
    const char* sql;
    int64_t* into;
  } kPragmas[] = {{"PRAGMA page_size", &usage.page_size},
                  {"PRAGMA page_count", &usage.page_count},
                  {"PRAGMA freelist_count", &usage.freelist_count}};
  for (const auto& p : kPragmas) {
    OneShot q(db_, p.sql);
    int rc = q.rc == SQLITE_OK ? sqlite3_step(q.get()) : q.rc;
    if (rc != SQLITE_ROW) return SqlError(rc, p.sql);
    *p.into = ColumnInt(q.get(), 0);
  }
  return usage;
}

absl::StatusOr<std::vector<JobExtent>> SqliteStore::JobExtents() {
  std::vector<JobExtent> jobs;
  std::vector<int64_t> next_steps;
  {
    OneShot q(db_,
              "SELECT j.job, j.world_size, j.last_step, j.last_seen, coalesce(d.next_step, 0) "
              "FROM jobs j LEFT JOIN downsampled d ON d.job = j.job ORDER BY j.job");
    int rc = q.rc;
    if (rc == SQLITE_OK) {
      while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
        JobExtent& j = jobs.emplace_back();
        j.job = ColumnText(q.get(), 0);
        j.world_size = ColumnU32(q.get(), 1);
        j.newest_step = static_cast<uint64_t>(ColumnInt(q.get(), 2));
        j.last_seen = ColumnTime(q.get(), 3);
        next_steps.push_back(ColumnInt(q.get(), 4));
      }
    }
    if (rc != SQLITE_DONE) return SqlError(rc, "job extents");
  }
  OneShot oldest_rank(db_,
                      "SELECT step, max(received_at) FROM rank_steps WHERE job = ?1 AND step = "
                      "(SELECT min(step) FROM rank_steps WHERE job = ?1 AND step >= ?2)");
  OneShot oldest_step(db_,
                      "SELECT step, completed_at FROM step_stats WHERE job = ?1 ORDER BY step "
                      "LIMIT 1");
  if (oldest_rank.rc != SQLITE_OK) return SqlError(oldest_rank.rc, "prepare oldest rank row");
  if (oldest_step.rc != SQLITE_OK) return SqlError(oldest_step.rc, "prepare oldest step");
  for (size_t i = 0; i < jobs.size(); ++i) {
    JobExtent& j = jobs[i];
    {
      sqlite::ScopedReset reset(oldest_rank.get());
      int rc = Binder(oldest_rank.get()).Text(j.job).Int(next_steps[i]).rc();
      if (rc == SQLITE_OK) rc = sqlite3_step(oldest_rank.get());
      if (rc != SQLITE_ROW) return SqlError(rc, absl::StrCat("oldest rank row of ", Quote(j.job)));
      if (!IsNull(oldest_rank.get(), 0)) {
        j.oldest_rank_step = static_cast<uint64_t>(ColumnInt(oldest_rank.get(), 0));
        j.oldest_rank_time = ColumnTime(oldest_rank.get(), 1);
      }
    }
    {
      sqlite::ScopedReset reset(oldest_step.get());
      int rc = Binder(oldest_step.get()).Text(j.job).rc();
      if (rc == SQLITE_OK) rc = sqlite3_step(oldest_step.get());
      if (rc == SQLITE_ROW) {
        j.oldest_step = static_cast<uint64_t>(ColumnInt(oldest_step.get(), 0));
        j.oldest_step_time = ColumnTime(oldest_step.get(), 1);
      } else if (rc != SQLITE_DONE) {
        return SqlError(rc, absl::StrCat("oldest step of ", Quote(j.job)));
      }
    }
  }
  return jobs;
}

absl::StatusOr<SqliteStore::PruneResult> SqliteStore::Prune(const PruneAction& action,
                                                            uint32_t window_steps,
                                                            double outlier_threshold) {
  switch (action.kind) {
    case PruneAction::Kind::kDownsample:
      return Downsample(action, window_steps, outlier_threshold);
    case PruneAction::Kind::kDropSteps:
      return DropSteps(action);
    case PruneAction::Kind::kVacuum:
      return IncrementalVacuum(action.vacuum_pages);
    case PruneAction::Kind::kNone:
      break;
  }
  return PruneResult();
}

// Long: one retention transaction's statements in order (read the batch's rank rows, fold them into
// windows, upsert the windows, delete the folded rows, move the job's mark), sharing the open
// transaction and the counts.
absl::StatusOr<SqliteStore::PruneResult> SqliteStore::Downsample(const PruneAction& action,
                                                                 uint32_t window_steps,
                                                                 double outlier_threshold) {
  PruneResult result;
  const int64_t window = window_steps == 0 ? 1 : window_steps;
  absl::Status status = InTransaction([&]() -> absl::Status {
    int64_t first = 0;
    {
      OneShot q(db_, "SELECT next_step FROM downsampled WHERE job = ?1");
      int rc = q.rc == SQLITE_OK ? Binder(q.get()).Text(action.job).rc() : q.rc;
      if (rc == SQLITE_OK) rc = sqlite3_step(q.get());
      if (rc == SQLITE_ROW) {
        first = ColumnInt(q.get(), 0);
      } else if (rc != SQLITE_DONE) {
        return SqlError(rc, "downsampled");
      }
    }
    // The batch: the oldest steps whose rows were all received before the cutoff, in order.
    int64_t last = -1;
    {
      OneShot q(db_,
                "SELECT step, max(received_at) FROM rank_steps WHERE job = ?1 AND step >= ?2 AND "
                "step <= ?3 GROUP BY step ORDER BY step LIMIT ?4");
      int rc = q.rc == SQLITE_OK ? Binder(q.get())
                                       .Text(action.job)
                                       .Int(first)
                                       .Int(ClampStep(action.max_step))
                                       .Int(std::max<int64_t>(action.max_steps, 1))
                                       .rc()
                                 : q.rc;
      if (rc == SQLITE_OK) {
        while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
          if (!(ColumnTime(q.get(), 1) < action.cutoff)) break;
          last = ColumnInt(q.get(), 0);
          ++result.steps;
        }
      }
      if (rc != SQLITE_ROW && rc != SQLITE_DONE) return SqlError(rc, "downsample batch");
    }
    if (last < 0) return absl::OkStatus();
    {
      OneShot q(db_, FoldIntoWindowsSql().c_str());
      int rc = q.rc == SQLITE_OK ? Binder(q.get())
                                       .Text(action.job)
                                       .Int(first)
                                       .Int(last)
                                       .Int(window)
                                       .Double(outlier_threshold)
                                       .rc()
                                 : q.rc;
      if (rc == SQLITE_OK) rc = StepToDone(q.get());
      if (rc != SQLITE_DONE) return SqlError(rc, "fold rank_steps into rank_windows");
      result.windows_written = sqlite3_changes(db_);
    }
    {
      const std::string sql =
          absl::StrCat("DELETE FROM rank_steps WHERE job = ?1 AND step >= ?2 AND step <= ?3 AND ",
                       "NOT ", kRowIsFlagged);
      OneShot q(db_, sql.c_str());
      int rc =
          q.rc == SQLITE_OK
              ? Binder(q.get()).Text(action.job).Int(first).Int(last).Double(outlier_threshold).rc()
              : q.rc;
      if (rc == SQLITE_OK) rc = StepToDone(q.get());
      if (rc != SQLITE_DONE) return SqlError(rc, "delete downsampled rank_steps");
      result.rank_rows = sqlite3_changes(db_);
    }
    // Folded and deleted, not committed, `downsampled` not advanced (testing only).
    CrashPointForTesting("store_downsample_fold");
    {
      OneShot q(db_,
                "SELECT count(*) FROM rank_steps WHERE job = ?1 AND step >= ?2 AND step <= ?3");
      int rc =
          q.rc == SQLITE_OK ? Binder(q.get()).Text(action.job).Int(first).Int(last).rc() : q.rc;
      if (rc == SQLITE_OK) rc = sqlite3_step(q.get());
      if (rc != SQLITE_ROW) return SqlError(rc, "count kept rank_steps");
      result.rank_rows_kept = ColumnInt(q.get(), 0);
    }
    OneShot q(db_,
              "INSERT INTO downsampled(job, next_step) VALUES(?1, ?2) ON CONFLICT(job) DO UPDATE "
              "SET next_step = max(next_step, excluded.next_step)");
    int rc = q.rc == SQLITE_OK ? Binder(q.get()).Text(action.job).Int(last + 1).rc() : q.rc;
    if (rc == SQLITE_OK) rc = StepToDone(q.get());
    if (rc != SQLITE_DONE) return SqlError(rc, "update downsampled");
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<SqliteStore::PruneResult> SqliteStore::DropSteps(const PruneAction& action) {
  PruneResult result;
  absl::Status status = InTransaction([&]() -> absl::Status {
    const auto run = [&](const char* sql, int64_t through, int64_t* changes) -> absl::Status {
      OneShot q(db_, sql);
      int rc = q.rc == SQLITE_OK ? Binder(q.get()).Text(action.job).Int(through).rc() : q.rc;
      if (rc == SQLITE_OK) rc = StepToDone(q.get());
      if (rc != SQLITE_DONE) return SqlError(rc, sql);
      if (changes != nullptr) *changes += sqlite3_changes(db_);
      return absl::OkStatus();
    };
    int64_t last = -1;
    bool any_step = false;
    {
      OneShot q(db_,
                "SELECT step, completed_at FROM step_stats WHERE job = ?1 AND step <= ?2 ORDER BY "
                "step LIMIT ?3");
      int rc = q.rc == SQLITE_OK ? Binder(q.get())
                                       .Text(action.job)
                                       .Int(ClampStep(action.max_step))
                                       .Int(std::max<int64_t>(action.max_steps, 1))
                                       .rc()
                                 : q.rc;
      if (rc == SQLITE_OK) {
        while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
          any_step = true;
          if (!(ColumnTime(q.get(), 1) < action.cutoff)) break;
          last = ColumnInt(q.get(), 0);
          ++result.steps;
        }
      }
      if (rc != SQLITE_ROW && rc != SQLITE_DONE) return SqlError(rc, "drop steps batch");
    }
    if (last >= 0) {
      if (absl::Status s =
              run("DELETE FROM rank_steps WHERE job = ?1 AND step <= ?2", last, &result.rank_rows);
          !s.ok()) {
        return s;
      }
      if (absl::Status s =
              run("DELETE FROM step_stats WHERE job = ?1 AND step <= ?2", last, &result.step_rows);
          !s.ok()) {
        return s;
      }
      if (absl::Status s = run("DELETE FROM rank_windows WHERE job = ?1 AND first_step <= ?2 AND "
                               "last_step <= ?2",
                               last, &result.window_rows);
          !s.ok()) {
        return s;
      }
      // The steps' rows deleted, not committed (testing only).
      CrashPointForTesting("store_drop_steps");
      return run("UPDATE downsampled SET next_step = max(next_step, ?2 + 1) WHERE job = ?1", last,
                 nullptr);
    }
    if (any_step || action.reason != PruneReason::kAge) return absl::OkStatus();
    // No step left: forget the job if it was last seen before the cutoff (retention.h rule 2).
    {
      OneShot q(db_, "SELECT last_seen FROM jobs WHERE job = ?1");
      int rc = q.rc == SQLITE_OK ? Binder(q.get()).Text(action.job).rc() : q.rc;
      if (rc == SQLITE_OK) rc = sqlite3_step(q.get());
      if (rc == SQLITE_DONE) return absl::OkStatus();
      if (rc != SQLITE_ROW) return SqlError(rc, "jobs.last_seen");
      if (!(ColumnTime(q.get(), 0) < action.cutoff)) return absl::OkStatus();
    }
    const int64_t all = kMaxStep;
    for (const auto& [sql, changes] : std::vector<std::pair<const char*, int64_t*>>{
             {"DELETE FROM rank_steps WHERE job = ?1 AND step <= ?2", &result.rank_rows},
             {"DELETE FROM rank_windows WHERE job = ?1 AND first_step <= ?2", &result.window_rows},
             {"DELETE FROM downsampled WHERE job = ?1 AND ?2 >= 0", nullptr},
             {"DELETE FROM rank_identities WHERE job = ?1 AND ?2 >= 0", nullptr},
             {"DELETE FROM jobs WHERE job = ?1 AND ?2 >= 0", &result.job_rows}}) {
      if (absl::Status s = run(sql, all, changes); !s.ok()) return s;
    }
    result.steps = 1;  // progress: the job is gone
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<SqliteStore::PruneResult> SqliteStore::IncrementalVacuum(int64_t pages) {
  PruneResult result;
  auto before = Usage();
  if (!before.ok()) return before.status();
  const std::string sql =
      absl::StrFormat("PRAGMA incremental_vacuum(%d)", std::max<int64_t>(pages, 1));
  OneShot q(db_, sql.c_str());
  int rc = q.rc;
  if (rc == SQLITE_OK) {
    while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
      // One page moved, the vacuum's transaction not committed (testing only).
      CrashPointForTesting("store_incremental_vacuum");
    }
  }
  if (rc != SQLITE_DONE) return SqlError(rc, sql);
  auto after = Usage();
  if (!after.ok()) return after.status();
  result.pages_vacuumed = before->page_count - after->page_count;
  result.steps = result.pages_vacuumed > 0 ? 1 : 0;
  return result;
}

}  // namespace rankscope::collector
