// Tests of the Prometheus sink: JobMetrics (per-job statistics) and HealthMetrics (the
// collector's own health). Time is injected through ExportOptions::clock; the serialized text is
// checked by the real `promtool check metrics`.
#include "collector/metrics/prometheus_export.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collector/metrics/health_metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace rankscope::collector {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAreArray;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const absl::Time kStart = absl::FromUnixSeconds(1'700'000'000);

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() const { return now_; }
  void Advance(absl::Duration d) { now_ += d; }
  std::function<absl::Time()> AsFunction() {
    return [this] { return now_; };
  }

 private:
  absl::Time now_ = kStart;
};

ExportOptions OptionsWith(FakeClock& clock, size_t per_rank_limit = 32) {
  ExportOptions options;
  options.per_rank_series_limit = per_rank_limit;
  options.spike_window = absl::Seconds(60);
  options.job_expiry = absl::Hours(1);
  options.clock = clock.AsFunction();
  return options;
}

// Statistics of a healthy step of `world` ranks with the given loss std (other fields fixed).
StepStatistics HealthyStats(uint32_t world, double loss_std = 0.1) {
  StepStatistics s;
  s.ranks = world;
  s.loss_mean = 2.0;
  s.loss_std = loss_std;
  s.loss_range = 4 * loss_std;
  s.grad_norm_mean = 1.5;
  s.grad_norm_std = 0.15;
  s.grad_norm_cv = 0.1;
  s.grad_cosine_mean = 0.8;
  for (uint32_t r = 0; r < world; ++r) {
    // Mild, distinct deviations so no ties decide the per-rank order by accident.
    const double jitter = static_cast<double>((r * 7919) % 1000) / 1000.0;  // [0, 1)
    s.per_rank.push_back({r, 0.9 - 0.05 * jitter, 0.5 * jitter, -0.5 * jitter});
  }
  return s;
}

ExportedStep Step(uint64_t number, const StepStatistics& stats, uint32_t world,
                  absl::Span<const uint32_t> missing = {}, bool timed_out = false) {
  ExportedStep step;
  step.step = number;
  step.world_size = world;
  step.timed_out = timed_out;
  step.stats = &stats;
  step.missing_ranks = missing;
  return step;
}

const MetricFamily* FindFamily(const std::vector<MetricFamily>& families, const std::string& name) {
  for (const MetricFamily& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::vector<ClientMetric::Label> Labels(const std::string& job,
                                        std::optional<uint32_t> rank = std::nullopt) {
  std::vector<ClientMetric::Label> labels = {{"train_job", job}};
  if (rank) labels.push_back({"rank", absl::StrCat(*rank)});
  return labels;
}

// The value of the series `name{labels}`, or nullopt if it is not exported.
std::optional<double> Value(const std::vector<MetricFamily>& families, const std::string& name,
                            std::vector<ClientMetric::Label> labels) {
  const MetricFamily* f = FindFamily(families, name);
  if (f == nullptr) return std::nullopt;
  std::sort(labels.begin(), labels.end());
  for (const ClientMetric& m : f->metric) {
    std::vector<ClientMetric::Label> have = m.label;
    std::sort(have.begin(), have.end());
    if (have != labels) continue;
    switch (f->type) {
      case MetricType::Counter:
        return m.counter.value;
      case MetricType::Gauge:
        return m.gauge.value;
      default:
        ADD_FAILURE() << name << " is neither a counter nor a gauge";
        return std::nullopt;
    }
  }
  return std::nullopt;
}

// The `rank` label values of family `name` for `job`.
std::set<uint32_t> RanksOf(const std::vector<MetricFamily>& families, const std::string& name,
                           const std::string& job) {
  std::set<uint32_t> ranks;
  const MetricFamily* f = FindFamily(families, name);
  if (f == nullptr) return ranks;
  for (const ClientMetric& m : f->metric) {
    std::string train_job, rank;
    for (const auto& l : m.label) {
      if (l.name == "train_job") train_job = l.value;
      if (l.name == "rank") rank = l.value;
    }
    if (train_job == job) ranks.insert(static_cast<uint32_t>(std::stoul(rank)));
  }
  return ranks;
}

std::string Serialize(const std::vector<MetricFamily>& families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

// promtool is a hard dependency of these tests (Debian package `prometheus`).
std::string PromtoolPath() {
  if (const char* env = std::getenv("PROMTOOL"); env != nullptr && *env != '\0') return env;
  if (access("/usr/bin/promtool", X_OK) == 0) return "/usr/bin/promtool";
  return "";
}

struct PromtoolResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr: the problems found
};

// Runs `promtool check metrics` on `text` (stdin from a temp file).
PromtoolResult RunPromtoolCheckMetrics(const std::string& text) {
  PromtoolResult result;
  const std::string promtool = PromtoolPath();
  if (promtool.empty()) {
    ADD_FAILURE() << "promtool not found (looked at $PROMTOOL and /usr/bin/promtool): install "
                     "the Debian package `prometheus`; `promtool check metrics` is how these "
                     "tests verify the exposition format";
    return result;
  }
  static std::atomic<int> counter{0};
  const std::string path = absl::StrCat(::testing::TempDir(), "/rankscope_metrics_", getpid(), "_",
                                        counter.fetch_add(1), ".prom");
  {
    std::ofstream file(path, std::ios::binary);
    file << text;
    if (!file) {
      ADD_FAILURE() << "cannot write " << path;
      return result;
    }
  }
  const std::string command = absl::StrCat("'", promtool, "' check metrics < '", path, "' 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << command;
    std::remove(path.c_str());
    return result;
  }
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::remove(path.c_str());
  return result;
}

void ExpectPromtoolClean(const std::string& text) {
  const PromtoolResult r = RunPromtoolCheckMetrics(text);
  EXPECT_EQ(r.exit_code, 0) << "promtool check metrics failed:\n" << r.output << "\non:\n" << text;
  EXPECT_THAT(r.output, IsEmpty()) << "on:\n" << text;
}

// ---------------------------------------------------------------------------------------------
// JobMetrics: latest step, counters, labels.

TEST(JobMetricsTest, NothingExportedBeforeAnyEvent) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  EXPECT_THAT(metrics.Collect(), IsEmpty());
}

TEST(JobMetricsTest, ExportsLatestStepGaugesLabelledByTrainJob) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics first = HealthyStats(8, 0.1);
  StepStatistics second = HealthyStats(8, 0.2);
  second.loss_mean = 1.75;
  second.grad_cosine_mean = 0.5;
  metrics.OnStep("exp-42", Step(10, first, 8));
  clock.Advance(absl::Seconds(1));
  metrics.OnStep("exp-42", Step(11, second, 8));

  const auto families = metrics.Collect();
  const auto job = Labels("exp-42");
  EXPECT_EQ(Value(families, "rankscope_step", job), 11);
  EXPECT_EQ(Value(families, "rankscope_world_size", job), 8);
  EXPECT_EQ(Value(families, "rankscope_ranks_reporting", job), 8);
  EXPECT_EQ(Value(families, "rankscope_loss_mean", job), 1.75);
  EXPECT_EQ(Value(families, "rankscope_loss_std", job), 0.2);
  EXPECT_EQ(Value(families, "rankscope_loss_range", job), 0.8);
  EXPECT_EQ(Value(families, "rankscope_grad_norm_mean", job), 1.5);
  EXPECT_EQ(Value(families, "rankscope_grad_norm_std", job), 0.15);
  EXPECT_EQ(Value(families, "rankscope_grad_norm_cv", job), 0.1);
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean", job), 0.5);
  EXPECT_EQ(Value(families, "rankscope_steps_total", job), 2);

  for (const MetricFamily& f : families) {
    EXPECT_FALSE(f.help.empty()) << f.name;
    EXPECT_FALSE(f.metric.empty()) << f.name;
    EXPECT_EQ(f.name.rfind("rankscope_", 0), 0u) << f.name;
    EXPECT_EQ(f.type == MetricType::Counter,
              f.name.size() > 6 && f.name.compare(f.name.size() - 6, 6, "_total") == 0)
        << f.name;
    // The series budget's two gauges are the collector's, not a job's: no label.
    if (f.name == "rankscope_export_series" || f.name == "rankscope_export_groups_capped") {
      ASSERT_EQ(f.metric.size(), 1u) << f.name;
      EXPECT_TRUE(f.metric[0].label.empty()) << f.name;
      continue;
    }
    for (const ClientMetric& m : f.metric) {
      ASSERT_FALSE(m.label.empty()) << f.name;
      EXPECT_EQ(m.label[0].name, "train_job") << f.name;
      EXPECT_EQ(m.label[0].value, "exp-42") << f.name;
    }
  }

  const std::string text = Serialize(families);
  EXPECT_THAT(text, HasSubstr("# HELP rankscope_loss_std "));
  EXPECT_THAT(text, HasSubstr("# TYPE rankscope_loss_std gauge"));
  EXPECT_THAT(text, HasSubstr("# TYPE rankscope_steps_total counter"));
  EXPECT_THAT(text, HasSubstr("rankscope_step{train_job=\"exp-42\"} 11"));
}

