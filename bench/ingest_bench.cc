// Collector ingest throughput beside a bare gRPC streaming sink, in one run.
//
// The same load drives, one after the other and for the same time, two servers in this process:
//   bare       an Ingest/Stream callback server that parses each message (gRPC deserializes it
//              into the reactor's AgentMessage) and drops it, acking every report at once: acks
//              are coalesced exactly like the collector's (at most one write in flight per stream,
//              the seqs that arrived meanwhile go into the next Ack). Without acks the agents'
//              flow control would stop the load, so acking at once is what lets it flow.
//   collector  the real Collector: SQLite file in a temp dir (WAL), /metrics served over HTTP and
//              scraped every --scrape_ms, everything joined, computed, stored and exported.
// The load: --ranks real rankscope::Agent instances (k = --sketch_dim) of one job, driven by
// --drivers threads that Record() step after step, each rank waiting while it has more than
// --max_inflight reports queued or unacked (flow control: the agents never drop; a run with drops
// is reported INVALID).
//
// Measured over a window of --seconds after --warmup_seconds:
//   reports/s  reports acknowledged to the agents in the window / window length (for the
//              collector an ack means "committed to SQLite");
//   cpu us/rep process CPU time (user + sys, load generator and server together) per report;
//   latency    the collector's own rankscope_ingest_latency_seconds histogram (HealthMetrics
//              registry), window delta: from the step's last report handed to the pipeline by the
//              stream reactor to the step's statistics updated in the Prometheus export;
//              p50/p99 interpolated inside buckets as histogram_quantile() does; the fraction
//              <= 50 ms is exact (50 ms is a bucket bound).
// After the window the drivers stop, every agent is flushed, and for the collector the rows in
// SQLite are counted (CountRankRows) and must equal the reports acked.
//
// The whole run is bounded: a watchdog aborts it after --max_wall_seconds.
//
// Usage: ingest_bench [--seconds=30] [--ranks=1024] [--sketch_dim=1024] [--only=bare|collector]
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "collector/sqlite_store.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

ABSL_FLAG(int, seconds, 30, "Length of the measured window for each server.");
ABSL_FLAG(int, warmup_seconds, 3, "Load before the window starts (connections, caches).");
ABSL_FLAG(int, ranks, 1024, "Agents (ranks of one job).");
ABSL_FLAG(int, sketch_dim, 1024, "Sketch dimension k.");
ABSL_FLAG(int, drivers, 2, "Threads calling Record() (the ranks are split between them).");
ABSL_FLAG(int, max_inflight, 48, "Per rank: wait while this many reports are queued or unacked.");
ABSL_FLAG(int, queue_capacity, 64, "Agent ring capacity (> max_inflight, so no ring drops).");
ABSL_FLAG(int, scrape_ms, 1000, "Scrape the collector's /metrics this often (0: never).");
ABSL_FLAG(std::string, only, "", "Run only 'bare' or only 'collector'.");
ABSL_FLAG(std::string, tmpdir, "", "Directory for the SQLite file (default: $TMPDIR or /tmp).");
ABSL_FLAG(bool, ignore_deadlock_detection, false,
          "Experiment: turn absl's debug-mode Mutex deadlock detection off in this process.");
ABSL_FLAG(int, max_wall_seconds, 0, "Abort after this long (0: 2 * (warmup + seconds) + 180).");

namespace {

namespace v1 = ::rankscope::v1;
using rankscope::Agent;

// ---- The bare sink --------------------------------------------------------------------------

class BareSinkService;

// One stream: parse, count, ack at once (coalesced while a write is in flight), never store.
class BareReactor final : public grpc::ServerBidiReactor<v1::AgentMessage, v1::CollectorMessage> {
 public:
  explicit BareReactor(std::atomic<uint64_t>* received) : received_(received) { StartRead(&in_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      finish_requested_ = true;
      MaybeWriteLocked();
      return;
    }
    if (in_.kind_case() == v1::AgentMessage::kReport) {
      const v1::StepReport& r = in_.report();
      // Touch the parsed payload so nothing about it is left lazy.
      checksum_ += r.sketch_size() > 0 ? r.sketch(r.sketch_size() - 1) : 0.0f;
      received_->fetch_add(1, std::memory_order_relaxed);
      absl::MutexLock lock(&mu_);
      pending_.push_back(r.seq());
      MaybeWriteLocked();
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      pending_.clear();
      finish_requested_ = true;
    }
    MaybeWriteLocked();
  }

