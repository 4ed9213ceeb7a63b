// Tests of the count sketch (agent/include/rankscope/sketch.h).
//
// Statistical tests use fixed seeds, so they are deterministic; their tolerances are set at
// several standard errors of the estimator so that a correct sketch passes with any seeds.
#include "rankscope/sketch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope {
namespace {

using sketch_internal::AddWithIsa;
using sketch_internal::KernelIsa;
using sketch_internal::KernelIsaName;
using sketch_internal::SupportedKernelIsas;

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

uint64_t DoubleBits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

std::vector<float> RandomVector(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// float -> bfloat16 by truncation, and float -> float16 by the hardware-independent rule below;
// the tests only need some valid 16-bit values, and compare against their exact widening.
std::vector<uint16_t> ToBFloat16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<uint16_t>(FloatBits(v[i]) >> 16);
  return out;
}

std::vector<uint16_t> RandomFloat16Bits(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> out(n);
  for (uint16_t& h : out) {
    do {
      h = static_cast<uint16_t>(rng());
    } while ((h & 0x7c00) == 0x7c00);  // finite values only, subnormals included
  }
  return out;
}

std::vector<float> Widen(const std::vector<uint16_t>& bits, ScalarType type) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    out[i] = type == ScalarType::kBFloat16 ? BFloat16ToFloat(bits[i]) : Float16ToFloat(bits[i]);
  }
  return out;
}

// The sketch by its definition and sketch.h's rounding rule: within each segment of
// SketchSegment(dim) coordinates, every coordinate added in index order to its float partial
// base + offset (one of dim + 31; partial p belongs to bin p mod dim); each segment's partials
// then added into the double bins in ascending p.
std::vector<double> ReferenceBins(const std::vector<float>& x, uint64_t offset, uint32_t dim,
                                  uint64_t seed) {
  std::vector<double> bins(dim, 0.0);
  std::vector<float> partial(dim + kSketchBlock - 1, 0.0f);
  const uint64_t segment = SketchSegment(dim);
  auto close = [&] {
    for (size_t p = 0; p < partial.size(); ++p) bins[p % dim] += static_cast<double>(partial[p]);
    std::fill(partial.begin(), partial.end(), 0.0f);
  };
  for (size_t i = 0; i < x.size(); ++i) {
    if (i > 0 && (offset + i) % segment == 0) close();
    const uint64_t index = offset + i;
    const SketchSlot slot = SketchHash(index, seed, dim);
    const uint64_t base = (SketchMix(index / kSketchBlock, seed) >> 32) % dim;
    const uint64_t p = base + index % kSketchBlock;
    EXPECT_EQ(p % dim, slot.bin);
    partial[p] += slot.sign * x[i];
  }
  close();
  return bins;
}

// Sum of squares as the header promises to compute it: within each run of 1024 coordinates,
// coordinate i's square into float partial i % 32 by a fused multiply-add; each run's partials
// into double lanes; the 32 lanes folded by pairs in groups of 8, then the groups by pairs.
double ReferenceSumSquares(const std::vector<float>& x, uint64_t offset) {
  float partial[32] = {};
  double lanes[32] = {};
  auto close = [&] {
    for (int l = 0; l < 32; ++l) {
      lanes[l] += static_cast<double>(partial[l]);
      partial[l] = 0.0f;
    }
  };
  for (size_t i = 0; i < x.size(); ++i) {
    if (i > 0 && (offset + i) % kSketchSquareRun == 0) close();
    float& p = partial[(offset + i) % 32];
    p = std::fma(x[i], x[i], p);
  }
  close();
  double group[4];
  for (int g = 0; g < 4; ++g) {
    const double* l = lanes + 8 * g;
    group[g] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
  return (group[0] + group[1]) + (group[2] + group[3]);
}

void ExpectBitIdentical(absl::Span<const double> a, absl::Span<const double> b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(DoubleBits(a[i]), DoubleBits(b[i])) << "bin " << i << ": " << a[i] << " vs " << b[i];
  }
}

// ---- The hash.

