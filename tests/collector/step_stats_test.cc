#include "collector/analysis/step_stats.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();
constexpr float kInff = std::numeric_limits<float>::infinity();

// Doubles computed from floats by two correct algorithms differ only by summation-order
// rounding: a few ulps times sqrt(number of terms). 1e-9 relative leaves a wide margin for that
// and still catches any real mistake (a wrong divisor, a missed term, a wrong sign).
constexpr double kRelTol = 1e-9;

// ---------------------------------------------------------------------------------------------
// Brute-force reference: O(W^2 k), written from the conventions in step_stats.h, sharing no code
// with the implementation.

struct Described {
  double mean, std, range;
};

Described RefDescribe(const std::vector<double>& xs) {
  if (xs.empty()) return {0.0, 0.0, 0.0};
  for (double x : xs) {
    if (std::isnan(x)) return {kNaN, kNaN, kNaN};
  }
  bool all_equal = true;
  for (double x : xs) all_equal &= (x == xs[0]);
  if (all_equal && std::isfinite(xs[0])) return {xs[0], 0.0, 0.0};
  double sum = 0.0;
  for (double x : xs) sum += x;
  const double mean = sum / xs.size();
  double ss = 0.0;
  for (double x : xs) ss += (x - mean) * (x - mean);
  const double mx = *std::max_element(xs.begin(), xs.end());
  const double mn = *std::min_element(xs.begin(), xs.end());
  return {mean, std::sqrt(ss / xs.size()), mx - mn};
}

double RefZ(double x, const Described& d) { return d.std == 0.0 ? 0.0 : (x - d.mean) / d.std; }

// Cosine with the zero-vector convention; NaN if either holds a non-finite value.
double RefCosine(const std::vector<double>& a, const std::vector<double>& b) {
  double dot = 0.0, na = 0.0, nb = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  if (!std::isfinite(na) || !std::isfinite(nb)) return kNaN;
  if (na == 0.0 || nb == 0.0) return 0.0;
  return dot / (std::sqrt(na) * std::sqrt(nb));
}

struct RefResult {
  Described loss, norm;
  double cv;
  double cosine_mean;
  std::vector<double> consensus, loss_z, norm_z;
};

RefResult Reference(const std::vector<RankSample>& samples) {
  const size_t w = samples.size();
  RefResult ref;
  std::vector<double> losses, norms;
  for (const RankSample& s : samples) {
    losses.push_back(s.loss);
    norms.push_back(s.grad_norm);
  }
  ref.loss = RefDescribe(losses);
  ref.norm = RefDescribe(norms);
  ref.cv = ref.norm.std == 0.0 ? 0.0 : ref.norm.std / ref.norm.mean;
  for (size_t r = 0; r < w; ++r) {
    ref.loss_z.push_back(RefZ(losses[r], ref.loss));
    ref.norm_z.push_back(RefZ(norms[r], ref.norm));
  }
  std::vector<std::vector<double>> v(w);
  for (size_t r = 0; r < w; ++r) v[r] = DecodeSketch(samples[r].sketch);
  // Every unordered pair.
  if (w < 2) {
    ref.cosine_mean = kNaN;
  } else {
    double sum = 0.0;
    for (size_t a = 0; a < w; ++a) {
      for (size_t b = a + 1; b < w; ++b) sum += RefCosine(v[a], v[b]);
    }
    ref.cosine_mean = sum / (w * (w - 1) / 2.0);
  }
  // cos(v_r, sum_{j != r} v_j), the rest summed directly.
  const size_t k = w == 0 ? 0 : v[0].size();
  for (size_t r = 0; r < w; ++r) {
    if (w < 2) {
      ref.consensus.push_back(kNaN);
      continue;
    }
    std::vector<double> rest(k, 0.0);
    for (size_t j = 0; j < w; ++j) {
      if (j == r) continue;
      for (size_t i = 0; i < k; ++i) rest[i] += v[j][i];
    }
    ref.consensus.push_back(RefCosine(v[r], rest));
  }
  return ref;
}

// NaN must match NaN, an infinity must match exactly, a finite value within kRelTol * scale.
void ExpectClose(double actual, double expected, double scale, const std::string& what) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << what << ": expected NaN, got " << actual;
  } else if (std::isinf(expected)) {
    EXPECT_EQ(actual, expected) << what;
  } else {
    EXPECT_NEAR(actual, expected, kRelTol * std::max(scale, std::abs(expected))) << what;
  }
}

