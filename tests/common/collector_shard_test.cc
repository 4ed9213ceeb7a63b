#include "common/collector_shard.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> Jobs(int n) {
  std::vector<std::string> jobs;
  for (int i = 0; i < n; ++i) jobs.push_back(absl::StrCat("job-", i));
  return jobs;
}

std::vector<std::string> Shards(int n) {
  std::vector<std::string> shards;
  for (int i = 0; i < n; ++i) shards.push_back(absl::StrCat("collector-", i, ":50051"));
  return shards;
}

// The weight is a cross-language contract (the Python in collector_shard.h): these values come
// from that Python, not from the C++ under test.
TEST(RendezvousWeight, MatchesThePythonDefinition) {
  EXPECT_EQ(RendezvousWeight("a:50051", "exp-42"), 0x8a5acdcdd0954219ULL);
  EXPECT_EQ(RendezvousWeight("b:50051", "exp-42"), 0x0bb98775626943f9ULL);
  EXPECT_EQ(RendezvousWeight("c:50051", "exp-42"), 0x1ad4c653acb1254dULL);
  EXPECT_EQ(RendezvousWeight("rankscope-collector-0.rankscope-collector:50051", "llama-70b"),
            0x32c600cf0e8a2a13ULL);
}

TEST(RendezvousWeight, SeparatesAddressFromJob) {
  // Without the 0x00 separator these two pairs would hash the same bytes.
  EXPECT_NE(RendezvousWeight("a:1", "2x"), RendezvousWeight("a:12", "x"));
}

TEST(ParseCollectorList, SplitsTrimsAndDropsDuplicates) {
  auto one = ParseCollectorList("127.0.0.1:50051");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_THAT(*one, ElementsAre("127.0.0.1:50051"));
  auto fleet = ParseCollectorList(" a:50051, b:50051 ,a:50051,c:50051,b:50051");
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  EXPECT_THAT(*fleet, ElementsAre("a:50051", "b:50051", "c:50051"));
  auto v6 = ParseCollectorList("[::1]:50051,[::1]:50052");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_THAT(*v6, ElementsAre("[::1]:50051", "[::1]:50052"));
}

TEST(ParseCollectorList, RefusesEmptyEntriesClearly) {
  for (const char* bad : {"", "  ", "a:1,,b:1", "a:1,", ",a:1", "a:1, ,b:1"}) {
    auto parsed = ParseCollectorList(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  EXPECT_THAT(std::string(ParseCollectorList("a:1,,b:1").status().message()),
              ::testing::HasSubstr("entry 2 of the collector list 'a:1,,b:1' is empty"));
  EXPECT_EQ(ParseCollectorList("a:1,b :1").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PickCollector, OneShardTakesEveryJob) {
  const std::vector<std::string> one = {"127.0.0.1:50051"};
  for (const std::string& job : Jobs(100)) EXPECT_EQ(PickCollector(one, job), one[0]);
}

TEST(PickCollector, IsTheShardOfHighestWeight) {
  const std::vector<std::string> shards = Shards(7);
  for (const std::string& job : Jobs(200)) {
    const std::string& picked = PickCollector(shards, job);
    for (const std::string& s : shards) {
      EXPECT_GE(RendezvousWeight(picked, job), RendezvousWeight(s, job)) << job;
    }
  }
}

TEST(PickCollector, DoesNotDependOnOrderNorDuplicates) {
  std::vector<std::string> shards = Shards(5);
  std::vector<std::string> reversed(shards.rbegin(), shards.rend());
  auto listed_twice =
      ParseCollectorList(absl::StrCat(shards[3], ",", shards[1], ",", shards[3], ",", shards[0],
                                      ",", shards[4], ",", shards[2], ",", shards[1]));
  ASSERT_TRUE(listed_twice.ok());
  for (const std::string& job : Jobs(500)) {
    const std::string& picked = PickCollector(shards, job);
    EXPECT_EQ(PickCollector(reversed, job), picked) << job;
    EXPECT_EQ(PickCollector(*listed_twice, job), picked) << job;
  }
}

TEST(PickCollector, RemovingAShardMovesOnlyItsJobs) {
  const std::vector<std::string> shards = Shards(5);
  for (size_t removed = 0; removed < shards.size(); ++removed) {
    std::vector<std::string> rest = shards;
    rest.erase(rest.begin() + removed);
    int moved = 0;
    std::map<std::string, int> moved_to;
    for (const std::string& job : Jobs(2000)) {
      const std::string& before = PickCollector(shards, job);
      const std::string& after = PickCollector(rest, job);
      if (before == shards[removed]) {
        ++moved;
        ++moved_to[after];
      } else {
        EXPECT_EQ(after, before) << job << " moved although its shard stayed";
      }
    }
    // The removed shard's jobs spread over every remaining shard, not onto one neighbour.
    EXPECT_GT(moved, 0);
    EXPECT_EQ(moved_to.size(), rest.size()) << "removed " << shards[removed];
  }
}

TEST(PickCollector, AddingAShardMovesJobsOnlyOntoIt) {
  const std::vector<std::string> shards = Shards(4);
  std::vector<std::string> grown = shards;
  grown.push_back("collector-new:50051");
  int moved = 0;
  for (const std::string& job : Jobs(2000)) {
    const std::string& after = PickCollector(grown, job);
    if (after != PickCollector(shards, job)) {
      EXPECT_EQ(after, grown.back()) << job;
      ++moved;
    }
  }
  EXPECT_GT(moved, 0);
}

TEST(PickCollector, SpreadsJobsEvenly) {
  // 3000 jobs over 3 shards: each gets its third within 10 % (a binomial's std here is ~26).
  const std::vector<std::string> shards = Shards(3);
  std::map<std::string, int> count;
  for (const std::string& job : Jobs(3000)) ++count[PickCollector(shards, job)];
  ASSERT_EQ(count.size(), 3u);
  for (const auto& [shard, n] : count) {
    EXPECT_GT(n, 900) << shard;
    EXPECT_LT(n, 1100) << shard;
  }
}

}  // namespace
}  // namespace rankscope
