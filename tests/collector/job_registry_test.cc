#include "collector/job_registry.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
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
  std::optional<v1::Control> control;
  ASSERT_TRUE(registry.Attach(Hello(1), kT0, a, &control).status.ok());
  const Rejection r = registry.Attach(Hello(1, "node-b"), kT0, b, &control);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReasonLabel(r.reason), "rank_taken");
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("already connected from host 'node-a'"));
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

TEST(JobRegistryTest, IdentityTtlAndMaxJobs) {
  JobRegistry registry(1, absl::Hours(1));
  auto s = std::make_shared<NullStream>();
  std::optional<v1::Control> control;
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

TEST(JobRegistryTest, ControlRetunesTheSketchSchedule) {
  JobRegistry registry(10, absl::Hours(1));
  auto s = std::make_shared<NullStream>();
  std::optional<v1::Control> control;
  ASSERT_TRUE(registry.Attach(Hello(0), kT0, s, &control).status.ok());
  EXPECT_FALSE(control.has_value());
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

}  // namespace
}  // namespace rankscope::collector
