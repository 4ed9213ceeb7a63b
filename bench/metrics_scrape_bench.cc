// /metrics at fleet scale: the collector's per-job export (JobMetrics::Collect plus Prometheus'
// text serialization, what one scrape of /metrics costs the collector beside its small health
// registry) for --jobs jobs of --ranks ranks, each with a worst-case latest step: every per-rank
// metric present (RankExtras), --missing ranks missing, every identity known. Prints, for the
// default --max_exported_series budget and for no cap: series, bytes, milliseconds per scrape,
// and the wall time of --concurrent scrapes at once (the 100 concurrent scrapes of issue 34.5).
//
//   build/bin/metrics_scrape_bench --jobs=1000 --ranks=64 --scrapes=10 --concurrent=100
//
// Results: docs/reliability.md "What a hostile client can still do".
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/step_stats.h"
#include "collector/metrics/prometheus_export.h"
#include "prometheus/text_serializer.h"

ABSL_FLAG(int, jobs, 1000, "Jobs exported.");
ABSL_FLAG(int, ranks, 64, "Ranks per job.");
ABSL_FLAG(int, missing, 4, "Ranks missing from each job's latest step.");
ABSL_FLAG(int, scrapes, 10, "Sequential scrapes timed (the mean is printed).");
ABSL_FLAG(int, concurrent, 100, "Scrapes run at once, timed together.");

namespace rankscope::collector {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// One scrape: Collect and serialize. Returns the text's size; *series gets the sample count.
size_t Scrape(const JobMetrics& metrics, size_t* series) {
  const auto families = metrics.Collect();
  size_t n = 0;
  for (const auto& f : families) n += f.metric.size();
  if (series != nullptr) *series = n;
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str().size();
}

void Run(size_t max_series) {
  const int jobs = absl::GetFlag(FLAGS_jobs);
  const uint32_t ranks = static_cast<uint32_t>(absl::GetFlag(FLAGS_ranks));
  const uint32_t missing = static_cast<uint32_t>(absl::GetFlag(FLAGS_missing));
  ExportOptions options;
  options.max_series = max_series;
  JobMetrics metrics(options);
  for (int j = 0; j < jobs; ++j) {
    const std::string job = absl::StrCat("bench-job-", j);
    StepStatistics s;
    s.ranks = ranks - missing;
    s.loss_mean = 2.0;
    s.loss_std = 0.1 + 0.001 * j;
    s.loss_range = 0.4;
    s.grad_norm_mean = 1.5;
    s.grad_norm_std = 0.15;
    s.grad_norm_cv = 0.1;
    s.grad_cosine_mean = 0.8 - 0.0001 * j;
    std::vector<RankExtras> extras;
    std::vector<uint32_t> missing_ranks;
    for (uint32_t r = 0; r < ranks; ++r) {
      RankIdentity id;
      id.known = true;
      id.rank = r;
      id.global_rank = r;
      id.host = absl::StrCat("node-", r / 8);
      id.agent_version = "bench";
      metrics.OnAgentConnected(job, ranks, id);
      if (r >= ranks - missing) {
        missing_ranks.push_back(r);
        continue;
      }
      s.per_rank.push_back({r, 0.8 - 0.001 * r, 0.01 * r, -0.01 * r});
      RankExtras e;
      e.outlier_score = e.held_outlier_score = 0.1 * r;
      e.step_time_seconds = 0.2;
      e.step_time_z = 0.01 * r;
      e.drift_score = 0.001 * r;
      e.slow_score = 0.002 * r;
      extras.push_back(e);
    }
    ExportedStep step;
    step.step = 100;
    step.world_size = ranks;
    step.stats = &s;
    step.missing_ranks = missing_ranks;
    step.extras = extras;
    metrics.OnStep(job, step);
  }
  size_t series = 0;
  const size_t bytes = Scrape(metrics, &series);
  const int scrapes = absl::GetFlag(FLAGS_scrapes);
  const auto t0 = Clock::now();
  for (int i = 0; i < scrapes; ++i) Scrape(metrics, nullptr);
  const double per_scrape = Ms(Clock::now() - t0) / scrapes;
  const int concurrent = absl::GetFlag(FLAGS_concurrent);
  const auto t1 = Clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < concurrent; ++i) threads.emplace_back([&] { Scrape(metrics, nullptr); });
  for (std::thread& t : threads) t.join();
  const double together = Ms(Clock::now() - t1);
  std::printf(
      "max_exported_series=%-7zu jobs=%d ranks=%u: %zu series, %.2f MiB, %.1f ms per scrape, "
      "%d concurrent scrapes in %.0f ms (%u cores)\n",
      max_series, jobs, ranks, series, bytes / 1048576.0, per_scrape, concurrent, together,
      std::thread::hardware_concurrency());
}

}  // namespace
}  // namespace rankscope::collector

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  rankscope::collector::Run(rankscope::collector::ExportOptions().max_series);
  rankscope::collector::Run(0);
  return 0;
}
