#include "collector/analysis/bucket_scores.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

std::vector<absl::Span<const float>> Spans(const std::vector<std::vector<float>>& rows) {
  return {rows.begin(), rows.end()};
}

// Four ranks, six buckets of slightly different norms (healthy noise, a few percent).
std::vector<std::vector<float>> Healthy() {
  return {{1.00f, 2.00f, 3.00f, 0.50f, 4.0f, 1.5f},
          {1.02f, 1.97f, 3.05f, 0.51f, 4.1f, 1.48f},
          {0.98f, 2.03f, 2.96f, 0.49f, 3.9f, 1.52f},
          {1.01f, 2.01f, 3.02f, 0.50f, 4.05f, 1.49f}};
}

TEST(BucketScoresTest, HealthyRanksNameNoBucket) {
  const auto norms = Healthy();
  const auto z = BucketNormZ(Spans(norms));
  ASSERT_EQ(z.size(), 4u);
  for (const auto& row : z) {
    ASSERT_EQ(row.size(), 6u);
    EXPECT_TRUE(DeviatingBuckets(row).empty());
  }
}

TEST(BucketScoresTest, OneCorruptedLayerNamesItsBucketOnly) {
  auto norms = Healthy();
  norms[2][3] *= 45.0f;  // rank 2's gradient scaled in bucket 3 only
  const auto z = BucketNormZ(Spans(norms));
  const auto dev = DeviatingBuckets(z[2]);
  ASSERT_EQ(dev.size(), 1u);
  EXPECT_EQ(dev[0].bucket, 3u);
  EXPECT_GT(dev[0].z, 100.0f);
  for (int r : {0, 1, 3}) EXPECT_TRUE(DeviatingBuckets(z[r]).empty()) << r;
  const std::vector<std::string> names = {
      "embed", "layers.0-3.attn", "layers.0-3.mlp", "layers.20-23.mlp", "norm", "head"};
  const std::string text = FormatDeviatingBuckets(dev, names);
  EXPECT_EQ(text.rfind("layers.20-23.mlp z=", 0), 0u) << text;
}

TEST(BucketScoresTest, DataFaultNamesManyBucketsMostDeviatingFirst) {
  auto norms = Healthy();
  for (size_t b = 0; b < norms[1].size(); ++b) norms[1][b] *= 3.0f + 0.5f * b;
  const auto z = BucketNormZ(Spans(norms));
  const auto dev = DeviatingBuckets(z[1]);
  ASSERT_EQ(dev.size(), 6u);
  for (size_t i = 1; i < dev.size(); ++i) EXPECT_GE(std::abs(dev[i - 1].z), std::abs(dev[i].z));
}

TEST(BucketScoresTest, NonFiniteNormIsNamedFirstAndOthersStillScored) {
  auto norms = Healthy();
  norms[0][1] = std::numeric_limits<float>::quiet_NaN();
  norms[0][4] *= 50.0f;
  const auto z = BucketNormZ(Spans(norms));
  const auto dev = DeviatingBuckets(z[0]);
  ASSERT_EQ(dev.size(), 2u);
  EXPECT_EQ(dev[0].bucket, 1u);
  EXPECT_TRUE(std::isnan(dev[0].z));
  EXPECT_EQ(dev[1].bucket, 4u);
  EXPECT_EQ(FormatDeviatingBuckets(dev, {}).substr(0, 14), "bucket 1 z=nan");
  for (int r : {1, 2, 3}) EXPECT_TRUE(DeviatingBuckets(z[r]).empty()) << r;
}

TEST(BucketScoresTest, TooFewRanksOrMismatchedLengthsScoreNothing) {
  auto norms = Healthy();
  norms.resize(2);
  EXPECT_TRUE(BucketNormZ(Spans(norms)).empty());
  norms = Healthy();
  norms[3].pop_back();
  EXPECT_TRUE(BucketNormZ(Spans(norms)).empty());
  // A rank without norms (an old agent) is left out; three others still score.
  norms = Healthy();
  norms[3].clear();
  const auto z = BucketNormZ(Spans(norms));
  ASSERT_EQ(z.size(), 4u);
  EXPECT_TRUE(z[3].empty());
  EXPECT_EQ(z[0].size(), 6u);
}

TEST(BucketScoresTest, NamesAtMostTheCap) {
  std::vector<std::vector<float>> norms(5, std::vector<float>(40, 1.0f));
  for (size_t r = 0; r < norms.size(); ++r) {
    for (size_t b = 0; b < 40; ++b) norms[r][b] += 0.01f * static_cast<float>(r);
  }
  for (size_t b = 0; b < 40; ++b) norms[4][b] *= 10.0f + static_cast<float>(b);
  const auto dev = DeviatingBuckets(BucketNormZ(Spans(norms))[4]);
  ASSERT_EQ(dev.size(), kMaxNamedBuckets);
  EXPECT_EQ(dev[0].bucket, 39u);
}

}  // namespace
}  // namespace rankscope::collector
