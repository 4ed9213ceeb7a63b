// Tests of the SQLite sink against a real SQLite file in a per-test temp directory.
#include "collector/store/sqlite_store.h"

#include <signal.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::IsSupersetOf;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// --- A raw SQLite connection, to look at the file the way the sqlite3 shell would. ---------

class RawDb {
 public:
  explicit RawDb(const std::string& path) {
    EXPECT_EQ(
        sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr),
        SQLITE_OK);
    sqlite3_busy_timeout(db_, 5000);
  }
  ~RawDb() { sqlite3_close(db_); }
  RawDb(const RawDb&) = delete;
  RawDb& operator=(const RawDb&) = delete;

  void Exec(const std::string& sql) {
    char* error = nullptr;
    EXPECT_EQ(sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &error), SQLITE_OK)
        << sql << ": " << (error ? error : "");
    sqlite3_free(error);
  }

  // Every row of `sql`, each value rendered by its storage class: NULL, an integer, a REAL
  // with 17 digits ("r:..."), or text ("t:...").
  std::vector<std::vector<std::string>> Rows(const std::string& sql) {
    std::vector<std::vector<std::string>> rows;
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK)
        << sql << ": " << sqlite3_errmsg(db_);
    if (stmt == nullptr) return rows;
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      std::vector<std::string>& row = rows.emplace_back();
      for (int i = 0; i < sqlite3_column_count(stmt); ++i) {
        switch (sqlite3_column_type(stmt, i)) {
          case SQLITE_NULL:
            row.push_back("NULL");
            break;
          case SQLITE_INTEGER:
            row.push_back(absl::StrCat(sqlite3_column_int64(stmt, i)));
            break;
          case SQLITE_FLOAT: {
            char buf[64];
            std::snprintf(buf, sizeof(buf), "r:%.17g", sqlite3_column_double(stmt, i));
            row.push_back(buf);
            break;
          }
          default:
            row.push_back(absl::StrCat(
                "t:", std::string(reinterpret_cast<const char*>(sqlite3_column_text(stmt, i)),
                                  sqlite3_column_bytes(stmt, i))));
        }
      }
    }
    EXPECT_EQ(rc, SQLITE_DONE) << sql << ": " << sqlite3_errmsg(db_);
    sqlite3_finalize(stmt);
    return rows;
  }

  // The first column of the first row, as rendered by Rows ("" when there is no row).
  std::string One(const std::string& sql) {
    auto rows = Rows(sql);
    return rows.empty() || rows[0].empty() ? std::string() : rows[0][0];
  }
  int64_t Int(const std::string& sql) {
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    int64_t value = -1;
    if (stmt != nullptr && sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
    return value;
  }

  sqlite3* get() { return db_; }

 private:
  sqlite3* db_ = nullptr;
};

// --- Rows to write. ------------------------------------------------------------------------

const absl::Time kT0 = absl::FromUnixMicros(1'700'000'000'123'457);

JobRow MakeJob(const std::string& name, uint64_t last_step = 0) {
  JobRow job;
  job.job = name;
  job.world_size = 8;
  job.sketch_dim = 1024;
  job.sketch_seed = 42;
  job.first_seen = kT0;
  job.last_seen = kT0 + absl::Seconds(1);
  job.last_step = last_step;
  return job;
}

StepRow MakeStats(uint64_t step, uint32_t attempt, uint32_t ranks, double loss_mean = 2.0) {
  StepRow row;
  row.step = step;
  row.attempt = attempt;
  row.ranks = ranks;
  row.world_size = 8;
  row.loss_mean = loss_mean;
  row.loss_std = 0.125;
  row.loss_range = 0.5;
  row.grad_norm_mean = 3.0;
  row.grad_norm_std = 0.25;
  row.grad_norm_cv = 0.25 / 3.0;
  row.grad_cosine_mean = 0.875;
  row.completed_at = kT0 + absl::Milliseconds(step);
  return row;
}

RankRow MakeRank(uint32_t rank, uint32_t attempt, uint32_t join_size, double loss = 2.0) {
  RankRow row;
  row.rank = rank;
  row.attempt = attempt;
  row.join_size = join_size;
  row.loss = loss;
  row.grad_norm = 3.0 + rank;
  row.grad_cosine = 0.5;
  row.loss_z = -0.25;
  row.grad_norm_z = 1.5;
  row.reduced_grad_fingerprint = 0x1234;
  row.param_fingerprint = 0x5678;
  row.step_time_seconds = 0.125;
  row.received_at = kT0 + absl::Microseconds(rank);
  return row;
}

// One step of `job` joined from ranks [0, ranks) at `attempt`.
StepWrite MakeStep(const std::string& job, uint64_t step, uint32_t attempt, uint32_t ranks,
                   double loss = 2.0) {
  StepWrite write;
  write.job = job;
  write.step = step;
  write.stats = MakeStats(step, attempt, ranks, loss);
  for (uint32_t r = 0; r < ranks; ++r) write.ranks.push_back(MakeRank(r, attempt, ranks, loss));
  return write;
}

StoreBatch Batch(std::vector<StepWrite> steps, std::vector<JobRow> jobs = {}) {
  StoreBatch batch;
  batch.jobs = std::move(jobs);
  batch.steps = std::move(steps);
  return batch;
}

// --- Comparisons that treat NaN as equal to NaN and tell +Inf from -Inf. ---------------------

bool Same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }
bool Same(const std::optional<double>& a, const std::optional<double>& b) {
  return a.has_value() == b.has_value() && (!a.has_value() || Same(*a, *b));
}
std::string Str(double v) { return absl::StrCat(v); }
std::string Str(const std::optional<double>& v) {
  return v.has_value() ? absl::StrCat(*v) : "nullopt";
}
#define EXPECT_SAME(want, got) \
  EXPECT_TRUE(Same(want, got)) << #got << ": want " << Str(want) << " got " << Str(got)

void ExpectJobEq(const JobRow& want, const JobRow& got) {
  SCOPED_TRACE(want.job);
  EXPECT_EQ(want.job, got.job);
  EXPECT_EQ(want.world_size, got.world_size);
  EXPECT_EQ(want.sketch_dim, got.sketch_dim);
  EXPECT_EQ(want.sketch_seed, got.sketch_seed);
  EXPECT_EQ(want.first_seen, got.first_seen);
  EXPECT_EQ(want.last_seen, got.last_seen);
  EXPECT_EQ(want.last_step, got.last_step);
  EXPECT_EQ(want.attempt, got.attempt);
}

void ExpectStepEq(const StepRow& want, const StepRow& got) {
  SCOPED_TRACE(absl::StrCat("step ", want.step));
  EXPECT_EQ(want.step, got.step);
  EXPECT_EQ(want.attempt, got.attempt);
  EXPECT_EQ(want.ranks, got.ranks);
  EXPECT_EQ(want.world_size, got.world_size);
  EXPECT_SAME(want.loss_mean, got.loss_mean);
  EXPECT_SAME(want.loss_std, got.loss_std);
  EXPECT_SAME(want.loss_range, got.loss_range);
  EXPECT_SAME(want.grad_norm_mean, got.grad_norm_mean);
  EXPECT_SAME(want.grad_norm_std, got.grad_norm_std);
  EXPECT_SAME(want.grad_norm_cv, got.grad_norm_cv);
  EXPECT_SAME(want.grad_cosine_mean, got.grad_cosine_mean);
  EXPECT_EQ(want.missing_ranks, got.missing_ranks);
  EXPECT_EQ(want.timed_out, got.timed_out);
  EXPECT_EQ(want.completed_at, got.completed_at);
  EXPECT_SAME(want.grad_noise_scale, got.grad_noise_scale);
  EXPECT_EQ(want.replica_checked, got.replica_checked);
  EXPECT_EQ(want.replica_divergent_ranks, got.replica_divergent_ranks);
  EXPECT_EQ(want.outlier_ranks, got.outlier_ranks);
  EXPECT_EQ(want.drifting_ranks, got.drifting_ranks);
  EXPECT_EQ(want.slow_ranks, got.slow_ranks);
  EXPECT_EQ(want.integrity_error_ratio, got.integrity_error_ratio);
  EXPECT_EQ(want.integrity_relative_error, got.integrity_relative_error);
  EXPECT_EQ(want.integrity_fault, got.integrity_fault);
  EXPECT_EQ(want.integrity_rank, got.integrity_rank);
  EXPECT_EQ(want.integrity_weight, got.integrity_weight);
}

