// JobRegistry: the jobs a collector tracks and who may report for them.
//
// - Admission: a job is tracked from its first accepted hello (at most max_jobs at once) with the
//   identity of that hello (world size, sketch dim and seed), which later hellos must match
//   while the job is tracked. A job with no stream attached and not seen for identity_ttl is
//   forgotten on its next hello (the name may be reused by a new run of another shape).
// - Jobs here are a job's data-parallel groups: the pipeline passes the group key
//   (common/job_name.h GroupKey) as the hello's job, so each group is admitted, claimed and
//   controlled on its own. Rank numbers are ranks in the group.
// - Rank claims: one rank, one process. While a stream of (job, rank) is attached, a hello for
//   the same rank and attempt from another agent instance (Hello.instance_id; for agents that
//   state none, from another host) is refused with ALREADY_EXISTS (reason rank_taken), naming
//   the holder's host, pid and instance. The same instance (an agent reconnecting before its old
//   stream was noticed dead) and a higher attempt (a torchelastic restart) are accepted.
// - Runs: a hello may state its run (Hello.run_id, shared by every rank of one launch). While a
//   run holds live streams for a job (group), a hello of another run whose attempt is not higher
//   than the holder's is refused with ALREADY_EXISTS (reason run_collision), naming the holder's
//   run id, attempt, first host and pid, and since when it holds the job: two live runs under one
//   name are a collision, never a restart, whichever ranks connect first. The check is per job,
//   not per rank, so no mix of two runs' ranks is ever joined. A higher attempt is a documented
//   takeover (see "Epochs"). Once the holder's streams are gone (closed, or cancelled by the
//   server's keepalive when its node died), the next run is admitted as a restart. Hellos that
//   state no run (older agents) are checked per rank only (below).
// - Epochs: every report joins under its stream's epoch, the "attempt" the joiner and the store
//   compare (the newest epoch wins). A job's epoch starts at its first hello's attempt and moves
//   on (to max(epoch + 1, attempt)) when the job restarts: a hello with a higher attempt than any
//   before, or a new instance for a rank whose previous instance had the current epoch (a restart
//   with no restart counter: a Slurm requeue, a manual resume). The other ranks of the restarted
//   run join the new epoch without moving it again; a surviving instance of the old run keeps
//   its own, older epoch (its reports lose). A restart may change the job's world size and
//   sketch (an elastic resize); within an epoch they are fixed.
// - Per-job controls (rankscope ctl) and the streams to push them to; the job's sketch-dimension
//   schedule (common/sketch_dim.h) follows from its identity and its control.
// - Bookkeeping for ListJobs (first/last seen, newest step, connected streams) and for the
//   store's jobs row, and the per-rank dropped count last forwarded to JobMetrics.
//
// Pure bookkeeping: no threads, no clock (times are passed in), no I/O. Streams are only stored;
// the caller sends them controls.
//
// Thread safety: not thread-safe. StepPipeline holds it ABSL_GUARDED_BY its mu_, together with
// the StepJoiner, because a job's admission and its registration in the joiner must be one
// atomic step; every method must be called with that mutex held.
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_JOB_REGISTRY_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_JOB_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/ingest/validation.h"
#include "collector/model/rows.h"
#include "collector/pipeline/agent_stream.h"
#include "common/sketch_dim.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

// One job as ListJobs reports it.
struct JobSummary {
  std::string job;
  JobIdentity identity;
  absl::Time first_seen = absl::UnixEpoch();
  absl::Time last_seen = absl::UnixEpoch();
  uint64_t newest_step = 0;
  uint32_t connected = 0;
};

// OK when `required_token` is empty or the hello carries it; otherwise UNAUTHENTICATED
// (reason unauthenticated).
Rejection CheckAuthToken(const v1::Hello& hello, absl::string_view required_token);

// Checks a control request's arguments: every >= 1 and sketch_dim in [1, max_sketch_dim] when
// given (INVALID_ARGUMENT otherwise).
absl::Status ValidateControlRequest(std::optional<uint32_t> every,
                                    std::optional<uint32_t> sketch_dim, uint32_t max_sketch_dim);

