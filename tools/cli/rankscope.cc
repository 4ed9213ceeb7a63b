// rankscope: the command-line client of a running collector.
//
//   rankscope jobs                          what is being watched
//   rankscope show --job J [--once]         the latest steps of a job and its worst ranks
//                                           (refreshes every 2 s)
//   rankscope export --job J --format csv|json [--table steps|ranks] [--db PATH]
//   rankscope report --job J -o report.png [--db PATH]
//   rankscope ctl enable|disable --job J    switch a dormant/active job's ranks on or off
//   rankscope ctl set --job J [--every N] [--sketch_dim K]
//   rankscope attach --job J [--dormant] PID... | --all-local
//                                           attach to live processes started without rankscope
//
// Every verb talks to the collector's Query service at --collector (a fleet's list: jobs asks
// every shard, the other verbs the job's shard); export and report read a
// SQLite file directly instead with --db. report runs `PYTHON -m rankscope.report` on the package
// installed beside the binary (<bin>/../python), handing it an export as JSON; attach runs
// `PYTHON -m rankscope.attach`. PYTHON: report's --python, else $RANKSCOPE_PYTHON, else the
// interpreter the build was configured with (RANKSCOPE_DEFAULT_PYTHON: the project's environment).
//
// main: the attach hand-over, --help, flags, the Query client, then the verb
// (tools/cli/{live_verbs,export_report,attach_handover,help}.h).
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "common/collector_dns.h"
#include "common/collector_shard.h"
#include "common/flag_help.h"
#include "common/query_client.h"
#include "tools/cli/attach_handover.h"
#include "tools/cli/cli_config.h"
#include "tools/cli/export_report.h"
#include "tools/cli/help.h"
#include "tools/cli/live_verbs.h"

namespace cli = rankscope::cli;

// Long: the CLI's dispatch in the order it must run (the attach hand-over before absl parses flags,
// --help, flags, the client, one branch per verb); every verb's work is in its own file.
int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(cli::kUsage);
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    if (std::string(argv[i]) == "attach") return cli::Attach(argc, argv, i);
    break;
  }
  // `rankscope VERB --help`: the verb's own help; `rankscope --help`: the usage and the CLI's own
  // flags (common/flag_help.h), exit 0.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg != "--help" && arg != "-h" && arg != "-help") continue;
    for (int j = 1; j < argc; ++j) {
      if (const char* help = cli::VerbHelp(argv[j])) {
        std::printf("%s", help);
        return 0;
      }
    }
  }
  rankscope::HandleHelpFlag(argc, argv, "cli/cli_config.cc");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fprintf(stderr, "%s\n", cli::kUsage);
    return 2;
  }
  cli::CliConfig config = cli::ReadFlags();
  const std::string verb = args[1];
  // A fleet (docs/deploy.md "A fleet of collectors"): jobs asks every shard, the other verbs the
  // job's shard, picked as the job's agents pick it (common/collector_shard.h).
  absl::StatusOr<std::vector<std::string>> shards =
      rankscope::ParseCollectorList(config.query.address);
  if (!shards.ok()) {
    std::fprintf(stderr, "rankscope: --collector: %s\n",
                 std::string(shards.status().message()).c_str());
    return 2;
  }
  *shards = rankscope::ExpandCollectorName(*std::move(shards));
  const bool fleet_jobs = verb == "jobs" && shards->size() > 1;
  if (!fleet_jobs) config.query.address = rankscope::PickCollector(*shards, config.job);
  // A bad TLS setting is reported before an unreadable token.
  absl::StatusOr<std::string> token = std::string();
  if (!config.auth_token_file.empty()) token = cli::ReadAuthToken(config.auth_token_file);
  std::vector<std::unique_ptr<rankscope::query::QueryClient>> clients;
  for (const std::string& address :
       fleet_jobs ? *shards : std::vector<std::string>{config.query.address}) {
    rankscope::query::QueryClientOptions query = config.query;
    query.address = address;
    if (token.ok()) query.auth_token = *token;
    auto client = rankscope::query::QueryClient::Create(std::move(query));
    if (!client.ok()) {
      std::fprintf(stderr, "rankscope: %s\n", std::string(client.status().message()).c_str());
      return 2;
    }
    clients.push_back(*std::move(client));
  }
  if (!token.ok()) {
    std::fprintf(stderr, "rankscope: %s\n", std::string(token.status().message()).c_str());
    return 2;
  }
  if (fleet_jobs) {
    std::vector<rankscope::query::QueryClient*> each;
    for (auto& c : clients) each.push_back(c.get());
    return cli::FleetJobs(config, each);
  }
  const cli::Cli context{config, *clients[0]};
  const std::string& job = config.job;
  if (verb == "jobs") return cli::Jobs(context);
  if (verb == "show" || verb == "ctl" || verb == "export" || verb == "report" || verb == "groups") {
    if (job.empty()) {
      std::fprintf(stderr, "rankscope: %s needs --job\n", verb.c_str());
      return 2;
    }
    if (verb == "show") return cli::Show(context, job);
    if (verb == "groups") return cli::Groups(context, job);
    if (verb == "export") return cli::Export(context, job);
    if (verb == "report") return cli::Report(context, job);
    if (args.size() < 3) {
      std::fprintf(stderr, "rankscope: ctl needs a verb: enable, disable or set\n");
      return 2;
    }
    return cli::Ctl(context, args[2], job);
  }
  std::fprintf(stderr, "rankscope: unknown command '%s'\n\n%s\n", verb.c_str(), cli::kUsage);
  return 2;
}
