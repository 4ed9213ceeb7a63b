// The CLI's help texts: the usage message and each verb's own help.
#ifndef RANKSCOPE_TOOLS_CLI_HELP_H_
#define RANKSCOPE_TOOLS_CLI_HELP_H_

#include <string>

namespace rankscope::cli {

// The program's usage message (absl::SetProgramUsageMessage; also printed on a bad command).
extern const char kUsage[];

// The help of `verb` (`rankscope VERB --help`), or nullptr if it is not a verb with one.
const char* VerbHelp(const std::string& verb);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_HELP_H_
