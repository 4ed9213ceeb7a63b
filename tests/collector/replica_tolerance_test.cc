#include "collector/analysis/replica_tolerance.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collector/analysis/rank_diagnostics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// The shim's summary (rankscope/replica_summary.py) of float32 values at global indices 0..n-1:
// P_j = sum_i s_j(i) x_i, s_j(i) = -1 where bit 60 + j of splitmix64(i) is set, and
// R = sqrt(sum_i (2^-23 x_i)^2) (float32: p = 24), its float64 rounding term left out.
uint64_t SplitMix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

ReplicaSummary Summarize(const std::vector<float>& x) {
  ReplicaSummary s;
  double sq = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint64_t z = SplitMix64(i);
    for (size_t j = 0; j < kReplicaProjections; ++j) {
      s.projections[j] += ((z >> (60 + j)) & 1) ? -double{x[i]} : double{x[i]};
    }
    const double u = std::ldexp(double{x[i]}, -23);
    sq += u * u;
  }
  s.rounding = std::sqrt(sq);
  return s;
}

// A fingerprint stand-in: distinct bit patterns give distinct values (the test only needs
// equality to mean equal bits).
uint64_t Bits(const std::vector<float>& x) {
  uint64_t h = 1469598103934665603ull;
  for (float v : x) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    h = (h ^ b) * 1099511628211ull;
  }
  return h;
}

std::vector<float> Model(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

std::vector<RankReplicaSummary> Ranks(const std::vector<std::vector<float>>& replicas) {
  std::vector<RankReplicaSummary> out;
  for (size_t r = 0; r < replicas.size(); ++r) {
    out.push_back({static_cast<uint32_t>(r), Bits(replicas[r]), Summarize(replicas[r])});
  }
  return out;
}

std::vector<RankFingerprint> Fingerprints(const std::vector<RankReplicaSummary>& ranks) {
  std::vector<RankFingerprint> out;
  for (const RankReplicaSummary& r : ranks) out.push_back({r.rank, r.fingerprint});
  return out;
}

constexpr size_t kN = 4096;

TEST(ReplicaToleranceTest, IdenticalReplicasAreCheckedAndAgree) {
  const std::vector<float> x = Model(kN, 1);
  const ToleranceVerdict v = CheckReplicasWithTolerance(Ranks({x, x, x, x}));
  EXPECT_TRUE(v.verdict.checked);
  EXPECT_FALSE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, IsEmpty());
  EXPECT_THAT(v.within_tolerance, IsEmpty());
  EXPECT_EQ(v.worst_ratio, 0.0);
}

TEST(ReplicaToleranceTest, EmptyInputIsUnchecked) {
  EXPECT_FALSE(CheckReplicasWithTolerance({}).verdict.checked);
}

// The last bits of a few values: the exact check names the rank, the tolerance check does not
// (it lists it as within the tolerance).
TEST(ReplicaToleranceTest, LastBitDifferencesAreWithinTheTolerance) {
  const std::vector<float> x = Model(kN, 2);
  std::vector<float> y = x;
  for (size_t i : {3u, 100u, 2000u, 4095u}) y[i] = std::nextafter(y[i], 1.0f);
  const std::vector<RankReplicaSummary> ranks = Ranks({x, x, y, x});
  EXPECT_THAT(CheckReplicas(Fingerprints(ranks)).divergent_ranks, ElementsAre(2u));
  const ToleranceVerdict v = CheckReplicasWithTolerance(ranks);
  EXPECT_THAT(v.verdict.divergent_ranks, IsEmpty());
  EXPECT_THAT(v.within_tolerance, ElementsAre(2u));
  EXPECT_GT(v.worst_ratio, 0.0);
  EXPECT_LT(v.worst_ratio, 0.01);
}

