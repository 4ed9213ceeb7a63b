#include "collector/query/job_listing.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "collector/pipeline/pipeline.h"

namespace rankscope::collector {

std::vector<v1::JobInfo> MergeJobs(const std::vector<JobRow>& stored,
                                   const std::vector<JobSummary>& live) {
  absl::flat_hash_map<std::string, v1::JobInfo> jobs;
  for (const JobRow& row : stored) {
    v1::JobInfo& info = jobs[row.job];
    info.set_job(row.job);
    info.set_world_size(row.world_size);
    info.set_sketch_dim(row.sketch_dim);
    info.set_sketch_seed(row.sketch_seed);
    info.set_first_seen_unix_nanos(absl::ToUnixNanos(row.first_seen));
    info.set_last_seen_unix_nanos(absl::ToUnixNanos(row.last_seen));
    info.set_last_step(row.last_step);
    info.set_state("idle");
  }
  for (const JobSummary& s : live) {
    v1::JobInfo& info = jobs[s.job];
    info.set_job(s.job);
    info.set_world_size(s.identity.world_size);
    info.set_sketch_dim(s.identity.sketch_dim);
    info.set_sketch_seed(s.identity.sketch_seed);
    if (info.first_seen_unix_nanos() == 0) {
      info.set_first_seen_unix_nanos(absl::ToUnixNanos(s.first_seen));
    }
    info.set_last_seen_unix_nanos(
        std::max(info.last_seen_unix_nanos(), absl::ToUnixNanos(s.last_seen)));
    info.set_last_step(std::max(info.last_step(), s.newest_step));
    info.set_connected_ranks(s.connected);
    info.set_state(s.connected > 0 ? "active" : "idle");
  }
  std::vector<v1::JobInfo> out;
  out.reserve(jobs.size());
  for (auto& [name, info] : jobs) out.push_back(std::move(info));
  std::sort(out.begin(), out.end(),
            [](const v1::JobInfo& a, const v1::JobInfo& b) { return a.job() < b.job(); });
  return out;
}

absl::StatusOr<std::vector<v1::JobInfo>> ListKnownJobs(SqliteStore& reader,
                                                       const StepPipeline& pipeline) {
  auto stored = reader.ListJobs();
  if (!stored.ok()) return stored.status();
  return MergeJobs(*stored, pipeline.ListJobs());
}

}  // namespace rankscope::collector
