// WebServer: the collector's web view and JSON API over HTTP (docs/DESIGN.md "Web view"), on its
// own civetweb server at --http_address.
//
//   GET /                 the jobs page          GET /static/NAME   an embedded asset
//   (web_assets.h) GET /job/JOB[?group=G] a job's live page     GET /api/v1/...    the JSON API
//   (web_api.h)
//
// Pages and assets hold no data and are served to anyone who reaches the address; the API
// applies the Query service's rules (query_checks.h): when the collector has a shared token,
// every API request must carry "Authorization: Bearer <token>" (401 without one, 403 with a
// wrong one), names and ranges are checked as Query checks them, and every SQLite read runs on
// the StoreReaderPool, never on civetweb's threads: a civetweb thread parses, queues the read
// and waits for it (at most `read_timeout`, then 504). A full pool queue is 503 with
// Retry-After, like Query's RESOURCE_EXHAUSTED.
//
// civetweb serves each connection on one of `threads` threads; a connection that has not sent
// its request within `request_timeout` is closed (as the /metrics server does), so slow clients
// cannot hold every thread.
//
// In a fleet (WebServerOptions::fleet) the jobs answer also asks every shard's Query service,
// on the civetweb thread serving the request, never on a reader thread.
//
// Thread safety: Start and the destructor (which stops the server and waits for its threads)
// are called by the Collector; handlers run on civetweb's threads and share only immutable
// state, the thread-safe StoreReaderPool and StepPipeline and the fleet's QueryClients
// (thread-safe). Stop it before the pool.
#ifndef RANKSCOPE_COLLECTOR_WEB_WEB_SERVER_H_
#define RANKSCOPE_COLLECTOR_WEB_WEB_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collector/pipeline/pipeline.h"
#include "collector/store/store_reader_pool.h"
#include "collector/web/web_api.h"
#include "common/query_client.h"

struct mg_context;
struct mg_connection;

namespace rankscope::collector {

struct WebServerOptions {
  std::string address = "127.0.0.1:0";  // civetweb listening_ports syntax without 's'/'r'
  size_t threads = 4;
  absl::Duration request_timeout = absl::Seconds(5);
  absl::Duration read_timeout = absl::Seconds(10);
  std::string auth_token;  // empty: no token required
  // A fleet of collectors (docs/deploy.md "A fleet of collectors"): the list its agents are given,
  // this collector among them. Non-empty: /api/v1/jobs also lists the jobs of every other shard
  // (each shard's Query.ListJobs, plaintext, with auth_token, at most fleet_timeout each; a shard
  // that does not answer is named in "unreachable"), each entry with the collector that holds
  // it; a job this collector does not hold is answered with 404 naming its shard.
  std::vector<std::string> fleet;
  absl::Duration fleet_timeout = absl::Seconds(2);
};

class WebServer {
 public:
  // Binds and serves. Errors: Unavailable when the address cannot be bound (in use, not local,
  // bad syntax). `pipeline` and `readers` must outlive the server.
  static absl::StatusOr<std::unique_ptr<WebServer>> Start(WebServerOptions options,
                                                          const StepPipeline* pipeline,
                                                          StoreReaderPool* readers);
  ~WebServer();  // Stop()
  WebServer(const WebServer&) = delete;
  WebServer& operator=(const WebServer&) = delete;

  // Stops accepting, finishes the requests being served and joins civetweb's threads.
  // Idempotent; call from one thread.
  void Stop();

  int port() const { return port_; }

 private:
  WebServer(WebServerOptions options, const StepPipeline* pipeline, StoreReaderPool* readers);
  static int HandleRequest(mg_connection* conn, void* self);
  void Serve(mg_connection* conn);
  void ServeApi(mg_connection* conn, const std::string& path, const std::string& query);
  // The jobs answer of a fleet: this collector's `local` entries and every other shard's jobs.
  std::string FleetJobsJson(std::vector<JobListEntry> local) const;

  const WebServerOptions options_;
  const StepPipeline* const pipeline_;
  StoreReaderPool* const readers_;
  std::vector<std::unique_ptr<query::QueryClient>> shards_;  // one per options_.fleet address
  mg_context* context_ = nullptr;                            // null once stopped
  int port_ = 0;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_WEB_WEB_SERVER_H_
