#include "collector/web/web_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "collector/query/job_listing.h"
#include "collector/query/query_checks.h"
#include "collector/web/web_api.h"
#include "collector/web/web_assets.h"
#include "common/collector_shard.h"
#include "common/mutex.h"

namespace rankscope::collector {
namespace {

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Internal Server Error";
  }
}

// Writes one whole response. `extra_headers`: complete header lines ("Name: value\r\n").
void Respond(mg_connection* conn, int status, absl::string_view content_type,
             absl::string_view body, absl::string_view extra_headers = "", bool head_only = false) {
  const std::string head =
      absl::StrCat("HTTP/1.1 ", status, " ", Reason(status), "\r\nContent-Type: ", content_type,
                   "\r\nContent-Length: ", body.size(),
                   "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                   "Content-Security-Policy: default-src 'self'; img-src 'self' data:\r\n",
                   extra_headers, "Connection: close\r\n\r\n");
  mg_write(conn, head.data(), head.size());
  if (!head_only && !body.empty()) mg_write(conn, body.data(), body.size());
}

void RespondError(mg_connection* conn, const absl::Status& status, bool head_only) {
  const int http = HttpStatusFor(status);
  std::string extra;
  if (http == 401) extra = "WWW-Authenticate: Bearer realm=\"rankscope\"\r\n";
  if (http == 503) extra = "Retry-After: 1\r\n";
  Respond(conn, http, "application/json", ErrorJson(status), extra, head_only);
}

// What a read on the pool hands back to the waiting civetweb thread.
struct ReadResult {
  Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  std::string body ABSL_GUARDED_BY(mu);
  std::vector<JobListEntry> entries ABSL_GUARDED_BY(mu);  // a fleet's jobs request
};

// The job name of a job key "JOB" or "JOB/GROUP".
absl::string_view JobOfKey(absl::string_view key) { return key.substr(0, key.find('/')); }

std::optional<v1::JobInfo> FindJob(const std::vector<v1::JobInfo>& jobs, absl::string_view key) {
  auto it = std::lower_bound(jobs.begin(), jobs.end(), key,
                             [](const v1::JobInfo& a, absl::string_view k) { return a.job() < k; });
  if (it == jobs.end() || it->job() != key) return std::nullopt;
  return *it;
}

// The jobs this collector holds, each with its newest step (on a reader thread).
absl::StatusOr<std::vector<JobListEntry>> ReadJobEntries(std::vector<v1::JobInfo> jobs,
                                                         SqliteStore& reader) {
  std::vector<JobListEntry> entries;
  entries.reserve(jobs.size());
  for (v1::JobInfo& info : jobs) {
    JobListEntry entry;
    auto latest = reader.RecentSteps(info.job(), 1);
    if (!latest.ok()) return latest.status();
    if (!latest->empty()) entry.latest = std::move(latest->front());
    entry.info = std::move(info);
    entries.push_back(std::move(entry));
  }
  return entries;
}

