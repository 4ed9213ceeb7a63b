#include "common/client_tls.h"

#include "common/tls_files.h"

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