void ExpectRankEq(const RankRow& want, const RankRow& got) {
  SCOPED_TRACE(absl::StrCat("rank ", want.rank));
  EXPECT_EQ(want.rank, got.rank);
  EXPECT_EQ(want.attempt, got.attempt);
  EXPECT_EQ(want.join_size, got.join_size);
  EXPECT_SAME(want.loss, got.loss);
  EXPECT_SAME(want.grad_norm, got.grad_norm);
  EXPECT_SAME(want.grad_cosine, got.grad_cosine);
  EXPECT_SAME(want.loss_z, got.loss_z);
  EXPECT_SAME(want.grad_norm_z, got.grad_norm_z);
  EXPECT_EQ(want.reduced_grad_fingerprint, got.reduced_grad_fingerprint);
  EXPECT_EQ(want.param_fingerprint, got.param_fingerprint);
  EXPECT_SAME(want.step_time_seconds, got.step_time_seconds);
  EXPECT_EQ(want.received_at, got.received_at);
  EXPECT_EQ(want.replica_ok, got.replica_ok);
  EXPECT_SAME(want.outlier_score, got.outlier_score);
  EXPECT_SAME(want.step_time_z, got.step_time_z);
}

// --- Fixture: a fresh directory per test. ---------------------------------------------------

class SqliteStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "/sqlite_store_test.XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr) << "mkdtemp " << templ << ": " << errno;
    dir_ = templ;
    path_ = dir_ + "/rankscope.db";
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::unique_ptr<SqliteStore> OpenStore(const StoreOptions& options = StoreOptions()) {
    absl::StatusOr<std::unique_ptr<SqliteStore>> store = SqliteStore::Open(path_, options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  // Every row of every table, for "nothing changed" comparisons.
  // Every row of `before` is in `after`, in order, with the same values in its columns; later
  // schemas append columns (ALTER TABLE ADD COLUMN), which `after` may have beyond them.
  static void ExpectRowsKept(const std::vector<std::vector<std::string>>& before,
                             const std::vector<std::vector<std::string>>& after) {
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < before.size(); ++i) {
      ASSERT_GE(after[i].size(), before[i].size()) << "row " << i;
      EXPECT_EQ(std::vector<std::string>(after[i].begin(), after[i].begin() + before[i].size()),
                before[i])
          << "row " << i;
    }
  }

  std::vector<std::vector<std::string>> DumpAll() {
    RawDb raw(path_);
    auto rows = raw.Rows("SELECT 'jobs', * FROM jobs ORDER BY job");
    for (auto& r : raw.Rows("SELECT 'stats', * FROM step_stats ORDER BY job, step")) {
      rows.push_back(r);
    }
    for (auto& r : raw.Rows("SELECT 'ranks', * FROM rank_steps ORDER BY job, step, rank")) {
      rows.push_back(r);
    }
    return rows;
  }

  std::string dir_;
  std::string path_;
};

// --- Schema. ---------------------------------------------------------------------------------

struct ColumnInfo {
  std::vector<std::string> names;
  std::vector<std::string> primary_key;  // in key order
};

ColumnInfo TableInfo(RawDb& raw, const std::string& table) {
  ColumnInfo info;
  std::map<int, std::string> pk;
  // cid, name, type, notnull, dflt_value, pk
  for (const auto& row : raw.Rows(absl::StrCat("PRAGMA table_info(", table, ")"))) {
    std::string name = row[1].substr(2);  // "t:" prefix
    info.names.push_back(name);
    if (row[5] != "0") pk[std::stoi(row[5])] = name;
  }
  for (const auto& [pos, name] : pk) info.primary_key.push_back(name);
  return info;
}

TEST_F(SqliteStoreTest, CreatesTheDocumentedSchema) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  RawDb raw(path_);

  ColumnInfo jobs = TableInfo(raw, "jobs");
  // DESIGN.md's required columns...
  EXPECT_THAT(jobs.names, IsSupersetOf({"job", "world_size", "sketch_dim", "sketch_seed",
                                        "first_seen", "last_seen"}));
  // ...and exactly the header's schema.
  EXPECT_THAT(jobs.names, ElementsAre("job", "world_size", "sketch_dim", "sketch_seed",
                                      "first_seen", "last_seen", "last_step", "attempt"));
  EXPECT_THAT(jobs.primary_key, ElementsAre("job"));

  ColumnInfo ranks = TableInfo(raw, "rank_steps");
  EXPECT_THAT(ranks.names, IsSupersetOf({"job", "step", "rank", "loss", "grad_norm", "grad_cosine",
                                         "received_at"}));
  EXPECT_THAT(
      ranks.names,
      ElementsAre("job", "step", "rank", "attempt", "join_size", "loss", "grad_norm", "grad_cosine",
                  "loss_z", "grad_norm_z", "nonfinite", "reduced_grad_fingerprint",
                  "param_fingerprint", "step_time_seconds", "received_at", "replica_ok",
                  "outlier_score", "step_time_z", "deviating_buckets", "bucket_norms", "bucket_z"));
  EXPECT_THAT(ranks.primary_key, ElementsAre("job", "step", "rank"));

  ColumnInfo who = TableInfo(raw, "rank_identities");
  EXPECT_THAT(who.names, ElementsAre("job", "rank", "global_rank", "host", "instance_id", "pid",
                                     "attempt", "first_seen", "last_seen"));
  EXPECT_THAT(who.primary_key, ElementsAre("job", "rank"));

  ColumnInfo stats = TableInfo(raw, "step_stats");
  EXPECT_THAT(stats.names, IsSupersetOf({"job", "step", "ranks", "loss_mean", "loss_std",
                                         "loss_range", "grad_norm_mean", "grad_norm_std",
                                         "grad_norm_cv", "grad_cosine_mean"}));
  EXPECT_THAT(stats.names,
              ElementsAre("job", "step", "attempt", "ranks", "world_size", "loss_mean", "loss_std",
                          "loss_range", "grad_norm_mean", "grad_norm_std", "grad_norm_cv",
                          "grad_cosine_mean", "missing_ranks", "timed_out", "completed_at",
                          "grad_noise_scale", "replica_checked", "replica_divergent_ranks",
                          "outlier_ranks", "duplicate_groups", "drifting_ranks", "slow_ranks",
                          "integrity_error_ratio", "integrity_relative_error", "integrity_fault",
                          "integrity_rank", "integrity_weight"));
  EXPECT_THAT(stats.primary_key, ElementsAre("job", "step"));
}

TEST_F(SqliteStoreTest, UsesWalAndRecordsTheSchemaVersion) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->path(), path_);
  RawDb raw(path_);
  EXPECT_EQ(raw.One("PRAGMA journal_mode"), "t:wal");
  EXPECT_EQ(raw.Int("PRAGMA user_version"), SqliteStore::kSchemaVersion);
  EXPECT_EQ(SqliteStore::kSchemaVersion, 7);
}

TEST_F(SqliteStoreTest, OpenTwiceAndReopenKeepData) {
  {
    auto store = OpenStore();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 5, 0, 4)}, {MakeJob("exp", 5)})).ok());
    auto second = OpenStore();  // a second connection to the same file, e.g. a query service
    ASSERT_NE(second, nullptr);
    EXPECT_EQ(*second->CountRankRows("exp"), 4);
  }
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(*store->CountRankRows("exp"), 4);
  auto step = store->GetStep("exp", 5);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(step->has_value());
  ExpectStepEq(MakeStats(5, 0, 4), **step);
  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  ExpectJobEq(MakeJob("exp", 5), (*jobs)[0]);
}

TEST_F(SqliteStoreTest, RefusesAFileFromANewerSchema) {
  ASSERT_NE(OpenStore(), nullptr);
  RawDb(path_).Exec("PRAGMA user_version = 8");
  auto store = SqliteStore::Open(path_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr(path_));
  EXPECT_THAT(store.status().message(), HasSubstr("schema_version 8"));
}

