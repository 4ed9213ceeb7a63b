// Conversions from the store's rows to the Query service's wire messages. Shared by the query
// service (rows read by the collector) and the CLI (rows read from a SQLite file with --db), so
// both paths give the same output.
#ifndef RANKSCOPE_COLLECTOR_QUERY_ROW_PROTO_H_
#define RANKSCOPE_COLLECTOR_QUERY_ROW_PROTO_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collector/model/rank_windows.h"
#include "collector/model/rows.h"
#include "collector/model/step_summary.h"
#include "collector/store/sqlite_store.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

// Fills the statistics *out shares with StepSummary (collector/model/step_summary.h): the one
// place they are copied into the wire message.
void FillStepSummary(const StepSummary& summary, v1::StepStats* out);

// Fills *out from a step_stats row (its StepSummary through FillStepSummary).
void FillStepStats(const StepRow& row, v1::StepStats* out);

// Fills *out from a rank_steps row; optional columns that are NULL stay unset.
void FillRankStep(const StepRankRow& in, v1::RankStep* out);

// Fills *out from a rank_windows row; a metric with no value in the window stays unset.
void FillRankWindow(const RankWindowRow& in, v1::RankWindow* out);

// Sets out->downsampled_before_step from the store and adds the rank_windows rows overlapping
// [first_step, min(last_step, downsampled_before_step - 1)] (at most `limit`; more sets
// truncated). Used with the rank rows of a range (query service, CLI --db).
absl::Status FillRankWindows(SqliteStore& store, absl::string_view job, uint64_t first_step,
                             uint64_t last_step, int limit, v1::StepRangeResponse* out);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_QUERY_ROW_PROTO_H_
