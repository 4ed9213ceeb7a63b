// Collector: the daemon's parts wired together, with its servers.
//
//   gRPC server (Ingest + Query + grpc.health.v1) ─► StepPipeline ─► StoreWriter ─► SQLite
//   HTTP /metrics (prometheus-cpp Exposer) ◄─ JobMetrics + HealthMetrics registry
//   HTTP web view + JSON API (WebServer, --http_address) ─► StoreReaderPool ─► SQLite (read-only)
//
// Start() binds everything (port 0 picks free ports, see grpc_port()/metrics_port()) and
// returns once it serves. Shutdown() stops accepting, ends the streams and queries, stops the
// query readers, closes the open steps and commits what it has.
//
// Thread safety: Shutdown and the accessors are thread-safe. Threads: gRPC's callback threads
// (Ingest and Query reactions), the pipeline's step thread, the StoreWriter thread,
// `query_threads` StoreReaderPool threads (Query and web API reads), prometheus-cpp's HTTP
// threads, the WebServer's civetweb threads.
#ifndef RANKSCOPE_COLLECTOR_COLLECTOR_H_
#define RANKSCOPE_COLLECTOR_COLLECTOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collector/ingest/ingest_service.h"
#include "collector/metrics/health_metrics.h"
#include "collector/metrics/prometheus_export.h"
#include "collector/pipeline/pipeline.h"
#include "collector/query/query_service.h"
#include "collector/store/store_reader_pool.h"
#include "collector/web/web_server.h"
#include "common/keepalive.h"
#include "common/mutex.h"
#include "grpcpp/grpcpp.h"

namespace prometheus {
class Exposer;
}

namespace rankscope::collector {

// TLS of the gRPC port (Ingest and Query share it). Off (plaintext) when every field is empty.
//   cert_file + key_file:                  server-side TLS; agents verify the collector, the
//                                          collector asks for no client certificate.
//   cert_file + key_file + client_ca_file: mutual TLS; every client (agent, CLI) must present a
//                                          certificate signed by client_ca_file, or its
//                                          handshake is refused before any RPC.
// client_ca_file without cert_file/key_file is an error.
// The three files are read again every reload_interval (gRPC's FileWatcherCertificateProvider):
// a certificate and key, or a client CA bundle, replaced on disk are used by every handshake after
// the next read, without a restart; connections already made keep their streams. Replace each file
// atomically (write beside it, then rename over it, as cert-manager's symlink swap does): a file
// read half-written fails the handshakes until the next read.
struct ServerTlsOptions {
  std::string cert_file;       // PEM certificate chain of the collector
  std::string key_file;        // PEM private key of cert_file (unencrypted)
  std::string client_ca_file;  // PEM CA bundle that signs the clients' certificates
  absl::Duration reload_interval = absl::Seconds(60);  // whole seconds, at least 1
  bool enabled() const {
    return !cert_file.empty() || !key_file.empty() || !client_ca_file.empty();
  }
  bool mutual() const { return !client_ca_file.empty(); }
};

struct CollectorOptions {
  std::string grpc_address = "127.0.0.1:50051";
  std::string metrics_address = "127.0.0.1:9464";  // empty: no HTTP endpoint
  // The HTTP server (civetweb, one thread per connection): its worker threads, and how long one
  // connection may take to send its request (and read the answer) before it is dropped. Clients
  // that never finish their headers hold a thread each for at most metrics_request_timeout; with
  // fewer of them than metrics_threads a scrape is answered at once.
  size_t metrics_threads = 8;
  absl::Duration metrics_request_timeout = absl::Seconds(5);
  // The web view and its JSON API (web_server.h): empty (the default here; the collector's
  // --http_address flag defaults to 127.0.0.1:9465) serves none. Its own civetweb server, with
  // the same thread and timeout rules as /metrics; the API's reads share the Query readers.
  std::string http_address;
  size_t http_threads = 8;
  absl::Duration http_request_timeout = absl::Seconds(5);
  // The fleet this collector is a shard of (WebServerOptions::fleet): the web view lists every
  // shard's jobs. Empty: a lone collector.
  std::vector<std::string> fleet;
  std::string db_path = "rankscope.db";
  PipelineOptions pipeline;
  ExportOptions export_options;
  // Threads serving the Query service's SQLite reads, each with its own read-only connection,
  // and the queries that may wait for them before more are refused with RESOURCE_EXHAUSTED.
  size_t query_threads = 2;
  size_t max_queued_queries = 256;
  size_t max_streams = 10'000;
  int max_message_bytes = 8 << 20;
  // See IngestOptions: a stream's first message must come within this; per-stream queue bounds.
  absl::Duration hello_timeout = absl::Seconds(5);
  // Server keepalive (--grpc_keepalive_time/--grpc_keepalive_timeout): every connection is pinged
  // after keepalive_time without activity and closed when the ping is unanswered after
  // keepalive_timeout, which cancels its streams (their ranks are released). A node that died
  // without a FIN, or a process that stopped answering, lets go of its ranks within
  // keepalive_time + keepalive_timeout (30 s by default). <= 0: gRPC's defaults (2 h).
  absl::Duration keepalive_time = keepalive::kServerPingInterval;
  absl::Duration keepalive_timeout = keepalive::kServerPingTimeout;
  // What the collector accepts of the agents' pings (--grpc_agent_min_ping_interval, ...).
  keepalive::AgentPingPolicy agent_pings;
  size_t max_queued_messages_per_stream = 1024;
  size_t max_pending_acks_per_stream = 65'536;
  ServerTlsOptions tls;
};

class Collector {
 public:
  // Errors: InvalidArgument or NotFound naming the flag when a TLS file is missing, unreadable,
  // not PEM, or the key does not match the certificate; Unavailable when an address cannot be
  // bound; the store's errors when the database cannot be opened.
  static absl::StatusOr<std::unique_ptr<Collector>> Start(CollectorOptions options);
  ~Collector();

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  int http_port() const { return web_ == nullptr ? 0 : web_->port(); }
  std::string grpc_target() const { return "127.0.0.1:" + std::to_string(grpc_port_); }

