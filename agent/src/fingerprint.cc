#include "rankscope/fingerprint.h"

#include <cassert>
#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "fold_partial_sums.h"
#include "isa_targets.h"
#include "rankscope/sketch.h"

namespace rankscope {
namespace {

using sketch_internal::KernelIsa;

// Partial sums of the squares (element i of a call into partial sum i % kSquareLanes, folded in
// a fixed order): independent additions the core can overlap, where one running sum chains
// every element's addition to the previous one's (4 cycles each). F needs no such care: integer
// addition is exact in any order.
constexpr size_t kSquareLanes = internal::kPartialSums;

// Elements a span of F's small-integer sums (FoldRangeBySpans).
constexpr size_t kSpan = 256;

// The value of element `bits` of a dtype (ScalarType code, 16 or 32 bits) for the sum of
// squares, exact. A float16 stays exact under denormals-are-zero (sketch.h's decoder is integer
// code, the vector paths' vcvtph2ps ignores the mode, and its subnormals are normal floats);
// float32 and bfloat16 subnormals read as 0 under that mode, on every path alike.
template <ScalarType kType, typename Bits>
inline double Decode(Bits bits) {
  if constexpr (kType == ScalarType::kFloat32) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return static_cast<double>(f);
  } else if constexpr (kType == ScalarType::kBFloat16) {
    return static_cast<double>(BFloat16ToFloat(static_cast<uint16_t>(bits)));
  } else {
    return static_cast<double>(Float16ToFloat(static_cast<uint16_t>(bits)));
  }
}

// Adds the squares of `count` elements (a multiple of kSquareLanes) into sums[j % kSquareLanes],
// j the element's place, in element order. Every square of a float is exact in double, so a
// fused multiply-add gives the bits of a multiply and an add: all paths agree bit for bit.
using SquaresFn = void (*)(const void* data, size_t count, double* sums);

template <ScalarType kType>
void SquaresScalar(const void* data, size_t count, double* sums) {
  using Bits = std::conditional_t<kType == ScalarType::kFloat32, int32_t, int16_t>;
  const auto* p = static_cast<const Bits*>(data);
  for (size_t j = 0; j < count; j += kSquareLanes) {
    for (size_t l = 0; l < kSquareLanes; ++l) {
      const double v = Decode<kType>(p[j + l]);
      sums[l] += v * v;
    }
  }
}

// Whole spans of 16-bit elements in one pass: F's span sums S0 and S1 (as FoldRangeBySpans
// defines them) and the squares, from one load of each element. Adds `spans` spans, the first at
// element 0 of the call, into *b0, *b1 and sums[kSquareLanes]; the same bits as the two passes.
using SpansFn = void (*)(const void* data, size_t spans, uint64_t* b0, uint64_t* b1, double* sums);

// Adds the span at element `first` of the call into B0 and B1 (mod 2^64), from its S0 and S1.
inline void AddSpan(int64_t s0, int64_t s1, size_t first, uint64_t* b0, uint64_t* b1) {
  const auto wide0 = static_cast<uint64_t>(s0);
  *b0 += wide0;
  *b1 += static_cast<uint64_t>(first) * wide0 + static_cast<uint64_t>(s1);
}

#ifdef RANKSCOPE_KERNEL_X86

// 8 (AVX2) or 16 (AVX-512) 16-bit elements as floats, exactly (Spans16*).
template <ScalarType kType>
RANKSCOPE_TARGET_AVX2 inline __m256 Widen8(__m128i h) {
  if constexpr (kType == ScalarType::kBFloat16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

template <ScalarType kType>
RANKSCOPE_TARGET_AVX512 inline __m512 Widen16(__m256i h) {
  if constexpr (kType == ScalarType::kBFloat16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(h);
  }
}

// The squares of 8 floats into the partial sums of doubles lo (the first 4) and hi.
RANKSCOPE_TARGET_AVX2 inline void AddSquares8(__m256 f, __m256d& lo, __m256d& hi) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
  lo = _mm256_fmadd_pd(a, a, lo);
  hi = _mm256_fmadd_pd(b, b, hi);
}

// The squares of 16 floats into the partial sums of doubles lo (the first 8) and hi.
RANKSCOPE_TARGET_AVX512 inline void AddSquares16(__m512 f, __m512d& lo, __m512d& hi) {
  const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
  const __m512d b = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
  lo = _mm512_fmadd_pd(a, a, lo);
  hi = _mm512_fmadd_pd(b, b, hi);
}

// float32 squares (16-bit elements take Spans16*, which square from the vector F loads).
// Sums 4l .. 4l + 3 in s<l>.
RANKSCOPE_TARGET_AVX2 void SquaresFloat32Avx2(const void* data, size_t count, double* sums) {
  const auto* p = static_cast<const float*>(data);
  __m256d s0 = _mm256_loadu_pd(sums), s1 = _mm256_loadu_pd(sums + 4),
          s2 = _mm256_loadu_pd(sums + 8), s3 = _mm256_loadu_pd(sums + 12),
          s4 = _mm256_loadu_pd(sums + 16), s5 = _mm256_loadu_pd(sums + 20),
          s6 = _mm256_loadu_pd(sums + 24), s7 = _mm256_loadu_pd(sums + 28);
  for (const float* end = p + count; p != end; p += kSquareLanes) {
    AddSquares8(_mm256_loadu_ps(p), s0, s1);
    AddSquares8(_mm256_loadu_ps(p + 8), s2, s3);
    AddSquares8(_mm256_loadu_ps(p + 16), s4, s5);
    AddSquares8(_mm256_loadu_ps(p + 24), s6, s7);
  }
  _mm256_storeu_pd(sums, s0);
  _mm256_storeu_pd(sums + 4, s1);
  _mm256_storeu_pd(sums + 8, s2);
  _mm256_storeu_pd(sums + 12, s3);
  _mm256_storeu_pd(sums + 16, s4);
  _mm256_storeu_pd(sums + 20, s5);
  _mm256_storeu_pd(sums + 24, s6);
  _mm256_storeu_pd(sums + 28, s7);
}

// Sums 8l .. 8l + 7 in s<l>.
RANKSCOPE_TARGET_AVX512 void SquaresFloat32Avx512(const void* data, size_t count, double* sums) {
  const auto* p = static_cast<const float*>(data);
  __m512d s0 = _mm512_loadu_pd(sums), s1 = _mm512_loadu_pd(sums + 8),
          s2 = _mm512_loadu_pd(sums + 16), s3 = _mm512_loadu_pd(sums + 24);
  for (const float* end = p + count; p != end; p += kSquareLanes) {
    AddSquares16(_mm512_loadu_ps(p), s0, s1);
    AddSquares16(_mm512_loadu_ps(p + 16), s2, s3);
  }
  _mm512_storeu_pd(sums, s0);
  _mm512_storeu_pd(sums + 8, s1);
  _mm512_storeu_pd(sums + 16, s2);
  _mm512_storeu_pd(sums + 24, s3);
}

// j = 0 .. 31, the element's place in a group of 32 (vpmaddwd multiplies it by the element).
alignas(64) constexpr int16_t kPlaces[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                             11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                             22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

// Exact: each vpmaddwd lane is b j + b' j' with |b|, |b'| <= 2^15 and j, j' < 256, and a lane's
// sum over a span stays within |S1| < 2^31 (every partial sum is bounded by sum |j b|).
RANKSCOPE_TARGET_AVX2 inline int32_t SumLanes(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
}

template <ScalarType kType>
RANKSCOPE_TARGET_AVX2 void Spans16Avx2(const void* data, size_t spans, uint64_t* b0, uint64_t* b1,
                                       double* sums) {
  const auto* p = static_cast<const __m256i*>(data);
  const __m256i ones = _mm256_set1_epi16(1), step = _mm256_set1_epi16(32);
  __m256d s0 = _mm256_loadu_pd(sums), s1 = _mm256_loadu_pd(sums + 4),
          s2 = _mm256_loadu_pd(sums + 8), s3 = _mm256_loadu_pd(sums + 12),
          s4 = _mm256_loadu_pd(sums + 16), s5 = _mm256_loadu_pd(sums + 20),
          s6 = _mm256_loadu_pd(sums + 24), s7 = _mm256_loadu_pd(sums + 28);
  for (size_t span = 0; span < spans; ++span) {
    __m256i sum0 = _mm256_setzero_si256(), sum1 = _mm256_setzero_si256();
    __m256i j0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPlaces));
    __m256i j1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPlaces + 16));
    for (size_t g = 0; g < kSpan / 32; ++g, p += 2) {
      const __m256i x0 = _mm256_loadu_si256(p), x1 = _mm256_loadu_si256(p + 1);
      sum0 = _mm256_add_epi32(
          sum0, _mm256_add_epi32(_mm256_madd_epi16(x0, ones), _mm256_madd_epi16(x1, ones)));
      sum1 = _mm256_add_epi32(
          sum1, _mm256_add_epi32(_mm256_madd_epi16(x0, j0), _mm256_madd_epi16(x1, j1)));
      j0 = _mm256_add_epi16(j0, step);
      j1 = _mm256_add_epi16(j1, step);
      AddSquares8(Widen8<kType>(_mm256_castsi256_si128(x0)), s0, s1);
      AddSquares8(Widen8<kType>(_mm256_extracti128_si256(x0, 1)), s2, s3);
      AddSquares8(Widen8<kType>(_mm256_castsi256_si128(x1)), s4, s5);
      AddSquares8(Widen8<kType>(_mm256_extracti128_si256(x1, 1)), s6, s7);
    }
    AddSpan(SumLanes(sum0), SumLanes(sum1), span * kSpan, b0, b1);
  }
  _mm256_storeu_pd(sums, s0);
  _mm256_storeu_pd(sums + 4, s1);
  _mm256_storeu_pd(sums + 8, s2);
  _mm256_storeu_pd(sums + 12, s3);
  _mm256_storeu_pd(sums + 16, s4);
  _mm256_storeu_pd(sums + 20, s5);
  _mm256_storeu_pd(sums + 24, s6);
  _mm256_storeu_pd(sums + 28, s7);
}

