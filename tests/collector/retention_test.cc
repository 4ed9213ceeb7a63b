// The storage lifecycle (DESIGN.md "Storage lifecycle"): the pure policy (retention.h), its
// execution by the store on a real SQLite file (sqlite_retention.cc), and the store writer thread
// that runs it. Time is injected: every `now` is a value, never the system clock.
#include "collector/store/retention.h"

#include <sqlite3.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collector/model/rank_windows.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/store_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);
constexpr uint32_t kRanks = 4;

// Step s of the test job completes (and its ranks are received) at kT0 + s seconds. Rank r's
// loss is s + 1000 r, its gradient norm 1 + r, its consensus cosine (s % 4) / 4 and its outlier
// score 0.5: values whose sums are exact in double, so window means can be compared exactly.
StepWrite Step(const std::string& job, uint64_t step, uint32_t ranks = kRanks) {
  StepWrite write;
  write.job = job;
  write.step = step;
  StepRow& stats = write.stats.emplace();
  stats.step = step;
  stats.ranks = ranks;
  stats.world_size = ranks;
  stats.completed_at = kT0 + absl::Seconds(step);
  for (uint32_t r = 0; r < ranks; ++r) {
    RankRow& row = write.ranks.emplace_back();
    row.rank = r;
    row.join_size = ranks;
    row.loss = static_cast<double>(step) + 1000.0 * r;
    row.grad_norm = 1.0 + r;
    row.grad_cosine = static_cast<double>(step % 4) / 4.0;
    row.outlier_score = 0.5;
    row.received_at = kT0 + absl::Seconds(step);
  }
  return write;
}

JobRow Job(const std::string& name, uint64_t last_step, uint32_t ranks = kRanks) {
  JobRow job;
  job.job = name;
  job.world_size = ranks;
  job.sketch_dim = 1024;
  job.first_seen = kT0;
  job.last_seen = kT0 + absl::Seconds(last_step);
  job.last_step = last_step;
  return job;
}

class RetentionStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "/retention_test.XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    dir_ = templ;
    path_ = dir_ + "/rankscope.db";
    auto store = SqliteStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }
  void TearDown() override {
    store_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  // Writes steps [first, last] of `job` (each step transformed by `edit`), and the job's row.
  template <typename Edit>
  void WriteSteps(const std::string& job, uint64_t first, uint64_t last, Edit edit,
                  uint32_t ranks = kRanks) {
    StoreBatch batch;
    batch.jobs.push_back(Job(job, last, ranks));
    for (uint64_t s = first; s <= last; ++s) {
      batch.steps.push_back(Step(job, s, ranks));
      edit(batch.steps.back());
    }
    ASSERT_TRUE(store_->Write(batch).ok());
  }
  void WriteSteps(const std::string& job, uint64_t first, uint64_t last, uint32_t ranks = kRanks) {
    WriteSteps(
        job, first, last, [](StepWrite&) {}, ranks);
  }

  struct Done {
    PruneAction action;
    SqliteStore::PruneResult result;
  };
  // Runs the policy and the store until the policy has nothing left but (at most) a vacuum that
  // frees nothing more; every action's transaction is checked against the batch bound.
  std::vector<Done> PruneUntilIdle(const RetentionOptions& options, absl::Time now,
                                   bool* over_cap = nullptr) {
    std::vector<Done> done;
    for (int i = 0; i < 10'000; ++i) {
      auto usage = store_->Usage();
      auto jobs = store_->JobExtents();
      EXPECT_TRUE(usage.ok() && jobs.ok());
      if (!usage.ok() || !jobs.ok()) break;
      PruneAction action = NextPruneAction(options, now, *usage, *jobs);
      if (over_cap != nullptr) *over_cap = action.over_cap;
      if (action.kind == PruneAction::Kind::kNone) break;
      auto result = store_->Prune(action, options.window_steps, options.outlier_threshold);
      EXPECT_TRUE(result.ok()) << result.status();
      if (!result.ok()) break;
      // Batches are bounded: a transaction touches at most max_rows_per_batch rank rows.
      EXPECT_LE(result->rank_rows + result->rank_rows_kept, options.max_rows_per_batch);
      if (result->steps == 0) break;  // nothing more to do for this action
      done.push_back({action, *result});
    }
    return done;
  }

  std::vector<uint64_t> RankSteps(const std::string& job) {
    auto rows = store_->RankRowsInRange(job, 0, std::numeric_limits<uint64_t>::max(), 1'000'000);
    EXPECT_TRUE(rows.ok());
    std::vector<uint64_t> steps;
    if (!rows.ok()) return steps;
    for (const StepRankRow& r : *rows) {
      if (steps.empty() || steps.back() != r.step) steps.push_back(r.step);
    }
    return steps;
  }

  std::string dir_;
  std::string path_;
  std::unique_ptr<SqliteStore> store_;
};

