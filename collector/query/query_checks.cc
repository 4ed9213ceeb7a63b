#include "collector/query/query_checks.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_name.h"

namespace rankscope::collector {

absl::Status CheckQueryJobName(absl::string_view job) {
  if (IsValidGroupKey(job)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "job must be 1-128 characters of [A-Za-z0-9_.:-], or JOB/GROUP with a group of 1-64 (got ",
      job.size(), " bytes)"));
}

absl::Status CheckStepRange(uint64_t first_step, uint64_t last_step) {
  if (first_step <= last_step) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("first_step ", first_step, " > last_step ", last_step));
}

TokenCheck CheckBearerToken(absl::string_view authorization, absl::string_view required_token) {
  if (required_token.empty()) return TokenCheck::kOk;
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(authorization, kBearer)) return TokenCheck::kMissing;
  const absl::string_view given = authorization.substr(kBearer.size());
  // Constant time in the token's length: the comparison does not stop at the first difference.
  unsigned char differ = given.size() == required_token.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    differ |= static_cast<unsigned char>(given[i]) ^
              static_cast<unsigned char>(required_token[i % required_token.size()]);
  }
  return differ == 0 ? TokenCheck::kOk : TokenCheck::kWrong;
}

absl::string_view TokenRefusalMessage(TokenCheck check) {
  if (check == TokenCheck::kWrong) {
    return "wrong auth token: the collector requires its shared token (rankscope "
           "--auth_token_file)";
  }
  return "missing or wrong auth token: the collector requires its shared token (rankscope "
         "--auth_token_file)";
}

}  // namespace rankscope::collector
