// rankscope-loadgen: simulated ranks of one training job, each a real rankscope::Agent, sending
// reports with controllable dispersion to a collector. For tests, benchmarks and the demo.
//
// Model of a step t (all ranks share the step's "true" gradient direction c_t):
//   sketch_r = sqrt(cosine) * c_t + sqrt(1 - cosine) * n_{r,t}   (pairwise cosine ~= --cosine)
//   loss_r   = 2 + exp(-t / 200) + loss_std * z                 (z ~ N(0, 1))
//   norm_r   = (1 + 0.5 exp(-t / 100)) * (1 + grad_norm_cv * z')
// The outlier rank (from --outlier_from_step) has loss + outlier_loss_shift, norm *
// outlier_norm_scale and a sketch of pure noise (consensus cosine ~= 0). The silent rank stops
// reporting at --silent_from_step. Vectors come from a precomputed pool so generation is cheap.
// Every rank sends the same replica fingerprints (a hash of the step), except the divergent rank
// from --divergent_from_step; step times are --step_time with 5% noise, the straggler's
// multiplied by --straggler_factor; the reduced gradient's norm follows the sketch model:
// base_norm * sqrt(cosine + (1 - cosine) / W).
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/flag_help.h"
#include "common/mutex.h"
#include "rankscope/agent.h"

ABSL_FLAG(std::string, collector, "127.0.0.1:50051",
          "Collector gRPC address, or a fleet's list (a:50051,b:50051): each job's agents pick "
          "its shard (rankscope/agent.h).");
ABSL_FLAG(std::string, job, "loadgen", "Training job name.");
ABSL_FLAG(int, jobs, 1,
          "Jobs to simulate; with more than one they are named JOB-0, JOB-1, ... "
          "and the fault flags apply to each.");
ABSL_FLAG(int, ranks, 8, "Simulated ranks (world size).");
ABSL_FLAG(int, groups, 1,
          "Data-parallel groups the --ranks form (must divide it): global rank r is rank "
          "r % (ranks/groups) of group g<r / (ranks/groups)>, as a job with tensor or pipeline "
          "parallelism lays them out; 1: the job's only group. Fault flags name global ranks.");
ABSL_FLAG(int, rank, -1,
          "Simulate only this rank of the --ranks (one process per rank, as a real job runs), "
          "or with --rank_count the ranks from this one on; -1: every rank.");
ABSL_FLAG(int, rank_count, 1,
          "With --rank: simulate this many consecutive ranks from --rank on (several loadgen "
          "processes share one large job: --rank=0 --rank_count=4096, --rank=4096 ...).");
ABSL_FLAG(int, steps, 100, "Steps per rank (ignored when --duration is set).");
ABSL_FLAG(absl::Duration, duration, absl::ZeroDuration(), "Run for this long instead of --steps.");
ABSL_FLAG(int, start_step, 1, "First step number.");
ABSL_FLAG(absl::Duration, step_interval, absl::Milliseconds(20),
          "Time between steps; 0 = as "
          "fast as the collector acknowledges (see --max_inflight).");
ABSL_FLAG(int, sketch_dim, 1024, "Sketch dimension k.");
ABSL_FLAG(uint64_t, sketch_seed, rankscope::kDefaultSketchSeed, "Sketch seed.");
ABSL_FLAG(double, loss_std, 0.01, "Std of per-rank loss around the step's loss.");
ABSL_FLAG(double, grad_norm_cv, 0.02, "Coefficient of variation of per-rank gradient norms.");
ABSL_FLAG(double, cosine, 0.95, "Target pairwise cosine of the ranks' gradients (0..1).");
ABSL_FLAG(int, outlier_rank, -1, "Rank that deviates (-1: none).");
ABSL_FLAG(int, outlier_from_step, 0, "Step from which the outlier rank deviates.");
ABSL_FLAG(double, outlier_loss_shift, 1.0, "Added to the outlier rank's loss.");
ABSL_FLAG(double, outlier_norm_scale, 3.0, "Multiplies the outlier rank's gradient norm.");
ABSL_FLAG(int, silent_rank, -1, "Rank that stops reporting (-1: none).");
ABSL_FLAG(bool, silent_in_every_group, false,
          "--silent_rank names a rank within each group (rank r % (ranks/groups)): every group "
          "has one silent rank, so every group's steps stay open until --step_timeout (the "
          "collector's memory per open step, bench/stream_load.py --silent-rank).");
