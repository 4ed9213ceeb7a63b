#include "collector/pipeline.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "collector/rank_diagnostics.h"
#include "collector/step_stats.h"

namespace rankscope::collector {
namespace {

// Sketch buffers handed back by the step thread once it is done with a step's reports, reused by
// OnReport for the next reports' sketches. Without it every report costs a malloc of k floats on
// a gRPC thread and its free on the step thread (4 KiB at k = 1024: glibc serves such chunks from
// its shared bins, under the arena lock, not from the per-thread cache). Bounded by kMaxBytes of
// capacity; thread-safe.
class SketchBufferPool {
 public:
  static SketchBufferPool& Get() {
    static SketchBufferPool* const pool = new SketchBufferPool();
    return *pool;
  }

  // A buffer with no particular size or contents (empty, capacity 0, when the pool is empty).
  std::vector<float> Take() {
    MutexLock lock(&mu_);
    if (free_.empty()) return {};
    std::vector<float> v = std::move(free_.back());
    free_.pop_back();
    bytes_ -= v.capacity() * sizeof(float);
    return v;
  }

  // Takes back the buffers of `reports` (their sketches are left empty).
  void Give(std::vector<RankReport>& reports) {
    MutexLock lock(&mu_);
    for (RankReport& r : reports) GiveLocked(r.sketch);
  }
  void Give(std::vector<float>& sketch) {
    if (sketch.capacity() == 0) return;  // e.g. moved into the joiner: nothing to lock for
    MutexLock lock(&mu_);
    GiveLocked(sketch);
  }

 private:
  static constexpr size_t kMaxBytes = 32 << 20;

  void GiveLocked(std::vector<float>& sketch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t bytes = sketch.capacity() * sizeof(float);
    if (bytes == 0 || bytes_ + bytes > kMaxBytes) return;
    bytes_ += bytes;
    free_.push_back(std::move(sketch));
    sketch = std::vector<float>();
  }

