// StepPipeline: everything between a validated message and the sinks.
//
//   ingest reactor ──AcceptHello/OnReport──► [mu_: job identities, StepJoiner] ──closed steps──►
//   step thread: ComputeStepStatistics ─► JobMetrics (Prometheus snapshot)
//                                       └► StoreWriter (SQLite, then acks to the agents)
//
// Reactor threads only take mu_ for O(1) work (the joiner's Add and a queue push); statistics
// run on the step thread, SQLite on the writer thread. The step thread also closes timed-out
// steps at their deadline (joiner.NextDeadline()).
//
// AgentStream is the pipeline's view of one agent's stream: it can be acked, sent a control
// message, and is detached by the ingest service when the stream ends.
//
// Thread safety: every public method is thread-safe.
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_H_

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
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collector/ack.h"
#include "collector/health_metrics.h"
#include "collector/prometheus_export.h"
#include "collector/sqlite_store.h"
#include "collector/step_joiner.h"
#include "collector/store_writer.h"
#include "collector/validation.h"
#include "common/mutex.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

class AgentStream : public AckSink {
 public:
  // Queues a control message for the agent. Must not block; ignored once the stream ended.
  virtual void SendControl(const v1::Control& control) = 0;
};

struct PipelineOptions {
  JoinerOptions joiner;
  IngestLimits limits;
  StoreWriterOptions writer;
  size_t max_jobs = 10'000;
  // A job's identity (world size, sketch) is enforced while it was seen within this long.
  absl::Duration identity_ttl = absl::Hours(1);
  std::string auth_token;  // when non-empty, every hello must carry it
  std::function<absl::Time()> clock = [] { return absl::Now(); };
};

// One job as ListJobs reports it.
struct JobSummary {
  std::string job;
  JobIdentity identity;
  absl::Time first_seen = absl::UnixEpoch();
  absl::Time last_seen = absl::UnixEpoch();
  uint64_t newest_step = 0;
  uint32_t connected = 0;
};

class StepPipeline {
 public:
  // `store` becomes the writer thread's connection. `known_jobs` (from the store) restores job
  // identities after a restart. metrics and health must outlive the pipeline.
  StepPipeline(PipelineOptions options, std::unique_ptr<SqliteStore> store,
               const std::vector<JobRow>& known_jobs, JobMetrics* metrics, HealthMetrics* health);
  ~StepPipeline();  // Stop(absl::Seconds(5)) if not stopped.

  // Validates and registers a stream's hello. On success the stream is attached to its job and
  // receives the job's current control message, if any.
  //
  // One rank, one identity: while a stream of (job, rank) is open, a hello for the same rank with
  // the same attempt from another host is refused with ALREADY_EXISTS (two runs share a job
  // name, or two processes were given the same rank). The same host (an agent reconnecting
  // before the collector noticed its old stream die) and another attempt (a restart: the newest
  // attempt wins in the joiner) are accepted.
  Rejection AcceptHello(const v1::Hello& hello, std::shared_ptr<AgentStream> stream);
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

 private:
  // Who holds a rank of a job: the newest accepted hello's host and attempt, and its open streams.
  struct RankClaim {
    std::string host;
    uint32_t attempt = 0;
    uint32_t streams = 0;
  };
  struct Job {
    JobIdentity identity;
    absl::Time first_seen;
    absl::Time last_seen;
    uint64_t newest_step = 0;
    bool has_step = false;
    uint32_t connected = 0;
    std::optional<v1::Control> control;
    absl::flat_hash_set<std::shared_ptr<AgentStream>> streams;
    absl::flat_hash_map<uint32_t, RankClaim> claims;  // ranks with an open stream
    // By rank: the dropped_total last passed to JobMetrics::OnAgentDropped, which only the
    // reports whose count differs from it need (JobMetrics keeps the same last value per rank, so
    // a repeat is a no-op there). Cleared by the rank's hello: a new stream (and a JobMetrics
    // state that may have expired meanwhile) sees its first count.
    std::vector<std::optional<uint64_t>> dropped_forwarded;
  };

  void StepThread();
  struct ComputedStep;  // pipeline.cc
  // Step thread: a closed step's statistics and diagnostics, exported to JobMetrics.
  ComputedStep ComputeAndExport(JoinedStep step);
  // Step thread: the step's rows to the store writer (whose commit acks its reports).
  void Store(ComputedStep computed);
  void EnqueueAcksOnly(std::vector<AckHandle> acks);
  // The store writer dropped these rows unstored: the joiner forgets that their steps were
  // closed, so that the agents' resends are joined and stored again, not taken for duplicates.
  void ForgetDroppedSteps(const StoreBatch& rows);

  const PipelineOptions options_;
  JobMetrics* const metrics_;
  HealthMetrics* const health_;
  uint64_t store_failures_ = 0;  // store writer thread only: consecutive failed commits
  StoreWriter writer_;

  mutable Mutex mu_;
  StepJoiner joiner_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<JoinedStep> closed_ ABSL_GUARDED_BY(mu_);
  absl::Time next_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  uint64_t closed_enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t closed_processed_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Step thread only: per job, per rank, the number of consecutive steps (of those the rank
  // reported) whose outlier score exceeded the threshold. Ranks at zero are not stored.
  absl::flat_hash_map<std::string, absl::flat_hash_map<uint32_t, uint32_t>> outlier_streaks_;
  std::thread step_thread_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_H_
