#include "collector/analysis/step_analysis.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/pipeline/step_joiner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Reason = JoinedStep::Reason;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

// Rank r's report: loss 1 + r/100, grad norm 2 + r/100, a sketch along the first axis of `dim`
// values (all ranks agree: consensus cosine 1), received r ms after kT0.
RankReport Report(uint32_t rank, uint64_t step, size_t dim = 4) {
  RankReport r;
  r.rank = rank;
  r.step = step;
  r.attempt = 2;
  r.loss = 1.0 + rank / 100.0;
  r.grad_norm = 2.0 + rank / 100.0;
  r.sketch.assign(dim, 0.0f);
  r.sketch[0] = 1.0f + rank / 1000.0f;
  r.sketch[1] = 0.01f * static_cast<float>(rank % 3);
  r.received_at = kT0 + absl::Milliseconds(rank);
  return r;
}

JoinedStep Step(uint64_t step, uint32_t world, const std::vector<uint32_t>& ranks,
                Reason reason = Reason::kComplete) {
  JoinedStep js;
  js.job = "exp-42";
  js.step = step;
  js.attempt = 2;
  js.world_size = world;
  js.reason = reason;
  for (uint32_t r = 0, i = 0; r < world; ++r) {
    if (i < ranks.size() && ranks[i] == r) {
      js.reports.push_back(Report(r, step));
      ++i;
    } else {
      js.missing_ranks.push_back(r);
    }
  }
  return js;
}

std::vector<uint32_t> AllRanks(uint32_t world) {
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < world; ++r) out.push_back(r);
  return out;
}

std::vector<uint32_t> RowRanks(const StepWrite& w) {
  std::vector<uint32_t> out;
  for (const RankRow& r : w.ranks) out.push_back(r.rank);
  return out;
}

TEST(StepAnalysisTest, CompleteStepRows) {
  StepAnalyzer analyzer;
  const JoinedStep js = Step(7, 4, AllRanks(4));
  AnalyzedStep a = analyzer.Analyze(js);
  const absl::Time done = kT0 + absl::Seconds(1);
  const StepWrite w = StepRows(js, std::move(a), done);

  EXPECT_EQ(w.job, "exp-42");
  EXPECT_EQ(w.step, 7u);
  ASSERT_TRUE(w.stats.has_value());
  const StepRow& s = *w.stats;
  EXPECT_EQ(s.step, 7u);
  EXPECT_EQ(s.attempt, 2u);
  EXPECT_EQ(s.ranks, 4u);
  EXPECT_EQ(s.world_size, 4u);
  EXPECT_FALSE(s.timed_out);
  EXPECT_THAT(s.missing_ranks, IsEmpty());
  EXPECT_EQ(s.completed_at, done);
  EXPECT_NEAR(s.loss_mean, 1.015, 1e-12);
  EXPECT_NEAR(s.loss_range, 0.03, 1e-12);
  EXPECT_NEAR(s.loss_std, std::sqrt(0.000125), 1e-12);  // population std of 1.00 .. 1.03
  EXPECT_NEAR(s.grad_norm_mean, 2.015, 1e-12);
  EXPECT_GT(s.grad_cosine_mean, 0.99);
  EXPECT_LE(s.grad_cosine_mean, 1.0 + 1e-9);
  EXPECT_FALSE(s.replica_checked);
  EXPECT_THAT(s.replica_divergent_ranks, IsEmpty());
  EXPECT_THAT(s.outlier_ranks, IsEmpty());
  EXPECT_TRUE(std::isnan(s.grad_noise_scale));  // no reduced norm reported

  EXPECT_THAT(RowRanks(w), ElementsAre(0, 1, 2, 3));
  for (const RankRow& r : w.ranks) {
    EXPECT_EQ(r.attempt, 2u);
    EXPECT_EQ(r.join_size, 4u);
    EXPECT_DOUBLE_EQ(r.loss, 1.0 + r.rank / 100.0);
    EXPECT_DOUBLE_EQ(r.grad_norm, 2.0 + r.rank / 100.0);
    EXPECT_EQ(r.received_at, kT0 + absl::Milliseconds(r.rank));
    ASSERT_TRUE(r.grad_cosine.has_value());
    EXPECT_GT(*r.grad_cosine, 0.99);
    ASSERT_TRUE(r.loss_z.has_value());
    ASSERT_TRUE(r.outlier_score.has_value());
    EXPECT_LT(*r.outlier_score, kOutlierThreshold);
    EXPECT_FALSE(r.replica_ok.has_value());  // no fingerprint sent
    EXPECT_FALSE(r.step_time_z.has_value());
  }
  // The loss z-scores are ordered like the losses.
  EXPECT_LT(*w.ranks[0].loss_z, 0.0);
  EXPECT_GT(*w.ranks[3].loss_z, 0.0);
}

