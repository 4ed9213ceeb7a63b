// Where in the model (docs/DESIGN.md "Where in the model"): which parameter groups ("buckets",
// named once in the hello) carry a rank's deviation. Pure functions.
//
// Every rank reports its local gradient's L2 norm per bucket. For bucket b and rank r the score
// is the robust z of the rank's norm against every rank's norm of that bucket,
// (n_rb - median_b) / (1.4826 MAD_b), with the MAD floored as the outlier score's
// (rank_diagnostics.h): the same measure, per bucket. A kernel fault or a bad GPU that corrupts
// a few layers moves a few buckets; a bad data shard (label noise) moves most of them.
//
// Needs at least kMinBucketRanks ranks with norms of one length (with two ranks every deviation
// is symmetric and names no one). A rank's non-finite norm gives that (rank, bucket) a NaN
// score, which is named (a NaN is a fault in itself); the other ranks are scored without it.
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_BUCKET_SCORES_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_BUCKET_SCORES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace rankscope::collector {

// A bucket whose |z| is at least this carries the deviation (the outlier score's threshold).
inline constexpr double kBucketZThreshold = 6.0;
// At most this many buckets are named per flagged rank (the most deviating first).
inline constexpr size_t kMaxNamedBuckets = 8;
inline constexpr size_t kMinBucketRanks = 3;

// Robust z per (rank, bucket): out[r][b], same order as `norms` (one span per rank). Empty when
// fewer than kMinBucketRanks ranks have a non-empty span, or when the non-empty spans differ in
// length; a rank with an empty span gets an empty row.
std::vector<std::vector<float>> BucketNormZ(absl::Span<const absl::Span<const float>> norms);

struct BucketDeviation {
  uint32_t bucket = 0;
  float z = 0.0f;  // NaN for a non-finite norm
};

// The buckets of one rank's scores with |z| >= kBucketZThreshold (or NaN), NaN first, then by
// decreasing |z|, at most kMaxNamedBuckets.
std::vector<BucketDeviation> DeviatingBuckets(absl::Span<const float> z);

// "layers.20-23.mlp z=45.1; embed z=-7.0" (a bucket without a name is "bucket 7"); empty when
// `deviations` is.
std::string FormatDeviatingBuckets(absl::Span<const BucketDeviation> deviations,
                                   absl::Span<const std::string> names);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_BUCKET_SCORES_H_
