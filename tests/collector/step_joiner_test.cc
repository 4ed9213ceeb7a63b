#include "collector/pipeline/step_joiner.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Reason = JoinedStep::Reason;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

RankReport MakeReport(uint32_t rank, uint64_t step, uint32_t attempt = 0, uint64_t seq = 0) {
  RankReport r;
  r.rank = rank;
  r.step = step;
  r.attempt = attempt;
  r.loss = 1.0 + rank;
  r.grad_norm = 2.0 + rank;
  r.sketch = {1.0f, 2.0f, 3.0f};
  r.acks.push_back(AckHandle{nullptr, seq});
  return r;
}

std::vector<uint32_t> Ranks(const JoinedStep& js) {
  std::vector<uint32_t> out;
  for (const RankReport& r : js.reports) out.push_back(r.rank);
  return out;
}

std::vector<uint64_t> Seqs(const std::vector<AckHandle>& acks) {
  std::vector<uint64_t> out;
  for (const AckHandle& a : acks) out.push_back(a.seq);
  return out;
}

class StepJoinerTest : public ::testing::Test {
 protected:
  explicit StepJoinerTest(JoinerOptions options = {}) : joiner_(options) {}

  // Adds a fresh report and returns the outcome; closed steps accumulate in closed_.
  AddOutcome Add(const std::string& job, uint32_t rank, uint64_t step, uint32_t attempt = 0,
                 uint64_t seq = 0) {
    RankReport r = MakeReport(rank, step, attempt, seq);
    return joiner_.Add(job, r, now_, &closed_);
  }

  std::vector<JoinedStep> TakeClosed() { return std::exchange(closed_, {}); }

  StepJoiner joiner_;
  absl::Time now_ = kT0;
  std::vector<JoinedStep> closed_;
};

// ---------------------------------------------------------------------------------------------
// Registration and preconditions.

TEST_F(StepJoinerTest, RegisterJobChecksWorldSize) {
  EXPECT_TRUE(joiner_.RegisterJob("exp-42", 8).ok());
  EXPECT_TRUE(joiner_.RegisterJob("exp-42", 8).ok());
  const absl::Status st = joiner_.RegisterJob("exp-42", 16);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("world_size 16 != 8 for job exp-42"));
  EXPECT_EQ(joiner_.RegisterJob("zero", 0).code(), absl::StatusCode::kInvalidArgument);
  // The failed re-registration changed nothing: 8 reports still complete a step.
  for (uint32_t r = 0; r < 8; ++r) Add("exp-42", r, 1);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].world_size, 8u);
}

TEST_F(StepJoinerTest, ForgetClosedStepMakesResendsOfADroppedStepJoinAgain) {
  ASSERT_TRUE(joiner_.RegisterJob("dropped", 2).ok());
  EXPECT_EQ(Add("dropped", 0, 7), AddOutcome::kAccepted);
  EXPECT_EQ(Add("dropped", 1, 7), AddOutcome::kAccepted);
  ASSERT_EQ(TakeClosed().size(), 1u);
  // Stored: a resend is a duplicate (acked, nothing stored again).
  EXPECT_EQ(Add("dropped", 0, 7), AddOutcome::kDuplicate);

  // The store writer dropped the step unstored: resends must be joined and stored again.
  joiner_.ForgetClosedStep("dropped", 7, /*attempt=*/0);
  EXPECT_EQ(Add("dropped", 0, 7, 0, /*seq=*/10), AddOutcome::kAccepted);
  EXPECT_EQ(Add("dropped", 1, 7, 0, /*seq=*/11), AddOutcome::kAccepted);
  const std::vector<JoinedStep> again = TakeClosed();
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].reason, Reason::kComplete);
  EXPECT_THAT(Ranks(again[0]), ElementsAre(0u, 1u));
  EXPECT_THAT(Seqs(again[0].reports[0].acks), ElementsAre(10u));

  // Only the attempt that was dropped is forgotten; unknown jobs and steps are no-ops.
  EXPECT_EQ(Add("dropped", 0, 8, 1), AddOutcome::kAccepted);
  EXPECT_EQ(Add("dropped", 1, 8, 1), AddOutcome::kAccepted);
  ASSERT_EQ(TakeClosed().size(), 1u);
  joiner_.ForgetClosedStep("dropped", 8, /*attempt=*/0);
  EXPECT_EQ(Add("dropped", 0, 8, 1), AddOutcome::kDuplicate);
  joiner_.ForgetClosedStep("never-registered", 8, 0);
  joiner_.ForgetClosedStep("dropped", 12345, 0);
  EXPECT_EQ(joiner_.open_steps("dropped"), 0u);
}

