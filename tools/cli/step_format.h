// Text forms of a step's fields shared by the show and export verbs.
#ifndef RANKSCOPE_TOOLS_CLI_STEP_FORMAT_H_
#define RANKSCOPE_TOOLS_CLI_STEP_FORMAT_H_

#include <string>

#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::cli {

// The ranks missing from a step, items separated by `sep`: the collector's compact form ("0-5",
// "+N" for ranks beyond its cap) when it sends one, else the plain list of an older collector.
std::string MissingRanks(const rankscope::v1::StepStats& st, const char* sep);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_STEP_FORMAT_H_
