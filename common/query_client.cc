#include "common/query_client.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <utility>

namespace rankscope::query {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<QueryClient>> QueryClient::Create(QueryClientOptions options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      tls::ChannelCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  if (options.max_receive_message_size != -1) {
    args.SetMaxReceiveMessageSize(options.max_receive_message_size);
  }
  tls::ApplyTargetName(options.tls, &args);
  auto stub = v1::Query::NewStub(grpc::CreateCustomChannel(options.address, *credentials, args));
  return std::unique_ptr<QueryClient>(new QueryClient(std::move(options), std::move(stub)));
}

QueryClient::QueryClient(QueryClientOptions options, std::unique_ptr<v1::Query::Stub> stub)
    : options_(std::move(options)), stub_(std::move(stub)) {}

void QueryClient::Prepare(grpc::ClientContext* ctx) const {
  if (!options_.auth_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMicroseconds(options_.timeout));
}

absl::StatusOr<v1::ListJobsResponse> QueryClient::ListJobs() {
  v1::ListJobsResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (grpc::Status s = stub_->ListJobs(&ctx, v1::ListJobsRequest(), &resp); !s.ok()) {
    return FromGrpcStatus(s);
  }
  return resp;
}

absl::StatusOr<v1::RecentStepsResponse> QueryClient::RecentSteps(
    const v1::RecentStepsRequest& request) {
  v1::RecentStepsResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (grpc::Status s = stub_->RecentSteps(&ctx, request, &resp); !s.ok()) {
    return FromGrpcStatus(s);
  }
  return resp;
}

absl::StatusOr<v1::ControlResponse> QueryClient::SetControl(const v1::ControlRequest& request) {
  v1::ControlResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (grpc::Status s = stub_->SetControl(&ctx, request, &resp); !s.ok()) {
    return FromGrpcStatus(s);
  }
  return resp;
}

absl::StatusOr<v1::StepRangeResponse> QueryClient::StepRange(const v1::StepRangeRequest& request) {
  v1::StepRangeResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (grpc::Status s = stub_->StepRange(&ctx, request, &resp); !s.ok()) {
    return FromGrpcStatus(s);
  }
  return resp;
}

absl::Status QueryClient::StepRangePaged(const StepRangeQuery& query, v1::StepRangeResponse* out) {
  const uint64_t first = query.first_step;
  const uint64_t last = query.last_step;
  const int max_rows = std::max(1, query.max_rows);
  const uint64_t page_rows = static_cast<uint64_t>(std::max(1, query.page_rows));
  const auto fetch = [&](uint64_t from, uint64_t to, bool ranks, uint32_t limit) {
    v1::StepRangeRequest req;
    req.set_job(query.job);
    req.set_first_step(from);
    req.set_last_step(to == std::numeric_limits<uint64_t>::max() ? 0 : to);
    req.set_include_ranks(ranks);
    req.set_limit(limit);
    return StepRange(req);
  };
  // Step rows page_rows at a time, resuming after the newest step of the previous page.
  uint64_t cursor = first;
  while (out->steps_size() < max_rows) {
    const uint32_t limit =
        static_cast<uint32_t>(std::min<uint64_t>(page_rows, max_rows - out->steps_size()));
    absl::StatusOr<v1::StepRangeResponse> page = fetch(cursor, last, false, limit);
    if (!page.ok()) return page.status();
    for (v1::StepStats& st : *page->mutable_steps()) *out->add_steps() = std::move(st);
    if (!page->truncated() || out->steps_size() == 0) break;
    const uint64_t next = out->steps(out->steps_size() - 1).step();
    if (next >= last) break;
    cursor = next + 1;
  }
  if (out->steps_size() >= max_rows) out->set_truncated(true);
  if (!query.include_ranks || out->steps_size() == 0) return absl::OkStatus();
  // Rank rows of the steps read, ~page_rows rows (page_rows / world_size steps) per request.
  const uint64_t world = std::max<uint64_t>(1, out->steps(0).world_size());
  const uint64_t chunk = std::max<uint64_t>(1, page_rows / world);
  const uint64_t end = out->steps(out->steps_size() - 1).step();
  std::set<std::pair<uint64_t, uint32_t>> windows_seen;
  for (uint64_t from = out->steps(0).step(); out->ranks_size() < max_rows;) {
    const uint64_t to = end - from < chunk ? end : from + chunk - 1;
    absl::StatusOr<v1::StepRangeResponse> page =
        fetch(from, to, true, static_cast<uint32_t>(max_rows));
    if (!page.ok()) return page.status();
    for (v1::RankStep& r : *page->mutable_ranks()) {
      if (out->ranks_size() >= max_rows) {
        out->set_truncated(true);
        break;
      }
      *out->add_ranks() = std::move(r);
    }
    // Downsampled windows overlap several pages: each once.
    out->set_downsampled_before_step(page->downsampled_before_step());
    for (v1::RankWindow& w : *page->mutable_rank_windows()) {
      if (!windows_seen.insert({w.first_step(), w.rank()}).second) continue;
      if (out->rank_windows_size() >= max_rows) {
        out->set_truncated(true);
        break;
      }
      *out->add_rank_windows() = std::move(w);
    }
    if (to == end) break;
    from = to + 1;
  }
  return absl::OkStatus();
}

}  // namespace rankscope::query