RetentionOptions AgeOptions() {
  RetentionOptions options;
  options.rank_steps = absl::Seconds(100);
  options.steps = absl::Seconds(1000);
  options.window_steps = 100;
  options.max_rows_per_batch = 30 * kRanks;  // 30 steps per transaction
  return options;
}

TEST(ParseRetentionAgeTest, UnitsAndZero) {
  EXPECT_EQ(*ParseRetentionAge("7d"), absl::Hours(7 * 24));
  EXPECT_EQ(*ParseRetentionAge("36h"), absl::Hours(36));
  EXPECT_EQ(*ParseRetentionAge("90m"), absl::Minutes(90));
  EXPECT_EQ(*ParseRetentionAge("1.5s"), absl::Milliseconds(1500));
  EXPECT_EQ(*ParseRetentionAge("0"), absl::ZeroDuration());
  for (const char* bad : {"", "7", "d", "7w", "-1d", "x1h"}) {
    auto age = ParseRetentionAge(bad);
    EXPECT_EQ(age.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(NextPruneActionTest, ZeroKeepsForeverAndBatchesFollowTheWorldSize) {
  RetentionOptions forever;
  forever.rank_steps = absl::ZeroDuration();
  forever.steps = absl::ZeroDuration();
  EXPECT_FALSE(forever.enabled());
  JobExtent old;
  old.job = "j";
  old.world_size = 1024;
  old.newest_step = 10;
  old.oldest_rank_step = 0;
  old.oldest_rank_time = kT0;
  old.oldest_step = 0;
  old.oldest_step_time = kT0;
  StoreUsage usage{4096, 100, 0};
  EXPECT_EQ(NextPruneAction(forever, kT0 + absl::Hours(10000), usage, {old}).kind,
            PruneAction::Kind::kNone);

  RetentionOptions options;
  options.max_rows_per_batch = 8192;
  const PruneAction a = NextPruneAction(options, kT0 + absl::Hours(8 * 24), usage, {old});
  EXPECT_EQ(a.kind, PruneAction::Kind::kDownsample);
  EXPECT_EQ(a.reason, PruneReason::kAge);
  EXPECT_EQ(a.cutoff, kT0 + absl::Hours(24));
  EXPECT_EQ(a.max_steps, 8);  // 8192 rows / 1024 ranks
  old.world_size = 100'000;
  EXPECT_EQ(NextPruneAction(options, kT0 + absl::Hours(8 * 24), usage, {old}).max_steps, 1);
}

TEST(NextPruneActionTest, SizeNeverTouchesTheNewestStep) {
  RetentionOptions options;
  options.rank_steps = absl::ZeroDuration();
  options.steps = absl::ZeroDuration();
  options.max_db_bytes = 4096;
  JobExtent j;
  j.job = "j";
  j.world_size = 8;
  j.newest_step = 7;
  j.oldest_rank_step = 7;
  j.oldest_rank_time = kT0;
  j.oldest_step = 7;
  j.oldest_step_time = kT0;
  const PruneAction a = NextPruneAction(options, kT0, StoreUsage{4096, 100, 10}, {j});
  EXPECT_TRUE(a.over_cap);
  EXPECT_EQ(a.kind, PruneAction::Kind::kVacuum);  // only free pages are left to give back
  EXPECT_EQ(a.vacuum_pages, 10);
}

TEST_F(RetentionStoreTest, NewFilesVacuumIncrementally) {
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &raw), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(raw, "PRAGMA auto_vacuum", -1, &stmt, nullptr), SQLITE_OK);
  ASSERT_EQ(sqlite3_step(stmt), SQLITE_ROW);
  EXPECT_EQ(sqlite3_column_int(stmt, 0), 2);  // INCREMENTAL
  sqlite3_finalize(stmt);
  sqlite3_close(raw);
}

// Per-rank rows older than retention_rank_steps are downsampled and deleted, a batch at a time;
// step_stats stay; the windows hold the exact min/mean/max of what was deleted.
TEST_F(RetentionStoreTest, DownsamplesRankRowsByAgeIntoExactWindows) {
  WriteSteps("job", 0, 299);
  const RetentionOptions options = AgeOptions();
  // At kT0 + 200 s, steps 0..99 (received before kT0 + 100 s) are past the per-rank retention.
  const std::vector<Done> done = PruneUntilIdle(options, kT0 + absl::Seconds(200));
  ASSERT_GE(done.size(), 4u);  // 100 steps, 30 per transaction
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(done[i].action.kind, PruneAction::Kind::kDownsample);
    EXPECT_EQ(done[i].action.reason, PruneReason::kAge);
  }
  auto steps = RankSteps("job");
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.front(), 100u);
  EXPECT_EQ(steps.size(), 200u);
  EXPECT_EQ(*store_->DownsampledBefore("job"), 100u);
  auto stats = store_->StepRange("job", 0, 299, 1000);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->size(), 300u);  // step_stats live until retention_steps

  auto windows = store_->RankWindowsInRange("job", 0, 299, 1000);
  ASSERT_TRUE(windows.ok()) << windows.status();
  ASSERT_EQ(windows->size(), kRanks);
  for (uint32_t r = 0; r < kRanks; ++r) {
    const RankWindowRow& w = (*windows)[r];
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.first_step, 0u);
    EXPECT_EQ(w.last_step, 99u);
    EXPECT_EQ(w.rows, 100);  // merged from 4 transactions of 30, 30, 30 and 10 steps
    EXPECT_EQ(w.first_received, kT0);
    EXPECT_EQ(w.last_received, kT0 + absl::Seconds(99));
    EXPECT_EQ(w.loss.count, 100);
    EXPECT_EQ(*w.loss.min, 1000.0 * r);
    EXPECT_EQ(*w.loss.max, 99.0 + 1000.0 * r);
    EXPECT_EQ(w.loss.mean(), 49.5 + 1000.0 * r);  // (0 + ... + 99) / 100
    EXPECT_EQ(*w.grad_norm.min, 1.0 + r);
    EXPECT_EQ(w.grad_norm.mean(), 1.0 + r);
    EXPECT_EQ(*w.grad_cosine.min, 0.0);
    EXPECT_EQ(*w.grad_cosine.max, 0.75);
    EXPECT_EQ(w.grad_cosine.mean(), 0.375);  // 25 each of 0, 0.25, 0.5, 0.75
    EXPECT_EQ(w.outlier_score.mean(), 0.5);
    EXPECT_EQ(w.nonfinite, 0);
    EXPECT_EQ(w.outliers, 0);
  }
  // A window is found by any step inside it.
  EXPECT_EQ(store_->RankWindowsInRange("job", 42, 42, 1000)->size(), kRanks);
  EXPECT_TRUE(store_->RankWindowsInRange("job", 100, 299, 1000)->empty());
}

