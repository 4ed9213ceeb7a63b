// Bad input (DESIGN.md "Delivery and failure semantics"), end to end: a real in-process collector
// on port 0 with a real SQLite file, driven over loopback through grpc::GenericStub, so that any
// bytes can be sent, well-formed or not.
//
// For every case: the exact gRPC status code (or Rejection code) and an actionable message; a
// healthy stream of another job, open throughout, keeps being served (its next report is acked
// and stored); and nothing stored changed (every row of every table outside the healthy job,
// before and after, compared as text). The outcomes are tabulated in docs/reliability_cases.md.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sqlite3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "rankscope/v1/rankscope.pb.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

using collector::Collector;
using collector::CollectorOptions;
using ::rankscope::Agent;
using ::rankscope::AgentOptions;
using ::rankscope::StepReport;
using ::testing::HasSubstr;

constexpr char kMethod[] = "/rankscope.v1.Ingest/Stream";
constexpr uint32_t kDim = 4;
constexpr int kMaxMessageBytes = 64 << 10;

// One Ingest.Stream call carrying raw bytes, driven synchronously over its own completion queue
// (every operation waits for its own completion, with a deadline).
class RawStream {
 public:
  RawStream(grpc::GenericStub* stub) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    call_ = stub->PrepareCall(&ctx_, kMethod, &cq_);
    call_->StartCall(this);
    Wait();
  }
  ~RawStream() {
    if (!finished_) {
      ctx_.TryCancel();
      Finish();
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // Writes one message (one gRPC frame) holding exactly `bytes`. False once the call is over.
  bool WriteBytes(const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    call_->Write(buffer, this);
    return Wait();
  }
  bool Write(const v1::AgentMessage& msg) { return WriteBytes(msg.SerializeAsString()); }

  // Half-closes the call: the agent will send nothing more.
  bool WritesDone() {
    call_->WritesDone(this);
    return Wait();
  }

  // Reads the next message from the collector. False at the end of the stream.
  bool Read(v1::CollectorMessage* msg) {
    grpc::ByteBuffer buffer;
    call_->Read(&buffer, this);
    if (!Wait()) return false;
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(buffer.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& s : slices) bytes.append(s.begin(), s.end());
    return msg->ParseFromString(bytes);
  }

  // Reads until an Ack holding `seq` (true) or a Rejection of it (false, *rejection set), or the
  // end of the stream (false).
  bool AwaitAck(uint64_t seq, v1::Rejection* rejection = nullptr) {
    v1::CollectorMessage msg;
    while (Read(&msg)) {
      if (msg.has_ack()) {
        for (uint64_t s : msg.ack().seqs()) {
          if (s == seq) return true;
        }
      }
      if (msg.has_rejection() && msg.rejection().seq() == seq) {
        if (rejection != nullptr) *rejection = msg.rejection();
        return false;
      }
    }
    return false;
  }

  // The call's status: reads what is left, then Finish.
  grpc::Status Finish() {
    if (finished_) return status_;
    v1::CollectorMessage ignored;
    while (Read(&ignored)) {
    }
    call_->Finish(&status_, this);
    Wait();
    finished_ = true;
    return status_;
  }

  // The status the collector ends the call with after `bytes` (and nothing else) was sent.
  grpc::Status SendAndFinish(const std::vector<std::string>& messages) {
    for (const std::string& m : messages) {
      if (!WriteBytes(m)) break;
    }
    return Finish();
  }

 private:
  bool Wait() {
    void* tag = nullptr;
    bool ok = false;
    const auto status =
        cq_.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + std::chrono::seconds(60));
    EXPECT_EQ(status, grpc::CompletionQueue::GOT_EVENT) << "a gRPC operation never completed";
    return status == grpc::CompletionQueue::GOT_EVENT && ok;
  }

  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  grpc::Status status_;
  bool finished_ = false;
};

v1::AgentMessage Hello(const std::string& job, uint32_t rank, uint32_t world, uint32_t dim = kDim,
                       const std::string& host = "host-a", uint32_t attempt = 0) {
  v1::AgentMessage m;
  v1::Hello* h = m.mutable_hello();
  h->set_job(job);
  h->set_rank(rank);
  h->set_world_size(world);
  h->set_sketch_dim(dim);
  h->set_sketch_seed(7);
  h->set_host(host);
  h->set_attempt(attempt);
  return m;
}

v1::AgentMessage Report(uint64_t seq, uint64_t step, size_t sketch_values = kDim, double loss = 2.5,
                        double grad_norm = 1.25) {
  v1::AgentMessage m;
  v1::StepReport* r = m.mutable_report();
  r->set_seq(seq);
  r->set_step(step);
  r->set_loss(loss);
  r->set_grad_norm(grad_norm);
  for (size_t i = 0; i < sketch_values; ++i) r->add_sketch(0.5f + static_cast<float>(i));
  return m;
}

std::string Bytes(const v1::AgentMessage& m) { return m.SerializeAsString(); }

