// Collector ingest throughput beside a bare gRPC streaming sink, in one run.
//
// The same load drives, one after the other and for the same time, two servers that live in this
// process:
//   bare       an Ingest/Stream callback server that parses each message (gRPC deserializes it
//              into the reactor's AgentMessage) and drops it, acking every report at once. Acks
//              are coalesced as the collector's are (at most one write in flight per stream; the
//              seqs that arrived meanwhile go into the next Ack). Acking is what lets the load
//              flow: the agents' flow control (below) waits for acks, as it does with the
//              collector, which acks after the SQLite commit.
//   collector  the real Collector (as tests/integration/pipeline_test.cc starts it): a SQLite file
//              in a temp dir (WAL), /metrics served over HTTP and scraped every --scrape_ms,
//              every step joined, computed, exported and stored.
// The load: --ranks real rankscope::Agent instances (k = --sketch_dim) of one job, each with its
// own gRPC connection as ranks in separate processes have, run by default in a child process
// (this binary re-executed with --role=load) so that the server's CPU and the load generator's are
// measured apart; --inprocess runs them in this process. --drivers threads Record() step after
// step (each driver owns ranks/drivers ranks, a step at a time, like synchronous training); a rank
// waits while it has --max_inflight reports queued or unacked (flow control: agents never drop; a
// run with a drop is reported INVALID). --rate paces the load (reports/s offered) instead of
// running as fast as acks come back.
//
// Measured over a window of --seconds after --warmup_seconds:
//   reports/s  reports acknowledged to the agents in the window / window length (for the
//              collector an ack means "committed to SQLite");
//   cpu        user + sys CPU of the server process and of the load generator, per report, and
//              per thread name (rs-step-thread, rs-store-writer, gRPC's nexting_thread, ...);
//   latency    the collector's own rankscope_ingest_latency_seconds histogram (HealthMetrics
//              registry), window delta: from the step's last report handed to the pipeline by the
//              stream reactor to the step's statistics updated in the Prometheus export;
//              p50/p99 interpolated inside buckets as PromQL's histogram_quantile() does; the
//              fraction <= 50 ms is exact (50 ms is a bucket bound).
// After the window the drivers stop, every agent is flushed, and for the collector the rows in
// SQLite are counted (CountRankRows) and must equal the reports acked.
//
// The run is bounded: a watchdog aborts it (and the load process) after --max_wall_seconds.
//
// --retention_rank_steps=D runs the collector with the storage retention pruning rows older than
// D during the run (the cost of pruning on ingest); the rows it pruned count as stored.
//
// --sketch_encoding (float32, float16, int8) packs the agents' sketches (common/sketch_encoding.h);
// at the same bytes a rank a step, float16 takes --sketch_dim=2048 and int8 --sketch_dim=4096.
//
// Usage: ingest_bench [--seconds=30] [--ranks=1024] [--sketch_dim=1024] [--only=bare|collector]
//                     [--sketch_encoding=float32|float16|int8]
//                     [--rate=0] [--inprocess] [--retention_rank_steps=2s]
//
// One file, several parts (the bare sink, CPU accounting, the collector-side metrics, the load, the
// report: the sections below), kept together on purpose: they exist only for this one measurement
// and are read with its figures in docs/PERFORMANCE.md; split, a reader would follow one run across
// five files.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "collector/store/sqlite_store.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

extern char** environ;

ABSL_FLAG(int, seconds, 30, "Length of the measured window for each server.");
ABSL_FLAG(int, warmup_seconds, 5, "Load before the window starts (connections, caches).");
ABSL_FLAG(int, ranks, 1024, "Agents (ranks of one job).");
ABSL_FLAG(
    int, groups, 1,
    "Data-parallel groups the --ranks form (must divide it): rank r is rank r % (ranks/groups) "
    "of group g<r / (ranks/groups)>, as loadgen --groups lays them out; 1: one group.");
ABSL_FLAG(std::string, analysis_threads, "1",
          "The collector's analysis threads (PipelineOptions::analysis_threads), a comma-separated "
          "list: the collector phase runs once per value, side by side in one run.");
ABSL_FLAG(int, sketch_dim, 1024, "Sketch dimension k.");
ABSL_FLAG(std::string, sketch_encoding, "float32",
          "How the agents send the sketch: float32, float16 or int8 (common/sketch_encoding.h).");
