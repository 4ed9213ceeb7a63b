#include "tools/cli/cli_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/client_tls.h"

ABSL_FLAG(std::string, collector, "",
          "Collector gRPC address, or a fleet's list (a:50051,b:50051,c:50051, or one DNS name "
          "of several addresses): jobs lists every shard's jobs, the other verbs talk to the "
          "job's shard. Default $RANKSCOPE_COLLECTOR, else 127.0.0.1:50051.");
ABSL_FLAG(std::string, job, "", "Training job name (show, ctl).");
ABSL_FLAG(bool, once, false, "show: print once and exit (for scripts).");
ABSL_FLAG(int, limit, 20, "show: number of steps.");
ABSL_FLAG(int, every, 0, "ctl set: report every N optimizer steps (>= 1).");
ABSL_FLAG(int, sketch_dim, 0, "ctl set: new sketch dimension.");
ABSL_FLAG(int, lead_steps, 5, "ctl: apply this many steps after the job's newest step.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "RPC deadline.");
ABSL_FLAG(int, worst, 5, "show: number of worst ranks (by outlier score) of the newest step.");
ABSL_FLAG(std::string, format, "csv", "export: csv or json.");
ABSL_FLAG(std::string, table, "steps",
          "export --format=csv: steps (step_stats), ranks (rank_steps) or windows "
          "(rank_windows: downsampled per-rank data); json has all three.");
ABSL_FLAG(std::string, db, "", "export, report: read this SQLite file instead of the collector.");
ABSL_FLAG(uint64_t, first_step, 0, "export, report: first step.");
ABSL_FLAG(uint64_t, last_step, 0, "export, report: last step (0: the newest).");
ABSL_FLAG(int, max_rows, 1000000, "export, report: at most this many rows of each table.");
ABSL_FLAG(int, page_rows, 10000, "export, report: rows per request to the collector.");
ABSL_FLAG(std::string, o, "", "report: output image (png, pdf or svg by extension).");
ABSL_FLAG(std::string, python, "",
          "report: the Python interpreter (with matplotlib). Default $RANKSCOPE_PYTHON, else "
          "the one this build was configured with (" RANKSCOPE_DEFAULT_PYTHON ").");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the collector's shared token (its --auth_token_file), if it requires one. "
          "Default $RANKSCOPE_AUTH_TOKEN_FILE.");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA that signs the collector's certificate: talk to it over TLS. Default "
          "$RANKSCOPE_TLS_CA.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate, for a collector that requires mutual TLS. Default "
          "$RANKSCOPE_TLS_CERT.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM key of --tls_cert_file. Default $RANKSCOPE_TLS_KEY.");
ABSL_FLAG(std::string, tls_target_name, "",
          "Name to verify in the collector's certificate instead of the host of --collector. "
          "Default $RANKSCOPE_TLS_TARGET_NAME.");

namespace rankscope::cli {
namespace {

// The flag, else the environment variable, else "".
std::string FlagOrEnv(const absl::Flag<std::string>& flag, const char* env) {
  std::string v = absl::GetFlag(flag);
  if (v.empty() && std::getenv(env) != nullptr) v = std::getenv(env);
  return v;
}

}  // namespace

std::string PythonInterpreter(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  const char* env = std::getenv("RANKSCOPE_PYTHON");
  return env != nullptr && *env != '\0' ? env : RANKSCOPE_DEFAULT_PYTHON;
}

CliConfig ReadFlags() {
  CliConfig c;
  c.query.address = FlagOrEnv(FLAGS_collector, "RANKSCOPE_COLLECTOR");
  if (c.query.address.empty()) c.query.address = "127.0.0.1:50051";
  c.query.timeout = absl::GetFlag(FLAGS_timeout);
  c.query.max_receive_message_size = 64 << 20;  // export pages stay far below; headroom for show
  c.query.tls.ca_file = FlagOrEnv(FLAGS_tls_ca_file, "RANKSCOPE_TLS_CA");
  c.query.tls.cert_file = FlagOrEnv(FLAGS_tls_cert_file, "RANKSCOPE_TLS_CERT");
  c.query.tls.key_file = FlagOrEnv(FLAGS_tls_key_file, "RANKSCOPE_TLS_KEY");
  c.query.tls.target_name = FlagOrEnv(FLAGS_tls_target_name, "RANKSCOPE_TLS_TARGET_NAME");
  c.query.tls.ca_name = "--tls_ca_file";
  c.query.tls.cert_name = "--tls_cert_file";
  c.query.tls.key_name = "--tls_key_file";
  c.auth_token_file = FlagOrEnv(FLAGS_auth_token_file, "RANKSCOPE_AUTH_TOKEN_FILE");
  c.job = absl::GetFlag(FLAGS_job);
  c.once = absl::GetFlag(FLAGS_once);
  c.limit = absl::GetFlag(FLAGS_limit);
  c.every = absl::GetFlag(FLAGS_every);
  c.sketch_dim = absl::GetFlag(FLAGS_sketch_dim);
  c.lead_steps = absl::GetFlag(FLAGS_lead_steps);
  c.worst = absl::GetFlag(FLAGS_worst);
  c.format = absl::GetFlag(FLAGS_format);
  c.table = absl::GetFlag(FLAGS_table);
  c.db = absl::GetFlag(FLAGS_db);
  c.first_step = absl::GetFlag(FLAGS_first_step);
  c.last_step = absl::GetFlag(FLAGS_last_step);
  c.max_rows = absl::GetFlag(FLAGS_max_rows);
  c.page_rows = absl::GetFlag(FLAGS_page_rows);
  c.output = absl::GetFlag(FLAGS_o);
  c.python = PythonInterpreter(absl::GetFlag(FLAGS_python));
  return c;
}

bool PathExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string PythonDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string exe(buf, n);
  const size_t slash = exe.rfind('/');
  const std::string bin = exe.substr(0, slash == std::string::npos ? 0 : slash);
  // The build tree's layout, else the installed wheel's (site-packages/rankscope/_bin/rankscope).
  for (const std::string& dir : {bin + "/../python", bin + "/../.."}) {
    if (PathExists(dir + "/rankscope/__init__.py")) return dir;
  }
  return bin + "/../python";
}

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string token(absl::StripAsciiWhitespace(text));
  if (!in || token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read a token from --auth_token_file ", path));
  }
  return token;
}

int Fail(const CliConfig& config, const absl::Status& s) {
  // A refused TLS handshake reaches a client as UNAVAILABLE, like a collector that is down.
  const rankscope::tls::ClientTlsFiles& tls = config.query.tls;
  const bool unavailable = s.code() == absl::StatusCode::kUnavailable;
  const char* hint = "";
  if (unavailable) {
    hint = !tls.enabled() ? " (plaintext: if the collector serves TLS, give --tls_ca_file)"
           : tls.cert_file.empty()
               ? " (TLS without a client certificate: if the collector requires mutual TLS, give "
                 "--tls_cert_file and --tls_key_file)"
               : "";
  }
  std::fprintf(stderr, "rankscope: %s (collector %s): %s%s\n",
               unavailable ? "collector unreachable" : "request failed",
               config.query.address.c_str(), std::string(s.message()).c_str(), hint);
  return 1;
}

}  // namespace rankscope::cli
