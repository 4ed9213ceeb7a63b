// StepPipeline driven directly (no gRPC): hellos and reports in, JobMetrics out.
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collector/metrics/health_metrics.h"
#include "collector/metrics/prometheus_export.h"
#include "collector/pipeline/pipeline.h"
#include "collector/store/sqlite_store.h"
#include "common/job_name.h"
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
// after a hello); the counter must read as if every report's count had been passed, never
// decrease, and start again from zero only for a new agent process (a new instance).
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
  // Rank 0's agent reconnects on a new stream: the same process, whose count goes on.
  Connect(rank0);
  Report(rank0, 5, 5);  // +0
  Report(rank0, 6, 4);  // smaller, from the same process: a client's error, +0 (never decreases)
  Report(rank0, 7, 8);  // +3
  Report(rank1, 3, 2);  // +0
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2 + 3);
  // The same agent reconnects without having dropped more: nothing is counted twice.
  Connect(rank1);
  Report(rank1, 4, 2);
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2 + 3);
  // A new process (a restart, attempt 1) counts from zero: a count that already passed the old
  // one's is counted whole.
  v1::Hello restarted = Hello(1);
  restarted.set_instance_id("second-process");
  restarted.set_attempt(1);
  Connect(restarted);
  Report(restarted, 5, 6);  // +6, not 6 - 2
  EXPECT_EQ(DroppedTotal(metrics_, "j"), 3 + 2 + 2 + 3 + 6);
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

// Sharded analysis (PipelineOptions::analysis_threads): 8 groups fed by 4 threads at once, each
// group with a rank that turns outlier at its own step. A group's steps are analysed in order on
// its shard, so the order-dependent results (persistent outliers, CUSUM drift, every score) are
// stored exactly as with one analysis thread, every step once.
struct GroupRun {
  std::vector<StepRow> steps;  // per group, steps 1..kSteps
  std::vector<std::vector<RankRow>> ranks;
};
constexpr int kGroups = 8;
constexpr uint32_t kWorld = 8;
constexpr uint64_t kSteps = 16;
constexpr uint32_t kOutlierRank = 5;
uint64_t OutlierFrom(int group) { return 4 + static_cast<uint64_t>(group); }

std::vector<GroupRun> RunGroups(size_t analysis_threads) {
  const std::string path = testing::MakeTempDir() + "/rankscope.db";
  {
    JobMetrics metrics;
    HealthMetrics health;
    auto store = SqliteStore::Open(path);
    EXPECT_TRUE(store.ok()) << store.status();
    PipelineOptions options;
    options.analysis_threads = analysis_threads;
    options.joiner.step_timeout = absl::Hours(1);  // every step completes; none times out
    StepPipeline pipeline(options, std::move(*store), {}, &metrics, &health);
    auto feed = [&pipeline](int group) {
      std::vector<v1::Hello> hellos(kWorld);
      for (uint32_t rank = 0; rank < kWorld; ++rank) {
        v1::Hello& h = hellos[rank];
        h.set_job("big");
        h.set_group(absl::StrCat("g", group));
        h.set_rank(rank);
        h.set_world_size(kWorld);
        h.set_sketch_dim(8);
        h.set_sketch_seed(1);
        EXPECT_TRUE(pipeline.AcceptHello(h, std::make_shared<NullStream>()).status.ok());
      }
      for (uint64_t step = 1; step <= kSteps; ++step) {
        for (uint32_t rank = 0; rank < kWorld; ++rank) {
          const bool outlier = rank == kOutlierRank && step >= OutlierFrom(group);
          v1::StepReport r;
          r.set_seq(step);
          r.set_step(step);
          // Deterministic spread around the step's values; the outlier's loss and norm are far
          // off and its gradient points the other way.
          const double wobble = 0.01 * std::sin(static_cast<double>(rank * 7 + step * 3));
          r.set_loss(2.0 / static_cast<double>(step) + wobble + (outlier ? 5.0 : 0.0));
          r.set_grad_norm((1.0 + wobble) * (outlier ? 8.0 : 1.0));
          for (int i = 0; i < 8; ++i) {
            const double v = 1.0 + i + std::cos(static_cast<double>(rank + i * step));
            r.add_sketch(static_cast<float>(outlier ? -v : v));
          }
          r.set_step_time_seconds(0.1 + 0.001 * wobble);
          EXPECT_TRUE(pipeline.OnReport(hellos[rank], r, AckHandle{}).status.ok());
        }
      }
    };
    std::vector<std::thread> feeders;
    for (int t = 0; t < 4; ++t) {
      feeders.emplace_back([&feed, t] {
        feed(t);
        feed(t + 4);
      });
    }
    for (std::thread& t : feeders) t.join();
    EXPECT_TRUE(pipeline.Flush(absl::Seconds(60)));
    EXPECT_TRUE(pipeline.Stop(absl::Seconds(60)).ok());
  }
  auto store = SqliteStore::Open(path);
  EXPECT_TRUE(store.ok()) << store.status();
  std::vector<GroupRun> runs(kGroups);
  for (int g = 0; g < kGroups; ++g) {
    const std::string key = GroupKey("big", absl::StrCat("g", g));
    auto steps = (*store)->StepRange(key, 1, kSteps, 1000);
    EXPECT_TRUE(steps.ok()) << steps.status();
    runs[g].steps = *steps;
    for (uint64_t step = 1; step <= kSteps; ++step) {
      auto ranks = (*store)->RankRows(key, step);
      EXPECT_TRUE(ranks.ok()) << ranks.status();
      runs[g].ranks.push_back(*ranks);
    }
  }
  return runs;
}