// The reads of one API request on a reader thread; returns the JSON body. With `entries` (a
// fleet's jobs request), the jobs are left there for FleetJobsJson and the body is empty.
absl::StatusOr<std::string> ReadApi(const ApiRequest& request, SqliteStore& reader,
                                    const StepPipeline& pipeline,
                                    std::vector<JobListEntry>* entries = nullptr) {
  auto jobs = ListKnownJobs(reader, pipeline);
  if (!jobs.ok()) return jobs.status();
  if (request.route == ApiRequest::Route::kJobs) {
    auto read = ReadJobEntries(*std::move(jobs), reader);
    if (!read.ok()) return read.status();
    if (entries != nullptr) {
      *entries = *std::move(read);
      return std::string();
    }
    return JobsJson(*read);
  }
  const std::optional<v1::JobInfo> job = FindJob(*jobs, request.job);
  if (!job.has_value()) {
    // The name passed CheckQueryJobName: only [A-Za-z0-9_.:-/], safe to echo.
    return absl::NotFoundError(
        absl::StrCat("no job ", request.job, " on this collector (see /api/v1/jobs)"));
  }
  if (request.route == ApiRequest::Route::kSteps) {
    const StepWindow window = ResolveWindow(request, job->last_step(), kDefaultStepsWindow);
    auto steps =
        reader.StepRange(request.job, window.first, window.last, kStepRangeDefaultLimit + 1);
    if (!steps.ok()) return steps.status();
    const bool truncated = steps->size() > static_cast<size_t>(kStepRangeDefaultLimit);
    if (truncated) steps->resize(kStepRangeDefaultLimit);
    return StepsJson(request.job, window, *steps, truncated);
  }
  const StepWindow window = ResolveWindow(request, job->last_step(), kDefaultRanksWindow);
  if (request.rank.has_value()) {
    auto rows = reader.RankSeriesInRange(request.job, *request.rank, window.first, window.last,
                                         kStepRangeMaxLimit + 1);
    if (!rows.ok()) return rows.status();
    const bool truncated = rows->size() > static_cast<size_t>(kStepRangeMaxLimit);
    if (truncated) rows->resize(kStepRangeMaxLimit);
    return RankSeriesJson(request.job, window, *request.rank, *rows, truncated,
                          pipeline.BucketNames(request.job).get());
  }
  // The rank matrix. The cursor is taken before the reads: whatever commits after it is
  // answered again to the next request that passes it.
  const ChangeCursor cursor = pipeline.changes().Now();
  // The step ranges to read, ascending and disjoint: the held steps that changed (or all of
  // them, resync), then the new ones.
  std::vector<StepWindow> ranges;
  StepWindow answered = window;
  bool resync = false;
  if (request.changes.has_value()) {
    const StepWindow held = HeldWindow(request, job->last_step(), kDefaultRanksWindow);
    if (held.first <= held.last) {
      const StepChangeLog::Changes changed = pipeline.changes().StepsChangedSince(
          request.job, *request.changes, held.first, held.last);
      resync = !changed.complete;
      if (resync) {
        ranges.push_back(held);
      } else {
        for (uint64_t step : changed.steps) {
          if (!ranges.empty() && ranges.back().last + 1 == step) {
            ranges.back().last = step;
          } else {
            ranges.push_back(StepWindow{step, step});
          }
        }
      }
      answered.first = std::min(answered.first, held.first);
    }
  }
  // Without since, a changes request's window is the held one: nothing newer is asked for.
  if (!request.changes.has_value() || request.since.has_value()) {
    if (!ranges.empty() && ranges.back().last >= window.first) {
      ranges.back().last = std::max(ranges.back().last, window.last);  // overlap (not expected)
    } else {
      ranges.push_back(window);
    }
  }
  std::vector<StepRankRow> rows;
  for (const StepWindow& range : ranges) {
    if (rows.size() > static_cast<size_t>(kStepRangeMaxLimit)) break;
    auto read = reader.RankRowsInRange(request.job, range.first, range.last,
                                       kStepRangeMaxLimit + 1 - static_cast<int>(rows.size()));
    if (!read.ok()) return read.status();
    rows.insert(rows.end(), std::make_move_iterator(read->begin()),
                std::make_move_iterator(read->end()));
  }
  const bool truncated = rows.size() > static_cast<size_t>(kStepRangeMaxLimit);
  if (truncated) {
    // Whole steps only: drop the step the limit cut.
    const uint64_t cut = rows[kStepRangeMaxLimit].step;
    rows.resize(kStepRangeMaxLimit);
    while (rows.size() > 1 && rows.back().step == cut) rows.pop_back();
  }
  // Steps whose rank rows retention downsampled: their rank_windows rows too (not for a
  // changes-only answer, which holds the changed steps alone).
  absl::StatusOr<uint64_t> before = reader.DownsampledBefore(request.job);
  if (!before.ok()) return before.status();
  std::vector<RankWindowRow> windows;
  const bool whole = !request.changes.has_value() || resync;
  if (whole && *before > answered.first) {
    auto read = reader.RankWindowsInRange(request.job, answered.first,
                                          std::min(answered.last, *before - 1), kStepRangeMaxLimit);
    if (!read.ok()) return read.status();
    windows = *std::move(read);
  }
  return WithChanges(
      RanksJson(request.job, answered, job->world_size(), rows, truncated, *before, windows),
      cursor, resync);
}