  Mutex mu_;
  std::vector<std::vector<float>> free_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

RankReport ToRankReport(const v1::StepReport& r, uint32_t rank, uint32_t attempt,
                        absl::Time received_at, AckHandle ack) {
  RankReport out;
  out.rank = rank;
  out.step = r.step();
  out.attempt = attempt;
  out.loss = r.loss();
  out.grad_norm = r.grad_norm();
  out.sketch = SketchBufferPool::Get().Take();
  // One memcpy: assign() from RepeatedField iterators compiles to a 16-byte loop (4% of the
  // server's CPU in the ingest bench). A pooled buffer already has this size, so resize() does
  // not write it twice.
  out.sketch.resize(static_cast<size_t>(r.sketch_size()));
  if (r.sketch_size() > 0) {
    std::memcpy(out.sketch.data(), r.sketch().data(), out.sketch.size() * sizeof(float));
  }
  out.received_at = received_at;
  if (r.has_reduced_grad_fingerprint()) out.reduced_grad_fingerprint = r.reduced_grad_fingerprint();
  if (r.has_param_fingerprint()) out.param_fingerprint = r.param_fingerprint();
  if (r.has_reduced_grad_norm()) out.reduced_grad_norm = r.reduced_grad_norm();
  if (r.has_step_time_seconds()) out.step_time_seconds = r.step_time_seconds();
  out.local_batch_size = r.local_batch_size();
  out.acks.push_back(std::move(ack));
  return out;
}

RankRow ToRankRow(const RankReport& r, uint32_t join_size) {
  RankRow row;
  row.rank = r.rank;
  row.attempt = r.attempt;
  row.join_size = join_size;
  row.loss = r.loss;
  row.grad_norm = r.grad_norm;
  row.reduced_grad_fingerprint = r.reduced_grad_fingerprint;
  row.param_fingerprint = r.param_fingerprint;
  row.step_time_seconds = r.step_time_seconds;
  row.received_at = r.received_at;
  return row;
}

// Everything rank_diagnostics.h derives from one joined step.
struct StepDiagnostics {
  std::vector<OutlierScore> outliers;           // per report
  std::vector<RankExtras> extras;               // per report
  std::vector<std::optional<bool>> replica_ok;  // per report
  bool replica_checked = false;
  std::vector<uint32_t> replica_divergent;  // sorted
  std::vector<uint32_t> flagged_ranks;      // score above threshold this step, sorted
  double grad_noise_scale = std::nan("");
};

StepDiagnostics Diagnose(const JoinedStep& js, const StepStatistics& stats) {
  StepDiagnostics d;
  const size_t n = js.reports.size();
  std::vector<RankSignals> signals;
  std::vector<RankFingerprint> grads, params;
  std::vector<double> local_norms, reduced_norms, times;
  signals.reserve(n);
  local_norms.reserve(n);
  times.reserve(n);
  d.replica_ok.reserve(n);
  d.extras.reserve(n);
  uint32_t batch = 0;
  bool any_time = false;
  for (size_t i = 0; i < n; ++i) {
    const RankReport& r = js.reports[i];
    signals.push_back({r.rank, r.loss, r.grad_norm, stats.per_rank[i].consensus_cosine});
    if (r.reduced_grad_fingerprint) grads.push_back({r.rank, *r.reduced_grad_fingerprint});
    if (r.param_fingerprint) params.push_back({r.rank, *r.param_fingerprint});
    local_norms.push_back(r.grad_norm);
    if (r.reduced_grad_norm) reduced_norms.push_back(*r.reduced_grad_norm);
    times.push_back(r.step_time_seconds.value_or(std::nan("")));
    any_time = any_time || r.step_time_seconds.has_value();
    batch = std::max(batch, r.local_batch_size);
  }
  d.outliers = ComputeOutlierScores(signals);
  const ReplicaVerdict grad_verdict = CheckReplicas(grads);
  const ReplicaVerdict param_verdict = CheckReplicas(params);
  d.replica_checked = grad_verdict.checked || param_verdict.checked;
  std::set_union(grad_verdict.divergent_ranks.begin(), grad_verdict.divergent_ranks.end(),
                 param_verdict.divergent_ranks.begin(), param_verdict.divergent_ranks.end(),
                 std::back_inserter(d.replica_divergent));
  const std::vector<double> time_z =
      any_time ? StepTimeRobustZ(times) : std::vector<double>(n, std::nan(""));
  for (size_t i = 0; i < n; ++i) {
    const RankReport& r = js.reports[i];
    if (r.reduced_grad_fingerprint || r.param_fingerprint) {
      d.replica_ok.push_back(
          !std::binary_search(d.replica_divergent.begin(), d.replica_divergent.end(), r.rank));
    } else {
      d.replica_ok.push_back(std::nullopt);
    }
    RankExtras e;
    e.outlier_score = d.outliers[i].score;
    e.step_time_seconds = times[i];
    e.step_time_z = time_z[i];
    d.extras.push_back(e);
    if (d.outliers[i].flagged) d.flagged_ranks.push_back(r.rank);
  }
  if (!reduced_norms.empty()) {
    // Every rank holds the same reduced gradient; take the median against a stray value.
    std::nth_element(reduced_norms.begin(), reduced_norms.begin() + reduced_norms.size() / 2,
                     reduced_norms.end());
    d.grad_noise_scale =
        GradientNoiseScale(local_norms, reduced_norms[reduced_norms.size() / 2], batch);
  }
  return d;
}

}  // namespace

// What ComputeAndExport leaves for Store.
struct StepPipeline::ComputedStep {
  JoinedStep js;
  StepStatistics stats;
  StepDiagnostics diag;
  std::vector<uint32_t> outlier_ranks;
};

StepPipeline::StepPipeline(PipelineOptions options, std::unique_ptr<SqliteStore> store,
                           const std::vector<JobRow>& known_jobs, JobMetrics* metrics,
                           HealthMetrics* health)
    : options_(std::move(options)),
      metrics_(metrics),
      health_(health),
      writer_(std::move(store), options_.writer,
              StoreWriterHooks{
                  .on_commit =
                      [this](absl::Duration d, size_t) {
                        health_->ObserveStoreCommit(d);
                        health_->SetStoreHealthy(true);
                        if (store_failures_ > 0) {
                          std::fprintf(stderr,
                                       "rankscope-collector: SQLite writes recovered after %llu "
                                       "failed attempts; held reports stored and acked\n",
                                       static_cast<unsigned long long>(store_failures_));
                          store_failures_ = 0;
                        }
                      },
                  .on_error =
                      [this](const absl::Status& error) {
                        health_->StoreError();
                        health_->SetStoreHealthy(false);
                        // The first failure of a run of them, then every 60th (one a minute at the
                        // default retry backoff): clear, without flooding the log.
                        if (store_failures_++ % 60 == 0) {
                          std::fprintf(
                              stderr,
                              "rankscope-collector: SQLite write failed (attempt %llu): %s; "
                              "nothing is acked until a retry commits (agents keep their "
                              "reports)\n",
                              static_cast<unsigned long long>(store_failures_),
                              error.ToString().c_str());
                        }
                      },
                  .on_queue_depth = [health](size_t n) { health->SetStoreQueueDepth(n); },
                  .on_drop =
                      [this](const StoreBatch& rows, size_t items, const absl::Status& why) {
                        health_->StoreDropped(items);
                        std::fprintf(stderr,
                                     "rankscope-collector: dropped %zu unstored store items (%s); "
                                     "their agents' streams are ended so that they resend\n",
                                     items, why.ToString().c_str());
                        ForgetDroppedSteps(rows);
                      },
              }),
      joiner_(options_.joiner) {
  const absl::Time now = options_.clock();
  MutexLock lock(&mu_);
  for (const JobRow& row : known_jobs) {
    if (now - row.last_seen > options_.identity_ttl) continue;
    Job& job = jobs_[row.job];
    job.identity = JobIdentity{row.world_size, row.sketch_dim, row.sketch_seed};
    job.first_seen = row.first_seen;
    job.last_seen = row.last_seen;
    job.newest_step = row.last_step;
    job.has_step = true;
    joiner_.RegisterJob(row.job, row.world_size).IgnoreError();
  }
  step_thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "rs-step-thread");  // for top -H, perf and the bench
    StepThread();
  });
}

