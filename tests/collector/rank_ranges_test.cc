// collector/model/rank_ranges.h: the compact text of a set of ranks (issue 12.3).
#include "collector/model/rank_ranges.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;

std::vector<uint32_t> Iota(uint32_t first, uint32_t last) {
  std::vector<uint32_t> out;
  for (uint64_t r = first; r <= last; ++r) out.push_back(static_cast<uint32_t>(r));
  return out;
}

TEST(RankRangesTest, RunsAndSingles) {
  EXPECT_EQ(FormatRankRanges({}), "");
  EXPECT_EQ(FormatRankRanges({3}), "3");
  EXPECT_EQ(FormatRankRanges({3, 7}), "3,7");
  EXPECT_EQ(FormatRankRanges({0, 1, 2, 3, 4, 5, 9}), "0-5,9");
  EXPECT_EQ(FormatRankRanges({1, 1, 2, 4, 4}), "1-2,4");  // duplicates written once
}

TEST(RankRangesTest, AMillionMissingRanksIsAFewBytes) {
  std::vector<uint32_t> missing = Iota(0, 4);
  const std::vector<uint32_t> rest = Iota(6, 999'999);
  missing.insert(missing.end(), rest.begin(), rest.end());
  const std::string text = FormatRankRanges(missing);
  EXPECT_EQ(text, "0-4,6-999999");
  RankRanges parsed;
  ASSERT_TRUE(ParseRankRanges(text, &parsed));
  EXPECT_EQ(parsed.count(), 999'999u);
  EXPECT_THAT(ListedRanks(parsed, 7), ElementsAre(0, 1, 2, 3, 4, 6, 7));
}

TEST(RankRangesTest, RunsBeyondTheCapAreCounted) {
  std::vector<uint32_t> every_other;
  for (uint32_t r = 0; r < 1'000'000; r += 2) every_other.push_back(r);  // 500,000 runs
  const std::string text = FormatRankRanges(every_other);
  EXPECT_LE(text.size(), kMaxMissingRankRuns * 24);
  EXPECT_TRUE(text.rfind(",+499936") == text.size() - 8) << text;
  RankRanges parsed;
  ASSERT_TRUE(ParseRankRanges(text, &parsed));
  EXPECT_EQ(parsed.runs.size(), kMaxMissingRankRuns);
  EXPECT_EQ(parsed.more, 500'000u - kMaxMissingRankRuns);
  EXPECT_EQ(parsed.count(), 500'000u);
  EXPECT_EQ(FormatRankRanges({1, 3, 5}, 0), "+3");
}

TEST(RankRangesTest, ParsesOldListsAndRefusesGarbage) {
  RankRanges parsed;
  ASSERT_TRUE(ParseRankRanges("3,7", &parsed));
  EXPECT_EQ(parsed.count(), 2u);
  ASSERT_TRUE(ParseRankRanges("", &parsed));
  EXPECT_EQ(parsed.count(), 0u);
  for (const char* bad : {"x", "3-", "-3", "5-3", "+2,4", "1--2", "4294967296"}) {
    EXPECT_FALSE(ParseRankRanges(bad, &parsed)) << bad;
  }
}

}  // namespace
}  // namespace rankscope::collector
