#include "collector/pipeline/job_registry.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::HasSubstr;
using ::testing::SizeIs;

class NullStream : public AgentStream {
 public:
  void Ack(absl::Span<const uint64_t>) override {}
  void Abandon(const absl::Status&) override {}
  void SendControl(const v1::Control&) override {}
};

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

v1::Hello Hello(uint32_t rank, const std::string& host = "node-a", uint32_t attempt = 0) {
  v1::Hello h;
  h.set_job("exp-42");
  h.set_rank(rank);
  h.set_world_size(4);
  h.set_sketch_dim(1024);
  h.set_sketch_seed(7);
  h.set_host(host);
  h.set_attempt(attempt);
  return h;
}

TEST(JobRegistryTest, RankClaimedByAnotherHostIsAlreadyExists) {
  JobRegistry registry(10, absl::Hours(1));
  auto a = std::make_shared<NullStream>();
  auto b = std::make_shared<NullStream>();
  JobRegistry::Attached control;
  ASSERT_TRUE(registry.Attach(Hello(1), kT0, a, &control).status.ok());
  const Rejection r = registry.Attach(Hello(1, "node-b"), kT0, b, &control);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReasonLabel(r.reason), "rank_taken");
  EXPECT_THAT(std::string(r.status.message()),
              HasSubstr("held by a live stream from host 'node-a'"));
  // The same host, or another attempt, takes the claim over.
  EXPECT_TRUE(registry.Attach(Hello(1), kT0, b, &control).status.ok());
  auto c = std::make_shared<NullStream>();
  EXPECT_TRUE(registry.Attach(Hello(1, "node-c", 1), kT0, c, &control).status.ok());
  EXPECT_EQ(ReasonLabel(registry.Attach(Hello(1, "node-a", 1), kT0, a, &control).reason),
            "rank_taken");
  // Once every stream of the rank is detached, anyone may claim it.
  EXPECT_TRUE(registry.Detach(Hello(1), a, kT0));
  EXPECT_TRUE(registry.Detach(Hello(1), b, kT0));
  EXPECT_FALSE(registry.Detach(Hello(1), b, kT0));
  EXPECT_TRUE(registry.Detach(Hello(1, "node-c", 1), c, kT0));
  EXPECT_TRUE(registry.Attach(Hello(1, "node-d"), kT0, a, &control).status.ok());
}

v1::Hello Instance(uint32_t rank, const std::string& instance, uint32_t attempt = 0) {
  v1::Hello h = Hello(rank, "node-a", attempt);
  h.set_instance_id(instance);
  h.set_pid(100 + rank);
  return h;
}

// Two processes on one host (two runs, or two models with one job name) are told apart by
// instance: the second is refused while the first's stream is live, with the holder named.
TEST(JobRegistryTest, AnotherInstanceOnTheSameHostIsAlreadyExists) {
  JobRegistry registry(10, absl::Hours(1));
  auto a = std::make_shared<NullStream>();
  auto b = std::make_shared<NullStream>();
  JobRegistry::Attached attached;
  ASSERT_TRUE(registry.Attach(Instance(2, "run-a"), kT0, a, &attached).status.ok());
  const Rejection r = registry.Attach(Instance(2, "run-b"), kT0, b, &attached);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(r.status.message()),
              HasSubstr("host 'node-a' pid 102 (instance 'run-a')"));
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("group="));
  // The same instance reconnecting before its old stream was noticed dead is accepted.
  EXPECT_TRUE(registry.Attach(Instance(2, "run-a"), kT0, b, &attached).status.ok());
  EXPECT_EQ(attached.epoch, 0u);
  EXPECT_FALSE(attached.restarted);
}

