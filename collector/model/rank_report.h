// One rank's validated report of one step, as the collector's core sees it.
#ifndef RANKSCOPE_COLLECTOR_MODEL_RANK_REPORT_H_
#define RANKSCOPE_COLLECTOR_MODEL_RANK_REPORT_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "collector/model/ack.h"
#include "common/sketch_encoding.h"

namespace rankscope::collector {

// The float summary of a replicated vector (proto ReplicaSummary; docs/DESIGN.md "Replica
// check: exact or tolerance"): kReplicaProjections signed sums, the size R of a one-ulp
// difference in every value plus the summary's own rounding, and (the reduced gradient's) the
// precision of the dtype its reduction ran in.
inline constexpr size_t kReplicaProjections = 4;
struct ReplicaSummary {
  std::array<double, kReplicaProjections> projections{};
  double rounding = 0.0;
  uint32_t precision = 0;
};

struct RankReport {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t attempt = 0;
  double loss = 0.0;         // may be NaN/Inf
  bool loss_absent = false;  // no loss this step (a pipeline stage): `loss` is NaN, not a fault
  double grad_norm = 0.0;    // may be NaN/Inf
  // The sketch, kept in its wire encoding (common/sketch_encoding.h). float32: the values in
  // `sketch` (length == the job's sketch_dim). float16 / int8: the packed bins as received in
  // `sketch_packed` (sketch_dim * bytes per bin) with their scale, and `sketch` is empty.
  std::vector<float> sketch;
  std::string sketch_packed;
  SketchEncoding sketch_encoding = SketchEncoding::kFloat32;
  float sketch_scale = 1.0f;
  absl::Time received_at = absl::UnixEpoch();
  std::optional<uint64_t> reduced_grad_fingerprint;
  std::optional<uint64_t> param_fingerprint;
  // With param_fingerprint, from a rank whose replica check is "tolerance": the parameters'
  // float summary (validated: kReplicaProjections finite values, a finite rounding >= 0).
  std::optional<ReplicaSummary> param_summary;
  // With param_fingerprint: the replica set it belongs to (StepReport.replica_set; the collector
  // compares the parameters within each set). Unset: the one set of the whole group.
  std::optional<uint32_t> replica_set;
  // With reduced_grad_fingerprint, likewise (precision in [1, 53]).
  std::optional<ReplicaSummary> reduced_grad_summary;
  std::optional<double> reduced_grad_norm;
  std::optional<double> step_time_seconds;
  uint32_t local_batch_size = 0;
  // The local gradient's norm per bucket the hello names (Hello.bucket_names), or empty.
  std::vector<float> bucket_norms;
  // Aggregation integrity: the reduced gradient's sketch (float32, empty unless this rank checks
  // this step) and the precision of the dtype its reduction ran in.
  std::vector<float> reduced_sketch;
  uint32_t reduced_grad_mantissa_bits = 0;
  // Everyone to acknowledge once this report is stored (a resend over a new stream adds one).
  std::vector<AckHandle> acks;

  // The sketch in whichever encoding it is held.
  SketchView SketchValues() const {
    if (sketch_encoding == SketchEncoding::kFloat32) return SketchView(sketch);
    return SketchView(sketch_encoding, sketch_packed.data(),
                      sketch_packed.size() / SketchBytesPerBin(sketch_encoding), sketch_scale);
  }
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_RANK_REPORT_H_
