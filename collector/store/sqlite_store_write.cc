// SqliteStore's write path: Write (one transaction per batch) and the upserts it runs.
#include <sqlite3.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collector/store/sqlite_statement.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/sqlite_store_statements.h"

namespace rankscope::collector {

using sqlite::Binder;
using sqlite::kMaxStoredStep;
using sqlite::Quote;
using sqlite::ScopedReset;
using sqlite::StepToDone;

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
                       outlier_score, step_time_z, deviating_buckets, bucket_norms, bucket_z)
VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20,
       ?21)
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
  step_time_z = excluded.step_time_z,
  deviating_buckets = excluded.deviating_buckets,
  bucket_norms = excluded.bucket_norms,
  bucket_z = excluded.bucket_z
WHERE excluded.attempt > rank_steps.attempt
   OR (excluded.attempt = rank_steps.attempt AND excluded.join_size >= rank_steps.join_size)
)sql";

constexpr char kUpsertStep[] = R"sql(
INSERT INTO step_stats(job, step, attempt, ranks, world_size, loss_mean, loss_std, loss_range,
                       grad_norm_mean, grad_norm_std, grad_norm_cv, grad_cosine_mean,
                       missing_ranks, timed_out, completed_at, grad_noise_scale,
                       replica_checked, replica_divergent_ranks, outlier_ranks,
                       duplicate_groups, drifting_ranks, slow_ranks, integrity_error_ratio,
                       integrity_relative_error, integrity_fault, integrity_rank,
                       integrity_weight)
VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20,
       ?21, ?22, ?23, ?24, ?25, ?26, ?27)
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
  slow_ranks = excluded.slow_ranks,
  integrity_error_ratio = excluded.integrity_error_ratio,
  integrity_relative_error = excluded.integrity_relative_error,
  integrity_fault = excluded.integrity_fault,
  integrity_rank = excluded.integrity_rank,
  integrity_weight = excluded.integrity_weight
WHERE excluded.attempt > step_stats.attempt
   OR (excluded.attempt = step_stats.attempt AND excluded.ranks >= step_stats.ranks)
)sql";

std::string JoinRanks(const std::vector<uint32_t>& ranks) { return absl::StrJoin(ranks, ","); }

// Each Upsert* binds one row to its (reset) statement and steps it: returns SQLITE_DONE or the
// error code. Bound text must outlive the step, so each keeps what it formats until then.
int UpsertJob(sqlite3_stmt* stmt, const JobRow& job) {
  const int rc = Binder(stmt)
                     .Text(job.job)
                     .Int(job.world_size)
                     .Int(job.sketch_dim)
                     .Bits(job.sketch_seed)
                     .Time(job.first_seen)
                     .Time(job.last_seen)
                     .Int(static_cast<int64_t>(job.last_step))
                     .Int(job.attempt)
                     .rc();
  return rc == SQLITE_OK ? StepToDone(stmt) : rc;
}

int UpsertRankIdentity(sqlite3_stmt* stmt, const RankIdentityRow& who) {
  Binder b(stmt);
  b.Text(who.job).Int(who.rank);
  if (who.global_rank) {
    b.Int(*who.global_rank);
  } else {
    b.Null();
  }
  const int rc =
      b.Text(who.host).Text(who.instance_id).Int(who.pid).Int(who.attempt).Time(who.seen).rc();
  return rc == SQLITE_OK ? StepToDone(stmt) : rc;
}

int UpsertStep(sqlite3_stmt* stmt, const std::string& job, const StepRow& row) {
  const std::string divergent = JoinRanks(row.replica_divergent_ranks);
  const std::string outliers = JoinRanks(row.outlier_ranks);
  const std::string drifting = JoinRanks(row.drifting_ranks);
  const std::string slow = JoinRanks(row.slow_ranks);
  Binder b(stmt);
  b.Text(job)
      .Int(static_cast<int64_t>(row.step))
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
      .Double(row.integrity_error_ratio)
      .Double(row.integrity_relative_error)
      .Text(row.integrity_fault);
  if (row.integrity_rank) {
    b.Int(*row.integrity_rank);
  } else {
    b.Null();
  }
  const int rc = b.Double(row.integrity_weight).rc();
  return rc == SQLITE_OK ? StepToDone(stmt) : rc;
}

