// The replica fingerprint kernel against a straightforward reference, and its properties.
#include "rankscope/fingerprint.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "rankscope/sketch.h"

#if defined(__x86_64__)
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr
#endif

namespace rankscope {
namespace {

// The definition, written out independently of the kernel: each element's bits read as a signed
// integer of its width (the dtype's width in bytes), sign-extended, plus one, times 2g + 1, summed
// mod 2^64 (unsigned arithmetic wraps).
uint64_t ReferenceFingerprint(const void* data, size_t width, size_t n, uint64_t offset) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint64_t f = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t bits = 0;
    if (width == 2) {
      int16_t b;
      std::memcpy(&b, bytes + i * width, 2);
      bits = b;
    } else if (width == 4) {
      int32_t b;
      std::memcpy(&b, bytes + i * width, 4);
      bits = b;
    } else {
      std::memcpy(&bits, bytes + i * width, 8);
    }
    const uint64_t g = offset + i;
    f += (static_cast<uint64_t>(bits) + 1) * (2 * g + 1);
  }
  return f;
}

uint16_t Bits16(uint16_t b) { return b; }

ReplicaFingerprint Whole(const void* data, int dtype, size_t n, uint64_t offset = 0) {
  const std::vector<size_t> starts = {0}, counts = {n};
  const std::vector<uint64_t> offsets = {offset};
  absl::StatusOr<ReplicaFingerprint> r = FingerprintSegments(data, dtype, starts, counts, offsets);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : ReplicaFingerprint{};
}

TEST(FingerprintTest, HeaderTestVector) {
  const float v[] = {1.0f, -2.0f};
  const ReplicaFingerprint r = Whole(v, 0, 2);
  EXPECT_EQ(r.fingerprint, 0xFFFFFFFF7F800004ull);
  EXPECT_EQ(r.sum_squares, 5.0);
}

TEST(FingerprintTest, HandComputedVectors) {
  // float32 zero has bits 0: its term is 1 * (2g + 1).
  const float zeros[3] = {0.0f, 0.0f, 0.0f};
  EXPECT_EQ(Whole(zeros, 0, 3).fingerprint, 1u + 3u + 5u);
  EXPECT_EQ(Whole(zeros, 0, 3, 10).fingerprint, 21u + 23u + 25u);
  // -0.0f is 0x80000000: sign-extended -2^31, term (1 - 2^31) * 1, wrapped.
  const float negzero = -0.0f;
  EXPECT_EQ(Whole(&negzero, 0, 1).fingerprint,
            static_cast<uint64_t>(int64_t{1} - (int64_t{1} << 31)));
  // bfloat16 1.0 is 0x3F80 (term 0x3F81); float16 -2.0 is 0xC000 (sign-extended -16384).
  const uint16_t bf16_one = Bits16(0x3F80);
  EXPECT_EQ(Whole(&bf16_one, 1, 1, 2).fingerprint, 0x3F81u * 5u);
  EXPECT_EQ(Whole(&bf16_one, 1, 1).sum_squares, 1.0);
  const uint16_t f16_minus_two = Bits16(0xC000);
  EXPECT_EQ(Whole(&f16_minus_two, 2, 1).fingerprint, static_cast<uint64_t>(int64_t{-16383}));
  EXPECT_EQ(Whole(&f16_minus_two, 2, 1).sum_squares, 4.0);
  // float64 0.5 is 0x3FE0000000000000.
  const double half = 0.5;
  EXPECT_EQ(Whole(&half, kFingerprintFloat64, 1, 1).fingerprint, (0x3FE0000000000000ull + 1) * 3);
  EXPECT_EQ(Whole(&half, kFingerprintFloat64, 1).sum_squares, 0.25);
}

