// The export and report verbs: a job's stored steps and rank rows in a step range, read from the
// collector (paged) or, with --db, from a SQLite file directly; written as CSV/JSON on stdout
// (export) or handed as JSON to `PYTHON -m rankscope.report` to plot (report). Each returns the
// exit code: 0, 1 when reading or the report fails (after printing why on stderr), 2 for bad
// flags.
#ifndef RANKSCOPE_TOOLS_CLI_EXPORT_REPORT_H_
#define RANKSCOPE_TOOLS_CLI_EXPORT_REPORT_H_

#include <string>

#include "tools/cli/cli_config.h"

namespace rankscope::cli {

// `job`'s rows in [--first_step, --last_step] on stdout: --format csv (of --table steps, ranks or
// windows) or json (all tables).
int Export(const Cli& cli, const std::string& job);

// Plots `job`'s rows in [--first_step, --last_step] into -o by running cli.config.python
// -m rankscope.report on the package in PythonDir() (a child process; waits for it).
int Report(const Cli& cli, const std::string& job);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_EXPORT_REPORT_H_