int UpsertRank(sqlite3_stmt* stmt, const std::string& job, uint64_t step, const RankRow& row) {
  const bool nonfinite = row.sketch_nonfinite || (!row.loss_absent && !std::isfinite(row.loss)) ||
                         !std::isfinite(row.grad_norm);
  const int rc = Binder(stmt)
                     .Text(job)
                     .Int(static_cast<int64_t>(step))
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
                     .Text(row.deviating_buckets)
                     .Floats(row.bucket_norms)
                     .Floats(row.bucket_z)
                     .rc();
  return rc == SQLITE_OK ? StepToDone(stmt) : rc;
}

absl::Status ValidateBatch(const StoreBatch& batch) {
  for (const JobRow& job : batch.jobs) {
    if (job.last_step > static_cast<uint64_t>(kMaxStoredStep)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "job %s: last_step %d > INT64_MAX cannot be stored", Quote(job.job), job.last_step));
    }
  }
  for (const StepWrite& write : batch.steps) {
    if (write.step > static_cast<uint64_t>(kMaxStoredStep)) {
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

absl::StatusOr<sqlite::WriteStatements> sqlite::WriteStatements::Prepare(sqlite3* db,
                                                                         const std::string& path) {
  WriteStatements statements;
  if (absl::Status s = PreparePersistent(db, path,
                                         {{&statements.upsert_job, kUpsertJob},
                                          {&statements.upsert_rank_identity, kUpsertRankIdentity},
                                          {&statements.upsert_rank, kUpsertRank},
                                          {&statements.upsert_step, kUpsertStep}});
      !s.ok()) {
    return s;
  }
  return statements;
}

absl::Status SqliteStore::Write(const StoreBatch& batch) {
  if (batch.empty()) return absl::OkStatus();
  if (absl::Status s = ValidateBatch(batch); !s.ok()) return s;
  return InTransaction([&] { return WriteRows(batch); });
}

absl::Status SqliteStore::WriteRows(const StoreBatch& batch) {
  const sqlite::WriteStatements& stmts = stmts_->write;
  // Runs one upsert (`bind_and_step` returns SQLITE_DONE or the error code); an error names
  // what(). The statement is reset after the error's message is read.
  auto upsert = [&](sqlite3_stmt* stmt, auto bind_and_step, auto what) -> absl::Status {
    ScopedReset reset(stmt);
    const int rc = bind_and_step(stmt);
    if (rc != SQLITE_DONE) return SqlError(rc, what());
    return absl::OkStatus();
  };
  for (const JobRow& job : batch.jobs) {
    if (absl::Status s = upsert(
            stmts.upsert_job.get(), [&](sqlite3_stmt* stmt) { return UpsertJob(stmt, job); },
            [&] { return absl::StrCat("upsert jobs ", Quote(job.job)); });
        !s.ok()) {
      return s;
    }
  }
  for (const RankIdentityRow& who : batch.rank_identities) {
    if (absl::Status s = upsert(
            stmts.upsert_rank_identity.get(),
            [&](sqlite3_stmt* stmt) { return UpsertRankIdentity(stmt, who); },
            [&] { return absl::StrCat("upsert rank_identities ", Quote(who.job)); });
        !s.ok()) {
      return s;
    }
  }
  for (const StepWrite& write : batch.steps) {
    if (write.stats.has_value()) {
      if (absl::Status s = upsert(
              stmts.upsert_step.get(),
              [&](sqlite3_stmt* stmt) { return UpsertStep(stmt, write.job, *write.stats); },
              [&] {
                return absl::StrFormat("upsert step_stats job %s step %d", Quote(write.job),
                                       write.step);
              });
          !s.ok()) {
        return s;
      }
    }
    for (const RankRow& row : write.ranks) {
      if (absl::Status s = upsert(
              stmts.upsert_rank.get(),
              [&](sqlite3_stmt* stmt) { return UpsertRank(stmt, write.job, write.step, row); },
              [&] {
                return absl::StrFormat("upsert rank_steps job %s step %d rank %d", Quote(write.job),
                                       write.step, row.rank);
              });
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace rankscope::collector
