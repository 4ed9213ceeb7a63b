// Sketch buffers handed back by the step thread once it is done with a step's reports, reused by
// OnReport for the next reports' sketches. Without it every report costs a malloc of its sketch
// on a gRPC thread and its free on the step thread (4 KiB at k = 1024 float32 or k = 4096 int8:
// glibc serves such chunks from its shared bins, under the arena lock, not from the per-thread
// cache). Float sketches and packed ones (common/sketch_encoding.h) have a free list each; both
// together are bounded by kMaxBytes of capacity.
//
// One per StepPipeline (which hands its buffers out in OnReport and takes them back on the step
// thread), not one per process: two collectors in a process (tests, benchmarks) do not share
// buffers or their bound.
//
// Thread safety: thread-safe.
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_SKETCH_BUFFER_POOL_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_SKETCH_BUFFER_POOL_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "collector/model/rank_report.h"
#include "common/mutex.h"

namespace rankscope::collector {

class SketchBufferPool {
 public:
  // A buffer with no particular size or contents (empty, capacity 0, when the pool is empty).
  std::vector<float> TakeFloats() {
    MutexLock lock(&mu_);
    return TakeLocked(free_floats_);
  }
  std::string TakePacked() {
    MutexLock lock(&mu_);
    return TakeLocked(free_packed_);
  }

  // Takes back the buffers of `reports` (their sketches are left empty).
  void Give(std::vector<RankReport>& reports) {
    MutexLock lock(&mu_);
    for (RankReport& r : reports) GiveLocked(r);
  }
  void Give(RankReport& report) {
    // e.g. moved into the joiner: nothing to lock for
    if (report.sketch.capacity() == 0 && report.sketch_packed.capacity() <= kInlineCapacity) return;
    MutexLock lock(&mu_);
    GiveLocked(report);
  }

 private:
  static constexpr size_t kMaxBytes = 32 << 20;
  // A std::string of this capacity or less holds its characters inline: nothing to reuse.
  static constexpr size_t kInlineCapacity = 15;

  static size_t Bytes(const std::vector<float>& v) { return v.capacity() * sizeof(float); }
  static size_t Bytes(const std::string& s) {
    return s.capacity() <= kInlineCapacity ? 0 : s.capacity();
  }

  template <typename Buffer>
  Buffer TakeLocked(std::vector<Buffer>& list) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (list.empty()) return {};
    Buffer b = std::move(list.back());
    list.pop_back();
    bytes_ -= Bytes(b);
    return b;
  }

  template <typename Buffer>
  void GiveLocked(Buffer& buffer, std::vector<Buffer>& list) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t bytes = Bytes(buffer);
    if (bytes == 0 || bytes_ + bytes > kMaxBytes) return;
    bytes_ += bytes;
    list.push_back(std::move(buffer));
    buffer = Buffer();
  }

  void GiveLocked(RankReport& report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    GiveLocked(report.sketch, free_floats_);
    GiveLocked(report.sketch_packed, free_packed_);
  }

  Mutex mu_;
  std::vector<std::vector<float>> free_floats_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> free_packed_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_SKETCH_BUFFER_POOL_H_