// A file the first release (schema 1) wrote: a read-only open refuses it and says how to
// migrate; a read-write open migrates it in place, keeps its rows and takes new ones.
TEST_F(SqliteStoreTest, MigratesADatabaseOfTheFirstRelease) {
  std::ifstream in(std::string(RANKSCOPE_SOURCE_DIR) + "/tests/collector/testdata/schema_v1.sql");
  ASSERT_TRUE(in.good());
  std::stringstream sql;
  sql << in.rdbuf();
  RawDb(path_).Exec(sql.str());

  StoreOptions read_only;
  read_only.read_only = true;
  auto early = SqliteStore::Open(path_, read_only);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.status().message(), HasSubstr("schema_version 1 is older"));

  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(RawDb(path_).Int("PRAGMA user_version"), SqliteStore::kSchemaVersion);
  auto old = store->GetStep("old-job", 41);
  ASSERT_TRUE(old.ok()) << old.status();
  ASSERT_TRUE(old->has_value());
  EXPECT_EQ((*old)->ranks, 2u);
  EXPECT_EQ((*old)->loss_mean, 1.5);
  EXPECT_THAT((*old)->outlier_ranks, ElementsAre(1));
  EXPECT_EQ((*old)->duplicate_groups, "");
  EXPECT_THAT((*old)->drifting_ranks, IsEmpty());  // schema 4's columns, empty for old rows
  EXPECT_THAT((*old)->slow_ranks, IsEmpty());
  EXPECT_EQ(*store->CountRankRows("old-job"), 2);

  StoreBatch batch = Batch({MakeStep("old-job", 42, 0, 2)}, {});
  batch.steps[0].stats->duplicate_groups = "0,1";
  batch.steps[0].stats->drifting_ranks = {1};
  batch.steps[0].stats->slow_ranks = {0, 1};
  ASSERT_TRUE(store->Write(batch).ok());
  auto fresh = store->GetStep("old-job", 42);
  ASSERT_TRUE(fresh.ok() && fresh->has_value());
  EXPECT_EQ((*fresh)->duplicate_groups, "0,1");
  EXPECT_THAT((*fresh)->drifting_ranks, ElementsAre(1));
  EXPECT_THAT((*fresh)->slow_ranks, ElementsAre(0, 1));
  // Schema 3: the jobs row carries the job's epoch (JobRegistry), 0 for the old job.
  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  for (const JobRow& job : *jobs) EXPECT_EQ(job.attempt, 0u) << job.job;
  JobRow restarted = MakeJob("old-job", 42);
  restarted.attempt = 2;
  ASSERT_TRUE(store->Write(Batch({}, {restarted})).ok());
  jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok() && !jobs->empty());
  EXPECT_EQ(jobs->front().attempt, 2u);
  auto reader = SqliteStore::Open(path_, read_only);  // migrated: readers open it now
  EXPECT_TRUE(reader.ok()) << reader.status();
}

// A file the schema-4 release wrote (tests/collector/testdata/schema_v4.sql, dumped from a real
// collector fed by loadgen): the migration to 5 keeps every row, adds rank_windows and
// downsampled, and switches the file to auto_vacuum=INCREMENTAL (one VACUUM), after which
// pruning it shrinks it.
TEST_F(SqliteStoreTest, MigratesADatabaseOfSchema4) {
  std::ifstream in(std::string(RANKSCOPE_SOURCE_DIR) + "/tests/collector/testdata/schema_v4.sql");
  ASSERT_TRUE(in.good());
  std::stringstream sql;
  sql << in.rdbuf();
  RawDb(path_).Exec(sql.str());
  ASSERT_EQ(RawDb(path_).Int("PRAGMA user_version"), 4);
  ASSERT_EQ(RawDb(path_).Int("PRAGMA auto_vacuum"), 0);
  const auto before = DumpAll();
  ASSERT_FALSE(before.empty());

  StoreOptions read_only;
  read_only.read_only = true;
  auto early = SqliteStore::Open(path_, read_only);
  ASSERT_FALSE(early.ok());
  EXPECT_THAT(early.status().message(), HasSubstr("schema_version 4 is older"));

  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  {
    RawDb raw(path_);
    EXPECT_EQ(raw.Int("PRAGMA user_version"), SqliteStore::kSchemaVersion);
    EXPECT_EQ(raw.Int("PRAGMA auto_vacuum"), 2);  // INCREMENTAL
    EXPECT_EQ(raw.Int("SELECT count(*) FROM rank_windows"), 0);
    EXPECT_EQ(raw.Int("SELECT count(*) FROM downsampled"), 0);
  }
  // Every row of jobs, step_stats and rank_steps kept as it was; the migrations to 6 and 7 add
  // rank_steps' where-in-the-model columns and step_stats' integrity columns, empty.
  ExpectRowsKept(before, DumpAll());
  EXPECT_EQ(RawDb(path_).Int("SELECT count(*) FROM rank_steps WHERE deviating_buckets != '' OR "
                             "bucket_norms IS NOT NULL OR bucket_z IS NOT NULL"),
            0);
  EXPECT_EQ(*store->CountRankRows("v4-job"), 24);
  auto outlier = store->GetStep("v4-job", 6);
  ASSERT_TRUE(outlier.ok() && outlier->has_value());
  EXPECT_THAT((*outlier)->outlier_ranks, ElementsAre(2));

  // The migrated file is pruned like a new one. In the fixture, four rows are flagged (outlier
  // score >= 6: rank 1 at step 3, the outlier rank 2 at steps 4..6) and kept; the other 20 of the
  // 24 rows are deleted; all of them are folded into the window of steps 0..99.
  RetentionOptions options;
  options.rank_steps = absl::Seconds(1);
  options.steps = absl::ZeroDuration();
  auto usage = store->Usage();
  auto jobs = store->JobExtents();
  ASSERT_TRUE(usage.ok() && jobs.ok());
  const PruneAction action = NextPruneAction(options, absl::Now() + absl::Hours(1), *usage, *jobs);
  ASSERT_EQ(action.kind, PruneAction::Kind::kDownsample);
  auto pruned = store->Prune(action, options.window_steps, options.outlier_threshold);
  ASSERT_TRUE(pruned.ok()) << pruned.status();
  EXPECT_EQ(pruned->rank_rows, 20);
  EXPECT_EQ(pruned->rank_rows_kept, 4);
  auto windows = store->RankWindowsInRange("v4-job", 0, 99, 100);
  ASSERT_TRUE(windows.ok());
  ASSERT_EQ(windows->size(), 4u);
  for (const RankWindowRow& w : *windows) EXPECT_EQ(w.rows, 6);
  auto reader = SqliteStore::Open(path_, read_only);
  EXPECT_TRUE(reader.ok()) << reader.status();
}

// A file the schema-5 release wrote (tests/collector/testdata/schema_v5.sql, dumped from a real
// collector fed by loadgen): the migrations to 6 and 7 keep every row, and the
// aggregation-integrity columns of its steps read back unset (never checked).
TEST_F(SqliteStoreTest, MigratesADatabaseOfSchema5) {
  std::ifstream in(std::string(RANKSCOPE_SOURCE_DIR) + "/tests/collector/testdata/schema_v5.sql");
  ASSERT_TRUE(in.good());
  std::stringstream sql;
  sql << in.rdbuf();
  RawDb(path_).Exec(sql.str());
  ASSERT_EQ(RawDb(path_).Int("PRAGMA user_version"), 5);
  const auto before = DumpAll();
  ASSERT_FALSE(before.empty());

  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(RawDb(path_).Int("PRAGMA user_version"), SqliteStore::kSchemaVersion);
  ExpectRowsKept(before, DumpAll());
  auto old = store->GetStep("v5-job", 6);
  ASSERT_TRUE(old.ok() && old->has_value()) << old.status();
  EXPECT_THAT((*old)->outlier_ranks, ElementsAre(2));
  EXPECT_FALSE((*old)->integrity_error_ratio.has_value());
  EXPECT_EQ((*old)->integrity_fault, "");
  EXPECT_FALSE((*old)->integrity_rank.has_value());

  StoreBatch batch = Batch({MakeStep("v5-job", 7, 0, 4)}, {});
  batch.steps[0].stats->integrity_error_ratio = 37.0;
  batch.steps[0].stats->integrity_relative_error = 0.25;
  batch.steps[0].stats->integrity_fault = "doubled";
  batch.steps[0].stats->integrity_rank = 1;
  batch.steps[0].stats->integrity_weight = 2.0;
  ASSERT_TRUE(store->Write(batch).ok());
  auto fresh = store->GetStep("v5-job", 7);
  ASSERT_TRUE(fresh.ok() && fresh->has_value());
  EXPECT_EQ((*fresh)->integrity_fault, "doubled");
  EXPECT_EQ((*fresh)->integrity_rank, 1u);
  EXPECT_EQ((*fresh)->integrity_weight, 2.0);
}

