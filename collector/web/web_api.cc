#include "collector/web/web_api.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "collector/analysis/bucket_scores.h"
#include "collector/query/query_checks.h"
#include "common/job_name.h"

namespace rankscope::collector {
namespace {

constexpr uint64_t kMaxStoredStep = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decodes `s` ('+' stays '+': job names have no spaces). A bad escape stays as it is,
// which the name check then refuses.
std::string PercentDecode(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      const int hi = HexValue(s[i + 1]), lo = HexValue(s[i + 2]);
      if (hi >= 0 && lo >= 0) {
        out.push_back(static_cast<char>(hi * 16 + lo));
        i += 2;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

absl::StatusOr<uint64_t> ParseStep(absl::string_view name, absl::string_view value) {
  uint64_t v = 0;
  const bool digits =
      !value.empty() && value.size() <= 20 &&
      std::all_of(value.begin(), value.end(), [](char c) { return absl::ascii_isdigit(c); });
  if (!digits || !absl::SimpleAtoi(value, &v) || v > kMaxStoredStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a step: a decimal integer from 0 to ", kMaxStoredStep,
                     " (got ", value.size(), " characters)"));
  }
  return v;
}

void AppendDouble(double v, int digits, std::string* out) {
  if (!std::isfinite(v)) {
    out->append("null");
    return;
  }
  char buf[32];
  const int n = std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  out->append(buf, static_cast<size_t>(n));
}

void AppendOptional(const std::optional<double>& v, int digits, std::string* out) {
  if (v.has_value()) {
    AppendDouble(*v, digits, out);
  } else {
    out->append("null");
  }
}

void AppendRanks(const std::vector<uint32_t>& ranks, std::string* out) {
  out->push_back('[');
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, ranks[i]);
  }
  out->push_back(']');
}

