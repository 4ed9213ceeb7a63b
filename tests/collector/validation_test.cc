#include "collector/validation.h"

#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::HasSubstr;

v1::Hello GoodHello() {
  v1::Hello h;
  h.set_job("exp-42");
  h.set_rank(3);
  h.set_world_size(8);
  h.set_sketch_dim(1024);
  h.set_sketch_seed(7);
  return h;
}

TEST(ValidationTest, JobNames) {
  EXPECT_TRUE(IsValidJobName("exp-42", 128));
  EXPECT_TRUE(IsValidJobName("a.b:c_d-E9", 128));
  EXPECT_FALSE(IsValidJobName("", 128));
  EXPECT_FALSE(IsValidJobName("with space", 128));
  EXPECT_FALSE(IsValidJobName("quote'; DROP TABLE jobs;--", 128));
  EXPECT_FALSE(IsValidJobName(std::string(129, 'a'), 128));
  EXPECT_TRUE(IsValidJobName(std::string(128, 'a'), 128));
  EXPECT_FALSE(IsValidJobName(std::string("nul\0byte", 8), 128));
}

TEST(ValidationTest, GoodHelloPasses) {
  EXPECT_TRUE(ValidateHello(GoodHello(), IngestLimits{}).status.ok());
}

TEST(ValidationTest, RankOutOfRangeNamesRankWorldAndJob) {
  v1::Hello h = GoodHello();
  h.set_rank(9);
  Rejection r = ValidateHello(h, IngestLimits{});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReasonLabel(r.reason), "rank_out_of_range");
  EXPECT_EQ(r.status.message(), "rank 9 >= world_size 8 for job exp-42");
}

TEST(ValidationTest, BadHelloFields) {
  IngestLimits limits;
  limits.max_world_size = 100;
  limits.max_sketch_dim = 4096;
  v1::Hello h = GoodHello();
  h.set_world_size(0);
  EXPECT_EQ(ReasonLabel(ValidateHello(h, limits).reason), "bad_hello");
  h = GoodHello();
  h.set_world_size(101);
  h.set_rank(0);
  EXPECT_THAT(std::string(ValidateHello(h, limits).status.message()), HasSubstr("[1, 100]"));
  h = GoodHello();
  h.set_sketch_dim(0);
  EXPECT_EQ(ReasonLabel(ValidateHello(h, limits).reason), "bad_hello");
  h.set_sketch_dim(4097);
  EXPECT_EQ(ValidateHello(h, limits).status.code(), absl::StatusCode::kInvalidArgument);
  h = GoodHello();
  h.set_job("bad job");
  EXPECT_EQ(ReasonLabel(ValidateHello(h, limits).reason), "bad_hello");
}

TEST(ValidationTest, JobIdentityMustNotChange) {
  const JobIdentity id{8, 1024, 7};
  EXPECT_TRUE(CheckJobIdentity(GoodHello(), id).status.ok());
  v1::Hello h = GoodHello();
  h.set_world_size(16);
  Rejection r = CheckJobIdentity(h, id);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonLabel(r.reason), "world_size_changed");
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("world_size 16 != 8 for job exp-42"));
  h = GoodHello();
  h.set_sketch_dim(512);
  EXPECT_EQ(ReasonLabel(CheckJobIdentity(h, id).reason), "sketch_mismatch");
  h = GoodHello();
  h.set_sketch_seed(8);
  EXPECT_EQ(ReasonLabel(CheckJobIdentity(h, id).reason), "sketch_mismatch");
}

TEST(ValidationTest, ReportSketchLength) {
  v1::StepReport report;
  report.set_step(5);
  for (int i = 0; i < 1024; ++i) report.add_sketch(0.0f);
  EXPECT_TRUE(ValidateReport(report, GoodHello(), {1024}).status.ok());
  report.mutable_sketch()->RemoveLast();
  Rejection r = ValidateReport(report, GoodHello(), {1024});
  EXPECT_EQ(ReasonLabel(r.reason), "sketch_length");
  EXPECT_EQ(r.status.message(),
            "sketch of step 5 has 1023 values, job exp-42 uses sketch_dim 1024");
}

TEST(ValidationTest, StepBeyondInt64IsRejected) {
  v1::StepReport report;
  report.set_step(uint64_t{1} << 63);
  Rejection r = ValidateReport(report, GoodHello(), {0});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReasonLabel(r.reason), "invalid_report");
  report.set_step((uint64_t{1} << 63) - 1);
  EXPECT_TRUE(ValidateReport(report, GoodHello(), {0}).status.ok());
}

TEST(ValidationTest, NonFiniteValuesAreAccepted) {
  v1::StepReport report;
  report.set_loss(std::numeric_limits<double>::quiet_NaN());
  report.set_grad_norm(std::numeric_limits<double>::infinity());
  for (int i = 0; i < 4; ++i) report.add_sketch(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(ValidateReport(report, GoodHello(), {4}).status.ok());
}

}  // namespace
}  // namespace rankscope::collector
