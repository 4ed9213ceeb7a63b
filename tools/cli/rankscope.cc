// rankscope: the command-line client of a running collector.
//
//   rankscope jobs                          what is being watched
//   rankscope show --job J [--once]         the latest steps of a job and its worst ranks
//                                           (refreshes every 2 s)
//   rankscope export --job J --format csv|json [--table steps|ranks] [--db PATH]
//   rankscope report --job J -o report.png [--db PATH]
//   rankscope ctl enable|disable --job J    switch a dormant/active job's ranks on or off
//   rankscope ctl set --job J [--every N] [--sketch_dim K]
//   rankscope attach --job J [--dormant] PID... | --all-local
//                                           attach to live processes started without rankscope
//
// Every verb talks to the collector's Query service at --collector; export and report read a
// SQLite file directly instead with --db. report runs `PYTHON -m rankscope.report` on the package
// installed beside the binary (<bin>/../python), handing it an export as JSON; attach runs
// `PYTHON -m rankscope.attach`. PYTHON: report's --python, else $RANKSCOPE_PYTHON, else the
// interpreter the build was configured with (RANKSCOPE_DEFAULT_PYTHON: the project's environment).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/query/row_proto.h"
#include "collector/store/sqlite_store.h"
#include "common/client_tls.h"
#include "common/flag_help.h"
#include "common/query_client.h"
#include "google/protobuf/util/json_util.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "tools/cli/groups_view.h"

ABSL_FLAG(std::string, collector, "127.0.0.1:50051", "Collector gRPC address.");
ABSL_FLAG(std::string, job, "", "Training job name (show, ctl).");
ABSL_FLAG(bool, once, false, "show: print once and exit (for scripts).");
ABSL_FLAG(int, limit, 20, "show: number of steps.");
ABSL_FLAG(int, every, 0, "ctl set: report every N optimizer steps (>= 1).");
ABSL_FLAG(int, sketch_dim, 0, "ctl set: new sketch dimension.");
ABSL_FLAG(int, lead_steps, 5, "ctl: apply this many steps after the job's newest step.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "RPC deadline.");
ABSL_FLAG(int, worst, 5, "show: number of worst ranks (by outlier score) of the newest step.");
ABSL_FLAG(std::string, format, "csv", "export: csv or json.");
ABSL_FLAG(std::string, table, "steps",
          "export --format=csv: steps (step_stats), ranks (rank_steps) or windows "
          "(rank_windows: downsampled per-rank data); json has all three.");
ABSL_FLAG(std::string, db, "", "export, report: read this SQLite file instead of the collector.");
ABSL_FLAG(uint64_t, first_step, 0, "export, report: first step.");
ABSL_FLAG(uint64_t, last_step, 0, "export, report: last step (0: the newest).");
ABSL_FLAG(int, max_rows, 1000000, "export, report: at most this many rows of each table.");
ABSL_FLAG(int, page_rows, 10000, "export, report: rows per request to the collector.");
ABSL_FLAG(std::string, o, "", "report: output image (png, pdf or svg by extension).");
ABSL_FLAG(std::string, python, "",
          "report: the Python interpreter (with matplotlib). Default $RANKSCOPE_PYTHON, else "
          "the one this build was configured with (" RANKSCOPE_DEFAULT_PYTHON ").");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the collector's shared token (its --auth_token_file), if it requires one. "
          "Default $RANKSCOPE_AUTH_TOKEN_FILE.");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA that signs the collector's certificate: talk to it over TLS. Default "
          "$RANKSCOPE_TLS_CA.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate, for a collector that requires mutual TLS. Default "
          "$RANKSCOPE_TLS_CERT.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM key of --tls_cert_file. Default $RANKSCOPE_TLS_KEY.");
ABSL_FLAG(std::string, tls_target_name, "",
          "Name to verify in the collector's certificate instead of the host of --collector. "
          "Default $RANKSCOPE_TLS_TARGET_NAME.");

