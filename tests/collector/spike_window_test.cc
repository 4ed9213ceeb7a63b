// Tests of the Prometheus export's spike window: WorstOf's NaN rule and how long a step counts.
#include "collector/metrics/spike_window.h"

#include <cmath>
#include <limits>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const absl::Time kStart = absl::FromUnixSeconds(1'700'000'000);
const absl::Duration kWindow = absl::Seconds(60);  // buckets of 1 s

WindowValues Values(double dispersion, double cosine, double divergent = kNaN) {
  return WindowValues{dispersion, dispersion, dispersion, cosine, divergent};
}

TEST(WorstOfTest, LargestDispersionSmallestCosineNanIgnoredUnlessBoth) {
  const WindowValues worst = WorstOf(Values(1.0, 0.5, 2.0), Values(3.0, 0.9, kNaN));
  EXPECT_EQ(worst.loss_std, 3.0);
  EXPECT_EQ(worst.loss_range, 3.0);
  EXPECT_EQ(worst.grad_norm_cv, 3.0);
  EXPECT_EQ(worst.grad_cosine_mean, 0.5);
  EXPECT_EQ(worst.replica_divergent, 2.0);

  const WindowValues nan_first = WorstOf(Values(kNaN, kNaN), Values(1.0, 0.2));
  EXPECT_EQ(nan_first.loss_std, 1.0);
  EXPECT_EQ(nan_first.grad_cosine_mean, 0.2);
  EXPECT_TRUE(std::isnan(WorstOf(Values(kNaN, kNaN), Values(kNaN, kNaN)).loss_std));
  EXPECT_TRUE(std::isnan(WorstOf(Values(kNaN, kNaN), Values(kNaN, kNaN)).grad_cosine_mean));
}

TEST(SpikeWindowTest, AStepCountsForTheWindowThenLeaves) {
  SpikeWindow window;
  window.Add(kStart, kWindow, Values(5.0, -0.5));
  const WindowValues latest = Values(1.0, 0.9);
  EXPECT_EQ(window.Worst(kStart + absl::Seconds(30), kWindow, latest).loss_std, 5.0);
  EXPECT_EQ(window.Worst(kStart + kWindow, kWindow, latest).grad_cosine_mean, -0.5);
  // At most one bucket (1 s) later it no longer counts.
  const WindowValues after = window.Worst(kStart + kWindow + absl::Seconds(1), kWindow, latest);
  EXPECT_EQ(after.loss_std, 1.0);
  EXPECT_EQ(after.grad_cosine_mean, 0.9);
}

TEST(SpikeWindowTest, StepsOfOneBucketMergeAndTheWorstStays) {
  SpikeWindow window;
  window.Add(kStart, kWindow, Values(2.0, 0.1, 3.0));
  window.Add(kStart + absl::Milliseconds(500), kWindow, Values(1.0, 0.7, kNaN));
  const WindowValues worst = window.Worst(kStart + absl::Seconds(2), kWindow, Values(0.0, 1.0));
  EXPECT_EQ(worst.loss_std, 2.0);
  EXPECT_EQ(worst.grad_cosine_mean, 0.1);
  EXPECT_EQ(worst.replica_divergent, 3.0);
}

TEST(SpikeWindowTest, NoWindowKeepsNothing) {
  SpikeWindow window;
  window.Add(kStart, absl::ZeroDuration(), Values(9.0, -1.0));
  const WindowValues worst = window.Worst(kStart, absl::ZeroDuration(), Values(1.0, 0.9));
  EXPECT_EQ(worst.loss_std, 1.0);
  EXPECT_EQ(worst.grad_cosine_mean, 0.9);
}

TEST(SpikeWindowTest, TheLatestAlwaysCountsAndAClockGoingBackMerges) {
  SpikeWindow window;
  window.Add(kStart + absl::Seconds(10), kWindow, Values(1.0, 0.9));
  window.Add(kStart, kWindow, Values(4.0, 0.9));  // earlier than the back: merged into it
  EXPECT_EQ(window.Worst(kStart + absl::Seconds(65), kWindow, Values(0.5, 0.9)).loss_std, 4.0);
  EXPECT_EQ(window.Worst(kStart + absl::Seconds(75), kWindow, Values(0.5, 0.9)).loss_std, 0.5);
}

}  // namespace
}  // namespace rankscope::collector
