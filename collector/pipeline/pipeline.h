// StepPipeline: everything between a validated message and the sinks; it orchestrates, the
// pieces decide.
//
//   ingest reactor ──AcceptHello/OnReport──► [mu_: JobRegistry] ─► [shard(group).mu: StepJoiner]
//       ──closed steps──► analysis thread of the group's shard (one of analysis_threads):
//                StepAnalyzer (statistics, diagnostics, outlier streaks, rows)
//                ─► JobMetrics (Prometheus snapshot)
//                └► StoreWriter (one for all shards: SQLite, then acks to the agents)
//
// Shards: joining and analysis are split over `analysis_threads` shards by the group key
// (common/job_name.h GroupKey; the job's name for an agent that states no group). A group
// always maps to the same shard, so its steps are joined, analysed, exported and handed to the
// StoreWriter in the order its joiner closed them, as with one thread; groups of different
// shards proceed in parallel, in no order relative to each other. The StoreWriter stays one
// (SQLite has one writer) and batches whatever the shards queued into one transaction.
//
// Threads and locks:
// - Reactor threads (AcceptHello, OnReport, StreamClosed) and query threads (SetControl,
//   ListJobs) take mu_ only for O(1) work: the JobRegistry (admission, rank claims, controls).
//   OnReport takes its group's shard lock before releasing mu_ (hand over hand), so that the
//   registry's view of the report and the joiner's Add are one atomic step with respect to
//   AcceptHello, which changes a group's joiner under mu_ and its shard lock. The joiner's Add
//   and the queue push run under the shard lock alone. Validation runs before, outside any lock.
// - Each shard's analysis thread (rs-step-thread, one per shard) drains its closed steps,
//   closes its timed-out ones at their deadline (its joiner's NextDeadline(), measured with
//   options.clock), runs its StepAnalyzer (which only it touches) outside every lock, exports to
//   JobMetrics and hands rows to the StoreWriter.
// - The StoreWriter's own thread commits to SQLite and acks; its hooks (health, dropped rows)
//   run there.
// Lock order: mu_ before any Shard::mu; at most one Shard::mu at a time. Neither is held while
// calling JobMetrics, HealthMetrics, the StoreWriter or an AgentStream.
//
// Time: every time the pipeline stamps or compares comes from options.clock.
//
// Thread safety: every public method is thread-safe.
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_PIPELINE_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_PIPELINE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collector/analysis/step_analysis.h"
#include "collector/ingest/validation.h"
#include "collector/metrics/health_metrics.h"
#include "collector/metrics/prometheus_export.h"
#include "collector/model/ack.h"
#include "collector/pipeline/agent_stream.h"
#include "collector/pipeline/job_registry.h"
#include "collector/pipeline/sketch_buffer_pool.h"
#include "collector/pipeline/step_change_log.h"
#include "collector/pipeline/step_joiner.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/store_writer.h"
#include "common/mutex.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

struct PipelineOptions {
  JoinerOptions joiner;
  IngestLimits limits;
  StoreWriterOptions writer;
  size_t max_jobs = 10'000;
  // A job's identity (world size, sketch) is enforced while it was seen within this long.
  absl::Duration identity_ttl = absl::Hours(1);
  std::string auth_token;  // when non-empty, every hello must carry it
  // The pipeline's only source of time (receive and completion stamps, step deadlines, control
  // generations, the budget of Flush and Stop).
  std::function<absl::Time()> clock = &absl::Now;
  // Shards of joining and analysis, each with its own thread (see the file comment). 0: one per
  // core (std::thread::hardware_concurrency()).
  size_t analysis_threads = 0;
  // Seconds of `clock` per real second (the collector's --time_scale, for soak benchmarks): the
  // durations measured with `clock` that are real waits or exported metrics (the ingest latency,
  // Flush and Stop budgets, the wait for the next step deadline) are divided by it. 1 for a
  // real clock or a test clock.
  double clock_rate = 1.0;
};