template <ScalarType kType>
RANKSCOPE_TARGET_AVX512 void Spans16Avx512(const void* data, size_t spans, uint64_t* b0,
                                           uint64_t* b1, double* sums) {
  const auto* p = static_cast<const unsigned char*>(data);
  const __m512i ones = _mm512_set1_epi16(1), step = _mm512_set1_epi16(32);
  __m512d s0 = _mm512_loadu_pd(sums), s1 = _mm512_loadu_pd(sums + 8),
          s2 = _mm512_loadu_pd(sums + 16), s3 = _mm512_loadu_pd(sums + 24);
  for (size_t span = 0; span < spans; ++span) {
    __m512i sum0 = _mm512_setzero_si512(), sum1 = _mm512_setzero_si512();
    __m512i j = _mm512_load_si512(kPlaces);
    for (size_t g = 0; g < kSpan / 32; ++g, p += 64) {
      const __m512i x = _mm512_loadu_si512(p);
      sum0 = _mm512_add_epi32(sum0, _mm512_madd_epi16(x, ones));
      sum1 = _mm512_add_epi32(sum1, _mm512_madd_epi16(x, j));
      j = _mm512_add_epi16(j, step);
      AddSquares16(Widen16<kType>(_mm512_castsi512_si256(x)), s0, s1);
      AddSquares16(Widen16<kType>(_mm512_extracti64x4_epi64(x, 1)), s2, s3);
    }
    AddSpan(_mm512_reduce_add_epi32(sum0), _mm512_reduce_add_epi32(sum1), span * kSpan, b0, b1);
  }
  _mm512_storeu_pd(sums, s0);
  _mm512_storeu_pd(sums + 8, s1);
  _mm512_storeu_pd(sums + 16, s2);
  _mm512_storeu_pd(sums + 24, s3);
}