double MaxAbs(const std::vector<double>& xs) {
  double m = 0.0;
  for (double x : xs) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

void ExpectMatchesReference(const std::vector<RankSample>& samples) {
  const StepStatistics got = ComputeStepStatistics(samples);
  const RefResult ref = Reference(samples);
  std::vector<double> losses, norms;
  for (const RankSample& s : samples) {
    losses.push_back(s.loss);
    norms.push_back(s.grad_norm);
  }
  const double loss_scale = MaxAbs(losses), norm_scale = MaxAbs(norms);
  ASSERT_EQ(got.ranks, samples.size());
  ExpectClose(got.loss_mean, ref.loss.mean, loss_scale, "loss_mean");
  ExpectClose(got.loss_std, ref.loss.std, loss_scale, "loss_std");
  ExpectClose(got.loss_range, ref.loss.range, loss_scale, "loss_range");
  ExpectClose(got.grad_norm_mean, ref.norm.mean, norm_scale, "grad_norm_mean");
  ExpectClose(got.grad_norm_std, ref.norm.std, norm_scale, "grad_norm_std");
  ExpectClose(got.grad_norm_cv, ref.cv, 0.0, "grad_norm_cv");
  ExpectClose(got.grad_cosine_mean, ref.cosine_mean, 1.0, "grad_cosine_mean");
  ASSERT_EQ(got.per_rank.size(), samples.size());
  for (size_t r = 0; r < samples.size(); ++r) {
    const std::string at = " at index " + std::to_string(r);
    EXPECT_EQ(got.per_rank[r].rank, samples[r].rank) << at;
    ExpectClose(got.per_rank[r].consensus_cosine, ref.consensus[r], 1.0, "consensus" + at);
    ExpectClose(got.per_rank[r].loss_z, ref.loss_z[r], 1.0, "loss_z" + at);
    ExpectClose(got.per_rank[r].grad_norm_z, ref.norm_z[r], 1.0, "grad_norm_z" + at);
  }
}

// Owns the sketches that the RankSamples' spans point into.
struct Step {
  std::vector<std::vector<float>> sketches;
  std::vector<RankSample> samples;

  void Rebind() {
    for (size_t r = 0; r < samples.size(); ++r) samples[r].sketch = sketches[r];
  }
};

// W ranks with losses near 2.3, norms near 1, and sketches sharing a common direction of random
// strength plus per-rank noise of random magnitude (so the cosines span a useful range and the
// normalization matters). Ranks are numbered in a shuffled order to check per_rank order.
Step RandomStep(size_t w, size_t k, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  Step step;
  std::vector<float> common(k);
  for (float& c : common) c = static_cast<float>(normal(rng));
  const double strength = uniform(rng) * 2.0;
  std::vector<uint32_t> ranks(w);
  for (size_t r = 0; r < w; ++r) ranks[r] = static_cast<uint32_t>(r);
  std::shuffle(ranks.begin(), ranks.end(), rng);
  for (size_t r = 0; r < w; ++r) {
    const double magnitude = std::pow(10.0, uniform(rng) * 4.0 - 2.0);
    std::vector<float> v(k);
    for (size_t i = 0; i < k; ++i) {
      v[i] = static_cast<float>(magnitude * (strength * common[i] + normal(rng)));
    }
    step.sketches.push_back(std::move(v));
    RankSample s;
    s.rank = ranks[r];
    s.loss = 2.3 + 0.1 * normal(rng);
    s.grad_norm = std::abs(1.0 + 0.3 * normal(rng));
    step.samples.push_back(s);
  }
  step.Rebind();
  return step;
}

Step StepFromSketches(std::vector<std::vector<float>> sketches) {
  Step step;
  step.sketches = std::move(sketches);
  for (size_t r = 0; r < step.sketches.size(); ++r) {
    RankSample s;
    s.rank = static_cast<uint32_t>(r);
    s.loss = 1.0 + r;
    s.grad_norm = 2.0 + r;
    step.samples.push_back(s);
  }
  step.Rebind();
  return step;
}

// ---------------------------------------------------------------------------------------------
// Randomized comparison against the reference over W x k.

class StepStatsReferenceTest : public ::testing::TestWithParam<std::tuple<size_t, size_t>> {};

TEST_P(StepStatsReferenceTest, RandomInputs) {
  const auto [w, k] = GetParam();
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Step step = RandomStep(w, k, seed * 7919 + static_cast<uint32_t>(w * 31 + k));
    ExpectMatchesReference(step.samples);
  }
}

TEST_P(StepStatsReferenceTest, OneRankHasZeroSketch) {
  const auto [w, k] = GetParam();
  Step step = RandomStep(w, k, 42);
  std::fill(step.sketches[w / 2].begin(), step.sketches[w / 2].end(), 0.0f);
  ExpectMatchesReference(step.samples);
  const StepStatistics got = ComputeStepStatistics(step.samples);
  if (w >= 2) {
    EXPECT_EQ(got.per_rank[w / 2].consensus_cosine, 0.0);
  }
}

