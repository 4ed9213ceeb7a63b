#include "collector/pipeline/pipeline.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "collector/pipeline/sketch_buffer_pool.h"
#include "common/job_name.h"
#include "common/version.h"

namespace rankscope::collector {
namespace {

// A validated ReplicaSummary (kReplicaProjections values).
ReplicaSummary SummaryOf(const v1::ReplicaSummary& in) {
  ReplicaSummary summary;
  for (size_t j = 0; j < kReplicaProjections; ++j) {
    summary.projections[j] = in.projections(static_cast<int>(j));
  }
  summary.rounding = in.rounding();
  summary.precision = in.precision();
  return summary;
}

// The report's sketch goes into a buffer from `pool`.
RankReport ToRankReport(const v1::StepReport& r, SketchEncoding encoding, uint32_t rank,
                        uint32_t attempt, absl::Time received_at, AckHandle ack,
                        SketchBufferPool& pool) {
  RankReport out;
  out.rank = rank;
  out.step = r.step();
  out.attempt = attempt;
  out.loss_absent = r.loss_absent();
  out.loss = r.loss_absent() ? std::numeric_limits<double>::quiet_NaN() : r.loss();
  out.grad_norm = r.grad_norm();
  out.sketch_encoding = encoding;
  if (encoding != SketchEncoding::kFloat32) {
    // Kept packed: the joiner holds k * bytes-per-bin bytes per rank-step. A pooled buffer has
    // the capacity already, so assign() copies without allocating.
    out.sketch_packed = pool.TakePacked();
    out.sketch_packed.assign(r.sketch_packed());
    out.sketch_scale = r.sketch_scale();
  } else {
    out.sketch = pool.TakeFloats();
    // One memcpy: assign() from RepeatedField iterators compiles to a 16-byte loop (4% of the
    // server's CPU in the ingest bench). A pooled buffer already has this size, so resize() does
    // not write it twice.
    out.sketch.resize(static_cast<size_t>(r.sketch_size()));
    if (r.sketch_size() > 0) {
      std::memcpy(out.sketch.data(), r.sketch().data(), out.sketch.size() * sizeof(float));
    }
  }
  out.received_at = received_at;
  if (r.has_reduced_grad_fingerprint()) out.reduced_grad_fingerprint = r.reduced_grad_fingerprint();
  if (r.has_param_fingerprint()) out.param_fingerprint = r.param_fingerprint();
  if (r.has_param_summary()) out.param_summary = SummaryOf(r.param_summary());
  if (r.has_replica_set()) out.replica_set = r.replica_set();
  if (r.has_reduced_grad_summary()) out.reduced_grad_summary = SummaryOf(r.reduced_grad_summary());
  if (r.has_reduced_grad_norm()) out.reduced_grad_norm = r.reduced_grad_norm();
  if (r.has_step_time_seconds()) out.step_time_seconds = r.step_time_seconds();
  out.local_batch_size = r.local_batch_size();
  out.bucket_norms.assign(r.bucket_norms().begin(), r.bucket_norms().end());
  if (r.reduced_sketch_size() > 0) {
    out.reduced_sketch.assign(r.reduced_sketch().begin(), r.reduced_sketch().end());
    out.reduced_grad_mantissa_bits = r.reduced_grad_mantissa_bits();
  }
  out.acks.push_back(std::move(ack));
  return out;
}

}  // namespace

// What AnalyzeAndExport leaves for Store.
struct StepPipeline::ComputedStep {
  JoinedStep js;
  AnalyzedStep analyzed;
};

StepPipeline::StepPipeline(PipelineOptions options, std::unique_ptr<SqliteStore> store,
                           const std::vector<JobRow>& known_jobs, JobMetrics* metrics,
                           HealthMetrics* health)
    : options_(std::move(options)),
      metrics_(metrics),
      health_(health),
      // A random instance: a cursor a restarted collector issued is never taken for this one's.
      changes_(absl::Uniform<uint64_t>(absl::BitGen())),
      writer_(std::move(store), options_.writer, StoreHooks()),
      registry_(options_.max_jobs, options_.identity_ttl) {
  const size_t n = options_.analysis_threads != 0
                       ? options_.analysis_threads
                       : std::max<size_t>(1, std::thread::hardware_concurrency());
  shards_.reserve(n);
  for (size_t i = 0; i < n; ++i) shards_.push_back(std::make_unique<Shard>(options_.joiner));
  const absl::Time now = options_.clock();
  {
    MutexLock lock(&mu_);
    for (const JobRow& row : known_jobs) {
      if (!registry_.Restore(row, now)) continue;
      Shard& shard = ShardOf(row.job);
      MutexLock shard_lock(&shard.mu);
      shard.joiner.RegisterJob(row.job, row.world_size).IgnoreError();
    }
  }
  for (const std::unique_ptr<Shard>& shard : shards_) {
    shard->thread = std::thread([this, s = shard.get()] {
      // Every shard's thread has the one name, for top -H, perf and the bench's per-name CPU.
      pthread_setname_np(pthread_self(), "rs-step-thread");
      StepThread(*s);
    });
  }
}

StepPipeline::Shard& StepPipeline::ShardOf(const std::string& job) const {
  // absl::Hash is seeded per process: stable for the pipeline's life, which is all it needs.
  return *shards_[absl::Hash<std::string>{}(job) % shards_.size()];
}

StoreWriterHooks StepPipeline::StoreHooks() {
  HealthMetrics* const health = health_;
  return StoreWriterHooks{
      .on_commit = [this](absl::Duration took, size_t) { OnStoreCommit(took); },
      .on_stored = [this](const StoreBatch& stored) { changes_.Record(stored); },
      .on_error = [this](const absl::Status& error) { OnStoreError(error); },
      .on_queue_depth = [health](size_t n) { health->SetStoreQueueDepth(n); },
      .on_drop = [this](const StoreBatch& rows, size_t items,
                        const absl::Status& why) { OnStoreDrop(rows, items, why); },
      .on_prune = [this](const PruneAction& action, const SqliteStore::PruneResult& result,
                         absl::Duration took) { OnPrune(action, result, took); },
      .on_usage = [this](const StoreUsage& usage, bool over_cap) { OnStoreUsage(usage, over_cap); },
      .on_prune_error = [this](const absl::Status& error) { OnPruneError(error); },
  };
}

void StepPipeline::OnStoreCommit(absl::Duration took) {
  health_->ObserveStoreCommit(took);
  health_->SetStoreHealthy(true);
  if (store_failures_ > 0) {
    std::fprintf(stderr,
                 "rankscope-collector: SQLite writes recovered after %llu "
                 "failed attempts; held reports stored and acked\n",
                 static_cast<unsigned long long>(store_failures_));
    store_failures_ = 0;
  }
}

void StepPipeline::OnStoreError(const absl::Status& error) {
  health_->StoreError();
  health_->SetStoreHealthy(false);
  // The first failure of a run of them, then every 60th (one a minute at the default retry
  // backoff): clear, without flooding the log.
  if (store_failures_++ % 60 == 0) {
    std::fprintf(stderr,
                 "rankscope-collector: SQLite write failed (attempt %llu): %s; "
                 "nothing is acked until a retry commits (agents keep their "
                 "reports)\n",
                 static_cast<unsigned long long>(store_failures_), error.ToString().c_str());
  }
}

void StepPipeline::OnStoreDrop(const StoreBatch& rows, size_t items, const absl::Status& why) {
  health_->StoreDropped(items);
  std::fprintf(stderr,
               "rankscope-collector: dropped %zu unstored store items (%s); "
               "their agents' streams are ended so that they resend\n",
               items, why.ToString().c_str());
  ForgetDroppedSteps(rows);
}

void StepPipeline::OnPrune(const PruneAction& action, const SqliteStore::PruneResult& result,
                           absl::Duration took) {
  const bool downsample = action.kind == PruneAction::Kind::kDownsample;
  health_->ObservePrune(action.reason, result.rank_rows, result.step_rows, result.window_rows,
                        result.job_rows, downsample ? result.rank_rows + result.rank_rows_kept : 0,
                        result.pages_vacuumed * page_size_.load(std::memory_order_relaxed), took);
}

void StepPipeline::OnStoreUsage(const StoreUsage& usage, bool over_cap) {
  page_size_.store(usage.page_size, std::memory_order_relaxed);
  health_->SetStoreUsage(usage.file_bytes(), usage.page_size * usage.freelist_count, over_cap);
}

void StepPipeline::OnPruneError(const absl::Status& error) {
  health_->PruneError();
  std::fprintf(stderr, "rankscope-collector: storage retention: %s\n", error.ToString().c_str());
}

StepPipeline::~StepPipeline() { Stop(absl::Seconds(5)).IgnoreError(); }

void StepPipeline::EnqueueClosedLocked(Shard& shard, std::vector<JoinedStep>& steps) {
  for (JoinedStep& s : steps) {
    shard.closed.push_back(std::move(s));
    ++shard.closed_enqueued;
  }
}

Rejection StepPipeline::AcceptHello(v1::Hello& hello, std::shared_ptr<AgentStream> stream) {
  Rejection r = ValidateHello(hello, options_.limits);
  if (!r.status.ok()) return r;
  r = CheckAuthToken(hello, options_.auth_token);
  if (!r.status.ok()) return r;
  const absl::Time now = options_.clock();
  // From here on the group is the unit: joined, stored and exported under its key.
  if (!hello.group().empty()) hello.set_job(GroupKey(hello.job(), hello.group()));
  JobRegistry::Attached attached;
  {
    MutexLock lock(&mu_);
    r = AdmitLocked(hello, now, stream, &attached);
    if (!r.status.ok()) return r;
  }
  ReportAttached(hello, attached);
  hello.set_attempt(attached.epoch);
  PublishIdentity(hello);
  if (attached.control) {
    metrics_->OnControl(hello.job(), attached.control->enabled());
    stream->SendControl(*attached.control);
  }
  StoreHello(hello, attached.epoch, now);
  return {};
}

Rejection StepPipeline::AdmitLocked(const v1::Hello& hello, absl::Time now,
                                    const std::shared_ptr<AgentStream>& stream,
                                    JobRegistry::Attached* attached) {
  Shard& shard = ShardOf(hello.job());
  if (registry_.ForgetIfIdle(hello.job(), now)) {
    // Long idle: the name may be reused by a new run with another shape. Whatever the old run
    // left open is closed (and stored) first.
    std::vector<JoinedStep> forgotten;
    MutexLock shard_lock(&shard.mu);
    shard.joiner.ForgetJob(hello.job(), &forgotten);
    EnqueueClosedLocked(shard, forgotten);
    shard.forgotten_jobs.push_back(hello.job());
  }
  if (!registry_.Contains(hello.job())) {
    Rejection r = registry_.CheckRoomForJob(hello);
    if (!r.status.ok() && ForgetAnIdleJobLocked()) r = registry_.CheckRoomForJob(hello);
    if (!r.status.ok()) return r;
    MutexLock shard_lock(&shard.mu);
    absl::Status st = shard.joiner.RegisterJob(hello.job(), hello.world_size());
    if (!st.ok()) return Rejection{st, RejectReason::kWorldSizeChanged};
  }
  Rejection r = registry_.Attach(hello, now, stream, attached);
  if (!r.status.ok()) {
    // A collision is logged once per refused run (each may be a different user's mistake).
    LogRefusalOnceLocked(
        r.reason == RejectReason::kRunCollision
            ? absl::StrCat(hello.job(), " (run '", absl::CHexEscape(hello.run_id()), "')")
            : hello.job(),
        r);
    return r;
  }
  if (attached->resized) {
    // An elastic resize (or a restart with another sketch): the old epoch's open steps are
    // closed and stored as they are; steps from now on are joined at the new size.
    std::vector<JoinedStep> old_steps;
    MutexLock shard_lock(&shard.mu);
    shard.joiner.ForgetJob(hello.job(), &old_steps);
    EnqueueClosedLocked(shard, old_steps);
    shard.joiner.RegisterJob(hello.job(), hello.world_size()).IgnoreError();
  }
  return {};
}

void StepPipeline::ReportAttached(const v1::Hello& hello, const JobRegistry::Attached& attached) {
  if (attached.takeover) {
    health_->AttemptTakeover();
    std::fprintf(stderr,
                 "rankscope-collector: job %s: rank %u of attempt %u (host %s, pid %u) took over "
                 "while streams of an older attempt are still connected; its reports win. A real "
                 "restart whose old processes linger, or a client announcing one: a shared token "
                 "or mutual TLS is what stops the latter (docs/deploy.md \"Security\")\n",
                 hello.job().c_str(), hello.rank(), hello.attempt(),
                 absl::CHexEscape(hello.host()).c_str(), hello.pid());
  }
  if (attached.new_process) metrics_->OnAgentStarted(hello.job(), hello.rank());
  if (attached.new_process && hello.agent_version() != RANKSCOPE_VERSION) {
    std::fprintf(stderr,
                 "rankscope-collector: job %s: rank %u (host %s) runs agent version %s, this "
                 "collector is %s (rankscope_rank_info{version})\n",
                 hello.job().c_str(), hello.rank(), absl::CHexEscape(hello.host()).c_str(),
                 absl::CHexEscape(hello.agent_version()).c_str(), RANKSCOPE_VERSION);
  }
  if (attached.restarted) {
    std::fprintf(stderr,
                 "rankscope-collector: job %s restarted (rank %u came back as a new process or "
                 "attempt %u; world size %u): its reports from now on replace the old run's\n",
                 hello.job().c_str(), hello.rank(), hello.attempt(), hello.world_size());
  }
}

void StepPipeline::PublishIdentity(const v1::Hello& hello) {
  RankIdentity identity;
  identity.known = true;
  identity.rank = hello.rank();
  if (hello.has_global_rank()) identity.global_rank = hello.global_rank();
  identity.host = hello.host();
  identity.agent_version = hello.agent_version();
  metrics_->OnAgentConnected(hello.job(), hello.world_size(), std::move(identity));
}

void StepPipeline::StoreHello(const v1::Hello& hello, uint32_t epoch, absl::Time now) {
  JobRow row;
  row.job = hello.job();
  row.world_size = hello.world_size();
  row.sketch_dim = hello.sketch_dim();
  row.sketch_seed = hello.sketch_seed();
  row.attempt = epoch;
  row.first_seen = now;
  row.last_seen = now;
  RankIdentityRow who;
  who.job = hello.job();
  who.rank = hello.rank();
  if (hello.has_global_rank()) who.global_rank = hello.global_rank();
  who.host = hello.host();
  who.instance_id = hello.instance_id();
  who.pid = hello.pid();
  who.attempt = epoch;
  who.seen = now;
  WriteItem item;
  item.batch.jobs.push_back(std::move(row));
  item.batch.rank_identities.push_back(std::move(who));
  writer_.Enqueue(std::move(item));
}

bool StepPipeline::ForgetAnIdleJobLocked() {
  for (const std::string& job : registry_.IdleJobsOldestFirst()) {
    Shard& shard = ShardOf(job);
    MutexLock shard_lock(&shard.mu);
    if (shard.joiner.open_steps(job) != 0) continue;  // its open steps still need their identity
    registry_.ForgetIdle(job);
    std::vector<JoinedStep> none;
    shard.joiner.ForgetJob(job, &none);  // closed-step memory only: no open step
    shard.forgotten_jobs.push_back(job);
    return true;
  }
  return false;
}

void StepPipeline::LogRefusalOnceLocked(const std::string& job, const Rejection& r) {
  if (r.reason != RejectReason::kRankTaken && r.reason != RejectReason::kWorldSizeChanged &&
      r.reason != RejectReason::kSketchMismatch && r.reason != RejectReason::kRunCollision) {
    return;
  }
  if (refusals_logged_.size() >= kMaxRefusalsLogged) return;
  if (!refusals_logged_.emplace(job, r.reason).second) return;
  std::fprintf(stderr,
               "rankscope-collector: refused a stream of job %s: %s (logged once per job "
               "and reason; rankscope_reports_rejected_total counts every one)\n",
               job.c_str(), std::string(r.status.message()).c_str());
}

void StepPipeline::StreamClosed(const v1::Hello& hello,
                                const std::shared_ptr<AgentStream>& stream) {
  {
    MutexLock lock(&mu_);
    if (!registry_.Detach(hello, stream, options_.clock())) return;
  }
  metrics_->OnAgentDisconnected(hello.job());
}

Rejection StepPipeline::OnReport(const v1::Hello& hello, const v1::StepReport& report,
                                 AckHandle ack) {
  const absl::Time now = options_.clock();
  // The hello's sketch dimension is valid at every step, so the common report is validated
  // without job state: only a report of another length needs the job's re-tune (SetControl).
  const uint64_t sketch_size = ReportSketchDim(report, hello);
  SketchDimSchedule dims{hello.sketch_dim()};
  if (!SketchDimAccepted(dims, sketch_size)) {
    MutexLock lock(&mu_);
    dims = registry_.SketchDims(hello);
  }
  Rejection r = ValidateReport(report, hello, dims);
  if (!r.status.ok()) return r;

  RankReport rr = ToRankReport(
      report, SketchEncodingFromWire(hello.sketch_encoding()).value_or(SketchEncoding::kFloat32),
      hello.rank(), hello.attempt(), now, std::move(ack), sketch_pool_);
  std::vector<JoinedStep> closed;
  AddOutcome outcome;
  bool dropped_changed = false;
  Shard& shard = ShardOf(hello.job());
  {
    MutexLock lock(&mu_);
    if (!registry_.NoteReport(hello, report.step(), report.dropped_total(), now,
                              &dropped_changed)) {
      return Rejection{absl::FailedPreconditionError(
                           absl::StrCat("job ", hello.job(), " is no longer tracked; reconnect")),
                       RejectReason::kInvalidReport};
    }
    // Hand over hand (file comment): the shard lock is taken before mu_ is released.
    shard.mu.Lock();
  }
  outcome = shard.joiner.Add(hello.job(), rr, now, &closed);
  EnqueueClosedLocked(shard, closed);
  shard.next_deadline = shard.joiner.NextDeadline();
  shard.mu.Unlock();
  // JobMetrics takes only what changed: a repeated count is a no-op there
  // (JobRegistry::NoteReport).
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
                       RejectReason::kInvalidReport};
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
  sketch_pool_.Give(rr);
  return {};
}