// Appends `"key":` (key is a literal of ours, never user input).
void Key(absl::string_view key, std::string* out) {
  out->push_back('"');
  out->append(key.data(), key.size());
  out->append("\":");
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

void AppendWindow(absl::string_view job, StepWindow window, bool truncated, std::string* out) {
  Key("job", out);
  AppendJsonString(job, out);
  absl::StrAppend(out, ",\"first\":", window.first, ",\"last\":", window.last,
                  ",\"truncated\":", truncated ? "true" : "false");
}

// The alert-worthy columns of a step, shared by the jobs and steps answers.
void AppendStepFlags(const StepRow& row, std::string* out) {
  out->append(",\"missing_ranks\":");
  AppendJsonString(row.missing_ranks, out);
  absl::StrAppend(out, ",\"timed_out\":", row.timed_out ? "true" : "false", ",\"outlier_ranks\":");
  AppendRanks(row.outlier_ranks, out);
  out->append(",\"divergent_ranks\":");
  AppendRanks(row.replica_divergent_ranks, out);
  out->append(",\"drifting_ranks\":");
  AppendRanks(row.drifting_ranks, out);
  out->append(",\"slow_ranks\":");
  AppendRanks(row.slow_ranks, out);
  // The aggregation check's verdict: "" when the step was not checked or passed; the rank its
  // regression named, null when none (collector/analysis/aggregation_integrity.h).
  out->append(",\"integrity_fault\":");
  AppendJsonString(row.integrity_fault, out);
  out->append(",\"integrity_rank\":");
  if (row.integrity_rank && !row.integrity_fault.empty()) {
    absl::StrAppend(out, *row.integrity_rank);
  } else {
    out->append("null");
  }
  out->append(",\"completed_at\":");
  AppendDouble(UnixSeconds(row.completed_at), 16, out);
}

// The stored verdict (rank_steps.nonfinite), never the values read back: a pipeline stage's
// absent loss reads back as NaN without being non-finite.
bool RowNonfinite(const StepRankRow& row) { return row.nonfinite; }

// Appends a heatmap column's cells, `"cosine":[...],"outlier":[...],"missing":[...],
// "nonfinite":[...],"divergent":[...]`: `at[r]` is the index of rank r's entry, -1 for none (null
// cells; missing when r < world_size); `cosine(i)` and `outlier(i)` are entry i's values,
// `nonfinite(i)` and `divergent(i)` its flags.
template <typename Cosine, typename Outlier, typename Nonfinite, typename Divergent>
void AppendHeatmapCells(const std::vector<int64_t>& at, uint32_t world_size, Cosine cosine,
                        Outlier outlier, Nonfinite nonfinite, Divergent divergent,
                        std::string* out) {
  const auto append_values = [&](auto value) {
    for (size_t r = 0; r < at.size(); ++r) {
      if (r > 0) out->push_back(',');
      if (at[r] < 0) {
        out->append("null");
      } else {
        AppendOptional(value(at[r]), 4, out);
      }
    }
  };
  out->append("\"cosine\":[");
  append_values(cosine);
  out->append("],\"outlier\":[");
  append_values(outlier);
  std::vector<uint32_t> missing, nonfinite_ranks, divergent_ranks;
  for (uint32_t r = 0; r < at.size(); ++r) {
    if (at[r] < 0) {
      if (r < world_size) missing.push_back(r);
      continue;
    }
    if (nonfinite(at[r])) nonfinite_ranks.push_back(r);
    if (divergent(at[r])) divergent_ranks.push_back(r);
  }
  out->append("],\"missing\":");
  AppendRanks(missing, out);
  out->append(",\"nonfinite\":");
  AppendRanks(nonfinite_ranks, out);
  out->append(",\"divergent\":");
  AppendRanks(divergent_ranks, out);
}

}  // namespace

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == '<' || c == '>' || c == '&') {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
          out->append(buf);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

absl::StatusOr<ApiRequest> ParseApiRequest(absl::string_view path, absl::string_view query) {
  ApiRequest request;
  const std::string decoded = PercentDecode(path);
  absl::string_view rest = decoded;
  if (rest == "/jobs" || rest == "/jobs/") {
    request.route = ApiRequest::Route::kJobs;
  } else if (absl::ConsumePrefix(&rest, "/jobs/")) {
    if (absl::ConsumeSuffix(&rest, "/steps")) {
      request.route = ApiRequest::Route::kSteps;
    } else if (absl::ConsumeSuffix(&rest, "/ranks")) {
      request.route = ApiRequest::Route::kRanks;
    } else {
      return absl::NotFoundError(
          "no such API path: use /api/v1/jobs, /api/v1/jobs/NAME/steps or "
          "/api/v1/jobs/NAME/ranks");
    }
    if (absl::Status name = CheckQueryJobName(rest); !name.ok()) return name;
    request.job = std::string(rest);
  } else {
    return absl::NotFoundError(
        "no such API path: use /api/v1/jobs, /api/v1/jobs/NAME/steps or /api/v1/jobs/NAME/ranks");
  }
  if (query.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("query string too long (", query.size(), " bytes, at most 1024)"));
  }
  for (absl::string_view pair : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(pair, absl::MaxSplits('=', 1));
    const std::string value = PercentDecode(kv.second);
    if (request.route == ApiRequest::Route::kJobs) {
      return absl::InvalidArgumentError("/api/v1/jobs takes no parameters");
    }
    if (kv.first == "first" || kv.first == "last" || kv.first == "since") {
      auto step = ParseStep(kv.first, value);
      if (!step.ok()) return step.status();
      (kv.first == "first"  ? request.first
       : kv.first == "last" ? request.last
                            : request.since) = *step;
    } else if (kv.first == "rank" && request.route == ApiRequest::Route::kRanks) {
      uint32_t rank = 0;
      if (value.empty() || value.size() > 10 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return absl::ascii_isdigit(c); }) ||
          !absl::SimpleAtoi(value, &rank)) {
        return absl::InvalidArgumentError("rank must be a decimal integer from 0 to 4294967295");
      }
      request.rank = rank;
    } else if (kv.first == "changes" && request.route == ApiRequest::Route::kRanks) {
      request.changes = ParseChangeCursor(value);
      if (!request.changes.has_value()) {
        return absl::InvalidArgumentError(
            "changes must be the cursor of an earlier answer (its \"changes\" field)");
      }
    } else if (kv.first == "token") {
      // The token as a parameter is read by the server (for links a browser opens); not here.
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown parameter (", kv.first.size(),
                       " characters): steps takes first, last and since, ranks first, last, "
                       "since, changes and rank"));
    }
  }
  if (request.changes.has_value() && request.rank.has_value()) {
    return absl::InvalidArgumentError(
        "changes and rank exclude each other: changes=C re-reads the rank matrix's steps");
  }
  if (request.since.has_value()) {
    // With changes, first is where the window the caller holds begins (web_api.h).
    if (request.first.has_value() && !request.changes.has_value()) {
      return absl::InvalidArgumentError(
          "since and first exclude each other: since=S answers the steps after S");
    }
    if (*request.since >= kMaxStoredStep) {
      return absl::InvalidArgumentError(
          absl::StrCat("since must be below ", kMaxStoredStep, ": no step follows it"));
    }
    if (request.last.has_value() && *request.since >= *request.last) {
      return absl::InvalidArgumentError(absl::StrCat("since (", *request.since,
                                                     ") must be below last (", *request.last,
                                                     "): since=S answers the steps after S"));
    }
  }
  if (request.first.has_value() && request.last.has_value() && !request.since.has_value()) {
    if (absl::Status range = CheckStepRange(*request.first, *request.last); !range.ok()) {
      return range;
    }
  }
  return request;
}