ABSL_FLAG(int, silent_from_step, 0, "Step from which the silent rank stops reporting.");
ABSL_FLAG(int, attempt, 0, "Job attempt (restart count).");
ABSL_FLAG(bool, fingerprints, true,
          "Send replica fingerprints: of the reduced gradient every "
          "step and of the parameters every --param_check_every steps.");
ABSL_FLAG(int, param_check_every, 50, "Steps between parameter fingerprints.");
ABSL_FLAG(int, divergent_rank, -1, "Rank whose replica fingerprints differ (-1: none).");
ABSL_FLAG(int, divergent_from_step, 0, "Step from which the divergent rank's fingerprints differ.");
ABSL_FLAG(double, step_time, 0.1, "Simulated compute time per step, in seconds (0: not sent).");
ABSL_FLAG(int, straggler_rank, -1, "Rank whose step time is --straggler_factor times longer.");
ABSL_FLAG(double, straggler_factor, 3.0, "Slowdown of the straggler rank.");
ABSL_FLAG(int, local_batch_size, 8, "Samples per rank per step (for the gradient noise scale).");
ABSL_FLAG(int, threads, 0, "Driver threads (0: min(ranks, 4)).");
ABSL_FLAG(int, max_inflight, 256,
          "Per rank: wait while more reports than this are unacked "
          "(keeps a fast run from overflowing the agent's ring); 0: never wait (Record() as "
          "fast as the driver goes, whatever the collector does).");
ABSL_FLAG(int, queue_capacity, 1024, "Agent ring capacity.");
ABSL_FLAG(absl::Duration, max_backoff, absl::Seconds(10),
          "Agents' longest reconnect backoff (AgentOptions::max_backoff).");
ABSL_FLAG(absl::Duration, flush_timeout, absl::Seconds(60),
          "How long to wait for acks at the end.");
ABSL_FLAG(uint64_t, seed, 42, "Random seed of the simulated data.");
ABSL_FLAG(bool, progress, false, "Print a progress line every second.");
ABSL_FLAG(absl::Duration, progress_interval, absl::Seconds(1), "Time between progress lines.");
ABSL_FLAG(
    std::string, summary_json, "",
    "If set, write a JSON summary here at the end: per agent (job, rank, collector) and in total, "
    "the reports recorded, sent, acked, dropped and rejected, and whether all were acked.");
ABSL_FLAG(std::string, dump_reports, "",
          "Connect nothing: write every report the flags describe to this file instead (no "
          "pacing), for bench/relay_sim.py. Same --seed, --threads and shape: the same reports "
          "a run against a collector sends. Format: per report, little-endian uint32 global "
          "rank, uint64 step, float64 loss, float64 grad_norm, uint32 k, then k float32.");
ABSL_FLAG(std::string, auth_token_file, "", "File holding the collector's shared token.");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA of the collector's certificate: connect over TLS.");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate (mutual TLS).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_target_name, "",
          "Name to verify in the collector's certificate instead of the host of --collector.");
ABSL_FLAG(bool, wait_connected, false,
          "Before the first step, wait (up to --flush_timeout) until every agent's stream is "
          "open, and print 'loadgen: all N agents connected' (load tests: every stream is up "
          "before reports flow).");
ABSL_FLAG(bool, go_on_stdin, false,
          "Wait for a line on stdin before the first step (after --wait_connected) and another "
          "before closing the streams (after --hold): several loadgen processes of one large "
          "job start reporting together and keep every stream open until all are done "
          "(bench/stream_load.py --loadgen-procs).");