// One collector for the whole suite (every case uses its own job): the healthy stream is served
// across all of them.
class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeTempDir());
    CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "127.0.0.1:0";
    o.db_path = *dir_ + "/rankscope.db";
    o.pipeline.joiner.step_timeout = absl::Seconds(300);  // no step closes by itself mid-suite
    o.max_message_bytes = kMaxMessageBytes;
    auto c = Collector::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    collector_ = c->release();
    stub_ = new grpc::GenericStub(
        grpc::CreateChannel(collector_->grpc_target(), grpc::InsecureChannelCredentials()));
    // The healthy job: one rank, so each report completes (and stores) its step at once.
    healthy_ = new RawStream(stub_);
    ASSERT_TRUE(healthy_->Write(Hello("healthy", 0, 1)));
  }

  static void TearDownTestSuite() {
    delete healthy_;
    healthy_ = nullptr;
    if (collector_ != nullptr) EXPECT_TRUE(collector_->Shutdown(absl::Seconds(10)).ok());
    delete collector_;
    collector_ = nullptr;
    delete stub_;
    stub_ = nullptr;
    delete dir_;
    dir_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(collector_, nullptr);
    ExpectHealthyServed();
  }

  // The healthy stream's next report is acked, and its row is in SQLite.
  void ExpectHealthyServed() {
    ++healthy_step_;
    ASSERT_TRUE(healthy_->Write(Report(healthy_step_, healthy_step_)));
    ASSERT_TRUE(healthy_->AwaitAck(healthy_step_)) << "healthy stream not served";
    EXPECT_EQ(Query(absl::StrCat("SELECT COUNT(*) FROM rank_steps WHERE job = 'healthy' AND "
                                 "step = ",
                                 healthy_step_)),
              "1");
  }

  // Every row of every table outside the healthy job, as text, once the collector has committed
  // everything it holds.
  std::string Snapshot() {
    EXPECT_TRUE(collector_->Flush(absl::Seconds(30)));
    std::string out;
    for (const char* table : {"jobs", "rank_steps", "step_stats"}) {
      absl::StrAppend(
          &out, table, ":\n",
          Query(absl::StrCat("SELECT * FROM ", table, " WHERE job != 'healthy' ORDER BY 1, 2, 3")));
    }
    return out;
  }

  // Rows of `sql` on a fresh read-only connection: columns joined by '|', rows by '\n'.
  std::string Query(const std::string& sql) {
    sqlite3* db = nullptr;
    EXPECT_EQ(
        sqlite3_open_v2((*dir_ + "/rankscope.db").c_str(), &db, SQLITE_OPEN_READONLY, nullptr),
        SQLITE_OK);
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK)
        << sqlite3_errmsg(db);
    std::string out;
    while (sqlite3_step(stmt) == SQLITE_ROW) {
      for (int i = 0; i < sqlite3_column_count(stmt); ++i) {
        const unsigned char* text = sqlite3_column_text(stmt, i);
        absl::StrAppend(&out, i == 0 ? "" : "|",
                        text == nullptr ? "NULL" : reinterpret_cast<const char*>(text));
      }
      out += "\n";
    }
    sqlite3_finalize(stmt);
    sqlite3_close(db);
    if (!out.empty()) out.pop_back();
    return out;
  }

  double Metric(const std::string& name, const std::string& labels = "") {
    const std::string text = testing::HttpGet(collector_->metrics_port(), "/metrics");
    const std::string prefix = labels.empty() ? name + " " : absl::StrCat(name, "{", labels, "} ");
    for (size_t pos = 0; (pos = text.find(prefix, pos)) != std::string::npos; ++pos) {
      if (pos == 0 || text[pos - 1] == '\n') {
        return std::stod(text.substr(pos + prefix.size()));
      }
    }
    return -1;
  }

  // Runs `bad`, which returns the status the collector answered with; checks the code, the
  // message, that nothing stored changed and that the healthy stream is still served.
  template <typename Fn>
  void ExpectRefused(Fn bad, grpc::StatusCode code, const std::string& message_part) {
    const std::string before = Snapshot();
    const grpc::Status status = bad();
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(message_part));
    EXPECT_EQ(Snapshot(), before) << "a refused input changed what is stored";
    ExpectHealthyServed();
  }

  grpc::Status Stream(const std::vector<std::string>& messages) {
    RawStream s(stub_);
    return s.SendAndFinish(messages);
  }

  static std::string* dir_;
  static Collector* collector_;
  static grpc::GenericStub* stub_;
  static RawStream* healthy_;
  static uint64_t healthy_step_;
};

std::string* BadInputTest::dir_ = nullptr;
Collector* BadInputTest::collector_ = nullptr;
grpc::GenericStub* BadInputTest::stub_ = nullptr;
RawStream* BadInputTest::healthy_ = nullptr;
uint64_t BadInputTest::healthy_step_ = 0;

TEST_F(BadInputTest, NonFiniteValuesAreStoredAsSuchAndFlagged) {
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("nonfinite", 0, 1)));
  v1::AgentMessage nan = Report(1, 1, kDim, std::nan(""), std::numeric_limits<double>::infinity());
  nan.mutable_report()->set_sketch(0, std::nanf(""));
  ASSERT_TRUE(s.Write(nan));
  ASSERT_TRUE(s.AwaitAck(1));
  ASSERT_TRUE(s.Write(Report(2, 2, kDim, -std::numeric_limits<double>::infinity(), 1.0)));
  ASSERT_TRUE(s.AwaitAck(2));
  // NaN is NULL in SQLite (its own rule), +/-Inf are REAL infinities; both flagged nonfinite.
  EXPECT_EQ(Query("SELECT step, loss, grad_norm, nonfinite FROM rank_steps WHERE job = "
                  "'nonfinite' ORDER BY step"),
            "1|NULL|Inf|1\n2|-Inf|1.0|1");
  EXPECT_EQ(Metric("rankscope_steps_nonfinite_total", "train_job=\"nonfinite\""), 2);
  ExpectHealthyServed();
}