// Opens and closes one TCP connection to the server listening on `address` (civetweb syntax,
// "host:port" or "port") at `port`; a wildcard host is reached on 127.0.0.1. Best effort.
void PokeListener(const std::string& address, int port) {
  std::string host = "127.0.0.1";
  const size_t colon = address.rfind(':');
  if (colon != std::string::npos && colon > 0) {
    host = address.substr(0, colon);
    if (host == "0.0.0.0") host = "127.0.0.1";
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) return;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  (void)connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  close(fd);
}

}  // namespace

WebServer::WebServer(WebServerOptions options, const StepPipeline* pipeline,
                     StoreReaderPool* readers)
    : options_(std::move(options)), pipeline_(pipeline), readers_(readers) {}

absl::StatusOr<std::unique_ptr<WebServer>> WebServer::Start(WebServerOptions options,
                                                            const StepPipeline* pipeline,
                                                            StoreReaderPool* readers) {
  mg_init_library(0);
  std::unique_ptr<WebServer> server(new WebServer(std::move(options), pipeline, readers));
  for (const std::string& address : server->options_.fleet) {
    query::QueryClientOptions shard;
    shard.address = address;
    shard.auth_token = server->options_.auth_token;
    shard.timeout = server->options_.fleet_timeout;
    auto client = query::QueryClient::Create(std::move(shard));
    if (!client.ok()) return client.status();
    server->shards_.push_back(*std::move(client));
  }
  const std::string threads = std::to_string(std::max<size_t>(server->options_.threads, 1));
  const std::string timeout_ms = std::to_string(
      std::max<int64_t>(absl::ToInt64Milliseconds(server->options_.request_timeout), 1));
  const char* civet_options[] = {"listening_ports",
                                 server->options_.address.c_str(),
                                 "num_threads",
                                 threads.c_str(),
                                 "request_timeout_ms",
                                 timeout_ms.c_str(),
                                 "enable_directory_listing",
                                 "no",
                                 nullptr};
  mg_callbacks callbacks{};
  // civetweb logs bind failures itself; the caller reports them with the flag named.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  server->context_ = mg_start(&callbacks, nullptr, civet_options);
  if (server->context_ == nullptr) {
    mg_exit_library();
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", server->options_.address,
                                               " (in use, or not a local address?)"));
  }
  mg_set_request_handler(server->context_, "/", &WebServer::HandleRequest, server.get());
  mg_server_port ports[4];
  const int n = mg_get_server_ports(server->context_, 4, ports);
  server->port_ = n > 0 ? ports[0].port : 0;
  return server;
}

WebServer::~WebServer() { Stop(); }

