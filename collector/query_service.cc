#include "collector/query_service.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collector/row_proto.h"
#include "collector/validation.h"
#include "common/job_name.h"
#include "common/tsan.h"

namespace rankscope::collector {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, const grpc::Status& s) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RANKSCOPE_TSAN_RELEASE(reactor);  // gRPC reads the response written on this thread
  reactor->Finish(s);
  return reactor;
}

// Every Query method that names a job checks it first, with the ingest's rule: the name came over
// the wire, so the refusal never echoes it (any length, any bytes).
// A job name, or the key of one of its data-parallel groups ("JOB/GROUP", common/job_name.h).
grpc::Status CheckJobName(const std::string& job) {
  if (IsValidGroupKey(job)) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("job must be 1-128 characters of [A-Za-z0-9_.:-], or "
                                   "JOB/GROUP with a group of 1-64 (got ",
                                   job.size(), " bytes)"));
}

}  // namespace

QueryService::QueryService(StepPipeline* pipeline, StoreReaderPool* readers, std::string auth_token)
    : pipeline_(pipeline), readers_(readers), auth_token_(std::move(auth_token)) {}

grpc::ServerUnaryReactor* QueryService::FinishOnReader(
    grpc::CallbackServerContext* context, std::function<grpc::Status(SqliteStore&)> read) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RANKSCOPE_TSAN_RELEASE(reactor);  // the pool's thread reads the request
  absl::Status queued = readers_->Submit([reactor, read = std::move(read)](SqliteStore& reader) {
    RANKSCOPE_TSAN_ACQUIRE(reactor);
    const grpc::Status status = read(reader);
    RANKSCOPE_TSAN_RELEASE(reactor);
    reactor->Finish(status);
  });
  if (!queued.ok()) reactor->Finish(ToGrpc(queued));
  return reactor;
}

grpc::Status QueryService::CheckToken(const grpc::CallbackServerContext* context) const {
  if (auth_token_.empty()) return grpc::Status::OK;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it != metadata.end() &&
      std::string(it->second.data(), it->second.size()) == absl::StrCat("Bearer ", auth_token_)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or wrong auth token: the collector requires its shared token "
                      "(rankscope --auth_token_file)");
}

grpc::ServerUnaryReactor* QueryService::ListJobs(grpc::CallbackServerContext* context,
                                                 const v1::ListJobsRequest* request,
                                                 v1::ListJobsResponse* response) {
  if (grpc::Status auth = CheckToken(context); !auth.ok()) return Done(context, auth);
  return FinishOnReader(
      context, [this, response](SqliteStore& reader) { return ListJobsOn(reader, response); });
}