StepPipeline::~StepPipeline() { Stop(absl::Seconds(5)).IgnoreError(); }

Rejection StepPipeline::AcceptHello(const v1::Hello& hello, std::shared_ptr<AgentStream> stream) {
  Rejection r = ValidateHello(hello, options_.limits);
  if (!r.status.ok()) return r;
  if (!options_.auth_token.empty() && hello.auth_token() != options_.auth_token) {
    return Rejection{absl::UnauthenticatedError(absl::StrCat(
                         "job ", hello.job(), " rank ", hello.rank(),
                         ": missing or wrong auth token (the collector requires --auth_token)")),
                     "unauthenticated"};
  }
  const absl::Time now = options_.clock();
  std::optional<v1::Control> control;
  {
    MutexLock lock(&mu_);
    auto it = jobs_.find(hello.job());
    if (it != jobs_.end() && it->second.connected == 0 &&
        now - it->second.last_seen > options_.identity_ttl) {
      // Long idle: the name may be reused by a new run with another shape. Whatever the old run
      // left open is closed (and stored) first.
      std::vector<JoinedStep> forgotten;
      joiner_.ForgetJob(hello.job(), &forgotten);
      for (JoinedStep& s : forgotten) {
        closed_.push_back(std::move(s));
        ++closed_enqueued_;
      }
      jobs_.erase(it);
      it = jobs_.end();
    }
    if (it == jobs_.end()) {
      if (jobs_.size() >= options_.max_jobs) {
        return Rejection{absl::ResourceExhaustedError(
                             absl::StrCat("the collector already tracks ", jobs_.size(),
                                          " jobs (--max_jobs); job ", hello.job(), " refused")),
                         "too_many_jobs"};
      }
      Job job;
      job.identity = JobIdentity{hello.world_size(), hello.sketch_dim(), hello.sketch_seed()};
      job.first_seen = now;
      job.last_seen = now;
      absl::Status st = joiner_.RegisterJob(hello.job(), hello.world_size());
      if (!st.ok()) {
        return Rejection{st, "world_size_changed"};
      }
      it = jobs_.emplace(hello.job(), std::move(job)).first;
    } else {
      r = CheckJobIdentity(hello, it->second.identity);
      if (!r.status.ok()) return r;
      auto claim = it->second.claims.find(hello.rank());
      if (claim != it->second.claims.end() && claim->second.attempt == hello.attempt() &&
          claim->second.host != hello.host()) {
        return Rejection{
            absl::AlreadyExistsError(absl::StrCat(
                "rank ", hello.rank(), " of job ", hello.job(), " (attempt ", hello.attempt(),
                ") is already connected from host '", absl::CHexEscape(claim->second.host),
                "'; this hello from host '", absl::CHexEscape(hello.host()),
                "' claims it too: two runs share a job name (give each its own) or two "
                "processes were given the same rank")),
            std::string(kRejectRankTaken)};
      }
    }
    Job& job = it->second;
    RankClaim& claim = job.claims[hello.rank()];
    claim.host = hello.host();
    claim.attempt = hello.attempt();
    ++claim.streams;
    ++job.connected;
    job.last_seen = now;
    job.streams.insert(stream);
    if (hello.rank() < job.dropped_forwarded.size()) job.dropped_forwarded[hello.rank()].reset();
    control = job.control;
  }
  metrics_->OnAgentConnected(hello.job(), hello.world_size());
  if (control) stream->SendControl(*control);
  JobRow row;
  row.job = hello.job();
  row.world_size = hello.world_size();
  row.sketch_dim = hello.sketch_dim();
  row.sketch_seed = hello.sketch_seed();
  row.first_seen = now;
  row.last_seen = now;
  WriteItem item;
  item.batch.jobs.push_back(std::move(row));
  writer_.Enqueue(std::move(item));
  return {};
}