// Flagged rank rows outlive the per-rank retention, and go with their step_stats; the other rows
// of a flagged step are downsampled like any.
TEST_F(RetentionStoreTest, FlaggedRankRowsAreKeptUntilRetentionSteps) {
  WriteSteps("job", 0, 299, [](StepWrite& w) {
    if (w.step == 10) w.stats->outlier_ranks = {2};
    if (w.step == 20) w.stats->replica_divergent_ranks = {1};
    if (w.step == 30) w.stats->missing_ranks = "3";
    if (w.step == 40) w.ranks[1].loss = std::numeric_limits<double>::infinity();
    if (w.step == 50) w.stats->drifting_ranks = {0};
    if (w.step == 60) w.stats->slow_ranks = {3};
    if (w.step == 70) w.ranks[2].outlier_score = 9.0;
  });
  const RetentionOptions options = AgeOptions();
  PruneUntilIdle(options, kT0 + absl::Seconds(200));
  // (step, rank) of every rank row left below step 100.
  auto rows = store_->RankRowsInRange("job", 0, 99, 1000);
  ASSERT_TRUE(rows.ok());
  std::vector<std::pair<uint64_t, uint32_t>> kept;
  for (const StepRankRow& r : *rows) kept.emplace_back(r.step, r.row.rank);
  // Step 30's missing rank 3 has no row to keep (its other rows are not flagged).
  EXPECT_EQ(kept, (std::vector<std::pair<uint64_t, uint32_t>>{
                      {10, 2}, {20, 1}, {40, 1}, {50, 0}, {60, 3}, {70, 2}}));
  EXPECT_EQ(RankSteps("job").back(), 299u);
  auto windows = store_->RankWindowsInRange("job", 0, 99, 1000);
  ASSERT_TRUE(windows.ok());
  ASSERT_EQ(windows->size(), kRanks);
  EXPECT_EQ((*windows)[1].nonfinite, 1);  // flagged rows are folded in too
  EXPECT_EQ((*windows)[1].loss.max, std::numeric_limits<double>::infinity());
  EXPECT_EQ((*windows)[2].outliers, 1);
  EXPECT_EQ((*windows)[2].outlier_score.max, 9.0);

  // Past retention_steps (1000 s) for steps 0..149: step_stats, the flagged rows and the windows
  // that end by then go; the rest stays.
  PruneUntilIdle(options, kT0 + absl::Seconds(1150));
  auto stats = store_->StepRange("job", 0, 299, 1000);
  ASSERT_TRUE(stats.ok());
  ASSERT_FALSE(stats->empty());
  EXPECT_EQ(stats->front().step, 150u);
  // Every rank row is past the per-rank retention now (received before kT0 + 1050 s): the
  // flagged ones went with their steps, the others into windows.
  EXPECT_THAT(RankSteps("job"), ::testing::IsEmpty());
  EXPECT_TRUE(store_->RankWindowsInRange("job", 0, 99, 1000)->empty());
  EXPECT_EQ(store_->RankWindowsInRange("job", 100, 199, 1000)->size(), kRanks);
}

