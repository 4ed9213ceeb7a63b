// QueryClient against a real collector on port 0 (agents -> collector -> SQLite -> Query).
#include "common/query_client.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collector/collector.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rankscope/agent.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

using collector::Collector;
using collector::CollectorOptions;
using query::QueryClient;
using query::QueryClientOptions;
using query::StepRangeQuery;

constexpr char kToken[] = "query-client-token";
constexpr char kJob[] = "paged";
constexpr uint32_t kWorld = 3, kDim = 16;
constexpr uint64_t kSteps = 17;

class QueryClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.db_path = testing::MakeTempDir() + "/rankscope.db";
    o.pipeline.auth_token = kToken;
    o.pipeline.joiner.step_timeout = absl::Seconds(2);
    auto collector = Collector::Start(o);
    ASSERT_TRUE(collector.ok()) << collector.status();
    collector_ = std::move(*collector);

    std::vector<std::unique_ptr<Agent>> agents;
    for (uint32_t r = 0; r < kWorld; ++r) {
      AgentOptions a;
      a.collector_address = collector_->grpc_target();
      a.job = kJob;
      a.rank = r;
      a.world_size = kWorld;
      a.sketch_dim = kDim;
      a.auth_token = kToken;
      a.initial_backoff = absl::Milliseconds(20);
      a.max_backoff = absl::Milliseconds(200);
      auto agent = Agent::Create(a);
      ASSERT_TRUE(agent.ok()) << agent.status();
      agents.push_back(std::move(*agent));
    }
    std::vector<float> sketch(kDim);
    for (uint64_t step = 1; step <= kSteps; ++step) {
      for (uint32_t r = 0; r < kWorld; ++r) {
        for (uint32_t j = 0; j < kDim; ++j) sketch[j] = static_cast<float>(r + j + step);
        StepReport rep;
        rep.step = step;
        rep.loss = 1.0 + r;
        rep.grad_norm = 2.0 + r;
        rep.sketch = sketch;
        ASSERT_TRUE(agents[r]->Record(rep).ok());
      }
    }
    for (auto& a : agents) ASSERT_TRUE(a->Flush(absl::Seconds(60)).ok());
    ASSERT_TRUE(collector_->Flush(absl::Seconds(30)));
    for (auto& a : agents) EXPECT_TRUE(a->Close(absl::Seconds(5)).ok());
  }

  void TearDown() override {
    if (collector_ != nullptr) EXPECT_TRUE(collector_->Shutdown(absl::Seconds(5)).ok());
  }

  std::unique_ptr<QueryClient> Client(std::string token = kToken) {
    QueryClientOptions o;
    o.address = collector_->grpc_target();
    o.auth_token = std::move(token);
    o.timeout = absl::Seconds(10);
    auto client = QueryClient::Create(o);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  std::unique_ptr<Collector> collector_;
};

TEST_F(QueryClientTest, PagedStepRangeReturnsEveryRowExactlyOnce) {
  auto client = Client();
  ASSERT_NE(client, nullptr);
  for (int page_rows : {1, 2, 4, 5, 1000}) {
    SCOPED_TRACE(absl::StrCat("page_rows=", page_rows));
    StepRangeQuery q;
    q.job = kJob;
    q.include_ranks = true;
    q.page_rows = page_rows;
    v1::StepRangeResponse out;
    ASSERT_TRUE(client->StepRangePaged(q, &out).ok());
    EXPECT_FALSE(out.truncated());
    ASSERT_EQ(out.steps_size(), static_cast<int>(kSteps));
    for (int i = 0; i < out.steps_size(); ++i) EXPECT_EQ(out.steps(i).step(), i + 1u);
    std::map<std::pair<uint64_t, uint32_t>, int> seen;
    for (const v1::RankStep& r : out.ranks()) ++seen[{r.step(), r.rank()}];
    EXPECT_EQ(seen.size(), kSteps * kWorld);
    for (const auto& [key, count] : seen) EXPECT_EQ(count, 1) << key.first << "/" << key.second;
  }
}

