#include "collector/analysis/aggregation_integrity.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/sketch_encoding.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

constexpr size_t kDim = 1024;

// W ranks' local sketches of correlated gradients (a shared direction plus 30 % rank noise), as
// float32 values, and their encodings.
struct Group {
  std::vector<std::vector<float>> local;
  std::vector<PackedSketch> packed;
  std::vector<double> norms;
  SketchEncoding encoding = SketchEncoding::kFloat32;

  std::vector<IntegrityInput> Inputs() const {
    std::vector<IntegrityInput> in;
    for (size_t r = 0; r < local.size(); ++r) {
      IntegrityInput x;
      x.rank = static_cast<uint32_t>(r);
      x.grad_norm = norms[r];
      if (encoding == SketchEncoding::kFloat32) {
        x.sketch = SketchView(local[r]);
      } else {
        x.sketch = SketchView(encoding, packed[r].bins.data(), kDim, packed[r].scale);
      }
      in.push_back(x);
    }
    return in;
  }
};

Group MakeGroup(uint32_t world, SketchEncoding encoding, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> common(kDim);
  for (double& c : common) c = normal(rng);
  Group g;
  g.encoding = encoding;
  for (uint32_t r = 0; r < world; ++r) {
    std::vector<float> x(kDim);
    double ss = 0.0;
    for (size_t b = 0; b < kDim; ++b) {
      x[b] = static_cast<float>(1e-3 * (common[b] + 0.3 * normal(rng)));
      ss += static_cast<double>(x[b]) * x[b];
    }
    g.norms.push_back(std::sqrt(ss));
    g.packed.push_back(PackSketch(x, encoding));
    g.local.push_back(std::move(x));
  }
  return g;
}

// The sketch of the reduced gradient as DDP's all-reduce makes it in float32: each rank's value
// divided by W, then added rank by rank, every operation rounded to float. `weight[r]` scales
// rank r's contribution (1 for a correct reduction).
std::vector<float> Reduce(const Group& g, const std::vector<float>& weight) {
  const float w = static_cast<float>(g.local.size());
  std::vector<float> out(kDim, 0.0f);
  for (size_t r = 0; r < g.local.size(); ++r) {
    for (size_t b = 0; b < kDim; ++b) out[b] += weight[r] * (g.local[r][b] / w);
  }
  return out;
}