TEST_F(StepJoinerTest, ForgetJobClosesItsStepsAndAllowsANewWorldSize) {
  ASSERT_TRUE(joiner_.RegisterJob("reused", 4).ok());
  ASSERT_TRUE(joiner_.RegisterJob("other", 2).ok());
  Add("reused", 0, 1);
  Add("reused", 1, 1);
  Add("reused", 2, 1);
  Add("reused", 3, 1);  // complete, remembered
  now_ += absl::Seconds(1);
  Add("reused", 2, 3);
  now_ += absl::Seconds(1);
  Add("other", 0, 1);
  Add("reused", 1, 2);
  TakeClosed();

  joiner_.ForgetJob("reused", &closed_);
  ASSERT_EQ(closed_.size(), 2u);
  EXPECT_EQ(closed_[0].step, 3u);  // opened first
  EXPECT_EQ(closed_[1].step, 2u);
  for (const JoinedStep& js : closed_) {
    EXPECT_EQ(js.reason, Reason::kEvicted);
    EXPECT_EQ(js.job, "reused");
  }
  EXPECT_THAT(closed_[1].missing_ranks, ElementsAre(0u, 2u, 3u));
  EXPECT_EQ(joiner_.open_steps("reused"), 0u);
  EXPECT_EQ(joiner_.remembered_steps("reused"), 0u);
  EXPECT_EQ(joiner_.open_steps_total(), 1u);  // the other job's step is untouched
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(32));
  EXPECT_EQ(Add("reused", 0, 9), AddOutcome::kUnknownJob);

  // A new run under the same name, with another shape: nothing of the old one is remembered.
  ASSERT_TRUE(joiner_.RegisterJob("reused", 2).ok());
  TakeClosed();
  EXPECT_EQ(Add("reused", 0, 1), AddOutcome::kAccepted);
  EXPECT_EQ(Add("reused", 1, 1), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].world_size, 2u);
  EXPECT_EQ(closed_[0].reason, Reason::kComplete);

  joiner_.ForgetJob("never-registered", &closed_);  // no-op
  EXPECT_EQ(closed_.size(), 1u);
}

TEST_F(StepJoinerTest, UnknownJobAndRankOutOfRangeChangeNothing) {
  ASSERT_TRUE(joiner_.RegisterJob("a", 4).ok());
  RankReport unknown = MakeReport(0, 1, 0, 11);
  EXPECT_EQ(joiner_.Add("nope", unknown, now_, &closed_), AddOutcome::kUnknownJob);
  EXPECT_EQ(unknown.sketch.size(), 3u);  // not moved from
  EXPECT_THAT(Seqs(unknown.acks), ElementsAre(11u));
  RankReport out_of_range = MakeReport(4, 1, 0, 12);
  EXPECT_EQ(joiner_.Add("a", out_of_range, now_, &closed_), AddOutcome::kRankOutOfRange);
  EXPECT_EQ(out_of_range.sketch.size(), 3u);
  EXPECT_EQ(joiner_.open_steps("a"), 0u);
  EXPECT_EQ(joiner_.open_steps("nope"), 0u);
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
  EXPECT_EQ(joiner_.NextDeadline(), absl::InfiniteFuture());
  EXPECT_THAT(closed_, IsEmpty());
}

// ---------------------------------------------------------------------------------------------
// Completion and timeout.

TEST_F(StepJoinerTest, CompletesWhenAllRanksReport) {
  ASSERT_TRUE(joiner_.RegisterJob("exp-42", 4).ok());
  const uint32_t order[] = {2, 0, 3};
  for (uint32_t r : order) {
    EXPECT_EQ(Add("exp-42", r, 7, 0, 100 + r), AddOutcome::kAccepted);
    now_ += absl::Seconds(1);
  }
  EXPECT_THAT(closed_, IsEmpty());
  EXPECT_EQ(joiner_.open_steps("exp-42"), 1u);
  EXPECT_EQ(Add("exp-42", 1, 7, 0, 101), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 1u);
  const JoinedStep& js = closed_[0];
  EXPECT_EQ(js.job, "exp-42");
  EXPECT_EQ(js.step, 7u);
  EXPECT_EQ(js.attempt, 0u);
  EXPECT_EQ(js.world_size, 4u);
  EXPECT_EQ(js.reason, Reason::kComplete);
  EXPECT_EQ(js.opened_at, kT0);
  EXPECT_THAT(Ranks(js), ElementsAre(0u, 1u, 2u, 3u));
  EXPECT_THAT(js.missing_ranks, IsEmpty());
  for (const RankReport& r : js.reports) {
    EXPECT_EQ(r.loss, 1.0 + r.rank);
    EXPECT_THAT(Seqs(r.acks), ElementsAre(100u + r.rank));
  }
  EXPECT_EQ(joiner_.open_steps("exp-42"), 0u);
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
  EXPECT_EQ(joiner_.NextDeadline(), absl::InfiniteFuture());
  EXPECT_EQ(joiner_.remembered_steps("exp-42"), 1u);
}

TEST_F(StepJoinerTest, SingleRankJobCompletesAtOnce) {
  ASSERT_TRUE(joiner_.RegisterJob("solo", 1).ok());
  EXPECT_EQ(Add("solo", 0, 1), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].reason, Reason::kComplete);
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
  EXPECT_EQ(joiner_.NextDeadline(), absl::InfiniteFuture());
  EXPECT_EQ(Add("solo", 0, 1), AddOutcome::kDuplicate);
}

TEST_F(StepJoinerTest, TimesOutWithMissingRanksNamed) {
  ASSERT_TRUE(joiner_.RegisterJob("exp-42", 5).ok());
  Add("exp-42", 3, 9);
  Add("exp-42", 0, 9);
  now_ += absl::Seconds(5);
  Add("exp-42", 1, 9);  // later reports do not move the deadline
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(30));

  joiner_.Expire(kT0 + absl::Seconds(30) - absl::Nanoseconds(1), &closed_);
  EXPECT_THAT(closed_, IsEmpty());
  joiner_.Expire(kT0 + absl::Seconds(30), &closed_);  // deadline <= now closes
  ASSERT_EQ(closed_.size(), 1u);
  const JoinedStep& js = closed_[0];
  EXPECT_EQ(js.reason, Reason::kTimedOut);
  EXPECT_EQ(js.step, 9u);
  EXPECT_EQ(js.opened_at, kT0);
  EXPECT_THAT(Ranks(js), ElementsAre(0u, 1u, 3u));
  EXPECT_THAT(js.missing_ranks, ElementsAre(2u, 4u));
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
  EXPECT_EQ(joiner_.NextDeadline(), absl::InfiniteFuture());
}

