// A set of ranks written compactly, for the ranks missing from a step (step_stats.missing_ranks,
// StepStats.missing_rank_ranges): ascending runs "first-last" or single ranks, comma-separated,
// at most `max_runs` of them; the ranks beyond are counted in a last item "+N" ("0-5,9,+999990").
// The text of a sorted list of N ranks is at most max_runs * 24 bytes whatever N, so a job
// claiming a world size of 1,000,000 cannot make each step's row megabytes long. A plain list
// ("3,7", what older collectors stored) is valid text.
//
// Pure functions, no state.
#ifndef RANKSCOPE_COLLECTOR_MODEL_RANK_RANGES_H_
#define RANKSCOPE_COLLECTOR_MODEL_RANK_RANGES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace rankscope::collector {

inline constexpr size_t kMaxMissingRankRuns = 64;

// `ranks` sorted ascending (duplicates allowed, written once).
std::string FormatRankRanges(absl::Span<const uint32_t> ranks,
                             size_t max_runs = kMaxMissingRankRuns);

struct RankRanges {
  std::vector<std::pair<uint32_t, uint32_t>> runs;  // [first, last], as written
  uint64_t more = 0;                                // the "+N" item: ranks not listed
  uint64_t count() const;                           // ranks listed + more
};

// Parses FormatRankRanges' text (or a plain list). False on anything else.
bool ParseRankRanges(absl::string_view text, RankRanges* out);

// The first `limit` ranks listed in `ranges`, ascending as written.
std::vector<uint32_t> ListedRanks(const RankRanges& ranges, size_t limit);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_RANK_RANGES_H_
