// The outlier score's scale floor (rank_diagnostics.h, "Scale floor"; issue 36, item 4): per job,
// the last kOutlierScaleWindowSteps steps' own cross-rank scales of each outlier signal, and their
// median as the floor of the next step's scale. Pure: no threads, no clock.
//
// Why the median of recent steps. A step's MAD scale from W ranks is an estimate with its own
// spread, widest at small W (4 ranks: when three agree closely it is a fraction of the usual
// spread). The signals' spread across ranks moves slowly with training (the loss and its spread
// fall over hundreds of steps), so the last 16 steps estimate it with about 16 times the data;
// their median is robust to a few steps where a fault widened it. The floor is the median itself
// (no factor): a step may still see a *larger* spread than usual (its own scale wins), never a
// much smaller one. Nothing is floored before kOutlierScaleMinSteps steps are in the window.
//
// State: 3 x kOutlierScaleWindowSteps doubles per job (StepAnalyzer keeps one per job and epoch).
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_OUTLIER_SCALE_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_OUTLIER_SCALE_H_

#include <array>
#include <cstddef>

#include "collector/analysis/rank_diagnostics.h"

namespace rankscope::collector {

inline constexpr size_t kOutlierScaleWindowSteps = 16;
inline constexpr size_t kOutlierScaleMinSteps = 4;

class OutlierScaleWindow {
 public:
  // Adds one step's own scales (ComputeOutlierScores' `step_scales`); the oldest step leaves once
  // the window is full. NaN scales are kept and ignored by Floor.
  void Push(const SignalScales& scales);

  // Per signal, the median of the finite scales in the window; NaN (no floor) while fewer than
  // kOutlierScaleMinSteps of them are finite.
  SignalScales Floor() const;

  size_t steps() const { return count_; }

 private:
  std::array<SignalScales, kOutlierScaleWindowSteps> ring_{};
  size_t next_ = 0;
  size_t count_ = 0;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_OUTLIER_SCALE_H_