// A job that claims a world size past the dense limit keeps only the ranks present per open
// step; joins, resends, late reports and the missing list behave as for a small job.
TEST_F(StepJoinerTest, AHugeClaimedWorldSizeJoinsLikeASmallOne) {
  constexpr uint32_t kWorld = 1'000'000;
  ASSERT_TRUE(joiner_.RegisterJob("huge", kWorld).ok());
  EXPECT_EQ(Add("huge", 999'999, 1), AddOutcome::kAccepted);
  EXPECT_EQ(Add("huge", 5, 1), AddOutcome::kAccepted);
  EXPECT_EQ(Add("huge", 999'999, 1), AddOutcome::kDuplicate);  // a resend while open
  joiner_.Expire(kT0 + absl::Seconds(30), &closed_);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_THAT(Ranks(closed_[0]), ElementsAre(5u, 999'999u));
  ASSERT_EQ(closed_[0].missing_ranks.size(), kWorld - 2);
  EXPECT_EQ(closed_[0].missing_ranks[5], 6u);
  EXPECT_EQ(closed_[0].missing_ranks.back(), 999'998u);
  EXPECT_EQ(Add("huge", 5, 1), AddOutcome::kDuplicate);  // remembered as part of the closed step
  EXPECT_EQ(Add("huge", 7, 1), AddOutcome::kLate);
  EXPECT_EQ(Add("huge", 7, 1), AddOutcome::kDuplicate);
}

TEST_F(StepJoinerTest, ExpireWithInfiniteFutureFlushesEverything) {
  ASSERT_TRUE(joiner_.RegisterJob("a", 3).ok());
  for (uint64_t s = 0; s < 5; ++s) Add("a", 1, s);
  joiner_.Expire(absl::InfiniteFuture(), &closed_);
  ASSERT_EQ(closed_.size(), 5u);
  for (const JoinedStep& js : closed_) {
    EXPECT_EQ(js.reason, Reason::kTimedOut);
    EXPECT_THAT(js.missing_ranks, ElementsAre(0u, 2u));
  }
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
}

TEST_F(StepJoinerTest, ExpireClosesInDeadlineOrderAcrossJobs) {
  ASSERT_TRUE(joiner_.RegisterJob("b", 2).ok());
  ASSERT_TRUE(joiner_.RegisterJob("a", 2).ok());
  Add("b", 0, 5);  // t0
  now_ += absl::Seconds(1);
  Add("a", 0, 9);  // t0+1
  Add("b", 0, 3);  // t0+1
  Add("a", 0, 2);  // t0+1
  now_ += absl::Seconds(1);
  Add("a", 0, 1);  // t0+2
  joiner_.Expire(kT0 + absl::Seconds(31), &closed_);
  std::vector<std::pair<std::string, uint64_t>> order;
  for (const JoinedStep& js : closed_) order.emplace_back(js.job, js.step);
  EXPECT_THAT(order, ElementsAre(std::pair<std::string, uint64_t>("b", 5),
                                 std::pair<std::string, uint64_t>("a", 2),
                                 std::pair<std::string, uint64_t>("a", 9),
                                 std::pair<std::string, uint64_t>("b", 3)));
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(32));
  EXPECT_EQ(joiner_.open_steps("a"), 1u);
}

// ---------------------------------------------------------------------------------------------
// Duplicates and late reports.

TEST_F(StepJoinerTest, DuplicateInOpenStepMergesAcksAndKeepsHeldReport) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 3).ok());
  EXPECT_EQ(Add("j", 0, 4, 0, 1), AddOutcome::kAccepted);
  RankReport resend = MakeReport(0, 4, 0, 2);
  resend.loss = 99.0;  // a resend never replaces what is held
  EXPECT_EQ(joiner_.Add("j", resend, now_, &closed_), AddOutcome::kDuplicate);
  EXPECT_THAT(resend.acks, IsEmpty());  // taken into the held report
  RankReport again = MakeReport(0, 4, 0, 3);
  EXPECT_EQ(joiner_.Add("j", again, now_, &closed_), AddOutcome::kDuplicate);
  Add("j", 1, 4, 0, 4);
  EXPECT_THAT(closed_, IsEmpty());  // a duplicate does not count towards completion
  Add("j", 2, 4, 0, 5);
  ASSERT_EQ(closed_.size(), 1u);
  const JoinedStep& js = closed_[0];
  EXPECT_EQ(js.reason, Reason::kComplete);
  ASSERT_EQ(js.reports.size(), 3u);
  EXPECT_EQ(js.reports[0].loss, 1.0);
  EXPECT_THAT(Seqs(js.reports[0].acks), ElementsAre(1u, 2u, 3u));
  EXPECT_THAT(Seqs(js.reports[1].acks), ElementsAre(4u));
}

TEST_F(StepJoinerTest, DuplicateOfClosedStepLeavesAcksToCaller) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 2).ok());
  Add("j", 0, 4);
  Add("j", 1, 4);
  ASSERT_EQ(TakeClosed().size(), 1u);
  RankReport resend = MakeReport(1, 4, 0, 77);
  EXPECT_EQ(joiner_.Add("j", resend, now_, &closed_), AddOutcome::kDuplicate);
  EXPECT_THAT(Seqs(resend.acks), ElementsAre(77u));
  EXPECT_EQ(resend.sketch.size(), 3u);  // not moved from
  EXPECT_THAT(closed_, IsEmpty());
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
}

