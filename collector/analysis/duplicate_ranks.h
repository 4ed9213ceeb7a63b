// Ranks that train on the same data: groups of ranks whose local gradients are identical or
// nearly so (DESIGN.md "Who a rank is"; docs/runbook.md RankscopeDuplicateData). Pure functions.
//
// A missing or mis-seeded DistributedSampler gives two or more ranks the same batches; their
// local gradients, and so their sketches, are then equal (bitwise on deterministic kernels, to
// within rounding on GPU kernels that are not). Ranks that see different data have sketch
// cosines far from 1 even when the job's direction consistency runs high (small models, early
// steps): the near-duplicate threshold is 0.999, where two independent batches of a real model
// practically never land (docs/DESIGN.md "Duplicate data").
//
// Cost: O(W k) to hash every sketch once, then O(W L) work to group, with L = the number of
// LSH bands (8), and at most W L sketch cosines (O(k) each) to confirm candidates: never the
// O(W^2 k) of comparing every pair.
//
//  1. Exact duplicates: ranks whose sketches have the same bits (same hash, then compared
//     byte for byte) form one class.
//  2. Near duplicates: the sign of each of the first b sketch bins is one bit of a
//     locality-sensitive signature. A count-sketch bin is a random +-1 projection of the
//     gradient, so two gradients at angle theta disagree on a bin's sign with probability about
//     theta / pi (SimHash). The b bits are cut into L bands of r bits; classes that agree on a
//     whole band are candidates, and each candidate is confirmed against the first class seen
//     in that band by its exact sketch cosine (>= min_cosine). At cosine 0.999 (theta/pi =
//     0.0142) and r = 32 a band agrees with probability 0.63, so a true pair is missed by all 8
//     bands with probability 3e-4 per step; at cosine 0.9 a band agrees with probability 0.007,
//     so unrelated ranks rarely cost a confirmation.
//  Groups are the connected components of confirmed pairs: a chain a~b~c is one group even if
//  cos(a, c) < min_cosine (its min_cosine field says how close the loosest confirmed link was).
//
// Ranks whose sketch is all zeros or holds NaN/Inf are never grouped (their direction is
// undefined); sketches of a length other than the first non-empty sketch's are ignored.
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_DUPLICATE_RANKS_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_DUPLICATE_RANKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "collector/analysis/step_stats.h"

namespace rankscope::collector {

struct DuplicateOptions {
  // Two sketches with a cosine at or above this are near duplicates.
  double min_cosine = 0.999;
  // LSH bands and bits per band; bands * bits_per_band sketch bins are read (fewer when the
  // sketch is shorter: then bits_per_band shrinks to k / bands, at least 1).
  int bands = 8;
  int bits_per_band = 32;
};

struct DuplicateGroup {
  std::vector<uint32_t> ranks;  // ascending, at least 2
  bool exact = false;           // every member's sketch has the same bits
  double min_cosine = 1.0;      // the lowest confirmed cosine between members (1 when exact)
};

// Groups of ranks of one step whose sketches are identical or near duplicates. Groups are in
// ascending order of their lowest rank. Deterministic: the same samples give the same groups
// whatever their order.
std::vector<DuplicateGroup> FindDuplicateRanks(absl::Span<const RankSample> samples,
                                               const DuplicateOptions& options = {});

// "0,2;1,3": groups separated by ';', ranks by ','; "" when there are none.
std::string FormatDuplicateGroups(absl::Span<const DuplicateGroup> groups);

// Number of ranks that are in some group.
uint32_t CountDuplicateRanks(absl::Span<const DuplicateGroup> groups);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_DUPLICATE_RANKS_H_
