// Replica sets (issue 32; docs/DESIGN.md "Replica sets"). Pure functions.
//
// Under DDP every rank of a group holds the same parameters, so the replica check compares the
// group's ranks all against all. Under HSDP (FSDP2 on a 2-D mesh, replicate x shard) a rank
// holds one shard: the ranks of one shard index in the different replicas hold equal values,
// and ranks of different shard indices hold different values by design. Each rank says which
// set its parameter fingerprint belongs to (StepReport.replica_set: HSDP sends its shard index),
// and CheckReplicaSets compares the fingerprints (or, where every rank of the set sent one, the
// tolerance summaries, replica_tolerance.h) only within each set; a rank that sends no set is in
// the set of the ranks that send none, which for an agent that never sends one is the whole
// group: today's check, unchanged.
//
// Within a set the rule is CheckReplicas' (rank_diagnostics.h): the ranks that differ from a
// strict majority are named; with no strict majority every rank of that set is named and the
// verdict is ambiguous. So a set of two replicas that disagree names both (HSDP with two
// replicas: both ranks of the shard index; nothing says which one is right), and the other sets
// are not touched. A set of one rank has nothing to compare: it names no rank.
//
// The verdict is the union over the sets: checked when any set was (a fingerprint was sent),
// ambiguous when any set was, divergent_ranks the union; `majority` only when there is one set
// (otherwise the sets' values differ by design and no one value is the group's).
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_REPLICA_SETS_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_REPLICA_SETS_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/replica_tolerance.h"
#include "collector/model/rank_report.h"

namespace rankscope::collector {

// One rank's fingerprint, the replica set it belongs to, and its tolerance summary if it sent one.
struct RankReplica {
  uint32_t rank = 0;
  uint64_t fingerprint = 0;
  std::optional<uint32_t> replica_set;  // nullopt: the set of the ranks that send none
  std::optional<ReplicaSummary> summary;
};

struct ReplicaSetsVerdict {
  ReplicaVerdict verdict;  // the union over the sets (above)
  size_t sets = 0;         // how many sets had a fingerprint
  // Some set was compared with its summaries (every rank of it sent one, and `reduction` is a
  // number); then the union of the sets' within_tolerance (sorted) and their largest
  // worst_ratio (NaN when no set was).
  bool tolerance = false;
  std::vector<uint32_t> within_tolerance;
  double worst_ratio = std::numeric_limits<double>::quiet_NaN();
};

// `ranks`: every rank that sent a fingerprint. Each set is compared with
// CheckReplicasWithTolerance (`reduction` as there) when each of its ranks has a summary and
// `reduction` is not NaN, else bit for bit with CheckReplicas. Unchecked for an empty input.
ReplicaSetsVerdict CheckReplicaSets(absl::Span<const RankReplica> ranks, double reduction = 0.0);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_REPLICA_SETS_H_