void StepPipeline::ForgetDroppedSteps(const StoreBatch& rows) {
  for (const StepWrite& w : rows.steps) {
    const uint32_t attempt =
        w.stats ? w.stats->attempt : (w.ranks.empty() ? 0 : w.ranks.front().attempt);
    Shard& shard = ShardOf(w.job);
    MutexLock lock(&shard.mu);
    shard.joiner.ForgetClosedStep(w.job, w.step, attempt);
  }
}

void StepPipeline::EnqueueAcksOnly(std::vector<AckHandle> acks) {
  WriteItem item;
  item.acks = std::move(acks);
  writer_.Enqueue(std::move(item));
}

void StepPipeline::StepThread(Shard& shard) {
  std::vector<JoinedStep> batch;
  std::vector<std::string> forgotten;
  while (true) {
    {
      MutexLock lock(&shard.mu);
      auto ready = [this, &shard]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
        return !shard.closed.empty() || shard.stopping || options_.clock() >= shard.next_deadline;
      };
      // Wake at the earliest deadline even if nobody signals.
      while (!ready()) {
        const absl::Duration wait =
            shard.next_deadline == absl::InfiniteFuture()
                ? absl::Seconds(1)
                : std::max(absl::Milliseconds(1),
                           (shard.next_deadline - options_.clock()) / options_.clock_rate);
        shard.mu.AwaitWithTimeout(absl::Condition(&ready), std::min(wait, absl::Seconds(1)));
      }
      std::vector<JoinedStep> expired;
      shard.joiner.Expire(shard.stopping ? absl::InfiniteFuture() : options_.clock(), &expired);
      EnqueueClosedLocked(shard, expired);
      shard.next_deadline = shard.joiner.NextDeadline();
      batch.clear();
      forgotten.clear();
      forgotten.swap(shard.forgotten_jobs);
      while (!shard.closed.empty()) {
        batch.push_back(std::move(shard.closed.front()));
        shard.closed.pop_front();
      }
      if (batch.empty() && shard.stopping) {
        shard.stopped = true;
        return;
      }
    }
    // Metrics first for the whole batch, then the store: a step's metrics do not wait for the
    // rows of the steps closed before it in the same batch (a lagging rank closes dozens at once).
    std::vector<ComputedStep> computed;
    computed.reserve(batch.size());
    for (JoinedStep& s : batch) computed.push_back(AnalyzeAndExport(shard.analyzer, std::move(s)));
    for (ComputedStep& c : computed) Store(std::move(c));
    for (const std::string& job : forgotten) shard.analyzer.ForgetJob(job);
    MutexLock lock(&shard.mu);
    shard.closed_processed += batch.size();
  }
}