TEST_F(SqliteStoreTest, OpenErrorsNameThePath) {
  const std::string missing_dir = dir_ + "/no/such/dir/rankscope.db";
  auto store = SqliteStore::Open(missing_dir);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr(missing_dir));

  const std::string garbage = dir_ + "/not-a-database";
  std::ofstream(garbage) << std::string(8192, 'x');
  store = SqliteStore::Open(garbage);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr(garbage));
}

// --- Round trips. ---------------------------------------------------------------------------

// Long: every stored field set and read back, listed once: the list is the test.
TEST_F(SqliteStoreTest, RoundTripsEveryField) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);

  JobRow job = MakeJob("exp-42", 77);
  job.sketch_seed = 0xF00D'0000'0000'0001ull;  // high bit set
  job.last_seen = kT0 + absl::Hours(24 * 14) + absl::Microseconds(999'999);

  StepWrite write;
  write.job = "exp-42";
  write.step = 77;
  StepRow stats = MakeStats(77, 3, 6);
  stats.loss_mean = 2.718281828459045;
  stats.loss_std = 1e-300;
  stats.loss_range = 12345.678901234567;
  stats.grad_norm_cv = 0.1;
  stats.grad_cosine_mean = -0.33333333333333331;
  stats.missing_ranks = "3,7";
  stats.timed_out = true;
  stats.completed_at = kT0 + absl::Microseconds(1);
  stats.grad_noise_scale = 123.5;
  stats.replica_checked = true;
  stats.replica_divergent_ranks = {2};
  stats.outlier_ranks = {0, 2};
  stats.drifting_ranks = {1};
  stats.slow_ranks = {2, 5};
  stats.integrity_error_ratio = 412.5;
  stats.integrity_relative_error = 0.25;
  stats.integrity_fault = "missing";
  stats.integrity_rank = 3;
  stats.integrity_weight = 0.0078125;
  write.stats = stats;

  RankRow full = MakeRank(0, 3, 6);
  full.loss = 1.0 / 3.0;
  full.grad_norm = 5e-324;  // the smallest subnormal
  full.grad_cosine = -1.0;
  full.loss_z = 0.0;
  full.grad_norm_z = -2.5;
  full.reduced_grad_fingerprint = 0x8000'0000'0000'0000ull;
  full.param_fingerprint = 0xFFFF'FFFF'FFFF'FFFFull;
  full.step_time_seconds = 0.0625;
  full.received_at = kT0 + absl::Microseconds(500'001);
  full.replica_ok = false;
  full.outlier_score = 7.25;
  full.step_time_z = -0.5;

  RankRow sparse;  // every optional absent
  sparse.rank = 5;
  sparse.attempt = 3;
  sparse.join_size = 6;
  sparse.loss = 2.0;
  sparse.grad_norm = 4.0;
  sparse.received_at = kT0 - absl::Hours(1);

  write.ranks = {sparse, full};  // written out of rank order
  ASSERT_TRUE(store->Write(Batch({write}, {job})).ok());

  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  ExpectJobEq(job, (*jobs)[0]);

  auto got = store->GetStep("exp-42", 77);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->has_value());
  ExpectStepEq(stats, **got);

  auto recent = store->RecentSteps("exp-42", 10);
  ASSERT_TRUE(recent.ok()) << recent.status();
  ASSERT_EQ(recent->size(), 1u);
  ExpectStepEq(stats, (*recent)[0]);

  auto ranks = store->RankRows("exp-42", 77);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  ASSERT_EQ(ranks->size(), 2u);
  ExpectRankEq(full, (*ranks)[0]);
  ExpectRankEq(sparse, (*ranks)[1]);

  // On disk: uint64 as the int64 bit pattern, times as REAL Unix seconds, ranks as "3,7".
  RawDb raw(path_);
  EXPECT_EQ(raw.Int("SELECT reduced_grad_fingerprint FROM rank_steps WHERE rank = 0"),
            std::numeric_limits<int64_t>::min());
  EXPECT_EQ(raw.Int("SELECT param_fingerprint FROM rank_steps WHERE rank = 0"), -1);
  EXPECT_EQ(raw.One("SELECT reduced_grad_fingerprint FROM rank_steps WHERE rank = 5"), "NULL");
  EXPECT_EQ(static_cast<uint64_t>(raw.Int("SELECT sketch_seed FROM jobs")), job.sketch_seed);
  EXPECT_EQ(raw.One("SELECT missing_ranks FROM step_stats"), "t:3,7");
  EXPECT_EQ(raw.Int("SELECT timed_out FROM step_stats"), 1);
  EXPECT_EQ(raw.One("SELECT typeof(completed_at) FROM step_stats"), "t:real");
  EXPECT_NEAR(std::stod(raw.One("SELECT completed_at FROM step_stats").substr(2)),
              1'700'000'000.123458, 1e-6);
  EXPECT_EQ(raw.Int("SELECT sum(nonfinite) FROM rank_steps"), 0);
}

TEST_F(SqliteStoreTest, NanIsNullAndFlaggedInfIsKept) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  StepWrite write = MakeStep("exp", 1, 0, 0);
  write.stats->loss_mean = kNaN;
  write.stats->loss_std = kNaN;
  write.stats->loss_range = kInf;
  write.stats->grad_norm_mean = -kInf;
  RankRow nan_loss = MakeRank(0, 0, 4, kNaN);
  nan_loss.grad_cosine = kNaN;  // an optional that holds NaN reads back as nullopt
  nan_loss.loss_z = -kInf;
  RankRow inf_norm = MakeRank(1, 0, 4);
  inf_norm.grad_norm = kInf;
  RankRow neg_inf_norm = MakeRank(2, 0, 4);
  neg_inf_norm.grad_norm = -kInf;
  RankRow finite = MakeRank(3, 0, 4);
  finite.grad_norm_z = kInf;  // only loss and grad_norm set the flag
  write.ranks = {nan_loss, inf_norm, neg_inf_norm, finite};
  ASSERT_TRUE(store->Write(Batch({write})).ok());

  auto step = store->GetStep("exp", 1);
  ASSERT_TRUE(step.ok() && step->has_value());
  ExpectStepEq(*write.stats, **step);

  auto ranks = store->RankRows("exp", 1);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  ASSERT_EQ(ranks->size(), 4u);
  EXPECT_TRUE(std::isnan((*ranks)[0].loss));
  EXPECT_EQ((*ranks)[0].grad_cosine, std::nullopt);
  EXPECT_EQ((*ranks)[0].loss_z, -kInf);
  EXPECT_EQ((*ranks)[1].grad_norm, kInf);
  EXPECT_EQ((*ranks)[2].grad_norm, -kInf);
  EXPECT_EQ((*ranks)[3].grad_norm_z, kInf);
  nan_loss.grad_cosine = std::nullopt;
  ExpectRankEq(nan_loss, (*ranks)[0]);
  ExpectRankEq(inf_norm, (*ranks)[1]);
  ExpectRankEq(neg_inf_norm, (*ranks)[2]);
  ExpectRankEq(finite, (*ranks)[3]);

  RawDb raw(path_);
  EXPECT_THAT(raw.Rows("SELECT rank, typeof(loss), typeof(grad_norm), nonfinite FROM rank_steps "
                       "ORDER BY rank"),
              ElementsAre(ElementsAre("0", "t:null", "t:real", "1"),
                          ElementsAre("1", "t:real", "t:real", "1"),
                          ElementsAre("2", "t:real", "t:real", "1"),
                          ElementsAre("3", "t:real", "t:real", "0")));
  EXPECT_EQ(raw.One("SELECT grad_norm FROM rank_steps WHERE rank = 1"), "r:inf");
  EXPECT_EQ(raw.One("SELECT loss_mean FROM step_stats"), "NULL");
  EXPECT_EQ(raw.One("SELECT loss_range FROM step_stats"), "r:inf");
}

// --- Idempotency and "newest report wins". ---------------------------------------------------