TEST(JobMetricsTest, JobsAreSeparateSeries) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics a = HealthyStats(4, 0.1);
  const StepStatistics b = HealthyStats(2, 0.3);
  metrics.OnStep("a", Step(1, a, 4));
  metrics.OnStep("b", Step(7, b, 2));
  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_step", Labels("a")), 1);
  EXPECT_EQ(Value(families, "rankscope_step", Labels("b")), 7);
  EXPECT_EQ(Value(families, "rankscope_loss_std", Labels("b")), 0.3);
  EXPECT_EQ(Value(families, "rankscope_world_size", Labels("b")), 2);
}

TEST(JobMetricsTest, CountsStepsTimedOutAndNonfinite) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics ok = HealthyStats(4);
  StepStatistics nan_loss = HealthyStats(4);
  nan_loss.loss_mean = nan_loss.loss_std = nan_loss.loss_range = kNaN;
  StepStatistics single = HealthyStats(1);
  single.grad_cosine_mean = kNaN;  // one rank: no pairs, which is not a non-finite input
  const std::vector<uint32_t> missing = {3};

  metrics.OnStep("j", Step(1, ok, 4));
  metrics.OnStep("j", Step(2, ok, 4, missing, /*timed_out=*/true));
  metrics.OnStep("j", Step(3, nan_loss, 4));
  metrics.OnStep("j", Step(4, single, 4, {}, true));
  metrics.OnStep("j", Step(5, ok, 4));

  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_steps_total", Labels("j")), 5);
  EXPECT_EQ(Value(families, "rankscope_steps_timed_out_total", Labels("j")), 2);
  EXPECT_EQ(Value(families, "rankscope_steps_nonfinite_total", Labels("j")), 1);
}

TEST(JobMetricsTest, CountsAggregationChecksAndNamesTheLatestFailure) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics ok = HealthyStats(4);
  metrics.OnStep("j", Step(1, ok, 4));  // not checked: no integrity series yet
  EXPECT_EQ(Value(metrics.Collect(), "rankscope_integrity_checks_total", Labels("j")),
            std::nullopt);

  AggregationVerdict clean;
  clean.checked = true;
  clean.error = 1.0;
  clean.tolerance = 4.0;
  AggregationVerdict missing = clean;
  missing.error = 40.0;
  missing.flagged = true;
  missing.fault = AggregationFault::kMissing;
  missing.suspect_rank = 2;
  ExportedStep step = Step(2, ok, 4);
  step.integrity = &clean;
  metrics.OnStep("j", step);
  step = Step(3, ok, 4);
  step.integrity = &missing;
  metrics.OnStep("j", step);
  step = Step(4, ok, 4);
  step.integrity = &clean;
  metrics.OnStep("j", step);

  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_integrity_checks_total", Labels("j")), 3);
  EXPECT_EQ(Value(families, "rankscope_integrity_failed_steps_total", Labels("j")), 1);
  EXPECT_EQ(Value(families, "rankscope_integrity_error_ratio", Labels("j")), 0.25);
  EXPECT_EQ(Value(families, "rankscope_integrity_suspect_rank",
                  {{"train_job", "j"}, {"fault", "missing"}}),
            2);
  ExpectPromtoolClean(Serialize(families));
}

TEST(JobMetricsTest, NaNIsExportedAsNaN) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  StepStatistics s = HealthyStats(4);
  s.loss_mean = s.loss_std = s.loss_range = kNaN;
  s.per_rank[2].loss_z = kNaN;
  metrics.OnStep("j", Step(1, s, 4));
  const auto families = metrics.Collect();
  const auto loss_std = Value(families, "rankscope_loss_std", Labels("j"));
  ASSERT_TRUE(loss_std.has_value());
  EXPECT_TRUE(std::isnan(*loss_std));
  // The only step is NaN, so the window is NaN too.
  const auto window = Value(families, "rankscope_loss_std_max_window", Labels("j"));
  ASSERT_TRUE(window.has_value());
  EXPECT_TRUE(std::isnan(*window));
  const auto z = Value(families, "rankscope_rank_loss_z", Labels("j", 2));
  ASSERT_TRUE(z.has_value());
  EXPECT_TRUE(std::isnan(*z));
  ExpectPromtoolClean(Serialize(families));
}

TEST(JobMetricsTest, ConnectedAgentsAndWorldSizeBeforeAnyStep) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  metrics.OnAgentConnected("j", 16);
  metrics.OnAgentConnected("j", 16);
  metrics.OnAgentConnected("j", 16);
  metrics.OnAgentDisconnected("j");
  metrics.OnAgentDisconnected("unknown-job");  // creates nothing
  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_connected_agents", Labels("j")), 2);
  EXPECT_EQ(Value(families, "rankscope_world_size", Labels("j")), 16);
  EXPECT_EQ(Value(families, "rankscope_steps_total", Labels("j")), 0);
  EXPECT_FALSE(Value(families, "rankscope_step", Labels("j")).has_value());
  EXPECT_FALSE(Value(families, "rankscope_connected_agents", Labels("unknown-job")).has_value());
  ExpectPromtoolClean(Serialize(families));
}

// A job of two data-parallel groups: each group's series carry {train_job, group}, the job-level
// aggregates name the least consistent group's cosine and count groups with outliers, and the
// ranks with per-rank series say who they are.
TEST(JobMetricsTest, GroupsAreLabelledAndAggregatedPerJob) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  for (uint32_t r = 0; r < 2; ++r) {
    RankIdentity who;
    who.known = true;
    who.rank = r;
    who.global_rank = 2 * r + 1;  // the odd ranks: group dp1
    who.host = absl::StrCat("node-", r);
    who.agent_version = r == 0 ? "0.1.0" : "0.0.9";  // mixed versions in one job
    metrics.OnAgentConnected("exp/dp1", 2, who);
  }
  metrics.OnAgentConnected("exp/dp0", 2);  // an agent that stated nothing
  StepStatistics calm = HealthyStats(2);
  StepStatistics off = HealthyStats(2);
  off.grad_cosine_mean = 0.1;
  ExportedStep calm_step = Step(5, calm, 2);
  ExportedStep off_step = Step(5, off, 2);
  off_step.outlier_ranks = 1;
  metrics.OnStep("exp/dp0", calm_step);
  metrics.OnStep("exp/dp1", off_step);
  metrics.OnStep("solo", Step(3, calm, 2));
  const auto families = metrics.Collect();
  const std::vector<ClientMetric::Label> dp1 = {{"train_job", "exp"}, {"group", "dp1"}};
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean", dp1), 0.1);
  EXPECT_EQ(Value(families, "rankscope_step", {{"train_job", "exp"}, {"group", "dp0"}}), 5);
  EXPECT_FALSE(Value(families, "rankscope_step", Labels("exp/dp1")).has_value());
  EXPECT_EQ(Value(families, "rankscope_rank_grad_cosine",
                  {{"train_job", "exp"}, {"group", "dp1"}, {"rank", "1"}}),
            off.per_rank[1].consensus_cosine);
  EXPECT_EQ(Value(families, "rankscope_job_groups", Labels("exp")), 2);
  EXPECT_EQ(Value(families, "rankscope_job_grad_cosine_mean_min", Labels("exp")), 0.1);
  EXPECT_EQ(Value(families, "rankscope_job_groups_with_outliers", Labels("exp")), 1);
  EXPECT_EQ(Value(families, "rankscope_job_groups_replica_divergent", Labels("exp")), 0);
  EXPECT_EQ(Value(families, "rankscope_job_groups", Labels("solo")), 1);
  EXPECT_EQ(Value(families, "rankscope_job_grad_cosine_mean_min", Labels("solo")), 0.8);
  EXPECT_EQ(Value(families, "rankscope_rank_info",
                  {{"train_job", "exp"},
                   {"group", "dp1"},
                   {"rank", "1"},
                   {"global_rank", "3"},
                   {"host", "node-1"},
                   {"version", "0.0.9"}}),
            1);
  // dp0's agent stated no identity: no info series for it.
  const MetricFamily* info = FindFamily(families, "rankscope_rank_info");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->metric.size(), 2u);
  ExpectPromtoolClean(Serialize(families));
}