#endif  // RANKSCOPE_KERNEL_X86

// The one-pass path for whole spans of 16-bit elements, or nullptr (float32, or no vector path).
template <ScalarType kType>
SpansFn SelectSpans(KernelIsa isa) {
#ifdef RANKSCOPE_KERNEL_X86
  if constexpr (kType != ScalarType::kFloat32) {
    if (isa == KernelIsa::kAvx512) return &Spans16Avx512<kType>;
    if (isa == KernelIsa::kAvx2) return &Spans16Avx2<kType>;
  }
#endif
  (void)isa;
  return nullptr;
}

// The path for a span's squares where SelectSpans gives none.
template <ScalarType kType>
SquaresFn SelectSquares(KernelIsa isa) {
#ifdef RANKSCOPE_KERNEL_X86
  if constexpr (kType == ScalarType::kFloat32) {
    if (isa == KernelIsa::kAvx512) return &SquaresFloat32Avx512;
    if (isa == KernelIsa::kAvx2) return &SquaresFloat32Avx2;
  }
#endif
  (void)isa;
  return &SquaresScalar<kType>;
}

// One pass over n elements of bit type Bits (int64, for float64); no temporaries. Inlined into
// each clone of Fold, so that every instruction set gets its own vectorized loop.
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
// i into partial sum i % kSquareLanes, in element order; a span's by `squares` (the path of an
// instruction set), the last partial span's one by one. Where `spans` is given (16-bit
// elements on AVX2 or AVX-512), it does the whole spans, S0, S1 and squares in one pass.
template <ScalarType kType, typename Bits, typename Acc>
__attribute__((always_inline)) inline void FoldRangeBySpans(const Bits* p, size_t n,
                                                            uint64_t offset, SpansFn spans,
                                                            SquaresFn squares,
                                                            ReplicaFingerprint* acc) {
  uint64_t b0 = 0, b1 = 0;
  double sums[kSquareLanes] = {};
  size_t i = 0;
  if (spans != nullptr) {
    spans(p, n / kSpan, &b0, &b1, sums);
    i = n / kSpan * kSpan;
  }
  for (; i + kSpan <= n; i += kSpan) {
    Acc s0 = 0, s1 = 0;
    for (size_t j = 0; j < kSpan; ++j) {
      const Acc b = p[i + j];
      s0 += b;
      s1 += static_cast<Acc>(static_cast<Bits>(j)) * b;  // both widened from Bits
    }
    squares(p + i, kSpan, sums);  // the span again, from L1
    AddSpan(s0, s1, i, &b0, &b1);
  }
  for (; i < n; ++i) {
    const uint64_t b = static_cast<uint64_t>(static_cast<int64_t>(p[i]));
    b0 += b;
    b1 += static_cast<uint64_t>(i) * b;
    const double v = Decode<kType>(p[i]);
    sums[i % kSquareLanes] += v * v;
  }
  const uint64_t count = n;
  acc->fingerprint += (2 * offset + 1) * (b0 + count) + 2 * b1 + count * (count - 1);
  acc->sum_squares += internal::FoldPartialSums(sums);
}

