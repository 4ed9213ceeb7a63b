// The /metrics exposition of a real collector fed a small known job, compared with a checked-in
// golden file (tests/integration/golden/metrics.golden) after `promtool check metrics`, as
// node_exporter's end-to-end test does. The golden keeps every family's HELP and TYPE lines and
// each series' name and label names; sample values and timestamps are dropped, and label values
// that depend on timing or on which ranks deviate most (normalised below) are replaced by a
// placeholder. So a renamed metric, a changed HELP text, type or label shows as a diff.
//
// To accept an intended change, regenerate the golden and review its diff:
//   RANKSCOPE_UPDATE_GOLDEN=1 build/bin/metrics_golden_test
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "collector/collector.h"
#include "gtest/gtest.h"
#include "rankscope/agent.h"
#include "tests/testing/test_util.h"

namespace rankscope {
namespace {

constexpr char kGoldenPath[] = RANKSCOPE_SOURCE_DIR "/tests/integration/golden/metrics.golden";

// Label values replaced by "<name>" in the golden: which ranks are exported depends on which
// deviate most (prometheus_export.h caps per-rank series). A `version` equal to this build's
// (kAgentVersion) is written "<this build>"; any other version stays as it is.
bool IsNormalisedLabel(absl::string_view name) { return name == "rank"; }

// One sample line without its value and timestamp, label values normalised. Label values of the
// exposition never contain '"' unescaped, nor '}' here (job names are [A-Za-z0-9_.:-]).
std::string NormaliseSample(absl::string_view line) {
  const size_t brace = line.find('{');
  if (brace == absl::string_view::npos) return std::string(line.substr(0, line.find(' ')));
  const size_t close = line.find('}', brace);
  std::vector<std::string> labels;
  for (absl::string_view label :
       absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',', absl::SkipEmpty())) {
    const size_t eq = label.find('=');
    const absl::string_view name = label.substr(0, eq);
    if (IsNormalisedLabel(name)) {
      labels.push_back(absl::StrCat(name, "=\"<", name, ">\""));
    } else if (name == "version" &&
               label.substr(eq + 1) == absl::StrCat("\"", kAgentVersion, "\"")) {
      // The agents' version, the project's (common/version.h): no golden change per release.
      labels.push_back("version=\"<this build>\"");
    } else {
      labels.push_back(std::string(label));
    }
  }
  return absl::StrCat(line.substr(0, brace), "{", absl::StrJoin(labels, ","), "}");
}

// The rankscope families only (prometheus-cpp's own exposer_* families are the library's): HELP
// and TYPE lines verbatim, then the family's series, each once, sorted (the exposition's order of
// series within a family is a hash map's).
std::string Normalise(const std::string& exposition) {
  std::vector<std::string> out;
  std::vector<std::string> series;  // of the current family
  const auto flush = [&] {
    std::sort(series.begin(), series.end());
    series.erase(std::unique(series.begin(), series.end()), series.end());
    out.insert(out.end(), series.begin(), series.end());
    series.clear();
  };
  for (absl::string_view line : absl::StrSplit(exposition, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "#")) {
      flush();
      // "# HELP name ..." / "# TYPE name type"
      std::vector<absl::string_view> words = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (words.size() >= 3 && absl::StartsWith(words[2], "rankscope_")) {
        out.emplace_back(line);
      }
    } else if (absl::StartsWith(line, "rankscope_")) {
      series.push_back(NormaliseSample(line));
    }
  }
  flush();
  return absl::StrCat(absl::StrJoin(out, "\n"), "\n");
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(MetricsGoldenTest, ExpositionMatchesTheGoldenFile) {
  constexpr uint32_t kWorld = 4, kDim = 64, kSteps = 4;
  collector::CollectorOptions options;
  options.grpc_address = "127.0.0.1:0";
  options.metrics_address = "127.0.0.1:0";
  options.db_path = testing::MakeTempDir() + "/rankscope.db";
  options.pipeline.joiner.step_timeout = absl::Milliseconds(300);
  auto collector = collector::Collector::Start(options);
  ASSERT_TRUE(collector.ok()) << collector.status();

  // One job with fingerprints, step times and batch sizes, its last rank's replica diverging and
  // that rank missing from the last step, so that every rankscope family has its series.
  std::vector<std::unique_ptr<Agent>> agents;
  for (uint32_t r = 0; r < kWorld; ++r) {
    AgentOptions o;
    o.collector_address = (*collector)->grpc_target();
    o.job = "golden";
    o.rank = r;
    o.world_size = kWorld;
    o.sketch_dim = kDim;
    o.host = "golden-host";  // the machine's name would make the file differ from host to host
    o.global_rank = 10 + r;
    auto agent = Agent::Create(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agents.push_back(std::move(*agent));
  }
  for (uint64_t step = 1; step <= kSteps + 1; ++step) {
    for (uint32_t r = 0; r < kWorld; ++r) {
      if (step == kSteps + 1 && r == kWorld - 1) continue;  // missing: the step times out
      StepReport report;
      report.step = step;
      report.loss = 2.0 + 0.01 * r + 0.001 * step;
      report.grad_norm = 1.0 + 0.02 * r;
      std::vector<float> sketch(kDim);
      for (uint32_t j = 0; j < kDim; ++j) sketch[j] = static_cast<float>((j + r) % 7) - 3;
      report.sketch = sketch;
      // The last rank's replica diverges from step 3 on.
      report.reduced_grad_fingerprint = step * 10 + (r == kWorld - 1 && step >= 3 ? 1 : 0);
      report.param_fingerprint = step;
      report.reduced_grad_norm = 0.8;
      report.local_batch_size = 8;
      report.step_time_seconds = 0.1 + 0.01 * r;
      ASSERT_TRUE(agents[r]->Record(report).ok());
    }
  }
  for (auto& a : agents) ASSERT_TRUE(a->Flush(absl::Seconds(60)).ok());
  ASSERT_TRUE((*collector)->Flush(absl::Seconds(60)));

  // The last step closes by timeout, naming the missing rank; until then its series are absent.
  std::string metrics;
  ASSERT_TRUE(testing::WaitFor([&] {
    metrics = testing::HttpGet((*collector)->metrics_port(), "/metrics");
    return absl::StrContains(metrics, "rankscope_rank_missing{");
  }));
  std::string complaints;
  EXPECT_EQ(testing::PromtoolCheckMetrics(metrics, &complaints), 0) << complaints;

  const std::string actual = Normalise(metrics);
  if (const char* update = std::getenv("RANKSCOPE_UPDATE_GOLDEN");
      update != nullptr && std::string(update) == "1") {
    std::ofstream(kGoldenPath) << actual;
    GTEST_SKIP() << "wrote " << kGoldenPath << ": review its diff and commit it";
  }
  const std::string golden = ReadFile(kGoldenPath);
  EXPECT_EQ(actual, golden)
      << "/metrics differs from " << kGoldenPath
      << " (names, labels, HELP or TYPE changed). If the change is intended, regenerate the "
         "golden with\n  RANKSCOPE_UPDATE_GOLDEN=1 build/bin/metrics_golden_test\nand commit "
         "the diff.";
  for (auto& a : agents) a->Close(absl::Seconds(5)).IgnoreError();
  EXPECT_TRUE((*collector)->Shutdown(absl::Seconds(5)).ok());
}

}  // namespace
}  // namespace rankscope
