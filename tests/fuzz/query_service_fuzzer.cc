// Fuzzes the Query service's request handling end to end: a real in-process Collector (port 0 on
// 127.0.0.1, a real SQLite file seeded with a job whose steps have missing ranks) answers
// ListJobs, RecentSteps, StepRange and SetControl requests whose bytes come from the fuzzer,
// through a real gRPC channel. Checks, from query_service.h and rankscope.proto:
//  - every call ends (deadline 10 s) with a documented code: OK, INVALID_ARGUMENT, NOT_FOUND,
//    FAILED_PRECONDITION or RESOURCE_EXHAUSTED; never INTERNAL, UNKNOWN or a crash;
//  - a job name outside [A-Za-z0-9_.:-]{1,128} is INVALID_ARGUMENT for every method that names a
//    job, and no error message is longer than 512 bytes (none echoes the request);
//  - RecentSteps returns at most its limit (default 20, at most 10,000) rows, newest first;
//    StepRange only steps in [first_step, last_step], ascending, at most its limit;
//  - every StepStats' missing_rank_ranges parses (collector/model/rank_ranges.h) and its count is
//    missing_count; missing_ranks lists at most 1,024.
//
// Input layout: u8 method (mod 4: ListJobs, RecentSteps, StepRange, SetControl), then the
// request's serialized bytes; bytes that do not parse as the request are used as its job name.
// A job name that is not valid UTF-8 is skipped: a proto3 string cannot carry it (the generated
// client refuses to send it and the server's generated parser, not the service, refuses it).
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "collector/model/rank_ranges.h"
#include "collector/store/sqlite_store.h"
#include "common/job_name.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "tests/fuzz/byte_reader.h"
#include "tests/fuzz/fuzz_check.h"