TEST_F(StepJoinerTest, LateReportForTimedOutStep) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 3).ok());
  Add("j", 0, 4);
  Add("j", 1, 4);
  joiner_.Expire(kT0 + absl::Minutes(1), &closed_);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_THAT(closed_[0].missing_ranks, ElementsAre(2u));
  TakeClosed();

  now_ = kT0 + absl::Minutes(2);
  RankReport late = MakeReport(2, 4, 0, 9);
  EXPECT_EQ(joiner_.Add("j", late, now_, &closed_), AddOutcome::kLate);
  EXPECT_EQ(late.sketch.size(), 3u);  // the caller stores it alone
  EXPECT_THAT(Seqs(late.acks), ElementsAre(9u));
  EXPECT_THAT(closed_, IsEmpty());
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
  // The late report is now part of the step: its resend, like rank 0's, is a duplicate.
  EXPECT_EQ(Add("j", 2, 4), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 4), AddOutcome::kDuplicate);
}

TEST_F(StepJoinerTest, LateReportsInEveryRankSetForm) {
  // 200 ranks: a step with 3 present is stored as the present list, one with 3 missing as the
  // missing list, one with 100 of each as a bitset. Each must answer Contains/Insert the same.
  ASSERT_TRUE(joiner_.RegisterJob("j", 200).ok());
  const std::vector<std::vector<uint32_t>> present_sets = {{5, 77, 199},
                                                           [] {
                                                             std::vector<uint32_t> v;
                                                             for (uint32_t r = 0; r < 200; ++r) {
                                                               if (r != 0 && r != 64 && r != 130)
                                                                 v.push_back(r);
                                                             }
                                                             return v;
                                                           }(),
                                                           [] {
                                                             std::vector<uint32_t> v;
                                                             for (uint32_t r = 0; r < 200; r += 2)
                                                               v.push_back(r);
                                                             return v;
                                                           }()};
  for (uint64_t step = 0; step < present_sets.size(); ++step) {
    for (uint32_t r : present_sets[step]) Add("j", r, step);
  }
  joiner_.Expire(absl::InfiniteFuture(), &closed_);
  ASSERT_EQ(closed_.size(), 3u);
  for (uint64_t step = 0; step < present_sets.size(); ++step) {
    const std::set<uint32_t> present(present_sets[step].begin(), present_sets[step].end());
    for (uint32_t r = 0; r < 200; ++r) {
      const AddOutcome expected = present.count(r) ? AddOutcome::kDuplicate : AddOutcome::kLate;
      EXPECT_EQ(Add("j", r, step), expected) << "step " << step << " rank " << r;
    }
    for (uint32_t r = 0; r < 200; ++r) {
      EXPECT_EQ(Add("j", r, step), AddOutcome::kDuplicate) << "step " << step << " rank " << r;
    }
  }
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Attempts: the newest wins.

TEST_F(StepJoinerTest, RestartedJobRejoinsClosedSteps) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 2).ok());
  for (uint64_t s = 10; s < 13; ++s) {
    Add("j", 0, s, 0);
    Add("j", 1, s, 0);
  }
  ASSERT_EQ(TakeClosed().size(), 3u);
  // Restart from a checkpoint at step 10: attempt 1 sends steps 10.. again.
  now_ += absl::Minutes(5);
  EXPECT_EQ(Add("j", 1, 10, 1), AddOutcome::kAccepted);
  EXPECT_EQ(joiner_.open_steps("j"), 1u);
  EXPECT_EQ(Add("j", 0, 10, 0), AddOutcome::kStale);  // an old resend meets the new attempt
  EXPECT_EQ(Add("j", 0, 10, 1), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].attempt, 1u);
  EXPECT_EQ(closed_[0].reason, Reason::kComplete);
  EXPECT_EQ(closed_[0].opened_at, now_);
  EXPECT_THAT(Ranks(closed_[0]), ElementsAre(0u, 1u));
  EXPECT_EQ(Add("j", 0, 10, 1), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 1, 10, 0), AddOutcome::kStale);
  // Step 11 not yet re-sent: attempt 0 resends are still duplicates of what is stored.
  EXPECT_EQ(Add("j", 1, 11, 0), AddOutcome::kDuplicate);
}

TEST_F(StepJoinerTest, HigherAttemptSupersedesOpenStep) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 3).ok());
  Add("j", 0, 5, 0, 1);
  Add("j", 1, 5, 0, 2);
  now_ += absl::Seconds(1);
  EXPECT_EQ(Add("j", 2, 5, 1, 3), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 1u);
  const JoinedStep old = TakeClosed()[0];
  EXPECT_EQ(old.reason, Reason::kSuperseded);
  EXPECT_EQ(old.attempt, 0u);
  EXPECT_THAT(Ranks(old), ElementsAre(0u, 1u));
  EXPECT_THAT(old.missing_ranks, ElementsAre(2u));
  EXPECT_THAT(Seqs(old.reports[0].acks), ElementsAre(1u));  // acks travel with the old reports
  EXPECT_EQ(joiner_.open_steps("j"), 1u);
  EXPECT_EQ(joiner_.NextDeadline(), now_ + absl::Seconds(30));

  EXPECT_EQ(Add("j", 2, 5, 0), AddOutcome::kStale);
  EXPECT_EQ(Add("j", 0, 5, 1), AddOutcome::kAccepted);
  EXPECT_EQ(Add("j", 1, 5, 1), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].reason, Reason::kComplete);
  EXPECT_EQ(closed_[0].attempt, 1u);
  EXPECT_EQ(closed_[0].opened_at, now_);
  EXPECT_THAT(Ranks(closed_[0]), ElementsAre(0u, 1u, 2u));
  EXPECT_EQ(Add("j", 2, 5, 0), AddOutcome::kStale);
  EXPECT_EQ(Add("j", 2, 5, 1), AddOutcome::kDuplicate);
}