ABSL_FLAG(int, drivers, 2, "Threads calling Record() (the ranks are split between them).");
ABSL_FLAG(int, max_inflight, 48, "Per rank: wait while this many reports are queued or unacked.");
ABSL_FLAG(int, queue_capacity, 64, "Agent ring capacity (> max_inflight, so no ring drops).");
ABSL_FLAG(double, rate, 0,
          "Offered load in reports/s, paced step by step (0: as fast as acks "
          "allow).");
ABSL_FLAG(int, scrape_ms, 1000, "Scrape the collector's /metrics this often (0: never).");
ABSL_FLAG(std::string, only, "", "Run only 'bare' or only 'collector'.");
ABSL_FLAG(bool, inprocess, false, "Run the agents in this process instead of a child process.");
ABSL_FLAG(bool, pin, false,
          "Pin the server process to CPU 0 and the load process to CPU 1, so "
          "that the collector has a core of its own as on a dedicated machine (needs 2 CPUs and "
          "the child process).");
ABSL_FLAG(absl::Duration, retention_rank_steps, absl::ZeroDuration(),
          "Collector: prune per-rank rows older than this (storage retention, downsampled into "
          "rank_windows) during the run, checked every 100 ms; 0: no retention. With e.g. 2s the "
          "store thread prunes as fast as rows arrive: the cost of retention on ingest.");
ABSL_FLAG(std::string, tmpdir, "", "Directory for the SQLite file (default: $TMPDIR or /tmp).");
ABSL_FLAG(bool, ignore_deadlock_detection, false,
          "In the server process, turn off absl's Mutex deadlock detection (on by default in "
          "Debian's libabsl, which is built without NDEBUG), as the agent library does.");
ABSL_FLAG(int, max_wall_seconds, 0, "Abort after this long (0: 2 * (warmup + seconds) + 240).");
// Internal: the load generator process.
ABSL_FLAG(std::string, role, "", "Internal: 'load' runs the agents against --target.");
ABSL_FLAG(std::string, target, "", "Internal: the server's address (with --role=load).");
ABSL_FLAG(std::string, job, "bench", "Internal: the job name (with --role=load).");

namespace {

namespace v1 = ::rankscope::v1;
using rankscope::Agent;

// ---- The bare sink --------------------------------------------------------------------------

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

 private:
  std::atomic<uint64_t> received_{0};
};

// ---- CPU accounting -------------------------------------------------------------------------

struct CpuSample {
  double user = 0, sys = 0;
  uint64_t switches = 0;
  std::map<std::string, double> by_thread;  // CPU seconds of live threads, by thread name
};

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
    std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
    if (fields.size() < 13) continue;
    double utime = 0, stime = 0;  // fields 14 and 15 of /proc/<pid>/stat
    if (!absl::SimpleAtod(fields[11], &utime) || !absl::SimpleAtod(fields[12], &stime)) continue;
    if (comm.empty() || comm == "ingest_bench") comm = "other";
    out[comm] += (utime + stime) / tick;
  }
  closedir(dir);
  return out;
}

CpuSample SampleCpu() {
  CpuSample s;
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  s.user = u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6;
  s.sys = u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
  s.switches = static_cast<uint64_t>(u.ru_nvcsw + u.ru_nivcsw);
  s.by_thread = CpuByThreadName();
  return s;
}

// CPU used between two samples; threads are matched by name (threads that ended in between are
// missing from `by_thread` but counted in the totals).
struct CpuUse {
  double seconds = 0, sys = 0;
  uint64_t switches = 0;
  std::map<std::string, double> by_thread;
};

CpuUse Between(const CpuSample& a, const CpuSample& b) {
  CpuUse u;
  u.seconds = b.user + b.sys - a.user - a.sys;
  u.sys = b.sys - a.sys;
  u.switches = b.switches - a.switches;
  for (const auto& [name, cpu] : b.by_thread) {
    auto it = a.by_thread.find(name);
    u.by_thread[name] = cpu - (it == a.by_thread.end() ? 0.0 : it->second);
  }
  return u;
}

// Machine-wide CPU time from /proc/stat, in seconds: busy (everything but idle and iowait) and
// steal (taken by the hypervisor).
struct MachineCpu {
  double busy = 0, steal = 0;
};

MachineCpu SampleMachine() {
  std::ifstream f("/proc/stat");
  std::string cpu;
  double v[10] = {0};
  f >> cpu;
  for (double& x : v) f >> x;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  // user nice system idle iowait irq softirq steal guest guest_nice
  return {(v[0] + v[1] + v[2] + v[5] + v[6]) / tick, v[7] / tick};
}