StepPipeline::ComputedStep StepPipeline::AnalyzeAndExport(StepAnalyzer& analyzer, JoinedStep js) {
  if (js.reason == JoinedStep::Reason::kEvicted) health_->StepEvicted();
  if (std::any_of(js.reports.begin(), js.reports.end(),
                  [](const RankReport& r) { return !r.bucket_norms.empty(); })) {
    MutexLock lock(&mu_);
    js.bucket_names = registry_.BucketNames(js.job);
  }
  AnalyzedStep analyzed = analyzer.Analyze(js);

  ExportedStep exported;
  exported.step = js.step;
  exported.world_size = js.world_size;
  exported.timed_out = js.reason != JoinedStep::Reason::kComplete;
  exported.stats = &analyzed.stats;
  exported.missing_ranks = js.missing_ranks;
  exported.extras = analyzed.diag.extras;
  exported.grad_noise_scale = analyzed.diag.grad_noise_scale;
  exported.replica_checked = analyzed.diag.replica_checked;
  exported.replica_divergent_ranks = analyzed.diag.replica_divergent;
  exported.duplicate_ranks = CountDuplicateRanks(analyzed.duplicates);
  exported.outlier_ranks = static_cast<uint32_t>(analyzed.outlier_ranks.size());
  exported.loss_absent = std::any_of(js.reports.begin(), js.reports.end(),
                                     [](const RankReport& r) { return r.loss_absent; });
  exported.drifting_ranks = analyzed.drifting_ranks;
  exported.slow_ranks = analyzed.slow_ranks;
  exported.top_bucket = analyzed.top_bucket;
  if (analyzed.integrity.checked) exported.integrity = &analyzed.integrity;
  metrics_->OnStep(js.job, exported);

  absl::Time last_received = absl::InfinitePast();
  for (const RankReport& r : js.reports) last_received = std::max(last_received, r.received_at);
  if (js.reason == JoinedStep::Reason::kComplete) {
    health_->ObserveIngestLatency((options_.clock() - last_received) / options_.clock_rate);
  }
  return ComputedStep{std::move(js), std::move(analyzed)};
}