// Replicas that all differ by rounding (every fingerprint distinct: no exact majority, so the
// exact check names every rank) agree under the tolerance.
TEST(ReplicaToleranceTest, EveryRankDifferentByRoundingAgrees) {
  const std::vector<float> x = Model(kN, 3);
  std::vector<std::vector<float>> replicas;
  std::mt19937 rng(7);
  std::bernoulli_distribution flip(0.3);
  for (int r = 0; r < 5; ++r) {
    std::vector<float> y = x;
    for (float& v : y) {
      if (flip(rng)) v = std::nextafter(v, r % 2 ? 1.0f : -1.0f);
    }
    replicas.push_back(y);
  }
  const std::vector<RankReplicaSummary> ranks = Ranks(replicas);
  const ReplicaVerdict exact = CheckReplicas(Fingerprints(ranks));
  EXPECT_TRUE(exact.ambiguous);
  EXPECT_EQ(exact.divergent_ranks.size(), 5u);
  const ToleranceVerdict v = CheckReplicasWithTolerance(ranks);
  EXPECT_FALSE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, IsEmpty());
  EXPECT_THAT(v.within_tolerance, ElementsAre(0u, 1u, 2u, 3u, 4u));
}

// A real divergence: one layer (a quarter of the values) off by 1e-3 relative on rank 1.
TEST(ReplicaToleranceTest, ARelativeDivergenceOfOneLayerIsNamed) {
  const std::vector<float> x = Model(kN, 4);
  std::vector<float> y = x;
  for (size_t i = kN / 2; i < kN / 2 + kN / 4; ++i) y[i] *= 1.001f;
  const ToleranceVerdict v = CheckReplicasWithTolerance(Ranks({x, y, x, x}));
  EXPECT_FALSE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(1u));
  EXPECT_THAT(v.within_tolerance, IsEmpty());
  EXPECT_GT(v.worst_ratio, 1.0);
}

// Rounding on every rank and a real divergence on one: only that one is named.
TEST(ReplicaToleranceTest, DivergenceAmongRoundingDifferencesIsNamed) {
  const std::vector<float> x = Model(kN, 5);
  std::vector<std::vector<float>> replicas;
  for (int r = 0; r < 4; ++r) {
    std::vector<float> y = x;
    for (size_t i = static_cast<size_t>(r); i < kN; i += 7) y[i] = std::nextafter(y[i], 0.0f);
    replicas.push_back(y);
  }
  for (size_t i = 0; i < kN / 4; ++i) replicas[3][i] *= 1.001f;
  const ToleranceVerdict v = CheckReplicasWithTolerance(Ranks(replicas));
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(3u));
  EXPECT_THAT(v.within_tolerance, ElementsAre(0u, 1u, 2u));
}

// Two ranks that disagree beyond the tolerance: no majority, both named (as the exact check).
TEST(ReplicaToleranceTest, TwoRanksThatDisagreeAreBothNamed) {
  const std::vector<float> x = Model(kN, 6);
  std::vector<float> y = x;
  for (float& v : y) v *= 1.01f;
  const ToleranceVerdict v = CheckReplicasWithTolerance(Ranks({x, y}));
  EXPECT_TRUE(v.verdict.ambiguous);
  EXPECT_THAT(v.verdict.divergent_ranks, ElementsAre(0u, 1u));
}

