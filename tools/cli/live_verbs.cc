#include "tools/cli/live_verbs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rankscope/v1/rankscope.pb.h"
#include "tools/cli/groups_view.h"
#include "tools/cli/step_format.h"

namespace rankscope::cli {
namespace {

namespace v1 = rankscope::v1;

std::string Num(double v, int precision = 4) {
  if (std::isnan(v)) return "nan";
  return absl::StrFormat("%.*g", precision, v);
}

std::string Opt(bool has, double v, int precision = 4) {
  return has ? Num(v, precision) : std::string("-");
}

template <typename Container>
std::string Ranks(const Container& ranks, const char* none) {
  return ranks.empty() ? std::string(none) : absl::StrJoin(ranks, ",");
}

int ShowOnce(const Cli& cli, const std::string& job) {
  v1::RecentStepsRequest req;
  req.set_job(job);
  req.set_limit(static_cast<uint32_t>(std::max(1, cli.config.limit)));
  absl::StatusOr<v1::RecentStepsResponse> recent = cli.client.RecentSteps(req);
  if (!recent.ok()) return Fail(cli.config, recent.status());
  const v1::RecentStepsResponse& resp = *recent;
  std::printf("job %s: %d steps (newest first)\n", job.c_str(), resp.steps_size());
  std::printf("%10s %6s %10s %10s %10s %10s %10s %8s %10s  %-9s %-9s %-9s %-9s %-11s %s\n", "STEP",
              "RANKS", "LOSS_MEAN", "LOSS_STD", "LOSS_RANGE", "GNORM_MEAN", "GNORM_CV", "COSINE",
              "NOISE_B", "DIVERGENT", "OUTLIERS", "DRIFTING", "SLOW", "DUPLICATES", "MISSING");
  for (const v1::StepStats& st : resp.steps()) {
    std::printf("%10llu %6u %10s %10s %10s %10s %10s %8s %10s  %-9s %-9s %-9s %-9s %-11s %s\n",
                static_cast<unsigned long long>(st.step()), st.ranks(), Num(st.loss_mean()).c_str(),
                Num(st.loss_std()).c_str(), Num(st.loss_range()).c_str(),
                Num(st.grad_norm_mean()).c_str(), Num(st.grad_norm_cv()).c_str(),
                Num(st.grad_cosine_mean(), 3).c_str(), Num(st.grad_noise_scale()).c_str(),
                st.replica_checked() ? Ranks(st.replica_divergent_ranks(), "ok").c_str() : "-",
                Ranks(st.outlier_ranks(), "-").c_str(), Ranks(st.drifting_ranks(), "-").c_str(),
                Ranks(st.slow_ranks(), "-").c_str(),
                st.duplicate_groups().empty() ? "-" : st.duplicate_groups().c_str(),
                MissingRanks(st, ",").c_str());
  }
  if (resp.steps_size() == 0 || cli.config.worst <= 0) return 0;

  // The worst ranks of the newest step, by outlier score.
  const uint64_t newest = resp.steps(0).step();
  v1::StepRangeRequest range;
  range.set_job(job);
  range.set_first_step(newest);
  range.set_last_step(newest);
  range.set_include_ranks(true);
  absl::StatusOr<v1::StepRangeResponse> ranks = cli.client.StepRange(range);
  if (!ranks.ok()) return Fail(cli.config, ranks.status());
  std::vector<const v1::RankStep*> rows;
  for (const v1::RankStep& r : ranks->ranks()) rows.push_back(&r);
  const auto score = [](const v1::RankStep* r) {
    // NaN (a rank with non-finite inputs) sorts first: it is flagged.
    if (!r->has_outlier_score()) return -std::numeric_limits<double>::infinity();
    return std::isnan(r->outlier_score()) ? std::numeric_limits<double>::infinity()
                                          : r->outlier_score();
  };
  std::stable_sort(rows.begin(), rows.end(), [&](const v1::RankStep* a, const v1::RankStep* b) {
    return score(a) > score(b);
  });
  rows.resize(std::min<size_t>(rows.size(), cli.config.worst));
  std::printf("\nworst ranks of step %llu (by outlier score):\n",
              static_cast<unsigned long long>(newest));
  std::printf("%6s %10s %10s %10s %8s %8s %10s %8s %7s\n", "RANK", "OUTLIER", "LOSS", "GRAD_NORM",
              "COSINE", "LOSS_Z", "STEP_TIME", "TIME_Z", "REPLICA");
  for (const v1::RankStep* r : rows) {
    std::printf("%6u %10s %10s %10s %8s %8s %10s %8s %7s\n", r->rank(),
                Opt(r->has_outlier_score(), r->outlier_score()).c_str(), Num(r->loss()).c_str(),
                Num(r->grad_norm()).c_str(), Opt(r->has_grad_cosine(), r->grad_cosine(), 3).c_str(),
                Opt(r->has_loss_z(), r->loss_z(), 3).c_str(),
                Opt(r->has_step_time_seconds(), r->step_time_seconds()).c_str(),
                Opt(r->has_step_time_z(), r->step_time_z(), 3).c_str(),
                !r->has_replica_ok() ? "-" : (r->replica_ok() ? "ok" : "DIVERGED"));
  }
  return 0;
}

}  // namespace

namespace {

// One line of `jobs`; `collector` is the fleet's extra column ("" for a lone collector).
void PrintJob(const v1::JobInfo& j, const std::string& collector) {
  std::printf("%-32s %8u %8u %10llu %10u %-7s %s%s%s\n", j.job().c_str(), j.world_size(),
              j.sketch_dim(), static_cast<unsigned long long>(j.last_step()), j.connected_ranks(),
              j.state().c_str(),
              absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixNanos(j.last_seen_unix_nanos()),
                               absl::UTCTimeZone())
                  .c_str(),
              collector.empty() ? "" : " ", collector.c_str());
}

void PrintJobsHeader(bool fleet) {
  std::printf("%-32s %8s %8s %10s %10s %-7s %s\n", "JOB", "WORLD", "SKETCH", "LAST_STEP",
              "CONNECTED", "STATE", fleet ? "LAST_SEEN            COLLECTOR" : "LAST_SEEN");
}

}  // namespace

