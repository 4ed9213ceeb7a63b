// The TLS options of a collector client (the agent, the CLI, the Python control calls): which
// PEM files to present and check, and the names to give them in messages. Plain data with no
// gRPC inside, so that the agent's public header can carry it (AgentOptions::tls);
// common/client_tls.h turns it into channel credentials.
//
// Thread safety: plain data (thread-compatible).
#ifndef RANKSCOPE_COMMON_CLIENT_TLS_FILES_H_
#define RANKSCOPE_COMMON_CLIENT_TLS_FILES_H_

#include <string>

namespace rankscope::tls {

struct ClientTlsFiles {
  std::string ca_file;      // PEM CA bundle that signs the collector's certificate; empty: the
                            // system's roots (when TLS is on)
  std::string cert_file;    // PEM client certificate (mutual TLS); requires key_file
  std::string key_file;     // its PEM private key (unencrypted)
  std::string target_name;  // checked against the collector's certificate instead of the host
                            // of the address (e.g. "rankscope-collector" when dialing an IP)
  // With a ca_file, the three files are read again every reload_interval_s seconds (at least 1):
  // a trust bundle or client certificate replaced on disk (atomically, by rename) is used by the
  // next connection, e.g. the reconnect after the collector's certificate changed CA, without
  // restarting the process. Without a ca_file (the system's roots) the files are read once.
  int reload_interval_s = 60;
  // Names for messages (the flags, options or environment variables the person set).
  std::string ca_name = "tls_ca_file";
  std::string cert_name = "tls_cert_file";
  std::string key_name = "tls_key_file";

  // TLS is on when a CA, a certificate or a key is given; target_name alone changes nothing.
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

}  // namespace rankscope::tls

#endif  // RANKSCOPE_COMMON_CLIENT_TLS_FILES_H_