TEST_F(SqliteStoreTest, TheSameBatchTwiceChangesNothing) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  StoreBatch batch = Batch({MakeStep("a", 1, 0, 8), MakeStep("a", 2, 0, 8), MakeStep("b", 1, 1, 3)},
                           {MakeJob("a", 2), MakeJob("b", 1)});
  ASSERT_TRUE(store->Write(batch).ok());
  const auto before = DumpAll();
  ASSERT_EQ(before.size(), 2u + 3u + 19u);
  ASSERT_TRUE(store->Write(batch).ok());
  EXPECT_EQ(DumpAll(), before);
  EXPECT_EQ(*store->CountRankRows("a"), 16);
  EXPECT_EQ(*store->CountRankRows("b"), 3);
}

TEST_F(SqliteStoreTest, AHigherAttemptReplacesEvenWithFewerRanks) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 9, 0, 8, /*loss=*/1.0)})).ok());
  // The job restarted from a checkpoint: attempt 1 of step 9, joined with 4 ranks so far.
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 9, 1, 4, /*loss=*/7.0)})).ok());

  auto step = store->GetStep("exp", 9);
  ASSERT_TRUE(step.ok() && step->has_value());
  EXPECT_EQ((*step)->attempt, 1u);
  EXPECT_EQ((*step)->ranks, 4u);
  EXPECT_EQ((*step)->loss_mean, 7.0);
  auto ranks = store->RankRows("exp", 9);
  ASSERT_TRUE(ranks.ok());
  ASSERT_EQ(ranks->size(), 8u);
  for (const RankRow& row : *ranks) {
    SCOPED_TRACE(row.rank);
    // Ranks 0-3 were reported again; 4-7 keep the old attempt's rows until they report.
    EXPECT_EQ(row.attempt, row.rank < 4 ? 1u : 0u);
    EXPECT_EQ(row.loss, row.rank < 4 ? 7.0 : 1.0);
  }

  // A late resend of the old attempt changes nothing.
  const auto before = DumpAll();
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 9, 0, 8, /*loss=*/1.0)})).ok());
  EXPECT_EQ(DumpAll(), before);
}

TEST_F(SqliteStoreTest, SameAttemptReplacesOnlyWithAtLeastAsManyRanks) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 3, 2, 6, /*loss=*/1.0)})).ok());
  const auto six = DumpAll();

  // A resend after a collector crash, joined with fewer ranks: does not degrade.
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 3, 2, 5, /*loss=*/5.0)})).ok());
  EXPECT_EQ(DumpAll(), six);

  // As full a join of the same attempt replaces (the newest report wins).
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 3, 2, 6, /*loss=*/6.0)})).ok());
  auto six_again = store->GetStep("exp", 3);
  ASSERT_TRUE(six_again.ok() && six_again->has_value());
  EXPECT_EQ((*six_again)->loss_mean, 6.0);
  EXPECT_EQ((*store->RankRows("exp", 3))[5].loss, 6.0);

  // A fuller join of the same attempt replaces.
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 3, 2, 8, /*loss=*/8.0)})).ok());
  auto step = store->GetStep("exp", 3);
  ASSERT_TRUE(step.ok() && step->has_value());
  EXPECT_EQ((*step)->ranks, 8u);
  EXPECT_EQ((*step)->loss_mean, 8.0);
  auto ranks = store->RankRows("exp", 3);
  ASSERT_TRUE(ranks.ok());
  ASSERT_EQ(ranks->size(), 8u);
  for (const RankRow& row : *ranks) {
    EXPECT_EQ(row.join_size, 8u);
    EXPECT_EQ(row.loss, 8.0);
  }
}

TEST_F(SqliteStoreTest, ALateRankRowInsertsButNeverDegradesAJoinedRow) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 4, 0, 3)})).ok());  // step timed out, 3 of 8

  StepWrite late;
  late.job = "exp";
  late.step = 4;
  RankRow r6 = MakeRank(6, 0, /*join_size=*/1, /*loss=*/9.0);
  r6.grad_cosine.reset();
  r6.loss_z.reset();
  r6.grad_norm_z.reset();
  RankRow r1 = MakeRank(1, 0, /*join_size=*/1, /*loss=*/9.0);  // a duplicate of a joined rank
  r1.grad_cosine.reset();
  late.ranks = {r6, r1};
  ASSERT_TRUE(store->Write(Batch({late})).ok());

  auto ranks = store->RankRows("exp", 4);
  ASSERT_TRUE(ranks.ok());
  ASSERT_EQ(ranks->size(), 4u);
  ExpectRankEq(MakeRank(1, 0, 3), (*ranks)[1]);
  ExpectRankEq(r6, (*ranks)[3]);
  auto step = store->GetStep("exp", 4);
  ASSERT_TRUE(step.ok() && step->has_value());
  ExpectStepEq(MakeStats(4, 0, 3), **step);  // untouched by the late report
  EXPECT_EQ(*store->CountRankRows("exp"), 4);
}

TEST_F(SqliteStoreTest, JobUpsertKeepsTheExtremesAndTheLatestConfig) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  JobRow first = MakeJob("exp", 100);
  ASSERT_TRUE(store->Write(Batch({}, {first})).ok());

  JobRow older = MakeJob("exp", 50);  // an earlier first_seen and last_seen, a smaller step
  older.first_seen = kT0 - absl::Hours(1);
  older.last_seen = kT0 - absl::Hours(1);
  older.world_size = 16;
  older.sketch_dim = 256;
  older.sketch_seed = ~0ull;
  ASSERT_TRUE(store->Write(Batch({}, {older})).ok());

  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  JobRow want = older;
  want.first_seen = older.first_seen;
  want.last_seen = first.last_seen;
  want.last_step = 100;
  ExpectJobEq(want, (*jobs)[0]);

  JobRow newer = MakeJob("exp", 200);
  newer.last_seen = kT0 + absl::Hours(2);
  ASSERT_TRUE(store->Write(Batch({}, {newer})).ok());
  jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok());
  want = newer;
  want.first_seen = older.first_seen;
  ExpectJobEq(want, (*jobs)[0]);
}

TEST_F(SqliteStoreTest, AnEmptyBatchIsANoOp) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->Write(StoreBatch()).ok());
  EXPECT_THAT(DumpAll(), IsEmpty());
}

TEST_F(SqliteStoreTest, RejectsABadBatchWithoutWritingAnyOfIt) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  const uint64_t too_big = uint64_t{1} << 63;
  absl::Status status = store->Write(
      Batch({MakeStep("exp", 1, 0, 2), MakeStep("exp", too_big, 0, 2)}, {MakeJob("exp", 1)}));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("9223372036854775808"));

  StepWrite mismatch = MakeStep("exp", 2, 0, 2);
  mismatch.stats->step = 3;
  status = store->Write(Batch({MakeStep("exp", 1, 0, 2), mismatch}));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(DumpAll(), IsEmpty());

  // Reads of such a step find nothing rather than failing.
  auto step = store->GetStep("exp", too_big);
  ASSERT_TRUE(step.ok());
  EXPECT_FALSE(step->has_value());
  auto ranks = store->RankRows("exp", too_big);
  ASSERT_TRUE(ranks.ok());
  EXPECT_THAT(*ranks, IsEmpty());
}

// --- Queries. ----------------------------------------------------------------------------------