grpc::Status QueryService::ListJobsOn(SqliteStore& reader, v1::ListJobsResponse* response) {
  absl::flat_hash_map<std::string, v1::JobInfo> jobs;
  {
    auto stored = reader.ListJobs();
    if (!stored.ok()) return ToGrpc(stored.status());
    for (const JobRow& row : *stored) {
      v1::JobInfo& info = jobs[row.job];
      info.set_job(row.job);
      info.set_world_size(row.world_size);
      info.set_sketch_dim(row.sketch_dim);
      info.set_sketch_seed(row.sketch_seed);
      info.set_first_seen_unix_nanos(absl::ToUnixNanos(row.first_seen));
      info.set_last_seen_unix_nanos(absl::ToUnixNanos(row.last_seen));
      info.set_last_step(row.last_step);
      info.set_state("idle");
    }
  }
  for (const JobSummary& s : pipeline_->ListJobs()) {
    v1::JobInfo& info = jobs[s.job];
    info.set_job(s.job);
    info.set_world_size(s.identity.world_size);
    info.set_sketch_dim(s.identity.sketch_dim);
    info.set_sketch_seed(s.identity.sketch_seed);
    if (info.first_seen_unix_nanos() == 0) {
      info.set_first_seen_unix_nanos(absl::ToUnixNanos(s.first_seen));
    }
    info.set_last_seen_unix_nanos(
        std::max(info.last_seen_unix_nanos(), absl::ToUnixNanos(s.last_seen)));
    info.set_last_step(std::max(info.last_step(), s.newest_step));
    info.set_connected_ranks(s.connected);
    info.set_state(s.connected > 0 ? "active" : "idle");
  }
  std::vector<std::string> names;
  for (const auto& [name, info] : jobs) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) *response->add_jobs() = std::move(jobs[name]);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* QueryService::RecentSteps(grpc::CallbackServerContext* context,
                                                    const v1::RecentStepsRequest* request,
                                                    v1::RecentStepsResponse* response) {
  if (grpc::Status auth = CheckToken(context); !auth.ok()) return Done(context, auth);
  if (grpc::Status job = CheckJobName(request->job()); !job.ok()) return Done(context, job);
  int limit = request->limit() == 0 ? 20 : static_cast<int>(std::min(request->limit(), 10000u));
  return FinishOnReader(context, [request, response, limit](SqliteStore& reader) {
    auto rows = reader.RecentSteps(request->job(), limit);
    if (!rows.ok()) return ToGrpc(rows.status());
    for (const StepRow& row : *rows) FillStepStats(row, response->add_steps());
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* QueryService::StepRange(grpc::CallbackServerContext* context,
                                                  const v1::StepRangeRequest* request,
                                                  v1::StepRangeResponse* response) {
  if (grpc::Status auth = CheckToken(context); !auth.ok()) return Done(context, auth);
  if (grpc::Status job = CheckJobName(request->job()); !job.ok()) return Done(context, job);
  const uint64_t last =
      request->last_step() == 0 ? std::numeric_limits<uint64_t>::max() : request->last_step();
  if (request->first_step() > last) {
    return Done(context, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                      absl::StrCat("first_step ", request->first_step(),
                                                   " > last_step ", last)));
  }
  const int limit =
      request->limit() == 0 ? 10000 : static_cast<int>(std::min(request->limit(), 1000000u));
  return FinishOnReader(context, [request, response, last, limit](SqliteStore& reader) {
    // One more than the limit tells whether the response is truncated.
    auto steps = reader.StepRange(request->job(), request->first_step(), last, limit + 1);
    if (!steps.ok()) return ToGrpc(steps.status());
    if (steps->size() > static_cast<size_t>(limit)) {
      steps->resize(limit);
      response->set_truncated(true);
    }
    for (const StepRow& row : *steps) FillStepStats(row, response->add_steps());
    if (request->include_ranks()) {
      auto ranks = reader.RankRowsInRange(request->job(), request->first_step(), last, limit + 1);
      if (!ranks.ok()) return ToGrpc(ranks.status());
      if (ranks->size() > static_cast<size_t>(limit)) {
        ranks->resize(limit);
        response->set_truncated(true);
      }
      for (const StepRankRow& row : *ranks) FillRankStep(row, response->add_ranks());
      // Where the full rank rows were pruned, the downsampled rank_windows (and say so).
      if (absl::Status s =
              FillRankWindows(reader, request->job(), request->first_step(), last, limit, response);
          !s.ok()) {
        return ToGrpc(s);
      }
    }
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* QueryService::SetControl(grpc::CallbackServerContext* context,
                                                   const v1::ControlRequest* request,
                                                   v1::ControlResponse* response) {
  if (grpc::Status auth = CheckToken(context); !auth.ok()) return Done(context, auth);
  if (grpc::Status job = CheckJobName(request->job()); !job.ok()) return Done(context, job);
  std::optional<bool> enabled;
  std::optional<uint32_t> every, sketch_dim;
  if (request->has_enabled()) enabled = request->enabled();
  if (request->has_every()) every = request->every();
  if (request->has_sketch_dim()) sketch_dim = request->sketch_dim();
  const uint32_t lead = request->lead_steps() == 0 ? 5 : request->lead_steps();
  auto result = pipeline_->SetControl(request->job(), enabled, every, sketch_dim, lead);
  if (!result.ok()) return Done(context, ToGrpc(result.status()));
  *response->mutable_control() = result->first;
  response->set_ranks_notified(result->second);
  return Done(context, grpc::Status::OK);
}

}  // namespace rankscope::collector