void StepPipeline::StreamClosed(const v1::Hello& hello,
                                const std::shared_ptr<AgentStream>& stream) {
  {
    MutexLock lock(&mu_);
    auto it = jobs_.find(hello.job());
    if (it == jobs_.end()) return;
    if (it->second.streams.erase(stream) == 0) return;
    if (it->second.connected > 0) --it->second.connected;
    auto claim = it->second.claims.find(hello.rank());
    if (claim != it->second.claims.end() && --claim->second.streams == 0) {
      it->second.claims.erase(claim);
    }
    it->second.last_seen = options_.clock();
  }
  metrics_->OnAgentDisconnected(hello.job());
}

Rejection StepPipeline::OnReport(const v1::Hello& hello, const v1::StepReport& report,
                                 AckHandle ack) {
  const absl::Time now = options_.clock();
  uint32_t sketch_dim = hello.sketch_dim();
  if (static_cast<uint32_t>(report.sketch_size()) != sketch_dim) {
    // Only a re-tuned sketch (SetControl) may differ from the hello's, so the common path takes
    // no lock for this.
    MutexLock lock(&mu_);
    auto it = jobs_.find(hello.job());
    if (it != jobs_.end() && it->second.control && it->second.control->sketch_dim() != 0 &&
        it->second.control->sketch_dim() == static_cast<uint32_t>(report.sketch_size())) {
      sketch_dim = it->second.control->sketch_dim();
    }
  }
  Rejection r = ValidateReport(report, hello, sketch_dim);
  if (!r.status.ok()) return r;

  RankReport rr = ToRankReport(report, hello.rank(), hello.attempt(), now, std::move(ack));
  std::vector<JoinedStep> closed;
  AddOutcome outcome;
  bool dropped_changed = false;
  {
    MutexLock lock(&mu_);
    auto it = jobs_.find(hello.job());
    if (it == jobs_.end()) {
      return Rejection{absl::FailedPreconditionError(
                           absl::StrCat("job ", hello.job(), " is no longer tracked; reconnect")),
                       "invalid_report"};
    }
    Job& job = it->second;
    job.last_seen = now;
    if (!job.has_step || report.step() > job.newest_step) job.newest_step = report.step();
    job.has_step = true;
    if (job.dropped_forwarded.size() <= hello.rank()) {
      job.dropped_forwarded.resize(hello.rank() + 1);
    }
    std::optional<uint64_t>& forwarded = job.dropped_forwarded[hello.rank()];
    dropped_changed = forwarded != report.dropped_total();
    forwarded = report.dropped_total();
    outcome = joiner_.Add(hello.job(), rr, now, &closed);
    for (JoinedStep& s : closed) {
      closed_.push_back(std::move(s));
      ++closed_enqueued_;
    }
    next_deadline_ = joiner_.NextDeadline();
  }
  // JobMetrics takes only what changed: a repeated count is a no-op there (see Job).
  if (dropped_changed) metrics_->OnAgentDropped(hello.job(), hello.rank(), report.dropped_total());

  switch (outcome) {
    case AddOutcome::kAccepted:
      break;
    case AddOutcome::kUnknownJob:
    case AddOutcome::kRankOutOfRange:
      // AcceptHello registered the job and validated the rank; reaching this is a bug. Refuse
      // the report with a Rejection so it is visibly counted, never silently lost.
      return Rejection{absl::InternalError(absl::StrCat("joiner does not know rank ", hello.rank(),
                                                        " of job ", hello.job())),
                       "invalid_report"};
    case AddOutcome::kDuplicate:
      health_->ReportDuplicate();
      if (!rr.acks.empty()) EnqueueAcksOnly(std::move(rr.acks));
      break;
    case AddOutcome::kStale:
      health_->ReportDuplicate();
      EnqueueAcksOnly(std::move(rr.acks));
      break;
    case AddOutcome::kLate: {
      health_->ReportLate();
      WriteItem item;
      StepWrite w;
      w.job = hello.job();
      w.step = rr.step;
      RankRow row = ToRankRow(rr, 1);
      w.ranks.push_back(std::move(row));
      item.batch.steps.push_back(std::move(w));
      item.acks = std::move(rr.acks);
      writer_.Enqueue(std::move(item));
      break;
    }
  }
  // Unless the joiner took the report, its sketch buffer is free again.
  SketchBufferPool::Get().Give(rr.sketch);
  return {};
}

