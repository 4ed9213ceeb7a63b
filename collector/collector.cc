#include "collector/collector.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collector/query/parse_error_interceptor.h"
#include "common/keepalive.h"
#include "common/tls_files.h"
#include "grpc/grpc.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "prometheus/exposer.h"

namespace rankscope::collector {
namespace {

// The gRPC port's credentials: insecure, TLS, or mutual TLS (see ServerTlsOptions).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const ServerTlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls_cert_file and --tls_key_file (--tls_client_ca_file alone cannot "
        "serve TLS: mutual TLS is server TLS plus client certificates)");
  }
  if (tls.reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_reload_interval must be at least 1s, not ",
                     absl::FormatDuration(tls.reload_interval)));
  }
  tls::PemPaths paths;
  paths.cert_file = tls.cert_file;
  paths.key_file = tls.key_file;
  paths.ca_file = tls.client_ca_file;
  paths.cert_name = "--tls_cert_file";
  paths.key_name = "--tls_key_file";
  paths.ca_name = "--tls_client_ca_file";
  auto pem = tls::LoadPemFiles(paths);
  if (!pem.ok()) return pem.status();
  // The files were checked above; from here gRPC's file watcher re-reads them every
  // reload_interval, so a certificate, key or client CA replaced on disk serves every handshake
  // after the next read, and connections already made keep their streams.
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key_file, tls.cert_file, tls.client_ca_file,
      static_cast<unsigned int>(std::max<int64_t>(absl::ToInt64Seconds(tls.reload_interval), 1)));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (tls.mutual()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Collector>> Collector::Start(CollectorOptions options) {
  // TLS files are checked first: a bad file must not leave a database or a port behind.
  auto credentials = ServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<Collector> c(new Collector());
  c->options_ = options;
  // On a failure the half-started collector is destroyed: Shutdown stops what had started.
  if (absl::Status st = c->BuildServices(); !st.ok()) return st;
  if (absl::Status st = c->ServeGrpc(*credentials); !st.ok()) return st;
  if (absl::Status st = c->ServeMetrics(); !st.ok()) return st;
  if (absl::Status st = c->ServeWeb(); !st.ok()) return st;
  return c;
}

absl::Status Collector::BuildServices() {
  const CollectorOptions& options = options_;
  auto writer_store = SqliteStore::Open(options.db_path);
  if (!writer_store.ok()) return writer_store.status();
  StoreOptions read_only;
  read_only.read_only = true;
  std::vector<std::unique_ptr<SqliteStore>> readers;
  for (size_t i = 0; i < std::max<size_t>(options.query_threads, 1); ++i) {
    auto reader_store = SqliteStore::Open(options.db_path, read_only);
    if (!reader_store.ok()) return reader_store.status();
    readers.push_back(std::move(*reader_store));
  }
  auto known_jobs = readers.front()->ListJobs();
  if (!known_jobs.ok()) return known_jobs.status();

  health_ = std::make_unique<HealthMetrics>();
  metrics_ = std::make_shared<JobMetrics>(options.export_options);
  pipeline_ = std::make_unique<StepPipeline>(options.pipeline, std::move(*writer_store),
                                             *known_jobs, metrics_.get(), health_.get());
  IngestOptions ingest;
  ingest.max_streams = options.max_streams;
  ingest.max_message_bytes = static_cast<size_t>(std::max(options.max_message_bytes, 0));
  ingest.hello_timeout = options.hello_timeout;
  ingest.max_queued_messages = options.max_queued_messages_per_stream;
  ingest.max_pending_acks = options.max_pending_acks_per_stream;
  ingest_ = std::make_unique<IngestService>(pipeline_.get(), health_.get(), ingest);
  StoreReaderPoolOptions reader_options;
  reader_options.max_queued = options.max_queued_queries;
  readers_ = std::make_unique<StoreReaderPool>(std::move(readers), reader_options);
  query_ =
      std::make_unique<QueryService>(pipeline_.get(), readers_.get(), options.pipeline.auth_token);
  return absl::OkStatus();
}

absl::Status Collector::ServeGrpc(const std::shared_ptr<grpc::ServerCredentials>& credentials) {
  const CollectorOptions& options = options_;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.grpc_address, credentials, &grpc_port_);
  // A vanished agent noticed within keepalive_time + keepalive_timeout (common/keepalive.h).
  keepalive::ApplyToServer(&builder, options.keepalive_time, options.keepalive_timeout,
                           options.agent_pings);
  // The ingest service refuses messages over max_message_bytes with an actionable status; gRPC's
  // own limit, at twice that, stops a grossly oversized one before it is buffered.
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(int64_t{options.max_message_bytes} * 2, INT32_MAX)));
  {
    // A Query request that does not parse is answered INVALID_ARGUMENT saying so, not gRPC's
    // bare UNIMPLEMENTED (query/parse_error_interceptor.h).
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(std::make_unique<ParseErrorInterceptorFactory>(
        std::vector<std::string>{v1::Query::service_full_name()}));
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  builder.RegisterService(ingest_.get());
  builder.RegisterService(query_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || grpc_port_ == 0) {
    pipeline_->Stop(absl::Seconds(1)).IgnoreError();
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options.grpc_address,
                                               " (in use, or not a local address?)"));
  }
  server_->GetHealthCheckService()->SetServingStatus(true);
  return absl::OkStatus();
}