TEST_F(SqliteStoreTest, RecentStepsAreNewestFirstPerJob) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  std::vector<StepWrite> steps;
  for (uint64_t s : {3, 1, 10, 7, 2, 9, 4, 8, 6, 5}) steps.push_back(MakeStep("a", s, 0, 2));
  steps.push_back(MakeStep("b", 100, 0, 2));
  steps.push_back(MakeStep("a-suffix", 50, 0, 2));
  ASSERT_TRUE(store->Write(Batch(std::move(steps))).ok());

  auto step_numbers = [](const std::vector<StepRow>& rows) {
    std::vector<uint64_t> out;
    for (const StepRow& row : rows) out.push_back(row.step);
    return out;
  };
  auto recent = store->RecentSteps("a", 3);
  ASSERT_TRUE(recent.ok()) << recent.status();
  EXPECT_THAT(step_numbers(*recent), ElementsAre(10, 9, 8));
  recent = store->RecentSteps("a", 100);
  ASSERT_TRUE(recent.ok());
  EXPECT_THAT(step_numbers(*recent), ElementsAre(10, 9, 8, 7, 6, 5, 4, 3, 2, 1));
  recent = store->RecentSteps("a", 0);
  ASSERT_TRUE(recent.ok());
  EXPECT_THAT(*recent, IsEmpty());
  recent = store->RecentSteps("nope", 5);
  ASSERT_TRUE(recent.ok());
  EXPECT_THAT(*recent, IsEmpty());
  EXPECT_EQ(store->RecentSteps("a", -1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SqliteStoreTest, RangesOfStepsAndRankRowsAreOldestFirstAndBounded) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  std::vector<StepWrite> steps;
  for (uint64_t s : {5, 1, 3, 2, 4}) steps.push_back(MakeStep("a", s, 0, 3));
  steps.push_back(MakeStep("a-other", 3, 0, 3));
  ASSERT_TRUE(store->Write(Batch(std::move(steps))).ok());

  auto range = store->StepRange("a", 2, 4, 100);
  ASSERT_TRUE(range.ok()) << range.status();
  std::vector<uint64_t> numbers;
  for (const StepRow& row : *range) numbers.push_back(row.step);
  EXPECT_THAT(numbers, ElementsAre(2, 3, 4));
  range = store->StepRange("a", 0, std::numeric_limits<uint64_t>::max(), 2);
  ASSERT_TRUE(range.ok());
  ASSERT_EQ(range->size(), 2u);
  EXPECT_EQ((*range)[0].step, 1u);
  EXPECT_THAT(*store->StepRange("a", 4, 2, 10), IsEmpty());
  EXPECT_EQ(store->StepRange("a", 0, 1, -1).status().code(), absl::StatusCode::kInvalidArgument);

  auto ranks = store->RankRowsInRange("a", 4, 5, 100);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  std::vector<std::pair<uint64_t, uint32_t>> keys;
  for (const StepRankRow& r : *ranks) keys.emplace_back(r.step, r.row.rank);
  EXPECT_THAT(keys,
              ElementsAre(std::make_pair(4u, 0u), std::make_pair(4u, 1u), std::make_pair(4u, 2u),
                          std::make_pair(5u, 0u), std::make_pair(5u, 1u), std::make_pair(5u, 2u)));
  // The rows read the same as RankRows of one step.
  auto one = store->RankRows("a", 5);
  ASSERT_TRUE(one.ok());
  for (size_t i = 0; i < one->size(); ++i) {
    EXPECT_EQ((*ranks)[3 + i].row.loss, (*one)[i].loss);
    EXPECT_EQ((*ranks)[3 + i].row.replica_ok, (*one)[i].replica_ok);
    EXPECT_EQ((*ranks)[3 + i].row.outlier_score, (*one)[i].outlier_score);
  }
  ranks = store->RankRowsInRange("a", 0, 100, 4);
  ASSERT_TRUE(ranks.ok());
  EXPECT_EQ(ranks->size(), 4u);
  EXPECT_THAT(*store->RankRowsInRange("nope", 0, 100, 10), IsEmpty());
  EXPECT_EQ(store->RankRowsInRange("a", 0, 1, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SqliteStoreTest, RankSeriesReadsOneRankAndTheStoredNonFiniteVerdict) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  std::vector<StepWrite> steps;
  for (uint64_t s : {1, 2, 3, 5, 8}) steps.push_back(MakeStep("a", s, 0, 3));
  steps.push_back(MakeStep("b", 2, 0, 3));
  // Step 3: rank 1's loss is NaN (stored NULL, nonfinite 1); rank 2 has no loss at all (a
  // pipeline stage: NULL, nonfinite 0). Step 5: rank 1's sketch was non-finite.
  steps[2].ranks[1].loss = std::nan("");
  steps[2].ranks[2].loss = std::nan("");
  steps[2].ranks[2].loss_absent = true;
  steps[3].ranks[1].sketch_nonfinite = true;
  ASSERT_TRUE(store->Write(Batch(std::move(steps))).ok());

  auto series = store->RankSeriesInRange("a", 1, 2, 8, 100);
  ASSERT_TRUE(series.ok()) << series.status();
  std::vector<std::pair<uint64_t, bool>> got;
  for (const StepRankRow& r : *series) {
    EXPECT_EQ(r.row.rank, 1u);
    got.emplace_back(r.step, r.nonfinite);
  }
  EXPECT_THAT(got, ElementsAre(std::make_pair(2u, false), std::make_pair(3u, true),
                               std::make_pair(5u, true), std::make_pair(8u, false)));
  // The same rows, and verdicts, as the range of every rank.
  auto all = store->RankRowsInRange("a", 2, 8, 100);
  ASSERT_TRUE(all.ok());
  std::vector<std::pair<uint64_t, bool>> filtered;
  for (const StepRankRow& r : *all) {
    if (r.row.rank == 1) filtered.emplace_back(r.step, r.nonfinite);
    // The stage without a loss reads back NaN but is not non-finite.
    if (r.step == 3 && r.row.rank == 2) {
      EXPECT_FALSE(r.nonfinite);
    }
  }
  EXPECT_EQ(got, filtered);
  series = store->RankSeriesInRange("a", 1, 0, std::numeric_limits<uint64_t>::max(), 2);
  ASSERT_TRUE(series.ok());
  ASSERT_EQ(series->size(), 2u);
  EXPECT_EQ((*series)[1].step, 2u);
  EXPECT_THAT(*store->RankSeriesInRange("a", 7, 0, 100, 10), IsEmpty());
  EXPECT_THAT(*store->RankSeriesInRange("a", 1, 6, 7, 10), IsEmpty());
  EXPECT_THAT(*store->RankSeriesInRange("a", 1, 8, 2, 10), IsEmpty());
  EXPECT_EQ(store->RankSeriesInRange("a", 1, 0, 1, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SqliteStoreTest, AbsentStepsAndJobsReadAsEmpty) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Write(Batch({MakeStep("a", 1, 0, 2)})).ok());
  auto step = store->GetStep("a", 2);
  ASSERT_TRUE(step.ok());
  EXPECT_FALSE(step->has_value());
  auto ranks = store->RankRows("a", 2);
  ASSERT_TRUE(ranks.ok());
  EXPECT_THAT(*ranks, IsEmpty());
  EXPECT_EQ(*store->CountRankRows("b"), 0);
  auto jobs = store->ListJobs();  // rank rows and stats do not create a jobs row
  ASSERT_TRUE(jobs.ok());
  EXPECT_THAT(*jobs, IsEmpty());
}

TEST_F(SqliteStoreTest, ListJobsIsOrderedByName) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(
      store->Write(Batch({}, {MakeJob("zeta"), MakeJob("alpha"), MakeJob("Mid"), MakeJob("beta")}))
          .ok());
  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok());
  std::vector<std::string> names;
  for (const JobRow& job : *jobs) names.push_back(job.job);
  EXPECT_THAT(names, ElementsAre("Mid", "alpha", "beta", "zeta"));  // BINARY collation
}

TEST_F(SqliteStoreTest, InjectionLookingJobNamesAreStoredVerbatim) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  const std::vector<std::string> names = {
      "x'); DROP TABLE jobs; --",
      "Robert\"); DELETE FROM rank_steps WHERE ('1'='1",
      "a%b_c",
      "' OR '1'='1",
      "ünïcödé\ttab\nnewline",
      "",
      std::string("nul\0byte", 8),
  };
  for (size_t i = 0; i < names.size(); ++i) {
    ASSERT_TRUE(store
                    ->Write(Batch({MakeStep(names[i], 1, 0, static_cast<uint32_t>(i + 1))},
                                  {MakeJob(names[i], 1)}))
                    .ok())
        << i;
  }
  auto jobs = store->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> stored;
  for (const JobRow& job : *jobs) stored.push_back(job.job);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_THAT(stored, ElementsAreArray(sorted));
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(*store->CountRankRows(names[i]), static_cast<int64_t>(i + 1)) << i;
    auto step = store->GetStep(names[i], 1);
    ASSERT_TRUE(step.ok() && step->has_value()) << i;
    EXPECT_EQ((*step)->ranks, i + 1);
  }
  // No pattern matching, no truncation at NUL.
  EXPECT_EQ(*store->CountRankRows("aXbYc"), 0);
  EXPECT_EQ(*store->CountRankRows("nul"), 0);
  RawDb raw(path_);
  // jobs, rank_identities, rank_steps, step_stats, rank_windows, downsampled: no table dropped.
  EXPECT_EQ(raw.Int("SELECT count(*) FROM sqlite_schema WHERE type = 'table'"), 6);
}

