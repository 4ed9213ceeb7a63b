// Fuzzes collector/step_stats: bytes -> W ranks (0..8) with sketches of k floats (0..8),
// losses and gradient norms including NaN, +-Inf and -0 -> ComputeStepStatistics.
//
// In grid mode every value is a multiple of 1/16 below 8 in magnitude (or NaN/Inf/-0), so every
// sum the implementation forms is exact and its O(W k) formulas must agree with a brute-force
// reference (pairwise cosines, plain two-pass moments in long double) to ~1e-9, following the
// conventions in step_stats.h literally. In raw mode the values are arbitrary bit patterns;
// there only invariants are checked: cosines in [-1, 1] unless NaN, NaN exactly when the header
// says so, std >= 0 and <= range / 2, |z| <= sqrt(W - 1) (Samuelson), finite statistics from
// finite inputs of moderate magnitude.
//
// Input layout (tests/fuzz/make_corpus.py writes seeds in it): u8 mode (bit 0: raw, bit 1: a
// rank's sketch may be one value longer, bit 2: every rank's sketch is packed as the agent packs
// it, common/sketch_encoding.h, in int8 with bit 3 set and float16 without; the reference reads
// the decoded values, which are exact in double), u8 W, u8 k, then per rank: loss, grad_norm, [u8
// extra length in mode bit 1], k (+1) sketch values; a grid value is one byte, a raw one 8 (double)
// or 4 (float) bytes.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "collector/analysis/step_stats.h"
#include "tests/fuzz/byte_reader.h"
#include "tests/fuzz/fuzz_check.h"