TEST(SketchMixTest, IsSplitMix64) {
  // Outputs of Vigna's splitmix64.c: seeded with 0, and the sequence seeded with 1234567.
  EXPECT_EQ(SketchMix(0, 0), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(SketchMix(0, 1234567), 6457827717110365317ULL);
  EXPECT_EQ(SketchMix(1, 1234567), 3203168211198807973ULL);
  // The test vectors documented in sketch.h for the PyTorch port.
  EXPECT_EQ(SketchMix(0, kDefaultSketchSeed), 0x9609B8E9179AF10CULL);
  EXPECT_EQ(SketchMix(12345, kDefaultSketchSeed), 0x5FA110022D614E1BULL);
  EXPECT_EQ(SketchMix(771, kDefaultSketchSeed), 0x26C6053CFF35630DULL);
  EXPECT_EQ(SketchMix(385, kDefaultSketchSeed), 0xFD1FA0A8C3134223ULL);
}

TEST(SketchHashTest, BlockWindowFromHighBitsSignsFromLowBits) {
  // sketch.h's rule, restated from SketchMix: block i >> 5 gets base (mix >> 32) % dim, offset
  // o = i & 31 goes to (base + o) % dim with the sign of bit o.
  for (uint32_t dim : {1u, 2u, 3u, 7u, 31u, 32u, 33u, 1000u, 1024u, 999983u, kMaxSketchDim}) {
    for (uint64_t index :
         {0ULL, 1ULL, 15ULL, 16ULL, 31ULL, 32ULL, 12345ULL, (1ULL << 40) + 7, ~0ULL}) {
      const uint64_t mix = SketchMix(index >> 5, kDefaultSketchSeed);
      const uint64_t o = index & 31;
      const SketchSlot slot = SketchHash(index, kDefaultSketchSeed, dim);
      EXPECT_EQ(slot.bin, ((mix >> 32) % dim + o) % dim) << "dim " << dim << " index " << index;
      EXPECT_EQ(slot.sign, ((mix >> o) & 1) ? -1.0f : 1.0f);
    }
  }
  // The test vectors documented in sketch.h (computed with the rule in Python integers).
  auto expect_slot = [](uint64_t index, uint32_t dim, uint32_t bin, float sign) {
    const SketchSlot slot = SketchHash(index, kDefaultSketchSeed, dim);
    EXPECT_EQ(slot.bin, bin) << "index " << index << " dim " << dim;
    EXPECT_EQ(slot.sign, sign) << "index " << index << " dim " << dim;
  };
  expect_slot(0, 1024, 233, 1.0f);
  expect_slot(31, 1024, 264, 1.0f);
  expect_slot(12345, 1024, 193, -1.0f);
  expect_slot(12345, 1000, 417, -1.0f);
  expect_slot(12345, 7, 0, -1.0f);
}

TEST(SketchHashTest, BlockCoversThirtyTwoDistinctConsecutiveBins) {
  // The property the variance argument rests on: coordinates of one block never collide when
  // dim >= 32, and their bins are consecutive modulo dim.
  for (uint32_t dim : {32u, 33u, 63u, 1000u, 1024u}) {
    for (uint64_t block = 0; block < 2000; ++block) {
      const uint32_t base = SketchHash(32 * block, 9, dim).bin;
      std::vector<bool> seen(dim, false);
      for (uint32_t o = 0; o < 32; ++o) {
        const uint32_t bin = SketchHash(32 * block + o, 9, dim).bin;
        ASSERT_EQ(bin, (base + o) % dim) << "dim " << dim << " block " << block;
        ASSERT_FALSE(seen[bin]);
        seen[bin] = true;
      }
    }
  }
}

TEST(SketchHashTest, BasesUniformSignsBalanced) {
  // Chi-square of the bases of 1e6 consecutive blocks over 1000 bins: 999 degrees of freedom,
  // mean 999 and standard deviation 44.7; the bound is 6 standard deviations above the mean.
  // (The base is the bin of offset 0; the other offsets are shifts of it.)
  constexpr uint32_t kDim = 1000;
  constexpr int kBlocks = 1000000;
  std::vector<int> count(kDim, 0);
  for (int b = 0; b < kBlocks; ++b) ++count[SketchHash(32ULL * b, kDefaultSketchSeed, kDim).bin];
  const double expected = static_cast<double>(kBlocks) / kDim;
  double chi2 = 0.0;
  for (int c : count) chi2 += (c - expected) * (c - expected) / expected;
  EXPECT_LT(chi2, 999 + 6 * 44.7);
  // Signs of 1e6 consecutive coordinates (32 bits of each of 31250 mixes): binomial(1e6, 1/2)
  // has standard deviation 500; and each offset's sign alone, binomial(31250, 1/2), 88.4.
  constexpr int kN = 1000000;
  int negative = 0;
  std::vector<int> negative_at(32, 0);
  for (int i = 0; i < kN; ++i) {
    const bool neg = SketchHash(i, kDefaultSketchSeed, kDim).sign < 0;
    negative += neg;
    negative_at[i % 32] += neg;
  }
  EXPECT_NEAR(negative, kN / 2, 6 * 500);
  for (int o = 0; o < 32; ++o) EXPECT_NEAR(negative_at[o], kN / 64, 6 * 88.4) << "offset " << o;
}

// ---- Conversions.

TEST(ConversionTest, BFloat16IsTheHighHalfOfAFloat) {
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(BFloat16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(BFloat16ToFloat(0x7f80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(BFloat16ToFloat(0xff80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(0x7fc0)));
  EXPECT_TRUE(std::signbit(BFloat16ToFloat(0x8000)));
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    ASSERT_EQ(FloatBits(BFloat16ToFloat(static_cast<uint16_t>(h))), h << 16) << h;
  }
}

TEST(ConversionTest, Float16KnownValues) {
  EXPECT_EQ(Float16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Float16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Float16ToFloat(0x7bff), 65504.0f);                      // largest finite
  EXPECT_EQ(Float16ToFloat(0x0400), std::ldexp(1.0f, -14));         // smallest normal
  EXPECT_EQ(Float16ToFloat(0x03ff), 1023 * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(Float16ToFloat(0x0001), std::ldexp(1.0f, -24));         // smallest subnormal
  EXPECT_EQ(Float16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(Float16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Float16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Float16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(FloatBits(Float16ToFloat(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(FloatBits(Float16ToFloat(0x0000)), 0x00000000u);
  // NaNs keep sign and payload and come out quiet (as x86 vcvtph2ps gives them).
  EXPECT_EQ(FloatBits(Float16ToFloat(0x7e00)), 0x7fc00000u);
  EXPECT_EQ(FloatBits(Float16ToFloat(0x7c01)), 0x7fc02000u);
  EXPECT_EQ(FloatBits(Float16ToFloat(0xfc01)), 0xffc02000u);
  EXPECT_EQ(FloatBits(Float16ToFloat(0x7dff)), 0x7fffe000u);
}

TEST(ConversionTest, Float16ExhaustiveAgainstDefinition) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const int sign = (h >> 15) ? -1 : 1;
    const int exponent = (h >> 10) & 0x1f;
    const int mantissa = h & 0x3ff;
    const float got = Float16ToFloat(static_cast<uint16_t>(h));
    if (exponent == 0x1f) {
      ASSERT_EQ(std::isnan(got), mantissa != 0) << h;
      continue;
    }
    // value = sign * mantissa * 2^-24 (subnormal) or sign * (1024 + mantissa) * 2^(e - 25).
    const double want = exponent == 0 ? sign * std::ldexp(mantissa, -24)
                                      : sign * std::ldexp(1024 + mantissa, exponent - 25);
    ASSERT_EQ(static_cast<double>(got), want) << h;
    ASSERT_EQ(std::signbit(got), sign < 0) << h;
  }
}

// ---- CountSketch against its definition.

TEST(CountSketchTest, MatchesDefinitionExactly) {
  const std::vector<float> x = RandomVector(10007, 1);
  // Offsets 65536 - 5000 and 2^17 - 3 make the input cross a segment boundary for the small dims.
  for (uint32_t dim : {1u, 3u, 7u, 16u, 31u, 32u, 33u, 1000u, 1024u, 4096u, 999983u}) {
    for (uint64_t offset :
         {0ULL, 5ULL, 32ULL, 65536ULL - 5000, (1ULL << 17) - 3, 123456789ULL, (1ULL << 40) + 3}) {
      CountSketch sketch(dim, kDefaultSketchSeed);
      sketch.AddFloat32(x.data(), x.size(), offset);
      ExpectBitIdentical(sketch.bins(), ReferenceBins(x, offset, dim, kDefaultSketchSeed));
      EXPECT_EQ(DoubleBits(sketch.sum_squares()), DoubleBits(ReferenceSumSquares(x, offset)))
          << "dim " << dim << " offset " << offset;
    }
  }
}

TEST(CountSketchTest, SumSquaresIsTheSquaredNorm) {
  // Small integers: every partial sum is exact, so the result is the exact squared norm.
  std::vector<float> x(1001);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 17) - 8);
  double want = 0.0;
  for (float v : x) want += static_cast<double>(v) * v;
  CountSketch sketch(1024, 7);
  sketch.AddFloat32(x.data(), x.size(), 3);
  EXPECT_EQ(sketch.sum_squares(), want);

  // Random values: equal to the exact sum up to sketch.h's bound: a float partial sums at most
  // 32 fused multiply-adds, each rounding once, so the error is at most 32 * 2^-24 of the sum (all
  // terms are positive), plus the double sums' rounding.
  const std::vector<float> y = RandomVector(100003, 2);
  long double exact = 0.0L;
  for (float v : y) exact += static_cast<long double>(v) * v;
  CountSketch other(1024, 7);
  other.AddFloat32(y.data(), y.size(), 0);
  EXPECT_NEAR(other.sum_squares(), static_cast<double>(exact),
              33 * std::ldexp(1.0, -24) * static_cast<double>(exact));
  EXPECT_NE(other.sum_squares(), 0.0);
}

TEST(CountSketchTest, SumSquaresOverflowsOnlyFromTwoToTheSixtyFour) {
  // sketch.h: a coordinate below 2^64 in magnitude has a finite float square; one of 2^64 or
  // more overflows it, and the sum is +inf.
  const std::vector<float> below = {std::ldexp(1.0f, 63), 3.0f};
  CountSketch sketch(64, 1);
  sketch.AddFloat32(below.data(), below.size(), 0);
  EXPECT_EQ(sketch.sum_squares(), std::ldexp(1.0, 126) + 9.0);
  const float above = std::ldexp(1.0f, 64);
  sketch.AddFloat32(&above, 1, 2);
  EXPECT_EQ(sketch.sum_squares(), std::numeric_limits<double>::infinity());
}

// ---- Every instruction-set path gives the same bits.

TEST(CountSketchTest, AllKernelPathsBitIdentical) {
  std::mt19937_64 rng(3);
  const std::vector<float> f32 = RandomVector(5000, 4);
  const std::vector<uint16_t> bf16 = ToBFloat16(f32);
  const std::vector<uint16_t> f16 = RandomFloat16Bits(5000, 5);
  // One spare byte in front, so the input can be read from an odd address.
  std::vector<unsigned char> bytes(1 + f32.size() * sizeof(float));
  for (ScalarType type : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
    const void* src = type == ScalarType::kFloat32    ? static_cast<const void*>(f32.data())
                      : type == ScalarType::kBFloat16 ? static_cast<const void*>(bf16.data())
                                                      : static_cast<const void*>(f16.data());
    for (uint32_t dim :
         {1u, 7u, 16u, 31u, 32u, 33u, 1000u, 1024u, 65536u, 999983u, kMaxSketchDim - 1}) {
      for (int trial = 0; trial < 20; ++trial) {
        const size_t n = rng() % 5000;
        const uint64_t offset = trial < 10 ? rng() % 1000 : rng() >> 4;
        const size_t shift = trial % 2;  // odd addresses every other trial
        std::memcpy(bytes.data() + shift, src, n * size);
        CountSketch reference(dim, trial);
        AddWithIsa(reference, KernelIsa::kScalar, bytes.data() + shift, type, n, offset);
        for (KernelIsa isa : SupportedKernelIsas()) {
          SCOPED_TRACE(testing::Message()
                       << KernelIsaName(isa) << " type " << static_cast<int>(type) << " dim " << dim
                       << " n " << n << " offset " << offset);
          CountSketch sketch(dim, trial);
          AddWithIsa(sketch, isa, bytes.data() + shift, type, n, offset);
          ExpectBitIdentical(sketch.bins(), reference.bins());
          EXPECT_EQ(DoubleBits(sketch.sum_squares()), DoubleBits(reference.sum_squares()));
        }
      }
    }
  }
}

TEST(CountSketchTest, SpecialValuesIdenticalOnAllPaths) {
  // Subnormals, signed zeros, infinities and NaNs of every dtype, through every path.
  std::vector<uint16_t> half_bits;
  for (uint32_t h = 0; h <= 0xffff; h += 7) half_bits.push_back(static_cast<uint16_t>(h));
  std::vector<float> f32;
  for (uint32_t h : half_bits) {
    const uint32_t u = (h << 16) | (h * 2654435761u >> 16);
    float f;
    std::memcpy(&f, &u, sizeof f);
    f32.push_back(f);
  }
  for (ScalarType type : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    const void* data = type == ScalarType::kFloat32 ? static_cast<const void*>(f32.data())
                                                    : static_cast<const void*>(half_bits.data());
    CountSketch reference(64, 11);
    AddWithIsa(reference, KernelIsa::kScalar, data, type, half_bits.size(), 0);
    for (KernelIsa isa : SupportedKernelIsas()) {
      SCOPED_TRACE(KernelIsaName(isa));
      CountSketch sketch(64, 11);
      AddWithIsa(sketch, isa, data, type, half_bits.size(), 0);
      for (uint32_t b = 0; b < 64; ++b) {
        // NaN payloads may legitimately differ; NaN-ness and every other bit pattern may not.
        if (std::isnan(reference.bins()[b])) {
          EXPECT_TRUE(std::isnan(sketch.bins()[b])) << b;
        } else {
          EXPECT_EQ(DoubleBits(sketch.bins()[b]), DoubleBits(reference.bins()[b])) << b;
        }
      }
    }
  }
}

// ---- A call's own squares (Add's `squares`).

TEST(CountSketchTest, CallSquaresSameOnAllPathsNearExactAndIndependentOfTheState) {
  // Random lengths and offsets (heads, bodies, tails; runs and segments crossed), a sketch that
  // already holds other values: the call's squares are the same bits on every path, within the
  // contract's 2^-19 of the exact sum (computed in long double from the floats the kernel reads),
  // and added to what *squares held.
  std::mt19937_64 rng(13);
  const std::vector<float> f32 = RandomVector(70000, 14);
  const std::vector<uint16_t> bf16 = ToBFloat16(f32);
  const std::vector<uint16_t> f16 = RandomFloat16Bits(f32.size(), 15);
  for (ScalarType type : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
    const auto* bytes = type == ScalarType::kFloat32    ? reinterpret_cast<const char*>(f32.data())
                        : type == ScalarType::kBFloat16 ? reinterpret_cast<const char*>(bf16.data())
                                                        : reinterpret_cast<const char*>(f16.data());
    for (int trial = 0; trial < 24; ++trial) {
      const size_t n = trial == 0 ? 0 : rng() % (trial < 12 ? 100 : 70000);
      const size_t start = rng() % (f32.size() - n + 1);
      const uint64_t offset = rng() % 300000;
      long double exact = 0;
      for (size_t j = 0; j < n; ++j) {
        float v;
        if (type == ScalarType::kFloat32) {
          v = f32[start + j];
        } else {
          const uint16_t h = (type == ScalarType::kBFloat16 ? bf16 : f16)[start + j];
          v = type == ScalarType::kBFloat16 ? BFloat16ToFloat(h) : Float16ToFloat(h);
        }
        exact += static_cast<long double>(v) * v;
      }
      double reference = -1.0;
      for (KernelIsa isa : SupportedKernelIsas()) {
        SCOPED_TRACE(testing::Message() << KernelIsaName(isa) << " type " << static_cast<int>(type)
                                        << " n " << n << " at " << offset);
        CountSketch sketch(1000, 5);
        // Earlier values in the same run and segment, and a read: none of them may leak in.
        AddWithIsa(sketch, isa, bytes, type, 77, offset > 77 ? offset - 77 : offset + n);
        double squares = 0.5;
        AddWithIsa(sketch, isa, bytes + start * size, type, n, offset, &squares);
        squares -= 0.5;
        if (reference < 0) reference = squares;
        EXPECT_EQ(DoubleBits(squares), DoubleBits(reference));
        EXPECT_NEAR(squares, static_cast<double>(exact),
                    std::ldexp(1.0, -19) * static_cast<double>(exact) + 1e-300);
        // The sketch itself is what it is without the output.
        CountSketch without(1000, 5);
        AddWithIsa(without, isa, bytes, type, 77, offset > 77 ? offset - 77 : offset + n);
        AddWithIsa(without, isa, bytes + start * size, type, n, offset);
        ExpectBitIdentical(sketch.bins(), without.bins());
        EXPECT_EQ(DoubleBits(sketch.sum_squares()), DoubleBits(without.sum_squares()));
      }
    }
  }
}

// ---- Chunking.

TEST(CountSketchTest, AscendingChunksEqualWholeExactly) {
  // Chunks of random lengths (short ones split blocks; long ones hold whole blocks and cross
  // runs) at an odd global offset, 7001 before a segment boundary, through every dtype and path,
  // give the bits of one whole Add.
  const std::vector<float> f32 = RandomVector(20000, 6);
  const std::vector<uint16_t> bf16 = ToBFloat16(f32);
  const std::vector<uint16_t> f16 = RandomFloat16Bits(f32.size(), 23);
  constexpr uint64_t kOffset = 65536 - 7001;
  std::mt19937_64 rng(7);
  for (ScalarType type : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
    const auto* bytes = type == ScalarType::kFloat32    ? reinterpret_cast<const char*>(f32.data())
                        : type == ScalarType::kBFloat16 ? reinterpret_cast<const char*>(bf16.data())
                                                        : reinterpret_cast<const char*>(f16.data());
    for (KernelIsa isa : SupportedKernelIsas()) {
      for (uint32_t dim : {1u, 7u, 16u, 32u, 1000u, 1024u}) {
        SCOPED_TRACE(testing::Message()
                     << KernelIsaName(isa) << " type " << static_cast<int>(type) << " dim " << dim);
        CountSketch whole(dim, 99);
        AddWithIsa(whole, isa, bytes, type, f32.size(), kOffset);
        for (int trial = 0; trial < 6; ++trial) {
          CountSketch chunked(dim, 99);
          size_t start = 0;
          while (start < f32.size()) {
            const size_t limit = trial % 2 == 0 ? 40 : 700;
            const size_t len = std::min<size_t>(f32.size() - start, rng() % limit);
            AddWithIsa(chunked, isa, bytes + start * size, type, len, kOffset + start);
            start += len;
          }
          ExpectBitIdentical(chunked.bins(), whole.bins());
          EXPECT_EQ(DoubleBits(chunked.sum_squares()), DoubleBits(whole.sum_squares()));
        }
      }
    }
  }
}

TEST(CountSketchTest, ChunksInAnyOrderEqualWholeUpToRounding) {
  const std::vector<float> x = RandomVector(20000, 8);
  constexpr uint32_t kDim = 512;
  constexpr uint64_t kSeed = 5;
  // Recursive summation of m terms errs by at most (m - 1) * u * sum |terms| (Higham), u = 2^-24
  // for the float partials (the double sums add far less), so two orders differ by at most twice
  // that. The squares: at most 33 * 2^-24 of the sum each (SumSquaresIsTheSquaredNorm).
  std::vector<double> abs_sum(kDim, 0.0);
  std::vector<int> count(kDim, 0);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t bin = SketchHash(i, kSeed, kDim).bin;
    abs_sum[bin] += std::fabs(x[i]);
    ++count[bin];
  }
  double square_sum = 0.0;
  for (float v : x) square_sum += static_cast<double>(v) * v;
  CountSketch whole(kDim, kSeed);
  whole.AddFloat32(x.data(), x.size(), 0);

  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 10; ++trial) {
    std::vector<size_t> cuts = {0, x.size()};
    for (int c = 0; c < 40; ++c) cuts.push_back(rng() % x.size());
    std::sort(cuts.begin(), cuts.end());
    std::vector<size_t> order(cuts.size() - 1);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    CountSketch chunked(kDim, kSeed);
    for (size_t k : order) chunked.AddFloat32(x.data() + cuts[k], cuts[k + 1] - cuts[k], cuts[k]);
    for (uint32_t b = 0; b < kDim; ++b) {
      const double tol = 2.0 * count[b] * std::ldexp(1.0, -24) * abs_sum[b];
      ASSERT_NEAR(chunked.bins()[b], whole.bins()[b], tol) << "bin " << b;
    }
    EXPECT_NEAR(chunked.sum_squares(), whole.sum_squares(),
                2.0 * 33 * std::ldexp(1.0, -24) * square_sum);
  }
}

// ---- Dtypes.

TEST(CountSketchTest, HalfPrecisionSketchEqualsSketchOfItsWidening) {
  const std::vector<uint16_t> bf16 = ToBFloat16(RandomVector(3001, 10));
  const std::vector<uint16_t> f16 = RandomFloat16Bits(3001, 11);
  for (ScalarType type : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
    const std::vector<uint16_t>& bits = type == ScalarType::kBFloat16 ? bf16 : f16;
    const std::vector<float> wide = Widen(bits, type);
    CountSketch half(1000, 12), single(1000, 12);
    half.Add(bits.data(), type, bits.size(), 77);
    single.AddFloat32(wide.data(), wide.size(), 77);
    ExpectBitIdentical(half.bins(), single.bins());
    EXPECT_EQ(DoubleBits(half.sum_squares()), DoubleBits(single.sum_squares()));
  }
}

// ---- Instances, Reset, edge cases.

TEST(CountSketchTest, DeterministicAcrossInstancesAndSeedDependent) {
  const std::vector<float> x = RandomVector(4096, 13);
  CountSketch a(1024, 42), b(1024, 42), c(1024, 43);
  a.AddFloat32(x.data(), x.size(), 0);
  b.AddFloat32(x.data(), x.size(), 0);
  c.AddFloat32(x.data(), x.size(), 0);
  ExpectBitIdentical(a.bins(), b.bins());
  EXPECT_EQ(a.sum_squares(), c.sum_squares());  // the norm does not depend on the seed
  EXPECT_NE(std::vector<double>(a.bins().begin(), a.bins().end()),
            std::vector<double>(c.bins().begin(), c.bins().end()));
  EXPECT_EQ(a.dim(), 1024u);
  EXPECT_EQ(a.seed(), 42u);
}

TEST(CountSketchTest, ResetStartsOver) {
  const std::vector<float> x = RandomVector(1000, 14);
  const std::vector<float> y = RandomVector(1000, 15);
  CountSketch fresh(1000, 1), reused(1000, 1);
  reused.AddFloat32(x.data(), x.size(), 0);
  reused.Reset();
  EXPECT_THAT(reused.bins(), testing::Each(0.0));
  EXPECT_EQ(reused.sum_squares(), 0.0);
  reused.AddFloat32(y.data(), y.size(), 3);
  fresh.AddFloat32(y.data(), y.size(), 3);
  ExpectBitIdentical(reused.bins(), fresh.bins());
  EXPECT_EQ(DoubleBits(reused.sum_squares()), DoubleBits(fresh.sum_squares()));
}

TEST(CountSketchTest, DimOneSumsSignedCoordinates) {
  const std::vector<float> x = RandomVector(999, 16);
  CountSketch sketch(1, 3);
  sketch.AddFloat32(x.data(), x.size(), 10);
  // One segment. Every base is 0, so offset o of every block goes to float partial o (of 32),
  // in index order; the partials then go into the one double bin in the order o = 0 .. 31.
  float partial[kSketchBlock] = {};
  for (size_t i = 0; i < x.size(); ++i) {
    partial[(10 + i) % kSketchBlock] += SketchHash(10 + i, 3, 1).sign * x[i];
  }
  double want = 0.0;
  for (float p : partial) want += static_cast<double>(p);
  ASSERT_EQ(sketch.bins().size(), 1u);
  EXPECT_EQ(sketch.bins()[0], want);
}

TEST(CountSketchTest, EmptyAndTinyInputs) {
  CountSketch sketch(16, 1);
  sketch.AddFloat32(nullptr, 0, 0);
  EXPECT_THAT(sketch.bins(), testing::Each(0.0));
  const float one = 1.5f;
  sketch.AddFloat32(&one, 1, 1ULL << 62);
  const SketchSlot slot = SketchHash(1ULL << 62, 1, 16);
  EXPECT_EQ(sketch.bins()[slot.bin], 1.5 * slot.sign);
  EXPECT_EQ(sketch.sum_squares(), 2.25);
}

TEST(CountSketchTest, CopyToAndToFloats) {
  const std::vector<float> x = RandomVector(5000, 17);
  CountSketch sketch(100, 2);
  sketch.AddFloat32(x.data(), x.size(), 0);
  std::vector<float> out(100);
  sketch.CopyTo(absl::MakeSpan(out));
  EXPECT_EQ(out, sketch.ToFloats());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(sketch.bins()[i]));
}

TEST(CountSketchTest, NaNAndInfinityPropagate) {
  std::vector<float> x = RandomVector(100, 18);
  x[37] = std::numeric_limits<float>::quiet_NaN();
  CountSketch sketch(64, 4);
  sketch.AddFloat32(x.data(), x.size(), 0);
  EXPECT_TRUE(std::isnan(sketch.bins()[SketchHash(37, 4, 64).bin]));
  EXPECT_TRUE(std::isnan(sketch.sum_squares()));
  const std::vector<float> v = sketch.ToFloats();
  const std::vector<float> ok(64, 1.0f);
  EXPECT_TRUE(std::isnan(SketchCosine(v, ok)));

  x[37] = std::numeric_limits<float>::infinity();
  CountSketch inf(64, 4);
  inf.AddFloat32(x.data(), x.size(), 0);
  EXPECT_TRUE(std::isinf(inf.sum_squares()));
  EXPECT_TRUE(std::isnan(SketchCosine(inf.ToFloats(), ok)));
}

// ---- SketchDot and SketchCosine.

TEST(SketchCosineTest, EdgeCases) {
  const std::vector<float> a = {1, 2, 3, 4};
  const std::vector<float> neg = {-1, -2, -3, -4};
  const std::vector<float> zero(4, 0.0f);
  const std::vector<float> nan = {1, std::numeric_limits<float>::quiet_NaN(), 0, 0};
  const std::vector<float> inf = {1, std::numeric_limits<float>::infinity(), 0, 0};
  EXPECT_EQ(SketchDot(a, a), 30.0);
  EXPECT_DOUBLE_EQ(SketchCosine(a, a), 1.0);
  EXPECT_DOUBLE_EQ(SketchCosine(a, neg), -1.0);
  EXPECT_EQ(SketchCosine(a, zero), 0.0);
  EXPECT_EQ(SketchCosine(zero, zero), 0.0);
  EXPECT_TRUE(std::isnan(SketchCosine(a, nan)));
  EXPECT_TRUE(std::isnan(SketchCosine(nan, a)));
  EXPECT_TRUE(std::isnan(SketchCosine(zero, nan)));
  EXPECT_TRUE(std::isnan(SketchCosine(a, inf)));
  EXPECT_TRUE(std::isnan(SketchDot(a, std::vector<float>(3))));
  EXPECT_TRUE(std::isnan(SketchCosine(a, std::vector<float>(5))));
  EXPECT_EQ(SketchCosine({}, {}), 0.0);
  // Cosine stays within [-1, 1] despite rounding.
  const std::vector<float> b = {0.1f, 0.1f, 0.1f};
  EXPECT_LE(SketchCosine(b, b), 1.0);
}

// ---- Statistics: unbiasedness and accuracy.

// E[<Sa, Sb>] = <a, b> over the choice of seed: the mean of the estimates over many seeds must
// lie within 5 standard errors of the truth (standard error from the sample variance). Dim 7 is
// below the block size: windows wrap onto themselves, and the estimate must stay unbiased.
TEST(SketchStatisticsTest, InnerProductUnbiased) {
  constexpr size_t kN = 4096;
  constexpr int kSeeds = 2000;
  const std::vector<float> a = RandomVector(kN, 19);
  std::vector<float> b = RandomVector(kN, 20);
  for (size_t i = 0; i < kN; ++i) b[i] += 0.5f * a[i];  // <a, b> about kN / 2
  double truth = 0.0, a_norm2 = 0.0;
  for (size_t i = 0; i < kN; ++i) {
    truth += double{a[i]} * b[i];
    a_norm2 += double{a[i]} * a[i];
  }
  for (uint32_t dim : {64u, 7u}) {
    double sum = 0.0, sum2 = 0.0, norm_sum = 0.0, norm_sum2 = 0.0;
    for (int s = 0; s < kSeeds; ++s) {
      CountSketch sa(dim, s), sb(dim, s);
      sa.AddFloat32(a.data(), kN, 0);
      sb.AddFloat32(b.data(), kN, 0);
      const double est = SketchDot(sa.ToFloats(), sb.ToFloats());
      const double norm = SketchDot(sa.ToFloats(), sa.ToFloats());
      sum += est;
      sum2 += est * est;
      norm_sum += norm;
      norm_sum2 += norm * norm;
    }
    const double mean = sum / kSeeds;
    const double se = std::sqrt((sum2 / kSeeds - mean * mean) / kSeeds);
    EXPECT_NEAR(mean, truth, 5 * se) << "dim " << dim << " truth " << truth;
    const double norm_mean = norm_sum / kSeeds;
    const double norm_se = std::sqrt((norm_sum2 / kSeeds - norm_mean * norm_mean) / kSeeds);
    EXPECT_NEAR(norm_mean, a_norm2, 5 * norm_se) << "dim " << dim << " |a|^2 " << a_norm2;
    // Sanity: the estimator is not degenerate (a count sketch has variance about |a|^2 |b|^2 / k).
    EXPECT_GT(se, 0.0);
  }
}

// Vectors with a known cosine c: b = c u + sqrt(1 - c^2) w for orthogonalized Gaussian u, w,
// supported on the coordinates stride * j + phase (j < kSupport). The sketch cosine errs by about
// (1 - c^2) / sqrt(k); every single estimate must be within 4 / sqrt(k), and the root-mean-square
// error over seeds within 1.5 / sqrt(k).
void ExpectCosineErrorShrinksLikeOneOverSqrtK(size_t stride, size_t phase) {
  constexpr size_t kSupport = 50000;
  const size_t n = stride * kSupport;
  std::vector<double> u(kSupport), w(kSupport);
  {
    const std::vector<float> ru = RandomVector(kSupport, 21), rw = RandomVector(kSupport, 22);
    double uu = 0, uw = 0;
    for (size_t i = 0; i < kSupport; ++i) {
      uu += double{ru[i]} * ru[i];
      uw += double{ru[i]} * rw[i];
    }
    double ww = 0;
    for (size_t i = 0; i < kSupport; ++i) {
      u[i] = ru[i] / std::sqrt(uu);
      w[i] = rw[i] - uw / uu * ru[i];
      ww += w[i] * w[i];
    }
    for (double& x : w) x /= std::sqrt(ww);
  }
  for (double c : {-0.5, 0.0, 0.3, 0.7, 0.95}) {
    std::vector<float> a(n, 0.0f), b(n, 0.0f);
    for (size_t i = 0; i < kSupport; ++i) {
      a[stride * i + phase] = static_cast<float>(u[i]);
      b[stride * i + phase] = static_cast<float>(c * u[i] + std::sqrt(1 - c * c) * w[i]);
    }
    const double truth = SketchCosine(a, b);  // the exact cosine of the float vectors
    ASSERT_NEAR(truth, c, 1e-5);
    for (uint32_t k : {256u, 1024u, 4096u}) {
      double sq = 0.0;
      constexpr int kSeeds = 20;
      for (int s = 0; s < kSeeds; ++s) {
        CountSketch sa(k, 1000 + s), sb(k, 1000 + s);
        sa.AddFloat32(a.data(), n, 0);
        sb.AddFloat32(b.data(), n, 0);
        const double err = SketchCosine(sa.ToFloats(), sb.ToFloats()) - truth;
        EXPECT_LT(std::fabs(err), 4 / std::sqrt(k)) << "c " << c << " k " << k << " seed " << s;
        sq += err * err;
      }
      EXPECT_LT(std::sqrt(sq / kSeeds), 1.5 / std::sqrt(k)) << "c " << c << " k " << k;
    }
  }
}

TEST(SketchStatisticsTest, CosineErrorShrinksLikeOneOverSqrtK) {
  ExpectCosineErrorShrinksLikeOneOverSqrtK(1, 0);
}

// All the energy on one in-block offset (only coordinates i = 0 mod 32, or i = 31 mod 32, are
// nonzero): every nonzero coordinate sits in its own block, so the bins it can reach must still
// be all dim of them. A scheme with block-aligned windows (base a multiple of 32) would put them
// all into dim / 32 bins, and its error would be about 5.7 times larger.
TEST(SketchStatisticsTest, CosineErrorBoundHoldsWithEnergyOnOneBlockOffset) {
  ExpectCosineErrorShrinksLikeOneOverSqrtK(32, 0);
  ExpectCosineErrorShrinksLikeOneOverSqrtK(32, 31);
}

}  // namespace
}  // namespace rankscope