class StepPipeline {
 public:
  // `store` becomes the writer thread's connection. `known_jobs` (from the store) restores job
  // identities after a restart. metrics and health must outlive the pipeline.
  StepPipeline(PipelineOptions options, std::unique_ptr<SqliteStore> store,
               const std::vector<JobRow>& known_jobs, JobMetrics* metrics, HealthMetrics* health);
  ~StepPipeline();  // Stop(absl::Seconds(5)) if not stopped.

  // Validates and registers a stream's hello. On success the stream is attached to its job's
  // group and receives the job's current control message, if any, and *hello becomes the
  // stream's identity as the pipeline knows it, to pass to OnReport and StreamClosed: job is the
  // group key (common/job_name.h GroupKey; the job's name for an agent that states no group) and
  // attempt is the epoch the stream's reports join under (JobRegistry "Epochs").
  //
  // One rank, one process: while a stream of (job, group, rank) is open, a hello for it with the
  // same attempt from another agent instance is refused with ALREADY_EXISTS naming the holder
  // (two runs or two models share a job name, or two processes were given the same rank). The
  // same instance (an agent reconnecting before the collector noticed its old stream die), a
  // higher attempt and a new instance after the old stream closed (restarts: the newest wins)
  // are accepted. A restart may change the world size (an elastic resize). Refusals of a rank's
  // identity are logged once per job and reason.
  Rejection AcceptHello(v1::Hello& hello, std::shared_ptr<AgentStream> stream);
  // The stream of an accepted hello ended.
  void StreamClosed(const v1::Hello& hello, const std::shared_ptr<AgentStream>& stream);

  // Validates and ingests one report of an accepted stream. A Rejection with a non-OK status
  // means the report was refused (the caller answers with a Rejection message).
  Rejection OnReport(const v1::Hello& hello, const v1::StepReport& report, AckHandle ack);

  // Operator control (rankscope ctl): updates the job's control and pushes it to every stream.
  // Generations increase across collector restarts: max(previous + 1, now in Unix microseconds).
  absl::StatusOr<std::pair<v1::Control, uint32_t>> SetControl(const std::string& job,
                                                              std::optional<bool> enabled,
                                                              std::optional<uint32_t> every,
                                                              std::optional<uint32_t> sketch_dim,
                                                              uint32_t lead_steps);

  std::vector<JobSummary> ListJobs() const;

  // Waits until every step closed so far and everything queued for the store is committed.
  bool Flush(absl::Duration timeout);

  // Closes every open step (stored with its missing ranks), commits what is queued within
  // `timeout`, stops the threads. Idempotent.
  absl::Status Stop(absl::Duration timeout);

  absl::Status store_health() const { return writer_.health(); }

  // Which steps of each job were committed after a cursor (step_change_log.h). Thread-safe.
  const StepChangeLog& changes() const { return changes_; }
  // The bucket names of a job's newest hello that named any (Hello.bucket_names), or null.
  std::shared_ptr<const std::vector<std::string>> BucketNames(const std::string& job) const;

 private:
  // One shard of joining and analysis: the groups whose key it is given (ShardOf).
  struct Shard {
    explicit Shard(const JoinerOptions& options) : joiner(options) {}
    Mutex mu;
    StepJoiner joiner ABSL_GUARDED_BY(mu);
    std::deque<JoinedStep> closed ABSL_GUARDED_BY(mu);
    // Groups the registry forgot since the shard's thread last looked: it frees their analysis
    // state (StepAnalyzer::ForgetJob) after the closed steps taken with them.
    std::vector<std::string> forgotten_jobs ABSL_GUARDED_BY(mu);
    absl::Time next_deadline ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
    uint64_t closed_enqueued ABSL_GUARDED_BY(mu) = 0;
    uint64_t closed_processed ABSL_GUARDED_BY(mu) = 0;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    bool stopped ABSL_GUARDED_BY(mu) = false;
    StepAnalyzer analyzer;  // the shard's thread only
    std::thread thread;
  };
  // The shard of a group key: fixed for the pipeline's life.
  Shard& ShardOf(const std::string& job) const;

