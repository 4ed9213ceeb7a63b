#include "collector/model/rank_ranges.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rankscope::collector {

std::string FormatRankRanges(absl::Span<const uint32_t> ranks, size_t max_runs) {
  std::string out;
  size_t runs = 0;
  size_t i = 0;
  while (i < ranks.size() && runs < max_runs) {
    const uint32_t first = ranks[i];
    uint32_t last = first;
    ++i;
    while (i < ranks.size() && (ranks[i] == last || ranks[i] == last + 1)) last = ranks[i++];
    absl::StrAppend(&out, out.empty() ? "" : ",", first);
    if (last != first) absl::StrAppend(&out, "-", last);
    ++runs;
  }
  if (i < ranks.size()) {
    uint64_t more = 0;
    for (size_t j = i; j < ranks.size(); ++j) more += (j == i || ranks[j] != ranks[j - 1]) ? 1 : 0;
    absl::StrAppend(&out, out.empty() ? "+" : ",+", more);
  }
  return out;
}

uint64_t RankRanges::count() const {
  uint64_t n = more;
  for (const auto& [first, last] : runs) n += uint64_t{last} - first + 1;
  return n;
}

bool ParseRankRanges(absl::string_view text, RankRanges* out) {
  *out = RankRanges();
  bool ended = false;  // a "+N" item is the last one
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    if (ended) return false;
    if (item.front() == '+') {
      if (!absl::SimpleAtoi(item.substr(1), &out->more)) return false;
      ended = true;
      continue;
    }
    const size_t dash = item.find('-');
    uint32_t first = 0;
    uint32_t last = 0;
    if (dash == absl::string_view::npos) {
      if (!absl::SimpleAtoi(item, &first)) return false;
      last = first;
    } else if (!absl::SimpleAtoi(item.substr(0, dash), &first) ||
               !absl::SimpleAtoi(item.substr(dash + 1), &last) || last < first) {
      return false;
    }
    out->runs.emplace_back(first, last);
  }
  return true;
}

std::vector<uint32_t> ListedRanks(const RankRanges& ranges, size_t limit) {
  std::vector<uint32_t> out;
  for (const auto& [first, last] : ranges.runs) {
    for (uint64_t r = first; r <= last && out.size() < limit; ++r) {
      out.push_back(static_cast<uint32_t>(r));
    }
    if (out.size() >= limit) break;
  }
  return out;
}

}  // namespace rankscope::collector