// Equal, or both NaN.
bool Same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }
bool Same(std::optional<double> a, std::optional<double> b) {
  return a.has_value() == b.has_value() && (!a || Same(*a, *b));
}

TEST(StepPipelineShardsTest, ShardedAnalysisStoresWhatOneThreadStores) {
  const std::vector<GroupRun> serial = RunGroups(1);
  const std::vector<GroupRun> sharded = RunGroups(4);
  for (int g = 0; g < kGroups; ++g) {
    SCOPED_TRACE(absl::StrCat("group g", g));
    ASSERT_EQ(serial[g].steps.size(), kSteps);
    ASSERT_EQ(sharded[g].steps.size(), kSteps);
    for (uint64_t i = 0; i < kSteps; ++i) {
      const StepRow& a = serial[g].steps[i];
      const StepRow& b = sharded[g].steps[i];
      SCOPED_TRACE(absl::StrCat("step ", a.step));
      EXPECT_EQ(a.step, i + 1);
      EXPECT_EQ(b.step, i + 1);
      EXPECT_FALSE(b.timed_out);
      EXPECT_EQ(a.outlier_ranks, b.outlier_ranks);
      EXPECT_EQ(a.drifting_ranks, b.drifting_ranks);
      EXPECT_EQ(a.slow_ranks, b.slow_ranks);
      EXPECT_EQ(a.duplicate_groups, b.duplicate_groups);
      // The persistence rule: named from the third flagged step on, never before the onset.
      if (a.step >= OutlierFrom(g) + 2) {
        EXPECT_EQ(b.outlier_ranks, std::vector<uint32_t>{kOutlierRank});
      }
      if (a.step < OutlierFrom(g)) {
        EXPECT_TRUE(b.outlier_ranks.empty());
      }
      ASSERT_EQ(serial[g].ranks[i].size(), kWorld);
      ASSERT_EQ(sharded[g].ranks[i].size(), kWorld);
      for (uint32_t r = 0; r < kWorld; ++r) {
        const RankRow& x = serial[g].ranks[i][r];
        const RankRow& y = sharded[g].ranks[i][r];
        EXPECT_EQ(x.rank, y.rank);
        EXPECT_TRUE(Same(x.loss, y.loss));
        EXPECT_TRUE(Same(x.grad_cosine, y.grad_cosine));
        EXPECT_TRUE(Same(x.outlier_score, y.outlier_score)) << "rank " << r;
        EXPECT_TRUE(Same(x.step_time_z, y.step_time_z));
      }
    }
  }
}

}  // namespace
}  // namespace rankscope::collector