StepWindow ResolveWindow(const ApiRequest& request, uint64_t newest_step, uint64_t default_window) {
  StepWindow w;
  if (request.last.has_value()) {
    w.last = *request.last;
  } else {
    w.last = std::max(newest_step, request.first.value_or(0));
  }
  const uint64_t span = std::max<uint64_t>(default_window, 1) - 1;
  const uint64_t window_first = w.last > span ? w.last - span : 0;
  if (request.first.has_value() && !request.since.has_value()) {
    w.first = *request.first;
  } else if (request.since.has_value()) {
    // The steps after `since`, at most the default window's newest (a page that fell far behind
    // gets the newest window, not the oldest steps it missed). since < INT64_MAX (parsed).
    w.first = std::max(*request.since + 1, window_first);
    w.last = std::max(w.last, w.first);
  } else {
    w.first = window_first;
  }
  return w;
}

StepWindow HeldWindow(const ApiRequest& request, uint64_t newest_step, uint64_t default_window) {
  if (!request.changes.has_value()) return StepWindow{1, 0};
  if (!request.since.has_value()) return ResolveWindow(request, newest_step, default_window);
  const StepWindow window = ResolveWindow(request, newest_step, default_window);
  const uint64_t span = std::max<uint64_t>(default_window, 1) - 1;
  StepWindow held;
  held.first = request.first.value_or(window.last > span ? window.last - span : 0);
  held.last = std::min(*request.since, window.last);
  if (held.first > held.last) return StepWindow{1, 0};
  return held;
}

std::string WithChanges(std::string json, const ChangeCursor& cursor, bool resync) {
  if (json.empty() || json.back() != '}') return json;
  json.pop_back();
  json.append(",\"changes\":");
  AppendJsonString(FormatChangeCursor(cursor), &json);
  if (resync) json.append(",\"resync\":true");
  json.push_back('}');
  return json;
}

std::string JobsJson(const std::vector<JobListEntry>& jobs,
                     const std::vector<std::string>& unreachable) {
  std::string out = "{\"jobs\":[";
  for (size_t i = 0; i < jobs.size(); ++i) {
    const v1::JobInfo& info = jobs[i].info;
    if (i > 0) out.push_back(',');
    out.push_back('{');
    const auto [job, group] = SplitGroupKey(info.job());
    Key("key", &out);
    AppendJsonString(info.job(), &out);
    out.append(",\"job\":");
    AppendJsonString(job, &out);
    out.append(",\"group\":");
    AppendJsonString(group, &out);
    out.append(",\"state\":");
    AppendJsonString(info.state(), &out);
    absl::StrAppend(&out, ",\"world_size\":", info.world_size(),
                    ",\"connected_ranks\":", info.connected_ranks(),
                    ",\"last_step\":", info.last_step(), ",\"first_seen\":");
    AppendDouble(static_cast<double>(info.first_seen_unix_nanos()) * 1e-9, 16, &out);
    out.append(",\"last_seen\":");
    AppendDouble(static_cast<double>(info.last_seen_unix_nanos()) * 1e-9, 16, &out);
    out.append(",\"latest\":");
    if (!jobs[i].latest.has_value()) {
      out.append("null");
    } else {
      const StepRow& row = *jobs[i].latest;
      absl::StrAppend(&out, "{\"step\":", row.step, ",\"ranks\":", row.ranks,
                      ",\"world_size\":", row.world_size, ",\"grad_cosine_mean\":");
      AppendDouble(row.grad_cosine_mean, 6, &out);
      AppendStepFlags(row, &out);
      out.push_back('}');
    }
    if (!jobs[i].collector.empty()) {
      out.append(",\"collector\":");
      AppendJsonString(jobs[i].collector, &out);
      out.append(jobs[i].remote ? ",\"remote\":true" : ",\"remote\":false");
    }
    out.push_back('}');
  }
  out.push_back(']');
  if (!unreachable.empty()) {
    out.append(",\"unreachable\":[");
    for (size_t i = 0; i < unreachable.size(); ++i) {
      if (i > 0) out.push_back(',');
      AppendJsonString(unreachable[i], &out);
    }
    out.push_back(']');
  }
  out.push_back('}');
  return out;
}

