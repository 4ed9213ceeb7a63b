// One rank's validated report of one step, as the collector's core sees it.
#ifndef RANKSCOPE_COLLECTOR_RANK_REPORT_H_
#define RANKSCOPE_COLLECTOR_RANK_REPORT_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "collector/ack.h"

namespace rankscope::collector {

struct RankReport {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t attempt = 0;
  double loss = 0.0;          // may be NaN/Inf
  bool loss_absent = false;   // no loss this step (a pipeline stage): `loss` is NaN, not a fault
  double grad_norm = 0.0;     // may be NaN/Inf
  std::vector<float> sketch;  // length == the job's sketch_dim
  absl::Time received_at = absl::UnixEpoch();
  std::optional<uint64_t> reduced_grad_fingerprint;
  std::optional<uint64_t> param_fingerprint;
  std::optional<double> reduced_grad_norm;
  std::optional<double> step_time_seconds;
  uint32_t local_batch_size = 0;
  // Everyone to acknowledge once this report is stored (a resend over a new stream adds one).
  std::vector<AckHandle> acks;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_RANK_REPORT_H_
