#include "collector/analysis/rank_diagnostics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "collector/analysis/outlier_scale.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(CheckReplicasTest, AgreementNamesNobody) {
  std::vector<RankFingerprint> f = {{0, 7}, {1, 7}, {2, 7}, {3, 7}};
  ReplicaVerdict v = CheckReplicas(f);
  EXPECT_TRUE(v.checked);
  EXPECT_FALSE(v.ambiguous);
  EXPECT_EQ(v.majority, 7u);
  EXPECT_THAT(v.divergent_ranks, IsEmpty());
}

TEST(CheckReplicasTest, OneDivergentRankIsNamed) {
  std::vector<RankFingerprint> f = {{0, 7}, {1, 7}, {2, 8}, {3, 7}};
  ReplicaVerdict v = CheckReplicas(f);
  EXPECT_EQ(v.majority, 7u);
  EXPECT_THAT(v.divergent_ranks, ElementsAre(2));
}

TEST(CheckReplicasTest, NoStrictMajorityNamesEveryRank) {
  std::vector<RankFingerprint> two = {{0, 1}, {1, 2}};
  ReplicaVerdict v = CheckReplicas(two);
  EXPECT_TRUE(v.ambiguous);
  EXPECT_FALSE(v.majority.has_value());
  EXPECT_THAT(v.divergent_ranks, ElementsAre(0, 1));
  std::vector<RankFingerprint> split = {{3, 1}, {0, 2}, {2, 1}, {1, 2}};
  EXPECT_THAT(CheckReplicas(split).divergent_ranks, ElementsAre(0, 1, 2, 3));
}

TEST(CheckReplicasTest, NothingReportedIsNotChecked) {
  EXPECT_FALSE(CheckReplicas({}).checked);
  std::vector<RankFingerprint> one = {{5, 9}};
  ReplicaVerdict v = CheckReplicas(one);
  EXPECT_TRUE(v.checked);
  EXPECT_THAT(v.divergent_ranks, IsEmpty());
}

std::vector<RankSignals> Healthy(int world, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<RankSignals> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(
        {static_cast<uint32_t>(r), 2.0 + 0.01 * n(rng), 1.0 + 0.02 * n(rng), 0.9 + 0.01 * n(rng)});
  }
  return ranks;
}

// The false-positive rates documented in rank_diagnostics.h, with margin for sampling.
TEST(OutlierScoreTest, HealthyRanksAreRarelyFlagged) {
  struct Case {
    int world;
    double max_rate;
  };
  for (const Case c : {Case{16, 3e-3}, Case{64, 2e-4}, Case{256, 1e-4}}) {
    int flagged = 0, total = 0;
    for (uint64_t seed = 1; total < 100000; ++seed) {
      for (const OutlierScore& s : ComputeOutlierScores(Healthy(c.world, seed))) {
        flagged += s.flagged;
        ++total;
      }
    }
    EXPECT_LE(static_cast<double>(flagged) / total, c.max_rate) << "W=" << c.world;
  }
}