// --- Concurrency with other connections. ------------------------------------------------------

TEST_F(SqliteStoreTest, AReaderKeepsItsSnapshotWhileTheWriterCommits) {
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 1, 0, 4)})).ok());
  RawDb reader(path_);
  reader.Exec("BEGIN");
  EXPECT_EQ(reader.Int("SELECT count(*) FROM rank_steps"), 4);        // the read transaction starts
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 2, 0, 4)})).ok());  // not blocked by it
  EXPECT_EQ(reader.Int("SELECT count(*) FROM rank_steps"), 4);
  reader.Exec("COMMIT");
  EXPECT_EQ(reader.Int("SELECT count(*) FROM rank_steps"), 8);
}

TEST_F(SqliteStoreTest, ALockHeldByAnotherWriterIsUnavailableAndWritesNothing) {
  StoreOptions options;
  options.busy_timeout = absl::ZeroDuration();
  auto store = OpenStore(options);
  ASSERT_NE(store, nullptr);
  RawDb other(path_);
  other.Exec("BEGIN IMMEDIATE");
  absl::Status status = store->Write(Batch({MakeStep("exp", 1, 0, 4)}));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr(path_));
  other.Exec("ROLLBACK");
  EXPECT_THAT(DumpAll(), IsEmpty());
  // The caller retries, and the retry succeeds.
  ASSERT_TRUE(store->Write(Batch({MakeStep("exp", 1, 0, 4)})).ok());
  EXPECT_EQ(*store->CountRankRows("exp"), 4);
}

// --- Write errors. ------------------------------------------------------------------------------
// The tests run as root, which ignores file permissions, so a read-only file is not a reliable
// write error. A read-only connection (SQLITE_OPEN_READONLY) and a size cap (max_page_count)
// produce SQLite's real SQLITE_READONLY and SQLITE_FULL instead.

TEST_F(SqliteStoreTest, AReadOnlyConnectionRefusesWritesWithPermissionDenied) {
  auto writer = OpenStore();
  ASSERT_NE(writer, nullptr);
  ASSERT_TRUE(writer->Write(Batch({MakeStep("exp", 1, 0, 4)}, {MakeJob("exp", 1)})).ok());

  StoreOptions read_only;
  read_only.read_only = true;
  auto reader = OpenStore(read_only);
  ASSERT_NE(reader, nullptr);
  const auto before = DumpAll();
  absl::Status status = reader->Write(Batch({MakeStep("exp", 2, 0, 4)}, {MakeJob("exp", 2)}));
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_THAT(status.message(), HasSubstr(path_));
  EXPECT_THAT(status.message(), HasSubstr("readonly"));
  EXPECT_EQ(DumpAll(), before);

  // Reads work, and see what the writer commits afterwards.
  EXPECT_EQ(*reader->CountRankRows("exp"), 4);
  ASSERT_TRUE(writer->Write(Batch({MakeStep("exp", 2, 0, 4)})).ok());
  EXPECT_EQ(*reader->CountRankRows("exp"), 8);
  auto recent = reader->RecentSteps("exp", 1);
  ASSERT_TRUE(recent.ok());
  ASSERT_EQ(recent->size(), 1u);
  EXPECT_EQ((*recent)[0].step, 2u);
}

TEST_F(SqliteStoreTest, AReadOnlyOpenNeedsAnExistingSchema) {
  StoreOptions read_only;
  read_only.read_only = true;
  auto store = SqliteStore::Open(path_, read_only);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr(path_));

  RawDb(path_).Exec("CREATE TABLE unrelated(x)");
  store = SqliteStore::Open(path_, read_only);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
}

TEST_F(SqliteStoreTest, AFullDiskIsResourceExhaustedAtomicAndRetryable) {
  constexpr uint32_t kRanks = 64;
  auto step_batch = [&](uint64_t b) {
    std::vector<StepWrite> steps;
    for (uint64_t s = b * 4; s < b * 4 + 4; ++s) steps.push_back(MakeStep("exp", s, 0, kRanks));
    return Batch(std::move(steps), {MakeJob("exp", b * 4 + 3)});
  };
  absl::Status status;
  uint64_t failed = 0;
  {
    StoreOptions options;
    options.max_size_bytes = 256 * 1024;
    auto store = OpenStore(options);
    ASSERT_NE(store, nullptr);
    for (uint64_t b = 0; b < 1000; ++b) {
      status = store->Write(step_batch(b));
      if (!status.ok()) {
        failed = b;
        break;
      }
    }
    ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    ASSERT_GT(failed, 0u);
    EXPECT_THAT(status.message(), HasSubstr(path_));
    EXPECT_THAT(status.message(), HasSubstr("full"));

    // Nothing of the failed batch is stored; everything before it is, and reads still work.
    EXPECT_EQ(*store->CountRankRows("exp"), static_cast<int64_t>(failed * 4 * kRanks));
    auto recent = store->RecentSteps("exp", 1);
    ASSERT_TRUE(recent.ok()) << recent.status();
    ASSERT_EQ(recent->size(), 1u);
    EXPECT_EQ((*recent)[0].step, failed * 4 - 1);
    auto jobs = store->ListJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ(jobs->size(), 1u);
    EXPECT_EQ((*jobs)[0].last_step, failed * 4 - 1);
    RawDb raw(path_);
    EXPECT_EQ(raw.One("PRAGMA integrity_check"), "t:ok");

    // Still full: the retry fails the same way, without side effects.
    EXPECT_EQ(store->Write(step_batch(failed)).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(*store->CountRankRows("exp"), static_cast<int64_t>(failed * 4 * kRanks));
  }
  // Space freed (no cap): the retried batch is stored.
  auto store = OpenStore();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Write(step_batch(failed)).ok());
  EXPECT_EQ(*store->CountRankRows("exp"), static_cast<int64_t>((failed + 1) * 4 * kRanks));
}

// --- Crash safety: a writer process SIGKILLed in the middle of a batch. -------------------------
//
// A child process opens the store and writes batch after batch, reporting each commit through a
// pipe. The parent SIGKILLs it at a point the child announces (no sleeps): inside a batch after
// SQLite has spilled uncommitted pages into the WAL, right before COMMIT, or wherever the child
// happens to be after its N-th commit. Hooks are installed on the store's connection from the
// test through sqlite3_auto_extension, so the store needs no test-only code.

constexpr uint64_t kCrashStepsPerBatch = 40;
constexpr uint32_t kCrashRanks = 64;
const char kCrashJob[] = "crash";

StoreBatch CrashBatch(uint64_t b) {
  std::vector<StepWrite> steps;
  for (uint64_t s = b * kCrashStepsPerBatch; s < (b + 1) * kCrashStepsPerBatch; ++s) {
    StepWrite write = MakeStep(kCrashJob, s, 0, kCrashRanks, /*loss=*/static_cast<double>(s));
    for (RankRow& row : write.ranks) row.param_fingerprint = s * 1000 + row.rank;
    steps.push_back(std::move(write));
  }
  return Batch(std::move(steps), {MakeJob(kCrashJob, (b + 1) * kCrashStepsPerBatch - 1)});
}

enum class KillPoint { kMidBatch, kBeforeCommit, kAfterCommits };

struct ChildMessage {
  char kind;  // 'C' committed batch, 'I' inside (blocked in) batch, 'E' error
  int64_t batch;
  int64_t spills;  // SQLITE_DBSTATUS_CACHE_SPILL of the connection so far
};

// The child's state; only ever touched in the child process.
struct CrashHooks {
  int fd = -1;
  KillPoint point = KillPoint::kAfterCommits;
  bool armed = false;
  int64_t batch = 0;
  int64_t ticks = 0;             // progress-handler calls in the current batch
  int64_t last_batch_ticks = 0;  // ... in the previous, committed batch
  sqlite3* db = nullptr;
} g_hooks;

void Send(char kind, int64_t batch) {
  ChildMessage message{kind, batch, 0};
  if (g_hooks.db != nullptr) {
    int current = 0, highwater = 0;
    sqlite3_db_status(g_hooks.db, SQLITE_DBSTATUS_CACHE_SPILL, &current, &highwater, 0);
    message.spills = current;
  }
  ssize_t n = write(g_hooks.fd, &message, sizeof(message));
  (void)n;
}

[[noreturn]] void BlockUntilKilled(int64_t batch) {
  Send('I', batch);
  for (;;) pause();
}

