// End to end over real loopback gRPC: agents -> collector -> SQLite and /metrics.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collector/collector.h"
#include "collector/store/sqlite_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rankscope/agent.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

using collector::Collector;
using collector::CollectorOptions;
using collector::SqliteStore;
using ::testing::HasSubstr;

// What one rank sent for one step.
struct Sent {
  double loss;
  double grad_norm;
  std::vector<float> sketch;
};

// Deterministic per-(rank, step) data with real dispersion.
Sent MakeReport(uint32_t rank, uint64_t step, uint32_t dim) {
  std::mt19937_64 rng(rank * 1000003ULL + step);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Sent s;
  s.loss = 2.0 + 0.1 * n(rng) + 0.001 * rank;
  s.grad_norm = 1.0 + 0.05 * std::abs(n(rng));
  s.sketch.resize(dim);
  std::mt19937_64 common(step);
  for (uint32_t j = 0; j < dim; ++j) s.sketch[j] = n(common) + 0.5f * n(rng);
  return s;
}

struct Reference {
  double loss_mean, loss_std, loss_range, norm_mean, norm_std, cosine_mean;
};

// Straightforward two-pass statistics and O(W^2 k) pairwise cosines.
Reference BruteForce(const std::vector<Sent>& ranks) {
  const double w = static_cast<double>(ranks.size());
  Reference r{};
  double lo = 1e300, hi = -1e300;
  for (const Sent& s : ranks) {
    r.loss_mean += s.loss / w;
    r.norm_mean += s.grad_norm / w;
    lo = std::min(lo, s.loss);
    hi = std::max(hi, s.loss);
  }
  for (const Sent& s : ranks) {
    r.loss_std += (s.loss - r.loss_mean) * (s.loss - r.loss_mean) / w;
    r.norm_std += (s.grad_norm - r.norm_mean) * (s.grad_norm - r.norm_mean) / w;
  }
  r.loss_std = std::sqrt(r.loss_std);
  r.norm_std = std::sqrt(r.norm_std);
  r.loss_range = hi - lo;
  double sum = 0;
  int pairs = 0;
  for (size_t a = 0; a < ranks.size(); ++a) {
    for (size_t b = a + 1; b < ranks.size(); ++b) {
      double dot = 0, na = 0, nb = 0;
      for (size_t j = 0; j < ranks[a].sketch.size(); ++j) {
        dot += double(ranks[a].sketch[j]) * ranks[b].sketch[j];
        na += double(ranks[a].sketch[j]) * ranks[a].sketch[j];
        nb += double(ranks[b].sketch[j]) * ranks[b].sketch[j];
      }
      sum += dot / std::sqrt(na * nb);
      ++pairs;
    }
  }
  r.cosine_mean = sum / pairs;
  return r;
}

class PipelineTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir(); }

  CollectorOptions Options(int grpc_port) const {
    CollectorOptions o;
    o.grpc_address = absl::StrCat("127.0.0.1:", grpc_port);
    o.metrics_address = "127.0.0.1:0";
    o.db_path = dir_ + "/rankscope.db";
    o.pipeline.joiner.step_timeout = absl::Seconds(2);
    return o;
  }

  std::vector<std::unique_ptr<Agent>> MakeAgents(const std::string& job, uint32_t world,
                                                 uint32_t dim, int port, size_t capacity) {
    std::vector<std::unique_ptr<Agent>> agents;
    for (uint32_t r = 0; r < world; ++r) {
      AgentOptions o;
      o.collector_address = absl::StrCat("127.0.0.1:", port);
      o.job = job;
      o.rank = r;
      o.world_size = world;
      o.sketch_dim = dim;
      o.queue_capacity = capacity;
      o.initial_backoff = absl::Milliseconds(20);
      o.max_backoff = absl::Milliseconds(200);
      auto a = Agent::Create(o);
      EXPECT_TRUE(a.ok()) << a.status();
      agents.push_back(std::move(*a));
    }
    return agents;
  }

  static void RecordStep(std::vector<std::unique_ptr<Agent>>& agents, uint64_t step, uint32_t dim) {
    for (uint32_t r = 0; r < agents.size(); ++r) {
      Sent s = MakeReport(r, step, dim);
      StepReport rep;
      rep.step = step;
      rep.loss = s.loss;
      rep.grad_norm = s.grad_norm;
      rep.sketch = s.sketch;
      ASSERT_TRUE(agents[r]->Record(rep).ok());
    }
  }

  std::string dir_;
};