namespace {

namespace v1 = rankscope::v1;

constexpr char kUsage[] =
    "rankscope: look at and steer what a rankscope collector watches.\n"
    "\n"
    "usage:\n"
    "  rankscope [--collector=HOST:PORT] jobs\n"
    "  rankscope groups --job=J [--limit=N]\n"
    "  rankscope show --job=J [--once] [--limit=N] [--worst=N]\n"
    "  rankscope export --job=J --format=csv|json [--table=steps|ranks] [--db=PATH]\n"
    "  rankscope report --job=J -o report.png [--db=PATH]\n"
    "  rankscope ctl enable --job=J [--lead_steps=N]\n"
    "  rankscope ctl disable --job=J [--lead_steps=N]\n"
    "  rankscope ctl set --job=J [--every=N] [--sketch_dim=K] [--lead_steps=N]\n"
    "  rankscope attach --job=J [--collector=HOST:PORT] [--dormant] PID... | --all-local\n"
    "\n"
    "ctl changes are applied by every rank of the job at the same future step (the job's newest\n"
    "step + lead_steps), so the ranks' sketches stay comparable.";

// Everything the flags (and their environment variables) say, read once by main before any
// verb runs; verbs take it instead of reading flags.
struct CliConfig {
  rankscope::query::QueryClientOptions query;  // address, TLS, token, deadline
  std::string auth_token_file;
  std::string job;
  bool once = false;
  int limit = 20;
  int every = 0;
  int sketch_dim = 0;
  int lead_steps = 5;
  int worst = 5;
  std::string format;
  std::string table;
  std::string db;
  uint64_t first_step = 0;
  uint64_t last_step = 0;
  int max_rows = 1000000;
  int page_rows = 10000;
  std::string output;
  std::string python;
};

// The flag, else the environment variable, else "".
std::string FlagOrEnv(const absl::Flag<std::string>& flag, const char* env) {
  std::string v = absl::GetFlag(flag);
  if (v.empty() && std::getenv(env) != nullptr) v = std::getenv(env);
  return v;
}

// The Python that runs the report and attach verbs: `flag_value`, else $RANKSCOPE_PYTHON, else
// the build's (RANKSCOPE_DEFAULT_PYTHON).
std::string PythonInterpreter(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  const char* env = std::getenv("RANKSCOPE_PYTHON");
  return env != nullptr && *env != '\0' ? env : RANKSCOPE_DEFAULT_PYTHON;
}

CliConfig ReadFlags() {
  CliConfig c;
  c.query.address = absl::GetFlag(FLAGS_collector);
  c.query.timeout = absl::GetFlag(FLAGS_timeout);
  c.query.max_receive_message_size = 64 << 20;  // export pages stay far below; headroom for show
  c.query.tls.ca_file = FlagOrEnv(FLAGS_tls_ca_file, "RANKSCOPE_TLS_CA");
  c.query.tls.cert_file = FlagOrEnv(FLAGS_tls_cert_file, "RANKSCOPE_TLS_CERT");
  c.query.tls.key_file = FlagOrEnv(FLAGS_tls_key_file, "RANKSCOPE_TLS_KEY");
  c.query.tls.target_name = FlagOrEnv(FLAGS_tls_target_name, "RANKSCOPE_TLS_TARGET_NAME");
  c.query.tls.ca_name = "--tls_ca_file";
  c.query.tls.cert_name = "--tls_cert_file";
  c.query.tls.key_name = "--tls_key_file";
  c.auth_token_file = FlagOrEnv(FLAGS_auth_token_file, "RANKSCOPE_AUTH_TOKEN_FILE");
  c.job = absl::GetFlag(FLAGS_job);
  c.once = absl::GetFlag(FLAGS_once);
  c.limit = absl::GetFlag(FLAGS_limit);
  c.every = absl::GetFlag(FLAGS_every);
  c.sketch_dim = absl::GetFlag(FLAGS_sketch_dim);
  c.lead_steps = absl::GetFlag(FLAGS_lead_steps);
  c.worst = absl::GetFlag(FLAGS_worst);
  c.format = absl::GetFlag(FLAGS_format);
  c.table = absl::GetFlag(FLAGS_table);
  c.db = absl::GetFlag(FLAGS_db);
  c.first_step = absl::GetFlag(FLAGS_first_step);
  c.last_step = absl::GetFlag(FLAGS_last_step);
  c.max_rows = absl::GetFlag(FLAGS_max_rows);
  c.page_rows = absl::GetFlag(FLAGS_page_rows);
  c.output = absl::GetFlag(FLAGS_o);
  c.python = PythonInterpreter(absl::GetFlag(FLAGS_python));
  return c;
}

// The stripped token in `path`; InvalidArgument (with the message to print) if it cannot be
// read or is empty.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string token(absl::StripAsciiWhitespace(text));
  if (!in || token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read a token from --auth_token_file ", path));
  }
  return token;
}