ABSL_FLAG(absl::Duration, hold, absl::ZeroDuration(),
          "After the last step is acked, keep every stream open this long before closing "
          "(load tests: measure the collector with all streams open and idle).");

namespace {

constexpr int kPoolSize = 64;

// Each agent holds its own TCP connection (one file descriptor, plus the collector's when it
// runs on the same machine): thousands of agents in one process need more than the usual soft
// limit of 1,024. Raises the soft limit to the hard limit; returns the soft limit now in force.
rlim_t RaiseFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return raised.rlim_cur;
  }
  return lim.rlim_cur;
}

// The simulated ranks, as the flags describe them. Agent i is rank RankOf(i) of job
// i / local_ranks.
struct Plan {
  int ranks = 0;        // world size of the whole job (--ranks)
  int dim = 0;          // --sketch_dim
  int jobs = 0;         // --jobs
  int groups = 0;       // --groups
  int group_size = 0;   // ranks / groups: each agent's world size
  double cosine = 0;    // --cosine, clamped to [0, 1]
  int only_rank = -1;   // --rank: simulate from this rank on only (-1: every rank)
  int local_ranks = 0;  // ranks simulated per job: --rank_count with --rank, else --ranks
  int total_agents = 0;
  int RankOf(int agent) const {
    return only_rank >= 0 ? only_rank + agent % local_ranks : agent % ranks;
  }
};

// The plan from the flags, or nullopt after saying why (exit status 2).
std::optional<Plan> PlanFromFlags() {
  Plan plan;
  plan.ranks = absl::GetFlag(FLAGS_ranks);
  plan.dim = absl::GetFlag(FLAGS_sketch_dim);
  plan.jobs = absl::GetFlag(FLAGS_jobs);
  if (plan.ranks < 1 || plan.dim < 1 || plan.jobs < 1) {
    std::fprintf(stderr, "loadgen: --ranks, --jobs and --sketch_dim must be >= 1\n");
    return std::nullopt;
  }
  plan.groups = absl::GetFlag(FLAGS_groups);
  if (plan.groups < 1 || plan.ranks % plan.groups != 0) {
    std::fprintf(stderr, "loadgen: --groups %d must be >= 1 and divide --ranks %d\n", plan.groups,
                 plan.ranks);
    return std::nullopt;
  }
  plan.group_size = plan.ranks / plan.groups;
  plan.cosine = std::clamp(absl::GetFlag(FLAGS_cosine), 0.0, 1.0);
  plan.only_rank = absl::GetFlag(FLAGS_rank);
  if (plan.only_rank >= plan.ranks) {
    std::fprintf(stderr, "loadgen: --rank %d >= --ranks %d\n", plan.only_rank, plan.ranks);
    return std::nullopt;
  }
  const int rank_count = absl::GetFlag(FLAGS_rank_count);
  if (plan.only_rank >= 0 && (rank_count < 1 || plan.only_rank + rank_count > plan.ranks)) {
    std::fprintf(stderr, "loadgen: --rank %d --rank_count %d must name ranks below --ranks %d\n",
                 plan.only_rank, rank_count, plan.ranks);
    return std::nullopt;
  }
  plan.local_ranks = plan.only_rank >= 0 ? rank_count : plan.ranks;
  plan.total_agents = plan.local_ranks * plan.jobs;
  return plan;
}

// The token of --auth_token_file ("" without one), or nullopt after saying why it cannot be read.
std::optional<std::string> ReadAuthToken() {
  const std::string path = absl::GetFlag(FLAGS_auth_token_file);
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "loadgen: cannot read --auth_token_file %s\n", path.c_str());
    return std::nullopt;
  }
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return std::string(absl::StripAsciiWhitespace(text));
}