// Over max_db_bytes, the oldest data goes first: rank rows (downsampled) of the oldest job, then
// whole steps; never a job's newest step. The file shrinks.
TEST_F(RetentionStoreTest, MaxDbBytesPrunesOldestFirstAndNeverTheNewestStep) {
  constexpr uint32_t kWide = 64;
  // Job "old" ran at kT0 + [0, 199] s, job "new" at kT0 + [1000, 1199] s.
  WriteSteps("old", 0, 199, kWide);
  WriteSteps(
      "new", 1000, 1199, [](StepWrite&) {}, kWide);
  auto before = store_->Usage();
  ASSERT_TRUE(before.ok());
  RetentionOptions options;
  options.rank_steps = absl::ZeroDuration();
  options.steps = absl::ZeroDuration();
  options.max_db_bytes = before->page_size;  // below anything: prune all that may be pruned
  options.max_rows_per_batch = 20 * kWide;
  bool over_cap = false;
  const std::vector<Done> done = PruneUntilIdle(options, kT0 + absl::Seconds(5000), &over_cap);
  EXPECT_TRUE(over_cap);  // only the newest steps are left, still above the cap
  ASSERT_FALSE(done.empty());
  // Oldest first: all of job "old"'s rank rows before any of job "new"'s, and rank rows before
  // whole steps.
  size_t first_new = done.size(), first_drop = done.size();
  for (size_t i = 0; i < done.size(); ++i) {
    if (done[i].action.kind == PruneAction::Kind::kVacuum) continue;
    EXPECT_EQ(done[i].action.reason, PruneReason::kSize);
    if (done[i].action.job == "new" && first_new == done.size()) first_new = i;
    if (done[i].action.kind == PruneAction::Kind::kDropSteps && first_drop == done.size()) {
      first_drop = i;
    }
  }
  for (size_t i = 0; i < first_new; ++i) {
    if (done[i].action.kind != PruneAction::Kind::kVacuum) {
      EXPECT_EQ(done[i].action.job, "old");
    }
  }
  for (size_t i = first_drop; i < done.size(); ++i) {
    EXPECT_NE(done[i].action.kind, PruneAction::Kind::kDownsample) << i;
  }
  // Each job's newest step survives whole.
  EXPECT_THAT(RankSteps("old"), ElementsAre(199u));
  EXPECT_THAT(RankSteps("new"), ElementsAre(1199u));
  auto old_stats = store_->StepRange("old", 0, 1 << 30, 1000);
  auto new_stats = store_->StepRange("new", 0, 1 << 30, 1000);
  ASSERT_TRUE(old_stats.ok() && new_stats.ok());
  ASSERT_EQ(old_stats->size(), 1u);
  EXPECT_EQ(old_stats->front().step, 199u);
  ASSERT_EQ(new_stats->size(), 1u);
  EXPECT_EQ(new_stats->front().step, 1199u);
  EXPECT_EQ(store_->RankRows("new", 1199)->size(), kWide);
  // And the file gave its pages back.
  auto after = store_->Usage();
  ASSERT_TRUE(after.ok());
  EXPECT_LT(after->file_bytes(), before->file_bytes() / 4);
  EXPECT_EQ(after->freelist_count, 0);
}