TEST_F(StepJoinerTest, LowerAttemptIsStale) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 2).ok());
  Add("j", 0, 1, 3);  // open at attempt 3
  RankReport stale = MakeReport(1, 1, 2, 8);
  EXPECT_EQ(joiner_.Add("j", stale, now_, &closed_), AddOutcome::kStale);
  EXPECT_THAT(Seqs(stale.acks), ElementsAre(8u));  // the caller acks and drops it
  EXPECT_EQ(stale.sketch.size(), 3u);
  Add("j", 1, 1, 3);  // closed at attempt 3
  ASSERT_EQ(TakeClosed().size(), 1u);
  EXPECT_EQ(Add("j", 0, 1, 0), AddOutcome::kStale);
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Bounded memory.

class StepJoinerCapTest : public StepJoinerTest {
 protected:
  StepJoinerCapTest() : StepJoinerTest(JoinerOptions{absl::Seconds(30), 3, 4}) {}
};

TEST_F(StepJoinerCapTest, OpenStepCapEvictsOldest) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 2).ok());
  Add("j", 0, 10);  // t0
  now_ += absl::Seconds(1);
  Add("j", 0, 7);  // t0+1
  Add("j", 0, 5);  // t0+1
  EXPECT_THAT(closed_, IsEmpty());
  EXPECT_EQ(joiner_.open_steps("j"), 3u);

  now_ += absl::Seconds(1);
  EXPECT_EQ(Add("j", 1, 20), AddOutcome::kAccepted);  // evicts step 10: smallest opened_at
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].step, 10u);
  EXPECT_EQ(closed_[0].reason, Reason::kEvicted);
  EXPECT_THAT(closed_[0].missing_ranks, ElementsAre(1u));
  EXPECT_EQ(joiner_.open_steps("j"), 3u);
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(31));
  TakeClosed();

  Add("j", 1, 21);  // steps 7 and 5 tie on opened_at: the smaller step goes first
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].step, 5u);
  TakeClosed();
  // Completing an open step frees its slot without evicting.
  Add("j", 1, 7);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].reason, Reason::kComplete);
  EXPECT_EQ(joiner_.open_steps("j"), 2u);
  TakeClosed();
  // The evicted step is closed: its missing rank is late now.
  EXPECT_EQ(Add("j", 1, 10), AddOutcome::kLate);
  EXPECT_EQ(Add("j", 0, 10), AddOutcome::kDuplicate);
  EXPECT_EQ(joiner_.open_steps("j"), 2u);
}

TEST_F(StepJoinerCapTest, OpenStepsStayBounded) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 2).ok());
  ASSERT_TRUE(joiner_.RegisterJob("k", 2).ok());
  for (uint64_t s = 0; s < 1000; ++s) {
    now_ += absl::Milliseconds(1);
    Add("j", 0, s);
    EXPECT_LE(joiner_.open_steps("j"), 3u);
    EXPECT_LE(joiner_.remembered_steps("j"), 4u);
  }
  EXPECT_EQ(closed_.size(), 997u);
  for (const JoinedStep& js : closed_) EXPECT_EQ(js.reason, Reason::kEvicted);
  // The cap is per job: another job's steps are untouched.
  Add("k", 0, 1);
  Add("k", 0, 2);
  EXPECT_EQ(joiner_.open_steps("k"), 2u);
  EXPECT_EQ(joiner_.open_steps("j"), 3u);
  EXPECT_EQ(joiner_.open_steps_total(), 5u);
}

TEST_F(StepJoinerCapTest, ClosedStepMemoryIsBoundedFifo) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 1).ok());
  for (uint64_t s = 0; s < 10; ++s) Add("j", 0, s);
  EXPECT_EQ(joiner_.remembered_steps("j"), 4u);  // steps 6..9
  EXPECT_EQ(Add("j", 0, 9), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 6), AddOutcome::kDuplicate);
  TakeClosed();
  // Step 5 was forgotten: a resend joins it again (and it is remembered again, pushing out 6).
  EXPECT_EQ(Add("j", 0, 5), AddOutcome::kAccepted);
  EXPECT_EQ(TakeClosed().size(), 1u);
  EXPECT_EQ(joiner_.remembered_steps("j"), 4u);
  EXPECT_EQ(Add("j", 0, 5), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 7), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 6), AddOutcome::kAccepted);
}

TEST_F(StepJoinerCapTest, ReclosingOneStepKeepsFifoCorrect) {
  // Closing step 100 again and again (newer attempts) leaves stale FIFO entries behind; the
  // joiner must still remember exactly the 4 most recently closed distinct steps.
  ASSERT_TRUE(joiner_.RegisterJob("j", 1).ok());
  Add("j", 0, 1);
  Add("j", 0, 2);
  Add("j", 0, 3);
  for (uint32_t attempt = 0; attempt < 500; ++attempt) {
    EXPECT_EQ(Add("j", 0, 100, attempt), AddOutcome::kAccepted);
    EXPECT_EQ(joiner_.remembered_steps("j"), 4u);
  }
  EXPECT_EQ(Add("j", 0, 1), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 2), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 3), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 100, 499), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 100, 498), AddOutcome::kStale);
  Add("j", 0, 4);  // pushes out step 1, the oldest
  EXPECT_EQ(Add("j", 0, 2), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 100, 499), AddOutcome::kDuplicate);
  TakeClosed();
  EXPECT_EQ(Add("j", 0, 1), AddOutcome::kAccepted);
  EXPECT_EQ(TakeClosed().size(), 1u);
}

