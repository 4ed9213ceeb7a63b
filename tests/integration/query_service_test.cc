// The Query service's reads run on the StoreReaderPool, not on gRPC's callback threads: many
// concurrent calls against a real collector (gRPC on port 0, a real SQLite file) are all answered
// correctly, and the pool's bound refuses a call with RESOURCE_EXHAUSTED, deterministically: the
// test holds the pool's only thread and fills its queue itself before calling.
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "collector/collector.h"
#include "collector/query/row_proto.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/store_reader_pool.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "tests/testing/test_util.h"

namespace rankscope::collector {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kSteps = 40;
constexpr uint32_t kWorld = 4;

// A database holding job "stored" with steps 1..kSteps of kWorld ranks.
void FillDatabase(const std::string& path) {
  auto store = SqliteStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  StoreBatch batch;
  JobRow job;
  job.job = "stored";
  job.world_size = kWorld;
  job.sketch_dim = 64;
  job.sketch_seed = 7;
  job.last_step = kSteps;
  batch.jobs.push_back(job);
  for (uint64_t step = 1; step <= kSteps; ++step) {
    StepWrite write;
    write.job = "stored";
    write.step = step;
    StepRow stats;
    stats.step = step;
    stats.ranks = kWorld;
    stats.world_size = kWorld;
    stats.loss_mean = static_cast<double>(step);
    write.stats = stats;
    for (uint32_t r = 0; r < kWorld; ++r) {
      RankRow row;
      row.rank = r;
      row.join_size = kWorld;
      row.loss = step + 0.01 * r;
      write.ranks.push_back(row);
    }
    batch.steps.push_back(std::move(write));
  }
  ASSERT_TRUE((*store)->Write(batch).ok());
}

class QueryServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::MakeTempDir() + "/rankscope.db";
    FillDatabase(path_);
  }

  std::unique_ptr<Collector> Start(size_t threads, size_t max_queued) {
    CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.db_path = path_;
    o.query_threads = threads;
    o.max_queued_queries = max_queued;
    auto c = Collector::Start(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  static std::unique_ptr<v1::Query::Stub> Stub(const Collector& c) {
    return v1::Query::NewStub(
        grpc::CreateChannel(c.grpc_target(), grpc::InsecureChannelCredentials()));
  }

  std::string path_;
};

// The step's statistics reach the wire message from the one place that copies StepSummary
// (FillStepSummary): each field with its own value, none swapped or left at zero.
TEST(RowProtoTest, StepStatsCarryEveryStatisticOfTheRow) {
  StepRow row;
  row.step = 12;
  row.world_size = 9;
  row.ranks = 8;
  row.loss_mean = 1.5;
  row.loss_std = 2.5;
  row.loss_range = 3.5;
  row.grad_norm_mean = 4.5;
  row.grad_norm_std = 5.5;
  row.grad_norm_cv = 6.5;
  row.grad_cosine_mean = 0.75;
  row.missing_ranks = "3";
  v1::StepStats st;
  FillStepStats(row, &st);
  EXPECT_EQ(st.step(), 12u);
  EXPECT_EQ(st.ranks(), 8u);
  EXPECT_EQ(st.loss_mean(), 1.5);
  EXPECT_EQ(st.loss_std(), 2.5);
  EXPECT_EQ(st.loss_range(), 3.5);
  EXPECT_EQ(st.grad_norm_mean(), 4.5);
  EXPECT_EQ(st.grad_norm_std(), 5.5);
  EXPECT_EQ(st.grad_norm_cv(), 6.5);
  EXPECT_EQ(st.grad_cosine_mean(), 0.75);
  EXPECT_THAT(st.missing_ranks(), ElementsAre(3u));
  EXPECT_EQ(st.missing_count(), 1u);
}

TEST(StoreReaderPoolTest, RefusesBeyondItsQueueRunsQueuedTasksInOrderAndRefusesAfterStop) {
  const std::string path = testing::MakeTempDir() + "/rankscope.db";
  FillDatabase(path);
  StoreOptions read_only;
  read_only.read_only = true;
  auto reader = SqliteStore::Open(path, read_only);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<std::unique_ptr<SqliteStore>> readers;
  readers.push_back(std::move(*reader));
  StoreReaderPoolOptions options;
  options.max_queued = 2;
  StoreReaderPool pool(std::move(readers), options);
  ASSERT_EQ(pool.threads(), 1u);

  absl::Notification running, release;
  absl::Mutex mu;
  std::vector<std::string> ran;
  auto record = [&](std::string name) {
    absl::MutexLock lock(&mu);
    ran.push_back(std::move(name));
  };
  ASSERT_TRUE(pool.Submit([&](SqliteStore& store) {
                    running.Notify();
                    release.WaitForNotification();
                    auto jobs = store.ListJobs();
                    record(jobs.ok() && jobs->size() == 1 ? "blocker" : "blocker: bad read");
                  })
                  .ok());
  running.WaitForNotification();  // the only thread is busy: what follows waits in the queue
  ASSERT_TRUE(pool.Submit([&](SqliteStore&) { record("first"); }).ok());
  ASSERT_TRUE(pool.Submit([&](SqliteStore&) { record("second"); }).ok());
  const absl::Status refused = pool.Submit([&](SqliteStore&) { record("refused"); });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("query queue is full (2 queries waiting for 1"));
  EXPECT_THAT(refused.message(), HasSubstr("retry with backoff"));

  release.Notify();
  pool.Stop();  // runs what was queued before it returns
  {
    absl::MutexLock lock(&mu);
    EXPECT_THAT(ran, ElementsAre("blocker", "first", "second"));
  }
  const absl::Status stopped = pool.Submit([&](SqliteStore&) { record("late"); });
  EXPECT_EQ(stopped.code(), absl::StatusCode::kUnavailable) << stopped;
  EXPECT_THAT(stopped.message(), HasSubstr("shutting down"));
  pool.Stop();  // idempotent
}