TEST_F(BadInputTest, RankAtOrAboveWorldSizeIsInvalidArgument) {
  ExpectRefused([&] { return Stream({Bytes(Hello("exp-42", 8, 8))}); },
                grpc::StatusCode::INVALID_ARGUMENT, "rank 8 >= world_size 8 for job exp-42");
}

TEST_F(BadInputTest, BadHelloFieldsAreInvalidArgument) {
  ExpectRefused([&] { return Stream({Bytes(Hello("bad job name!", 0, 1))}); },
                grpc::StatusCode::INVALID_ARGUMENT, "job name must be 1-128 characters");
  ExpectRefused([&] { return Stream({Bytes(Hello("zero-world", 0, 0))}); },
                grpc::StatusCode::INVALID_ARGUMENT, "world_size 0 must be in [1, 1000000]");
  ExpectRefused([&] { return Stream({Bytes(Hello("zero-dim", 0, 1, 0))}); },
                grpc::StatusCode::INVALID_ARGUMENT, "sketch_dim 0 must be in [1, 1048576]");
}

TEST_F(BadInputTest, WorldSizeOrSketchChangingMidJobIsFailedPrecondition) {
  RawStream first(stub_);
  ASSERT_TRUE(first.Write(Hello("shape", 0, 2)));
  ExpectHealthyServed();  // the hello above is accepted and its job row stored by now
  ExpectRefused([&] { return Stream({Bytes(Hello("shape", 1, 4))}); },
                grpc::StatusCode::FAILED_PRECONDITION,
                "world_size 4 != 2 for job shape: a job's world size is fixed");
  ExpectRefused([&] { return Stream({Bytes(Hello("shape", 1, 2, 8))}); },
                grpc::StatusCode::FAILED_PRECONDITION,
                "sketch (dim 8, seed 7) differs from job shape's (dim 4, seed 7)");
}

TEST_F(BadInputTest, ReportRejectionsKeepTheStreamOpen) {
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("sketch-len", 0, 1)));
  ASSERT_TRUE(s.Write(Report(1, 1)));
  ASSERT_TRUE(s.AwaitAck(1));
  const std::string before = Snapshot();
  v1::Rejection rejection;
  ASSERT_TRUE(s.Write(Report(2, 2, kDim - 1)));
  ASSERT_FALSE(s.AwaitAck(2, &rejection));
  EXPECT_EQ(rejection.code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(rejection.message(), "sketch of step 2 has 3 values, job sketch-len uses sketch_dim 4");
  ASSERT_TRUE(s.Write(Report(3, uint64_t{1} << 63)));
  ASSERT_FALSE(s.AwaitAck(3, &rejection));
  EXPECT_EQ(rejection.code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(rejection.message(), "step 9223372036854775808 of job sketch-len exceeds 2^63-1");
  EXPECT_EQ(Snapshot(), before);
  // The same stream goes on.
  ASSERT_TRUE(s.Write(Report(4, 4)));
  ASSERT_TRUE(s.AwaitAck(4));
  EXPECT_EQ(Metric("rankscope_reports_rejected_total", "reason=\"sketch_length\""), 1);
  ExpectHealthyServed();
}

TEST_F(BadInputTest, OversizedMessagesAreResourceExhausted) {
  // As a first message (a hello with a huge job name) and after a good start.
  v1::AgentMessage huge_hello = Hello(std::string(kMaxMessageBytes + 1, 'j'), 0, 1);
  ExpectRefused([&] { return Stream({Bytes(huge_hello)}); }, grpc::StatusCode::RESOURCE_EXHAUSTED,
                "bytes, more than the collector's --max_message_bytes 65536");
  EXPECT_EQ(Metric("rankscope_reports_rejected_total", "reason=\"message_too_large\""), 1);
  // Grossly oversized: gRPC refuses it at its own limit (2x), before buffering it.
  v1::AgentMessage giant_hello = Hello(std::string(3 * kMaxMessageBytes, 'j'), 0, 1);
  ExpectRefused([&] { return Stream({Bytes(giant_hello)}); }, grpc::StatusCode::RESOURCE_EXHAUSTED,
                "Received message larger than max");
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("oversized", 0, 1)));
  ASSERT_TRUE(s.Write(Report(1, 1)));
  ASSERT_TRUE(s.AwaitAck(1));
  ExpectRefused(
      [&] {
        s.Write(Report(2, 2, kMaxMessageBytes / 4 + 16));
        return s.Finish();
      },
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      "bytes, more than the collector's --max_message_bytes 65536 (a report carries 4 bytes per "
      "sketch value): lower the agents' sketch_dim or raise --max_message_bytes");
}