TEST(FingerprintTest, MatchesTheReferenceForEveryDtype) {
  std::mt19937_64 rng(42);
  const size_t n = 1000;
  const uint64_t offset = 123456789;
  std::vector<float> f32(n);
  std::vector<uint16_t> b16(n);
  std::vector<double> f64(n);
  for (size_t i = 0; i < n; ++i) {
    f32[i] = std::ldexp(static_cast<float>(rng() % 2001) - 1000.0f, -4);
    b16[i] = static_cast<uint16_t>(rng());  // any bits, NaN and infinities included
    f64[i] = std::ldexp(static_cast<double>(rng() % 2001) - 1000.0, -8);
  }
  double f32_ss = 0.0, f64_ss = 0.0;  // the values are k/16 and k/256: every square is exact
  for (size_t i = 0; i < n; ++i) {
    f32_ss += static_cast<double>(f32[i]) * f32[i];
    f64_ss += f64[i] * f64[i];
  }
  const ReplicaFingerprint r32 = Whole(f32.data(), 0, n, offset);
  EXPECT_EQ(r32.fingerprint, ReferenceFingerprint(f32.data(), 4, n, offset));
  EXPECT_EQ(r32.sum_squares, f32_ss);
  EXPECT_EQ(Whole(b16.data(), 1, n, offset).fingerprint,
            ReferenceFingerprint(b16.data(), 2, n, offset));
  EXPECT_EQ(Whole(b16.data(), 2, n, offset).fingerprint,
            ReferenceFingerprint(b16.data(), 2, n, offset));
  const ReplicaFingerprint r64 = Whole(f64.data(), kFingerprintFloat64, n, offset);
  EXPECT_EQ(r64.fingerprint, ReferenceFingerprint(f64.data(), 8, n, offset));
  EXPECT_EQ(r64.sum_squares, f64_ss);
}

TEST(FingerprintTest, SpansOfEveryLengthAndExtremeBitsMatchTheReference) {
  // The 16- and 32-bit kernels sum F span by span in small integers (fingerprint.cc): lengths
  // around the span (256), the most negative and most positive bits everywhere (the sums'
  // extremes), random bits, and offsets near 2^64 (where 2 g + 1 wraps) must all give the
  // definition's F.
  std::mt19937_64 rng(7);
  for (size_t n : {size_t{255}, size_t{256}, size_t{257}, size_t{511}, size_t{70001}}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{1} << 40, ~uint64_t{0} - 100000}) {
      for (int fill = 0; fill < 3; ++fill) {
        std::vector<uint16_t> b16(n);
        std::vector<uint32_t> b32(n);
        for (size_t i = 0; i < n; ++i) {
          b16[i] = fill == 0 ? 0x8000 : fill == 1 ? 0x7fff : static_cast<uint16_t>(rng());
          b32[i] = fill == 0 ? 0x80000000u : fill == 1 ? 0x7fffffffu : static_cast<uint32_t>(rng());
        }
        SCOPED_TRACE(testing::Message() << "n " << n << " offset " << offset << " fill " << fill);
        EXPECT_EQ(Whole(b16.data(), 1, n, offset).fingerprint,
                  ReferenceFingerprint(b16.data(), 2, n, offset));
        EXPECT_EQ(Whole(b16.data(), 2, n, offset).fingerprint,
                  ReferenceFingerprint(b16.data(), 2, n, offset));
        EXPECT_EQ(Whole(b32.data(), 0, n, offset).fingerprint,
                  ReferenceFingerprint(b32.data(), 4, n, offset));
      }
    }
  }
}

