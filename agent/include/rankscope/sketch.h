// Count sketch of a flat gradient vector (DESIGN.md "Sketch").
//
// A block count sketch: coordinate i of the flat vector lies in block i / 32 at offset i % 32.
// One 64-bit mix of (block, seed) gives the block a base bin, uniform in [0, dim), and 32 sign
// bits; offset o of the block goes to bin (base + o) mod dim with the sign of bit o. Every rank
// must use the same (k, seed) and the same flat index order, or the sketches are not comparable.
// The sketch is linear, so a gradient may be fed chunk by chunk in any order (chunks may start
// and end anywhere, mid-block included), each chunk with the global offset of its first
// coordinate, and the result equals feeding it whole (exactly, up to floating-point rounding).
//
// Why it keeps DESIGN.md's contract (unbiased inner products, cosine error ~ 1/sqrt(k)): the
// estimate <Sa, Sb> = sum_{i,j} s(i) s(j) [h(i) = h(j)] a_i b_j has a mean and a variance that
// depend only on the pairwise collision probabilities and on the independence of the signs. Two
// coordinates in different blocks collide with probability exactly 1/dim (their bases are
// independent and uniform over all dim values, whatever their offsets); two in the same block
// never collide (dim >= 32: the window holds 32 distinct bins); every coordinate has its own sign
// bit. So E<Sa, Sb> = <a, b>, and the variance is no larger than that of the per-coordinate count
// sketch (whose same-block pairs collide with probability 1/dim); the cosine error still shrinks
// like 1/sqrt(k). For dim < 32 a window wraps onto itself and same-block pairs may collide, with
// signs still independent, so the estimate stays unbiased. The window is what makes the kernel
// fast: one hash per 32 coordinates and contiguous vector updates (docs/PERFORMANCE.md).
//
// Rounding (the same bits on every instruction-set path; docs/ARCHITECTURE.md "Sketch hash"):
// coordinate i's value, sign applied, is a float (exact: 16-bit types widen exactly).
//   - Bins: the coordinates are cut at fixed global positions into segments of
//     SketchSegment(dim) coordinates. Within a segment the sums are kept in dim + 31 float
//     partials: offset o of a block with base b goes to partial b + o, which belongs to bin
//     (b + o) mod dim (partials dim .. dim + 30 hold the part of a window that wraps past the
//     last bin). Each partial sums its values in float, in ascending index order, from +0; when
//     the segment is closed, the partials are added into their bins' doubles in ascending
//     partial order (so bin j < 31 takes its own partial, then its wrapped one). So a bin's
//     error is at most about (values per bin per segment, ~32 to 64) x 2^-24 of the magnitudes
//     it sums: far below the sketch's own 1/sqrt(k).
//   - Sum of squares: the coordinates are cut at fixed global positions into runs of
//     kSketchSquareRun = 1024. Within a run, coordinate i's square goes into float partial sum
//     i % 32 by one fused multiply-add; when the run is closed, partial l is added into double
//     lane l, and sum_squares() folds the 32 double lanes in a fixed order. Relative error at
//     most about 2^-19 (32 terms a float partial); a coordinate of magnitude >= 2^64 overflows
//     its float square and makes the sum +inf, as does an infinite one (NaN stays NaN).
//   - A call's own squares (Add's `squares`): the same squares (one fused multiply-add each into
//     float partial i % 32), but in partials of the call's own, which are added into 32 double
//     lanes of the call's own at every run boundary and wherever the call's head (up to the
//     first block boundary), body (whole blocks) and tail end; the lanes are then folded in the
//     fixed order of sum_squares() and added to *squares. So at most 32 squares meet in a float
//     partial: relative error at most about 2^-19 of the sum (2^-24 for each of <= 32 float
//     additions, the double part exact to ~2^-50), whatever the length; identical bits on
//     every instruction-set path; independent of what the sketch held before. (It replaces the
//     shim's float32 torch norm, squared, for the per-bucket norms: both are float rounding
//     away from the exact value; tests/python/test_bucket_norms* hold it to 1e-5 of it.)
//   A segment or run is closed when an Add goes on past its end, when an Add starts in another
//   one, and when the sketch is read (bins(), sum_squares(), CopyTo, ToFloats, MergeFrom). So
//   chunks fed in ascending order, with no read between them, give the bits of one whole Add.
//
// Thread safety: thread-compatible, with one exception to the usual rule: a read closes the
// open segment and run, so even the const methods must not run concurrently with each other on
// one CountSketch. The free functions are thread-safe.
#ifndef RANKSCOPE_SKETCH_H_
#define RANKSCOPE_SKETCH_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/types/span.h"

