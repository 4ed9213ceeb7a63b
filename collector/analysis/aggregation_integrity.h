// Aggregation integrity (docs/DESIGN.md "Aggregation integrity"): does the all-reduced gradient
// equal the mean of the ranks' local gradients?
//
// Count sketches are linear, so the sketch s of the reduced gradient (sent by one rank of the
// group, computed in float32 from the reduced buffer) must equal the mean m of the ranks' local
// sketches x_r up to rounding. CheckAggregation compares ||s - m||_2 with a tolerance derived from
// the arithmetic (docs/DESIGN.md "Aggregation integrity: the tolerance"):
//
//   tau = kIntegrityLambda * sqrt(V_enc + V_red) + kIntegrityFloor * ||m||,
//   V_enc = sum_b [ sum_r d_rb^2 / W^2 + d_sb^2 ] / 3    (the sketches' own rounding:
//           d = 2^-24 |x| for float32, 2^-11 |x| + 2^-25 scale for float16, scale / 2 for int8;
//           the reduced sketch is float32),
//   V_red = u^2 * sum_r ||g_r||^2                          (the all-reduce's rounding in the
//           gradient's dtype, unit roundoff u = 2^-p: the pre-divide by W and W - 1 additions per
//           coordinate, each a zero-mean error of at most u times its operand),
//
// where ||g_r|| are the ranks' exact local gradient norms. A step whose error exceeds tau is
// flagged; then the reduced sketch is regressed on the local sketches (least squares over the k
// bins, one weight per rank, W * w_r = 1 each when the reduction is right) to name the rank whose
// contribution is missing (W w ~ 0), doubled (W w ~ 2) or otherwise scaled; a residual that no
// rank's weight explains (every rank got the same wrong sum) names no rank.
//
// Pure: no threads, no clock; O(W k) per checked step, plus O(W^2 k + W^3) for the regression of a
// flagged step (at most kIntegrityMaxRegressionRanks ranks; larger groups are flagged without a
// rank named).
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_AGGREGATION_INTEGRITY_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_AGGREGATION_INTEGRITY_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "common/sketch_encoding.h"

namespace rankscope::collector {

// The tolerance's multiple of the modelled standard deviation of ||s - m||, and its relative
// floor (the float64 arithmetic of the comparison itself, far below every other term).
inline constexpr double kIntegrityLambda = 4.0;
inline constexpr double kIntegrityFloor = 1e-9;
// A weight is named missing / doubled / scaled when |W w_r - 1| exceeds this.
inline constexpr double kIntegrityWeightMargin = 0.5;
// Groups larger than this are checked but not regressed (O(W^2 k) on a flagged step).
inline constexpr uint32_t kIntegrityMaxRegressionRanks = 256;

// One rank's local sketch and exact local gradient norm.
struct IntegrityInput {
  uint32_t rank = 0;
  SketchView sketch;
  double grad_norm = 0.0;
};

enum class AggregationFault : uint8_t {
  kNone = 0,
  kSum,        // the reduced sketch differs, and no rank's weight explains it (same wrong sum)
  kMissing,    // a rank's weight is ~0: its contribution was dropped
  kDoubled,    // a rank's weight is ~2/W: counted twice
  kScaled,     // a rank's weight is off 1/W otherwise
  kCorrupted,  // the best weights leave a residual, and a rank's weight is off: named, corrupted
};

// "", "sum", "missing", "doubled", "scaled", "corrupted" (step_stats.integrity_fault).
const char* AggregationFaultName(AggregationFault f);

struct AggregationVerdict {
  bool checked = false;  // a reduced sketch was compared
  uint32_t sender_rank = 0;
  double error = std::numeric_limits<double>::quiet_NaN();           // ||s - m||
  double tolerance = std::numeric_limits<double>::quiet_NaN();       // tau
  double relative_error = std::numeric_limits<double>::quiet_NaN();  // ||s - m|| / ||s||
  bool flagged = false;                                              // error > tolerance
  AggregationFault fault = AggregationFault::kNone;
  std::optional<uint32_t> suspect_rank;
  // W * w_r of the suspect rank (1 expected), NaN when no regression ran.
  double suspect_weight = std::numeric_limits<double>::quiet_NaN();
  // W * w_r per input, in input order; empty when no regression ran.
  std::vector<double> weights;
  // ||s - X w|| / tau after the regression (<= 1: the weights explain the difference).
  double residual_ratio = std::numeric_limits<double>::quiet_NaN();
};

// Compares `reduced` (float32, the reduced gradient's sketch sent by `sender_rank`) with the mean
// of `locals` (every rank of the group, one each; `world_size` of them) and, when flagged,
// regresses. `mantissa_bits` is the precision p of the reduced gradient's dtype (24 float32,
// 8 bfloat16, 11 float16). Not checked (checked == false) when a rank is missing, a sketch's
// length differs from the reduced one's, or a value is not finite.
AggregationVerdict CheckAggregation(absl::Span<const IntegrityInput> locals,
                                    absl::Span<const float> reduced, uint32_t sender_rank,
                                    uint32_t world_size, uint32_t mantissa_bits);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_AGGREGATION_INTEGRITY_H_