std::string LoadAvg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

// ---- Collector-side metrics -----------------------------------------------------------------

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
    if (f.name == name && !f.metric.empty()) return f.metric.front().counter.value;
  }
  return -1;
}

// The sum of a labelled counter family's series whose `label` is `value`; 0 when none.
double LabeledCounterValue(const prometheus::Registry& registry, const std::string& name,
                           const std::string& label, const std::string& value) {
  double total = 0;
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == label && l.value == value) total += m.counter.value;
      }
    }
  }
  return total;
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
  uint64_t recorded = 0, acked = 0, sent = 0, dropped = 0, rejected = 0, invalid = 0;
  uint64_t record_errors = 0;
  uint64_t steps = 0;  // steps recorded by every rank
  bool connected = true;
  bool flushed = true;
  CpuUse cpu;  // of the load generator over the window (in-process: of the whole process)
  double rate() const { return window_seconds > 0 ? window_acked / window_seconds : 0; }
  bool valid() const {
    return connected && flushed && dropped == 0 && rejected == 0 && invalid == 0 &&
           record_errors == 0 && acked == recorded && window_acked > 0;
  }
};

uint64_t SumAcked(const std::vector<std::unique_ptr<Agent>>& agents) {
  uint64_t n = 0;
  for (const auto& a : agents) n += a->stats().acked;
  return n;
}

// Runs the agents against `target` for warmup + window. on_window(true/false) is called at the
// window's start and end.
// Long: one measured run as it happens (set-up, the loop, what it records), its phases commented in
// order; split, its processes and figures would be handed between helpers.
LoadResult RunLoad(const std::string& target, const std::string& job,
                   const std::function<void(bool start)>& on_window) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int dim = absl::GetFlag(FLAGS_sketch_dim);
  const int drivers = std::clamp(absl::GetFlag(FLAGS_drivers), 1, ranks);
  const size_t max_inflight = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_inflight)));
  const double rate = absl::GetFlag(FLAGS_rate);
  const absl::Duration step_interval =
      rate > 0 ? absl::Seconds(ranks / rate) : absl::ZeroDuration();
  LoadResult res;

  // Sketches: a pool of Gaussian vectors around a common direction (pairwise cosine ~0.9).
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
  const int groups = std::max(1, absl::GetFlag(FLAGS_groups));
  const int group_size = ranks / groups;
  for (int r = 0; r < ranks; ++r) {
    rankscope::AgentOptions o;
    o.collector_address = target;
    o.job = job;
    o.rank = static_cast<uint32_t>(r % group_size);
    o.world_size = static_cast<uint32_t>(group_size);
    if (groups > 1) o.group = absl::StrCat("g", r / group_size);
    o.sketch_dim = static_cast<uint32_t>(dim);
    o.sketch_encoding = rankscope::ParseSketchEncoding(absl::GetFlag(FLAGS_sketch_encoding))
                            .value_or(rankscope::SketchEncoding::kFloat32);
    o.framework_version = "ingest_bench";
    o.queue_capacity = static_cast<size_t>(absl::GetFlag(FLAGS_queue_capacity));
    o.initial_backoff = absl::Milliseconds(50);
    o.max_backoff = absl::Seconds(1);
    auto a = Agent::Create(o);
    if (!a.ok()) {
      std::fprintf(stderr, "ingest_bench: %s\n", a.status().ToString().c_str());
      std::_Exit(2);
    }
    agents.push_back(std::move(*a));
  }
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
  const absl::Time start = absl::Now();
  auto drive = [&](int d) {
    pthread_setname_np(pthread_self(), "bench-driver");
    const int begin = ranks * d / drivers, end = ranks * (d + 1) / drivers;
    std::mt19937_64 rng(1000 + d);
    std::normal_distribution<double> z(0.0, 1.0);
    rankscope::StepReport rep;
    for (uint64_t step = 1; !stop.load(std::memory_order_relaxed); ++step) {
      if (step_interval > absl::ZeroDuration()) {
        const absl::Time due = start + step_interval * static_cast<double>(step - 1);
        while (!stop.load(std::memory_order_relaxed) && absl::Now() < due) {
          absl::SleepFor(std::min(due - absl::Now(), absl::Milliseconds(50)));
        }
      }
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
  const CpuSample cpu0 = SampleCpu();
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  const uint64_t acked1 = SumAcked(agents);
  const CpuSample cpu1 = SampleCpu();
  const absl::Time t1 = absl::Now();
  on_window(false);
  res.window_seconds = absl::ToDoubleSeconds(t1 - t0);
  res.window_acked = acked1 - acked0;
  res.cpu = Between(cpu0, cpu1);

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
  rankscope::AgentStats total;
  for (auto& a : agents) total.Add(a->stats());
  res.recorded = total.recorded;
  res.acked = total.acked;
  res.sent = total.sent;
  res.dropped = total.dropped;
  res.rejected = total.rejected;
  res.invalid = total.invalid;
  // Close in parallel: each Close joins a thread.
  std::vector<std::thread> closers;
  for (int d = 0; d < drivers; ++d) {
    closers.emplace_back([&, d] {
      for (int r = d; r < ranks; r += drivers) agents[r]->Close(absl::Seconds(1)).IgnoreError();
    });
  }
  for (auto& t : closers) t.join();
  return res;
}

// The child's report to the parent, one line: "result key=value ...".
std::string FormatResult(const LoadResult& r) {
  std::string s = absl::StrFormat(
      "result window_seconds=%.6f window_acked=%d recorded=%d acked=%d sent=%d dropped=%d "
      "rejected=%d invalid=%d record_errors=%d steps=%d connected=%d flushed=%d cpu=%.6f "
      "sys=%.6f switches=%d",
      r.window_seconds, r.window_acked, r.recorded, r.acked, r.sent, r.dropped, r.rejected,
      r.invalid, r.record_errors, r.steps, r.connected ? 1 : 0, r.flushed ? 1 : 0, r.cpu.seconds,
      r.cpu.sys, r.cpu.switches);
  for (const auto& [name, cpu] : r.cpu.by_thread) {
    std::string key = name;
    std::replace(key.begin(), key.end(), ' ', '_');
    absl::StrAppendFormat(&s, " thread:%s=%.6f", key, cpu);
  }
  return s;
}

LoadResult ParseResult(const std::string& line) {
  LoadResult r;
  for (absl::string_view kv : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos) continue;
    const std::string key(kv.substr(0, eq));
    const std::string value(kv.substr(eq + 1));
    double d = 0;
    if (!absl::SimpleAtod(value, &d)) continue;
    const uint64_t u = static_cast<uint64_t>(d);
    if (key == "window_seconds") r.window_seconds = d;
    if (key == "window_acked") r.window_acked = u;
    if (key == "recorded") r.recorded = u;
    if (key == "acked") r.acked = u;
    if (key == "sent") r.sent = u;
    if (key == "dropped") r.dropped = u;
    if (key == "rejected") r.rejected = u;
    if (key == "invalid") r.invalid = u;
    if (key == "record_errors") r.record_errors = u;
    if (key == "steps") r.steps = u;
    if (key == "connected") r.connected = u != 0;
    if (key == "flushed") r.flushed = u != 0;
    if (key == "cpu") r.cpu.seconds = d;
    if (key == "sys") r.cpu.sys = d;
    if (key == "switches") r.cpu.switches = u;
    if (key.rfind("thread:", 0) == 0) r.cpu.by_thread[key.substr(7)] = d;
  }
  return r;
}