// The store writer runs the retention pass on its own thread, between commits, with its clock.
TEST_F(RetentionStoreTest, StoreWriterPrunesOnItsThreadWithItsClock) {
  store_.reset();
  auto store = SqliteStore::Open(path_);
  ASSERT_TRUE(store.ok());
  StoreWriterOptions options;
  options.clock = [] { return kT0 + absl::Seconds(200); };
  options.retention = AgeOptions();
  int64_t rank_rows_pruned = 0;
  int64_t db_bytes = 0;
  StoreWriterHooks hooks;
  hooks.on_prune = [&](const PruneAction&, const SqliteStore::PruneResult& r, absl::Duration) {
    rank_rows_pruned += r.rank_rows;  // writer thread; read after WaitRetentionIdle
  };
  hooks.on_usage = [&](const StoreUsage& u, bool) { db_bytes = u.file_bytes(); };
  StoreWriter writer(std::move(*store), options, hooks);
  WriteItem item;
  item.batch.jobs.push_back(Job("job", 299));
  for (uint64_t s = 0; s <= 299; ++s) item.batch.steps.push_back(Step("job", s));
  writer.Enqueue(std::move(item));
  ASSERT_TRUE(writer.Flush(absl::Seconds(30)));
  ASSERT_TRUE(writer.WaitRetentionIdle(absl::Seconds(30)));
  ASSERT_TRUE(writer.Stop(absl::Seconds(5)).ok());
  EXPECT_EQ(rank_rows_pruned, 100 * kRanks);
  EXPECT_GT(db_bytes, 0);
  auto reader = SqliteStore::Open(path_);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(*(*reader)->CountRankRows("job"), 200 * kRanks);
  EXPECT_EQ((*reader)->RankWindowsInRange("job", 0, 299, 1000)->size(), kRanks);
}

}  // namespace
}  // namespace rankscope::collector
