#include "common/client_tls.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "common/tls_files.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace rankscope::tls {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientTlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  PemPaths paths;
  paths.ca_file = files.ca_file;
  paths.cert_file = files.cert_file;
  paths.key_file = files.key_file;
  paths.ca_name = files.ca_name;
  paths.cert_name = files.cert_name;
  paths.key_name = files.key_name;
  auto pem = LoadPemFiles(paths);
  if (!pem.ok()) return pem.status();
  if (!files.ca_file.empty()) {
    // Checked above; from here gRPC's file watcher re-reads them for each new connection.
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        files.key_file, files.cert_file, files.ca_file,
        static_cast<unsigned int>(std::max(files.reload_interval_s, 1)));
    grpc::experimental::TlsChannelCredentialsOptions options;
    options.set_certificate_provider(std::move(provider));
    options.watch_root_certs();
    if (!files.cert_file.empty()) options.watch_identity_key_cert_pairs();
    options.set_verify_server_certs(true);  // chain and host name (or target_name) checked
    return grpc::experimental::TlsCredentials(options);
  }
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pem->ca;
  options.pem_private_key = pem->key;
  options.pem_cert_chain = pem->cert;
  return grpc::SslCredentials(options);
}

void ApplyTargetName(const ClientTlsFiles& files, grpc::ChannelArguments* args) {
  if (files.enabled() && !files.target_name.empty()) {
    args->SetSslTargetNameOverride(files.target_name);
  }
}

}  // namespace rankscope::tls
