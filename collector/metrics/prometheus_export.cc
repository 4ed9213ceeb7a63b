#include "collector/metrics/prometheus_export.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/job_name.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace rankscope::collector {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// The spike window is kept as buckets of spike_window / kWindowBuckets each.
constexpr int64_t kWindowBuckets = 60;
// Expired jobs are looked for at most this often (Collect() filters exactly regardless).
constexpr absl::Duration kPruneInterval = absl::Minutes(1);

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Every family Collect() may emit, in output order.
enum Family : size_t {
  kStep,
  kWorldSize,
  kRanksReporting,
  kConnectedAgents,
  kLossMean,
  kLossStd,
  kLossRange,
  kGradNormMean,
  kGradNormStd,
  kGradNormCv,
  kGradCosineMean,
  kLossStdMaxWindow,
  kLossRangeMaxWindow,
  kGradNormCvMaxWindow,
  kGradCosineMeanMinWindow,
  kStepsTotal,
  kStepsTimedOutTotal,
  kStepsNonfiniteTotal,
  kAgentDroppedReportsTotal,
  kRankGradCosine,
  kRankLossZ,
  kRankGradNormZ,
  kRankMissing,
  kRankOutlierScore,
  kRankStepTimeSeconds,
  kRankStepTimeZ,
  kGradNoiseScale,
  kReplicaDivergentRanks,
  kReplicaChecksTotal,
  kReplicaDivergentStepsTotal,
  kRankReplicaDivergent,
  kDuplicateRanks,
  kDuplicateStepsTotal,
  kRankInfo,
  kJobGroups,
  kJobGradCosineMeanMin,
  kJobGroupsWithOutliers,
  kJobGroupsReplicaDivergent,
  kRankDriftScore,
  kRankSlowScore,
  kDriftingRanks,
  kSlowRanks,
  kFamilyCount,
};

struct FamilySpec {
  const char* name;
  const char* help;
  MetricType type;
};