// One agent per simulated rank of each job.
absl::StatusOr<std::vector<std::unique_ptr<rankscope::Agent>>> CreateAgents(
    const Plan& plan, const std::string& auth_token) {
  std::vector<std::unique_ptr<rankscope::Agent>> agents;
  for (int i = 0; i < plan.total_agents; ++i) {
    const int r = plan.RankOf(i);
    rankscope::AgentOptions o;
    o.collector_address = absl::GetFlag(FLAGS_collector);
    o.job = plan.jobs == 1 ? absl::GetFlag(FLAGS_job)
                           : absl::StrCat(absl::GetFlag(FLAGS_job), "-", i / plan.local_ranks);
    o.rank = r % plan.group_size;
    o.world_size = plan.group_size;
    if (plan.groups > 1) {
      o.group = absl::StrCat("g", r / plan.group_size);
      o.global_rank = r;
    }
    o.sketch_dim = plan.dim;
    o.sketch_seed = absl::GetFlag(FLAGS_sketch_seed);
    o.attempt = absl::GetFlag(FLAGS_attempt);
    o.framework_version = "rankscope-loadgen";
    o.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
    o.max_backoff = absl::GetFlag(FLAGS_max_backoff);
    o.initial_backoff = std::min(o.initial_backoff, o.max_backoff);
    o.auth_token = auth_token;
    o.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
    o.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
    o.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
    o.tls.target_name = absl::GetFlag(FLAGS_tls_target_name);
    auto agent = rankscope::Agent::Create(o);
    if (!agent.ok()) return agent.status();
    agents.push_back(std::move(*agent));
  }
  return agents;
}

