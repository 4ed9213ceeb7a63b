// The live verbs over the collector's Query service: jobs, groups, show and ctl. Each prints its
// result on stdout and returns the exit code: 0, 1 when the collector fails or knows nothing
// (after printing why on stderr), 2 for a bad request.
#ifndef RANKSCOPE_TOOLS_CLI_LIVE_VERBS_H_
#define RANKSCOPE_TOOLS_CLI_LIVE_VERBS_H_

#include <string>

#include "absl/types/span.h"
#include "common/query_client.h"
#include "tools/cli/cli_config.h"

namespace rankscope::cli {

// The jobs the collector knows, one line each.
int Jobs(const Cli& cli);

// The jobs of every shard of a fleet (`shards`: one client per collector of the list), one line
// each with the collector that holds it. A shard that fails is named on stderr and the others
// are still listed; returns 1 then.
int FleetJobs(const CliConfig& config, absl::Span<rankscope::query::QueryClient* const> shards);

// The data-parallel groups of `job` (keys "JOB/GROUP", or the job itself when stored without
// groups), their newest --limit steps side by side (tools/cli/groups_view.h).
int Groups(const Cli& cli, const std::string& job);

// The newest --limit steps of `job` and the --worst ranks of the newest; with --once printed
// once, else redrawn every 2 s until interrupted or a request fails.
int Show(const Cli& cli, const std::string& job);

// `ctl enable|disable|set` (`verb`): a control message for every rank of `job`.
int Ctl(const Cli& cli, const std::string& verb, const std::string& job);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_LIVE_VERBS_H_