constexpr FamilySpec kFamilies[kFamilyCount] = {
    {"rankscope_step", "Step number of the training job's latest joined step.", MetricType::Gauge},
    {"rankscope_world_size", "Number of ranks of the training job.", MetricType::Gauge},
    {"rankscope_ranks_reporting", "Ranks that reported the latest joined step.", MetricType::Gauge},
    {"rankscope_connected_agents", "Agents of the training job with an open stream.",
     MetricType::Gauge},
    {"rankscope_loss_mean", "Mean of the ranks' local losses at the latest step.",
     MetricType::Gauge},
    {"rankscope_loss_std",
     "Population standard deviation of the ranks' local losses at the "
     "latest step.",
     MetricType::Gauge},
    {"rankscope_loss_range", "Max minus min of the ranks' local losses at the latest step.",
     MetricType::Gauge},
    {"rankscope_grad_norm_mean", "Mean of the ranks' local gradient L2 norms at the latest step.",
     MetricType::Gauge},
    {"rankscope_grad_norm_std",
     "Population standard deviation of the ranks' local gradient L2 "
     "norms at the latest step.",
     MetricType::Gauge},
    {"rankscope_grad_norm_cv",
     "Coefficient of variation (std/mean) of the ranks' local gradient "
     "L2 norms at the latest step.",
     MetricType::Gauge},
    {"rankscope_grad_cosine_mean",
     "Mean pairwise cosine of the ranks' gradient sketches at the "
     "latest step (NaN with fewer than two ranks).",
     MetricType::Gauge},
    {"rankscope_loss_std_max_window",
     "Max of rankscope_loss_std over the latest step and the "
     "steps completed in the spike window.",
     MetricType::Gauge},
    {"rankscope_loss_range_max_window",
     "Max of rankscope_loss_range over the latest step and the "
     "steps completed in the spike window.",
     MetricType::Gauge},
    {"rankscope_grad_norm_cv_max_window",
     "Max of rankscope_grad_norm_cv over the latest step and "
     "the steps completed in the spike window.",
     MetricType::Gauge},
    {"rankscope_grad_cosine_mean_min_window",
     "Min of rankscope_grad_cosine_mean over the latest "
     "step and the steps completed in the spike window.",
     MetricType::Gauge},
    {"rankscope_steps_total", "Steps of the training job joined and exported.",
     MetricType::Counter},
    {"rankscope_steps_timed_out_total", "Steps closed by the join timeout with ranks missing.",
     MetricType::Counter},
    {"rankscope_steps_nonfinite_total",
     "Steps with a NaN or Inf loss, gradient-norm or cosine "
     "statistic.",
     MetricType::Counter},
    {"rankscope_agent_dropped_reports_total",
     "Reports dropped by the training job's agents "
     "because their queue was full.",
     MetricType::Counter},
    {"rankscope_rank_grad_cosine",
     "Consensus cosine of the rank's gradient sketch with the sum "
     "of the other ranks' at the latest step (most deviating ranks only).",
     MetricType::Gauge},
    {"rankscope_rank_loss_z",
     "Z-score of the rank's local loss at the latest step (most "
     "deviating ranks only).",
     MetricType::Gauge},
    {"rankscope_rank_grad_norm_z",
     "Z-score of the rank's local gradient L2 norm at the latest "
     "step (most deviating ranks only).",
     MetricType::Gauge},
    {"rankscope_rank_missing",
     "1 for each rank missing from the latest step (capped; "
     "world_size - ranks_reporting is the full count).",
     MetricType::Gauge},
    {"rankscope_rank_outlier_score",
     "Robust outlier score of the rank held over its last 3 reported steps (the smallest of "
     "them): per step the largest of the median/MAD z-scores of its loss and gradient norm and "
     "the deficit of its consensus cosine (most deviating ranks only; above 6: a persistent "
     "outlier).",
     MetricType::Gauge},
    {"rankscope_rank_step_time_seconds",
     "The rank's own compute time of the latest step, up to its gradient hook (most deviating "
     "ranks only).",
     MetricType::Gauge},
    {"rankscope_rank_step_time_z",
     "Robust z-score of the rank's step time at the latest step; a straggler is large and "
     "positive (most deviating ranks only).",
     MetricType::Gauge},
    {"rankscope_grad_noise_scale",
     "Gradient noise scale B_simple (McCandlish et al. 2018) of the latest step where it was "
     "defined, in samples.",
     MetricType::Gauge},
    {"rankscope_replica_divergent_ranks",
     "Most ranks whose replica fingerprint differed from the majority in one checked step of "
     "the spike window.",
     MetricType::Gauge},
    {"rankscope_replica_checks_total", "Steps whose replica fingerprints were compared.",
     MetricType::Counter},
    {"rankscope_replica_divergent_steps_total",
     "Checked steps in which some rank's replica fingerprint differed.", MetricType::Counter},
    {"rankscope_rank_replica_divergent",
     "1 for each rank whose replica fingerprint differed in a step of the spike window (capped).",
     MetricType::Gauge},
    {"rankscope_duplicate_ranks",
     "Ranks whose local gradient was identical or nearly so (sketch cosine >= 0.999) to another "
     "rank's at the latest step: ranks that train on the same data.",
     MetricType::Gauge},
    {"rankscope_duplicate_steps_total",
     "Steps in which two or more ranks had identical or near-identical local gradients.",
     MetricType::Counter},
    {"rankscope_rank_info",
     "1 for each rank with per-rank series (most deviating, missing, replica-divergent ranks): "
     "its global rank, host and agent version, as its agent stated them.",
     MetricType::Gauge},
    {"rankscope_job_groups", "Data-parallel groups of the training job exported.",
     MetricType::Gauge},
    {"rankscope_job_grad_cosine_mean_min",
     "The least consistent data-parallel group's mean pairwise cosine at its latest step.",
     MetricType::Gauge},
    {"rankscope_job_groups_with_outliers",
     "Data-parallel groups of the job with a persistent outlier rank at their latest step.",
     MetricType::Gauge},
    {"rankscope_job_groups_replica_divergent",
     "Data-parallel groups of the job whose latest checked step had a divergent replica.",
     MetricType::Gauge},
    {"rankscope_rank_drift_score",
     "The rank's data-drift CUSUM (loss, gradient norm and consensus cosine rank scores) over "
     "its threshold at the latest step; above 1 the rank is named drifting (most deviating "
     "ranks only).",
     MetricType::Gauge},
    {"rankscope_rank_slow_score",
     "The rank's step-time CUSUM over its threshold at the latest step; above 1 the rank is "
     "named slow (most deviating ranks only).",
     MetricType::Gauge},
    {"rankscope_drifting_ranks",
     "Ranks whose data-drift CUSUM was above its threshold at the latest step "
     "(step_stats.drifting_ranks).",
     MetricType::Gauge},
    {"rankscope_slow_ranks",
     "Ranks whose step-time CUSUM was above its threshold at the latest step "
     "(step_stats.slow_ranks): stragglers.",
     MetricType::Gauge},
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

// Max/min that ignore NaN unless both are NaN (PromQL's max_over_time semantics).
double MaxIgnoringNaN(double a, double b) { return std::fmax(a, b); }
double MinIgnoringNaN(double a, double b) { return std::fmin(a, b); }

bool IsNonfinite(const StepStatistics& s, bool loss_absent) {
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

// Deviation keys: larger is more deviating; NaN is the most deviating.
double CosineDeviation(const RankStatistics& r) {
  return std::isnan(r.consensus_cosine) ? std::numeric_limits<double>::infinity()
                                        : -r.consensus_cosine;
}
double AbsZ(double z) {
  return std::isnan(z) ? std::numeric_limits<double>::infinity() : std::fabs(z);
}

// Indices into `ranks` of the (at most) `limit` most deviating by `key(index)`, most deviating
// first.
template <typename Key>
std::vector<uint32_t> TopByDeviation(const std::vector<RankStatistics>& ranks, size_t limit,
                                     Key key) {
  std::vector<uint32_t> order(ranks.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  const size_t n = std::min(limit, order.size());
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](uint32_t a, uint32_t b) {
    const double ka = key(a);
    const double kb = key(b);
    if (ka != kb) return ka > kb;
    return ranks[a].rank < ranks[b].rank;
  });
  order.resize(n);
  return order;
}

// Larger is more deviating; an unknown value (NaN) is the least deviating for these keys, since
// it means "not measured" (a non-finite rank already has a NaN outlier score, which ranks first
// through the cosine and z rankings).
double KnownOrLowest(double v) {
  return std::isnan(v) ? -std::numeric_limits<double>::infinity() : v;
}

// The ranks exported per rank: round-robin over the rankings, without duplicates.
std::vector<uint32_t> SelectDeviatingRanks(const std::vector<RankStatistics>& ranks,
                                           absl::Span<const RankExtras> extras, size_t limit) {
  const size_t n = std::min(limit, ranks.size());
  if (n == 0) return {};
  const bool has_extras = extras.size() == ranks.size();
  auto outlier = [&](uint32_t i) {
    return has_extras ? KnownOrLowest(extras[i].held_outlier_score)
                      : -std::numeric_limits<double>::infinity();
  };
  auto cosine = [&](uint32_t i) { return CosineDeviation(ranks[i]); };
  if (n == ranks.size()) {
    // Everything fits: order by the primary ranking only.
    return has_extras ? TopByDeviation(ranks, n, outlier) : TopByDeviation(ranks, n, cosine);
  }
  std::vector<std::vector<uint32_t>> rankings;
  if (has_extras) rankings.push_back(TopByDeviation(ranks, n, outlier));
  rankings.push_back(TopByDeviation(ranks, n, cosine));
  rankings.push_back(TopByDeviation(ranks, n, [&](uint32_t i) { return AbsZ(ranks[i].loss_z); }));
  rankings.push_back(
      TopByDeviation(ranks, n, [&](uint32_t i) { return AbsZ(ranks[i].grad_norm_z); }));
  if (has_extras) {
    rankings.push_back(
        TopByDeviation(ranks, n, [&](uint32_t i) { return KnownOrLowest(extras[i].step_time_z); }));
    rankings.push_back(
        TopByDeviation(ranks, n, [&](uint32_t i) { return KnownOrLowest(extras[i].drift_score); }));
    rankings.push_back(
        TopByDeviation(ranks, n, [&](uint32_t i) { return KnownOrLowest(extras[i].slow_score); }));
  }
  std::vector<uint32_t> chosen;
  chosen.reserve(n);
  std::vector<bool> taken(ranks.size(), false);
  // Each ranking holds n distinct indices, so this ends with n chosen.
  for (size_t depth = 0; chosen.size() < n; ++depth) {
    for (const auto& ranking : rankings) {
      if (chosen.size() == n) break;
      const uint32_t index = ranking[depth];
      if (!taken[index]) {
        taken[index] = true;
        chosen.push_back(index);
      }
    }
  }
  return chosen;
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
  // A smaller count means the agent restarted and counts from zero again.
  state.dropped_total += dropped_total >= last ? dropped_total - last : dropped_total;
  last = dropped_total;
}

void JobMetrics::OnStep(const std::string& job, const ExportedStep& step) {
  const absl::Time now = options_.clock();

  StepStatistics latest;
  std::vector<RankPoint> top_ranks;
  if (step.stats != nullptr) {
    const StepStatistics& s = *step.stats;
    latest.ranks = s.ranks;
    latest.loss_mean = s.loss_mean;
    latest.loss_std = s.loss_std;
    latest.loss_range = s.loss_range;
    latest.grad_norm_mean = s.grad_norm_mean;
    latest.grad_norm_std = s.grad_norm_std;
    latest.grad_norm_cv = s.grad_norm_cv;
    latest.grad_cosine_mean = s.grad_cosine_mean;
    const bool has_extras = step.extras.size() == s.per_rank.size();
    for (uint32_t index :
         SelectDeviatingRanks(s.per_rank, step.extras, options_.per_rank_series_limit)) {
      const RankStatistics& r = s.per_rank[index];
      const RankExtras e = has_extras ? step.extras[index] : RankExtras{};
      top_ranks.push_back({r.rank, r.consensus_cosine, r.loss_z, r.grad_norm_z,
                           e.held_outlier_score, e.step_time_seconds, e.step_time_z, e.drift_score,
                           e.slow_score, has_extras});
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
  state.ranks_reporting = latest.ranks;
  ++state.steps_total;
  if (step.timed_out) ++state.steps_timed_out_total;
  if (IsNonfinite(latest, step.loss_absent)) ++state.steps_nonfinite_total;
  state.duplicate_ranks = step.duplicate_ranks;
  state.has_sequential = !step.extras.empty();
  state.drifting_ranks = static_cast<uint32_t>(step.drifting_ranks.size());
  state.slow_ranks = static_cast<uint32_t>(step.slow_ranks.size());
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

  const absl::Duration window = options_.spike_window;
  if (window <= absl::ZeroDuration()) return;  // the window metrics equal the latest step
  const absl::Duration granularity = window / kWindowBuckets;
  const WindowPoint point{absl::UnixEpoch() + absl::Floor(now - absl::UnixEpoch(), granularity),
                          latest.loss_std,
                          latest.loss_range,
                          latest.grad_norm_cv,
                          latest.grad_cosine_mean,
                          replica_divergent};
  std::deque<WindowPoint>& points = state.window;
  if (!points.empty() && points.back().at >= point.at) {
    // Same bucket (or the clock went back): merge, keeping the deque ordered.
    WindowPoint& back = points.back();
    back.loss_std = MaxIgnoringNaN(back.loss_std, point.loss_std);
    back.loss_range = MaxIgnoringNaN(back.loss_range, point.loss_range);
    back.grad_norm_cv = MaxIgnoringNaN(back.grad_norm_cv, point.grad_norm_cv);
    back.grad_cosine_mean = MinIgnoringNaN(back.grad_cosine_mean, point.grad_cosine_mean);
    back.replica_divergent = MaxIgnoringNaN(back.replica_divergent, point.replica_divergent);
  } else {
    points.push_back(point);
  }
  while (!points.empty() && points.front().at + granularity <= now - window) points.pop_front();
  while (points.size() > static_cast<size_t>(kWindowBuckets) + 2) points.pop_front();
}

std::vector<MetricFamily> JobMetrics::Collect() const {
  const absl::Time now = options_.clock();
  const absl::Duration window = options_.spike_window;
  const absl::Duration granularity =
      window > absl::ZeroDuration() ? window / kWindowBuckets : absl::ZeroDuration();

  std::vector<MetricFamily> families(kFamilyCount);
  for (size_t i = 0; i < kFamilyCount; ++i) {
    families[i].name = kFamilies[i].name;
    families[i].help = kFamilies[i].help;
    families[i].type = kFamilies[i].type;
  }

  {
    MutexLock lock(&mu_);
    std::vector<const std::pair<const std::string, JobState>*> live;
    live.reserve(jobs_.size());
    for (const auto& entry : jobs_) {
      if (!Expired(entry.second, now)) live.push_back(&entry);
    }
    std::sort(live.begin(), live.end(),
              [](const auto* a, const auto* b) { return a->first < b->first; });

    // Job-level aggregates across the job's data-parallel groups (a job without groups is one).
    struct JobAggregate {
      int groups = 0;
      double cosine_min = kNaN;
      int with_outliers = 0;
      int replica_divergent = 0;
    };
    std::map<std::string, JobAggregate> by_job;
    for (const auto* entry : live) {
      const JobState& state = entry->second;
      JobAggregate& a = by_job[std::string(SplitGroupKey(entry->first).first)];
      ++a.groups;
      if (!state.has_step) continue;
      a.cosine_min = MinIgnoringNaN(a.cosine_min, state.latest.grad_cosine_mean);
      a.with_outliers += state.outlier_ranks_latest > 0 ? 1 : 0;
      a.replica_divergent += state.replica_divergent_checked ? 1 : 0;
    }
    for (const auto& [job, a] : by_job) {
      const std::vector<ClientMetric::Label> labels = {{"train_job", job}};
      AddSample(families[kJobGroups], labels, a.groups);
      if (!std::isnan(a.cosine_min))
        AddSample(families[kJobGradCosineMeanMin], labels, a.cosine_min);
      AddSample(families[kJobGroupsWithOutliers], labels, a.with_outliers);
      AddSample(families[kJobGroupsReplicaDivergent], labels, a.replica_divergent);
    }

    // A job of more groups than per_job_group_series_limit exports the series of its most
    // deviating groups only (a divergent replica or an outlier first, then the lowest latest
    // cosine); the aggregates above cover every group.
    absl::flat_hash_set<const std::string*> hidden;
    {
      std::map<absl::string_view, std::vector<const std::pair<const std::string, JobState>*>>
          groups_of;
      for (const auto* entry : live) groups_of[SplitGroupKey(entry->first).first].push_back(entry);
      const size_t limit = options_.per_job_group_series_limit;
      for (auto& [job, groups] : groups_of) {
        if (groups.size() <= limit) continue;
        auto deviation = [](const JobState& st) {
          const bool flagged = st.outlier_ranks_latest > 0 || st.replica_divergent_checked;
          const double cos = st.has_step && !std::isnan(st.latest.grad_cosine_mean)
                                 ? st.latest.grad_cosine_mean
                                 : std::numeric_limits<double>::infinity();
          return std::make_pair(!flagged, cos);
        };
        std::stable_sort(groups.begin(), groups.end(), [&](const auto* a, const auto* b) {
          return deviation(a->second) < deviation(b->second);
        });
        for (size_t i = limit; i < groups.size(); ++i) hidden.insert(&groups[i]->first);
      }
    }

    for (const auto* entry : live) {
      if (hidden.contains(&entry->first)) continue;
      const std::string& job = entry->first;
      const JobState& state = entry->second;
      const std::vector<ClientMetric::Label> job_labels = JobLabels(job);
      auto add = [&](Family f, double value) { AddSample(families[f], job_labels, value); };

      if (state.world_size > 0) add(kWorldSize, state.world_size);
      add(kConnectedAgents, state.connected);
      add(kStepsTotal, static_cast<double>(state.steps_total));
      add(kStepsTimedOutTotal, static_cast<double>(state.steps_timed_out_total));
      add(kStepsNonfiniteTotal, static_cast<double>(state.steps_nonfinite_total));
      add(kDuplicateStepsTotal, static_cast<double>(state.duplicate_steps_total));
      add(kAgentDroppedReportsTotal, static_cast<double>(state.dropped_total));
      if (!state.has_step) continue;

      const StepStatistics& s = state.latest;
      add(kStep, static_cast<double>(state.step));
      add(kRanksReporting, state.ranks_reporting);
      add(kLossMean, s.loss_mean);
      add(kLossStd, s.loss_std);
      add(kLossRange, s.loss_range);
      add(kGradNormMean, s.grad_norm_mean);
      add(kGradNormStd, s.grad_norm_std);
      add(kGradNormCv, s.grad_norm_cv);
      add(kGradCosineMean, s.grad_cosine_mean);
      add(kDuplicateRanks, state.duplicate_ranks);
      if (state.has_sequential) {
        add(kDriftingRanks, state.drifting_ranks);
        add(kSlowRanks, state.slow_ranks);
      }

      WindowPoint worst{now,
                        s.loss_std,
                        s.loss_range,
                        s.grad_norm_cv,
                        s.grad_cosine_mean,
                        state.replica_divergent_latest};
      for (const WindowPoint& p : state.window) {
        if (p.at + granularity <= now - window) continue;  // bucket entirely before the window
        worst.loss_std = MaxIgnoringNaN(worst.loss_std, p.loss_std);
        worst.loss_range = MaxIgnoringNaN(worst.loss_range, p.loss_range);
        worst.grad_norm_cv = MaxIgnoringNaN(worst.grad_norm_cv, p.grad_norm_cv);
        worst.grad_cosine_mean = MinIgnoringNaN(worst.grad_cosine_mean, p.grad_cosine_mean);
        worst.replica_divergent = MaxIgnoringNaN(worst.replica_divergent, p.replica_divergent);
      }
      add(kLossStdMaxWindow, worst.loss_std);
      add(kLossRangeMaxWindow, worst.loss_range);
      add(kGradNormCvMaxWindow, worst.grad_norm_cv);
      add(kGradCosineMeanMinWindow, worst.grad_cosine_mean);

      // An ended job's latest step is not news: its deviating ranks are not exported.
      const bool ended = state.had_agents && state.connected == 0;
      const absl::Span<const RankPoint> top_ranks =
          ended ? absl::Span<const RankPoint>() : absl::MakeConstSpan(state.top_ranks);
      for (const RankPoint& r : top_ranks) {
        std::vector<ClientMetric::Label> labels = RankLabels(job, r.rank);
        AddSample(families[kRankGradCosine], labels, r.grad_cosine);
        AddSample(families[kRankLossZ], labels, r.loss_z);
        AddSample(families[kRankGradNormZ], labels, r.grad_norm_z);
        if (r.has_extras) {
          AddSample(families[kRankOutlierScore], labels, r.outlier_score);
          AddSample(families[kRankDriftScore], labels, r.drift_score);
          AddSample(families[kRankSlowScore], labels, r.slow_score);
        }
        if (!std::isnan(r.step_time_seconds)) {
          AddSample(families[kRankStepTimeSeconds], labels, r.step_time_seconds);
          AddSample(families[kRankStepTimeZ], std::move(labels), r.step_time_z);
        }
      }
      if (!std::isnan(state.grad_noise_scale)) add(kGradNoiseScale, state.grad_noise_scale);
      if (state.replica_checks_total > 0) {
        add(kReplicaDivergentRanks,
            std::isnan(worst.replica_divergent) ? 0.0 : worst.replica_divergent);
        add(kReplicaChecksTotal, static_cast<double>(state.replica_checks_total));
        add(kReplicaDivergentStepsTotal, static_cast<double>(state.replica_divergent_steps_total));
        std::vector<uint32_t> divergent;
        for (const auto& [rank, at] : state.replica_divergent_at) {
          if (at >= now - window) divergent.push_back(rank);
        }
        std::sort(divergent.begin(), divergent.end());
        if (divergent.size() > options_.per_rank_series_limit) {
          divergent.resize(options_.per_rank_series_limit);
        }
        for (uint32_t rank : divergent) {
          AddSample(families[kRankReplicaDivergent], RankLabels(job, rank), 1);
        }
      }
      for (uint32_t rank : state.missing) {
        AddSample(families[kRankMissing], RankLabels(job, rank), 1);
      }
      // Who the ranks with per-rank series are: their global rank and host.
      absl::flat_hash_set<uint32_t> shown;
      for (const RankPoint& r : top_ranks) shown.insert(r.rank);
      for (uint32_t rank : state.missing) shown.insert(rank);
      for (const auto& [rank, at] : state.replica_divergent_at) {
        if (at >= now - window) shown.insert(rank);
      }
      std::vector<uint32_t> ordered(shown.begin(), shown.end());
      std::sort(ordered.begin(), ordered.end());
      for (uint32_t rank : ordered) {
        auto who = state.identities.find(rank);
        if (who == state.identities.end()) continue;
        std::vector<ClientMetric::Label> labels = RankLabels(job, rank);
        labels.push_back({"global_rank", who->second.global_rank
                                             ? absl::StrCat(*who->second.global_rank)
                                             : std::string()});
        labels.push_back({"host", who->second.host});
        labels.push_back({"version", who->second.agent_version});
        AddSample(families[kRankInfo], std::move(labels), 1);
      }
    }
  }

  // A family with no sample would be HELP and TYPE alone: leave it out.
  families.erase(std::remove_if(families.begin(), families.end(),
                                [](const MetricFamily& f) { return f.metric.empty(); }),
                 families.end());
  return families;
}

}  // namespace rankscope::collector