double Norm(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

class AggregationIntegrityTest : public ::testing::TestWithParam<SketchEncoding> {};

TEST_P(AggregationIntegrityTest, CleanReductionsAreNeverFlagged) {
  for (uint32_t world : {2u, 3u, 4u, 8u, 16u}) {
    for (uint32_t seed = 0; seed < 50; ++seed) {
      const Group g = MakeGroup(world, GetParam(), seed);
      const std::vector<float> reduced = Reduce(g, std::vector<float>(world, 1.0f));
      const std::vector<IntegrityInput> in = g.Inputs();
      const AggregationVerdict v = CheckAggregation(in, reduced, seed % world, world, 24);
      ASSERT_TRUE(v.checked);
      EXPECT_FALSE(v.flagged) << "world " << world << " seed " << seed << " error " << v.error
                              << " tolerance " << v.tolerance;
      EXPECT_EQ(v.fault, AggregationFault::kNone);
    }
  }
}

TEST_P(AggregationIntegrityTest, DroppedAndDoubledContributionsNameTheRank) {
  for (uint32_t world : {2u, 4u, 8u}) {
    for (uint32_t culprit = 0; culprit < world; ++culprit) {
      const Group g = MakeGroup(world, GetParam(), 100 + culprit);
      const std::vector<IntegrityInput> in = g.Inputs();
      std::vector<float> weight(world, 1.0f);
      weight[culprit] = 0.0f;
      AggregationVerdict v = CheckAggregation(in, Reduce(g, weight), 0, world, 24);
      ASSERT_TRUE(v.flagged);
      EXPECT_EQ(v.fault, AggregationFault::kMissing) << AggregationFaultName(v.fault);
      ASSERT_TRUE(v.suspect_rank.has_value());
      EXPECT_EQ(*v.suspect_rank, culprit);
      EXPECT_NEAR(v.suspect_weight, 0.0, 0.1);
      ASSERT_EQ(v.weights.size(), world);
      for (uint32_t r = 0; r < world; ++r) {
        if (r != culprit) EXPECT_NEAR(v.weights[r], 1.0, 0.1) << "rank " << r;
      }

      weight[culprit] = 2.0f;
      v = CheckAggregation(in, Reduce(g, weight), 0, world, 24);
      ASSERT_TRUE(v.flagged);
      EXPECT_EQ(v.fault, AggregationFault::kDoubled) << AggregationFaultName(v.fault);
      ASSERT_TRUE(v.suspect_rank.has_value());
      EXPECT_EQ(*v.suspect_rank, culprit);
      EXPECT_NEAR(v.suspect_weight, 2.0, 0.1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, AggregationIntegrityTest,
                         ::testing::Values(SketchEncoding::kFloat32, SketchEncoding::kFloat16,
                                           SketchEncoding::kInt8),
                         [](const auto& info) {
                           return std::string(SketchEncodingName(info.param));
                         });

TEST(AggregationIntegrity, SameWrongSumAboveOneInTenThousandIsFlaggedWithoutARank) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const Group g = MakeGroup(4, SketchEncoding::kFloat32, 200 + seed);
    std::vector<float> reduced = Reduce(g, std::vector<float>(4, 1.0f));
    // A perturbation of 1.5e-4 of the reduced sketch's norm, spread over every bin.
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    std::vector<double> p(kDim);
    double pn = 0.0;
    for (double& x : p) {
      x = normal(rng);
      pn += x * x;
    }
    const double scale = 1.5e-4 * Norm(reduced) / std::sqrt(pn);
    for (size_t b = 0; b < kDim; ++b) reduced[b] += static_cast<float>(scale * p[b]);
    const AggregationVerdict v = CheckAggregation(g.Inputs(), reduced, 1, 4, 24);
    ASSERT_TRUE(v.flagged) << "error " << v.error << " tolerance " << v.tolerance;
    EXPECT_NEAR(v.relative_error, 1.5e-4, 0.2e-4);
    EXPECT_EQ(v.fault, AggregationFault::kSum);
    EXPECT_FALSE(v.suspect_rank.has_value());
    EXPECT_GT(v.residual_ratio, 1.0);
  }
}

TEST(AggregationIntegrity, ToleranceGrowsWithTheGradientDtypeAndTheEncoding) {
  const Group f32 = MakeGroup(4, SketchEncoding::kFloat32, 7);
  const Group i8 = MakeGroup(4, SketchEncoding::kInt8, 7);
  const std::vector<float> reduced = Reduce(f32, std::vector<float>(4, 1.0f));
  const double t32 = CheckAggregation(f32.Inputs(), reduced, 0, 4, 24).tolerance;
  const double tbf16 = CheckAggregation(f32.Inputs(), reduced, 0, 4, 8).tolerance;
  const double ti8 = CheckAggregation(i8.Inputs(), reduced, 0, 4, 24).tolerance;
  EXPECT_GT(tbf16, 1000 * t32);
  EXPECT_GT(ti8, 100 * t32);
  // A bfloat16 reduction's own rounding (each operation rounded to 8 bits) stays inside.
  std::vector<float> rounded = reduced;
  for (float& x : rounded) {
    int e;
    const double m = std::frexp(static_cast<double>(x), &e);
    x = static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8));
  }
  EXPECT_FALSE(CheckAggregation(f32.Inputs(), rounded, 0, 4, 8).flagged);
  EXPECT_TRUE(CheckAggregation(f32.Inputs(), rounded, 0, 4, 24).flagged);
}

TEST(AggregationIntegrity, NotCheckedWithoutEveryRankOrWithNonFiniteValues) {
  const Group g = MakeGroup(4, SketchEncoding::kFloat32, 3);
  const std::vector<float> reduced = Reduce(g, std::vector<float>(4, 1.0f));
  std::vector<IntegrityInput> in = g.Inputs();
  EXPECT_TRUE(CheckAggregation(in, reduced, 0, 4, 24).checked);
  EXPECT_FALSE(CheckAggregation(absl::MakeConstSpan(in).subspan(0, 3), reduced, 0, 4, 24).checked);
  std::vector<float> bad = reduced;
  bad[5] = std::nanf("");
  EXPECT_FALSE(CheckAggregation(in, bad, 0, 4, 24).checked);
  std::vector<float> short_sketch(reduced.begin(), reduced.end() - 1);
  EXPECT_FALSE(CheckAggregation(in, short_sketch, 0, 4, 24).checked);
  in[2].grad_norm = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(CheckAggregation(in, reduced, 0, 4, 24).checked);
}

}  // namespace
}  // namespace rankscope::collector
