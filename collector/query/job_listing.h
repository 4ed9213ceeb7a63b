// The jobs a collector knows: the stored jobs table merged with the pipeline's live jobs, one
// JobInfo per job key (a job name or "JOB/GROUP"), sorted by key. Shared by Query.ListJobs and
// the HTTP API's /api/v1/jobs so both list the same jobs in the same states.
//
// Thread safety: ListKnownJobs runs on a StoreReaderPool thread with that thread's connection;
// it takes the pipeline's lock briefly (StepPipeline::ListJobs).
#ifndef RANKSCOPE_COLLECTOR_QUERY_JOB_LISTING_H_
#define RANKSCOPE_COLLECTOR_QUERY_JOB_LISTING_H_

#include <vector>

#include "absl/status/statusor.h"
#include "collector/pipeline/job_registry.h"
#include "collector/store/sqlite_store.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

class StepPipeline;

// Pure: `stored` rows (state "idle") overlaid with `live` summaries (state "active" while a rank
// is connected; the newest step and last-seen time are the larger of both), sorted by job key.
std::vector<v1::JobInfo> MergeJobs(const std::vector<JobRow>& stored,
                                   const std::vector<JobSummary>& live);

// MergeJobs of reader.ListJobs() and pipeline.ListJobs(). Errors: the store's.
absl::StatusOr<std::vector<v1::JobInfo>> ListKnownJobs(SqliteStore& reader,
                                                       const StepPipeline& pipeline);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_QUERY_JOB_LISTING_H_
