// Tests of SelectDeviatingRanks: which ranks of a step get per-rank Prometheus series.
#include "collector/metrics/rank_selection.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// `n` unremarkable ranks numbered 0..n-1: cosine 0.9, z-scores 0.
std::vector<RankStatistics> Ranks(uint32_t n) {
  std::vector<RankStatistics> ranks(n);
  for (uint32_t i = 0; i < n; ++i) ranks[i] = {i, 0.9, 0.0, 0.0};
  return ranks;
}

// Extras for `n` ranks with every score measured and unremarkable.
std::vector<RankExtras> Extras(uint32_t n) {
  std::vector<RankExtras> extras(n);
  for (RankExtras& e : extras) {
    e.outlier_score = e.held_outlier_score = 1.0;
    e.step_time_seconds = 0.1;
    e.step_time_z = 0.0;
  }
  return extras;
}

TEST(SelectDeviatingRanksTest, NothingToSelect) {
  EXPECT_THAT(SelectDeviatingRanks({}, {}, 8), IsEmpty());
  EXPECT_THAT(SelectDeviatingRanks(Ranks(4), {}, 0), IsEmpty());
}

TEST(SelectDeviatingRanksTest, AllFitWithoutExtrasOrdersByCosineNanFirstTiesByRank) {
  std::vector<RankStatistics> ranks = Ranks(4);
  ranks[1].consensus_cosine = 0.5;
  ranks[2].consensus_cosine = kNaN;
  ranks[3].consensus_cosine = 0.5;
  // Indices: NaN first, then the two 0.5 cosines by rank number, then the rest.
  EXPECT_THAT(SelectDeviatingRanks(ranks, {}, 4), ElementsAre(2, 1, 3, 0));
  EXPECT_THAT(SelectDeviatingRanks(ranks, {}, 100), ElementsAre(2, 1, 3, 0));
}

TEST(SelectDeviatingRanksTest, AllFitWithExtrasOrdersByHeldOutlierScoreNanLast) {
  const std::vector<RankStatistics> ranks = Ranks(3);
  std::vector<RankExtras> extras = Extras(3);
  extras[0].held_outlier_score = kNaN;
  extras[1].held_outlier_score = 2.0;
  extras[2].held_outlier_score = 7.0;
  EXPECT_THAT(SelectDeviatingRanks(ranks, extras, 3), ElementsAre(2, 1, 0));
}

TEST(SelectDeviatingRanksTest, WorstRankOfEveryRankingIsKeptInPriorityOrder) {
  // 16 ranks, 7 kept: each ranking's worst is a different rank.
  std::vector<RankStatistics> ranks = Ranks(16);
  std::vector<RankExtras> extras = Extras(16);
  extras[9].held_outlier_score = 8.0;
  ranks[4].consensus_cosine = -0.2;
  ranks[11].loss_z = -5.0;  // |z| counts
  ranks[2].grad_norm_z = 4.0;
  extras[14].step_time_z = 6.0;
  extras[6].drift_score = 3.0;
  extras[13].slow_score = 2.5;
  EXPECT_THAT(SelectDeviatingRanks(ranks, extras, 7), ElementsAre(9, 4, 11, 2, 14, 6, 13));
}

TEST(SelectDeviatingRanksTest, ARankWorstEverywhereIsTakenOnceAndTheNextDepthFills) {
  std::vector<RankStatistics> ranks = Ranks(8);
  ranks[5] = {5, kNaN, kNaN, kNaN};  // non-finite: the most deviating cosine and z-scores
  ranks[3].consensus_cosine = 0.1;
  ranks[6].loss_z = 2.0;
  // Without extras: depth 0 gives 5 (all three rankings); depth 1 gives 3, then 6, then the
  // grad-norm ranking's second, rank 0 (the lowest number among the ties).
  const std::vector<uint32_t> chosen = SelectDeviatingRanks(ranks, {}, 4);
  EXPECT_THAT(chosen, ElementsAre(5, 3, 6, 0));
}

TEST(SelectDeviatingRanksTest, ExtrasOfAnotherSizeAreIgnored) {
  std::vector<RankStatistics> ranks = Ranks(6);
  ranks[1].consensus_cosine = 0.0;
  std::vector<RankExtras> extras = Extras(5);
  extras[4].held_outlier_score = 100.0;
  extras[4].slow_score = 100.0;
  // The cosine ranking leads; nothing from `extras` takes part.
  EXPECT_THAT(SelectDeviatingRanks(ranks, extras, 2), ElementsAre(1, 0));
  EXPECT_THAT(SelectDeviatingRanks(ranks, extras, 6), ElementsAre(1, 0, 2, 3, 4, 5));
}

TEST(SelectDeviatingRanksTest, UnmeasuredScoresNeverOutrankMeasuredOnes) {
  std::vector<RankStatistics> ranks = Ranks(4);
  std::vector<RankExtras> extras = Extras(4);
  for (RankExtras& e : extras) e.step_time_z = kNaN;  // step time not reported
  extras[3].step_time_z = -1.0;                       // measured, and fast
  extras[2].held_outlier_score = 9.0;
  // Limit 2: the outlier ranking gives 2; the cosine ranking's first is 0 (all tie).
  EXPECT_THAT(SelectDeviatingRanks(ranks, extras, 2), UnorderedElementsAre(2, 0));
  // Limit 3: depth 0 of the rankings gives 2, 0, (0), (0), then the step-time ranking's first
  // is rank 3, the only measured one.
  EXPECT_THAT(SelectDeviatingRanks(ranks, extras, 3), ElementsAre(2, 0, 3));
}

}  // namespace
}  // namespace rankscope::collector
