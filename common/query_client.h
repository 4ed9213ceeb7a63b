// A client of the collector's Query service, shared by the CLI (tools/cli/) and the
// Python package (rankscope._native.set_control): one channel with the collector's TLS settings
// (common/client_tls.h), every call with the same deadline and, when set, the shared bearer
// token, and StepRange paged so that no response nears gRPC's message size limit.
//
// Errors carry the gRPC status's code and message unchanged (absl and gRPC codes share their
// numbers): kUnavailable is most likely a collector that is down or a refused TLS handshake
// (retry later or fix the TLS settings); other codes are the collector's answer to the request.
//
// Thread safety: a QueryClient may be used from several threads at once (gRPC stubs are).
#ifndef RANKSCOPE_COMMON_QUERY_CLIENT_H_
#define RANKSCOPE_COMMON_QUERY_CLIENT_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/client_tls.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

namespace rankscope::query {

struct QueryClientOptions {
  std::string address = "127.0.0.1:50051";     // the collector's gRPC host:port
  tls::ClientTlsFiles tls;                     // plaintext when !tls.enabled()
  std::string auth_token;                      // sent as "authorization: Bearer <token>" if set
  absl::Duration timeout = absl::Seconds(10);  // deadline of each call (each page)
  int max_receive_message_size = -1;           // bytes; -1: gRPC's default
};

// A StepRange read spread over as many requests as it takes.
struct StepRangeQuery {
  std::string job;
  uint64_t first_step = 0;
  uint64_t last_step = std::numeric_limits<uint64_t>::max();  // inclusive; max: the newest
  bool include_ranks = false;
  int max_rows = 1000000;  // at most this many rows of each table (then `truncated` is set)
  int page_rows = 10000;   // rows per request
};

// Converts a gRPC status to an absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

class QueryClient {
 public:
  // Builds the channel credentials (errors: NotFound / InvalidArgument naming a TLS file, as
  // tls::ChannelCredentials returns them; not retryable). Does not connect.
  static absl::StatusOr<std::unique_ptr<QueryClient>> Create(QueryClientOptions options);

  const QueryClientOptions& options() const { return options_; }

  absl::StatusOr<v1::ListJobsResponse> ListJobs();
  absl::StatusOr<v1::RecentStepsResponse> RecentSteps(const v1::RecentStepsRequest& request);
  absl::StatusOr<v1::ControlResponse> SetControl(const v1::ControlRequest& request);
  // One request, one response (possibly truncated at request.limit()).
  absl::StatusOr<v1::StepRangeResponse> StepRange(const v1::StepRangeRequest& request);

  // Appends the job's step rows in [first_step, last_step], oldest first, at most max_rows of
  // them (page_rows per request), then, with include_ranks, the rank rows of those steps, a few
  // steps (about page_rows rows) per request, at most max_rows, with the rank_windows of those
  // steps where the rank rows were downsampled (and downsampled_before_step). Every stored row
  // comes exactly once; out->truncated() is set when max_rows cut either list. On an error `out`
  // holds the rows read so far.
  absl::Status StepRangePaged(const StepRangeQuery& query, v1::StepRangeResponse* out);

 private:
  QueryClient(QueryClientOptions options, std::unique_ptr<v1::Query::Stub> stub);

  // Sets the call's deadline and its token (every call goes through here).
  void Prepare(grpc::ClientContext* ctx) const;

  const QueryClientOptions options_;
  const std::unique_ptr<v1::Query::Stub> stub_;
};

}  // namespace rankscope::query

#endif  // RANKSCOPE_COMMON_QUERY_CLIENT_H_