TEST(StepAnalysisTest, StepWithAMissingRankNamesItAndJoinsTheOthers) {
  StepAnalyzer analyzer;
  const JoinedStep js = Step(8, 4, {0, 1, 3}, Reason::kTimedOut);
  const StepWrite w = StepRows(js, analyzer.Analyze(js), kT0);
  ASSERT_TRUE(w.stats.has_value());
  EXPECT_EQ(w.stats->ranks, 3u);
  EXPECT_EQ(w.stats->world_size, 4u);
  EXPECT_TRUE(w.stats->timed_out);
  EXPECT_EQ(w.stats->missing_ranks, "2");
  EXPECT_NEAR(w.stats->loss_mean, (1.00 + 1.01 + 1.03) / 3, 1e-12);
  EXPECT_THAT(RowRanks(w), ElementsAre(0, 1, 3));
  for (const RankRow& r : w.ranks) EXPECT_EQ(r.join_size, 3u);
}

TEST(StepAnalysisTest, MixedSketchDimsMaskEveryCosine) {
  JoinedStep js = Step(9, 4, AllRanks(4));
  // Ranks 2 and 3 already applied a control's re-tuned sketch (8 values instead of 4).
  js.reports[2].sketch = Report(2, 9, 8).sketch;
  js.reports[3].sketch = Report(3, 9, 8).sketch;
  StepAnalyzer analyzer;
  const StepWrite w = StepRows(js, analyzer.Analyze(js), kT0);
  ASSERT_TRUE(w.stats.has_value());
  EXPECT_TRUE(std::isnan(w.stats->grad_cosine_mean));
  EXPECT_NEAR(w.stats->loss_mean, 1.015, 1e-12);  // the rest is still computed
  ASSERT_EQ(w.ranks.size(), 4u);
  for (const RankRow& r : w.ranks) {
    ASSERT_TRUE(r.grad_cosine.has_value());
    EXPECT_TRUE(std::isnan(*r.grad_cosine)) << "rank " << r.rank;
    EXPECT_TRUE(r.loss_z.has_value());
  }

  // The same step with one sketch length has its cosines.
  const JoinedStep same = Step(9, 4, AllRanks(4));
  const StepWrite ok = StepRows(same, analyzer.Analyze(same), kT0);
  EXPECT_FALSE(std::isnan(ok.stats->grad_cosine_mean));
}