TEST(FingerprintTest, EverySixteenBitValueSquaresAsItsExactConversion) {
  // The kernel's vectorizable float16 decode against sketch.h's exact one, and bfloat16 too, for
  // all 65,536 bit patterns, one at a time and as one vector (8 partial sums, so every lane).
  std::vector<uint16_t> all(1 << 16);
  double f16_sum = 0.0;
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    all[h] = static_cast<uint16_t>(h);
    const double f16 = Float16ToFloat(all[h]), bf16 = BFloat16ToFloat(all[h]);
    const double got16 = Whole(&all[h], 2, 1).sum_squares, gotb = Whole(&all[h], 1, 1).sum_squares;
    if (std::isnan(f16)) {
      ASSERT_TRUE(std::isnan(got16)) << h;
    } else {
      ASSERT_EQ(got16, f16 * f16) << h;
      if (std::isfinite(f16)) f16_sum += f16 * f16;
    }
    if (std::isnan(bf16)) {
      ASSERT_TRUE(std::isnan(gotb)) << h;
    } else {
      ASSERT_EQ(gotb, bf16 * bf16) << h;
    }
  }
  EXPECT_TRUE(std::isnan(Whole(all.data(), 2, all.size()).sum_squares));  // NaNs included
  // Without the infinities and NaNs (exponent 0x1f): the finite values' squares.
  std::vector<uint16_t> finite;
  for (uint16_t h : all) {
    if ((h & 0x7c00u) != 0x7c00u) finite.push_back(h);
  }
  EXPECT_NEAR(Whole(finite.data(), 2, finite.size()).sum_squares, f16_sum, 1e-12 * f16_sum);
}

using sketch_internal::KernelIsa;
using sketch_internal::SupportedKernelIsas;

ReplicaFingerprint WithIsa(KernelIsa isa, const void* data, int dtype, size_t n, uint64_t offset) {
  ReplicaFingerprint acc;
  fingerprint_internal::FoldFingerprintWithIsa(isa, data, dtype, n, offset, &acc);
  return acc;
}

uint64_t DoubleBits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

TEST(FingerprintTest, EveryInstructionSetPathGivesTheSameBits) {
  // Random finite values of every exponent (subnormals included), lengths around the span of
  // 256 and the group of 32, a start one element past the buffer's (vector-misaligned): F and the
  // sum of squares' bits are the scalar path's. (F reads bits; the squares are exact, so only their
  // order could differ.)
  std::mt19937_64 rng(11);
  std::vector<unsigned char> bytes(4 * 70001 + 4);
  for (size_t n : {size_t{31}, size_t{32}, size_t{256}, size_t{289}, size_t{1000}, size_t{70001}}) {
    for (int dtype : {0, 1, 2}) {
      const size_t size = FingerprintElementSize(dtype);
      for (size_t i = 0; i < n; ++i) {
        uint32_t bits = static_cast<uint32_t>(rng());
        if (dtype == 0 && (bits & 0x7f800000u) == 0x7f800000u) bits &= 0xbfffffffu;
        if (dtype == 1 && (bits & 0x7f80u) == 0x7f80u) bits &= 0xbfffu;
        if (dtype == 2 && (bits & 0x7c00u) == 0x7c00u) bits &= 0xbfffu;
        std::memcpy(bytes.data() + size + i * size, &bits, size);
      }
      const void* data = bytes.data() + size;  // element-aligned, not vector-aligned
      const ReplicaFingerprint want = WithIsa(KernelIsa::kScalar, data, dtype, n, 77);
      ASSERT_TRUE(std::isfinite(want.sum_squares));
      for (KernelIsa isa : SupportedKernelIsas()) {
        SCOPED_TRACE(testing::Message()
                     << sketch_internal::KernelIsaName(isa) << " dtype " << dtype << " n " << n);
        const ReplicaFingerprint got = WithIsa(isa, data, dtype, n, 77);
        EXPECT_EQ(got.fingerprint, want.fingerprint);
        EXPECT_EQ(DoubleBits(got.sum_squares), DoubleBits(want.sum_squares));
      }
    }
  }
  // The most negative and most positive 16-bit patterns everywhere (the extremes of F's span
  // sums; NaNs as values, so only F is compared).
  for (uint16_t fill : {uint16_t{0x8000}, uint16_t{0x7fff}}) {
    const std::vector<uint16_t> extreme(70001, fill);
    for (int dtype : {1, 2}) {
      const uint64_t want = ReferenceFingerprint(extreme.data(), 2, extreme.size(), 5);
      for (KernelIsa isa : SupportedKernelIsas()) {
        EXPECT_EQ(WithIsa(isa, extreme.data(), dtype, extreme.size(), 5).fingerprint, want)
            << sketch_internal::KernelIsaName(isa) << " fill " << fill << " dtype " << dtype;
      }
    }
  }
  // Non-finite values reach the sum on every path.
  const float specials[] = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  std::vector<float> many(300, 0.5f);
  many[257] = std::numeric_limits<float>::quiet_NaN();
  for (KernelIsa isa : SupportedKernelIsas()) {
    EXPECT_EQ(WithIsa(isa, specials, 0, 3, 0).sum_squares, std::numeric_limits<double>::infinity());
    EXPECT_TRUE(std::isnan(WithIsa(isa, many.data(), 0, many.size(), 0).sum_squares));
    many[257] = 0.5f;
    many[3] = -std::numeric_limits<float>::infinity();  // inside the first span
    EXPECT_EQ(WithIsa(isa, many.data(), 0, many.size(), 0).sum_squares,
              std::numeric_limits<double>::infinity());
    many[3] = 0.5f;
    many[257] = std::numeric_limits<float>::quiet_NaN();
  }
}

