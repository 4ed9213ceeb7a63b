// How a count sketch's bins travel and are held (DESIGN.md "Sketch encodings"): the one
// definition shared by the agent (which packs), the collector (which validates, keeps and reads
// packed sketches) and the Python shim (which picks the encoding and k from a byte budget).
//
// Encodings, and the exact value `x_i` a bin stands for:
//  - kFloat32: 4 bytes a bin, x_i = the float (the `repeated float sketch` of old agents).
//  - kFloat16: 2 bytes a bin (IEEE binary16, little-endian), x_i = half_i * scale. The agent picks
//    scale = 2^(e - 15) where 2^(e-1) <= max_i |v_i| < 2^e, so v_i / scale is exact and every
//    |v_i / scale| < 2^15: no overflow, and only bins below 2^-29 of the largest become
//    subnormal. Each bin is rounded to nearest, ties to even: |x_i - v_i| <= 2^-11 |v_i| for
//    normal halves.
//  - kInt8: 1 byte a bin (two's complement, -127..127; -128 is never produced and decodes as
//    -128), x_i = q_i * scale with scale = max_i |v_i| / 127 rounded to float, and
//    q_i = v_i / scale rounded to nearest, ties to even, clamped to [-127, 127]:
//    |x_i - v_i| <= scale / 2 (plus the clamp's, at most one float ulp of the max).
// The rounding is deterministic (no stochastic rounding): the quantization error is a fixed
// function of the sketch. Its effect on an inner product estimate <x, y> is bounded by
// |<x, y> - <v, w>| <= |<x - v, w>| + |<v, y - w>| + |<x - v, y - w>|, and for int8, whose errors
// are near uniform on [-scale/2, scale/2] and uncorrelated with the bins, it adds a variance of
// about k scale^2 / 12 to each squared norm (tests/common/sketch_encoding_test.cc measures it).
//
// Special values. A sketch whose bins are all zero has scale 1 and zero bins. A sketch holding
// NaN or +/-Inf is sent with scale NaN (and zero bins) in the packed encodings: every decoded
// value is then NaN, as the float32 path would make every cosine NaN. Any other non-positive or
// infinite scale is invalid input (the collector's validation refuses it).
//
// Every decoded value is exact in double: a half or an int8 times a float has at most 35
// significant bits. Decoding is therefore the same on every CPU and instruction set.
//
// Pure functions, no state: usable from any thread.
#ifndef RANKSCOPE_COMMON_SKETCH_ENCODING_H_
#define RANKSCOPE_COMMON_SKETCH_ENCODING_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace rankscope {

// Values match rankscope.v1.SketchEncoding on the wire.
enum class SketchEncoding : uint8_t { kFloat32 = 0, kFloat16 = 1, kInt8 = 2 };

// Bytes one bin takes: 4, 2 or 1.
constexpr size_t SketchBytesPerBin(SketchEncoding e) {
  return e == SketchEncoding::kFloat16 ? 2 : (e == SketchEncoding::kInt8 ? 1 : 4);
}

// "float32", "float16", "int8".
const char* SketchEncodingName(SketchEncoding e);

// The encoding named `name` (as SketchEncodingName spells it), or nullopt.
std::optional<SketchEncoding> ParseSketchEncoding(absl::string_view name);

// The encoding with wire value `value`, or nullopt for an unknown one.
std::optional<SketchEncoding> SketchEncodingFromWire(int value);

// IEEE binary16 <-> binary32. FloatFromHalf is exact (every half is a float); HalfFromFloat
// rounds to nearest, ties to even (overflow to +/-Inf, NaN stays NaN), independent of the
// floating-point environment's rounding mode.
uint16_t HalfFromFloat(float f);
float FloatFromHalf(uint16_t h);

// A packed (float16 or int8) sketch: `bins` holds k * SketchBytesPerBin bytes.
struct PackedSketch {
  std::string bins;
  float scale = 1.0f;
};

// Packs `values` in `encoding` (kFloat16 or kInt8; kFloat32 returns the floats' bytes with
// scale 1) as the file comment states. O(k), no allocation beyond the result.
PackedSketch PackSketch(absl::Span<const float> values, SketchEncoding encoding);

// A read-only view of one sketch in any encoding: `dim` bins at `data` (any alignment), decoded
// as the file comment states. Implicitly made from float values (kFloat32), so code written for
// float sketches keeps working.
struct SketchView {
  SketchEncoding encoding = SketchEncoding::kFloat32;
  const void* data = nullptr;
  size_t dim = 0;
  float scale = 1.0f;  // kFloat16 and kInt8 only (kFloat32 ignores it)

  SketchView() = default;
  SketchView(absl::Span<const float> floats)  // NOLINT(google-explicit-constructor)
      : data(floats.data()), dim(floats.size()) {}
  SketchView(const std::vector<float>& floats)  // NOLINT(google-explicit-constructor)
      : data(floats.data()), dim(floats.size()) {}
  SketchView(SketchEncoding e, const void* bytes, size_t k, float s)
      : encoding(e), data(bytes), dim(k), scale(s) {}

  size_t size() const { return dim; }
  bool empty() const { return dim == 0; }
  size_t byte_size() const { return dim * SketchBytesPerBin(encoding); }
  // The exact value of bin i (i < dim).
  double Value(size_t i) const;
  // True iff every decoded value is finite (a packed sketch: its scale is finite).
  bool AllFinite() const;
  // The values as floats; kFloat32 only.
  absl::Span<const float> floats() const {
    return absl::MakeConstSpan(static_cast<const float*>(data), dim);
  }
};

// sum_i a_i b_i of the decoded values (a.size() == b.size()), summed in double in index order
// except for two int8 sketches, whose integer products are summed exactly and scaled once. One
// dispatch on the encodings, not one per bin.
double SketchDot(const SketchView& a, const SketchView& b);

// The decoded values of `view` as doubles (tests and benchmarks).
std::vector<double> DecodeSketch(const SketchView& view);

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_SKETCH_ENCODING_H_