// Past per_job_group_series_limit groups, only the most deviating groups' series are exported:
// a group with an outlier first, then the lowest consistency; the aggregates count every group.
TEST(JobMetricsTest, GroupSeriesAreCappedToTheMostDeviatingGroups) {
  FakeClock clock;
  ExportOptions options = OptionsWith(clock);
  options.per_job_group_series_limit = 2;
  JobMetrics metrics(options);
  std::vector<StepStatistics> stats(4, HealthyStats(2));
  stats[1].grad_cosine_mean = 0.2;  // the least consistent
  stats[3].grad_cosine_mean = 0.9;  // consistent, but an outlier rank
  for (int g = 0; g < 4; ++g) {
    ExportedStep step = Step(9, stats[g], 2);
    if (g == 3) step.outlier_ranks = 1;
    metrics.OnStep(absl::StrCat("big/g", g), step);
  }
  const auto families = metrics.Collect();
  auto group = [](int g) {
    return std::vector<ClientMetric::Label>{{"train_job", "big"}, {"group", absl::StrCat("g", g)}};
  };
  EXPECT_TRUE(Value(families, "rankscope_step", group(3)).has_value());
  EXPECT_TRUE(Value(families, "rankscope_step", group(1)).has_value());
  EXPECT_FALSE(Value(families, "rankscope_step", group(0)).has_value());
  EXPECT_FALSE(Value(families, "rankscope_step", group(2)).has_value());
  EXPECT_EQ(Value(families, "rankscope_job_groups", Labels("big")), 4);
  EXPECT_EQ(Value(families, "rankscope_job_grad_cosine_mean_min", Labels("big")), 0.2);
}

TEST(JobMetricsTest, DroppedReportsCounterSumsRanksAndSurvivesAgentRestart) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  metrics.OnAgentDropped("j", 0, 5);
  metrics.OnAgentDropped("j", 1, 3);
  metrics.OnAgentDropped("j", 0, 7);  // +2
  metrics.OnAgentDropped("j", 0, 7);  // repeated cumulative count: +0
  metrics.OnAgentStarted("j", 1);     // rank 1's agent restarted (a new process's hello)
  metrics.OnAgentDropped("j", 1, 1);  // +1
  metrics.OnAgentDropped("j", 1, 4);  // +3
  EXPECT_EQ(Value(metrics.Collect(), "rankscope_agent_dropped_reports_total", Labels("j")),
            5 + 3 + 2 + 1 + 3);
}

// Issue 34.5: a hostile agent's dropped_total of 2^64 - 1 followed by a small value made the
// counter go down (a uint64 wrap). The counter never decreases, and one report adds a bound.
TEST(JobMetricsTest, DroppedReportsCounterNeverDecreasesAndOneReportAddsABound) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  auto total = [&] {
    return *Value(metrics.Collect(), "rankscope_agent_dropped_reports_total", Labels("j"));
  };
  metrics.OnAgentDropped("j", 0, 3);
  EXPECT_EQ(total(), 3);
  metrics.OnAgentDropped("j", 0, UINT64_MAX);
  const double after_max = total();
  EXPECT_EQ(after_max, 3 + JobMetrics::kMaxDroppedPerReport);
  metrics.OnAgentDropped("j", 0, 5);  // smaller, same process: adds nothing, takes nothing
  EXPECT_EQ(total(), after_max);
  metrics.OnAgentDropped("j", 0, UINT64_MAX);  // another bounded step
  EXPECT_EQ(total(), after_max + JobMetrics::kMaxDroppedPerReport);
  // A new process of the rank counts from zero again, still never below the total.
  metrics.OnAgentStarted("j", 0);
  metrics.OnAgentDropped("j", 0, 2);
  EXPECT_EQ(total(), after_max + JobMetrics::kMaxDroppedPerReport + 2);
  // Thousands of hostile reports: monotonic and saturating, never wrapping.
  double previous = total();
  for (int i = 0; i < 1000; ++i) {
    metrics.OnAgentStarted("j", 0);
    metrics.OnAgentDropped("j", 0, UINT64_MAX - static_cast<uint64_t>(i));
    metrics.OnAgentDropped("j", 0, static_cast<uint64_t>(i));
    const double now = total();
    ASSERT_GE(now, previous) << i;
    ASSERT_LE(now - previous, JobMetrics::kMaxDroppedPerReport) << i;
    previous = now;
  }
}

// Issue 34.5: the collector's series budget (--max_exported_series) is a cap: whole groups are
// left out, the least deviating first, and the scrape says how many.
TEST(JobMetricsTest, SeriesBudgetLeavesOutWholeLeastDeviatingGroups) {
  FakeClock clock;
  const StepStatistics healthy = HealthyStats(8, 0.1);
  StepStatistics deviating = HealthyStats(8, 0.1);
  deviating.grad_cosine_mean = 0.1;
  auto feed = [&](JobMetrics& metrics, int jobs) {
    for (int j = 0; j < jobs; ++j) {
      metrics.OnStep(absl::StrCat("j", j), Step(1, j == 7 ? deviating : healthy, 8));
    }
  };
  auto exported = [](const std::vector<MetricFamily>& families) {
    return *Value(families, "rankscope_export_series", {});
  };
  JobMetrics one(OptionsWith(clock));
  feed(one, 1);
  const std::vector<MetricFamily> one_families = one.Collect();
  size_t samples = 0;
  for (const MetricFamily& f : one_families) samples += f.metric.size();
  EXPECT_EQ(exported(one_families), samples);  // it counts what the scrape holds
  const size_t per_group = samples - 2 - 4;    // less the two budget gauges and 4 job aggregates

  ExportOptions options = OptionsWith(clock);
  options.max_series = 2 + 10 * 4 + 3 * per_group;  // room for exactly 3 of 10 groups
  JobMetrics capped(options);
  feed(capped, 10);
  const std::vector<MetricFamily> families = capped.Collect();
  samples = 0;
  for (const MetricFamily& f : families) samples += f.metric.size();
  EXPECT_EQ(samples, options.max_series);
  EXPECT_EQ(exported(families), options.max_series);
  EXPECT_EQ(Value(families, "rankscope_export_groups_capped", {}), 7);
  EXPECT_TRUE(Value(families, "rankscope_step", Labels("j7")).has_value());  // most deviating
  int groups_with_step = 0;
  for (int j = 0; j < 10; ++j) {
    groups_with_step += Value(families, "rankscope_step", Labels(absl::StrCat("j", j))) ? 1 : 0;
    // The aggregates cover every job, exported or not.
    EXPECT_TRUE(Value(families, "rankscope_job_groups", Labels(absl::StrCat("j", j))));
  }
  EXPECT_EQ(groups_with_step, 3);

  options.max_series = 0;  // no cap
  JobMetrics unlimited(options);
  feed(unlimited, 10);
  EXPECT_EQ(Value(unlimited.Collect(), "rankscope_export_groups_capped", {}), 0);
}

// ---------------------------------------------------------------------------------------------
// The spike window.