TEST_F(PipelineTest, SixtyFourAgentsEveryReportStoredOnceStatsMatchMetricsClean) {
  constexpr uint32_t kWorld = 64, kDim = 128, kSteps = 12;
  auto collector = Collector::Start(Options(0));
  ASSERT_TRUE(collector.ok()) << collector.status();
  auto agents = MakeAgents("exp-64", kWorld, kDim, (*collector)->grpc_port(), 64);
  for (uint64_t step = 1; step <= kSteps; ++step) RecordStep(agents, step, kDim);
  for (auto& a : agents) ASSERT_TRUE(a->Flush(absl::Seconds(60)).ok()) << a->stats().unacked;
  for (auto& a : agents) {
    EXPECT_EQ(a->stats().acked, kSteps);
    EXPECT_EQ(a->stats().dropped, 0u);
  }

  auto store = SqliteStore::Open(dir_ + "/rankscope.db");
  ASSERT_TRUE(store.ok());
  auto count = (*store)->CountRankRows("exp-64");
  ASSERT_TRUE(count.ok());
  EXPECT_EQ(*count, int64_t{kWorld} * kSteps);
  for (uint64_t step = 1; step <= kSteps; ++step) {
    std::vector<Sent> sent;
    for (uint32_t r = 0; r < kWorld; ++r) sent.push_back(MakeReport(r, step, kDim));
    const Reference ref = BruteForce(sent);
    auto row = (*store)->GetStep("exp-64", step);
    ASSERT_TRUE(row.ok() && row->has_value()) << "step " << step;
    const collector::StepRow& s = **row;
    EXPECT_EQ(s.ranks, kWorld);
    EXPECT_TRUE(s.missing_ranks.empty());
    EXPECT_NEAR(s.loss_mean, ref.loss_mean, 1e-12);
    EXPECT_NEAR(s.loss_std, ref.loss_std, 1e-9);
    EXPECT_NEAR(s.loss_range, ref.loss_range, 1e-12);
    EXPECT_NEAR(s.grad_norm_mean, ref.norm_mean, 1e-12);
    EXPECT_NEAR(s.grad_norm_std, ref.norm_std, 1e-9);
    EXPECT_NEAR(s.grad_norm_cv, ref.norm_std / ref.norm_mean, 1e-9);
    EXPECT_NEAR(s.grad_cosine_mean, ref.cosine_mean, 1e-6);
    auto ranks = (*store)->RankRows("exp-64", step);
    ASSERT_TRUE(ranks.ok());
    ASSERT_EQ(ranks->size(), kWorld);
    for (uint32_t r = 0; r < kWorld; ++r) {
      EXPECT_EQ((*ranks)[r].rank, r);
      EXPECT_DOUBLE_EQ((*ranks)[r].loss, sent[r].loss);
      EXPECT_DOUBLE_EQ((*ranks)[r].grad_norm, sent[r].grad_norm);
      ASSERT_TRUE((*ranks)[r].grad_cosine.has_value());
    }
  }

  const std::string metrics = testing::HttpGet((*collector)->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("rankscope_step{train_job=\"exp-64\"} 12"));
  EXPECT_THAT(metrics, HasSubstr("rankscope_ranks_reporting{train_job=\"exp-64\"} 64"));
  EXPECT_THAT(metrics, HasSubstr("rankscope_reports_received_total"));
  EXPECT_THAT(metrics, HasSubstr("rankscope_rank_grad_cosine{"));
  std::string complaints;
  EXPECT_EQ(testing::PromtoolCheckMetrics(metrics, &complaints), 0) << complaints;
  EXPECT_EQ(complaints, "");
  for (auto& a : agents) EXPECT_TRUE(a->Close(absl::Seconds(5)).ok());
  EXPECT_TRUE((*collector)->Shutdown(absl::Seconds(5)).ok());
}

TEST_F(PipelineTest, CollectorRestartLosesNothingThatFittedInTheBuffers) {
  constexpr uint32_t kWorld = 8, kDim = 64;
  const int port = testing::PickFreePort();
  auto agents = MakeAgents("exp-restart", kWorld, kDim, port, 256);

  auto first = Collector::Start(Options(port));
  ASSERT_TRUE(first.ok()) << first.status();
  for (uint64_t step = 1; step <= 20; ++step) RecordStep(agents, step, kDim);
  // Half the steps are likely acked, the rest in flight, when the collector goes away.
  ASSERT_TRUE((*first)->Shutdown(absl::Seconds(2)).ok());
  first->reset();

  // The job goes on while no collector runs: reports wait in the agents' buffers.
  for (uint64_t step = 21; step <= 60; ++step) RecordStep(agents, step, kDim);

  auto second = Collector::Start(Options(port));
  ASSERT_TRUE(second.ok()) << second.status();
  for (uint64_t step = 61; step <= 70; ++step) RecordStep(agents, step, kDim);
  for (auto& a : agents) {
    ASSERT_TRUE(a->Flush(absl::Seconds(60)).ok()) << "unacked " << a->stats().unacked;
    EXPECT_EQ(a->stats().dropped, 0u);
    EXPECT_EQ(a->stats().acked, 70u);
  }
  auto store = SqliteStore::Open(dir_ + "/rankscope.db");
  ASSERT_TRUE(store.ok());
  auto count = (*store)->CountRankRows("exp-restart");
  ASSERT_TRUE(count.ok());
  EXPECT_EQ(*count, int64_t{kWorld} * 70);
  for (uint64_t step = 1; step <= 70; ++step) {
    auto rows = (*store)->RankRows("exp-restart", step);
    ASSERT_TRUE(rows.ok());
    ASSERT_EQ(rows->size(), kWorld) << "step " << step;
    for (uint32_t r = 0; r < kWorld; ++r) {
      EXPECT_DOUBLE_EQ((*rows)[r].loss, MakeReport(r, step, kDim).loss);
    }
    auto s = (*store)->GetStep("exp-restart", step);
    ASSERT_TRUE(s.ok() && s->has_value());
    EXPECT_EQ((**s).ranks, kWorld) << "step " << step << " stored from a partial join";
  }
  for (auto& a : agents) a->Close(absl::Seconds(5)).IgnoreError();
}