TEST_F(StepJoinerCapTest, StaleFifoEntryDoesNotEvictTheLiveRecord) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 1).ok());
  Add("j", 0, 1, 0);
  Add("j", 0, 2, 0);
  Add("j", 0, 1, 1);  // step 1 closed again: it is now newer than step 2
  Add("j", 0, 3, 0);
  Add("j", 0, 4, 0);
  EXPECT_EQ(joiner_.remembered_steps("j"), 4u);
  Add("j", 0, 5, 0);  // the oldest closed step is 2, not 1
  EXPECT_EQ(joiner_.remembered_steps("j"), 4u);
  EXPECT_EQ(Add("j", 0, 1, 1), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("j", 0, 1, 0), AddOutcome::kStale);
  TakeClosed();
  EXPECT_EQ(Add("j", 0, 2, 0), AddOutcome::kAccepted);  // forgotten, joined again
  EXPECT_EQ(TakeClosed().size(), 1u);
}

TEST_F(StepJoinerCapTest, SupersededStepTakesNoRememberedSlot) {
  ASSERT_TRUE(joiner_.RegisterJob("j", 2).ok());
  for (uint64_t s = 1; s <= 4; ++s) {
    Add("j", 0, s);
    Add("j", 1, s);
  }
  Add("j", 0, 10, 0);
  Add("j", 0, 10, 1);  // supersedes the open step 10
  ASSERT_EQ(closed_.size(), 5u);
  EXPECT_EQ(closed_.back().reason, Reason::kSuperseded);
  EXPECT_EQ(joiner_.remembered_steps("j"), 4u);
  EXPECT_EQ(Add("j", 1, 1), AddOutcome::kDuplicate);  // step 1 still remembered
  EXPECT_EQ(Add("j", 1, 10, 0), AddOutcome::kStale);
}

TEST_F(StepJoinerTest, ZeroOpenStepCapMeansOne) {
  StepJoiner joiner(JoinerOptions{absl::Seconds(30), 0, 16});
  ASSERT_TRUE(joiner.RegisterJob("j", 2).ok());
  RankReport a = MakeReport(0, 1);
  RankReport b = MakeReport(0, 2);
  EXPECT_EQ(joiner.Add("j", a, now_, &closed_), AddOutcome::kAccepted);
  EXPECT_EQ(joiner.Add("j", b, now_, &closed_), AddOutcome::kAccepted);
  EXPECT_EQ(joiner.open_steps("j"), 1u);
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].reason, Reason::kEvicted);
}

// ---------------------------------------------------------------------------------------------
// Jobs are independent; deadlines are tracked across them.

TEST_F(StepJoinerTest, MultipleJobsAreIndependent) {
  ASSERT_TRUE(joiner_.RegisterJob("a", 2).ok());
  ASSERT_TRUE(joiner_.RegisterJob("b", 3).ok());
  Add("a", 0, 1);
  Add("b", 0, 1);
  Add("b", 1, 1);
  Add("a", 1, 1);  // completes a/1 only
  ASSERT_EQ(closed_.size(), 1u);
  EXPECT_EQ(closed_[0].job, "a");
  EXPECT_EQ(joiner_.open_steps("a"), 0u);
  EXPECT_EQ(joiner_.open_steps("b"), 1u);
  // A duplicate in a is not a duplicate in b.
  EXPECT_EQ(Add("a", 0, 1), AddOutcome::kDuplicate);
  EXPECT_EQ(Add("b", 2, 1), AddOutcome::kAccepted);
  ASSERT_EQ(closed_.size(), 2u);
  EXPECT_EQ(closed_[1].job, "b");
  EXPECT_EQ(closed_[1].world_size, 3u);
  EXPECT_THAT(Ranks(closed_[1]), ElementsAre(0u, 1u, 2u));
  // Attempts are per job too.
  Add("a", 0, 2, 5);
  EXPECT_EQ(Add("b", 0, 2, 0), AddOutcome::kAccepted);
}

