// gRPC channel credentials of a collector client (agent, CLI, Python control calls): plaintext,
// TLS verifying the collector, or mutual TLS with a client certificate.
//
// Thread-safe (pure functions).
#ifndef RANKSCOPE_COMMON_CLIENT_TLS_H_
#define RANKSCOPE_COMMON_CLIENT_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace rankscope::tls {

struct ClientTlsFiles {
  std::string ca_file;      // PEM CA bundle that signs the collector's certificate; empty: the
                            // system's roots (when TLS is on)
  std::string cert_file;    // PEM client certificate (mutual TLS); requires key_file
  std::string key_file;     // its PEM private key
  std::string target_name;  // checked against the collector's certificate instead of the host
                            // of the address (e.g. "collector.internal" when dialing an IP)
  // Names for messages (the flags, options or environment variables the person set).
  std::string ca_name = "tls_ca_file";
  std::string cert_name = "tls_cert_file";
  std::string key_name = "tls_key_file";

  // TLS is on when a CA, a certificate or a key is given; target_name alone changes nothing.
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// Reads and checks the files (common/tls_files.h) and returns the credentials: insecure when
// !files.enabled(). Errors: NotFound / InvalidArgument naming the file (not retryable).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientTlsFiles& files);

// Sets the channel argument for files.target_name when TLS is on and it is not empty.
void ApplyTargetName(const ClientTlsFiles& files, grpc::ChannelArguments* args);

}  // namespace rankscope::tls

#endif  // RANKSCOPE_COMMON_CLIENT_TLS_H_