// The load generator as a child process: this binary with --role=load. Its stdout is a pipe on
// which it announces the window ("window_start", "window_end") and its result.
LoadResult RunLoadInChild(const std::string& target, const std::string& job,
                          const std::function<void(bool start)>& on_window) {
  int fds[2];
  if (pipe(fds) != 0) {
    std::perror("ingest_bench: pipe");
    std::_Exit(2);
  }
  std::vector<std::string> args = {
      "ingest_bench",
      "--role=load",
      absl::StrCat("--target=", target),
      absl::StrCat("--job=", job),
      absl::StrCat("--seconds=", absl::GetFlag(FLAGS_seconds)),
      absl::StrCat("--warmup_seconds=", absl::GetFlag(FLAGS_warmup_seconds)),
      absl::StrCat("--ranks=", absl::GetFlag(FLAGS_ranks)),
      absl::StrCat("--groups=", absl::GetFlag(FLAGS_groups)),
      absl::StrCat("--sketch_dim=", absl::GetFlag(FLAGS_sketch_dim)),
      absl::StrCat("--sketch_encoding=", absl::GetFlag(FLAGS_sketch_encoding)),
      absl::StrCat("--drivers=", absl::GetFlag(FLAGS_drivers)),
      absl::StrCat("--max_inflight=", absl::GetFlag(FLAGS_max_inflight)),
      absl::StrCat("--queue_capacity=", absl::GetFlag(FLAGS_queue_capacity)),
      absl::StrCat("--rate=", absl::GetFlag(FLAGS_rate)),
      absl::StrCat("--max_wall_seconds=", absl::GetFlag(FLAGS_max_wall_seconds)),
      absl::StrCat("--pin=", absl::GetFlag(FLAGS_pin) ? "true" : "false"),
  };
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    std::fprintf(stderr, "ingest_bench: cannot start the load process: %s\n", std::strerror(rc));
    std::_Exit(2);
  }
  LoadResult result;
  bool got_result = false;
  FILE* in = fdopen(fds[0], "r");
  char line[65536];
  while (std::fgets(line, sizeof(line), in) != nullptr) {
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (s == "window_start") {
      on_window(true);
    } else if (s == "window_end") {
      on_window(false);
    } else if (s.rfind("result ", 0) == 0) {
      result = ParseResult(s);
      got_result = true;
    }
  }
  std::fclose(in);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!got_result) {
    std::fprintf(stderr, "ingest_bench: the load process ended without a result (status %d)\n",
                 status);
    result.connected = false;
  }
  return result;
}