TEST_F(StepJoinerTest, NextDeadlineFollowsAddsClosesAndExpires) {
  ASSERT_TRUE(joiner_.RegisterJob("a", 2).ok());
  ASSERT_TRUE(joiner_.RegisterJob("b", 2).ok());
  EXPECT_EQ(joiner_.NextDeadline(), absl::InfiniteFuture());
  Add("a", 0, 1);  // t0
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(30));
  now_ = kT0 + absl::Seconds(10);
  Add("b", 0, 1);  // t0+10
  Add("a", 0, 2);  // t0+10
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(30));
  Add("a", 1, 1);  // completes the earliest
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(40));
  now_ = kT0 + absl::Seconds(20);
  Add("b", 1, 2, 0);                                           // t0+20
  Add("b", 0, 1, 1);                                           // supersedes b/1: reopened at t0+20
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(40));  // a/2 still at t0+10
  joiner_.Expire(kT0 + absl::Seconds(40), &closed_);
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(50));
  joiner_.Expire(kT0 + absl::Seconds(49), &closed_);
  EXPECT_EQ(joiner_.NextDeadline(), kT0 + absl::Seconds(50));
  joiner_.Expire(kT0 + absl::Seconds(50), &closed_);
  EXPECT_EQ(joiner_.NextDeadline(), absl::InfiniteFuture());
  EXPECT_EQ(joiner_.open_steps_total(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Randomized: many ranks, shuffled arrival, duplicates, timeouts, evictions and restarts. Every
// ack handle must come back exactly once (in a JoinedStep, or left in the report for the caller),
// and every (step, rank, attempt) must be joined at most once.

struct Sent {
  uint32_t rank;
  uint64_t step;
  uint32_t attempt;
  uint64_t seq;
};

struct Scenario {
  uint32_t world_size;
  uint64_t steps;
  uint32_t attempts;          // > 1: the job crashes and restarts from a checkpoint
  double duplicate_fraction;  // extra copies of random reports
  size_t shuffle_window;      // how far out of order a report may arrive
  JoinerOptions options;
  absl::Duration tick;  // clock advance per Add
};

void CheckJoinedStep(const JoinedStep& js) {
  ASSERT_GE(js.world_size, 1u);
  for (size_t i = 0; i < js.reports.size(); ++i) {
    EXPECT_EQ(js.reports[i].step, js.step);
    EXPECT_EQ(js.reports[i].attempt, js.attempt);
    if (i > 0) {
      EXPECT_LT(js.reports[i - 1].rank, js.reports[i].rank);
    }
  }
  std::vector<uint32_t> all = Ranks(js);
  all.insert(all.end(), js.missing_ranks.begin(), js.missing_ranks.end());
  std::sort(all.begin(), all.end());
  EXPECT_TRUE(std::is_sorted(js.missing_ranks.begin(), js.missing_ranks.end()));
  ASSERT_EQ(all.size(), js.world_size);
  for (uint32_t r = 0; r < js.world_size; ++r) EXPECT_EQ(all[r], r);
  EXPECT_EQ(js.reason == Reason::kComplete, js.missing_ranks.empty());
}

struct ScenarioCounts {
  std::map<AddOutcome, int> outcomes;
  std::map<Reason, int> reasons;
};

// Long: one randomised scenario against the reference, read top to bottom; its counters are the
// test's expectations.
ScenarioCounts RunScenario(const Scenario& sc, uint64_t seed) {
  ScenarioCounts counts;
  std::mt19937_64 rng(seed);
  // Reports in send order: attempt by attempt, step by step, ranks shuffled within a step.
  // Attempt a (but the last) crashes at step steps*(a+1)/attempts, its last two steps sent by
  // half the ranks only; attempt a+1 resumes from a checkpoint 6 steps before the crash, so it
  // meets steps of attempt a that are still open.
  std::vector<Sent> sent;
  std::vector<uint32_t> newest(sc.steps, 0);  // the newest attempt that sends each step
  uint64_t next_seq = 1;
  uint64_t first_step = 0;
  for (uint32_t attempt = 0; attempt < sc.attempts; ++attempt) {
    const bool last = attempt + 1 == sc.attempts;
    const uint64_t end_step = last ? sc.steps : sc.steps * (attempt + 1) / sc.attempts;
    for (uint64_t s = first_step; s < end_step; ++s) {
      newest[s] = attempt;
      std::vector<uint32_t> ranks(sc.world_size);
      for (uint32_t r = 0; r < sc.world_size; ++r) ranks[r] = r;
      std::shuffle(ranks.begin(), ranks.end(), rng);
      if (!last && s + 2 >= end_step) ranks.resize((sc.world_size + 1) / 2);
      for (uint32_t r : ranks) sent.push_back({r, s, attempt, next_seq++});
    }
    first_step = end_step >= 6 ? end_step - 6 : 0;
  }
  // Arrival order: each report is delayed by up to shuffle_window positions (network and queue
  // jitter); each resend arrives at a uniformly random time after its original.
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const size_t originals = sent.size();
  std::vector<std::pair<double, Sent>> arrivals;
  for (size_t i = 0; i < originals; ++i) {
    arrivals.emplace_back(i + unit(rng) * sc.shuffle_window, sent[i]);
    if (unit(rng) < sc.duplicate_fraction) {
      Sent dup = sent[i];
      dup.seq = next_seq++;
      arrivals.emplace_back(i + unit(rng) * (originals + sc.shuffle_window - i), dup);
    }
  }
  std::sort(arrivals.begin(), arrivals.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  sent.clear();
  for (const auto& a : arrivals) sent.push_back(a.second);

  StepJoiner joiner(sc.options);
  EXPECT_TRUE(joiner.RegisterJob("job", sc.world_size).ok());
  absl::Time now = kT0;
  std::vector<JoinedStep> joined;
  std::map<uint64_t, int> acked;  // seq -> times returned
  std::map<AddOutcome, int>& outcomes = counts.outcomes;
  for (const Sent& s : sent) {
    now += sc.tick;
    std::vector<JoinedStep> closed;
    if (joiner.NextDeadline() <= now) joiner.Expire(now, &closed);
    EXPECT_GT(joiner.NextDeadline(), now);
    RankReport r = MakeReport(s.rank, s.step, s.attempt, s.seq);
    const AddOutcome outcome = joiner.Add("job", r, now, &closed);
    ++outcomes[outcome];
    for (const AckHandle& a : r.acks) ++acked[a.seq];  // left to the caller
    if (outcome == AddOutcome::kAccepted) {
      EXPECT_THAT(r.acks, IsEmpty());
    }
    EXPECT_LE(joiner.open_steps("job"), sc.options.max_open_steps_per_job);
    EXPECT_LE(joiner.remembered_steps("job"), sc.options.completed_steps_remembered);
    for (JoinedStep& js : closed) joined.push_back(std::move(js));
  }
  joiner.Expire(absl::InfiniteFuture(), &joined);
  EXPECT_EQ(joiner.open_steps_total(), 0u);
  EXPECT_EQ(joiner.NextDeadline(), absl::InfiniteFuture());

  std::map<std::tuple<uint64_t, uint32_t, uint32_t>, int> joined_count;  // (step, rank, attempt)
  std::map<uint64_t, uint32_t> last_attempt_joined;
  for (const JoinedStep& js : joined) {
    CheckJoinedStep(js);
    ++counts.reasons[js.reason];
    for (const RankReport& r : js.reports) {
      ++joined_count[{r.step, r.rank, r.attempt}];
      for (const AckHandle& a : r.acks) ++acked[a.seq];
    }
    last_attempt_joined[js.step] = js.attempt;
  }
  for (const auto& [key, n] : joined_count) {
    EXPECT_EQ(n, 1) << "step " << std::get<0>(key) << " rank " << std::get<1>(key) << " attempt "
                    << std::get<2>(key) << " joined " << n << " times";
  }
  EXPECT_EQ(acked.size(), sent.size()) << "some ack handle was lost";
  for (const auto& [seq, n] : acked) EXPECT_EQ(n, 1) << "seq " << seq;
  // The newest attempt of every step is the one joined last.
  for (const auto& [step, attempt] : last_attempt_joined) {
    EXPECT_EQ(attempt, newest[step]) << "step " << step;
  }
  EXPECT_EQ(last_attempt_joined.size(), sc.steps);
  std::printf(
      "adds: accepted %d duplicate %d late %d stale %d; steps: complete %d timed out %d "
      "evicted %d superseded %d\n",
      outcomes[AddOutcome::kAccepted], outcomes[AddOutcome::kDuplicate],
      outcomes[AddOutcome::kLate], outcomes[AddOutcome::kStale], counts.reasons[Reason::kComplete],
      counts.reasons[Reason::kTimedOut], counts.reasons[Reason::kEvicted],
      counts.reasons[Reason::kSuperseded]);
  return counts;
}

TEST(StepJoinerRandomTest, GenerousLimitsCompleteEveryStepExactlyOnce) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    const Scenario sc{/*world_size=*/97,
                      /*steps=*/120,
                      /*attempts=*/1,
                      /*duplicate_fraction=*/0.2,
                      /*shuffle_window=*/300,
                      JoinerOptions{absl::Hours(1), 256, 4096},
                      absl::Milliseconds(1)};
    RunScenario(sc, seed);
  }
}

TEST(StepJoinerRandomTest, TightLimitsTimeoutsEvictionsAndLateReports) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    // A timeout of about two steps' worth of reports and two open steps: completions,
    // timeouts, evictions and late reports all happen, but everything closed stays remembered,
    // so nothing may be joined twice.
    const Scenario sc{/*world_size=*/64,
                      /*steps=*/150,
                      /*attempts=*/1,
                      /*duplicate_fraction=*/0.3,
                      /*shuffle_window=*/80,
                      JoinerOptions{absl::Milliseconds(200), 2, 100000},
                      absl::Milliseconds(1)};
    const ScenarioCounts counts = RunScenario(sc, seed);
    EXPECT_GT(counts.reasons.count(Reason::kComplete), 0u);
    EXPECT_GT(counts.reasons.count(Reason::kTimedOut), 0u);
    EXPECT_GT(counts.reasons.count(Reason::kEvicted), 0u);
    EXPECT_GT(counts.outcomes.count(AddOutcome::kLate), 0u);
  }
}

