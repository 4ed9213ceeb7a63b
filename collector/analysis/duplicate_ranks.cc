#include "collector/analysis/duplicate_ranks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rankscope::collector {
namespace {

// One usable sketch: finite, nonzero, of the step's length.
struct Candidate {
  uint32_t rank = 0;
  SketchView sketch;
  double norm = 0.0;
  uint64_t hash = 0;
};

uint64_t Mix(uint64_t x) {  // SplitMix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A hash of the sketch's bits (not its values: -0.0 and 0.0 differ, as do NaN payloads, which
// never reach here), in its encoding, with its scale.
uint64_t HashBits(const SketchView& sketch) {
  uint32_t scale_bits = 0;
  if (sketch.encoding != SketchEncoding::kFloat32) {
    std::memcpy(&scale_bits, &sketch.scale, sizeof scale_bits);
  }
  uint64_t h = Mix(sketch.size() ^ (static_cast<uint64_t>(sketch.encoding) << 56) ^
                   (static_cast<uint64_t>(scale_bits) << 16));
  const auto* bytes = static_cast<const unsigned char*>(sketch.data);
  const size_t n = sketch.byte_size();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    uint32_t word;
    std::memcpy(&word, bytes + i, sizeof word);
    h = Mix(h ^ word);
  }
  for (; i < n; ++i) h = Mix(h ^ bytes[i]);
  return h;
}

// True iff a and b hold the same bits in the same encoding (and scale).
bool SameBits(const SketchView& a, const SketchView& b) {
  if (a.encoding != b.encoding || a.size() != b.size()) return false;
  if (a.encoding != SketchEncoding::kFloat32 &&
      std::memcmp(&a.scale, &b.scale, sizeof a.scale) != 0) {
    return false;
  }
  return std::memcmp(a.data, b.data, a.byte_size()) == 0;
}

double Cosine(const Candidate& a, const Candidate& b) {
  return SketchDot(a.sketch, b.sketch) / (a.norm * b.norm);
}

class UnionFind {
 public:
  explicit UnionFind(size_t n) : parent_(n) { std::iota(parent_.begin(), parent_.end(), 0); }
  size_t Find(size_t x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }
  // Joins the sets of a and b; the smaller index becomes the root (deterministic).
  void Union(size_t a, size_t b) {
    a = Find(a);
    b = Find(b);
    if (a == b) return;
    if (a > b) std::swap(a, b);
    parent_[b] = a;
  }

 private:
  std::vector<size_t> parent_;
};

}  // namespace

// Long: one algorithm in its passes (hash and band the sketches, confirm candidates by their
// cosine, union and order the groups) that share the candidates and the union-find.
std::vector<DuplicateGroup> FindDuplicateRanks(absl::Span<const RankSample> samples,
                                               const DuplicateOptions& options) {
  // Usable sketches in ascending rank order, so the result does not depend on input order.
  std::vector<Candidate> candidates;
  candidates.reserve(samples.size());
  size_t dim = 0;
  for (const RankSample& s : samples) {
    if (s.sketch.empty()) continue;
    if (dim == 0) dim = s.sketch.size();
    if (s.sketch.size() != dim) continue;
    const double sum_sq = SketchDot(s.sketch, s.sketch);
    if (!std::isfinite(sum_sq) || sum_sq == 0.0) continue;
    candidates.push_back({s.rank, s.sketch, std::sqrt(sum_sq), 0});
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.rank < b.rank; });
  const size_t n = candidates.size();
  if (n < 2) return {};

  UnionFind sets(n);
  std::vector<double> min_cosine(n, 1.0);  // per root: the loosest confirmed link
  std::vector<bool> inexact(n, false);     // per root: some link was not bit-identical
  auto join = [&](size_t a, size_t b, double cosine, bool exact) {
    const size_t ra = sets.Find(a), rb = sets.Find(b);
    if (ra == rb) return;
    const double low = std::min({min_cosine[ra], min_cosine[rb], cosine});
    const bool mixed = inexact[ra] || inexact[rb] || !exact;
    sets.Union(ra, rb);
    const size_t root = sets.Find(ra);
    min_cosine[root] = low;
    inexact[root] = mixed;
  };

  // 1. Exact duplicates: same hash, then the same bytes as the first sketch with that hash.
  absl::flat_hash_map<uint64_t, size_t> first_with_hash;
  std::vector<size_t> representatives;  // one per class of identical sketches
  for (size_t i = 0; i < n; ++i) {
    candidates[i].hash = HashBits(candidates[i].sketch);
    auto [it, inserted] = first_with_hash.try_emplace(candidates[i].hash, i);
    const Candidate& head = candidates[it->second];
    if (!inserted && SameBits(head.sketch, candidates[i].sketch)) {
      join(it->second, i, 1.0, /*exact=*/true);
    } else {
      representatives.push_back(i);  // a hash collision with different bytes stays separate
    }
  }

  // 2. Near duplicates among the classes: LSH bands of sign bits, confirmed by cosine.
  const int bands = std::max(1, options.bands);
  const size_t bits_per_band =
      std::max<size_t>(1, std::min<size_t>(options.bits_per_band, dim / bands));
  for (int band = 0; band < bands; ++band) {
    const size_t first_bin = band * bits_per_band;
    if (first_bin + bits_per_band > dim) break;
    absl::flat_hash_map<uint64_t, size_t> head_of_key;
    for (size_t i : representatives) {
      uint64_t key = Mix(static_cast<uint64_t>(band) + 1);
      for (size_t b = 0; b < bits_per_band; ++b) {
        const bool positive = candidates[i].sketch.Value(first_bin + b) > 0.0;
        key = Mix(key ^ ((static_cast<uint64_t>(b) << 1) | positive));
      }
      auto [it, inserted] = head_of_key.try_emplace(key, i);
      if (inserted || sets.Find(it->second) == sets.Find(i)) continue;
      const double cosine = Cosine(candidates[it->second], candidates[i]);
      if (cosine >= options.min_cosine) join(it->second, i, cosine, /*exact=*/false);
    }
  }

  // Components of two or more ranks, in ascending order of their lowest rank.
  absl::flat_hash_map<size_t, size_t> group_of_root;
  std::vector<DuplicateGroup> groups;
  std::vector<size_t> roots;
  for (size_t i = 0; i < n; ++i) {
    const size_t root = sets.Find(i);
    auto [it, inserted] = group_of_root.try_emplace(root, groups.size());
    if (inserted) {
      groups.emplace_back();
      roots.push_back(root);
    }
    groups[it->second].ranks.push_back(candidates[i].rank);
  }
  std::vector<DuplicateGroup> result;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].ranks.size() < 2) continue;
    groups[g].exact = !inexact[roots[g]];
    groups[g].min_cosine = min_cosine[roots[g]];
    result.push_back(std::move(groups[g]));
  }
  return result;  // candidates are rank-sorted and roots are lowest indices: already in order
}

std::string FormatDuplicateGroups(absl::Span<const DuplicateGroup> groups) {
  std::vector<std::string> parts;
  parts.reserve(groups.size());
  for (const DuplicateGroup& g : groups) parts.push_back(absl::StrJoin(g.ranks, ","));
  return absl::StrJoin(parts, ";");
}

uint32_t CountDuplicateRanks(absl::Span<const DuplicateGroup> groups) {
  uint32_t count = 0;
  for (const DuplicateGroup& g : groups) count += static_cast<uint32_t>(g.ranks.size());
  return count;
}

}  // namespace rankscope::collector
