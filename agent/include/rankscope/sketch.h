// Count sketch of a flat gradient vector (DESIGN.md "Sketch").
//
// Coordinate i of the flat vector goes to bin h(i) mod k with sign s(i) = +-1, both taken from
// one 64-bit mix of (i, seed). Every rank must use the same (k, seed) and the same flat index
// order, or the sketches are not comparable. The sketch is linear, so a gradient may be fed
// chunk by chunk in any order, each chunk with the global offset of its first coordinate, and the
// result equals feeding it whole (exactly, up to floating-point summation order in the bins).
//
// Thread safety: a CountSketch is thread-compatible (const methods may be called concurrently;
// mutation needs external synchronization). The free functions are thread-safe.
#ifndef RANKSCOPE_SKETCH_H_
#define RANKSCOPE_SKETCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace rankscope {

inline constexpr uint32_t kDefaultSketchDim = 1024;
inline constexpr uint64_t kDefaultSketchSeed = 0x72616e6b73636f70ULL;  // "rankscop"
inline constexpr uint32_t kMaxSketchDim = 1u << 20;

// Element types a gradient chunk may have. Values match the C API's RANKSCOPE_DTYPE_*.
enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Where coordinate `index` lands: a bin in [0, dim) and a sign of +1.0f or -1.0f.
struct SketchSlot {
  uint32_t bin;
  float sign;
};

// The 64-bit mix of (index, seed) from which bin and sign are taken. Pure; identical on every
// platform. The bin is taken from the high bits (mix >> 32) mod dim, the sign from the lowest bit.
uint64_t SketchMix(uint64_t index, uint64_t seed);
SketchSlot SketchHash(uint64_t index, uint64_t seed, uint32_t dim);

// Converts one bfloat16 / IEEE float16 value (given as raw bits) to float, exactly.
float BFloat16ToFloat(uint16_t bits);
float Float16ToFloat(uint16_t bits);

class CountSketch {
 public:
  // Requires 1 <= dim <= kMaxSketchDim.
  CountSketch(uint32_t dim, uint64_t seed);

  uint32_t dim() const { return static_cast<uint32_t>(bins_.size()); }
  uint64_t seed() const { return seed_; }

  // Zeroes the bins and the sum of squares.
  void Reset();

  // Adds coordinates [offset, offset + n) of the flat vector, read from `data` as `type`.
  void Add(const void* data, ScalarType type, size_t n, uint64_t offset);
  void AddFloat32(const float* data, size_t n, uint64_t offset) {
    Add(data, ScalarType::kFloat32, n, offset);
  }

  // The bins, accumulated in double precision.
  absl::Span<const double> bins() const { return bins_; }
  // Writes the bins as float into out; out.size() must equal dim().
  void CopyTo(absl::Span<float> out) const;
  std::vector<float> ToFloats() const;

  // Exact sum of squares of every coordinate added so far (accumulated in double): the squared
  // L2 norm of the gradient, not an estimate from the sketch.
  double sum_squares() const { return sum_squares_; }

 private:
  uint64_t seed_;
  std::vector<double> bins_;
  double sum_squares_ = 0.0;
};

// Inner product and cosine of two sketches (double accumulation). Cosine is 0 when either vector
// is zero, NaN when either holds a non-finite value.
double SketchDot(absl::Span<const float> a, absl::Span<const float> b);
double SketchCosine(absl::Span<const float> a, absl::Span<const float> b);

}  // namespace rankscope

#endif  // RANKSCOPE_SKETCH_H_