void StepPipeline::ForgetDroppedSteps(const StoreBatch& rows) {
  MutexLock lock(&mu_);
  for (const StepWrite& w : rows.steps) {
    const uint32_t attempt =
        w.stats ? w.stats->attempt : (w.ranks.empty() ? 0 : w.ranks.front().attempt);
    joiner_.ForgetClosedStep(w.job, w.step, attempt);
  }
}

void StepPipeline::EnqueueAcksOnly(std::vector<AckHandle> acks) {
  WriteItem item;
  item.acks = std::move(acks);
  writer_.Enqueue(std::move(item));
}

void StepPipeline::StepThread() {
  std::vector<JoinedStep> batch;
  while (true) {
    {
      MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !closed_.empty() || stopping_ || options_.clock() >= next_deadline_;
      };
      // Wake at the earliest deadline even if nobody signals.
      while (!ready()) {
        const absl::Duration wait =
            next_deadline_ == absl::InfiniteFuture()
                ? absl::Seconds(1)
                : std::max(absl::Milliseconds(1), next_deadline_ - options_.clock());
        mu_.AwaitWithTimeout(absl::Condition(&ready), std::min(wait, absl::Seconds(1)));
      }
      std::vector<JoinedStep> expired;
      joiner_.Expire(stopping_ ? absl::InfiniteFuture() : options_.clock(), &expired);
      for (JoinedStep& s : expired) {
        closed_.push_back(std::move(s));
        ++closed_enqueued_;
      }
      next_deadline_ = joiner_.NextDeadline();
      batch.clear();
      while (!closed_.empty()) {
        batch.push_back(std::move(closed_.front()));
        closed_.pop_front();
      }
      if (batch.empty() && stopping_) {
        stopped_ = true;
        return;
      }
    }
    // Metrics first for the whole batch, then the store: a step's metrics do not wait for the
    // rows of the steps closed before it in the same batch (a lagging rank closes dozens at once).
    std::vector<ComputedStep> computed;
    computed.reserve(batch.size());
    for (JoinedStep& s : batch) computed.push_back(ComputeAndExport(std::move(s)));
    for (ComputedStep& c : computed) Store(std::move(c));
    MutexLock lock(&mu_);
    closed_processed_ += batch.size();
  }
}

