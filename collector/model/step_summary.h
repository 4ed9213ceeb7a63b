// The statistics of one step across its ranks, declared once: computed by the analysis
// (StepStatistics, collector/analysis/step_stats.h, which adds the per-rank values), stored
// (StepRow, rows.h), exported to Prometheus (JobMetrics keeps the latest) and sent to the CLI
// (v1::StepStats, filled by FillStepStats in collector/query/row_proto.cc). Whoever copies them
// copies the StepSummary whole, so a statistic added here reaches every layer that holds one.
//
// Pure: plain values.
#ifndef RANKSCOPE_COLLECTOR_MODEL_STEP_SUMMARY_H_
#define RANKSCOPE_COLLECTOR_MODEL_STEP_SUMMARY_H_

#include <cstdint>

namespace rankscope::collector {

// Conventions (W = 1, zero vectors, NaN) are stated in collector/analysis/step_stats.h.
struct StepSummary {
  uint32_t ranks = 0;             // ranks whose reports the statistics cover
  double loss_mean = 0.0;         // of the ranks' local losses
  double loss_std = 0.0;          // population standard deviation
  double loss_range = 0.0;        // max - min
  double grad_norm_mean = 0.0;    // of the ranks' local gradient L2 norms
  double grad_norm_std = 0.0;     // population standard deviation
  double grad_norm_cv = 0.0;      // std / mean
  double grad_cosine_mean = 0.0;  // mean pairwise cosine of the ranks' sketches
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_STEP_SUMMARY_H_