TEST_P(StepStatsReferenceTest, NaNInOneRankSketch) {
  const auto [w, k] = GetParam();
  Step step = RandomStep(w, k, 43);
  step.sketches[w - 1][k / 2] = kNaNf;
  ExpectMatchesReference(step.samples);
}

TEST_P(StepStatsReferenceTest, NaNLossAndInfGradNorm) {
  const auto [w, k] = GetParam();
  Step step = RandomStep(w, k, 44);
  step.samples[0].loss = kNaN;
  step.samples[w - 1].grad_norm = kInf;
  ExpectMatchesReference(step.samples);
}

INSTANTIATE_TEST_SUITE_P(WByK, StepStatsReferenceTest,
                         ::testing::Combine(::testing::Values<size_t>(1, 2, 3, 8, 64, 1000),
                                            ::testing::Values<size_t>(1, 16, 1024)),
                         [](const ::testing::TestParamInfo<std::tuple<size_t, size_t>>& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_k" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// Hand-checked cases.

TEST(StepStatsTest, EmptyStep) {
  const StepStatistics got = ComputeStepStatistics({});
  EXPECT_EQ(got.ranks, 0u);
  EXPECT_EQ(got.loss_mean, 0.0);
  EXPECT_EQ(got.loss_std, 0.0);
  EXPECT_EQ(got.loss_range, 0.0);
  EXPECT_EQ(got.grad_norm_mean, 0.0);
  EXPECT_EQ(got.grad_norm_std, 0.0);
  EXPECT_EQ(got.grad_norm_cv, 0.0);
  EXPECT_TRUE(std::isnan(got.grad_cosine_mean));
  EXPECT_TRUE(got.per_rank.empty());
}

TEST(StepStatsTest, SingleRank) {
  Step step = StepFromSketches({{1.0f, 2.0f, 3.0f}});
  step.samples[0].rank = 7;
  step.samples[0].loss = 0.1;
  step.samples[0].grad_norm = 3.5;
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_EQ(got.ranks, 1u);
  EXPECT_EQ(got.loss_mean, 0.1);
  EXPECT_EQ(got.loss_std, 0.0);
  EXPECT_EQ(got.loss_range, 0.0);
  EXPECT_EQ(got.grad_norm_mean, 3.5);
  EXPECT_EQ(got.grad_norm_std, 0.0);
  EXPECT_EQ(got.grad_norm_cv, 0.0);
  EXPECT_TRUE(std::isnan(got.grad_cosine_mean));
  ASSERT_EQ(got.per_rank.size(), 1u);
  EXPECT_EQ(got.per_rank[0].rank, 7u);
  EXPECT_TRUE(std::isnan(got.per_rank[0].consensus_cosine));
  EXPECT_EQ(got.per_rank[0].loss_z, 0.0);
  EXPECT_EQ(got.per_rank[0].grad_norm_z, 0.0);
}

TEST(StepStatsTest, KnownMoments) {
  Step step = StepFromSketches({{1.0f}, {1.0f}, {1.0f}, {1.0f}});
  // Large offset: a one-pass sum-of-squares formula would lose every digit here.
  const double losses[] = {1e9 + 0, 1e9 + 1, 1e9 + 2, 1e9 + 3};
  const double norms[] = {1, 2, 3, 6};
  for (int r = 0; r < 4; ++r) {
    step.samples[r].loss = losses[r];
    step.samples[r].grad_norm = norms[r];
  }
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_DOUBLE_EQ(got.loss_mean, 1e9 + 1.5);
  EXPECT_DOUBLE_EQ(got.loss_std, std::sqrt(1.25));
  EXPECT_DOUBLE_EQ(got.loss_range, 3.0);
  EXPECT_DOUBLE_EQ(got.grad_norm_mean, 3.0);
  EXPECT_DOUBLE_EQ(got.grad_norm_std, std::sqrt(3.5));  // (4 + 1 + 0 + 9) / 4
  EXPECT_DOUBLE_EQ(got.grad_norm_cv, std::sqrt(3.5) / 3.0);
  EXPECT_DOUBLE_EQ(got.per_rank[0].loss_z, -1.5 / std::sqrt(1.25));
  EXPECT_DOUBLE_EQ(got.per_rank[3].grad_norm_z, 3.0 / std::sqrt(3.5));
}

TEST(StepStatsTest, EqualValuesGiveExactZeroStd) {
  // 0.1 * 3 / 3 != 0.1 in floating point; the convention still demands std == 0 and z == 0.
  Step step = StepFromSketches({{1.0f}, {2.0f}, {3.0f}});
  for (RankSample& s : step.samples) {
    s.loss = 0.1;
    s.grad_norm = 0.0;
  }
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_EQ(got.loss_mean, 0.1);
  EXPECT_EQ(got.loss_std, 0.0);
  EXPECT_EQ(got.loss_range, 0.0);
  EXPECT_EQ(got.grad_norm_mean, 0.0);
  EXPECT_EQ(got.grad_norm_std, 0.0);
  EXPECT_EQ(got.grad_norm_cv, 0.0);  // not 0/0
  for (const RankStatistics& r : got.per_rank) {
    EXPECT_EQ(r.loss_z, 0.0);
    EXPECT_EQ(r.grad_norm_z, 0.0);
  }
}

TEST(StepStatsTest, ValuesUlpsApartKeepZScoresWithinSamuelsonsBound) {
  // Ranks that compute the same loss in a different order report values one ulp apart. Their
  // exact mean is not representable, and z-scores taken from the rounded mean came out as 0 and 2
  // (|z| <= sqrt(W - 1) = 1 for two values). Found by tests/fuzz/step_stats_fuzzer.cc.
  const double a = 2.3456789;
  const double b = std::nextafter(a, 3.0);
  Step two = StepFromSketches({{1.0f}, {1.0f}});
  two.samples[0].loss = a;
  two.samples[1].loss = b;
  const StepStatistics got = ComputeStepStatistics(two.samples);
  EXPECT_DOUBLE_EQ(got.per_rank[0].loss_z, -1.0);
  EXPECT_DOUBLE_EQ(got.per_rank[1].loss_z, 1.0);

  // Seven equal values and one an ulp above: that one sits exactly on the bound sqrt(7).
  Step eight = StepFromSketches({{1.0f}, {1.0f}, {1.0f}, {1.0f}, {1.0f}, {1.0f}, {1.0f}, {1.0f}});
  for (RankSample& s : eight.samples) s.grad_norm = a;
  eight.samples[5].grad_norm = b;
  const StepStatistics got8 = ComputeStepStatistics(eight.samples);
  for (int r = 0; r < 8; ++r) {
    EXPECT_NEAR(got8.per_rank[r].grad_norm_z, r == 5 ? std::sqrt(7.0) : -1.0 / std::sqrt(7.0), 1e-9)
        << "rank " << r;
  }
}

TEST(StepStatsTest, AllZeroSketches) {
  Step step = StepFromSketches({{0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0}});
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_EQ(got.grad_cosine_mean, 0.0);
  for (const RankStatistics& r : got.per_rank) EXPECT_EQ(r.consensus_cosine, 0.0);
  ExpectMatchesReference(step.samples);
}

TEST(StepStatsTest, ZeroLengthSketches) {
  Step step = StepFromSketches({{}, {}, {}});
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_EQ(got.grad_cosine_mean, 0.0);
  for (const RankStatistics& r : got.per_rank) EXPECT_EQ(r.consensus_cosine, 0.0);
}

TEST(StepStatsTest, IdenticalSketchesHaveCosineOne) {
  for (size_t w : {2, 3, 100}) {
    std::vector<std::vector<float>> sketches(w, {0.3f, -1.7f, 2.25f, 1e-3f, 4e4f});
    Step step = StepFromSketches(sketches);
    const StepStatistics got = ComputeStepStatistics(step.samples);
    EXPECT_NEAR(got.grad_cosine_mean, 1.0, kRelTol) << "W=" << w;
    for (const RankStatistics& r : got.per_rank) EXPECT_NEAR(r.consensus_cosine, 1.0, kRelTol);
  }
}

TEST(StepStatsTest, ParallelSketchesOfDifferentLengthHaveCosineOne) {
  Step step = StepFromSketches({{1, 2, 3}, {1e-4f, 2e-4f, 3e-4f}, {1e4f, 2e4f, 3e4f}});
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_NEAR(got.grad_cosine_mean, 1.0, kRelTol);
  for (const RankStatistics& r : got.per_rank) EXPECT_NEAR(r.consensus_cosine, 1.0, kRelTol);
}

TEST(StepStatsTest, OppositeSketches) {
  {
    Step step = StepFromSketches({{1, -2, 3}, {-1, 2, -3}});
    const StepStatistics got = ComputeStepStatistics(step.samples);
    EXPECT_NEAR(got.grad_cosine_mean, -1.0, kRelTol);
    EXPECT_NEAR(got.per_rank[0].consensus_cosine, -1.0, kRelTol);
    EXPECT_NEAR(got.per_rank[1].consensus_cosine, -1.0, kRelTol);
  }
  {
    // Two up, two down: pairs (++), (--) are +1, the four mixed pairs -1: C = (2 - 4) / 6.
    // Each rank's rest is (one like it, two opposite) = -v: consensus -1.
    Step step = StepFromSketches({{1, 1}, {1, 1}, {-1, -1}, {-1, -1}});
    const StepStatistics got = ComputeStepStatistics(step.samples);
    EXPECT_NEAR(got.grad_cosine_mean, -1.0 / 3.0, kRelTol);
    for (const RankStatistics& r : got.per_rank) EXPECT_NEAR(r.consensus_cosine, -1.0, kRelTol);
  }
  {
    // Three cancel exactly without the fourth: rank 3's rest is exactly zero, so its consensus
    // is 0 by the zero-vector convention, computed without catastrophic cancellation.
    Step step = StepFromSketches({{1, 0}, {-1, 0}, {0, 0}, {5, 5}});
    const StepStatistics got = ComputeStepStatistics(step.samples);
    EXPECT_EQ(got.per_rank[3].consensus_cosine, 0.0);
    EXPECT_EQ(got.per_rank[2].consensus_cosine, 0.0);
    ExpectMatchesReference(step.samples);
  }
}

TEST(StepStatsTest, OrthogonalSketches) {
  std::vector<std::vector<float>> basis(16, std::vector<float>(16, 0.0f));
  for (size_t i = 0; i < 16; ++i) basis[i][i] = static_cast<float>(i + 1);
  Step step = StepFromSketches(basis);
  const StepStatistics got = ComputeStepStatistics(step.samples);
  EXPECT_NEAR(got.grad_cosine_mean, 0.0, kRelTol);
  for (const RankStatistics& r : got.per_rank) EXPECT_NEAR(r.consensus_cosine, 0.0, kRelTol);
}

TEST(StepStatsTest, DominantRankAgainstTinyRest) {
  // |S - v_0|^2 expanded as |S|^2 - 2<S,v_0> + |v_0|^2 would be all cancellation here.
  Step step = StepFromSketches({{1e6f, 0.0f}, {0.0f, 1e-3f}, {1e-3f, 1e-3f}});
  const StepStatistics got = ComputeStepStatistics(step.samples);
  // rest of rank 0 = (1e-3, 2e-3): cos = 1e-3 / sqrt(5e-6).
  const double f = 1e-3f;  // the float value actually stored
  EXPECT_NEAR(got.per_rank[0].consensus_cosine, f / std::sqrt(f * f + 4 * f * f), kRelTol);
  ExpectMatchesReference(step.samples);
}

// Issue 12.8b: beside a rank of scale 1e-38, S - v_r cancelled to 0 in double for the big ranks,
// whose consensus cosine (with the tiny rank's direction) came out 0.0 instead of ~0.54.
TEST(StepStatsTest, ATinyRankKeepsTheOthersConsensusCosine) {
  std::mt19937_64 rng(12);
  std::normal_distribution<double> normal(0.0, 1.0);
  constexpr size_t kK = 1024;
  std::vector<float> big(kK), tiny(kK);
  for (size_t i = 0; i < kK; ++i) {
    const double a = normal(rng);
    big[i] = static_cast<float>(a);
    tiny[i] = static_cast<float>(1e-38 * (0.54 * a + 0.84 * normal(rng)));  // float denormals too
  }
  Step step = StepFromSketches({big, tiny});
  const StepStatistics got = ComputeStepStatistics(step.samples);
  const std::vector<double> b(big.begin(), big.end()), t(tiny.begin(), tiny.end());
  const double want = RefCosine(b, t);
  EXPECT_NEAR(want, 0.54, 0.05);
  EXPECT_NEAR(got.per_rank[0].consensus_cosine, want, 1e-6);
  EXPECT_NEAR(got.per_rank[1].consensus_cosine, want, 1e-6);
  ExpectMatchesReference(step.samples);
  // Three ranks: two big ones that cancel exactly, and the tiny one.
  std::vector<float> minus(kK);
  for (size_t i = 0; i < kK; ++i) minus[i] = -big[i];
  Step three = StepFromSketches({big, minus, tiny});
  ExpectMatchesReference(three.samples);
}

TEST(StepStatsTest, CulpritRankStandsOut) {
  Step step = RandomStep(64, 256, 5);
  // Rank at index 10 points the other way and has a loss spike.
  for (float& x : step.sketches[10]) x = -x;
  step.samples[10].loss += 5.0;
  const StepStatistics got = ComputeStepStatistics(step.samples);
  size_t lowest = 0, highest_z = 0;
  for (size_t r = 0; r < got.per_rank.size(); ++r) {
    if (got.per_rank[r].consensus_cosine < got.per_rank[lowest].consensus_cosine) lowest = r;
    if (got.per_rank[r].loss_z > got.per_rank[highest_z].loss_z) highest_z = r;
  }
  EXPECT_EQ(lowest, 10u);
  EXPECT_EQ(highest_z, 10u);
  ExpectMatchesReference(step.samples);
}

// ---------------------------------------------------------------------------------------------
// Non-finite inputs: NaN goes exactly where the definitions take it, and nowhere else.

class StepStatsNonFiniteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    step_ = RandomStep(8, 16, 99);
    clean_ = ComputeStepStatistics(step_.samples);
  }
  void ExpectLossStatsUnchanged(const StepStatistics& got) {
    EXPECT_EQ(got.loss_mean, clean_.loss_mean);
    EXPECT_EQ(got.loss_std, clean_.loss_std);
    EXPECT_EQ(got.loss_range, clean_.loss_range);
    for (size_t r = 0; r < got.per_rank.size(); ++r) {
      EXPECT_EQ(got.per_rank[r].loss_z, clean_.per_rank[r].loss_z);
    }
  }
  void ExpectGradNormStatsUnchanged(const StepStatistics& got) {
    EXPECT_EQ(got.grad_norm_mean, clean_.grad_norm_mean);
    EXPECT_EQ(got.grad_norm_std, clean_.grad_norm_std);
    EXPECT_EQ(got.grad_norm_cv, clean_.grad_norm_cv);
    for (size_t r = 0; r < got.per_rank.size(); ++r) {
      EXPECT_EQ(got.per_rank[r].grad_norm_z, clean_.per_rank[r].grad_norm_z);
    }
  }
  void ExpectCosinesUnchanged(const StepStatistics& got) {
    EXPECT_EQ(got.grad_cosine_mean, clean_.grad_cosine_mean);
    for (size_t r = 0; r < got.per_rank.size(); ++r) {
      EXPECT_EQ(got.per_rank[r].consensus_cosine, clean_.per_rank[r].consensus_cosine);
    }
  }

  Step step_;
  StepStatistics clean_;
};

