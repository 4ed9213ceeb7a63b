#include "collector/metrics/prometheus_export.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "collector/metrics/job_families.h"
#include "collector/metrics/rank_selection.h"
#include "common/job_name.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace rankscope::collector {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Expired jobs are looked for at most this often (Collect() filters exactly regardless).
constexpr absl::Duration kPruneInterval = absl::Minutes(1);

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The latest step's statistics, one gauge each.
struct StatisticSeries {
  JobFamily family;
  double StepSummary::*value;
};
constexpr StatisticSeries kLatestSeries[] = {
    {kLossMean, &StepSummary::loss_mean},
    {kLossStd, &StepSummary::loss_std},
    {kLossRange, &StepSummary::loss_range},
    {kGradNormMean, &StepSummary::grad_norm_mean},
    {kGradNormStd, &StepSummary::grad_norm_std},
    {kGradNormCv, &StepSummary::grad_norm_cv},
    {kGradCosineMean, &StepSummary::grad_cosine_mean},
};

// The spike window's worst values (spike_window.h), one gauge each; replica_divergent is
// exported with the replica series.
struct WindowSeries {
  JobFamily family;
  double WindowValues::*value;
};
constexpr WindowSeries kWindowSeries[] = {
    {kLossStdMaxWindow, &WindowValues::loss_std},
    {kLossRangeMaxWindow, &WindowValues::loss_range},
    {kGradNormCvMaxWindow, &WindowValues::grad_norm_cv},
    {kGradCosineMeanMinWindow, &WindowValues::grad_cosine_mean},
};

// The labels of a group key's series: {train_job} for a job with one group (its name), else
// {train_job, group} (common/job_name.h SplitGroupKey).
std::vector<ClientMetric::Label> JobLabels(const std::string& key) {
  const auto [job, group] = SplitGroupKey(key);
  std::vector<ClientMetric::Label> labels = {{"train_job", std::string(job)}};
  if (!group.empty()) labels.push_back({"group", std::string(group)});
  return labels;
}

std::vector<ClientMetric::Label> RankLabels(const std::string& key, uint32_t rank) {
  std::vector<ClientMetric::Label> labels = JobLabels(key);
  labels.push_back({"rank", absl::StrCat(rank)});
  return labels;
}

void AddSample(MetricFamily& family, std::vector<ClientMetric::Label> labels, double value) {
  ClientMetric metric;
  metric.label = std::move(labels);
  if (family.type == MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
}

bool IsNonfinite(const StepSummary& s, bool loss_absent) {
  if (s.ranks == 0) return false;  // nothing reported: the statistics are empty, not bad
  if (!loss_absent) {
    for (double v : {s.loss_mean, s.loss_std, s.loss_range}) {
      if (!std::isfinite(v)) return true;
    }
  }
  for (double v : {s.grad_norm_mean, s.grad_norm_std, s.grad_norm_cv}) {
    if (!std::isfinite(v)) return true;
  }
  return s.ranks >= 2 && !std::isfinite(s.grad_cosine_mean);
}

// The families of kJobFamilies, HELP and TYPE set, no samples yet.
std::vector<MetricFamily> EmptyFamilies() {
  std::vector<MetricFamily> families(kJobFamilyCount);
  for (const JobFamilySpec& spec : kJobFamilies) {
    families[spec.family].name = spec.name;
    families[spec.family].help = spec.help;
    families[spec.family].type = spec.type;
  }
  return families;
}

// The ranks whose newest joined step is off the lower median of every rank's (the group's
// step), with their distance from it (positive: ahead), the largest |distance| first (ties: the
// lower rank), at most `limit`.
std::vector<std::pair<uint32_t, int64_t>> RanksOffTheMedianStep(
    const absl::flat_hash_map<uint32_t, uint64_t>& newest_by_rank, size_t limit) {
  std::vector<std::pair<uint32_t, int64_t>> off;
  if (newest_by_rank.empty() || limit == 0) return off;
  std::vector<uint64_t> steps;
  steps.reserve(newest_by_rank.size());
  for (const auto& [rank, step] : newest_by_rank) steps.push_back(step);
  const size_t mid = (steps.size() - 1) / 2;
  std::nth_element(steps.begin(), steps.begin() + mid, steps.end());
  const uint64_t median = steps[mid];
  for (const auto& [rank, step] : newest_by_rank) {
    if (step == median) continue;
    off.emplace_back(rank, step > median ? static_cast<int64_t>(step - median)
                                         : -static_cast<int64_t>(median - step));
  }
  auto further = [](const std::pair<uint32_t, int64_t>& a, const std::pair<uint32_t, int64_t>& b) {
    const uint64_t da = a.second < 0 ? 0 - static_cast<uint64_t>(a.second) : a.second;
    const uint64_t db = b.second < 0 ? 0 - static_cast<uint64_t>(b.second) : b.second;
    return da != db ? da > db : a.first < b.first;
  };
  const size_t kept = std::min(off.size(), limit);
  std::partial_sort(off.begin(), off.begin() + kept, off.end(), further);
  off.resize(kept);
  return off;
}

}  // namespace