// The scale floor (rank_diagnostics.h, outlier_scale.h) on i.i.d. Gaussian ranks at W = 4, the
// world size where a step's MAD is the noisiest: the fraction of rank-steps above 6 and of ranks
// above 6 on 3 steps in a row (the persistence rule), with and without the floor.
TEST(OutlierScoreTest, ScaleFloorCutsTheTailAtW4) {
  constexpr int kSteps = 50000;  // 200,000 rank-steps
  int flagged[2] = {0, 0}, persistent[2] = {0, 0};
  for (int floored = 0; floored < 2; ++floored) {
    OutlierScaleWindow window;
    std::vector<int> streak(4, 0);
    for (int step = 0; step < kSteps; ++step) {
      SignalScales own;
      const std::vector<OutlierScore> scores = ComputeOutlierScores(
          Healthy(4, 1000 + step), floored ? window.Floor() : SignalScales{}, &own);
      window.Push(own);
      for (const OutlierScore& s : scores) {
        flagged[floored] += s.flagged;
        streak[s.rank] = s.flagged ? streak[s.rank] + 1 : 0;
        persistent[floored] += streak[s.rank] == kOutlierPersistence;
      }
    }
  }
  const double rank_steps = 4.0 * kSteps;
  std::printf("W=4, above 6: %.2e without the floor, %.2e with; 3 in a row: %.2e, %.2e\n",
              flagged[0] / rank_steps, flagged[1] / rank_steps, persistent[0] / rank_steps,
              persistent[1] / rank_steps);
  // Measured: 4.1e-2 -> 7e-4 above 6; 3 in a row 4.5e-5 (the persistence rule was documented at
  // ~6e-5) -> none.
  EXPECT_GT(flagged[0], 10 * flagged[1]);
  EXPECT_GE(persistent[0], 5);
  EXPECT_GE(persistent[0], 5 * persistent[1]);
}

TEST(OutlierScoreTest, ScaleFloorOnlyLowersScoresAndOwnScalesAreReported) {
  std::vector<RankSignals> ranks = Healthy(4, 7);
  SignalScales own;
  const std::vector<OutlierScore> bare = ComputeOutlierScores(ranks, {}, &own);
  EXPECT_GT(own.loss, 0.0);
  EXPECT_GT(own.grad_norm, 0.0);
  EXPECT_GT(own.cosine, 0.0);
  // A floor below the step's own scales changes nothing; one above scales every z down.
  const SignalScales low{own.loss / 2, own.grad_norm / 2, own.cosine / 2};
  const SignalScales high{own.loss * 4, own.grad_norm * 4, own.cosine * 4};
  const std::vector<OutlierScore> same = ComputeOutlierScores(ranks, low);
  const std::vector<OutlierScore> lower = ComputeOutlierScores(ranks, high);
  for (size_t i = 0; i < ranks.size(); ++i) {
    EXPECT_DOUBLE_EQ(same[i].score, bare[i].score);
    EXPECT_NEAR(lower[i].score, bare[i].score / 4, 1e-12);
  }
}

TEST(OutlierScaleWindowTest, MedianOfTheLastStepsOnceEnoughAreIn) {
  OutlierScaleWindow w;
  for (int i = 1; i < static_cast<int>(kOutlierScaleMinSteps); ++i) {
    w.Push({1.0 * i, 1.0, kNaN});
    EXPECT_TRUE(std::isnan(w.Floor().loss)) << i;
  }
  w.Push({4.0, 1.0, kNaN});
  EXPECT_DOUBLE_EQ(w.Floor().loss, 2.5);  // median of 1, 2, 3, 4
  EXPECT_DOUBLE_EQ(w.Floor().grad_norm, 1.0);
  EXPECT_TRUE(std::isnan(w.Floor().cosine));  // never known: no floor
  // The oldest steps leave once the window is full.
  for (size_t i = 0; i < kOutlierScaleWindowSteps; ++i) w.Push({100.0, 1.0, 0.5});
  EXPECT_EQ(w.steps(), kOutlierScaleWindowSteps);
  EXPECT_DOUBLE_EQ(w.Floor().loss, 100.0);
  EXPECT_DOUBLE_EQ(w.Floor().cosine, 0.5);
}

TEST(OutlierScoreTest, EachKindOfDeviationIsFlaggedAndScoresHighest) {
  for (int kind = 0; kind < 3; ++kind) {
    std::vector<RankSignals> ranks = Healthy(16, 11);
    if (kind == 0) ranks[5].loss += 0.5;
    if (kind == 1) ranks[5].grad_norm *= 3.0;
    if (kind == 2) ranks[5].consensus_cosine = 0.0;
    std::vector<OutlierScore> scores = ComputeOutlierScores(ranks);
    for (const OutlierScore& s : scores) EXPECT_EQ(s.flagged, s.rank == 5) << "kind " << kind;
    auto worst = std::max_element(scores.begin(), scores.end(),
                                  [](auto& a, auto& b) { return a.score < b.score; });
    EXPECT_EQ(worst->rank, 5u);
  }
}