TEST(StepAnalysisTest, OutlierStreakReachesThePersistenceRuleOnTheThirdStep) {
  static_assert(kOutlierPersistence == 3);
  StepAnalyzer analyzer;
  auto step_with_outlier = [](uint64_t step, const std::vector<uint32_t>& ranks) {
    JoinedStep js = Step(step, 8, ranks);
    for (RankReport& r : js.reports) {
      if (r.rank == 5) r.loss = 50.0;  // far outside the others' 1.00 .. 1.07
    }
    return js;
  };

  // Steps 1 and 2: rank 5 is flagged but not yet a persistent outlier.
  for (uint64_t step = 1; step <= 2; ++step) {
    const JoinedStep js = step_with_outlier(step, AllRanks(8));
    AnalyzedStep a = analyzer.Analyze(js);
    EXPECT_THAT(a.diag.flagged_ranks, ElementsAre(5)) << "step " << step;
    EXPECT_THAT(a.outlier_ranks, IsEmpty()) << "step " << step;
    EXPECT_EQ(analyzer.OutlierStreak("exp-42", 5), step);
    const StepWrite w = StepRows(js, std::move(a), kT0);
    EXPECT_THAT(w.stats->outlier_ranks, IsEmpty());
    EXPECT_GT(*w.ranks[5].outlier_score, kOutlierThreshold);
  }

  // A step rank 5 did not report neither breaks nor extends its streak.
  {
    const JoinedStep js = step_with_outlier(3, {0, 1, 2, 3, 4, 6, 7});
    const AnalyzedStep a = analyzer.Analyze(js);
    EXPECT_THAT(a.outlier_ranks, IsEmpty());
    EXPECT_EQ(analyzer.OutlierStreak("exp-42", 5), 2u);
  }

  // The third flagged step it reported makes it a persistent outlier, stored in step_stats.
  {
    const JoinedStep js = step_with_outlier(4, AllRanks(8));
    const StepWrite w = StepRows(js, analyzer.Analyze(js), kT0);
    EXPECT_THAT(w.stats->outlier_ranks, ElementsAre(5));
    EXPECT_EQ(analyzer.OutlierStreak("exp-42", 5), 3u);
  }
  // And every further flagged step keeps it one.
  {
    const JoinedStep js = step_with_outlier(5, AllRanks(8));
    EXPECT_THAT(analyzer.Analyze(js).outlier_ranks, ElementsAre(5));
  }

  // A healthy step it reports ends the streak; another job's streaks are separate.
  {
    JoinedStep other = step_with_outlier(6, AllRanks(8));
    other.job = "exp-43";
    EXPECT_THAT(analyzer.Analyze(other).outlier_ranks, IsEmpty());
    EXPECT_EQ(analyzer.OutlierStreak("exp-43", 5), 1u);

    const JoinedStep healthy = Step(6, 8, AllRanks(8));
    const AnalyzedStep a = analyzer.Analyze(healthy);
    EXPECT_THAT(a.diag.flagged_ranks, IsEmpty());
    EXPECT_THAT(a.outlier_ranks, IsEmpty());
    EXPECT_EQ(analyzer.OutlierStreak("exp-42", 5), 0u);
  }
}

// What Prometheus exports is the score held over the rank's last 3 reported steps: a job that
// stops stepping holds its latest step, so one noisy step must not read as an outlier.
TEST(StepAnalysisTest, HeldOutlierScoreIsTheSmallestOfTheRanksLastThreeSteps) {
  static_assert(kOutlierPersistence == 3);
  StepAnalyzer analyzer;
  auto analyze = [&](uint64_t step, const std::vector<uint32_t>& ranks, double rank5_loss) {
    JoinedStep js = Step(step, 8, ranks);
    for (RankReport& r : js.reports) {
      if (r.rank == 5) r.loss = rank5_loss;
    }
    AnalyzedStep a = analyzer.Analyze(js);
    for (size_t i = 0; i < js.reports.size(); ++i) {
      if (js.reports[i].rank == 5) {
        return std::make_pair(a.diag.outliers[i].score, a.diag.extras[i].held_outlier_score);
      }
    }
    ADD_FAILURE() << "rank 5 not in step " << step;
    return std::make_pair(0.0, 0.0);
  };

  // Its first step: only that step to hold.
  const auto [first, first_held] = analyze(1, AllRanks(8), 1.03);
  EXPECT_EQ(first_held, first);
  const auto [second, second_held] = analyze(2, AllRanks(8), 1.03);
  EXPECT_EQ(second_held, std::min(first, second));
  ASSERT_LT(second_held, kOutlierThreshold);

  // One far-off step: flagged, but what is held stays the healthy steps' score, also while the
  // job stops there.
  const auto [noisy, noisy_held] = analyze(3, AllRanks(8), 50.0);
  EXPECT_GT(noisy, kOutlierThreshold);
  EXPECT_EQ(noisy_held, std::min({first, second, noisy}));
  EXPECT_LT(noisy_held, kOutlierThreshold);

  // A step it did not report changes nothing; the third far-off step it reported is held.
  analyzer.Analyze(Step(4, 8, {0, 1, 2, 3, 4, 6, 7}));
  const auto [fourth, fourth_held] = analyze(5, AllRanks(8), 60.0);
  EXPECT_EQ(fourth_held, std::min(second, noisy));
  const auto [fifth, fifth_held] = analyze(6, AllRanks(8), 70.0);
  EXPECT_EQ(fifth_held, std::min({noisy, fourth, fifth}));
  EXPECT_GT(fifth_held, kOutlierThreshold);
  EXPECT_EQ(analyzer.OutlierStreak("exp-42", 5), 3u);

  // A NaN score (non-finite loss) is passed over while a finite one is held, and held when
  // all three are NaN.
  const auto [nan1, nan1_held] = analyze(7, AllRanks(8), std::nan(""));
  EXPECT_TRUE(std::isnan(nan1));
  EXPECT_EQ(nan1_held, std::min(fourth, fifth));
  analyze(8, AllRanks(8), std::nan(""));
  const auto [nan3, nan3_held] = analyze(9, AllRanks(8), std::nan(""));
  EXPECT_TRUE(std::isnan(nan3_held));
  EXPECT_EQ(analyzer.OutlierStreak("exp-42", 5), 6u);
}