namespace rankscope {

inline constexpr uint32_t kDefaultSketchDim = 1024;
inline constexpr uint64_t kDefaultSketchSeed = 0x72616e6b73636f70ULL;  // "rankscop"
inline constexpr uint32_t kMaxSketchDim = 1u << 20;
// Coordinates that share one hash (the block), and the run of the float sums of squares.
inline constexpr uint32_t kSketchBlock = 32;
inline constexpr uint32_t kSketchSquareRun = 1024;

// The length of the segments whose float partial bins are summed before they go into the
// double bins: max(2^16, the smallest power of two >= 32 * dim). A power of two, so a multiple
// of kSketchSquareRun and of StripedSketch's stripe, and at least 32 values a bin on average.
uint64_t SketchSegment(uint32_t dim);

// Element types a gradient chunk may have. Values match the C API's RANKSCOPE_DTYPE_*.
enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Where coordinate `index` lands: a bin in [0, dim) and a sign of +1.0f or -1.0f.
struct SketchSlot {
  uint32_t bin;
  float sign;
};

// SketchMix is output number `index` (counting from 0) of the SplitMix64 generator seeded with
// `seed` (Vigna, prng.di.unimi.it/splitmix64.c); SketchHash applies it to the BLOCK index. Pure;
// identical on every platform. All arithmetic is on uint64 modulo 2^64, and every >> is a
// LOGICAL shift:
//
//   z = seed + (index + 1) * 0x9E3779B97F4A7C15
//   z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//   z = (z ^ (z >> 27)) * 0x94D049BB133111EB
//   SketchMix(index, seed) = z ^ (z >> 31)
//
//   SketchHash(i, seed, dim), for coordinate i:
//   mix  = SketchMix(i >> 5, seed)                (one mix per block of 32 coordinates)
//   o    = i & 31                                 (the offset in the block)
//   bin  = ((mix >> 32) % dim + o) % dim          (exact remainders, also for dims not 2^n)
//   sign = ((mix >> o) & 1) == 0 ? +1.0f : -1.0f  (bits 0-31 are the block's 32 signs)
//
// A port to signed int64 (e.g. torch tensors on a GPU) gets the same bits: + and * wrap the same
// way in two's complement, but >> on int64 is arithmetic there, so write the logical shift as
// (z >> s) & ((1 << (64 - s)) - 1); (mix >> 32) then lies in [0, 2^32) and % dim is unchanged
// (bit o of mix, o < 32, is the same under either shift).
// The three constants are defined once, below; the Python shim reads them from rankscope._native
// (SKETCH_MIX_CONSTANTS) into its one Python copy (torch_sketch.py), which its Triton kernels get
// as arguments (triton_kernels.py); tests/python/test_shim.py compares them with this text.
// Test vectors: SketchMix(0, 0) == 0xE220A8397B1DCDAF;
//   SketchMix(0, kDefaultSketchSeed) == 0x9609B8E9179AF10C;
//   SketchMix(385, kDefaultSketchSeed) == 0xFD1FA0A8C3134223 (block 385 holds 12320-12351);
//   SketchHash(0, kDefaultSketchSeed, 1024) == {233, +1}; SketchHash(31, ..., 1024) == {264, +1};
//   SketchHash(12345, ..., 1024) == {193, -1}; SketchHash(12345, ..., 1000) == {417, -1};
//   SketchHash(12345, ..., 7) == {0, -1}.
inline constexpr uint64_t kSketchMixGolden = 0x9E3779B97F4A7C15ULL;
inline constexpr uint64_t kSketchMixM1 = 0xBF58476D1CE4E5B9ULL;
inline constexpr uint64_t kSketchMixM2 = 0x94D049BB133111EBULL;
uint64_t SketchMix(uint64_t index, uint64_t seed);
SketchSlot SketchHash(uint64_t index, uint64_t seed, uint32_t dim);

// Converts one bfloat16 / IEEE float16 value (given as raw bits) to float, exactly: subnormals,
// signed zeros and infinities included. A bfloat16 NaN keeps all its bits (bits << 16); a float16
// NaN keeps its sign and payload and comes out quiet, as x86 F16C's vcvtph2ps gives it. Inline:
// the kernels call them per element.
inline float BFloat16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float Float16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    // Infinity, or a NaN made quiet (bit 22) with its payload kept.
    u = sign | 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u);
  } else if (exponent != 0) {
    u = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&u, &magnitude, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

class CountSketch;

namespace sketch_internal {

// The instruction sets CountSketch::Add has code paths for. All paths give bit-identical bins
// and sums of squares; Add picks the best one the CPU supports. Tests and benchmarks pin a path
// with AddWithIsa to prove and to measure that.
enum class KernelIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// True iff this build and this CPU can run `isa` (kScalar always can).
bool KernelIsaSupported(KernelIsa isa);
// The supported paths, scalar first.
std::vector<KernelIsa> SupportedKernelIsas();
// The path CountSketch::Add uses on this CPU.
KernelIsa BestKernelIsa();
const char* KernelIsaName(KernelIsa isa);
// CountSketch::Add through the given path; `isa` must be supported.
void AddWithIsa(CountSketch& sketch, KernelIsa isa, const void* data, ScalarType type, size_t n,
                uint64_t offset, double* squares = nullptr);

}  // namespace sketch_internal

class CountSketch {
 public:
  // Requires 1 <= dim <= kMaxSketchDim.
  CountSketch(uint32_t dim, uint64_t seed);

  uint32_t dim() const { return static_cast<uint32_t>(bins_.size()); }
  uint64_t seed() const { return seed_; }

  // Zeroes the bins and the sum of squares.
  void Reset();

  // Adds coordinates [offset, offset + n) of the flat vector, read from `data` as `type`.
  // `data` needs no alignment. Chunks fed in ascending order of offset, with no read between
  // them, give bit-for-bit the bins and sum of squares of one whole Add; in any other order, or
  // read between chunks, they differ only by rounding (see "Rounding" above).
  // `squares`, when given, gets this call's own sum of squares added to it (see "Rounding": the
  // call's squares), read in the same pass: a parameter's squared gradient norm, for instance.
  void Add(const void* data, ScalarType type, size_t n, uint64_t offset, double* squares = nullptr);
  void AddFloat32(const float* data, size_t n, uint64_t offset) {
    Add(data, ScalarType::kFloat32, n, offset);
  }

  // Adds `other`'s bins and lanes of sums of squares to this one's (bin by bin, lane by lane),
  // both closed first: the sketch of both inputs, up to rounding. Requires the same dim and seed.
  void MergeFrom(const CountSketch& other);

  // The bins, in double precision (the open segment closed first). Valid until the next Add,
  // Reset or MergeFrom.
  absl::Span<const double> bins() const {
    Close();
    return bins_;
  }
  // Writes the bins as float into out; out.size() must equal dim().
  void CopyTo(absl::Span<float> out) const;
  std::vector<float> ToFloats() const;

  // The sum of squares of every coordinate added so far (see "Rounding" above): the squared
  // L2 norm of the gradient, not an estimate from the sketch.
  double sum_squares() const {
    Close();
    return sum_squares_;
  }

 private:
  friend void sketch_internal::AddWithIsa(CountSketch&, sketch_internal::KernelIsa, const void*,
                                          ScalarType, size_t, uint64_t, double*);
  // Lanes of the sums of squares: coordinate i goes to float partial i % 32 within its run, and
  // the run's partials to the double lanes of the same number.
  static constexpr int kSumSquaresLanes = 32;
  static constexpr uint64_t kNone = ~uint64_t{0};

  // Adds the open segment's float partial bins into the double bins and the open run's float
  // partial squares into the double lanes (zeroing the partials), and refolds sum_squares_.
  void Close() const;
  void CloseSegment() const;
  void CloseRun() const;

  uint64_t seed_;
  uint64_t segment_length_;  // SketchSegment(dim)
  // Mutable: a const read closes the open segment and run (see "Thread safety" above).
  mutable std::vector<double> bins_;
  // The open segment's dim + 31 float partials (see "Rounding"), else all +0.
  mutable std::vector<float> partial_bins_;
  mutable uint64_t open_segment_ = kNone;  // the segment partial_bins_ holds, if any
  // The open run's float sums of squares (all +0 when no run is open), and that run.
  mutable float partial_squares_[kSumSquaresLanes] = {};
  uint64_t open_run_ = kNone;
  mutable double square_lanes_[kSumSquaresLanes] = {};
  mutable double sum_squares_ = 0.0;  // the lanes folded in a fixed order by Close
};

// Inner product and cosine of two sketches (double accumulation). Cosine is 0 when either vector
// is zero, NaN when either holds a non-finite value. Both return NaN when the sizes differ.
double SketchDot(absl::Span<const float> a, absl::Span<const float> b);
double SketchCosine(absl::Span<const float> a, absl::Span<const float> b);

}  // namespace rankscope

#endif  // RANKSCOPE_SKETCH_H_