TEST_F(StepStatsNonFiniteTest, NaNLoss) {
  step_.samples[3].loss = kNaN;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_TRUE(std::isnan(got.loss_mean));
  EXPECT_TRUE(std::isnan(got.loss_std));
  EXPECT_TRUE(std::isnan(got.loss_range));
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.loss_z));
  ExpectGradNormStatsUnchanged(got);
  ExpectCosinesUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, InfLoss) {
  step_.samples[3].loss = kInf;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_EQ(got.loss_mean, kInf);
  EXPECT_TRUE(std::isnan(got.loss_std));
  EXPECT_EQ(got.loss_range, kInf);
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.loss_z));
  ExpectGradNormStatsUnchanged(got);
  ExpectCosinesUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, PlusAndMinusInfLoss) {
  step_.samples[1].loss = kInf;
  step_.samples[2].loss = -kInf;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_TRUE(std::isnan(got.loss_mean));
  EXPECT_TRUE(std::isnan(got.loss_std));
  EXPECT_EQ(got.loss_range, kInf);
  ExpectGradNormStatsUnchanged(got);
  ExpectCosinesUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, AllLossesInf) {
  for (RankSample& s : step_.samples) s.loss = kInf;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_EQ(got.loss_mean, kInf);
  EXPECT_TRUE(std::isnan(got.loss_std));
  EXPECT_TRUE(std::isnan(got.loss_range));  // Inf - Inf
  ExpectGradNormStatsUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, NaNGradNorm) {
  step_.samples[0].grad_norm = kNaN;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_TRUE(std::isnan(got.grad_norm_mean));
  EXPECT_TRUE(std::isnan(got.grad_norm_std));
  EXPECT_TRUE(std::isnan(got.grad_norm_cv));
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.grad_norm_z));
  ExpectLossStatsUnchanged(got);
  ExpectCosinesUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, InfGradNorm) {
  step_.samples[0].grad_norm = kInf;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_EQ(got.grad_norm_mean, kInf);
  EXPECT_TRUE(std::isnan(got.grad_norm_std));
  EXPECT_TRUE(std::isnan(got.grad_norm_cv));
  ExpectLossStatsUnchanged(got);
  ExpectCosinesUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, NaNInSketch) {
  step_.sketches[5][7] = kNaNf;
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_TRUE(std::isnan(got.grad_cosine_mean));
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.consensus_cosine));
  ExpectLossStatsUnchanged(got);
  ExpectGradNormStatsUnchanged(got);
}

