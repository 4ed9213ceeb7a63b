// rankscope-collector: joins the ranks' reports per step, stores them in SQLite and exports
// Prometheus metrics. See README.md and docs/ARCHITECTURE.md.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "collector/store/retention.h"
#include "common/collector_shard.h"
#include "common/flag_help.h"
#include "common/memory_trimmer.h"
#include "grpc/support/log.h"

ABSL_FLAG(std::string, grpc_address, "127.0.0.1:50051",
          "Address for agents (Ingest) and the CLI (Query). Loopback by default; binding "
          "elsewhere is your explicit choice.");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "Address of the Prometheus /metrics endpoint; empty disables it.");
ABSL_FLAG(int, metrics_threads, 8,
          "HTTP threads of the /metrics endpoint (one per connection being served).");
ABSL_FLAG(absl::Duration, metrics_request_timeout, absl::Seconds(5),
          "A /metrics connection that has not sent its request (or read the answer) within this "
          "is closed, so slow clients cannot starve scrapes.");
ABSL_FLAG(std::string, http_address, "127.0.0.1:9465",
          "Address of the web view (/ lists jobs, /job/NAME shows one live) and its JSON API "
          "(/api/v1/jobs, /api/v1/jobs/NAME/steps, /api/v1/jobs/NAME/ranks); empty disables it. "
          "Loopback by default. With --auth_token_file the API requires the same token "
          "(Authorization: Bearer).");
ABSL_FLAG(std::string, fleet, "",
          "The fleet this collector is a shard of: the collector list its agents are given "
          "(a:50051,b:50051,c:50051, this collector among them). The web view then lists every "
          "shard's jobs (asking each shard's Query service, plaintext, with this collector's "
          "token), each with the collector that holds it, and names the shard of a job it does "
          "not hold. Empty: a lone collector.");
ABSL_FLAG(int, http_threads, 8, "HTTP threads of the web view (one per connection being served).");
ABSL_FLAG(absl::Duration, http_request_timeout, absl::Seconds(5),
          "A web view connection that has not sent its request (or read the answer) within this "
          "is closed.");
ABSL_FLAG(std::string, db_path, "rankscope.db", "SQLite database file (created if missing).");
ABSL_FLAG(absl::Duration, step_timeout, absl::Seconds(30),
          "A step closes this long after its first report even if ranks are missing; the "
          "missing ranks are named.");
ABSL_FLAG(int, analysis_threads, 0,
          "Threads that join and analyse closed steps, each for the groups whose key hashes to it "
          "(a group's steps stay in order on its thread); 0: one per core.");
ABSL_FLAG(int, max_open_steps, 256,
          "Open (incomplete) steps kept per job; beyond, the oldest "
          "is closed early.");
ABSL_FLAG(int, per_rank_series_limit, 32,
          "Per-rank Prometheus series per job and metric (the most deviating ranks first).");
ABSL_FLAG(int, max_exported_series, 100000,
          "The collector's /metrics budget of per-job series per scrape (0: no cap): beyond it "
          "whole data-parallel groups are left out, the least deviating first, and counted in "
          "rankscope_export_groups_capped. A group exports at most about 30 + 13 x "
          "--per_rank_series_limit series (446 by default).");
ABSL_FLAG(int, per_job_group_series_limit, 32,
          "Data-parallel groups of one job whose Prometheus series are exported (the most "
          "deviating first: a divergent replica or an outlier rank, then the lowest direction "
          "consistency); rankscope_job_* aggregates cover every group.");
ABSL_FLAG(absl::Duration, spike_window, absl::Seconds(60),
          "Window of the *_window metrics (worst value over the steps of this window).");
ABSL_FLAG(int, max_streams, 10000,
          "Concurrent agent streams accepted; one more is refused with RESOURCE_EXHAUSTED (the "
          "agent retries with backoff). The soft file descriptor limit is raised to cover it.");
ABSL_FLAG(absl::Duration, hello_timeout, absl::Seconds(5),
          "A stream whose first message (the agent's Hello) has not come this long after it "
          "opened is ended with DEADLINE_EXCEEDED, so idle connections cannot hold the "
          "--max_streams slots. 0 disables the deadline.");
ABSL_FLAG(absl::Duration, grpc_keepalive_time, rankscope::keepalive::kServerPingInterval,
          "Every gRPC connection idle this long is pinged; 0 keeps gRPC's default (2 h). With "
          "--grpc_keepalive_timeout it bounds how long a crashed node's streams (no FIN) hold "
          "their ranks: time + timeout (30 s by default), after which a rank refused because of "
          "them (ALREADY_EXISTS) is admitted on its next retry.");