// F and the sums of squares of n elements, the squares of whole spans by the path of `isa`. One
// clone per instruction set, chosen once by the loader (GCC's target_clones): the loops for F
// (and float64's squares) vectorize with AVX-512 (64-bit multiplies) or AVX2 where the CPU has
// them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void Fold(KernelIsa isa, const void* data, int dtype, size_t n, uint64_t offset,
          ReplicaFingerprint* acc) {
  switch (dtype) {
    case static_cast<int>(ScalarType::kFloat32):
      FoldRangeBySpans<ScalarType::kFloat32, int32_t, int64_t>(
          static_cast<const int32_t*>(data), n, offset, nullptr,
          SelectSquares<ScalarType::kFloat32>(isa), acc);
      return;
    case static_cast<int>(ScalarType::kBFloat16):
      FoldRangeBySpans<ScalarType::kBFloat16, int16_t, int32_t>(
          static_cast<const int16_t*>(data), n, offset, SelectSpans<ScalarType::kBFloat16>(isa),
          SelectSquares<ScalarType::kBFloat16>(isa), acc);
      return;
    case static_cast<int>(ScalarType::kFloat16):
      FoldRangeBySpans<ScalarType::kFloat16, int16_t, int32_t>(
          static_cast<const int16_t*>(data), n, offset, SelectSpans<ScalarType::kFloat16>(isa),
          SelectSquares<ScalarType::kFloat16>(isa), acc);
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

}  // namespace

size_t FingerprintElementSize(int dtype) {
  if (dtype == kFingerprintFloat64) return 8;
  return dtype == static_cast<int>(ScalarType::kFloat32) ? 4 : 2;
}

void FoldFingerprint(const void* data, int dtype, size_t n, uint64_t offset,
                     ReplicaFingerprint* acc) {
  Fold(sketch_internal::BestKernelIsa(), data, dtype, n, offset, acc);
}

namespace fingerprint_internal {

void FoldFingerprintWithIsa(sketch_internal::KernelIsa isa, const void* data, int dtype, size_t n,
                            uint64_t offset, ReplicaFingerprint* acc) {
  assert(sketch_internal::KernelIsaSupported(isa));
  if (!sketch_internal::KernelIsaSupported(isa)) isa = KernelIsa::kScalar;
  Fold(isa, data, dtype, n, offset, acc);
}

}  // namespace fingerprint_internal

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