TEST_F(StepStatsNonFiniteTest, InfInSketch) {
  // Bins where other ranks are zero would give cos = finite / Inf = 0 if Inf were let through.
  step_.sketches[2][0] = -kInff;
  for (size_t r = 0; r < step_.sketches.size(); ++r) {
    if (r != 2) step_.sketches[r][0] = 0.0f;
  }
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_TRUE(std::isnan(got.grad_cosine_mean));
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.consensus_cosine));
  ExpectLossStatsUnchanged(got);
  ExpectGradNormStatsUnchanged(got);
  ExpectMatchesReference(step_.samples);
}

TEST_F(StepStatsNonFiniteTest, MismatchedSketchLengthsDoNotCrash) {
  step_.sketches[4].resize(3);
  step_.Rebind();
  const StepStatistics got = ComputeStepStatistics(step_.samples);
  EXPECT_TRUE(std::isnan(got.grad_cosine_mean));
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.consensus_cosine));
  ExpectLossStatsUnchanged(got);
  ExpectGradNormStatsUnchanged(got);
}

// ---------------------------------------------------------------------------------------------
// Every instruction-set path of the sketch kernels gives bit-identical results.

void ExpectSameBits(double a, double b, const std::string& what) {
  if (std::isnan(b)) {
    EXPECT_TRUE(std::isnan(a)) << what;
  } else {
    EXPECT_EQ(a, b) << what;
  }
}

