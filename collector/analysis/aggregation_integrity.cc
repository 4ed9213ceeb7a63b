#include "collector/analysis/aggregation_integrity.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace rankscope::collector {

namespace {

constexpr double kFloat32Half = 0x1p-24;  // half an ulp of a float32, relative
constexpr double kFloat16Half = 0x1p-11;  // half an ulp of a normal half, relative

// The bound d on |x - v| of bin value `x` of a sketch held in `encoding` (the agent's float32
// rounding of its float64 bins, then the packing's), as aggregation_integrity.h states it.
double EncodingBound(SketchEncoding encoding, double x, double scale) {
  const double a = std::fabs(x);
  switch (encoding) {
    case SketchEncoding::kFloat16:
      return (kFloat16Half + kFloat32Half) * a + 0x1p-25 * scale;
    case SketchEncoding::kInt8:
      return 0.5 * scale + kFloat32Half * a;
    case SketchEncoding::kFloat32:
      break;
  }
  return kFloat32Half * a;
}

// Solves (A + mu I) w = b + mu w0 for the symmetric positive semi-definite n x n `a` (row-major)
// by Cholesky; the small ridge mu pulls weights that the sketches cannot tell apart (ranks with
// identical gradients) towards the prior w0 instead of making the system singular. Returns false
// when the factorization fails.
bool SolveRidge(std::vector<double> a, std::vector<double> b, size_t n, double mu, double w0,
                std::vector<double>* w) {
  for (size_t i = 0; i < n; ++i) {
    a[i * n + i] += mu;
    b[i] += mu * w0;
  }
  for (size_t j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (size_t k = 0; k < j; ++k) d -= a[j * n + k] * a[j * n + k];
    if (!(d > 0.0)) return false;
    const double l = std::sqrt(d);
    a[j * n + j] = l;
    for (size_t i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (size_t k = 0; k < j; ++k) s -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = s / l;
    }
  }
  w->assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {  // L y = b
    double s = b[i];
    for (size_t k = 0; k < i; ++k) s -= a[i * n + k] * (*w)[k];
    (*w)[i] = s / a[i * n + i];
  }
  for (size_t i = n; i-- > 0;) {  // L^T w = y
    double s = (*w)[i];
    for (size_t k = i + 1; k < n; ++k) s -= a[k * n + i] * (*w)[k];
    (*w)[i] = s / a[i * n + i];
  }
  return true;
}

// Regresses `reduced` on the local sketches (`values`, W rows of k decoded bins) and names the
// rank, as aggregation_integrity.h states.
void Regress(absl::Span<const IntegrityInput> locals, const std::vector<double>& values,
             absl::Span<const float> reduced, AggregationVerdict* v) {
  const size_t w_count = locals.size();
  const size_t k = reduced.size();
  std::vector<double> gram(w_count * w_count, 0.0), rhs(w_count, 0.0);
  for (size_t i = 0; i < w_count; ++i) {
    const double* xi = &values[i * k];
    for (size_t j = 0; j <= i; ++j) {
      const double* xj = &values[j * k];
      double s = 0.0;
      for (size_t b = 0; b < k; ++b) s += xi[b] * xj[b];
      gram[i * w_count + j] = gram[j * w_count + i] = s;
    }
    double s = 0.0;
    for (size_t b = 0; b < k; ++b) s += xi[b] * static_cast<double>(reduced[b]);
    rhs[i] = s;
  }
  double trace = 0.0;
  for (size_t i = 0; i < w_count; ++i) trace += gram[i * w_count + i];
  const double inv_w = 1.0 / static_cast<double>(w_count);
  std::vector<double> w;
  if (trace <= 0.0 || !SolveRidge(gram, rhs, w_count, 1e-9 * trace * inv_w, inv_w, &w)) return;
  double resid = 0.0;
  for (size_t b = 0; b < k; ++b) {
    double fit = 0.0;
    for (size_t i = 0; i < w_count; ++i) fit += w[i] * values[i * k + b];
    const double d = static_cast<double>(reduced[b]) - fit;
    resid += d * d;
  }
  v->residual_ratio = std::sqrt(resid) / v->tolerance;
  v->weights.resize(w_count);
  size_t worst = 0;
  for (size_t i = 0; i < w_count; ++i) {
    v->weights[i] = w[i] * static_cast<double>(w_count);
    if (std::fabs(v->weights[i] - 1.0) > std::fabs(v->weights[worst] - 1.0)) worst = i;
  }
  const double omega = v->weights[worst];
  if (!(std::fabs(omega - 1.0) > kIntegrityWeightMargin)) return;  // kSum: no rank explains it
  v->suspect_rank = locals[worst].rank;
  v->suspect_weight = omega;
  if (v->residual_ratio > 1.0) {
    v->fault = AggregationFault::kCorrupted;
  } else if (omega < kIntegrityWeightMargin) {
    v->fault = AggregationFault::kMissing;
  } else if (std::fabs(omega - 2.0) < kIntegrityWeightMargin) {
    v->fault = AggregationFault::kDoubled;
  } else {
    v->fault = AggregationFault::kScaled;
  }
}

}  // namespace

