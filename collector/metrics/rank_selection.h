// Which ranks of a step get per-rank Prometheus series (prometheus_export.h "Per-rank series").
//
// Pure: no I/O, no threads, no prometheus-cpp.
#ifndef RANKSCOPE_COLLECTOR_METRICS_RANK_SELECTION_H_
#define RANKSCOPE_COLLECTOR_METRICS_RANK_SELECTION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/step_stats.h"

namespace rankscope::collector {

// Returns indices into `ranks` of the (at most) `limit` ranks to export, without duplicates, taken
// round-robin from these rankings, in this priority: largest held outlier score, lowest consensus
// cosine, largest |loss_z|, largest |grad_norm_z|, largest step-time z, largest drift score,
// largest slow score. The rankings from `extras` (the outlier score and the last three) are used
// only when extras.size() == ranks.size() (extras[i] goes with ranks[i]); otherwise `extras` is
// ignored. A NaN cosine or z-score is the most deviating; a NaN outlier score, step-time z, drift
// or slow score the least (not measured). Ties go to the lower rank number. When every rank fits
// (limit >= ranks.size()) all are returned, ordered by the first ranking alone.
std::vector<uint32_t> SelectDeviatingRanks(absl::Span<const RankStatistics> ranks,
                                           absl::Span<const RankExtras> extras, size_t limit);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_METRICS_RANK_SELECTION_H_
