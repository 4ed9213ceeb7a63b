// Replica fingerprint kernel: the order-independent 64-bit fingerprint of a flat vector's bits,
// for CPU memory (rankscope/fingerprint.py defines it and computes it with torch ops on devices;
// the two agree bit for bit).
//
// For element i with global flat index g_i and bit pattern bits_i (the value viewed as int32 for
// float32, int16 for bfloat16 and float16, int64 for float64, sign-extended to int64):
//
//   F = sum_i (bits_i + 1) * (2 g_i + 1)   mod 2^64
//
// A sum, so any split into segments, in any order, gives the same F: fingerprints of disjoint
// parts combine by a wrapping add. Beside F the kernel returns the exact sum of squares of the
// values, accumulated in double (within a call of FoldFingerprint, element i of the call into
// partial sum i % 32 in element order; each group of 8 partial sums folded as ((s0 + s1) +
// (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the four groups as (g0 + g1) + (g2 + g3); summed
// across calls in call order). Every square is exact (the values are decoded exactly, whatever
// the floating-point mode), so the scalar, AVX2 and AVX-512 paths give the same bits.
//
// Pure: no threads, no allocation.
//
// Test vector (tests/agent/fingerprint_test.cc checks it): the float32 values {1.0f, -2.0f} at
// global indices 0 and 1 have bits 0x3F800000 and 0xC0000000 (sign-extended: -1073741824), so
// F = 1065353217 * 1 + (-1073741823) * 3 mod 2^64 = 2^64 - 2155872252 = 0xFFFFFFFF7F800004, and
// the sum of squares is 5.
#ifndef RANKSCOPE_FINGERPRINT_H_
#define RANKSCOPE_FINGERPRINT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "rankscope/sketch.h"

namespace rankscope {

// Element type codes the kernel reads: the ScalarType codes of rankscope/sketch.h (0 float32,
// 1 bfloat16, 2 float16), plus 3 for float64.
inline constexpr int kFingerprintFloat64 = 3;

struct ReplicaFingerprint {
  uint64_t fingerprint = 0;  // F mod 2^64
  double sum_squares = 0.0;  // sum of the values' squares
};

// Bytes per element of a valid dtype code (0..kFingerprintFloat64).
size_t FingerprintElementSize(int dtype);

// Adds the `n` elements at `data` (of the valid dtype code `dtype`), at global indices
// [offset, offset + n), into *acc. `data` is aligned to the element size (as a tensor's storage
// is); no wider alignment is needed.
void FoldFingerprint(const void* data, int dtype, size_t n, uint64_t offset,
                     ReplicaFingerprint* acc);

namespace fingerprint_internal {

// FoldFingerprint with the sums of squares through the given instruction-set path (that of
// CountSketch's kernel; `isa` must be supported). Every path gives the same bits; tests and
// benchmarks pin one to prove and to measure that. FoldFingerprint takes the best one.
void FoldFingerprintWithIsa(sketch_internal::KernelIsa isa, const void* data, int dtype, size_t n,
                            uint64_t offset, ReplicaFingerprint* acc);

}  // namespace fingerprint_internal

// The fingerprint and sum of squares of segments of the buffer at `base`: segment k is counts[k]
// elements from element starts[k], at global indices from global_offsets[k]. Errors
// (InvalidArgument, nothing read): a dtype code outside 0..3, spans of different lengths, a null
// `base` with segments.
absl::StatusOr<ReplicaFingerprint> FingerprintSegments(const void* base, int dtype,
                                                       absl::Span<const size_t> starts,
                                                       absl::Span<const size_t> counts,
                                                       absl::Span<const uint64_t> global_offsets);

}  // namespace rankscope

#endif  // RANKSCOPE_FINGERPRINT_H_