// Waits up to --flush_timeout for every agent's stream. Returns false, after closing the agents
// and saying how many connected, when not all did.
bool WaitConnected(std::vector<std::unique_ptr<rankscope::Agent>>& agents) {
  const absl::Time deadline = absl::Now() + absl::GetFlag(FLAGS_flush_timeout);
  size_t connected = 0;
  while (true) {
    connected = 0;
    for (auto& a : agents) connected += a->stats().connected ? 1 : 0;
    if (connected == agents.size() || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  if (connected < agents.size()) {
    std::string why = agents.empty() ? "" : agents.front()->stats().last_error;
    std::fprintf(stderr, "loadgen: only %zu of %zu agents connected within --flush_timeout (%s)\n",
                 connected, agents.size(), why.c_str());
    for (auto& a : agents) a->Close(absl::ZeroDuration()).IgnoreError();
    return false;
  }
  std::printf("loadgen: all %zu agents connected\n", agents.size());
  std::fflush(stdout);
  return true;
}

// Records the simulated steps (the model at the top of this file) into the agents, on `threads`
// driver threads, each driving every threads-th agent. Thread-safe: Drive runs on each driver
// thread, max_step_done and record_errors may be read from any.
class Driver {
 public:
  // With a `dump` file (--dump_reports) the reports go there instead of into `agents`, which is
  // then empty, and steps are not paced.
  Driver(const Plan& plan, std::vector<std::unique_ptr<rankscope::Agent>>& agents, int threads,
         std::FILE* dump = nullptr)
      : plan_(plan), agents_(agents), threads_(threads), dump_(dump) {
    std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    pool_.assign(kPoolSize, std::vector<float>(plan.dim));
    for (auto& v : pool_) {
      for (float& x : v) x = normal(rng);
    }
  }

  // Starts the clock: step i is due at start + i * --step_interval.
  void Start() {
    start_ = absl::Now();
    const absl::Duration duration = absl::GetFlag(FLAGS_duration);
    end_ = duration > absl::ZeroDuration() ? start_ + duration : absl::InfiniteFuture();
  }

  // Driver thread `tid`: every step, for agents tid, tid + threads, ...
  void Drive(int tid) {
    ThreadRandom random{std::mt19937_64(absl::GetFlag(FLAGS_seed) * 7919 + tid)};
    const absl::Duration interval = absl::GetFlag(FLAGS_step_interval);
    const absl::Duration duration = absl::GetFlag(FLAGS_duration);
    const int steps = absl::GetFlag(FLAGS_steps);
    const int start_step = absl::GetFlag(FLAGS_start_step);
    const int max_inflight = absl::GetFlag(FLAGS_max_inflight);
    std::vector<float> sketch(plan_.dim);
    for (int i = 0;; ++i) {
      const int64_t step = start_step + i;
      if (duration > absl::ZeroDuration() ? absl::Now() >= end_ : i >= steps) break;
      const absl::Time tick = start_ + interval * i;
      if (interval > absl::ZeroDuration() && dump_ == nullptr) absl::SleepFor(tick - absl::Now());
      for (int i = tid; i < plan_.total_agents; i += threads_) {
        const int r = plan_.RankOf(i);
        const int silent_as = absl::GetFlag(FLAGS_silent_in_every_group) ? r % plan_.group_size : r;
        if (silent_as == absl::GetFlag(FLAGS_silent_rank) &&
            step >= absl::GetFlag(FLAGS_silent_from_step)) {
          continue;
        }
        if (dump_ != nullptr) {
          Dump(r, Report(step, r, random, sketch));
          continue;
        }
        rankscope::Agent& agent = *agents_[i];
        while (max_inflight > 0 && interval == absl::ZeroDuration() &&
               agent.stats().unacked + agent.stats().queued >= static_cast<size_t>(max_inflight)) {
          absl::SleepFor(absl::Microseconds(200));  // flow control for as-fast-as-possible runs
        }
        if (!agent.Record(Report(step, r, random, sketch)).ok()) ++record_errors_;
      }
      if (tid == 0) max_step_done_ = step;
    }
  }

  absl::Time start() const { return start_; }
  int64_t max_step_done() const { return max_step_done_.load(); }
  uint64_t record_errors() const { return record_errors_.load(); }

 private:
  // One report to dump_ (the format of --dump_reports), whole under dump_mu_.
  void Dump(int global_rank, const rankscope::StepReport& report) {
    std::string rec;
    auto put = [&rec](const void* p, size_t n) { rec.append(static_cast<const char*>(p), n); };
    const uint32_t rank = static_cast<uint32_t>(global_rank);
    const uint64_t step = report.step;
    const uint32_t k = static_cast<uint32_t>(report.sketch.size());
    put(&rank, sizeof rank);
    put(&step, sizeof step);
    put(&report.loss, sizeof report.loss);
    put(&report.grad_norm, sizeof report.grad_norm);
    put(&k, sizeof k);
    put(report.sketch.data(), k * sizeof(float));
    rankscope::MutexLock lock(&dump_mu_);
    if (std::fwrite(rec.data(), 1, rec.size(), dump_) != rec.size()) ++record_errors_;
  }

  // A driver thread's random numbers (the distributions keep state between draws).
  struct ThreadRandom {
    std::mt19937_64 engine;
    std::normal_distribution<double> z{0.0, 1.0};
    std::uniform_int_distribution<int> pick{0, kPoolSize - 1};
  };

  // Rank r's report of `step`; `sketch` is the driver thread's buffer.
  rankscope::StepReport Report(int64_t step, int r, ThreadRandom& random,
                               std::vector<float>& sketch) const {
    std::mt19937_64& trng = random.engine;
    std::normal_distribution<double>& z = random.z;
    std::uniform_int_distribution<int>& pick = random.pick;
    const int dim = plan_.dim;
    const float a = static_cast<float>(std::sqrt(plan_.cosine));
    const float b = static_cast<float>(std::sqrt(1.0 - plan_.cosine));
    const size_t common_index = static_cast<size_t>(step) % kPoolSize;
    const std::vector<float>& common = pool_[common_index];
    const double base_loss = 2.0 + std::exp(-static_cast<double>(step) / 200.0);
    const double base_norm = 1.0 + 0.5 * std::exp(-static_cast<double>(step) / 100.0);
    const bool outlier =
        r == absl::GetFlag(FLAGS_outlier_rank) && step >= absl::GetFlag(FLAGS_outlier_from_step);
    size_t noise_index = static_cast<size_t>(pick(trng));
    // The outlier's pure noise is never the step's own direction c_t: drawn with no rotation (1
    // in kPoolSize^2 of its reports) it would agree with the consensus at a step it deviates.
    if (outlier && noise_index == common_index) noise_index = (noise_index + 1) % kPoolSize;
    const std::vector<float>& noise = pool_[noise_index];
    // Rotate the noise by a random offset so ranks sharing a pool vector still differ.
    const int shift = pick(trng) * 131 % dim;
    for (int j = 0; j < dim; ++j) {
      const float n = noise[(j + shift) % dim];
      sketch[j] = outlier ? n : a * common[j] + b * n;
    }
    double loss = base_loss + absl::GetFlag(FLAGS_loss_std) * z(trng);
    double norm = base_norm * (1.0 + absl::GetFlag(FLAGS_grad_norm_cv) * z(trng));
    if (outlier) {
      loss += absl::GetFlag(FLAGS_outlier_loss_shift);
      norm *= absl::GetFlag(FLAGS_outlier_norm_scale);
    }
    rankscope::StepReport report;
    report.step = static_cast<uint64_t>(step);
    report.loss = loss;
    report.grad_norm = std::abs(norm);
    report.sketch = sketch;
    report.local_batch_size = static_cast<uint32_t>(absl::GetFlag(FLAGS_local_batch_size));
    report.reduced_grad_norm =
        base_norm * std::sqrt(plan_.cosine + (1.0 - plan_.cosine) / plan_.group_size);
    if (absl::GetFlag(FLAGS_fingerprints)) {
      const bool divergent = r == absl::GetFlag(FLAGS_divergent_rank) &&
                             step >= absl::GetFlag(FLAGS_divergent_from_step);
      const uint64_t fp =
          (static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL) ^ (divergent ? 0x1ULL : 0x0ULL);
      report.reduced_grad_fingerprint = fp;
      const int every = std::max(1, absl::GetFlag(FLAGS_param_check_every));
      if (step % every == 0) report.param_fingerprint = ~fp;
    }
    if (absl::GetFlag(FLAGS_step_time) > 0) {
      double t = absl::GetFlag(FLAGS_step_time) * (1.0 + 0.05 * z(trng));
      if (r == absl::GetFlag(FLAGS_straggler_rank)) t *= absl::GetFlag(FLAGS_straggler_factor);
      report.step_time_seconds = std::max(0.0, t);
    }
    return report;
  }

  const Plan plan_;
  std::vector<std::unique_ptr<rankscope::Agent>>& agents_;
  const int threads_;
  std::vector<std::vector<float>> pool_;  // unit-variance Gaussian vectors
  std::FILE* const dump_;
  rankscope::Mutex dump_mu_;
  absl::Time start_;
  absl::Time end_;
  std::atomic<uint64_t> record_errors_{0};
  std::atomic<int64_t> max_step_done_{0};
};

// Prints a progress line every --progress_interval until `done`.
void PrintProgress(const std::vector<std::unique_ptr<rankscope::Agent>>& agents,
                   const Driver& driver, const std::atomic<bool>& done) {
  while (!done.load()) {
    absl::SleepFor(absl::GetFlag(FLAGS_progress_interval));
    rankscope::AgentStats sum;
    for (auto& a : agents) sum.Add(a->stats());
    std::fprintf(stderr,
                 "loadgen: progress step=%lld recorded=%llu acked=%llu dropped=%llu "
                 "queued=%zu unacked=%zu\n",
                 static_cast<long long>(driver.max_step_done()),
                 static_cast<unsigned long long>(sum.recorded),
                 static_cast<unsigned long long>(sum.acked),
                 static_cast<unsigned long long>(sum.dropped), sum.queued, sum.unacked);
  }
}

// Flushes every agent within --flush_timeout in all; returns whether every report was acked.
bool FlushAll(std::vector<std::unique_ptr<rankscope::Agent>>& agents) {
  const absl::Time flush_deadline = absl::Now() + absl::GetFlag(FLAGS_flush_timeout);
  bool flushed = true;
  for (auto& a : agents) {
    if (!a->Flush(std::max(absl::ZeroDuration(), flush_deadline - absl::Now())).ok()) {
      flushed = false;
    }
  }
  return flushed;
}

std::string JsonStats(const rankscope::AgentStats& s) {
  return absl::StrFormat(
      "\"recorded\": %d, \"sent\": %d, \"acked\": %d, \"dropped\": %d, \"rejected\": %d, "
      "\"invalid\": %d, \"reconnects\": %d",
      s.recorded, s.sent, s.acked, s.dropped, s.rejected, s.invalid, s.reconnects);
}

// The agents' stats summed; with --summary_json, written there with each agent's (atomically:
// a temporary file renamed). Returns false when the file cannot be written.
bool Summarize(const std::vector<std::unique_ptr<rankscope::Agent>>& agents, bool flushed,
               rankscope::AgentStats* total) {
  std::string per_agent;
  for (auto& a : agents) {
    const rankscope::AgentStats s = a->stats();
    total->Add(s);
    absl::StrAppend(
        &per_agent, per_agent.empty() ? "" : ",\n    ",
        absl::StrFormat("{\"job\": \"%s\", \"rank\": %d, \"collector\": \"%s\", %s}",
                        a->options().job, a->options().rank, a->collector(), JsonStats(s)));
  }
  const std::string path = absl::GetFlag(FLAGS_summary_json);
  if (path.empty()) return true;
  std::ofstream out(path + ".tmp");
  out << absl::StrFormat(
      "{\n  \"flushed\": %s,\n  \"total\": {%s},\n  \"agents\": [\n    %s\n  ]\n}\n",
      flushed ? "true" : "false", JsonStats(*total), per_agent);
  out.close();
  if (!out || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "loadgen: cannot write --summary_json %s\n", path.c_str());
    return false;
  }
  return true;
}

}  // namespace