  void OnDone() override { delete this; }

 private:
  void MaybeWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return;
    if (!finish_requested_ && !pending_.empty()) {
      out_.Clear();
      out_.mutable_ack()->mutable_seqs()->Add(pending_.begin(), pending_.end());
      pending_.clear();
      writing_ = true;
      StartWrite(&out_);
      return;
    }
    if (finish_requested_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  std::atomic<uint64_t>* const received_;
  v1::AgentMessage in_;
  float checksum_ = 0;
  absl::Mutex mu_;
  std::vector<uint64_t> pending_ ABSL_GUARDED_BY(mu_);
  v1::CollectorMessage out_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class BareSinkService final : public v1::Ingest::CallbackService {
 public:
  grpc::ServerBidiReactor<v1::AgentMessage, v1::CollectorMessage>* Stream(
      grpc::CallbackServerContext*) override {
    return new BareReactor(&received_);
  }
  uint64_t received() const { return received_.load(); }

 private:
  std::atomic<uint64_t> received_{0};
};

// ---- Measurement helpers --------------------------------------------------------------------

struct CpuUsage {
  double user = 0, sys = 0;
  uint64_t voluntary_switches = 0, involuntary_switches = 0;
};

CpuUsage Usage() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return {u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6, u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6,
          static_cast<uint64_t>(u.ru_nvcsw), static_cast<uint64_t>(u.ru_nivcsw)};
}

// CPU seconds (user + sys) of each live thread of this process, by thread name.
std::map<std::string, double> CpuByThreadName() {
  std::map<std::string, double> out;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const std::string base = absl::StrCat("/proc/self/task/", e->d_name);
    std::ifstream comm_file(base + "/comm");
    std::string comm;
    std::getline(comm_file, comm);
    std::ifstream stat_file(base + "/stat");
    std::string stat;
    std::getline(stat_file, stat);
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    std::string f;
    double utime = 0, stime = 0;
    for (int i = 3; i <= 15 && fields >> f; ++i) {
      if (i == 14) utime = std::atof(f.c_str());
      if (i == 15) stime = std::atof(f.c_str());
    }
    // Group gRPC's and others' numbered or suffixed threads under one name.
    if (comm.empty() || comm == "ingest_bench") comm = "unnamed (gRPC callbacks, pollers)";
    out[comm] += (utime + stime) / tick;
  }
  closedir(dir);
  return out;
}

std::string LoadAvg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

// GET http://127.0.0.1:port/path; returns the bytes received (0 on error).
size_t HttpGetBytes(int port, const char* path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  size_t total = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) total += static_cast<size_t>(n);
    }
  }
  close(fd);
  return total;
}

// Cumulative bucket counts of a histogram (upper bounds ascending, +Inf last).
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> cumulative;
  double sum = 0;
  uint64_t count = 0;
};

Histogram ReadHistogram(const prometheus::Registry& registry, const std::string& name) {
  Histogram h;
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name || f.metric.empty()) continue;
    const prometheus::ClientMetric::Histogram& m = f.metric.front().histogram;
    for (const auto& b : m.bucket) {
      h.bounds.push_back(b.upper_bound);
      h.cumulative.push_back(b.cumulative_count);
    }
    h.sum = m.sample_sum;
    h.count = m.sample_count;
  }
  return h;
}

double CounterValue(const prometheus::Registry& registry, const std::string& name) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name || f.metric.empty()) continue;
    return f.metric.front().counter.value;
  }
  return -1;
}

Histogram Delta(const Histogram& after, const Histogram& before) {
  Histogram d = after;
  for (size_t i = 0; i < d.cumulative.size() && i < before.cumulative.size(); ++i) {
    d.cumulative[i] -= before.cumulative[i];
  }
  d.sum -= before.sum;
  d.count -= before.count;
  return d;
}

// As PromQL's histogram_quantile: linear inside the bucket holding the q-th observation.
double Quantile(const Histogram& h, double q) {
  if (h.cumulative.empty() || h.cumulative.back() == 0) return std::nan("");
  const double rank = q * static_cast<double>(h.cumulative.back());
  for (size_t i = 0; i < h.cumulative.size(); ++i) {
    if (static_cast<double>(h.cumulative[i]) >= rank) {
      if (std::isinf(h.bounds[i])) return i > 0 ? h.bounds[i - 1] : std::nan("");
      const double lo = i == 0 ? 0.0 : h.bounds[i - 1];
      const double below = i == 0 ? 0.0 : static_cast<double>(h.cumulative[i - 1]);
      const double in = static_cast<double>(h.cumulative[i]) - below;
      return lo + (h.bounds[i] - lo) * (in > 0 ? (rank - below) / in : 1.0);
    }
  }
  return h.bounds.back();
}

