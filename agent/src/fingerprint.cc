#include "rankscope/fingerprint.h"

#include <cstring>

#include "absl/status/status.h"
#include "fold_partial_sums.h"
#include "rankscope/sketch.h"

namespace rankscope {
namespace {

// Partial sums of the squares (element i of a call into partial sum i % kSquareLanes, folded in
// a fixed order): independent additions the core can overlap, where one running sum chains
// every element's addition to the previous one's (4 cycles each). F needs no such care: integer
// addition is exact in any order.
constexpr size_t kSquareLanes = internal::kPartialSums;

// A float16's value for the sum of squares, branch-free so that the loop below vectorizes (the
// exact Float16ToFloat of sketch.h branches, and a loop over it stays scalar: a quarter of the
// speed). Its 15 exponent and mantissa bits moved to a float's places read as 2^-112 times the
// value, for normal and subnormal float16 alike, and one exact multiplication by 2^112 scales
// them; infinities and NaNs are selected apart. The one difference: under a denormals-are-zero
// floating-point mode a float16 subnormal (|v| < 2^-14) reads as 0 here, which moves the sum of
// squares by less than 2^-28 per such element; F, computed from the bits, never changes.
inline float Float16ForSquares(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t shifted = static_cast<uint32_t>(bits & 0x7fffu) << 13;
  float scaled;
  std::memcpy(&scaled, &shifted, sizeof scaled);
  scaled *= 0x1p112f;
  uint32_t u;
  std::memcpy(&u, &scaled, sizeof u);
  const uint32_t special = 0x7f800000u | shifted | ((bits & 0x3ffu) != 0 ? 0x00400000u : 0u);
  u = ((bits & 0x7c00u) == 0x7c00u ? special : u) | sign;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One pass over n elements of bit type Bits (int64, for float64); no temporaries. Inlined into
// each clone of FoldFingerprint, so that every instruction set gets its own vectorized loop.
template <typename Bits, typename Decode>
__attribute__((always_inline)) inline void FoldRange(const Bits* p, size_t n, uint64_t offset,
                                                     Decode decode, ReplicaFingerprint* acc) {
  uint64_t fp = 0;
  double sums[kSquareLanes] = {};
  size_t i = 0;
  for (; i + kSquareLanes <= n; i += kSquareLanes) {
    for (size_t l = 0; l < kSquareLanes; ++l) {
      const uint64_t term = static_cast<uint64_t>(static_cast<int64_t>(p[i + l])) + 1;
      fp += term * (2 * (offset + i + l) + 1);
      const double v = decode(p[i + l]);
      sums[l] += v * v;
    }
  }
  for (size_t l = 0; i < n; ++i, ++l) {
    const uint64_t term = static_cast<uint64_t>(static_cast<int64_t>(p[i])) + 1;
    fp += term * (2 * (offset + i) + 1);
    const double v = decode(p[i]);
    sums[l] += v * v;
  }
  acc->fingerprint += fp;
  acc->sum_squares += internal::FoldPartialSums(sums);
}

// The same F for 16- and 32-bit elements without a 64-bit multiply per element. With b_i the
// sign-extended bits and i the element's index in this call (0 .. n-1), mod 2^64:
//
//   F = sum_i (b_i + 1)(2 (offset + i) + 1) = (2 offset + 1)(B0 + n) + 2 B1 + n (n - 1),
//   B0 = sum_i b_i,  B1 = sum_i i b_i.
//
// B0 and B1 are summed span by span (kSpan elements at index s): B1 gets s * S0 + S1 with the
// span's S0 = sum_j b_{s+j} and S1 = sum_j j b_{s+j}, j < kSpan, in Acc: int32 for 16-bit
// elements (|S1| <= 2^15 * sum_{j<256} j < 2^31, exact), int64 for 32-bit ones (< 2^47). So the
// inner loop is small-integer multiply-adds, which vectorize (vpmaddwd for 16 bits, vpmuldq
// for 32), and F is exactly the definition's. The squares are the same as FoldRange's: element
// i into partial sum i % kSquareLanes, in element order.
template <typename Bits, typename Acc, typename Decode>
__attribute__((always_inline)) inline void FoldRangeBySpans(const Bits* p, size_t n,
                                                            uint64_t offset, Decode decode,
                                                            ReplicaFingerprint* acc) {
  constexpr size_t kSpan = 256;
  uint64_t b0 = 0, b1 = 0;
  double sums[kSquareLanes] = {};
  size_t i = 0;
  for (; i + kSpan <= n; i += kSpan) {
    Acc s0 = 0, s1 = 0;
    for (size_t j = 0; j < kSpan; ++j) {
      const Acc b = p[i + j];
      s0 += b;
      s1 += static_cast<Acc>(static_cast<Bits>(j)) * b;  // both widened from Bits
    }
    // The span again, from L1, for the squares: lanes in element order.
    for (size_t j = 0; j < kSpan; j += kSquareLanes) {
      for (size_t l = 0; l < kSquareLanes; ++l) {
        const double v = decode(p[i + j + l]);
        sums[l] += v * v;
      }
    }
    b0 += static_cast<uint64_t>(static_cast<int64_t>(s0));
    b1 += static_cast<uint64_t>(i) * static_cast<uint64_t>(static_cast<int64_t>(s0)) +
          static_cast<uint64_t>(static_cast<int64_t>(s1));
  }
  for (; i < n; ++i) {
    const uint64_t b = static_cast<uint64_t>(static_cast<int64_t>(p[i]));
    b0 += b;
    b1 += static_cast<uint64_t>(i) * b;
    const double v = decode(p[i]);
    sums[i % kSquareLanes] += v * v;
  }
  const uint64_t count = n;
  acc->fingerprint += (2 * offset + 1) * (b0 + count) + 2 * b1 + count * (count - 1);
  acc->sum_squares += internal::FoldPartialSums(sums);
}

}  // namespace

size_t FingerprintElementSize(int dtype) {
  if (dtype == kFingerprintFloat64) return 8;
  return dtype == static_cast<int>(ScalarType::kFloat32) ? 4 : 2;
}

// One clone per instruction set, chosen once by the loader (GCC's target_clones): the loops
// above vectorize with AVX-512 (64-bit multiplies) or AVX2 where the CPU has them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void FoldFingerprint(const void* data, int dtype, size_t n, uint64_t offset,
                     ReplicaFingerprint* acc) {
  switch (dtype) {
    case static_cast<int>(ScalarType::kFloat32):
      FoldRangeBySpans<int32_t, int64_t>(
          static_cast<const int32_t*>(data), n, offset,
          [](int32_t b) {
            float f;
            std::memcpy(&f, &b, sizeof(f));
            return static_cast<double>(f);
          },
          acc);
      return;
    case static_cast<int>(ScalarType::kBFloat16):
      FoldRangeBySpans<int16_t, int32_t>(
          static_cast<const int16_t*>(data), n, offset,
          [](int16_t b) { return static_cast<double>(BFloat16ToFloat(static_cast<uint16_t>(b))); },
          acc);
      return;
    case static_cast<int>(ScalarType::kFloat16):
      FoldRangeBySpans<int16_t, int32_t>(
          static_cast<const int16_t*>(data), n, offset,
          [](int16_t b) {
            return static_cast<double>(Float16ForSquares(static_cast<uint16_t>(b)));
          },
          acc);
      return;
    default:  // kFingerprintFloat64
      FoldRange(
          static_cast<const int64_t*>(data), n, offset,
          [](int64_t b) {
            double d;
            std::memcpy(&d, &b, sizeof(d));
            return d;
          },
          acc);
  }
}

absl::StatusOr<ReplicaFingerprint> FingerprintSegments(const void* base, int dtype,
                                                       absl::Span<const size_t> starts,
                                                       absl::Span<const size_t> counts,
                                                       absl::Span<const uint64_t> global_offsets) {
  if (dtype < 0 || dtype > kFingerprintFloat64) {
    return absl::InvalidArgumentError(
        "dtype must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64)");
  }
  if (starts.size() != counts.size() || counts.size() != global_offsets.size()) {
    return absl::InvalidArgumentError("starts, counts and global_offsets differ in length");
  }
  if (base == nullptr && !counts.empty()) return absl::InvalidArgumentError("null address");
  ReplicaFingerprint result;
  const size_t size = FingerprintElementSize(dtype);
  const char* bytes = static_cast<const char*>(base);
  for (size_t k = 0; k < counts.size(); ++k) {
    FoldFingerprint(bytes + starts[k] * size, dtype, counts[k], global_offsets[k], &result);
  }
  return result;
}

}  // namespace rankscope