TEST(JobMetricsTest, OneStepSpikeIsSeenUntilTheWindowPasses) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));  // window 60 s
  const StepStatistics calm = HealthyStats(8, 0.1);
  StepStatistics spike = HealthyStats(8, 5.0);
  spike.grad_norm_cv = 2.0;
  spike.grad_cosine_mean = -0.3;

  uint64_t step = 0;
  metrics.OnStep("j", Step(++step, calm, 8));
  clock.Advance(absl::Milliseconds(250));
  metrics.OnStep("j", Step(++step, spike, 8));
  const absl::Time spike_at = clock.Now();
  // One step every 250 ms afterwards, all calm; scrape at various times.
  auto run_until = [&](absl::Time until) {
    while (clock.Now() + absl::Milliseconds(250) <= until) {
      clock.Advance(absl::Milliseconds(250));
      metrics.OnStep("j", Step(++step, calm, 8));
    }
    clock.Advance(until - clock.Now());
  };
  const auto job = Labels("j");

  run_until(spike_at + absl::Seconds(15));
  auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_loss_std", job), 0.1);  // the latest step is calm
  EXPECT_EQ(Value(families, "rankscope_loss_std_max_window", job), 5.0);
  EXPECT_EQ(Value(families, "rankscope_loss_range_max_window", job), 20.0);
  EXPECT_EQ(Value(families, "rankscope_grad_norm_cv_max_window", job), 2.0);
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean_min_window", job), -0.3);

  // Still seen exactly one window after the spike.
  run_until(spike_at + absl::Seconds(60));
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_loss_std_max_window", job), 5.0);
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean_min_window", job), -0.3);

  // Gone once the window and one bucket (window / 60) have passed.
  run_until(spike_at + absl::Seconds(61));
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_loss_std_max_window", job), 0.1);
  EXPECT_EQ(Value(families, "rankscope_loss_range_max_window", job), 0.4);
  EXPECT_EQ(Value(families, "rankscope_grad_norm_cv_max_window", job), 0.1);
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean_min_window", job), 0.8);
}

TEST(JobMetricsTest, WindowAlwaysIncludesTheLatestStep) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics spike = HealthyStats(8, 3.0);
  metrics.OnStep("j", Step(1, spike, 8));
  // The job stalls: no step for ten minutes. The last step is still the window's worst.
  clock.Advance(absl::Minutes(10));
  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_loss_std_max_window", Labels("j")), 3.0);
  EXPECT_EQ(Value(families, "rankscope_loss_std", Labels("j")), 3.0);
}

TEST(JobMetricsTest, WindowIgnoresNaNLikeMaxOverTime) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics high = HealthyStats(8, 2.0);
  StepStatistics nan = HealthyStats(8);
  nan.loss_std = nan.loss_range = nan.grad_norm_cv = nan.grad_cosine_mean = kNaN;
  metrics.OnStep("j", Step(1, high, 8));
  clock.Advance(absl::Seconds(1));
  metrics.OnStep("j", Step(2, nan, 8));
  const auto families = metrics.Collect();
  EXPECT_TRUE(std::isnan(*Value(families, "rankscope_loss_std", Labels("j"))));
  EXPECT_EQ(Value(families, "rankscope_loss_std_max_window", Labels("j")), 2.0);
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean_min_window", Labels("j")), 0.8);
  EXPECT_EQ(Value(families, "rankscope_steps_nonfinite_total", Labels("j")), 1);
}

// Many fast steps: the bucketed window agrees with a brute-force max over the last window.
TEST(JobMetricsTest, WindowMatchesBruteForceOverManySteps) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  std::vector<std::pair<absl::Time, double>> history;
  const auto job = Labels("j");
  for (int i = 0; i < 20'000; ++i) {
    clock.Advance(absl::Milliseconds(7));
    // A deterministic, irregular sequence of loss std values.
    const double loss_std = static_cast<double>((i * 2654435761u) % 100'003) / 1000.0;
    const StepStatistics s = HealthyStats(2, loss_std);
    metrics.OnStep("j", Step(i, s, 2));
    history.emplace_back(clock.Now(), loss_std);
    if (i % 997 != 0) continue;
    double lower = history.back().second;  // every step within the window counts for sure
    double upper = lower;                  // and nothing older than window + window/60
    for (const auto& [at, v] : history) {
      if (clock.Now() - at <= absl::Seconds(60)) lower = std::max(lower, v);
      if (clock.Now() - at < absl::Seconds(61)) upper = std::max(upper, v);
    }
    const auto got = Value(metrics.Collect(), "rankscope_loss_std_max_window", job);
    ASSERT_TRUE(got.has_value());
    EXPECT_GE(*got, lower) << "step " << i;
    EXPECT_LE(*got, upper) << "step " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Per-rank series.

TEST(JobMetricsTest, SmallJobExportsEveryRank) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  StepStatistics s = HealthyStats(8);
  s.per_rank[5].consensus_cosine = -0.25;
  s.per_rank[5].loss_z = 2.5;
  s.per_rank[5].grad_norm_z = -1.5;
  metrics.OnStep("exp-42", Step(3, s, 8));
  const auto families = metrics.Collect();
  const std::set<uint32_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  for (const char* name :
       {"rankscope_rank_grad_cosine", "rankscope_rank_loss_z", "rankscope_rank_grad_norm_z"}) {
    EXPECT_EQ(RanksOf(families, name, "exp-42"), all) << name;
  }
  EXPECT_EQ(Value(families, "rankscope_rank_grad_cosine", Labels("exp-42", 5)), -0.25);
  EXPECT_EQ(Value(families, "rankscope_rank_loss_z", Labels("exp-42", 5)), 2.5);
  EXPECT_EQ(Value(families, "rankscope_rank_grad_norm_z", Labels("exp-42", 5)), -1.5);
  EXPECT_THAT(Serialize(families),
              HasSubstr("rankscope_rank_grad_cosine{train_job=\"exp-42\",rank=\"5\"} -0.25"));
}

TEST(JobMetricsTest, TenThousandRanksAreCappedToTheMostDeviating) {
  constexpr uint32_t kWorld = 10'000;
  constexpr size_t kLimit = 32;
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, kLimit));
  StepStatistics s = HealthyStats(kWorld);
  // Planted culprits, each deviating by one criterion only.
  s.per_rank[7777].consensus_cosine = -0.9;  // lowest cosine
  s.per_rank[4242].consensus_cosine = 0.1;   // second lowest cosine
  s.per_rank[9999].consensus_cosine = kNaN;  // non-finite sketch: most deviating
  s.per_rank[1234].loss_z = 40.0;            // largest |loss_z|
  s.per_rank[2345].loss_z = -12.0;           // second largest |loss_z|
  s.per_rank[4321].grad_norm_z = -35.0;      // largest |grad_norm_z|
  s.per_rank[10].grad_norm_z = kNaN;         // non-finite norm
  std::vector<uint32_t> missing;
  for (uint32_t r = 9000; r > 3000; r -= 2) missing.push_back(r);  // 3000 missing, unordered

  metrics.OnStep("big", Step(1, s, kWorld, missing, /*timed_out=*/true));
  const auto families = metrics.Collect();

  const std::set<uint32_t> cosine = RanksOf(families, "rankscope_rank_grad_cosine", "big");
  EXPECT_EQ(cosine.size(), kLimit);
  EXPECT_EQ(RanksOf(families, "rankscope_rank_loss_z", "big"), cosine);
  EXPECT_EQ(RanksOf(families, "rankscope_rank_grad_norm_z", "big"), cosine);
  for (uint32_t culprit : {7777u, 4242u, 9999u, 1234u, 2345u, 4321u, 10u}) {
    EXPECT_EQ(cosine.count(culprit), 1u) << "rank " << culprit << " not exported";
  }
  EXPECT_EQ(Value(families, "rankscope_rank_grad_cosine", Labels("big", 7777)), -0.9);
  EXPECT_EQ(Value(families, "rankscope_rank_loss_z", Labels("big", 1234)), 40.0);
  EXPECT_EQ(Value(families, "rankscope_rank_grad_norm_z", Labels("big", 4321)), -35.0);
  EXPECT_TRUE(std::isnan(*Value(families, "rankscope_rank_grad_cosine", Labels("big", 9999))));

  // Missing ranks: capped too, the lowest rank numbers.
  const std::set<uint32_t> missing_exported = RanksOf(families, "rankscope_rank_missing", "big");
  std::set<uint32_t> lowest_missing;
  for (uint32_t r = 3002; lowest_missing.size() < kLimit; r += 2) lowest_missing.insert(r);
  EXPECT_EQ(missing_exported, lowest_missing);
  EXPECT_EQ(Value(families, "rankscope_rank_missing", Labels("big", 3002)), 1);

  for (const MetricFamily& f : families) EXPECT_LE(f.metric.size(), kLimit) << f.name;
  ExpectPromtoolClean(Serialize(families));
}

