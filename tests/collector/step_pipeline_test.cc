// StepPipeline driven directly (no gRPC): hellos and reports in, JobMetrics out.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collector/health_metrics.h"
#include "collector/pipeline.h"
#include "collector/prometheus_export.h"
#include "collector/sqlite_store.h"
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
}

}  // namespace
}  // namespace rankscope::collector