#if defined(__x86_64__)
TEST(FingerprintTest, DenormalsAreZeroLeavesFloat16SquaresExactOnEveryPath) {
  // Under DAZ and FTZ (torch.set_flush_denormal(True) sets both), float16 subnormals, which are
  // normal floats, still square exactly on every path; float32 and bfloat16 subnormals, which
  // the mode reads as zero, give the same bits on every path.
  std::vector<uint16_t> subnormals;
  double want16 = 0.0;
  for (uint16_t h = 1; h < 0x400; ++h) subnormals.push_back(h);
  std::vector<double> squares;
  for (uint16_t h : subnormals) squares.push_back(Float16ToFloat(h) * Float16ToFloat(h));
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
  std::vector<ReplicaFingerprint> f16, bf16;
  for (KernelIsa isa : SupportedKernelIsas()) {
    f16.push_back(WithIsa(isa, subnormals.data(), 2, subnormals.size(), 0));
    bf16.push_back(WithIsa(isa, subnormals.data(), 1, subnormals.size(), 0));
  }
  _mm_setcsr(csr);
  // The kernel's own order (partial sum i % 32, folded by pairs), without the mode.
  double partial[32] = {};
  for (size_t i = 0; i < squares.size(); ++i) partial[i % 32] += squares[i];
  double group[4];
  for (int g = 0; g < 4; ++g) {
    const double* x = partial + 8 * g;
    group[g] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
  want16 = (group[0] + group[1]) + (group[2] + group[3]);
  ASSERT_GT(want16, 0.0);
  for (size_t k = 0; k < f16.size(); ++k) {
    EXPECT_EQ(f16[k].sum_squares, want16) << k;
    EXPECT_EQ(DoubleBits(bf16[k].sum_squares), DoubleBits(bf16[0].sum_squares)) << k;
  }
}
#endif

TEST(FingerprintTest, SixteenBitSumOfSquaresDecodesPerDtype) {
  // 0x4000 is 2.0 both as bfloat16 and as float16; 0x3C00 is 1.0 as float16 and 2^-7 as
  // bfloat16 (float bits 0x3C000000).
  const uint16_t v[] = {Bits16(0x4000), Bits16(0x3C00)};
  EXPECT_EQ(Whole(v, 2, 2).sum_squares, 4.0 + 1.0);
  EXPECT_EQ(Whole(v, 1, 2).sum_squares, 4.0 + std::ldexp(1.0, -14));
  // Same bits, same fingerprint: it reads bits, not values.
  EXPECT_EQ(Whole(v, 1, 2).fingerprint, Whole(v, 2, 2).fingerprint);
}

TEST(FingerprintTest, SegmentsInAnyOrderAndAnySplitGiveTheSameResult) {
  std::mt19937_64 rng(7);
  std::vector<float> values(64);
  for (float& v : values) v = static_cast<float>(static_cast<int>(rng() % 201) - 100) / 8.0f;
  const ReplicaFingerprint whole = Whole(values.data(), 0, values.size(), 1000);

  // The buffer holds the vector's parts out of order: [40, 64) at element 0, [0, 15) at 24,
  // [15, 40) at 39; global offsets say where each belongs.
  std::vector<float> buffer(64);
  std::copy(values.begin() + 40, values.end(), buffer.begin());
  std::copy(values.begin(), values.begin() + 15, buffer.begin() + 24);
  std::copy(values.begin() + 15, values.begin() + 40, buffer.begin() + 39);
  const std::vector<size_t> starts = {0, 24, 39}, counts = {24, 15, 25};
  const std::vector<uint64_t> offsets = {1040, 1000, 1015};
  absl::StatusOr<ReplicaFingerprint> split =
      FingerprintSegments(buffer.data(), 0, starts, counts, offsets);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->fingerprint, whole.fingerprint);
  EXPECT_EQ(split->sum_squares, whole.sum_squares);  // squares of k/8: exact in any order

  // Folding parts one by one in reverse order and adding: the same again.
  ReplicaFingerprint acc;
  FoldFingerprint(values.data() + 40, 0, 24, 1040, &acc);
  FoldFingerprint(values.data() + 15, 0, 25, 1015, &acc);
  FoldFingerprint(values.data(), 0, 15, 1000, &acc);
  EXPECT_EQ(acc.fingerprint, whole.fingerprint);
  EXPECT_EQ(acc.sum_squares, whole.sum_squares);
}