int Jobs(const Cli& cli) {
  absl::StatusOr<v1::ListJobsResponse> jobs = cli.client.ListJobs();
  if (!jobs.ok()) return Fail(cli.config, jobs.status());
  PrintJobsHeader(/*fleet=*/false);
  for (const v1::JobInfo& j : jobs->jobs()) PrintJob(j, "");
  return 0;
}

int FleetJobs(const CliConfig& config, absl::Span<rankscope::query::QueryClient* const> shards) {
  std::vector<std::pair<v1::JobInfo, std::string>> all;
  int rc = 0;
  for (rankscope::query::QueryClient* shard : shards) {
    absl::StatusOr<v1::ListJobsResponse> jobs = shard->ListJobs();
    if (!jobs.ok()) {
      CliConfig one = config;
      one.query.address = shard->options().address;
      rc = Fail(one, jobs.status());
      continue;
    }
    for (const v1::JobInfo& j : jobs->jobs()) all.emplace_back(j, shard->options().address);
  }
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.first.job() < b.first.job(); });
  PrintJobsHeader(/*fleet=*/true);
  for (const auto& [job, collector] : all) PrintJob(job, collector);
  return rc;
}

int Groups(const Cli& cli, const std::string& job) {
  absl::StatusOr<v1::ListJobsResponse> jobs = cli.client.ListJobs();
  if (!jobs.ok()) return Fail(cli.config, jobs.status());
  std::vector<rankscope::cli::GroupSteps> groups;
  const std::string prefix = absl::StrCat(job, "/");
  for (const v1::JobInfo& j : jobs->jobs()) {
    if (j.job() != job && !absl::StartsWith(j.job(), prefix)) continue;
    v1::RecentStepsRequest req;
    req.set_job(j.job());
    req.set_limit(static_cast<uint32_t>(std::max(1, cli.config.limit)));
    absl::StatusOr<v1::RecentStepsResponse> recent = cli.client.RecentSteps(req);
    if (!recent.ok()) return Fail(cli.config, recent.status());
    rankscope::cli::GroupSteps& g = groups.emplace_back();
    g.group = j.job() == job ? "" : j.job().substr(prefix.size());
    g.steps.assign(recent->steps().begin(), recent->steps().end());
  }
  if (groups.empty()) {
    std::fprintf(stderr, "rankscope: the collector knows no job %s nor groups %s*\n", job.c_str(),
                 prefix.c_str());
    return 1;
  }
  const std::string text =
      rankscope::cli::RenderGroupsView(job, rankscope::cli::BuildGroupsView(std::move(groups)));
  std::fputs(text.c_str(), stdout);
  return 0;
}

int Show(const Cli& cli, const std::string& job) {
  if (cli.config.once) return ShowOnce(cli, job);
  while (true) {
    std::printf("\033[H\033[2J");  // clear the terminal
    const int rc = ShowOnce(cli, job);
    if (rc != 0) return rc;
    std::fflush(stdout);
    absl::SleepFor(absl::Seconds(2));
  }
}

int Ctl(const Cli& cli, const std::string& verb, const std::string& job) {
  const CliConfig& config = cli.config;
  v1::ControlRequest req;
  req.set_job(job);
  req.set_lead_steps(static_cast<uint32_t>(std::max(1, config.lead_steps)));
  if (verb == "enable") {
    req.set_enabled(true);
  } else if (verb == "disable") {
    req.set_enabled(false);
  } else if (verb == "set") {
    if (config.every < 0 || config.sketch_dim < 0) {
      std::fprintf(stderr, "rankscope: --every and --sketch_dim must be positive\n");
      return 2;
    }
    if (config.every > 0) req.set_every(config.every);
    if (config.sketch_dim > 0) req.set_sketch_dim(config.sketch_dim);
    if (!req.has_every() && !req.has_sketch_dim()) {
      std::fprintf(stderr, "rankscope: ctl set needs --every and/or --sketch_dim\n");
      return 2;
    }
  } else {
    std::fprintf(stderr, "rankscope: unknown ctl verb '%s' (enable, disable, set)\n", verb.c_str());
    return 2;
  }
  absl::StatusOr<v1::ControlResponse> set = cli.client.SetControl(req);
  if (!set.ok()) return Fail(config, set.status());
  const v1::ControlResponse& resp = *set;
  const v1::Control& c = resp.control();
  std::printf(
      "job %s: generation %llu, to apply at step %llu (ranks that have not reported recently, "
      "e.g. dormant ones, agree on a later common step): enabled=%s every=%u sketch_dim=%s; "
      "%u ranks notified\n",
      job.c_str(), static_cast<unsigned long long>(c.generation()),
      static_cast<unsigned long long>(c.apply_at_step()), c.enabled() ? "true" : "false", c.every(),
      c.sketch_dim() == 0 ? "unchanged" : std::to_string(c.sketch_dim()).c_str(),
      resp.ranks_notified());
  return 0;
}

}  // namespace rankscope::cli
