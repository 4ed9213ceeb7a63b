// Mutual TLS on the collector's gRPC port, in process: the C++ and C agent APIs against a real
// Collector on 127.0.0.1 port 0, with certificates made by the openssl command at test time
// (tests/python/test_tls.py covers the binaries, the CLI and the Python options).
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collector/collector.h"
#include "collector/store/sqlite_store.h"
#include "common/tls_files.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rankscope/agent.h"
#include "rankscope/agent_c.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

using collector::Collector;
using collector::CollectorOptions;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uint32_t kDim = 8;
constexpr char kToken[] = "tls-test-token";

// Writes ca, server (SAN IP:127.0.0.1), client, rogue-ca and rogue-client .pem/.key into `dir`.
bool MakePki(const std::string& dir) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  auto ca = [&](const std::string& name) {
    return absl::StrCat("openssl req -x509 ", ec, " -keyout ", name, ".key -out ", name,
                        ".pem -days 1 -subj /CN=", name,
                        " -addext basicConstraints=critical,CA:TRUE"
                        " -addext keyUsage=critical,keyCertSign,cRLSign && ");
  };
  auto leaf = [&](const std::string& name, const std::string& signer, const std::string& ext) {
    return absl::StrCat("printf '", ext, "' > ", name, ".ext && openssl req -new ", ec, " -keyout ",
                        name, ".key -out ", name, ".csr -subj /CN=", name,
                        " && openssl x509 -req -in ", name, ".csr -CA ", signer, ".pem -CAkey ",
                        signer, ".key -CAcreateserial -days 1 -extfile ", name, ".ext -out ", name,
                        ".pem && ");
  };
  const std::string cmd = absl::StrCat(
      "(cd ", dir, " && ", ca("ca"),
      leaf("server", "ca", "subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n"),
      leaf("client", "ca", "extendedKeyUsage=clientAuth\\n"), ca("rogue-ca"),
      leaf("rogue-client", "rogue-ca", "extendedKeyUsage=clientAuth\\n"), "true) >/dev/null 2>&1");
  return std::system(cmd.c_str()) == 0;
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("openssl version >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "the openssl command is not installed";
    }
    dir_ = testing::MakeTempDir();
    ASSERT_TRUE(MakePki(dir_)) << "openssl failed in " << dir_;
  }

  std::string Pem(const std::string& name) const { return absl::StrCat(dir_, "/", name); }

  CollectorOptions MutualTlsOptions() const {
    CollectorOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.db_path = dir_ + "/rankscope.db";
    o.pipeline.auth_token = kToken;
    o.tls.cert_file = Pem("server.pem");
    o.tls.key_file = Pem("server.key");
    o.tls.client_ca_file = Pem("ca.pem");
    return o;
  }

  AgentOptions AgentFor(const Collector& c, const std::string& job) const {
    AgentOptions o;
    o.collector_address = c.grpc_target();
    o.job = job;
    o.sketch_dim = kDim;
    o.auth_token = kToken;
    o.initial_backoff = absl::Milliseconds(20);
    o.max_backoff = absl::Milliseconds(200);
    o.tls.ca_file = Pem("ca.pem");
    return o;
  }

  int64_t StoredRows(const std::string& job) const {
    auto store = collector::SqliteStore::Open(dir_ + "/rankscope.db");
    if (!store.ok()) return -1;
    auto count = (*store)->CountRankRows(job);
    return count.ok() ? *count : -1;
  }

  static void RecordSteps(Agent& agent, int n) {
    std::vector<float> sketch(kDim, 1.0f);
    for (int step = 1; step <= n; ++step) {
      StepReport r;
      r.step = static_cast<uint64_t>(step);
      r.loss = 1.0;
      r.grad_norm = 1.0;
      r.sketch = sketch;
      ASSERT_TRUE(agent.Record(r).ok());
    }
  }

  // The agent keeps accepting reports, says why it is refused, is left without a stream, and
  // nothing of it is stored. (A refusal after the handshake, a wrong token, is said while the
  // refused stream is still closing: wait for both.)
  void ExpectRefused(Collector& c, Agent& agent, const std::string& job,
                     const std::string& error_prefix) {
    RecordSteps(agent, 10);
    testing::WaitFor(
        [&] {
          const AgentStats s = agent.stats();
          return !s.last_error.empty() && !s.connected;
        },
        absl::Seconds(30));
    const AgentStats s = agent.stats();
    EXPECT_THAT(s.last_error, StartsWith(error_prefix));
    EXPECT_EQ(s.recorded, 10u);
    EXPECT_EQ(s.acked, 0u);
    EXPECT_FALSE(s.connected);
    ASSERT_TRUE(c.Flush(absl::Seconds(30)));
    EXPECT_EQ(StoredRows(job), 0);
  }

  std::string dir_;
};

