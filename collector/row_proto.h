// Conversions from the store's rows to the Query service's wire messages. Shared by the query
// service (rows read by the collector) and the CLI (rows read from a SQLite file with --db), so
// both paths give the same output.
#ifndef RANKSCOPE_COLLECTOR_ROW_PROTO_H_
#define RANKSCOPE_COLLECTOR_ROW_PROTO_H_

#include "collector/sqlite_store.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

// Fills *out from a step_stats row.
void FillStepStats(const StepRow& row, v1::StepStats* out);

// Fills *out from a rank_steps row; optional columns that are NULL stay unset.
void FillRankStep(const StepRankRow& in, v1::RankStep* out);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ROW_PROTO_H_