TEST_F(BadInputTest, UnknownFieldsAreIgnoredForwardCompatibly) {
  v1::AgentMessage hello = Hello("unknown-fields", 0, 1);
  hello.GetReflection()->MutableUnknownFields(&hello)->AddVarint(99, 1);
  hello.mutable_hello()
      ->GetReflection()
      ->MutableUnknownFields(hello.mutable_hello())
      ->AddVarint(98, 2);
  v1::AgentMessage report = Report(1, 1);
  report.mutable_report()
      ->GetReflection()
      ->MutableUnknownFields(report.mutable_report())
      ->AddLengthDelimited(97, "from a newer agent");
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(hello));
  ASSERT_TRUE(s.Write(report));
  ASSERT_TRUE(s.AwaitAck(1)) << "a report with unknown fields must be accepted";
  EXPECT_EQ(Query("SELECT step, rank, loss FROM rank_steps WHERE job = 'unknown-fields'"),
            "1|0|2.5");
  ExpectHealthyServed();
}

TEST_F(BadInputTest, ReportBeforeHelloIsFailedPrecondition) {
  ExpectRefused([&] { return Stream({Bytes(Report(1, 1))}); },
                grpc::StatusCode::FAILED_PRECONDITION,
                "the first message of a stream must be a Hello");
  ExpectRefused([&] { return Stream({Bytes(v1::AgentMessage())}); },
                grpc::StatusCode::FAILED_PRECONDITION,
                "the first message of a stream must be a Hello");
}

TEST_F(BadInputTest, SecondHelloOrEmptyMessageEndsTheStream) {
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("two-hellos", 0, 1)));
  ASSERT_TRUE(s.Write(Report(1, 1)));
  ASSERT_TRUE(s.AwaitAck(1));
  ExpectRefused(
      [&] {
        s.Write(Hello("two-hellos", 0, 1));
        return s.Finish();
      },
      grpc::StatusCode::FAILED_PRECONDITION, "a stream sends exactly one Hello");
  RawStream t(stub_);
  ASSERT_TRUE(t.Write(Hello("two-hellos", 0, 1)));
  ASSERT_TRUE(t.Write(Report(2, 2)));
  ASSERT_TRUE(t.AwaitAck(2));
  ExpectRefused(
      [&] {
        t.Write(v1::AgentMessage());
        return t.Finish();
      },
      grpc::StatusCode::FAILED_PRECONDITION, "empty AgentMessage");
}

TEST_F(BadInputTest, RandomAndTruncatedBytesAreRefused) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 8; ++trial) {
    std::string garbage(64 + trial * 40, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    SCOPED_TRACE(absl::StrCat("random bytes, trial ", trial));
    const std::string before = Snapshot();
    const grpc::Status status = Stream({garbage});
    EXPECT_FALSE(status.ok()) << "random bytes answered with OK";
    EXPECT_EQ(Snapshot(), before);
  }
  ExpectHealthyServed();

  const std::string hello = Bytes(Hello("truncated", 0, 1));
  ExpectRefused([&] { return Stream({hello.substr(0, hello.size() - 3)}); },
                grpc::StatusCode::INVALID_ARGUMENT, "could not be parsed");
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("truncated", 0, 1)));
  ASSERT_TRUE(s.Write(Report(1, 1)));
  ASSERT_TRUE(s.AwaitAck(1));
  const std::string report = Bytes(Report(2, 2));
  ExpectRefused(
      [&] {
        s.WriteBytes(report.substr(0, report.size() / 2));
        return s.Finish();
      },
      grpc::StatusCode::INVALID_ARGUMENT, "could not be parsed");
}

TEST_F(BadInputTest, ARankConnectedFromAnotherHostWithTheSameAttemptIsAlreadyExists) {
  RawStream owner(stub_);
  ASSERT_TRUE(owner.Write(Hello("claimed", 0, 1, kDim, "host-a")));
  ASSERT_TRUE(owner.Write(Report(1, 1)));
  ASSERT_TRUE(owner.AwaitAck(1));
  ExpectRefused([&] { return Stream({Bytes(Hello("claimed", 0, 1, kDim, "host-b"))}); },
                grpc::StatusCode::ALREADY_EXISTS,
                "rank 0 of job claimed (attempt 0) is held by a live stream from host 'host-a' "
                "pid 0 (instance ''); this hello from host 'host-b' pid 0 claims it too");
  EXPECT_EQ(Metric("rankscope_reports_rejected_total", "reason=\"rank_taken\""), 1);
  // The same host (a reconnect the collector has not noticed yet) is accepted ...
  RawStream reconnect(stub_);
  ASSERT_TRUE(reconnect.Write(Hello("claimed", 0, 1, kDim, "host-a")));
  ASSERT_TRUE(reconnect.Write(Report(2, 2)));
  ASSERT_TRUE(reconnect.AwaitAck(2));
  // ... and so is a restart (a higher attempt) from anywhere.
  RawStream restarted(stub_);
  ASSERT_TRUE(restarted.Write(Hello("claimed", 0, 1, kDim, "host-b", 1)));
  ASSERT_TRUE(restarted.Write(Report(3, 3)));
  ASSERT_TRUE(restarted.AwaitAck(3));
  // ... but a takeover while the old attempt is still connected is counted (and logged): without
  // a token or mutual TLS anyone may announce a restart (issue 12.10).
  EXPECT_EQ(Metric("rankscope_attempt_takeovers_total"), 1);
  ExpectHealthyServed();
}

