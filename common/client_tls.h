// gRPC channel credentials of a collector client (agent, CLI, Python control calls): plaintext,
// TLS verifying the collector, or mutual TLS with a client certificate, from the options in
// common/client_tls_files.h.
//
// Thread-safe (pure functions).
#ifndef RANKSCOPE_COMMON_CLIENT_TLS_H_
#define RANKSCOPE_COMMON_CLIENT_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/client_tls_files.h"
#include "grpcpp/grpcpp.h"

namespace rankscope::tls {

// Reads and checks the files (common/tls_files.h) and returns the credentials: insecure when
// !files.enabled(). Errors: NotFound / InvalidArgument naming the file (not retryable).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientTlsFiles& files);

// Sets the channel argument for files.target_name when TLS is on and it is not empty.
void ApplyTargetName(const ClientTlsFiles& files, grpc::ChannelArguments* args);

}  // namespace rankscope::tls

#endif  // RANKSCOPE_COMMON_CLIENT_TLS_H_
