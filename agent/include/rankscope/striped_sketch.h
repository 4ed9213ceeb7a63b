// A count sketch (rankscope/sketch.h) fed by several threads, bit-identical whatever the number
// of threads: for large CPU gradients (CPU training, optimizer or gradient offload), where one
// core sketches a few billion coordinates a second.
//
// Fixed partition: the flat vector's coordinates are cut into stripes of kStripe = 65,536
// coordinates at fixed global positions (stripe s holds [s * kStripe, (s + 1) * kStripe)), and
// stripe s is added into slot s mod slots(), one of slots() CountSketches (slots() =
// min(kMaxSlots, max(1, 2^20 / dim)): 16 at every dim up to 65,536, so at most 8 MiB of bins).
// A slot is added to by one thread at a time, and receives its coordinates in the same order
// whatever the number of threads: the calls' order, and within a call the segments' order and
// ascending coordinates. Deterministic merge: sketch() adds the slots into one CountSketch in
// slot order (CountSketch::MergeFrom, slots never added to since the last Reset skipped). So the
// bins and the sum of squares depend on the calls (their order and their cuts), as a
// CountSketch's do, but not on the thread count; they differ from one CountSketch fed the same
// calls only by rounding (the same values summed in another order).
//
// Threads: a call's slots are spread over the pool (WorkerPool: threads - 1 workers plus the
// caller, started by the constructor, joined by the destructor). A call of fewer than
// 2 * kStripe coordinates runs on the caller's thread alone (the result is the same).
//
// Thread safety: thread-compatible, like CountSketch (one caller at a time).
#ifndef RANKSCOPE_STRIPED_SKETCH_H_
#define RANKSCOPE_STRIPED_SKETCH_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "rankscope/sketch.h"

namespace rankscope {

class WorkerPool;

class StripedSketch {
 public:
  static constexpr uint64_t kStripe = uint64_t{1} << 16;
  static constexpr uint32_t kMaxSlots = 16;

  // Requires 1 <= dim <= kMaxSketchDim; threads < 1 counts as 1.
  StripedSketch(uint32_t dim, uint64_t seed, int threads);
  ~StripedSketch();
  StripedSketch(const StripedSketch&) = delete;
  StripedSketch& operator=(const StripedSketch&) = delete;

  uint32_t dim() const { return merged_.dim(); }
  uint64_t seed() const { return merged_.seed(); }
  int threads() const;
  uint32_t slots() const { return static_cast<uint32_t>(slots_.size()); }

  // Empties every slot.
  void Reset();

  // n values of `type` at `data` (no alignment needed) as coordinates [offset, offset + n).
  struct Segment {
    const void* data;
    size_t n;
    uint64_t offset;
  };
  void Add(const void* data, ScalarType type, size_t n, uint64_t offset);
  // The segments in order (one gradient bucket), in one pass over the threads. When
  // `segment_squares` is not empty it has one entry per segment, and segment i's sum of squares
  // is added to segment_squares[i], read in the same pass (CountSketch::Add's `squares`: the
  // sums of its stripes' pieces, added in ascending coordinate order, so the bits do not depend
  // on the thread count).
  void AddSegments(absl::Span<const Segment> segments, ScalarType type,
                   absl::Span<double> segment_squares = {});

  // The merged sketch, recomputed on the first call after an Add or Reset. Valid until the next
  // Add, AddSegments or Reset.
  const CountSketch& sketch();

 private:
  // A stripe's part of a segment, bound for one slot.
  struct Piece {
    const unsigned char* data;
    size_t n;
    uint64_t offset;
    size_t id;  // this call's pieces are numbered in order: piece_squares_[id]
  };

  std::vector<CountSketch> slots_;
  std::vector<bool> touched_;               // added to since the last Reset
  std::vector<std::vector<Piece>> pieces_;  // per slot, this call's pieces (reused buffers)
  std::vector<uint32_t> busy_;              // this call's slots with pieces, ascending
  std::vector<double> piece_squares_;       // this call's pieces' sums of squares, by id
  std::vector<uint32_t> piece_segment_;     // the segment each piece of this call is from
  CountSketch merged_;
  bool merged_valid_ = true;
  std::unique_ptr<WorkerPool> pool_;
};

}  // namespace rankscope

#endif  // RANKSCOPE_STRIPED_SKETCH_H_
