#include "collector/ingest/validation.h"

#include <cmath>
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

// Where in the model: a report carries no bucket norms or exactly one per name of its hello;
// a hello names at most kMaxHelloBuckets buckets of at most kMaxBucketNameBytes bytes.
TEST(ValidationTest, BucketNormsMatchTheHellosNames) {
  v1::Hello hello = GoodHello();
  hello.add_bucket_names("net.0");
  hello.add_bucket_names("net.2");
  EXPECT_TRUE(ValidateHello(hello, IngestLimits{}).status.ok());
  v1::StepReport report;
  report.set_step(5);
  for (int i = 0; i < 1024; ++i) report.add_sketch(0.0f);
  EXPECT_TRUE(ValidateReport(report, hello, {1024}).status.ok());
  report.add_bucket_norms(1.0f);
  report.add_bucket_norms(2.0f);
  EXPECT_TRUE(ValidateReport(report, hello, {1024}).status.ok());
  report.add_bucket_norms(3.0f);
  Rejection r = ValidateReport(report, hello, {1024});
  EXPECT_EQ(ReasonLabel(r.reason), "invalid_report");
  EXPECT_EQ(r.status.message(),
            "report of step 5 carries 3 bucket norms, the hello of job exp-42 names 2 buckets");

  hello.add_bucket_names(std::string(kMaxBucketNameBytes + 1, 'x'));
  EXPECT_EQ(ReasonLabel(ValidateHello(hello, IngestLimits{}).reason), "bad_hello");
  hello = GoodHello();
  for (int i = 0; i <= kMaxHelloBuckets; ++i) hello.add_bucket_names("b");
  EXPECT_THAT(ValidateHello(hello, IngestLimits{}).status.message(), HasSubstr("257 buckets"));
}

// The tolerance replica check's summaries: kReplicaProjections finite projections, a finite
// rounding >= 0, with their fingerprint; the reduced gradient's with a precision in [1, 53].
TEST(ValidationTest, ReplicaSummariesAreChecked) {
  v1::StepReport report;
  report.set_step(5);
  for (int i = 0; i < 4; ++i) report.add_sketch(0.0f);
  auto fill = [](v1::ReplicaSummary* s, uint32_t precision) {
    for (int j = 0; j < 4; ++j) s->add_projections(0.5 * j);
    s->set_rounding(1e-7);
    s->set_precision(precision);
  };
  fill(report.mutable_param_summary(), 0);
  Rejection r = ValidateReport(report, GoodHello(), {4});  // no param_fingerprint
  EXPECT_EQ(ReasonLabel(r.reason), "invalid_report");
  EXPECT_THAT(r.status.message(), HasSubstr("param_summary of step 5"));
  report.set_param_fingerprint(42);
  EXPECT_TRUE(ValidateReport(report, GoodHello(), {4}).status.ok());
  report.mutable_param_summary()->add_projections(1.0);  // five
  EXPECT_EQ(ReasonLabel(ValidateReport(report, GoodHello(), {4}).reason), "invalid_report");
  report.mutable_param_summary()->mutable_projections()->RemoveLast();
  report.mutable_param_summary()->set_rounding(std::numeric_limits<double>::infinity());
  EXPECT_EQ(ReasonLabel(ValidateReport(report, GoodHello(), {4}).reason), "invalid_report");
  report.mutable_param_summary()->set_rounding(0.0);
  EXPECT_TRUE(ValidateReport(report, GoodHello(), {4}).status.ok());

  report.set_reduced_grad_fingerprint(7);
  fill(report.mutable_reduced_grad_summary(), 0);  // precision 0
  r = ValidateReport(report, GoodHello(), {4});
  EXPECT_EQ(ReasonLabel(r.reason), "invalid_report");
  EXPECT_THAT(r.status.message(), HasSubstr("reduced_grad_summary of step 5"));
  report.mutable_reduced_grad_summary()->set_precision(24);
  EXPECT_TRUE(ValidateReport(report, GoodHello(), {4}).status.ok());
  report.mutable_reduced_grad_summary()->set_projections(2, std::nan(""));
  EXPECT_EQ(ReasonLabel(ValidateReport(report, GoodHello(), {4}).reason), "invalid_report");
}

v1::Hello PackedHello(v1::SketchEncoding encoding) {
  v1::Hello h = GoodHello();
  h.set_sketch_encoding(encoding);
  return h;
}

TEST(ValidationTest, UnknownSketchEncodingIsABadHello) {
  v1::Hello h = GoodHello();
  h.set_sketch_encoding(static_cast<v1::SketchEncoding>(7));
  Rejection r = ValidateHello(h, IngestLimits{});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReasonLabel(r.reason), "bad_hello");
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("sketch_encoding 7 of job exp-42"));
  EXPECT_TRUE(ValidateHello(PackedHello(v1::SKETCH_ENCODING_INT8), IngestLimits{}).status.ok());
  EXPECT_TRUE(ValidateHello(PackedHello(v1::SKETCH_ENCODING_FLOAT16), IngestLimits{}).status.ok());
}

