#include "common/collector_shard.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rankscope {
namespace {

constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;

uint64_t FnvAppend(uint64_t h, absl::string_view bytes) {
  for (const char c : bytes) {
    h ^= static_cast<uint8_t>(c);
    h *= kFnvPrime;
  }
  return h;
}

// splitmix64's finalizer: FNV-1a's low bits mix poorly when only the end of the input differs.
uint64_t Mix(uint64_t h) {
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseCollectorList(absl::string_view list) {
  if (absl::StripAsciiWhitespace(list).empty()) {
    return absl::InvalidArgumentError("the collector list is empty; give host:port[,host:port...]");
  }
  std::vector<std::string> shards;
  int index = 0;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    ++index;
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry ", index, " of the collector list '", list, "' is empty"));
    }
    if (std::any_of(entry.begin(), entry.end(),
                    [](char c) { return absl::ascii_isspace(static_cast<unsigned char>(c)); })) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry ", index, " of the collector list ('", entry, "') holds a space"));
    }
    if (std::find(shards.begin(), shards.end(), entry) == shards.end()) {
      shards.emplace_back(entry);
    }
  }
  return shards;
}

uint64_t RendezvousWeight(absl::string_view address, absl::string_view job) {
  uint64_t h = FnvAppend(kFnvOffsetBasis, address);
  h = FnvAppend(h, absl::string_view("\0", 1));
  return Mix(FnvAppend(h, job));
}

const std::string& PickCollector(absl::Span<const std::string> shards, absl::string_view job) {
  size_t best = 0;
  uint64_t best_weight = RendezvousWeight(shards[0], job);
  for (size_t i = 1; i < shards.size(); ++i) {
    const uint64_t weight = RendezvousWeight(shards[i], job);
    if (weight > best_weight || (weight == best_weight && shards[i] < shards[best])) {
      best = i;
      best_weight = weight;
    }
  }
  return shards[best];
}

}  // namespace rankscope
