// The collector's HTTP JSON API (docs/DESIGN.md "Web view"), as pure functions: parsing a request
// into what to read, and building each answer's JSON from store rows. web_server.cc does the
// HTTP, the token and the reads (on the StoreReaderPool); everything here is tested directly.
//
//   GET /api/v1/jobs                                   every job key, with its latest step's alerts
//   GET /api/v1/jobs/NAME/steps?first=F&last=L         step_stats rows of steps F..L
//   GET /api/v1/jobs/NAME/ranks?first=F&last=L[&rank=R]
//       every rank's consensus cosine and outlier score per step (a rank x step matrix, one
//       array per step indexed by rank), or with rank=R that rank's own series (read alone:
//       SqliteStore::RankSeriesInRange)
//   ...?since=S (steps and ranks, instead of first): only the steps after S, for a page that
//       already holds S and before. The window is then S+1..L (L as below), but never starts
//       before the default window's first step: a page that fell far behind gets the newest
//       window. Empty when nothing is newer than S.
//   ...&changes=C (ranks, the matrix only; C the "changes" cursor of an earlier matrix answer):
//       also the steps the caller holds whose rank rows were stored after C (a late report, a
//       step that closed after newer ones, a step joined again), each a whole step as in any
//       answer, so a page re-reads exactly what changed. The held steps are, with since,
//       first..since (first: where the caller's window begins, default the default window's
//       first step; first is allowed beside since only with changes), without since the whole
//       first..last window (which then answers only its changed steps). Where the collector
//       cannot say what changed since C (a cursor of another collector process, or older than
//       the collector's change log keeps: StepChangeLog), the answer holds every held step and
//       says "resync": true: the caller replaces what it holds.
//   Every matrix answer carries "changes": the cursor to pass next time (taken before the read).
//
// NAME is a job name or a group key "JOB/GROUP", its '/' literal or encoded as %2F. `last`
// defaults to the job's newest step, `first` to a window before it (kDefaultStepsWindow,
// kDefaultRanksWindow). The limits are Query's (query_checks.h): a steps answer holds at most
// kStepRangeDefaultLimit steps, a ranks answer at most kStepRangeMaxLimit rank rows (whole steps);
// a longer range is answered from `first` on and says "truncated": true. first > last, since
// with first, since >= last, a value
// that is not a decimal uint64 (or above INT64_MAX, the store's bound) and a bad name are
// InvalidArgument (400); an unknown job and an unknown path NotFound (404).
//
// JSON numbers: non-finite values are null (JSON has no NaN); doubles keep 6 significant digits
// in the steps answer, 4 in the rank matrix. Times are Unix seconds.
//
// Thread-safe (pure functions).
#ifndef RANKSCOPE_COLLECTOR_WEB_WEB_API_H_
#define RANKSCOPE_COLLECTOR_WEB_WEB_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collector/model/change_cursor.h"
#include "collector/model/rank_windows.h"
#include "collector/model/rows.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

// Steps answered when a request names no `first`.
inline constexpr uint64_t kDefaultStepsWindow = 300;
inline constexpr uint64_t kDefaultRanksWindow = 120;

struct ApiRequest {
  enum class Route { kJobs, kSteps, kRanks };
  Route route = Route::kJobs;
  std::string job;  // kSteps, kRanks: the job key, checked by CheckQueryJobName
  std::optional<uint64_t> first;
  std::optional<uint64_t> last;
  std::optional<uint64_t> since;  // only steps after it; never with `first`, always < INT64_MAX
  std::optional<uint32_t> rank;   // kRanks: one rank's series
  std::optional<ChangeCursor> changes;  // kRanks without rank: re-read the steps changed since
};

// `path`: the URL path after "/api/v1" (e.g. "/jobs/exp-42/steps"), percent-decoded or not;
// `query`: the raw query string without '?'. Errors: InvalidArgument (bad name, bad number,
// first > last, unknown parameter), NotFound (no such route).
absl::StatusOr<ApiRequest> ParseApiRequest(absl::string_view path, absl::string_view query);

// The steps a request reads: [first, last] with the defaults above applied against the job's
// newest step (first is clamped at 0); with `since`, first = max(since + 1, the default window's
// first) and last at least first. Always first <= last.
struct StepWindow {
  uint64_t first = 0;
  uint64_t last = 0;
};
StepWindow ResolveWindow(const ApiRequest& request, uint64_t newest_step, uint64_t default_window);

// With `changes`, the steps the caller holds (whose changes are answered again): with since,
// [first (default: the default window's first step), min(since, last)]; without, the window
// ResolveWindow gives. Empty (first > last) without `changes`.
StepWindow HeldWindow(const ApiRequest& request, uint64_t newest_step, uint64_t default_window);

