// ReportRing: the bounded, preallocated queue between Agent::Record() and the sender thread.
//
// Push copies a report into the next slot; when all slots are full it overwrites the oldest
// report and says so (the caller counts the drop). Pop swaps the oldest slot's buffers with the
// caller's, so neither side allocates once every slot's sketch buffer has reached its size.
//
// Thread safety: thread-compatible; the Agent guards its ring with its own mutex.
#ifndef RANKSCOPE_AGENT_SRC_REPORT_QUEUE_H_
#define RANKSCOPE_AGENT_SRC_REPORT_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "rankscope/agent.h"

namespace rankscope::internal {

// An owned copy of a StepReport, plus when it was recorded.
struct QueuedReport {
  uint64_t step = 0;
  double loss = 0.0;
  bool loss_absent = false;
  double grad_norm = 0.0;
  std::vector<float> sketch;
  std::vector<float> bucket_norms;
  std::optional<uint64_t> reduced_grad_fingerprint;
  std::optional<uint64_t> param_fingerprint;
  std::optional<uint32_t> replica_set;
  std::optional<double> reduced_grad_norm;
  std::optional<double> step_time_seconds;
  uint32_t local_batch_size = 0;
  std::vector<float> reduced_sketch;  // empty on most steps
  uint32_t reduced_grad_mantissa_bits = 0;
  std::vector<double> param_projections;  // empty: no summary (the exact check)
  double param_rounding = 0.0;
  std::vector<double> reduced_grad_projections;  // empty: no summary
  double reduced_grad_rounding = 0.0;
  uint32_t reduced_grad_precision = 0;
  int64_t recorded_unix_nanos = 0;
};

class ReportRing {
 public:
  // Requires capacity >= 1. Each slot's sketch buffer is reserved for `sketch_dim` floats.
  // `buckets` floats are reserved for the per-bucket norms.
  ReportRing(size_t capacity, uint32_t sketch_dim, size_t buckets = 0);

  // Copies `report` into the ring. Returns true if the oldest report was dropped to make room.
  bool Push(const StepReport& report, int64_t recorded_unix_nanos);

  // Moves the oldest report into *out (swapping buffers). Returns false when empty.
  bool Pop(QueuedReport* out);

  // Forgets every queued report; the slots keep their buffers.
  void Clear() {
    head_ = 0;
    size_ = 0;
  }

  size_t size() const { return size_; }
  size_t capacity() const { return slots_.size(); }
  bool empty() const { return size_ == 0; }

 private:
  std::vector<QueuedReport> slots_;
  size_t head_ = 0;  // oldest
  size_t size_ = 0;
};

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_REPORT_QUEUE_H_