namespace rankscope::fuzz {
namespace {

namespace v1 = ::rankscope::v1;

constexpr char kJob[] = "seeded";
constexpr uint64_t kSteps = 40;

// One collector for the whole run (never destroyed: libFuzzer exits without returning).
struct Server {
  collector::Collector* collector = nullptr;
  std::unique_ptr<v1::Query::Stub> stub;
};

Server& TheServer() {
  static Server* const server = [] {
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in a parsed string is logged
    char dir[] = "/tmp/rankscope-query-fuzz-XXXXXX";
    FUZZ_CHECK(mkdtemp(dir) != nullptr);
    const std::string db = std::string(dir) + "/rankscope.db";
    {
      auto store = collector::SqliteStore::Open(db);
      FUZZ_CHECK(store.ok());
      collector::StoreBatch batch;
      collector::JobRow job;
      job.job = kJob;
      job.world_size = 10;
      job.sketch_dim = 4;
      job.last_step = kSteps;
      batch.jobs.push_back(job);
      for (uint64_t step = 1; step <= kSteps; ++step) {
        collector::StepWrite w;
        w.job = kJob;
        w.step = step;
        collector::StepRow row;
        row.step = step;
        row.ranks = 8;
        row.world_size = 10;
        row.missing_ranks = step % 2 == 0 ? "3,7" : "0-1";
        w.stats = row;
        for (uint32_t r : {2u, 4u}) {
          collector::RankRow rank;
          rank.rank = r;
          rank.join_size = 8;
          rank.loss = 1.0 + r;
          w.ranks.push_back(rank);
        }
        batch.steps.push_back(std::move(w));
      }
      FUZZ_CHECK((*store)->Write(batch).ok());
    }
    collector::CollectorOptions options;
    options.grpc_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.db_path = db;
    auto started = collector::Collector::Start(options);
    FUZZ_CHECK(started.ok());
    auto* s = new Server;
    s->collector = started->release();
    s->stub = v1::Query::NewStub(
        grpc::CreateChannel(s->collector->grpc_target(), grpc::InsecureChannelCredentials()));
    return s;
  }();
  return *server;
}

void CheckStatus(const grpc::Status& status) {
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      break;
    default:
      std::fprintf(stderr, "unexpected status %d: %s\n", status.error_code(),
                   status.error_message().c_str());
      std::abort();
  }
  FUZZ_CHECK(status.error_message().size() <= 512);
}

void CheckSteps(const google::protobuf::RepeatedPtrField<v1::StepStats>& steps) {
  for (const v1::StepStats& st : steps) {
    collector::RankRanges missing;
    FUZZ_CHECK(collector::ParseRankRanges(st.missing_rank_ranges(), &missing));
    FUZZ_CHECK(missing.count() == st.missing_count());
    FUZZ_CHECK(st.missing_ranks_size() <= 1024);
    FUZZ_CHECK(static_cast<uint64_t>(st.missing_ranks_size()) <= st.missing_count());
  }
}

// Whether `s` is well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool ValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (size_t j = 1; j <= n; ++j) {
      const auto d = static_cast<unsigned char>(s[i + j]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

template <typename Request>
Request Parse(absl::string_view bytes) {
  Request request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    request.Clear();
    request.set_job(std::string(bytes));
  }
  return request;
}

// A job name or a data-parallel group's key ("JOB/GROUP", common/job_name.h) is what a query may
// name; anything else is refused before any work.
void ExpectJobChecked(const std::string& job, const grpc::Status& status) {
  if (!IsValidGroupKey(job)) FUZZ_CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return ctx;
}

}  // namespace
}  // namespace rankscope::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rankscope::fuzz;  // NOLINT
  Server& server = TheServer();
  ByteReader in(data, size);
  const uint8_t method = in.U8() % 4;
  const absl::string_view bytes(reinterpret_cast<const char*>(data) + (size > 0 ? 1 : 0),
                                size > 0 ? size - 1 : 0);
  auto ctx = Context();
  switch (method) {
    case 0: {
      v1::ListJobsRequest request;
      v1::ListJobsResponse response;
      const grpc::Status status = server.stub->ListJobs(ctx.get(), request, &response);
      CheckStatus(status);
      FUZZ_CHECK(status.ok() && response.jobs_size() >= 1);
      break;
    }
    case 1: {
      const auto request = Parse<v1::RecentStepsRequest>(bytes);
      if (!ValidUtf8(request.job())) break;
      v1::RecentStepsResponse response;
      const grpc::Status status = server.stub->RecentSteps(ctx.get(), request, &response);
      CheckStatus(status);
      ExpectJobChecked(request.job(), status);
      const uint32_t limit = request.limit() == 0 ? 20 : std::min(request.limit(), 10000u);
      FUZZ_CHECK(static_cast<uint32_t>(response.steps_size()) <= limit);
      for (int i = 1; i < response.steps_size(); ++i) {
        FUZZ_CHECK(response.steps(i).step() < response.steps(i - 1).step());
      }
      CheckSteps(response.steps());
      break;
    }
    case 2: {
      const auto request = Parse<v1::StepRangeRequest>(bytes);
      if (!ValidUtf8(request.job())) break;
      v1::StepRangeResponse response;
      const grpc::Status status = server.stub->StepRange(ctx.get(), request, &response);
      CheckStatus(status);
      ExpectJobChecked(request.job(), status);
      const uint64_t last = request.last_step() == 0 ? UINT64_MAX : request.last_step();
      const uint32_t limit = request.limit() == 0 ? 10000 : std::min(request.limit(), 1000000u);
      FUZZ_CHECK(static_cast<uint32_t>(response.steps_size()) <= limit);
      for (int i = 0; i < response.steps_size(); ++i) {
        const uint64_t step = response.steps(i).step();
        FUZZ_CHECK(step >= request.first_step() && step <= last);
        if (i > 0) FUZZ_CHECK(step > response.steps(i - 1).step());
      }
      if (!request.include_ranks()) FUZZ_CHECK(response.ranks_size() == 0);
      CheckSteps(response.steps());
      break;
    }
    case 3: {
      const auto request = Parse<v1::ControlRequest>(bytes);
      if (!ValidUtf8(request.job())) break;
      v1::ControlResponse response;
      const grpc::Status status = server.stub->SetControl(ctx.get(), request, &response);
      CheckStatus(status);
      ExpectJobChecked(request.job(), status);
      break;
    }
  }
  return 0;
}