// One job key of the jobs answer: its listing and its newest step_stats row (absent before the
// first step closes).
struct JobListEntry {
  v1::JobInfo info;
  std::optional<StepRow> latest;
  // A fleet (--fleet): the collector that holds the job (its address in the fleet's list), and
  // whether that is another shard (listed from its Query service, without `latest`).
  std::string collector;
  bool remote = false;
};

// {"jobs":[{"key","job","group","state","world_size","connected_ranks","last_step",
//   "first_seen","last_seen","latest":null|{"step","ranks","world_size","missing_ranks",
//   "timed_out","outlier_ranks","divergent_ranks","drifting_ranks","slow_ranks",
//   "grad_cosine_mean","completed_at"}}]}; `group` is "" for a job's only group. In a fleet each
// entry also has "collector" and "remote", and `unreachable` (non-empty) adds
// ,"unreachable":[shards whose jobs could not be listed].
std::string JobsJson(const std::vector<JobListEntry>& jobs,
                     const std::vector<std::string>& unreachable = {});

// {"job","first","last","truncated","steps":[{"step","ranks","world_size","loss_mean",
//   "loss_std","loss_range","grad_norm_mean","grad_norm_std","grad_norm_cv","grad_cosine_mean",
//   "grad_noise_scale","missing_ranks","timed_out","outlier_ranks","divergent_ranks",
//   "drifting_ranks","slow_ranks","completed_at"}]}, oldest step first.
std::string StepsJson(absl::string_view job, StepWindow window, const std::vector<StepRow>& steps,
                      bool truncated);

// The rank x step matrix of `rows` (ordered by step, then rank):
// {"job","first","last","world_size","truncated","steps":[{"step","cosine":[W],"outlier":[W],
//   "missing":[ranks],"nonfinite":[ranks],"divergent":[ranks]}]}. cosine[r]/outlier[r] are null
// where rank r has no row or no value; `missing` lists the ranks < world_size without a row at
// that step, `nonfinite` those whose stored `nonfinite` column is set (StepRankRow::nonfinite:
// the loss, gradient norm or sketch was NaN/Inf), `divergent` those whose
// replica fingerprint disagreed. world_size is the larger of `world_size` and the highest rank + 1.
//
// Where retention downsampled the job's rank rows (steps below `downsampled_before`, 0: none),
// the answer also says so and carries the rank_windows rows overlapping the window (ordered by
// first_step, then rank), one entry per window of steps: ,"downsampled_before":B,
// "windows":[{"first","last","cosine":[W] (each rank's lowest),"outlier":[W] (highest),
// "missing":[ranks without a row],"nonfinite":[ranks with a non-finite row],
// "divergent":[ranks with a replica mismatch]}]. In those steps `steps` holds only the rows
// retention kept (flagged ones).
std::string RanksJson(absl::string_view job, StepWindow window, uint32_t world_size,
                      const std::vector<StepRankRow>& rows, bool truncated,
                      uint64_t downsampled_before = 0,
                      const std::vector<RankWindowRow>& windows = {});

// `json` (a RanksJson answer) with ,"changes":"CURSOR" and, when `resync`, ,"resync":true
// added at its end.
std::string WithChanges(std::string json, const ChangeCursor& cursor, bool resync);

// One rank's series: {"job","rank","first","last","truncated","steps":[{"step","loss",
// "grad_norm","cosine","outlier","loss_z","grad_norm_z","step_time_z","nonfinite",
// "replica_ok"}],"bucket_names":[names],"bucket_z_threshold"} from the rows of `rank` in `rows`
// (others are skipped); `nonfinite` is the stored column. Where in the model: a step whose row
// names deviating buckets also has "deviating_buckets" (the stored text), and a step whose
// per-bucket z were kept (flagged rows, every 100th step) "bucket_z":[z per bucket] and
// "buckets":[{"bucket","name","z"}], the buckets with |z| >= bucket_z_threshold (or NaN: null),
// worst first (bucket_scores.h DeviatingBuckets). `bucket_names`: the job's (the registry's,
// from its hello; null or short: "bucket B").
std::string RankSeriesJson(absl::string_view job, StepWindow window, uint32_t rank,
                           const std::vector<StepRankRow>& rows, bool truncated,
                           const std::vector<std::string>* bucket_names = nullptr);

// {"error":{"code":"INVALID_ARGUMENT","message":...}}
std::string ErrorJson(const absl::Status& status);

// The HTTP status for a refusal: InvalidArgument 400, Unauthenticated 401, PermissionDenied 403,
// NotFound 404, ResourceExhausted and Unavailable 503, DeadlineExceeded 504, anything else 500.
int HttpStatusFor(const absl::Status& status);

// Appends `s` to *out as a JSON string literal (quotes, escapes, control characters as \uXXXX).
void AppendJsonString(absl::string_view s, std::string* out);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_WEB_WEB_API_H_
