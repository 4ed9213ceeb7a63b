// The checks and limits every reader of the collector's store shares: the gRPC Query service and
// the HTTP JSON API (web_server) refuse the same names, cap the same ranges and accept the same
// token, so a tool gets the same answer whichever door it uses.
//
// Thread-safe (pure functions and constants).
#ifndef RANKSCOPE_COLLECTOR_QUERY_QUERY_CHECKS_H_
#define RANKSCOPE_COLLECTOR_QUERY_QUERY_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rankscope::collector {

// RecentSteps: steps returned when the request names no limit, and the most it may ask for.
inline constexpr int kRecentStepsDefaultLimit = 20;
inline constexpr int kRecentStepsMaxLimit = 10'000;
// StepRange: rows (steps, and rank rows) returned when the request names no limit, and the most
// it may ask for. An answer cut at the limit says so (`truncated`).
inline constexpr int kStepRangeDefaultLimit = 10'000;
inline constexpr int kStepRangeMaxLimit = 1'000'000;

// OK iff `job` is a job name or a data-parallel group key "JOB/GROUP" (common/job_name.h
// IsValidGroupKey); else InvalidArgument. The name came over the wire, so the message gives only
// its length, never its bytes.
absl::Status CheckQueryJobName(absl::string_view job);

// OK iff first_step <= last_step; else InvalidArgument naming both.
absl::Status CheckStepRange(uint64_t first_step, uint64_t last_step);

// What a request's credentials say against the collector's shared token.
enum class TokenCheck {
  kOk,       // no token is required, or the request carries the right one
  kMissing,  // a token is required and the request carries none
  kWrong,    // the request carries a token that is not the collector's
};

// `authorization`: the request's "authorization" value ("Bearer <token>"), empty when absent.
// `required_token`: empty when the collector requires none. Compares in constant time.
TokenCheck CheckBearerToken(absl::string_view authorization, absl::string_view required_token);

// The message for a refused token (kMissing or kWrong), the same on every door.
absl::string_view TokenRefusalMessage(TokenCheck check);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_QUERY_QUERY_CHECKS_H_
