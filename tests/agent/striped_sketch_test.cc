// Tests of the multi-threaded sketch (agent/include/rankscope/striped_sketch.h): bit-identical
// bins and sum of squares whatever the thread count, the same sketch as one CountSketch up to
// rounding, and the reuse of a sketch across steps. Also run under ThreadSanitizer (./run test).
#include "rankscope/striped_sketch.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rankscope/sketch.h"

namespace rankscope {
namespace {

uint64_t DoubleBits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

// n values of `type` (float32, or the high/low 16 bits of float32 normals) as raw bytes.
std::vector<unsigned char> RandomValues(size_t n, ScalarType type, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
  std::vector<unsigned char> out(n * size);
  for (size_t i = 0; i < n; ++i) {
    const float f = normal(rng);
    if (type == ScalarType::kFloat32) {
      std::memcpy(&out[i * 4], &f, 4);
    } else {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      // bfloat16: the high half; float16: a normal number of about the same size.
      const uint16_t h =
          type == ScalarType::kBFloat16
              ? static_cast<uint16_t>(u >> 16)
              : static_cast<uint16_t>(((u >> 16) & 0x8000) | (15 << 10) | ((u >> 13) & 0x3ff));
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

// A bucket as the shim feeds it: segments of varied sizes, not in ascending order, starting and
// ending mid-stripe and mid-block.
struct Bucket {
  std::vector<unsigned char> bytes;
  std::vector<StripedSketch::Segment> segments;
};

Bucket MakeBucket(ScalarType type, uint64_t seed) {
  const size_t sizes[] = {300'001, 17, 70'000, 1, 1'000'003, 65'536, 4'099};
  size_t total = 0;
  for (size_t s : sizes) total += s;
  Bucket b;
  b.bytes = RandomValues(total, type, seed);
  const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
  // Global offsets: the segments in reverse order of the flat vector, from an odd start.
  uint64_t offset = 123'457 + total;
  size_t at = 0;
  for (size_t s : sizes) {
    offset -= s;
    b.segments.push_back({b.bytes.data() + at * size, s, offset});
    at += s;
  }
  return b;
}

void ExpectBitIdentical(const CountSketch& a, const CountSketch& b) {
  ASSERT_EQ(a.dim(), b.dim());
  for (uint32_t i = 0; i < a.dim(); ++i) {
    ASSERT_EQ(DoubleBits(a.bins()[i]), DoubleBits(b.bins()[i])) << "bin " << i;
  }
  EXPECT_EQ(DoubleBits(a.sum_squares()), DoubleBits(b.sum_squares()));
}

class StripedSketchTest : public ::testing::TestWithParam<std::tuple<ScalarType, uint32_t>> {};

TEST_P(StripedSketchTest, BitIdenticalWhateverTheThreadCount) {
  const auto [type, dim] = GetParam();
  const Bucket bucket = MakeBucket(type, 7);
  const Bucket second = MakeBucket(type, 8);
  StripedSketch one(dim, kDefaultSketchSeed, 1);
  one.AddSegments(bucket.segments, type);
  one.AddSegments(second.segments, type);
  for (int threads : {2, 3, 8}) {
    StripedSketch many(dim, kDefaultSketchSeed, threads);
    EXPECT_EQ(many.threads(), threads);
    many.AddSegments(bucket.segments, type);
    many.AddSegments(second.segments, type);
    ExpectBitIdentical(one.sketch(), many.sketch());
  }
}

TEST_P(StripedSketchTest, SegmentsAtOnceEqualOneCallEachAndOneCountSketchUpToRounding) {
  const auto [type, dim] = GetParam();
  const Bucket bucket = MakeBucket(type, 9);
  StripedSketch at_once(dim, kDefaultSketchSeed, 4);
  at_once.AddSegments(bucket.segments, type);
  StripedSketch one_by_one(dim, kDefaultSketchSeed, 2);
  CountSketch plain(dim, kDefaultSketchSeed);
  for (const StripedSketch::Segment& s : bucket.segments) {
    one_by_one.Add(s.data, type, s.n, s.offset);
    plain.Add(s.data, type, s.n, s.offset);
  }
  // Each slot receives the same pieces in the same order either way.
  ExpectBitIdentical(at_once.sketch(), one_by_one.sketch());
  // The same values summed in other groups and orders (sketch.h "Rounding": float partials per
  // segment and run). A float sum of m terms errs by at most m * 2^-24 of their magnitudes, so two
  // groupings differ by at most twice that per bin; the sums of squares by 2 * 33 * 2^-24.
  std::vector<double> count(dim, 0.0), magnitude(dim, 0.0);
  const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
  for (const StripedSketch::Segment& s : bucket.segments) {
    const auto* p = static_cast<const unsigned char*>(s.data);
    for (size_t j = 0; j < s.n; ++j) {
      float v;
      uint16_t h;
      if (type == ScalarType::kFloat32) {
        std::memcpy(&v, p + 4 * j, 4);
      } else {
        std::memcpy(&h, p + size * j, 2);
        v = type == ScalarType::kBFloat16 ? BFloat16ToFloat(h) : Float16ToFloat(h);
      }
      const uint32_t bin = SketchHash(s.offset + j, kDefaultSketchSeed, dim).bin;
      count[bin] += 1;
      magnitude[bin] += std::abs(v);
    }
  }
  for (uint32_t i = 0; i < dim; ++i) {
    EXPECT_NEAR(at_once.sketch().bins()[i], plain.bins()[i],
                2 * count[i] * std::ldexp(1.0, -24) * magnitude[i])
        << i;
  }
  EXPECT_NEAR(at_once.sketch().sum_squares(), plain.sum_squares(),
              2 * 33 * std::ldexp(1.0, -24) * plain.sum_squares());
}

TEST_P(StripedSketchTest, SegmentSquaresSameWhateverTheThreadCountAndEqualOneCountSketchEach) {
  // The segments' squares, read in the bucket's one pass, are the same bits on any number of
  // threads, equal those of a CountSketch fed each segment alone (a segment's stripes are pieces
  // whose sums add in ascending order: equal within one rounding per piece), and leave the
  // sketch as it is without them.
  const auto [type, dim] = GetParam();
  const Bucket bucket = MakeBucket(type, 17);
  std::vector<double> one_squares(bucket.segments.size(), 0.0);
  StripedSketch one(dim, kDefaultSketchSeed, 1);
  one.AddSegments(bucket.segments, type, absl::MakeSpan(one_squares));
  StripedSketch plain(dim, kDefaultSketchSeed, 1);
  plain.AddSegments(bucket.segments, type);
  ExpectBitIdentical(one.sketch(), plain.sketch());
  for (int threads : {2, 8}) {
    std::vector<double> squares(bucket.segments.size(), 0.0);
    StripedSketch many(dim, kDefaultSketchSeed, threads);
    many.AddSegments(bucket.segments, type, absl::MakeSpan(squares));
    for (size_t i = 0; i < squares.size(); ++i) {
      EXPECT_EQ(DoubleBits(squares[i]), DoubleBits(one_squares[i])) << i;
    }
  }
  for (size_t i = 0; i < bucket.segments.size(); ++i) {
    const StripedSketch::Segment& s = bucket.segments[i];
    CountSketch alone(dim, kDefaultSketchSeed);
    double squares = 0.0;
    alone.Add(s.data, type, s.n, s.offset, &squares);
    const double pieces = static_cast<double>(s.n / StripedSketch::kStripe + 2);
    EXPECT_NEAR(one_squares[i], squares, pieces * std::ldexp(1.0, -19) * squares) << i;
    EXPECT_GT(one_squares[i], 0.0) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(TypesAndDims, StripedSketchTest,
                         ::testing::Combine(::testing::Values(ScalarType::kFloat32,
                                                              ScalarType::kBFloat16,
                                                              ScalarType::kFloat16),
                                            ::testing::Values(1024u, 1000u, 7u)));

TEST(StripedSketch, ResetEmptiesEverySlotAndTheSketchIsReusable) {
  const Bucket bucket = MakeBucket(ScalarType::kFloat32, 11);
  StripedSketch s(1024, kDefaultSketchSeed, 2);
  s.AddSegments(bucket.segments, ScalarType::kFloat32);
  const std::vector<double> first(s.sketch().bins().begin(), s.sketch().bins().end());
  const double first_ss = s.sketch().sum_squares();
  s.Reset();
  for (double v : s.sketch().bins()) ASSERT_EQ(v, 0.0);
  EXPECT_EQ(s.sketch().sum_squares(), 0.0);
  s.AddSegments(bucket.segments, ScalarType::kFloat32);
  for (uint32_t i = 0; i < 1024; ++i)
    ASSERT_EQ(DoubleBits(s.sketch().bins()[i]), DoubleBits(first[i]));
  EXPECT_EQ(DoubleBits(s.sketch().sum_squares()), DoubleBits(first_ss));
}

TEST(StripedSketch, SlotsBoundTheMemoryAndThreadsAtLeastOne) {
  EXPECT_EQ(StripedSketch(1024, 1, 1).slots(), 16u);
  EXPECT_EQ(StripedSketch(65536, 1, 1).slots(), 16u);
  EXPECT_EQ(StripedSketch(1u << 18, 1, 1).slots(), 4u);
  EXPECT_EQ(StripedSketch(kMaxSketchDim, 1, 1).slots(), 1u);
  EXPECT_EQ(StripedSketch(64, 1, 0).threads(), 1);
  EXPECT_EQ(StripedSketch(64, 1, -3).threads(), 1);
}

TEST(StripedSketch, NoSegmentsOrEmptySegmentsChangeNothing) {
  StripedSketch s(256, kDefaultSketchSeed, 3);
  s.AddSegments({}, ScalarType::kFloat32);
  const float x = 1.5f;
  const StripedSketch::Segment empty[] = {{&x, 0, 5}};
  s.AddSegments(empty, ScalarType::kFloat32);
  for (double v : s.sketch().bins()) ASSERT_EQ(v, 0.0);
  s.Add(&x, ScalarType::kFloat32, 1, 5);
  EXPECT_EQ(s.sketch().sum_squares(), 2.25);
  EXPECT_EQ(s.sketch().bins()[SketchHash(5, kDefaultSketchSeed, 256).bin],
            1.5 * SketchHash(5, kDefaultSketchSeed, 256).sign);
}

}  // namespace
}  // namespace rankscope