// Long: the load generator read top to bottom (flags into one plan of jobs, groups and faults, the
// agents started, the steps driven, the summary written); the per-step work is in functions of its
// own.
int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "rankscope-loadgen: simulated ranks of one job streaming to a rankscope collector\n"
      "through the real agent library. Prints a final line:\n"
      "  loadgen: job=J ranks=W recorded=N acked=N dropped=N rejected=N elapsed=S rate=R/s");
  rankscope::HandleHelpFlag(argc, argv, "loadgen/loadgen.cc");  // --help: its flags, exits 0
  absl::ParseCommandLine(argc, argv);
  const std::optional<Plan> plan = PlanFromFlags();
  if (!plan) return 2;
  const rlim_t file_limit = RaiseFileLimit();
  if (file_limit != RLIM_INFINITY &&
      static_cast<rlim_t>(plan->ranks) * plan->jobs + 64 > file_limit) {
    std::fprintf(stderr,
                 "loadgen: warning: %d agents need about as many file descriptors; the limit is "
                 "%llu (ulimit -Hn)\n",
                 plan->ranks * plan->jobs, static_cast<unsigned long long>(file_limit));
  }
  if (!absl::GetFlag(FLAGS_dump_reports).empty()) {
    const std::string path = absl::GetFlag(FLAGS_dump_reports);
    std::FILE* out = std::fopen(path.c_str(), "wb");
    if (out == nullptr) {
      std::fprintf(stderr, "loadgen: cannot write --dump_reports %s\n", path.c_str());
      return 2;
    }
    std::vector<std::unique_ptr<rankscope::Agent>> none;
    const int threads = absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads)
                                                         : std::min(plan->total_agents, 4);
    Driver driver(*plan, none, threads, out);
    driver.Start();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) workers.emplace_back([&driver, t] { driver.Drive(t); });
    for (auto& w : workers) w.join();
    const bool ok = std::fclose(out) == 0 && driver.record_errors() == 0;
    std::printf("loadgen: dumped the reports of %d ranks to %s%s\n", plan->total_agents,
                path.c_str(), ok ? "" : " (WRITE FAILED)");
    return ok ? 0 : 1;
  }
  const std::optional<std::string> auth_token = ReadAuthToken();
  if (!auth_token) return 2;
  absl::StatusOr<std::vector<std::unique_ptr<rankscope::Agent>>> created =
      CreateAgents(*plan, *auth_token);
  if (!created.ok()) {
    std::fprintf(stderr, "loadgen: %s\n", created.status().ToString().c_str());
    return 2;
  }
  std::vector<std::unique_ptr<rankscope::Agent>>& agents = *created;
  if (absl::GetFlag(FLAGS_wait_connected) && !WaitConnected(agents)) return 1;
  // --go_on_stdin: a line (or EOF) lets this process go on.
  auto await_go = [] {
    if (!absl::GetFlag(FLAGS_go_on_stdin)) return;
    std::string line;
    std::getline(std::cin, line);
  };
  await_go();

  const int threads = absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads)
                                                       : std::min(plan->total_agents, 4);
  Driver driver(*plan, agents, threads);
  driver.Start();
  std::atomic<bool> done{false};
  std::thread progress;
  if (absl::GetFlag(FLAGS_progress)) {
    progress = std::thread([&] { PrintProgress(agents, driver, done); });
  }
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) workers.emplace_back([&driver, t] { driver.Drive(t); });
  for (auto& w : workers) w.join();
  const absl::Time recorded_at = absl::Now();
  {
    uint64_t recorded = 0;
    for (auto& a : agents) recorded += a->stats().recorded;
    std::fprintf(stderr, "loadgen: recording done recorded=%llu in %.3f s; flushing\n",
                 static_cast<unsigned long long>(recorded),
                 absl::ToDoubleSeconds(recorded_at - driver.start()));
  }

  const bool flushed = FlushAll(agents);
  const absl::Time acked_at = absl::Now();
  if (absl::GetFlag(FLAGS_hold) > absl::ZeroDuration()) {
    size_t connected = 0;
    for (auto& a : agents) connected += a->stats().connected ? 1 : 0;
    std::printf("loadgen: holding %zu connected streams for %s\n", connected,
                absl::FormatDuration(absl::GetFlag(FLAGS_hold)).c_str());
    std::fflush(stdout);
    absl::SleepFor(absl::GetFlag(FLAGS_hold));
  }
  await_go();
  std::string last_error;
  for (auto& a : agents) {
    if (last_error.empty()) last_error = a->stats().last_error;
  }
  // Closing counts what is still unacked as dropped, so the summary is taken after Close.
  for (auto& a : agents) a->Close(absl::ZeroDuration()).IgnoreError();
  done = true;
  if (progress.joinable()) progress.join();
  rankscope::AgentStats total;
  if (!Summarize(agents, flushed, &total)) return 1;
  const double elapsed = absl::ToDoubleSeconds(acked_at - driver.start());
  std::printf(
      "loadgen: job=%s jobs=%d ranks=%d recorded=%llu acked=%llu dropped=%llu rejected=%llu "
      "sent=%llu elapsed=%.3f record_elapsed=%.3f rate=%.0f/s\n",
      absl::GetFlag(FLAGS_job).c_str(), plan->jobs, plan->ranks,
      static_cast<unsigned long long>(total.recorded), static_cast<unsigned long long>(total.acked),
      static_cast<unsigned long long>(total.dropped),
      static_cast<unsigned long long>(total.rejected), static_cast<unsigned long long>(total.sent),
      elapsed, absl::ToDoubleSeconds(recorded_at - driver.start()),
      elapsed > 0 ? static_cast<double>(total.acked) / elapsed : 0.0);
  std::fflush(stdout);
  if (!flushed) {
    std::fprintf(stderr, "loadgen: not every report was acknowledged within --flush_timeout%s%s\n",
                 last_error.empty() ? "" : "; last stream error: ", last_error.c_str());
    return 1;
  }
  return driver.record_errors() == 0 ? 0 : 1;
}