const char* AggregationFaultName(AggregationFault f) {
  switch (f) {
    case AggregationFault::kNone:
      return "";
    case AggregationFault::kSum:
      return "sum";
    case AggregationFault::kMissing:
      return "missing";
    case AggregationFault::kDoubled:
      return "doubled";
    case AggregationFault::kScaled:
      return "scaled";
    case AggregationFault::kCorrupted:
      return "corrupted";
  }
  return "";
}

AggregationVerdict CheckAggregation(absl::Span<const IntegrityInput> locals,
                                    absl::Span<const float> reduced, uint32_t sender_rank,
                                    uint32_t world_size, uint32_t mantissa_bits) {
  AggregationVerdict v;
  v.sender_rank = sender_rank;
  const size_t k = reduced.size();
  if (k == 0 || world_size == 0 || locals.size() != world_size || mantissa_bits == 0 ||
      mantissa_bits > 53) {
    return v;
  }
  for (const IntegrityInput& in : locals) {
    if (in.sketch.size() != k || !in.sketch.AllFinite() || !std::isfinite(in.grad_norm)) return v;
  }
  for (float f : reduced) {
    if (!std::isfinite(f)) return v;
  }
  const double inv_w = 1.0 / static_cast<double>(world_size);
  // One streaming pass over the local sketches: their mean and the encodings' bound per bin.
  std::vector<double> mean(k, 0.0), enc_var(k, 0.0);
  double sum_norm_sq = 0.0;
  for (const IntegrityInput& in : locals) {
    const SketchView& x = in.sketch;
    if (x.encoding == SketchEncoding::kFloat32) {
      const absl::Span<const float> f = x.floats();
      for (size_t b = 0; b < k; ++b) {
        const double v = f[b];
        mean[b] += v;
        enc_var[b] += kFloat32Half * kFloat32Half * v * v;
      }
    } else {
      const std::vector<double> row = DecodeSketch(x);  // one dispatch on the encoding
      for (size_t b = 0; b < k; ++b) {
        const double v = row[b];
        mean[b] += v;
        const double d = EncodingBound(x.encoding, v, x.scale);
        enc_var[b] += d * d;
      }
    }
    sum_norm_sq += in.grad_norm * in.grad_norm;
  }
  double diff_sq = 0.0, mean_sq = 0.0, reduced_sq = 0.0, v_enc = 0.0;
  for (size_t b = 0; b < k; ++b) {
    mean[b] *= inv_w;
    const double s = reduced[b];
    const double d = s - mean[b];
    diff_sq += d * d;
    mean_sq += mean[b] * mean[b];
    reduced_sq += s * s;
    const double ds = kFloat32Half * std::fabs(s);
    v_enc += enc_var[b] * inv_w * inv_w + ds * ds;
  }
  v_enc /= 3.0;  // each rounding error near uniform on [-d, d]: variance d^2 / 3
  const double u = std::ldexp(1.0, -static_cast<int>(mantissa_bits));
  const double v_red = u * u * sum_norm_sq;
  v.checked = true;
  v.error = std::sqrt(diff_sq);
  v.tolerance = kIntegrityLambda * std::sqrt(v_enc + v_red) + kIntegrityFloor * std::sqrt(mean_sq);
  v.relative_error = reduced_sq > 0.0
                         ? v.error / std::sqrt(reduced_sq)
                         : (v.error > 0.0 ? std::numeric_limits<double>::infinity() : 0.0);
  v.flagged = v.error > v.tolerance;
  if (!v.flagged) return v;
  v.fault = AggregationFault::kSum;
  if (world_size <= kIntegrityMaxRegressionRanks && world_size < k) {
    // The decoded local sketches, row by rank (a flagged step only).
    std::vector<double> values;
    values.reserve(locals.size() * k);
    for (const IntegrityInput& in : locals) {
      const std::vector<double> row = DecodeSketch(in.sketch);
      values.insert(values.end(), row.begin(), row.end());
    }
    Regress(locals, values, reduced, &v);
  }
  return v;
}

}  // namespace rankscope::collector
