#include "collector/step_stats.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace rankscope::collector {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Moments {
  double mean = 0.0;
  double std = 0.0;
  double range = 0.0;
  // The exact mean minus `mean` (its rounding error) as the second pass estimates it; 0 when that
  // estimate is not finite. ZScore subtracts it from x - mean separately: when the values lie
  // within a few ulps of each other the exact mean is not representable, its rounding error is
  // as large as their spread, and (x - mean) / std alone exceeds Samuelson's bound sqrt(W - 1)
  // (z = 2 for two values one ulp apart; found by tests/fuzz/step_stats_fuzzer.cc).
  double mean_error = 0.0;
};

// Population mean, std and range of get(sample) over the samples, by the corrected two-pass
// algorithm (Chan, Golub & LeVeque 1983): the second pass subtracts the rounding error of the
// mean, so the variance does not lose digits when the values are large and close together.
template <typename Getter>
Moments Describe(absl::Span<const RankSample> samples, Getter get) {
  const size_t n = samples.size();
  if (n == 0) return {};
  double sum = 0.0;
  double lo = kInf;
  double hi = -kInf;
  bool has_nan = false;
  for (const RankSample& s : samples) {
    const double x = get(s);
    has_nan |= std::isnan(x);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    sum += x;
  }
  if (has_nan) return {kNaN, kNaN, kNaN};
  if (lo == hi && std::isfinite(lo)) return {lo, 0.0, 0.0};  // exact, no rounding noise

  const double mean = sum / static_cast<double>(n);
  double squares = 0.0;
  double residual = 0.0;
  for (const RankSample& s : samples) {
    const double d = get(s) - mean;
    squares += d * d;
    residual += d;
  }
  double variance =
      (squares - residual * residual / static_cast<double>(n)) / static_cast<double>(n);
  if (variance < 0.0) variance = 0.0;  // NaN stays NaN
  const double mean_error = std::isfinite(residual) ? residual / static_cast<double>(n) : 0.0;
  return {mean, std::sqrt(variance), hi - lo, mean_error};
}

double ZScore(double x, const Moments& m) {
  if (m.std == 0.0) return 0.0;
  return ((x - m.mean) - m.mean_error) / m.std;
}

double ClampCosine(double c) { return c < -1.0 ? -1.0 : (c > 1.0 ? 1.0 : c); }

// sum_i v[i]^2 in double. Four independent accumulators let the compiler keep the loop in
// vector registers without -ffast-math; the rounding differs from a sequential sum only in
// summation order.
double SquaredNorm(const float* v, size_t k) {
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  size_t i = 0;
  for (; i + 4 <= k; i += 4) {
    const double x0 = v[i], x1 = v[i + 1], x2 = v[i + 2], x3 = v[i + 3];
    a0 += x0 * x0;
    a1 += x1 * x1;
    a2 += x2 * x2;
    a3 += x3 * x3;
  }
  for (; i < k; ++i) {
    const double x = v[i];
    a0 += x * x;
  }
  return (a0 + a1) + (a2 + a3);
}

// With w = total - v: returns <v, w> in *dot and |w|^2 in *norm2. Forms w explicitly rather than
// expanding |total - v|^2 = |total|^2 - 2<total, v> + |v|^2, which cancels catastrophically when
// v dominates the total (e.g. every other rank's sketch is near zero or they cancel).
void DotWithRest(const float* v, const double* total, size_t k, double* dot, double* norm2) {
  double d0 = 0.0, d1 = 0.0, n0 = 0.0, n1 = 0.0;
  size_t i = 0;
  for (; i + 2 <= k; i += 2) {
    const double x0 = v[i], x1 = v[i + 1];
    const double w0 = total[i] - x0, w1 = total[i + 1] - x1;
    d0 += x0 * w0;
    d1 += x1 * w1;
    n0 += w0 * w0;
    n1 += w1 * w1;
  }
  for (; i < k; ++i) {
    const double x = v[i];
    const double w = total[i] - x;
    d0 += x * w;
    n0 += w * w;
  }
  *dot = d0 + d1;
  *norm2 = n0 + n1;
}