// With statistics computed by the real ComputeStepStatistics: the culprits are the ones exported.
TEST(JobMetricsTest, RealStatisticsNameTheCulpritRanks) {
  constexpr uint32_t kWorld = 64;
  constexpr size_t kDim = 128;
  uint64_t lcg = 42;
  auto uniform = [&lcg] {  // deterministic, in [-1, 1)
    lcg = lcg * 6364136223846793005u + 1442695040888963407u;
    return static_cast<double>(lcg >> 11) / static_cast<double>(1ull << 52) - 1.0;
  };
  std::vector<float> shared(kDim);
  for (float& x : shared) x = static_cast<float>(uniform());
  std::vector<std::vector<float>> sketches(kWorld, std::vector<float>(kDim));
  std::vector<RankSample> samples;
  for (uint32_t r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < kDim; ++i) {
      const float sign = r == 13 ? -1.0f : 1.0f;  // rank 13's gradient points the other way
      sketches[r][i] = sign * shared[i] + 0.1f * static_cast<float>(uniform());
    }
    const double loss = r == 40 ? 9.0 : 2.0 + 0.01 * uniform();   // rank 40's loss is off
    const double norm = r == 51 ? 30.0 : 1.0 + 0.01 * uniform();  // rank 51's norm is off
    samples.push_back({r, loss, norm, sketches[r]});
  }
  const StepStatistics stats = ComputeStepStatistics(samples);
  ASSERT_EQ(stats.per_rank.size(), kWorld);

  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/3));
  metrics.OnStep("exp-42", Step(1, stats, kWorld));
  const auto families = metrics.Collect();
  EXPECT_EQ(RanksOf(families, "rankscope_rank_grad_cosine", "exp-42"),
            (std::set<uint32_t>{13, 40, 51}));
  EXPECT_LT(*Value(families, "rankscope_rank_grad_cosine", Labels("exp-42", 13)), 0);
  EXPECT_GT(*Value(families, "rankscope_rank_loss_z", Labels("exp-42", 40)), 5);
  EXPECT_GT(*Value(families, "rankscope_rank_grad_norm_z", Labels("exp-42", 51)), 5);
  EXPECT_EQ(Value(families, "rankscope_grad_cosine_mean", Labels("exp-42")),
            stats.grad_cosine_mean);
  ExpectPromtoolClean(Serialize(families));
}

TEST(JobMetricsTest, PerRankSeriesFollowTheLatestStep) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/2));
  StepStatistics first = HealthyStats(100);
  first.per_rank[17].consensus_cosine = -0.5;
  StepStatistics second = HealthyStats(100);
  second.per_rank[83].consensus_cosine = -0.5;
  const std::vector<uint32_t> missing_first = {3, 4};
  metrics.OnStep("j", Step(1, first, 100, missing_first));
  metrics.OnStep("j", Step(2, second, 100));
  const auto families = metrics.Collect();
  const auto ranks = RanksOf(families, "rankscope_rank_grad_cosine", "j");
  EXPECT_EQ(ranks.size(), 2u);
  EXPECT_EQ(ranks.count(83), 1u);
  EXPECT_EQ(ranks.count(17), 0u);
  EXPECT_EQ(FindFamily(families, "rankscope_rank_missing"), nullptr);  // none missing now
}

TEST(JobMetricsTest, ZeroLimitExportsNoPerRankSeries) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/0));
  const StepStatistics s = HealthyStats(8);
  const std::vector<uint32_t> missing = {1};
  metrics.OnStep("j", Step(1, s, 9, missing));
  const auto families = metrics.Collect();
  EXPECT_EQ(FindFamily(families, "rankscope_rank_grad_cosine"), nullptr);
  EXPECT_EQ(FindFamily(families, "rankscope_rank_missing"), nullptr);
  EXPECT_EQ(Value(families, "rankscope_loss_std", Labels("j")), 0.1);
}

TEST(JobMetricsTest, StepWithoutStatisticsDoesNotCrash) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  ExportedStep step;
  step.step = 4;
  step.world_size = 2;
  step.timed_out = true;
  const std::vector<uint32_t> missing = {0, 1};
  step.missing_ranks = missing;
  metrics.OnStep("j", step);
  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_ranks_reporting", Labels("j")), 0);
  EXPECT_EQ(RanksOf(families, "rankscope_rank_missing", "j"), (std::set<uint32_t>{0, 1}));
  EXPECT_EQ(Value(families, "rankscope_steps_nonfinite_total", Labels("j")), 0);
  ExpectPromtoolClean(Serialize(families));
}

// ---------------------------------------------------------------------------------------------
// Job expiry.

TEST(JobMetricsTest, JobWithoutUpdateForJobExpiryIsDropped) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));  // expiry 1 h
  const StepStatistics s = HealthyStats(4);
  metrics.OnStep("old", Step(1, s, 4));
  metrics.OnAgentDropped("old", 0, 3);
  clock.Advance(absl::Minutes(50));
  metrics.OnStep("new", Step(1, s, 4));

  clock.Advance(absl::Minutes(10));  // "old" last updated exactly one expiry ago: kept
  auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_step", Labels("old")), 1);

  clock.Advance(absl::Seconds(1));
  families = metrics.Collect();
  EXPECT_FALSE(Value(families, "rankscope_step", Labels("old")).has_value());
  EXPECT_FALSE(Value(families, "rankscope_steps_total", Labels("old")).has_value());
  EXPECT_FALSE(Value(families, "rankscope_agent_dropped_reports_total", Labels("old")).has_value());
  EXPECT_EQ(Value(families, "rankscope_step", Labels("new")), 1);
  for (const MetricFamily& f : families) {
    for (const ClientMetric& m : f.metric) {
      // The series budget's two gauges carry no label (they are the collector's).
      if (!m.label.empty()) EXPECT_NE(m.label[0].value, "old") << f.name;
    }
  }

  // An update of another job frees the expired state: "old" comes back from zero.
  metrics.OnStep("new", Step(2, s, 4));
  metrics.OnStep("old", Step(9, s, 4));
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_steps_total", Labels("old")), 1);
  EXPECT_EQ(Value(families, "rankscope_agent_dropped_reports_total", Labels("old")), 0);
  EXPECT_EQ(Value(families, "rankscope_steps_total", Labels("new")), 2);
}

TEST(JobMetricsTest, JobWithConnectedAgentIsNeverExpired) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics s = HealthyStats(4);
  metrics.OnAgentConnected("hung", 4);
  metrics.OnStep("hung", Step(5, s, 4));
  clock.Advance(absl::Hours(5));
  metrics.OnStep("other", Step(1, s, 4));  // would free "hung" if it were expired
  auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_step", Labels("hung")), 5);
  EXPECT_EQ(Value(families, "rankscope_connected_agents", Labels("hung")), 1);

  metrics.OnAgentDisconnected("hung");
  clock.Advance(absl::Hours(1) + absl::Seconds(1));
  families = metrics.Collect();
  EXPECT_FALSE(Value(families, "rankscope_step", Labels("hung")).has_value());
}

// The statistics of a step that `ranks` reported (HealthyStats' per-rank values).
StepStatistics StatsOfRanks(uint32_t world, std::vector<uint32_t> ranks) {
  StepStatistics s = HealthyStats(world);
  std::vector<RankStatistics> kept;
  for (const RankStatistics& r : s.per_rank) {
    if (std::find(ranks.begin(), ranks.end(), r.rank) != ranks.end()) kept.push_back(r);
  }
  s.per_rank = std::move(kept);
  s.ranks = static_cast<uint32_t>(s.per_rank.size());
  return s;
}