// A run resumed with no restart counter: every rank comes back as a new instance after the old
// streams closed. The first one moves the job to a new epoch, the others join it, a survivor of
// the old run keeps the old epoch (its reports lose), and the epoch is in the jobs row.
TEST(JobRegistryTest, NewInstancesAfterTheOldStreamsClosedAreARestart) {
  JobRegistry registry(10, absl::Hours(1));
  std::vector<std::shared_ptr<AgentStream>> old_run, new_run;
  JobRegistry::Attached attached;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    old_run.push_back(std::make_shared<NullStream>());
    ASSERT_TRUE(
        registry.Attach(Instance(rank, absl::StrCat("old-", rank)), kT0, old_run.back(), &attached)
            .status.ok());
    EXPECT_EQ(attached.epoch, 0u);
  }
  for (uint32_t rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(registry.Detach(Instance(rank, absl::StrCat("old-", rank)), old_run[rank], kT0));
  }
  for (uint32_t rank = 0; rank < 3; ++rank) {
    new_run.push_back(std::make_shared<NullStream>());
    ASSERT_TRUE(
        registry.Attach(Instance(rank, absl::StrCat("new-", rank)), kT0, new_run.back(), &attached)
            .status.ok());
    EXPECT_EQ(attached.epoch, 1u) << rank;
    EXPECT_EQ(attached.restarted, rank == 0) << rank;
  }
  EXPECT_EQ(registry.Epoch("exp-42"), 1u);
  // Rank 3 of the old run is still connected: a new instance of it in the same attempt waits.
  EXPECT_EQ(ReasonLabel(registry.Attach(Instance(3, "new-3"), kT0, new_run[0], &attached).reason),
            "rank_taken");
  // The old process of rank 3 reconnects: it keeps its old epoch.
  ASSERT_TRUE(registry.Attach(Instance(3, "old-3"), kT0, old_run[3], &attached).status.ok());
  EXPECT_EQ(attached.epoch, 0u);
  ASSERT_TRUE(registry.StoredRow("exp-42").has_value());
  EXPECT_EQ(registry.StoredRow("exp-42")->attempt, 1u);
  // A collector restart restores the epoch from the jobs row.
  JobRegistry restored(10, absl::Hours(1));
  ASSERT_TRUE(restored.Restore(*registry.StoredRow("exp-42"), kT0));
  EXPECT_EQ(restored.Epoch("exp-42"), 1u);
}

// An elastic resize: a higher attempt may change the world size; the same attempt may not.
TEST(JobRegistryTest, ANewAttemptMayResizeTheJob) {
  JobRegistry registry(10, absl::Hours(1));
  auto s = std::make_shared<NullStream>();
  JobRegistry::Attached attached;
  ASSERT_TRUE(registry.Attach(Instance(0, "a"), kT0, s, &attached).status.ok());
  v1::Hello smaller = Instance(0, "b", 1);
  smaller.set_world_size(2);
  ASSERT_TRUE(registry.Attach(smaller, kT0, s, &attached).status.ok());
  EXPECT_TRUE(attached.resized);
  EXPECT_TRUE(attached.restarted);
  EXPECT_EQ(attached.epoch, 1u);
  EXPECT_EQ(registry.StoredRow("exp-42")->world_size, 2u);
  v1::Hello same_attempt = Instance(1, "c", 1);
  same_attempt.set_world_size(4);
  EXPECT_EQ(ReasonLabel(registry.Attach(same_attempt, kT0, s, &attached).reason),
            "world_size_changed");
  // An older attempt's process is accepted but joins an epoch below the current one.
  v1::Hello old = Instance(1, "d", 0);
  old.set_world_size(2);
  ASSERT_TRUE(registry.Attach(old, kT0, s, &attached).status.ok());
  EXPECT_EQ(attached.epoch, 0u);
}

