// Sketch encodings (common/sketch_encoding.h): exact half decoding, round-to-nearest-even
// packing within the stated per-bin bounds, special values, and a Monte Carlo check that the
// packed sketches' inner-product estimate stays unbiased.
#include "common/sketch_encoding.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "rankscope/sketch.h"

namespace rankscope {
namespace {

TEST(HalfTest, EveryHalfRoundTripsExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = FloatFromHalf(static_cast<uint16_t>(h));
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) {
      EXPECT_TRUE(std::isnan(f)) << h;
      continue;
    }
    EXPECT_EQ(HalfFromFloat(f), h) << h;
  }
  EXPECT_EQ(FloatFromHalf(0x3c00), 1.0f);
  EXPECT_EQ(FloatFromHalf(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(FloatFromHalf(0x7bff), 65504.0f);
  EXPECT_EQ(FloatFromHalf(0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(HalfTest, RoundsToNearestTiesToEven) {
  // Between 1 and its successor 1 + 2^-10: the midpoint goes to the even one (1).
  EXPECT_EQ(HalfFromFloat(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(HalfFromFloat(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(HalfFromFloat(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3c01);
  // Subnormal grid (2^-24): 2.5 * 2^-24 -> 2, 3.5 * 2^-24 -> 4; below half the grid -> 0.
  EXPECT_EQ(HalfFromFloat(2.5f * std::ldexp(1.0f, -24)), 0x0002);
  EXPECT_EQ(HalfFromFloat(3.5f * std::ldexp(1.0f, -24)), 0x0004);
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(HalfFromFloat(65520.0f), 0x7c00);  // rounds past the largest half: Inf
  EXPECT_EQ(HalfFromFloat(-1e30f), 0xfc00);
  EXPECT_EQ(HalfFromFloat(std::numeric_limits<float>::quiet_NaN()) & 0x7e00, 0x7e00);
}

std::vector<float> Gaussian(size_t n, uint64_t seed, float sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

TEST(PackSketchTest, EveryBinWithinItsStatedBound) {
  for (float sigma : {1e-30f, 1e-6f, 1.0f, 1e30f}) {
    const std::vector<float> v = Gaussian(4096, 7, sigma);
    const PackedSketch i8 = PackSketch(v, SketchEncoding::kInt8);
    ASSERT_EQ(i8.bins.size(), v.size());
    const SketchView i8_view(SketchEncoding::kInt8, i8.bins.data(), v.size(), i8.scale);
    const PackedSketch f16 = PackSketch(v, SketchEncoding::kFloat16);
    ASSERT_EQ(f16.bins.size(), 2 * v.size());
    const SketchView f16_view(SketchEncoding::kFloat16, f16.bins.data(), v.size(), f16.scale);
    float max_abs = 0.0f;
    for (float x : v) max_abs = std::max(max_abs, std::fabs(x));
    for (size_t i = 0; i < v.size(); ++i) {
      const double x = v[i];
      // int8: within scale / 2 (the clamp of the largest bin adds at most an ulp of it).
      EXPECT_LE(std::fabs(i8_view.Value(i) - x), i8.scale / 2.0 + 1e-7 * max_abs) << i;
      const int q = static_cast<int8_t>(i8.bins[i]);
      EXPECT_GE(q, -127);
      EXPECT_LE(q, 127);
      // float16: within 2^-11 relative for bins above 2^-14 of the scaled range, else within
      // half a subnormal step.
      const double err = std::fabs(f16_view.Value(i) - x);
      EXPECT_LE(err, std::max(std::ldexp(std::fabs(x), -11), std::ldexp(1.0, -25) * f16.scale))
          << i;
    }
    // float16's scale is a power of two; the largest bin maps into [2^14, 2^15).
    int e = 0;
    EXPECT_EQ(std::frexp(f16.scale, &e), 0.5f);
    EXPECT_GE(max_abs / f16.scale, 16384.0f);
    EXPECT_LT(max_abs / f16.scale, 32768.0f);
  }
}

TEST(PackSketchTest, ZeroAndNonFiniteSketches) {
  const std::vector<float> zeros(64, 0.0f);
  for (SketchEncoding e : {SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    const PackedSketch p = PackSketch(zeros, e);
    EXPECT_EQ(p.scale, 1.0f);
    EXPECT_EQ(p.bins, std::string(64 * SketchBytesPerBin(e), '\0'));
    std::vector<float> bad(64, 1.0f);
    bad[5] = std::numeric_limits<float>::infinity();
    const PackedSketch q = PackSketch(bad, e);
    EXPECT_TRUE(std::isnan(q.scale));
    const SketchView view(e, q.bins.data(), 64, q.scale);
    EXPECT_FALSE(view.AllFinite());
    EXPECT_TRUE(std::isnan(view.Value(0)));
  }
}

TEST(PackSketchTest, DeterministicAndSignSymmetric) {
  const std::vector<float> v = Gaussian(1000, 3, 0.01f);
  std::vector<float> neg(v.size());
  for (size_t i = 0; i < v.size(); ++i) neg[i] = -v[i];
  for (SketchEncoding e : {SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    const PackedSketch a = PackSketch(v, e);
    EXPECT_EQ(PackSketch(v, e).bins, a.bins);
    const PackedSketch b = PackSketch(neg, e);
    EXPECT_EQ(a.scale, b.scale);
    const SketchView va(e, a.bins.data(), v.size(), a.scale);
    const SketchView vb(e, b.bins.data(), v.size(), b.scale);
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(va.Value(i), -vb.Value(i));
  }
}

TEST(SketchEncodingTest, NamesAndWireValues) {
  for (SketchEncoding e :
       {SketchEncoding::kFloat32, SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    EXPECT_EQ(ParseSketchEncoding(SketchEncodingName(e)), e);
    EXPECT_EQ(SketchEncodingFromWire(static_cast<int>(e)), e);
  }
  EXPECT_EQ(ParseSketchEncoding("bfloat16"), std::nullopt);
  EXPECT_EQ(SketchEncodingFromWire(3), std::nullopt);
  EXPECT_EQ(SketchEncodingFromWire(-1), std::nullopt);
  EXPECT_EQ(SketchBytesPerBin(SketchEncoding::kInt8), 1u);
  EXPECT_EQ(SketchBytesPerBin(SketchEncoding::kFloat16), 2u);
  EXPECT_EQ(SketchBytesPerBin(SketchEncoding::kFloat32), 4u);
}

TEST(SketchDotTest, EqualsTheSumOfDecodedProducts) {
  const std::vector<float> x = Gaussian(999, 1, 0.3f), y = Gaussian(999, 2, 3.0f);
  for (SketchEncoding ea :
       {SketchEncoding::kFloat32, SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    for (SketchEncoding eb :
         {SketchEncoding::kFloat32, SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
      const PackedSketch pa = PackSketch(x, ea), pb = PackSketch(y, eb);
      const SketchView a(ea, pa.bins.data(), x.size(), pa.scale);
      const SketchView b(eb, pb.bins.data(), y.size(), pb.scale);
      long double exact = 0.0L;
      for (size_t i = 0; i < x.size(); ++i) {
        exact += static_cast<long double>(a.Value(i)) * b.Value(i);
      }
      EXPECT_NEAR(SketchDot(a, b), static_cast<double>(exact),
                  1e-12 * std::sqrt(SketchDot(a, a) * SketchDot(b, b)))
          << SketchEncodingName(ea) << " x " << SketchEncodingName(eb);
    }
  }
}

double Dot(const SketchView& a, const SketchView& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a.Value(i) * b.Value(i);
  return s;
}

// Monte Carlo over sketch seeds. Two correlated heavy-tailed "gradients" x, y (n coordinates,
// a few large ones as real gradients have); for each seed, the count sketches a = Sx, b = Sy
// (float) and their packed forms. The count sketch's estimate <a, b> is unbiased for <x, y>; the
// stated bound for the packed estimate <Q(a), Q(b)> is that its mean over seeds is within four
// standard errors of <x, y> (unbiased up to the Monte Carlo noise), and that the quantization's
// own contribution D = <Q(a), Q(b)> - <a, b> has a mean within four of its standard errors of 0
// plus the deterministic rounding's bias, at most k * (scale_a * scale_b / 4) / 1000 (the
// errors are near uniform and uncorrelated with the bins, so their products average out).
TEST(PackSketchTest, InnerProductEstimateIsUnbiased) {
  constexpr size_t kN = 20000;
  constexpr int kSeeds = 400;
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal;
  std::vector<float> x(kN), y(kN);
  double truth = 0.0;
  for (size_t i = 0; i < kN; ++i) {
    const double big = (i % 997 == 0) ? 20.0 : 1.0;  // heavy coordinates
    const double shared = normal(rng) * big;
    x[i] = static_cast<float>(shared + 0.8 * normal(rng));
    y[i] = static_cast<float>(shared + 0.8 * normal(rng));
    truth += static_cast<double>(x[i]) * y[i];
  }
  for (SketchEncoding e : {SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    const uint32_t k = static_cast<uint32_t>(4096 / SketchBytesPerBin(e));
    double est_sum = 0.0, est_sq = 0.0, d_sum = 0.0, d_sq = 0.0, bias_bound = 0.0;
    for (int seed = 0; seed < kSeeds; ++seed) {
      CountSketch sa(k, 1000 + seed), sb(k, 1000 + seed);
      sa.AddFloat32(x.data(), kN, 0);
      sb.AddFloat32(y.data(), kN, 0);
      const std::vector<float> a = sa.ToFloats(), b = sb.ToFloats();
      const PackedSketch pa = PackSketch(a, e), pb = PackSketch(b, e);
      const SketchView qa(e, pa.bins.data(), k, pa.scale), qb(e, pb.bins.data(), k, pb.scale);
      const double est = Dot(qa, qb);
      const double d = est - Dot(SketchView(a), SketchView(b));
      est_sum += est;
      est_sq += est * est;
      d_sum += d;
      d_sq += d * d;
      bias_bound += k * (static_cast<double>(pa.scale) * pb.scale / 4.0) / 1000.0;
    }
    const double n = kSeeds;
    const double est_mean = est_sum / n;
    const double est_se = std::sqrt((est_sq / n - est_mean * est_mean) / n);
    const double d_mean = d_sum / n;
    const double d_se = std::sqrt(std::max(0.0, d_sq / n - d_mean * d_mean) / n);
    SCOPED_TRACE(SketchEncodingName(e));
    EXPECT_LE(std::fabs(est_mean - truth), 4.0 * est_se)
        << "mean " << est_mean << " truth " << truth << " se " << est_se;
    EXPECT_LE(std::fabs(d_mean), 4.0 * d_se + bias_bound / n)
        << "quantization bias " << d_mean << " se " << d_se;
    // The quantization noise is small beside the sketch's own.
    EXPECT_LT(std::sqrt(d_sq / n), 0.1 * est_se * std::sqrt(n));
  }
}

}  // namespace
}  // namespace rankscope