StepPipeline::ComputedStep StepPipeline::ComputeAndExport(JoinedStep js) {
  std::vector<RankSample> samples;
  samples.reserve(js.reports.size());
  bool same_dim = true;
  for (const RankReport& r : js.reports) {
    if (!js.reports.empty() && r.sketch.size() != js.reports.front().sketch.size()) {
      same_dim = false;
    }
  }
  for (const RankReport& r : js.reports) {
    RankSample s;
    s.rank = r.rank;
    s.loss = r.loss;
    s.grad_norm = r.grad_norm;
    if (same_dim) s.sketch = r.sketch;
    samples.push_back(s);
  }
  StepStatistics stats = ComputeStepStatistics(samples);
  if (!same_dim) {
    // A sketch re-tune crossed this step: cosines across different sketches mean nothing.
    stats.grad_cosine_mean = std::nan("");
    for (RankStatistics& p : stats.per_rank) p.consensus_cosine = std::nan("");
  }
  const bool timed_out = js.reason != JoinedStep::Reason::kComplete;
  if (js.reason == JoinedStep::Reason::kEvicted) health_->StepEvicted();
  StepDiagnostics diag = Diagnose(js, stats);
  // Persistent outliers: flagged on kOutlierPersistence consecutive steps the rank reported.
  std::vector<uint32_t> outlier_ranks;
  {
    auto& streaks = outlier_streaks_[js.job];
    for (size_t i = 0; i < js.reports.size(); ++i) {
      const uint32_t rank = js.reports[i].rank;
      if (diag.outliers[i].flagged) {
        if (++streaks[rank] >= kOutlierPersistence) outlier_ranks.push_back(rank);
      } else {
        streaks.erase(rank);
      }
    }
    if (streaks.empty()) outlier_streaks_.erase(js.job);
  }

  ExportedStep exported;
  exported.step = js.step;
  exported.world_size = js.world_size;
  exported.timed_out = timed_out;
  exported.stats = &stats;
  exported.missing_ranks = js.missing_ranks;
  exported.extras = diag.extras;
  exported.grad_noise_scale = diag.grad_noise_scale;
  exported.replica_checked = diag.replica_checked;
  exported.replica_divergent_ranks = diag.replica_divergent;
  metrics_->OnStep(js.job, exported);

  absl::Time last_received = absl::InfinitePast();
  for (const RankReport& r : js.reports) last_received = std::max(last_received, r.received_at);
  if (js.reason == JoinedStep::Reason::kComplete) {
    health_->ObserveIngestLatency(options_.clock() - last_received);
  }
  return ComputedStep{std::move(js), std::move(stats), std::move(diag), std::move(outlier_ranks)};
}

void StepPipeline::Store(ComputedStep computed) {
  JoinedStep& js = computed.js;
  const StepStatistics& stats = computed.stats;
  const StepDiagnostics& diag = computed.diag;
  const bool timed_out = js.reason != JoinedStep::Reason::kComplete;

  WriteItem item;
  StepWrite w;
  w.job = js.job;
  w.step = js.step;
  StepRow row;
  row.step = js.step;
  row.attempt = js.attempt;
  row.ranks = static_cast<uint32_t>(js.reports.size());
  row.world_size = js.world_size;
  row.loss_mean = stats.loss_mean;
  row.loss_std = stats.loss_std;
  row.loss_range = stats.loss_range;
  row.grad_norm_mean = stats.grad_norm_mean;
  row.grad_norm_std = stats.grad_norm_std;
  row.grad_norm_cv = stats.grad_norm_cv;
  row.grad_cosine_mean = stats.grad_cosine_mean;
  row.missing_ranks = js.missing_ranks;
  row.timed_out = timed_out;
  row.completed_at = options_.clock();
  row.grad_noise_scale = diag.grad_noise_scale;
  row.replica_checked = diag.replica_checked;
  row.replica_divergent_ranks = diag.replica_divergent;
  row.outlier_ranks = std::move(computed.outlier_ranks);
  w.stats = std::move(row);
  const uint32_t join_size = static_cast<uint32_t>(js.reports.size());
  w.ranks.reserve(js.reports.size());
  item.acks.reserve(js.reports.size());
  for (size_t i = 0; i < js.reports.size(); ++i) {
    RankReport& r = js.reports[i];
    RankRow rank_row = ToRankRow(r, join_size);
    rank_row.grad_cosine = stats.per_rank[i].consensus_cosine;
    rank_row.loss_z = stats.per_rank[i].loss_z;
    rank_row.grad_norm_z = stats.per_rank[i].grad_norm_z;
    rank_row.replica_ok = diag.replica_ok[i];
    rank_row.outlier_score = diag.outliers[i].score;
    if (!std::isnan(diag.extras[i].step_time_z)) rank_row.step_time_z = diag.extras[i].step_time_z;
    w.ranks.push_back(std::move(rank_row));
    std::move(r.acks.begin(), r.acks.end(), std::back_inserter(item.acks));
  }
  item.batch.steps.push_back(std::move(w));
  JobRow job_row;
  job_row.job = js.job;
  {
    MutexLock lock(&mu_);
    auto it = jobs_.find(js.job);
    if (it != jobs_.end()) {
      job_row.world_size = it->second.identity.world_size;
      job_row.sketch_dim = it->second.identity.sketch_dim;
      job_row.sketch_seed = it->second.identity.sketch_seed;
      job_row.first_seen = it->second.first_seen;
      job_row.last_seen = it->second.last_seen;
    }
  }
  job_row.last_step = js.step;
  if (job_row.world_size != 0) item.batch.jobs.push_back(std::move(job_row));
  writer_.Enqueue(std::move(item));
  SketchBufferPool::Get().Give(js.reports);  // `samples` and `stats` are done with them
}