// A higher attempt accepted while an older attempt's stream is still connected is a takeover
// (logged and counted by the pipeline); a restart after the old streams closed is not.
TEST(JobRegistryTest, AHigherAttemptWhileTheOldOneIsConnectedIsATakeover) {
  JobRegistry registry(10, absl::Hours(1));
  auto s0 = std::make_shared<NullStream>();
  auto s1 = std::make_shared<NullStream>();
  JobRegistry::Attached attached;
  ASSERT_TRUE(registry.Attach(Instance(0, "a0"), kT0, s0, &attached).status.ok());
  ASSERT_TRUE(registry.Attach(Instance(1, "a1"), kT0, s1, &attached).status.ok());
  ASSERT_TRUE(registry.Attach(Instance(0, "b0", 1), kT0, s0, &attached).status.ok());
  EXPECT_TRUE(attached.takeover);
  EXPECT_TRUE(attached.restarted);
  ASSERT_TRUE(registry.Detach(Instance(0, "a0"), s0, kT0));
  ASSERT_TRUE(registry.Detach(Instance(1, "a1"), s1, kT0));
  auto s2 = std::make_shared<NullStream>();
  ASSERT_TRUE(registry.Attach(Instance(1, "c1", 2), kT0, s2, &attached).status.ok());
  EXPECT_TRUE(attached.restarted);
  EXPECT_TRUE(attached.takeover);  // rank 0 of attempt 1 (b0) is still connected
  JobRegistry quiet(10, absl::Hours(1));
  ASSERT_TRUE(quiet.Attach(Instance(0, "a0"), kT0, s0, &attached).status.ok());
  ASSERT_TRUE(quiet.Detach(Instance(0, "a0"), s0, kT0));
  ASSERT_TRUE(quiet.Attach(Instance(0, "b0", 1), kT0, s0, &attached).status.ok());
  EXPECT_TRUE(attached.restarted);
  EXPECT_FALSE(attached.takeover);
}

TEST(JobRegistryTest, IdleJobsOldestFirst) {
  JobRegistry registry(3, absl::Hours(1));
  auto s = std::make_shared<NullStream>();
  JobRegistry::Attached attached;
  for (const char* job : {"late", "early", "busy"}) {
    v1::Hello h = Hello(0);
    h.set_job(job);
    const absl::Time at = kT0 + absl::Seconds(std::string(job) == "early" ? 1 : 2);
    ASSERT_TRUE(registry.Attach(h, at, s, &attached).status.ok());
    if (std::string(job) != "busy") {
      ASSERT_TRUE(registry.Detach(h, s, at));
    }
  }
  EXPECT_THAT(registry.IdleJobsOldestFirst(), ::testing::ElementsAre("early", "late"));
  EXPECT_FALSE(registry.ForgetIdle("busy"));
  EXPECT_TRUE(registry.ForgetIdle("early"));
  EXPECT_FALSE(registry.Contains("early"));
}

TEST(JobRegistryTest, IdentityTtlAndMaxJobs) {
  JobRegistry registry(1, absl::Hours(1));
  auto s = std::make_shared<NullStream>();
  JobRegistry::Attached control;
  ASSERT_TRUE(registry.Attach(Hello(0), kT0, s, &control).status.ok());
  v1::Hello other = Hello(0);
  other.set_job("exp-43");
  EXPECT_EQ(ReasonLabel(registry.CheckRoomForJob(other).reason), "too_many_jobs");
  v1::Hello resized = Hello(0);
  resized.set_world_size(8);
  EXPECT_EQ(ReasonLabel(registry.Attach(resized, kT0, s, &control).reason), "world_size_changed");
  // Not forgotten while a stream is attached, nor within the TTL after it left.
  EXPECT_FALSE(registry.ForgetIfIdle("exp-42", kT0 + absl::Hours(2)));
  ASSERT_TRUE(registry.Detach(Hello(0), s, kT0));
  EXPECT_FALSE(registry.ForgetIfIdle("exp-42", kT0 + absl::Hours(1)));
  EXPECT_TRUE(registry.ForgetIfIdle("exp-42", kT0 + absl::Hours(1) + absl::Seconds(1)));
  EXPECT_FALSE(registry.Contains("exp-42"));
  EXPECT_TRUE(registry.CheckRoomForJob(other).status.ok());
}