namespace rankscope::fuzz {
namespace {

using collector::RankSample;
using collector::StepStatistics;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A grid value: (b - 125) / 16 for b < 250, else NaN, +Inf, -Inf, -0.0, +0.0.
double GridValue(uint8_t b) {
  switch (b) {
    case 250:
      return kNaN;
    case 251:
      return kInf;
    case 252:
      return -kInf;
    case 253:
      return -0.0;
    case 254:
    case 255:
      return 0.0;
  }
  return (static_cast<int>(b) - 125) / 16.0;
}

// Both NaN, or equal within `tol` (relative to the larger magnitude, absolute below 1).
bool Near(double got, double want, double tol) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::fabs(got - want) <= tol * std::max(1.0, std::max(std::fabs(got), std::fabs(want)));
}

struct RefMoments {
  double mean, std, range;
};

// step_stats.h's conventions, computed the plain way.
RefMoments ReferenceMoments(const std::vector<double>& x) {
  const size_t n = x.size();
  bool has_nan = false, has_inf = false, all_equal = true;
  double lo = kInf, hi = -kInf, sum = 0.0;
  for (double v : x) {
    has_nan |= std::isnan(v);
    has_inf |= std::isinf(v);
    all_equal &= v == x[0];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    sum += v;  // exact for grid values
  }
  if (has_nan) return {kNaN, kNaN, kNaN};
  if (all_equal && std::isfinite(x[0])) return {x[0], 0.0, 0.0};
  const double mean = sum / static_cast<double>(n);
  if (has_inf) return {mean, kNaN, hi - lo};  // an Inf makes the mean +-Inf (or NaN) and std NaN
  long double ss = 0.0L;
  for (double v : x)
    ss += (static_cast<long double>(v) - mean) * (static_cast<long double>(v) - mean);
  return {mean, static_cast<double>(std::sqrt(ss / n)), hi - lo};
}

double ReferenceZ(double v, const RefMoments& m) {
  return m.std == 0.0 ? 0.0 : (v - m.mean) / m.std;
}

long double Dot(const std::vector<long double>& a, const std::vector<long double>& b) {
  long double s = 0.0L;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// cos(a, b), 0 when either is a zero vector.
double ReferenceCosine(const std::vector<long double>& a, const std::vector<long double>& b) {
  const long double na = Dot(a, a), nb = Dot(b, b);
  if (na == 0.0L || nb == 0.0L) return 0.0;
  return static_cast<double>(Dot(a, b) / std::sqrt(na * nb));
}

void CheckInvariants(absl::Span<const RankSample> samples, const StepStatistics& s) {
  const size_t w = samples.size();
  FUZZ_CHECK(s.ranks == w);
  if (w == 0) {
    FUZZ_CHECK(s.per_rank.empty() && std::isnan(s.grad_cosine_mean));
    FUZZ_CHECK(s.loss_mean == 0 && s.loss_std == 0 && s.loss_range == 0);
    FUZZ_CHECK(s.grad_norm_mean == 0 && s.grad_norm_std == 0 && s.grad_norm_cv == 0);
    return;
  }
  FUZZ_CHECK(s.per_rank.size() == w);
  bool lengths_differ = false, sketch_non_finite = false;
  for (size_t r = 0; r < w; ++r) {
    FUZZ_CHECK(s.per_rank[r].rank == samples[r].rank);
    lengths_differ |= samples[r].sketch.size() != samples[0].sketch.size();
    for (double v : DecodeSketch(samples[r].sketch)) sketch_non_finite |= !std::isfinite(v);
  }
  // Cosines: in [-1, 1], NaN exactly when step_stats.h says.
  const bool cosine_nan = w < 2 || lengths_differ || sketch_non_finite;
  FUZZ_CHECK(std::isnan(s.grad_cosine_mean) == cosine_nan);
  if (!cosine_nan) FUZZ_CHECK(s.grad_cosine_mean >= -1.0 && s.grad_cosine_mean <= 1.0);
  for (const auto& r : s.per_rank) {
    FUZZ_CHECK(std::isnan(r.consensus_cosine) == cosine_nan);
    if (!cosine_nan) FUZZ_CHECK(r.consensus_cosine >= -1.0 && r.consensus_cosine <= 1.0);
  }
  // Moments of each quantity.
  struct Quantity {
    double mean, std;
    double RankSample::*field;
    double collector::RankStatistics::*z;
  };
  const Quantity quantities[] = {
      {s.loss_mean, s.loss_std, &RankSample::loss, &collector::RankStatistics::loss_z},
      {s.grad_norm_mean, s.grad_norm_std, &RankSample::grad_norm,
       &collector::RankStatistics::grad_norm_z},
  };
  for (const Quantity& q : quantities) {
    bool has_nan = false, moderate = true;
    double lo = kInf, hi = -kInf;
    for (const RankSample& x : samples) {
      const double v = x.*q.field;
      has_nan |= std::isnan(v);
      // Moderate: no overflow in sums and squares, and distinct values differ by enough that
      // their squared differences are normal numbers (subnormals lose the relative precision
      // the inequalities below need).
      moderate &= std::isfinite(v) && std::fabs(v) <= 1e150 && (v == 0 || std::fabs(v) >= 1e-100);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    FUZZ_CHECK(!(q.std < 0.0));
    if (has_nan) {
      // A NaN makes mean, std and every z NaN.
      FUZZ_CHECK(std::isnan(q.mean) && std::isnan(q.std));
      for (const auto& r : s.per_rank) FUZZ_CHECK(std::isnan(r.*q.z));
    }
    if (!moderate) continue;
    // Finite, moderate inputs: finite statistics, mean within [lo, hi], std <= range / 2,
    // and Samuelson's inequality |z| <= sqrt(W - 1).
    FUZZ_CHECK(std::isfinite(q.mean) && std::isfinite(q.std));
    const double slack = 1e-9 * std::max(std::fabs(lo), std::fabs(hi));
    FUZZ_CHECK(q.mean >= lo - slack && q.mean <= hi + slack);
    FUZZ_CHECK(q.std <= (hi - lo) / 2 * (1 + 1e-9) + slack);
    if (lo == hi) FUZZ_CHECK(q.mean == lo && q.std == 0.0);
    for (const auto& r : s.per_rank) {
      FUZZ_CHECK(std::isfinite(r.*q.z));
      FUZZ_CHECK(std::fabs(r.*q.z) <= std::sqrt(static_cast<double>(w - 1)) * (1 + 1e-6) + 1e-9);
    }
  }
  if (std::isfinite(s.loss_range)) FUZZ_CHECK(s.loss_range >= 0.0);
}

void CheckAgainstReference(absl::Span<const RankSample> samples, const StepStatistics& s) {
  const size_t w = samples.size();
  if (w == 0) return;
  std::vector<double> losses, norms;
  for (const RankSample& x : samples) {
    losses.push_back(x.loss);
    norms.push_back(x.grad_norm);
  }
  const RefMoments loss = ReferenceMoments(losses);
  const RefMoments norm = ReferenceMoments(norms);
  FUZZ_CHECK(Near(s.loss_mean, loss.mean, 0));
  FUZZ_CHECK(Near(s.loss_std, loss.std, 1e-12));
  FUZZ_CHECK(Near(s.loss_range, loss.range, 0));
  FUZZ_CHECK(Near(s.grad_norm_mean, norm.mean, 0));
  FUZZ_CHECK(Near(s.grad_norm_std, norm.std, 1e-12));
  FUZZ_CHECK(Near(s.grad_norm_cv, norm.std == 0.0 ? 0.0 : norm.std / norm.mean, 1e-12));
  for (size_t r = 0; r < w; ++r) {
    FUZZ_CHECK(Near(s.per_rank[r].loss_z, ReferenceZ(losses[r], loss), 1e-9));
    FUZZ_CHECK(Near(s.per_rank[r].grad_norm_z, ReferenceZ(norms[r], norm), 1e-9));
  }

  // Cosines: pairwise mean and consensus, brute force.
  bool nan = w < 2;
  for (const RankSample& x : samples) {
    nan |= x.sketch.size() != samples[0].sketch.size();
    for (double v : DecodeSketch(x.sketch)) nan |= !std::isfinite(v);
  }
  if (nan) return;  // CheckInvariants checked that every cosine is NaN
  const size_t k = samples[0].sketch.size();
  std::vector<std::vector<long double>> v(w, std::vector<long double>(k));
  for (size_t r = 0; r < w; ++r) {
    for (size_t i = 0; i < k; ++i) v[r][i] = samples[r].sketch.Value(i);
  }
  double pair_sum = 0.0;
  for (size_t a = 0; a < w; ++a) {
    for (size_t b = a + 1; b < w; ++b) pair_sum += ReferenceCosine(v[a], v[b]);
  }
  const double pairs = static_cast<double>(w) * (w - 1) / 2;
  FUZZ_CHECK(Near(s.grad_cosine_mean, pair_sum / pairs, 1e-9));
  for (size_t r = 0; r < w; ++r) {
    std::vector<long double> rest(k, 0.0L);
    for (size_t j = 0; j < w; ++j) {
      if (j == r) continue;
      for (size_t i = 0; i < k; ++i) rest[i] += v[j][i];
    }
    FUZZ_CHECK(Near(s.per_rank[r].consensus_cosine, ReferenceCosine(v[r], rest), 1e-9));
  }
}

}  // namespace
}  // namespace rankscope::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rankscope::fuzz;  // NOLINT(build/namespaces): this function only
  ByteReader in(data, size);
  const uint8_t mode = in.U8();
  const bool raw = mode & 1;
  const bool ragged = mode & 2;
  const size_t w = in.U8() % 9;
  const size_t k = in.U8() % 9;
  const bool packed = mode & 4;
  const rankscope::SketchEncoding encoding =
      mode & 8 ? rankscope::SketchEncoding::kInt8 : rankscope::SketchEncoding::kFloat16;
  std::vector<std::vector<float>> sketches(w);
  std::vector<rankscope::PackedSketch> packs(w);
  std::vector<RankSample> samples(w);
  for (size_t r = 0; r < w; ++r) {
    RankSample& s = samples[r];
    s.rank = static_cast<uint32_t>(r * 3 + 1);  // not 0..W-1: per_rank must follow the input
    s.loss = raw ? in.RawDouble() : GridValue(in.U8());
    s.grad_norm = raw ? in.RawDouble() : GridValue(in.U8());
    const size_t len = k + (ragged && in.U8() % 3 == 0 ? 1 : 0);
    for (size_t i = 0; i < len; ++i) {
      sketches[r].push_back(raw ? in.RawFloat() : static_cast<float>(GridValue(in.U8())));
    }
    s.sketch = sketches[r];
    if (packed) {
      packs[r] = rankscope::PackSketch(sketches[r], encoding);
      s.sketch = rankscope::SketchView(encoding, packs[r].bins.data(), len, packs[r].scale);
    }
  }
  const rankscope::collector::StepStatistics stats =
      rankscope::collector::ComputeStepStatistics(samples);
  CheckInvariants(samples, stats);
  if (!raw) CheckAgainstReference(samples, stats);
  return 0;
}
