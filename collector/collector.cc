#include "collector/collector.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/exposer.h"

namespace rankscope::collector {

absl::StatusOr<std::unique_ptr<Collector>> Collector::Start(CollectorOptions options) {
  std::unique_ptr<Collector> c(new Collector());
  c->options_ = options;

  auto writer_store = SqliteStore::Open(options.db_path);
  if (!writer_store.ok()) return writer_store.status();
  StoreOptions read_only;
  read_only.read_only = true;
  auto reader_store = SqliteStore::Open(options.db_path, read_only);
  if (!reader_store.ok()) return reader_store.status();
  auto known_jobs = (*reader_store)->ListJobs();
  if (!known_jobs.ok()) return known_jobs.status();

  c->health_ = std::make_unique<HealthMetrics>();
  c->metrics_ = std::make_shared<JobMetrics>(options.export_options);
  c->pipeline_ = std::make_unique<StepPipeline>(options.pipeline, std::move(*writer_store),
                                                *known_jobs, c->metrics_.get(), c->health_.get());
  c->ingest_ =
      std::make_unique<IngestService>(c->pipeline_.get(), c->health_.get(), options.max_streams);
  c->query_ = std::make_unique<QueryService>(c->pipeline_.get(), std::move(*reader_store));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.grpc_address, grpc::InsecureServerCredentials(), &c->grpc_port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.RegisterService(c->ingest_.get());
  builder.RegisterService(c->query_.get());
  c->server_ = builder.BuildAndStart();
  if (c->server_ == nullptr || c->grpc_port_ == 0) {
    c->pipeline_->Stop(absl::Seconds(1)).IgnoreError();
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options.grpc_address,
                                               " (in use, or not a local address?)"));
  }
  c->server_->GetHealthCheckService()->SetServingStatus(true);

  if (!options.metrics_address.empty()) {
    try {
      c->exposer_ = std::make_unique<prometheus::Exposer>(options.metrics_address);
    } catch (const std::exception& e) {
      c->server_->Shutdown();
      c->pipeline_->Stop(absl::Seconds(1)).IgnoreError();
      return absl::UnavailableError(
          absl::StrCat("cannot serve /metrics on ", options.metrics_address, ": ", e.what()));
    }
    c->exposer_->RegisterCollectable(c->health_->registry());
    c->exposer_->RegisterCollectable(c->metrics_);
    const auto ports = c->exposer_->GetListeningPorts();
    c->metrics_port_ = ports.empty() ? 0 : ports.front();
  }
  return c;
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
  shutdown_status_ = pipeline_->Stop(timeout / 2);
  return shutdown_status_;
}

}  // namespace rankscope::collector
