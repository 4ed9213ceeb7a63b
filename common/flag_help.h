// `--help` for rankscope's binaries: the program's usage message and the flags defined in its own
// main file (name, default, help), on stdout, exit status 0 (absl's own --help exits 1 in the
// abseil this project builds with, and lists every linked library's flags under "Flags from
// /path/to/source.cc").
// `--version`: the program's name and the project's version, on stdout, exit status 0.
#ifndef RANKSCOPE_COMMON_FLAG_HELP_H_
#define RANKSCOPE_COMMON_FLAG_HELP_H_

#include <string>

#include "absl/strings/string_view.h"

namespace rankscope {

// Call before absl::ParseCommandLine, after absl::SetProgramUsageMessage. If argv holds --help,
// -help, --helpshort or -h, prints ProgramUsageMessage() and every flag whose defining file ends
// with `main_file` (e.g. "collector/main.cc"), sorted by name, then exits 0. If argv holds
// --version, prints "<program> <version>" (common/version.h) and exits 0. Otherwise returns.
// Also makes absl's own usage output (--helpfull, flag errors) name files without their build
// path.
void HandleHelpFlag(int argc, char** argv, absl::string_view main_file);

// The text HandleHelpFlag prints (tests).
std::string FlagHelpText(absl::string_view main_file);

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_FLAG_HELP_H_
