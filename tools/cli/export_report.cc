#include "tools/cli/export_report.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collector/query/row_proto.h"
#include "collector/store/sqlite_store.h"
#include "google/protobuf/util/json_util.h"
#include "rankscope/v1/rankscope.pb.h"
#include "tools/cli/step_format.h"

namespace rankscope::cli {
namespace {

namespace v1 = rankscope::v1;

namespace store = rankscope::collector;

using store::FillRankStep;
using store::FillStepStats;

// Reads the job's steps (and rank rows) in [--first_step, --last_step] from --db, or from the
// collector when --db is empty. Returns 0, or the exit code after printing why.
int LoadRange(const Cli& cli, const std::string& job, bool include_ranks,
              v1::StepRangeResponse* out) {
  const CliConfig& config = cli.config;
  const uint64_t first = config.first_step;
  const uint64_t last =
      config.last_step == 0 ? std::numeric_limits<uint64_t>::max() : config.last_step;
  const int max_rows = std::max(1, config.max_rows);
  const std::string& db = config.db;
  if (db.empty()) {
    // Paged, so that no response nears gRPC's message size limit even for 10,000-rank jobs:
    // step rows --page_rows at a time, then rank rows a few steps (~--page_rows rows) at a time.
    rankscope::query::StepRangeQuery query;
    query.job = job;
    query.first_step = first;
    query.last_step = last;
    query.include_ranks = include_ranks;
    query.max_rows = max_rows;
    query.page_rows = config.page_rows;
    if (absl::Status s = cli.client.StepRangePaged(query, out); !s.ok()) return Fail(config, s);
  } else {
    store::StoreOptions options;
    options.read_only = true;
    auto opened = store::SqliteStore::Open(db, options);
    if (!opened.ok()) {
      std::fprintf(stderr, "rankscope: %s\n", std::string(opened.status().message()).c_str());
      return 1;
    }
    auto steps = (*opened)->StepRange(job, first, last, max_rows + 1);
    if (!steps.ok()) {
      std::fprintf(stderr, "rankscope: %s\n", std::string(steps.status().message()).c_str());
      return 1;
    }
    if (steps->size() > static_cast<size_t>(max_rows)) {
      steps->resize(max_rows);
      out->set_truncated(true);
    }
    for (const store::StepRow& row : *steps) FillStepStats(row, out->add_steps());
    if (include_ranks) {
      auto ranks = (*opened)->RankRowsInRange(job, first, last, max_rows + 1);
      if (!ranks.ok()) {
        std::fprintf(stderr, "rankscope: %s\n", std::string(ranks.status().message()).c_str());
        return 1;
      }
      if (ranks->size() > static_cast<size_t>(max_rows)) {
        ranks->resize(max_rows);
        out->set_truncated(true);
      }
      for (const store::StepRankRow& row : *ranks) FillRankStep(row, out->add_ranks());
      if (absl::Status s = store::FillRankWindows(**opened, job, first, last, max_rows, out);
          !s.ok()) {
        std::fprintf(stderr, "rankscope: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
  }
  if (out->steps_size() == 0 && out->ranks_size() == 0) {
    std::fprintf(stderr, "rankscope: no steps stored for job %s in %s\n", job.c_str(),
                 db.empty() ? ("the collector at " + config.query.address).c_str() : db.c_str());
    return 1;
  }
  if (out->truncated()) {
    std::fprintf(stderr, "rankscope: more than --max_rows=%d rows; output truncated\n", max_rows);
  }
  if (include_ranks && out->downsampled_before_step() > first) {
    std::fprintf(stderr,
                 "rankscope: job %s: the per-rank rows of steps before %llu were pruned by the "
                 "collector's retention (--retention_rank_steps; flagged ranks keep theirs); "
                 "%d downsampled rank windows cover them (export --table=windows)\n",
                 job.c_str(), static_cast<unsigned long long>(out->downsampled_before_step()),
                 out->rank_windows_size());
  }
  return 0;
}

// A CSV field: full precision, "nan"/"inf"/"-inf" as text, empty when absent.
std::string Csv(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return absl::StrFormat("%.17g", v);
}
std::string Csv(bool has, double v) { return has ? Csv(v) : std::string(); }

}  // namespace

// Long: one verb's output in its two formats from the same reads, the columns of each listed once,
// side by side.
int Export(const Cli& cli, const std::string& job) {
  const std::string& format = cli.config.format;
  const std::string& table = cli.config.table;
  if (format != "csv" && format != "json") {
    std::fprintf(stderr, "rankscope: --format must be csv or json, not '%s'\n", format.c_str());
    return 2;
  }
  if (table != "steps" && table != "ranks" && table != "windows") {
    std::fprintf(stderr, "rankscope: --table must be steps, ranks or windows, not '%s'\n",
                 table.c_str());
    return 2;
  }
  v1::StepRangeResponse data;
  if (int rc = LoadRange(cli, job, format == "json" || table != "steps", &data); rc != 0) {
    return rc;
  }
  if (format == "json") {
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    options.always_print_primitive_fields = true;
    std::string json;
    auto status = google::protobuf::util::MessageToJsonString(data, &json, options);
    if (!status.ok()) {
      std::fprintf(stderr, "rankscope: JSON: %s\n", status.ToString().c_str());
      return 1;
    }
    std::printf("%s\n", json.c_str());
    return 0;
  }
  if (table == "steps") {
    std::printf(
        "step,ranks,world_size,loss_mean,loss_std,loss_range,grad_norm_mean,grad_norm_std,"
        "grad_norm_cv,grad_cosine_mean,grad_noise_scale,timed_out,missing_ranks,replica_checked,"
        "replica_divergent_ranks,outlier_ranks,duplicate_groups\n");
    for (const v1::StepStats& st : data.steps()) {
      // duplicate_groups ("0,2;1,3") holds commas: quoted when not empty.
      const std::string duplicates =
          st.duplicate_groups().empty() ? "" : absl::StrCat("\"", st.duplicate_groups(), "\"");
      std::printf(
          "%llu,%u,%u,%s,%s,%s,%s,%s,%s,%s,%s,%d,%s,%d,%s,%s,%s\n",
          static_cast<unsigned long long>(st.step()), st.ranks(), st.world_size(),
          Csv(st.loss_mean()).c_str(), Csv(st.loss_std()).c_str(), Csv(st.loss_range()).c_str(),
          Csv(st.grad_norm_mean()).c_str(), Csv(st.grad_norm_std()).c_str(),
          Csv(st.grad_norm_cv()).c_str(), Csv(st.grad_cosine_mean()).c_str(),
          Csv(st.grad_noise_scale()).c_str(), st.timed_out() ? 1 : 0, MissingRanks(st, ";").c_str(),
          st.replica_checked() ? 1 : 0, absl::StrJoin(st.replica_divergent_ranks(), ";").c_str(),
          absl::StrJoin(st.outlier_ranks(), ";").c_str(), duplicates.c_str());
    }
    return 0;
  }
  if (table == "windows") {
    // Downsampled per-rank data (rank_windows): min/mean/max per rank and window of steps.
    std::printf(
        "first_step,last_step,rank,rows,loss_min,loss_mean,loss_max,grad_norm_min,grad_norm_mean,"
        "grad_norm_max,grad_cosine_min,grad_cosine_mean,grad_cosine_max,outlier_score_min,"
        "outlier_score_mean,outlier_score_max,nonfinite,outliers,replica_bad\n");
    for (const v1::RankWindow& w : data.rank_windows()) {
      std::printf("%llu,%llu,%u,%lld,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%lld,%lld,%lld\n",
                  static_cast<unsigned long long>(w.first_step()),
                  static_cast<unsigned long long>(w.last_step()), w.rank(),
                  static_cast<long long>(w.rows()), Csv(w.has_loss_min(), w.loss_min()).c_str(),
                  Csv(w.has_loss_mean(), w.loss_mean()).c_str(),
                  Csv(w.has_loss_max(), w.loss_max()).c_str(),
                  Csv(w.has_grad_norm_min(), w.grad_norm_min()).c_str(),
                  Csv(w.has_grad_norm_mean(), w.grad_norm_mean()).c_str(),
                  Csv(w.has_grad_norm_max(), w.grad_norm_max()).c_str(),
                  Csv(w.has_grad_cosine_min(), w.grad_cosine_min()).c_str(),
                  Csv(w.has_grad_cosine_mean(), w.grad_cosine_mean()).c_str(),
                  Csv(w.has_grad_cosine_max(), w.grad_cosine_max()).c_str(),
                  Csv(w.has_outlier_score_min(), w.outlier_score_min()).c_str(),
                  Csv(w.has_outlier_score_mean(), w.outlier_score_mean()).c_str(),
                  Csv(w.has_outlier_score_max(), w.outlier_score_max()).c_str(),
                  static_cast<long long>(w.nonfinite()), static_cast<long long>(w.outliers()),
                  static_cast<long long>(w.replica_bad()));
    }
    return 0;
  }
  std::printf(
      "step,rank,attempt,loss,grad_norm,grad_cosine,loss_z,grad_norm_z,outlier_score,"
      "replica_ok,step_time_seconds,step_time_z,reduced_grad_fingerprint,param_fingerprint\n");
  for (const v1::RankStep& r : data.ranks()) {
    std::printf(
        "%llu,%u,%u,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s\n", static_cast<unsigned long long>(r.step()),
        r.rank(), r.attempt(), Csv(r.loss()).c_str(), Csv(r.grad_norm()).c_str(),
        Csv(r.has_grad_cosine(), r.grad_cosine()).c_str(), Csv(r.has_loss_z(), r.loss_z()).c_str(),
        Csv(r.has_grad_norm_z(), r.grad_norm_z()).c_str(),
        Csv(r.has_outlier_score(), r.outlier_score()).c_str(),
        r.has_replica_ok() ? (r.replica_ok() ? "1" : "0") : "",
        Csv(r.has_step_time_seconds(), r.step_time_seconds()).c_str(),
        Csv(r.has_step_time_z(), r.step_time_z()).c_str(),
        r.has_reduced_grad_fingerprint() ? std::to_string(r.reduced_grad_fingerprint()).c_str()
                                         : "",
        r.has_param_fingerprint() ? std::to_string(r.param_fingerprint()).c_str() : "");
  }
  return 0;
}

int Report(const Cli& cli, const std::string& job) {
  const std::string& output = cli.config.output;
  if (output.empty()) {
    std::fprintf(stderr, "rankscope: report needs -o FILE (e.g. -o report.png)\n");
    return 2;
  }
  const std::string pydir = PythonDir();
  if (!PathExists(pydir + "/rankscope/report.py")) {
    std::fprintf(stderr,
                 "rankscope: %s/rankscope/report.py not found (the report needs the "
                 "rankscope Python package beside the binary, as the build lays it out)\n",
                 pydir.c_str());
    return 1;
  }
  v1::StepRangeResponse data;
  if (int rc = LoadRange(cli, job, /*include_ranks=*/true, &data); rc != 0) return rc;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(data, &json, options).ok()) return 1;
  const char* tmpdir = std::getenv("TMPDIR");
  std::string path = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/rankscope-report-XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) {
    std::fprintf(stderr, "rankscope: cannot create a temp file: %s\n", std::strerror(errno));
    return 1;
  }
  const bool written = write(fd, json.data(), json.size()) == static_cast<ssize_t>(json.size());
  close(fd);
  if (!written) {
    unlink(path.c_str());
    std::fprintf(stderr, "rankscope: cannot write %s\n", path.c_str());
    return 1;
  }
  const std::string& python = cli.config.python;
  const pid_t pid = fork();
  if (pid == 0) {
    const char* old = std::getenv("PYTHONPATH");
    const std::string pythonpath = old && *old ? pydir + ":" + old : pydir;
    setenv("PYTHONPATH", pythonpath.c_str(), 1);
    execl(python.c_str(), python.c_str(), "-m", "rankscope.report", "--input", path.c_str(),
          "--job", job.c_str(), "-o", output.c_str(), static_cast<char*>(nullptr));
    std::fprintf(stderr, "rankscope: cannot run %s: %s\n", python.c_str(), std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) < 0) status = -1;
  unlink(path.c_str());
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "rankscope: report failed (%s -m rankscope.report)\n", python.c_str());
    return 1;
  }
  return 0;
}

}  // namespace rankscope::cli