  // Waits until everything ingested so far is joined-and-stored or still open (tests).
  bool Flush(absl::Duration timeout) { return pipeline_->Flush(timeout); }

  // Stops the gRPC server (streams are cancelled after `timeout`/2), then closes every open
  // step and commits. Idempotent.
  absl::Status Shutdown(absl::Duration timeout);

  StepPipeline& pipeline() { return *pipeline_; }
  HealthMetrics& health() { return *health_; }
  StoreReaderPool& query_readers() { return *readers_; }
  std::shared_ptr<JobMetrics> job_metrics() { return metrics_; }

 private:
  Collector() = default;
  // Start's steps, in order, each from options_. BuildServices: the store's connections (one
  // writer, the readers), the pipeline, the ingest and query services, the reader pool.
  // ServeGrpc: the gRPC server (health service, keepalive, message limit, the Query parse-error
  // interceptor) on grpc_address. ServeMetrics: /metrics on metrics_address, if set. ServeWeb: the
  // web view on http_address, if set. A failure is returned as is; Start then destroys the
  // collector, whose Shutdown stops what had started.
  absl::Status BuildServices();
  absl::Status ServeGrpc(const std::shared_ptr<grpc::ServerCredentials>& credentials);
  absl::Status ServeMetrics();
  absl::Status ServeWeb();

  CollectorOptions options_;
  std::unique_ptr<HealthMetrics> health_;
  std::shared_ptr<JobMetrics> metrics_;
  std::unique_ptr<StepPipeline> pipeline_;
  std::unique_ptr<IngestService> ingest_;
  std::unique_ptr<StoreReaderPool> readers_;
  std::unique_ptr<QueryService> query_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<WebServer> web_;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  absl::Status shutdown_status_ ABSL_GUARDED_BY(shutdown_mu_);
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_COLLECTOR_H_