TEST(JobMetricsTest, StalledJobKeepsItsLastStepTimeAndNamesTheRanksOffTheMedianStep) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  for (int i = 0; i < 4; ++i) metrics.OnAgentConnected("j", 4);
  const StepStatistics all = StatsOfRanks(4, {0, 1, 2, 3});
  metrics.OnStep("j", Step(5, all, 4));
  auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_last_step_timestamp_seconds", Labels("j")),
            absl::ToUnixSeconds(kStart));
  EXPECT_THAT(RanksOf(families, "rankscope_rank_step_lag", "j"), IsEmpty());  // all in step

  // Rank 2 stops before step 6; rank 3 alone reports step 7 (it skipped a collective and ran
  // ahead); then nothing closes for ten minutes while every agent stays connected.
  clock.Advance(absl::Seconds(1));
  const StepStatistics without_2 = StatsOfRanks(4, {0, 1, 3});
  const uint32_t missing_2[] = {2};
  metrics.OnStep("j", Step(6, without_2, 4, missing_2, /*timed_out=*/true));
  clock.Advance(absl::Seconds(1));
  const StepStatistics only_3 = StatsOfRanks(4, {3});
  const uint32_t missing_012[] = {0, 1, 2};
  metrics.OnStep("j", Step(7, only_3, 4, missing_012, /*timed_out=*/true));
  clock.Advance(absl::Minutes(10));
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_last_step_timestamp_seconds", Labels("j")),
            absl::ToUnixSeconds(kStart) + 2);
  // Newest steps 6, 6, 5, 7: the median step is 6.
  EXPECT_THAT(RanksOf(families, "rankscope_rank_step_lag", "j"),
              UnorderedElementsAreArray({2u, 3u}));
  EXPECT_EQ(Value(families, "rankscope_rank_step_lag", Labels("j", 2)), -1);
  EXPECT_EQ(Value(families, "rankscope_rank_step_lag", Labels("j", 3)), 1);

  // The cap keeps the furthest rank (ties: the lower rank).
  JobMetrics capped(OptionsWith(clock, /*per_rank_limit=*/1));
  capped.OnStep("j", Step(5, all, 4));
  const StepStatistics with_1 = StatsOfRanks(4, {0, 1});
  capped.OnStep("j", Step(6, with_1, 4));
  capped.OnStep("j", Step(9, StatsOfRanks(4, {1}), 4));
  families = capped.Collect();
  // Newest steps 6, 9, 5, 5: median 5; rank 1 is 4 ahead, rank 0 one.
  EXPECT_THAT(RanksOf(families, "rankscope_rank_step_lag", "j"), UnorderedElementsAreArray({1u}));
  EXPECT_EQ(Value(families, "rankscope_rank_step_lag", Labels("j", 1)), 4);

  // Every rank back in step: no lag. Then the job ends: its ranks stopped where they stopped.
  metrics.OnStep("j", Step(8, all, 4));
  EXPECT_THAT(RanksOf(metrics.Collect(), "rankscope_rank_step_lag", "j"), IsEmpty());
  metrics.OnStep("j", Step(9, without_2, 4, missing_2, /*timed_out=*/true));
  EXPECT_THAT(RanksOf(metrics.Collect(), "rankscope_rank_step_lag", "j"),
              UnorderedElementsAreArray({2u}));
  for (int i = 0; i < 4; ++i) metrics.OnAgentDisconnected("j");
  families = metrics.Collect();
  EXPECT_THAT(RanksOf(families, "rankscope_rank_step_lag", "j"), IsEmpty());
  EXPECT_TRUE(Value(families, "rankscope_last_step_timestamp_seconds", Labels("j")).has_value());
}

TEST(JobMetricsTest, ReportingSwitchedOffIsExportedPerGroup) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  metrics.OnAgentConnected("solo", 4);
  metrics.OnAgentConnected("exp/dp0", 4);
  metrics.OnAgentConnected("exp/dp1", 4);
  auto families = metrics.Collect();
  EXPECT_FALSE(Value(families, "rankscope_reporting_enabled", Labels("solo")).has_value());
  metrics.OnControl("solo", false);
  metrics.OnControl("exp", false);  // a job of several groups: every group
  metrics.OnControl("exp/dp1", true);
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_reporting_enabled", Labels("solo")), 0);
  std::vector<ClientMetric::Label> dp0 = Labels("exp"), dp1 = Labels("exp");
  dp0.push_back({"group", "dp0"});
  dp1.push_back({"group", "dp1"});
  EXPECT_EQ(Value(families, "rankscope_reporting_enabled", dp0), 0);
  EXPECT_EQ(Value(families, "rankscope_reporting_enabled", dp1), 1);
}

// ---------------------------------------------------------------------------------------------
// Exposition format checked by promtool.

TEST(JobMetricsTest, PromtoolAcceptsEveryFamilyWithAwkwardJobNames) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, 4));
  StepStatistics s = HealthyStats(10);
  s.grad_cosine_mean = kNaN;
  s.per_rank[0].loss_z = std::numeric_limits<double>::infinity();
  const std::vector<uint32_t> missing = {10, 11};
  for (const std::string job : {"exp-42", "quote\"back\\slash", "new\nline", "ünïcødé job"}) {
    metrics.OnAgentConnected(job, 12);
    metrics.OnAgentDropped(job, 3, 17);
    metrics.OnStep(job, Step(100, s, 12, missing, /*timed_out=*/true));
  }
  const auto families = metrics.Collect();
  // Every family of the header's contract is present.
  for (const char* name : {"rankscope_step",
                           "rankscope_world_size",
                           "rankscope_ranks_reporting",
                           "rankscope_connected_agents",
                           "rankscope_loss_mean",
                           "rankscope_loss_std",
                           "rankscope_loss_range",
                           "rankscope_grad_norm_mean",
                           "rankscope_grad_norm_std",
                           "rankscope_grad_norm_cv",
                           "rankscope_grad_cosine_mean",
                           "rankscope_loss_std_max_window",
                           "rankscope_loss_range_max_window",
                           "rankscope_grad_norm_cv_max_window",
                           "rankscope_grad_cosine_mean_min_window",
                           "rankscope_steps_total",
                           "rankscope_steps_timed_out_total",
                           "rankscope_steps_nonfinite_total",
                           "rankscope_agent_dropped_reports_total",
                           "rankscope_rank_grad_cosine",
                           "rankscope_rank_loss_z",
                           "rankscope_rank_grad_norm_z",
                           "rankscope_rank_missing"}) {
    const MetricFamily* f = FindFamily(families, name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_EQ(f->metric.size() % 4, 0u) << name;
  }
  EXPECT_EQ(Value(families, "rankscope_step", Labels("quote\"back\\slash")), 100);
  ExpectPromtoolClean(Serialize(families));
}

// The promtool harness itself: it must fail on a real problem, or the clean checks mean nothing.
TEST(PromtoolTest, RejectsBadExposition) {
  const PromtoolResult no_total = RunPromtoolCheckMetrics(
      "# HELP bad_counter A counter.\n# TYPE bad_counter counter\n"
      "bad_counter 1\n");
  EXPECT_NE(no_total.exit_code, 0) << no_total.output;
  EXPECT_THAT(no_total.output, HasSubstr("_total"));

  const PromtoolResult no_help =
      RunPromtoolCheckMetrics("# TYPE thing_total counter\nthing_total 1\n");
  EXPECT_NE(no_help.exit_code, 0) << no_help.output;
  EXPECT_THAT(no_help.output, HasSubstr("no help text"));

  const PromtoolResult unparsable = RunPromtoolCheckMetrics("this is not metrics\n");
  EXPECT_NE(unparsable.exit_code, 0) << unparsable.output;
}

// ---------------------------------------------------------------------------------------------
// HealthMetrics.

TEST(HealthMetricsTest, EveryRejectReasonIsExportedFromZero) {
  HealthMetrics health;
  const auto families = health.registry()->Collect();
  const MetricFamily* rejected = FindFamily(families, "rankscope_reports_rejected_total");
  ASSERT_NE(rejected, nullptr);
  EXPECT_EQ(rejected->type, MetricType::Counter);
  std::vector<std::string> reasons;
  for (const ClientMetric& m : rejected->metric) {
    ASSERT_EQ(m.label.size(), 1u);
    EXPECT_EQ(m.label[0].name, "reason");
    EXPECT_EQ(m.counter.value, 0);
    reasons.push_back(m.label[0].value);
  }
  EXPECT_THAT(reasons, UnorderedElementsAreArray(
                           {"before_hello", "bad_hello", "rank_out_of_range", "world_size_changed",
                            "sketch_mismatch", "sketch_length", "message_too_large",
                            "unauthenticated", "too_many_streams", "too_many_jobs", "rank_taken",
                            "invalid_report", "run_collision"}));
}

double Scalar(const std::vector<MetricFamily>& families, const std::string& name,
              std::vector<ClientMetric::Label> labels = {}) {
  const auto v = Value(families, name, std::move(labels));
  EXPECT_TRUE(v.has_value()) << name;
  return v.value_or(kNaN);
}

