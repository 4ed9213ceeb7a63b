// The web view's JSON API as pure functions (collector/web/web_api.h): request parsing with Query's
// checks, the step window's defaults, and the JSON of each answer.
#include "collector/web/web_api.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collector/query/query_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::collector {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ParseApiRequestTest, Routes) {
  auto jobs = ParseApiRequest("/jobs", "");
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->route, ApiRequest::Route::kJobs);

  auto steps = ParseApiRequest("/jobs/exp-42/steps", "first=3&last=9");
  ASSERT_TRUE(steps.ok()) << steps.status();
  EXPECT_EQ(steps->route, ApiRequest::Route::kSteps);
  EXPECT_EQ(steps->job, "exp-42");
  EXPECT_EQ(steps->first, 3u);
  EXPECT_EQ(steps->last, 9u);

  auto ranks = ParseApiRequest("/jobs/exp-42/ranks", "rank=5");
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  EXPECT_EQ(ranks->route, ApiRequest::Route::kRanks);
  EXPECT_EQ(ranks->rank, 5u);
  EXPECT_FALSE(ranks->first.has_value());
}

TEST(ParseApiRequestTest, GroupKeyWithLiteralOrEncodedSlash) {
  for (const char* path :
       {"/jobs/exp-42/tp0/steps", "/jobs/exp-42%2Ftp0/steps", "/jobs/exp-42%2ftp0/steps"}) {
    auto r = ParseApiRequest(path, "");
    ASSERT_TRUE(r.ok()) << path << ": " << r.status();
    EXPECT_EQ(r->job, "exp-42/tp0") << path;
  }
}

TEST(ParseApiRequestTest, BadNamesAreInvalidArgumentAndNeverEchoed) {
  const std::string long_name(200, 'a');
  for (const std::string& name :
       {std::string("bad%20name"), std::string("a/b/c"), long_name, std::string("%00"),
        std::string("job/"), std::string("/job"), std::string("<script>")}) {
    auto r = ParseApiRequest(absl::StrCat("/jobs/", name, "/steps"), "");
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(r.status().message(), Not(HasSubstr(name))) << name;
  }
  // The same rule as Query's: a name Query refuses is refused here, with its message.
  EXPECT_EQ(ParseApiRequest("/jobs/a%20b/ranks", "").status(), CheckQueryJobName("a b"));
}