JobMetrics::JobMetrics(ExportOptions options) : options_(std::move(options)) {
  if (!options_.clock) options_.clock = [] { return absl::Now(); };
}

bool JobMetrics::Expired(const JobState& state, absl::Time now) const {
  return state.connected == 0 && now - state.last_update > options_.job_expiry;
}

JobMetrics::JobState& JobMetrics::TouchLocked(const std::string& job, absl::Time now) {
  if (now >= next_prune_) {
    next_prune_ = now + kPruneInterval;
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      // erase(it++) is the flat_hash_map idiom for erasing while iterating.
      if (it->first != job && Expired(it->second, now)) {
        jobs_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  JobState& state = jobs_[job];
  state.last_update = now;
  return state;
}

void JobMetrics::OnAgentConnected(const std::string& job, uint32_t world_size) {
  OnAgentConnected(job, world_size, RankIdentity{});
}

void JobMetrics::OnAgentConnected(const std::string& job, uint32_t world_size,
                                  RankIdentity identity) {
  const absl::Time now = options_.clock();
  MutexLock lock(&mu_);
  JobState& state = TouchLocked(job, now);
  ++state.connected;
  state.had_agents = true;
  if (world_size > 0) state.world_size = world_size;
  if (identity.known) state.identities[identity.rank] = std::move(identity);
}

void JobMetrics::OnAgentDisconnected(const std::string& job) {
  const absl::Time now = options_.clock();
  MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  // Freed, or more disconnects than connects: nothing to count down (and no update to record).
  if (it == jobs_.end() || it->second.connected == 0) return;
  --TouchLocked(job, now).connected;
}

void JobMetrics::OnAgentStarted(const std::string& job, uint32_t rank) {
  const absl::Time now = options_.clock();
  MutexLock lock(&mu_);
  JobState& state = TouchLocked(job, now);
  auto it = state.dropped_by_rank.find(rank);
  if (it != state.dropped_by_rank.end()) it->second = 0;
}

void JobMetrics::OnAgentDropped(const std::string& job, uint32_t rank, uint64_t dropped_total) {
  const absl::Time now = options_.clock();
  MutexLock lock(&mu_);
  JobState& state = TouchLocked(job, now);
  uint64_t& last = state.dropped_by_rank[rank];
  // Monotonic per agent process: a new process starts from zero through OnAgentStarted, so a
  // smaller count from the same one is a client's error (or a lie) and adds nothing. One report
  // adds at most kMaxDroppedPerReport; a larger rise is taken in steps over the next reports (an
  // honest agent's count is caught up, a hostile 2^64 - 1 adds a bounded amount per report).
  if (dropped_total <= last) return;
  const uint64_t added = std::min(dropped_total - last, kMaxDroppedPerReport);
  last += added;
  state.dropped_total =
      state.dropped_total > UINT64_MAX - added ? UINT64_MAX : state.dropped_total + added;
}

void JobMetrics::OnControl(const std::string& job, bool enabled) {
  const absl::Time now = options_.clock();
  MutexLock lock(&mu_);
  if (jobs_.contains(job)) {
    TouchLocked(job, now).reporting_enabled = enabled;
    return;
  }
  const std::string prefix = absl::StrCat(job, "/");
  for (auto& [key, state] : jobs_) {
    if (absl::StartsWith(key, prefix)) state.reporting_enabled = enabled;
  }
}

// Long: one step's snapshot for every family (statistics, spike window, per-rank values, integrity,
// bucket scores) in one critical section under mu_; split, the lock would be taken per piece.
void JobMetrics::OnStep(const std::string& job, const ExportedStep& step) {
  const absl::Time now = options_.clock();

  StepSummary latest;
  std::vector<RankPoint> top_ranks;
  if (step.stats != nullptr) {
    const StepStatistics& s = *step.stats;
    latest = s;  // the StepSummary part
    const bool has_extras = step.extras.size() == s.per_rank.size();
    for (uint32_t index :
         SelectDeviatingRanks(s.per_rank, step.extras, options_.per_rank_series_limit)) {
      const RankStatistics& r = s.per_rank[index];
      const RankExtras e = has_extras ? step.extras[index] : RankExtras{};
      const bool has_bucket =
          step.top_bucket.size() == s.per_rank.size() && !step.top_bucket[index].first.empty();
      top_ranks.push_back({r.rank, r.consensus_cosine, r.loss_z, r.grad_norm_z,
                           e.held_outlier_score, e.step_time_seconds, e.step_time_z, e.drift_score,
                           e.slow_score, has_extras,
                           has_bucket ? step.top_bucket[index].first : std::string(),
                           has_bucket ? step.top_bucket[index].second : kNaN});
    }
  } else {
    // No statistics: as ComputeStepStatistics({}) gives (ranks 0, cosine NaN, the rest 0).
    latest.grad_cosine_mean = kNaN;
  }
  std::vector<uint32_t> missing(step.missing_ranks.begin(), step.missing_ranks.end());
  const size_t missing_kept = std::min(missing.size(), options_.per_rank_series_limit);
  std::partial_sort(missing.begin(), missing.begin() + missing_kept, missing.end());
  missing.resize(missing_kept);

  MutexLock lock(&mu_);
  JobState& state = TouchLocked(job, now);
  if (step.world_size > 0) state.world_size = step.world_size;
  state.has_step = true;
  state.step = step.step;
  state.last_step_at = now;
  if (step.stats != nullptr) {
    // Assigned, not maxed: a restarted attempt that steps from an older checkpoint goes back.
    for (const RankStatistics& r : step.stats->per_rank)
      state.newest_step_by_rank[r.rank] = step.step;
  }
  state.ranks_reporting = latest.ranks;
  ++state.steps_total;
  if (step.timed_out) ++state.steps_timed_out_total;
  if (IsNonfinite(latest, step.loss_absent)) ++state.steps_nonfinite_total;
  state.duplicate_ranks = step.duplicate_ranks;
  state.has_sequential = !step.extras.empty();
  state.drifting_ranks = static_cast<uint32_t>(step.drifting_ranks.size());
  state.slow_ranks = static_cast<uint32_t>(step.slow_ranks.size());
  if (step.integrity != nullptr && step.integrity->checked) {
    const AggregationVerdict& v = *step.integrity;
    ++state.integrity_checks_total;
    state.integrity_error_ratio = v.error / v.tolerance;
    if (v.flagged) {
      ++state.integrity_failed_total;
      state.integrity_suspect = v.suspect_rank;
      state.integrity_fault = AggregationFaultName(v.fault);
    }
  }
  if (step.duplicate_ranks > 0) ++state.duplicate_steps_total;
  state.outlier_ranks_latest = step.outlier_ranks;
  if (step.replica_checked) state.replica_divergent_checked = !step.replica_divergent_ranks.empty();
  state.latest = latest;
  state.top_ranks = std::move(top_ranks);
  state.missing = std::move(missing);
  if (!std::isnan(step.grad_noise_scale)) state.grad_noise_scale = step.grad_noise_scale;
  double replica_divergent = kNaN;
  if (step.replica_checked) {
    ++state.replica_checks_total;
    replica_divergent = static_cast<double>(step.replica_divergent_ranks.size());
    state.replica_divergent_latest = replica_divergent;
    if (!step.replica_divergent_ranks.empty()) ++state.replica_divergent_steps_total;
    for (uint32_t rank : step.replica_divergent_ranks) state.replica_divergent_at[rank] = now;
  }
  // Forget divergent ranks that left the window (bounded by the ranks of the job).
  for (auto it = state.replica_divergent_at.begin(); it != state.replica_divergent_at.end();) {
    if (it->second < now - options_.spike_window) {
      state.replica_divergent_at.erase(it++);
    } else {
      ++it;
    }
  }

  state.window.Add(now, options_.spike_window,
                   WindowValues{latest.loss_std, latest.loss_range, latest.grad_norm_cv,
                                latest.grad_cosine_mean, replica_divergent});
}

std::vector<MetricFamily> JobMetrics::Collect() const {
  const absl::Time now = options_.clock();
  Families families = EmptyFamilies();
  {
    MutexLock lock(&mu_);
    const std::vector<const JobEntry*> live = LiveJobsLocked(now);
    AddJobAggregates(live, families);
    const absl::flat_hash_set<const std::string*> hidden = HiddenGroups(live);
    std::vector<const JobEntry*> shown;
    shown.reserve(live.size());
    for (const JobEntry* entry : live) {
      if (!hidden.contains(&entry->first)) shown.push_back(entry);
    }
    // The budget goes to the most deviating groups first (each group's series built apart);
    // the groups that fit are then appended in key order, as without a budget.
    const size_t budget = options_.max_series == 0 ? SIZE_MAX : options_.max_series;
    size_t exported = 2;  // rankscope_export_series and rankscope_export_groups_capped
    for (const MetricFamily& f : families) exported += f.metric.size();
    size_t capped = 0;
    std::vector<const JobEntry*> by_deviation = shown;
    std::stable_sort(by_deviation.begin(), by_deviation.end(), MoreDeviating);
    absl::flat_hash_map<const JobEntry*, Families> fitted;
    for (const JobEntry* entry : by_deviation) {
      Families own(families.size());
      for (size_t f = 0; f < families.size(); ++f) own[f].type = families[f].type;
      AddJobSeries(entry->first, entry->second, now, own);
      size_t series = 0;
      for (const MetricFamily& f : own) series += f.metric.size();
      if (exported + series > budget) {
        ++capped;
        continue;
      }
      exported += series;
      fitted.emplace(entry, std::move(own));
    }
    for (const JobEntry* entry : shown) {
      auto it = fitted.find(entry);
      if (it == fitted.end()) continue;
      for (size_t f = 0; f < families.size(); ++f) {
        std::vector<ClientMetric>& from = it->second[f].metric;
        families[f].metric.insert(families[f].metric.end(), std::make_move_iterator(from.begin()),
                                  std::make_move_iterator(from.end()));
      }
    }
    // The collector's own two gauges (no label), once there is a job to budget.
    if (!live.empty()) {
      AddSample(families[kExportSeries], {}, static_cast<double>(exported));
      AddSample(families[kExportGroupsCapped], {}, static_cast<double>(capped));
    }
  }
  // A family with no sample would be HELP and TYPE alone: leave it out.
  families.erase(std::remove_if(families.begin(), families.end(),
                                [](const MetricFamily& f) { return f.metric.empty(); }),
                 families.end());
  return families;
}

std::vector<const JobMetrics::JobEntry*> JobMetrics::LiveJobsLocked(absl::Time now) const {
  std::vector<const JobEntry*> live;
  live.reserve(jobs_.size());
  for (const JobEntry& entry : jobs_) {
    if (!Expired(entry.second, now)) live.push_back(&entry);
  }
  std::sort(live.begin(), live.end(),
            [](const JobEntry* a, const JobEntry* b) { return a->first < b->first; });
  return live;
}

void JobMetrics::AddJobAggregates(absl::Span<const JobEntry* const> live, Families& families) {
  // A job without groups is one group.
  struct JobAggregate {
    int groups = 0;
    double cosine_min = kNaN;
    int with_outliers = 0;
    int replica_divergent = 0;
  };
  std::map<std::string, JobAggregate> by_job;
  for (const JobEntry* entry : live) {
    const JobState& state = entry->second;
    JobAggregate& a = by_job[std::string(SplitGroupKey(entry->first).first)];
    ++a.groups;
    if (!state.has_step) continue;
    a.cosine_min = std::fmin(a.cosine_min, state.latest.grad_cosine_mean);  // NaN ignored
    a.with_outliers += state.outlier_ranks_latest > 0 ? 1 : 0;
    a.replica_divergent += state.replica_divergent_checked ? 1 : 0;
  }
  for (const auto& [job, a] : by_job) {
    const std::vector<ClientMetric::Label> labels = {{"train_job", job}};
    AddSample(families[kJobGroups], labels, a.groups);
    if (!std::isnan(a.cosine_min)) AddSample(families[kJobGradCosineMeanMin], labels, a.cosine_min);
    AddSample(families[kJobGroupsWithOutliers], labels, a.with_outliers);
    AddSample(families[kJobGroupsReplicaDivergent], labels, a.replica_divergent);
  }
}

bool JobMetrics::MoreDeviating(const JobEntry* a, const JobEntry* b) {
  auto deviation = [](const JobState& st) {
    const bool flagged = st.outlier_ranks_latest > 0 || st.replica_divergent_checked;
    const double cos = st.has_step && !std::isnan(st.latest.grad_cosine_mean)
                           ? st.latest.grad_cosine_mean
                           : std::numeric_limits<double>::infinity();
    return std::make_pair(!flagged, cos);
  };
  const auto da = deviation(a->second);
  const auto db = deviation(b->second);
  if (da != db) return da < db;
  return a->first < b->first;
}

absl::flat_hash_set<const std::string*> JobMetrics::HiddenGroups(
    absl::Span<const JobEntry* const> live) const {
  // Most deviating first: a divergent replica or an outlier, then the lowest latest cosine.
  auto deviation = [](const JobState& st) {
    const bool flagged = st.outlier_ranks_latest > 0 || st.replica_divergent_checked;
    const double cos = st.has_step && !std::isnan(st.latest.grad_cosine_mean)
                           ? st.latest.grad_cosine_mean
                           : std::numeric_limits<double>::infinity();
    return std::make_pair(!flagged, cos);
  };
  absl::flat_hash_set<const std::string*> hidden;
  std::map<absl::string_view, std::vector<const JobEntry*>> groups_of;
  for (const JobEntry* entry : live) groups_of[SplitGroupKey(entry->first).first].push_back(entry);
  const size_t limit = options_.per_job_group_series_limit;
  for (auto& [job, groups] : groups_of) {
    if (groups.size() <= limit) continue;
    std::stable_sort(groups.begin(), groups.end(), [&](const JobEntry* a, const JobEntry* b) {
      return deviation(a->second) < deviation(b->second);
    });
    for (size_t i = limit; i < groups.size(); ++i) hidden.insert(&groups[i]->first);
  }
  return hidden;
}

void JobMetrics::AddJobSeries(const std::string& key, const JobState& state, absl::Time now,
                              Families& families) const {
  const std::vector<ClientMetric::Label> job_labels = JobLabels(key);
  auto add = [&](JobFamily f, double value) { AddSample(families[f], job_labels, value); };

  if (state.world_size > 0) add(kWorldSize, state.world_size);
  add(kConnectedAgents, state.connected);
  add(kStepsTotal, static_cast<double>(state.steps_total));
  add(kStepsTimedOutTotal, static_cast<double>(state.steps_timed_out_total));
  add(kStepsNonfiniteTotal, static_cast<double>(state.steps_nonfinite_total));
  add(kDuplicateStepsTotal, static_cast<double>(state.duplicate_steps_total));
  add(kAgentDroppedReportsTotal, static_cast<double>(state.dropped_total));
  if (state.reporting_enabled) add(kReportingEnabled, *state.reporting_enabled ? 1.0 : 0.0);
  if (!state.has_step) return;

  const StepSummary& s = state.latest;
  add(kStep, static_cast<double>(state.step));
  add(kLastStepTimestamp, absl::ToDoubleSeconds(state.last_step_at - absl::UnixEpoch()));
  add(kRanksReporting, state.ranks_reporting);
  for (const StatisticSeries& series : kLatestSeries) add(series.family, s.*series.value);
  add(kDuplicateRanks, state.duplicate_ranks);
  if (state.has_sequential) {
    add(kDriftingRanks, state.drifting_ranks);
    add(kSlowRanks, state.slow_ranks);
  }

  const WindowValues worst =
      state.window.Worst(now, options_.spike_window,
                         WindowValues{s.loss_std, s.loss_range, s.grad_norm_cv, s.grad_cosine_mean,
                                      state.replica_divergent_latest});
  for (const WindowSeries& series : kWindowSeries) add(series.family, worst.*series.value);

  if (!std::isnan(state.grad_noise_scale)) add(kGradNoiseScale, state.grad_noise_scale);
  if (state.replica_checks_total > 0) {
    add(kReplicaDivergentRanks,
        std::isnan(worst.replica_divergent) ? 0.0 : worst.replica_divergent);
    add(kReplicaChecksTotal, static_cast<double>(state.replica_checks_total));
    add(kReplicaDivergentStepsTotal, static_cast<double>(state.replica_divergent_steps_total));
  }
  if (state.integrity_checks_total > 0) {
    add(kIntegrityChecksTotal, static_cast<double>(state.integrity_checks_total));
    add(kIntegrityFailedStepsTotal, static_cast<double>(state.integrity_failed_total));
    add(kIntegrityErrorRatio, state.integrity_error_ratio);
    if (state.integrity_suspect) {
      std::vector<ClientMetric::Label> labels = job_labels;
      labels.push_back({"fault", state.integrity_fault});
      AddSample(families[kIntegritySuspectRank], std::move(labels), *state.integrity_suspect);
    }
  }
  AddRankSeries(key, state, now, families);
}

void JobMetrics::AddRankSeries(const std::string& key, const JobState& state, absl::Time now,
                               Families& families) const {
  const absl::Duration window = options_.spike_window;
  // An ended job's latest step is not news: its deviating ranks are not exported.
  const bool ended = state.had_agents && state.connected == 0;
  const absl::Span<const RankPoint> top_ranks =
      ended ? absl::Span<const RankPoint>() : absl::MakeConstSpan(state.top_ranks);
  for (const RankPoint& r : top_ranks) {
    std::vector<ClientMetric::Label> labels = RankLabels(key, r.rank);
    AddSample(families[kRankGradCosine], labels, r.grad_cosine);
    AddSample(families[kRankLossZ], labels, r.loss_z);
    AddSample(families[kRankGradNormZ], labels, r.grad_norm_z);
    if (r.has_extras) {
      AddSample(families[kRankOutlierScore], labels, r.outlier_score);
      AddSample(families[kRankDriftScore], labels, r.drift_score);
      AddSample(families[kRankSlowScore], labels, r.slow_score);
    }
    if (!r.top_bucket.empty()) {
      std::vector<ClientMetric::Label> where = labels;
      where.push_back({"bucket", r.top_bucket});
      AddSample(families[kRankDeviatingBucket], std::move(where), r.top_bucket_z);
    }
    if (!std::isnan(r.step_time_seconds)) {
      AddSample(families[kRankStepTimeSeconds], labels, r.step_time_seconds);
      AddSample(families[kRankStepTimeZ], std::move(labels), r.step_time_z);
    }
  }
  if (state.replica_checks_total > 0) {
    std::vector<uint32_t> divergent;
    for (const auto& [rank, at] : state.replica_divergent_at) {
      if (at >= now - window) divergent.push_back(rank);
    }
    std::sort(divergent.begin(), divergent.end());
    if (divergent.size() > options_.per_rank_series_limit) {
      divergent.resize(options_.per_rank_series_limit);
    }
    for (uint32_t rank : divergent) {
      AddSample(families[kRankReplicaDivergent], RankLabels(key, rank), 1);
    }
  }
  for (uint32_t rank : state.missing) {
    AddSample(families[kRankMissing], RankLabels(key, rank), 1);
  }
  // An ended job's ranks stopped where they stopped: no lag is news.
  const std::vector<std::pair<uint32_t, int64_t>> lagging =
      ended ? std::vector<std::pair<uint32_t, int64_t>>()
            : RanksOffTheMedianStep(state.newest_step_by_rank, options_.per_rank_series_limit);
  for (const auto& [rank, lag] : lagging) {
    AddSample(families[kRankStepLag], RankLabels(key, rank), static_cast<double>(lag));
  }

  // Who the ranks with per-rank series are: their global rank and host.
  absl::flat_hash_set<uint32_t> shown;
  for (const RankPoint& r : top_ranks) shown.insert(r.rank);
  for (uint32_t rank : state.missing) shown.insert(rank);
  for (const auto& [rank, lag] : lagging) shown.insert(rank);
  for (const auto& [rank, at] : state.replica_divergent_at) {
    if (at >= now - window) shown.insert(rank);
  }
  std::vector<uint32_t> ordered(shown.begin(), shown.end());
  std::sort(ordered.begin(), ordered.end());
  for (uint32_t rank : ordered) {
    auto who = state.identities.find(rank);
    if (who == state.identities.end()) continue;
    std::vector<ClientMetric::Label> labels = RankLabels(key, rank);
    labels.push_back({"global_rank", who->second.global_rank
                                         ? absl::StrCat(*who->second.global_rank)
                                         : std::string()});
    labels.push_back({"host", who->second.host});
    labels.push_back({"version", who->second.agent_version});
    AddSample(families[kRankInfo], std::move(labels), 1);
  }
}

}  // namespace rankscope::collector
