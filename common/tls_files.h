// TLS files of rankscope's gRPC endpoints (collector, agent, CLI): read a PEM file and check it
// before gRPC sees it, so that a bad file fails at start-up with a message naming the file and
// the fault, instead of as an opaque handshake error later.
//
// Pure functions over OpenSSL's PEM parser; thread-safe.
#ifndef RANKSCOPE_COMMON_TLS_FILES_H_
#define RANKSCOPE_COMMON_TLS_FILES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rankscope::tls {

// PEM material of one endpoint, read and checked by LoadPemFiles.
struct PemMaterial {
  std::string ca;    // CA bundle (verifies the peer); empty when no CA file was given
  std::string cert;  // certificate chain of this endpoint; empty when none
  std::string key;   // private key of `cert`; empty when none
};

// Paths, each optional; the names are the flags or options a person typed (for messages).
struct PemPaths {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string ca_name = "CA file";
  std::string cert_name = "certificate file";
  std::string key_name = "key file";
};

// Reads the given files and checks them: each parses as PEM of its kind (certificates for the
// CA and the certificate, a private key for the key), cert and key are given together and the
// key belongs to the certificate.
// Errors: NotFound (missing or unreadable file), InvalidArgument (empty, not PEM of the right
// kind, cert without key or key without cert, key not matching the certificate). Not retryable:
// the configuration must change.
absl::StatusOr<PemMaterial> LoadPemFiles(const PemPaths& paths);

}  // namespace rankscope::tls

#endif  // RANKSCOPE_COMMON_TLS_FILES_H_