// What a verb works with: the flags and the collector's Query client.
struct Cli {
  const CliConfig& config;
  rankscope::query::QueryClient& client;
};

int Fail(const CliConfig& config, const absl::Status& s) {
  // A refused TLS handshake reaches a client as UNAVAILABLE, like a collector that is down.
  const rankscope::tls::ClientTlsFiles& tls = config.query.tls;
  const bool unavailable = s.code() == absl::StatusCode::kUnavailable;
  const char* hint = "";
  if (unavailable) {
    hint = !tls.enabled() ? " (plaintext: if the collector serves TLS, give --tls_ca_file)"
           : tls.cert_file.empty()
               ? " (TLS without a client certificate: if the collector requires mutual TLS, give "
                 "--tls_cert_file and --tls_key_file)"
               : "";
  }
  std::fprintf(stderr, "rankscope: %s (collector %s): %s%s\n",
               unavailable ? "collector unreachable" : "request failed",
               config.query.address.c_str(), std::string(s.message()).c_str(), hint);
  return 1;
}

std::string Num(double v, int precision = 4) {
  if (std::isnan(v)) return "nan";
  return absl::StrFormat("%.*g", precision, v);
}

int Jobs(const Cli& cli) {
  absl::StatusOr<v1::ListJobsResponse> jobs = cli.client.ListJobs();
  if (!jobs.ok()) return Fail(cli.config, jobs.status());
  const v1::ListJobsResponse& resp = *jobs;
  std::printf("%-32s %8s %8s %10s %10s %-7s %s\n", "JOB", "WORLD", "SKETCH", "LAST_STEP",
              "CONNECTED", "STATE", "LAST_SEEN");
  for (const v1::JobInfo& j : resp.jobs()) {
    std::printf("%-32s %8u %8u %10llu %10u %-7s %s\n", j.job().c_str(), j.world_size(),
                j.sketch_dim(), static_cast<unsigned long long>(j.last_step()), j.connected_ranks(),
                j.state().c_str(),
                absl::FormatTime("%Y-%m-%dT%H:%M:%SZ",
                                 absl::FromUnixNanos(j.last_seen_unix_nanos()), absl::UTCTimeZone())
                    .c_str());
  }
  return 0;
}

// The data-parallel groups of `job` (keys "JOB/GROUP", or the job itself when stored without
// groups), their newest --limit steps side by side (tools/cli/groups_view.h).
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

std::string Opt(bool has, double v, int precision = 4) {
  return has ? Num(v, precision) : std::string("-");
}

template <typename Container>
std::string Ranks(const Container& ranks, const char* none) {
  return ranks.empty() ? std::string(none) : absl::StrJoin(ranks, ",");
}