std::string StepsJson(absl::string_view job, StepWindow window, const std::vector<StepRow>& steps,
                      bool truncated) {
  std::string out = "{";
  AppendWindow(job, window, truncated, &out);
  out.append(",\"steps\":[");
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepRow& row = steps[i];
    if (i > 0) out.push_back(',');
    absl::StrAppend(&out, "{\"step\":", row.step, ",\"ranks\":", row.ranks,
                    ",\"world_size\":", row.world_size);
    const std::pair<absl::string_view, double> values[] = {
        {"loss_mean", row.loss_mean},
        {"loss_std", row.loss_std},
        {"loss_range", row.loss_range},
        {"grad_norm_mean", row.grad_norm_mean},
        {"grad_norm_std", row.grad_norm_std},
        {"grad_norm_cv", row.grad_norm_cv},
        {"grad_cosine_mean", row.grad_cosine_mean},
        {"grad_noise_scale", row.grad_noise_scale}};
    for (const auto& [name, value] : values) {
      out.push_back(',');
      Key(name, &out);
      AppendDouble(value, 6, &out);
    }
    AppendStepFlags(row, &out);
    out.push_back('}');
  }
  out.append("]}");
  return out;
}

std::string RanksJson(absl::string_view job, StepWindow window, uint32_t world_size,
                      const std::vector<StepRankRow>& rows, bool truncated,
                      uint64_t downsampled_before, const std::vector<RankWindowRow>& windows) {
  uint32_t width = world_size;
  for (const StepRankRow& r : rows) width = std::max(width, r.row.rank + 1);
  for (const RankWindowRow& w : windows) width = std::max(width, w.rank + 1);
  std::string out = "{";
  AppendWindow(job, window, truncated, &out);
  absl::StrAppend(&out, ",\"world_size\":", width, ",\"steps\":[");
  // Per step: the rank's row index in `rows`, or -1.
  std::vector<int64_t> at(width, -1);
  bool first_step = true;
  for (size_t begin = 0; begin < rows.size();) {
    size_t end = begin;
    const uint64_t step = rows[begin].step;
    std::fill(at.begin(), at.end(), -1);
    while (end < rows.size() && rows[end].step == step) {
      at[rows[end].row.rank] = static_cast<int64_t>(end);
      ++end;
    }
    if (!first_step) out.push_back(',');
    first_step = false;
    absl::StrAppend(&out, "{\"step\":", step, ",");
    AppendHeatmapCells(
        at, world_size, [&](int64_t i) { return rows[i].row.grad_cosine; },
        [&](int64_t i) { return rows[i].row.outlier_score; },
        [&](int64_t i) { return RowNonfinite(rows[i]); },
        [&](int64_t i) {
          const std::optional<bool>& ok = rows[i].row.replica_ok;
          return ok.has_value() && !*ok;
        },
        &out);
    out.push_back('}');
    begin = end;
  }
  out.append("]");
  if (downsampled_before > 0 || !windows.empty()) {
    absl::StrAppend(&out, ",\"downsampled_before\":", downsampled_before, ",\"windows\":[");
    std::vector<int64_t> at(width, -1);
    for (size_t begin = 0; begin < windows.size();) {
      size_t end = begin;
      const uint64_t first = windows[begin].first_step;
      std::fill(at.begin(), at.end(), -1);
      while (end < windows.size() && windows[end].first_step == first) {
        at[windows[end].rank] = static_cast<int64_t>(end);
        ++end;
      }
      if (begin > 0) out.push_back(',');
      absl::StrAppend(&out, "{\"first\":", first, ",\"last\":", windows[begin].last_step, ",");
      AppendHeatmapCells(
          at, world_size, [&](int64_t i) { return windows[i].grad_cosine.min; },
          [&](int64_t i) { return windows[i].outlier_score.max; },
          [&](int64_t i) { return windows[i].nonfinite > 0; },
          [&](int64_t i) { return windows[i].replica_bad > 0; }, &out);
      out.push_back('}');
      begin = end;
    }
    out.append("]");
  }
  out.append("}");
  return out;
}

