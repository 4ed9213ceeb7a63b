// The web view's HTTP server and JSON API against a real collector (HTTP and gRPC on port 0, a
// real SQLite file): Query's bad-input treatment over HTTP (bad names 400, unknown jobs 404,
// huge ranges capped, first > last 400, token 401/403), the embedded pages, and reads that go
// through the StoreReaderPool (a full pool queue answers 503 at once).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "collector/collector.h"
#include "collector/query/query_checks.h"
#include "collector/store/sqlite_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace rankscope::collector {
namespace {

using ::rankscope::testing::Http;
using ::rankscope::testing::HttpResponse;
using ::testing::HasSubstr;
using ::testing::Not;

// More steps than one steps answer may hold (kStepRangeDefaultLimit).
constexpr uint64_t kSteps = kStepRangeDefaultLimit + 50;
constexpr uint32_t kWorld = 2;

size_t CountSteps(const std::string& json) {
  size_t count = 0;
  for (size_t at = json.find("{\"step\":"); at != std::string::npos;
       at = json.find("{\"step\":", at + 1)) {
    ++count;
  }
  return count;
}

void FillDatabase(const std::string& path) {
  auto store = SqliteStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  StoreBatch batch;
  JobRow job;
  job.job = "stored";
  job.world_size = kWorld;
  job.sketch_dim = 64;
  job.last_step = kSteps;
  batch.jobs.push_back(job);
  JobRow group = job;
  group.job = "stored/tp1";
  group.last_step = 3;
  batch.jobs.push_back(group);
  for (uint64_t step = 1; step <= kSteps; ++step) {
    StepWrite write;
    write.job = "stored";
    write.step = step;
    StepRow stats;
    stats.step = step;
    stats.ranks = kWorld;
    stats.world_size = kWorld;
    stats.loss_mean = static_cast<double>(step);
    write.stats = stats;
    for (uint32_t r = 0; r < kWorld; ++r) {
      RankRow row;
      row.rank = r;
      row.join_size = kWorld;
      row.loss = step + 0.25 * r;
      row.grad_norm = 1.0;
      row.grad_cosine = 0.5;
      write.ranks.push_back(row);
    }
    batch.steps.push_back(std::move(write));
  }
  ASSERT_TRUE((*store)->Write(batch).ok());
}

class WebServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::MakeTempDir() + "/rankscope.db";
    FillDatabase(path_);
  }

  std::unique_ptr<Collector> Start(std::string token = "", size_t query_threads = 2,
                                   size_t max_queued = 256) {
    CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.http_address = "127.0.0.1:0";
    o.db_path = path_;
    o.query_threads = query_threads;
    o.max_queued_queries = max_queued;
    o.pipeline.auth_token = std::move(token);
    auto c = Collector::Start(o);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return nullptr;
    EXPECT_GT((*c)->http_port(), 0);
    return *std::move(c);
  }

  std::string path_;
};

TEST_F(WebServerTest, ServesThePagesAndAssetsBuiltIntoTheBinary) {
  auto c = Start();
  ASSERT_NE(c, nullptr);
  for (const char* page : {"/", "/job/stored", "/job/stored?group=tp1"}) {
    HttpResponse r = Http(c->http_port(), "GET", page);
    EXPECT_EQ(r.status, 200) << page;
    EXPECT_THAT(r.headers, HasSubstr("content-type: text/html")) << page;
    EXPECT_THAT(r.body, HasSubstr("/static/app.js")) << page;
  }
  HttpResponse js = Http(c->http_port(), "GET", "/static/app.js");
  EXPECT_EQ(js.status, 200);
  EXPECT_THAT(js.headers, HasSubstr("content-type: text/javascript"));
  EXPECT_THAT(js.body, HasSubstr("/api/v1"));
  EXPECT_EQ(Http(c->http_port(), "GET", "/static/style.css").status, 200);
  EXPECT_EQ(Http(c->http_port(), "GET", "/static/nope.js").status, 404);
  EXPECT_EQ(Http(c->http_port(), "GET", "/static/../collector.cc").status, 404);
  EXPECT_EQ(Http(c->http_port(), "GET", "/etc/passwd").status, 404);
  HttpResponse post = Http(c->http_port(), "POST", "/api/v1/jobs");
  EXPECT_EQ(post.status, 405);
  EXPECT_THAT(post.headers, HasSubstr("allow: get, head"));
  HttpResponse head = Http(c->http_port(), "HEAD", "/api/v1/jobs");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");
}

TEST_F(WebServerTest, ListsJobsAndGroups) {
  auto c = Start();
  ASSERT_NE(c, nullptr);
  HttpResponse r = Http(c->http_port(), "GET", "/api/v1/jobs");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_THAT(r.headers, HasSubstr("content-type: application/json"));
  EXPECT_THAT(r.body, HasSubstr("{\"key\":\"stored\",\"job\":\"stored\",\"group\":\"\","));
  EXPECT_THAT(r.body, HasSubstr("{\"key\":\"stored/tp1\",\"job\":\"stored\",\"group\":\"tp1\","));
  EXPECT_THAT(r.body, HasSubstr(absl::StrCat("\"last_step\":", kSteps)));
  EXPECT_THAT(r.body, HasSubstr(absl::StrCat("\"latest\":{\"step\":", kSteps, ",")));
}

