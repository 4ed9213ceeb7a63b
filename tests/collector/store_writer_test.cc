// StoreWriter against a real SQLite file: acks only after a commit, retryable failures hold
// everything (nothing acked, nothing lost), and an item the writer gives up on is never silently
// forgotten: on_drop gets its rows and its sinks are abandoned with UNAVAILABLE (the agents
// reconnect and resend).
#include "collector/store/store_writer.h"

#include <sqlite3.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// An in-memory AckSink (a fake, not a mock): records what it was told.
class RecordingSink final : public AckSink {
 public:
  void Ack(absl::Span<const uint64_t> seqs) override {
    absl::MutexLock lock(&mu_);
    acked_.insert(acked_.end(), seqs.begin(), seqs.end());
  }
  void Abandon(const absl::Status& why) override {
    absl::MutexLock lock(&mu_);
    abandoned_.push_back(why);
  }
  std::vector<uint64_t> acked() const {
    absl::MutexLock lock(&mu_);
    return acked_;
  }
  std::vector<absl::Status> abandoned() const {
    absl::MutexLock lock(&mu_);
    return abandoned_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<uint64_t> acked_;
  std::vector<absl::Status> abandoned_;
};

// One late-report style item: rank `rank`'s row of `step`, acked to `sink` with `seq`.
WriteItem RankItem(const std::string& job, uint64_t step, uint32_t rank,
                   std::shared_ptr<AckSink> sink, uint64_t seq) {
  WriteItem item;
  StepWrite w;
  w.job = job;
  w.step = step;
  RankRow row;
  row.rank = rank;
  row.join_size = 1;
  row.loss = 1.0 + step;
  w.ranks.push_back(row);
  item.batch.steps.push_back(std::move(w));
  item.acks.push_back(AckHandle{std::move(sink), seq});
  return item;
}

struct Dropped {
  std::vector<uint64_t> steps;
  size_t items = 0;
  absl::Status why;
};

class StoreWriterTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = testing::MakeTempDir() + "/rankscope.db"; }

  std::unique_ptr<StoreWriter> MakeWriter(StoreWriterOptions options) {
    StoreOptions store_options;
    store_options.busy_timeout = absl::ZeroDuration();  // a held lock fails at once
    auto store = SqliteStore::Open(path_, store_options);
    EXPECT_TRUE(store.ok()) << store.status();
    StoreWriterHooks hooks;
    hooks.on_error = [this](const absl::Status& s) {
      absl::MutexLock lock(&mu_);
      errors_.push_back(s);
    };
    hooks.on_drop = [this](const StoreBatch& rows, size_t items, const absl::Status& why) {
      absl::MutexLock lock(&mu_);
      Dropped d;
      for (const StepWrite& w : rows.steps) d.steps.push_back(w.step);
      d.items = items;
      d.why = why;
      dropped_.push_back(d);
    };
    return std::make_unique<StoreWriter>(std::move(*store), options, std::move(hooks));
  }

  int64_t StoredRows(const std::string& job) {
    StoreOptions ro;
    ro.read_only = true;
    auto store = SqliteStore::Open(path_, ro);
    EXPECT_TRUE(store.ok()) << store.status();
    auto n = (*store)->CountRankRows(job);
    EXPECT_TRUE(n.ok()) << n.status();
    return n.ok() ? *n : -1;
  }

  // Another connection takes the write lock (as another process could): the writer's commits
  // fail with SQLITE_BUSY (Unavailable, retryable) until Unlock.
  void Lock() {
    ASSERT_EQ(sqlite3_open(path_.c_str(), &locker_), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(locker_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  }
  void Unlock() {
    sqlite3_exec(locker_, "ROLLBACK", nullptr, nullptr, nullptr);
    sqlite3_close(locker_);
    locker_ = nullptr;
  }

  size_t ErrorCount() {
    absl::MutexLock lock(&mu_);
    return errors_.size();
  }

  std::string path_;
  sqlite3* locker_ = nullptr;
  absl::Mutex mu_;
  std::vector<absl::Status> errors_ ABSL_GUARDED_BY(mu_);
  std::vector<Dropped> dropped_ ABSL_GUARDED_BY(mu_);
};

TEST_F(StoreWriterTest, RetryableFailureHoldsEverythingUnackedUntilACommitSucceeds) {
  StoreWriterOptions options;
  options.retry_backoff = absl::Milliseconds(20);
  auto writer = MakeWriter(options);
  auto sink = std::make_shared<RecordingSink>();
  Lock();
  for (uint64_t step = 1; step <= 5; ++step) writer->Enqueue(RankItem("held", step, 0, sink, step));
  ASSERT_TRUE(testing::WaitFor([&] { return ErrorCount() >= 3; }, absl::Seconds(30)));
  EXPECT_EQ(writer->health().code(), absl::StatusCode::kUnavailable) << writer->health();
  EXPECT_THAT(sink->acked(), IsEmpty());
  EXPECT_THAT(sink->abandoned(), IsEmpty());  // held, not given up: the stream stays open
  EXPECT_FALSE(writer->Flush(absl::ZeroDuration()));

  Unlock();
  ASSERT_TRUE(writer->Flush(absl::Seconds(30)));
  EXPECT_THAT(sink->acked(), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_TRUE(writer->health().ok());
  EXPECT_EQ(StoredRows("held"), 5);
  absl::MutexLock lock(&mu_);
  EXPECT_THAT(dropped_, IsEmpty());
}

TEST_F(StoreWriterTest, QueueOverflowDropsOldestAbandonsTheirSinksAndReportsTheirRows) {
  StoreWriterOptions options;
  options.retry_backoff = absl::Hours(1);  // after the first failure the writer waits for Stop
  options.max_pending_items = 3;
  auto writer = MakeWriter(options);
  auto first = std::make_shared<RecordingSink>();
  auto second = std::make_shared<RecordingSink>();
  Lock();
  writer->Enqueue(RankItem("overflow", 1, 0, first, 1));
  ASSERT_TRUE(testing::WaitFor([&] { return ErrorCount() >= 1; }, absl::Seconds(30)));
  // Step 1 is held for a retry; five more items overflow a queue of three: 1, 2, 3 go.
  for (uint64_t step = 2; step <= 6; ++step) {
    writer->Enqueue(RankItem("overflow", step, 0, step <= 3 ? first : second, step));
  }
  {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> steps;
    size_t items = 0;
    for (const Dropped& d : dropped_) {
      steps.insert(steps.end(), d.steps.begin(), d.steps.end());
      items += d.items;
      EXPECT_EQ(d.why.code(), absl::StatusCode::kResourceExhausted);
      EXPECT_THAT(d.why.message(), HasSubstr("store queue over 3 items"));
    }
    EXPECT_THAT(steps, UnorderedElementsAre(1, 2, 3));
    EXPECT_EQ(items, 3u);
  }
  ASSERT_FALSE(first->abandoned().empty());
  for (const absl::Status& s : first->abandoned()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(s.message(), HasSubstr("reconnect and resend"));
  }
  EXPECT_THAT(second->abandoned(), IsEmpty());

  Unlock();
  ASSERT_TRUE(writer->Stop(absl::Seconds(30)).ok());  // wakes the writer, which commits the rest
  EXPECT_THAT(first->acked(), IsEmpty());
  EXPECT_THAT(second->acked(), UnorderedElementsAre(4, 5, 6));
  EXPECT_EQ(StoredRows("overflow"), 3);
}

TEST_F(StoreWriterTest, PermanentFailureDropsTheBatchAbandonsItsSinksAndTheQueueMovesOn) {
  auto writer = MakeWriter(StoreWriterOptions{});
  auto bad = std::make_shared<RecordingSink>();
  auto good = std::make_shared<RecordingSink>();
  // A step SQLite cannot hold: InvalidArgument, not retryable.
  writer->Enqueue(RankItem("permanent", std::numeric_limits<uint64_t>::max(), 0, bad, 1));
  ASSERT_TRUE(writer->Flush(absl::Seconds(30)));
  writer->Enqueue(RankItem("permanent", 2, 1, good, 2));
  ASSERT_TRUE(writer->Flush(absl::Seconds(30)));
  EXPECT_THAT(bad->acked(), IsEmpty());
  ASSERT_EQ(bad->abandoned().size(), 1u);
  EXPECT_EQ(bad->abandoned()[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(bad->abandoned()[0].message(), HasSubstr("INT64_MAX"));
  EXPECT_THAT(good->acked(), ElementsAre(2));
  EXPECT_THAT(good->abandoned(), IsEmpty());
  EXPECT_EQ(StoredRows("permanent"), 1);
  absl::MutexLock lock(&mu_);
  ASSERT_EQ(dropped_.size(), 1u);
  EXPECT_EQ(dropped_[0].items, 1u);
  EXPECT_EQ(dropped_[0].why.code(), absl::StatusCode::kInvalidArgument);
}

// A test clock that moves `tick` forward on every reading (thread-safe).
class TickingClock {
 public:
  explicit TickingClock(absl::Duration tick) : tick_(tick) {}
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    now_ += tick_;
    return now_;
  }

 private:
  const absl::Duration tick_;
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1'700'000'000);
};

TEST_F(StoreWriterTest, CommitTimeIsMeasuredWithTheInjectedClock) {
  auto clock = std::make_shared<TickingClock>(absl::Seconds(1));
  StoreWriterOptions options;
  options.clock = [clock] { return clock->Now(); };
  auto store = SqliteStore::Open(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::Mutex mu;
  std::vector<absl::Duration> commit_times;
  StoreWriterHooks hooks;
  hooks.on_commit = [&](absl::Duration commit_time, size_t) {
    absl::MutexLock lock(&mu);
    commit_times.push_back(commit_time);
  };
  StoreWriter writer(std::move(*store), options, std::move(hooks));
  auto sink = std::make_shared<RecordingSink>();
  writer.Enqueue(RankItem("clock", 1, 0, sink, 1));
  ASSERT_TRUE(writer.Flush(absl::Seconds(30)));
  ASSERT_TRUE(writer.Stop(absl::Seconds(30)).ok());
  EXPECT_THAT(sink->acked(), ElementsAre(1));
  // Only the writer thread reads the clock around a commit: one reading before, one after.
  absl::MutexLock lock(&mu);
  EXPECT_THAT(commit_times, ElementsAre(absl::Seconds(1)));
}

TEST_F(StoreWriterTest, StopDeadlineIsReadFromTheInjectedClock) {
  // Every reading is two hours after the previous one: a Stop(1 h) deadline has passed by the
  // writer's next reading, so a writer held by a locked file gives up at once instead of
  // retrying for an hour of real time.
  auto clock = std::make_shared<TickingClock>(absl::Hours(2));
  StoreWriterOptions options;
  options.retry_backoff = absl::Milliseconds(10);
  options.clock = [clock] { return clock->Now(); };
  auto writer = MakeWriter(options);
  Lock();
  auto sink = std::make_shared<RecordingSink>();
  writer->Enqueue(RankItem("deadline", 1, 0, sink, 1));
  ASSERT_TRUE(testing::WaitFor([&] { return ErrorCount() >= 1; }));
  const absl::Status stopped = writer->Stop(absl::Hours(1));
  EXPECT_EQ(stopped.code(), absl::StatusCode::kDataLoss) << stopped;
  EXPECT_THAT(stopped.message(), HasSubstr("1 store items were not committed at shutdown"));
  EXPECT_THAT(sink->acked(), IsEmpty());
  Unlock();
}

}  // namespace
}  // namespace rankscope::collector