TEST(ParseApiRequestTest, BadParametersAreInvalidArgument) {
  for (const char* query :
       {"first=abc", "first=-1", "first=1.5", "last=", "first=9223372036854775808",
        "last=99999999999999999999999", "first=10&last=9", "rank=x", "rank=4294967296", "limit=5",
        "first=1&&colour=red"}) {
    auto r = ParseApiRequest("/jobs/exp/ranks", query);
    ASSERT_FALSE(r.ok()) << query;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << query;
  }
  // first > last says both, as Query's StepRange does.
  EXPECT_EQ(ParseApiRequest("/jobs/exp/steps", "first=10&last=9").status(), CheckStepRange(10, 9));
  // The largest step the store holds is accepted.
  EXPECT_TRUE(ParseApiRequest("/jobs/exp/steps", "last=9223372036854775807").ok());
  EXPECT_EQ(ParseApiRequest("/jobs", "first=1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseApiRequest("/jobs/exp/steps", std::string(2000, 'a')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseApiRequestTest, UnknownPathsAreNotFound) {
  for (const char* path : {"", "/", "/job", "/jobs/exp", "/jobs/exp/other", "/metrics"}) {
    EXPECT_EQ(ParseApiRequest(path, "").status().code(), absl::StatusCode::kNotFound) << path;
  }
}

TEST(ResolveWindowTest, Defaults) {
  ApiRequest r;
  EXPECT_EQ(ResolveWindow(r, 1000, 300).first, 701u);
  EXPECT_EQ(ResolveWindow(r, 1000, 300).last, 1000u);
  EXPECT_EQ(ResolveWindow(r, 5, 300).first, 0u);  // clamped
  r.first = 10;
  EXPECT_EQ(ResolveWindow(r, 1000, 300).first, 10u);
  EXPECT_EQ(ResolveWindow(r, 1000, 300).last, 1000u);
  r.first = 2000;  // beyond the newest step: an empty window, not first > last
  EXPECT_EQ(ResolveWindow(r, 1000, 300).last, 2000u);
  r.first.reset();
  r.last = 50;
  EXPECT_EQ(ResolveWindow(r, 1000, 300).first, 0u);
  EXPECT_EQ(ResolveWindow(r, 1000, 30).first, 21u);
}

TEST(ParseApiRequestTest, SinceAsksForTheStepsAfterIt) {
  for (const char* route : {"/jobs/exp/steps", "/jobs/exp/ranks"}) {
    auto r = ParseApiRequest(route, "since=41");
    ASSERT_TRUE(r.ok()) << route << ": " << r.status();
    EXPECT_EQ(r->since, 41u);
    EXPECT_FALSE(r->first.has_value());
  }
  auto with_last = ParseApiRequest("/jobs/exp/ranks", "since=41&last=50&rank=3");
  ASSERT_TRUE(with_last.ok()) << with_last.status();
  EXPECT_EQ(with_last->last, 50u);
  EXPECT_EQ(with_last->rank, 3u);
  for (const char* query : {"since=4&first=2", "first=2&since=4", "since=x", "since=-1",
                            "since=9223372036854775807", "since=50&last=50", "since=51&last=50"}) {
    auto r = ParseApiRequest("/jobs/exp/ranks", query);
    ASSERT_FALSE(r.ok()) << query;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << query;
  }
}

TEST(ParseApiRequestTest, ChangesTakeACursorAndAllowFirstBesideSince) {
  auto r = ParseApiRequest("/jobs/exp/ranks", "since=40&first=10&changes=9f3a.17");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->changes.has_value());
  EXPECT_EQ(r->changes->instance, 0x9f3au);
  EXPECT_EQ(r->changes->seq, 17u);
  EXPECT_EQ(r->first, 10u);
  EXPECT_EQ(r->since, 40u);
  auto history = ParseApiRequest("/jobs/exp/ranks", "first=10&last=50&changes=1.0");
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(history->changes, (ChangeCursor{1, 0}));
  for (const char* query :
       {"changes=", "changes=17", "changes=9G.1", "changes=9f.-1", "changes=9f.1.2",
        "changes=12345678901234567.1", "changes=A.1", "changes=9f.1&rank=3", "since=4&first=2"}) {
    auto bad = ParseApiRequest("/jobs/exp/ranks", query);
    ASSERT_FALSE(bad.ok()) << query;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << query;
  }
  // The steps answer has no change cursor.
  EXPECT_FALSE(ParseApiRequest("/jobs/exp/steps", "changes=9f.1").ok());
  EXPECT_EQ(FormatChangeCursor({0x9f3a, 17}), "9f3a.17");
  EXPECT_EQ(ParseChangeCursor(FormatChangeCursor({~0ull, ~0ull})), (ChangeCursor{~0ull, ~0ull}));
}

TEST(HeldWindowTest, TheStepsTheCallerHolds) {
  ApiRequest r;
  r.since = 100;
  // Without changes nothing held is read again.
  EXPECT_GT(HeldWindow(r, 104, 120).first, HeldWindow(r, 104, 120).last);
  r.changes = ChangeCursor{1, 5};
  // With since: the default window's first step (or `first`) up to since.
  EXPECT_EQ(HeldWindow(r, 104, 120).first, 0u);
  EXPECT_EQ(HeldWindow(r, 104, 120).last, 100u);
  EXPECT_EQ(HeldWindow(r, 150, 120).first, 31u);
  // A page far behind holds nothing of the newest window (it gets that window as new steps).
  EXPECT_GT(HeldWindow(r, 1000, 120).first, HeldWindow(r, 1000, 120).last);
  r.first = 60;
  EXPECT_EQ(HeldWindow(r, 104, 120).first, 60u);
  EXPECT_EQ(HeldWindow(r, 104, 120).last, 100u);
  // The new steps' window ignores `first` beside since.
  EXPECT_EQ(ResolveWindow(r, 104, 120).first, 101u);
  // A page that fell behind holds steps at or below since only.
  r.first = 101;
  EXPECT_GT(HeldWindow(r, 104, 120).first, HeldWindow(r, 104, 120).last);
  // Without since: the whole window asked for.
  ApiRequest h;
  h.changes = ChangeCursor{1, 5};
  h.first = 10;
  h.last = 50;
  EXPECT_EQ(HeldWindow(h, 1000, 120).first, 10u);
  EXPECT_EQ(HeldWindow(h, 1000, 120).last, 50u);
}

TEST(JsonTest, RankMatrixCarriesItsChangeCursor) {
  const std::string json = RanksJson("exp", {1, 2}, 2, {}, false);
  EXPECT_EQ(WithChanges(json, {0xab, 9}, false),
            json.substr(0, json.size() - 1) + ",\"changes\":\"ab.9\"}");
  EXPECT_THAT(WithChanges(json, {0xab, 9}, true),
              HasSubstr(",\"changes\":\"ab.9\",\"resync\":true}"));
}

TEST(ResolveWindowTest, SinceStartsAfterItWithinTheNewestWindow) {
  ApiRequest r;
  r.since = 100;
  // Newer steps: the ones after `since`, up to the newest.
  EXPECT_EQ(ResolveWindow(r, 104, 120).first, 101u);
  EXPECT_EQ(ResolveWindow(r, 104, 120).last, 104u);
  // Nothing newer: an empty window after `since` (first > the newest step), first <= last.
  EXPECT_EQ(ResolveWindow(r, 100, 120).first, 101u);
  EXPECT_EQ(ResolveWindow(r, 100, 120).last, 101u);
  EXPECT_EQ(ResolveWindow(r, 90, 120).first, 101u);
  // A page far behind gets the newest default window, not the oldest steps it missed.
  EXPECT_EQ(ResolveWindow(r, 1000, 120).first, 881u);
  EXPECT_EQ(ResolveWindow(r, 1000, 120).last, 1000u);
  r.last = 150;
  EXPECT_EQ(ResolveWindow(r, 1000, 120).first, 101u);
  EXPECT_EQ(ResolveWindow(r, 1000, 120).last, 150u);
}

StepRow Step(uint64_t step) {
  StepRow row;
  row.step = step;
  row.ranks = 3;
  row.world_size = 4;
  row.loss_mean = 2.5;
  row.loss_std = 0.125;
  row.grad_cosine_mean = 0.75;
  row.missing_ranks = "3";
  row.timed_out = true;
  row.outlier_ranks = {1};
  row.completed_at = absl::FromUnixSeconds(100);
  return row;
}

TEST(JsonTest, StepsCarryEveryColumnAndNonFiniteIsNull) {
  StepRow row = Step(7);
  row.grad_norm_cv = std::numeric_limits<double>::infinity();
  const std::string json = StepsJson("exp", {5, 9}, {row}, /*truncated=*/true);
  EXPECT_EQ(json,
            "{\"job\":\"exp\",\"first\":5,\"last\":9,\"truncated\":true,\"steps\":[{\"step\":7,"
            "\"ranks\":3,\"world_size\":4,\"loss_mean\":2.5,\"loss_std\":0.125,\"loss_range\":0,"
            "\"grad_norm_mean\":0,\"grad_norm_std\":0,\"grad_norm_cv\":null,"
            "\"grad_cosine_mean\":0.75,\"grad_noise_scale\":null,\"missing_ranks\":\"3\","
            "\"timed_out\":true,\"outlier_ranks\":[1],\"divergent_ranks\":[],"
            "\"drifting_ranks\":[],\"slow_ranks\":[],\"integrity_fault\":\"\","
            "\"integrity_rank\":null,\"completed_at\":100}]}");
  // A failed aggregation check names its fault and, when the regression found one, the rank.
  row.integrity_error_ratio = 40.0;
  row.integrity_fault = "missing";
  row.integrity_rank = 2;
  EXPECT_THAT(StepsJson("exp", {5, 9}, {row}, /*truncated=*/false),
              HasSubstr("\"integrity_fault\":\"missing\",\"integrity_rank\":2,"));
  row.integrity_fault = "sum";
  row.integrity_rank.reset();
  EXPECT_THAT(StepsJson("exp", {5, 9}, {row}, /*truncated=*/false),
              HasSubstr("\"integrity_fault\":\"sum\",\"integrity_rank\":null,"));
}

TEST(JsonTest, RankMatrixMarksMissingNonFiniteAndDivergentRanks) {
  std::vector<StepRankRow> rows;
  for (uint32_t r : {0u, 1u, 2u}) {  // rank 3 of 4 is missing
    StepRankRow row;
    row.step = 7;
    row.row.rank = r;
    // Rank 2's stored row says non-finite; rank 0 is a pipeline stage without a loss (NULL,
    // read back as NaN), which is not non-finite: the verdict is the stored column's.
    row.row.loss = r == 1 ? 1.0 : std::nan("");
    row.nonfinite = r == 2;
    row.row.grad_norm = 1.0;
    row.row.grad_cosine = 0.5 + r * 0.125;
    row.row.outlier_score = r;
    if (r == 1) row.row.replica_ok = false;
    rows.push_back(row);
  }
  const std::string json = RanksJson("exp", {7, 7}, 4, rows, false);
  EXPECT_EQ(json,
            "{\"job\":\"exp\",\"first\":7,\"last\":7,\"truncated\":false,\"world_size\":4,"
            "\"steps\":[{\"step\":7,\"cosine\":[0.5,0.625,0.75,null],\"outlier\":[0,1,2,null],"
            "\"missing\":[3],\"nonfinite\":[2],\"divergent\":[1]}]}");
  // A rank beyond the stated world size widens the matrix and is not "missing".
  StepRankRow extra = rows[0];
  extra.row.rank = 5;
  rows.push_back(extra);
  EXPECT_THAT(RanksJson("exp", {7, 7}, 4, rows, false),
              HasSubstr("\"world_size\":6,\"steps\":[{\"step\":7,\"cosine\":[0.5,0.625,0.75,"
                        "null,null,0.5],"));
  EXPECT_THAT(RanksJson("exp", {7, 7}, 4, rows, false), HasSubstr("\"missing\":[3]"));
}

TEST(JsonTest, RankMatrixCarriesTheDownsampledWindows) {
  std::vector<RankWindowRow> windows;
  for (uint32_t r : {0u, 2u}) {  // rank 1 of 3 has no row in the window
    RankWindowRow w;
    w.first_step = 0;
    w.last_step = 99;
    w.rank = r;
    w.rows = 20;
    w.grad_cosine = {20, 18.0, 0.25 + r, 0.75};
    w.outlier_score = {20, 30.0, 0.5, 7.5 + r};
    w.nonfinite = r == 2 ? 1 : 0;
    w.replica_bad = r == 0 ? 3 : 0;
    windows.push_back(w);
  }
  const std::string json = RanksJson("exp", {0, 39}, 3, {}, false, 20, windows);
  EXPECT_THAT(json, HasSubstr("\"steps\":[],\"downsampled_before\":20,\"windows\":[{\"first\":0,"
                              "\"last\":99,\"cosine\":[0.25,null,2.25],\"outlier\":[7.5,null,9.5],"
                              "\"missing\":[1],\"nonfinite\":[2],\"divergent\":[0]}]}"));
  // Nothing downsampled: no such keys.
  EXPECT_THAT(RanksJson("exp", {0, 39}, 3, {}, false), Not(HasSubstr("downsampled")));
}

TEST(JsonTest, RankSeriesNonFiniteIsTheStoredColumn) {
  StepRankRow stage;  // a pipeline stage: no loss (NaN read back), nothing non-finite stored
  stage.step = 3;
  stage.row.rank = 0;
  stage.row.loss = std::nan("");
  stage.row.grad_norm = 1.0;
  StepRankRow bad = stage;  // finite values read back, but the stored verdict is non-finite
  bad.step = 4;
  bad.row.loss = 1.0;
  bad.nonfinite = true;
  const std::string json = RankSeriesJson("exp", {3, 4}, 0, {stage, bad}, false);
  EXPECT_THAT(json, HasSubstr("{\"step\":3,\"loss\":null,"));
  EXPECT_THAT(json, HasSubstr("\"step_time_z\":null,\"nonfinite\":false,"));
  EXPECT_THAT(json, HasSubstr("\"step_time_z\":null,\"nonfinite\":true,"));
}

// Where in the model: a flagged row's deviating buckets ride in the rank's series (the rank
// panel shows them); a row without them has no such key.
TEST(JsonTest, RankSeriesCarriesDeviatingBuckets) {
  StepRankRow plain;
  plain.step = 3;
  plain.row.rank = 2;
  plain.row.loss = 1.0;
  plain.row.grad_norm = 1.0;
  StepRankRow flagged = plain;
  flagged.step = 4;
  flagged.row.deviating_buckets = "layers.20-23.mlp z=45.1; \"x\" z=7.0";
  const std::string json = RankSeriesJson("exp", {3, 4}, 2, {plain, flagged}, false);
  EXPECT_THAT(json,
              HasSubstr("\"deviating_buckets\":\"layers.20-23.mlp z=45.1; \\\"x\\\" z=7.0\""));
  EXPECT_EQ(json.find("deviating_buckets"), json.rfind("deviating_buckets"));
}

// The rank panel's buckets: every bucket's z where kept, and the deviating ones named with
// their z, worst first (names from the hello; a bucket beyond them is "bucket B").
TEST(JsonTest, RankSeriesNamesTheDeviatingBucketsWithTheirZ) {
  StepRankRow row;
  row.step = 4;
  row.row.rank = 2;
  row.row.loss = 1.0;
  row.row.grad_norm = 1.0;
  row.row.bucket_z = {0.5f, 45.25f, -7.0f, 2.0f};
  const std::vector<std::string> names = {"embed", "layers.20-23.mlp", "\"head\""};
  const std::string json = RankSeriesJson("exp", {4, 4}, 2, {row}, false, &names);
  EXPECT_THAT(json, HasSubstr("\"bucket_names\":[\"embed\",\"layers.20-23.mlp\","
                              "\"\\\"head\\\"\"],\"bucket_z_threshold\":6}"));
  EXPECT_THAT(json, HasSubstr("\"bucket_z\":[0.5,45.25,-7,2],\"buckets\":["
                              "{\"bucket\":1,\"name\":\"layers.20-23.mlp\",\"z\":45.25},"
                              "{\"bucket\":2,\"name\":\"\\\"head\\\"\",\"z\":-7}]"));
  // Without names (a collector restarted before the job's hello): numbered.
  row.row.bucket_z = {0.5f, 2.0f, 3.0f, 9.5f};
  EXPECT_THAT(RankSeriesJson("exp", {4, 4}, 2, {row}, false, &names),
              HasSubstr("\"buckets\":[{\"bucket\":3,\"name\":\"bucket 3\",\"z\":9.5}]"));
  // A row without kept z has neither key.
  row.row.bucket_z.clear();
  EXPECT_THAT(RankSeriesJson("exp", {4, 4}, 2, {row}, false), Not(HasSubstr("\"buckets\"")));
}

TEST(JsonTest, RankSeriesHoldsOneRank) {
  std::vector<StepRankRow> rows;
  for (uint64_t step : {1u, 2u}) {
    for (uint32_t r : {0u, 1u}) {
      StepRankRow row;
      row.step = step;
      row.row.rank = r;
      row.row.loss = step * 10.0 + r;
      row.row.grad_norm = 1.0;
      rows.push_back(row);
    }
  }
  const std::string json = RankSeriesJson("exp", {1, 2}, 1, rows, false);
  EXPECT_THAT(json, HasSubstr("\"rank\":1,\"steps\":[{\"step\":1,\"loss\":11,"));
  EXPECT_THAT(json, HasSubstr("{\"step\":2,\"loss\":21,"));
  EXPECT_THAT(json, Not(HasSubstr("\"loss\":10,")));
}

TEST(JsonTest, JobsSplitGroupKeysAndCarryTheLatestStepsAlerts) {
  JobListEntry a;
  a.info.set_job("exp/tp1");
  a.info.set_state("active");
  a.info.set_world_size(4);
  a.latest = Step(7);
  a.latest->replica_divergent_ranks = {2};
  JobListEntry b;
  b.info.set_job("solo");
  b.info.set_state("idle");
  const std::string json = JobsJson({a, b});
  EXPECT_THAT(json, HasSubstr("{\"key\":\"exp/tp1\",\"job\":\"exp\",\"group\":\"tp1\","
                              "\"state\":\"active\",\"world_size\":4,"));
  EXPECT_THAT(json, HasSubstr("\"outlier_ranks\":[1],\"divergent_ranks\":[2],"));
  EXPECT_THAT(json, HasSubstr("{\"key\":\"solo\",\"job\":\"solo\",\"group\":\"\","));
  EXPECT_THAT(json, HasSubstr("\"latest\":null}"));
}

TEST(JsonTest, FleetJobsNameTheirCollectorAndTheShardsThatDidNotAnswer) {
  JobListEntry here;
  here.info.set_job("a");
  here.collector = "c0:50051";
  JobListEntry there;
  there.info.set_job("b");
  there.collector = "c1:50051";
  there.remote = true;
  const std::string json = JobsJson({here, there}, {"c2:50051"});
  EXPECT_THAT(json, HasSubstr("\"latest\":null,\"collector\":\"c0:50051\",\"remote\":false}"));
  EXPECT_THAT(json, HasSubstr("\"latest\":null,\"collector\":\"c1:50051\",\"remote\":true}"));
  EXPECT_THAT(json, HasSubstr("],\"unreachable\":[\"c2:50051\"]}"));
  // A lone collector's answer has neither.
  const std::string lone = JobsJson({JobListEntry()});
  EXPECT_THAT(lone, Not(HasSubstr("collector")));
  EXPECT_THAT(lone, Not(HasSubstr("unreachable")));
}

TEST(JsonTest, StringsAreEscaped) {
  std::string out;
  AppendJsonString("a\"b\\c\n\x01<", &out);
  EXPECT_EQ(out, "\"a\\\"b\\\\c\\n\\u0001\\u003c\"");
  EXPECT_EQ(ErrorJson(absl::NotFoundError("no job x")),
            "{\"error\":{\"code\":\"NOT_FOUND\",\"message\":\"no job x\"}}");
}

TEST(HttpStatusForTest, MapsQueryCodes) {
  EXPECT_EQ(HttpStatusFor(absl::InvalidArgumentError("")), 400);
  EXPECT_EQ(HttpStatusFor(absl::UnauthenticatedError("")), 401);
  EXPECT_EQ(HttpStatusFor(absl::PermissionDeniedError("")), 403);
  EXPECT_EQ(HttpStatusFor(absl::NotFoundError("")), 404);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError("")), 503);
  EXPECT_EQ(HttpStatusFor(absl::UnavailableError("")), 503);
  EXPECT_EQ(HttpStatusFor(absl::DeadlineExceededError("")), 504);
  EXPECT_EQ(HttpStatusFor(absl::InternalError("")), 500);
}

TEST(CheckBearerTokenTest, MissingWrongAndRight) {
  EXPECT_EQ(CheckBearerToken("", ""), TokenCheck::kOk);
  EXPECT_EQ(CheckBearerToken("Bearer anything", ""), TokenCheck::kOk);
  EXPECT_EQ(CheckBearerToken("", "s3cret"), TokenCheck::kMissing);
  EXPECT_EQ(CheckBearerToken("Basic s3cret", "s3cret"), TokenCheck::kMissing);
  EXPECT_EQ(CheckBearerToken("Bearer s3cre", "s3cret"), TokenCheck::kWrong);
  EXPECT_EQ(CheckBearerToken("Bearer s3cret!", "s3cret"), TokenCheck::kWrong);
  EXPECT_EQ(CheckBearerToken("Bearer ", "s3cret"), TokenCheck::kWrong);
  EXPECT_EQ(CheckBearerToken("Bearer s3cret", "s3cret"), TokenCheck::kOk);
}

}  // namespace
}  // namespace rankscope::collector