TEST_F(QueryClientTest, PagedStepRangeHonoursBoundsAndMaxRows) {
  auto client = Client();
  ASSERT_NE(client, nullptr);
  StepRangeQuery q;
  q.job = kJob;
  q.first_step = 5;
  q.last_step = 9;
  q.include_ranks = true;
  q.page_rows = 2;
  v1::StepRangeResponse out;
  ASSERT_TRUE(client->StepRangePaged(q, &out).ok());
  ASSERT_EQ(out.steps_size(), 5);
  EXPECT_EQ(out.steps(0).step(), 5u);
  EXPECT_EQ(out.steps(4).step(), 9u);
  EXPECT_EQ(out.ranks_size(), static_cast<int>(5 * kWorld));
  EXPECT_FALSE(out.truncated());

  StepRangeQuery capped;
  capped.job = kJob;
  capped.include_ranks = true;
  capped.max_rows = 4;
  capped.page_rows = 3;
  v1::StepRangeResponse some;
  ASSERT_TRUE(client->StepRangePaged(capped, &some).ok());
  EXPECT_EQ(some.steps_size(), 4);
  EXPECT_EQ(some.ranks_size(), 4);
  EXPECT_TRUE(some.truncated());
}

TEST_F(QueryClientTest, ListJobsRecentStepsAndSetControl) {
  auto client = Client();
  ASSERT_NE(client, nullptr);
  auto jobs = client->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->jobs_size(), 1);
  EXPECT_EQ(jobs->jobs(0).job(), kJob);
  EXPECT_EQ(jobs->jobs(0).last_step(), kSteps);

  v1::RecentStepsRequest recent;
  recent.set_job(kJob);
  recent.set_limit(3);
  auto steps = client->RecentSteps(recent);
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->steps_size(), 3);
  EXPECT_EQ(steps->steps(0).step(), kSteps);

  v1::ControlRequest control;
  control.set_job(kJob);
  control.set_enabled(false);
  control.set_lead_steps(5);
  // The agents closed: the job's current `every` is unknown to this collector, so a control
  // that leaves it out is refused rather than filled from the defaults...
  auto unknown = client->SetControl(control);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnavailable) << unknown.status();
  EXPECT_THAT(std::string(unknown.status().message()), ::testing::HasSubstr("is connected"));
  // ...and one that gives every field is taken (delivered to ranks when they connect).
  control.set_every(1);
  auto set = client->SetControl(control);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->control().apply_at_step(), kSteps + 5);
  EXPECT_FALSE(set->control().enabled());
}

TEST_F(QueryClientTest, WrongTokenIsUnauthenticated) {
  auto client = Client("not-the-token");
  ASSERT_NE(client, nullptr);
  auto jobs = client->ListJobs();
  EXPECT_EQ(jobs.status().code(), absl::StatusCode::kUnauthenticated) << jobs.status();
}

TEST(QueryClientNoServerTest, DownCollectorIsUnavailableWithinTheDeadline) {
  QueryClientOptions o;
  o.address = absl::StrCat("127.0.0.1:", testing::PickFreePort());
  o.timeout = absl::Seconds(5);
  auto client = QueryClient::Create(o);
  ASSERT_TRUE(client.ok());
  auto jobs = (*client)->ListJobs();
  EXPECT_EQ(jobs.status().code(), absl::StatusCode::kUnavailable) << jobs.status();
}

TEST(QueryClientNoServerTest, MissingTlsFileIsReportedByCreate) {
  QueryClientOptions o;
  o.tls.ca_file = "/nonexistent/ca.pem";
  auto client = QueryClient::Create(o);
  ASSERT_FALSE(client.ok());
  EXPECT_NE(client.status().message().find("ca.pem"), absl::string_view::npos) << client.status();
}

}  // namespace
}  // namespace rankscope
