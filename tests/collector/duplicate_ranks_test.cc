#include "collector/analysis/duplicate_ranks.h"

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<float> Gaussian(std::mt19937_64& rng, size_t k) {
  std::normal_distribution<float> normal;
  std::vector<float> v(k);
  for (float& x : v) x = normal(rng);
  return v;
}

double Cos(const std::vector<float>& a, const std::vector<float>& b) {
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += double{a[i]} * b[i];
    na += double{a[i]} * a[i];
    nb += double{b[i]} * b[i];
  }
  return dot / std::sqrt(na * nb);
}

// A vector whose cosine with `base` is about `cosine` (base plus independent noise).
std::vector<float> Near(std::mt19937_64& rng, const std::vector<float>& base, double cosine) {
  const std::vector<float> noise = Gaussian(rng, base.size());
  const double scale = std::sqrt(1.0 / (cosine * cosine) - 1.0);
  std::vector<float> v(base.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = base[i] + static_cast<float>(scale * noise[i]);
  return v;
}

std::vector<RankSample> Samples(const std::vector<std::vector<float>>& sketches) {
  std::vector<RankSample> samples;
  for (size_t r = 0; r < sketches.size(); ++r) {
    samples.push_back({static_cast<uint32_t>(r), 1.0, 1.0, sketches[r]});
  }
  return samples;
}

TEST(DuplicateRanksTest, EveryRankOnTheSameDataIsOneExactGroup) {
  std::mt19937_64 rng(1);
  const std::vector<float> g = Gaussian(rng, 1024);
  const auto groups = FindDuplicateRanks(Samples({g, g, g, g}));
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_THAT(groups[0].ranks, ElementsAre(0, 1, 2, 3));
  EXPECT_TRUE(groups[0].exact);
  EXPECT_EQ(groups[0].min_cosine, 1.0);
  EXPECT_EQ(FormatDuplicateGroups(groups), "0,1,2,3");
  EXPECT_EQ(CountDuplicateRanks(groups), 4u);
}

TEST(DuplicateRanksTest, TwoOfEightDuplicated) {
  std::mt19937_64 rng(2);
  std::vector<std::vector<float>> sketches;
  for (int r = 0; r < 8; ++r) sketches.push_back(Gaussian(rng, 1024));
  sketches[5] = sketches[2];
  const auto groups = FindDuplicateRanks(Samples(sketches));
  EXPECT_EQ(FormatDuplicateGroups(groups), "2,5");
}

TEST(DuplicateRanksTest, TwoPairsAreTwoGroupsInRankOrder) {
  std::mt19937_64 rng(3);
  const std::vector<float> a = Gaussian(rng, 1024), b = Gaussian(rng, 1024);
  EXPECT_EQ(FormatDuplicateGroups(FindDuplicateRanks(Samples({a, b, a, b}))), "0,2;1,3");
}

TEST(DuplicateRanksTest, NearDuplicatesAreGroupedAndNotExact) {
  std::mt19937_64 rng(4);
  const std::vector<float> base = Gaussian(rng, 1024);
  const std::vector<float> other = Gaussian(rng, 1024);
  const std::vector<float> near = Near(rng, base, 0.9999);
  ASSERT_GT(Cos(base, near), 0.999);
  const auto groups = FindDuplicateRanks(Samples({other, base, Gaussian(rng, 1024), near}));
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_THAT(groups[0].ranks, ElementsAre(1, 3));
  EXPECT_FALSE(groups[0].exact);
  EXPECT_GE(groups[0].min_cosine, 0.999);
  EXPECT_LT(groups[0].min_cosine, 1.0);
}

// Augmented views of the same images, or a small model early in training: cosines run high
// but not to 0.999. Nothing is a duplicate, also for W = 2.
TEST(DuplicateRanksTest, HighButNotDuplicateCosinesAreNotGrouped) {
  std::mt19937_64 rng(5);
  const std::vector<float> base = Gaussian(rng, 1024);
  for (double cosine : {0.9, 0.98, 0.99}) {
    std::vector<std::vector<float>> sketches = {base};
    for (int r = 1; r < 8; ++r) sketches.push_back(Near(rng, base, cosine));
    EXPECT_THAT(FindDuplicateRanks(Samples(sketches)), IsEmpty()) << cosine;
    EXPECT_THAT(FindDuplicateRanks(Samples({sketches[0], sketches[1]})), IsEmpty()) << cosine;
  }
}

TEST(DuplicateRanksTest, TwoRanksIdentical) {
  std::mt19937_64 rng(6);
  const std::vector<float> g = Gaussian(rng, 1024);
  EXPECT_EQ(FormatDuplicateGroups(FindDuplicateRanks(Samples({g, g}))), "0,1");
}

TEST(DuplicateRanksTest, ZeroAndNonFiniteSketchesAreNeverGrouped) {
  std::mt19937_64 rng(7);
  const std::vector<float> zero(1024, 0.0f);
  std::vector<float> nan = Gaussian(rng, 1024);
  nan[17] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> inf = nan;
  inf[17] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(FindDuplicateRanks(Samples({zero, zero, nan, nan, inf, inf})), IsEmpty());
  EXPECT_THAT(FindDuplicateRanks(Samples({{}, {}})), IsEmpty());
}

TEST(DuplicateRanksTest, ResultDoesNotDependOnInputOrder) {
  std::mt19937_64 rng(8);
  const std::vector<float> a = Gaussian(rng, 1024);
  const std::vector<float> b = Near(rng, a, 0.99995);
  std::vector<RankSample> samples;
  std::vector<std::vector<float>> keep;
  for (int r = 0; r < 16; ++r)
    keep.push_back(r % 5 == 0 ? a : (r % 7 == 0 ? b : Gaussian(rng, 1024)));
  for (int r = 0; r < 16; ++r) samples.push_back({static_cast<uint32_t>(r), 0, 0, keep[r]});
  const std::string forward = FormatDuplicateGroups(FindDuplicateRanks(samples));
  std::reverse(samples.begin(), samples.end());
  EXPECT_EQ(FormatDuplicateGroups(FindDuplicateRanks(samples)), forward);
  EXPECT_EQ(forward, "0,5,7,10,14,15");  // a at 0, 5, 10, 15; b (near a) at 7, 14
}

TEST(DuplicateRanksTest, ShortSketchesStillWork) {
  std::mt19937_64 rng(9);
  const std::vector<float> a = Gaussian(rng, 16), b = Gaussian(rng, 16);
  EXPECT_EQ(FormatDuplicateGroups(FindDuplicateRanks(Samples({a, b, a}))), "0,2");
}

// Against the brute-force answer (every pair's cosine) on many random layouts whose pairs are
// either clear duplicates (cosine >= 0.9995) or clearly not (<= 0.99). The LSH may in principle
// miss a pair (probability about 3e-4 per pair at cosine 0.999, far less at 0.9995); with a fixed
// seed the outcome is deterministic, and a miss rate above 1 % of duplicate pairs fails.
TEST(DuplicateRanksTest, MatchesBruteForceOnRandomLayouts) {
  std::mt19937_64 rng(10);
  int duplicate_ranks = 0, missed = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int w = 2 + static_cast<int>(rng() % 15);
    std::vector<std::vector<float>> sketches;
    for (int r = 0; r < w; ++r) {
      const uint64_t u = rng() % 4;
      if (r > 0 && u == 0) {
        sketches.push_back(Near(rng, sketches[rng() % r], 0.99995));  // near duplicate
      } else if (r > 0 && u == 1) {
        sketches.push_back(Near(rng, sketches[rng() % r], 0.95));  // correlated, not duplicate
      } else {
        sketches.push_back(Gaussian(rng, 1024));
      }
    }
    // Brute force: components of pairs with cosine >= 0.999.
    std::vector<int> component(w);
    for (int r = 0; r < w; ++r) component[r] = r;
    auto find = [&](int x) {
      while (component[x] != x) x = component[x];
      return x;
    };
    for (int a = 0; a < w; ++a) {
      for (int b = a + 1; b < w; ++b) {
        if (Cos(sketches[a], sketches[b]) >= 0.999) component[find(b)] = find(a);
      }
    }
    std::set<int> expected_in_group;
    for (int r = 0; r < w; ++r) {
      for (int s = 0; s < w; ++s) {
        if (r != s && find(r) == find(s)) expected_in_group.insert(r);
      }
    }
    std::set<int> found;
    for (const DuplicateGroup& g : FindDuplicateRanks(Samples(sketches))) {
      for (uint32_t r : g.ranks) found.insert(static_cast<int>(r));
      for (uint32_t r : g.ranks) EXPECT_EQ(find(r), find(g.ranks[0])) << "trial " << trial;
    }
    for (int r : found) EXPECT_TRUE(expected_in_group.count(r)) << "false rank " << r;
    duplicate_ranks += static_cast<int>(expected_in_group.size());
    for (int r : expected_in_group) missed += found.count(r) ? 0 : 1;
  }
  ASSERT_GT(duplicate_ranks, 100);
  EXPECT_LE(missed * 100, duplicate_ranks) << missed << " of " << duplicate_ranks;
}

}  // namespace
}  // namespace rankscope::collector