// Restricts this process (every thread created from now on) to one CPU.
void PinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) std::perror("ingest_bench: sched_setaffinity");
}

int LoadMain() {
  pthread_setname_np(pthread_self(), "bench-load");
  if (absl::GetFlag(FLAGS_pin)) PinTo(1);
  LoadResult r = RunLoad(absl::GetFlag(FLAGS_target), absl::GetFlag(FLAGS_job), [](bool start) {
    std::printf("%s\n", start ? "window_start" : "window_end");
    std::fflush(stdout);
  });
  std::printf("%s\n", FormatResult(r).c_str());
  std::fflush(stdout);
  std::_Exit(0);  // gRPC's and the agents' static state need no orderly teardown here
}

// ---- Report ---------------------------------------------------------------------------------

std::string PerReport(const CpuUse& cpu, uint64_t reports) {
  if (reports == 0) return "-";
  std::string s;
  for (const auto& [name, seconds] : cpu.by_thread) {
    if (seconds <= 0) continue;
    absl::StrAppendFormat(&s, "%s%s %.1f", s.empty() ? "" : ", ", name, 1e6 * seconds / reports);
  }
  return s;
}

struct Phase {
  bool ran = false;
  LoadResult load;
  CpuUse server;  // the server process over the window (not measured apart with --inprocess)
  double machine_busy = 0, machine_steal = 0;  // all processes, over the window, in seconds
};

void PrintPhase(const char* name, const Phase& p, bool inprocess) {
  const LoadResult& r = p.load;
  const double n = static_cast<double>(std::max<uint64_t>(r.window_acked, 1));
  const double w = std::max(1e-9, r.window_seconds);
  std::printf("%-9s reports/s=%9.0f  (window %.1f s, %llu reports acked; %llu steps)%s\n", name,
              r.rate(), r.window_seconds, static_cast<unsigned long long>(r.window_acked),
              static_cast<unsigned long long>(r.steps),
              r.valid() ? "" : "  INVALID (drops, rejections, unflushed or unconnected agents)");
  const double ours = p.server.seconds + r.cpu.seconds;
  std::printf(
      "          machine: %.2f of %ld cores busy, %.2f of them this bench, %.2f other "
      "processes; steal %.2f cores\n",
      p.machine_busy / w, sysconf(_SC_NPROCESSORS_ONLN), ours / w,
      std::max(0.0, p.machine_busy - ours) / w, p.machine_steal / w);
  if (!inprocess) {
    std::printf("          server: %.2f cores, %.1f us CPU/report (%.0f%% sys)  [%s]\n",
                p.server.seconds / w, 1e6 * p.server.seconds / n,
                100.0 * p.server.sys / std::max(1e-9, p.server.seconds),
                PerReport(p.server, r.window_acked).c_str());
  }
  std::printf(
      "          %s: %.2f cores, %.1f us CPU/report (%.0f%% sys), %.2f context "
      "switches/report  [%s]\n",
      inprocess ? "process (server + agents)" : "agents", r.cpu.seconds / w,
      1e6 * r.cpu.seconds / n, 100.0 * r.cpu.sys / std::max(1e-9, r.cpu.seconds),
      r.cpu.switches / n, PerReport(r.cpu, r.window_acked).c_str());
  std::printf(
      "          agents: recorded=%llu acked=%llu sent=%llu dropped=%llu rejected=%llu "
      "invalid=%llu\n",
      static_cast<unsigned long long>(r.recorded), static_cast<unsigned long long>(r.acked),
      static_cast<unsigned long long>(r.sent), static_cast<unsigned long long>(r.dropped),
      static_cast<unsigned long long>(r.rejected), static_cast<unsigned long long>(r.invalid));
  std::fflush(stdout);
}

