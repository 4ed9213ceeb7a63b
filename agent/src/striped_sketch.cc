#include "rankscope/striped_sketch.h"

#include <algorithm>
#include <cassert>

#include "worker_pool.h"

namespace rankscope {
namespace {

size_t ElementSize(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

uint32_t SlotCount(uint32_t dim) {
  const uint32_t by_memory =
      std::max<uint32_t>(1, (uint32_t{1} << 20) / std::max<uint32_t>(dim, 1));
  return std::min(StripedSketch::kMaxSlots, by_memory);
}

}  // namespace

StripedSketch::StripedSketch(uint32_t dim, uint64_t seed, int threads)
    : merged_(dim, seed), pool_(std::make_unique<WorkerPool>(threads)) {
  const uint32_t n = SlotCount(merged_.dim());
  slots_.reserve(n);
  for (uint32_t i = 0; i < n; ++i) slots_.emplace_back(merged_.dim(), seed);
  touched_.assign(n, false);
  pieces_.resize(n);
}

StripedSketch::~StripedSketch() = default;

int StripedSketch::threads() const { return pool_->threads(); }

void StripedSketch::Reset() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (touched_[i]) slots_[i].Reset();
    touched_[i] = false;
  }
  merged_.Reset();
  merged_valid_ = true;
}

void StripedSketch::Add(const void* data, ScalarType type, size_t n, uint64_t offset) {
  const Segment segment{data, n, offset};
  AddSegments(absl::MakeConstSpan(&segment, 1), type);
}

void StripedSketch::AddSegments(absl::Span<const Segment> segments, ScalarType type,
                                absl::Span<double> segment_squares) {
  assert(segment_squares.empty() || segment_squares.size() == segments.size());
  const bool squares = !segment_squares.empty() && segment_squares.size() == segments.size();
  const size_t size = ElementSize(type);
  const uint64_t slot_count = slots_.size();
  size_t total = 0;
  busy_.clear();
  piece_segment_.clear();
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const auto* p = static_cast<const unsigned char*>(s.data);
    uint64_t offset = s.offset;
    size_t left = s.n;
    total += left;
    while (left > 0) {
      const uint64_t stripe = offset / kStripe;
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(left, (stripe + 1) * kStripe - offset));
      const auto slot = static_cast<uint32_t>(stripe % slot_count);
      if (pieces_[slot].empty()) busy_.push_back(slot);
      pieces_[slot].push_back(Piece{p, n, offset, piece_segment_.size()});
      piece_segment_.push_back(static_cast<uint32_t>(i));
      p += n * size;
      offset += n;
      left -= n;
    }
  }
  if (busy_.empty()) return;
  merged_valid_ = false;
  std::sort(busy_.begin(), busy_.end());
  // Each piece's squares into its own entry (no two threads share one), summed below in order.
  if (squares) piece_squares_.assign(piece_segment_.size(), 0.0);
  double* const piece_squares = squares ? piece_squares_.data() : nullptr;
  auto add_slot = [&](int task) {
    const uint32_t slot = busy_[task];
    for (const Piece& piece : pieces_[slot]) {
      slots_[slot].Add(piece.data, type, piece.n, piece.offset,
                       piece_squares == nullptr ? nullptr : piece_squares + piece.id);
    }
  };
  if (total < 2 * kStripe || pool_->threads() == 1) {
    for (size_t t = 0; t < busy_.size(); ++t) add_slot(static_cast<int>(t));
  } else {
    pool_->Run(static_cast<int>(busy_.size()), add_slot);
  }
  for (uint32_t slot : busy_) {
    touched_[slot] = true;
    pieces_[slot].clear();
  }
  if (squares) {
    for (size_t id = 0; id < piece_segment_.size(); ++id) {
      segment_squares[piece_segment_[id]] += piece_squares_[id];
    }
  }
}

const CountSketch& StripedSketch::sketch() {
  if (!merged_valid_) {
    merged_.Reset();
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (touched_[i]) merged_.MergeFrom(slots_[i]);
    }
    merged_valid_ = true;
  }
  return merged_;
}

}  // namespace rankscope