class JobRegistry {
 public:
  JobRegistry(size_t max_jobs, absl::Duration identity_ttl);

  // Tracks a job the store knew before a restart, unless it was last seen more than
  // identity_ttl before `now`. Returns whether it is tracked now.
  bool Restore(const JobRow& row, absl::Time now);

  bool Contains(const std::string& job) const { return jobs_.contains(job); }

  // Forgets `job` if no stream is attached and it was last seen more than identity_ttl before
  // `now`. Returns whether it was forgotten (the caller forgets its open joins too).
  bool ForgetIfIdle(const std::string& job, absl::Time now);

  // The tracked jobs with no stream attached, least recently seen first (candidates to forget
  // when --max_jobs is reached). O(jobs log jobs); called only when the registry is full.
  std::vector<std::string> IdleJobsOldestFirst() const;

  // Forgets a tracked job with no stream attached, whatever its age. Returns whether it did.
  bool ForgetIdle(const std::string& job);

  // For a job that is not tracked: OK iff one more job fits (RESOURCE_EXHAUSTED, reason
  // too_many_jobs, otherwise).
  Rejection CheckRoomForJob(const v1::Hello& hello) const;

  // What Attach decided for an accepted stream.
  struct Attached {
    uint32_t epoch = 0;      // the attempt this stream's reports join and are stored under
    bool resized = false;    // the job restarted with another identity (world size, sketch)
    bool restarted = false;  // this hello moved the job to a new epoch
    // A higher attempt was accepted while streams of an older one were still connected (a
    // restart whose old processes linger, or a client announcing a restart it is not).
    bool takeover = false;
    bool new_process = true;             // not a reconnect of the agent that last held the rank
    std::optional<v1::Control> control;  // the job's current control, if any
  };

  // Attaches `stream` of a validated hello to its job, tracking the job with the hello's
  // identity if it is not tracked yet (the caller checked CheckRoomForJob). For a tracked job
  // the hello may not take a rank held by another live instance in the same attempt
  // (ALREADY_EXISTS, reason rank_taken) and must match the job's identity (CheckJobIdentity)
  // unless it restarts the job (see "Epochs" above).
  Rejection Attach(const v1::Hello& hello, absl::Time now,
                   const std::shared_ptr<AgentStream>& stream, Attached* attached);

  // Detaches the stream of an accepted hello. Returns false (nothing changed) if the stream was
  // not attached (its job was forgotten meanwhile, or it was detached already).
  bool Detach(const v1::Hello& hello, const std::shared_ptr<AgentStream>& stream, absl::Time now);

  // The sketch dimensions a report of `hello`'s stream may carry: the hello's, and the job's
  // control's re-tuned one.
  SketchDimSchedule SketchDims(const v1::Hello& hello) const;

  // Records a report of step `step` from `hello`'s stream at `now`. Returns false iff the job is
  // no longer tracked. Sets *dropped_changed iff `dropped_total` differs from the count last
  // recorded for the rank since its hello (JobMetrics::OnAgentDropped needs only those).
  bool NoteReport(const v1::Hello& hello, uint64_t step, uint64_t dropped_total, absl::Time now,
                  bool* dropped_changed);

  // The current epoch of a tracked job (0 for an unknown one).
  uint32_t Epoch(const std::string& job) const;

  // The bucket names (Hello.bucket_names) of the newest hello of a tracked job that sent any,
  // or null.
  std::shared_ptr<const std::vector<std::string>> BucketNames(const std::string& job) const;

  // The jobs row of a tracked job (last_step left 0), or nullopt.
  std::optional<JobRow> StoredRow(const std::string& job) const;

  // Updates the job's control (fields not given keep their value; a job without one starts from
  // enabled, every 1) to apply `lead_steps` (at least 1) after its newest step, with a generation
  // of max(previous + 1, `now` in Unix microseconds) so that generations keep increasing across
  // collector restarts. Appends the job's streams to *streams. A job name that is no group key
  // but the name of a job with several groups updates every group ("JOB/GROUP"), each from its
  // own newest step; the first group's control is returned. NOT_FOUND for an unknown job;
  // UNAVAILABLE when a field left out would come from the defaults because the job has no
  // control and no connected rank (a collector that just restarted learns it from their hellos).
  absl::StatusOr<v1::Control> UpdateControl(const std::string& job, std::optional<bool> enabled,
                                            std::optional<uint32_t> every,
                                            std::optional<uint32_t> sketch_dim, uint32_t lead_steps,
                                            absl::Time now,
                                            std::vector<std::shared_ptr<AgentStream>>* streams);