// Sequential statistics (rank_cusum.h): a rank that is late on every step is named in slow_ranks
// after a fixed number of steps; its state is per job and epoch and freed with the job.
TEST(StepAnalysisTest, AlwaysTheSlowestRankIsNamedSlowAndItsStateIsFreedWithTheJob) {
  StepAnalyzer analyzer;
  // W = 8: late from the 4th step (kSlowMinWindowSteps), +1 a step: above h = 7 + ln 2 = 7.69 on
  // the 11th.
  auto slow_step = [](uint64_t step) {
    JoinedStep js = Step(step, 8, AllRanks(8));
    for (RankReport& r : js.reports) {
      r.step_time_seconds = 0.1 + 0.001 * ((r.rank * 5) % 8);
      r.loss = 1.0 + 0.01 * ((r.rank * 3 + step) % 8);  // nobody is always the worst
      r.grad_norm = 2.0 + 0.01 * ((r.rank * 5 + step) % 8);
    }
    js.reports[3].step_time_seconds = 0.3;
    return js;
  };
  for (uint64_t step = 1; step <= 11; ++step) {
    const JoinedStep js = slow_step(step);
    AnalyzedStep a = analyzer.Analyze(js);
    EXPECT_EQ(a.diag.extras[3].slow_score > 0.0, step >= 4) << step;
    if (step < 11) {
      EXPECT_THAT(a.slow_ranks, IsEmpty()) << step;
      EXPECT_LT(a.diag.extras[3].slow_score, 1.0) << step;
    } else {
      EXPECT_THAT(a.slow_ranks, ElementsAre(3));
      EXPECT_GT(a.diag.extras[3].slow_score, 1.0);
      const StepWrite w = StepRows(js, std::move(a), kT0);
      EXPECT_THAT(w.stats->slow_ranks, ElementsAre(3));
      EXPECT_THAT(w.stats->drifting_ranks, IsEmpty());
    }
  }
  EXPECT_TRUE(analyzer.Drift("exp-42", 3).is_slow);
  EXPECT_EQ(analyzer.drift_jobs(), 1u);
  // A new epoch starts from zero.
  JoinedStep restarted = slow_step(10);
  restarted.attempt = 3;
  EXPECT_THAT(analyzer.Analyze(restarted).slow_ranks, IsEmpty());
  EXPECT_FALSE(analyzer.Drift("exp-42", 3).is_slow);
  analyzer.ForgetJob("exp-42");
  EXPECT_EQ(analyzer.drift_jobs(), 0u);
  EXPECT_EQ(analyzer.Drift("exp-42", 3).slow, 0.0);
}

TEST(StepAnalysisTest, DivergentReplicaFingerprintIsNamedInRows) {
  JoinedStep js = Step(10, 4, AllRanks(4));
  for (RankReport& r : js.reports) {
    r.param_fingerprint = r.rank == 1 ? 99 : 42;
    r.reduced_grad_norm = 1.5;
    r.local_batch_size = 8;
  }
  StepAnalyzer analyzer;
  const StepWrite w = StepRows(js, analyzer.Analyze(js), kT0);
  EXPECT_TRUE(w.stats->replica_checked);
  EXPECT_THAT(w.stats->replica_divergent_ranks, ElementsAre(1));
  ASSERT_EQ(w.ranks.size(), 4u);
  for (const RankRow& r : w.ranks) {
    EXPECT_EQ(r.param_fingerprint, r.rank == 1 ? 99u : 42u);
    ASSERT_TRUE(r.replica_ok.has_value());
    EXPECT_EQ(*r.replica_ok, r.rank != 1);
  }
}

