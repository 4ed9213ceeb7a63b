// The agent against a real collector on loopback (and against no collector at all).
#include "rankscope/agent.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/src/send_poller.h"
#include "collector/collector.h"
#include "common/collector_shard.h"
#include "common/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rankscope/agent_c.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

using collector::Collector;
using collector::CollectorOptions;

AgentOptions Options(int port, uint32_t rank = 0, uint32_t world = 1) {
  AgentOptions o;
  o.collector_address = absl::StrCat("127.0.0.1:", port);
  o.job = "agent-test";
  o.rank = rank;
  o.world_size = world;
  o.sketch_dim = 16;
  o.queue_capacity = 32;
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Milliseconds(100);
  return o;
}

CollectorOptions CollectorAt(const std::string& dir, int port) {
  CollectorOptions o;
  o.grpc_address = absl::StrCat("127.0.0.1:", port);
  o.metrics_address = "";
  o.db_path = dir + "/agent.db";
  o.pipeline.joiner.step_timeout = absl::Seconds(1);
  return o;
}

StepReport Report(uint64_t step, const std::vector<float>& sketch) {
  StepReport r;
  r.step = step;
  r.loss = 1.0 + step;
  r.grad_norm = 2.0;
  r.sketch = sketch;
  return r;
}

TEST(AgentTest, CreateRejectsBadOptions) {
  AgentOptions o = Options(1);
  o.job = "";
  EXPECT_EQ(Agent::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(1);
  o.job = "bad job name";
  EXPECT_EQ(Agent::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(1, 4, 4);
  EXPECT_EQ(Agent::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(1);
  o.sketch_dim = 0;
  EXPECT_EQ(Agent::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AgentTest, CollectorListPicksTheJobsShardAndRefusesEmptyEntries) {
  // A fleet (common/collector_shard.h): the agent streams to the job's shard, whatever the order
  // and duplicates of the list; nothing listens on these ports (the agent does not wait).
  const std::vector<std::string> shards = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  for (const std::string job : {"exp-1", "exp-2", "exp-3", "exp-4", "exp-5", "exp-6"}) {
    AgentOptions o = Options(1);
    o.job = job;
    o.collector_address = "127.0.0.1:3, 127.0.0.1:1,127.0.0.1:2,127.0.0.1:3";
    auto agent = Agent::Create(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    EXPECT_EQ((*agent)->collector(), PickCollector(shards, job));
    EXPECT_EQ((*agent)->options().collector_address, o.collector_address);
  }
  AgentOptions o = Options(1);
  EXPECT_EQ((*Agent::Create(o))->collector(), "127.0.0.1:1");
  for (const char* bad : {"", "127.0.0.1:1,", "127.0.0.1:1,,127.0.0.1:2"}) {
    o.collector_address = bad;
    absl::Status status = Agent::Create(o).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("collector_address")) << bad;
  }
}

TEST(AgentTest, RecordRejectsWrongSketchLengthAndRecordAfterClose) {
  auto agent = Agent::Create(Options(testing::PickFreePort()));
  ASSERT_TRUE(agent.ok());
  std::vector<float> short_sketch(3, 1.0f);
  EXPECT_EQ((*agent)->Record(Report(1, short_sketch)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*agent)->stats().invalid, 1u);
  EXPECT_EQ((*agent)->stats().recorded, 0u);
  (*agent)->Close(absl::ZeroDuration()).IgnoreError();
  std::vector<float> sketch(16, 1.0f);
  EXPECT_EQ((*agent)->Record(Report(2, sketch)).code(), absl::StatusCode::kFailedPrecondition);
  // Close is idempotent.
  (*agent)->Close(absl::ZeroDuration()).IgnoreError();
}

// A replica summary (the tolerance check) needs kReplicaProjections finite values, a finite
// rounding >= 0, its fingerprint and, for the reduced gradient, a precision in [1, 53].
TEST(AgentTest, RecordRejectsAMalformedReplicaSummary) {
  auto agent = Agent::Create(Options(testing::PickFreePort()));
  ASSERT_TRUE(agent.ok());
  std::vector<float> sketch(16, 1.0f);
  const std::vector<double> four = {1.0, 2.0, 3.0, 4.0};
  const std::vector<double> three = {1.0, 2.0, 3.0};
  StepReport r = Report(1, sketch);
  r.param_projections = four;  // no param_fingerprint
  EXPECT_EQ((*agent)->Record(r).code(), absl::StatusCode::kInvalidArgument);
  r.param_fingerprint = 5;
  r.param_projections = three;
  EXPECT_EQ((*agent)->Record(r).code(), absl::StatusCode::kInvalidArgument);
  r.param_projections = four;
  r.param_rounding = -1.0;
  EXPECT_EQ((*agent)->Record(r).code(), absl::StatusCode::kInvalidArgument);
  r.param_rounding = 1e-7;
  r.reduced_grad_fingerprint = 6;
  r.reduced_grad_projections = four;  // precision 0
  EXPECT_EQ((*agent)->Record(r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*agent)->stats().invalid, 4u);
  r.reduced_grad_precision = 24;
  EXPECT_TRUE((*agent)->Record(r).ok());
  EXPECT_EQ((*agent)->stats().recorded, 1u);
  (*agent)->Close(absl::ZeroDuration()).IgnoreError();
}

TEST(AgentTest, CollectorDownRingDropsOldestThenDeliversTheRestWhenItComesUp) {
  const std::string dir = testing::MakeTempDir();
  const int port = testing::PickFreePort();
  auto agent = Agent::Create(Options(port));
  ASSERT_TRUE(agent.ok());
  std::vector<float> sketch(16, 0.5f);
  // 100 reports into a 32-slot ring with nobody to send to: the 68 oldest are dropped.
  for (uint64_t step = 1; step <= 100; ++step) {
    ASSERT_TRUE((*agent)->Record(Report(step, sketch)).ok());
  }
  EXPECT_EQ((*agent)->stats().recorded, 100u);
  EXPECT_EQ((*agent)->stats().dropped, 68u);
  EXPECT_EQ((*agent)->Flush(absl::Milliseconds(50)).code(), absl::StatusCode::kDeadlineExceeded);

  auto collector = Collector::Start(CollectorAt(dir, port));
  ASSERT_TRUE(collector.ok()) << collector.status();
  ASSERT_TRUE((*agent)->Flush(absl::Seconds(60)).ok());
  EXPECT_EQ((*agent)->stats().acked, 32u);
  ASSERT_TRUE((*collector)->Flush(absl::Seconds(10)));
  auto store = collector::SqliteStore::Open(dir + "/agent.db");
  ASSERT_TRUE(store.ok());
  // The newest 32 steps survived.
  for (uint64_t step = 69; step <= 100; ++step) {
    auto rows = (*store)->RankRows("agent-test", step);
    ASSERT_TRUE(rows.ok());
    EXPECT_EQ(rows->size(), 1u) << "step " << step;
  }
  auto rows = (*store)->RankRows("agent-test", 68);
  ASSERT_TRUE(rows.ok());
  EXPECT_TRUE(rows->empty());
  EXPECT_TRUE((*agent)->Close(absl::Seconds(5)).ok());
}

TEST(AgentTest, ReceivesControlPushedThroughTheCollector) {
  const std::string dir = testing::MakeTempDir();
  auto collector = Collector::Start(CollectorAt(dir, 0));
  ASSERT_TRUE(collector.ok());
  auto agent = Agent::Create(Options((*collector)->grpc_port()));
  ASSERT_TRUE(agent.ok());
  std::vector<float> sketch(16, 0.25f);
  ASSERT_TRUE((*agent)->Record(Report(7, sketch)).ok());
  ASSERT_TRUE((*agent)->Flush(absl::Seconds(30)).ok());
  auto result = (*collector)->pipeline().SetControl("agent-test", false, 4u, std::nullopt, 3);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->second, 1u);
  ASSERT_TRUE(testing::WaitFor([&] { return (*agent)->control().has_value(); }));
  const AgentControl c = *(*agent)->control();
  EXPECT_FALSE(c.enabled);
  EXPECT_EQ(c.every, 4u);
  EXPECT_EQ(c.apply_at_step, 10u);
  // Generations are at least the time in microseconds, so they survive collector restarts.
  EXPECT_GE(c.generation, static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()) - 60'000'000));
  auto again = (*collector)->pipeline().SetControl("agent-test", true, {}, {}, 3);
  ASSERT_TRUE(again.ok());
  EXPECT_GT(again->first.generation(), c.generation);
  EXPECT_EQ((*collector)->pipeline().SetControl("no-such-job", true, {}, {}, 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE((*agent)->Close(absl::Seconds(5)).ok());
}

TEST(AgentTest, HelloRejectedForMismatchedSketchIsNotAcked) {
  const std::string dir = testing::MakeTempDir();
  auto collector = Collector::Start(CollectorAt(dir, 0));
  ASSERT_TRUE(collector.ok());
  AgentOptions a = Options((*collector)->grpc_port(), 0, 2);
  AgentOptions b = Options((*collector)->grpc_port(), 1, 2);
  b.sketch_seed = 99;  // differs from rank 0's: cosines would mean nothing
  auto first = Agent::Create(a);
  ASSERT_TRUE(first.ok());
  std::vector<float> sketch(16, 1.0f);
  ASSERT_TRUE((*first)->Record(Report(1, sketch)).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return (*first)->stats().connected; }));
  auto second = Agent::Create(b);
  ASSERT_TRUE(second.ok());
  // The agent connects on its own thread, so the refusal of its hello races this call: usually
  // the report is held first; on a loaded machine the refusal may come back first, and then the
  // report is refused at once. Either order is correct; each is checked below.
  const absl::Status first_report = (*second)->Record(Report(1, sketch));
  ASSERT_TRUE(first_report.ok() || first_report.code() == absl::StatusCode::kFailedPrecondition)
      << first_report;
  // FAILED_PRECONDITION is a permanent refusal: the agent stops retrying, says why, lets go of
  // what it held (rejected, never acked) and refuses further reports.
  ASSERT_TRUE(testing::WaitFor([&] { return (*second)->stats().refused; }));
  const AgentStats refused = (*second)->stats();
  EXPECT_EQ(refused.acked, 0u);
  EXPECT_EQ(refused.rejected, first_report.ok() ? 1u : 0u);
  EXPECT_EQ(refused.unacked + refused.queued, 0u);
  EXPECT_THAT(refused.last_error, ::testing::HasSubstr("FAILED_PRECONDITION"));
  EXPECT_TRUE((*second)->Flush(absl::Milliseconds(300)).ok());  // nothing is held
  EXPECT_EQ((*second)->Record(Report(2, sketch)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*second)->stats().reconnects, 0u);
  (*second)->Close(absl::ZeroDuration()).IgnoreError();
  (*first)->Close(absl::ZeroDuration()).IgnoreError();
}

TEST(AgentCApiTest, SketchAndAgentRoundTrip) {
  rankscope_sketch* s = rankscope_sketch_create(8, 1);
  ASSERT_NE(s, nullptr);
  const float x[4] = {1, 2, 3, 4};
  EXPECT_EQ(rankscope_sketch_add(s, x, RANKSCOPE_DTYPE_FLOAT32, 4, 0), 0);
  EXPECT_NE(rankscope_sketch_add(s, x, 7, 4, 0), 0);
  EXPECT_DOUBLE_EQ(rankscope_sketch_sum_squares(s), 30.0);
  float out[8];
  rankscope_sketch_values(s, out);
  double total = 0;
  for (float v : out) total += std::abs(v);
  EXPECT_GT(total, 0.0);
  rankscope_sketch_destroy(s);

  rankscope_agent_options o;
  rankscope_agent_options_init(&o);
  o.job = "c-api";
  o.rank = 5;
  o.world_size = 2;
  rankscope_agent* agent = nullptr;
  char err[256];
  EXPECT_EQ(rankscope_agent_create(&o, &agent, err, sizeof(err)),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(std::string(err).find("rank 5 >= world_size 2"), std::string::npos) << err;
  o.rank = 1;
  ASSERT_EQ(rankscope_agent_create(&o, &agent, err, sizeof(err)), 0) << err;
  std::vector<float> sketch(1024, 1.0f);
  EXPECT_EQ(rankscope_agent_record(agent, 1, 0.5, 1.0, sketch.data(), sketch.size()), 0);
  rankscope_agent_stats st;
  rankscope_agent_stats_get(agent, &st);
  EXPECT_EQ(st.recorded, 1u);
  rankscope_agent_destroy(agent);
}

// A SendPoller client that records its polls; with `stuck` set, a poll waits until Release()
// (as an agent's PollSend would wait for a mutex held by a thread blocked elsewhere).
class TestClient final : public internal::SendPoller::Client {
 public:
  explicit TestClient(bool stuck) : stuck_(stuck) {}

  bool PollSend() override {
    MutexLock lock(&mu_);
    ++polls_;
    in_poll_ = true;
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !stuck_; };
    mu_.Await(absl::Condition(&released));
    in_poll_ = false;
    return false;
  }
  // Waits until PollSend has been called `n` times in all.
  void AwaitPolls(int n) {
    MutexLock lock(&mu_);
    auto polled = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return polls_ >= n; };
    mu_.Await(absl::Condition(&polled));
  }
  void Release() {
    MutexLock lock(&mu_);
    stuck_ = false;
  }
  bool in_poll() {
    MutexLock lock(&mu_);
    return in_poll_;
  }

 private:
  Mutex mu_;
  bool stuck_ ABSL_GUARDED_BY(mu_);
  int polls_ ABSL_GUARDED_BY(mu_) = 0;
  bool in_poll_ ABSL_GUARDED_BY(mu_) = false;
};