void StepPipeline::Store(ComputedStep computed) {
  JoinedStep& js = computed.js;
  WriteItem item;
  item.batch.steps.push_back(StepRows(js, std::move(computed.analyzed), options_.clock()));
  item.acks.reserve(js.reports.size());
  for (RankReport& r : js.reports) {
    std::move(r.acks.begin(), r.acks.end(), std::back_inserter(item.acks));
  }
  std::optional<JobRow> job_row;
  {
    MutexLock lock(&mu_);
    job_row = registry_.StoredRow(js.job);
  }
  if (job_row && job_row->world_size != 0) {
    job_row->last_step = js.step;
    item.batch.jobs.push_back(std::move(*job_row));
  }
  writer_.Enqueue(std::move(item));
  sketch_pool_.Give(js.reports);  // the analysis is done with them
}

absl::StatusOr<std::pair<v1::Control, uint32_t>> StepPipeline::SetControl(
    const std::string& job, std::optional<bool> enabled, std::optional<uint32_t> every,
    std::optional<uint32_t> sketch_dim, uint32_t lead_steps) {
  absl::Status valid = ValidateControlRequest(every, sketch_dim, options_.limits.max_sketch_dim);
  if (!valid.ok()) return valid;
  std::vector<std::shared_ptr<AgentStream>> streams;
  absl::StatusOr<v1::Control> control;
  {
    MutexLock lock(&mu_);
    control = registry_.UpdateControl(job, enabled, every, sketch_dim, lead_steps, options_.clock(),
                                      &streams);
  }
  if (!control.ok()) return control.status();
  // Every target group got the same `enabled` when it was given (else each kept its own).
  if (enabled) metrics_->OnControl(job, *enabled);
  for (const auto& s : streams) s->SendControl(*control);
  return std::make_pair(*std::move(control), static_cast<uint32_t>(streams.size()));
}