  // Every tracked job, sorted by name.
  std::vector<JobSummary> Summaries() const;

 private:
  // Who holds, or last held, a rank of a job: the newest accepted hello's instance, host, pid,
  // attempt and epoch, and its open streams. Kept after the streams close (a later hello from
  // another instance is then a restart); at most one per rank that ever connected.
  struct RankClaim {
    std::string instance_id;
    std::string host;
    uint32_t pid = 0;
    uint32_t attempt = 0;
    uint32_t epoch = 0;
    uint32_t streams = 0;
  };
  struct Job {
    JobIdentity identity;
    uint32_t epoch = 0;        // see "Epochs"
    uint32_t max_attempt = 0;  // the highest Hello.attempt accepted
    absl::Time first_seen;
    absl::Time last_seen;
    uint64_t newest_step = 0;
    bool has_step = false;
    uint32_t connected = 0;
    std::optional<v1::Control> control;
    absl::flat_hash_set<std::shared_ptr<AgentStream>> streams;
    absl::flat_hash_map<uint32_t, RankClaim> claims;  // ranks that ever connected
    // The runs (Hello.run_id, non-empty) with live streams, by run id: see "Runs". Erased when
    // their last stream detaches.
    struct RunHold {
      uint32_t attempt = 0;  // the highest attempt of the run's accepted hellos
      std::string host;      // of the run's first accepted hello
      uint32_t pid = 0;
      absl::Time since;
      uint32_t streams = 0;
    };
    absl::flat_hash_map<std::string, RunHold> live_runs;
    // By rank: the dropped_total last passed to JobMetrics::OnAgentDropped, which only the
    // reports whose count differs from it need (JobMetrics keeps the same last value per rank, so
    // a repeat is a no-op there). Cleared by the rank's hello: a new stream (and a JobMetrics
    // state that may have expired meanwhile) sees its first count.
    std::vector<std::optional<uint64_t>> dropped_forwarded;
    std::shared_ptr<const std::vector<std::string>> bucket_names;  // see BucketNames
  };

  // Attach's pieces.
  // Whether `hello` comes from the process that holds or held `claim`: the same instance id, or
  // for agents that state none the same host.
  static bool SameInstance(const RankClaim& claim, const v1::Hello& hello);
  // A hello for a known job: kRankTaken when a live stream of the same attempt from another
  // process holds its rank; otherwise sets *restart (a newer attempt, or a new instance of the
  // current one) and, unless it restarts the job, checks the hello against the job's identity
  // (completing an identity restored from the store).
  static Rejection CheckHello(Job& job, const v1::Hello& hello, bool* restart);
  // kRunCollision when another run holds live streams of the job with an attempt >= the hello's.
  static Rejection CheckRun(const Job& job, const v1::Hello& hello);
  // The job restarts with the hello's identity and a new epoch; sets attached->resized and
  // attached->takeover (streams of an older attempt are still open).
  static void Restart(Job& job, const v1::Hello& hello, Attached* attached);
  // The epoch the new stream's reports join: the job's, a reconnecting process's own, or an
  // older attempt's (whose reports lose against the current one's).
  static uint32_t EpochFor(const Job& job, const RankClaim& claim, bool restart, bool same_process,
                           const v1::Hello& hello);

  // The control that follows j's current one (see UpdateControl).
  static v1::Control NextControl(const Job& j, std::optional<bool> enabled,
                                 std::optional<uint32_t> every, std::optional<uint32_t> sketch_dim,
                                 uint32_t lead_steps, absl::Time now);

  const size_t max_jobs_;
  const absl::Duration identity_ttl_;
  absl::flat_hash_map<std::string, Job> jobs_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_JOB_REGISTRY_H_