// loadgen's 16,384 agents in one process once stalled for good: the poller held its lock across
// every client's PollSend, one PollSend waited (its agent's mutex was held by a thread blocked on
// a full stderr pipe), and the main thread's Register() of the next agent waited for the poller.
// Register() must not wait for a sweep, and Unregister() must wait for one that may poll its
// client. A regression hangs this test (ctest's timeout fails it).
TEST(SendPollerTest, RegisterNeverWaitsForAStuckPollAndUnregisterWaitsForIt) {
  internal::SendPoller& poller = internal::SendPoller::Get();
  TestClient stuck(/*stuck=*/true);
  poller.Register(&stuck);
  stuck.AwaitPolls(1);  // the poller's thread is now inside stuck.PollSend, and stays there

  TestClient other(/*stuck=*/false);
  poller.Register(&other);  // returns although the sweep in progress is stuck
  bool unregistered_while_in_poll = true;
  std::thread unregister([&] {
    poller.Unregister(&stuck);  // waits for the stuck sweep to end
    unregistered_while_in_poll = stuck.in_poll();
  });
  stuck.Release();
  unregister.join();
  EXPECT_FALSE(unregistered_while_in_poll);
  other.AwaitPolls(1);  // the next sweep polls the client registered during the stuck one
  poller.Unregister(&other);
}

}  // namespace
}  // namespace rankscope