TEST(HealthMetricsTest, MethodsUpdateTheirMetrics) {
  HealthMetrics health;
  health.ReportsReceived();
  health.ReportsReceived(9);
  health.Rejected(RejectReason::kRankOutOfRange);
  health.Rejected("rank_out_of_range");
  health.Rejected(RejectReason::kSketchLength);
  health.Rejected("no such reason");  // counted as invalid_report, no new label value
  health.ReportLate();
  health.ReportDuplicate();
  health.ReportDuplicate();
  health.StepEvicted();
  health.StoreError();
  health.SetStoreQueueDepth(12);
  health.StreamOpened();
  health.StreamOpened();
  health.StreamOpened();
  health.StreamClosed();

  const auto families = health.registry()->Collect();
  EXPECT_EQ(Scalar(families, "rankscope_reports_received_total"), 10);
  EXPECT_EQ(Scalar(families, "rankscope_reports_rejected_total", {{"reason", "rank_out_of_range"}}),
            2);
  EXPECT_EQ(Scalar(families, "rankscope_reports_rejected_total", {{"reason", "sketch_length"}}), 1);
  EXPECT_EQ(Scalar(families, "rankscope_reports_rejected_total", {{"reason", "invalid_report"}}),
            1);
  EXPECT_EQ(Scalar(families, "rankscope_reports_rejected_total", {{"reason", "bad_hello"}}), 0);
  EXPECT_EQ(FindFamily(families, "rankscope_reports_rejected_total")->metric.size(),
            kRejectReasons.size());
  EXPECT_EQ(Scalar(families, "rankscope_reports_late_total"), 1);
  EXPECT_EQ(Scalar(families, "rankscope_reports_duplicate_total"), 2);
  EXPECT_EQ(Scalar(families, "rankscope_steps_evicted_total"), 1);
  EXPECT_EQ(Scalar(families, "rankscope_store_errors_total"), 1);
  EXPECT_EQ(Scalar(families, "rankscope_store_queue_depth"), 12);
  EXPECT_EQ(Scalar(families, "rankscope_streams_open"), 2);
}

TEST(HealthMetricsTest, LatencyHistogramsSpan100MicrosecondsTo10Seconds) {
  HealthMetrics health;
  health.ObserveIngestLatency(absl::Microseconds(50));  // first bucket
  health.ObserveIngestLatency(absl::Milliseconds(3));   // le=0.005
  health.ObserveIngestLatency(absl::Seconds(30));       // only +Inf
  health.ObserveStoreCommit(absl::Milliseconds(20));

  const auto families = health.registry()->Collect();
  for (const char* name : {"rankscope_ingest_latency_seconds", "rankscope_store_commit_seconds"}) {
    const MetricFamily* f = FindFamily(families, name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_EQ(f->type, MetricType::Histogram);
    ASSERT_EQ(f->metric.size(), 1u);
    const auto& buckets = f->metric[0].histogram.bucket;
    ASSERT_GE(buckets.size(), 2u);
    EXPECT_DOUBLE_EQ(buckets.front().upper_bound, 100e-6) << name;
    EXPECT_DOUBLE_EQ(buckets[buckets.size() - 2].upper_bound, 10.0) << name;
    EXPECT_TRUE(std::isinf(buckets.back().upper_bound)) << name;
  }
  const auto& ingest =
      FindFamily(families, "rankscope_ingest_latency_seconds")->metric[0].histogram;
  EXPECT_EQ(ingest.sample_count, 3u);
  EXPECT_NEAR(ingest.sample_sum, 30.00305, 1e-9);
  EXPECT_EQ(ingest.bucket.front().cumulative_count, 1u);
  for (const auto& b : ingest.bucket) {
    if (b.upper_bound == 0.005 || b.upper_bound == 10.0) {
      EXPECT_EQ(b.cumulative_count, 2u) << "le=" << b.upper_bound;
    }
  }
  EXPECT_EQ(ingest.bucket.back().cumulative_count, 3u);
}

TEST(HealthMetricsTest, PromtoolAcceptsHealthAndTheCombinedScrape) {
  HealthMetrics health;
  health.ReportsReceived(3);
  health.Rejected(RejectReason::kBeforeHello);
  health.ObserveIngestLatency(absl::Milliseconds(2));
  health.ObserveStoreCommit(absl::Milliseconds(8));
  const std::string health_text = Serialize(health.registry()->Collect());
  EXPECT_THAT(health_text, HasSubstr("# TYPE rankscope_ingest_latency_seconds histogram"));
  EXPECT_THAT(health_text,
              HasSubstr("rankscope_reports_rejected_total{reason=\"before_hello\"} 1"));
  ExpectPromtoolClean(health_text);

  // What the exposer serves: both collectables in one scrape, with no family name twice.
  FakeClock clock;
  JobMetrics jobs(OptionsWith(clock));
  const StepStatistics s = HealthyStats(4);
  jobs.OnAgentConnected("exp-42", 4);
  jobs.OnStep("exp-42", Step(1, s, 4));
  std::vector<MetricFamily> combined = health.registry()->Collect();
  for (auto& f : jobs.Collect()) combined.push_back(std::move(f));
  std::set<std::string> names;
  for (const MetricFamily& f : combined) EXPECT_TRUE(names.insert(f.name).second) << f.name;
  ExpectPromtoolClean(Serialize(combined));
}

// ---------------------------------------------------------------------------------------------
// Concurrency: collector threads update while the exposer scrapes (run under TSAN in CI).

TEST(JobMetricsTest, ConcurrentUpdatesAndScrapes) {
  JobMetrics metrics;  // the real clock: only consistency is checked
  HealthMetrics health;
  const StepStatistics s = HealthyStats(64);
  std::atomic<bool> done{false};
  std::vector<std::thread> writers;
  for (int t = 0; t < 3; ++t) {
    writers.emplace_back([&, t] {
      const std::string job = absl::StrCat("job-", t);
      for (uint64_t step = 1; step <= 2000; ++step) {
        metrics.OnStep(job, Step(step, s, 64));
        metrics.OnAgentDropped(job, static_cast<uint32_t>(step % 64), step);
        health.ReportsReceived();
        health.ObserveIngestLatency(absl::Microseconds(step));
      }
    });
  }
  std::thread scraper([&] {
    while (!done.load()) {
      (void)Serialize(metrics.Collect());
      (void)Serialize(health.registry()->Collect());
    }
  });
  for (auto& w : writers) w.join();
  done.store(true);
  scraper.join();
  const auto families = metrics.Collect();
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(Value(families, "rankscope_steps_total", Labels(absl::StrCat("job-", t))), 2000);
  }
  EXPECT_EQ(Value(health.registry()->Collect(), "rankscope_reports_received_total", {}), 6000);
}

}  // namespace
}  // namespace rankscope::collector

namespace rankscope::collector {
namespace {

// Extras of `world` ranks whose held outlier score is 0.5, except `outlier`'s, 9.
std::vector<RankExtras> OneOutlier(uint32_t world, uint32_t outlier) {
  std::vector<RankExtras> extras(world);
  for (RankExtras& e : extras) e.held_outlier_score = 0.5;
  extras[outlier].held_outlier_score = 9.0;
  return extras;
}

// Where in the model: an exported flagged rank carries its most deviating bucket as one
// series {train_job, rank, bucket}; ranks without one (or not exported) have none.
TEST(JobMetricsDiagnosticsTest, DeviatingBucketRidesWithTheExportedRank) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/2));
  const StepStatistics stats = HealthyStats(64);
  const std::vector<RankExtras> extras = OneOutlier(64, 41);
  std::vector<std::pair<std::string, double>> top(64);
  top[41] = {"layers.20-23.mlp", 45.1};
  top[7] = {"embed", 8.0};  // not among the 2 exported ranks: no series
  ExportedStep step = Step(1, stats, 64);
  step.extras = extras;
  step.top_bucket = top;
  metrics.OnStep("j", step);
  const auto families = metrics.Collect();
  std::vector<ClientMetric::Label> labels = Labels("j", 41);
  labels.push_back({"bucket", "layers.20-23.mlp"});
  EXPECT_EQ(Value(families, "rankscope_rank_deviating_bucket_z", labels), 45.1);
  EXPECT_EQ(RanksOf(families, "rankscope_rank_deviating_bucket_z", "j").size(), 1u);
  ExpectPromtoolClean(Serialize(families));
}