TEST(ValidationTest, MixedEncodingsInAJobAreRefused) {
  const JobIdentity int8_job{8, 1024, 7, SketchEncoding::kInt8};
  EXPECT_TRUE(CheckJobIdentity(PackedHello(v1::SKETCH_ENCODING_INT8), int8_job).status.ok());
  Rejection r = CheckJobIdentity(GoodHello(), int8_job);  // an old agent: float32
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonLabel(r.reason), "sketch_mismatch");
  EXPECT_EQ(r.status.message(),
            "sketch_encoding float32 differs from job exp-42's (int8): a job uses one sketch "
            "encoding; attach every rank with the same sketch_encoding, or use a new job name");
  r = CheckJobIdentity(PackedHello(v1::SKETCH_ENCODING_FLOAT16), int8_job);
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("float16 differs from job exp-42's"));
  // An identity restored from the store does not know its encoding: any is accepted.
  const JobIdentity restored{8, 1024, 7, std::nullopt};
  EXPECT_TRUE(CheckJobIdentity(PackedHello(v1::SKETCH_ENCODING_FLOAT16), restored).status.ok());
  EXPECT_EQ(IdentityOf(PackedHello(v1::SKETCH_ENCODING_FLOAT16)).sketch_encoding,
            SketchEncoding::kFloat16);
  EXPECT_EQ(IdentityOf(GoodHello()).sketch_encoding, SketchEncoding::kFloat32);
}

TEST(ValidationTest, MixedHashBlocksInAJobAreRefused) {
  // Agents before Hello.sketch_block hashed blocks of 16 and do not send it (0).
  v1::Hello old_agent = GoodHello();
  old_agent.set_sketch_block(0);
  v1::Hello new_agent = GoodHello();
  new_agent.set_sketch_block(32);
  EXPECT_EQ(SketchBlockOf(old_agent), 16u);
  EXPECT_EQ(IdentityOf(new_agent).sketch_block, 32u);
  const JobIdentity job = IdentityOf(new_agent);
  EXPECT_TRUE(CheckJobIdentity(new_agent, job).status.ok());
  Rejection r = CheckJobIdentity(old_agent, job);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonLabel(r.reason), "sketch_mismatch");
  EXPECT_THAT(std::string(r.status.message()),
              HasSubstr("sketch_block 16 differs from job exp-42's (32)"));
  EXPECT_FALSE(CheckJobIdentity(new_agent, IdentityOf(old_agent)).status.ok());
  // An identity restored from the store does not know its block: any is accepted.
  const JobIdentity restored{job.world_size, job.sketch_dim, job.sketch_seed, std::nullopt,
                             std::nullopt};
  EXPECT_TRUE(CheckJobIdentity(old_agent, restored).status.ok());
}

TEST(ValidationTest, PackedReportLengthAndScale) {
  for (auto [encoding, per_bin] :
       {std::pair{v1::SKETCH_ENCODING_INT8, 1}, std::pair{v1::SKETCH_ENCODING_FLOAT16, 2}}) {
    const v1::Hello hello = PackedHello(encoding);
    v1::StepReport report;
    report.set_step(5);
    report.set_sketch_packed(std::string(1024 * per_bin, '\1'));
    report.set_sketch_scale(0.5f);
    EXPECT_TRUE(ValidateReport(report, hello, {1024}).status.ok());
    EXPECT_EQ(ReportSketchDim(report, hello), 1024u);
    // A whole number of bins of the wrong count.
    report.set_sketch_packed(std::string(1023 * per_bin, '\1'));
    Rejection r = ValidateReport(report, hello, {1024});
    EXPECT_EQ(ReasonLabel(r.reason), "sketch_length");
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("has 1023 "));
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("uses sketch_dim 1024"));
    // A re-tuned dimension is accepted.
    EXPECT_TRUE(ValidateReport(report, hello, {1024, 1023, 0}).status.ok());
    // Floats instead of (or beside) packed bytes.
    report.set_sketch_packed(std::string(1024 * per_bin, '\1'));
    report.add_sketch(1.0f);
    r = ValidateReport(report, hello, {1024});
    EXPECT_EQ(ReasonLabel(r.reason), "sketch_length");
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("1 float values"));
    report.clear_sketch();
    // Scales: finite and > 0, or NaN (a non-finite sketch, stored and flagged).
    for (float bad : {0.0f, -1.0f, -0.0f, std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      report.set_sketch_scale(bad);
      r = ValidateReport(report, hello, {1024});
      EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_EQ(ReasonLabel(r.reason), "invalid_report") << bad;
      EXPECT_THAT(std::string(r.status.message()), HasSubstr("must be finite and > 0")) << bad;
    }
    report.set_sketch_scale(std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(ValidateReport(report, hello, {1024}).status.ok());
    report.set_sketch_scale(std::numeric_limits<float>::denorm_min());
    EXPECT_TRUE(ValidateReport(report, hello, {1024}).status.ok());
  }
  // float16 bytes must be a whole number of bins.
  v1::StepReport odd;
  odd.set_sketch_packed(std::string(2047, '\0'));
  odd.set_sketch_scale(1.0f);
  Rejection r = ValidateReport(odd, PackedHello(v1::SKETCH_ENCODING_FLOAT16), {1023});
  EXPECT_EQ(ReasonLabel(r.reason), "sketch_length");
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("2047 packed bytes"));
}

TEST(ValidationTest, Float32JobRefusesPackedBytes) {
  v1::StepReport report;
  for (int i = 0; i < 4; ++i) report.add_sketch(1.0f);
  report.set_sketch_packed("abcd");
  Rejection r = ValidateReport(report, GoodHello(), {4});
  EXPECT_EQ(ReasonLabel(r.reason), "sketch_length");
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("sketch_encoding float32"));
}

}  // namespace
}  // namespace rankscope::collector