TEST(JobRegistryTest, ARestartedCollectorContinuesFromTheControlItsAgentsState) {
  JobRegistry registry(10, absl::Hours(1));  // a fresh collector: it knows no control
  auto s = std::make_shared<NullStream>();
  JobRegistry::Attached attached;
  v1::Hello h0 = Hello(0);
  v1::Control* c0 = h0.mutable_control();
  c0->set_generation(1000);
  c0->set_apply_at_step(30);
  c0->set_enabled(false);
  c0->set_every(3);
  c0->set_sketch_dim(256);
  ASSERT_TRUE(registry.Attach(h0, kT0, s, &attached).status.ok());
  ASSERT_TRUE(attached.control.has_value());
  EXPECT_EQ(attached.control->generation(), 1000u);
  // Reports at the re-tuned size are accepted again from the control's step.
  EXPECT_EQ(registry.SketchDims(h0).retuned_dim, 256u);
  EXPECT_EQ(registry.SketchDims(h0).apply_at_step, 30u);
  // A rank that states an older control does not roll the job back.
  v1::Hello h1 = Hello(1);
  h1.mutable_control()->set_generation(999);
  h1.mutable_control()->set_enabled(true);
  ASSERT_TRUE(registry.Attach(h1, kT0, s, &attached).status.ok());
  EXPECT_EQ(attached.control->generation(), 1000u);
  // `ctl set --every=5` keeps the job disabled and re-tuned, with a newer generation.
  std::vector<std::shared_ptr<AgentStream>> streams;
  auto c = registry.UpdateControl("exp-42", std::nullopt, 5, std::nullopt, 1, kT0, &streams);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->enabled());
  EXPECT_EQ(c->every(), 5u);
  EXPECT_EQ(c->sketch_dim(), 256u);
  EXPECT_GT(c->generation(), 1000u);
}

TEST(JobRegistryTest, ControlRetunesTheSketchSchedule) {
  JobRegistry registry(10, absl::Hours(1));
  auto s = std::make_shared<NullStream>();
  JobRegistry::Attached control;
  ASSERT_TRUE(registry.Attach(Hello(0), kT0, s, &control).status.ok());
  EXPECT_FALSE(control.control.has_value());
  bool dropped_changed = false;
  ASSERT_TRUE(registry.NoteReport(Hello(0), 40, 0, kT0, &dropped_changed));
  EXPECT_TRUE(dropped_changed);  // the first count of a stream is always forwarded
  ASSERT_TRUE(registry.NoteReport(Hello(0), 41, 0, kT0, &dropped_changed));
  EXPECT_FALSE(dropped_changed);
  EXPECT_EQ(registry.SketchDims(Hello(0)).retuned_dim, 0u);

  std::vector<std::shared_ptr<AgentStream>> streams;
  auto c = registry.UpdateControl("exp-42", std::nullopt, std::nullopt, 256, 5, kT0, &streams);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->apply_at_step(), 46u);
  EXPECT_EQ(c->generation(), static_cast<uint64_t>(absl::ToUnixMicros(kT0)));
  EXPECT_THAT(streams, SizeIs(1));
  const SketchDimSchedule dims = registry.SketchDims(Hello(0));
  EXPECT_EQ(dims.base_dim, 1024u);
  EXPECT_EQ(dims.retuned_dim, 256u);
  EXPECT_EQ(dims.apply_at_step, 46u);
  // A later control that leaves the sketch alone keeps the re-tuned dim; the generation grows.
  streams.clear();
  auto c2 = registry.UpdateControl("exp-42", false, std::nullopt, std::nullopt, 1, kT0, &streams);
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(c2->generation(), c->generation() + 1);
  EXPECT_EQ(registry.SketchDims(Hello(0)).retuned_dim, 256u);
  EXPECT_EQ(registry.UpdateControl("nope", true, 1, std::nullopt, 1, kT0, &streams).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ValidateControlRequest(0, std::nullopt, 1024).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateControlRequest(std::nullopt, 2048, 1024).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JobRegistryTest, AuthToken) {
  v1::Hello h = Hello(0);
  EXPECT_TRUE(CheckAuthToken(h, "").status.ok());
  EXPECT_EQ(ReasonLabel(CheckAuthToken(h, "s3cret").reason), "unauthenticated");
  h.set_auth_token("s3cret");
  EXPECT_TRUE(CheckAuthToken(h, "s3cret").status.ok());
}