// Issue 12.8a: a NaN or Inf in the sketch alone (loss and grad_norm finite) flags the row.
TEST_F(BadInputTest, ANonFiniteSketchValueAloneFlagsTheRow) {
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("nonfinite-sketch", 0, 1)));
  v1::AgentMessage nan = Report(1, 1);
  nan.mutable_report()->set_sketch(2, std::nanf(""));
  v1::AgentMessage inf = Report(2, 2);
  inf.mutable_report()->set_sketch(0, -std::numeric_limits<float>::infinity());
  ASSERT_TRUE(s.Write(nan));
  ASSERT_TRUE(s.Write(inf));
  ASSERT_TRUE(s.Write(Report(3, 3)));
  ASSERT_TRUE(s.AwaitAck(3));
  EXPECT_EQ(Query("SELECT step, loss, nonfinite FROM rank_steps WHERE job = "
                  "'nonfinite-sketch' ORDER BY step"),
            "1|2.5|1\n2|2.5|1\n3|2.5|0");
}

// Issue 12.4: the hello's free-text fields are bounded; the refusal gives the length, not the
// bytes.
TEST_F(BadInputTest, OverlongHelloTextFieldsAreInvalidArgument) {
  v1::AgentMessage host = Hello("long-host", 0, 1, kDim, std::string(256, 'h'));
  ExpectRefused([&] { return Stream({Bytes(host)}); }, grpc::StatusCode::INVALID_ARGUMENT,
                "hello field host has 256 bytes, more than 255 for job long-host");
  v1::AgentMessage agent = Hello("long-version", 0, 1);
  agent.mutable_hello()->set_agent_version(std::string(129, 'v'));
  ExpectRefused([&] { return Stream({Bytes(agent)}); }, grpc::StatusCode::INVALID_ARGUMENT,
                "hello field agent_version has 129 bytes, more than 128");
  v1::AgentMessage framework = Hello("long-version", 0, 1);
  framework.mutable_hello()->set_framework_version(std::string(60000, 'f'));
  ExpectRefused([&] { return Stream({Bytes(framework)}); }, grpc::StatusCode::INVALID_ARGUMENT,
                "hello field framework_version has 60000 bytes, more than 128");
  EXPECT_EQ(Query("SELECT COUNT(*) FROM jobs WHERE job IN ('long-host', 'long-version')"), "0");
  // At the limits, accepted.
  v1::AgentMessage ok = Hello("long-ok", 0, 1, kDim, std::string(255, 'h'));
  ok.mutable_hello()->set_agent_version(std::string(128, 'v'));
  ok.mutable_hello()->set_framework_version(std::string(128, 'f'));
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(ok));
  ASSERT_TRUE(s.Write(Report(1, 1)));
  ASSERT_TRUE(s.AwaitAck(1));
}

// Issue 12.4: SetControl checks the job name as the other Query methods do, and never echoes it.
TEST_F(BadInputTest, SetControlRefusesABadJobNameWithoutEchoingIt) {
  auto query = v1::Query::NewStub(
      grpc::CreateChannel(collector_->grpc_target(), grpc::InsecureChannelCredentials()));
  for (const std::string& job :
       {std::string(100000, 'x'), std::string("bad job\n'; --"), std::string()}) {
    grpc::ClientContext ctx;
    v1::ControlRequest request;
    request.set_job(job);
    request.set_enabled(false);
    v1::ControlResponse response;
    const grpc::Status status = query->SetControl(&ctx, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(),
                HasSubstr("job must be 1-128 characters of [A-Za-z0-9_.:-]"));
    EXPECT_LT(status.error_message().size(), 200u);
    if (!job.empty()) {
      EXPECT_THAT(status.error_message(), ::testing::Not(HasSubstr(job)));
    }
  }
  ExpectHealthyServed();
}

// Issue 34.5: a Query request of garbage bytes was answered UNIMPLEMENTED with no message (gRPC's
// callback API on a failed parse). It is INVALID_ARGUMENT saying what could not be parsed; a
// method the collector does not serve keeps gRPC's UNIMPLEMENTED.
TEST_F(BadInputTest, AQueryRequestOfGarbageBytesIsAnsweredWithWhatIsWrong) {
  // Field 1, length-delimited, with a length far beyond the message: no parser accepts it.
  const std::string garbage("\x0a\xff\xff\xff\xff\x0f\x01\x02", 8);
  auto unary = [&](const std::string& method, const std::string& bytes) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    absl::Notification done;
    grpc::Status status;
    stub_->UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
      status = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    return status;
  };
  for (const char* method : {"ListJobs", "RecentSteps", "SetControl", "StepRange"}) {
    SCOPED_TRACE(method);
    const std::string path = absl::StrCat("/rankscope.v1.Query/", method);
    const grpc::Status status = unary(path, garbage);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat("the request to ", path,
                                                               " could not be parsed as a "
                                                               "rankscope.v1.")));
  }
  const grpc::Status unknown = unary("/rankscope.v1.Query/NoSuchMethod", "");
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNIMPLEMENTED) << unknown.error_message();
  ExpectHealthyServed();
}

