// The job-name rule, one for the agent (Agent::Create) and the collector (a hello's job).
//
// A job name is 1..max_length characters of [A-Za-z0-9_.:-]: safe in a Prometheus label, a
// SQLite row, a file name and a log line.
//
// Thread-safe (pure functions).
#ifndef RANKSCOPE_COMMON_JOB_NAME_H_
#define RANKSCOPE_COMMON_JOB_NAME_H_

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rankscope {

inline constexpr size_t kMaxJobNameLength = 128;

// True iff `job` is 1..max_length characters of [A-Za-z0-9_.:-].
bool IsValidJobName(absl::string_view job, size_t max_length = kMaxJobNameLength);

// How a refusal's message shows the name.
enum class JobNameEcho {
  // Quotes the name: for a name the caller configured itself (the agent's own options), where
  // seeing it helps ("job name 'bad job' must be 1-128 characters of [A-Za-z0-9_.:-]").
  kQuote,
  // Gives only its length: for a name that arrived over the wire (the collector), whose bytes
  // may be anything and of any size and must not reach logs or status details
  // ("job name must be 1-128 characters of [A-Za-z0-9_.:-], got 300 characters").
  kLengthOnly,
};

// OK iff IsValidJobName(job, max_length); else InvalidArgument with the message `echo` selects.
absl::Status ValidateJobName(absl::string_view job, JobNameEcho echo,
                             size_t max_length = kMaxJobNameLength);

// A data-parallel group's name (docs/DESIGN.md "Who a rank is"): 0..kMaxGroupNameLength
// characters of the same set; empty is the job's only group.
inline constexpr size_t kMaxGroupNameLength = 64;

// OK iff `group` is empty or 1..kMaxGroupNameLength characters of [A-Za-z0-9_.:-]; else
// InvalidArgument with the message `echo` selects.
absl::Status ValidateGroupName(absl::string_view group, JobNameEcho echo);

// The name under which the collector joins, stores and exports one data-parallel group of a job:
// the job's name when `group` is empty (the job's only group), else "JOB/GROUP". '/' is in
// neither name's character set, so the key splits back unambiguously (SplitGroupKey).
std::string GroupKey(absl::string_view job, absl::string_view group);

// True iff `key` is a valid job name, or "JOB/GROUP" with a valid job name and a non-empty
// valid group name: what a query may name.
bool IsValidGroupKey(absl::string_view key);

// The (job, group) of a GroupKey; group is empty for a key without '/'.
std::pair<absl::string_view, absl::string_view> SplitGroupKey(absl::string_view key);

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_JOB_NAME_H_
