#include "collector/analysis/step_analysis.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "collector/analysis/replica_sets.h"
#include "collector/analysis/replica_tolerance.h"
#include "collector/model/rank_ranges.h"

namespace rankscope::collector {

namespace {

// The step's samples, in report order. Their sketches are left empty when the reports' sketches
// differ in length (*same_dim false): a sketch re-tune crossed this step.
std::vector<RankSample> JoinedSamples(const JoinedStep& step, bool* same_dim) {
  *same_dim = true;
  for (const RankReport& r : step.reports) {
    if (r.SketchValues().size() != step.reports.front().SketchValues().size()) *same_dim = false;
  }
  std::vector<RankSample> samples;
  samples.reserve(step.reports.size());
  for (const RankReport& r : step.reports) {
    RankSample s;
    s.rank = r.rank;
    s.loss = r.loss;
    s.grad_norm = r.grad_norm;
    if (*same_dim) s.sketch = r.SketchValues();
    samples.push_back(s);
  }
  return samples;
}

StepStatistics StatisticsOf(absl::Span<const RankSample> samples, bool same_dim) {
  StepStatistics stats = ComputeStepStatistics(samples);
  if (!same_dim) {
    // Cosines across different sketches mean nothing.
    stats.grad_cosine_mean = std::nan("");
    for (RankStatistics& p : stats.per_rank) p.consensus_cosine = std::nan("");
  }
  return stats;
}

}  // namespace

StepStatistics ComputeJoinedStepStatistics(const JoinedStep& step) {
  bool same_dim = true;
  const std::vector<RankSample> samples = JoinedSamples(step, &same_dim);
  return StatisticsOf(samples, same_dim);
}

// Long: one pass over the step's reports gathers what four independent verdicts read (the
// outlier scores, the replica checks exact or with a tolerance, the step-time z, the noise
// scale), and one pass writes each rank's row from them.
StepDiagnostics DiagnoseStep(const JoinedStep& step, const StepStatistics& stats,
                             absl::Span<const DuplicateGroup> duplicates,
                             const SignalScales& scale_floor) {
  // Every member of a duplicate group but its lowest rank is an echo of it.
  absl::flat_hash_set<uint32_t> echoes;
  for (const DuplicateGroup& g : duplicates) echoes.insert(g.ranks.begin() + 1, g.ranks.end());
  StepDiagnostics d;
  const size_t n = step.reports.size();
  std::vector<RankSignals> signals;
  std::vector<RankReplica> grads, params;
  uint32_t grad_precision = 53;
  bool any_grad_summary = false;
  std::vector<double> local_norms, reduced_norms, times;
  signals.reserve(n);
  local_norms.reserve(n);
  times.reserve(n);
  d.replica_ok.reserve(n);
  d.extras.reserve(n);
  uint32_t batch = 0;
  bool any_time = false;
  for (size_t i = 0; i < n; ++i) {
    const RankReport& r = step.reports[i];
    signals.push_back({r.rank, r.loss, r.grad_norm, stats.per_rank[i].consensus_cosine,
                       r.loss_absent, echoes.contains(r.rank)});
    if (r.reduced_grad_fingerprint) {
      // The reduced gradient: one set, the whole group.
      grads.push_back({r.rank, *r.reduced_grad_fingerprint, std::nullopt, r.reduced_grad_summary});
      if (r.reduced_grad_summary) {
        any_grad_summary = true;
        grad_precision = std::min(grad_precision, r.reduced_grad_summary->precision);
      }
    }
    if (r.param_fingerprint) {
      // The parameters: within each replica set (replica_sets.h).
      params.push_back({r.rank, *r.param_fingerprint, r.replica_set, r.param_summary});
    }
    local_norms.push_back(r.grad_norm);
    if (r.reduced_grad_norm) reduced_norms.push_back(*r.reduced_grad_norm);
    times.push_back(r.step_time_seconds.value_or(std::nan("")));
    any_time = any_time || r.step_time_seconds.has_value();
    batch = std::max(batch, r.local_batch_size);
  }
  d.outliers = ComputeOutlierScores(signals, scale_floor, &d.scales);
  // Each within its replica sets (replica_sets.h; the reduced gradient's are one set), a set
  // with a tolerance when every rank of it that sent its fingerprint sent a summary (their
  // replica check is "tolerance", replica_tolerance.h), else bit for bit.
  auto check = [&d](const std::vector<RankReplica>& ranks, double reduction) {
    ReplicaSetsVerdict sets = CheckReplicaSets(ranks, reduction);
    if (!sets.tolerance) return std::move(sets.verdict);
    d.replica_tolerance = true;
    std::vector<uint32_t> within;
    std::set_union(d.replica_within_tolerance.begin(), d.replica_within_tolerance.end(),
                   sets.within_tolerance.begin(), sets.within_tolerance.end(),
                   std::back_inserter(within));
    d.replica_within_tolerance = std::move(within);
    d.replica_tolerance_ratio = std::isnan(d.replica_tolerance_ratio)
                                    ? sets.worst_ratio
                                    : std::max(d.replica_tolerance_ratio, sets.worst_ratio);
    return std::move(sets.verdict);
  };
  const ReplicaVerdict grad_verdict = check(
      grads,
      any_grad_summary ? ReductionRounding(local_norms, step.world_size, grad_precision) : 0.0);
  const ReplicaVerdict param_verdict = check(params, 0.0);
  d.replica_checked = grad_verdict.checked || param_verdict.checked;
  std::set_union(grad_verdict.divergent_ranks.begin(), grad_verdict.divergent_ranks.end(),
                 param_verdict.divergent_ranks.begin(), param_verdict.divergent_ranks.end(),
                 std::back_inserter(d.replica_divergent));
  const std::vector<double> time_z =
      any_time ? StepTimeRobustZ(times) : std::vector<double>(n, std::nan(""));
  for (size_t i = 0; i < n; ++i) {
    const RankReport& r = step.reports[i];
    if (r.reduced_grad_fingerprint || r.param_fingerprint) {
      d.replica_ok.push_back(
          !std::binary_search(d.replica_divergent.begin(), d.replica_divergent.end(), r.rank));
    } else {
      d.replica_ok.push_back(std::nullopt);
    }
    RankExtras e;
    e.outlier_score = d.outliers[i].score;
    e.step_time_seconds = times[i];
    e.step_time_z = time_z[i];
    d.extras.push_back(e);
    if (d.outliers[i].flagged) d.flagged_ranks.push_back(r.rank);
  }
  if (!reduced_norms.empty()) {
    // Every rank holds the same reduced gradient; take the median against a stray value.
    std::nth_element(reduced_norms.begin(), reduced_norms.begin() + reduced_norms.size() / 2,
                     reduced_norms.end());
    d.grad_noise_scale =
        GradientNoiseScale(local_norms, reduced_norms[reduced_norms.size() / 2], batch);
  }
  return d;
}

AggregationVerdict CheckStepAggregation(const JoinedStep& step) {
  const RankReport* sender = nullptr;
  for (const RankReport& r : step.reports) {
    if (!r.reduced_sketch.empty() && (sender == nullptr || r.rank < sender->rank)) sender = &r;
  }
  if (sender == nullptr) return {};
  std::vector<IntegrityInput> locals;
  locals.reserve(step.reports.size());
  for (const RankReport& r : step.reports)
    locals.push_back({r.rank, r.SketchValues(), r.grad_norm});
  return CheckAggregation(locals, sender->reduced_sketch, sender->rank, step.world_size,
                          sender->reduced_grad_mantissa_bits);
}

// Long: the step's verdicts in the order each needs the one before (statistics, duplicates,
// diagnostics, outlier streaks, sequential statistics, integrity, bucket scores); each is a call,
// and what stays here is the per-job state they share.
AnalyzedStep StepAnalyzer::Analyze(const JoinedStep& step) {
  AnalyzedStep out;
  bool same_dim = true;
  const std::vector<RankSample> samples = JoinedSamples(step, &same_dim);
  out.stats = StatisticsOf(samples, same_dim);
  // Sketches of different lengths are never compared (their sketches are empty here).
  out.duplicates = FindDuplicateRanks(samples);
  // Per job and epoch: the sequential statistics and the outlier score's scale floor.
  auto it = drift_.find(step.job);
  if (it == drift_.end() || it->second.attempt != step.attempt ||
      it->second.world_size != step.world_size) {
    drift_.erase(step.job);
    it = drift_
             .emplace(step.job, JobDrift{step.attempt, step.world_size, RankCusum(step.world_size),
                                         OutlierScaleWindow()})
             .first;
  }
  out.diag = DiagnoseStep(step, out.stats, out.duplicates, it->second.outlier_scales.Floor());
  it->second.outlier_scales.Push(out.diag.scales);
  // Persistent outliers: flagged on kOutlierPersistence consecutive steps the rank reported.
  auto& history = outlier_history_[step.job];
  for (size_t i = 0; i < step.reports.size(); ++i) {
    const uint32_t rank = step.reports[i].rank;
    const OutlierScore& score = out.diag.outliers[i];
    RankOutlierHistory& h = history[rank];
    // std::fmin passes over a NaN, so `held` is NaN only when every score is.
    double held = score.score;
    for (uint32_t k = 0; k < h.kept; ++k) held = std::fmin(held, h.previous[k]);
    out.diag.extras[i].held_outlier_score = held;
    std::copy_backward(h.previous.begin(), h.previous.end() - 1, h.previous.end());
    h.previous[0] = score.score;
    h.kept = std::min<uint32_t>(h.kept + 1, h.previous.size());
    h.streak = score.flagged ? h.streak + 1 : 0;
    if (h.streak >= kOutlierPersistence) out.outlier_ranks.push_back(rank);
  }
  RankCusum& cusum = it->second.cusum;
  std::vector<RankDriftSignals> signals;
  signals.reserve(step.reports.size());
  for (size_t i = 0; i < step.reports.size(); ++i) {
    const RankReport& r = step.reports[i];
    signals.push_back({r.rank, r.loss, r.grad_norm, out.stats.per_rank[i].consensus_cosine,
                       out.diag.extras[i].step_time_seconds});
  }
  // Ranks with duplicate data are not exchangeable with the others (the pair's consensus cosines
  // are high, so the others' rank low): hold the data-drift statistics on such a step.
  const std::vector<RankDrift> drift = cusum.Update(signals, out.duplicates.empty());
  for (size_t i = 0; i < drift.size(); ++i) {
    out.diag.extras[i].drift_score = drift[i].data / cusum.threshold();
    out.diag.extras[i].slow_score = drift[i].slow / cusum.slow_threshold();
    if (drift[i].drifting) out.drifting_ranks.push_back(step.reports[i].rank);
    if (drift[i].is_slow) out.slow_ranks.push_back(step.reports[i].rank);
  }
  std::sort(out.drifting_ranks.begin(), out.drifting_ranks.end());
  std::sort(out.slow_ranks.begin(), out.slow_ranks.end());
  // Where in the model: every rank's per-bucket norms against the other ranks'.
  std::vector<absl::Span<const float>> bucket_norms;
  bucket_norms.reserve(step.reports.size());
  for (const RankReport& r : step.reports) bucket_norms.emplace_back(r.bucket_norms);
  out.bucket_z = BucketNormZ(bucket_norms);
  if (!out.bucket_z.empty()) {
    static const std::vector<std::string> kNoNames;
    const std::vector<std::string>& names = step.bucket_names ? *step.bucket_names : kNoNames;
    out.deviating_buckets.resize(step.reports.size());
    out.keep_bucket_norms.resize(step.reports.size(), false);
    out.top_bucket.resize(step.reports.size());
    auto named = [](const std::vector<uint32_t>& ranks, uint32_t rank) {
      return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
    };
    for (size_t i = 0; i < step.reports.size(); ++i) {
      if (out.bucket_z[i].empty()) continue;
      const RankReport& r = step.reports[i];
      // Flagged for any reason: this step's outlier score, a persistent outlier, a divergent
      // replica, the drift or slow statistics, or a non-finite value (the sketch's last: O(k)).
      const bool flagged = out.diag.outliers[i].flagged || named(out.outlier_ranks, r.rank) ||
                           out.diag.replica_ok[i] == false || named(out.drifting_ranks, r.rank) ||
                           named(out.slow_ranks, r.rank) || !std::isfinite(r.grad_norm) ||
                           (!r.loss_absent && !std::isfinite(r.loss)) ||
                           !r.SketchValues().AllFinite();
      if (flagged) {
        const std::vector<BucketDeviation> deviations = DeviatingBuckets(out.bucket_z[i]);
        out.deviating_buckets[i] = FormatDeviatingBuckets(deviations, names);
        if (!deviations.empty()) {
          const BucketDeviation& top = deviations.front();
          out.top_bucket[i] = {
              top.bucket < names.size() ? names[top.bucket] : absl::StrCat("bucket ", top.bucket),
              top.z};
        }
      }
      out.keep_bucket_norms[i] = flagged || step.step % kBucketSampleEvery == 0;
    }
  }
  out.integrity = CheckStepAggregation(step);
  return out;
}

RankDrift StepAnalyzer::Drift(const std::string& job, uint32_t rank) const {
  auto it = drift_.find(job);
  return it == drift_.end() ? RankDrift{} : it->second.cusum.Get(rank);
}

void StepAnalyzer::ForgetJob(const std::string& job) {
  outlier_history_.erase(job);
  drift_.erase(job);
}

uint32_t StepAnalyzer::OutlierStreak(const std::string& job, uint32_t rank) const {
  auto it = outlier_history_.find(job);
  if (it == outlier_history_.end()) return 0;
  auto r = it->second.find(rank);
  return r == it->second.end() ? 0 : r->second.streak;
}

RankRow ToRankRow(const RankReport& report, uint32_t join_size) {
  RankRow row;
  row.rank = report.rank;
  row.attempt = report.attempt;
  row.join_size = join_size;
  row.loss = report.loss;
  row.loss_absent = report.loss_absent;
  row.grad_norm = report.grad_norm;
  row.reduced_grad_fingerprint = report.reduced_grad_fingerprint;
  row.param_fingerprint = report.param_fingerprint;
  row.step_time_seconds = report.step_time_seconds;
  row.received_at = report.received_at;
  row.sketch_nonfinite = !report.SketchValues().AllFinite();
  return row;
}

StepWrite StepRows(const JoinedStep& step, AnalyzedStep analyzed, absl::Time completed_at) {
  const StepStatistics& stats = analyzed.stats;
  const StepDiagnostics& diag = analyzed.diag;
  StepWrite w;
  w.job = step.job;
  w.step = step.step;
  StepRow row;
  row.step = step.step;
  row.attempt = step.attempt;
  static_cast<StepSummary&>(row) = stats;
  row.ranks = static_cast<uint32_t>(step.reports.size());
  row.world_size = step.world_size;
  row.missing_ranks = FormatRankRanges(step.missing_ranks);  // bounded whatever world_size
  row.timed_out = step.reason != JoinedStep::Reason::kComplete;
  row.completed_at = completed_at;
  row.grad_noise_scale = diag.grad_noise_scale;
  row.replica_checked = diag.replica_checked;
  row.replica_divergent_ranks = diag.replica_divergent;
  row.outlier_ranks = std::move(analyzed.outlier_ranks);
  row.duplicate_groups = FormatDuplicateGroups(analyzed.duplicates);
  row.drifting_ranks = std::move(analyzed.drifting_ranks);
  row.slow_ranks = std::move(analyzed.slow_ranks);
  const AggregationVerdict& integrity = analyzed.integrity;
  if (integrity.checked) {
    row.integrity_error_ratio = integrity.error / integrity.tolerance;
    row.integrity_relative_error = integrity.relative_error;
    row.integrity_fault = AggregationFaultName(integrity.fault);
    row.integrity_rank = integrity.suspect_rank;
    if (integrity.suspect_rank) row.integrity_weight = integrity.suspect_weight;
  }
  w.stats = std::move(row);
  const uint32_t join_size = static_cast<uint32_t>(step.reports.size());
  w.ranks.reserve(step.reports.size());
  for (size_t i = 0; i < step.reports.size(); ++i) {
    RankRow rank_row = ToRankRow(step.reports[i], join_size);
    rank_row.grad_cosine = stats.per_rank[i].consensus_cosine;
    rank_row.loss_z = stats.per_rank[i].loss_z;
    rank_row.grad_norm_z = stats.per_rank[i].grad_norm_z;
    rank_row.replica_ok = diag.replica_ok[i];
    rank_row.outlier_score = diag.outliers[i].score;
    if (!std::isnan(diag.extras[i].step_time_z)) rank_row.step_time_z = diag.extras[i].step_time_z;
    if (i < analyzed.deviating_buckets.size()) {
      rank_row.deviating_buckets = std::move(analyzed.deviating_buckets[i]);
      if (analyzed.keep_bucket_norms[i]) {
        rank_row.bucket_norms = step.reports[i].bucket_norms;
        rank_row.bucket_z = analyzed.bucket_z[i];
      }
    }
    w.ranks.push_back(std::move(rank_row));
  }
  return w;
}

}  // namespace rankscope::collector