// Issue 12.6: an agent that half-closes after sending still gets every stored report acked, and
// the stream finishes with OK only then.
TEST_F(BadInputTest, AHalfClosedStreamGetsItsAcksBeforeItsStatus) {
  constexpr uint64_t kReports = 50;
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(Hello("half-close", 0, 1)));
  for (uint64_t seq = 1; seq <= kReports; ++seq) ASSERT_TRUE(s.Write(Report(seq, seq)));
  ASSERT_TRUE(s.WritesDone());
  std::set<uint64_t> acked;
  v1::CollectorMessage msg;
  while (s.Read(&msg)) {
    for (uint64_t seq : msg.ack().seqs()) acked.insert(seq);
  }
  const grpc::Status status = s.Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(acked.size(), kReports) << "acks lost when the agent half-closed";
  EXPECT_EQ(Query("SELECT COUNT(*) FROM rank_steps WHERE job = 'half-close'"),
            absl::StrCat(kReports));
  ExpectHealthyServed();
}

// Issue 12.5: a client that sends refused reports and never reads its stream cannot make the
// collector queue Rejections without bound: beyond the per-stream bound (1,024 messages) the
// stream ends with RESOURCE_EXHAUSTED and the collector reads nothing more from it.
TEST_F(BadInputTest, AStreamThatNeverReadsItsRejectionsEndsWithResourceExhausted) {
  constexpr int kFlood = 100'000;
  // The client's HTTP/2 receive window stays at its default size (no BDP probing, which would
  // grow it to megabytes): what the transport can buffer for a client that never reads is then
  // small next to the flood, so only the collector's own bound can explain a bounded count.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto ingest = v1::Ingest::NewStub(grpc::CreateCustomChannel(
      collector_->grpc_target(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = ingest->Stream(&ctx);
  ASSERT_TRUE(stream->Write(Hello("never-reads", 0, 1)));
  const double overflowed = Metric("rankscope_streams_overflowed_total");
  std::atomic<int> written{0};
  std::thread writer([&] {
    v1::AgentMessage bad = Report(0, uint64_t{1} << 63);  // each refused: step >= 2^63
    for (int seq = 1; seq <= kFlood; ++seq) {
      bad.mutable_report()->set_seq(seq);
      if (!stream->Write(bad)) break;
      written = seq;
    }
  });
  // Nothing is read until the collector has given up on the stream.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return Metric("rankscope_streams_overflowed_total") >= overflowed + 1; },
      absl::Seconds(60)))
      << "the collector kept queueing rejections for a client that never reads";
  int rejections = 0;
  v1::CollectorMessage msg;
  while (stream->Read(&msg)) rejections += msg.has_rejection() ? 1 : 0;
  writer.join();  // its write fails once the call is over
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("the agent does not read its stream"));
  // What reached the client is what the transport buffered (HTTP/2 windows) plus the bounded
  // queue; far fewer than the reports sent.
  EXPECT_LT(rejections, kFlood / 2);
  EXPECT_LT(written.load(), kFlood) << "the collector kept reading an overflowed stream";
  ExpectHealthyServed();
}

// Issue 12.2: connections that never finish their request headers cannot starve /metrics: with
// six of them held open (the HTTP server had 2 threads and a 30 s request timeout, so two were
// enough to stall every scrape ~30 s), a scrape is answered at once (bound: 3 s, for a loaded
// machine; the slow clients would hold for the whole test).
TEST_F(BadInputTest, SlowHttpClientsDoNotBlockAScrape) {
  constexpr int kSlow = 6;
  std::vector<int> slow;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(collector_->metrics_port()));
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string partial = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    ASSERT_EQ(write(fd, partial.data(), partial.size()), static_cast<ssize_t>(partial.size()));
    slow.push_back(fd);
  }
  const absl::Time start = absl::Now();
  const std::string text = testing::HttpGet(collector_->metrics_port(), "/metrics");
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(text, HasSubstr("rankscope_streams_open "));
  EXPECT_LT(took, absl::Seconds(3)) << "a scrape waited behind slow HTTP clients";
  for (int fd : slow) close(fd);
}

// Issue 15: packed sketch encodings (float16, int8 + scale) on the real gRPC edge.
v1::AgentMessage PackedHello(const std::string& job, uint32_t rank, uint32_t world,
                             v1::SketchEncoding encoding) {
  v1::AgentMessage m = Hello(job, rank, world);
  m.mutable_hello()->set_sketch_encoding(encoding);
  return m;
}

v1::AgentMessage PackedReport(uint64_t seq, uint64_t step, std::string bins, float scale) {
  v1::AgentMessage m = Report(seq, step, 0);
  m.mutable_report()->set_sketch_packed(std::move(bins));
  m.mutable_report()->set_sketch_scale(scale);
  return m;
}

TEST_F(BadInputTest, PackedSketchesAreJoinedAndTheirCosinesComputed) {
  for (auto [encoding, name] : {std::pair{v1::SKETCH_ENCODING_INT8, "packed-int8"},
                                std::pair{v1::SKETCH_ENCODING_FLOAT16, "packed-float16"}}) {
    const size_t per_bin = encoding == v1::SKETCH_ENCODING_INT8 ? 1 : 2;
    RawStream a(stub_), b(stub_);
    ASSERT_TRUE(a.Write(PackedHello(name, 0, 2, encoding)));
    ASSERT_TRUE(b.Write(PackedHello(name, 1, 2, encoding)));
    // Two ranks with the same bins at different scales: the same direction, cosine 1.
    const std::string bins = per_bin == 1 ? std::string("\x7f\x01\xc0\x00", kDim)
                                          : std::string("\x00\x3c\x00\xc0\x00\x38\x00\x00", 8);
    ASSERT_TRUE(a.Write(PackedReport(1, 1, bins, 0.5f)));
    ASSERT_TRUE(b.Write(PackedReport(1, 1, bins, 3.0f)));
    ASSERT_TRUE(a.AwaitAck(1));
    ASSERT_TRUE(b.AwaitAck(1));
    EXPECT_EQ(Query(absl::StrCat("SELECT ranks, round(grad_cosine_mean, 9) FROM step_stats "
                                 "WHERE job = '",
                                 name, "'")),
              "2|1.0");
    EXPECT_EQ(Query(absl::StrCat("SELECT rank, round(grad_cosine, 9), nonfinite FROM rank_steps "
                                 "WHERE job = '",
                                 name, "' ORDER BY rank")),
              "0|1.0|0\n1|1.0|0");
  }
  ExpectHealthyServed();
}