TEST(OutlierScoreTest, AHigherCosineIsNotSuspicious) {
  std::vector<RankSignals> ranks = Healthy(16, 3);
  ranks[2].consensus_cosine = 1.0;
  EXPECT_FALSE(ComputeOutlierScores(ranks)[2].flagged);
}

TEST(OutlierScoreTest, NonFiniteRankIsFlaggedOthersStillScored) {
  std::vector<RankSignals> ranks = Healthy(8, 4);
  ranks[3].loss = kNaN;
  ranks[6].grad_norm = std::numeric_limits<double>::infinity();
  std::vector<OutlierScore> scores = ComputeOutlierScores(ranks);
  for (const OutlierScore& s : scores) {
    if (s.rank == 3 || s.rank == 6) {
      EXPECT_TRUE(s.flagged);
      EXPECT_TRUE(std::isnan(s.score));
    } else {
      EXPECT_TRUE(std::isfinite(s.score));
      EXPECT_FALSE(s.flagged);
    }
  }
}

// A pipeline stage before the last has no loss: its NaN loss neither scores nor flags, while
// the gradient still names a deviating rank.
TEST(OutlierScoreTest, AbsentLossesAreIgnoredNotFlagged) {
  std::vector<RankSignals> ranks = Healthy(8, 4);
  for (RankSignals& r : ranks) {
    r.loss = kNaN;
    r.loss_absent = true;
  }
  for (const OutlierScore& s : ComputeOutlierScores(ranks)) {
    EXPECT_TRUE(std::isfinite(s.score)) << s.rank;
    EXPECT_FALSE(s.flagged) << s.rank;
    EXPECT_EQ(s.loss_robust_z, 0.0);
  }
  ranks[5].grad_norm *= 40;
  const std::vector<OutlierScore> scores = ComputeOutlierScores(ranks);
  EXPECT_TRUE(scores[5].flagged);
  EXPECT_FALSE(scores[4].flagged);
  // One rank without a loss beside ranks with one: the others' loss statistics are theirs.
  ranks = Healthy(8, 4);
  ranks[2].loss = kNaN;
  ranks[2].loss_absent = true;
  for (const OutlierScore& s : ComputeOutlierScores(ranks)) EXPECT_FALSE(s.flagged) << s.rank;
}

// Three of six ranks on the same data: counted as many, their identical values would make the
// median and a MAD near 0 theirs, and the ranks with their own data would be named outliers. A
// duplicate group counts once (its other members are echoes) while 3 independent ranks remain.
TEST(OutlierScoreTest, ADuplicateGroupCountsOnce) {
  std::vector<RankSignals> ranks = {{0, 2.31, 1.10, 0.40}, {1, 2.05, 1.45, 0.95},
                                    {2, 2.05, 1.45, 0.95}, {3, 2.05, 1.45, 0.95},
                                    {4, 2.12, 1.30, 0.60}, {5, 2.05, 1.45, 0.95}};
  EXPECT_TRUE(ComputeOutlierScores(ranks)[0].flagged);  // without knowing the duplicates
  ranks[2].echo = true;
  ranks[3].echo = true;
  ranks[5].echo = true;
  for (const OutlierScore& s : ComputeOutlierScores(ranks)) EXPECT_FALSE(s.flagged) << s.rank;
  // Every rank but one on the same data: too few independent ranks to leave echoes out.
  std::vector<RankSignals> same(4, RankSignals{0, 2.0, 1.0, 1.0});
  for (uint32_t r = 0; r < 4; ++r) same[r].rank = r;
  same[0].loss = 2.0001;
  same[2].echo = same[3].echo = true;
  const std::vector<OutlierScore> scores = ComputeOutlierScores(same);
  EXPECT_EQ(scores[1].flagged, ComputeOutlierScores(std::vector<RankSignals>(
                                   {same[0], same[1], {2, 2.0, 1.0, 1.0}, {3, 2.0, 1.0, 1.0}}))[1]
                                   .flagged);
}