double FractionAtMost(const Histogram& h, double bound) {
  if (h.cumulative.empty() || h.cumulative.back() == 0) return std::nan("");
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    if (std::abs(h.bounds[i] - bound) < 1e-12) {
      return static_cast<double>(h.cumulative[i]) / static_cast<double>(h.cumulative.back());
    }
  }
  return std::nan("");
}

// ---- The load -------------------------------------------------------------------------------

struct LoadResult {
  double window_seconds = 0;
  uint64_t window_acked = 0;
  double window_cpu_seconds = 0;
  double window_sys_seconds = 0;
  uint64_t window_switches = 0;
  std::map<std::string, double> window_cpu_by_thread;
  uint64_t recorded = 0, acked = 0, sent = 0, dropped = 0, rejected = 0, invalid = 0;
  uint64_t record_errors = 0;
  uint64_t steps = 0;  // steps recorded by every rank
  bool connected = true;
  bool flushed = true;
  double rate() const { return window_seconds > 0 ? window_acked / window_seconds : 0; }
};

uint64_t SumAcked(const std::vector<std::unique_ptr<Agent>>& agents) {
  uint64_t n = 0;
  for (const auto& a : agents) n += a->stats().acked;
  return n;
}

// Runs the load against `target` for warmup + window. on_window(true/false) is called at the
// window's start and end (snapshots of server-side metrics).
LoadResult RunLoad(const std::string& target, const std::string& job,
                   const std::function<void(bool start)>& on_window) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int dim = absl::GetFlag(FLAGS_sketch_dim);
  const int drivers = std::clamp(absl::GetFlag(FLAGS_drivers), 1, ranks);
  const size_t max_inflight = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_inflight)));
  LoadResult res;

  // Shared data: a pool of Gaussian vectors around a common direction (cosine ~ 0.9).
  constexpr int kPool = 64;
  std::vector<std::vector<float>> pool(kPool, std::vector<float>(dim));
  {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> common(dim);
    for (float& x : common) x = n(rng);
    for (auto& v : pool) {
      for (int j = 0; j < dim; ++j) v[j] = 0.95f * common[j] + 0.3f * n(rng);
    }
  }

  std::vector<std::unique_ptr<Agent>> agents;
  agents.reserve(ranks);
  for (int r = 0; r < ranks; ++r) {
    rankscope::AgentOptions o;
    o.collector_address = target;
    o.job = job;
    o.rank = static_cast<uint32_t>(r);
    o.world_size = static_cast<uint32_t>(ranks);
    o.sketch_dim = static_cast<uint32_t>(dim);
    o.framework_version = "ingest_bench";
    o.queue_capacity = static_cast<size_t>(absl::GetFlag(FLAGS_queue_capacity));
    o.initial_backoff = absl::Milliseconds(50);
    o.max_backoff = absl::Seconds(1);
    auto a = Agent::Create(o);
    if (!a.ok()) {
      std::fprintf(stderr, "ingest_bench: %s\n", a.status().ToString().c_str());
      std::exit(2);
    }
    agents.push_back(std::move(*a));
  }
  // Wait until every agent has its stream open.
  const absl::Time connect_deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < connect_deadline) {
    int up = 0;
    for (const auto& a : agents) up += a->stats().connected ? 1 : 0;
    if (up == ranks) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (const auto& a : agents) res.connected &= a->stats().connected;

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> record_errors{0};
  std::vector<uint64_t> steps_done(drivers, 0);
  auto drive = [&](int d) {
    pthread_setname_np(pthread_self(), "bench-driver");
    const int begin = ranks * d / drivers, end = ranks * (d + 1) / drivers;
    std::mt19937_64 rng(1000 + d);
    std::normal_distribution<double> z(0.0, 1.0);
    rankscope::StepReport rep;
    for (uint64_t step = 1; !stop.load(std::memory_order_relaxed); ++step) {
      for (int r = begin; r < end && !stop.load(std::memory_order_relaxed); ++r) {
        Agent& a = *agents[r];
        while (!stop.load(std::memory_order_relaxed)) {
          const rankscope::AgentStats s = a.stats();
          if (s.queued + s.unacked < max_inflight) break;
          absl::SleepFor(absl::Microseconds(100));
        }
        if (stop.load(std::memory_order_relaxed)) break;
        rep.step = step;
        rep.loss = 2.0 + 0.01 * z(rng);
        rep.grad_norm = 1.0 + 0.02 * std::abs(z(rng));
        rep.sketch = pool[(step * 31 + static_cast<uint64_t>(r)) % kPool];
        if (!a.Record(rep).ok()) record_errors.fetch_add(1);
      }
      if (!stop.load(std::memory_order_relaxed)) steps_done[d] = step;
    }
  };
  std::vector<std::thread> threads;
  for (int d = 0; d < drivers; ++d) threads.emplace_back(drive, d);

  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_warmup_seconds)));
  on_window(true);
  const uint64_t acked0 = SumAcked(agents);
  const CpuUsage cpu0 = Usage();
  const std::map<std::string, double> threads0 = CpuByThreadName();
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  const uint64_t acked1 = SumAcked(agents);
  const CpuUsage cpu1 = Usage();
  const std::map<std::string, double> threads1 = CpuByThreadName();
  const absl::Time t1 = absl::Now();
  on_window(false);
  res.window_seconds = absl::ToDoubleSeconds(t1 - t0);
  res.window_acked = acked1 - acked0;
  res.window_cpu_seconds = cpu1.user + cpu1.sys - cpu0.user - cpu0.sys;
  res.window_sys_seconds = cpu1.sys - cpu0.sys;
  for (const auto& [name, cpu] : threads1) {
    auto it = threads0.find(name);
    res.window_cpu_by_thread[name] = cpu - (it == threads0.end() ? 0.0 : it->second);
  }
  res.window_switches = cpu1.voluntary_switches + cpu1.involuntary_switches -
                        cpu0.voluntary_switches - cpu0.involuntary_switches;

  stop = true;
  for (auto& t : threads) t.join();
  res.steps = *std::min_element(steps_done.begin(), steps_done.end());
  res.record_errors = record_errors.load();
  const absl::Time flush_deadline = absl::Now() + absl::Seconds(60);
  for (auto& a : agents) {
    if (!a->Flush(std::max(absl::ZeroDuration(), flush_deadline - absl::Now())).ok()) {
      res.flushed = false;
    }
  }
  for (auto& a : agents) {
    const rankscope::AgentStats s = a->stats();
    res.recorded += s.recorded;
    res.acked += s.acked;
    res.sent += s.sent;
    res.dropped += s.dropped;
    res.rejected += s.rejected;
    res.invalid += s.invalid;
  }
  // Close in parallel: each Close joins two threads.
  std::vector<std::thread> closers;
  for (int d = 0; d < drivers; ++d) {
    closers.emplace_back([&, d] {
      for (int r = d; r < ranks; r += drivers) agents[r]->Close(absl::Seconds(1)).IgnoreError();
    });
  }
  for (auto& t : closers) t.join();
  return res;
}

