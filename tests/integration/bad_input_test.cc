// Bad input (DESIGN.md "Delivery and failure semantics"), end to end: a real in-process collector
// on port 0 with a real SQLite file, driven over loopback through grpc::GenericStub, so that any
// bytes can be sent, well-formed or not.
//
// For every case: the exact gRPC status code (or Rejection code) and an actionable message; a
// healthy stream of another job, open throughout, keeps being served (its next report is acked
// and stored); and nothing stored changed (every row of every table outside the healthy job,
// before and after, compared as text). The outcomes are tabulated in docs/reliability_cases.md.
#include <sqlite3.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collector/collector.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "rankscope/v1/rankscope.pb.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

using collector::Collector;
using collector::CollectorOptions;
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
  ExpectHealthyServed();
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