TEST_F(TlsTest, MutualTlsAgentIsStoredTheOthersAreRefused) {
  auto collector = Collector::Start(MutualTlsOptions());
  ASSERT_TRUE(collector.ok()) << collector.status();
  Collector& c = **collector;

  AgentOptions good = AgentFor(c, "mtls-good");
  good.tls.cert_file = Pem("client.pem");
  good.tls.key_file = Pem("client.key");
  auto agent = Agent::Create(good);
  ASSERT_TRUE(agent.ok()) << agent.status();
  RecordSteps(**agent, 5);
  ASSERT_TRUE((*agent)->Flush(absl::Seconds(60)).ok());
  EXPECT_EQ(StoredRows("mtls-good"), 5);
  EXPECT_EQ((*agent)->stats().last_error, "");

  auto no_cert = Agent::Create(AgentFor(c, "mtls-no-cert"));
  ASSERT_TRUE(no_cert.ok());
  ExpectRefused(c, **no_cert, "mtls-no-cert", "UNAVAILABLE");

  AgentOptions rogue = AgentFor(c, "mtls-rogue");
  rogue.tls.cert_file = Pem("rogue-client.pem");
  rogue.tls.key_file = Pem("rogue-client.key");
  auto rogue_agent = Agent::Create(rogue);
  ASSERT_TRUE(rogue_agent.ok());
  ExpectRefused(c, **rogue_agent, "mtls-rogue", "UNAVAILABLE");

  AgentOptions plain = AgentFor(c, "mtls-plain");
  plain.tls = ClientTlsOptions();
  auto plain_agent = Agent::Create(plain);
  ASSERT_TRUE(plain_agent.ok());
  ExpectRefused(c, **plain_agent, "mtls-plain", "UNAVAILABLE");

  AgentOptions bad_token = good;
  bad_token.job = "mtls-bad-token";
  bad_token.auth_token = "wrong";
  auto bad_token_agent = Agent::Create(bad_token);
  ASSERT_TRUE(bad_token_agent.ok());
  ExpectRefused(c, **bad_token_agent, "mtls-bad-token", "UNAUTHENTICATED");
}

TEST_F(TlsTest, CApiCarriesTlsOptionsAndLastError) {
  auto collector = Collector::Start(MutualTlsOptions());
  ASSERT_TRUE(collector.ok()) << collector.status();
  const std::string target = (*collector)->grpc_target();
  const std::string ca = Pem("ca.pem"), cert = Pem("client.pem"), key = Pem("client.key");
  std::vector<float> sketch(kDim, 1.0f);

  rankscope_agent_options o;
  rankscope_agent_options_init(&o);
  o.collector_address = target.c_str();
  o.job = "c-api-good";
  o.sketch_dim = kDim;
  o.auth_token = kToken;
  o.tls_ca_file = ca.c_str();
  o.tls_cert_file = cert.c_str();
  o.tls_key_file = key.c_str();
  rankscope_agent* good = nullptr;
  char err[256] = {0};
  ASSERT_EQ(rankscope_agent_create(&o, &good, err, sizeof(err)), 0) << err;
  ASSERT_EQ(rankscope_agent_record(good, 1, 1.0, 1.0, sketch.data(), kDim), 0);
  ASSERT_EQ(rankscope_agent_flush(good, 60, err, sizeof(err)), 0) << err;
  rankscope_agent_destroy(good);

  o.job = "c-api-no-cert";
  o.tls_cert_file = nullptr;
  o.tls_key_file = nullptr;
  rankscope_agent* refused = nullptr;
  ASSERT_EQ(rankscope_agent_create(&o, &refused, err, sizeof(err)), 0) << err;
  ASSERT_EQ(rankscope_agent_record(refused, 1, 1.0, 1.0, sketch.data(), kDim), 0);
  ASSERT_TRUE(testing::WaitFor([&] { return rankscope_agent_last_error(refused, nullptr, 0) > 0; },
                               absl::Seconds(30)));
  char last[512];
  rankscope_agent_last_error(refused, last, sizeof(last));
  EXPECT_THAT(std::string(last), StartsWith("UNAVAILABLE"));
  rankscope_agent_destroy(refused);

  o.tls_ca_file = "/nonexistent/ca.pem";
  rankscope_agent* missing = nullptr;
  EXPECT_NE(rankscope_agent_create(&o, &missing, err, sizeof(err)), 0);
  EXPECT_THAT(std::string(err), HasSubstr("cannot read tls_ca_file /nonexistent/ca.pem"));
}

TEST_F(TlsTest, BadFilesAreNamedAtStart) {
  CollectorOptions o = MutualTlsOptions();
  o.tls.key_file = Pem("missing.key");
  auto missing = Collector::Start(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("cannot read --tls_key_file"));

  o.tls.key_file = Pem("client.key");
  auto mismatched = Collector::Start(o);
  ASSERT_FALSE(mismatched.ok());
  EXPECT_THAT(mismatched.status().message(),
              HasSubstr("is not the private key of the certificate in --tls_cert_file"));

  tls::PemPaths paths;
  paths.ca_file = Pem("server.key");
  auto not_a_cert = tls::LoadPemFiles(paths);
  EXPECT_EQ(not_a_cert.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_a_cert.status().message(), HasSubstr("holds no PEM certificate"));

  AgentOptions a;
  a.job = "x";
  a.tls.cert_file = Pem("client.pem");  // without its key
  auto agent = Agent::Create(a);
  EXPECT_EQ(agent.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(agent.status().message(), HasSubstr("give both or neither"));
}

}  // namespace
}  // namespace rankscope