bool Valid(const LoadResult& r) {
  return r.connected && r.flushed && r.dropped == 0 && r.rejected == 0 && r.invalid == 0 &&
         r.record_errors == 0 && r.acked == r.recorded;
}

void PrintLoad(const char* name, const LoadResult& r) {
  std::printf(
      "%-9s reports/s=%9.0f  window=%.1fs acked_in_window=%llu  cpu=%.2f cores, %.1f us/report "
      "(%.0f%% sys), %.1f context switches/report\n"
      "          recorded=%llu acked=%llu sent=%llu dropped=%llu rejected=%llu steps=%llu%s\n",
      name, r.rate(), r.window_seconds, static_cast<unsigned long long>(r.window_acked),
      r.window_cpu_seconds / std::max(1e-9, r.window_seconds),
      r.window_acked > 0 ? 1e6 * r.window_cpu_seconds / r.window_acked : 0.0,
      100.0 * r.window_sys_seconds / std::max(1e-9, r.window_cpu_seconds),
      r.window_acked > 0 ? static_cast<double>(r.window_switches) / r.window_acked : 0.0,
      static_cast<unsigned long long>(r.recorded), static_cast<unsigned long long>(r.acked),
      static_cast<unsigned long long>(r.sent), static_cast<unsigned long long>(r.dropped),
      static_cast<unsigned long long>(r.rejected), static_cast<unsigned long long>(r.steps),
      Valid(r) ? "" : "  INVALID (drops, rejections, unflushed or unconnected agents)");
  std::string threads;
  for (const auto& [name, cpu] : r.window_cpu_by_thread) {
    if (r.window_acked == 0 || cpu <= 0) continue;
    absl::StrAppendFormat(&threads, "%s%s %.1f", threads.empty() ? "" : ", ", name,
                          1e6 * cpu / r.window_acked);
  }
  std::printf("          cpu us/report by thread: %s\n", threads.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_ignore_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  const std::string only = absl::GetFlag(FLAGS_only);
  const int seconds = absl::GetFlag(FLAGS_seconds);
  const int warmup = absl::GetFlag(FLAGS_warmup_seconds);
  const int max_wall = absl::GetFlag(FLAGS_max_wall_seconds) > 0
                           ? absl::GetFlag(FLAGS_max_wall_seconds)
                           : 2 * (warmup + seconds) + 180;
  std::thread([max_wall] {
    absl::SleepFor(absl::Seconds(max_wall));
    std::fprintf(stderr, "ingest_bench: still running after %d s, aborting\n", max_wall);
    std::_Exit(3);
  }).detach();

  std::printf(
      "ingest_bench: ranks=%d sketch_dim=%d drivers=%d max_inflight=%d queue_capacity=%d "
      "window=%ds warmup=%ds nproc=%ld loadavg=%s\n",
      absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_sketch_dim), absl::GetFlag(FLAGS_drivers),
      absl::GetFlag(FLAGS_max_inflight), absl::GetFlag(FLAGS_queue_capacity), seconds, warmup,
      sysconf(_SC_NPROCESSORS_ONLN), LoadAvg().c_str());
  std::fflush(stdout);

  LoadResult bare, coll;
  bool ran_bare = false, ran_coll = false, stored_ok = true;
  int64_t stored = -1;
  Histogram latency;
  if (only.empty() || only == "bare") {
    BareSinkService service;
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(8 << 20);
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr || port == 0) {
      std::fprintf(stderr, "ingest_bench: cannot start the bare sink\n");
      return 2;
    }
    bare = RunLoad(absl::StrCat("127.0.0.1:", port), "bench-bare", [](bool) {});
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ran_bare = true;
    PrintLoad("bare", bare);
  }
  if (only.empty() || only == "collector") {
    std::string dir = absl::GetFlag(FLAGS_tmpdir);
    if (dir.empty()) dir = getenv("TMPDIR") != nullptr ? getenv("TMPDIR") : "/tmp";
    std::string tmpl = dir + "/ingest_bench-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::fprintf(stderr, "ingest_bench: cannot create a temp dir under %s\n", dir.c_str());
      return 2;
    }
    const std::string db_path = tmpl + "/rankscope.db";
    rankscope::collector::CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "127.0.0.1:0";
    o.db_path = db_path;
    auto started = rankscope::collector::Collector::Start(o);
    if (!started.ok()) {
      std::fprintf(stderr, "ingest_bench: %s\n", started.status().ToString().c_str());
      return 2;
    }
    rankscope::collector::Collector& c = **started;
    const auto registry = c.health().registry();

    std::atomic<bool> scraping{true};
    std::atomic<uint64_t> scrapes{0}, scrape_bytes{0};
    std::thread scraper([&] {
      const int every = absl::GetFlag(FLAGS_scrape_ms);
      while (every > 0 && scraping.load()) {
        const size_t n = HttpGetBytes(c.metrics_port(), "/metrics");
        if (n > 0) {
          ++scrapes;
          scrape_bytes += n;
        }
        absl::SleepFor(absl::Milliseconds(every));
      }
    });
    Histogram before, commits_before, commits;
    coll = RunLoad(c.grpc_target(), "bench-collector", [&](bool start) {
      Histogram h = ReadHistogram(*registry, "rankscope_ingest_latency_seconds");
      Histogram k = ReadHistogram(*registry, "rankscope_store_commit_seconds");
      if (start) {
        before = h;
        commits_before = k;
      } else {
        latency = Delta(h, before);
        commits = Delta(k, commits_before);
      }
    });
    scraping = false;
    scraper.join();
    const bool flushed = c.Flush(absl::Seconds(60));
    const double late = CounterValue(*registry, "rankscope_reports_late_total");
    const double dup = CounterValue(*registry, "rankscope_reports_duplicate_total");
    const double evicted = CounterValue(*registry, "rankscope_steps_evicted_total");
    const double store_errors = CounterValue(*registry, "rankscope_store_errors_total");
    const absl::Status shut = c.Shutdown(absl::Seconds(10));
    rankscope::collector::StoreOptions ro;
    ro.read_only = true;
    auto store = rankscope::collector::SqliteStore::Open(db_path, ro);
    if (store.ok()) {
      auto n = (*store)->CountRankRows("bench-collector");
      if (n.ok()) stored = *n;
    }
    stored_ok = flushed && shut.ok() && stored == static_cast<int64_t>(coll.acked);
    ran_coll = true;
    PrintLoad("collector", coll);
    std::printf(
        "          stored_in_sqlite=%lld %s acked=%llu  late=%.0f duplicate=%.0f evicted=%.0f "
        "store_errors=%.0f  scrapes=%llu (%.0f KiB each)%s\n",
        static_cast<long long>(stored), stored == static_cast<int64_t>(coll.acked) ? "==" : "!=",
        static_cast<unsigned long long>(coll.acked), late, dup, evicted, store_errors,
        static_cast<unsigned long long>(scrapes.load()),
        scrapes.load() > 0 ? scrape_bytes.load() / 1024.0 / scrapes.load() : 0.0,
        stored_ok ? "" : "  STORE CHECK FAILED");
    const double p50 = Quantile(latency, 0.5), p99 = Quantile(latency, 0.99);
    std::printf(
        "          ingest latency (last report of a step -> metric updated), %llu steps in the "
        "window: p50=%.2f ms p99=%.2f ms mean=%.2f ms, <=50ms: %.2f%%\n",
        static_cast<unsigned long long>(latency.count), p50 * 1e3, p99 * 1e3,
        latency.count > 0 ? latency.sum / latency.count * 1e3 : 0.0,
        100.0 * FractionAtMost(latency, 0.05));
    std::printf(
        "          SQLite commits in the window: %llu (%.1f/s, %.0f reports each, %.2f ms mean "
        "commit)\n",
        static_cast<unsigned long long>(commits.count), commits.count / coll.window_seconds,
        commits.count > 0 ? static_cast<double>(coll.window_acked) / commits.count : 0.0,
        commits.count > 0 ? commits.sum / commits.count * 1e3 : 0.0);
    std::fflush(stdout);
    std::remove((db_path + "-wal").c_str());
    std::remove((db_path + "-shm").c_str());
    std::remove(db_path.c_str());
    rmdir(tmpl.c_str());
  }

  bool pass = true;
  std::printf("targets:\n");
  if (ran_coll) {
    const bool rate_ok = coll.rate() >= 50'000;
    const double p99 = Quantile(latency, 0.99);
    const bool lat_ok = FractionAtMost(latency, 0.05) >= 0.99;
    std::printf("  collector >= 50,000 reports/s      : %9.0f  %s\n", coll.rate(),
                rate_ok ? "PASS" : "MISS");
    std::printf("  p99 latency < 50 ms                : %8.2f ms %s\n", p99 * 1e3,
                lat_ok ? "PASS" : "MISS");
    std::printf("  everything stored (rows == acked)  : %s\n", stored_ok ? "PASS" : "FAIL");
    pass &= rate_ok && lat_ok && stored_ok && Valid(coll);
  }
  if (ran_bare && ran_coll) {
    const double ratio = bare.rate() > 0 ? coll.rate() / bare.rate() : 0;
    std::printf("  collector / bare sink >= 0.50      : %9.2f  %s\n", ratio,
                ratio >= 0.5 ? "PASS" : "MISS");
    std::printf("  cpu per report collector / bare    : %9.2f\n",
                bare.window_acked > 0 && coll.window_acked > 0
                    ? (coll.window_cpu_seconds / coll.window_acked) /
                          (bare.window_cpu_seconds / bare.window_acked)
                    : 0.0);
    pass &= ratio >= 0.5 && Valid(bare);
  }
  std::printf("loadavg at end: %s\n", LoadAvg().c_str());
  std::fflush(stdout);
  std::_Exit(pass ? 0 : 1);
}