  void StepThread(Shard& shard);
  struct ComputedStep;  // pipeline.cc
  // Analysis thread: a closed step analysed, exported to JobMetrics.
  ComputedStep AnalyzeAndExport(StepAnalyzer& analyzer, JoinedStep step);
  // Analysis thread: the step's rows to the store writer (whose commit acks its reports).
  void Store(ComputedStep computed);
  // Queues closed steps for the shard's thread.
  static void EnqueueClosedLocked(Shard& shard, std::vector<JoinedStep>& steps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  void EnqueueAcksOnly(std::vector<AckHandle> acks);
  // AcceptHello's steps, in order. AdmitLocked: the registry admits the stream (room for a new
  // job, a rank claim, a resize); the group's joiner follows under its shard lock (an idle job's
  // or an old epoch's open steps closed, the job registered at its world size). ReportAttached:
  // what the attach meant (a takeover, a new process, a version that differs, a restart) to the
  // metrics and the log. PublishIdentity: the rank's identity to JobMetrics. StoreHello: the job
  // row and the rank's identity row to the store writer.
  Rejection AdmitLocked(const v1::Hello& hello, absl::Time now,
                        const std::shared_ptr<AgentStream>& stream, JobRegistry::Attached* attached)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReportAttached(const v1::Hello& hello, const JobRegistry::Attached& attached);
  void PublishIdentity(const v1::Hello& hello);
  void StoreHello(const v1::Hello& hello, uint32_t epoch, absl::Time now);
  // At --max_jobs: forgets the least recently seen job with no stream and no open step (its
  // identity is then no longer enforced, as after identity_ttl). Returns whether one was.
  bool ForgetAnIdleJobLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Logs a refused hello's identity conflict (rank taken, shape changed) once per job and reason.
  void LogRefusalOnceLocked(const std::string& job, const Rejection& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The store writer dropped these rows unstored: the joiner forgets that their steps were
  // closed, so that the agents' resends are joined and stored again, not taken for duplicates.
  void ForgetDroppedSteps(const StoreBatch& rows);

  // The StoreWriter's hooks, each run on the writer's thread (on_drop also on an Enqueue
  // caller's): they update HealthMetrics and log.
  StoreWriterHooks StoreHooks();
  void OnStoreCommit(absl::Duration took);
  void OnStoreError(const absl::Status& error);
  void OnStoreDrop(const StoreBatch& rows, size_t items, const absl::Status& why);
  void OnPrune(const PruneAction& action, const SqliteStore::PruneResult& result,
               absl::Duration took);
  void OnStoreUsage(const StoreUsage& usage, bool over_cap);
  void OnPruneError(const absl::Status& error);

  const PipelineOptions options_;
  JobMetrics* const metrics_;
  HealthMetrics* const health_;
  uint64_t store_failures_ = 0;           // store writer thread only: consecutive failed commits
  std::atomic<int64_t> page_size_{4096};  // the store's page size, from its usage reports
  // Sketch buffers: taken by OnReport (reactor threads), given back by the analysis threads.
  SketchBufferPool sketch_pool_;
  // The steps each commit stored (the web view's ?changes=); before writer_, whose thread records
  // into it until writer_ is destroyed.
  StepChangeLog changes_;
  StoreWriter writer_;

  mutable Mutex mu_;
  JobRegistry registry_ ABSL_GUARDED_BY(mu_);
  static constexpr size_t kMaxRefusalsLogged = 10'000;
  absl::flat_hash_set<std::pair<std::string, RejectReason>> refusals_logged_ ABSL_GUARDED_BY(mu_);
  // Fixed at construction (the vector and the shards' addresses never change; each shard's
  // fields are guarded as declared).
  std::vector<std::unique_ptr<Shard>> shards_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_PIPELINE_H_
