// StepChangeLog (collector/pipeline/step_change_log.h): which steps were committed after a
// cursor, and when it cannot say.
#include "collector/pipeline/step_change_log.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

StoreBatch Batch(std::vector<std::pair<const char*, uint64_t>> steps) {
  StoreBatch batch;
  for (const auto& [job, step] : steps) {
    StepWrite& w = batch.steps.emplace_back();
    w.job = job;
    w.step = step;
  }
  return batch;
}

TEST(StepChangeLogTest, AnswersTheStepsCommittedAfterTheCursorInTheRange) {
  StepChangeLog log(7);
  log.Record(Batch({{"a", 1}, {"a", 2}, {"b", 1}}));
  const ChangeCursor cursor = log.Now();
  EXPECT_EQ(cursor.instance, 7u);
  // Nothing after the cursor yet.
  auto none = log.StepsChangedSince("a", cursor, 0, 100);
  EXPECT_TRUE(none.complete);
  EXPECT_THAT(none.steps, IsEmpty());
  // A late report for step 1, a new step 3, another job's step.
  log.Record(Batch({{"a", 1}, {"b", 9}}));
  log.Record(Batch({{"a", 3}, {"a", 1}}));
  auto changed = log.StepsChangedSince("a", cursor, 0, 100);
  EXPECT_TRUE(changed.complete);
  EXPECT_THAT(changed.steps, ElementsAre(1, 3));  // ascending, each once
  EXPECT_THAT(log.StepsChangedSince("a", cursor, 2, 100).steps, ElementsAre(3));
  EXPECT_THAT(log.StepsChangedSince("b", cursor, 0, 100).steps, ElementsAre(9));
  // A job never recorded changed nothing.
  EXPECT_TRUE(log.StepsChangedSince("c", cursor, 0, 100).complete);
  // The cursor now sees none of them.
  EXPECT_THAT(log.StepsChangedSince("a", log.Now(), 0, 100).steps, IsEmpty());
}

TEST(StepChangeLogTest, CannotSayForAnotherInstanceOrAFutureCursor) {
  StepChangeLog log(7);
  log.Record(Batch({{"a", 1}}));
  EXPECT_FALSE(log.StepsChangedSince("a", {8, 0}, 0, 100).complete);
  EXPECT_FALSE(log.StepsChangedSince("a", {7, 2}, 0, 100).complete);
  EXPECT_TRUE(log.StepsChangedSince("a", {7, 1}, 0, 100).complete);
}

TEST(StepChangeLogTest, ForgottenEntriesMakeAnOlderCursorIncomplete) {
  StepChangeLog log(1, /*max_entries_per_job=*/3, /*max_jobs=*/2);
  const ChangeCursor start = log.Now();
  for (uint64_t step = 1; step <= 3; ++step) log.RecordSteps("a", {step});
  EXPECT_THAT(log.StepsChangedSince("a", start, 0, 100).steps, ElementsAre(1, 2, 3));
  const ChangeCursor after_two = {1, 2};
  log.RecordSteps("a", {4});  // step 1's entry is dropped
  EXPECT_FALSE(log.StepsChangedSince("a", start, 0, 100).complete);
  auto recent = log.StepsChangedSince("a", after_two, 0, 100);
  EXPECT_TRUE(recent.complete);
  EXPECT_THAT(recent.steps, ElementsAre(3, 4));
  // A third job forgets the one recorded least recently ("a", at sequence 4): a cursor before
  // that cannot be answered for a job the log no longer holds.
  const ChangeCursor before_b = log.Now();
  log.RecordSteps("b", {1});
  log.RecordSteps("c", {1});
  EXPECT_FALSE(log.StepsChangedSince("a", after_two, 0, 100).complete);
  EXPECT_TRUE(log.StepsChangedSince("a", before_b, 0, 100).complete);
  EXPECT_THAT(log.StepsChangedSince("c", before_b, 0, 100).steps, ElementsAre(1));
}

}  // namespace
}  // namespace rankscope::collector