TEST(StepAnalysisTest, LateReportRowCarriesOnlyTheReport) {
  RankReport r = Report(3, 11);
  r.step_time_seconds = 0.25;
  const RankRow row = ToRankRow(r, 1);
  EXPECT_EQ(row.rank, 3u);
  EXPECT_EQ(row.attempt, 2u);
  EXPECT_EQ(row.join_size, 1u);
  EXPECT_DOUBLE_EQ(row.loss, 1.03);
  EXPECT_EQ(row.step_time_seconds, 0.25);
  EXPECT_FALSE(row.grad_cosine.has_value());
  EXPECT_FALSE(row.outlier_score.has_value());
}

// Ranks 1 and 3 computed the same gradient (the same data); ranks 0 and 2 point elsewhere. The
// step row names the group; a step that mixes sketch lengths compares nothing.
TEST(StepAnalysisTest, DuplicateRanksAreNamedInTheStepRow) {
  JoinedStep js = Step(7, 4, AllRanks(4));
  const std::vector<std::vector<float>> sketches = {
      {1, 0, 0, 0}, {0, 1, 1, 0}, {0, 0, 0, 1}, {0, 1, 1, 0}};
  for (size_t i = 0; i < 4; ++i) js.reports[i].sketch = sketches[i];
  StepAnalyzer analyzer;
  AnalyzedStep analyzed = analyzer.Analyze(js);
  ASSERT_EQ(analyzed.duplicates.size(), 1u);
  EXPECT_THAT(analyzed.duplicates[0].ranks, ElementsAre(1, 3));
  EXPECT_TRUE(analyzed.duplicates[0].exact);
  const StepWrite w = StepRows(js, std::move(analyzed), kT0);
  ASSERT_TRUE(w.stats.has_value());
  EXPECT_EQ(w.stats->duplicate_groups, "1,3");

  js.reports[2].sketch.assign(8, 0.5f);  // a re-tune crossed this step
  EXPECT_THAT(analyzer.Analyze(js).duplicates, IsEmpty());
}

// With a duplicate pair the ranks are not exchangeable (the pair's consensus cosines are high, the
// others' low): the data-drift statistics are held on such steps, so ranks 0 and 2 never drift.
TEST(StepAnalysisTest, StepsWithDuplicateRanksHoldTheDataDriftStatistics) {
  StepAnalyzer analyzer;
  const std::vector<std::vector<float>> sketches = {
      {1, 0, 0, 0}, {0, 1, 1, 0}, {0, 0, 0, 1}, {0, 1, 1, 0}};
  for (uint64_t step = 1; step <= 40; ++step) {
    JoinedStep js = Step(step, 4, AllRanks(4));
    for (size_t i = 0; i < 4; ++i) {
      js.reports[i].sketch = sketches[i];
      js.reports[i].loss = 1.0 + 0.01 * ((i + step) % 4);  // nobody is always the worst
      js.reports[i].grad_norm = 2.0 + 0.01 * ((i * 3 + step) % 4);
    }
    const AnalyzedStep a = analyzer.Analyze(js);
    ASSERT_EQ(a.duplicates.size(), 1u);
    EXPECT_THAT(a.drifting_ranks, IsEmpty()) << step;
  }
  EXPECT_EQ(analyzer.Drift("exp-42", 0).data, 0.0);
  EXPECT_EQ(analyzer.Drift("exp-42", 2).data, 0.0);
}

}  // namespace
}  // namespace rankscope::collector