TEST_F(BadInputTest, MixedSketchEncodingsInAJobAreFailedPrecondition) {
  RawStream first(stub_);
  ASSERT_TRUE(first.Write(PackedHello("one-encoding", 0, 2, v1::SKETCH_ENCODING_INT8)));
  ExpectHealthyServed();  // the hello above is accepted by now
  // An old agent (no encoding: float32) joining an int8 job.
  ExpectRefused([&] { return Stream({Bytes(Hello("one-encoding", 1, 2))}); },
                grpc::StatusCode::FAILED_PRECONDITION,
                "sketch_encoding float32 differs from job one-encoding's (int8): a job uses one "
                "sketch encoding");
  ExpectRefused(
      [&] {
        return Stream({Bytes(PackedHello("one-encoding", 1, 2, v1::SKETCH_ENCODING_FLOAT16))});
      },
      grpc::StatusCode::FAILED_PRECONDITION,
      "sketch_encoding float16 differs from job one-encoding's (int8)");
  ExpectRefused(
      [&] {
        return Stream(
            {Bytes(PackedHello("bad-encoding", 0, 1, static_cast<v1::SketchEncoding>(9)))});
      },
      grpc::StatusCode::INVALID_ARGUMENT, "sketch_encoding 9 of job bad-encoding is unknown");
}

TEST_F(BadInputTest, BadPackedReportsAreRejectedAndTheStreamGoesOn) {
  RawStream s(stub_);
  ASSERT_TRUE(s.Write(PackedHello("packed-bad", 0, 1, v1::SKETCH_ENCODING_INT8)));
  ASSERT_TRUE(s.Write(PackedReport(1, 1, std::string(kDim, '\x10'), 0.25f)));
  ASSERT_TRUE(s.AwaitAck(1));
  const std::string before = Snapshot();
  struct Bad {
    v1::AgentMessage message;
    std::string expected;
  };
  std::vector<Bad> bad;
  bad.push_back({PackedReport(2, 2, std::string(kDim - 1, '\x10'), 0.25f),
                 "sketch of step 2 has 3 int8 values, job packed-bad uses sketch_dim 4"});
  bad.push_back({PackedReport(3, 3, std::string(kDim, '\x10'), 0.0f),
                 "sketch_scale 0 of step 3 of job packed-bad must be finite and > 0"});
  bad.push_back(
      {PackedReport(4, 4, std::string(kDim, '\x10'), -2.0f), "sketch_scale -2 of step 4"});
  bad.push_back(
      {PackedReport(5, 5, std::string(kDim, '\x10'), std::numeric_limits<float>::infinity()),
       "sketch_scale inf of step 5"});
  bad.push_back({Report(6, 6), "sketch of step 6 has 4 float values and 0 packed bytes"});
  for (const Bad& b : bad) {
    v1::Rejection rejection;
    ASSERT_TRUE(s.Write(b.message));
    ASSERT_FALSE(s.AwaitAck(b.message.report().seq(), &rejection));
    EXPECT_EQ(rejection.code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(rejection.message(), HasSubstr(b.expected));
  }
  EXPECT_EQ(Snapshot(), before);
  // A sketch that held NaN/Inf travels with scale NaN: stored and flagged, like a float NaN.
  ASSERT_TRUE(s.Write(
      PackedReport(7, 7, std::string(kDim, '\0'), std::numeric_limits<float>::quiet_NaN())));
  ASSERT_TRUE(s.AwaitAck(7));
  ASSERT_TRUE(s.Write(PackedReport(8, 8, std::string(kDim, '\x10'), 0.25f)));
  ASSERT_TRUE(s.AwaitAck(8));
  EXPECT_EQ(Query("SELECT step, nonfinite FROM rank_steps WHERE job = 'packed-bad' ORDER BY step"),
            "1|0\n7|1\n8|0");
  ExpectHealthyServed();
}

// Issue 12.1: streams that never send a hello are ended after --hello_timeout and counted, so
// thousands of them (as many as --max_streams) cannot lock a real agent out.
TEST(HelloTimeoutTest, ThousandsOfSilentStreamsAreEndedAndARealAgentGetsIn) {
  constexpr int kSilent = 2000;
  const std::string dir = testing::MakeTempDir();
  CollectorOptions o;
  o.grpc_address = "127.0.0.1:0";
  o.metrics_address = "127.0.0.1:0";
  o.db_path = dir + "/rankscope.db";
  o.max_streams = kSilent;  // the silent streams alone fill the limit
  o.hello_timeout = absl::Seconds(2);
  auto c = Collector::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Collector& collector = **c;
  int timed_out = 0;
  int refused = 0;
  {
    grpc::GenericStub stub(
        grpc::CreateChannel(collector.grpc_target(), grpc::InsecureChannelCredentials()));
    std::vector<std::unique_ptr<RawStream>> silent;
    for (int i = 0; i < kSilent; ++i) silent.push_back(std::make_unique<RawStream>(&stub));

    // A real agent, retrying with its own backoff, gets its report stored and acked.
    AgentOptions a;
    a.collector_address = collector.grpc_target();
    a.job = "after-silence";
    a.sketch_dim = kDim;
    a.initial_backoff = absl::Milliseconds(50);
    a.max_backoff = absl::Milliseconds(500);
    auto agent = Agent::Create(a);
    ASSERT_TRUE(agent.ok()) << agent.status();
    const std::vector<float> sketch(kDim, 0.25f);
    StepReport report;
    report.step = 1;
    report.loss = 1.0;
    report.grad_norm = 1.0;
    report.sketch = sketch;
    ASSERT_TRUE((*agent)->Record(report).ok());
    EXPECT_TRUE((*agent)->Flush(absl::Seconds(60)).ok()) << "the silent streams locked it out";
    EXPECT_TRUE((*agent)->Close(absl::Seconds(5)).ok());

    // Each silent stream ends: at its hello deadline, or at once if it reached the collector
    // after the agent's stream had taken the last slot (RESOURCE_EXHAUSTED).
    for (auto& s : silent) {
      const grpc::Status status = s->Finish();
      if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++refused;
        continue;
      }
      ASSERT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
      ASSERT_THAT(status.error_message(),
                  HasSubstr("no Hello within the collector's --hello_timeout (2s)"));
      ++timed_out;
    }
  }
  EXPECT_GE(timed_out, kSilent - 10);
  EXPECT_EQ(timed_out + refused, kSilent);
  const std::string metrics = testing::HttpGet(collector.metrics_port(), "/metrics");
  EXPECT_THAT(metrics,
              HasSubstr(absl::StrCat("rankscope_streams_hello_timeout_total ", timed_out, "\n")));
  EXPECT_TRUE(collector.Shutdown(absl::Seconds(10)).ok());
}