absl::StatusOr<std::pair<v1::Control, uint32_t>> StepPipeline::SetControl(
    const std::string& job, std::optional<bool> enabled, std::optional<uint32_t> every,
    std::optional<uint32_t> sketch_dim, uint32_t lead_steps) {
  if (every && *every == 0) return absl::InvalidArgumentError("every must be >= 1");
  if (sketch_dim && (*sketch_dim == 0 || *sketch_dim > options_.limits.max_sketch_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sketch_dim must be in [1, ", options_.limits.max_sketch_dim, "]"));
  }
  v1::Control control;
  std::vector<std::shared_ptr<AgentStream>> streams;
  {
    MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("job ", job, " is not known to this collector"));
    }
    Job& j = it->second;
    if (j.control) {
      control = *j.control;
    } else {
      control.set_enabled(true);
      control.set_every(1);
    }
    // Generations must keep increasing across collector restarts (agents ignore a generation
    // they have already passed), so they are at least the current time in microseconds.
    control.set_generation(std::max<uint64_t>(
        control.generation() + 1, static_cast<uint64_t>(absl::ToUnixMicros(options_.clock()))));
    control.set_apply_at_step(j.newest_step + std::max<uint32_t>(lead_steps, 1));
    if (enabled) control.set_enabled(*enabled);
    if (every) control.set_every(*every);
    if (sketch_dim) control.set_sketch_dim(*sketch_dim);
    j.control = control;
    streams.assign(j.streams.begin(), j.streams.end());
  }
  for (const auto& s : streams) s->SendControl(control);
  return std::make_pair(control, static_cast<uint32_t>(streams.size()));
}

std::vector<JobSummary> StepPipeline::ListJobs() const {
  std::vector<JobSummary> out;
  MutexLock lock(&mu_);
  for (const auto& [name, job] : jobs_) {
    JobSummary s;
    s.job = name;
    s.identity = job.identity;
    s.first_seen = job.first_seen;
    s.last_seen = job.last_seen;
    s.newest_step = job.newest_step;
    s.connected = job.connected;
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(),
            [](const JobSummary& a, const JobSummary& b) { return a.job < b.job; });
  return out;
}

bool StepPipeline::Flush(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  {
    MutexLock lock(&mu_);
    const uint64_t target = closed_enqueued_;
    auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return closed_processed_ >= target || stopped_;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) return false;
  }
  return writer_.Flush(deadline - absl::Now());
}

absl::Status StepPipeline::Stop(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (step_thread_.joinable()) step_thread_.join();
  return writer_.Stop(std::max(absl::ZeroDuration(), deadline - absl::Now()));
}

}  // namespace rankscope::collector
