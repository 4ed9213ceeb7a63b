// Why the collector refused a hello, a report or a stream: the `reason` label of
// rankscope_reports_rejected_total.
//
// The label values are a public contract (alert rules, dashboards and tests match them): they
// live only in ReasonLabel's table below, and must stay byte-identical. Header-only and pure, so
// that validation (over the wire types) and the health metrics (no protobuf) share it.
#ifndef RANKSCOPE_COLLECTOR_MODEL_REJECT_REASON_H_
#define RANKSCOPE_COLLECTOR_MODEL_REJECT_REASON_H_

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>

namespace rankscope::collector {

enum class RejectReason {
  kNone,  // not a rejection (an OK Rejection); never exported
  kBeforeHello,
  kBadHello,
  kRankOutOfRange,
  kWorldSizeChanged,
  kSketchMismatch,
  kSketchLength,
  kMessageTooLarge,
  kUnauthenticated,
  kTooManyStreams,
  kTooManyJobs,
  kRankTaken,
  kInvalidReport,  // also where an unknown label is counted (HealthMetrics::Rejected)
  kRunCollision,   // another live run holds the job's group (JobRegistry, "Runs")
};

// Every exported reason, in export order (kNone excluded).
inline constexpr std::array<RejectReason, 13> kRejectReasons = {
    RejectReason::kBeforeHello,      RejectReason::kBadHello,        RejectReason::kRankOutOfRange,
    RejectReason::kWorldSizeChanged, RejectReason::kSketchMismatch,  RejectReason::kSketchLength,
    RejectReason::kMessageTooLarge,  RejectReason::kUnauthenticated, RejectReason::kTooManyStreams,
    RejectReason::kTooManyJobs,      RejectReason::kRankTaken,       RejectReason::kInvalidReport,
    RejectReason::kRunCollision,
};

// The label value of `reason` ("" for kNone).
constexpr std::string_view ReasonLabel(RejectReason reason) {
  switch (reason) {
    case RejectReason::kNone:
      return "";
    case RejectReason::kBeforeHello:
      return "before_hello";
    case RejectReason::kBadHello:
      return "bad_hello";
    case RejectReason::kRankOutOfRange:
      return "rank_out_of_range";
    case RejectReason::kWorldSizeChanged:
      return "world_size_changed";
    case RejectReason::kSketchMismatch:
      return "sketch_mismatch";
    case RejectReason::kSketchLength:
      return "sketch_length";
    case RejectReason::kMessageTooLarge:
      return "message_too_large";
    case RejectReason::kUnauthenticated:
      return "unauthenticated";
    case RejectReason::kTooManyStreams:
      return "too_many_streams";
    case RejectReason::kTooManyJobs:
      return "too_many_jobs";
    case RejectReason::kRankTaken:
      return "rank_taken";
    case RejectReason::kInvalidReport:
      return "invalid_report";
    case RejectReason::kRunCollision:
      return "run_collision";
  }
  return "";
}

// The reason whose label is `label`; nullopt for "" and for a label not in kRejectReasons.
constexpr std::optional<RejectReason> ReasonFromLabel(std::string_view label) {
  for (RejectReason r : kRejectReasons) {
    if (ReasonLabel(r) == label) return r;
  }
  return std::nullopt;
}

// kRejectReasons[ReasonIndex(r)] == r for every exported reason (kNone has no index).
constexpr size_t ReasonIndex(RejectReason reason) { return static_cast<size_t>(reason) - 1; }

namespace reject_reason_internal {
constexpr bool TableIsConsistent() {
  for (size_t i = 0; i < kRejectReasons.size(); ++i) {
    if (ReasonIndex(kRejectReasons[i]) != i || ReasonLabel(kRejectReasons[i]).empty()) return false;
  }
  return kRejectReasons.back() == RejectReason::kRunCollision;
}
}  // namespace reject_reason_internal
static_assert(reject_reason_internal::TableIsConsistent(),
              "kRejectReasons must list every reason but kNone, in enum order");

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_REJECT_REASON_H_