void WebServer::Stop() {
  if (context_ == nullptr) return;
  // civetweb's listening thread sees the stop flag only when its poll() returns: every 2 s, or
  // when a connection arrives. mg_stop runs on its own thread while this one connects to the
  // server until it has stopped, so a stop takes milliseconds, not 2 s. When the address cannot
  // be reached that way (an IPv6 or a non-local address), the stop takes up to the 2 s.
  std::atomic<bool> stopped{false};
  std::thread stopper([this, &stopped] {
    mg_stop(context_);
    stopped.store(true);
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(3);
  while (!stopped.load() && absl::Now() < give_up) {
    PokeListener(options_.address, port_);
    absl::SleepFor(absl::Milliseconds(10));
  }
  stopper.join();
  context_ = nullptr;
  mg_exit_library();
}

int WebServer::HandleRequest(mg_connection* conn, void* self) {
  static_cast<WebServer*>(self)->Serve(conn);
  return 1;  // handled
}

void WebServer::Serve(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  const absl::string_view method = info->request_method ? info->request_method : "";
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    Respond(conn, 405, "application/json",
            ErrorJson(absl::InvalidArgumentError("only GET and HEAD are served")),
            "Allow: GET, HEAD\r\n");
    return;
  }
  const std::string path = info->local_uri_raw ? info->local_uri_raw : "/";
  const std::string query = info->query_string ? info->query_string : "";
  absl::string_view rest = path;
  if (absl::ConsumePrefix(&rest, "/api/v1")) {
    ServeApi(conn, std::string(rest), query);
    return;
  }
  const WebAsset* asset = nullptr;
  if (path == "/" || path == "/index.html" || absl::StartsWith(path, "/job/")) {
    asset = FindWebAsset("app.html");
  } else if (absl::ConsumePrefix(&rest, "/static/")) {
    asset = FindWebAsset(rest);
  }
  if (asset == nullptr) {
    RespondError(conn, absl::NotFoundError("no such page: try / or /api/v1/jobs"), head);
    return;
  }
  Respond(conn, 200, asset->content_type, asset->body, "", head);
}

void WebServer::ServeApi(mg_connection* conn, const std::string& path, const std::string& query) {
  const bool head = absl::string_view(mg_get_request_info(conn)->request_method) == "HEAD";
  const char* authorization = mg_get_header(conn, "Authorization");
  const TokenCheck token =
      CheckBearerToken(authorization ? authorization : "", options_.auth_token);
  if (token != TokenCheck::kOk) {
    const std::string message(TokenRefusalMessage(token));
    RespondError(conn,
                 token == TokenCheck::kMissing ? absl::UnauthenticatedError(message)
                                               : absl::PermissionDeniedError(message),
                 head);
    return;
  }
  absl::StatusOr<ApiRequest> request = ParseApiRequest(path, query);
  if (!request.ok()) {
    RespondError(conn, request.status(), head);
    return;
  }
  auto result = std::make_shared<ReadResult>();
  const StepPipeline* pipeline = pipeline_;
  const bool fleet_jobs = !shards_.empty() && request->route == ApiRequest::Route::kJobs;
  const bool fleet_job = !shards_.empty() && request->route != ApiRequest::Route::kJobs;
  const std::string job_key = request->job;
  absl::Status queued = readers_->Submit(
      [result, pipeline, fleet_jobs, request = *std::move(request)](SqliteStore& reader) {
        std::vector<JobListEntry> entries;
        absl::StatusOr<std::string> body =
            ReadApi(request, reader, *pipeline, fleet_jobs ? &entries : nullptr);
        MutexLock lock(&result->mu);
        result->status = body.status();
        if (body.ok()) result->body = *std::move(body);
        result->entries = std::move(entries);
        result->done = true;
      });
  if (!queued.ok()) {
    RespondError(conn, queued, head);
    return;
  }
  absl::Status status;
  std::string body;
  std::vector<JobListEntry> entries;
  {
    MutexLock lock(&result->mu);
    const bool done =
        result->mu.AwaitWithTimeout(absl::Condition(&result->done), options_.read_timeout);
    if (!done) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "the read did not finish within ", absl::FormatDuration(options_.read_timeout),
          " (the collector's store is busy); retry with backoff"));
    } else {
      status = result->status;
      body = std::move(result->body);
      entries = std::move(result->entries);
    }
  }
  if (status.ok() && fleet_jobs) body = FleetJobsJson(std::move(entries));
  if (fleet_job && status.code() == absl::StatusCode::kNotFound) {
    // The name passed CheckQueryJobName: safe to echo.
    status = absl::NotFoundError(absl::StrCat(
        status.message(), "; in this fleet job ", JobOfKey(job_key), " is on ",
        PickCollector(options_.fleet, JobOfKey(job_key)), " (open that collector's web view)"));
  }
  if (!status.ok()) {
    RespondError(conn, status, head);
    return;
  }
  Respond(conn, 200, "application/json", body, "", head);
}

std::string WebServer::FleetJobsJson(std::vector<JobListEntry> local) const {
  absl::flat_hash_set<std::string> keys;
  for (JobListEntry& entry : local) {
    keys.insert(entry.info.job());
    entry.collector = PickCollector(options_.fleet, JobOfKey(entry.info.job()));
  }
  std::vector<std::string> unreachable;
  for (const auto& shard : shards_) {
    absl::StatusOr<v1::ListJobsResponse> jobs = shard->ListJobs();
    if (!jobs.ok()) {
      unreachable.push_back(shard->options().address);
      continue;
    }
    for (const v1::JobInfo& info : jobs->jobs()) {
      // This collector's own jobs (it is in the list too) come from its store, with their step.
      if (!keys.insert(info.job()).second) continue;
      JobListEntry& entry = local.emplace_back();
      entry.info = info;
      entry.collector = shard->options().address;
      entry.remote = true;
    }
  }
  std::sort(local.begin(), local.end(), [](const JobListEntry& a, const JobListEntry& b) {
    return a.info.job() < b.info.job();
  });
  return JobsJson(local, unreachable);
}

}  // namespace rankscope::collector