ABSL_FLAG(absl::Duration, grpc_keepalive_timeout, rankscope::keepalive::kServerPingTimeout,
          "A keepalive ping unanswered this long closes its connection and cancels its streams.");
ABSL_FLAG(int, max_jobs, 10000,
          "Jobs (data-parallel groups) tracked at once. At the limit, the least recently seen "
          "job with no stream and no open step is forgotten to make room; when none is, a hello "
          "for a new job is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(absl::Duration, identity_ttl, absl::Hours(1),
          "A job's identity (world size, sketch) is enforced while it was seen within this long; "
          "after that, a job with no stream is forgotten and its name may be reused with another "
          "shape.");
ABSL_FLAG(int, max_world_size, 1000000, "Largest world size accepted in a hello.");
ABSL_FLAG(int, max_message_bytes, 8 << 20, "Largest message accepted from an agent.");
ABSL_FLAG(std::string, retention_rank_steps, "7d",
          "Storage lifecycle: full per-rank rows (rank_steps) are kept this long (d, h, m or s; "
          "0 = forever), measured by the wall time each row was received. Older rows are first "
          "downsampled into rank_windows (per rank and --downsample_window_steps steps: "
          "min/mean/max of loss, gradient norm, consensus cosine, outlier score), then deleted, "
          "except flagged rows (a rank that was an outlier, diverged, was non-finite, drifting or "
          "slow at that step), which are kept until --retention_steps.");
ABSL_FLAG(std::string, retention_steps, "90d",
          "Storage lifecycle: per-step statistics (step_stats), rank_windows and the rank rows of "
          "flagged ranks are kept this long (d, h, m or s; 0 = forever), by the step's "
          "completion time. A job with nothing left that was last seen before then is forgotten.");
ABSL_FLAG(
    int64_t, max_db_bytes, 0,
    "Storage lifecycle: a cap on the live bytes of the database (0 = none). Above it the "
    "oldest data goes first (per-rank rows downsampled, then whole steps), never a job's "
    "newest step. Pruned rows are counted in rankscope_store_pruned_rows_total{table,reason}; "
    "rankscope_store_db_bytes is the file's size.");
ABSL_FLAG(int, downsample_window_steps, 100, "Storage lifecycle: steps per rank_windows row.");
ABSL_FLAG(int, retention_batch_rows, 2048,
          "Storage lifecycle: at most this many rank rows per pruning transaction (pruning runs "
          "on the store writer thread between commits, so a commit waits at most one batch).");
ABSL_FLAG(absl::Duration, retention_check_interval, absl::Seconds(10),
          "Storage lifecycle: how often an idle store looks for data to prune (while there is a "
          "backlog it prunes one batch after each commit, or continuously when idle).");
ABSL_FLAG(double, time_scale, 1.0,
          "Testing and soak benchmarks only: the collector's clock (receive and completion stamps, "
          "step timeouts, retention ages) runs this many times faster than real time from the "
          "collector's start, so days of retention pass in minutes. --step_timeout, "
          "--identity_ttl and the retention ages are in this clock's time; exported latencies, "
          "--retention_check_interval and the store's commit timing stay in real time.");
ABSL_FLAG(std::string, auth_token_file, "",
          "If set, every agent must present the shared token stored in this file.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain of the collector: serve gRPC (Ingest and Query) over TLS. Needs "
          "--tls_key_file. Empty: plaintext gRPC.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file (unencrypted).");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: with it, mutual TLS: every agent and CLI must present a client "
          "certificate signed by this CA, or its connection is refused. Without it, TLS only "
          "authenticates the collector (use --auth_token_file to authenticate agents).");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(60),
          "How often --tls_cert_file, --tls_key_file and --tls_client_ca_file are read again: a "
          "certificate renewed on disk (replaced atomically, by rename) serves new connections "
          "after at most this long, without a restart; open streams are kept. Whole seconds, at "
          "least 1s.");
ABSL_FLAG(absl::Duration, grpc_agent_min_ping_interval,
          absl::Milliseconds(rankscope::keepalive::kServerMinPingIntervalMs),
          "Pings from a peer closer together than this (with no data sent between) are strikes; "
          "after --grpc_agent_max_ping_strikes the connection is closed (GOAWAY too_many_pings). "
          "The default allows the agents' 30 s pings; gRPC's own default, 5m, is what a "
          "collector older than this flag used (agents then reconnect, nothing is lost).");