absl::Status Collector::ServeMetrics() {
  const CollectorOptions& options = options_;
  if (!options.metrics_address.empty()) {
    try {
      // civetweb's options: a connection that has not sent its request within
      // request_timeout_ms is closed (its default, 30 s, let two connections that never finish
      // their headers stall every scrape beyond Prometheus' 10 s scrape timeout).
      exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
          "listening_ports", options.metrics_address, "num_threads",
          std::to_string(std::max<size_t>(options.metrics_threads, 1)), "request_timeout_ms",
          std::to_string(
              std::max<int64_t>(absl::ToInt64Milliseconds(options.metrics_request_timeout), 1))});
    } catch (const std::exception& e) {
      server_->Shutdown();
      pipeline_->Stop(absl::Seconds(1)).IgnoreError();
      return absl::UnavailableError(
          absl::StrCat("cannot serve /metrics on ", options.metrics_address, ": ", e.what()));
    }
    exposer_->RegisterCollectable(health_->registry());
    exposer_->RegisterCollectable(metrics_);
    const auto ports = exposer_->GetListeningPorts();
    metrics_port_ = ports.empty() ? 0 : ports.front();
  }
  return absl::OkStatus();
}

absl::Status Collector::ServeWeb() {
  const CollectorOptions& options = options_;
  if (!options.http_address.empty()) {
    WebServerOptions web;
    web.address = options.http_address;
    web.threads = options.http_threads;
    web.request_timeout = options.http_request_timeout;
    web.auth_token = options.pipeline.auth_token;
    web.fleet = options.fleet;
    auto server = WebServer::Start(web, pipeline_.get(), readers_.get());
    if (!server.ok()) {
      exposer_.reset();
      server_->Shutdown();
      readers_->Stop();
      pipeline_->Stop(absl::Seconds(1)).IgnoreError();
      return absl::UnavailableError(absl::StrCat("--http_address: ", server.status().message()));
    }
    web_ = *std::move(server);
  }
  return absl::OkStatus();
}

Collector::~Collector() { Shutdown(absl::Seconds(5)).IgnoreError(); }

absl::Status Collector::Shutdown(absl::Duration timeout) {
  MutexLock lock(&shutdown_mu_);
  if (shut_down_) return shutdown_status_;
  shut_down_ = true;
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout / 2));
  }
  // Then the web view, before the readers: its requests wait on them.
  if (web_ != nullptr) web_->Stop();
  // After the servers: no query arrives any more; the ones queued are finished, then the reader
  // threads end (before the pipeline stops: ListJobs reads it).
  if (readers_ != nullptr) readers_->Stop();
  // Start() may have failed before the pipeline existed (e.g. the database could not be opened).
  if (pipeline_ != nullptr) shutdown_status_ = pipeline_->Stop(timeout / 2);
  return shutdown_status_;
}

}  // namespace rankscope::collector