TEST(JobMetricsDiagnosticsTest, OutlierScoreLeadsThePerRankSelection) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/2));
  const StepStatistics stats = HealthyStats(64);
  const std::vector<RankExtras> extras = OneOutlier(64, 41);  // 41: not extreme by cosine or z
  ExportedStep step = Step(1, stats, 64);
  step.extras = extras;  // a span: `extras` must outlive the step
  metrics.OnStep("j", step);
  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_rank_outlier_score", Labels("j", 41)), 9.0);
  EXPECT_LE(RanksOf(families, "rankscope_rank_outlier_score", "j").size(), 2u);
  // No step time reported: no step-time series.
  EXPECT_EQ(FindFamily(families, "rankscope_rank_step_time_seconds"), nullptr);
  ExpectPromtoolClean(Serialize(families));
}

// A job whose agents all disconnected has ended: its last step's deviating ranks would otherwise
// hold per-rank alerts for job_expiry. Job-level series stay; a reconnect brings them back.
TEST(JobMetricsDiagnosticsTest, EndedJobExportsNoDeviatingRanks) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/2));
  const StepStatistics stats = HealthyStats(4);
  for (uint32_t r = 0; r < 4; ++r) {
    RankIdentity who;
    who.known = true;
    who.rank = r;
    who.host = absl::StrCat("host-", r);
    metrics.OnAgentConnected("j", 4, who);
  }
  const std::vector<RankExtras> extras = OneOutlier(4, 1);
  ExportedStep step = Step(7, stats, 4);
  step.extras = extras;
  metrics.OnStep("j", step);
  auto shown = [&](const std::vector<MetricFamily>& families) {
    return Value(families, "rankscope_rank_outlier_score", Labels("j", 1)).has_value();
  };
  EXPECT_TRUE(shown(metrics.Collect()));

  // Three of four gone: still running.
  for (int i = 0; i < 3; ++i) metrics.OnAgentDisconnected("j");
  EXPECT_TRUE(shown(metrics.Collect()));

  // The last one gone: ended.
  metrics.OnAgentDisconnected("j");
  auto families = metrics.Collect();
  EXPECT_FALSE(shown(families));
  for (const char* name :
       {"rankscope_rank_grad_cosine", "rankscope_rank_loss_z", "rankscope_rank_grad_norm_z",
        "rankscope_rank_outlier_score", "rankscope_rank_drift_score", "rankscope_rank_info"}) {
    EXPECT_THAT(RanksOf(families, name, "j"), IsEmpty()) << name;
  }
  EXPECT_EQ(Value(families, "rankscope_step", Labels("j")), 7);
  EXPECT_EQ(Value(families, "rankscope_connected_agents", Labels("j")), 0);
  ExpectPromtoolClean(Serialize(families));

  // An agent back (a restart): the latest step's ranks are shown again.
  metrics.OnAgentConnected("j", 4);
  families = metrics.Collect();
  EXPECT_TRUE(shown(families));
  EXPECT_EQ(Value(families, "rankscope_rank_info",
                  {{"train_job", "j"},
                   {"rank", "1"},
                   {"global_rank", ""},
                   {"host", "host-1"},
                   {"version", ""}}),
            1);
}

TEST(JobMetricsDiagnosticsTest, StragglerStepTimeIsExported) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/3));
  const StepStatistics stats = HealthyStats(16);
  std::vector<RankExtras> extras(16);
  for (uint32_t r = 0; r < 16; ++r) {
    extras[r].held_outlier_score = 0.1;
    extras[r].step_time_seconds = 0.1;
    extras[r].step_time_z = 0.0;
  }
  extras[7].step_time_seconds = 0.9;
  extras[7].step_time_z = 80.0;
  ExportedStep step = Step(1, stats, 16);
  step.extras = extras;
  metrics.OnStep("j", step);
  const auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_rank_step_time_seconds", Labels("j", 7)), 0.9);
  EXPECT_EQ(Value(families, "rankscope_rank_step_time_z", Labels("j", 7)), 80.0);
  ExpectPromtoolClean(Serialize(families));
}

TEST(JobMetricsDiagnosticsTest, DriftingAndSlowRanksAreExportedWithinTheCap) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock, /*per_rank_limit=*/8));
  const StepStatistics stats = HealthyStats(64);
  std::vector<RankExtras> extras(64);
  for (uint32_t r = 0; r < 64; ++r) extras[r].held_outlier_score = 0.5;
  extras[12].drift_score = 1.4;  // not extreme by any other ranking
  extras[30].slow_score = 1.1;
  const std::vector<uint32_t> drifting = {12}, slow = {30};
  ExportedStep step = Step(1, stats, 64);
  step.extras = extras;
  step.drifting_ranks = drifting;
  step.slow_ranks = slow;
  metrics.OnStep("j", step);
  auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_rank_drift_score", Labels("j", 12)), 1.4);
  EXPECT_EQ(Value(families, "rankscope_rank_slow_score", Labels("j", 30)), 1.1);
  // Seven rankings, so with a cap of at least seven the worst by each is present.
  EXPECT_EQ(RanksOf(families, "rankscope_rank_drift_score", "j").size(), 8u);
  EXPECT_EQ(Value(families, "rankscope_drifting_ranks", Labels("j")), 1.0);
  EXPECT_EQ(Value(families, "rankscope_slow_ranks", Labels("j")), 1.0);
  ExpectPromtoolClean(Serialize(families));
  // A step without diagnostics exports neither count.
  metrics.OnStep("j", Step(2, stats, 64));
  families = metrics.Collect();
  EXPECT_EQ(FindFamily(families, "rankscope_drifting_ranks"), nullptr);
  EXPECT_EQ(FindFamily(families, "rankscope_rank_drift_score"), nullptr);
}

TEST(JobMetricsDiagnosticsTest, ReplicaDivergenceIsHeldForTheWindowAndCounted) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));  // window 60 s
  const StepStatistics stats = HealthyStats(4);
  const auto job = Labels("j");
  metrics.OnStep("j", Step(1, stats, 4));  // not checked
  auto families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_replica_divergent_ranks", job), std::nullopt);

  ExportedStep checked = Step(2, stats, 4);
  checked.replica_checked = true;
  clock.Advance(absl::Seconds(1));
  metrics.OnStep("j", checked);
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_replica_divergent_ranks", job), 0.0);
  EXPECT_EQ(Value(families, "rankscope_replica_checks_total", job), 1.0);

  const std::vector<uint32_t> divergent = {2};
  ExportedStep bad = Step(3, stats, 4);
  bad.replica_checked = true;
  bad.replica_divergent_ranks = divergent;
  clock.Advance(absl::Seconds(1));
  metrics.OnStep("j", bad);
  // Consistent checks afterwards: the divergent step stays visible for the window.
  for (uint64_t s = 4; s < 40; ++s) {
    clock.Advance(absl::Seconds(1));
    metrics.OnStep("j", checked);
  }
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_replica_divergent_ranks", job), 1.0);
  EXPECT_EQ(Value(families, "rankscope_rank_replica_divergent", Labels("j", 2)), 1.0);
  EXPECT_EQ(Value(families, "rankscope_replica_divergent_steps_total", job), 1.0);
  EXPECT_EQ(Value(families, "rankscope_replica_checks_total", job), 38.0);
  ExpectPromtoolClean(Serialize(families));

  for (int i = 0; i < 70; ++i) {
    clock.Advance(absl::Seconds(1));
    metrics.OnStep("j", checked);
  }
  families = metrics.Collect();
  EXPECT_EQ(Value(families, "rankscope_replica_divergent_ranks", job), 0.0);
  EXPECT_EQ(Value(families, "rankscope_rank_replica_divergent", Labels("j", 2)), std::nullopt);
  EXPECT_EQ(Value(families, "rankscope_replica_divergent_steps_total", job), 1.0);
}

TEST(JobMetricsDiagnosticsTest, NoiseScaleKeepsTheLastDefinedValue) {
  FakeClock clock;
  JobMetrics metrics(OptionsWith(clock));
  const StepStatistics stats = HealthyStats(4);
  ExportedStep step = Step(1, stats, 4);
  step.grad_noise_scale = 250.0;
  metrics.OnStep("j", step);
  ExportedStep undefined = Step(2, stats, 4);  // NaN: this step's estimate was undefined
  metrics.OnStep("j", undefined);
  EXPECT_EQ(Value(metrics.Collect(), "rankscope_grad_noise_scale", Labels("j")), 250.0);
}

}  // namespace
}  // namespace rankscope::collector