TEST_F(PipelineTest, DivergentReplicaOutlierAndStragglerAreNamedInSqlite) {
  constexpr uint32_t kWorld = 8, kDim = 64, kSteps = 6;
  auto collector = Collector::Start(Options(0));
  ASSERT_TRUE(collector.ok()) << collector.status();
  auto agents = MakeAgents("exp-culprit", kWorld, kDim, (*collector)->grpc_port(), 64);
  for (uint64_t step = 1; step <= kSteps; ++step) {
    for (uint32_t r = 0; r < kWorld; ++r) {
      Sent s = MakeReport(r, step, kDim);
      StepReport rep;
      rep.step = step;
      rep.loss = r == 6 ? s.loss + 5.0 : s.loss;  // rank 6: corrupted data
      rep.grad_norm = s.grad_norm;
      rep.sketch = s.sketch;
      // Rank 3's reduced gradient differs from step 4 on (silent corruption in all-reduce).
      rep.reduced_grad_fingerprint = step * 1000 + (r == 3 && step >= 4 ? 1 : 0);
      if (step == 5) rep.param_fingerprint = 42;
      rep.reduced_grad_norm = 0.5;
      rep.local_batch_size = 8;
      rep.step_time_seconds = r == 1 ? 0.5 : 0.1 + 0.001 * r;  // rank 1 straggles
      ASSERT_TRUE(agents[r]->Record(rep).ok());
    }
  }
  for (auto& a : agents) ASSERT_TRUE(a->Flush(absl::Seconds(60)).ok());

  auto store = SqliteStore::Open(dir_ + "/rankscope.db");
  ASSERT_TRUE(store.ok());
  for (uint64_t step = 1; step <= kSteps; ++step) {
    auto s = (*store)->GetStep("exp-culprit", step);
    ASSERT_TRUE(s.ok() && s->has_value());
    EXPECT_TRUE((**s).replica_checked);
    if (step >= 4) {
      EXPECT_THAT((**s).replica_divergent_ranks, ::testing::ElementsAre(3)) << "step " << step;
    } else {
      EXPECT_TRUE((**s).replica_divergent_ranks.empty()) << "step " << step;
    }
    // Rank 6 deviates on every step: an outlier of the job from its third step on.
    if (step >= 3) {
      EXPECT_THAT((**s).outlier_ranks, ::testing::ElementsAre(6u)) << "step " << step;
    } else {
      EXPECT_TRUE((**s).outlier_ranks.empty()) << "step " << step;
    }
    EXPECT_FALSE(std::isnan((**s).grad_noise_scale)) << "step " << step;
    auto rows = (*store)->RankRows("exp-culprit", step);
    ASSERT_TRUE(rows.ok());
    ASSERT_EQ(rows->size(), kWorld);
    for (const collector::RankRow& row : *rows) {
      ASSERT_TRUE(row.replica_ok.has_value());
      EXPECT_EQ(*row.replica_ok, !(row.rank == 3 && step >= 4));
      ASSERT_TRUE(row.step_time_z.has_value());
      if (row.rank == 1) EXPECT_GT(*row.step_time_z, 6.0);
    }
  }
  const std::string metrics = testing::HttpGet((*collector)->metrics_port(), "/metrics");
  EXPECT_THAT(
      metrics,
      HasSubstr("rankscope_rank_replica_divergent{train_job=\"exp-culprit\",rank=\"3\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("rankscope_replica_divergent_ranks{train_job=\"exp-culprit\"} 1"));
  EXPECT_THAT(metrics,
              HasSubstr("rankscope_rank_outlier_score{train_job=\"exp-culprit\",rank=\"6\"}"));
  EXPECT_THAT(
      metrics,
      HasSubstr("rankscope_rank_step_time_seconds{train_job=\"exp-culprit\",rank=\"1\"} 0.5"));
  EXPECT_THAT(metrics, HasSubstr("rankscope_grad_noise_scale{train_job=\"exp-culprit\"}"));
  std::string complaints;
  EXPECT_EQ(testing::PromtoolCheckMetrics(metrics, &complaints), 0) << complaints;
  for (auto& a : agents) a->Close(absl::Seconds(5)).IgnoreError();
}

}  // namespace
}  // namespace rankscope