// The ranks missing from a step, items separated by `sep`: the collector's compact form ("0-5",
// "+N" for ranks beyond its cap) when it sends one, else the plain list of an older collector.
std::string MissingRanks(const v1::StepStats& st, const char* sep) {
  if (!st.missing_rank_ranges().empty()) {
    return absl::StrJoin(absl::StrSplit(st.missing_rank_ranges(), ','), sep);
  }
  return absl::StrJoin(st.missing_ranks(), sep);
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

// ---- export and report ------------------------------------------------------------------------

namespace store = rankscope::collector;

using store::FillRankStep;
using store::FillStepStats;

// Reads the job's steps (and rank rows) in [--first_step, --last_step] from --db, or from the
// collector when --db is empty. Returns 0, or the exit code after printing why.
int LoadRange(const Cli& cli, const std::string& job, bool include_ranks,
              v1::StepRangeResponse* out) {
  const CliConfig& config = cli.config;
  const uint64_t first = config.first_step;
  const uint64_t last =
      config.last_step == 0 ? std::numeric_limits<uint64_t>::max() : config.last_step;
  const int max_rows = std::max(1, config.max_rows);
  const std::string& db = config.db;
  if (db.empty()) {
    // Paged, so that no response nears gRPC's message size limit even for 10,000-rank jobs:
    // step rows --page_rows at a time, then rank rows a few steps (~--page_rows rows) at a time.
    rankscope::query::StepRangeQuery query;
    query.job = job;
    query.first_step = first;
    query.last_step = last;
    query.include_ranks = include_ranks;
    query.max_rows = max_rows;
    query.page_rows = config.page_rows;
    if (absl::Status s = cli.client.StepRangePaged(query, out); !s.ok()) return Fail(config, s);
  } else {
    store::StoreOptions options;
    options.read_only = true;
    auto opened = store::SqliteStore::Open(db, options);
    if (!opened.ok()) {
      std::fprintf(stderr, "rankscope: %s\n", std::string(opened.status().message()).c_str());
      return 1;
    }
    auto steps = (*opened)->StepRange(job, first, last, max_rows + 1);
    if (!steps.ok()) {
      std::fprintf(stderr, "rankscope: %s\n", std::string(steps.status().message()).c_str());
      return 1;
    }
    if (steps->size() > static_cast<size_t>(max_rows)) {
      steps->resize(max_rows);
      out->set_truncated(true);
    }
    for (const store::StepRow& row : *steps) FillStepStats(row, out->add_steps());
    if (include_ranks) {
      auto ranks = (*opened)->RankRowsInRange(job, first, last, max_rows + 1);
      if (!ranks.ok()) {
        std::fprintf(stderr, "rankscope: %s\n", std::string(ranks.status().message()).c_str());
        return 1;
      }
      if (ranks->size() > static_cast<size_t>(max_rows)) {
        ranks->resize(max_rows);
        out->set_truncated(true);
      }
      for (const store::StepRankRow& row : *ranks) FillRankStep(row, out->add_ranks());
      if (absl::Status s = store::FillRankWindows(**opened, job, first, last, max_rows, out);
          !s.ok()) {
        std::fprintf(stderr, "rankscope: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
  }
  if (out->steps_size() == 0 && out->ranks_size() == 0) {
    std::fprintf(stderr, "rankscope: no steps stored for job %s in %s\n", job.c_str(),
                 db.empty() ? ("the collector at " + config.query.address).c_str() : db.c_str());
    return 1;
  }
  if (out->truncated()) {
    std::fprintf(stderr, "rankscope: more than --max_rows=%d rows; output truncated\n", max_rows);
  }
  if (include_ranks && out->downsampled_before_step() > first) {
    std::fprintf(stderr,
                 "rankscope: job %s: the per-rank rows of steps before %llu were pruned by the "
                 "collector's retention (--retention_rank_steps; flagged ranks keep theirs); "
                 "%d downsampled rank windows cover them (export --table=windows)\n",
                 job.c_str(), static_cast<unsigned long long>(out->downsampled_before_step()),
                 out->rank_windows_size());
  }
  return 0;
}

// A CSV field: full precision, "nan"/"inf"/"-inf" as text, empty when absent.
std::string Csv(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return absl::StrFormat("%.17g", v);
}
std::string Csv(bool has, double v) { return has ? Csv(v) : std::string(); }

int Export(const Cli& cli, const std::string& job) {
  const std::string& format = cli.config.format;
  const std::string& table = cli.config.table;
  if (format != "csv" && format != "json") {
    std::fprintf(stderr, "rankscope: --format must be csv or json, not '%s'\n", format.c_str());
    return 2;
  }
  if (table != "steps" && table != "ranks" && table != "windows") {
    std::fprintf(stderr, "rankscope: --table must be steps, ranks or windows, not '%s'\n",
                 table.c_str());
    return 2;
  }
  v1::StepRangeResponse data;
  if (int rc = LoadRange(cli, job, format == "json" || table != "steps", &data); rc != 0) {
    return rc;
  }
  if (format == "json") {
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    options.always_print_primitive_fields = true;
    std::string json;
    auto status = google::protobuf::util::MessageToJsonString(data, &json, options);
    if (!status.ok()) {
      std::fprintf(stderr, "rankscope: JSON: %s\n", status.ToString().c_str());
      return 1;
    }
    std::printf("%s\n", json.c_str());
    return 0;
  }
  if (table == "steps") {
    std::printf(
        "step,ranks,world_size,loss_mean,loss_std,loss_range,grad_norm_mean,grad_norm_std,"
        "grad_norm_cv,grad_cosine_mean,grad_noise_scale,timed_out,missing_ranks,replica_checked,"
        "replica_divergent_ranks,outlier_ranks,duplicate_groups\n");
    for (const v1::StepStats& st : data.steps()) {
      // duplicate_groups ("0,2;1,3") holds commas: quoted when not empty.
      const std::string duplicates =
          st.duplicate_groups().empty() ? "" : absl::StrCat("\"", st.duplicate_groups(), "\"");
      std::printf(
          "%llu,%u,%u,%s,%s,%s,%s,%s,%s,%s,%s,%d,%s,%d,%s,%s,%s\n",
          static_cast<unsigned long long>(st.step()), st.ranks(), st.world_size(),
          Csv(st.loss_mean()).c_str(), Csv(st.loss_std()).c_str(), Csv(st.loss_range()).c_str(),
          Csv(st.grad_norm_mean()).c_str(), Csv(st.grad_norm_std()).c_str(),
          Csv(st.grad_norm_cv()).c_str(), Csv(st.grad_cosine_mean()).c_str(),
          Csv(st.grad_noise_scale()).c_str(), st.timed_out() ? 1 : 0, MissingRanks(st, ";").c_str(),
          st.replica_checked() ? 1 : 0, absl::StrJoin(st.replica_divergent_ranks(), ";").c_str(),
          absl::StrJoin(st.outlier_ranks(), ";").c_str(), duplicates.c_str());
    }
    return 0;
  }
  if (table == "windows") {
    // Downsampled per-rank data (rank_windows): min/mean/max per rank and window of steps.
    std::printf(
        "first_step,last_step,rank,rows,loss_min,loss_mean,loss_max,grad_norm_min,grad_norm_mean,"
        "grad_norm_max,grad_cosine_min,grad_cosine_mean,grad_cosine_max,outlier_score_min,"
        "outlier_score_mean,outlier_score_max,nonfinite,outliers,replica_bad\n");
    for (const v1::RankWindow& w : data.rank_windows()) {
      std::printf("%llu,%llu,%u,%lld,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%lld,%lld,%lld\n",
                  static_cast<unsigned long long>(w.first_step()),
                  static_cast<unsigned long long>(w.last_step()), w.rank(),
                  static_cast<long long>(w.rows()), Csv(w.has_loss_min(), w.loss_min()).c_str(),
                  Csv(w.has_loss_mean(), w.loss_mean()).c_str(),
                  Csv(w.has_loss_max(), w.loss_max()).c_str(),
                  Csv(w.has_grad_norm_min(), w.grad_norm_min()).c_str(),
                  Csv(w.has_grad_norm_mean(), w.grad_norm_mean()).c_str(),
                  Csv(w.has_grad_norm_max(), w.grad_norm_max()).c_str(),
                  Csv(w.has_grad_cosine_min(), w.grad_cosine_min()).c_str(),
                  Csv(w.has_grad_cosine_mean(), w.grad_cosine_mean()).c_str(),
                  Csv(w.has_grad_cosine_max(), w.grad_cosine_max()).c_str(),
                  Csv(w.has_outlier_score_min(), w.outlier_score_min()).c_str(),
                  Csv(w.has_outlier_score_mean(), w.outlier_score_mean()).c_str(),
                  Csv(w.has_outlier_score_max(), w.outlier_score_max()).c_str(),
                  static_cast<long long>(w.nonfinite()), static_cast<long long>(w.outliers()),
                  static_cast<long long>(w.replica_bad()));
    }
    return 0;
  }
  std::printf(
      "step,rank,attempt,loss,grad_norm,grad_cosine,loss_z,grad_norm_z,outlier_score,"
      "replica_ok,step_time_seconds,step_time_z,reduced_grad_fingerprint,param_fingerprint\n");
  for (const v1::RankStep& r : data.ranks()) {
    std::printf(
        "%llu,%u,%u,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s\n", static_cast<unsigned long long>(r.step()),
        r.rank(), r.attempt(), Csv(r.loss()).c_str(), Csv(r.grad_norm()).c_str(),
        Csv(r.has_grad_cosine(), r.grad_cosine()).c_str(), Csv(r.has_loss_z(), r.loss_z()).c_str(),
        Csv(r.has_grad_norm_z(), r.grad_norm_z()).c_str(),
        Csv(r.has_outlier_score(), r.outlier_score()).c_str(),
        r.has_replica_ok() ? (r.replica_ok() ? "1" : "0") : "",
        Csv(r.has_step_time_seconds(), r.step_time_seconds()).c_str(),
        Csv(r.has_step_time_z(), r.step_time_z()).c_str(),
        r.has_reduced_grad_fingerprint() ? std::to_string(r.reduced_grad_fingerprint()).c_str()
                                         : "",
        r.has_param_fingerprint() ? std::to_string(r.param_fingerprint()).c_str() : "");
  }
  return 0;
}

// <directory of this binary>/../python, where the build puts the rankscope package.
std::string PythonDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string exe(buf, n);
  const size_t slash = exe.rfind('/');
  return exe.substr(0, slash == std::string::npos ? 0 : slash) + "/../python";
}

int Report(const Cli& cli, const std::string& job) {
  const std::string& output = cli.config.output;
  if (output.empty()) {
    std::fprintf(stderr, "rankscope: report needs -o FILE (e.g. -o report.png)\n");
    return 2;
  }
  const std::string pydir = PythonDir();
  if (access((pydir + "/rankscope/report.py").c_str(), R_OK) != 0) {
    std::fprintf(stderr,
                 "rankscope: %s/rankscope/report.py not found (the report needs the "
                 "rankscope Python package beside the binary, as the build lays it out)\n",
                 pydir.c_str());
    return 1;
  }
  v1::StepRangeResponse data;
  if (int rc = LoadRange(cli, job, /*include_ranks=*/true, &data); rc != 0) return rc;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(data, &json, options).ok()) return 1;
  const char* tmpdir = std::getenv("TMPDIR");
  std::string path = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/rankscope-report-XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) {
    std::fprintf(stderr, "rankscope: cannot create a temp file: %s\n", std::strerror(errno));
    return 1;
  }
  const bool written = write(fd, json.data(), json.size()) == static_cast<ssize_t>(json.size());
  close(fd);
  if (!written) {
    unlink(path.c_str());
    std::fprintf(stderr, "rankscope: cannot write %s\n", path.c_str());
    return 1;
  }
  const std::string& python = cli.config.python;
  const pid_t pid = fork();
  if (pid == 0) {
    const char* old = std::getenv("PYTHONPATH");
    const std::string pythonpath = old && *old ? pydir + ":" + old : pydir;
    setenv("PYTHONPATH", pythonpath.c_str(), 1);
    execl(python.c_str(), python.c_str(), "-m", "rankscope.report", "--input", path.c_str(),
          "--job", job.c_str(), "-o", output.c_str(), static_cast<char*>(nullptr));
    std::fprintf(stderr, "rankscope: cannot run %s: %s\n", python.c_str(), std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) < 0) status = -1;
  unlink(path.c_str());
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "rankscope: report failed (%s -m rankscope.report)\n", python.c_str());
    return 1;
  }
  return 0;
}