std::string RankSeriesJson(absl::string_view job, StepWindow window, uint32_t rank,
                           const std::vector<StepRankRow>& rows, bool truncated,
                           const std::vector<std::string>* bucket_names) {
  static const std::vector<std::string> kNoNames;
  const std::vector<std::string>& names = bucket_names != nullptr ? *bucket_names : kNoNames;
  std::string out = "{";
  AppendWindow(job, window, truncated, &out);
  absl::StrAppend(&out, ",\"rank\":", rank, ",\"steps\":[");
  bool first = true;
  for (const StepRankRow& r : rows) {
    if (r.row.rank != rank) continue;
    if (!first) out.push_back(',');
    first = false;
    absl::StrAppend(&out, "{\"step\":", r.step, ",\"loss\":");
    AppendDouble(r.row.loss, 6, &out);
    out.append(",\"grad_norm\":");
    AppendDouble(r.row.grad_norm, 6, &out);
    out.append(",\"cosine\":");
    AppendOptional(r.row.grad_cosine, 6, &out);
    out.append(",\"outlier\":");
    AppendOptional(r.row.outlier_score, 6, &out);
    out.append(",\"loss_z\":");
    AppendOptional(r.row.loss_z, 6, &out);
    out.append(",\"grad_norm_z\":");
    AppendOptional(r.row.grad_norm_z, 6, &out);
    out.append(",\"step_time_z\":");
    AppendOptional(r.row.step_time_z, 6, &out);
    if (!r.row.deviating_buckets.empty()) {
      // Where in the model: the buckets that carry a flagged rank's deviation.
      out.append(",\"deviating_buckets\":");
      AppendJsonString(r.row.deviating_buckets, &out);
    }
    if (!r.row.bucket_z.empty()) {
      // Every bucket's robust z where kept, and the deviating ones named, worst first.
      out.append(",\"bucket_z\":[");
      for (size_t b = 0; b < r.row.bucket_z.size(); ++b) {
        if (b > 0) out.push_back(',');
        AppendDouble(r.row.bucket_z[b], 4, &out);
      }
      out.append("],\"buckets\":[");
      bool first_bucket = true;
      for (const BucketDeviation& d : DeviatingBuckets(r.row.bucket_z)) {
        if (!first_bucket) out.push_back(',');
        first_bucket = false;
        absl::StrAppend(&out, "{\"bucket\":", d.bucket, ",\"name\":");
        AppendJsonString(
            d.bucket < names.size() ? names[d.bucket] : absl::StrCat("bucket ", d.bucket), &out);
        out.append(",\"z\":");
        AppendDouble(d.z, 4, &out);
        out.push_back('}');
      }
      out.push_back(']');
    }
    absl::StrAppend(&out, ",\"nonfinite\":", RowNonfinite(r) ? "true" : "false", ",\"replica_ok\":",
                    !r.row.replica_ok.has_value() ? "null"
                    : *r.row.replica_ok           ? "true"
                                                  : "false",
                    "}");
  }
  out.append("],\"bucket_names\":[");
  for (size_t b = 0; b < names.size(); ++b) {
    if (b > 0) out.push_back(',');
    AppendJsonString(names[b], &out);
  }
  out.append("],\"bucket_z_threshold\":");
  AppendDouble(kBucketZThreshold, 6, &out);
  out.append("}");
  return out;
}

std::string ErrorJson(const absl::Status& status) {
  std::string out = "{\"error\":{\"code\":";
  AppendJsonString(absl::StatusCodeToString(status.code()), &out);
  out.append(",\"message\":");
  AppendJsonString(status.message(), &out);
  out.append("}}");
  return out;
}

int HttpStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

}  // namespace rankscope::collector
