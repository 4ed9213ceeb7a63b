// Agent::Record() latency and the agent's resident memory, in one run.
//
// Latency: one agent (k = --sketch_dim, default buffers) and one training thread calling Record()
// --records times at --record_hz (a fast training loop), each call timed with the steady clock,
// in two situations measured one after the other:
//   up    a real Collector running in this process (SQLite file in a temp dir), so the agent's
//         sender, gRPC and the collector's threads compete with the training thread on the same
//         cores, as they do on a training node;
//   down  no collector at the address: the agent reconnects with backoff, the ring fills and every
//         Record() overwrites the oldest report (the drop path).
// It prints p50/p99/p99.9/max in ns, and the number of C++ heap allocations made by the training
// thread inside Record() after a warm-up (the contract is zero; operator new is counted per
// thread).
//
// Memory: VmRSS from /proc/self/status, just before Agent::Create and once the buffers are full:
//   down     collector down, ring full (queue_capacity reports);
//   no-acks  a sink that accepts the stream and reads every report but never acks, so the unacked
//            buffer fills to max_unacked and the ring to queue_capacity: the agent's most memory;
//   acked    collector up, steady state after --records reports were acked.
//
// Usage: agent_bench [--records=20000] [--record_hz=2000] [--sketch_dim=1024]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

ABSL_FLAG(int, records, 20000, "Record() calls timed in each situation.");
ABSL_FLAG(int, record_hz, 2000, "Record() calls per second (a training loop's step rate).");
ABSL_FLAG(int, sketch_dim, 1024, "Sketch dimension k.");
ABSL_FLAG(std::string, tmpdir, "", "Directory for the SQLite file (default: $TMPDIR or /tmp).");

// ---- Counting allocations of the training thread --------------------------------------------

namespace {
thread_local bool g_count_allocations = false;
thread_local uint64_t g_allocations = 0;
}  // namespace

