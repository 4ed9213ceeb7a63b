// rankscope: the command-line client of a running collector.
//
//   rankscope jobs                          what is being watched
//   rankscope show --job J [--once]         the latest steps of a job (refreshes every 2 s)
//   rankscope ctl enable|disable --job J    switch a dormant/active job's ranks on or off
//   rankscope ctl set --job J [--every N] [--sketch_dim K]
//
// Every verb talks to the collector's Query service at --collector.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

ABSL_FLAG(std::string, collector, "127.0.0.1:50051", "Collector gRPC address.");
ABSL_FLAG(std::string, job, "", "Training job name (show, ctl).");
ABSL_FLAG(bool, once, false, "show: print once and exit (for scripts).");
ABSL_FLAG(int, limit, 20, "show: number of steps.");
ABSL_FLAG(int, every, 0, "ctl set: report every N optimizer steps (>= 1).");
ABSL_FLAG(int, sketch_dim, 0, "ctl set: new sketch dimension.");
ABSL_FLAG(int, lead_steps, 5, "ctl: apply this many steps after the job's newest step.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "RPC deadline.");

namespace {

namespace v1 = rankscope::v1;

constexpr char kUsage[] =
    "rankscope: look at and steer what a rankscope collector watches.\n"
    "\n"
    "usage:\n"
    "  rankscope [--collector=HOST:PORT] jobs\n"
    "  rankscope show --job=J [--once] [--limit=N]\n"
    "  rankscope ctl enable --job=J [--lead_steps=N]\n"
    "  rankscope ctl disable --job=J [--lead_steps=N]\n"
    "  rankscope ctl set --job=J [--every=N] [--sketch_dim=K] [--lead_steps=N]\n"
    "\n"
    "ctl changes are applied by every rank of the job at the same future step (the job's newest\n"
    "step + lead_steps), so the ranks' sketches stay comparable.";

std::unique_ptr<v1::Query::Stub> Stub() {
  return v1::Query::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_collector), grpc::InsecureChannelCredentials()));
}

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_timeout)));
}

int Fail(const grpc::Status& s) {
  std::fprintf(stderr, "rankscope: %s (collector %s): %s\n",
               s.error_code() == grpc::StatusCode::UNAVAILABLE ? "collector unreachable"
                                                               : "request failed",
               absl::GetFlag(FLAGS_collector).c_str(), s.error_message().c_str());
  return 1;
}

std::string Num(double v, int precision = 4) {
  if (std::isnan(v)) return "nan";
  return absl::StrFormat("%.*g", precision, v);
}

int Jobs() {
  v1::ListJobsResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::Status s = Stub()->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
  if (!s.ok()) return Fail(s);
  std::printf("%-32s %8s %8s %10s %10s %-7s %s\n", "JOB", "WORLD", "SKETCH", "LAST_STEP",
              "CONNECTED", "STATE", "LAST_SEEN");
  for (const v1::JobInfo& j : resp.jobs()) {
    std::printf("%-32s %8u %8u %10llu %10u %-7s %s\n", j.job().c_str(), j.world_size(),
                j.sketch_dim(), static_cast<unsigned long long>(j.last_step()),
                j.connected_ranks(), j.state().c_str(),
                absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixNanos(j.last_seen_unix_nanos()),
                                 absl::UTCTimeZone())
                    .c_str());
  }
  return 0;
}

