// The CLI's configuration: what its flags (and their environment variables) say, read once by
// main before any verb runs, and the context every verb works with.
#ifndef RANKSCOPE_TOOLS_CLI_CLI_CONFIG_H_
#define RANKSCOPE_TOOLS_CLI_CLI_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/query_client.h"

namespace rankscope::cli {

// Everything the flags (and their environment variables) say, read once by main before any
// verb runs; verbs take it instead of reading flags.
struct CliConfig {
  // address (--collector: one collector or a fleet's list; main narrows it to the job's shard),
  // TLS, token, deadline
  rankscope::query::QueryClientOptions query;
  std::string auth_token_file;
  std::string job;
  bool once = false;
  int limit = 20;
  int every = 0;
  int sketch_dim = 0;
  int lead_steps = 5;
  int worst = 5;
  std::string format;
  std::string table;
  std::string db;
  uint64_t first_step = 0;
  uint64_t last_step = 0;
  int max_rows = 1000000;
  int page_rows = 10000;
  std::string output;
  std::string python;
};

// The flags after absl::ParseCommandLine; a TLS/token flag left empty takes its environment
// variable ($RANKSCOPE_TLS_CA, ..., $RANKSCOPE_AUTH_TOKEN_FILE).
CliConfig ReadFlags();

// The Python that runs the report and attach verbs: `flag_value`, else $RANKSCOPE_PYTHON, else
// the build's (RANKSCOPE_DEFAULT_PYTHON).
std::string PythonInterpreter(const std::string& flag_value);

// The folder holding the rankscope package the report and attach verbs run: <directory of this
// binary>/../python where the build puts it, else <directory of this binary>/../.. (the wheel
// installs the binary as site-packages/rankscope/_bin/rankscope); "" if the binary's path cannot
// be read.
std::string PythonDir();

// Whether `path` exists. stat(2), not access(2): access ignores a non-root user's capabilities
// (CAP_DAC_READ_SEARCH reaching a package under another user's home).
bool PathExists(const std::string& path);

// The stripped token in `path`; InvalidArgument (with the message to print) if it cannot be
// read or is empty.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

// What a verb works with: the flags and the collector's Query client.
struct Cli {
  const CliConfig& config;
  rankscope::query::QueryClient& client;
};

// Prints why a request to the collector failed (with a TLS hint when it was unreachable) on
// stderr; returns the exit code, 1.
int Fail(const CliConfig& config, const absl::Status& s);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_CLI_CONFIG_H_
