// A fleet of collectors sharded by job (docs/deploy.md "A fleet of collectors"): which collector
// of a list a job's agents, the CLI and the web view talk to.
//
// A collector list is "host:port[,host:port...]" (--collector, $RANKSCOPE_COLLECTOR, the Python
// `collector=` argument). Every rank of a job must meet on one collector with no coordination,
// so the choice is a pure function of the job name and the set of addresses: rendezvous
// (highest-random-weight) hashing. Each (address, job) pair gets a weight; the job goes to the
// address of the highest weight. Properties callers rely on:
//   - the order of the list does not matter, and an address listed twice counts once;
//   - taking an address out of the list moves only the jobs that were on it (to the address of
//     their second-highest weight); adding one moves only the jobs that now weigh most there;
//   - the choice never looks at whether a collector is reachable: a shard that is down or slow
//     is retried by its agents, never skipped (a job must not move because one shard is slow).
//
// The weight is defined once, here, and is stable across releases and languages (changing it
// moves every job): FNV-1a 64 over the address's bytes, one 0x00 byte, and the job's bytes,
// then splitmix64's finalizer. In Python:
//
//   def rendezvous_weight(address: str, job: str) -> int:
//       h = 0xCBF29CE484222325
//       for b in address.encode() + b"\0" + job.encode():
//           h = ((h ^ b) * 0x100000001B3) & (2**64 - 1)
//       h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
//       h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
//       return h ^ (h >> 31)
//
// Thread-safe (pure functions).
#ifndef RANKSCOPE_COMMON_COLLECTOR_SHARD_H_
#define RANKSCOPE_COMMON_COLLECTOR_SHARD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace rankscope {

// The addresses of a collector list: split at commas, spaces around each entry removed, an entry
// equal to an earlier one dropped (so "a:1,b:1,a:1" is the fleet {a:1, b:1}), in the order
// given. InvalidArgument when the list or one of its entries is empty ("a:1,,b:1", "a:1,") or
// an entry holds a space inside.
absl::StatusOr<std::vector<std::string>> ParseCollectorList(absl::string_view list);

// The rendezvous weight of `job` on the collector at `address` (see the file comment).
uint64_t RendezvousWeight(absl::string_view address, absl::string_view job);

// The address of `shards` (non-empty, as ParseCollectorList returns it) that `job` goes to: the
// highest RendezvousWeight, a tie going to the smaller address, so the result does not depend
// on the order of `shards`.
const std::string& PickCollector(absl::Span<const std::string> shards, absl::string_view job);

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_COLLECTOR_SHARD_H_