TEST_F(WebServerTest, BadInputGetsQuerysTreatment) {
  auto c = Start();
  ASSERT_NE(c, nullptr);
  const int port = c->http_port();
  struct Case {
    std::string target;
    int status;
    std::string says;
  };
  const std::string long_name(300, 'x');
  const std::vector<Case> cases = {
      {"/api/v1/jobs/bad%20name/steps", 400, "job must be 1-128 characters"},
      {"/api/v1/jobs/a/b/c/steps", 400, "job must be"},
      {absl::StrCat("/api/v1/jobs/", long_name, "/steps"), 400, "(got 300 bytes)"},
      {"/api/v1/jobs/%3Cscript%3E/ranks", 400, "job must be"},
      {"/api/v1/jobs/unknown/steps", 404, "no job unknown"},
      {"/api/v1/jobs/stored/tp9/ranks", 404, "no job stored/tp9"},
      {"/api/v1/jobs/stored/other", 404, "no such API path"},
      {"/api/v1/nothing", 404, "no such API path"},
      {"/api/v1/jobs/stored/steps?first=10&last=9", 400, "first_step 10 > last_step 9"},
      {"/api/v1/jobs/stored/steps?first=ten", 400, "first must be a step"},
      {"/api/v1/jobs/stored/steps?last=-1", 400, "last must be a step"},
      {"/api/v1/jobs/stored/steps?first=9223372036854775808", 400, "first must be a step"},
      {"/api/v1/jobs/stored/ranks?rank=x", 400, "rank must be"},
      {"/api/v1/jobs/stored/steps?limit=1000000000", 400, "unknown parameter"},
      {absl::StrCat("/api/v1/jobs/stored/steps?first=1&pad=", std::string(2000, 'p')), 400,
       "query string too long"},
  };
  for (const Case& t : cases) {
    HttpResponse r = Http(port, "GET", t.target);
    EXPECT_EQ(r.status, t.status) << t.target << ": " << r.body;
    // The JSON escapes '>' as \u003e; compare against the message as the client decodes it.
    std::string body = r.body;
    for (size_t at; (at = body.find("\\u003e")) != std::string::npos;) body.replace(at, 6, ">");
    EXPECT_THAT(body, HasSubstr(t.says)) << t.target;
    EXPECT_THAT(r.body, HasSubstr("{\"error\":{\"code\":")) << t.target;
    EXPECT_THAT(r.body, Not(HasSubstr(long_name))) << t.target;
    EXPECT_THAT(r.body, Not(HasSubstr("<script>"))) << t.target;
  }
}

TEST_F(WebServerTest, HugeRangesAreCappedAndSaySo) {
  auto c = Start();
  ASSERT_NE(c, nullptr);
  const int port = c->http_port();
  // All of a job's steps (more than one answer holds): the first kStepRangeDefaultLimit.
  HttpResponse all =
      Http(port, "GET", "/api/v1/jobs/stored/steps?first=0&last=9223372036854775807");
  ASSERT_EQ(all.status, 200) << all.body.substr(0, 300);
  EXPECT_THAT(all.body, HasSubstr("\"first\":0,\"last\":9223372036854775807,\"truncated\":true"));
  EXPECT_EQ(CountSteps(all.body), static_cast<size_t>(kStepRangeDefaultLimit));
  EXPECT_THAT(all.body, HasSubstr(absl::StrCat("{\"step\":", kStepRangeDefaultLimit, ",")));
  EXPECT_THAT(all.body,
              Not(HasSubstr(absl::StrCat("{\"step\":", kStepRangeDefaultLimit + 1, ","))));
  // A range within the limit is whole.
  HttpResponse some = Http(port, "GET", "/api/v1/jobs/stored/steps?first=10&last=19");
  ASSERT_EQ(some.status, 200);
  EXPECT_THAT(some.body, HasSubstr("\"truncated\":false"));
  EXPECT_EQ(CountSteps(some.body), 10u);
  // Defaults: the newest window of steps and of ranks.
  HttpResponse newest = Http(port, "GET", "/api/v1/jobs/stored/steps");
  EXPECT_THAT(newest.body, HasSubstr(absl::StrCat("\"first\":", kSteps - 299, ",\"last\":", kSteps,
                                                  ",\"truncated\":false")));
  EXPECT_EQ(CountSteps(newest.body), 300u);
  HttpResponse ranks = Http(port, "GET", "/api/v1/jobs/stored/ranks");
  ASSERT_EQ(ranks.status, 200);
  EXPECT_EQ(CountSteps(ranks.body), 120u);
  EXPECT_THAT(ranks.body, HasSubstr("\"world_size\":2,"));
  EXPECT_THAT(ranks.body, HasSubstr("\"cosine\":[0.5,0.5],"));
  // Only the steps after `since`: what a page that holds step kSteps - 3 reads on a refresh.
  for (const char* route : {"steps", "ranks"}) {
    HttpResponse newer =
        Http(port, "GET", absl::StrCat("/api/v1/jobs/stored/", route, "?since=", kSteps - 3));
    ASSERT_EQ(newer.status, 200) << route << ": " << newer.body.substr(0, 300);
    EXPECT_EQ(CountSteps(newer.body), 3u) << route;
    EXPECT_THAT(newer.body, HasSubstr(absl::StrCat("{\"step\":", kSteps - 2, ","))) << route;
    HttpResponse none =
        Http(port, "GET", absl::StrCat("/api/v1/jobs/stored/", route, "?since=", kSteps));
    ASSERT_EQ(none.status, 200) << route;
    EXPECT_EQ(CountSteps(none.body), 0u) << route;
  }
  EXPECT_EQ(Http(port, "GET", "/api/v1/jobs/stored/ranks?since=3&first=1").status, 400);
  // One rank's series.
  HttpResponse one = Http(port, "GET", "/api/v1/jobs/stored/ranks?rank=1&first=5&last=6");
  ASSERT_EQ(one.status, 200);
  EXPECT_THAT(one.body, HasSubstr("\"rank\":1,\"steps\":[{\"step\":5,\"loss\":5.25,"));
  EXPECT_EQ(CountSteps(one.body), 2u);
  // The group key, its slash literal or encoded.
  for (const char* target : {"/api/v1/jobs/stored/tp1/steps", "/api/v1/jobs/stored%2Ftp1/steps"}) {
    HttpResponse g = Http(port, "GET", target);
    EXPECT_EQ(g.status, 200) << target << ": " << g.body;
    EXPECT_THAT(g.body, HasSubstr("\"job\":\"stored/tp1\"")) << target;
  }
}

