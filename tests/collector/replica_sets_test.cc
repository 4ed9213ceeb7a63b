#include "collector/analysis/replica_sets.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/replica_tolerance.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// HSDP on a 2 x 2 mesh (replicate x shard): rank r holds shard r % 2, so the replica sets are
// {0, 2} (shard 0) and {1, 3} (shard 1), and the two shards' values differ by design.
std::vector<RankReplica> Hsdp(uint64_t shard0, uint64_t shard1) {
  return {{0, shard0, 0, {}}, {1, shard1, 1, {}}, {2, shard0, 0, {}}, {3, shard1, 1, {}}};
}

// The same fingerprints without their sets (what CheckReplicas compares all against all).
std::vector<RankFingerprint> Plain(const std::vector<RankReplica>& ranks) {
  std::vector<RankFingerprint> out;
  for (const RankReplica& r : ranks) out.push_back({r.rank, r.fingerprint});
  return out;
}

TEST(CheckReplicaSets, ShardsThatDifferByDesignAreNotDivergent) {
  const ReplicaSetsVerdict v = CheckReplicaSets(Hsdp(0xA, 0xB));
  EXPECT_TRUE(v.verdict.checked);
  EXPECT_FALSE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, IsEmpty());
  EXPECT_FALSE(v.verdict.majority.has_value());  // two sets: no one value is the group's
  EXPECT_EQ(v.sets, 2u);
  EXPECT_FALSE(v.tolerance);
  // The same fingerprints compared all against all (no sets: today's check) name every rank.
  EXPECT_THAT(CheckReplicas(Plain(Hsdp(0xA, 0xB))).divergent_ranks, ElementsAre(0, 1, 2, 3));
}

TEST(CheckReplicaSets, TwoReplicasThatDisagreeNameBothRanksOfTheirSetOnly) {
  std::vector<RankReplica> f = Hsdp(0xA, 0xB);
  f[3].fingerprint = 0xC;  // rank 3's shard 1 differs from rank 1's: no majority in {1, 3}
  const ReplicaSetsVerdict v = CheckReplicaSets(f);
  EXPECT_TRUE(v.verdict.checked);
  EXPECT_TRUE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(1, 3));
}

TEST(CheckReplicaSets, AMajorityWithinASetNamesTheOddRankOut) {
  // Replicate 3 x shard 2: sets {0, 2, 4} and {1, 3, 5}.
  std::vector<RankReplica> f = {{0, 0xA, 0, {}}, {1, 0xB, 1, {}}, {2, 0xA, 0, {}},
                                {3, 0xB, 1, {}}, {4, 0xD, 0, {}}, {5, 0xB, 1, {}}};
  const ReplicaSetsVerdict v = CheckReplicaSets(f);
  EXPECT_FALSE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(4));
  // Both sets diverge: the union.
  f[1].fingerprint = 0xE;
  EXPECT_THAT(CheckReplicaSets(f).verdict.divergent_ranks, ElementsAre(1, 4));
}

TEST(CheckReplicaSets, ASetOfOneRankHasNothingToCompare) {
  // Shard 1's other replica did not report this step: rank 1 alone is not a divergence.
  const std::vector<RankReplica> f = {{0, 0xA, 0, {}}, {1, 0xB, 1, {}}, {2, 0xA, 0, {}}};
  const ReplicaSetsVerdict v = CheckReplicaSets(f);
  EXPECT_TRUE(v.verdict.checked);
  EXPECT_FALSE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, IsEmpty());
  // Every set of one rank (one replica): checked, nothing named.
  const std::vector<RankReplica> alone = {{0, 0xA, 0, {}}, {1, 0xB, 1, {}}};
  EXPECT_THAT(CheckReplicaSets(alone).verdict.divergent_ranks, IsEmpty());
}

TEST(CheckReplicaSets, NoSetIsTheWholeGroupAsBefore) {
  // Agents that send no replica_set (DDP, older agents): one set, CheckReplicas' verdict.
  const std::vector<RankReplica> f = {
      {0, 0xA, std::nullopt, {}}, {1, 0xA, std::nullopt, {}}, {2, 0xB, std::nullopt, {}}};
  const ReplicaSetsVerdict v = CheckReplicaSets(f);
  const ReplicaVerdict whole = CheckReplicas(Plain(f));
  EXPECT_EQ(v.sets, 1u);
  EXPECT_EQ(v.verdict.checked, whole.checked);
  EXPECT_EQ(v.verdict.ambiguous, whole.ambiguous);
  EXPECT_EQ(v.verdict.majority, whole.majority);
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(2));
  EXPECT_FALSE(CheckReplicaSets({}).verdict.checked);
}

ReplicaSummary Summary(double p, double rounding) {
  ReplicaSummary s;
  s.projections = {p, -p, 2 * p, 0.5 * p};
  s.rounding = rounding;
  return s;
}

TEST(CheckReplicaSets, ToleranceIsWithinEachSet) {
  // Shard 0 holds values near 100, shard 1 near -50 (tolerance tau = 8 * 4 * 1e-3 = 0.032).
  // Rank 2 differs from rank 0 by rounding (within tau); rank 3 from rank 1 by far more.
  const std::vector<RankReplica> s = {{0, 0xA, 0, Summary(100.0, 1e-3)},
                                      {1, 0xB, 1, Summary(-50.0, 1e-3)},
                                      {2, 0xC, 0, Summary(100.001, 1e-3)},
                                      {3, 0xD, 1, Summary(-49.0, 1e-3)}};
  const ReplicaSetsVerdict v = CheckReplicaSets(s);
  EXPECT_TRUE(v.tolerance);
  EXPECT_TRUE(v.verdict.checked);
  // Set {0, 2}: two ranks within tau of their median (both within the tolerance, since neither
  // holds a strict majority's bits); set {1, 3}: no majority within tau, both named.
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(1, 3));
  EXPECT_THAT(v.within_tolerance, ElementsAre(0, 2));
  EXPECT_GT(v.worst_ratio, 1.0);
  // A set without every rank's summary is compared bit for bit: set {1, 3} with rank 3's
  // summary missing still names both, set {0, 2} is compared with its summaries.
  std::vector<RankReplica> partial = s;
  partial[3].summary.reset();
  const ReplicaSetsVerdict p = CheckReplicaSets(partial);
  EXPECT_THAT(p.verdict.divergent_ranks, ElementsAre(1, 3));
  EXPECT_THAT(p.within_tolerance, ElementsAre(0, 2));
  // A NaN reduction term: every set bit for bit, rounding differences named too.
  EXPECT_THAT(CheckReplicaSets(s, std::nan("")).verdict.divergent_ranks, ElementsAre(0, 1, 2, 3));
}

}  // namespace
}  // namespace rankscope::collector
