#include "report_queue.h"

#include <algorithm>
#include <utility>

namespace rankscope::internal {

ReportRing::ReportRing(size_t capacity, uint32_t sketch_dim, size_t buckets)
    : slots_(std::max<size_t>(capacity, 1)) {
  for (QueuedReport& slot : slots_) {
    slot.sketch.reserve(sketch_dim);
    slot.bucket_norms.reserve(buckets);
  }
}

bool ReportRing::Push(const StepReport& report, int64_t recorded_unix_nanos) {
  bool dropped = false;
  if (size_ == slots_.size()) {
    head_ = (head_ + 1) % slots_.size();
    --size_;
    dropped = true;
  }
  QueuedReport& slot = slots_[(head_ + size_) % slots_.size()];
  slot.step = report.step;
  slot.loss = report.loss;
  slot.loss_absent = report.loss_absent;
  slot.grad_norm = report.grad_norm;
  // assign() reuses the slot's capacity: no allocation once warm.
  slot.sketch.assign(report.sketch.begin(), report.sketch.end());
  slot.bucket_norms.assign(report.bucket_norms.begin(), report.bucket_norms.end());
  slot.reduced_grad_fingerprint = report.reduced_grad_fingerprint;
  slot.param_fingerprint = report.param_fingerprint;
  slot.replica_set = report.replica_set;
  slot.reduced_grad_norm = report.reduced_grad_norm;
  slot.step_time_seconds = report.step_time_seconds;
  slot.local_batch_size = report.local_batch_size;
  slot.reduced_sketch.assign(report.reduced_sketch.begin(), report.reduced_sketch.end());
  slot.reduced_grad_mantissa_bits = report.reduced_grad_mantissa_bits;
  slot.param_projections.assign(report.param_projections.begin(), report.param_projections.end());
  slot.param_rounding = report.param_rounding;
  slot.reduced_grad_projections.assign(report.reduced_grad_projections.begin(),
                                       report.reduced_grad_projections.end());
  slot.reduced_grad_rounding = report.reduced_grad_rounding;
  slot.reduced_grad_precision = report.reduced_grad_precision;
  slot.recorded_unix_nanos = recorded_unix_nanos;
  ++size_;
  return dropped;
}

bool ReportRing::Pop(QueuedReport* out) {
  if (size_ == 0) return false;
  QueuedReport& slot = slots_[head_];
  std::swap(*out, slot);
  head_ = (head_ + 1) % slots_.size();
  --size_;
  return true;
}

}  // namespace rankscope::internal
