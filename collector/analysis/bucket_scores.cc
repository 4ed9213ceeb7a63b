#include "collector/analysis/bucket_scores.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "absl/strings/str_cat.h"
#include "collector/analysis/rank_diagnostics.h"

namespace rankscope::collector {
namespace {

constexpr double kMadToSigma = 1.4826;

}  // namespace

std::vector<std::vector<float>> BucketNormZ(absl::Span<const absl::Span<const float>> norms) {
  size_t buckets = 0;
  size_t ranks = 0;
  for (absl::Span<const float> n : norms) {
    if (n.empty()) continue;
    if (buckets != 0 && n.size() != buckets) return {};
    buckets = n.size();
    ++ranks;
  }
  if (ranks < kMinBucketRanks) return {};
  std::vector<std::vector<float>> out(norms.size());
  for (size_t r = 0; r < norms.size(); ++r) {
    if (!norms[r].empty()) out[r].resize(buckets);
  }
  std::vector<double> column;
  std::vector<double> deviation;
  column.reserve(ranks);
  deviation.reserve(ranks);
  for (size_t b = 0; b < buckets; ++b) {
    column.clear();
    for (absl::Span<const float> n : norms) {
      if (!n.empty()) column.push_back(n[b]);
    }
    const double median = FiniteMedian(column);
    deviation.clear();
    for (double x : column) {
      if (std::isfinite(x)) deviation.push_back(std::abs(x - median));
    }
    const double floor = kMadFloorRelative * std::max(std::abs(median), kMadFloorAbsolute);
    const double sigma = std::max(kMadToSigma * FiniteMedian(deviation), floor);
    for (size_t r = 0; r < norms.size(); ++r) {
      if (norms[r].empty()) continue;
      const double x = norms[r][b];
      out[r][b] = std::isfinite(x) && std::isfinite(median)
                      ? static_cast<float>((x - median) / sigma)
                      : std::numeric_limits<float>::quiet_NaN();
    }
  }
  return out;
}

std::vector<BucketDeviation> DeviatingBuckets(absl::Span<const float> z) {
  std::vector<BucketDeviation> out;
  for (size_t b = 0; b < z.size(); ++b) {
    if (std::isnan(z[b]) || std::abs(z[b]) >= kBucketZThreshold) {
      out.push_back({static_cast<uint32_t>(b), z[b]});
    }
  }
  auto rank = [](const BucketDeviation& d) {
    return std::isnan(d.z) ? std::numeric_limits<float>::infinity() : std::abs(d.z);
  };
  std::stable_sort(out.begin(), out.end(), [&](const BucketDeviation& a, const BucketDeviation& b) {
    return rank(a) > rank(b);
  });
  if (out.size() > kMaxNamedBuckets) out.resize(kMaxNamedBuckets);
  return out;
}

std::string FormatDeviatingBuckets(absl::Span<const BucketDeviation> deviations,
                                   absl::Span<const std::string> names) {
  std::string out;
  for (const BucketDeviation& d : deviations) {
    if (!out.empty()) out += "; ";
    if (d.bucket < names.size()) {
      out += names[d.bucket];
    } else {
      absl::StrAppend(&out, "bucket ", d.bucket);
    }
    if (std::isnan(d.z)) {
      out += " z=nan";
    } else {
      char z[32];
      std::snprintf(z, sizeof(z), " z=%.1f", static_cast<double>(d.z));
      out += z;
    }
  }
  return out;
}

}  // namespace rankscope::collector
