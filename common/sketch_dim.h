// The job's sketch dimension at a step: the one definition shared by the agent, the collector
// and the Python shim.
//
// A job starts with the sketch dimension of its hello (the identity's `base_dim`). An operator
// control (rankscope ctl) may re-tune it: the newest control that set a non-zero sketch_dim
// (a later control with sketch_dim 0 leaves it unchanged) names `retuned_dim` and the step from
// which the ranks use it. Ranks switch at a step they agree on at or after the control's
// apply_at_step, and a rank that sees the control late switches later still, so around the switch
// a job legitimately carries both dimensions: a report is consistent with the schedule when its
// sketch has either length, at any step (SketchDimAccepted). Cosines are only computed between
// sketches of one length (the collector masks a step whose reports mix them).
//
// Pure and header-only: no state, no locks, usable from any thread.
#ifndef RANKSCOPE_COMMON_SKETCH_DIM_H_
#define RANKSCOPE_COMMON_SKETCH_DIM_H_

#include <cstdint>

namespace rankscope {

struct SketchDimSchedule {
  uint32_t base_dim = 0;       // the identity's (hello's) sketch dimension
  uint32_t retuned_dim = 0;    // the newest control's sketch_dim; 0: never re-tuned
  uint64_t apply_at_step = 0;  // the first step that uses retuned_dim
};

// The sketch dimension the job's ranks use at `step`: retuned_dim from apply_at_step on (when a
// control re-tuned it), base_dim before.
constexpr uint32_t SketchDimAtStep(const SketchDimSchedule& s, uint64_t step) {
  return s.retuned_dim != 0 && step >= s.apply_at_step ? s.retuned_dim : s.base_dim;
}

// True iff a sketch of `dim` values is consistent with the schedule at any step: base_dim, or a
// control's retuned_dim (see the file comment for why the step is not consulted).
constexpr bool SketchDimAccepted(const SketchDimSchedule& s, uint64_t dim) {
  return dim == s.base_dim || (s.retuned_dim != 0 && dim == s.retuned_dim);
}

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_SKETCH_DIM_H_