TEST(StepStatsIsaTest, EveryPathIsBitIdenticalToBaseline) {
  using step_stats_internal::ComputeStepStatisticsWithIsa;
  using step_stats_internal::KernelIsa;
  for (size_t w : {1, 2, 3, 64, 257}) {
    for (size_t k : {1, 7, 16, 17, 100, 1000, 1024}) {
      for (int variant = 0; variant < 4; ++variant) {
        Step step = RandomStep(w, k, static_cast<uint32_t>(w * 1000 + k));
        if (variant == 1) std::fill(step.sketches[w / 2].begin(), step.sketches[w / 2].end(), 0.f);
        if (variant == 2) step.sketches[w - 1][k - 1] = kNaNf;
        if (variant == 3) {  // one rank 1e-38 times smaller: the compensated total matters
          for (float& x : step.sketches[w / 2]) x *= 1e-38f;
        }
        const StepStatistics base =
            ComputeStepStatisticsWithIsa(step.samples, KernelIsa::kBaseline);
        for (KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
          if (!step_stats_internal::KernelIsaSupported(isa)) continue;
          const std::string at = "W=" + std::to_string(w) + " k=" + std::to_string(k) +
                                 " variant " + std::to_string(variant) + " isa " +
                                 std::to_string(static_cast<int>(isa));
          const StepStatistics got = ComputeStepStatisticsWithIsa(step.samples, isa);
          ExpectSameBits(got.grad_cosine_mean, base.grad_cosine_mean, "grad_cosine_mean " + at);
          ASSERT_EQ(got.per_rank.size(), base.per_rank.size());
          for (size_t r = 0; r < w; ++r) {
            ExpectSameBits(got.per_rank[r].consensus_cosine, base.per_rank[r].consensus_cosine,
                           "consensus " + at + " rank index " + std::to_string(r));
          }
        }
        // The dispatched path is one of them.
        const StepStatistics chosen = ComputeStepStatistics(step.samples);
        ExpectSameBits(chosen.grad_cosine_mean, base.grad_cosine_mean, "dispatched");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Packed sketches (float16, int8 + scale; common/sketch_encoding.h): the kernel reads them in
// place, matches the reference on their decoded values, and stays bit-identical across ISAs.

// `step`'s sketches packed in `encoding` (every `mixed`-th rank stays float32); the samples view
// the packed bytes.
struct PackedStep {
  std::vector<PackedSketch> packed;
  std::vector<RankSample> samples;
};
PackedStep Pack(const Step& step, SketchEncoding encoding, size_t mixed = 0) {
  PackedStep out;
  out.packed.reserve(step.sketches.size());
  for (const std::vector<float>& v : step.sketches) out.packed.push_back(PackSketch(v, encoding));
  out.samples = step.samples;
  for (size_t r = 0; r < out.samples.size(); ++r) {
    if (mixed != 0 && r % mixed == 0) {
      out.samples[r].sketch = step.sketches[r];
    } else {
      out.samples[r].sketch = SketchView(encoding, out.packed[r].bins.data(),
                                         step.sketches[r].size(), out.packed[r].scale);
    }
  }
  return out;
}

class StepStatsPackedTest : public ::testing::TestWithParam<SketchEncoding> {};

TEST_P(StepStatsPackedTest, MatchesReferenceOnDecodedValues) {
  for (size_t w : {2, 3, 8, 64}) {
    for (size_t k : {1, 17, 1024, 4096}) {
      Step step = RandomStep(w, k, static_cast<uint32_t>(w * 131 + k));
      SCOPED_TRACE("W=" + std::to_string(w) + " k=" + std::to_string(k));
      ExpectMatchesReference(Pack(step, GetParam()).samples);
      std::fill(step.sketches[w / 2].begin(), step.sketches[w / 2].end(), 0.0f);
      ExpectMatchesReference(Pack(step, GetParam()).samples);
    }
  }
}

TEST_P(StepStatsPackedTest, CloseToTheFloatSketches) {
  // 8 ranks at k = 4096: the packing moves the cosines by far less than the sketch's own error.
  const Step step = RandomStep(8, 4096, 5);
  const StepStatistics exact = ComputeStepStatistics(step.samples);
  const StepStatistics packed = ComputeStepStatistics(Pack(step, GetParam()).samples);
  EXPECT_NEAR(packed.grad_cosine_mean, exact.grad_cosine_mean, 2e-3);
  for (size_t r = 0; r < 8; ++r) {
    EXPECT_NEAR(packed.per_rank[r].consensus_cosine, exact.per_rank[r].consensus_cosine, 2e-3);
  }
}

TEST_P(StepStatsPackedTest, NonFiniteSketchMakesCosinesNaN) {
  Step step = RandomStep(4, 64, 9);
  step.sketches[2][3] = kInff;
  const PackedStep packed = Pack(step, GetParam());
  EXPECT_TRUE(std::isnan(packed.samples[2].sketch.scale));
  const StepStatistics got = ComputeStepStatistics(packed.samples);
  EXPECT_TRUE(std::isnan(got.grad_cosine_mean));
  for (const RankStatistics& r : got.per_rank) EXPECT_TRUE(std::isnan(r.consensus_cosine));
}

TEST_P(StepStatsPackedTest, EveryPathIsBitIdenticalToBaseline) {
  using step_stats_internal::ComputeStepStatisticsWithIsa;
  using step_stats_internal::KernelIsa;
  for (size_t w : {1, 2, 3, 64, 257}) {
    for (size_t k : {1, 7, 16, 17, 100, 1024, 4096}) {
      for (int variant = 0; variant < 3; ++variant) {
        Step step = RandomStep(w, k, static_cast<uint32_t>(w * 1000 + k));
        if (variant == 2) {  // one rank 1e-38 times smaller: the compensated total matters
          for (float& x : step.sketches[w / 2]) x *= 1e-38f;
        }
        // variant 1: every third rank float32 (the kernel decodes each sample in its encoding).
        const PackedStep packed = Pack(step, GetParam(), variant == 1 ? 3 : 0);
        const StepStatistics base =
            ComputeStepStatisticsWithIsa(packed.samples, KernelIsa::kBaseline);
        for (KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
          if (!step_stats_internal::KernelIsaSupported(isa)) continue;
          const std::string at = "W=" + std::to_string(w) + " k=" + std::to_string(k) +
                                 " variant " + std::to_string(variant) + " isa " +
                                 std::to_string(static_cast<int>(isa));
          const StepStatistics got = ComputeStepStatisticsWithIsa(packed.samples, isa);
          ExpectSameBits(got.grad_cosine_mean, base.grad_cosine_mean, "grad_cosine_mean " + at);
          ASSERT_EQ(got.per_rank.size(), base.per_rank.size());
          for (size_t r = 0; r < w; ++r) {
            ExpectSameBits(got.per_rank[r].consensus_cosine, base.per_rank[r].consensus_cosine,
                           "consensus " + at + " rank index " + std::to_string(r));
          }
        }
        const StepStatistics chosen = ComputeStepStatistics(packed.samples);
        ExpectSameBits(chosen.grad_cosine_mean, base.grad_cosine_mean, "dispatched");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, StepStatsPackedTest,
                         ::testing::Values(SketchEncoding::kFloat16, SketchEncoding::kInt8),
                         [](const ::testing::TestParamInfo<SketchEncoding>& info) {
                           return std::string(SketchEncodingName(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// Scale: 10,000 ranks x k = 1024 must be O(W k). An O(W^2 k) slip would take minutes; the bound
// is loose enough for a loaded shared machine and a sanitizer build.

TEST(StepStatsScaleTest, TenThousandRanksIsLinear) {
  Step step = RandomStep(10000, 1024, 7);
  const auto start = std::chrono::steady_clock::now();
  const StepStatistics got = ComputeStepStatistics(step.samples);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("ComputeStepStatistics(W=10000, k=1024): %.1f ms\n", seconds * 1e3);
  EXPECT_EQ(got.per_rank.size(), 10000u);
  EXPECT_TRUE(std::isfinite(got.grad_cosine_mean));
  EXPECT_LT(seconds, 10.0);
}

}  // namespace
}  // namespace rankscope::collector
