// StepPipeline driven directly (no gRPC): hellos and reports in, JobMetrics out.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collector/metrics/health_metrics.h"
#include "collector/metrics/prometheus_export.h"
#include "collector/pipeline/pipeline.h"
#include "collector/store/sqlite_store.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace rankscope::collector {
namespace {

class NullStream : public AgentStream {
 public:
  void Ack(absl::Span<const uint64_t>) override {}
  void SendControl(const v1::Control&) override {}
  void Abandon(const absl::Status&) override {}
};

std::optional<double> DroppedTotal(const JobMetrics& metrics, const std::string& job) {
  for (const prometheus::MetricFamily& f : metrics.Collect()) {
    if (f.name != "rankscope_agent_dropped_reports_total") continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == "train_job" && l.value == job) return m.counter.value;
      }
    }
  }
  return std::nullopt;
}

class StepPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = SqliteStore::Open(testing::MakeTempDir() + "/rankscope.db");
    ASSERT_TRUE(store.ok()) << store.status();
    pipeline_ = std::make_unique<StepPipeline>(PipelineOptions{}, std::move(*store),
                                               std::vector<JobRow>{}, &metrics_, &health_);
  }
  void TearDown() override { ASSERT_TRUE(pipeline_->Stop(absl::Seconds(10)).ok()); }

  v1::Hello Hello(uint32_t rank) const {
    v1::Hello h;
    h.set_job("j");
    h.set_rank(rank);
    h.set_world_size(2);
    h.set_sketch_dim(4);
    h.set_sketch_seed(1);
    return h;
  }
  void Connect(v1::Hello hello) {
    ASSERT_TRUE(pipeline_->AcceptHello(hello, std::make_shared<NullStream>()).status.ok());
  }
  void Report(const v1::Hello& hello, uint64_t step, uint64_t dropped_total) {
    v1::StepReport r;
    r.set_seq(++seq_);
    r.set_step(step);
    r.set_loss(1.0);
    r.set_grad_norm(1.0);
    for (int i = 0; i < 4; ++i) r.add_sketch(1.0f + i);
    r.set_dropped_total(dropped_total);
    ASSERT_TRUE(pipeline_->OnReport(hello, r, AckHandle{}).status.ok());
  }

  JobMetrics metrics_;
  HealthMetrics health_;
  std::unique_ptr<StepPipeline> pipeline_;
  uint64_t seq_ = 0;
};

// OnReport passes a rank's cumulative drop count to JobMetrics only when it changed (and always
// after a hello); the counter must read as if every report's count had been passed.
TEST_F(StepPipelineTest, DroppedCountsAddUpAcrossRepeatsAndAgentRestarts) {
  const v1::Hello rank0 = Hello(0), rank1 = Hello(1);
  Connect(rank0);
  Connect(rank1);
  Report(rank0, 1, 0);
  Report(rank1, 1, 0);
  EXPECT_EQ(DroppedTotal(metrics_, "j").value_or(0.0), 0.0);
  Report(rank0, 2, 3);
  Report(rank0, 3, 3);  // repeated count: +0
  Report(rank1, 2, 2);
  Report(rank0, 4, 5);  // +2
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2);
  // Rank 0's agent restarts (counts from zero again) on a new stream.
  Connect(rank0);
  Report(rank0, 5, 1);  // smaller than 5: a restart, +1
  Report(rank0, 6, 1);  // +0
  Report(rank0, 7, 4);  // +3
  Report(rank1, 3, 2);  // +0
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2 + 1 + 3);
  // The same agent reconnects without having dropped more: nothing is counted twice.
  Connect(rank1);
  Report(rank1, 4, 2);
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2 + 1 + 3);
  // A new process (a restart, attempt 1) whose count already passed the old one's: counted
  // whole.
  v1::Hello restarted = Hello(1);
  restarted.set_instance_id("second-process");
  restarted.set_attempt(1);
  Connect(restarted);
  Report(restarted, 5, 6);  // +6, not 6 - 2
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2 + 1 + 3 + 6);
}

// At --max_jobs the least recently seen job with no stream and no open step makes room; a job
// whose step is still open (its identity still matters) does not.
TEST(StepPipelineJobsTest, AtMaxJobsAnIdleJobMakesRoom) {
  JobMetrics metrics;
  HealthMetrics health;
  auto store = SqliteStore::Open(testing::MakeTempDir() + "/rankscope.db");
  ASSERT_TRUE(store.ok()) << store.status();
  PipelineOptions options;
  options.max_jobs = 1;
  StepPipeline pipeline(options, std::move(*store), {}, &metrics, &health);
  auto hello = [](const std::string& job, uint32_t rank) {
    v1::Hello h;
    h.set_job(job);
    h.set_rank(rank);
    h.set_world_size(2);
    h.set_sketch_dim(4);
    return h;
  };
  auto report = [](uint64_t step) {
    v1::StepReport r;
    r.set_seq(step);
    r.set_step(step);
    for (int i = 0; i < 4; ++i) r.add_sketch(1.0f + i);
    return r;
  };
  auto s0 = std::make_shared<NullStream>();
  auto s1 = std::make_shared<NullStream>();
  auto s2 = std::make_shared<NullStream>();
  v1::Hello a0 = hello("a", 0), a1 = hello("a", 1);
  ASSERT_TRUE(pipeline.AcceptHello(a0, s0).status.ok());
  ASSERT_TRUE(pipeline.AcceptHello(a1, s1).status.ok());
  ASSERT_TRUE(pipeline.OnReport(a0, report(1), AckHandle{}).status.ok());  // step 1 stays open
  pipeline.StreamClosed(a0, s0);
  pipeline.StreamClosed(a1, s1);
  v1::Hello b0 = hello("b", 0);
  EXPECT_EQ(ReasonLabel(pipeline.AcceptHello(b0, s2).reason), "too_many_jobs");
  ASSERT_TRUE(pipeline.AcceptHello(a1, s1).status.ok());
  ASSERT_TRUE(pipeline.OnReport(a1, report(1), AckHandle{}).status.ok());  // step 1 complete
  pipeline.StreamClosed(a1, s1);
  b0 = hello("b", 0);
  EXPECT_TRUE(pipeline.AcceptHello(b0, s2).status.ok());
  ASSERT_TRUE(pipeline.Stop(absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace rankscope::collector