ABSL_FLAG(bool, grpc_agent_pings_without_calls, true,
          "Accept pings on a connection with no open stream (the agents ping between streams); "
          "false, gRPC's default, counts them as strikes.");
ABSL_FLAG(int, grpc_agent_max_ping_strikes, 2,
          "Bad pings (see --grpc_agent_min_ping_interval) tolerated before GOAWAY.");
ABSL_FLAG(absl::Duration, memory_trim_interval, absl::Seconds(10),
          "How often the collector checks how much memory malloc holds free and, above "
          "--memory_trim_min_mib, gives it back to the system (malloc_trim): after a burst of "
          "connections or streams is freed, RSS follows what is in use instead of staying at "
          "the burst's peak. 0: never.");
ABSL_FLAG(int, memory_trim_min_mib, 16,
          "Free memory held by malloc below which --memory_trim_interval does nothing (MiB).");

namespace {

// Every agent stream holds a TCP connection, i.e. a file descriptor, and so does every
// connection that holds no stream (a half-open peer until keepalive closes it, an agent whose
// connect timed out while its connection waited in the accept queue, and that reconnected). An
// accept4 that fails with EMFILE stops gRPC 1.51's listener (Debian bookworm's) for good: the
// collector then serves its open streams but accepts no new connection ("Failed accept4: Too many
// open files" in its log; seen at 16,384 agents with the soft limit at 20,000,
// docs/PERFORMANCE.md). So the soft RLIMIT_NOFILE is raised to the hard limit, every descriptor
// the system allows, and a warning is printed when that is below `max_streams` plus a margin for
// the database, the HTTP endpoints and connections without a stream.
void RaiseFileLimit(size_t max_streams) {
  constexpr rlim_t kMargin = 1024;
  const rlim_t wanted = static_cast<rlim_t>(max_streams) + kMargin;
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return;
  rlimit raised = lim;
  // An infinite hard limit: as many as the kernel allows one process (fs/nr_open), at least wanted.
  raised.rlim_cur =
      lim.rlim_max != RLIM_INFINITY ? lim.rlim_max : std::max<rlim_t>(wanted, 1 << 20);
  if (raised.rlim_cur > lim.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) != 0) {
    raised.rlim_cur = std::max(lim.rlim_cur, wanted);  // fs/nr_open is lower: try what is needed
    if (raised.rlim_cur > lim.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      raised.rlim_cur = lim.rlim_cur;
    }
  }
  if (raised.rlim_cur < wanted) {
    std::fprintf(stderr,
                 "rankscope-collector: warning: the file descriptor limit (%llu, ulimit -Hn) is "
                 "below --max_streams + %llu; streams beyond it fail to connect, and a burst of "
                 "connections past it stops new connections until a restart (raise the hard "
                 "limit, e.g. LimitNOFILE= in the systemd unit)\n",
                 static_cast<unsigned long long>(raised.rlim_cur),
                 static_cast<unsigned long long>(kMargin));
  }
}

// gRPC's log lines, printed as gRPC prints them, watched for the one that means its listener is
// gone: gRPC 1.51's accept loop (Debian bookworm's) stops for good on an accept4 error other than
// EAGAIN/ECONNABORTED/EINTR ("Failed accept4: Too many open files" when the file-descriptor limit
// is hit), and the collector would then serve its open streams but never accept another
// connection: reconnecting agents and new jobs locked out, silently. The line raises
// kListenerFailed, and main shuts the collector down cleanly and exits with
// kExitListenerFailed, for its supervisor (systemd Restart=on-failure, Kubernetes) to restart it;
// the agents buffer and resend meanwhile, nothing acknowledged is lost.
constexpr int kListenerFailed = SIGUSR2;
constexpr int kExitListenerFailed = 75;  // EX_TEMPFAIL

void LogGrpc(gpr_log_func_args* args) {
  std::fprintf(stderr, "%s %s:%d] %s\n", gpr_log_severity_string(args->severity), args->file,
               args->line, args->message);
  if (std::strstr(args->message, "Failed accept4") != nullptr) kill(getpid(), kListenerFailed);
}

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --auth_token_file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(ss.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " is empty"));
  return token;
}