// ---- attach -----------------------------------------------------------------------------------

// `rankscope attach ...`: runs PYTHON -m rankscope.attach (the package beside the binary;
// PythonInterpreter("")) with every argument but the verb, in order; it has its own flags
// (--dormant,
// --all-local, PIDs), so it is handed over before absl parses anything. Returns only on failure.
int Attach(int argc, char** argv, int verb_index) {
  const std::string pydir = PythonDir();
  if (access((pydir + "/rankscope/attach.py").c_str(), R_OK) != 0) {
    std::fprintf(stderr,
                 "rankscope: %s/rankscope/attach.py not found (attach needs the rankscope "
                 "Python package beside the binary, as the build lays it out)\n",
                 pydir.c_str());
    return 1;
  }
  const std::string interpreter = PythonInterpreter("");
  const char* python = interpreter.c_str();
  std::vector<char*> args = {const_cast<char*>(python), const_cast<char*>("-m"),
                             const_cast<char*>("rankscope.attach")};
  for (int i = 1; i < argc; ++i) {
    if (i != verb_index) args.push_back(argv[i]);
  }
  args.push_back(nullptr);
  const char* old = std::getenv("PYTHONPATH");
  const std::string pythonpath = old && *old ? pydir + ":" + old : pydir;
  setenv("PYTHONPATH", pythonpath.c_str(), 1);
  execv(python, args.data());
  std::fprintf(stderr, "rankscope: cannot run %s: %s\n", python, std::strerror(errno));
  return 127;
}