int OnProgress(void*) {
  ++g_hooks.ticks;
  if (g_hooks.armed && g_hooks.point == KillPoint::kMidBatch &&
      g_hooks.ticks == g_hooks.last_batch_ticks / 2) {
    BlockUntilKilled(g_hooks.batch);
  }
  return 0;
}

int OnCommit(void*) {
  if (g_hooks.armed && g_hooks.point == KillPoint::kBeforeCommit) BlockUntilKilled(g_hooks.batch);
  return 0;
}

int InstallHooks(sqlite3* db, char**, const sqlite3_api_routines*) {
  g_hooks.db = db;
  // A small page cache makes SQLite write uncommitted pages to the WAL in mid-transaction.
  sqlite3_exec(db, "PRAGMA cache_size = 16", nullptr, nullptr, nullptr);
  sqlite3_progress_handler(db, 100, &OnProgress, nullptr);
  sqlite3_commit_hook(db, &OnCommit, nullptr);
  return SQLITE_OK;
}

[[noreturn]] void CrashChild(const std::string& path, int fd, KillPoint point, int64_t arm_at) {
  g_hooks.fd = fd;
  g_hooks.point = point;
  sqlite3_auto_extension(reinterpret_cast<void (*)(void)>(&InstallHooks));
  auto store = SqliteStore::Open(path);
  if (!store.ok()) {
    Send('E', -1);
    _exit(1);
  }
  StoreBatch batch = CrashBatch(0);
  for (int64_t b = 0; b < arm_at + 10'000; ++b) {
    g_hooks.batch = b;
    g_hooks.ticks = 0;
    g_hooks.armed = b == arm_at && point != KillPoint::kAfterCommits;
    if (!(*store)->Write(batch).ok()) {
      Send('E', b);
      _exit(1);
    }
    g_hooks.last_batch_ticks = g_hooks.ticks;
    // The next batch is built before the report, so that a kill right after it lands in Write.
    StoreBatch next = CrashBatch(b + 1);
    Send('C', b);
    batch = std::move(next);
  }
  _exit(2);  // the parent should have killed us long before
}

bool ReadMessage(int fd, ChildMessage* message) {
  char* p = reinterpret_cast<char*>(message);
  size_t left = sizeof(*message);
  while (left > 0) {
    ssize_t n = read(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

struct CrashOutcome {
  int64_t last_committed = -1;  // the last batch the child reported committed
  int64_t spills_at_kill = -1;  // for the 'I' kill points
};

// Runs the child, kills it at `point` (after `commits` commits), and reaps it.
CrashOutcome RunAndKill(const std::string& path, KillPoint point, int64_t commits) {
  CrashOutcome outcome;
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  std::fflush(nullptr);
  pid_t pid = fork();
  EXPECT_GE(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    CrashChild(path, fds[1], point, commits);
  }
  close(fds[1]);
  ChildMessage message;
  bool killed = false;
  while (!killed && ReadMessage(fds[0], &message)) {
    switch (message.kind) {
      case 'C':
        outcome.last_committed = message.batch;
        if (point == KillPoint::kAfterCommits && message.batch + 1 == commits) {
          kill(pid, SIGKILL);
          killed = true;
        }
        break;
      case 'I':
        EXPECT_EQ(message.batch, commits);
        outcome.spills_at_kill = message.spills;
        kill(pid, SIGKILL);
        killed = true;
        break;
      default:
        ADD_FAILURE() << "child failed in batch " << message.batch;
        kill(pid, SIGKILL);
        killed = true;
    }
  }
  EXPECT_TRUE(killed) << "the child exited before it was killed";
  close(fds[0]);
  int wstatus = 0;
  EXPECT_EQ(waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL) << wstatus;
  return outcome;
}

// Checks the file after the crash; returns how many batches it holds.
int64_t ExpectWholeBatchesOnly(const std::string& path, int64_t last_committed) {
  auto store = SqliteStore::Open(path);  // recovers the WAL
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return -1;
  RawDb raw(path);
  EXPECT_EQ(raw.One("PRAGMA integrity_check"), "t:ok");

  int64_t present = 0;
  bool gap = false;
  for (int64_t b = 0; b <= last_committed + 10'002; ++b) {
    const uint64_t first = b * kCrashStepsPerBatch;
    const uint64_t last = first + kCrashStepsPerBatch - 1;
    const int64_t ranks = raw.Int(
        absl::StrCat("SELECT count(*) FROM rank_steps WHERE job = 'crash' AND step BETWEEN ", first,
                     " AND ", last));
    const int64_t stats = raw.Int(
        absl::StrCat("SELECT count(*) FROM step_stats WHERE job = 'crash' AND step BETWEEN ", first,
                     " AND ", last));
    if (ranks == 0 && stats == 0) {
      gap = true;
      if (b > last_committed + 2) break;
      continue;
    }
    EXPECT_FALSE(gap) << "batch " << b << " is stored but an earlier one is not";
    EXPECT_EQ(ranks, static_cast<int64_t>(kCrashStepsPerBatch * kCrashRanks))
        << "batch " << b << " is half stored";
    EXPECT_EQ(stats, static_cast<int64_t>(kCrashStepsPerBatch))
        << "batch " << b << " is half stored";
    ++present;
  }
  EXPECT_GE(present, last_committed + 1) << "a committed batch is missing";

  // The three tables agree: the jobs row was written in the same transaction as the steps.
  auto jobs = (*store)->ListJobs();
  EXPECT_TRUE(jobs.ok());
  if (jobs.ok() && present > 0) {
    EXPECT_EQ(jobs->size(), 1u);
    if (!jobs->empty()) {
      EXPECT_EQ((*jobs)[0].last_step, present * kCrashStepsPerBatch - 1);
    }
  }
  // Contents are intact, not only counts.
  if (present > 0) {
    const uint64_t step = present * kCrashStepsPerBatch - 1;
    auto ranks = (*store)->RankRows(kCrashJob, step);
    EXPECT_TRUE(ranks.ok());
    if (ranks.ok()) {
      EXPECT_EQ(ranks->size(), kCrashRanks);
      for (const RankRow& row : *ranks) {
        EXPECT_EQ(row.loss, static_cast<double>(step));
        EXPECT_EQ(row.param_fingerprint, step * 1000 + row.rank);
      }
    }
  }
  // The store takes writes again.
  const int64_t next = present;
  EXPECT_TRUE((*store)->Write(CrashBatch(next)).ok());
  EXPECT_EQ(*(*store)->CountRankRows(kCrashJob),
            static_cast<int64_t>((next + 1) * kCrashStepsPerBatch * kCrashRanks));
  return present;
}

TEST_F(SqliteStoreTest, KilledInTheMiddleOfABatchAfterPagesSpilledToTheWal) {
  CrashOutcome outcome = RunAndKill(path_, KillPoint::kMidBatch, /*commits=*/3);
  EXPECT_EQ(outcome.last_committed, 2);
  EXPECT_GT(outcome.spills_at_kill, 0) << "no uncommitted page reached the WAL";
  EXPECT_EQ(ExpectWholeBatchesOnly(path_, outcome.last_committed), 3);
}

TEST_F(SqliteStoreTest, KilledRightBeforeCommit) {
  CrashOutcome outcome = RunAndKill(path_, KillPoint::kBeforeCommit, /*commits=*/3);
  EXPECT_EQ(outcome.last_committed, 2);
  EXPECT_EQ(ExpectWholeBatchesOnly(path_, outcome.last_committed), 3);
}

TEST_F(SqliteStoreTest, KilledWhereverItIsAfterItsCommits) {
  // The kill lands wherever the child is after its N-th commit: usually inside batch N, at times
  // past it, in a checkpoint, or in the next BEGIN. Several rounds on the same file.
  int64_t committed_total = 0;
  for (int64_t round = 1; round <= 4; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::filesystem::remove(path_);
    std::filesystem::remove(path_ + "-wal");
    std::filesystem::remove(path_ + "-shm");
    CrashOutcome outcome = RunAndKill(path_, KillPoint::kAfterCommits, /*commits=*/round);
    EXPECT_EQ(outcome.last_committed, round - 1);
    committed_total += ExpectWholeBatchesOnly(path_, outcome.last_committed);
  }
  EXPECT_GE(committed_total, 1 + 2 + 3 + 4);
}

}  // namespace
}  // namespace rankscope::collector