// The bound: a rank whose every value is off by up to kReplicaToleranceUlps ulps, at random,
// is never named (500 draws; the bound's tail is ~1e-13 a draw), and a 1e-3 relative change
// of a quarter of the values always is.
TEST(ReplicaToleranceTest, FourUlpsEverywhereNeverNamedRealDivergenceAlways) {
  const std::vector<float> x = Model(kN, 8);
  const RankReplicaSummary base{0, Bits(x), Summarize(x)};
  auto against = [&base](const std::vector<float>& y) {
    RankReplicaSummary other = base;
    other.rank = 2;
    return CheckReplicasWithTolerance({base, {1, Bits(y), Summarize(y)}, other});
  };
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> ulps(-static_cast<int>(kReplicaToleranceUlps),
                                          static_cast<int>(kReplicaToleranceUlps));
  double worst = 0.0;
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<float> y = x;
    for (float& v : y) {
      const int k = ulps(rng);
      for (int s = 0; s < std::abs(k); ++s) v = std::nextafter(v, k > 0 ? 1.0f : -1.0f);
    }
    const ToleranceVerdict v = against(y);
    ASSERT_THAT(v.verdict.divergent_ranks, IsEmpty()) << "trial " << trial;
    worst = std::max(worst, v.worst_ratio);
  }
  std::printf("up to 4 ulps in every value, 500 draws: largest deviation / tolerance %.3f\n",
              worst);
  EXPECT_LT(worst, 1.0);
  std::uniform_int_distribution<size_t> start(0, kN - kN / 4);
  double least = std::numeric_limits<double>::infinity();
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<float> y = x;
    const size_t s = start(rng);
    for (size_t i = s; i < s + kN / 4; ++i) y[i] *= 1.001f;
    const ToleranceVerdict v = against(y);
    ASSERT_THAT(v.verdict.divergent_ranks, ElementsAre(1u)) << "trial " << trial;
    least = std::min(least, v.worst_ratio);
  }
  std::printf("a quarter of the values x 1.001, 100 draws: smallest deviation / tolerance %.1f\n",
              least);
}

// The reduced gradient of a one-shot all-reduce that sums the W ranks' float32 gradients on
// every rank starting from its own (pytorch#129501's shape): each rank's result differs by
// rounding. With ReductionRounding's term none is named; a 1e-3 change of a quarter of one
// rank's result is.
TEST(ReplicaToleranceTest, ReductionsInDifferentOrdersAgreeUnderTheReductionTerm) {
  constexpr uint32_t kW = 8;
  std::vector<std::vector<float>> local;
  std::vector<double> norms;
  for (uint32_t r = 0; r < kW; ++r) {
    local.push_back(Model(kN, 100 + r));
    double sq = 0.0;
    for (float v : local.back()) sq += double{v} * v;
    norms.push_back(std::sqrt(sq));
  }
  std::vector<std::vector<float>> reduced(kW, std::vector<float>(kN));
  for (uint32_t r = 0; r < kW; ++r) {
    for (size_t i = 0; i < kN; ++i) {
      float acc = 0.0f;
      for (uint32_t k = 0; k < kW; ++k) acc += local[(r + k) % kW][i] / static_cast<float>(kW);
      reduced[r][i] = acc;
    }
  }
  std::vector<RankReplicaSummary> ranks = Ranks(reduced);
  EXPECT_TRUE(CheckReplicas(Fingerprints(ranks)).ambiguous);  // every rank's bits differ
  const double reduction = ReductionRounding(norms, kW, 24);
  EXPECT_GT(reduction, 0.0);
  const ToleranceVerdict v = CheckReplicasWithTolerance(ranks, reduction);
  EXPECT_THAT(v.verdict.divergent_ranks, IsEmpty());
  EXPECT_EQ(v.within_tolerance.size(), kW);
  EXPECT_LT(v.worst_ratio, 1.0);

  for (size_t i = 0; i < kN / 4; ++i) reduced[5][i] *= 1.001f;
  const ToleranceVerdict bad = CheckReplicasWithTolerance(Ranks(reduced), reduction);
  EXPECT_THAT(bad.verdict.divergent_ranks, ElementsAre(5u));
}

TEST(ReplicaToleranceTest, ReductionRoundingScalesWithTheNormsAndThePrecision) {
  const std::vector<double> norms = {3.0, 4.0};
  EXPECT_DOUBLE_EQ(ReductionRounding(norms, 2, 24), 2.0 * std::ldexp(1.0, -24) * 5.0);
  // Two of four ranks reported: the missing ones counted at the reported ones' mean square.
  EXPECT_DOUBLE_EQ(ReductionRounding(norms, 4, 8),
                   2.0 * std::ldexp(1.0, -8) * std::sqrt(25.0 * 2.0));
  EXPECT_TRUE(std::isnan(ReductionRounding({1.0, std::nan("")}, 2, 24)));
  EXPECT_EQ(ReductionRounding({}, 2, 24), 0.0);
}

}  // namespace
}  // namespace rankscope::collector