// Issue 12.3: one rank claiming a world size of 1,000,000 made every step store (and
// RecentSteps return) a 7 MB missing_ranks list, more than a default gRPC client reads. The
// ranks are stored and sent as ranges, with the full count beside them.
TEST(WorldSizeAmplificationTest, AMillionMissingRanksAreStoredAndSentCompactly) {
  const std::string dir = testing::MakeTempDir();
  CollectorOptions o;
  o.grpc_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.db_path = dir + "/rankscope.db";
  o.pipeline.joiner.step_timeout = absl::Milliseconds(200);  // steps close by timeout
  auto c = Collector::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Collector& collector = **c;
  auto channel = grpc::CreateChannel(collector.grpc_target(), grpc::InsecureChannelCredentials());
  {
    grpc::GenericStub stub(channel);
    RawStream s(&stub);
    ASSERT_TRUE(s.Write(Hello("huge-world", 5, 1'000'000)));
    for (uint64_t step = 1; step <= 3; ++step) {
      ASSERT_TRUE(s.Write(Report(step, step)));
      ASSERT_TRUE(s.AwaitAck(step)) << "acked once its step closed by timeout and was stored";
    }
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(o.db_path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "SELECT missing_ranks FROM step_stats WHERE job = 'huge-world'",
                               -1, &stmt, nullptr),
            SQLITE_OK);
  int rows = 0;
  while (sqlite3_step(stmt) == SQLITE_ROW) {
    ++rows;
    EXPECT_STREQ(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0)), "0-4,6-999999");
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  EXPECT_EQ(rows, 3);

  // A default client (4 MiB receive limit) reads them back.
  auto query = v1::Query::NewStub(channel);
  grpc::ClientContext ctx;
  v1::RecentStepsRequest request;
  request.set_job("huge-world");
  v1::RecentStepsResponse response;
  const grpc::Status status = query->RecentSteps(&ctx, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.steps_size(), 3);
  EXPECT_LT(response.ByteSizeLong(), 32u << 10);
  for (const v1::StepStats& st : response.steps()) {
    EXPECT_EQ(st.missing_rank_ranges(), "0-4,6-999999");
    EXPECT_EQ(st.missing_count(), 999'999u);
    ASSERT_EQ(st.missing_ranks_size(), 1024);  // the first ones, for older readers
    EXPECT_EQ(st.missing_ranks(4), 4u);
    EXPECT_EQ(st.missing_ranks(5), 6u);
  }
  EXPECT_TRUE(collector.Shutdown(absl::Seconds(10)).ok());
}

TEST(BadDatabaseTest, ACollectorOnAFileThatIsNotADatabaseFailsToStartCleanly) {
  const std::string path = testing::MakeTempDir() + "/rankscope.db";
  std::ofstream(path) << std::string(8192, 'x');
  CollectorOptions o;
  o.grpc_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.db_path = path;
  auto c = Collector::Start(o);  // used to crash in ~Collector on this path
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr(path));
  EXPECT_THAT(c.status().message(), HasSubstr("file is not a database"));
}

}  // namespace
}  // namespace rankscope