int ShowOnce(const std::string& job) {
  v1::RecentStepsRequest req;
  req.set_job(job);
  req.set_limit(static_cast<uint32_t>(std::max(1, absl::GetFlag(FLAGS_limit))));
  v1::RecentStepsResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::Status s = Stub()->RecentSteps(&ctx, req, &resp);
  if (!s.ok()) return Fail(s);
  std::printf("job %s: %d steps (newest first)\n", job.c_str(), resp.steps_size());
  std::printf("%10s %6s %10s %10s %10s %10s %10s %8s  %s\n", "STEP", "RANKS", "LOSS_MEAN",
              "LOSS_STD", "LOSS_RANGE", "GNORM_MEAN", "GNORM_CV", "COSINE", "MISSING");
  for (const v1::StepStats& st : resp.steps()) {
    std::printf("%10llu %6u %10s %10s %10s %10s %10s %8s  %s\n",
                static_cast<unsigned long long>(st.step()), st.ranks(),
                Num(st.loss_mean()).c_str(), Num(st.loss_std()).c_str(),
                Num(st.loss_range()).c_str(), Num(st.grad_norm_mean()).c_str(),
                Num(st.grad_norm_cv()).c_str(), Num(st.grad_cosine_mean(), 3).c_str(),
                absl::StrJoin(st.missing_ranks(), ",").c_str());
  }
  return 0;
}

int Show(const std::string& job) {
  if (absl::GetFlag(FLAGS_once)) return ShowOnce(job);
  while (true) {
    std::printf("\033[H\033[2J");  // clear the terminal
    const int rc = ShowOnce(job);
    if (rc != 0) return rc;
    std::fflush(stdout);
    absl::SleepFor(absl::Seconds(2));
  }
}

int Ctl(const std::string& verb, const std::string& job) {
  v1::ControlRequest req;
  req.set_job(job);
  req.set_lead_steps(static_cast<uint32_t>(std::max(1, absl::GetFlag(FLAGS_lead_steps))));
  if (verb == "enable") {
    req.set_enabled(true);
  } else if (verb == "disable") {
    req.set_enabled(false);
  } else if (verb == "set") {
    if (absl::GetFlag(FLAGS_every) < 0 || absl::GetFlag(FLAGS_sketch_dim) < 0) {
      std::fprintf(stderr, "rankscope: --every and --sketch_dim must be positive\n");
      return 2;
    }
    if (absl::GetFlag(FLAGS_every) > 0) req.set_every(absl::GetFlag(FLAGS_every));
    if (absl::GetFlag(FLAGS_sketch_dim) > 0) req.set_sketch_dim(absl::GetFlag(FLAGS_sketch_dim));
    if (!req.has_every() && !req.has_sketch_dim()) {
      std::fprintf(stderr, "rankscope: ctl set needs --every and/or --sketch_dim\n");
      return 2;
    }
  } else {
    std::fprintf(stderr, "rankscope: unknown ctl verb '%s' (enable, disable, set)\n",
                 verb.c_str());
    return 2;
  }
  v1::ControlResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::Status s = Stub()->SetControl(&ctx, req, &resp);
  if (!s.ok()) return Fail(s);
  const v1::Control& c = resp.control();
  std::printf(
      "job %s: generation %llu, to apply at step %llu (ranks that have not reported recently, "
      "e.g. dormant ones, agree on a later common step): enabled=%s every=%u sketch_dim=%s; "
      "%u ranks notified\n",
      job.c_str(), static_cast<unsigned long long>(c.generation()),
      static_cast<unsigned long long>(c.apply_at_step()), c.enabled() ? "true" : "false",
      c.every(), c.sketch_dim() == 0 ? "unchanged" : std::to_string(c.sketch_dim()).c_str(),
      resp.ranks_notified());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const std::string verb = args[1];
  const std::string job = absl::GetFlag(FLAGS_job);
  if (verb == "jobs") return Jobs();
  if (verb == "show" || verb == "ctl") {
    if (job.empty()) {
      std::fprintf(stderr, "rankscope: %s needs --job\n", verb.c_str());
      return 2;
    }
    if (verb == "show") return Show(job);
    if (args.size() < 3) {
      std::fprintf(stderr, "rankscope: ctl needs a verb: enable, disable or set\n");
      return 2;
    }
    return Ctl(args[2], job);
  }
  std::fprintf(stderr, "rankscope: unknown command '%s'\n\n%s\n", verb.c_str(), kUsage);
  return 2;
}