// ---- help -------------------------------------------------------------------------------------

const char* VerbHelp(const std::string& verb) {
  if (verb == "jobs") {
    return "rankscope [--collector=HOST:PORT] jobs\n\n"
           "Lists the jobs the collector knows: world size, sketch size, last step, connected\n"
           "ranks, state (active: a rank is connected; idle) and when a rank last reported.\n";
  }
  if (verb == "groups") {
    return "rankscope groups --job=J [--limit=N] [--collector=HOST:PORT]\n\n"
           "The data-parallel groups of job J (stored as J/GROUP) side by side over their newest\n"
           "N steps: per group its last cosine, the steps with an outlier rank or a divergent\n"
           "replica and how often it was the least consistent group (lowest mean pairwise\n"
           "cosine), and a groups x steps picture ('#' least consistent, 'O' outlier, 'X'\n"
           "divergent replica).\n";
  }
  if (verb == "show") {
    return "rankscope show --job=J [--once] [--limit=N] [--worst=N] [--collector=HOST:PORT]\n\n"
           "The newest N steps of job J (loss mean/std/range, gradient-norm mean and CV, mean\n"
           "pairwise cosine, gradient noise scale, ranks whose replica fingerprints diverged,\n"
           "outlier ranks, ranks whose sequential detector says drifting or slow, duplicate\n"
           "groups, missing ranks), then the --worst ranks of the newest step by outlier\n"
           "score (loss, norm, consensus cosine, loss z, step time and its z, replica check).\n"
           "Refreshes every 2 s until interrupted; --once prints once (for scripts).\n";
  }
  if (verb == "export") {
    return "rankscope export --job=J [--format=csv|json] [--table=steps|ranks|windows]\n"
           "                 [--db=PATH] [--first_step=N] [--last_step=N] [--max_rows=N]\n\n"
           "Writes job J's stored rows to stdout, oldest step first: csv of step_stats\n"
           "(--table=steps, the default), of rank_steps (--table=ranks) or of rank_windows\n"
           "(--table=windows: per rank and window of steps, min/mean/max of loss, gradient norm,\n"
           "consensus cosine and outlier score where the collector's retention pruned the full\n"
           "rank rows), or json with all ({\"steps\": [...], \"ranks\": [...], \"rank_windows\":\n"
           "[...], \"downsampled_before_step\": N}, uint64 values as decimal strings). A notice "
           "on\n"
           "stderr says when rank rows of the range were downsampled. Reads\n"
           "the running collector (--collector) or, with --db, a SQLite file directly (also one\n"
           "a running collector is writing). Lists inside a csv field are separated by ';'.\n";
  }
  if (verb == "report") {
    return "rankscope report --job=J -o report.png [--db=PATH] [--first_step=N] [--last_step=N]\n\n"
           "Plots job J over steps: loss mean with its dispersion (std band, range), gradient-\n"
           "norm CV, direction consistency (mean pairwise cosine) and replica checks, with the\n"
           "outlier ranks marked. Data come from the collector or, with --db, a SQLite file; the\n"
           "plot is drawn by PYTHON -m rankscope.report (matplotlib) from the package in\n"
           "<bin>/../python; PYTHON is --python, else $RANKSCOPE_PYTHON, else the build's\n"
           "(" RANKSCOPE_DEFAULT_PYTHON "). The format follows -o's extension (png, pdf, svg).\n";
  }
  if (verb == "ctl") {
    return "rankscope ctl enable|disable --job=J [--lead_steps=N]\n"
           "rankscope ctl set --job=J [--every=N] [--sketch_dim=K] [--lead_steps=N]\n\n"
           "Pushes a control message to every rank of job J, applied by all of them at the same\n"
           "future step (the job's newest step + lead_steps).\n";
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    if (std::string(argv[i]) == "attach") return Attach(argc, argv, i);
    break;
  }
  // `rankscope VERB --help`: the verb's own help; `rankscope --help`: the usage and the CLI's own
  // flags (common/flag_help.h), exit 0.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg != "--help" && arg != "-h" && arg != "-help") continue;
    for (int j = 1; j < argc; ++j) {
      if (const char* help = VerbHelp(argv[j])) {
        std::printf("%s", help);
        return 0;
      }
    }
  }
  rankscope::HandleHelpFlag(argc, argv, "cli/rankscope.cc");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const CliConfig config = ReadFlags();
  // A bad TLS setting is reported before an unreadable token.
  absl::StatusOr<std::string> token = std::string();
  if (!config.auth_token_file.empty()) token = ReadAuthToken(config.auth_token_file);
  rankscope::query::QueryClientOptions query = config.query;
  if (token.ok()) query.auth_token = *token;
  auto client = rankscope::query::QueryClient::Create(std::move(query));
  if (!client.ok()) {
    std::fprintf(stderr, "rankscope: %s\n", std::string(client.status().message()).c_str());
    return 2;
  }
  if (!token.ok()) {
    std::fprintf(stderr, "rankscope: %s\n", std::string(token.status().message()).c_str());
    return 2;
  }
  const Cli cli{config, **client};
  const std::string verb = args[1];
  const std::string& job = config.job;
  if (verb == "jobs") return Jobs(cli);
  if (verb == "show" || verb == "ctl" || verb == "export" || verb == "report" || verb == "groups") {
    if (job.empty()) {
      std::fprintf(stderr, "rankscope: %s needs --job\n", verb.c_str());
      return 2;
    }
    if (verb == "show") return Show(cli, job);
    if (verb == "groups") return Groups(cli, job);
    if (verb == "export") return Export(cli, job);
    if (verb == "report") return Report(cli, job);
    if (args.size() < 3) {
      std::fprintf(stderr, "rankscope: ctl needs a verb: enable, disable or set\n");
      return 2;
    }
    return Ctl(cli, args[2], job);
  }
  std::fprintf(stderr, "rankscope: unknown command '%s'\n\n%s\n", verb.c_str(), kUsage);
  return 2;
}