std::vector<JobSummary> StepPipeline::ListJobs() const {
  MutexLock lock(&mu_);
  return registry_.Summaries();
}

std::shared_ptr<const std::vector<std::string>> StepPipeline::BucketNames(
    const std::string& job) const {
  MutexLock lock(&mu_);
  return registry_.BucketNames(job);
}

bool StepPipeline::Flush(absl::Duration timeout) {
  const absl::Time start = options_.clock();
  // What every shard had closed when Flush was called: each shard's count is taken under its
  // own lock, so a step closed before the call (on any shard) is waited for.
  std::vector<uint64_t> targets;
  targets.reserve(shards_.size());
  for (const std::unique_ptr<Shard>& shard : shards_) {
    MutexLock lock(&shard->mu);
    targets.push_back(shard->closed_enqueued);
  }
  for (size_t i = 0; i < shards_.size(); ++i) {
    Shard& shard = *shards_[i];
    const uint64_t target = targets[i];
    MutexLock lock(&shard.mu);
    auto done = [&shard, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
      return shard.closed_processed >= target || shard.stopped;
    };
    const absl::Duration left = timeout - (options_.clock() - start) / options_.clock_rate;
    if (!shard.mu.AwaitWithTimeout(absl::Condition(&done), left)) return false;
  }
  return writer_.Flush(timeout - (options_.clock() - start) / options_.clock_rate);
}

absl::Status StepPipeline::Stop(absl::Duration timeout) {
  const absl::Time start = options_.clock();
  for (const std::unique_ptr<Shard>& shard : shards_) {
    MutexLock lock(&shard->mu);
    shard->stopping = true;
  }
  for (const std::unique_ptr<Shard>& shard : shards_) {
    if (shard->thread.joinable()) shard->thread.join();
  }
  return writer_.Stop(
      std::max(absl::ZeroDuration(), timeout - (options_.clock() - start) / options_.clock_rate));
}

}  // namespace rankscope::collector