// The collector's options from its parsed flags; an invalid value is INVALID_ARGUMENT with the
// message to print (the flag named).
// Long: a flat list of flag -> option assignments and their checks, one per flag.
absl::StatusOr<rankscope::collector::CollectorOptions> OptionsFromFlags() {
  using rankscope::collector::CollectorOptions;
  using rankscope::collector::ParseRetentionAge;
  using rankscope::collector::RetentionOptions;
  CollectorOptions options;
  RetentionOptions retention;
  for (const auto& [name, flag, into] :
       {std::tuple{"--retention_rank_steps", absl::GetFlag(FLAGS_retention_rank_steps),
                   &retention.rank_steps},
        std::tuple{"--retention_steps", absl::GetFlag(FLAGS_retention_steps), &retention.steps}}) {
    auto age = ParseRetentionAge(flag);
    if (!age.ok())
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", age.status().message()));
    *into = *age;
  }
  retention.max_db_bytes = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_db_bytes));
  retention.window_steps =
      static_cast<uint32_t>(std::max(1, absl::GetFlag(FLAGS_downsample_window_steps)));
  retention.max_rows_per_batch = std::max(1, absl::GetFlag(FLAGS_retention_batch_rows));
  retention.check_interval = absl::GetFlag(FLAGS_retention_check_interval);
  if (retention.enabled()) options.pipeline.writer.retention = retention;
  if (const double scale = absl::GetFlag(FLAGS_time_scale); scale != 1.0) {
    if (!(scale > 0)) return absl::InvalidArgumentError("--time_scale must be > 0");
    const absl::Time start = absl::Now();
    auto scaled = [start, scale] { return start + (absl::Now() - start) * scale; };
    options.pipeline.clock = scaled;
    options.pipeline.clock_rate = scale;
    // The writer keeps real time for its commit interval and check interval; the retention ages
    // are measured on the pipeline's (scaled) clock, which stamped the rows.
    options.pipeline.writer.retention_clock = scaled;
  }
  options.grpc_address = absl::GetFlag(FLAGS_grpc_address);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.http_address = absl::GetFlag(FLAGS_http_address);
  options.http_threads = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_http_threads)));
  options.http_request_timeout = absl::GetFlag(FLAGS_http_request_timeout);
  if (const std::string fleet = absl::GetFlag(FLAGS_fleet); !fleet.empty()) {
    absl::StatusOr<std::vector<std::string>> shards = rankscope::ParseCollectorList(fleet);
    if (!shards.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--fleet: ", shards.status().message()));
    }
    options.fleet = *std::move(shards);
  }
  options.db_path = absl::GetFlag(FLAGS_db_path);
  options.metrics_threads = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_metrics_threads)));
  options.metrics_request_timeout = absl::GetFlag(FLAGS_metrics_request_timeout);
  options.pipeline.joiner.step_timeout = absl::GetFlag(FLAGS_step_timeout);
  options.pipeline.joiner.max_open_steps_per_job =
      static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_open_steps)));
  options.pipeline.analysis_threads =
      static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_analysis_threads)));
  options.pipeline.max_jobs = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_jobs)));
  options.pipeline.identity_ttl = std::max(absl::ZeroDuration(), absl::GetFlag(FLAGS_identity_ttl));
  options.pipeline.limits.max_world_size =
      static_cast<uint32_t>(std::max(1, absl::GetFlag(FLAGS_max_world_size)));
  options.export_options.per_rank_series_limit =
      static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_per_rank_series_limit)));
  options.export_options.max_series =
      static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_max_exported_series)));
  options.export_options.per_job_group_series_limit =
      static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_per_job_group_series_limit)));
  options.export_options.spike_window = absl::GetFlag(FLAGS_spike_window);
  options.max_streams = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_streams)));
  options.max_message_bytes = std::max(1024, absl::GetFlag(FLAGS_max_message_bytes));
  options.hello_timeout = absl::GetFlag(FLAGS_hello_timeout);
  options.keepalive_time = absl::GetFlag(FLAGS_grpc_keepalive_time);
  options.keepalive_timeout = absl::GetFlag(FLAGS_grpc_keepalive_timeout);
  options.agent_pings.min_interval = absl::GetFlag(FLAGS_grpc_agent_min_ping_interval);
  options.agent_pings.permit_without_calls = absl::GetFlag(FLAGS_grpc_agent_pings_without_calls);
  options.agent_pings.max_strikes = absl::GetFlag(FLAGS_grpc_agent_max_ping_strikes);
  if (!absl::GetFlag(FLAGS_auth_token_file).empty()) {
    auto token = ReadToken(absl::GetFlag(FLAGS_auth_token_file));
    if (!token.ok()) return absl::InvalidArgumentError(token.status().ToString());
    options.pipeline.auth_token = *token;
  }

  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  return options;
}

}  // namespace

