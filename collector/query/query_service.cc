#include "collector/query/query_service.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collector/query/job_listing.h"
#include "collector/query/query_checks.h"
#include "collector/query/row_proto.h"
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

// Every Query method that names a job checks it first, with the rule the HTTP API shares
// (query_checks.h): a job name, or the key of one of its data-parallel groups ("JOB/GROUP").
grpc::Status CheckJobName(const std::string& job) { return ToGrpc(CheckQueryJobName(job)); }

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
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  const absl::string_view authorization =
      it == metadata.end() ? absl::string_view()
                           : absl::string_view(it->second.data(), it->second.size());
  if (CheckBearerToken(authorization, auth_token_) == TokenCheck::kOk) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      std::string(TokenRefusalMessage(TokenCheck::kMissing)));
}

grpc::ServerUnaryReactor* QueryService::ListJobs(grpc::CallbackServerContext* context,
                                                 const v1::ListJobsRequest* request,
                                                 v1::ListJobsResponse* response) {
  if (grpc::Status auth = CheckToken(context); !auth.ok()) return Done(context, auth);
  return FinishOnReader(
      context, [this, response](SqliteStore& reader) { return ListJobsOn(reader, response); });
}

grpc::Status QueryService::ListJobsOn(SqliteStore& reader, v1::ListJobsResponse* response) {
  auto jobs = ListKnownJobs(reader, *pipeline_);
  if (!jobs.ok()) return ToGrpc(jobs.status());
  for (v1::JobInfo& info : *jobs) *response->add_jobs() = std::move(info);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* QueryService::RecentSteps(grpc::CallbackServerContext* context,
                                                    const v1::RecentStepsRequest* request,
                                                    v1::RecentStepsResponse* response) {
  if (grpc::Status auth = CheckToken(context); !auth.ok()) return Done(context, auth);
  if (grpc::Status job = CheckJobName(request->job()); !job.ok()) return Done(context, job);
  const int limit =
      request->limit() == 0
          ? kRecentStepsDefaultLimit
          : static_cast<int>(std::min<uint32_t>(request->limit(), kRecentStepsMaxLimit));
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
  if (absl::Status range = CheckStepRange(request->first_step(), last); !range.ok()) {
    return Done(context, ToGrpc(range));
  }
  const int limit =
      request->limit() == 0
          ? kStepRangeDefaultLimit
          : static_cast<int>(std::min<uint32_t>(request->limit(), kStepRangeMaxLimit));
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
