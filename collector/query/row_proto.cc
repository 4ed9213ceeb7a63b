#include "collector/query/row_proto.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "collector/model/rank_ranges.h"

namespace rankscope::collector {
namespace {

// StepStats.missing_ranks lists at most this many (the rest: missing_rank_ranges, missing_count).
constexpr size_t kMaxListedMissingRanks = 1024;

}  // namespace

void FillStepSummary(const StepSummary& summary, v1::StepStats* out) {
  // Binding every field by name does not compile once StepSummary gains or loses one: a new
  // statistic is added here (and to v1::StepStats) before anything builds.
  const auto& [ranks, loss_mean, loss_std, loss_range, grad_norm_mean, grad_norm_std, grad_norm_cv,
               grad_cosine_mean] = summary;
  out->set_ranks(ranks);
  out->set_loss_mean(loss_mean);
  out->set_loss_std(loss_std);
  out->set_loss_range(loss_range);
  out->set_grad_norm_mean(grad_norm_mean);
  out->set_grad_norm_std(grad_norm_std);
  out->set_grad_norm_cv(grad_norm_cv);
  out->set_grad_cosine_mean(grad_cosine_mean);
}

void FillStepStats(const StepRow& row, v1::StepStats* s) {
  s->set_step(row.step);
  FillStepSummary(row, s);
  // The stored text was checked when read (ReadStepRow).
  RankRanges missing;
  if (ParseRankRanges(row.missing_ranks, &missing)) {
    const std::vector<uint32_t> listed = ListedRanks(missing, kMaxListedMissingRanks);
    s->mutable_missing_ranks()->Add(listed.begin(), listed.end());
  }
  s->set_missing_rank_ranges(row.missing_ranks);
  s->set_missing_count(row.world_size > row.ranks ? row.world_size - row.ranks
                                                  : static_cast<uint32_t>(missing.count()));
  s->set_world_size(row.world_size);
  s->set_timed_out(row.timed_out);
  s->set_grad_noise_scale(row.grad_noise_scale);
  s->set_replica_checked(row.replica_checked);
  s->mutable_replica_divergent_ranks()->Add(row.replica_divergent_ranks.begin(),
                                            row.replica_divergent_ranks.end());
  s->mutable_outlier_ranks()->Add(row.outlier_ranks.begin(), row.outlier_ranks.end());
  s->set_duplicate_groups(row.duplicate_groups);
  s->mutable_drifting_ranks()->Add(row.drifting_ranks.begin(), row.drifting_ranks.end());
  s->mutable_slow_ranks()->Add(row.slow_ranks.begin(), row.slow_ranks.end());
  if (row.integrity_error_ratio) {
    s->set_integrity_checked(true);
    s->set_integrity_error_ratio(*row.integrity_error_ratio);
    s->set_integrity_relative_error(row.integrity_relative_error.value_or(std::nan("")));
    s->set_integrity_fault(row.integrity_fault);
    if (row.integrity_rank) s->set_integrity_rank(*row.integrity_rank);
    if (row.integrity_weight) s->set_integrity_weight(*row.integrity_weight);
  }
}

void FillRankStep(const StepRankRow& in, v1::RankStep* out) {
  const RankRow& r = in.row;
  out->set_step(in.step);
  out->set_rank(r.rank);
  out->set_attempt(r.attempt);
  out->set_loss(r.loss);
  out->set_grad_norm(r.grad_norm);
  if (r.grad_cosine) out->set_grad_cosine(*r.grad_cosine);
  if (r.loss_z) out->set_loss_z(*r.loss_z);
  if (r.grad_norm_z) out->set_grad_norm_z(*r.grad_norm_z);
  if (r.reduced_grad_fingerprint) out->set_reduced_grad_fingerprint(*r.reduced_grad_fingerprint);
  if (r.param_fingerprint) out->set_param_fingerprint(*r.param_fingerprint);
  if (r.step_time_seconds) out->set_step_time_seconds(*r.step_time_seconds);
  if (r.replica_ok) out->set_replica_ok(*r.replica_ok);
  if (r.outlier_score) out->set_outlier_score(*r.outlier_score);
  if (r.step_time_z) out->set_step_time_z(*r.step_time_z);
  out->set_deviating_buckets(r.deviating_buckets);
  out->set_received_at_unix_nanos(absl::ToUnixNanos(r.received_at));
}

void FillRankWindow(const RankWindowRow& in, v1::RankWindow* w) {
  w->set_first_step(in.first_step);
  w->set_last_step(in.last_step);
  w->set_rank(in.rank);
  w->set_rows(in.rows);
  w->set_first_received_unix_nanos(absl::ToUnixNanos(in.first_received));
  w->set_last_received_unix_nanos(absl::ToUnixNanos(in.last_received));
  if (in.loss.count > 0) {
    w->set_loss_min(*in.loss.min);
    w->set_loss_mean(in.loss.mean());
    w->set_loss_max(*in.loss.max);
  }
  if (in.grad_norm.count > 0) {
    w->set_grad_norm_min(*in.grad_norm.min);
    w->set_grad_norm_mean(in.grad_norm.mean());
    w->set_grad_norm_max(*in.grad_norm.max);
  }
  if (in.grad_cosine.count > 0) {
    w->set_grad_cosine_min(*in.grad_cosine.min);
    w->set_grad_cosine_mean(in.grad_cosine.mean());
    w->set_grad_cosine_max(*in.grad_cosine.max);
  }
  if (in.outlier_score.count > 0) {
    w->set_outlier_score_min(*in.outlier_score.min);
    w->set_outlier_score_mean(in.outlier_score.mean());
    w->set_outlier_score_max(*in.outlier_score.max);
  }
  w->set_nonfinite(in.nonfinite);
  w->set_outliers(in.outliers);
  w->set_replica_bad(in.replica_bad);
}

absl::Status FillRankWindows(SqliteStore& store, absl::string_view job, uint64_t first_step,
                             uint64_t last_step, int limit, v1::StepRangeResponse* out) {
  absl::StatusOr<uint64_t> before = store.DownsampledBefore(job);
  if (!before.ok()) return before.status();
  out->set_downsampled_before_step(*before);
  if (*before == 0 || first_step >= *before) return absl::OkStatus();
  auto windows =
      store.RankWindowsInRange(job, first_step, std::min(last_step, *before - 1), limit + 1);
  if (!windows.ok()) return windows.status();
  if (windows->size() > static_cast<size_t>(limit)) {
    windows->resize(limit);
    out->set_truncated(true);
  }
  for (const RankWindowRow& w : *windows) FillRankWindow(w, out->add_rank_windows());
  return absl::OkStatus();
}

}  // namespace rankscope::collector