// Fills grad_cosine_mean and every per_rank[r].consensus_cosine. O(W k) time, O(W + k) memory:
// one pass accumulates S = sum_r v_r and U = sum_r u_r (both in double), a second pass computes
// cos(v_r, S - v_r) for each rank.
void ComputeCosines(absl::Span<const RankSample> samples, StepStatistics* out) {
  const size_t w = samples.size();
  const size_t k = samples[0].sketch.size();
  auto set_all_nan = [&] {
    out->grad_cosine_mean = kNaN;
    for (RankStatistics& r : out->per_rank) r.consensus_cosine = kNaN;
  };
  for (const RankSample& s : samples) {
    if (s.sketch.size() != k) return set_all_nan();
  }

  std::vector<double> total(k, 0.0);  // S
  std::vector<double> units(k, 0.0);  // U
  std::vector<double> norm2(w);
  size_t nonzero = 0;
  bool non_finite = false;
  for (size_t r = 0; r < w; ++r) {
    const float* v = samples[r].sketch.data();
    // Floats squared and summed in double cannot overflow (k <= 2^20), so a non-finite norm
    // means the sketch itself holds NaN or Inf.
    const double n2 = SquaredNorm(v, k);
    norm2[r] = n2;
    if (!std::isfinite(n2)) {
      non_finite = true;
      continue;
    }
    if (n2 == 0.0) continue;  // zero vector: u_r = 0, contributes nothing to S either
    ++nonzero;
    const double inv_norm = 1.0 / std::sqrt(n2);
    double* s = total.data();
    double* u = units.data();
    for (size_t i = 0; i < k; ++i) {
      const double x = v[i];
      s[i] += x;
      u[i] += x * inv_norm;
    }
  }
  if (non_finite) return set_all_nan();

  if (w < 2) {
    set_all_nan();
    return;
  }
  double units_norm2 = 0.0;
  for (size_t i = 0; i < k; ++i) units_norm2 += units[i] * units[i];
  const double wd = static_cast<double>(w);
  out->grad_cosine_mean =
      ClampCosine((units_norm2 - static_cast<double>(nonzero)) / (wd * (wd - 1.0)));

  for (size_t r = 0; r < w; ++r) {
    double cosine = 0.0;
    if (norm2[r] != 0.0) {
      double dot = 0.0;
      double rest_norm2 = 0.0;
      DotWithRest(samples[r].sketch.data(), total.data(), k, &dot, &rest_norm2);
      if (rest_norm2 != 0.0) {
        cosine = ClampCosine(dot / (std::sqrt(norm2[r]) * std::sqrt(rest_norm2)));
      }
    }
    out->per_rank[r].consensus_cosine = cosine;
  }
}

}  // namespace

StepStatistics ComputeStepStatistics(absl::Span<const RankSample> samples) {
  StepStatistics out;
  out.ranks = static_cast<uint32_t>(samples.size());
  if (samples.empty()) {
    out.grad_cosine_mean = kNaN;
    return out;
  }

  const Moments loss = Describe(samples, [](const RankSample& s) { return s.loss; });
  const Moments norm = Describe(samples, [](const RankSample& s) { return s.grad_norm; });
  out.loss_mean = loss.mean;
  out.loss_std = loss.std;
  out.loss_range = loss.range;
  out.grad_norm_mean = norm.mean;
  out.grad_norm_std = norm.std;
  out.grad_norm_cv = norm.std == 0.0 ? 0.0 : norm.std / norm.mean;

  out.per_rank.resize(samples.size());
  for (size_t r = 0; r < samples.size(); ++r) {
    RankStatistics& rs = out.per_rank[r];
    rs.rank = samples[r].rank;
    rs.loss_z = ZScore(samples[r].loss, loss);
    rs.grad_norm_z = ZScore(samples[r].grad_norm, norm);
  }
  ComputeCosines(samples, &out);
  return out;
}

}  // namespace rankscope::collector
