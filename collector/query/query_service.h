// QueryService: read-only queries and operator control (rankscope.v1.Query), callback API.
//
// ListJobs merges live state (connected ranks) with the SQLite jobs table; RecentSteps reads
// SQLite through a read-only connection (WAL lets it run beside the writer); StepRange reads step
// and rank rows of a step range the same way (export, report, the worst ranks of `show`);
// SetControl asks the pipeline to push a control message to every rank of a job.
//
// Reads never run on gRPC's callback threads: a reaction checks the token and the request, then
// hands the read to a StoreReaderPool and returns; the pool's thread reads, fills the response
// and Finishes the call. When the pool's queue is full the call ends at once with
// RESOURCE_EXHAUSTED (retry with backoff); every other status is the store's or the request
// check's, as it was when reads ran on the reaction.
//
// Authentication: when the collector has a shared token (--auth_token_file), every call must
// carry it as "authorization: Bearer <token>" metadata (UNAUTHENTICATED otherwise), as agents
// carry it in their hello; with mutual TLS, gRPC has verified the client's certificate before
// any call reaches the service.
//
// Thread safety: thread-safe, and holds no lock of its own. Reactions run on gRPC's callback
// threads; ListJobs, RecentSteps and StepRange finish on a StoreReaderPool thread, which owns the
// connection it reads (ListJobs also takes the pipeline's lock there, briefly). SetControl runs
// and finishes on the reaction (the pipeline's lock, no SQLite).
#ifndef RANKSCOPE_COLLECTOR_QUERY_QUERY_SERVICE_H_
#define RANKSCOPE_COLLECTOR_QUERY_QUERY_SERVICE_H_

#include <functional>
#include <string>

#include "collector/pipeline/pipeline.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/store_reader_pool.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

namespace rankscope::collector {

class QueryService final : public v1::Query::CallbackService {
 public:
  // `auth_token`: empty, or the shared token every call must carry.
  // `readers` must outlive the service's calls (the Collector stops it after the server).
  QueryService(StepPipeline* pipeline, StoreReaderPool* readers, std::string auth_token = "");

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
  // Runs `read` on a reader thread and Finishes the call with its status; Finishes at once with
  // the pool's refusal (RESOURCE_EXHAUSTED when full) if it cannot be queued.
  // ListJobs' work on a reader thread: the stored jobs merged with the pipeline's live ones.
  grpc::Status ListJobsOn(SqliteStore& reader, v1::ListJobsResponse* response);
  grpc::ServerUnaryReactor* FinishOnReader(grpc::CallbackServerContext* context,
                                           std::function<grpc::Status(SqliteStore&)> read);

  StepPipeline* const pipeline_;
  StoreReaderPool* const readers_;
  const std::string auth_token_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_QUERY_QUERY_SERVICE_H_
