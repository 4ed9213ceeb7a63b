#include "tools/cli/step_format.h"

#include <string>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace rankscope::cli {

namespace v1 = rankscope::v1;

std::string MissingRanks(const v1::StepStats& st, const char* sep) {
  if (!st.missing_rank_ranges().empty()) {
    return absl::StrJoin(absl::StrSplit(st.missing_rank_ranges(), ','), sep);
  }
  return absl::StrJoin(st.missing_ranks(), sep);
}

}  // namespace rankscope::cli
