#include "collector/analysis/replica_sets.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

namespace rankscope::collector {

namespace {

struct OneSet {
  std::vector<RankFingerprint> fingerprints;
  std::vector<RankReplicaSummary> summaries;
};

}  // namespace

ReplicaSetsVerdict CheckReplicaSets(absl::Span<const RankReplica> ranks, double reduction) {
  ReplicaSetsVerdict out;
  // std::map: the sets in a fixed order (nullopt, the set of ranks that send none, first).
  std::map<std::optional<uint32_t>, OneSet> sets;
  for (const RankReplica& r : ranks) {
    OneSet& set = sets[r.replica_set];
    set.fingerprints.push_back({r.rank, r.fingerprint});
    if (r.summary) set.summaries.push_back({r.rank, r.fingerprint, *r.summary});
  }
  out.sets = sets.size();
  for (const auto& [set, members] : sets) {
    ReplicaVerdict v;
    if (members.summaries.size() == members.fingerprints.size() && !std::isnan(reduction)) {
      ToleranceVerdict t = CheckReplicasWithTolerance(members.summaries, reduction);
      out.tolerance = true;
      out.within_tolerance.insert(out.within_tolerance.end(), t.within_tolerance.begin(),
                                  t.within_tolerance.end());
      out.worst_ratio =
          std::isnan(out.worst_ratio) ? t.worst_ratio : std::max(out.worst_ratio, t.worst_ratio);
      v = std::move(t.verdict);
    } else {
      v = CheckReplicas(members.fingerprints);
    }
    out.verdict.checked = out.verdict.checked || v.checked;
    out.verdict.ambiguous = out.verdict.ambiguous || v.ambiguous;
    if (sets.size() == 1) out.verdict.majority = v.majority;
    out.verdict.divergent_ranks.insert(out.verdict.divergent_ranks.end(), v.divergent_ranks.begin(),
                                       v.divergent_ranks.end());
  }
  std::sort(out.verdict.divergent_ranks.begin(), out.verdict.divergent_ranks.end());
  std::sort(out.within_tolerance.begin(), out.within_tolerance.end());
  return out;
}

}  // namespace rankscope::collector