void* operator new(std::size_t n) {
  if (g_count_allocations) ++g_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (g_count_allocations) ++g_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

namespace v1 = ::rankscope::v1;
using rankscope::Agent;

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

int64_t VmRssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

rankscope::AgentOptions Options(const std::string& address, const std::string& job) {
  rankscope::AgentOptions o;
  o.collector_address = address;
  o.job = job;
  o.rank = 0;
  o.world_size = 1;
  o.sketch_dim = static_cast<uint32_t>(absl::GetFlag(FLAGS_sketch_dim));
  o.initial_backoff = absl::Milliseconds(100);
  o.max_backoff = absl::Seconds(1);
  return o;  // queue_capacity and max_unacked: the defaults
}

std::vector<float> Sketch() {
  std::vector<float> v(absl::GetFlag(FLAGS_sketch_dim));
  std::mt19937 rng(3);
  std::normal_distribution<float> n;
  for (float& x : v) x = n(rng);
  return v;
}

struct Latency {
  std::vector<int64_t> ns;
  std::vector<int64_t> baseline_ns;  // a plain copy of the same report into a ring-sized buffer
  uint64_t allocations = 0;
  rankscope::AgentStats stats;
};

// Records `records` reports at `hz`, timing each Record(); the first 10% are a warm-up (ring slots
// reach their size) and are neither timed nor counted.
Latency TimeRecords(Agent& agent, int records, int hz) {
  const std::vector<float> sketch = Sketch();
  const int warmup = std::max(records / 10, static_cast<int>(agent.options().queue_capacity) + 8);
  const absl::Duration period = absl::Seconds(1.0 / std::max(1, hz));
  Latency out;
  out.ns.reserve(records);
  out.baseline_ns.reserve(records);
  const size_t slots = agent.options().queue_capacity;
  std::vector<float> baseline_ring(slots * sketch.size());
  rankscope::StepReport rep;
  rep.sketch = sketch;
  absl::Time next = absl::Now();
  for (int i = 0; i < warmup + records; ++i) {
    next += period;
    const absl::Duration wait = next - absl::Now();
    if (wait > absl::ZeroDuration()) absl::SleepFor(wait);
    rep.step = static_cast<uint64_t>(i + 1);
    rep.loss = 2.0 + 1e-3 * (i % 17);
    rep.grad_norm = 1.0;
    const bool timed = i >= warmup;
    g_count_allocations = timed;
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status s = agent.Record(rep);
    const auto t1 = std::chrono::steady_clock::now();
    g_count_allocations = false;
    if (!s.ok()) {
      std::fprintf(stderr, "agent_bench: Record: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    // The baseline, timed the same way right after: what copying the report costs on this
    // machine at this moment, with no lock and no agent.
    const auto b0 = std::chrono::steady_clock::now();
    std::copy(sketch.begin(), sketch.end(),
              baseline_ring.begin() + static_cast<ptrdiff_t>((i % slots) * sketch.size()));
    const auto b1 = std::chrono::steady_clock::now();
    if (timed) {
      out.ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
      out.baseline_ns.push_back(
          std::chrono::duration_cast<std::chrono::nanoseconds>(b1 - b0).count());
    }
  }
  out.allocations = g_allocations;
  g_allocations = 0;
  out.stats = agent.stats();
  return out;
}

int64_t Percentile(std::vector<int64_t> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

void PrintLatency(const char* name, const Latency& l) {
  std::printf(
      "Record() collector %-4s: n=%zu p50=%lld ns p99=%lld ns p99.9=%lld ns max=%lld ns  "
      "heap allocations in Record=%llu  (agent: recorded=%llu acked=%llu dropped=%llu)\n",
      name, l.ns.size(), static_cast<long long>(Percentile(l.ns, 0.5)),
      static_cast<long long>(Percentile(l.ns, 0.99)),
      static_cast<long long>(Percentile(l.ns, 0.999)),
      static_cast<long long>(*std::max_element(l.ns.begin(), l.ns.end())),
      static_cast<unsigned long long>(l.allocations),
      static_cast<unsigned long long>(l.stats.recorded),
      static_cast<unsigned long long>(l.stats.acked),
      static_cast<unsigned long long>(l.stats.dropped));
  std::printf(
      "  baseline (copy %d floats into a ring-sized buffer, interleaved): p50=%lld ns p99=%lld ns "
      "p99.9=%lld ns max=%lld ns\n",
      absl::GetFlag(FLAGS_sketch_dim), static_cast<long long>(Percentile(l.baseline_ns, 0.5)),
      static_cast<long long>(Percentile(l.baseline_ns, 0.99)),
      static_cast<long long>(Percentile(l.baseline_ns, 0.999)),
      static_cast<long long>(*std::max_element(l.baseline_ns.begin(), l.baseline_ns.end())));
  std::fflush(stdout);
}

// A sink that reads every report and never acks.
class NoAckReactor final : public grpc::ServerBidiReactor<v1::AgentMessage, v1::CollectorMessage> {
 public:
  NoAckReactor() { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    StartRead(&in_);
  }
  void OnDone() override { delete this; }

 private:
  v1::AgentMessage in_;
};

class NoAckService final : public v1::Ingest::CallbackService {
  grpc::ServerBidiReactor<v1::AgentMessage, v1::CollectorMessage>* Stream(
      grpc::CallbackServerContext*) override {
    return new NoAckReactor();
  }
};

// Records until the ring and the unacked buffer are full (or 30 s pass), then returns the RSS
// delta in KiB since `rss0`.
int64_t FillAndMeasure(Agent& agent, int64_t rss0, bool expect_unacked_full) {
  const std::vector<float> sketch = Sketch();
  rankscope::StepReport rep;
  rep.sketch = sketch;
  const rankscope::AgentOptions& o = agent.options();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  uint64_t step = 0;
  while (absl::Now() < deadline) {
    for (int i = 0; i < 256; ++i) {
      rep.step = ++step;
      agent.Record(rep).IgnoreError();
    }
    const rankscope::AgentStats s = agent.stats();
    const bool ring_full = s.queued == o.queue_capacity;
    const bool unacked_full = s.unacked >= o.max_unacked;
    if (ring_full && (!expect_unacked_full || unacked_full)) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  const rankscope::AgentStats s = agent.stats();
  std::printf("  buffers: ring %zu/%zu, unacked %zu/%zu, recorded %llu, dropped %llu\n", s.queued,
              o.queue_capacity, s.unacked, o.max_unacked,
              static_cast<unsigned long long>(s.recorded),
              static_cast<unsigned long long>(s.dropped));
  return VmRssKiB() - rss0;
}

}  // namespace

// Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
// runs, the table it prints; the measured pieces are functions of their own.
int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int records = absl::GetFlag(FLAGS_records);
  const int hz = absl::GetFlag(FLAGS_record_hz);
  std::string dir = absl::GetFlag(FLAGS_tmpdir);
  if (dir.empty()) dir = getenv("TMPDIR") != nullptr ? getenv("TMPDIR") : "/tmp";
  std::string tmpl = dir + "/agent_bench-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return 2;
  std::printf(
      "agent_bench: sketch_dim=%d records=%d at %d Hz, default buffers "
      "(queue_capacity=%zu, max_unacked=%zu), nproc=%ld\n",
      absl::GetFlag(FLAGS_sketch_dim), records, hz, rankscope::AgentOptions().queue_capacity,
      rankscope::AgentOptions().max_unacked, sysconf(_SC_NPROCESSORS_ONLN));

  // gRPC's global state first (a throwaway agent), so that the RSS deltas below are the agents'
  // own. The "down" address is a port that was free a moment ago.
  const int spare_port = FreePort();
  {
    rankscope::AgentOptions o = Options(absl::StrCat("127.0.0.1:", spare_port), "bench-warm");
    o.queue_capacity = 1;  // so that its freed ring does not serve the next agent's
    auto warm = Agent::Create(o);
    if (warm.ok()) (*warm)->Close(absl::ZeroDuration()).IgnoreError();
  }

  // 1. Collector down: latency of the drop path, then the memory with the ring full.
  {
    const std::string address = absl::StrCat("127.0.0.1:", spare_port);  // nobody listens now
    const int64_t rss0 = VmRssKiB();
    auto agent = Agent::Create(Options(address, "bench-down"));
    if (!agent.ok()) return 2;
    const Latency l = TimeRecords(**agent, records, hz);
    PrintLatency("down", l);
    std::printf("RSS, collector down, ring full:\n");
    const int64_t kib = FillAndMeasure(**agent, rss0, /*expect_unacked_full=*/false);
    std::printf("  agent RSS delta: %.1f MiB\n", kib / 1024.0);
    (*agent)->Close(absl::ZeroDuration()).IgnoreError();
  }

  // 2. Collector up, in this process.
  {
    rankscope::collector::CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "127.0.0.1:0";
    o.db_path = tmpl + "/agent_bench.db";
    auto collector = rankscope::collector::Collector::Start(o);
    if (!collector.ok()) {
      std::fprintf(stderr, "agent_bench: %s\n", collector.status().ToString().c_str());
      return 2;
    }
    const int64_t rss0 = VmRssKiB();
    auto agent = Agent::Create(Options((*collector)->grpc_target(), "bench-up"));
    if (!agent.ok()) return 2;
    const Latency l = TimeRecords(**agent, records, hz);
    const absl::Status flushed = (*agent)->Flush(absl::Seconds(30));
    PrintLatency("up", l);
    std::printf("RSS, collector up, steady state after %llu reports acked (%s): %.1f MiB\n",
                static_cast<unsigned long long>((*agent)->stats().acked),
                flushed.ok() ? "all acked" : "NOT all acked", (VmRssKiB() - rss0) / 1024.0);
    (*agent)->Close(absl::Seconds(5)).IgnoreError();
    (*collector)->Shutdown(absl::Seconds(5)).IgnoreError();
  }

  // 3. A sink that never acks: the most memory an agent holds.
  {
    NoAckService service;
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.SetMaxReceiveMessageSize(8 << 20);
    b.RegisterService(&service);
    auto server = b.BuildAndStart();
    const int64_t rss0 = VmRssKiB();
    auto agent = Agent::Create(Options(absl::StrCat("127.0.0.1:", port), "bench-noack"));
    if (!agent.ok()) return 2;
    std::printf("RSS, collector accepting but never acking, ring and unacked buffer full:\n");
    const int64_t kib = FillAndMeasure(**agent, rss0, /*expect_unacked_full=*/true);
    std::printf("  agent RSS delta: %.1f MiB (%.1f KiB per buffered report)\n", kib / 1024.0,
                static_cast<double>(kib) / static_cast<double>((*agent)->options().queue_capacity +
                                                               (*agent)->options().max_unacked));
    (*agent)->Close(absl::ZeroDuration()).IgnoreError();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  std::remove((tmpl + "/agent_bench.db").c_str());
  std::remove((tmpl + "/agent_bench.db-wal").c_str());
  std::remove((tmpl + "/agent_bench.db-shm").c_str());
  rmdir(tmpl.c_str());
  std::fflush(stdout);
  std::_Exit(0);
}