// Issue 34.1: two live runs under one name. Whichever ranks connect first, the run that holds the
// job keeps it whole: every hello of the other run is refused (run_collision, naming the holder),
// also for ranks the holder has not claimed yet, so no step mixes two runs' ranks. Once the
// holder's streams are gone, the other run is admitted as a restart (a new epoch).
TEST(JobRegistryTest, AnotherLiveRunIsRefusedOnEveryRankUntilTheHolderIsGone) {
  JobRegistry registry(10, absl::Hours(1));
  auto run_hello = [](uint32_t rank, const std::string& run, uint32_t pid) {
    v1::Hello h = Hello(rank, "node-a");
    h.set_run_id(run);
    h.set_instance_id(absl::StrCat(run, "-", rank));
    h.set_pid(pid);
    return h;
  };
  std::vector<std::shared_ptr<AgentStream>> a, b;
  for (int i = 0; i < 4; ++i) {
    a.push_back(std::make_shared<NullStream>());
    b.push_back(std::make_shared<NullStream>());
  }
  JobRegistry::Attached attached;
  ASSERT_TRUE(registry.Attach(run_hello(0, "run-a", 100), kT0, a[0], &attached).status.ok());
  const uint32_t epoch = attached.epoch;
  // Run b's rank 1, a rank run a has not claimed: refused all the same.
  for (uint32_t rank : {1u, 0u}) {
    const Rejection r = registry.Attach(run_hello(rank, "run-b", 200), kT0, b[rank], &attached);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kAlreadyExists) << rank;
    EXPECT_EQ(ReasonLabel(r.reason), "run_collision");
    const std::string message(r.status.message());
    EXPECT_THAT(message, HasSubstr("held by another live run: run 'run-a' (attempt 0, 1 live "
                                   "stream, since "));
    EXPECT_THAT(message, HasSubstr("first from host 'node-a' pid 100"));
    EXPECT_THAT(message, HasSubstr("rank " + std::to_string(rank) + " of run 'run-b'"));
    EXPECT_THAT(message, HasSubstr("is NOT stored"));
  }
  // The holder's other ranks join it; a reconnect of its rank 0 is still its own.
  ASSERT_TRUE(registry.Attach(run_hello(1, "run-a", 101), kT0, a[1], &attached).status.ok());
  EXPECT_EQ(attached.epoch, epoch);
  // A hello that states no run (an older agent) is judged per rank, as before.
  v1::Hello old = Hello(2, "node-z");
  EXPECT_TRUE(registry.Attach(old, kT0, b[2], &attached).status.ok());
  EXPECT_TRUE(registry.Detach(old, b[2], kT0));
  // Run a's streams end (closed, or cancelled by keepalive): run b is a restart.
  EXPECT_TRUE(registry.Detach(run_hello(0, "run-a", 100), a[0], kT0));
  EXPECT_EQ(ReasonLabel(registry.Attach(run_hello(0, "run-b", 200), kT0, b[0], &attached).reason),
            "run_collision");  // run a still has rank 1 live
  EXPECT_TRUE(registry.Detach(run_hello(1, "run-a", 101), a[1], kT0));
  ASSERT_TRUE(registry.Attach(run_hello(0, "run-b", 200), kT0, b[0], &attached).status.ok());
  EXPECT_TRUE(attached.restarted);
  EXPECT_GT(attached.epoch, epoch);
  ASSERT_TRUE(registry.Attach(run_hello(1, "run-b", 201), kT0, b[1], &attached).status.ok());
  EXPECT_EQ(attached.epoch, epoch + 1);
  // Now run a is the one refused.
  EXPECT_EQ(ReasonLabel(registry.Attach(run_hello(1, "run-a", 101), kT0, a[1], &attached).reason),
            "run_collision");
  // A higher attempt is a takeover (a torchelastic restart whose old processes linger).
  v1::Hello next = run_hello(0, "run-c", 300);
  next.set_attempt(1);
  ASSERT_TRUE(registry.Attach(next, kT0, a[3], &attached).status.ok());
  EXPECT_TRUE(attached.restarted);
  EXPECT_TRUE(attached.takeover);  // run b's streams of attempt 0 are still open
}

}  // namespace
}  // namespace rankscope::collector