TEST(OutlierScoreTest, IdenticalRanksDoNotExplode) {
  std::vector<RankSignals> ranks(8, RankSignals{0, 2.0, 1.0, 1.0});
  for (uint32_t r = 0; r < 8; ++r) ranks[r].rank = r;
  for (const OutlierScore& s : ComputeOutlierScores(ranks)) {
    EXPECT_EQ(s.score, 0.0);
    EXPECT_FALSE(s.flagged);
  }
  // A one-ulp difference on one rank is not an outlier in the statistical sense.
  ranks[1].loss = std::nextafter(2.0, 3.0);
  EXPECT_FALSE(ComputeOutlierScores(ranks)[1].flagged);
}

TEST(GradientNoiseScaleTest, ExactExpectationsGiveTheTrueValue) {
  // |G|^2 = 4, tr S = 100, b = 8, W = 4: E||g_r||^2 = 4 + 100/8, E||mean||^2 = 4 + 100/32.
  std::vector<double> local(4, std::sqrt(4.0 + 100.0 / 8));
  EXPECT_NEAR(GradientNoiseScale(local, std::sqrt(4.0 + 100.0 / 32), 8), 25.0, 1e-9);
}

TEST(GradientNoiseScaleTest, MonteCarloAverageIsUnbiased) {
  // Per-sample gradients G + noise (sigma^2 I in D dims); rank gradient = mean over b samples.
  constexpr int kD = 64, kW = 8, kB = 4, kTrials = 4000;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> g(kD, 0.25);  // |G|^2 = 4
  const double sigma = 1.0;         // tr S = 64
  double sum_small = 0, sum_big = 0;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<double> mean(kD, 0.0);
    for (int r = 0; r < kW; ++r) {
      double sq = 0;
      for (int d = 0; d < kD; ++d) {
        double x = g[d];
        for (int s = 0; s < kB; ++s) x += sigma * n(rng) / kB;
        sq += x * x;
        mean[d] += x / kW;
      }
      sum_small += sq / kW;
    }
    double sq = 0;
    for (double x : mean) sq += x * x;
    sum_big += sq;
  }
  // Estimates averaged over trials, then divided (as a dashboard would do over steps).
  std::vector<double> local(kW, std::sqrt(sum_small / kTrials));
  EXPECT_NEAR(GradientNoiseScale(local, std::sqrt(sum_big / kTrials), kB), 64.0 / 4.0, 0.8);
}

TEST(GradientNoiseScaleTest, UndefinedCasesAreNaN) {
  EXPECT_TRUE(std::isnan(GradientNoiseScale({1.0}, 1.0, 8)));
  EXPECT_TRUE(std::isnan(GradientNoiseScale({1.0, 1.0}, kNaN, 8)));
  EXPECT_TRUE(std::isnan(GradientNoiseScale({1.0, kNaN}, 1.0, 8)));
  // Pure noise: the mean gradient is tiny, the |G|^2 estimate is negative.
  EXPECT_TRUE(std::isnan(GradientNoiseScale({1.0, 1.0, 1.0, 1.0}, 0.1, 1)));
}

TEST(StepTimeRobustZTest, StragglerStandsOut) {
  std::vector<double> times = {0.100, 0.101, 0.099, 0.102, 0.100, 0.350, 0.098, 0.101};
  std::vector<double> z = StepTimeRobustZ(times);
  for (size_t i = 0; i < z.size(); ++i) {
    if (i == 5) {
      EXPECT_GT(z[i], 50.0);
    } else {
      EXPECT_LT(std::abs(z[i]), 3.5);
    }
  }
}

}  // namespace
}  // namespace rankscope::collector