// Long: the daemon's whole life in order (usage text, flags, signal masks, options, descriptor
// limit, start, memory trimmer, wait for a stop or a failed listener, shutdown), each a call or
// a commented line; most of the length is the usage text and the comments.
int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "rankscope-collector: watches data-parallel training ranks for silent inconsistency.\n"
      "Agents stream per-rank loss, gradient norm and gradient sketch; the collector joins\n"
      "each step, stores it in SQLite (--db_path) and serves Prometheus metrics\n"
      "(--metrics_address) and a web view with a JSON API (--http_address). Stop with\n"
      "SIGTERM or SIGINT: open steps are closed and stored.\n\n"
      "usage: rankscope-collector [--flag=value ...]");
  rankscope::HandleHelpFlag(argc, argv, "collector/main.cc");  // --help: exits 0
  absl::ParseCommandLine(argc, argv);

  // Debian's libabsl is built without NDEBUG, so every Mutex acquisition taken while another is
  // held (OnReport takes its group's shard lock before releasing the pipeline's mu_, on every
  // report) would insert an edge into absl's global lock-order graph under its own global lock:
  // 7 % of the collector's instructions under callgrind, and a serial section shared by every
  // thread (docs/PERFORMANCE.md, "Analysis on every core"). The tests keep the detection on (a
  // lock-order cycle fails them); the daemon, as the agent does, turns it off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // A file-size limit (ulimit -f, prlimit --fsize) must fail SQLite's write with EFBIG, which the
  // store treats as a transient disk condition (retried, nothing acked), not kill the collector
  // with SIGXFSZ's default action.
  signal(SIGXFSZ, SIG_IGN);

  // Block the stop signals in every thread; main waits for them with sigwait.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, kListenerFailed);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  gpr_set_log_function(LogGrpc);

  absl::StatusOr<rankscope::collector::CollectorOptions> parsed = OptionsFromFlags();
  if (!parsed.ok()) {
    std::fprintf(stderr, "rankscope-collector: %s\n",
                 std::string(parsed.status().message()).c_str());
    return 2;
  }
  const rankscope::collector::CollectorOptions& options = *parsed;
  RaiseFileLimit(options.max_streams);

  auto collector = rankscope::collector::Collector::Start(options);
  if (!collector.ok()) {
    std::fprintf(stderr, "rankscope-collector: %s\n", collector.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr,
               "rankscope-collector: serving gRPC on 127.0.0.1:%d (%s, %s%s), metrics on "
               ":%d/metrics, web view on :%d/, db %s\n",
               (*collector)->grpc_port(), options.grpc_address.c_str(),
               !options.tls.enabled() ? "plaintext"
               : options.tls.mutual() ? "mutual TLS"
                                      : "TLS",
               options.pipeline.auth_token.empty() ? "" : ", shared token",
               (*collector)->metrics_port(), (*collector)->http_port(), options.db_path.c_str());
  std::fflush(stderr);

  // Started after the collector (its threads have made their arenas): stopped before it.
  rankscope::MemoryTrimmer::Options trim;
  trim.interval = absl::GetFlag(FLAGS_memory_trim_interval);
  trim.min_free_bytes = static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_memory_trim_min_mib)))
                        << 20;
  auto trimmer = std::make_unique<rankscope::MemoryTrimmer>(trim);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  trimmer.reset();
  if (sig == kListenerFailed) {
    std::fprintf(stderr,
                 "rankscope-collector: gRPC stopped accepting connections (accept4 failed, see "
                 "above; it does not retry): shutting down to be restarted, exit status %d; the "
                 "agents buffer and resend. If the file-descriptor limit was hit, raise it "
                 "(LimitNOFILE=, ulimit -Hn)\n",
                 kExitListenerFailed);
  } else {
    std::fprintf(stderr, "rankscope-collector: signal %d, closing open steps and committing\n",
                 sig);
  }
  absl::Status st = (*collector)->Shutdown(absl::Seconds(10));
  if (!st.ok()) {
    std::fprintf(stderr, "rankscope-collector: shutdown: %s\n", st.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "rankscope-collector: stopped cleanly\n");
  return sig == kListenerFailed ? kExitListenerFailed : 0;
}
