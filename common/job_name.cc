#include "common/job_name.h"

#include "absl/strings/str_cat.h"

namespace rankscope {

bool IsValidJobName(absl::string_view job, size_t max_length) {
  if (job.empty() || job.size() > max_length) return false;
  for (char c : job) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::Status ValidateJobName(absl::string_view job, JobNameEcho echo, size_t max_length) {
  if (IsValidJobName(job, max_length)) return absl::OkStatus();
  switch (echo) {
    case JobNameEcho::kQuote:
      return absl::InvalidArgumentError(absl::StrCat("job name '", job, "' must be 1-", max_length,
                                                     " characters of [A-Za-z0-9_.:-]"));
    case JobNameEcho::kLengthOnly:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("job name must be 1-", max_length,
                                                 " characters of [A-Za-z0-9_.:-], got ", job.size(),
                                                 " characters"));
}

absl::Status ValidateGroupName(absl::string_view group, JobNameEcho echo) {
  if (group.empty() || IsValidJobName(group, kMaxGroupNameLength)) return absl::OkStatus();
  if (echo == JobNameEcho::kQuote) {
    return absl::InvalidArgumentError(absl::StrCat("group name '", group, "' must be 0-",
                                                   kMaxGroupNameLength,
                                                   " characters of [A-Za-z0-9_.:-]"));
  }
  return absl::InvalidArgumentError(absl::StrCat("group name must be 0-", kMaxGroupNameLength,
                                                 " characters of [A-Za-z0-9_.:-], got ",
                                                 group.size(), " characters"));
}

std::string GroupKey(absl::string_view job, absl::string_view group) {
  if (group.empty()) return std::string(job);
  return absl::StrCat(job, "/", group);
}

bool IsValidGroupKey(absl::string_view key) {
  const auto [job, group] = SplitGroupKey(key);
  if (!IsValidJobName(job)) return false;
  return key.size() == job.size() || IsValidJobName(group, kMaxGroupNameLength);
}

std::pair<absl::string_view, absl::string_view> SplitGroupKey(absl::string_view key) {
  const size_t slash = key.find('/');
  if (slash == absl::string_view::npos) return {key, absl::string_view()};
  return {key.substr(0, slash), key.substr(slash + 1)};
}

}  // namespace rankscope