TEST(FingerprintTest, PositionAndOneBitMatter) {
  std::vector<float> v = {1.0f, 2.0f, 3.0f, 4.0f};
  const uint64_t f = Whole(v.data(), 0, v.size()).fingerprint;
  std::swap(v[1], v[2]);
  EXPECT_NE(Whole(v.data(), 0, v.size()).fingerprint, f);
  std::swap(v[1], v[2]);
  uint32_t bits;
  std::memcpy(&bits, &v[3], 4);
  bits ^= 1;  // one ulp
  std::memcpy(&v[3], &bits, 4);
  EXPECT_NE(Whole(v.data(), 0, v.size()).fingerprint, f);
  EXPECT_NE(Whole(v.data(), 0, v.size(), 1).fingerprint, f);
}

TEST(FingerprintTest, ElementSizes) {
  EXPECT_EQ(FingerprintElementSize(0), 4u);
  EXPECT_EQ(FingerprintElementSize(1), 2u);
  EXPECT_EQ(FingerprintElementSize(2), 2u);
  EXPECT_EQ(FingerprintElementSize(kFingerprintFloat64), 8u);
}

TEST(FingerprintTest, RefusesBadArgumentsWithoutReading) {
  const float v = 1.0f;
  const std::vector<size_t> one = {0}, count = {1};
  const std::vector<uint64_t> offset = {0};
  absl::StatusOr<ReplicaFingerprint> r = FingerprintSegments(&v, 4, one, count, offset);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "dtype must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64)");
  EXPECT_EQ(FingerprintSegments(&v, -1, one, count, offset).status().code(),
            absl::StatusCode::kInvalidArgument);
  r = FingerprintSegments(&v, 0, one, {}, offset);
  EXPECT_EQ(r.status().message(), "starts, counts and global_offsets differ in length");
  r = FingerprintSegments(nullptr, 0, one, count, offset);
  EXPECT_EQ(r.status().message(), "null address");
  // No segments: a null base is fine, and the result is the empty sum.
  r = FingerprintSegments(nullptr, 0, {}, {}, {});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->fingerprint, 0u);
  EXPECT_EQ(r->sum_squares, 0.0);
  // A zero-length segment contributes nothing.
  const std::vector<size_t> zero = {0};
  r = FingerprintSegments(&v, 0, one, zero, offset);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->fingerprint, 0u);
}

}  // namespace
}  // namespace rankscope