double TotalCpuPerReport(const Phase& p) {
  if (p.load.window_acked == 0) return 0;
  return (p.load.cpu.seconds + p.server.seconds) / p.load.window_acked;
}

}  // namespace

// Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
// runs, the table it prints; the measured pieces are functions of their own.
int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!rankscope::ParseSketchEncoding(absl::GetFlag(FLAGS_sketch_encoding))) {
    std::fprintf(stderr, "ingest_bench: --sketch_encoding must be float32, float16 or int8\n");
    return 2;
  }
  const int seconds = absl::GetFlag(FLAGS_seconds);
  const int warmup = absl::GetFlag(FLAGS_warmup_seconds);
  const int max_wall = absl::GetFlag(FLAGS_max_wall_seconds) > 0
                           ? absl::GetFlag(FLAGS_max_wall_seconds)
                           : 2 * (warmup + seconds) + 240;
  std::thread([max_wall] {
    absl::SleepFor(absl::Seconds(max_wall));
    std::fprintf(stderr, "ingest_bench: still running after %d s, aborting\n", max_wall);
    std::_Exit(3);
  }).detach();
  if (absl::GetFlag(FLAGS_role) == "load") return LoadMain();
  signal(SIGPIPE, SIG_IGN);
  if (absl::GetFlag(FLAGS_ignore_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }

  const bool inprocess = absl::GetFlag(FLAGS_inprocess);
  if (absl::GetFlag(FLAGS_pin)) {
    if (inprocess || sysconf(_SC_NPROCESSORS_ONLN) < 2) {
      std::fprintf(stderr, "ingest_bench: --pin needs 2 CPUs and the load in a child process\n");
      return 2;
    }
    PinTo(0);  // before any gRPC or collector thread exists
  }
  const std::string only = absl::GetFlag(FLAGS_only);
  const std::string rate = absl::GetFlag(FLAGS_rate) > 0
                               ? absl::StrCat(absl::GetFlag(FLAGS_rate), "/s")
                               : std::string("max");
  std::printf(
      "ingest_bench: ranks=%d sketch_dim=%d sketch_encoding=%s drivers=%d max_inflight=%d "
      "queue_capacity=%d rate=%s window=%ds warmup=%ds agents=%s%s nproc=%ld loadavg=%s\n",
      absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_sketch_dim),
      absl::GetFlag(FLAGS_sketch_encoding).c_str(), absl::GetFlag(FLAGS_drivers),
      absl::GetFlag(FLAGS_max_inflight), absl::GetFlag(FLAGS_queue_capacity), rate.c_str(), seconds,
      warmup, inprocess ? "in-process" : "child process",
      absl::GetFlag(FLAGS_pin) ? " (server pinned to CPU 0, agents to CPU 1)" : "",
      sysconf(_SC_NPROCESSORS_ONLN), LoadAvg().c_str());
  std::fflush(stdout);

  // Runs the load against `target`; on_window also samples this process's CPU.
  auto run = [&](const std::string& target, const std::string& job, Phase* phase,
                 const std::function<void(bool)>& on_window) {
    CpuSample server0;
    MachineCpu machine0;
    auto window = [&](bool start) {
      if (start) {
        server0 = SampleCpu();
        machine0 = SampleMachine();
      } else {
        phase->server = Between(server0, SampleCpu());
        const MachineCpu machine1 = SampleMachine();
        phase->machine_busy = machine1.busy - machine0.busy;
        phase->machine_steal = machine1.steal - machine0.steal;
      }
      on_window(start);
    };
    phase->load = inprocess ? RunLoad(target, job, window) : RunLoadInChild(target, job, window);
    if (inprocess) phase->server = CpuUse();  // everything is in load.cpu
    phase->ran = true;
  };

  Phase bare, coll;
  bool stored_ok = false;
  int64_t stored = -1;
  Histogram latency, commits;
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
    run(absl::StrCat("127.0.0.1:", port), "bench-bare", &bare, [](bool) {});
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    PrintPhase("bare", bare, inprocess);
  }
  // One collector phase per --analysis_threads value, side by side.
  std::vector<size_t> thread_counts;
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_analysis_threads), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(t, &n) || n < 0) {
      std::fprintf(stderr,
                   "ingest_bench: --analysis_threads takes counts >= 0 (0: one per core)\n");
      return 2;
    }
    thread_counts.push_back(static_cast<size_t>(n));
  }
  struct CollectorRun {
    size_t threads;
    double rate, server_cores, server_us, p50_ms, p99_ms, share_50ms, others;
    bool stored_ok;
  };
  std::vector<CollectorRun> collector_runs;
  for (const size_t analysis_threads : thread_counts) {
    if (only.empty() || only == "collector") {
      coll = Phase{};
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
      o.pipeline.analysis_threads = analysis_threads;
      const absl::Duration retention = absl::GetFlag(FLAGS_retention_rank_steps);
      if (retention > absl::ZeroDuration()) {
        rankscope::collector::RetentionOptions r;
        r.rank_steps = retention;
        r.steps = absl::ZeroDuration();
        r.check_interval = absl::Milliseconds(100);
        o.pipeline.writer.retention = r;
      }
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
        pthread_setname_np(pthread_self(), "bench-scraper");
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
      Histogram latency0, commits0, prunes0, prunes;
      run(c.grpc_target(), "bench-collector", &coll, [&](bool start) {
        Histogram h = ReadHistogram(*registry, "rankscope_ingest_latency_seconds");
        Histogram k = ReadHistogram(*registry, "rankscope_store_commit_seconds");
        Histogram p = ReadHistogram(*registry, "rankscope_store_prune_seconds");
        if (start) {
          latency0 = h;
          commits0 = k;
          prunes0 = p;
        } else {
          latency = Delta(h, latency0);
          commits = Delta(k, commits0);
          prunes = Delta(p, prunes0);
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
      // Rows the retention pruned (after Shutdown: no pass runs any more) count as stored.
      const int64_t pruned = static_cast<int64_t>(LabeledCounterValue(
          *registry, "rankscope_store_pruned_rows_total", "table", "rank_steps"));
      rankscope::collector::StoreOptions ro;
      ro.read_only = true;
      auto store = rankscope::collector::SqliteStore::Open(db_path, ro);
      if (store.ok()) {
        // Every group's rows (stored under its group key).
        auto jobs = (*store)->ListJobs();
        if (jobs.ok()) {
          stored = pruned;
          for (const rankscope::collector::JobRow& j : *jobs) {
            auto n = (*store)->CountRankRows(j.job);
            if (n.ok()) stored += *n;
          }
        }
      }
      stored_ok = flushed && shut.ok() && stored == static_cast<int64_t>(coll.load.acked);
      std::printf("collector, analysis_threads=%zu%s:\n", analysis_threads,
                  analysis_threads == 0 ? " (one per core)" : "");
      PrintPhase("collector", coll, inprocess);
      std::printf(
          "          stored in SQLite: %lld rows %s %llu acked; late=%.0f duplicate=%.0f "
          "evicted=%.0f store_errors=%.0f; /metrics scraped %llu times (%.0f KiB each)%s\n",
          static_cast<long long>(stored),
          stored == static_cast<int64_t>(coll.load.acked) ? "==" : "!=",
          static_cast<unsigned long long>(coll.load.acked), late, dup, evicted, store_errors,
          static_cast<unsigned long long>(scrapes.load()),
          scrapes.load() > 0 ? scrape_bytes.load() / 1024.0 / scrapes.load() : 0.0,
          stored_ok ? "" : "  STORE CHECK FAILED");
      std::printf(
          "          SQLite commits in the window: %llu (%.1f/s, %.0f reports each, %.1f ms "
          "mean)\n",
          static_cast<unsigned long long>(commits.count),
          commits.count / std::max(1e-9, coll.load.window_seconds),
          commits.count > 0 ? static_cast<double>(coll.load.window_acked) / commits.count : 0.0,
          commits.count > 0 ? commits.sum / commits.count * 1e3 : 0.0);
      std::printf(
          "          SQLite commit p50=%.1f ms p99=%.1f ms; retention %s: %llu pruning "
          "transactions in the window (p99 %.1f ms), %lld rank rows pruned in all\n",
          Quantile(commits, 0.5) * 1e3, Quantile(commits, 0.99) * 1e3,
          retention > absl::ZeroDuration() ? absl::FormatDuration(retention).c_str() : "off",
          static_cast<unsigned long long>(prunes.count), Quantile(prunes, 0.99) * 1e3,
          static_cast<long long>(pruned));
      std::printf(
          "          ingest latency (last report of a step -> its metrics updated), %llu steps: "
          "p50=%.1f ms p99=%.1f ms mean=%.1f ms, <= 50 ms: %.2f%%\n",
          static_cast<unsigned long long>(latency.count), Quantile(latency, 0.5) * 1e3,
          Quantile(latency, 0.99) * 1e3,
          latency.count > 0 ? latency.sum / latency.count * 1e3 : 0.0,
          100.0 * FractionAtMost(latency, 0.05));
      std::fflush(stdout);
      std::remove((db_path + "-wal").c_str());
      std::remove((db_path + "-shm").c_str());
      std::remove(db_path.c_str());
      rmdir(tmpl.c_str());
      const double w = std::max(1e-9, coll.load.window_seconds);
      const double n = static_cast<double>(std::max<uint64_t>(coll.load.window_acked, 1));
      collector_runs.push_back(CollectorRun{
          .threads = analysis_threads,
          .rate = coll.load.rate(),
          .server_cores = coll.server.seconds / w,
          .server_us = 1e6 * coll.server.seconds / n,
          .p50_ms = Quantile(latency, 0.5) * 1e3,
          .p99_ms = Quantile(latency, 0.99) * 1e3,
          .share_50ms = 100.0 * FractionAtMost(latency, 0.05),
          .others =
              std::max(0.0, coll.machine_busy - coll.server.seconds - coll.load.cpu.seconds) / w,
          .stored_ok = stored_ok && coll.load.valid(),
      });
    }
  }
  if (collector_runs.size() > 1) {
    std::printf(
        "side by side (groups=%d):\n  analysis_threads | reports/s | server cores | server "
        "us/report"
        " | ingest p50 / p99 ms (<= 50 ms) | other processes (cores) | stored == acked\n",
        absl::GetFlag(FLAGS_groups));
    for (const CollectorRun& r : collector_runs) {
      std::printf("  %16zu | %9.0f | %12.2f | %16.1f | %8.1f / %6.1f (%.1f%%) | %23.2f | %s\n",
                  r.threads, r.rate, r.server_cores, r.server_us, r.p50_ms, r.p99_ms, r.share_50ms,
                  r.others, r.stored_ok ? "yes" : "NO");
    }
  }

  bool pass = true;
  for (const CollectorRun& r : collector_runs) pass &= r.stored_ok;  // every side-by-side run
  std::printf("targets:\n");
  if (coll.ran) {
    const bool rate_ok = coll.load.rate() >= 50'000;
    const bool lat_ok = FractionAtMost(latency, 0.05) >= 0.99;
    std::printf("  collector >= 50,000 reports/s       : %9.0f    %s\n", coll.load.rate(),
                rate_ok ? "PASS" : "MISS");
    std::printf("  p99 ingest latency < 50 ms          : %9.1f ms %s\n",
                Quantile(latency, 0.99) * 1e3, lat_ok ? "PASS" : "MISS");
    std::printf("  everything stored (rows == acked)   : %9s    %s\n", "",
                stored_ok && coll.load.valid() ? "PASS" : "FAIL");
    pass &= rate_ok && lat_ok && stored_ok && coll.load.valid();
  }
  if (bare.ran && coll.ran) {
    const double ratio = bare.load.rate() > 0 ? coll.load.rate() / bare.load.rate() : 0;
    std::printf("  collector / bare sink >= 0.50       : %9.2f    %s\n", ratio,
                ratio >= 0.5 ? "PASS" : "MISS");
    const double b = TotalCpuPerReport(bare), k = TotalCpuPerReport(coll);
    std::printf("  CPU per report, server + agents     : bare %.1f us, collector %.1f us (x%.2f)\n",
                1e6 * b, 1e6 * k, b > 0 ? k / b : 0.0);
    if (!inprocess && bare.load.window_acked > 0 && coll.load.window_acked > 0) {
      const double bs = bare.server.seconds / bare.load.window_acked;
      const double ks = coll.server.seconds / coll.load.window_acked;
      std::printf(
          "  CPU per report, server only         : bare %.1f us, collector %.1f us (x%.2f)\n",
          1e6 * bs, 1e6 * ks, bs > 0 ? ks / bs : 0.0);
    }
    pass &= ratio >= 0.5 && bare.load.valid();
  }
  std::printf("loadavg at end: %s\n", LoadAvg().c_str());
  std::fflush(stdout);
  std::_Exit(pass ? 0 : 1);
}