TEST(StepJoinerRandomTest, RestartsNewestAttemptWins) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    const Scenario sc{/*world_size=*/32,
                      /*steps=*/100,
                      /*attempts=*/3,
                      /*duplicate_fraction=*/0.25,
                      /*shuffle_window=*/40,
                      JoinerOptions{absl::Milliseconds(300), 16, 100000},
                      absl::Milliseconds(1)};
    const ScenarioCounts counts = RunScenario(sc, seed);
    EXPECT_GT(counts.reasons.count(Reason::kSuperseded), 0u);
    EXPECT_GT(counts.outcomes.count(AddOutcome::kStale), 0u);
  }
}

// 10,000 ranks: Add, NextDeadline after every Add, and closing must not be quadratic in W.
TEST(StepJoinerScaleTest, TenThousandRanks) {
  constexpr uint32_t kWorld = 10000;
  constexpr uint64_t kSteps = 20;
  StepJoiner joiner;
  ASSERT_TRUE(joiner.RegisterJob("big", kWorld).ok());
  std::mt19937_64 rng(3);
  std::vector<std::pair<uint64_t, uint32_t>> order;
  for (uint64_t s = 0; s < kSteps; ++s) {
    for (uint32_t r = 0; r < kWorld; ++r) order.emplace_back(s, r);
  }
  // Steps overlap: each report lands within a window of ~2 steps.
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    const size_t j =
        std::min(order.size() - 1, i + std::uniform_int_distribution<size_t>(0, 2 * kWorld)(rng));
    std::swap(order[i], order[j]);
  }
  std::vector<JoinedStep> closed;
  absl::Time now = kT0;
  absl::Time deadline = absl::InfiniteFuture();
  const auto start = std::chrono::steady_clock::now();
  for (const auto& [s, r] : order) {
    RankReport rep;
    rep.rank = r;
    rep.step = s;
    rep.received_at = now;
    joiner.Add("big", rep, now, &closed);
    deadline = std::min(deadline, joiner.NextDeadline());
    now += absl::Microseconds(10);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("StepJoiner: %llu adds at W=%u in %.1f ms\n",
              static_cast<unsigned long long>(order.size()), kWorld, seconds * 1e3);
  ASSERT_EQ(closed.size(), kSteps);
  for (const JoinedStep& js : closed) {
    EXPECT_EQ(js.reason, Reason::kComplete);
    EXPECT_EQ(js.reports.size(), kWorld);
  }
  EXPECT_LT(seconds, 20.0);
}

}  // namespace
}  // namespace rankscope::collector
