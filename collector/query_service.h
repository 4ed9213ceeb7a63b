// QueryService: read-only queries and operator control (rankscope.v1.Query), callback API.
//
// ListJobs merges live state (connected ranks) with the SQLite jobs table; RecentSteps reads
// SQLite through the service's own read connection (WAL lets it run beside the writer);
// StepRange reads step and rank rows of a step range the same way (export, report, the worst
// ranks of `show`); SetControl asks the pipeline to push a control message to every rank of a job.
//
// Authentication: when the collector has a shared token (--auth_token_file), every call must
// carry it as "authorization: Bearer <token>" metadata (UNAUTHENTICATED otherwise), as agents
// carry it in their hello; with mutual TLS, gRPC has verified the client's certificate before
// any call reaches the service.
//
// Thread safety: thread-safe; the read connection is guarded by mu_.
#ifndef RANKSCOPE_COLLECTOR_QUERY_SERVICE_H_
#define RANKSCOPE_COLLECTOR_QUERY_SERVICE_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "collector/pipeline.h"
#include "collector/sqlite_store.h"
#include "common/mutex.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

namespace rankscope::collector {

class QueryService final : public v1::Query::CallbackService {
 public:
  // `auth_token`: empty, or the shared token every call must carry.
  QueryService(StepPipeline* pipeline, std::unique_ptr<SqliteStore> reader,
               std::string auth_token = "");

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* RecentSteps(grpc::CallbackServerContext* context,
                                        const v1::RecentStepsRequest* request,
                                        v1::RecentStepsResponse* response) override;
  grpc::ServerUnaryReactor* SetControl(grpc::CallbackServerContext* context,
                                       const v1::ControlRequest* request,
                                       v1::ControlResponse* response) override;
  grpc::ServerUnaryReactor* StepRange(grpc::CallbackServerContext* context,
                                      const v1::StepRangeRequest* request,
                                      v1::StepRangeResponse* response) override;

 private:
  // OK when no token is required or the call carries it; else UNAUTHENTICATED.
  grpc::Status CheckToken(const grpc::CallbackServerContext* context) const;

  StepPipeline* const pipeline_;
  const std::string auth_token_;
  Mutex mu_;
  std::unique_ptr<SqliteStore> reader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_QUERY_SERVICE_H_