TEST_F(QueryServiceTest, ManyConcurrentCallsAreAllAnsweredCorrectly) {
  auto collector = Start(/*threads=*/2, /*max_queued=*/1024);
  ASSERT_NE(collector, nullptr);
  auto stub = Stub(*collector);
  constexpr int kClients = 16, kCallsPerClient = 24;
  absl::Mutex mu;
  std::vector<std::string> failures;
  int answered = 0;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < kCallsPerClient; ++i) {
        grpc::ClientContext context;
        std::string failure;
        switch ((c + i) % 3) {
          case 0: {
            v1::RecentStepsRequest request;
            request.set_job("stored");
            request.set_limit(5);
            v1::RecentStepsResponse response;
            grpc::Status s = stub->RecentSteps(&context, request, &response);
            if (!s.ok()) {
              failure = "RecentSteps: " + s.error_message();
            } else if (response.steps_size() != 5 || response.steps(0).step() != kSteps ||
                       response.steps(4).step() != kSteps - 4) {
              failure = "RecentSteps: " + response.ShortDebugString();
            }
            break;
          }
          case 1: {
            v1::StepRangeRequest request;
            request.set_job("stored");
            request.set_first_step(10);
            request.set_last_step(19);
            request.set_include_ranks(true);
            v1::StepRangeResponse response;
            grpc::Status s = stub->StepRange(&context, request, &response);
            if (!s.ok()) {
              failure = "StepRange: " + s.error_message();
            } else if (response.steps_size() != 10 || response.steps(0).step() != 10 ||
                       response.ranks_size() != 10 * static_cast<int>(kWorld) ||
                       response.truncated()) {
              failure = "StepRange: " + response.ShortDebugString();
            }
            break;
          }
          default: {
            v1::ListJobsResponse response;
            grpc::Status s = stub->ListJobs(&context, v1::ListJobsRequest(), &response);
            if (!s.ok()) {
              failure = "ListJobs: " + s.error_message();
            } else if (response.jobs_size() != 1 || response.jobs(0).job() != "stored" ||
                       response.jobs(0).last_step() != kSteps ||
                       response.jobs(0).state() != "idle") {
              failure = "ListJobs: " + response.ShortDebugString();
            }
          }
        }
        absl::MutexLock lock(&mu);
        ++answered;
        if (!failure.empty()) failures.push_back(failure);
      }
    });
  }
  for (std::thread& t : clients) t.join();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(answered, kClients * kCallsPerClient);
  EXPECT_THAT(failures, ::testing::IsEmpty());
  EXPECT_TRUE(collector->Shutdown(absl::Seconds(5)).ok());
}

TEST_F(QueryServiceTest, FullReaderQueueRefusesACallWithResourceExhaustedThenServesAgain) {
  auto collector = Start(/*threads=*/1, /*max_queued=*/1);
  ASSERT_NE(collector, nullptr);
  auto stub = Stub(*collector);
  // Hold the only reader thread, then fill the queue's one place.
  absl::Notification running, release, drained;
  ASSERT_TRUE(collector->query_readers()
                  .Submit([&](SqliteStore&) {
                    running.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  running.WaitForNotification();
  ASSERT_TRUE(collector->query_readers().Submit([&](SqliteStore&) { drained.Notify(); }).ok());

  v1::RecentStepsRequest request;
  request.set_job("stored");
  {
    grpc::ClientContext context;
    v1::RecentStepsResponse response;
    grpc::Status s = stub->RecentSteps(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("query queue is full"));
    EXPECT_THAT(s.error_message(), HasSubstr("retry with backoff"));
  }
  // Checks that need no read still answer on the reaction, with their own status.
  {
    grpc::ClientContext context;
    v1::RecentStepsRequest bad;
    bad.set_job("no spaces allowed");
    v1::RecentStepsResponse response;
    grpc::Status s = stub->RecentSteps(&context, bad, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  release.Notify();
  drained.WaitForNotification();  // the queue is empty again
  {
    grpc::ClientContext context;
    v1::RecentStepsResponse response;
    grpc::Status s = stub->RecentSteps(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.steps_size(), 20);  // the default limit
  }
  EXPECT_TRUE(collector->Shutdown(absl::Seconds(5)).ok());
}

}  // namespace
}  // namespace rankscope::collector
