// The one job-name rule and the two ways its refusal shows the name.
#include "common/job_name.h"

#include <string>

#include "gtest/gtest.h"

namespace rankscope {
namespace {

TEST(JobNameTest, AcceptsExactlyTheAllowedAlphabetAndLengths) {
  EXPECT_TRUE(IsValidJobName("exp-42"));
  EXPECT_TRUE(IsValidJobName("a.b:c_d-E9"));
  EXPECT_TRUE(IsValidJobName(std::string(kMaxJobNameLength, 'a')));
  EXPECT_FALSE(IsValidJobName(std::string(kMaxJobNameLength + 1, 'a')));
  EXPECT_FALSE(IsValidJobName(""));
  EXPECT_FALSE(IsValidJobName("with space"));
  EXPECT_FALSE(IsValidJobName("slash/name"));
  EXPECT_FALSE(IsValidJobName(std::string("nul\0byte", 8)));
  EXPECT_FALSE(IsValidJobName("caf\xc3\xa9"));
  EXPECT_TRUE(IsValidJobName("abcd", 4));
  EXPECT_FALSE(IsValidJobName("abcde", 4));
}

TEST(JobNameTest, QuoteNamesTheJob) {
  EXPECT_TRUE(ValidateJobName("exp-42", JobNameEcho::kQuote).ok());
  const absl::Status s = ValidateJobName("bad job", JobNameEcho::kQuote);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "job name 'bad job' must be 1-128 characters of [A-Za-z0-9_.:-]");
}

TEST(JobNameTest, LengthOnlyNeverEchoesTheBytes) {
  EXPECT_TRUE(ValidateJobName("exp-42", JobNameEcho::kLengthOnly).ok());
  const absl::Status s = ValidateJobName("bad job name!", JobNameEcho::kLengthOnly);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "job name must be 1-128 characters of [A-Za-z0-9_.:-], got 13 characters");
  const absl::Status limited = ValidateJobName("abcde", JobNameEcho::kLengthOnly, 4);
  EXPECT_EQ(limited.message(),
            "job name must be 1-4 characters of [A-Za-z0-9_.:-], got 5 characters");
}

TEST(JobNameTest, GroupNamesAndKeys) {
  EXPECT_TRUE(ValidateGroupName("", JobNameEcho::kQuote).ok());  // the job's only group
  EXPECT_TRUE(ValidateGroupName("pp2-tp5", JobNameEcho::kQuote).ok());
  EXPECT_EQ(ValidateGroupName("a/b", JobNameEcho::kQuote).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateGroupName(std::string(65, 'g'), JobNameEcho::kLengthOnly).message(),
            "group name must be 0-64 characters of [A-Za-z0-9_.:-], got 65 characters");
  EXPECT_EQ(GroupKey("exp-42", ""), "exp-42");
  EXPECT_EQ(GroupKey("exp-42", "dp1"), "exp-42/dp1");
  EXPECT_EQ(SplitGroupKey("exp-42/dp1").first, "exp-42");
  EXPECT_EQ(SplitGroupKey("exp-42/dp1").second, "dp1");
  EXPECT_EQ(SplitGroupKey("exp-42").second, "");
  EXPECT_TRUE(IsValidGroupKey("exp-42"));
  EXPECT_TRUE(IsValidGroupKey("exp-42/dp1"));
  EXPECT_FALSE(IsValidGroupKey("exp-42/"));
  EXPECT_FALSE(IsValidGroupKey("/dp1"));
  EXPECT_FALSE(IsValidGroupKey("exp-42/dp1/x"));
  EXPECT_FALSE(IsValidGroupKey("exp-42/" + std::string(65, 'g')));
}

}  // namespace
}  // namespace rankscope