namespace rankscope::collector {
namespace {

// Where in the model: a rank whose gradient norm is 50x in one bucket is flagged (its gradient
// norm's robust z) and its row names that bucket; the healthy ranks' rows name none and keep no
// per-bucket norms (step 7 is not a sampled step), the flagged row keeps its norms and z.
TEST(StepAnalysisTest, FlaggedRankNamesTheBucketThatCarriesItsDeviation) {
  StepAnalyzer analyzer;
  JoinedStep js = Step(7, 5, AllRanks(5));
  js.bucket_names = std::make_shared<const std::vector<std::string>>(
      std::vector<std::string>{"embed", "layers.0-3.attn", "layers.20-23.mlp"});
  for (RankReport& r : js.reports) {
    r.bucket_norms = {1.0f + r.rank / 100.0f, 2.0f - r.rank / 100.0f, 1.5f + r.rank / 200.0f};
  }
  js.reports[3].bucket_norms[2] *= 50.0f;
  js.reports[3].grad_norm *= 30.0;
  AnalyzedStep a = analyzer.Analyze(js);
  const StepWrite w = StepRows(js, std::move(a), kT0);
  ASSERT_EQ(w.ranks.size(), 5u);
  for (const RankRow& row : w.ranks) {
    if (row.rank == 3) {
      EXPECT_THAT(row.deviating_buckets, ::testing::StartsWith("layers.20-23.mlp z="));
      EXPECT_EQ(row.deviating_buckets.find(';'), std::string::npos) << row.deviating_buckets;
      EXPECT_EQ(row.bucket_norms.size(), 3u);
      EXPECT_EQ(row.bucket_z.size(), 3u);
    } else {
      EXPECT_THAT(row.deviating_buckets, IsEmpty()) << row.rank;
      EXPECT_THAT(row.bucket_norms, IsEmpty()) << row.rank;
    }
  }
  // A sampled step keeps every rank's norms.
  JoinedStep sampled = Step(kBucketSampleEvery, 5, AllRanks(5));
  for (RankReport& r : sampled.reports) r.bucket_norms = {1.0f, 2.0f, 3.0f + r.rank / 100.0f};
  const StepWrite ws = StepRows(sampled, analyzer.Analyze(sampled), kT0);
  for (const RankRow& row : ws.ranks) EXPECT_EQ(row.bucket_norms.size(), 3u) << row.rank;
}

}  // namespace
}  // namespace rankscope::collector

namespace rankscope::collector {
namespace {

// The parameters are compared within the tolerance when every rank that sent a fingerprint sent
// its summary (replica_tolerance.h), bit for bit otherwise; the reduced gradient likewise, with
// the reduction's rounding from the ranks' local norms.
TEST(StepAnalysisTest, SummariesSelectTheToleranceCheck) {
  auto step = [](bool summaries, double drift) {
    JoinedStep js = Step(10, 4, AllRanks(4));
    for (RankReport& r : js.reports) {
      r.param_fingerprint = r.rank == 2 ? 2 : 1;  // rank 2's bits differ
      r.reduced_grad_fingerprint = 100 + r.rank;  // every rank's bits differ
      if (!summaries) continue;
      ReplicaSummary s;
      s.projections = {1.0, -2.0, 3.0, 0.5};
      s.rounding = 1e-7;
      if (r.rank == 2) s.projections[1] += drift;
      r.param_summary = s;
      s.precision = 24;
      s.projections[0] += 1e-9 * r.rank;  // rounding-sized, far below 2 * 2^-24 * 4.06
      r.reduced_grad_summary = s;
    }
    return DiagnoseStep(js, ComputeJoinedStepStatistics(js));
  };
  const StepDiagnostics exact = step(false, 0.0);
  EXPECT_FALSE(exact.replica_tolerance);
  EXPECT_THAT(exact.replica_divergent, ElementsAre(0u, 1u, 2u, 3u));  // no gradient majority

  const StepDiagnostics near = step(true, 1e-7);  // 1e-7 < 32 * 1e-7
  EXPECT_TRUE(near.replica_tolerance);
  EXPECT_THAT(near.replica_divergent, IsEmpty());
  EXPECT_THAT(near.replica_within_tolerance, ElementsAre(0u, 1u, 2u, 3u));
  for (const std::optional<bool>& ok : near.replica_ok) EXPECT_EQ(ok, std::optional<bool>(true));
  EXPECT_LT(near.replica_tolerance_ratio, 1.0);

  const StepDiagnostics far = step(true, 1e-3);
  EXPECT_THAT(far.replica_divergent, ElementsAre(2u));
  EXPECT_EQ(far.replica_ok[2], std::optional<bool>(false));
  EXPECT_GT(far.replica_tolerance_ratio, 1.0);
}

}  // namespace
}  // namespace rankscope::collector
