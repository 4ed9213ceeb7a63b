#include "collector/pipeline/job_registry.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rankscope::collector {

Rejection CheckAuthToken(const v1::Hello& hello, absl::string_view required_token) {
  if (required_token.empty() || hello.auth_token() == required_token) return {};
  return Rejection{absl::UnauthenticatedError(absl::StrCat(
                       "job ", hello.job(), " rank ", hello.rank(),
                       ": missing or wrong auth token (the collector requires --auth_token)")),
                   RejectReason::kUnauthenticated};
}

absl::Status ValidateControlRequest(std::optional<uint32_t> every,
                                    std::optional<uint32_t> sketch_dim, uint32_t max_sketch_dim) {
  if (every && *every == 0) return absl::InvalidArgumentError("every must be >= 1");
  if (sketch_dim && (*sketch_dim == 0 || *sketch_dim > max_sketch_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sketch_dim must be in [1, ", max_sketch_dim, "]"));
  }
  return absl::OkStatus();
}

JobRegistry::JobRegistry(size_t max_jobs, absl::Duration identity_ttl)
    : max_jobs_(max_jobs), identity_ttl_(identity_ttl) {}

bool JobRegistry::Restore(const JobRow& row, absl::Time now) {
  if (now - row.last_seen > identity_ttl_) return false;
  Job& job = jobs_[row.job];
  // The store keeps no encoding or hash block: the next hello's are adopted (validation.h).
  job.identity = JobIdentity{row.world_size, row.sketch_dim, row.sketch_seed,
                             /*sketch_encoding=*/std::nullopt, /*sketch_block=*/std::nullopt};
  job.epoch = row.attempt;
  job.max_attempt = row.attempt;
  job.first_seen = row.first_seen;
  job.last_seen = row.last_seen;
  job.newest_step = row.last_step;
  job.has_step = true;
  return true;
}

bool JobRegistry::ForgetIfIdle(const std::string& job, absl::Time now) {
  auto it = jobs_.find(job);
  if (it == jobs_.end() || it->second.connected != 0 ||
      now - it->second.last_seen <= identity_ttl_) {
    return false;
  }
  jobs_.erase(it);
  return true;
}

std::vector<std::string> JobRegistry::IdleJobsOldestFirst() const {
  std::vector<std::pair<absl::Time, std::string>> idle;
  for (const auto& [name, job] : jobs_) {
    if (job.connected == 0) idle.emplace_back(job.last_seen, name);
  }
  std::sort(idle.begin(), idle.end());
  std::vector<std::string> out;
  out.reserve(idle.size());
  for (auto& [seen, name] : idle) out.push_back(std::move(name));
  return out;
}

bool JobRegistry::ForgetIdle(const std::string& job) {
  auto it = jobs_.find(job);
  if (it == jobs_.end() || it->second.connected != 0) return false;
  jobs_.erase(it);
  return true;
}

Rejection JobRegistry::CheckRoomForJob(const v1::Hello& hello) const {
  if (jobs_.size() < max_jobs_) return {};
  return Rejection{absl::ResourceExhaustedError(
                       absl::StrCat("the collector already tracks ", jobs_.size(),
                                    " jobs (--max_jobs); job ", hello.job(), " refused")),
                   RejectReason::kTooManyJobs};
}

bool JobRegistry::SameInstance(const RankClaim& claim, const v1::Hello& hello) {
  // Agents that state no instance are told apart by host, as before instance ids existed.
  return hello.instance_id().empty() && claim.instance_id.empty()
             ? claim.host == hello.host()
             : claim.instance_id == hello.instance_id();
}

Rejection JobRegistry::CheckRun(const Job& job, const v1::Hello& hello) {
  if (hello.run_id().empty()) return {};
  for (const auto& [run_id, run] : job.live_runs) {
    if (run_id == hello.run_id() || run.streams == 0 || hello.attempt() > run.attempt) continue;
    return Rejection{
        absl::AlreadyExistsError(absl::StrCat(
            "job ", hello.job(), " is held by another live run: run '", absl::CHexEscape(run_id),
            "' (attempt ", run.attempt, ", ", run.streams, " live stream",
            run.streams == 1 ? "" : "s", ", since ", absl::FormatTime(run.since),
            ", first from host '", absl::CHexEscape(run.host), "' pid ", run.pid,
            "); this rank (rank ", hello.rank(), " of run '", absl::CHexEscape(hello.run_id()),
            "', host '", absl::CHexEscape(hello.host()), "' pid ", hello.pid(),
            ") is NOT stored: two live runs under one job name are a collision, never a "
            "restart. The agent retries and is admitted once that run's streams are gone "
            "(a crashed node's stream is dropped by the collector's keepalive); give each run "
            "its own job name (job=..., RANKSCOPE_JOB)")),
        RejectReason::kRunCollision};
  }
  return {};
}

Rejection JobRegistry::CheckHello(Job& job, const v1::Hello& hello, bool* restart) {
  if (Rejection r = CheckRun(job, hello); !r.status.ok()) return r;
  auto held = job.claims.find(hello.rank());
  const RankClaim* claim = held == job.claims.end() ? nullptr : &held->second;
  const bool same_instance = claim != nullptr && SameInstance(*claim, hello);
  if (claim != nullptr && claim->streams > 0 && claim->attempt == hello.attempt() &&
      !same_instance) {
    return Rejection{
        absl::AlreadyExistsError(absl::StrCat(
            "rank ", hello.rank(), " of job ", hello.job(), " (attempt ", hello.attempt(),
            ") is held by a live stream from host '", absl::CHexEscape(claim->host), "' pid ",
            claim->pid, " (instance '", absl::CHexEscape(claim->instance_id),
            "'); this hello from host '", absl::CHexEscape(hello.host()), "' pid ", hello.pid(),
            " claims it too: two runs or two models share a job name and group (give each "
            "its own job name, or attach with group=...), or two processes were given the "
            "same rank")),
        RejectReason::kRankTaken};
  }
  *restart = hello.attempt() > job.max_attempt ||
             (claim != nullptr && !same_instance && !hello.instance_id().empty() &&
              claim->epoch == job.epoch && hello.attempt() == job.max_attempt);
  if (*restart) return {};
  Rejection r = CheckJobIdentity(hello, job.identity);
  if (!r.status.ok()) return r;
  // An identity restored from the store does not know its encoding: the first hello says it.
  if (!job.identity.sketch_encoding)
    job.identity.sketch_encoding = IdentityOf(hello).sketch_encoding;
  if (!job.identity.sketch_block) job.identity.sketch_block = SketchBlockOf(hello);
  return {};
}

void JobRegistry::Restart(Job& job, const v1::Hello& hello, Attached* attached) {
  const JobIdentity identity = IdentityOf(hello);
  attached->resized = identity.world_size != job.identity.world_size ||
                      identity.sketch_dim != job.identity.sketch_dim ||
                      identity.sketch_seed != job.identity.sketch_seed ||
                      identity.sketch_encoding != job.identity.sketch_encoding ||
                      identity.sketch_block != job.identity.sketch_block;
  job.identity = identity;
  job.epoch = std::max(job.epoch + 1, hello.attempt());
  job.max_attempt = std::max(job.max_attempt, hello.attempt());
  if (attached->resized) job.dropped_forwarded.clear();
  for (const auto& [rank, other] : job.claims) {
    if (other.streams > 0 && other.attempt < hello.attempt()) {
      attached->takeover = true;
      break;
    }
  }
}

uint32_t JobRegistry::EpochFor(const Job& job, const RankClaim& claim, bool restart,
                               bool same_process, const v1::Hello& hello) {
  if (restart) return job.epoch;
  if (same_process) return claim.epoch;  // a reconnect: its reports keep their epoch
  // A process of an older attempt: its reports lose against the current one's.
  if (hello.attempt() < job.max_attempt) return std::min(job.epoch, hello.attempt());
  return job.epoch;
}

Rejection JobRegistry::Attach(const v1::Hello& hello, absl::Time now,
                              const std::shared_ptr<AgentStream>& stream, Attached* attached) {
  *attached = Attached();
  auto it = jobs_.find(hello.job());
  bool restart = false;
  if (it == jobs_.end()) {
    Job job;
    job.identity = IdentityOf(hello);
    job.epoch = hello.attempt();
    job.max_attempt = hello.attempt();
    job.first_seen = now;
    job.last_seen = now;
    it = jobs_.emplace(hello.job(), std::move(job)).first;
  } else if (Rejection r = CheckHello(it->second, hello, &restart); !r.status.ok()) {
    return r;
  }
  Job& job = it->second;
  if (restart) Restart(job, hello, attached);
  auto [held, first_claim] = job.claims.try_emplace(hello.rank());
  RankClaim& claim = held->second;
  const bool same_process =
      !first_claim && claim.attempt == hello.attempt() && SameInstance(claim, hello);
  attached->epoch = EpochFor(job, claim, restart, same_process, hello);
  attached->restarted = restart;
  attached->new_process = !same_process;
  claim.instance_id = hello.instance_id();
  claim.host = hello.host();
  claim.pid = hello.pid();
  claim.attempt = hello.attempt();
  claim.epoch = attached->epoch;
  ++claim.streams;
  ++job.connected;
  if (!hello.run_id().empty()) {
    auto [run, first_stream] = job.live_runs.try_emplace(hello.run_id());
    if (first_stream) {
      run->second.host = hello.host();
      run->second.pid = hello.pid();
      run->second.since = now;
    }
    run->second.attempt = std::max(run->second.attempt, hello.attempt());
    ++run->second.streams;
  }
  job.last_seen = now;
  job.streams.insert(stream);
  if (hello.rank() < job.dropped_forwarded.size()) job.dropped_forwarded[hello.rank()].reset();
  // The newest hello's bucket names (every rank of a job sends the same ones); a job whose
  // agents name none keeps none.
  if (hello.bucket_names_size() > 0 &&
      (!job.bucket_names ||
       !std::equal(job.bucket_names->begin(), job.bucket_names->end(), hello.bucket_names().begin(),
                   hello.bucket_names().end()))) {
    job.bucket_names = std::make_shared<const std::vector<std::string>>(
        hello.bucket_names().begin(), hello.bucket_names().end());
  }
  // A restarted collector learns the job's control from its agents (each states the newest
  // control it received); the newest generation wins, so `ctl` continues from what the ranks
  // apply instead of from the defaults.
  if (hello.has_control() &&
      (!job.control || hello.control().generation() > job.control->generation())) {
    job.control = hello.control();
  }
  attached->control = job.control;
  return {};
}

bool JobRegistry::Detach(const v1::Hello& hello, const std::shared_ptr<AgentStream>& stream,
                         absl::Time now) {
  auto it = jobs_.find(hello.job());
  if (it == jobs_.end()) return false;
  Job& job = it->second;
  if (job.streams.erase(stream) == 0) return false;
  if (job.connected > 0) --job.connected;
  auto claim = job.claims.find(hello.rank());
  if (claim != job.claims.end() && claim->second.streams > 0) --claim->second.streams;
  if (auto run = job.live_runs.find(hello.run_id()); run != job.live_runs.end()) {
    if (--run->second.streams == 0) job.live_runs.erase(run);
  }
  job.last_seen = now;
  return true;
}

uint32_t JobRegistry::Epoch(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.epoch;
}

SketchDimSchedule JobRegistry::SketchDims(const v1::Hello& hello) const {
  SketchDimSchedule dims{hello.sketch_dim()};
  auto it = jobs_.find(hello.job());
  if (it != jobs_.end() && it->second.control) {
    dims.retuned_dim = it->second.control->sketch_dim();
    dims.apply_at_step = it->second.control->apply_at_step();
  }
  return dims;
}

bool JobRegistry::NoteReport(const v1::Hello& hello, uint64_t step, uint64_t dropped_total,
                             absl::Time now, bool* dropped_changed) {
  auto it = jobs_.find(hello.job());
  if (it == jobs_.end()) return false;
  Job& job = it->second;
  job.last_seen = now;
  if (!job.has_step || step > job.newest_step) job.newest_step = step;
  job.has_step = true;
  if (job.dropped_forwarded.size() <= hello.rank()) job.dropped_forwarded.resize(hello.rank() + 1);
  std::optional<uint64_t>& forwarded = job.dropped_forwarded[hello.rank()];
  *dropped_changed = forwarded != dropped_total;
  forwarded = dropped_total;
  return true;
}

std::shared_ptr<const std::vector<std::string>> JobRegistry::BucketNames(
    const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? nullptr : it->second.bucket_names;
}

std::optional<JobRow> JobRegistry::StoredRow(const std::string& job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return std::nullopt;
  JobRow row;
  row.job = job;
  row.world_size = it->second.identity.world_size;
  row.sketch_dim = it->second.identity.sketch_dim;
  row.sketch_seed = it->second.identity.sketch_seed;
  row.attempt = it->second.epoch;
  row.first_seen = it->second.first_seen;
  row.last_seen = it->second.last_seen;
  return row;
}

absl::StatusOr<v1::Control> JobRegistry::UpdateControl(
    const std::string& job, std::optional<bool> enabled, std::optional<uint32_t> every,
    std::optional<uint32_t> sketch_dim, uint32_t lead_steps, absl::Time now,
    std::vector<std::shared_ptr<AgentStream>>* streams) {
  std::vector<Job*> targets;
  if (auto it = jobs_.find(job); it != jobs_.end()) {
    targets.push_back(&it->second);
  } else {
    // A job of several data-parallel groups: the control goes to every group ("JOB/GROUP").
    const std::string prefix = absl::StrCat(job, "/");
    for (auto& [key, j] : jobs_) {
      if (absl::StartsWith(key, prefix)) targets.push_back(&j);
    }
  }
  if (targets.empty()) {
    return absl::NotFoundError(absl::StrCat("job ", job, " is not known to this collector"));
  }
  // A field left out keeps the job's current value; with no control known and no rank connected
  // to state one (a collector that just restarted), that value is unknown: refuse rather than
  // fall back to the defaults, which would silently undo an earlier `ctl`.
  for (const Job* j : targets) {
    if (!j->control && j->connected == 0 && (!enabled || !every)) {
      return absl::UnavailableError(absl::StrCat(
          "no rank of job ", job,
          " is connected, so its current control is unknown (after a collector restart the "
          "ranks reconnect within their backoff, 10 s by default); retry then, or give both "
          "enabled and every"));
    }
  }
  std::optional<v1::Control> first;
  for (Job* j : targets) {
    v1::Control control = NextControl(*j, enabled, every, sketch_dim, lead_steps, now);
    j->control = control;
    streams->insert(streams->end(), j->streams.begin(), j->streams.end());
    if (!first) first = control;
  }
  return *first;
}

v1::Control JobRegistry::NextControl(const Job& j, std::optional<bool> enabled,
                                     std::optional<uint32_t> every,
                                     std::optional<uint32_t> sketch_dim, uint32_t lead_steps,
                                     absl::Time now) {
  v1::Control control;
  if (j.control) {
    control = *j.control;
  } else {
    control.set_enabled(true);
    control.set_every(1);
  }
  // Generations must keep increasing across collector restarts (agents ignore a generation
  // they have already passed), so they are at least the current time in microseconds.
  control.set_generation(
      std::max<uint64_t>(control.generation() + 1, static_cast<uint64_t>(absl::ToUnixMicros(now))));
  control.set_apply_at_step(j.newest_step + std::max<uint32_t>(lead_steps, 1));
  if (enabled) control.set_enabled(*enabled);
  if (every) control.set_every(*every);
  if (sketch_dim) control.set_sketch_dim(*sketch_dim);
  return control;
}

std::vector<JobSummary> JobRegistry::Summaries() const {
  std::vector<JobSummary> out;
  out.reserve(jobs_.size());
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

}  // namespace rankscope::collector