TEST_F(WebServerTest, TheQueryTokenGuardsTheApi) {
  auto c = Start("s3cret");
  ASSERT_NE(c, nullptr);
  const int port = c->http_port();
  HttpResponse missing = Http(port, "GET", "/api/v1/jobs");
  EXPECT_EQ(missing.status, 401);
  EXPECT_THAT(missing.headers, HasSubstr("www-authenticate: bearer"));
  EXPECT_THAT(missing.body, Not(HasSubstr("stored")));
  HttpResponse wrong =
      Http(port, "GET", "/api/v1/jobs/stored/steps", "Authorization: Bearer no\r\n");
  EXPECT_EQ(wrong.status, 403);
  EXPECT_THAT(wrong.body, HasSubstr("wrong auth token"));
  // The token is checked before anything else: a bad name without it is still 401.
  EXPECT_EQ(Http(port, "GET", "/api/v1/jobs/bad%20name/steps").status, 401);
  HttpResponse right = Http(port, "GET", "/api/v1/jobs", "Authorization: Bearer s3cret\r\n");
  EXPECT_EQ(right.status, 200);
  EXPECT_THAT(right.body, HasSubstr("\"key\":\"stored\""));
  // The pages hold no data and are served without it (the page asks for the token).
  EXPECT_EQ(Http(port, "GET", "/").status, 200);
}

TEST_F(WebServerTest, ReadsGoThroughTheReaderPoolAndAFullQueueAnswers503) {
  auto c = Start("", /*query_threads=*/1, /*max_queued=*/1);
  ASSERT_NE(c, nullptr);
  // Hold the pool's only thread, then fill its queue of one.
  absl::Notification running, release;
  ASSERT_TRUE(c->query_readers()
                  .Submit([&](SqliteStore&) {
                    running.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  running.WaitForNotification();
  ASSERT_TRUE(c->query_readers().Submit([](SqliteStore&) {}).ok());
  HttpResponse busy = Http(c->http_port(), "GET", "/api/v1/jobs");
  EXPECT_EQ(busy.status, 503);
  EXPECT_THAT(busy.headers, HasSubstr("retry-after: 1"));
  EXPECT_THAT(busy.body, HasSubstr("RESOURCE_EXHAUSTED"));
  // Pages need no read and are still served.
  EXPECT_EQ(Http(c->http_port(), "GET", "/").status, 200);
  release.Notify();
  EXPECT_TRUE(
      testing::WaitFor([&] { return Http(c->http_port(), "GET", "/api/v1/jobs").status == 200; }));
}

TEST_F(WebServerTest, AnAddressInUseFailsTheStartNamingTheFlag) {
  auto first = Start();
  ASSERT_NE(first, nullptr);
  CollectorOptions o;
  o.grpc_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.http_address = absl::StrCat("127.0.0.1:", first->http_port());
  o.db_path = testing::MakeTempDir() + "/other.db";
  auto second = Collector::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("--http_address"));
  // The first one still serves.
  EXPECT_EQ(Http(first->http_port(), "GET", "/api/v1/jobs").status, 200);
}

}  // namespace
}  // namespace rankscope::collector
